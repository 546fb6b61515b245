"""Attention as an open op: masks, score modifiers, block kernels, MLA's latent on the wire.

* every mask kind's reference against a numpy loop with independently written rules, and its
  block classification (empty / full) against the dense mask on random blocks;
* soft cap, sinks and a `ScoreMod` under ring CP against the reference (forward, dq/dk/dv and
  the sinks' gradient), and the formulas against transformers (Gemma-2, gpt-oss);
* the tokamax kernel under CP (its XLA implementation on CPU) and a user-registered kernel;
* the compiled program's executed `conditional` count does not grow with the sequence, and the
  flash kernel alone has none;
* MLA's collective bytes under ring and all-gather fall by the latent/expanded ratio;
* under a sliding window with a known layout, the ring moves only the hops some query can see
  (`zoo.ops.ring.hop_plan`), exactly, and falls back to the full ring when the check fails;
* a user mask of a few lines trains a step of mini DeepSeek-V3 under ring CP.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from zoo.layers.mla import MLA
from zoo.ops import (Causal, Chunked, Document, FlashKernel, MaskFn, PrefixLM, ScoreMod,
                     SlidingWindow, TokamaxKernel, attention, dot_product_attention,
                     mla_attention)
from zoo.ops import hlo, kernels, ring
from zoo.ops.masks import EMPTY, FULL, block_kind, bounds, evaluate, prefix_segment_ids

KERNEL = FlashKernel(q_tile=8, kv_tile=8)


def _sentence(q_pos, kv_pos, q_seg, kv_seg):
    return (q_pos // 5 == kv_pos // 5) | (kv_pos < 4)


MASKS = {  # name: (mask, the same rule written independently for one (q, k) pair)
    "causal": (Causal() & Document(), lambda qp, kp, qs, ks: kp <= qp and abs(qs) == abs(ks)),
    "window": (Causal() & SlidingWindow(3) & Document(),
               lambda qp, kp, qs, ks: 0 <= qp - kp < 3 and abs(qs) == abs(ks)),
    "chunked": (Chunked(4) & Document(),
                lambda qp, kp, qs, ks: qp // 4 == kp // 4 and abs(qs) == abs(ks)),
    "prefix": (PrefixLM() & Document(), lambda qp, kp, qs, ks: abs(qs) == abs(ks) and (
        kp <= qp or (qs < 0 and ks < 0))),
    "document": (Document(), lambda qp, kp, qs, ks: abs(qs) == abs(ks)),
    "user": (MaskFn(_sentence) | Causal(), lambda qp, kp, qs, ks: (
        qp // 5 == kp // 5 or kp < 4 or kp <= qp)),
}


def _small():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 12, 4, 8)), rng.normal(size=(2, 12, 2, 8)), rng.normal(
        size=(2, 12, 2, 6))
    seg = prefix_segment_ids(np.array([[1] * 5 + [2] * 4 + [0] * 3, [3] * 12]), [[2, 1], [0, 0,
                                                                                     4]])
    pos = np.array([list(range(5)) + list(range(4)) + [0] * 3, list(range(12))])
    return q, k, v, pos, seg


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_kinds_match_numpy_loop(name):
    mask, rule = MASKS[name]
    q, k, v, pos, seg = _small()
    got = dot_product_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                                q_positions=jnp.asarray(pos), kv_positions=jnp.asarray(pos),
                                q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg),
                                mask=mask)
    want = np.zeros(got.shape)
    for b in range(2):
        for i in range(12):
            keys = [j for j in range(12) if seg[b, i] and seg[b, j]
                    and rule(pos[b, i], pos[b, j], seg[b, i], seg[b, j])]
            for n in range(4):
                if keys:
                    s = np.array([q[b, i, n] @ k[b, j, n // 2] for j in keys]) / np.sqrt(8)
                    p = np.exp(s - s.max())
                    want[b, i, n] = (p / p.sum()) @ v[b, keys, n // 2]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(MASKS))
def test_block_classification_is_sound(name):
    """EMPTY only if the dense block is all False, FULL only if all True; both do occur."""
    mask = MASKS[name][0]
    rng = np.random.default_rng(2)
    n = 3000
    # blocks of 3 tokens at nearby positions: start + 0..2 steps of 0 or 1
    qp, kp = (rng.integers(0, 12, (n, 1, 1)) + np.cumsum(rng.integers(0, 2, (n, 1, 3)), -1)
              for _ in range(2))
    qs, ks = rng.integers(-2, 3, (n, 1, 3)), rng.integers(-2, 3, (n, 1, 3))
    # half of the blocks: one document, no padding, so FULL blocks exist
    one = rng.random(n) < 0.5
    qs[one], ks[one] = np.sign(qs[one]) + (qs[one] == 0), np.sign(ks[one]) + (ks[one] == 0)
    args = tuple(jnp.asarray(x, jnp.int32) for x in (qp, kp, qs, ks))
    kind = jax.vmap(lambda a, b, c, d: block_kind(mask, bounds(a, c), bounds(b, d)))(*args)
    dense = jax.vmap(lambda a, b, c, d: evaluate(mask, a[:, :, None], b[:, None, :],
                                                 c[:, :, None], d[:, None, :]))(*args)
    kind, dense = np.asarray(kind), np.asarray(dense).reshape(n, -1)
    assert not dense[kind == EMPTY].any() and dense[kind == FULL].all()
    if name != "user":  # MaskFn says "partial"; the others prune
        assert (kind == EMPTY).mean() > 0.005 and (kind == FULL).mean() > 0.005


# -- score modifiers ---------------------------------------------------------------------------

def _packed(B=2, L=32, N=4, K=2, H=8, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((B, L, N, H), (B, L, K, H), (B, L, K, H)))
    seg = np.repeat([[1] * 11 + [2] * 15 + [3] * 4 + [0] * 2], B, 0)
    pos = np.concatenate([np.arange(11), np.arange(15), np.arange(4), [0, 0]])
    w = jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.float32)
    return q, k, v, jnp.asarray(np.tile(pos, (B, 1)), jnp.int32), jnp.asarray(seg), w


def _grads(fn, q, k, v, pos, seg, w, sinks):
    def loss(q, k, v, sinks):
        o = fn(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
               kv_segment_ids=seg, sinks=sinks)
        return jnp.sum(o * w), o
    (_, o), g = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return (o, *g)


def _alibi(s, q_pos, kv_pos, q_seg, kv_seg, head):
    return s - 0.1 * (head + 1) * jnp.abs(q_pos - kv_pos)


ALIBI = ScoreMod(_alibi)


def _close(got, want, names=("out", "dq", "dk", "dv", "dsinks"), tol=2e-5):
    for n, g, r in zip(names, got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4,
                                   atol=tol * max(1.0, float(np.abs(r).max())), err_msg=n)


def test_soft_cap_sinks_and_score_mod_under_ring_and_all_gather():
    q, k, v, pos, seg, w = _packed()
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    kw = dict(logits_soft_cap=2.0, score_mod=ALIBI)
    want = jax.jit(lambda: _grads(functools.partial(dot_product_attention, **kw), q, k, v, pos,
                                  seg, w, sinks))()
    p = zoo.Partitioner(zoo.make_mesh(context=4, data=2), "cp")
    for impl in ("ring", "all_gather"):
        got = jax.jit(lambda impl=impl: _grads(functools.partial(
            attention, partitioner=p, implementation=impl, kernel=KERNEL, **kw), q, k, v, pos,
            seg, w, sinks))()
        _close(got, want)
    assert float(jnp.abs(want[4]).max()) > 1e-3  # the sinks' gradient is not trivially zero


def test_soft_cap_and_sinks_formulas():
    """Against softmax([cap * tanh(s / cap), sink]) written out, one document, no mask."""
    q, k, v, _, _, _ = _packed(B=1, L=6, N=2, K=2)
    pos = jnp.arange(6)[None]
    sinks = jnp.asarray([1.0, -0.5])
    got = dot_product_attention(q, k, v, q_positions=pos, kv_positions=pos, causal=False,
                                logits_soft_cap=3.0, sinks=sinks)
    s = np.einsum("blnh,bsnh->bnls", np.asarray(q), np.asarray(k)) / np.sqrt(8)
    s = 3.0 * np.tanh(s / 3.0)
    e = np.exp(s)
    p = e / (e.sum(-1, keepdims=True) + np.exp(np.asarray(sinks))[None, :, None, None])
    want = np.einsum("bnls,bsnh->blnh", p, np.asarray(v))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def _hf_inputs(N=4, K=2, L=10, H=8):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((1, L, N, H), (1, L, K, H),
                                                               (1, L, K, H)))
    causal = np.tril(np.ones((L, L), bool))
    hf_mask = torch.tensor(np.where(causal, 0.0, -np.inf)[None, None], dtype=torch.float32)
    t = lambda x: torch.tensor(x).transpose(1, 2)  # [B, L, N, H] -> [B, N, L, H]
    pos = jnp.arange(L)[None]
    return torch, (q, k, v), (t(q), t(k), t(v)), hf_mask, pos


def test_soft_cap_matches_gemma2():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    _torch, (q, k, v), tq, mask, pos = _hf_inputs()
    module = types.SimpleNamespace(num_key_value_groups=2, training=False, head_dim=8)
    want, _ = eager_attention_forward(module, *tq, mask, scaling=8 ** -0.5, softcap=1.5)
    got = attention(*(jnp.asarray(x) for x in (q, k, v)), q_positions=pos, kv_positions=pos,
                    logits_soft_cap=1.5, kernel=KERNEL)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)


def test_sinks_match_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    torch, (q, k, v), tq, mask, pos = _hf_inputs()
    sinks = np.asarray([0.3, -1.0, 2.5, 0.0], np.float32)
    module = types.SimpleNamespace(num_key_value_groups=2, training=False,
                                   sinks=torch.tensor(sinks))
    want, _ = eager_attention_forward(module, *tq, mask, scaling=8 ** -0.5)
    got = attention(*(jnp.asarray(x) for x in (q, k, v)), q_positions=pos, kv_positions=pos,
                    sinks=jnp.asarray(sinks), kernel=KERNEL)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)


# -- kernels -----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl,sizes,kernel", [
    ("ring", dict(context=4, data=2), "tokamax"),
    ("all_gather", dict(context=2, fsdp=4), "tokamax"),
    # blocks padded to whole tiles with hidden queries and keys (Mosaic TPU's 128; here 32)
    ("ring", dict(context=4, data=2), TokamaxKernel(pad_to=32))])
def test_tokamax_kernel_under_cp(impl, sizes, kernel):
    """The tokamax kernel (XLA implementation on CPU) with packed documents, padding, a
    window and sinks, load-balanced order, against the reference."""
    q, k, v, pos, seg, w = _packed()
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    mask = Causal() & SlidingWindow(9) & Document()
    want = jax.jit(lambda: _grads(functools.partial(dot_product_attention, mask=mask), q, k, v,
                                  pos, seg, w, sinks))()
    p = zoo.Partitioner(zoo.make_mesh(**sizes), "cp")
    run = jax.jit(lambda *a: _grads(functools.partial(
        attention, mask=mask, partitioner=p, implementation=impl, kernel=kernel), *a, sinks))
    compiled = run.lower(q, k, v, pos, seg, w).compile()
    assert "tokamax" in compiled.as_text()  # tokamax's op is in the program (its named scope)
    _close(compiled(q, k, v, pos, seg, w), want)


@dataclasses.dataclass(frozen=True)
class CountingKernel(FlashKernel):
    """A user's kernel: the flash kernel with its own tiles, recording its calls at trace. It
    returns each sub-block's results (``accumulates = False``), so the strategies take their
    `lax.switch` path for it (the flash kernel itself adds in place)."""
    calls: list = dataclasses.field(default_factory=list, compare=False, hash=False)
    accumulates = False

    def forward(self, *args, **kw):
        self.calls.append("forward")
        return super().forward(*args, **kw)


def test_registered_user_kernel():
    """A registered kernel that returns its sub-block results (the strategies' `lax.switch`
    path): forward and dq/dk/dv/dsinks against the reference, unsharded and under both CP
    strategies."""
    user = CountingKernel(q_tile=4, kv_tile=4)
    kernels.register_kernel("counting", user)
    q, k, v, pos, seg, w = _packed()
    sinks = jnp.asarray([0.5, -1.0, 0.0, 1.5])
    want = jax.jit(lambda: _grads(dot_product_attention, q, k, v, pos, seg, w, sinks))()
    p = zoo.Partitioner(zoo.make_mesh(context=4, data=2), "cp")
    for impl, part in (("auto", None), ("ring", p), ("all_gather", p)):
        got = jax.jit(lambda impl=impl, part=part: _grads(functools.partial(
            attention, partitioner=part, implementation=impl, kernel="counting"), q, k, v, pos,
            seg, w, sinks))()
        _close(got, want)
    assert user.calls


def _fwd_bwd_text(L, impl="ring", cp=4):
    sds = jax.ShapeDtypeStruct
    p = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")

    def f(q, k, v, pos):
        return jnp.sum(attention(q, k, v, q_positions=pos, kv_positions=pos, partitioner=p,
                                 implementation=impl, kernel=KERNEL))

    args = (sds((1, L, 2, 8), jnp.float32), sds((1, L, 1, 8), jnp.float32),
            sds((1, L, 1, 8), jnp.float32), sds((1, L), jnp.int32))
    return jax.jit(jax.grad(f, (0, 1, 2))).lower(*args).compile().as_text()


def test_conditionals_do_not_grow_with_length():
    """Block-level skipping decides once per sub-block, whatever the length: split**2
    sub-blocks per ring step and pass, each one 0-or-1-trip loop per way to run it (full, and
    the flash kernel's two tile plans: no `conditional`, which would copy the accumulators).
    The tile loops run more often at the longer length, the decisions do not."""
    short, long = _fwd_bwd_text(256), _fwd_bwd_text(1024)
    counts = [hlo.decisions(t) for t in (short, long)]
    ways = 1 + len(KERNEL.partial_plans(32, 32))  # full, then the budget and every tile
    assert counts[0] == counts[1] == 2 * 4 * 2 * 2 * ways  # fwd + bwd, 4 ring steps, 2x2
    assert hlo.count_executed(long, "conditional") == 0
    # the tile loops' bodies (their fusions) run more often
    assert hlo.count_executed(long, "fusion") > 2 * hlo.count_executed(short, "fusion")
    # the flash kernel alone, forward and backward: no conditional at all
    q, kv = jnp.ones((1, 128, 2, 8)), jnp.ones((1, 128, 1, 8))
    pos, seg = jnp.arange(128)[None], jnp.ones((1, 128), jnp.int32)
    scores = kernels.Scores(Causal() & Document(), 0.3, 5.0, ALIBI)

    def both(q, k, v):
        out, lse = KERNEL.forward(q, k, v, pos, pos, seg, seg, scores=scores, masked=True)
        return KERNEL.backward(q, k, v, pos, pos, seg, seg, out, lse, out, scores=scores,
                               masked=True)

    assert hlo.count_executed(jax.jit(both).lower(q, kv, kv).compile().as_text(),
                              "conditional") == 0


@pytest.mark.parametrize("order", ["chunk", "shuffled"])
def test_tile_budget_is_exact_and_picked(order):
    """The flash kernel's tile budget (`TilePlan`) on one 32x32 block of 8x8 tiles (budget 40
    of 64): with a load-balanced chunk (tokens in order, packed documents) the causal and
    window masks' visible tiles fit and the budget is picked; with shuffled tokens they do
    not and every tile is walked. Either way forward and dq/dk/dv equal the reference."""
    kern = FlashKernel(q_tile=4, kv_tile=4)
    q, k, v, pos, seg, w = _packed()
    if order == "shuffled":
        perm = np.random.default_rng(4).permutation(32)
        q, k, v, pos, seg, w = (x[:, perm] for x in (q, k, v, pos, seg, w))
    plans = kern.partial_plans(32, 32)
    assert [p.budget for p in plans] == [40, None]
    assert FlashKernel(q_tile=4, kv_tile=4, tile_budget=False).partial_plans(32, 32) == plans[1:]
    for mask in (Causal() & Document(), Causal() & SlidingWindow(6) & Document()):
        scores = kernels.Scores(mask, 8 ** -0.5)
        tokens = (pos, pos, seg, seg)
        pick = int(kern.pick_plan(plans, scores, *tokens))
        assert pick == (0 if order == "chunk" else 1)

        out, lse = kern.forward(q, k, v, *tokens, scores=scores, masked=plans[pick])
        grads = kern.backward(q, k, v, *tokens, out, lse, w, scores=scores, masked=plans[pick])
        ref = functools.partial(dot_product_attention, q_positions=pos, kv_positions=pos,
                                q_segment_ids=seg, kv_segment_ids=seg, mask=mask)
        ref_out, vjp = jax.vjp(ref, q, k, v)
        _close((out, *grads), (ref_out, *vjp(w)), names=("out", "dq", "dk", "dv"))


# -- MLA: the latent on the wire --------------------------------------------------------------

def _mla_bytes(impl, latent_on_wire, cp=4):
    """Float bytes moved by collectives per device, forward + backward, mini DeepSeek-V3."""
    B, L, N, R, Hn, Hr, Hv = 2, 64, 4, 32, 16, 16, 32  # DeepSeek3Config.mini()'s attention
    p = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")
    sds = jax.ShapeDtypeStruct
    pos = sds((B, L), jnp.int32)
    kw = dict(partitioner=p, implementation=impl, kernel=KERNEL)

    def f(q, latent, k_pe, kv_up, pos):
        if latent_on_wire:
            o = mla_attention(q, latent, k_pe, kv_up, qk_nope_head_dim=Hn, q_positions=pos,
                              kv_positions=pos, **kw)
        else:  # the expanded per-head K/V cross the wire instead
            kv = jnp.einsum("bsr,rnd->bsnd", latent, kv_up)
            k = jnp.concatenate([kv[..., :Hn], jnp.broadcast_to(k_pe[:, :, None], (B, L, N, Hr))],
                                -1)
            o = attention(q, k, kv[..., Hn:], q_positions=pos, kv_positions=pos, **kw)
        return jnp.sum(o)

    args = (sds((B, L, N, Hn + Hr), jnp.float32), sds((B, L, R), jnp.float32),
            sds((B, L, Hr), jnp.float32), sds((R, N, Hn + Hv), jnp.float32), pos)
    text = jax.jit(jax.grad(f, (0, 1, 2, 3))).lower(*args).compile().as_text()
    moved = hlo.collective_bytes(text, floats_only=True)
    # all-reduce: kv_up's gradient summed over the sequence shards, the same in both programs
    # (any replicated weight's gradient is); the rest is the attention's own traffic
    return sum(b for kind, b in moved.items() if kind != "all-reduce"), (R + Hr) / (
        N * (Hn + Hr + Hv))


@pytest.mark.parametrize("impl", ["ring", "all_gather"])
def test_mla_sends_its_latent(impl):
    latent, ratio = _mla_bytes(impl, True)
    expanded, _ = _mla_bytes(impl, False)
    assert latent / expanded == pytest.approx(ratio, rel=1e-6), (latent, expanded, ratio)


# -- a user's mask trains mini DeepSeek-V3 under ring CP ----------------------------------------

def same_sentence_or_head(q_pos, kv_pos, q_seg, kv_seg):
    """Attend within the same 8-token "sentence", plus the document's first 4 tokens."""
    return (q_pos // 8 == kv_pos // 8) | (kv_pos < 4)


class SentenceMLA(MLA):
    mask = MaskFn(same_sentence_or_head) & Causal() & Document()


@pytest.mark.slow
def test_user_mask_trains_mini_deepseek3_under_ring():
    from zoo.models import deepseek3
    B, L = 2, 32
    layer = type("Layer", (deepseek3.DeepSeek3DecoderLayer,), {"attention_cls": SentenceMLA})
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 264, (B, L)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 12], B, 0))
    pos = jnp.asarray(np.repeat([list(range(20)) + list(range(12))], B, 0))
    targets = jnp.roll(tokens, -1, axis=1)

    def build(impl, partitioner):
        cfg = deepseek3.DeepSeek3Config.mini(num_hidden_layers=1, attention_implementation=impl)
        return deepseek3.DeepSeek3(cfg, inputs_shape=(B, L), partitioner=partitioner,
                                   rngs=nnx.Rngs(0), decoder_layer_cls=layer)

    def loss(model):
        logits, _ = model(tokens, positions=pos, segment_ids=seg)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    @jax.jit
    def value_and_grads(model):
        return nnx.value_and_grad(loss)(model)

    def step(model):  # plain SGD, one compiled program per model
        value, grads = value_and_grads(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params,
                                       nnx.state(grads, nnx.Param)))
        return value, value_and_grads(model)[0], grads

    p = zoo.Partitioner(zoo.make_mesh(context=4, fsdp=2), "cp")
    ring = build("ring", p)
    ref = build("reference", None)
    before, after, g_ring = step(ring)
    before_ref, _, g_ref = step(ref)
    assert np.isfinite(float(before)) and float(after) < float(before)
    np.testing.assert_allclose(float(before), float(before_ref), rtol=1e-5)
    leaves = lambda g: [np.asarray(x) for x in jax.tree.leaves(nnx.state(g, nnx.Param))]
    for a, b in zip(leaves(g_ring), leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5 * max(1.0, np.abs(b).max()))


# -- overlap: what each ring transfer waits for ------------------------------------------------

COMPUTE = ("scan", "while", "cond")  # the loop over sub-blocks (a fori_loop) holds the kernel


def _scan_consts(params) -> int:
    """How many of a scan body's inputs are constants: jax 0.10 says ``num_consts``; jax 0.12
    groups the inputs as (consts, carry, xs) in ``ft_in``."""
    if "num_consts" in params:
        return params["num_consts"]
    return len(params["ft_in"].unpack()[0])


def _scan_bodies(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"]  # ClosedJaxpr on jax 0.10, Jaxpr on jax 0.12
            yield getattr(body, "jaxpr", body), _scan_consts(eqn.params)
        for sub in jex.core.jaxprs_in_params(eqn.params):
            yield from _scan_bodies(sub)


def test_ring_transfers_are_independent_of_the_block_compute():
    """In the ring's scan bodies (jaxpr dependency analysis): the K/V (payload) sends depend on
    no block compute (the loop over sub-blocks) of the same step, so they can overlap it; in
    the backward, the block compute does not read the dK/dV accumulator that arrived from the
    previous step (it is only added at the end), so that transfer overlaps the compute too."""
    q, k, v, pos, seg, w = _packed()
    p = zoo.Partitioner(zoo.make_mesh(context=4, data=2), "cp")
    fn = functools.partial(attention, partitioner=p, implementation="ring", kernel=KERNEL)
    jaxpr = jax.make_jaxpr(lambda *a: _grads(fn, *a, None))(q, k, v, pos, seg, w).jaxpr
    bodies = list(_scan_bodies(jaxpr))
    bodies = [(b, n) for b, n in bodies if any(e.primitive.name == "ppermute" for e in b.eqns)]
    assert len(bodies) == 2  # forward and backward ring
    for body, num_consts in bodies:
        computed, reads = set(), {}  # vars derived from a block compute; invars each eqn reads
        index = {v: i for i, v in enumerate(body.invars)}
        deps = {v: {i} for v, i in index.items()}
        sends = []
        for eqn in body.eqns:
            ins = [x for x in eqn.invars if isinstance(x, jex.core.Var)]
            d = set().union(*(deps.get(x, set()) for x in ins))
            after = any(x in computed for x in ins)
            for o in eqn.outvars:
                deps[o] = d
                if after or eqn.primitive.name in COMPUTE:
                    computed.add(o)
            if eqn.primitive.name == "ppermute":
                sends.append((eqn, after))
            if eqn.primitive.name in COMPUTE:
                reads.setdefault("compute", set()).update(d)
        payload_sends = [e for e, after in sends if not after]
        assert payload_sends, "every K/V send waits for the block compute"
        acc_outs = {o for e, after in sends if after for o in e.outvars}
        acc_carry = {num_consts + i for i, o in enumerate(body.outvars)
                     if isinstance(o, jex.core.Var) and o in acc_outs}
        assert not (acc_carry & reads["compute"]), "the block compute reads the arriving dK/dV"
    assert any(after for e, after in sends)  # the backward does send an accumulator


# -- the ring's static hop plan under a sliding window -----------------------------------------

PLANS = {  # name: (layout, cp, window, the shard offsets the ring still moves)
    "contiguous-cp8": ("contiguous", 8, 7, (1,)),  # 8 tokens a shard: the window needs r-1
    "contiguous-cp4": ("contiguous", 4, 20, (1, 2)),  # 16 a shard, 19 back: r-1 and r-2
    "balanced-cp8": ("balanced", 8, 3, (1, 7)),  # chunks of 4: neighbours r-1 and r+1
}


def _window_data(L=64):
    """Two rows: documents of 13/30/9 tokens then padding, and one document of L tokens."""
    rng = np.random.default_rng(3)
    q, k, v, w = (jnp.asarray(rng.normal(size=(2, L, n, 8)), jnp.float32) for n in (4, 2, 2, 4))
    seg = np.array([[1] * 13 + [2] * 30 + [3] * 9 + [0] * (L - 52), [1] * L])
    pos = np.array([[*range(13), *range(30), *range(9), *[0] * (L - 52)], list(range(L))])
    return q, k, v, jnp.asarray(pos, jnp.int32), jnp.asarray(seg, jnp.int32), w


def test_reach_and_hop_plan():
    window = Causal() & SlidingWindow(7) & Document()
    assert window.reach().sequence() == (6, 0)
    assert (Chunked(4) & Document()).reach().sequence() == (3, 3)
    assert (window | (Chunked(4) & Document())).reach().sequence() == (6, 3)
    for unbounded in (Causal() & SlidingWindow(7), Causal() & Document(), PrefixLM() & Document(),
                      MaskFn(_sentence) & Document(), window | Document()):
        assert ring.hop_plan(unbounded.reach(), "contiguous", 8, 64) is None, unbounded
    assert ring.hop_plan(window.reach(), None, 8, 64) is None  # layout unknown: full ring
    assert ring.hop_plan(window.reach(), "contiguous", 8, 16) == (1, 2, 3)  # 2 a shard
    assert ring.hop_plan(window.reach(), "contiguous", 8, 8) == (1, 2, 3, 4, 5, 6)
    wide = Causal() & SlidingWindow(8) & Document()
    assert ring.hop_plan(wide.reach(), "contiguous", 8, 8) is None  # every hop: the full ring
    assert ring.hop_plan((Chunked(4) & Document()).reach(), "contiguous", 8, 64) == (1, 7)
    with pytest.raises(ValueError, match="layout='zigzag'"):
        ring.hop_plan(window.reach(), "zigzag", 8, 64)


@pytest.mark.parametrize("name", list(PLANS))
def test_sliding_window_ring_moves_only_visible_hops(name):
    """With a layout and a sliding window the ring fetches only the blocks in the plan: forward
    and dq/dk/dv equal the dense reference, and each fallback `conditional`'s planned branch
    moves len(hops)/cp of the full ring's float bytes (forward K/V; backward K/V and dK/dV).
    Tokens in another order fail the plan's check and run the full ring, exactly."""
    layout, cp, window, hops = PLANS[name]
    mask = Causal() & SlidingWindow(window) & Document()
    assert ring.hop_plan(mask.reach(), layout, cp, 64) == hops
    p = zoo.Partitioner(zoo.make_mesh(context=cp, data=8 // cp), "cp")
    fn = functools.partial(attention, mask=mask, partitioner=p, implementation="ring",
                           kernel=KERNEL, layout=layout)
    ref = jax.jit(lambda *a: _grads(functools.partial(dot_product_attention, mask=mask), *a,
                                    None)[:4])
    balanced = np.concatenate([np.concatenate([c[r], c[2 * cp - 1 - r]]) for c in
                               [np.arange(64).reshape(2 * cp, -1)] for r in range(cp)])
    orders = (np.arange(64), balanced)[::1 if layout == "contiguous" else -1]
    data = _window_data()
    args = [tuple(x[:, o] for x in data) for o in orders]  # the layout's order, then the other
    prog = jax.jit(lambda *a: _grads(fn, *a, None)[:4]).lower(*args[0]).compile()
    for a, planned in zip(args, (True, False)):
        assert bool(ring.sequence_order_ok(layout, cp, a[3], a[3], a[4], a[4])) == planned
        _close(prog(*a), ref(*a))
    _check_plan_overlap(jax.make_jaxpr(lambda *a: _grads(fn, *a, None))(*args[0]).jaxpr,
                        len(hops))
    text = prog.as_text()
    permutes = lambda comp: hlo.collective_bytes(text, True, root=comp).get(
        "collective-permute", 0)
    fallbacks = [b for b in hlo.branches(text) if all(map(permutes, b))]
    assert len(fallbacks) == 2  # forward and backward
    for full, plan in fallbacks:
        assert permutes(plan) * cp == permutes(full) * len(hops), (permutes(plan),
                                                                   permutes(full))


def test_sliding_window_ring_hops_over_two_mesh_axes():
    """ep_as_cp shards the sequence over ("context", "expert"), the reverse of the mesh's axis
    order: the hop plan's sends go to the shards it names in sequence order (`ring.ring_perm`),
    so forward and dq/dk/dv equal the dense reference (jax 0.10 numbered the ppermute group in
    mesh order and this was off by whole blocks; jax 0.12 refuses such a ppermute)."""
    mask = Causal() & SlidingWindow(20) & Document()
    assert ring.hop_plan(mask.reach(), "contiguous", 4, 64) == (1, 2)
    p = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    fn = functools.partial(attention, mask=mask, partitioner=p, implementation="ring",
                           kernel=KERNEL, layout="contiguous")
    data = _window_data()
    got = jax.jit(lambda *a: _grads(fn, *a, None)[:4])(*data)
    _close(got, _grads(functools.partial(dot_product_attention, mask=mask), *data, None)[:4])


def _sends(jaxpr):
    return any(e.primitive.name == "ppermute" or any(map(_sends, jex.core.jaxprs_in_params(
        e.params))) for e in jaxpr.eqns)


def _planned_branches(jaxpr):
    """The planned branch of every fallback `cond` (both branches send) in a jaxpr."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            branches = [b.jaxpr for b in eqn.params["branches"]]
            if all(map(_sends, branches)):
                yield branches[1]
                continue
        for sub in jex.core.jaxprs_in_params(eqn.params):
            yield from _planned_branches(sub)


def _check_plan_overlap(jaxpr, hops):
    """The hop plan's overlap, by jaxpr dependencies: every K/V send depends on no block
    compute, and the dK/dV sent home (which does) is never read by a later block compute."""
    branches, counts = list(_planned_branches(jaxpr)), []
    assert len(branches) == 2  # forward and backward
    for body in branches:
        computed, sent_home, kv_sends, home_sends = set(), set(), 0, 0
        for eqn in body.eqns:
            ins = [x for x in eqn.invars if isinstance(x, jex.core.Var)]
            compute = eqn.primitive.name in COMPUTE
            assert not (compute and any(x in sent_home for x in ins)), "compute reads dK/dV"
            after = any(x in computed for x in ins)
            if eqn.primitive.name == "ppermute":
                kv_sends += not after
                home_sends += after
            for o in eqn.outvars:
                if after or compute:
                    computed.add(o)
                if (eqn.primitive.name == "ppermute" and after) or any(
                        x in sent_home for x in ins):
                    sent_home.add(o)
        counts.append((kv_sends, home_sends))
    # per hop: k, v, positions, segments fetched (forward and backward), dK and dV sent home
    assert sorted(counts) == [(4 * hops, 0), (4 * hops, 2 * hops)], counts
