"""Context-parallel attention: per-device memory and per-shard work, from compilation only.

Memory: XLA's compiled memory analysis (temp + argument + output bytes of one device's share
of the SPMD program) of forward + backward (gradient of the sum of the outputs w.r.t. q, k, v)
for each sequence length, CP degree (``context`` mesh axis over the first cp devices) and
strategy, and its ratio to the same strategy unsharded (cp=1) -- the tiled kernel, so the ratio
measures sharding alone; the dense reference (O(L^2) logits) is shown for scale. Nothing is
executed.

Work: the fraction of (query tile, kv tile) pairs each shard computes under a causal mask --
the pairs the kernels' own skip test (`zoo.ops.block_may_attend`, per ring block and per tile)
keeps -- for contiguous and load-balanced (shard r holds chunks r and 2*cp-1-r) order, and the
busiest shard relative to the mean.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/context_parallel.py
"""

from __future__ import annotations

import argparse
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np

import zoo
from zoo.ops import attention, block_may_attend
from zoo.ops.flash import Q_TILE, tile_size


def balanced_order(length: int, cp: int) -> np.ndarray:
    chunks = np.arange(length).reshape(2 * cp, length // (2 * cp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]])
                           for r in range(cp)])


def per_device_bytes(length, cp, strategy, *, heads, kv_heads, head_dim, dtype):
    """temp + argument + output bytes per device of jit(grad(sum(attention)))."""
    partitioner = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")
    sharding = partitioner.sharding(("batch", "length", "act_heads", "act_head_dim"),
                                    "attention")
    tokens = partitioner.sharding(("batch", "length"), "attention")
    sds = jax.ShapeDtypeStruct
    q = sds((1, length, heads, head_dim), dtype, sharding=sharding)
    kv = sds((1, length, kv_heads, head_dim), dtype, sharding=sharding)
    pos = sds((1, length), jnp.int32, sharding=tokens)

    def loss(q, k, v, pos, seg):
        out = attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                        kv_segment_ids=seg, partitioner=partitioner, implementation=strategy)
        return jnp.sum(out.astype(jnp.float32))

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    mem = fn.lower(q, kv, kv, pos, pos).compile().memory_analysis()
    return mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes


def work_per_shard(length, cp, balanced, tile=Q_TILE):
    """Computed (q tile, kv tile) pairs per shard / all pairs per shard, causal, one document."""
    order = balanced_order(length, cp) if balanced else np.arange(length)
    local = length // cp
    t = tile_size(local, tile)
    pos = order.reshape(cp, local // t, t)  # [shard, tile, token]: positions of each tile
    seg = np.ones_like(pos)
    # every (shard r, ring step s -> kv shard (r - s) % cp, q tile i, kv tile j), batched
    r, j_shard, qi, kj = np.meshgrid(np.arange(cp), np.arange(cp), np.arange(local // t),
                                     np.arange(local // t), indexing="ij")
    qp, kp = pos[r, qi][:, :, :, :, None], pos[j_shard, kj][:, :, :, :, None]
    may = jax.vmap(lambda a, b, c, d: block_may_attend(a, b, c, d, causal=True,
                                                       sliding_window=None))
    flat = lambda x: jnp.asarray(x.reshape(-1, 1, t))
    # the kernels also test whole ring blocks first, but the tile test is implied by it: a
    # block the block test rejects has every tile pair rejected too (ranges of subsets)
    tile_ok = np.asarray(may(flat(qp), flat(kp), flat(seg[r, qi][..., None, :]),
                             flat(seg[j_shard, kj][..., None, :])))
    computed = tile_ok.reshape(r.shape).sum(axis=(1, 2, 3))  # per shard
    return computed / (cp * (local // t) ** 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
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

    print(f"\n## Work per shard: computed ({Q_TILE}x{Q_TILE} tile pairs) / all pairs, causal "
          f"mask, length {lengths[-1]}\n")
    print("| cp | order | per shard | busiest / mean |")
    print("|---|---|---|---|")
    for cp in cps:
        for balanced in (False, True):
            frac = work_per_shard(lengths[-1], cp, balanced)
            shown = " ".join(f"{f:.2f}" for f in frac)
            print(f"| {cp} | {'load-balanced' if balanced else 'contiguous'} | {shown} | "
                  f"{frac.max() / frac.mean():.3f} |", flush=True)
    print(f"\n({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
