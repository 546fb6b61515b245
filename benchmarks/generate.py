"""Generation: decode tokens/s with the KV cache against the naive full recompute, and cache sizes.

* Decode table: for each mini model (``mini`` presets, random weights, one device, batch 1)
  and context length, the cached decode step (`zoo.inference.Decoder.decode` over a cache of
  ``context + steps`` slots, filled by `zoo.inference.prefill`) against the naive loop's step
  (the whole ``[1, context]`` buffer through ``model(...)`` for each new token). Every program
  is compiled before it is timed; the median of ``--steps`` steps is kept, the contexts of a
  model timed in turn within each round so that their ratio sees one load.
* Long-context table (``--long-contexts``, default 1024 and 32768): the cached step alone for
  the hybrid minis (``--long-models``: Qwen3-Next and Qwen3.5-MoE, three gated DeltaNet layers
  to one full-attention layer), the Qwen3-Next mini with linear layers only
  (``qwen3_next_linear``) and a full-attention one (Qwen3-MoE) for contrast. A linear layer's
  cache is a recurrent state and a convolution window, constant in the context, so its step
  is flat; only the full layers' K/V grows (at mini widths the one full layer's attention over
  32k keys is most of a hybrid's step there).
* Cache table: bytes per token (all layers, bf16) of the full-size presets' caches
  (`zoo.inference.cache_bytes_per_token` on abstract models: no memory), with, for MLA, what
  expanded per-head K/V would take.

Usage::

    python benchmarks/generate.py                       # contexts 128, 1024, 4096; 5 families
                                                        # + the long-context table (1k, 32k)
    python benchmarks/generate.py --long-contexts ""   # without the long-context table
    python benchmarks/generate.py --contexts 128,1024 --models deepseek3 --steps 5
    python benchmarks/generate.py --json docs/benchmarks   # also the tables as records
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zoo.inference as G
from zoo.layers.gated_deltanet import GatedDeltaNet
from zoo.layers.mla import MLA
from zoo.models import deepseek3, mixtral, qwen3_5_moe, qwen3_moe, qwen3_next
from zoo.train.launch import set_cpu_devices

MINI = {"mixtral": (mixtral.Mixtral, mixtral.MixtralConfig.mini),
        "deepseek3": (deepseek3.DeepSeek3, deepseek3.DeepSeek3Config.mini),
        "qwen3_moe": (qwen3_moe.Qwen3Moe, qwen3_moe.Qwen3MoeConfig.mini),
        "qwen3_next": (qwen3_next.Qwen3Next, qwen3_next.Qwen3NextConfig.mini),
        "qwen3_5_moe": (qwen3_5_moe.Qwen3_5Moe, qwen3_5_moe.Qwen3_5MoeConfig.mini),
        # the Qwen3-Next mini with its full-attention layer made linear: the linear layers alone
        "qwen3_next_linear": (qwen3_next.Qwen3Next, functools.partial(
            qwen3_next.Qwen3NextConfig.mini, layer_types=("linear_attention",) * 4))}
LONG_MODELS = ("qwen3_next", "qwen3_5_moe", "qwen3_next_linear", "qwen3_moe")
FULL = {"deepseek_v3": (deepseek3.DeepSeek3, deepseek3.DeepSeek3Config.deepseek_v3),
        "mixtral_8x7b": (mixtral.Mixtral, mixtral.MixtralConfig.mixtral_8x7b),
        "mixtral_8x22b": (mixtral.Mixtral, mixtral.MixtralConfig.mixtral_8x22b),
        "qwen3_30b_a3b": (qwen3_moe.Qwen3Moe, qwen3_moe.Qwen3MoeConfig.qwen3_30b_a3b),
        "qwen3_next_80b_a3b": (qwen3_next.Qwen3Next, qwen3_next.Qwen3NextConfig.qwen3_next_80b_a3b),
        "qwen3_5_397b_a17b": (qwen3_5_moe.Qwen3_5Moe,
                              qwen3_5_moe.Qwen3_5MoeConfig.qwen3_5_397b_a17b)}
HYBRID_CONTEXT = 32768  # a hybrid's constant linear-layer state, amortised over this context


def _interleaved_medians(fns, steps: int, block: int = 10) -> list[float]:
    """The median seconds of a call of each of `fns`, `steps` calls each, made in turns of
    `block` back-to-back calls (a decode loop runs its step back to back: warm) so that all of
    them see the same load on a shared box and their ratios hold."""
    times = [[] for _ in fns]
    while len(times[0]) < steps:
        n = min(block, steps - len(times[0]))
        for fn, ts in zip(fns, times):
            fn()  # warm again after the others ran
            for _ in range(n):
                start = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - start)
    return [float(np.median(ts)) for ts in times]


def decode_fns(name: str, context: int, steps: int, naive: bool = True):
    """(cached step, naive step) at this context, both compiled: the cached one decodes from
    a cache of ``context + steps`` slots filled by `zoo.inference.prefill`, the naive one runs
    the whole ``[1, context]`` buffer through ``model(...)`` (None without ``naive``)."""
    cls, preset = MINI[name]
    model = nnx.jit(lambda: cls(preset(max_position_embeddings=max(4096, 2 * context)),
                                rngs=nnx.Rngs(0)))()
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, model.config.vocab_size, (1, context)).astype(np.int32)
    logits, cache = G.prefill(model, tokens, np.ones_like(tokens),
                              max_length=context + 2 * steps + 1)
    token = np.asarray(jnp.argmax(logits, -1), np.int32)
    decoder = G.Decoder(model)
    logits, cache = decoder.decode(cache, token)  # compiles
    jax.block_until_ready(logits)
    state = {"cache": cache}

    def cached():
        out, state["cache"] = decoder.decode(state["cache"], token)
        jax.block_until_ready(out)

    if not naive:
        return cached, None
    forward = jax.jit(lambda m, t: m(t)[0][:, -1])
    buffer = jnp.asarray(tokens)
    jax.block_until_ready(forward(model, buffer))  # compiles

    def naive():
        jax.block_until_ready(forward(model, buffer))

    return cached, naive


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--models", default="mixtral,deepseek3,qwen3_moe,qwen3_next,qwen3_5_moe")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per row")
    ap.add_argument("--long-contexts", default="1024,32768",
                    help="the long-context table's contexts (cached step only); empty: no table")
    ap.add_argument("--long-models", default=",".join(LONG_MODELS))
    args = ap.parse_args()
    set_cpu_devices(1)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    models = [m for m in args.models.split(",") if m]
    long_contexts = [int(c) for c in args.long_contexts.split(",") if c]
    long_models = [m for m in args.long_models.split(",") if m] if long_contexts else []
    unknown = [m for m in models + long_models if m not in MINI]
    if unknown:
        ap.error(f"--models/--long-models {unknown}: choose among {', '.join(MINI)}")
    start = time.time()
    print("## Decode step: KV cache vs naive full recompute (mini models, batch 1, fp32, "
          f"{jax.devices()[0].platform})\n")
    print("| model | context | cached ms/token | naive ms/token | speed-up | cached vs first "
          "context |")
    print("|---|---|---|---|---|---|")
    for name in models:
        fns = [decode_fns(name, context, args.steps) for context in contexts]
        cached = _interleaved_medians([c for c, _ in fns], args.steps)
        naive = _interleaved_medians([n for _, n in fns], max(1, min(args.steps, 5)))
        for context, c, n in zip(contexts, cached, naive, strict=True):
            print(f"| {name} mini | {context} | {c * 1e3:.2f} | {n * 1e3:.2f} | "
                  f"{n / c:.1f}x | {c / cached[0]:.2f}x |", flush=True)
    print("\n## KV cache bytes per token, all layers, bf16 (full-size presets)\n")
    print("| preset | layers | cache | bytes/token | expanded K/V bytes/token |")
    print("|---|---|---|---|---|")
    for name, (cls, preset) in FULL.items():
        config = preset()
        model = cls.abstract(config)
        got = G.cache_bytes_per_token(model, jnp.bfloat16)
        linear = [layer for layer in model.layers if isinstance(layer.self_attn, GatedDeltaNet)]
        if linear:
            n_linear = sum(layer.stack_size or 1 for layer in linear)
            entries = G.KVCache.shapes(model, 1, 1, jnp.bfloat16).layers
            state = sum(np.prod(a.shape) * a.dtype.itemsize
                        for layer, entry in zip(model.layers, entries, strict=True)
                        if isinstance(layer.self_attn, GatedDeltaNet) for a in entry.values())
            got = G.cache_bytes_per_token(model, jnp.bfloat16, context=HYBRID_CONTEXT)
            what = (f"K/V of {config.num_hidden_layers - n_linear} full layers: "
                    f"{config.num_key_value_heads} kv heads x {config.head_dim}; {n_linear} "
                    f"linear layers' state + conv window: {state / 1e6:.1f} MB a sequence, "
                    f"amortised over {HYBRID_CONTEXT}")
            expanded = "(same)"
        elif isinstance(model.layers[0].self_attn, MLA):
            what = f"MLA latent {config.kv_lora_rank} + rotary key {config.qk_rope_head_dim}"
            expanded = config.num_hidden_layers * config.num_attention_heads * (
                config.qk_head_dim + config.v_head_dim) * 2
            expanded = f"{expanded:,}"
        else:
            what = f"K/V: {config.num_key_value_heads} kv heads x {config.head_dim}"
            expanded = "(same)"
        print(f"| {name} | {config.num_hidden_layers} | {what} | {got:,} | {expanded} |")
    if long_models:
        print(f"\n## Decode step at long context: hybrid linear attention (cached step, mini "
              f"models, batch 1, fp32, {jax.devices()[0].platform})\n")
        print("| model | " + " | ".join(f"ms/token at {c}" for c in long_contexts)
              + f" | {long_contexts[-1]} vs {long_contexts[0]} |")
        print("|---|" + "---|" * (len(long_contexts) + 1))
    for name in long_models:
        fns = [decode_fns(name, context, args.steps, naive=False)[0]
               for context in long_contexts]
        cached = _interleaved_medians(fns, args.steps)
        print(f"| {name} mini | " + " | ".join(f"{c * 1e3:.2f}" for c in cached)
              + f" | {cached[-1] / cached[0]:.2f}x |", flush=True)
    print(f"\n({time.time() - start:.0f} s)")


if __name__ == "__main__":
    from _record import json_main  # --json PATH: the tables as records
    raise SystemExit(json_main(main, ["generate_decode", "generate_cache_bytes",
                                          "generate_decode_long"]))
