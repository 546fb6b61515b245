"""DeepSeek sparse attention (DSA top-k) against dense MLA: compiled FLOPs, memory, wire bytes.

Three forward programs per sequence length and CP degree (``context`` mesh axis over the first
cp devices; batch 1, one document, causal), at DeepSeek-V3.2's attention widths by default
(`zoo.models.deepseek_v32.DeepSeekV32Config.deepseek_v3_2`: 128 heads, kv_lora_rank 512, rope
64, no-position 128, v 128; indexer 64 heads x 128, q_lora_rank 1536, embed 7168; top-2048):

* ``sparse``: `zoo.ops.sparse_mla_attention` -- absorbed MLA over each query's k selected keys
  (the indices an argument), its ``implementation="auto"`` and ``query_chunk="auto"``; under
  CP it all-gathers the latent and rotary key.
* ``dense``: dense causal MLA in the same (absorbed) form -- the query's no-position part taken
  into latent space by ``kv_up``'s key half, `zoo.ops.attention` (flash kernel, its ``"auto"``
  strategy) of all heads over one shared key head ``[latent; k_pe]`` (R + Hr wide) with the
  latent as values, ``kv_up``'s value half after -- so the two differ only in which keys each
  query sees.
* ``indexer``: `zoo.layers.Indexer.select` -- the lightning indexer's projections, its scores
  over every key of the row and the top-k (under CP the index keys are all-gathered): the
  selection's cost, counted separately and stated beside.

Columns, per device of the SPMD program:

* FLOPs (compiled): the dots and convolutions of the compiled HLO with every loop body times
  its trip count (`zoo.ops.hlo.hlo_stats`). A conditional counts its costliest branch: the
  dense program's CP strategy skips empty causal sub-blocks at run time, so its compiled count
  holds every sub-block (about twice the causal work). XLA's own ``cost_analysis()`` is printed
  beside: it counts a loop body once, so it misses most of the attention (the flash kernel's
  tile loop, the sparse op's query chunks).
* FLOPs (formula): ``2 N (R + Hr + R)`` per visible (query, key) pair plus the absorption
  ``2 N Hn R + 2 N R Hv`` per query -- pairs ``L k`` for sparse (every slot of the top-k, empty
  ones included; ``L L`` where the op picks its dense implementation, k >= L/2:
  `zoo.ops.sparse_attention.choose_sparse_implementation`), ``L (L + 1) / 2`` for dense
  causal; for the indexer its projections plus ``2 Ni Hi + 2 Ni`` per pair of the full L x L
  score matrix it computes.
* ``FLOPs / dense causal``: the compiled FLOPs over the dense causal formula (the least any
  dense causal implementation computes): the issue-47 goal is sparse <= 1/8 at 128k, k=2,048.
* Memory: ``memory_analysis()``'s temp + argument + output bytes of one device's program.
* Wire: bytes of the collectives' results per device (`zoo.ops.hlo.collective_bytes`, loop
  bodies times trips; positions and segment ids included; the indexer's also its parameters'
  all-gather, which the cp partitioner shards over the context axis).
* CPU ms: wall time of the forward on this machine's virtual CPU devices (median of
  ``--iters``) for lengths up to ``--time-up-to``, with the MLA heads cut to ``--time-heads``
  (stated in the header) and only where the program's memory on all devices fits in
  ``--time-max-gib``; "compile only" elsewhere.

    python benchmarks/sparse_attention.py      # 8 virtual CPU devices unless JAX_NUM_CPU_DEVICES
                                               # or XLA_FLAGS sets a count

``--fetch`` prints instead how the selected latents reach each context shard
(`zoo.ops.sparse_attention.fetch_plan` and ``fetch_bytes``): for a row of packed documents laid
out by each `zoo.data.load_balance` layout, the distances ``fetch="hops"`` visits and the bytes
per device of one forward call (the latent, ``k_pe``, positions and segment ids; the backward
sends the latent's gradient back the same way) under hops and under the all-gather, and what
``fetch="auto"`` takes. Two selections stand in for the indexer's: ``recent`` (each query's k
most recent keys of its document) and ``spread`` (k keys evenly over its document's causal
prefix, the whole prefix when it is shorter than k).

    python benchmarks/sparse_attention.py --fetch
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
from zoo.ops import attention, hlo, sparse_mla_attention
from zoo.ops.sparse_attention import choose_sparse_implementation
from zoo.train.launch import set_cpu_devices


@dataclasses.dataclass(frozen=True)
class Dims:
    """MLA and indexer widths."""

    heads: int
    kv_lora_rank: int
    nope: int
    rope: int
    v_head_dim: int
    index_heads: int
    index_head_dim: int
    q_lora_rank: int
    embed: int
    topk: int

    @classmethod
    def deepseek_v3_2(cls) -> Dims:
        """The published DeepSeek-V3.2's (`DeepSeekV32Config.deepseek_v3_2`)."""
        from zoo.models.deepseek_v32 import DeepSeekV32Config
        c = DeepSeekV32Config.deepseek_v3_2()
        return cls(heads=c.num_attention_heads, kv_lora_rank=c.kv_lora_rank,
                   nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                   index_heads=c.index_n_heads, index_head_dim=c.index_head_dim,
                   q_lora_rank=c.q_lora_rank, embed=c.hidden_size, topk=c.index_topk)


@dataclasses.dataclass(frozen=True)
class Program:
    fn: object
    args: tuple            # ShapeDtypeStructs with their shardings
    make: object           # () -> concrete arguments (for timing)
    formula: float         # FLOPs of the whole program (all devices)


def _partitioner(cp: int) -> zoo.Partitioner:
    return zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")


def _concrete(args, seed=0):
    """Random normal floats (scaled down), arange positions, recent-key indices, as placed by
    each argument's sharding."""
    rng = np.random.default_rng(seed)
    out = []
    for a in args:
        if jnp.issubdtype(a.dtype, jnp.floating):
            x = (rng.standard_normal(a.shape, np.float32) * 0.1).astype(a.dtype)
        elif a.ndim == 2:  # positions [B, L]
            x = np.broadcast_to(np.arange(a.shape[1], dtype=np.int32), a.shape)
        else:  # indices [B, L, k]: the k most recent causal keys (-1 before the row starts)
            L, k = a.shape[1:]
            x = np.arange(L, dtype=np.int32)[:, None] - np.arange(k, dtype=np.int32)[None]
            x = np.broadcast_to(np.where(x >= 0, x, -1), a.shape)
        out.append(jax.device_put(x, a.sharding))
    return out


def attention_programs(length: int, cp: int, d: Dims, dtype) -> dict[str, Program]:
    """The sparse and the dense (absorbed) MLA forward programs."""
    p = _partitioner(cp)
    sds = jax.ShapeDtypeStruct
    act = p.sharding(("batch", "length", "act_heads", "act_head_dim"), "attention")
    row = p.sharding(("batch", "length", None), "attention")
    pos = sds((1, length), jnp.int32, sharding=p.sharding(("batch", "length"), "attention"))
    N, R, Hn, Hr, Hv = d.heads, d.kv_lora_rank, d.nope, d.rope, d.v_head_dim
    q = sds((1, length, N, Hn + Hr), dtype, sharding=act)
    latent, k_pe = sds((1, length, R), dtype, sharding=row), sds((1, length, Hr), dtype,
                                                                    sharding=row)
    kv_up = sds((R, N, Hn + Hv), dtype, sharding=NamedSharding(p.mesh, P()))
    k = min(d.topk, length)  # as `Indexer.select` gives them
    indices = sds((1, length, k), jnp.int32, sharding=row)
    # the sparse op's own choice: gather k keys a query, or dense scores over the whole row
    visited = k if choose_sparse_implementation(k, length) == "gather" else length
    absorb = 2 * length * N * (Hn * R + R * Hv)
    pair = 2 * N * (R + Hr + R)

    def sparse(q, latent, k_pe, kv_up, indices, pos):
        return sparse_mla_attention(q, latent, k_pe, kv_up, indices, qk_nope_head_dim=Hn,
                                    positions=pos, partitioner=p)

    def dense(q, latent, k_pe, kv_up, pos):
        q_lat = jnp.einsum("blnh,rnh->blnr", q[..., :Hn], kv_up[..., :Hn])
        q_abs = jnp.concatenate([q_lat, q[..., Hn:]], axis=-1)  # [B, L, N, R + Hr]
        keys = jnp.concatenate([latent, k_pe], axis=-1)[:, :, None]  # one shared head
        o = attention(q_abs, keys, latent[:, :, None], q_positions=pos, kv_positions=pos,
                      scale=(Hn + Hr) ** -0.5, partitioner=p)  # [B, L, N, R]
        return jnp.einsum("blnr,rnv->blnv", o, kv_up[..., Hn:])

    sparse_args = (q, latent, k_pe, kv_up, indices, pos)
    dense_args = (q, latent, k_pe, kv_up, pos)
    return {
        "sparse": Program(sparse, sparse_args, lambda: _concrete(sparse_args),
                          pair * length * visited + absorb),
        "dense": Program(dense, dense_args, lambda: _concrete(dense_args),
                         pair * length * (length + 1) / 2 + absorb)}


def indexer_program(length: int, cp: int, d: Dims, dtype) -> Program:
    """`Indexer.select` on hidden states and the query latent."""
    from flax import nnx

    from zoo.layers.indexer import Indexer
    p = _partitioner(cp)
    sds = jax.ShapeDtypeStruct
    row = p.sharding(("batch", "length", None), "attention")
    pos = sds((1, length), jnp.int32, sharding=p.sharding(("batch", "length"), "attention"))
    x = sds((1, length, d.embed), dtype, sharding=row)
    q_latent = sds((1, length, d.q_lora_rank), dtype, sharding=row)

    def build(rngs):
        return Indexer(num_heads=d.index_heads, head_dim=d.index_head_dim,
                       rope_head_dim=d.rope, q_lora_rank=d.q_lora_rank,
                       inputs_shape=(1, length, d.embed), partitioner=p, dtype=dtype,
                       rngs=rngs)

    graph, state = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))

    def select(state, x, q_latent, pos):
        return nnx.merge(graph, state).select(x, q_latent, d.topk, positions=pos)

    def make():
        return [nnx.split(build(nnx.Rngs(0)))[1], *_concrete((x, q_latent, pos))]

    Ni, Hi = d.index_heads, d.index_head_dim
    projections = 2 * length * (d.q_lora_rank * Ni * Hi + d.embed * Hi + d.embed * Ni)
    return Program(select, (state, x, q_latent, pos), make,
                   projections + 2 * length * length * (Ni * Hi + Ni))


def measure(prog: Program) -> dict:
    """Compile and read the compiled program (per device)."""
    compiled = jax.jit(prog.fn).lower(*prog.args).compile()
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    return dict(compiled=compiled, flops=hlo.hlo_stats(text).flops,
                xla_flops=float((cost or {}).get("flops", 0.0)),
                memory=mem.temp_size_in_bytes + mem.argument_size_in_bytes
                + mem.output_size_in_bytes,
                wire=sum(hlo.collective_bytes(text).values()))


def cpu_ms(prog: Program, compiled, iters: int) -> float:
    args = prog.make()
    jax.block_until_ready(compiled(*args))  # warm
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def packed_documents(length: int, mean: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Positions and segment ids [1, length] of documents with lognormal lengths (median
    ``mean``), packed until the row is full (the last one cut)."""
    rng = np.random.default_rng(seed)
    pos, seg = np.zeros(length, np.int32), np.zeros(length, np.int32)
    at, doc = 0, 1
    while at < length:
        n = min(max(int(rng.lognormal(np.log(mean), 1.0)), 16), length - at)
        pos[at:at + n], seg[at:at + n] = np.arange(n), doc
        at, doc = at + n, doc + 1
    return pos[None], seg[None]


def selection(positions: np.ndarray, k: int, kind: str, chunk: int = 4096) -> np.ndarray:
    """Indices [L, k] int32 into the natural row: ``recent`` or ``spread`` (module docstring),
    built ``chunk`` queries at a time."""
    L = positions.shape[-1]
    out = np.empty((L, k), np.int32)
    j = np.arange(k, dtype=np.int64)[None]
    for at in range(0, L, chunk):
        p = positions[0, at:at + chunk].astype(np.int64)[:, None]  # the queries' positions
        i = np.arange(at, min(at + chunk, L), dtype=np.int64)[:, None]  # document at i - p
        if kind == "recent":
            idx = np.where(j <= p, i - j, -1)
        else:
            idx = np.where(p + 1 <= k, np.where(j <= p, i - p + j, -1),
                           i - p + j * p // max(k - 1, 1))
        out[at:at + chunk] = idx
    return out


def fetch_table(lengths, cps, d: Dims, dtype, mean: int):
    from zoo.data import load_balance
    from zoo.ops.sparse_attention import choose_fetch, fetch_bytes, fetch_plan
    per_token = (d.kv_lora_rank + d.rope) * dtype.itemsize + 8
    print(f"## Fetching the selected latents under context parallelism: hops against the "
          f"all-gather, bytes per device of one forward call (top-{d.topk}; latent "
          f"{d.kv_lora_rank} + rope {d.rope} in {dtype.name}, positions and segment ids: "
          f"{per_token} bytes a token; documents of median {mean} tokens)\n")
    print("| length | cp | layout | selection | distances needed (of cp-1) | hops MiB | "
          "all-gather MiB | hops / all-gather | auto takes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in lengths:
        pos, seg = packed_documents(length, mean)
        for kind in ("recent", "spread"):
            natural = selection(pos, min(d.topk, length), kind)  # query i's keys, natural row
            for cp in cps:
                for layout in ("row", "document", "auto", "none"):
                    order = np.asarray(load_balance(
                        {"o": np.arange(length, dtype=np.int32)[None], "positions": pos,
                         "segment_ids": seg}, cp, strategy=layout)["o"])[0]  # new -> old
                    inv = np.argsort(order).astype(np.int32)  # old -> new
                    # place m of the new row holds query order[m]; its keys, renamed
                    idx = natural[order]
                    idx = np.where(idx >= 0, inv[np.maximum(idx, 0)], -1)[None]
                    dist = np.asarray(fetch_plan(idx, cp)[1])
                    del idx
                    wire = fetch_bytes(dist, length // cp, per_token)
                    hops = int(dist[1:].sum())
                    take = "hops" if choose_fetch(hops, cp) else "all_gather"
                    print(f"| {length} | {cp} | {layout} | {kind} | {hops} | "
                          f"{_num(wire['hops'] / 2**20)} | {_num(wire['all_gather'] / 2**20)} "
                          f"| {wire['hops'] / wire['all_gather']:.3f} | {take} |", flush=True)


def v4_select_table(lengths: list[int], iters: int) -> int:
    """DeepSeek-V4's CSA selection (`CompressedIndexer.select_entries`) at V4-Flash's indexer
    widths on one device, one document: one query a step over all entries at once (the
    program before `select_entries` went through `Indexer.select_keys`) against its
    ``"auto"`` chunks and entry blocks."""
    from zoo.layers.compressor import CompressedIndexer
    from zoo.layers.indexer import KEY_BLOCK, SELECT_VALUES, SORT_VALUES
    from zoo.models.deepseek_v4 import DeepSeekV4Config
    from zoo.ops.sparse_attention import choose_query_chunk
    c = DeepSeekV4Config.deepseek_v4_flash()
    N, H, k, rate = c.index_n_heads, c.index_head_dim, c.index_topk, c.compress_rate_csa
    print(f"## DeepSeek-V4 CSA selection, one device ({N} index heads x {H}, top-{k}, "
          f"entries every {rate} tokens; bfloat16 queries)\n")
    print("| length | entries | program | queries a step | steps | temp MiB | CPU ms | "
          "CPU ms / one query a step |")
    print("|---|---|---|---|---|---|---|---|")
    for L in lengths:
        E = L // rate
        ix = CompressedIndexer(num_heads=N, head_dim=H, rope_head_dim=c.qk_rope_head_dim,
                               q_lora_rank=8, rate=rate, inputs_shape=(1, L, 8),
                               partitioner=None, rngs=nnx.Rngs(0))
        rng = np.random.default_rng(0)
        pos, seg = jnp.arange(L)[None], jnp.ones((1, L), jnp.int32)
        args = (jnp.asarray(rng.standard_normal((1, L, N, H)), jnp.bfloat16),
                jnp.asarray(rng.random((1, L, N)), jnp.float32),
                jnp.asarray(rng.standard_normal((1, E, H)), jnp.bfloat16),
                jnp.arange(E, dtype=jnp.int32)[None] * rate, jnp.ones((1, E), jnp.int32))
        auto = choose_query_chunk(L, N * min(KEY_BLOCK, E) + SORT_VALUES * E, SELECT_VALUES)
        base = None
        for name, chunk, block in (("one query a step", 1, E), ("auto", "auto", "auto")):
            fn = jax.jit(functools.partial(ix.select_entries, k=k, positions=pos,
                                           segment_ids=seg, query_chunk=chunk,
                                           key_block=block))
            compiled = fn.lower(*args).compile()
            ms = cpu_ms(Program(fn=None, args=None, make=lambda a=args: a, formula=0.0),
                        compiled, iters)
            base = base or ms
            q = 1 if chunk == 1 else auto
            print(f"| {L} | {E} | {name} | {q} | {L // q} | "
                  f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:.0f} | {ms:.0f} | "
                  f"{ms / base:.3f} |", flush=True)
    return 0


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.4g}"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--cps", default="1,4,8")
    published = Dims.deepseek_v3_2()
    for f in dataclasses.fields(Dims):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=int,
                        default=getattr(published, f.name))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--time-up-to", type=int, default=8192,
                    help="time the forward at lengths up to this (0: compile only)")
    ap.add_argument("--time-heads", type=int, default=2,
                    help="MLA heads of the timed programs (the indexer keeps its own)")
    ap.add_argument("--time-max-gib", type=float, default=8.0,
                    help="time a program only if its memory on all devices fits in this")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--fetch", action="store_true",
                    help="print only the fetch table: hops against the all-gather (docstring)")
    ap.add_argument("--fetch-lengths", default="32768,131072")
    ap.add_argument("--document-tokens", type=int, default=2048,
                    help="median document length of the --fetch rows")
    ap.add_argument("--v4-select", action="store_true",
                    help="print only DeepSeek-V4's CSA selection table (v4_select_table) at "
                         "--v4-select-lengths")
    ap.add_argument("--v4-select-lengths", default="8192,16384")
    args = ap.parse_args()
    if args.v4_select:
        return v4_select_table(_ints(args.v4_select_lengths), args.iters)
    set_cpu_devices(None)  # importing jax started no backend: still in time
    d = Dims(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Dims)})
    lengths, cps = _ints(args.lengths), _ints(args.cps)
    if args.fetch:
        return fetch_table(_ints(args.fetch_lengths), [c for c in cps if c > 1], d,
                           jnp.dtype(args.dtype), args.document_tokens)
    if max(cps) > len(jax.devices()):
        raise SystemExit(f"--cps {args.cps}: {max(cps)} devices needed, {len(jax.devices())} "
                         f"here; set JAX_NUM_CPU_DEVICES={max(cps)} or lower --cps")
    dtype = jnp.dtype(args.dtype)
    timed = dataclasses.replace(d, heads=args.time_heads)
    start = time.time()

    print(f"## Sparse (DSA top-{d.topk}) against dense causal MLA, forward, per device "
          f"({d.heads} heads, kv_lora_rank {d.kv_lora_rank}, rope {d.rope}, nope {d.nope}, v "
          f"{d.v_head_dim}; indexer {d.index_heads} heads x {d.index_head_dim}; "
          f"{dtype.name}; batch 1)\n")
    print(f"| length | cp | program | GFLOP (compiled) | GFLOP (formula) | GFLOP (XLA "
          f"cost_analysis) | FLOPs / dense causal | memory GiB | memory / dense | wire MiB | "
          f"wire / dense | CPU ms ({args.time_heads} MLA heads) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for length in lengths:
        for cp in cps:
            progs = {**attention_programs(length, cp, d, dtype),
                     "indexer": indexer_program(length, cp, d, dtype)}
            stats = {name: measure(prog) for name, prog in progs.items()}
            times = {}
            if length <= args.time_up_to:
                small = {**attention_programs(length, cp, timed, dtype),
                         "indexer": progs["indexer"]}
                for name, prog in small.items():
                    s = stats[name] if name == "indexer" else measure(prog)
                    need = s["memory"] * cp / 2**30
                    times[name] = (f"compile only (needs {need:.0f} GiB)"
                                   if need > args.time_max_gib else
                                   cpu_ms(prog, s["compiled"], args.iters))
            dense_formula = progs["dense"].formula / cp
            base = stats["dense"]
            for name, s in stats.items():
                ms = times.get(name, "compile only")
                if not isinstance(ms, str):
                    ms = f"{ms:.0f}" + (f" ({ms / times['dense']:.2f}x)" if name != "dense"
                                        and not isinstance(times["dense"], str) else "")
                wire = (f"{s['wire'] / base['wire']:.3f}" if base["wire"] else "-")
                print(f"| {length} | {cp} | {name} | {_num(s['flops'] / 1e9)} | "
                      f"{_num(progs[name].formula / cp / 1e9)} | "
                      f"{_num(s['xla_flops'] / 1e9)} | {s['flops'] / dense_formula:.4f} | "
                      f"{_num(s['memory'] / 2**30)} | {s['memory'] / base['memory']:.3f} | "
                      f"{_num(s['wire'] / 2**20)} | {wire} | {ms} |", flush=True)
    print(f"\n({time.time() - start:.0f} s)")


if __name__ == "__main__":
    from _record import json_main  # --json PATH: the table as a record
    raise SystemExit(json_main(main, ["sparse_attention"]))
