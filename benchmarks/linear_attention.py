"""Gated DeltaNet under context parallelism: one layer's per-device memory, time and bytes on
the wire.

The layer is `zoo.layers.GatedDeltaNet` at Qwen3-Next-80B-A3B's linear-attention widths
(`zoo.models.qwen3_next.Qwen3NextConfig`: hidden 2048, 16 key heads and 32 value heads of 128,
convolution kernel 4, ``linear_max_pieces`` state slots), batch 1, one document per row laid
out as the data pipeline lays it out for the CP degree (`zoo.data.load_balance`), under the
``cp`` strategy on a ``context=cp`` mesh over the first cp devices (the parameters are
FSDP-sharded over that axis, as ``cp`` says).

The program is forward + backward: (parameters, x, positions, segment ids, dy) -> (parameter
gradients, dx), the output's cotangent an argument as in a real backward (see
`benchmarks/context_parallel.py`), the gradients sharded as their parameters.

* Memory: XLA's compiled memory analysis of that program, temp + argument + output bytes of one
  device's share, and its ratio to cp=1 at the same length. Nothing is executed for it.
* Time: the compiled program run on the virtual devices (median of ``--iters`` after one warm
  run), for lengths up to ``--time-up-to`` whose cp devices' memory fits in the host's free
  memory; other rows are compile-only and say so. Virtual devices share the host's cores, so
  a time is the whole job's, not one accelerator's.
* Bytes on the wire: per-device collective bytes counted from the compiled HLO (loop bodies
  times trip counts, `zoo.ops.hlo.collective_bytes`, results as it counts them): the layer's
  sequence mixing (its ``mix`` scope: the convolution's left context and the delta rule's keys
  and state summaries) apart from the parameters' FSDP gathers and gradient reductions. The
  mixing's bytes are set by ``cp * max_pieces`` summaries, not by L. Against it, all-gathering
  K/V over the context axis, by formula: every device receives k and v whole, ``L * (Hk*Dk +
  Hv*Dv) * itemsize`` bytes (the forward's gathered result, as `collective_bytes` counts an
  all-gather; the backward of such a scheme only adds to it).

    python benchmarks/linear_attention.py        # 8 virtual CPU devices unless
                                                 # JAX_NUM_CPU_DEVICES or XLA_FLAGS sets a count
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zoo
from zoo.data import load_balance
from zoo.layers.gated_deltanet import GatedDeltaNet
from zoo.models.qwen3_next import Qwen3NextConfig
from zoo.ops import hlo
from zoo.train.launch import set_cpu_devices

ACT = ("batch", "length", "act_embed")
TOKENS = ("batch", "length")
SCOPE = "attention"
MIX = "/mix/"  # the layer's sequence-mixing scope (`GatedDeltaNet.run`'s named scope)


def layer_dims(preset: str = "qwen3_next_80b_a3b") -> dict:
    """The layer's widths from a Qwen3-Next preset."""
    c = getattr(Qwen3NextConfig, preset)()
    return dict(hidden=c.hidden_size, num_key_heads=c.linear_num_key_heads,
                num_value_heads=c.linear_num_value_heads, key_head_dim=c.linear_key_head_dim,
                value_head_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
                max_pieces=c.linear_max_pieces)


def build(length: int, cp: int, dims: dict, dtype):
    """One layer's forward+backward compiled from abstract arguments (nothing allocated), and
    a function that makes concrete arguments for it."""
    p = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")
    dims = dict(dims)
    hidden = dims.pop("hidden")

    def make():
        return GatedDeltaNet(**dims, inputs_shape=(1, length, hidden), partitioner=p,
                             dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    act, tok = p.sharding(ACT, SCOPE), p.sharding(TOKENS, SCOPE)

    def forward_backward(params, x, positions, segment_ids, dy):
        def f(params, x):
            return nnx.merge(graphdef, params, rest)(x, positions=positions,
                                                     segment_ids=segment_ids)
        _, vjp = jax.vjp(f, params, x)
        return vjp(dy)

    sds = jax.ShapeDtypeStruct
    x = sds((1, length, hidden), dtype, sharding=act)
    pos = sds((1, length), jnp.int32, sharding=tok)
    abstract = jax.tree.map(lambda v: sds(v.shape, v.dtype, sharding=v.sharding), params)
    # gradients sharded as their parameters, as a train step's optimizer takes them
    out = (jax.tree.map(lambda v: v.sharding, abstract), act)
    compiled = jax.jit(forward_backward, out_shardings=out).lower(abstract, x, pos, pos,
                                                                  x).compile()

    def arguments():
        """Parameters as initialised, random x and dy, one document in the row layout."""
        _, params, _ = nnx.split(make(), nnx.Param, ...)
        rng = np.random.default_rng(0)
        x, dy = (jax.device_put(rng.normal(size=(1, length, hidden)).astype(dtype), act)
                 for _ in range(2))
        batch = load_balance({"positions": np.arange(length)[None],
                              "segment_ids": np.ones((1, length), np.int32)}, cp,
                             strategy="row")
        pos, seg = (jax.device_put(np.asarray(batch[k], np.int32), tok)
                    for k in ("positions", "segment_ids"))
        return params, x, pos, seg, dy
    return compiled, arguments


def per_device_bytes(compiled) -> int:
    """temp + argument + output bytes of one device's share of the program."""
    mem = compiled.memory_analysis()
    return mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes


def wire_bytes(compiled) -> tuple[int, int]:
    """(the sequence mixing's, everything else's) collective bytes per device."""
    text = compiled.as_text()
    total = sum(hlo.collective_bytes(text).values())
    mixing = sum(hlo.collective_bytes(text, scope=MIX).values())
    return mixing, total - mixing


def all_gather_kv_bytes(length: int, dims: dict, dtype) -> int:
    """Per-device bytes of all-gathering k [L, Hk, Dk] and v [L, Hv, Dv] (the gathered
    result, as `zoo.ops.hlo.collective_bytes` counts an all-gather)."""
    width = dims["num_key_heads"] * dims["key_head_dim"] + \
        dims["num_value_heads"] * dims["value_head_dim"]
    return length * width * jnp.dtype(dtype).itemsize


def free_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def timed(compiled, args, iters: int) -> float:
    jax.block_until_ready(compiled(*args))  # warm
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def mib(b: float) -> str:
    """MiB with one decimal (KiB below 1 MiB, so small runs still show a figure)."""
    return f"{b / 2**20:,.1f} MiB" if b >= 2**20 or b == 0 else f"{b / 2**10:,.1f} KiB"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--preset", default="qwen3_next_80b_a3b",
                    help="the Qwen3NextConfig preset whose linear-attention widths to use")
    ap.add_argument("--hidden", type=int, help="override the preset's hidden size")
    ap.add_argument("--heads", help="override the preset's key,value heads (e.g. 16,32)")
    ap.add_argument("--head-dim", type=int, help="override the preset's key = value head dim")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--time-up-to", type=int, default=0,
                    help="run (time) the program for lengths up to this; longer ones are "
                         "compiled only (0: time nothing)")
    ap.add_argument("--iters", type=int, default=2, help="timed runs after one warm run")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.cps = [int(x) for x in args.cps.split(",")]
    for cp in args.cps:
        bad = [n for n in args.lengths if n % (2 * cp)]
        if bad:
            ap.error(f"--lengths {bad}: not divisible by 2*cp = {2 * cp} (the load-balanced "
                     f"layout cuts a row into 2*cp chunks); pick multiples of {2 * cp}")
    return args


def main():
    args = parse_args()
    set_cpu_devices(None)  # importing jax started no backend: still in time
    if max(args.cps) > len(jax.devices()):
        raise SystemExit(f"--cps {max(args.cps)}: only {len(jax.devices())} devices; set "
                         f"JAX_NUM_CPU_DEVICES={max(args.cps)}")
    dims = layer_dims(args.preset)
    if args.hidden:
        dims["hidden"] = args.hidden
    if args.heads:
        dims["num_key_heads"], dims["num_value_heads"] = (int(h) for h in args.heads.split(","))
    if args.head_dim:
        dims["key_head_dim"] = dims["value_head_dim"] = args.head_dim
    dtype = jnp.dtype(args.dtype)
    start = time.time()
    print(f"## Gated DeltaNet layer under context parallelism: forward+backward per device "
          f"(batch 1, hidden {dims['hidden']}, {dims['num_key_heads']} key / "
          f"{dims['num_value_heads']} value heads of {dims['key_head_dim']}/"
          f"{dims['value_head_dim']}, conv {dims['conv_kernel']}, max_pieces "
          f"{dims['max_pieces']}, {dtype.name}; row layout)\n")
    print(f"| length | cp | memory per device | vs cp={args.cps[0]} | time fwd+bwd | mixing on "
          f"the wire | all-gather K/V | vs all-gather K/V | FSDP weights on the wire |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    for length in args.lengths:
        base = None
        for cp in args.cps:
            want_time = length <= args.time_up_to
            compiled, arguments = build(length, cp, dims, dtype)
            mem = per_device_bytes(compiled)
            base = mem if base is None else base
            mixing, weights = wire_bytes(compiled)
            kv = all_gather_kv_bytes(length, dims, dtype)
            if not want_time:
                shown = "compile only"
            elif mem * cp > 0.7 * free_host_bytes():
                shown = f"compile only ({mib(mem * cp)} > 70% of free host memory)"
            else:
                shown = f"{timed(compiled, arguments(), args.iters):.2f} s"
            vs_kv = "-" if cp == 1 else f"{mixing / kv:.4f}"
            print(f"| {length} | {cp} | {mib(mem)} | {mem / base:.3f}x | {shown} | "
                  f"{mib(mixing)} | {mib(kv) if cp > 1 else '-'} | {vs_kv} | {mib(weights)} |",
                  flush=True)
            results[length, cp] = dict(mem=mem, ratio=mem / base, mixing=mixing)
    cp = max(args.cps)
    if cp > args.cps[0]:
        print(f"\nGoal: memory per device at cp={cp} <= 0.15x cp={args.cps[0]}: "
              + ", ".join(f"{n}: {results[n, cp]['ratio']:.3f}x "
                          f"({'holds' if results[n, cp]['ratio'] <= 0.15 else 'misses'})"
                          for n in args.lengths))
    for c in (c for c in args.cps if c > 1):
        flat = {results[n, c]["mixing"] for n in args.lengths}
        print(f"Goal: mixing bytes flat in L at cp={c}: "
              + ("holds" if len(flat) == 1 else "misses") + " ("
              + ", ".join(mib(results[n, c]["mixing"]) for n in args.lengths) + ")")
    print(f"\n({time.time() - start:.0f} s)")


if __name__ == "__main__":
    from _record import json_main  # --json PATH: the table as a record
    raise SystemExit(json_main(main, ["linear_attention"]))
