"""MoE part of the accelerator check: each dispatch and grouped matmul on the device against
the CPU reference, and tokamax's grouped matmul timed against `jax.lax.ragged_dot`.

`run(report)` is imported by ``benchmarks/accelerator_check.py`` (which prints the rows as
tables); ``python benchmarks/accel_moe.py`` runs it alone and prints plain rows.

* ``moe dispatch`` rows: a Mixtral-shaped `zoo.layers.moe.MoE` (bf16 compute, fp32 parameters)
  over every device of the default backend (mesh ``expert=n``), forward and gradients, for
  ``dispatch`` in all_gather / all_to_all and ``grouped_matmul`` in auto / tokamax /
  ragged_dot, each compared with the same layer run unsharded on the CPU with the blocked
  grouped matmul (the path CI tests). Columns: the largest error relative to the reference's
  largest value, and whether the program holds ``ragged-all-to-all``.
* ``moe grouped matmul`` rows: `zoo.ops.grouped.grouped_swiglu` with ``"tokamax"`` and
  ``"ragged_dot"`` at a few expert counts, forward and forward+backward milliseconds; on a TPU
  also the Pallas Mosaic grouped matmul that ships with jax (``megablox``), the kernel that
  tokamax's Mosaic TPU ragged dot and MaxText use.

Needs a GPU or TPU to mean anything; on CPU it runs (small) and checks the call path only.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.layers.moe import ACT, MoE
from zoo.ops.grouped import grouped_swiglu
from zoo.partitioning import Partitioner, make_mesh


def _timed(fn, *args, iters: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def _layer(partitioner, shape, **kw):
    return MoE(num_experts=16, num_experts_per_tok=2, mlp_dim=256, inputs_shape=shape,
               partitioner=partitioner, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), **kw)


def _loss_and_grads(moe, x):
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2), y
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return fn, params


def dispatch_rows(report, tokens_per_device: int = 1024, embed: int = 512) -> None:
    devices = jax.devices()
    n = len(devices)
    shape = (n * 4, tokens_per_device // 4, embed)
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = _layer(None, shape, grouped_matmul="blocked")
        fn, params = _loss_and_grads(ref, x)
        (_, y_ref), (g_ref, gx_ref) = jax.device_get(fn(params, jnp.asarray(x)))
    ref_state = {".".join(map(str, k)): np.asarray(v) for k, v in
                 nnx.to_flat_state(nnx.state(ref, nnx.Param))}
    part = Partitioner(make_mesh(expert=n, devices=devices), "fsdp")
    for dispatch in ("all_gather", "all_to_all"):
        for gm in ("auto", "tokamax", "ragged_dot"):
            moe = _layer(part, shape, dispatch=dispatch, grouped_matmul=gm)
            for k, var in nnx.to_flat_state(nnx.state(moe, nnx.Param)):
                var[...] = jax.device_put(ref_state[".".join(map(str, k))], var[...].sharding)
            fn, params = _loss_and_grads(moe, x)
            xs = jax.device_put(x, part.sharding(ACT))
            try:
                text = fn.lower(params, xs).compile().as_text()
            except Exception as e:  # a path that does not build here: say why, go on
                report("moe dispatch", dict(
                    devices=f"{n} x {devices[0].platform}", dispatch=dispatch,
                    grouped_matmul=gm, y_rel_err="-", dx_rel_err="-", dwo_rel_err="-",
                    ragged_all_to_all="-", ms=f"fails: {str(e).splitlines()[0][:120]}"))
                continue
            (_, y), (g, gx) = fn(params, xs)
            scale = lambda a: float(np.abs(np.asarray(a, np.float32)).max()) or 1.0
            err = lambda a, b, scale=scale: float(np.abs(
                np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()) / scale(b)
            report("moe dispatch", dict(
                devices=f"{n} x {devices[0].platform}", dispatch=dispatch, grouped_matmul=gm,
                y_rel_err=f"{err(y, y_ref):.2e}", dx_rel_err=f"{err(gx, gx_ref):.2e}",
                dwo_rel_err=f"{err(g.wo[...], g_ref.wo[...]):.2e}",
                ragged_all_to_all="ragged-all-to-all" in text,
                ms=f"{_timed(fn, params, xs):.2f}"))


def grouped_matmul_rows(report, rows: int = 16384, embed: int = 2048, mlp: int = 1024) -> None:
    rng = np.random.default_rng(0)
    for experts in (8, 32, 128):
        sizes = np.bincount(rng.integers(0, experts, rows), minlength=experts).astype(np.int32)
        x = jnp.asarray(rng.normal(size=(rows, embed)), jnp.bfloat16)
        wg, wu = (jnp.asarray(rng.normal(size=(experts, embed, mlp)) * 0.02, jnp.bfloat16)
                  for _ in range(2))
        wo = jnp.asarray(rng.normal(size=(experts, mlp, embed)) * 0.02, jnp.bfloat16)
        gs = jnp.asarray(sizes)
        row = dict(experts=experts, rows=rows, embed=embed, mlp=mlp)
        outs = {}
        impls = ("tokamax", "ragged_dot", *(("megablox",) if on_tpu() else ()))
        for impl in impls:
            swiglu = _megablox_swiglu if impl == "megablox" else (
                lambda x, wg, wu, wo, gs, impl=impl: grouped_swiglu(x, wg, wu, wo, gs, impl))
            fwd = jax.jit(lambda x, wg, wu, wo, f=swiglu, gs=gs: f(x, wg, wu, wo, gs))
            both = jax.jit(jax.grad(lambda x, wg, wu, wo, f=swiglu, gs=gs: jnp.sum(
                f(x, wg, wu, wo, gs).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3)))
            outs[impl] = np.asarray(fwd(x, wg, wu, wo), np.float32)
            row[f"{impl}_fwd_ms"] = f"{_timed(fwd, x, wg, wu, wo):.2f}"
            row[f"{impl}_fwd_bwd_ms"] = f"{_timed(both, x, wg, wu, wo):.2f}"
        speedup = float(row["ragged_dot_fwd_bwd_ms"]) / float(row["tokamax_fwd_bwd_ms"])
        row["speedup_fwd_bwd"] = f"{speedup:.2f}"
        for impl in impls[:1] + impls[2:]:
            diff = (np.abs(outs[impl] - outs["ragged_dot"]).max()
                    / np.abs(outs["ragged_dot"]).max())
            row[f"{impl}_rel_diff"] = f"{diff:.1e}"
        report("moe grouped matmul", row)


def on_tpu() -> bool:
    return jax.devices()[0].platform == "tpu"


def _megablox_swiglu(x, wg, wu, wo, gs):
    """SwiGLU through jax's Pallas TPU grouped matmul (its own custom VJP); TPU only."""
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
    dot = lambda a, w: megablox.gmm(a, w, gs, a.dtype)
    return dot(jax.nn.silu(dot(x, wg)) * dot(x, wu), wo)


def run(report) -> None:
    """Report the MoE rows: ``report(section, row_dict)`` per row."""
    dispatch_rows(report)
    on_cpu = jax.default_backend() == "cpu"
    grouped_matmul_rows(report, **(dict(rows=512, embed=64, mlp=32) if on_cpu else {}))


if __name__ == "__main__":
    run(lambda section, row: print(section, row, flush=True))
