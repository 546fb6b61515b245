"""Blockwise FP8 (`zoo.ops.fp8`) on the mini DeepSeek-V3: each GEMM kind's error, and loss curves.

**GEMM error.** One float32 forward and backward of the mini (``deepseek3`` preset ``mini``,
unrolled layers, ``mla_kv_wire="expanded"`` so MLA's latent expansion is a `zoo.layers.Linear`
call) on a batch of the built-in corpus (the standard library's sources, `zoo.data`), at
initialisation, captures every GEMM's real operands with `flax.nnx.capture`: each projection's
input (a method output: the norms, ``attend``, the MLPs' ``activation``) and the gradient of
the cross-entropy at its output (``method_outputs=nnx.Perturbation``). Kinds:

* ``attention projections``: MLA's ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``o_proj``;
* ``MLA latent expansion``: ``kv_b_proj`` on the compressed latent;
* ``dense MLP``: the first (dense) layer's gate, up and down projections;
* ``shared expert``: the MoE layers' shared experts' three projections;
* ``routed experts``: the grouped matmul (`zoo.ops.fp8.ragged_dot`) of the tokens sorted by
  the router's choice against each expert's gate, up and down weights; the down projection's
  output gradient is each copy's routing weight times the token's gradient, the gate's and up's
  follow through SwiGLU in float32.

For each kind and each product of its VJP -- ``fwd`` ``y = x w``, ``dgrad`` ``dx = dy w^T``,
``wgrad`` ``dw = x^T dy`` -- the table gives the relative Frobenius error of the FP8 result
(`zoo.ops.fp8.dot` / ``ragged_dot`` and their VJPs: 1x128 activation and gradient tiles,
128x128 weight blocks, float32 accumulation) against the float32 product of the same operands,
pooled over the kind's GEMMs and layers (``sqrt(sum |err|^2 / sum |ref|^2)``), with the FP8
statistics of the operands (`zoo.ops.fp8.quantize_stats`: saturated blocks, underflowed values).

**Loss curves** (``--steps N``): the same training run (`zoo.train.Trainer`, the preset's
defaults on this machine's devices, ``--batch-size`` x ``--seq-len``) with and without
``fp8=blockwise``, the loss every ``--every`` steps and the last.

    python benchmarks/fp8.py                  # GEMM errors (about a minute on 2 cores)
    python benchmarks/fp8.py --steps 200      # and 200-step loss curves
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout
from zoo.train.launch import set_cpu_devices

KINDS = {  # kind -> (module path suffixes under a layer, where their input is read)
    "attention projections": ("self_attn.q_a_proj", "self_attn.q_b_proj",
                              "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"),
    "MLA latent expansion": ("self_attn.kv_b_proj",),
    "dense MLP": ("mlp.gate", "mlp.up", "mlp.down"),
    "shared expert": ("mlp.shared_experts.gate", "mlp.shared_experts.up",
                      "mlp.shared_experts.down"),
}
# a Linear's input: the output of this method of the layer (None: the Linear's kernel input
# is the previous entry's); "attend" is [B, L, N, Hv], flattened to o_proj's [*, N*Hv]
INPUTS = {"self_attn.q_a_proj": "input_layernorm.__call__",
          "self_attn.kv_a_proj_with_mqa": "input_layernorm.__call__",
          "self_attn.q_b_proj": "self_attn.q_a_layernorm.__call__",
          "self_attn.o_proj": "self_attn.attend",
          "self_attn.kv_b_proj": "self_attn.kv_a_layernorm.__call__",
          "mlp.gate": "post_attention_layernorm.__call__",
          "mlp.up": "post_attention_layernorm.__call__",
          "mlp.down": "mlp.activation",
          "mlp.shared_experts.gate": "post_attention_layernorm.__call__",
          "mlp.shared_experts.up": "post_attention_layernorm.__call__",
          "mlp.shared_experts.down": "mlp.shared_experts.activation"}


def corpus_batch(batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """One packed batch of the built-in corpus (byte tokens)."""
    from zoo.data import text_dataset
    return next(iter(text_dataset(None, seq_len=seq_len, batch_size=batch_size,
                                  load_balance=False)))


def mini_model(seq_len: int, batch_size: int):
    from zoo.models import registry
    family, config = registry.resolve("deepseek3_mini")
    config = dataclasses.replace(config, scan_layers=False, dtype="float32",
                                 mla_kv_wire="expanded", num_nextn_predict_layers=0)
    return config, family.model_cls(config, inputs_shape=(batch_size, seq_len),
                                    rngs=nnx.Rngs(0))


@contextlib.contextmanager
def perturbed_outputs():
    """For the capture only: every `zoo.layers.Linear` and `zoo.layers.MoE` output passes
    through `flax.nnx.Module.perturb` (a zero added), so the loss's gradient at it can be read
    (class attributes, restored on exit)."""
    from zoo.layers import Linear, MoE
    linear_call, moe_call = Linear.__call__, MoE.__call__

    def moe(self, x):
        y, aux = moe_call(self, x)
        return self.perturb("out", y), aux

    Linear.__call__ = lambda self, x: self.perturb("out", linear_call(self, x))
    MoE.__call__ = moe
    try:
        yield
    finally:
        Linear.__call__, MoE.__call__ = linear_call, moe_call


def capture(model, batch):
    """``(outputs, output gradients)``: every module method's output in one forward, and the
    cross-entropy's gradient at each Linear's and MoE's output, keyed by dotted path."""
    from zoo.ops.loss import cross_entropy

    def loss(m):
        logits, _ = m(jnp.asarray(batch["inputs"]), positions=jnp.asarray(batch["positions"]),
                      segment_ids=jnp.asarray(batch["segment_ids"]))
        w = jnp.asarray(batch["loss_weights"], jnp.float32)
        return jnp.sum(cross_entropy(logits, jnp.asarray(batch["targets"])) * w) / jnp.sum(w)

    graphdef, state = nnx.split(model)
    _, outs = nnx.capture(loss, nnx.Intermediate, method_outputs=nnx.Intermediate)(
        nnx.merge(graphdef, state))
    with perturbed_outputs():  # (nnx.capture's method_outputs wraps classes too: apart)
        _, perts = nnx.capture(loss, nnx.Perturbation)(nnx.merge(graphdef, state))
        grads = jax.grad(lambda p: nnx.capture(loss, init=p)(nnx.merge(graphdef, state)))(
            perts)

    def flat(s):
        return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(s)}
    return flat(outs), flat(grads)


def _only(v):
    return v[0] if isinstance(v, tuple) and len(v) == 1 else v


class Pooled:
    """Squared errors and references summed over a kind's GEMMs, per product; FP8 stats."""

    def __init__(self):
        self.err = {p: 0.0 for p in ("fwd", "dgrad", "wgrad")}
        self.ref = dict(self.err)
        self.stats = np.zeros(4)

    def add(self, product, got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        self.err[product] += float(np.sum((got - want) ** 2))
        self.ref[product] += float(np.sum(want ** 2))

    def row(self, kind, n):
        rel = {p: (self.err[p] / self.ref[p]) ** 0.5 if self.ref[p] else float("nan")
               for p in self.err}
        sat = self.stats[1] / max(self.stats[0], 1)
        under = self.stats[3] / max(self.stats[2], 1)
        return (f"| {kind} | {n} | {rel['fwd']:.4f} | {rel['dgrad']:.4f} | {rel['wgrad']:.4f} | "
                f"{sat:.2e} | {under:.2e} |")


def dense_errors(pool: Pooled, x, w, dy):
    """One `zoo.ops.fp8.dot` GEMM and its VJP against float32."""
    from zoo.ops import fp8
    x, w, dy = (jnp.asarray(a, jnp.float32) for a in (x, w, dy))
    y, vjp = jax.vjp(fp8.dot, x, w)
    dx, dw = vjp(dy)
    hi = jax.lax.Precision.HIGHEST
    pool.add("fwd", y, jnp.dot(x, w, precision=hi))
    pool.add("dgrad", dx, jnp.dot(dy, w.T, precision=hi))
    pool.add("wgrad", dw, jnp.dot(x.T, dy, precision=hi))
    pool.stats += np.asarray(fp8.quantize_stats(x)) + np.asarray(
        fp8.quantize_stats(w, block=fp8.WEIGHT_BLOCK)) + np.asarray(fp8.quantize_stats(dy))


def ragged_errors(pool: Pooled, x, w, group_sizes, dy):
    """One `zoo.ops.fp8.ragged_dot` grouped GEMM and its VJP against float32."""
    from zoo.ops import fp8
    x, w, dy = (jnp.asarray(a, jnp.float32) for a in (x, w, dy))
    y, vjp = jax.vjp(lambda a, b: fp8.ragged_dot(a, b, group_sizes), x, w)
    dx, dw = vjp(dy)
    ref = lambda a, b: jax.lax.ragged_dot(a, b, group_sizes,
                                          precision=jax.lax.Precision.HIGHEST)
    want, ref_vjp = jax.vjp(ref, x, w)
    want_dx, want_dw = ref_vjp(dy)
    pool.add("fwd", y, want)
    pool.add("dgrad", dx, want_dx)
    pool.add("wgrad", dw, want_dw)
    pool.stats += np.asarray(fp8.quantize_stats(x)) + np.asarray(
        fp8.quantize_stats(w, block=fp8.WEIGHT_BLOCK)) + np.asarray(fp8.quantize_stats(dy))


def routed(pool: Pooled, moe, h, dy_out, route):
    """The routed experts' three grouped GEMMs of one MoE layer: tokens ``h [T, D]`` sorted by
    expert, ``dy_out [T, D]`` the gradient at the layer's routed output."""
    weights, indices = (np.asarray(a).reshape(h.shape[0], -1) for a in route[:2])
    k = indices.shape[1]
    token = np.repeat(np.arange(h.shape[0]), k)
    expert, wcopy = indices.reshape(-1), weights.reshape(-1)
    order = np.argsort(expert, kind="stable")
    xs = h[token[order]]
    gs = jnp.asarray(np.bincount(expert, minlength=moe.num_experts), jnp.int32)
    wg, wu, wo = moe.wi_gate[...], moe.wi_up[...], moe.wo[...]  # DeepSeek-V3: separate
    hi = jax.lax.Precision.HIGHEST
    g = jax.lax.ragged_dot(xs, wg, gs, precision=hi)
    u = jax.lax.ragged_dot(xs, wu, gs, precision=hi)
    act, act_vjp = jax.vjp(lambda a, b: jax.nn.silu(a) * b, g, u)
    dy_down = dy_out[token[order]] * wcopy[order][:, None]  # y = sum_k w_k * down_k
    ragged_errors(pool, act, wo, gs, dy_down)
    d_act = jax.lax.ragged_dot(dy_down, jnp.swapaxes(wo, 1, 2), gs, precision=hi)
    dg, du = act_vjp(d_act)
    ragged_errors(pool, xs, wg, gs, dg)
    ragged_errors(pool, xs, wu, gs, du)


def gemm_table(batch_size: int, seq_len: int) -> None:
    config, model = mini_model(seq_len, batch_size)
    batch = corpus_batch(batch_size, seq_len)
    outs, grads = capture(model, batch)
    pools, counts = {k: Pooled() for k in (*KINDS, "routed experts")}, {}
    for i, layer in enumerate(model.layers):
        pre = f"layers.{i}."
        for kind, names in KINDS.items():
            for name in names:
                if pre + name + ".__call__" not in outs:
                    continue
                lin = eval("layer." + name)
                x = np.asarray(_only(outs[pre + INPUTS[name]]))
                dy = np.asarray(_only(grads[pre + name + ".out"]))
                kdim = int(np.prod(lin.in_features))
                dense_errors(pools[kind], x.reshape(-1, kdim),
                             np.asarray(lin.kernel[...]).reshape(kdim, -1),
                             dy.reshape(x.reshape(-1, kdim).shape[0], -1))
                counts[kind] = counts.get(kind, 0) + 1
        if pre + "mlp.route" in outs:
            h = np.asarray(_only(outs[pre + "post_attention_layernorm.__call__"]))
            d = h.shape[-1]
            # the routed output's gradient is the MoE output's (the shared expert adds beside)
            dy = np.asarray(_only(grads[pre + "mlp.out"])).reshape(-1, d)
            routed(pools["routed experts"], layer.mlp, jnp.asarray(h.reshape(-1, d)),
                   jnp.asarray(dy), _only(outs[pre + "mlp.route"]))
            counts["routed experts"] = counts.get("routed experts", 0) + 3
    print(f"## FP8 GEMM error against float32, mini DeepSeek-V3 at initialisation ({batch_size}"
          f" x {seq_len} tokens of the built-in corpus; hidden {config.hidden_size}, "
          f"{config.n_routed_experts} routed experts)\n")
    print("| GEMM kind | GEMMs | fwd rel. error | dgrad rel. error | wgrad rel. error | "
          "saturated blocks | underflowed values |")
    print("|---|---|---|---|---|---|---|")
    for kind, pool in pools.items():
        print(pool.row(kind, counts.get(kind, 0)), flush=True)


def loss_curves(steps: int, every: int, batch_size: int, seq_len: int) -> None:
    from zoo.train import TrainConfig, Trainer, read_metrics
    losses = {}
    for label, extra in (("without FP8", ()), ("fp8=blockwise", ("fp8=blockwise",))):
        with tempfile.TemporaryDirectory(prefix="zoo-fp8-bench-") as run_dir:
            cfg = TrainConfig(family="deepseek3", preset="mini", overrides=extra, steps=steps,
                              batch_size=batch_size, seq_len=seq_len, run_dir=run_dir,
                              checkpoint_every=10 ** 9, progress=False, tensorboard=False)
            start = time.time()
            with Trainer(cfg) as t:
                t.train()
            rows = read_metrics(run_dir)
            losses[label] = ({r["step"]: r["loss"] for r in rows}, time.time() - start,
                             rows[-1].get("fp8/underflow"))
    base, fp8_run = losses["without FP8"][0], losses["fp8=blockwise"][0]
    print(f"\n## Loss, mini DeepSeek-V3 with and without fp8=blockwise ({steps} steps, "
          f"{batch_size} x {seq_len}; runs {losses['without FP8'][1]:.0f} s and "
          f"{losses['fp8=blockwise'][1]:.0f} s)\n")
    print("| step | loss without FP8 | loss fp8=blockwise | relative difference |")
    print("|---|---|---|---|")
    shown = sorted({s for s in base if s % every == 0 or s == max(base)} & set(fp8_run))
    for s in shown:
        print(f"| {s} | {base[s]:.4f} | {fp8_run[s]:.4f} | "
              f"{(fp8_run[s] - base[s]) / base[s]:+.2%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=0, help="loss curves of this many steps "
                    "(0: none)")
    ap.add_argument("--every", type=int, default=10, help="a loss row every this many steps")
    args = ap.parse_args()
    set_cpu_devices(None)
    start = time.time()
    gemm_table(args.batch_size, args.seq_len)
    if args.steps:
        loss_curves(args.steps, args.every, args.batch_size, args.seq_len)
    print(f"\n({time.time() - start:.0f} s)")


if __name__ == "__main__":
    from _record import json_main  # --json PATH: the tables as records
    raise SystemExit(json_main(main, ["fp8_gemm_error", "fp8_loss"]))
