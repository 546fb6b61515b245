"""Partitioner: resolved specs per strategy and mesh, context sizes, and every documented error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import zoo
from zoo.partitioning import MeshShape, Partitioner, make_mesh

ACT = ("batch", "length", "act_embed")


def test_make_mesh_axes_and_sizes(devices):
    mesh = make_mesh(fsdp=2, expert=2, context=2)
    assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor")
    assert dict(mesh.shape) == dict(data=1, fsdp=2, expert=2, context=2, tensor=1)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    sub = make_mesh(fsdp=4, devices=devices[:4])
    assert sub.devices.size == 4


@pytest.mark.parametrize("sizes", [dict(fsdp=3), dict(fsdp=2, context=2), dict(data=16)])
def test_make_mesh_wrong_product(devices, sizes):
    with pytest.raises(ValueError, match=r"multiply to \d+, but there are 8 devices"):
        make_mesh(**sizes)


def test_make_mesh_bad_size(devices):
    with pytest.raises(ValueError, match="positive integer"):
        make_mesh(fsdp=0, data=8)


def test_unknown_strategy_lists_valid_ones(devices):
    with pytest.raises(ValueError, match=r"'tp'.*'fsdp', 'cp', 'ep_as_cp'"):
        Partitioner(make_mesh(fsdp=8), "tp")


# (mesh sizes, strategy, logical axes, scope, expected spec)
CASES = [
    (dict(fsdp=8), "fsdp", ACT, None, P("fsdp", None, None)),
    (dict(fsdp=8), "fsdp", ("embed", "mlp"), None, P("fsdp", None)),
    (dict(fsdp=8), "fsdp", ("experts", "embed", "mlp"), "moe", P(None, "fsdp", None)),
    (dict(fsdp=8), "fsdp", ("vocab", "embed"), None, P(None, "fsdp")),
    (dict(context=8), "cp", ACT, "attention", P(None, "context", None)),
    (dict(context=8), "cp", ("embed", "heads", "head_dim"), "attention", P("context", None, None)),
    (dict(data=2, context=4), "cp", ACT, "attention", P("data", "context", None)),
    (dict(context=4, expert=2), "cp", ACT, None, P("expert", "context", None)),
    (dict(context=4, expert=2), "cp", ACT, "moe", P(None, "context", None)),
    (dict(context=4, expert=2), "cp", ("experts", "embed", "mlp"), "moe",
     P("expert", "context", None)),
    (dict(fsdp=2, expert=4), "ep_as_cp", ACT, "attention", P("fsdp", "expert", None)),
    (dict(fsdp=2, expert=4), "ep_as_cp", ACT, "moe", P("fsdp", None, None)),
    (dict(fsdp=2, expert=4), "ep_as_cp", ("experts", "embed", "mlp"), "moe",
     P("expert", "fsdp", None)),
    (dict(fsdp=2, expert=4), "ep_as_cp", ("embed", "mlp"), None, P(("fsdp", "expert"), None)),
    (dict(fsdp=2, expert=2, context=2), "ep_as_cp", ACT, "attention",
     P("fsdp", ("context", "expert"), None)),
    (dict(fsdp=2, expert=2, context=2), "ep_as_cp", ACT, "moe", P("fsdp", "context", None)),
    (dict(fsdp=4, tensor=2), "fsdp", ("embed", "heads", "head_dim"), "attention",
     P("fsdp", "tensor", None)),
    (dict(fsdp=4, tensor=2), "fsdp", ("batch", "length", "act_heads", "act_head_dim"),
     "attention", P("fsdp", None, "tensor", None)),
    (dict(fsdp=4, tensor=2), "fsdp", ("vocab", "embed"), None, P("tensor", "fsdp")),
]


@pytest.mark.parametrize("sizes,strategy,axes,scope,expected", CASES)
def test_resolved_specs(devices, sizes, strategy, axes, scope, expected):
    p = Partitioner(make_mesh(**sizes), strategy)
    assert p.spec(axes, scope) == expected
    assert p.sharding(axes, scope).spec == expected


@pytest.mark.parametrize("sizes,strategy,attention,moe", [
    (dict(fsdp=8), "fsdp", 1, 1),
    (dict(context=8), "cp", 8, 8),
    (dict(data=2, context=4), "cp", 4, 4),
    (dict(context=4, expert=2), "cp", 4, 4),
    (dict(fsdp=2, expert=4), "ep_as_cp", 4, 1),
    (dict(fsdp=2, expert=2, context=2), "ep_as_cp", 4, 2),
])
def test_context_size(devices, sizes, strategy, attention, moe):
    p = Partitioner(make_mesh(**sizes), strategy)
    assert p.context_size() == p.context_size("attention") == attention
    assert p.context_size("moe") == moe
    assert p.size("experts", "moe") == sizes.get("expert", 1)


def test_same_mesh_axis_twice_raises_at_resolution(devices):
    p = Partitioner(make_mesh(fsdp=8), "fsdp")
    with pytest.raises(ValueError, match=r"map both 'batch' and 'embed' to mesh axis 'fsdp'"):
        p.spec(("batch", "embed"))
    # The table is checked even where the colliding axis has size 1 (a bug on any mesh).
    with pytest.raises(ValueError, match="mesh axis"):
        Partitioner(make_mesh(data=8), "fsdp").spec(("batch", "embed"))


def test_unknown_logical_axis_and_scope(devices):
    p = Partitioner(make_mesh(fsdp=8))
    with pytest.raises(ValueError, match="unknown logical axis 'sequence'"):
        p.spec(("batch", "sequence"))
    with pytest.raises(ValueError, match="unknown scope 'mlp'"):
        p.spec(("batch",), "mlp")
    with pytest.raises(TypeError, match="sequence of names"):
        p.spec("batch")


def test_overrides(devices):
    p = Partitioner(make_mesh(fsdp=4, tensor=2), "fsdp", overrides={None: {"vocab": None}})
    assert p.spec(("vocab", "embed")) == P(None, "fsdp")
    with pytest.raises(ValueError, match="names mesh axis 'model'"):
        Partitioner(make_mesh(fsdp=8), overrides={None: {"vocab": "model"}})
    with pytest.raises(ValueError, match="unknown scope"):
        Partitioner(make_mesh(fsdp=8), overrides={"mlp": {}})


def test_repr_shows_resolved_table(devices):
    text = repr(Partitioner(make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp"))
    assert "strategy='ep_as_cp'" in text and "fsdp=2, expert=2, context=2" in text
    length_row = next(line for line in text.splitlines() if line.strip().startswith("length"))
    assert "context,expert" in length_row and length_row.rstrip().endswith("context")
    assert "attention=4" in text and "moe=2" in text


def test_unsharded_partitioner_is_a_no_op():
    p = Partitioner(None)
    x = jnp.ones((2, 3))
    assert p.spec(("batch", "embed")) == P()
    assert p.sharding(("batch",)) is None
    assert p.constrain(x, ("batch", "act_embed")) is x
    assert p.context_size() == 1
    assert "unsharded" in repr(p)


def test_constrain_under_jit_with_and_without_ambient_mesh(devices):
    mesh = make_mesh(fsdp=2, expert=2, context=2)
    p = Partitioner(mesh, "ep_as_cp")
    x = jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(2, 8, 4)
    f = jax.jit(lambda x: p.constrain(x * 2, ACT, "attention"))
    y = f(x)
    assert y.sharding.is_equivalent_to(p.sharding(ACT, "attention"), 3)
    assert tuple(y.sharding.spec)[:2] == ("fsdp", ("context", "expert"))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    with jax.set_mesh(mesh):
        z = f(x)
    assert z.sharding.spec == y.sharding.spec
    with pytest.raises(ValueError, match="name 2 dimensions"):
        p.constrain(x, ("batch", "length"))


def test_mesh_shape_parse(devices):
    assert MeshShape.parse("fsdp=2,expert=2,context=2") == MeshShape(fsdp=2, expert=2, context=2)
    assert MeshShape.parse("data=8").make().shape["data"] == 8
    with pytest.raises(ValueError, match="bad mesh entry 'pipeline=2'"):
        MeshShape.parse("pipeline=2")
    with pytest.raises(ValueError, match="bad mesh entry 'fsdp'"):
        MeshShape.parse("fsdp")


def test_top_level_exports():
    assert zoo.make_mesh is make_mesh and zoo.Partitioner is Partitioner


def test_shape_checks_live_on_the_partitioner(devices):
    """The layers' and ops' divisibility and head rules: each check passes on a shape that
    splits and names the value, the shards and the fix on one that does not."""
    p = Partitioner(make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")  # attention cp = 4
    p.check_split("embed", 64, "embed", "attention")
    with pytest.raises(ValueError, match=r"X: embed=6 is not divisible by its 8 shards over "
                                         r"mesh axes \('fsdp', 'context', 'expert'\).*e\.g\. 8"):
        p.check_split("embed", 6, "embed", "attention", what="X")
    p.check_sequence(24, "attention")  # 24 = 3 * 2*cp: balanced chunks
    with pytest.raises(ValueError, match=r"length=20 is not divisible by 2\*context = 8.*pad "
                                         r"it to 24 \(or cut it to 16\)"):
        p.check_sequence(20, "attention")
    p.check_sequence(20, "attention", balanced=False)  # 20 % cp == 0 is enough unbalanced
    with pytest.raises(ValueError, match=r"kv length=6 is not divisible by its 4 shards"):
        p.check_sequence(6, "attention", name="kv length", balanced=False)
    p.check_tokens(2, 8, "moe")
    with pytest.raises(ValueError, match=r"batch=3 is not divisible by its 2 shards.*multiple "
                                         r"of 2"):
        p.check_tokens(3, 8, "attention")
    t = Partitioner(make_mesh(fsdp=2, tensor=4), "fsdp")
    t.check_heads(8, 2)  # 2 kv heads repeated over 4 tensor shards
    t.check_heads(8, 8)
    for heads, kv, pattern in ((6, 4, "not a multiple of num_kv_heads=4; choose num_kv_heads "
                                      r"among \[1, 2, 3, 6\]"),
                               (6, 3, "num_heads=6 is not divisible by the tensor axis size 4"),
                               (12, 3, "num_kv_heads=3 and the tensor axis size 4 must divide "
                                       "one another")):
        with pytest.raises(ValueError, match=pattern):
            t.check_heads(heads, kv)
    assert Partitioner.check_inputs_shape((2, 8, 4)) == (2, 8, 4)
    with pytest.raises(ValueError, match="three positive ints"):
        Partitioner.check_inputs_shape((2, 8))
    assert zoo.partitioning.axes_size(t.mesh, ("fsdp", "tensor")) == 8 == t.axis_size(
        ("fsdp", "tensor"))
    assert zoo.partitioning.axes_size(None, "fsdp") == 1


def test_flax_workarounds_are_version_guarded():
    from zoo import _flax_compat as fc
    assert fc.version_tuple("0.12.8") == (0, 12, 8) == fc.version_tuple("0.12.8+local")
    assert fc.version_tuple("0.13.0rc1") == (0, 13, 0)
    on = fc.FLAX_VERSION <= fc.CHECKED_ON
    assert fc.NUMPY_RNG_COUNTER is on


# -- the platform a program is built for is its mesh's ------------------------------------------

class _Device:  # a topology's device description: only its platform is read
    def __init__(self, platform):
        self.platform = platform


class _Mesh:
    def __init__(self, platform, n=8):
        self.devices = np.array([_Device(platform) for _ in range(n)], dtype=object)


def test_mesh_platform_reads_the_devices(devices):
    from zoo.partitioning import mesh_platform
    assert mesh_platform(zoo.make_mesh(fsdp=8)) == "cpu"
    assert mesh_platform(_Mesh("tpu")) == "tpu"
    assert mesh_platform(_Mesh("cuda")) == mesh_platform(_Mesh("gpu")) == "gpu"
    assert mesh_platform(None) == "cpu"  # no mesh: the default device's
    assert zoo.Partitioner(zoo.make_mesh(fsdp=8)).platform == "cpu"


def test_program_choices_follow_the_mesh_not_the_process(devices, monkeypatch):
    """A process whose default backend is an accelerator (as with libtpu loaded) still builds
    the CPU program for a CPU mesh, and an accelerator mesh gets the accelerator program on a
    CPU host: kernels, tiles, ring pieces, donation and host offload."""
    from zoo.models.stacks import remat_policy
    from zoo.ops.flash import ACCELERATOR_TILES, CPU_TILES, FlashKernel
    from zoo.ops.kernels import TokamaxKernel, get_kernel
    from zoo.ops.pallas_tpu import PallasTpuKernel
    from zoo.ops.ring import ring_rounds
    from zoo.train.step import make_train_step
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    cpu = zoo.Partitioner(zoo.make_mesh(fsdp=8)).platform
    kern = get_kernel("auto", cpu)
    assert isinstance(kern, FlashKernel) and (kern.q_tile, kern.kv_tile) == CPU_TILES
    tpu = get_kernel("auto", "tpu")  # zoo's Mosaic kernel, compiled, not interpreted
    assert isinstance(tpu, PallasTpuKernel) and tpu.interpret is False
    assert get_kernel("pallas_tpu", cpu).interpret is True  # Pallas' interpreter on CPU
    assert isinstance(get_kernel("auto", "gpu"), TokamaxKernel)
    tok = get_kernel("tokamax", "tpu")
    assert tok.implementation[0] == "mosaic_tpu" and tok.pad_to == 128
    assert get_kernel("tokamax", "gpu").implementation[0] == "mosaic_gpu"
    assert FlashKernel().for_platform("gpu").tiles(4096, 4096) == ACCELERATOR_TILES
    assert FlashKernel(q_tile=16).for_platform("tpu").q_tile == 16  # a user's tile stays
    shape = (1, 4096, 8, 64)
    assert ring_rounds(8, shape, shape, shape, platform=cpu) == 16  # 256-key pieces
    assert ring_rounds(8, shape, shape, shape, platform="tpu") == 4  # 1,024-key pieces
    with pytest.raises(ValueError, match="pinned host memory"):
        remat_policy("offload_layer_outputs", cpu)
    assert remat_policy("offload_layer_outputs", "gpu")[0]
    # donation: on by default for an accelerator mesh, off for a CPU one (XLA:CPU cache hangs)
    assert make_train_step(platform=cpu)._jit_info.donate_argnums == ()
    assert make_train_step(platform="gpu")._jit_info.donate_argnums == (0, 1)
