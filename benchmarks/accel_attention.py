"""Attention block kernels timed under context parallelism on the device at hand.

`run(report)` times forward+backward of `zoo.ops.attention` for each block kernel (``"flash"``:
the zoo's pure-JAX kernel; ``"tokamax"``: tokamax's Pallas kernels on GPU/TPU;
``"pallas_tpu"``: zoo's Mosaic kernel, on TPU) under each strategy (``ring``, ``all_gather``)
with the sequence sharded over every local device, one causal document or three packed ones,
bf16 inputs, and checks each one's output and gradients against the flash kernel's. It calls
``report(section, row)`` with one dict per row; `benchmarks/accelerator_check.py` imports it
when present, and ``python benchmarks/accel_attention.py [lengths]`` prints the rows itself.
On CPU it runs tiny shapes (an import/path check, not a measurement).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import zoo
from zoo.ops import attention

SECTION = "attention kernels under CP"
SHAPES = {  # name: (heads, kv heads, q/k head dim, v head dim)
    "gqa": (32, 8, 128, 128),
    "mla-like": (16, 16, 192, 128),
}


def _inputs(length, shape, dtype, docs=1):
    """One row of `docs` packed causal documents (uneven lengths: 3/6, 2/6, 1/6 for three)."""
    N, K, H, V = shape
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, length, n, d)), dtype)
               for n, d in ((N, H), (K, H), (K, V)))
    weights = np.arange(docs, 0, -1)
    ends = np.cumsum(weights * length // weights.sum())
    ends[-1] = length
    seg = np.searchsorted(ends, np.arange(length), side="right") + 1
    starts = np.concatenate([[0], ends[:-1]])
    pos = np.arange(length) - starts[seg - 1]
    return q, k, v, jnp.asarray(pos[None], jnp.int32), jnp.asarray(seg[None], jnp.int32)


def _timed(fn, *args, repeats=5):
    out = jax.block_until_ready(fn(*args))  # compile + warm up
    start = time.perf_counter()
    for _ in range(repeats):
        out = jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats, out


def run(report, lengths=None, docs=(1, 3)):
    """Rows for every length, head shape and packing (`docs` documents per row); each row's
    output and gradients are compared with the first kernel's (flash)."""
    accel = jax.default_backend() in ("gpu", "tpu")
    lengths = lengths or ((8192, 32768) if accel else (256,))
    shapes = SHAPES if accel else {"tiny": (4, 2, 16, 16)}
    cp = jax.local_device_count()
    p = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.local_devices()), "cp")
    # zoo's Mosaic kernel is TPU-only (its interpreter elsewhere is a test path, not a timing)
    kernels = ("flash", "tokamax") + (("pallas_tpu",) if jax.default_backend() == "tpu" else ())
    for length, name, n_docs in ((a, b, c) for a in lengths for b in shapes for c in docs):
        shape = shapes[name]
        q, k, v, pos, seg = _inputs(length, shape, jnp.bfloat16, n_docs)
        w = jnp.asarray(np.random.default_rng(1).normal(size=(1, length, shape[0], shape[3])),
                        jnp.float32)  # output weights: every row's gradient differs
        # causal: half of 2*L^2*N*(H+V) forward, x3.5 with the backward
        flops = length * length * shape[0] * (shape[2] + shape[3]) * 3.5
        base = None
        for strategy in ("ring", "all_gather"):
            # the ring also in one round: its default rounds (`zoo.ops.ring.ring_rounds`)
            # trade memory for more, shorter steps, whose cost only a device shows
            variants = [(kernel, None) for kernel in kernels]
            variants += [("flash", 1)] if strategy == "ring" else []
            for kernel, rounds in variants:
                row = dict(length=length, shape=name, docs=n_docs, cp=cp,
                           strategy=strategy, kernel=kernel, rounds=rounds or "auto")

                def loss(q, k, v, kernel=kernel, strategy=strategy, rounds=rounds, pos=pos,
                         seg=seg, w=w):
                    o = attention(q, k, v, q_positions=pos, kv_positions=pos,
                                  q_segment_ids=seg, kv_segment_ids=seg, partitioner=p,
                                  implementation=strategy, kernel=kernel, rounds=rounds)
                    return jnp.sum(o.astype(jnp.float32) * w), o

                fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
                try:
                    seconds, ((_, out), grads) = _timed(fn, q, k, v)
                except Exception as e:
                    report(SECTION, {**row, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                got = [np.asarray(x, np.float32) for x in (out, *grads)]
                base = got if base is None else base
                diffs = [float(np.abs(a - b).max() / max(1e-6, np.abs(b).max()))
                         for a, b in zip(got, base)]
                row.update(ms=round(seconds * 1e3, 2),
                           tflops=round(flops / seconds / 1e12, 2),
                           max_abs_diff_vs_first=float(np.abs(got[0] - base[0]).max()),
                           max_rel_grad_diff_vs_first=max(diffs[1:]))
                report(SECTION, row)


def _print(section, row):
    print(f"[{section}] " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    import sys
    lengths = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    functools.partial(run, _print, lengths)()
