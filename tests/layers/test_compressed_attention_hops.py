"""DeepSeek-V4's sliding branch under context parallelism with a declared token layout: only
the ring hops its window can reach move (`CompressedAttention.sliding_hops`), equal to the
unsharded layer, forward and gradients; a batch the plan does not hold for (a reordering by
document) takes the all-gather and stays exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import assert_close
from test_compressed_attention import B, D, W, packed, sharded_and_plain, value_and_grads
from zoo.layers.compressed_attention import CompressedAttention
from zoo.ops import ring

LH = 64  # 8 chunks of 8 tokens over 4 shards: a window of W = 5 reaches one chunk back
HOP_DOCS = ([20, 27, 9], [40, 3, 15])


def shard_of_token(layout, cp, length):
    """Which shard holds each token of the sequence under `layout` (a plain list)."""
    if layout == "contiguous":
        return [t * cp // length for t in range(length)]
    c = length // (2 * cp)
    return [x if x < cp else 2 * cp - 1 - x for x in (t // c for t in range(length))]


def reachable_offsets(layout, cp, length, window):
    """Offsets d (shard r reads shard r - d) some token's window needs: a plain loop."""
    home = shard_of_token(layout, cp, length)
    return sorted({(home[t] - home[s]) % cp for t in range(length)
                   for s in range(max(0, t - window + 1), t + 1)} - {0})


@pytest.mark.parametrize("kind,layout,order", [
    ("sliding", "contiguous", "none"),
    ("sliding", "balanced", "row"),
    ("sliding", "balanced", "document"),
    pytest.param("csa", "balanced", "row", marks=pytest.mark.slow)])
def test_sliding_hops_equal_unsharded(kind, layout, order):
    import zoo
    from zoo.data import load_balance

    p = zoo.Partitioner(zoo.make_mesh(data=2, context=4), "cp")
    cp = p.context_size("attention")
    sharded, plain = sharded_and_plain(kind, p, LH, seed=3)
    sharded.layout = layout
    hops = sharded.sliding_hops(cp, LH)
    assert list(hops) == reachable_offsets(layout, cp, LH, W) and len(hops) < cp - 1
    rng = np.random.default_rng(11)
    pos, seg = packed(HOP_DOCS, LH)
    x = rng.standard_normal((B, LH, D)).astype(np.float32)
    ct = rng.standard_normal((B, LH, D)).astype(np.float32)
    batch = load_balance({"x": x, "ct": ct, "positions": pos, "segment_ids": seg}, cp,
                         strategy=order)
    args = [np.asarray(batch[k]) for k in ("x", "positions", "segment_ids", "ct")]
    planned = bool(ring.sequence_order_ok(layout, cp, *(jnp.asarray(args[i]) for i in
                                                        (1, 1, 2, 2))))
    assert planned == (order != "document")  # a reordering by document runs the all-gather
    y, gp, gx = value_and_grads(sharded, *args)
    y_ref, gp_ref, gx_ref = value_and_grads(plain, *args)
    what = f"{kind} {layout} {order}"
    assert_close(y, y_ref, f"{what} output", rtol=1e-5)
    assert_close(gx, gx_ref, f"{what} dx", rtol=1e-5)
    ga, ge = dict(jax.tree_util.tree_leaves_with_path(gp)), \
        dict(jax.tree_util.tree_leaves_with_path(gp_ref))
    assert ga.keys() == ge.keys()
    for k, v in ge.items():
        assert_close(ga[k], v, f"{what} d{jax.tree_util.keystr(k)}", rtol=1e-5)


def test_layout_is_checked_at_construction():
    with pytest.raises(ValueError, match=r"layout='rows'.*contiguous"):
        CompressedAttention(
            kind="sliding", num_heads=4, head_dim=16, rope_head_dim=8, q_lora_rank=16,
            o_groups=2, o_lora_rank=6, sliding_window=W, inputs_shape=(B, LH, D),
            partitioner=None, layout="rows", rngs=nnx.Rngs(0))
