"""The command line of `zoo.generate` (``python -m zoo.generate --run DIR | --hf PATH``):
load a run's latest checkpoint (or a Hugging Face folder) with its tokenizer, generate from
``--prompt``, and print the text, prefill and decode tokens/s and the cache's bytes per token
(``--speculative mtp``: the speculative decoding statistics instead)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from zoo.generate import _generate

__all__ = ["main"]


def _parser():
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m zoo.generate",
        description="Generate text from a training run's latest checkpoint (--run) or a Hugging "
                    "Face checkpoint folder (--hf).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run dir (its checkpoints/, config and "
                     "tokenizer)")
    src.add_argument("--hf", metavar="PATH", help="a Hugging Face checkpoint folder")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative", choices=["mtp"], default=None, help="draft with the "
                   "model's multi-token-prediction module and verify (greedy; DeepSeek-V3 with "
                   "num_nextn_predict_layers >= 1)")
    p.add_argument("--step", type=int, default=None, help="--run: this checkpoint step "
                   "(default the newest)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the run's; "
                   "--hf: PATH/tokenizer.json if present, else bytes)")
    return p


def _load_hf(path: str):
    import json
    import os

    from zoo.models import registry
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"--hf {path}: has no config.json; pass a Hugging Face checkpoint "
                         f"folder (config.json + *.safetensors)")
    with open(config) as f:
        model_type = json.load(f).get("model_type")
    for family in registry.families():
        if model_type in family.model_cls.hf_model_types:
            return family.model_cls.from_hf(path)
    known = sorted(t for f in registry.families() for t in f.model_cls.hf_model_types)
    raise ValueError(f"--hf {path}: model_type={model_type!r} is not one zoo loads ({known})")


def _load(args):
    """(model, tokenizer) for the command line's --run / --hf."""
    import os

    from zoo.train.validate import load_tokenizer
    if args.hf:
        model = _load_hf(args.hf)
        default = os.path.join(args.hf, "tokenizer.json")
        return model, load_tokenizer(args.tokenizer or (default if os.path.exists(default)
                                                        else None))
    from zoo.train.load import load
    if not os.path.isdir(args.run):
        raise ValueError(f"--run {args.run}: is not a directory; pass a run dir (the "
                         f"recipes' --run-dir, e.g. runs/mini_deepseek3)")
    loaded = load(args.run, step=args.step)
    return loaded.model, load_tokenizer(args.tokenizer or loaded.config.tokenizer)


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.1f} tokens/s" if seconds > 0 else "n/a tokens/s"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring): 0 on success, 2 on bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.prompt:
        parser.error("--prompt is empty; give at least one character of text")
    try:
        model, tokenizer = _load(args)
        if args.speculative:
            from zoo.speculative import generate_speculative
            start = time.perf_counter()
            text, spec = generate_speculative(
                model, args.prompt, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, tokenizer=tokenizer, speculative=args.speculative)
            print(args.prompt + text)
            print(f"{spec}; {_rate(spec.tokens, time.perf_counter() - start)} with compilation")
            return 0
        stats: dict[str, Any] = {}
        ids, _ = _generate(
            model, [args.prompt], max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            stop=None, tokenizer=tokenizer, stats=stats, keep_logits=False)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(args.prompt + tokenizer.decode(ids[0]))
    n_pre, n_dec = stats["prefill_tokens"], stats["decode_steps"] * stats["batch"]
    print(f"prefill: {n_pre} tokens, {_rate(n_pre, stats['prefill_s'])}; decode: {n_dec} "
          f"tokens, {_rate(n_dec, stats['decode_s'])}; compile {stats['compile_s']:.1f} s; "
          f"cache {stats['cache_bytes_per_token']:,} bytes/token")
    return 0

