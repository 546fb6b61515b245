"""The command line of `zoo.inference` (``python -m zoo.generate --run DIR | --hf PATH``):
load a run's latest checkpoint (or a Hugging Face folder) with its tokenizer, generate from
``--prompt``, and print the text, prefill and decode tokens/s and the cache's bytes per token
(``--speculative mtp``: the speculative decoding statistics instead).

Bad input is exit 2 with one line naming the flag, the value and the fix: numbers that are
not finite or out of range (``--temperature nan``, ``--top-p 2``, ``--max-new-tokens 0``:
nothing to generate), sampling flags beside ``--speculative``, a ``--step`` the run holds no
checkpoint of (the error lists the steps it holds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from zoo.inference.generation import run
from zoo.inference.speculative import generate_speculative

__all__ = ["check_flags", "load_model", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zoo.generate",
        description="Generate text from a training run's latest checkpoint (--run) or a Hugging "
                    "Face checkpoint folder (--hf).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run dir (its checkpoints/, config and "
                     "tokenizer)")
    src.add_argument("--hf", metavar="PATH", help="a Hugging Face checkpoint folder")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (>= 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else a finite "
                   "number > 0 to sample")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely "
                   "tokens (1 .. vocab)")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely "
                   "tokens holding this probability mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative", choices=["mtp"], default=None, help="draft with the "
                   "model's multi-token-prediction module and verify (greedy; DeepSeek-V3, V3.2, "
                   "GLM-5 or V4 with num_nextn_predict_layers >= 1)")
    p.add_argument("--step", type=int, default=None, help="--run: this checkpoint step "
                   "(default the newest)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the run's; "
                   "--hf: PATH/tokenizer.json if present, else bytes)")
    from zoo.train.load import add_class_flags
    add_class_flags(p)  # --model-cls, --decoder-layer-cls
    return p


def check_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the parsed flags before anything loads (one line naming the flag,
    the value and the fix), or None."""
    if not args.prompt:
        return "--prompt is empty; give at least one character of text"
    if args.max_new_tokens < 1:
        return (f"--max-new-tokens {args.max_new_tokens}: nothing to generate; pass "
                f"--max-new-tokens 1 or more")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return (f"--temperature {args.temperature}: must be a finite number >= 0 (0: greedy; "
                f"e.g. 0.7 to sample)")
    if args.top_k is not None and args.top_k < 1:
        return f"--top-k {args.top_k}: must be an int >= 1 (the tokens sampled among)"
    if args.top_p is not None and not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        return f"--top-p {args.top_p}: must be a number in (0, 1] (the probability mass kept)"
    if args.step is not None and args.hf:
        return "--step picks a checkpoint of --run; an --hf folder has one, drop --step"
    if args.speculative:
        sampling = [flag for flag, on in (
            (f"--temperature {args.temperature}", args.temperature != 0),
            (f"--top-k {args.top_k}", args.top_k is not None),
            (f"--top-p {args.top_p}", args.top_p is not None)) if on]
        if sampling:
            return (f"--speculative {args.speculative} decodes greedily and {', '.join(sampling)} "
                    f"samples; drop {' and '.join(f.split()[0] for f in sampling)} or "
                    f"--speculative")
    return None


def _load_hf(path: str):
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


def load_model(args: argparse.Namespace):
    """(model, tokenizer) for the command line's --run / --hf."""
    from zoo.train.validate import load_tokenizer
    if args.hf:
        model = _load_hf(args.hf)
        default = os.path.join(args.hf, "tokenizer.json")
        return model, load_tokenizer(args.tokenizer or (default if os.path.exists(default)
                                                        else None))
    from zoo.train.load import classes_from_flags, load
    if not os.path.isdir(args.run):
        raise ValueError(f"--run {args.run}: is not a directory; pass a run dir (the "
                         f"recipes' --run-dir, e.g. runs/mini_deepseek3)")
    try:
        loaded = load(args.run, step=args.step, **classes_from_flags(args))
    except (ValueError, FileNotFoundError) as e:
        if args.step is None or (isinstance(e, ValueError) and "of step" not in str(e)):
            raise
        # a step the run does not hold: the message lists the steps it holds
        raise ValueError(f"--step {args.step}: {e}") from None
    return loaded.model, load_tokenizer(args.tokenizer or loaded.config.tokenizer)


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.1f} tokens/s" if seconds > 0 else "n/a tokens/s"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring): 0 on success, 2 on bad input."""
    p = parser()
    args = p.parse_args(argv)
    problem = check_flags(args)
    if problem:
        p.exit(2, f"{p.prog}: error: {problem}\n")
    try:
        model, tokenizer = load_model(args)
        vocab = model.config.vocab_size
        if args.top_k is not None and args.top_k > vocab:
            raise ValueError(f"--top-k {args.top_k}: the model has {vocab} tokens; pass "
                             f"--top-k {vocab} or fewer")
        refusal = model.speculative_support() if args.speculative else None
        if refusal:
            raise ValueError(f"--speculative {args.speculative}: {refusal}; or drop "
                             f"--speculative")
        if args.speculative:
            start = time.perf_counter()
            text, spec = generate_speculative(
                model, args.prompt, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, tokenizer=tokenizer, speculative=args.speculative)
            print(args.prompt + text)
            print(f"{spec}; {_rate(spec.tokens, time.perf_counter() - start)} with compilation")
            return 0
        stats: dict[str, Any] = {}
        ids, _ = run(model, [args.prompt], max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                     seed=args.seed, tokenizer=tokenizer, stats=stats)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(args.prompt + tokenizer.decode(ids[0]))
    n_pre, n_dec = stats["prefill_tokens"], stats["decode_steps"] * stats["batch"]
    print(f"prefill: {n_pre} tokens, {_rate(n_pre, stats['prefill_s'])}; decode: {n_dec} "
          f"tokens, {_rate(n_dec, stats['decode_s'])}; compile {stats['compile_s']:.1f} s; "
          f"cache {stats['cache_bytes_per_token']:,} bytes/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
