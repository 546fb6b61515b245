"""MoE forward+backward throughput by dispatch and expert parallelism, and collective bytes.

Runs `zoo.layers.moe.MoE` (and subclasses that swap one method) on the 8 virtual CPU devices
of this process (or whatever devices JAX sees) and prints a markdown table of tokens/s, with
ratios against the first variant at the smallest EP for the same number of experts.

* ``ragged``  -- all_gather dispatch, `jax.lax.ragged_dot` (on XLA:CPU a dense masked matmul).
* ``blocked`` -- all_gather dispatch, the blocked grouped matmul (the CPU default).
* ``dense``   -- one-hot combine matrix ``[T, E]``; every local expert on every token.
* ``loop``    -- a Python loop over local experts, each on every token, masked.
* ``a2a``     -- all_to_all dispatch (on CPU the padded transport), dropless buffers.
* ``a2a_f2``  -- all_to_all with ``buffer_factor=2`` (drops what overflows twice the
                 balanced share).

Every configuration is compiled first, then timed in interleaved rounds (best round kept), so
other load on the machine shifts all variants alike.

Mesh: ``expert=EP, fsdp=8/EP`` with the ``fsdp`` strategy (tokens sharded over all devices,
experts over ``expert``). ``--bytes`` instead prints the per-device collective bytes of one
full-size MoE layer (DeepSeek-V3 at EP 8/64/256, Mixtral 8x7B at EP 8) from the programs as
lowered (not compiled), against the analytic minimum; ``--temporaries`` the per-device XLA
temporaries of a one-layer full-width DeepSeek-V3 train step (compiled ahead of time, not run)
with the MoE and with a dense MLP in its place. ``--overflow`` times ``overflow="exact"``
(overflowing copies travel in further rounds over the same buffers) against ``"drop"`` at
buffer factors 1, 1.25 and 2, with the worst-case dropless buffers as each routing's baseline,
on ``expert=8`` (the 8 virtual devices): ``balanced`` (the random router), ``skewed`` (the
first device's experts favoured by a logit bias of 1) and ``one_device`` (every copy to the
first device's experts). Usage::

    python benchmarks/moe.py                    # E = 8, 16, 64; EP = 1, 2, 4; all variants
    python benchmarks/moe.py --experts 8 --ep 1 --variants ragged,dense --iters 5
    python benchmarks/moe.py --bytes --devices 256
    python benchmarks/moe.py --temporaries none,2,1 --devices 64
    python benchmarks/moe.py --overflow

Legend: T tokens, D embed, E experts (E_local per device), F mlp, k experts per token.
"""

from __future__ import annotations

import argparse
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.layers.moe import ACT, MoE
from zoo.ops import moe as ops
from zoo.ops.moe_execution import dispatch_bytes
from zoo.partitioning import Partitioner, make_mesh
from zoo.train.launch import set_cpu_devices


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


def build(cls, *, experts, ep, batch, length, embed, mlp, k, with_aux=False):
    """A compiled forward+backward step and its arguments; returns (run, compile seconds),
    and with ``with_aux`` the forward's aux dict as well."""
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
    run, compile_s = (lambda: step(params, x)), time.perf_counter() - t0
    if not with_aux:
        return run, compile_s
    aux = jax.jit(lambda params, x: nnx.merge(graphdef, params, rest)(x)[1])(params, x)
    return run, compile_s, jax.device_get(aux)


def timed(run, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        out = run()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


# -- exact overflow against drop ----------------------------------------------------------------
ROUTINGS = {"balanced": 0.0, "skewed": 1.0, "one_device": 100.0}  # logit bias, device 0's experts


def skewed(bias: float, ep: int):
    """An MoE whose router favours the first device's experts by ``bias`` in every logit."""
    class SkewedMoE(MoE):
        def route(self, x):
            E = self.num_experts
            hot = jnp.where(jnp.arange(E) < E // ep, bias, 0.0)
            logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32),
                                self.router[...].astype(jnp.float32)) + hot
            return ops.route(logits, k=self.num_experts_per_tok, scoring=self.scoring,
                             norm_topk_prob=self.norm_topk_prob)
    return SkewedMoE


def overflow_table(args, dims) -> None:
    ep, experts = jax.device_count(), int(args.experts.split(",")[-1])
    if experts % ep:
        raise SystemExit(f"--overflow: experts={experts} is not divisible by the {ep} devices; "
                         f"pass --experts with a multiple of {ep}")
    routings = [r for r in re.split(r"[, ]+", args.routings) if r]
    if bad := [r for r in routings if r not in ROUTINGS]:
        raise SystemExit(f"--routings: unknown {bad}; valid: {', '.join(ROUTINGS)}")
    factors = [float(f) for f in args.factors.split(",")]
    tokens = args.batch * args.length
    print(f"{ep} x {jax.devices()[0].platform} devices, expert={ep}; E={experts}, T={tokens} "
          f"tokens, D={args.embed}, F={args.mlp}, k={args.k}; forward+backward, best of "
          f"{args.rounds} rounds x {args.iters} steps", flush=True)
    configs = [(r, o, f) for r in routings for o, f in
               [("dropless", None)] + [(o, f) for f in factors for o in ("drop", "exact")]]
    runs, info = {}, {}
    for c in configs:
        r, o, f = c
        kw = dict(dispatch="all_to_all", grouped_matmul="blocked", buffer_factor=f,
                  overflow="drop" if o == "dropless" else o)
        runs[c], compile_s, aux = build((skewed(ROUTINGS[r], ep), kw), experts=experts, ep=ep,
                                        with_aux=True, **dims)
        load = np.asarray(aux["expert_counts"]).reshape(ep, -1).sum(1)
        info[c] = dict(compile_s=compile_s, busiest=load.max() / load.mean(),
                       rounds=int(aux["moe_rounds"]), dropped=float(aux["dropped_fraction"]))
        print(f"  compiled {r} {o} f={f} in {compile_s:.1f}s", flush=True)
    best = {c: float("inf") for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            best[c] = min(best[c], timed(runs[c], args.iters))
    print("\n| routing | busiest device (x balanced share) | overflow | buffer_factor | "
          "moe_rounds | dropped copies | tokens/s | vs dropless | compile s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for c in configs:
        r, o, f = c
        i, base = info[c], best[(r, "dropless", None)]
        print(f"| {r} | {i['busiest']:.2f} | {o} | {'-' if f is None else f'{f:g}'} | "
              f"{i['rounds'] if o == 'exact' else '-'} | {i['dropped']:.2%} | "
              f"{tokens / best[c]:,.0f} | {base / best[c]:.2f} | {i['compile_s']:.1f} |")


# -- collective bytes per device ----------------------------------------------------------------
PRESET_SHAPES = {  # (embed, experts, k, expert mlp) of the full-size presets
    "deepseek_v3": (7168, 256, 8, 2048),
    "mixtral_8x7b": (4096, 8, 2, 14336),
}
_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (all-gather|all-to-all|reduce-scatter|"
                         r"all-reduce|ragged-all-to-all)\(.*replica_groups=\{\{([\d,]*)\}")
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1}


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """Bytes one device sends per collective kind in an HLO module's text (ring algorithms:
    an all-gather or all-to-all sends ``(g-1)/g`` of its result, a reduce-scatter ``g-1``
    times its result, an all-reduce twice ``(g-1)/g`` of it); a ragged all-to-all is
    counted at its full receive buffer (the bound, not what travels)."""
    out: dict[str, float] = {}
    for dtype, dims, kind, group in _COLLECTIVE.findall(hlo_text):
        size = _ITEMSIZE.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        g = len(group.split(","))
        sent = {"reduce-scatter": size * (g - 1), "all-reduce": 2 * size * (g - 1) / g
                }.get(kind, size * (g - 1) / g)
        out[kind] = out.get(kind, 0.0) + sent
    return out


def layer_bytes(preset: str, ep: int, tokens: int, **moe_kw) -> dict[str, float]:
    """Per-device collective bytes of one MoE layer's forward+backward (bf16, ``tokens`` per
    device, mesh ``expert=ep``), from the program as lowered for CPU (no compile)."""
    embed, experts, k, mlp = PRESET_SHAPES[preset]
    part = Partitioner(make_mesh(expert=ep, devices=jax.devices()[:ep]), "fsdp")
    shape = (ep, tokens, embed)
    moe = nnx.eval_shape(lambda: MoE(num_experts=experts, num_experts_per_tok=k, mlp_dim=mlp,
                                     inputs_shape=shape, partitioner=part, dtype=jnp.bfloat16,
                                     param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), **moe_kw))
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                          if hasattr(v, "shape") else v, params)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=part.sharding(ACT))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x).lower(
        lowering_platforms=("cpu",)).as_text(dialect="hlo")
    return collective_bytes(text)


def bytes_table(tokens: int) -> None:
    gb = lambda v: f"{v / 1e9:.2f}"
    print(f"\nPer-device collective bytes of one MoE layer, forward+backward, bf16, {tokens} "
          f"tokens per device (GB); 'minimum' = every token copy sent once to its expert's "
          f"device and back (`zoo.ops.moe_execution.dispatch_bytes`)\n")
    print("| model | EP | all_gather analytic | all_gather measured | minimum (ragged a2a, "
          "balanced) | padded a2a f=2 measured | padded a2a dropless measured |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for preset, ep in (("deepseek_v3", 8), ("deepseek_v3", 64), ("deepseek_v3", 256),
                       ("mixtral_8x7b", 8)):
        if ep > jax.device_count():
            continue
        embed, _, k, _ = PRESET_SHAPES[preset]
        dims = dict(tokens=tokens, k=k, embed=embed, num_shards=ep)
        row = [preset, str(ep), gb(dispatch_bytes("all_gather", **dims))]
        for kw in (dict(dispatch="all_gather"), None,
                   dict(dispatch="all_to_all", buffer_factor=2.0), dict(dispatch="all_to_all")):
            if kw is None:
                row.append(gb(dispatch_bytes("all_to_all", **dims)))
                continue
            got = layer_bytes(preset, ep, tokens, **kw)
            row.append(gb(sum(v for kind, v in got.items() if kind != "all-reduce")))
        print("| " + " | ".join(row) + " |", flush=True)


# -- full-width temporaries -------------------------------------------------------------------
def layer_temporaries(moe: bool, *, fsdp: int, expert: int, tokens: int, seq_len: int,
                      buffer_factor: float | None = None) -> dict[str, float]:
    """Per-device XLA memory of a one-layer DeepSeek-V3 train step (full width, bf16 compute,
    remat full, AdamW), compiled ahead of time for mesh ``fsdp x expert`` of virtual devices;
    ``moe=False`` puts the dense MLP in the layer's place. Nothing is allocated."""
    from zoo.models.deepseek3 import DeepSeek3Config
    from zoo.train import TrainConfig, build
    from zoo.train.rehearse import rehearse_built
    cfg = DeepSeek3Config.deepseek_v3(num_hidden_layers=1, first_k_dense_replace=0 if moe else 1,
                                      remat_policy="full", moe_buffer_factor=buffer_factor,
                                      moe_overflow="drop",
                                      num_nextn_predict_layers=0)  # the layer alone
    batch = fsdp * expert * tokens // seq_len
    train = TrainConfig(mesh=f"fsdp={fsdp},expert={expert}", strategy="fsdp", batch_size=batch,
                        seq_len=seq_len, overrides=["dtype=bfloat16"])
    built = build(train, model_config=cfg, devices=jax.devices()[:fsdp * expert],
                  with_data=False, donate=True)
    r = rehearse_built(built, label="deepseek_v3 layer")
    model, _ = built.abstract_state()
    dispatch = next((m.dispatch for _, m in nnx.iter_modules(model)
                     if type(m).__name__ == "MoE"), "-")
    return dict(temp=r.temp_bytes / 2**30, args=r.argument_bytes / 2**30, dispatch=dispatch,
                compile_s=r.compile_s)


def temporaries_table(factors: list[float | None], tokens: int) -> None:
    dims = dict(fsdp=4, expert=16, tokens=tokens, seq_len=4096)
    print(f"\nOne full-width DeepSeek-V3 layer, train step, mesh fsdp=4 x expert=16 (64 virtual "
          f"devices), {tokens} tokens per device, bf16, remat full; XLA temporaries per device "
          f"(GiB)\n")
    print("| layer | dispatch | buffer_factor | temporaries | over the dense layer | compile s |")
    print("|---|---|---:|---:|---:|---:|")
    dense = layer_temporaries(False, **dims)
    print(f"| dense MLP | - | - | {dense['temp']:.2f} | - | {dense['compile_s']:.0f} |",
          flush=True)
    for f in factors:
        got = layer_temporaries(True, buffer_factor=f, **dims)
        print(f"| MoE | {got['dispatch']} | {'dropless' if f is None else f} | "
              f"{got['temp']:.2f} | {got['temp'] - dense['temp']:+.2f} | "
              f"{got['compile_s']:.0f} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default="8,16,64")
    ap.add_argument("--ep", default="1,2,4")
    ap.add_argument("--variants", default="blocked,a2a,a2a_f2,ragged,dense")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--embed", type=int, default=128)
    ap.add_argument("--mlp", type=int, default=256)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--devices", type=int, default=None,
                    help="virtual CPU devices (default 8 unless JAX_NUM_CPU_DEVICES or "
                         "XLA_FLAGS sets a count)")
    ap.add_argument("--bytes", action="store_true",
                    help="print only the collective-bytes table (full-size shapes, lowered, "
                         "not run; EP up to --devices)")
    ap.add_argument("--tokens-per-device", type=int, default=4096)
    ap.add_argument("--overflow", action="store_true",
                    help="print only overflow='exact' against 'drop' (and dropless) at "
                         "--factors on --routings, E = the last of --experts, EP = devices")
    ap.add_argument("--factors", default="1,1.25,2", help="buffer factors for --overflow")
    ap.add_argument("--routings", default=",".join(ROUTINGS), help="for --overflow")
    ap.add_argument("--temporaries", default=None, metavar="FACTORS",
                    help="print only the full-width DeepSeek-V3 layer temporaries for these "
                         "buffer factors, e.g. none,2,1 (needs --devices 64; ~2 min each)")
    args = ap.parse_args(argv)
    try:
        set_cpu_devices(args.devices)  # importing jax started no backend: still in time
    except ValueError as e:
        ap.error(str(e))
    if args.temporaries:
        return temporaries_table([None if f.lower() == "none" else float(f)
                                  for f in args.temporaries.split(",")], args.tokens_per_device)
    if args.bytes:
        return bytes_table(args.tokens_per_device)
    tokens = args.batch * args.length
    dims = dict(batch=args.batch, length=args.length, embed=args.embed, mlp=args.mlp, k=args.k)
    if args.overflow:
        return overflow_table(args, dims)
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
    import sys

    from _record import json_main  # --json PATH: the table as a record
    raise SystemExit(json_main(main, ["moe_bytes"] if "--bytes" in sys.argv else
                               ["moe_temporaries"] if "--temporaries" in sys.argv else
                               ["moe_overflow"] if "--overflow" in sys.argv else
                               ["moe_throughput"]))
