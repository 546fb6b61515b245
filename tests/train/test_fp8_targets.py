"""FP8 on the accelerator programs, compiled on this CPU host (docs/fp8.md).

* H100: the mini DeepSeek-V3 train step with ``fp8="blockwise"`` (two layers: one dense, one
  MoE; fsdp over 8 H100s) compiled on this host. Every GEMM
  of attention (MLA's projections and latent expansion), the dense MLP and the MoE (shared
  and routed experts), forward and backward, takes float8 operands in the optimized HLO (a
  Triton GEMM fusion whose dot reads float8, or cuBLASLt's FP8 matmul); none converts float8
  to a wider type before its dot. Only the router and the output head multiply wider types.
  The classifier itself is checked on two tiny programs: float8 operands, and the same
  converted to bf16 before the dot.
* H100: XLA:GPU multiplies a ``ragged-dot``'s every row by every group's weight (G times the
  grouped product's FLOPs), what the FP8 goal row's HLO FLOPs ratio comes from.
* TPU v4/v5e/v5p/v6e have no FP8 matrix unit: a layer built with ``fp8="blockwise"`` on a
  mesh of their devices warns `Fp8EmulatedWarning` (the platform read from the mesh, not the
  process); H100, CPU and device-less meshes do not.
"""

import collections
import dataclasses
import importlib.util
import re
import warnings

import pytest

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU_COMPILER = importlib.util.find_spec("jax_cuda12_plugin") is not None
SEQ, BATCH = 256, 8


def h100_program() -> str:
    """The optimized HLO of the fp8 mini DeepSeek-V3 train step for ``h100-8``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import zoo
    from zoo.models import registry
    from zoo.targets import compile_with_text
    from zoo.train import target_devices
    from zoo.train.step import BATCH_KEYS, abstract_state, make_train_step, make_tx

    family, config = registry.resolve("deepseek3_mini")
    mesh = zoo.make_mesh(devices=target_devices("h100-8"), fsdp=8)
    p = zoo.Partitioner(mesh, "fsdp")
    config = dataclasses.replace(config, num_hidden_layers=2, num_nextn_predict_layers=0,
                                 dtype="bfloat16", fp8="blockwise")
    model, opt = abstract_state(lambda: family.model_cls(
        config, inputs_shape=(BATCH, SEQ), partitioner=p, rngs=nnx.Rngs(0)), make_tx(), mesh)
    sharding = p.sharding(("batch", "length"))
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.float32 if k == "loss_weights"
                                     else jnp.int32, sharding=sharding) for k in BATCH_KEYS}
    lowered = make_train_step(donate=True).lower(model, opt, batch,
                                                 jax.ShapeDtypeStruct((), jnp.float32))
    return compile_with_text(lowered, "gpu")[1]


_PASS_THROUGH = ("bitcast", "copy", "transpose", "reshape", "slice", "dynamic-slice", "pad",
                 "broadcast", "select")


def _element(type_text: str) -> str:
    return type_text.split("[")[0].lstrip("(")


def gemms(text: str) -> collections.Counter:
    """``(kind, scope, direction)`` -> how many GEMM instructions of the program (a ``dot``
    anywhere, fused or not, or a cuBLAS matmul custom call), where kind is ``"fp8"`` (both
    operands float8), ``"upcast"`` (an operand converted from float8 just before: the GEMM
    runs wide) or the operands' types; scope ``attention``/``mlp``/``moe``/``router``/
    ``other`` from the op's named scopes; direction ``bwd`` inside the transpose."""
    from zoo.ops import hlo
    module = hlo.parse(text)
    out = collections.Counter()
    for comp, ins in module.instructions():
        cublas = ins.opcode == "custom-call" and re.search(r'custom_call_target="__cublas',
                                                            ins.attrs)
        if ins.opcode not in ("dot", "ragged-dot") and not cublas:
            continue
        types = module.types[comp]
        defs = {i.name: i for i in module.computations[comp]}
        elems = [_element(types.get(o, "?")) for o in ins.operands[:2]]
        kind = "fp8" if all(e.startswith("f8") for e in elems) else "/".join(elems)
        for o in ins.operands[:2]:
            d = defs.get(o)
            while d is not None and d.opcode in _PASS_THROUGH:
                d = defs.get(d.operands[-1] if d.opcode == "select" else d.operands[0])
            if d is not None and d.opcode == "convert" and \
                    _element(types.get(d.operands[0], "")).startswith("f8"):
                kind = "upcast"
        op = ins.op_name or ""
        scope = next((s for s, keys in (("router", ("/router/",)),
                                        ("attention", ("/mla/", "/attention/")),
                                        ("moe", ("/moe/",)), ("mlp", ("/mlp/",)))
                      if any(k in op for k in keys)), "other")
        out[kind, scope, "bwd" if "transpose(" in op else "fwd"] += 1
    return out


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs jax-cuda12-plugin (the test extra)")
def test_h100_program_multiplies_float8_in_every_fp8_scope():
    counts = gemms(h100_program())
    fp8 = {(s, d): n for (k, s, d), n in counts.items() if k == "fp8"}
    print("H100 FP8 GEMMs by scope:", dict(sorted(fp8.items())))
    print("all GEMMs:", dict(sorted(counts.items())))
    for scope in ("attention", "mlp", "moe"):
        for direction in ("fwd", "bwd"):
            assert fp8.get((scope, direction), 0) >= 1, (scope, direction, counts)
    # nothing upcasts float8 before its dot; only the router and the head multiply wide types
    wide = {key: n for key, n in counts.items() if key[0] != "fp8"}
    assert not any(k == "upcast" for k, _, _ in wide), wide
    assert {s for _, s, _ in wide} <= {"router", "other"}, wide
    # dgrad and wgrad: the backward holds at least the forward's FP8 GEMMs (a loop body
    # counts once, and XLA unrolls short 128-block loops differently on each side, so the
    # counts follow the loop structure, not twice the forward's)
    for scope in ("attention", "mlp", "moe"):
        assert fp8[scope, "bwd"] >= fp8[scope, "fwd"], fp8


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs jax-cuda12-plugin (the test extra)")
def test_gemm_classifier_tells_float8_from_upcast():
    """`gemms` on two tiny H100 programs: a dot of float8 operands is ``fp8``; the same
    operands converted to bf16 first (a GEMM that runs wide) is ``upcast``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zoo
    from zoo.train import target_devices
    mesh = zoo.make_mesh(devices=target_devices("h100-8"), fsdp=8)
    a = jax.ShapeDtypeStruct((256, 256), jnp.float8_e4m3fn, sharding=NamedSharding(mesh, P()))

    def upcast(x, w):
        with jax.named_scope("mlp"):
            return jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))

    def float8(x, w):
        with jax.named_scope("moe"):
            return jax.lax.dot(x, w, preferred_element_type=jnp.float32)
    compiled = lambda f: jax.jit(f).lower(a, a).compile().as_text()
    assert gemms(compiled(upcast)) == {("upcast", "mlp", "fwd"): 1}
    assert gemms(compiled(float8)) == {("fp8", "moe", "fwd"): 1}


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs jax-cuda12-plugin (the test extra)")
def test_h100_ragged_dot_multiplies_every_row_by_every_group():
    """Why the FP8 goal row's HLO FLOPs are 2.8x the model's (docs/fp8.md): XLA:GPU has no
    grouped GEMM for ``ragged-dot`` (its RaggedDotRewriter); it multiplies every row by every
    group's weight, the rows masked per group, so a grouped product costs G times its FLOPs:
    `fp8.ragged_dot`'s forward, dgrad and wgrad alike, and bf16's `jax.lax.ragged_dot`. When
    XLA gains a grouped lowering this fails, and that explanation is stale."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zoo
    from zoo.ops import fp8, hlo
    from zoo.train import target_devices
    m, k, n, g = 512, 256, 256, 4
    mesh = zoo.make_mesh(devices=target_devices("h100-8"), fsdp=8)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                     sharding=NamedSharding(mesh, P()))
    args = (spec((m, k), jnp.bfloat16), spec((g, k, n), jnp.bfloat16), spec((g,), jnp.int32))

    def flops(f):
        return hlo.hlo_stats(jax.jit(f).lower(*args).compile().as_text()).flops

    def fp8_loss(x, w, sizes):
        return fp8.ragged_dot(x, w, sizes).sum()

    def bf16(x, w, sizes):
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)

    grouped = 2 * m * k * n  # every row times its own group's weight
    assert flops(jax.value_and_grad(fp8_loss, argnums=(0, 1))) == 3 * g * grouped
    assert flops(bf16) == g * grouped


def _linear_on(mesh):
    """A Linear with FP8 on `mesh`, built abstractly; the warnings it raised."""
    from flax import nnx

    import zoo
    from zoo.layers import Linear
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nnx.eval_shape(lambda: Linear(256, 256, in_axes=("embed",), out_axes=("mlp",),
                                      partitioner=zoo.Partitioner(mesh, "fsdp"),
                                      fp8="blockwise", rngs=nnx.Rngs(0)))
    return caught


@pytest.mark.skipif(not (HAS_LIBTPU and HAS_GPU_COMPILER),
                    reason="needs libtpu and jax-cuda12-plugin (the test extra)")
@pytest.mark.parametrize("target,kind", [("tpu-v5p-8", "TPU v5"), ("tpu-v5e-8", "TPU v5 lite"),
                                         ("tpu-v4-8", "TPU v4"), ("h100-8", None)])
def test_tpus_without_fp8_units_warn_at_construction(target, kind):
    import zoo
    from zoo.ops.fp8 import Fp8EmulatedWarning
    from zoo.train import target_devices
    caught = _linear_on(zoo.make_mesh(devices=target_devices(target), fsdp=8))
    found = [w for w in caught if issubclass(w.category, Fp8EmulatedWarning)]
    if kind is None:
        assert not found
        return
    assert len(found) == 1
    msg = str(found[0].message)
    assert f"on {kind!r}" in msg and "no FP8 matrix unit" in msg and "fp8=None" in msg


def test_cpu_and_abstract_meshes_do_not_warn(devices):
    import jax

    import zoo
    from zoo.ops.fp8 import Fp8EmulatedWarning
    abstract = jax.sharding.AbstractMesh((8,), ("fsdp",))
    for mesh in (zoo.make_mesh(devices=devices, fsdp=8), None):
        assert not [w for w in _linear_on(mesh) if issubclass(w.category, Fp8EmulatedWarning)]
    from zoo.ops import fp8
    fp8.check_target("blockwise", abstract)  # no devices, no target: silent
    with pytest.raises(ValueError, match="is not an FP8 mode"):
        fp8.check_target("rowwise", None)
