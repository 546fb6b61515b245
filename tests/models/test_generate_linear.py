"""Generation for the hybrid linear-attention families (Qwen3-Next, Qwen3.5-MoE).

* transformers' ``generate(do_sample=False)`` on tiny random checkpoints of both families
  (one gated DeltaNet layer, one gated attention layer; norms perturbed off their zero init):
  zoo's greedy tokens for a batch of two left-padded prompts of different lengths (one
  shorter than the convolution's window) equal transformers' for each prompt run alone, and
  every step's cached logits equal transformers' no-cache forward over prompt +
  continuation (fp32, relative error < 1e-4 as the conformance suite's logits); under
  ``ep_as_cp`` on 8 virtual devices the tokens are still transformers' (slow);
* the cache of a gated DeltaNet layer: its arrays do not grow with the context (a float32
  state and a convolution window), and `GatedDeltaNet.prefill_cache` over packed rows in a
  shuffled order (two documents, padding in the middle and at the end) then
  ``decode_step`` continues each row's last document exactly as a full forward over that
  document does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo.inference as G
from support import rel_err
from zoo.inference.cache import KVCache
from zoo.layers.gated_deltanet import GatedDeltaNet
from zoo.models import qwen3_5_moe, qwen3_next
from zoo.partitioning import Partitioner, make_mesh

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from test_conformance import QWEN3_NEXT_CONFIG  # noqa: E402 -- needs transformers

NEW = 8
# the second prompt (2 tokens) is shorter than the convolution's window (3): left padding
# must not leak into it
PROMPTS = [[5, 17, 33, 2, 40, 9, 11], [50, 14]]
TINY = dict(QWEN3_NEXT_CONFIG, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"])
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
FAMILIES = {
    "qwen3_next": (qwen3_next, lambda: transformers.Qwen3NextConfig(
        **TINY, intermediate_size=48, rope_parameters=ROPE)),
    "qwen3_5_moe": (qwen3_5_moe, lambda: transformers.Qwen3_5MoeTextConfig(
        **TINY, rope_parameters=ROPE)),
}


_CHECKPOINTS: dict = {}


def _hf_checkpoint(name, tmp_path_factory):
    """A tiny random transformers model (norms and biases perturbed, as the conformance
    suite does), saved, and its greedy tokens for each prompt run alone: (path, model,
    tokens), made once per family."""
    if name not in _CHECKPOINTS:
        _CHECKPOINTS[name] = _make_checkpoint(name, tmp_path_factory)
    return _CHECKPOINTS[name]


def _make_checkpoint(name, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[name][1]())
    model = model.float().eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith((".bias", "_bias")):
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(f"{name}_gen")
    model.save_pretrained(path)
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            seq = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            tokens.append(seq[0, len(prompt):].tolist())
    return path, model, tokens


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_equals_transformers_and_cached_logits_equal_full_forward(name,
                                                                         tmp_path_factory):
    path, hf_model, want = _hf_checkpoint(name, tmp_path_factory)
    model = FAMILIES[name][0].from_hf(path)
    kinds = [type(layer.self_attn).__name__ for layer in model.layers]
    assert kinds == ["GatedDeltaNet", "GatedAttention"]
    tokens, logits = G.generate_with_logits(model, PROMPTS, max_new_tokens=NEW)
    assert tokens == want
    # every step's logits against transformers' no-cache forward over prompt + continuation
    for i, (p, t) in enumerate(zip(PROMPTS, tokens)):
        with torch.no_grad():
            full = hf_model(torch.tensor([p + t])).logits[0].numpy()
        ref = full[len(p) - 1:len(p) - 1 + NEW]
        err = np.abs(logits[i] - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
        assert err.max() < 1e-4, f"{name} prompt {i}: step {err.argmax()} rel err {err.max()}"
    # the linear layer's cache is constant in the context; the full layer's is K/V per slot
    short, long = (KVCache.shapes(model, 2, n) for n in (16, 4096))
    linear, full_attn = short.layers
    assert linear == long.layers[0]
    assert linear["state"].dtype == jnp.float32
    assert linear["state"].shape == (1, 2, 4, 8, 8)  # [n, B, Hv, Dk, Dv]
    assert linear["conv"].shape == (1, 2, 3, 2 * 2 * 8 + 4 * 8)  # [n, B, W-1, C]
    assert full_attn["k"].shape[3] == 16 and long.layers[1]["k"].shape[3] == 4096


@pytest.mark.slow
def test_ep_as_cp_greedy_equals_transformers(tmp_path_factory, devices):
    """Prefill under ep_as_cp (the linear layers' context-parallel op, the attention's ring or
    all-gather), decode with the cache sharded: transformers' tokens still."""
    path, _, want = _hf_checkpoint("qwen3_next", tmp_path_factory)
    p = Partitioner(make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    model = qwen3_next.from_hf(path, partitioner=p)
    assert G.generate(model, PROMPTS, max_new_tokens=NEW) == want


# -- the layer: prefill over packed, shuffled rows, then decode ------------------------------

D, HK, HV, DK, DV, W = 16, 2, 4, 8, 8, 4


class _Cache:
    """`zoo.layers.attention.LayerCache` over one layer's arrays (no stack axis)."""

    def __init__(self, arrays):
        self.arrays = dict(arrays)

    def __call__(self, name, new):
        raise AssertionError("a gated DeltaNet layer has no slotted arrays")

    def read(self, name):
        return self.arrays[name]

    def replace(self, name, value):
        assert value.shape == self.arrays[name].shape, name
        self.arrays[name] = value


@pytest.mark.parametrize("projections", ["interleaved", "separate"])
def test_deltanet_prefill_then_decode_equals_full_forward_on_packed_rows(projections):
    """Row 0: document 1 (5 tokens), padding, document 2 (2 tokens, shorter than the window),
    padding; row 1: document 1 (3 tokens) then document 2 (6 tokens); both rows shuffled.
    The cache continues each row's last document: decoding 3 tokens one at a time gives the
    outputs a full forward over (document 2 + those tokens) gives, in float32."""
    layer = GatedDeltaNet(num_key_heads=HK, num_value_heads=HV, key_head_dim=DK,
                          value_head_dim=DV, conv_kernel=W, inputs_shape=(2, 12, D),
                          partitioner=None, projections=projections, rngs=nnx.Rngs(0))
    seg = np.array([[1] * 5 + [0] * 2 + [2] * 2 + [0] * 3, [1] * 3 + [2] * 6 + [0] * 3])
    pos = np.array([[0, 1, 2, 3, 4, 0, 0, 0, 1, 0, 0, 0], [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 0, 0]])
    rng = np.random.RandomState(0)
    x = rng.randn(2, 12, D).astype(np.float32)
    new = rng.randn(2, 3, D).astype(np.float32)
    perm = np.stack([rng.permutation(12) for _ in range(2)])
    shuffled = [np.take_along_axis(a, perm if a.ndim == 2 else perm[..., None], axis=1)
                for a in (x, seg, pos)]
    _, cache = jax.jit(lambda *a: layer.prefill_cache(
        a[0], segment_ids=a[1], positions=a[2]))(*map(jnp.asarray, shuffled))
    assert cache["state"].dtype == jnp.float32
    assert cache["conv"].shape == (2, W - 1, layer.conv_dim)

    @jax.jit
    def step(t, arrays):
        io = _Cache(arrays)
        return layer.decode_step(t, io, q_positions=None), io.arrays

    got = []
    for t in range(3):
        y, cache = step(jnp.asarray(new[:, t:t + 1]), cache)
        got.append(np.asarray(y))
    got = np.concatenate(got, axis=1)
    # the reference: each row's last document + the new tokens alone, right-padded to 9
    docs = np.zeros((2, 9, D), np.float32)
    docs[0, :5] = np.concatenate([x[0, 7:9], new[0]])
    docs[1] = np.concatenate([x[1, 3:9], new[1]])
    seg_ref = np.array([[1] * 5 + [0] * 4, [1] * 9])
    pos_ref = np.array([[0, 1, 2, 3, 4, 0, 0, 0, 0], list(range(9))])
    full = np.asarray(jax.jit(lambda *a: layer(a[0], segment_ids=a[1], positions=a[2]))(
        *map(jnp.asarray, (docs, seg_ref, pos_ref))))
    want = np.stack([full[0, 2:5], full[1, 6:9]])
    assert rel_err(got, want) < 1e-5, (projections, rel_err(got, want))


# -- the ops generation uses ------------------------------------------------------------------

def test_returned_state_continued_by_recurrent_step_equals_one_long_pass():
    """``gated_delta_rule(return_state=True)`` (chunked and recurrent) over packed rows with
    padding, then `recurrent_step` over 3 more tokens of each row's last document, equals the
    recurrent op over that whole document; `conv_tail` is its last inputs, zeros before it."""
    from zoo.ops import gated_delta as gd
    rng = np.random.RandomState(1)
    B, L, T = 2, 10, 3
    seg = np.array([[1] * 4 + [2] * 3 + [0] * 3, [0] * 8 + [1] * 2])  # right and left padded
    pos = np.array([[0, 1, 2, 3, 0, 1, 2, 0, 0, 0], [0] * 8 + [0, 1]])

    def inputs(n):
        q, k = (rng.randn(B, n, HK, DK).astype(np.float32) for _ in range(2))
        v = rng.randn(B, n, HV, DV).astype(np.float32)
        g = -np.abs(rng.randn(B, n, HV)).astype(np.float32)
        beta = (1 / (1 + np.exp(-rng.randn(B, n, HV)))).astype(np.float32)
        return [q, k, v, g, beta]

    xs, more = inputs(L), inputs(T)
    rule = jax.jit(gd.gated_delta_rule, static_argnames=("implementation", "return_state"))
    kw = dict(segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos), return_state=True)
    o_c, s_c = rule(*xs, **kw)
    o_r, s_r = rule(*xs, implementation="recurrent", **kw)
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5
    o_more, _ = jax.jit(gd.recurrent_step)(s_c, *more)
    # the reference: each row's last document + the new tokens alone, right-padded to 6
    last = [slice(4, 7), slice(8, 10)]
    docs = [np.zeros((B, 6, *x.shape[2:]), np.float32) for x in xs]
    for b in range(B):
        n = last[b].stop - last[b].start + T
        for d, x, m in zip(docs, xs, more):
            d[b, :n] = np.concatenate([x[b, last[b]], m[b]])
    want = rule(*docs, segment_ids=jnp.asarray([[1] * 6, [1] * 5 + [0]]),
                positions=jnp.asarray([list(range(6)), [0, 1, 2, 3, 4, 0]]),
                implementation="recurrent")
    assert rel_err(o_more, np.stack([want[0, 3:6], want[1, 2:5]])) < 1e-5
    tail = np.asarray(gd.conv_tail(jnp.asarray(xs[2].reshape(B, L, -1)), 3,
                                   segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos)))
    flat = xs[2].reshape(B, L, -1)
    np.testing.assert_array_equal(tail[0], flat[0, 4:7])
    np.testing.assert_array_equal(tail[1], np.concatenate([np.zeros_like(flat[1, :1]),
                                                           flat[1, 8:10]]))
    with pytest.raises(ValueError, match="state"):
        gd.recurrent_step(s_c[:, :1], *map(jnp.asarray, more))
