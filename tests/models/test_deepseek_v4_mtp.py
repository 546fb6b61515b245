"""DeepSeek-V4's multi-token prediction (`zoo.models.deepseek_v4.DeepSeekV4MTP`, DeepSeek's
``MTPBlock``; transformers builds none, so the references are written here):

* `zoo.train.step.loss_fn`'s objective, ``aux["mtp_loss"]`` and every parameter's gradient
  equal a plain computation of DeepSeek's formula on rows packing two documents, two modules
  deep (the second reads the first's streams): ``e_proj(enorm(embed(token d ahead)))`` added
  to each stream of ``h_proj(hnorm(streams))``, the module's decoder layer, its own hyper
  head (sigmoid mix) and norm, the shared head, targets shifted within each document by
  hand;
* the MTP tensors round-trip in DeepSeek's published names (``mtp.0.e_proj.weight``,
  ``mtp.0.hc_head_fn``, ``mtp.0.attn.kv_norm.weight``, ...), config.json carries their
  attention kinds (the published ``compress_ratios``' trailing entries too), transformers
  loads the export and skips them (its logits equal the trunk's), and a checkpoint without
  them leaves the modules freshly initialised, with a warning;
* V4-Flash's count: transformers' meta-device count excludes MTP and equals the published
  "284B"; the preset (one module, as published) adds exactly one sliding routed layer and
  the module's own tensors;
* speculative decoding (``speculative="mtp"``) gives plain greedy decoding's tokens with
  drafts rejected, accepted, or both; construction errors.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conformance import assert_same_variables, close, hf_param_count
from support import rel_err
from zoo.models import deepseek_v4 as v4
from zoo.models import hf
from zoo.models.decoder import abstract_rngs
from zoo.train.step import loss_fn

SLIDING, CSA, HCA = v4.SLIDING, v4.CSA, v4.HCA
B, L = 2, 16
DOCS = [(9, 7), (16, 0)]  # per row: two documents, or one filling it


def _config(**kw):
    return v4.DeepSeekV4Config.mini(**{**dict(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, head_dim=16, qk_rope_head_dim=4, q_lora_rank=16,
        o_lora_rank=8, n_routed_experts=4, layer_types=(SLIDING,), compress_rate_hca=4,
        sliding_window=4, index_n_heads=2, index_head_dim=8, index_topk=2,
        num_nextn_predict_layers=2, mtp_layer_types=(SLIDING, SLIDING)), **kw})


def _make(cfg, seed):
    """A model of `cfg` with random values straight from numpy (no initialisation program
    to compile): kernels N(0, 0.1), norm and mixing scales 1 + N(0, 0.3), biases, bases and
    sinks N(0, 0.3), a hash table of distinct experts per token."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(v4.DeepSeekV4.abstract(cfg))
    for path, var in nnx.to_flat_state(state):
        shape, name = var.get_value().shape, str(path[-1])
        if name == "tid2eid":
            E, k = cfg.n_routed_experts, shape[-1]
            value = np.stack([rng.permutation(E)[:k] for _ in range(int(np.prod(shape[:-1])))])
            value = value.reshape(shape).astype(np.int32)
        elif name in ("scale", "hc_scale"):
            value = 1.0 + 0.3 * rng.standard_normal(shape)
        elif name in ("base", "hc_base", "sinks", "e_score_correction_bias", "position_bias"):
            value = 0.3 * rng.standard_normal(shape)
        else:
            value = 0.1 * rng.standard_normal(shape)
        var.set_value(jnp.asarray(value, var.get_value().dtype))
    return nnx.merge(graphdef, state)


def _batch():
    rng = np.random.default_rng(0)
    inputs, targets, pos, seg = (np.zeros((B, L), np.int32) for _ in range(4))
    for b, docs in enumerate(DOCS):
        at = 0
        for s, n in enumerate(docs, 1):
            if n:
                doc = rng.integers(2, 64, size=n + 1)
                inputs[b, at:at + n], targets[b, at:at + n] = doc[:-1], doc[1:]
                pos[b, at:at + n], seg[b, at:at + n] = np.arange(n), s
                at += n
    return dict(inputs=inputs, targets=targets, positions=pos, segment_ids=seg,
                loss_weights=np.ones((B, L), np.float32))


def _shifted(batch, depth):
    """By hand, per depth d: the token d ahead (input of module d), the token d + 1 ahead
    (its target) and whether both lie in the position's document."""
    tok, tgt, ok = (np.zeros((depth, B, L), t) for t in (np.int32, np.int32, np.float32))
    seg = batch["segment_ids"]
    for d in range(depth):
        for b in range(B):
            for i in range(L):
                j = i + d + 1  # the index of the target: the token d + 1 ahead of i
                if j < L and seg[b, j] == seg[b, i]:
                    tok[d, b, i], tgt[d, b, i] = batch["targets"][b, j - 1], batch["targets"][b, j]
                    ok[d, b, i] = 1.0
    return tok, tgt, ok


def _rms(x, scale, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _hyper_head(x, head, eps, norm_eps):
    """DeepSeek's ``hc_head``: sigmoid weights from the RMS-normed flattened streams."""
    flat = x.reshape(*x.shape[:2], -1)
    mix = (flat @ head.hc_fn[...]) * jax.lax.rsqrt(jnp.mean(flat * flat, -1, keepdims=True)
                                                   + norm_eps)
    pre = jax.nn.sigmoid(mix * head.hc_scale[...] + head.hc_base[...]) + eps
    return jnp.sum(pre[..., None] * x, axis=2)


def _reference_objective(model, batch, shifted):
    """Cross-entropy + 0.3 x the mean MTP cross-entropy, the MTP path written out from
    DeepSeek's ``MTPBlock.forward`` (the decoder layers are the model's own: each equals
    transformers' in test_deepseek_v4)."""
    c = model.config
    tok, tgt, ok = shifted
    args = dict(positions=batch["positions"], segment_ids=batch["segment_ids"])
    head = lambda x, norm: _rms(_hyper_head(x, norm[0], c.hc_eps, c.rms_norm_eps),
                                norm[1].scale[...], c.rms_norm_eps) @ model.lm_head.kernel[...]

    def ce(logits, targets, w):
        logp = jax.nn.log_softmax(logits, -1)
        picked = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        return -jnp.sum(picked * w) / jnp.sum(w)

    x, _ = model.streams(batch["inputs"], args["positions"], args["segment_ids"])
    main = ce(head(x, (model.hc_head, model.norm)), batch["targets"], batch["loss_weights"])
    table = model.embed_tokens.embedding[...]
    mtp = []
    for d, m in enumerate(model.mtp):
        e = _rms(table[tok[d]], m.enorm.scale[...], c.rms_norm_eps) @ m.e_proj.kernel[...]
        h = _rms(x, m.hnorm.scale[...], c.rms_norm_eps) @ m.h_proj.kernel[...]
        x, _ = m.layer(e[:, :, None] + h, tokens=jnp.asarray(tok[d]), **args)
        mtp.append(ce(head(x, (m.hc_head, m.norm)), tgt[d], ok[d]))
    return main + 0.3 * sum(mtp) / len(mtp), sum(mtp) / len(mtp)


@pytest.fixture(scope="module")
def trained():
    return _make(_config(), 0)


def _objectives(model, batch, shifted):
    def ours(m):
        obj, (_ce, _aux_loss, aux) = loss_fn(m, batch)
        return obj, aux["mtp_loss"]
    return ours, lambda m: _reference_objective(m, batch, shifted)


def _inputs(depth=2):
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    return batch, tuple(jnp.asarray(a) for a in _shifted(_batch(), depth))


@pytest.mark.slow  # ~17 s on a loaded 2-core box (load 6): the compile of both objectives
def test_mtp_loss_equals_a_plain_reference(trained):
    batch, shifted = _inputs()
    assert float(shifted[2][0].sum()) == 9 - 1 + 7 - 1 + 16 - 1  # in-document pairs only
    assert float(shifted[2][1].sum()) == 9 - 2 + 7 - 2 + 16 - 2
    ours, theirs = _objectives(trained, batch, shifted)
    (obj, mtp), (want_obj, want_mtp) = jax.jit(lambda m: (ours(m), theirs(m)))(trained)
    np.testing.assert_allclose(float(mtp), float(want_mtp), rtol=1e-5)
    np.testing.assert_allclose(float(obj), float(want_obj), rtol=1e-5)
    assert 3.0 < float(want_mtp) < 6.0  # a random model's loss over 64 tokens, ~log(64) = 4.2


@pytest.mark.slow  # one compile of two gradients, each through 2 V4 layers
def test_mtp_gradients_equal_a_plain_reference():
    """One module (the chain is in the loss test): the MTP module's every parameter."""
    model = _make(_config(num_nextn_predict_layers=1), 1)
    batch, shifted = _inputs(depth=1)
    ours, theirs = _objectives(model, batch, shifted)
    # the MTP modules' parameters (the trunk's gradients are transformers-checked elsewhere)
    wrt = nnx.DiffState(0, nnx.All(nnx.Param, nnx.PathContains("mtp")))
    grad = lambda f: nnx.grad(f, argnums=wrt, has_aux=True)
    (g, _), (want_g, _) = jax.jit(lambda m: (grad(ours)(m), grad(theirs)(m)))(model)
    got, want = nnx.to_flat_state(g), dict(nnx.to_flat_state(want_g))
    assert len(got) == 31 and all(p[0] == "mtp" for p, _ in got)
    # fp32: errors against the largest gradient (a tiny one, e.g. a hyper head's scale, is a
    # difference of large terms and carries their rounding)
    scale = max(float(jnp.abs(w[...]).max()) for w in want.values())
    for path, v in got:
        w = np.asarray(want[path][...], np.float64)
        err = float(np.abs(np.asarray(v[...], np.float64) - w).max())
        assert err <= 1e-5 * scale or close(v[...], w), \
            f"gradient of {path}: error {err:.2e}, rel {rel_err(v[...], w):.2e}"
    assert min(float(jnp.abs(v[...]).max()) for _, v in got) > 0  # every one reached


PUBLISHED = ["mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight",
             "mtp.0.hnorm.weight", "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_head_base",
             "mtp.0.hc_head_scale", "mtp.0.attn_norm.weight", "mtp.0.attn.wq_a.weight",
             "mtp.0.attn.kv_norm.weight", "mtp.0.attn.attn_sink",
             "mtp.0.attn.compressor.norm.weight", "mtp.0.attn.indexer.weights_proj.weight",
             "mtp.0.ffn.gate.weight", "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.3.w2.weight",
             "mtp.0.ffn.shared_experts.w1.weight", "mtp.0.hc_attn_fn", "mtp.0.hc_ffn_scale"]


@pytest.mark.slow  # ~18 s on a loaded 2-core box: transformers' load and both forwards
def test_mtp_round_trip_in_published_names(tmp_path):
    """One CSA module (its compressor and indexer): to_hf writes DeepSeek's names and the
    attention kind, from_hf reads the same variables back, transformers loads the folder
    (skipping ``mtp.*``: its logits are the trunk's)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = _config(num_nextn_predict_layers=1, mtp_layer_types=(CSA,))
    model = _make(cfg, 3)
    v4.to_hf(model, tmp_path)
    keys = set(hf.CheckpointReader(tmp_path).keys())
    mtp = {k for k in keys if k.startswith("mtp.")}
    assert set(PUBLISHED) <= mtp and not any(".self_attn." in k or ".mlp." in k for k in mtp)
    assert json.loads((tmp_path / "config.json").read_text())["mtp_layer_types"] == [CSA]
    back = v4.from_hf(tmp_path)
    assert back.config == model.config
    assert_same_variables(model, back)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (1, L))
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    got = jax.jit(lambda m, t: m(t)[0])(model, jnp.asarray(tokens))
    assert rel_err(got, want) < 1e-4


@pytest.mark.slow  # ~13 s on a loaded 2-core box: two initialisation programs
def test_checkpoint_without_mtp_starts_it_fresh(tmp_path):
    cfg = _config(num_nextn_predict_layers=0)
    model = _make(cfg, 3)
    v4.to_hf(model, tmp_path)
    with pytest.warns(UserWarning, match=r"no MTP module under \['mtp.0.'\]"):
        back = v4.from_hf(tmp_path, config_overrides=dict(num_nextn_predict_layers=1,
                                                          mtp_layer_types=None))
    fresh = jax.jit(lambda: v4.DeepSeekV4(back.config, rngs=abstract_rngs()))()
    assert_same_variables(back.mtp, fresh.mtp)  # the constructor's values
    assert_same_variables(back.layers, model.layers)


def test_published_config_gives_the_mtp_attention_kind():
    cfg = _config().to_hf_config()
    for k in ("layer_types", "mtp_layer_types", "compress_rates", "rope_parameters",
              "mlp_layer_types"):
        cfg.pop(k)
    cfg.update(compress_ratios=[0, 8, 4], compress_rate_hca=8, num_hash_layers=1,
               qk_rope_head_dim=4, rope_theta=10000.0)
    got = v4.DeepSeekV4Config.from_hf_config(cfg)  # the trunk's layer, then the 2 MTP layers'
    assert got.layer_types == (SLIDING,) and got.mtp_layer_types == (HCA, CSA)
    cfg.update(compress_ratios=[0])  # no trailing entries: sliding, as V4-Flash's 0
    assert v4.DeepSeekV4Config.from_hf_config(cfg).mtp_attention_types == (SLIDING, SLIDING)


@pytest.mark.slow  # ~12 s: two meta-device builds of V4-Flash in transformers
def test_flash_count_with_mtp():
    """transformers' meta-device count has no MTP and is the published "284B"; the preset's
    module adds one sliding routed V4 layer (transformers' count of a 44-layer model whose
    last layer is that, less the 43-layer one) and e_proj, h_proj, 3 norms, a hyper head."""
    flash = v4.DeepSeekV4Config.deepseek_v4_flash()
    assert flash.num_nextn_predict_layers == 1 and flash.mtp_attention_types == (SLIDING,)
    trunk = dataclasses.replace(flash, num_nextn_predict_layers=0)
    published = hf_param_count(trunk)
    assert published == 284_332_230_231 == trunk.num_params()
    longer = dataclasses.replace(trunk, num_hidden_layers=44,
                               layer_types=(*flash.layer_types, SLIDING),
                               mlp_layer_types=(*flash.mlp_layer_types, "moe"))
    layer = hf_param_count(longer) - published
    D, n = flash.hidden_size, flash.hc_mult
    extras = 2 * D * D + 3 * D + (n * D * n + n + 1)
    assert flash.num_params() == 284_332_230_231 + layer + extras == 290_942_278_866


# CSA in the trunk and in the MTP layer (the sliding window, the compressor with its carried
# overlap, the indexer's keys; HCA's state is a subset): every kind of state a verify step
# must take a rejected draft back out of. (A sliding layer's alone heals: the next step
# rewrites the rejected position's ring slot before reading it; the carried overlap does
# not.) 3 Sinkhorn iterations: the compiles halve.
SPEC_CONFIG = dict(num_hidden_layers=1, layer_types=(CSA,), mlp_layer_types=("moe",),
                   num_nextn_predict_layers=1, mtp_layer_types=(CSA,),
                   max_position_embeddings=64, hc_sinkhorn_iters=3)
# lengths 9, 2, 5: windows of 4 open at different places per row; 14 new tokens close several
# more, drafts included
SPEC_PROMPTS = [[5, 17, 33, 2, 40, 9, 11, 30, 3], [21, 8], [3, 60, 14, 27, 50]]


def _drafting(model, attention_scale: float):
    """`model` made to draft well (DeepSeek-V3's test_speculative construction for V4): every
    MoE's output zeroed, ``h_proj`` zero, ``e_proj`` the identity and ``enorm`` unweighted, the
    MTP's ``norm`` the trunk's. Streams then carry the token's embedding (scaled, which the
    norms undo) plus attention: with ``attention_scale=0`` the MTP module predicts exactly the
    trunk's next choice; scaled down (trunk's and MTP's attention alike) it agrees some of the
    time, and the attention over the caches still moves the tokens."""
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, path))
        if name.endswith(("mlp/wo", "shared_experts/down/kernel")) or \
                name == "mtp/0/h_proj/kernel":
            v[...] = jnp.zeros_like(v[...])
        elif name.endswith("o_b_proj/kernel"):
            v[...] = v[...] * attention_scale
        elif name == "mtp/0/e_proj/kernel":
            v[...] = jnp.eye(v[...].shape[0], dtype=v[...].dtype)
        elif name == "mtp/0/enorm/scale":
            v[...] = jnp.ones_like(v[...])
        elif name == "mtp/0/norm/scale":
            v[...] = model.norm.scale[...]
    return model


@pytest.fixture(scope="module")
def spec_config():
    """Module-scoped so the cases run on one xdist worker: the first compiles the plain and
    speculative programs, the others (the same shapes) reuse them."""
    return _config(**SPEC_CONFIG)


@pytest.mark.slow  # the first case 13-28 s on a loaded 2-core box (four compiles), the rest ~3 s
@pytest.mark.parametrize("attention_scale", [None, 0.0, 0.8])
def test_speculative_decoding_equals_plain_greedy(spec_config, attention_scale):
    """`zoo.inference.generate(..., speculative="mtp")` gives plain greedy decoding's tokens,
    prompts of three lengths in one batch, whether drafts are rejected (random weights: the
    rejected draft's token, taken into every layer's sliding window, open windows, carried
    overlap, compressed entries and index keys, must leave no trace), all accepted (a model
    whose MTP predicts the trunk) or both, rows advancing apart."""
    import zoo.inference as G
    import zoo.inference.speculative as S
    model = _make(spec_config, 3)
    if attention_scale is not None:
        model = _drafting(model, attention_scale)
    plain = G.generate(model, SPEC_PROMPTS, max_new_tokens=14)
    tokens, stats = S.generate_speculative(model, SPEC_PROMPTS, max_new_tokens=14)
    assert tokens == plain
    assert len({t for row in plain for t in row}) > 3, plain  # not one repeated token
    assert stats.tokens == sum(map(len, tokens)) == 3 * 14
    assert stats.tokens == stats.rows + stats.drafted + stats.accepted - stats.discarded
    rejected = stats.drafted - stats.accepted
    if attention_scale is None:
        assert rejected > 0.8 * stats.drafted, str(stats)
    elif attention_scale == 0:
        assert rejected == 0 and stats.steps == 7, str(stats)
    else:
        assert 0 < stats.accepted and 0 < rejected, str(stats)
    if attention_scale is not None:  # the MTP's cache: its drafts are the uncached module's
        assert (stats.drafted, stats.accepted) == _draft_counts(model, plain, 14), str(stats)


@jax.jit
def _mtp_logits(model, tokens, positions, segment_ids, ahead):
    return model(tokens, positions=positions, segment_ids=segment_ids,
                 mtp_tokens=ahead)[1]["mtp_logits"][0]


def _draft_counts(model, continuations, new):
    """(drafted, accepted) of speculative decoding with the drafts taken from the model's full
    forward (``mtp_logits``, no cache) over each prompt + continuation ``S``: the draft for
    ``S[j]`` is the MTP's argmax at position ``j - 2`` (it reads ``S[j - 1]``); a row drafts
    ``S[n + 1]`` after prefill, then after accepting ``S[j]`` it drafts ``S[j + 2]``, after
    rejecting it ``S[j + 1]``, until it holds `new` tokens."""
    seqs = [p + c for p, c in zip(SPEC_PROMPTS, continuations, strict=True)]
    width = max(map(len, seqs)) + 1
    tokens, seg = np.zeros((len(seqs), width), np.int32), np.zeros((len(seqs), width), np.int32)
    for b, seq in enumerate(seqs):
        tokens[b, :len(seq)], seg[b, :len(seq)] = seq, 1  # right-padded: causal, unseen
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    ahead = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)[None]
    guess = np.argmax(np.asarray(_mtp_logits(model, tokens, pos, seg, ahead)), -1)
    drafted = accepted = 0
    for b, seq in enumerate(seqs):
        have, j = 1, len(SPEC_PROMPTS[b]) + 1
        while have < new:
            drafted += 1
            ok = guess[b, j - 2] == seq[j]
            accepted += int(ok)
            have, j = have + 1 + ok, j + 1 + ok
    return drafted, accepted


@pytest.mark.slow  # 13-20 s on a loaded 2-core box: the sharded prefill and verify compiles
def test_speculative_decoding_under_ep_as_cp_equals_unsharded(spec_config, devices):
    """The same, the model under ep_as_cp (prefill's windows and top-k across 4 context
    shards, the states sharded over the batch axes in the verify step): its speculative
    tokens equal the unsharded model's plain greedy ones."""
    import zoo.inference as G
    import zoo.inference.speculative as S
    from conformance import partitioner
    model = _drafting(_make(spec_config, 3), 0.8)
    graphdef, state = nnx.split(v4.DeepSeekV4.abstract(spec_config,
                                                       partitioner=partitioner("ep_as_cp")))
    values = dict(nnx.to_flat_state(nnx.state(model)))
    for path, var in nnx.to_flat_state(state):
        var.set_value(jax.device_put(values[path].get_value(), var.get_value().sharding))
    tokens, stats = S.generate_speculative(nnx.merge(graphdef, state), SPEC_PROMPTS,
                                           max_new_tokens=14)
    assert tokens == G.generate(model, SPEC_PROMPTS, max_new_tokens=14)
    assert 0 < stats.accepted < stats.drafted, str(stats)

def test_verify_keeps_each_layers_state_after_the_first_token(spec_config):
    """The seam under a verify step, on V4's CSA layers (the trunk's, scanned; the MTP
    module's): `cached_layers` over 2 tokens with ``first_states`` returns, beside the states
    after both, states equal to a plain 1-token decode of the first from the same cache (every
    array: window ring, open windows, carried overlap, entries, index keys), rows at
    different positions; `kept_states` takes them for the chosen rows (over each array's
    batch axis) and the 2-token states for the others."""
    import zoo.inference.engine as E
    import zoo.inference.speculative as S
    from zoo.inference.prompts import pad_prompts
    model = _make(spec_config, 3)
    tokens, segs = (jnp.asarray(a) for a in pad_prompts(model, SPEC_PROMPTS))
    B, P = tokens.shape
    rng = np.random.default_rng(0)
    nxt = jnp.asarray(rng.integers(0, 64, (B, 2)), jnp.int32)  # any 2 tokens per row

    @jax.jit
    def run(model):
        pos = E.prefill_positions(segs)
        out = {}
        x, kw = model.stream_in(tokens)
        new, new_kw = model.stream_in(nxt)
        for name, layers in (("trunk", model.layers), ("mtp", [model.mtp[0].layer])):
            _, entries = E.prefill_layers(layers, x, pos, segs, layer_kwargs=kw,
                                          dtype=jnp.dtype(model.config.dtype),
                                          max_length=P + 4)
            cache = E.filled_cache(layers, entries, pos, segs, P + 4)
            q = cache.next_positions[:, None] + jnp.arange(2)  # each row's own
            args = (cache.positions, cache.segment_ids, cache.length)
            _, both, firsts = E.cached_layers(layers, cache.layers, new, q, *args,
                                              layer_kwargs=new_kw, first_states=True)
            _, one = E.cached_layers(layers, cache.layers, new[:, :1], q[:, :1], *args,
                                     layer_kwargs={"tokens": new_kw["tokens"][:, :1]})
            rows = jnp.arange(B) % 2 == 0
            out[name] = (both, firsts, one, S.kept_states(both, firsts, cache.axes, rows))
        return out

    for name, (both, firsts, one, kept) in run(model).items():
        for entry_b, entry_f, entry_1, entry_k in zip(both, firsts, one, kept, strict=True):
            assert sorted(entry_f) == sorted(entry_1), name  # every array is a state
            for k in entry_1:
                f, o, b, kp = (np.asarray(e[k]) for e in (entry_f, entry_1, entry_b, entry_k))
                np.testing.assert_allclose(f, o, rtol=1e-6, atol=1e-7, err_msg=f"{name} {k}")
                np.testing.assert_array_equal(kp[:, 0::2], o[:, 0::2], err_msg=f"{name} {k}")
                np.testing.assert_array_equal(kp[:, 1::2], b[:, 1::2], err_msg=f"{name} {k}")
            # the second token moved the state: the ring took it in, and (rows at positions
            # 9, 2, 5: the second token at 10, 3, 6) the row at 3 closed a window
            assert not np.array_equal(entry_f["window_pos"], entry_b["window_pos"]), name
            assert not np.array_equal(entry_f["prev_kv"], entry_b["prev_kv"]), name
            assert not np.array_equal(entry_f["index_entries"], entry_b["index_entries"]), name


def test_speculative_support():
    """DeepSeek-V4 drafts with its MTP module; without one it is refused, naming the fix."""
    import zoo
    assert v4.DeepSeekV4.abstract(_config()).speculative_support() is None
    model = v4.DeepSeekV4.abstract(_config(num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match=r"DeepSeekV4 has none.*num_nextn_predict_layers=1"):
        zoo.inference.generate(model, [[3, 4, 5]], max_new_tokens=2, speculative="mtp")


def test_mtp_settings_are_checked():
    with pytest.raises(ValueError, match="num_nextn_predict_layers=-1 must be an int >= 0"):
        _config(num_nextn_predict_layers=-1)
    with pytest.raises(ValueError, match=r"mtp_layer_types=.* one of .* per MTP module"):
        _config(mtp_layer_types=(HCA,))
    with pytest.raises(ValueError, match=r"mtp_layer_types=\('full',\)"):
        _config(num_nextn_predict_layers=1, mtp_layer_types=("full",))
    # the default (all sliding) follows the depth: a preset's depth changes alone
    assert dataclasses.replace(_config(), num_nextn_predict_layers=0).mtp_attention_types == ()
    with pytest.raises(ValueError, match="mtp_loss_weight=nan must be a finite number"):
        _config(mtp_loss_weight=float("nan"))
    m = v4.DeepSeekV4.abstract(_config(), inputs_shape=(B, L))
    with pytest.raises(ValueError, match=r"expected \(mtp_depth, batch, length\)"):
        m(jnp.zeros((B, L), jnp.int32), mtp_tokens=jnp.zeros((1, B, L), jnp.int32))
