"""Context-parallel attention: per-device memory and per-shard work, from compilation only.

Memory: XLA's compiled memory analysis (temp + argument + output bytes of one device's share of
the SPMD program) of forward + backward -- (q, k, v, positions, segment ids, dout) -> (dq, dk,
dv), the output's cotangent an argument as in a real backward (the gradient of a sum would make
it a constant, which XLA folds away unsharded but materialises under the ring, billing the
sharded program alone for it) -- for each sequence length, CP degree (``context`` mesh axis over
the first cp devices) and strategy, and its ratio to the same strategy unsharded (cp=1) -- the
tiled kernel, so the ratio measures sharding alone; the dense reference (O(L^2) logits) is shown
for scale. Nothing is executed.

Work: the fraction of (query, key) pairs each shard computes under a causal mask (ideal:
(L+1)/(2L) on average) -- the sub-blocks (``split`` x ``split`` per ring block) the strategies'
classification (`zoo.ops.masks.block_kind`) does not skip, and within a partially masked one
the tiles the flash kernel walks (its tile budget when the visible tiles fit, CPU tiles) -- for
contiguous and load-balanced (shard r holds chunks r and 2*cp-1-r) order, and the busiest shard
relative to the mean.

MLA bytes: per-device bytes that collectives move in forward+backward of MLA attention
(`zoo.ops.mla_attention`, latent + rotary key on the wire) against the same attention fed the
expanded per-head K/V, counted from the compiled HLO (loop bodies times trip counts,
`zoo.ops.hlo.collective_bytes`; all-reduce excluded: it is kv_up's weight gradient, the same in
both), at DeepSeek-V3's attention dims by default.

Ring hops: per-device collective-permute bytes of ring forward+backward under a causal mask
(the full ring: every hop) against a sliding window with the sequence layout stated
(``layout=``, the static hop plan `zoo.ops.ring.hop_plan`: only the shards some query can
see). The window's program holds both rings behind its per-batch check; the bytes counted are
those of the branch that runs when the check passes (the plan), from the compiled HLO.

    python benchmarks/context_parallel.py      # 8 virtual CPU devices unless JAX_NUM_CPU_DEVICES
                                               # or XLA_FLAGS sets a count
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import zoo
from zoo.ops import attention, hlo, mla_attention
from zoo.ops.flash import FlashKernel
from zoo.ops.kernels import Scores
from zoo.ops.masks import FULL, PARTIAL, Causal, Document, SlidingWindow, block_kind, bounds
from zoo.ops.ring import hop_plan
from zoo.train.launch import set_cpu_devices


def balanced_order(length: int, cp: int) -> np.ndarray:
    chunks = np.arange(length).reshape(2 * cp, length // (2 * cp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]])
                           for r in range(cp)])


def per_device_bytes(length, cp, strategy, *, heads, kv_heads, head_dim, dtype):
    """temp + argument + output bytes per device of attention's forward + backward."""
    partitioner = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")
    sharding = partitioner.sharding(("batch", "length", "act_heads", "act_head_dim"),
                                    "attention")
    tokens = partitioner.sharding(("batch", "length"), "attention")
    sds = jax.ShapeDtypeStruct
    q = sds((1, length, heads, head_dim), dtype, sharding=sharding)
    kv = sds((1, length, kv_heads, head_dim), dtype, sharding=sharding)
    pos = sds((1, length), jnp.int32, sharding=tokens)

    def forward_backward(q, k, v, pos, seg, dout):
        _, vjp = jax.vjp(lambda q, k, v: attention(
            q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
            partitioner=partitioner, implementation=strategy), q, k, v)
        return vjp(dout)

    mem = jax.jit(forward_backward).lower(q, kv, kv, pos, pos, q).compile().memory_analysis()
    return mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes


def work_per_shard(length, cp, balanced, split=2, kernel=FlashKernel()):
    """(query, key) pairs the flash kernel computes per shard / all pairs per shard, causal,
    one document: sub-blocks the strategies' classification (`zoo.ops.masks.block_kind`) does
    not skip, every tile of a full one, and of a partial one the tiles of the plan the kernel
    picks (`FlashKernel.pick_plan`: its tile budget when the visible tiles fit)."""
    order = balanced_order(length, cp) if balanced else np.arange(length)
    n = length // cp // split  # sub-block length
    pos = jnp.asarray(order.reshape(cp * split, 1, n))  # [sub-block of any shard, batch 1, n]
    seg = jnp.ones_like(pos)
    mask = Causal() & Document()
    scores = Scores(mask, 1.0)
    plans = kernel.partial_plans(n, n)
    tq, tk = kernel.tiles(n, n)
    walked = jnp.asarray([n * n if p.budget is None else p.budget * tq * tk for p in plans])

    def pairs(qp, qs, kp, ks):
        kind = block_kind(mask, bounds(qp, qs), bounds(kp, ks))
        plan = kernel.pick_plan(plans, scores, qp, kp, qs, ks)
        return jnp.where(kind == FULL, n * n, jnp.where(kind == PARTIAL, walked[plan], 0))

    # [q sub-block, kv sub-block] over all sub-blocks of all shards
    grid = jax.jit(jax.vmap(jax.vmap(pairs, (None, None, 0, 0)), (0, 0, None, None)))
    done = np.asarray(grid(pos, seg, pos, seg))
    per_shard = done.reshape(cp, split, cp * split).sum(axis=(1, 2))
    return per_shard / (length * length / cp)


def mla_bytes(length, cp, strategy, *, heads, kv_lora_rank, nope, rope, v_dim, dtype):
    """(latent on the wire, expanded K/V on the wire) collective bytes per device, fwd+bwd."""
    p = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")
    sds = jax.ShapeDtypeStruct
    act = p.sharding(("batch", "length", "act_heads", "act_head_dim"), "attention")
    lat = p.sharding(("batch", "length", None), "attention")
    pos = sds((1, length), jnp.int32, sharding=p.sharding(("batch", "length"), "attention"))
    args = (sds((1, length, heads, nope + rope), dtype, sharding=act),
            sds((1, length, kv_lora_rank), dtype, sharding=lat),
            sds((1, length, rope), dtype, sharding=lat),
            sds((kv_lora_rank, heads, nope + v_dim), dtype), pos)
    kw = dict(partitioner=p, implementation=strategy)
    out = []
    for on_wire in (True, False):
        def f(q, latent, k_pe, kv_up, pos, on_wire=on_wire):
            if on_wire:
                o = mla_attention(q, latent, k_pe, kv_up, qk_nope_head_dim=nope,
                                  q_positions=pos, kv_positions=pos, **kw)
            else:
                kv = jnp.einsum("bsr,rnd->bsnd", latent, kv_up)
                k_pe = jnp.broadcast_to(k_pe[:, :, None], (*kv.shape[:3], rope))
                o = attention(q, jnp.concatenate([kv[..., :nope], k_pe], -1), kv[..., nope:],
                              q_positions=pos, kv_positions=pos, **kw)
            return jnp.sum(o.astype(jnp.float32))

        text = jax.jit(jax.grad(f, (0, 1, 2, 3))).lower(*args).compile().as_text()
        moved = hlo.collective_bytes(text, floats_only=True)
        # not all-reduce: kv_up's gradient summed over the shards, the same in both programs
        out.append(sum(b for kind, b in moved.items() if kind != "all-reduce"))
    return tuple(out)


def ring_permute_bytes(length, cp, mask, layout, *, heads, kv_heads, head_dim, dtype):
    """Collective-permute bytes per device of ring forward+backward, as executed when the
    hop plan's check passes (a fallback conditional's full-ring branch is not counted)."""
    p = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")
    act = p.sharding(("batch", "length", "act_heads", "act_head_dim"), "attention")
    sds = jax.ShapeDtypeStruct
    pos = sds((1, length), jnp.int32, sharding=p.sharding(("batch", "length"), "attention"))
    q = sds((1, length, heads, head_dim), dtype, sharding=act)
    kv = sds((1, length, kv_heads, head_dim), dtype, sharding=act)

    def loss(q, k, v, pos, seg):
        out = attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                        kv_segment_ids=seg, mask=mask, partitioner=p, implementation="ring",
                        layout=layout)
        return jnp.sum(out.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, pos, pos).compile()
    text = text.as_text()
    permuted = lambda comp=None: hlo.collective_bytes(text, root=comp).get(
        "collective-permute", 0)
    fallbacks = [b for b in hlo.branches(text) if all(map(permuted, b))]
    return permuted() - sum(permuted(full) for full, _ in fallbacks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mla-lengths", default="4096",
                    help="lengths of the MLA bytes table (cp = the largest --cps)")
    ap.add_argument("--mla", default="128,512,128,64,128",
                    help="heads,kv_lora_rank,qk_nope,qk_rope,v_head_dim (DeepSeek-V3)")
    ap.add_argument("--windows", default="1024,4096",
                    help="sliding windows of the ring hops table (length = the largest "
                         "--lengths, cp = the largest --cps; empty: no table)")
    args = ap.parse_args()
    set_cpu_devices(None)  # importing jax started no backend: still in time
    lengths = [int(x) for x in args.lengths.split(",")]
    cps = [int(x) for x in args.cps.split(",")]
    dtype = jnp.dtype(args.dtype)
    start = time.time()

    print(f"## Per-device memory of forward+backward (batch 1, {args.heads} heads, "
          f"{args.kv_heads} kv heads, head dim {args.head_dim}, {dtype.name}; "
          f"ratio to the same strategy at cp=1)\n")
    print("| length | strategy | " + " | ".join(f"cp={c}" for c in cps) + " |")
    print("|---|---|" + "---|" * len(cps))
    for length in lengths:
        for strategy in ("ring", "all_gather"):
            cells, base = [], None
            for cp in cps:
                b = per_device_bytes(length, cp, strategy, heads=args.heads,
                                     kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype)
                base = b if base is None else base
                cells.append(f"{b / 2**20:.1f} MiB ({b / base:.3f}x)")
            print(f"| {length} | {strategy} | " + " | ".join(cells) + " |", flush=True)
        dense = per_device_bytes(length, 1, "reference", heads=args.heads,
                                 kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype)
        print(f"| {length} | dense reference | {dense / 2**20:.1f} MiB ({dense / base:.1f}x) | "
              + " | ".join("-" for _ in cps[1:]) + " |", flush=True)

    print(f"\n## Work per shard: computed (query, key) pairs / all pairs, causal mask, length "
          f"{lengths[-1]}, 2x2 sub-blocks per ring block, flash kernel tiles "
          f"{FlashKernel().tiles(lengths[-1], lengths[-1])}\n")
    print("| cp | order | per shard | busiest / mean |")
    print("|---|---|---|---|")
    for cp in cps:
        for balanced in (False, True):
            frac = work_per_shard(lengths[-1], cp, balanced)
            shown = " ".join(f"{f:.3f}" for f in frac)
            print(f"| {cp} | {'load-balanced' if balanced else 'contiguous'} | {shown} | "
                  f"{frac.max() / frac.mean():.3f} |", flush=True)
    cp = cps[-1]
    heads, rank, nope, rope, v_dim = (int(x) for x in args.mla.split(","))
    print(f"\n## MLA: collective bytes per device, forward+backward, cp={cp} ({heads} heads, "
          f"kv_lora_rank {rank}, qk dims {nope}+{rope}, v {v_dim}, {dtype.name}; batch 1)\n")
    print("| length | strategy | latent on the wire | expanded K/V on the wire | ratio |")
    print("|---|---|---|---|---|")
    for length in (int(x) for x in args.mla_lengths.split(",") if x):
        for strategy in ("ring", "all_gather"):
            lat, exp = mla_bytes(length, cp, strategy, heads=heads, kv_lora_rank=rank,
                                 nope=nope, rope=rope, v_dim=v_dim, dtype=dtype)
            print(f"| {length} | {strategy} | {lat / 2**20:.1f} MiB | {exp / 2**20:.1f} MiB | "
                  f"{lat / exp:.4f} |", flush=True)
    windows = [int(x) for x in args.windows.split(",") if x]
    length = lengths[-1]
    if windows and cp > 1:
        dims = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                    dtype=dtype)
        print(f"\n## Ring hops: collective-permute bytes per device, forward+backward, "
              f"length {length}, cp={cp} ({args.heads} heads, {args.kv_heads} kv heads, head "
              f"dim {args.head_dim}, {dtype.name}; batch 1)\n")
        print("| mask | layout | blocks moved per pass | bytes | / causal |")
        print("|---|---|---|---|---|")
        causal = Causal() & Document()
        full = ring_permute_bytes(length, cp, causal, None, **dims)
        print(f"| causal | any | {cp} (the full ring) | {full / 2**20:.1f} MiB | 1.000 |")
        for w in windows:
            mask = Causal() & SlidingWindow(w) & Document()
            for layout in ("contiguous", "balanced"):
                hops = hop_plan(mask.reach(), layout, cp, length)
                b = ring_permute_bytes(length, cp, mask, layout, **dims)
                moved = f"{cp} (the full ring)" if hops is None else f"{len(hops)}: offsets {hops}"
                print(f"| window {w} | {layout} | {moved} | {b / 2**20:.1f} MiB | "
                      f"{b / full:.3f} |", flush=True)
    print(f"\n({time.time() - start:.0f} s)")


if __name__ == "__main__":
    from _record import json_main  # --json PATH: the tables as records
    raise SystemExit(json_main(main, ["cp_memory", "cp_work", "cp_mla_bytes", "cp_ring_hops"]))
