"""MoE forward+backward throughput: dispatch strategies and expert parallelism.

Runs `zoo.layers.moe.MoE` (and subclasses that swap one method) on the 8 virtual CPU devices
of this process (or whatever devices JAX sees) and prints a markdown table of tokens/s, with
ratios against the dropless ragged_dot layer at EP=1 for the same number of experts.

* ``ragged``  -- sort copies by expert, `jax.lax.ragged_dot` (dropless; the GPU/TPU default).
* ``blocked`` -- the same with the blocked grouped matmul (dropless; the layer's CPU default).
* ``dense``   -- one-hot combine matrix ``[T, E]``; every local expert on every token.
* ``loop``    -- a Python loop over local experts, each on every token, masked.
* ``a2a``     -- dropless all-to-all dispatch (worst-case buffers, blocked grouped matmul)
                 instead of the layer's all-gather / reduce-scatter over ``expert`` (EP > 1);
                 compare it with ``blocked`` at the same EP.

Every configuration is compiled first, then timed in interleaved rounds (best round kept), so
other load on the machine shifts all variants alike.

Mesh: ``expert=EP, fsdp=8/EP`` with the ``fsdp`` strategy (tokens sharded over all devices,
experts over ``expert``). Usage::

    python benchmarks/moe.py                    # E = 8, 16, 64; EP = 1, 2, 4; all variants
    python benchmarks/moe.py --experts 8 --ep 1 --variants ragged,dense --iters 5

Legend: T tokens, D embed, E experts (E_local per device), F mlp, k experts per token.
"""

from __future__ import annotations

import argparse
import os
import re
import time

_flags = os.environ.get("XLA_FLAGS", "")  # 8 virtual CPU devices unless the caller chose
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from zoo.layers.moe import ACT, MoE  # noqa: E402
from zoo.ops import moe as ops  # noqa: E402
from zoo.partitioning import Partitioner, make_mesh  # noqa: E402


def _combine(indices, weights, expert_offset, num_local):
    """``[T, E_local]`` combine weights of the local experts (zero where not routed)."""
    local = jax.nn.one_hot(indices - expert_offset, num_local, dtype=jnp.float32)  # TkE
    return jnp.einsum("tke,tk->te", local, weights)


class DenseMoE(MoE):
    """Every local expert on every token; combine with the one-hot weight matrix."""

    def local_experts(self, x, indices, weights, wi_gate, wi_up, wo, expert_offset):
        comb = _combine(indices, weights, expert_offset, wi_gate.shape[0])
        h = jax.nn.silu(jnp.einsum("td,edf->tef", x, wi_gate))
        h = h * jnp.einsum("td,edf->tef", x, wi_up)
        y = jnp.einsum("tef,efd->ted", h, wo).astype(jnp.float32)
        return jnp.einsum("ted,te->td", y, comb), jnp.zeros((), jnp.int32)


class LoopMoE(MoE):
    """A Python loop over local experts, each on every token, masked by its combine weight."""

    def local_experts(self, x, indices, weights, wi_gate, wi_up, wo, expert_offset):
        comb = _combine(indices, weights, expert_offset, wi_gate.shape[0])
        y = 0.0
        for e in range(wi_gate.shape[0]):
            h = jax.nn.silu(x @ wi_gate[e]) * (x @ wi_up[e])
            y = y + (h @ wo[e]).astype(jnp.float32) * comb[:, e, None]
        return y, jnp.zeros((), jnp.int32)


# variant -> (layer class, constructor arguments)
VARIANTS = {"ragged": (MoE, dict(dispatch="all_gather", grouped_matmul="ragged_dot")),
            "blocked": (MoE, dict(dispatch="all_gather", grouped_matmul="blocked")),
            "dense": (DenseMoE, dict(dispatch="all_gather")),
            "loop": (LoopMoE, dict(dispatch="all_gather")),
            "a2a": (MoE, dict(dispatch="all_to_all", grouped_matmul="blocked")),
            "a2a_f2": (MoE, dict(dispatch="all_to_all", grouped_matmul="blocked",
                                 buffer_factor=2.0))}


def build(cls, *, experts, ep, batch, length, embed, mlp, k):
    """A compiled forward+backward step and its arguments; returns (run, compile seconds)."""
    n = len(jax.devices())
    part = Partitioner(make_mesh(expert=ep, fsdp=n // ep), "fsdp")
    cls, kw = cls
    moe = cls(num_experts=experts, num_experts_per_tok=k, mlp_dim=mlp,
              inputs_shape=(batch, length, embed), partitioner=part, rngs=nnx.Rngs(0), **kw)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    x = jax.device_put(np.random.default_rng(0).normal(size=(batch, length, embed)),
                       part.sharding(ACT)).astype(jnp.float32)

    @jax.jit
    def step(params, x):
        def loss(params, x):
            y, aux = nnx.merge(graphdef, params, rest)(x)
            return jnp.mean(y.astype(jnp.float32) ** 2) + 0.01 * aux["load_balance_loss"]
        return jax.grad(loss, argnums=(0, 1))(params, x)

    t0 = time.perf_counter()
    jax.block_until_ready(step(params, x))
    return (lambda: step(params, x)), time.perf_counter() - t0


def timed(run, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        out = run()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default="8,16,64")
    ap.add_argument("--ep", default="1,2,4")
    ap.add_argument("--variants", default="ragged,blocked,dense,loop,a2a")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--embed", type=int, default=128)
    ap.add_argument("--mlp", type=int, default=256)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    tokens = args.batch * args.length
    dims = dict(batch=args.batch, length=args.length, embed=args.embed, mlp=args.mlp, k=args.k)
    variants = [v for v in re.split(r"[, ]+", args.variants) if v]
    experts = [int(e) for e in args.experts.split(",")]
    eps = [int(e) for e in args.ep.split(",")]
    print(f"{jax.device_count()} x {jax.devices()[0].platform} devices; T={tokens} tokens, "
          f"D={args.embed}, F={args.mlp}, k={args.k}; forward+backward, best of "
          f"{args.rounds} rounds x {args.iters} steps", flush=True)
    configs = [(e, ep, v) for e in experts for ep in eps for v in variants
               if not (v.startswith("a2a") and ep == 1) and e % ep == 0]
    runs, compile_s = {}, {}
    for c in configs:
        e, ep, v = c
        runs[c], compile_s[c] = build(VARIANTS[v], experts=e, ep=ep, **dims)
        print(f"  compiled E={e} EP={ep} {v} in {compile_s[c]:.1f}s", flush=True)
    best = {c: float("inf") for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            best[c] = min(best[c], timed(runs[c], args.iters))
    # useful FLOPs per step: 3 matmuls of 2*D*F per token copy, x3 for forward+backward
    flops = 3 * 2 * args.embed * args.mlp * tokens * args.k * 3
    base = {e: best.get((e, min(eps), variants[0])) for e in experts}
    print(f"\n| experts | EP | dispatch | tokens/s | vs {variants[0]} EP={min(eps)} "
          f"| useful GFLOP/s | compile s |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for c in configs:
        e, ep, v = c
        ratio = f"{base[e] / best[c]:.2f}" if base[e] else "-"
        print(f"| {e} | {ep} | {v} | {tokens / best[c]:,.0f} | {ratio} | "
              f"{flops / best[c] / 1e9:.1f} | {compile_s[c]:.1f} |")


if __name__ == "__main__":
    main()
