"""sharding_table against hand-computed shard shapes and bytes, concrete and abstract."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.layers import MLP, Embed, RMSNorm
from zoo.partitioning import MESH_AXES, Partitioner, make_mesh
from zoo.shardings import sharding_table


class Tiny(nnx.Module):
    def __init__(self, p, rngs):
        self.embed = Embed(64, 16, partitioner=p, rngs=rngs)
        self.norm = RMSNorm(16, partitioner=p, rngs=rngs)
        self.mlp = MLP(embed_dim=16, mlp_dim=24, partitioner=p, param_dtype=jnp.bfloat16,
                       rngs=rngs)


def test_table_numbers_by_hand(devices):
    p = Partitioner(make_mesh(fsdp=4, tensor=2), "fsdp")
    table = sharding_table(Tiny(p, nnx.Rngs(0)))
    rows = {r.path: r for r in table}
    assert set(rows) == {"embed/embedding", "norm/scale", "mlp/gate/kernel", "mlp/up/kernel",
                         "mlp/down/kernel"}
    emb = rows["embed/embedding"]
    assert emb.shape == (64, 16) and emb.spec == P("tensor", "fsdp")
    assert emb.logical_axes == ("vocab", "embed")
    assert emb.shard_shape == (32, 4) and emb.bytes_per_device == 32 * 4 * 4
    gate = rows["mlp/gate/kernel"]
    assert gate.dtype == "bfloat16" and gate.spec == P("fsdp", "tensor")
    assert gate.shard_shape == (4, 12) and gate.bytes_per_device == 4 * 12 * 2
    assert rows["mlp/down/kernel"].shard_shape == (12, 4)
    assert rows["norm/scale"].shard_shape == (16,) and rows["norm/scale"].bytes_per_device == 64
    want = 32 * 4 * 4 + 64 + 3 * 4 * 12 * 2
    assert table.bytes_per_device == want
    assert table.num_params == 64 * 16 + 16 + 3 * 16 * 24
    text = str(table)
    assert "mlp/gate/kernel" in text and "P('fsdp', 'tensor')" in text
    assert "per device" in text.splitlines()[-1]
    html = table._repr_html_()
    assert html.startswith("<table>") and "mlp/up/kernel" in html


def test_table_on_abstract_model_uses_no_memory():
    # A DeepSeek-V3-sized MLP on a 512-device abstract mesh: nothing is allocated.
    mesh = jax.sharding.AbstractMesh((8, 64, 1, 1, 1), MESH_AXES)
    p = Partitioner(mesh, "fsdp")
    model = nnx.eval_shape(lambda: MLP(embed_dim=7168, mlp_dim=18432, partitioner=p,
                                       param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    table = sharding_table(model)
    assert table.num_params == 3 * 7168 * 18432
    assert {r.shard_shape for r in table} == {(112, 18432), (18432, 112)}
    assert table.bytes_per_device == 3 * 112 * 18432 * 2
    assert "fsdp=64" in str(table)


def test_table_unsharded():
    table = sharding_table(RMSNorm(8, rngs=nnx.Rngs(0)))
    (row,) = table.rows
    assert row.spec == P() and row.shard_shape == (8,) and table.mesh is None


def test_activation_table_follows_the_strategy(devices):
    from zoo.shardings import activation_table

    p = Partitioner(make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    table = activation_table(p, batch=8, length=256, embed=64, heads=4, kv_heads=2, head_dim=32,
                             mlp=128, vocab=264)
    rows = {r.path: r for r in table}
    assert rows["residual stream [default]"].shard_shape == (4, 64, 64)
    assert rows["attention k/v [attention]"].shard_shape == (4, 64, 2, 32)
    assert rows["moe tokens [moe]"].shard_shape == (4, 128, 64)  # only context shards it in MoE
    assert rows["logits [default]"].bytes_per_device == 4 * 64 * 264 * 4
