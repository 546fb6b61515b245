"""DeepSeek-V4 (`zoo.models.deepseek_v4`) against transformers' ``DeepseekV4ForCausalLM``:

* a tiny random checkpoint (every kind of layer: sliding, CSA with an indexer keeping 2 of 4
  entries, HCA; a hash-routed first layer with a random ``tid2eid``, sqrtsoftplus routing with
  a random selection bias; sinks, compressor position biases, norms and hyper-connection
  biases perturbed; YaRN on the compressed branches) saved by ``save_pretrained``:
  `zoo.models.from_hf` dispatches on ``deepseek_v4`` and reads exactly its tensors (the key map
  in the checkpoint's names, values bit-equal);
* logits, routing and the gradient of every parameter equal transformers' (scanned: the CSA /
  HCA layers form one cycle scanned twice); logits under fsdp and cp; under ep_as_cp, rows of
  packed documents reordered by `zoo.data.load_balance` give the unsharded model's logits;
* rows packing documents (lengths not multiples of 4 or 8) and padding equal each document
  run alone by transformers;
* greedy generation (`zoo.inference`, left-padded prompts of several lengths) equals
  transformers' generate, unsharded, under fsdp and under ep_as_cp, and each step's cached
  logits the model's full forward;
* `to_hf` / `from_hf` round trip through transformers (tied embeddings, scanned and unrolled);
* parameter counts of V4-Flash, V4-Pro (without their MTP module, which transformers does
  not build) and mini equal transformers' meta-device counts; the presets scan as cycles;
  config.json in both spellings; construction errors. Multi-token prediction:
  test_deepseek_v4_mtp.py.
"""

from __future__ import annotations

import copy
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from conformance import (B, L, TOL, FamilySpec, check_loads_exactly, check_packed_documents,
                         check_param_count, close, forward, grads_by_path,
                         params, partitioner, run)
from support import rel_err
from zoo.models import deepseek_v4 as v4
from zoo.models.stacks import layer_cycles

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention", "heavily_compressed_attention"]


def hf_config():
    return transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=5,
        num_attention_heads=4, head_dim=32, q_lora_rank=16, n_routed_experts=8,
        num_experts_per_tok=2, o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=16,
        index_topk=2, sliding_window=4, layer_types=LAYERS,
        mlp_layer_types=["hash_moe"] + ["moe"] * 4, partial_rotary_factor=0.25,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        max_position_embeddings=32, num_nextn_predict_layers=0,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                             beta_fast=32, beta_slow=1))


SPEC = FamilySpec(
    name="deepseek_v4", config_cls=v4.DeepSeekV4Config, model_cls=v4.DeepSeekV4,
    from_hf=v4.from_hf, to_hf=v4.to_hf, hf_config=hf_config,
    # transformers builds no MTP module: its counts are the presets' without one (with it:
    # test_deepseek_v4_mtp.py)
    presets={"deepseek_v4_flash": lambda: v4.DeepSeekV4Config.deepseek_v4_flash(
                 num_nextn_predict_layers=0),
             "deepseek_v4_pro": lambda: v4.DeepSeekV4Config.deepseek_v4_pro(
                 num_nextn_predict_layers=0),
             "mini": v4.DeepSeekV4Config.mini},
    recipe="mini_deepseek_v4")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """`conformance.reference` for V4: every bias, sink, norm and mixing parameter perturbed,
    a random token -> experts table (distinct experts per token)."""
    torch.manual_seed(0)
    cfg = hf_config()
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("_bias", "sinks", ".base", ".scale",
                                                "hc_base", "hc_scale")):
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(b.shape[0])]))
    path = tmp_path_factory.mktemp("v4_hf")
    model.save_pretrained(path)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (B, L))
    r = rng.randn(B, L, cfg.vocab_size).astype(np.float32)
    chosen, hooks = [], []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            hooks.append(module.register_forward_hook(
                lambda m, i, out: chosen.append(out[-1].detach().numpy().copy())))
    out = model(torch.tensor(tokens)).logits
    for h in hooks:
        h.remove()
    (out * torch.tensor(r)).sum().backward()
    grads = copy.deepcopy(model)
    with torch.no_grad():
        for (_, p), (_, g) in zip(model.named_parameters(), grads.named_parameters()):
            g.copy_(p.grad) if p.grad is not None else g.zero_()
    grad_path = tmp_path_factory.mktemp("v4_hf_grads")
    grads.save_pretrained(grad_path)
    counts = np.stack([np.bincount(c.ravel(), minlength=8) for c in chosen])
    return types.SimpleNamespace(path=path, grad_path=grad_path, model=model, config=cfg,
                                 tokens=tokens, r=r, logits=out.detach().numpy(),
                                 expert_counts=counts)


@pytest.fixture(scope="module")
def model(ref):
    return zoo.models.from_hf(ref.path)  # dispatches on model_type


def test_loads_exactly_by_model_type(ref, model):
    assert isinstance(model, v4.DeepSeekV4)
    assert model.config.layer_types == tuple(LAYERS)
    assert model.config.rope_scaling.factor == 4.0 and model.config.compress_rate_hca == 8
    # the CSA/HCA layers are one cycle of two stacks scanned twice; the hash layer alone
    assert [(layer.layer_idx, layer.stack_size, layer.stack_stride)
            for layer in model.layers] == [(0, 1, 1), (1, 2, 2), (2, 2, 2)]
    check_loads_exactly(SPEC, ref, model)
    table = np.asarray(model.layers[0].mlp.tid2eid[...])[0]
    np.testing.assert_array_equal(table, ref.model.model.layers[0].mlp.gate.tid2eid.numpy())


@pytest.mark.slow  # ~35 s on a loaded 2-core box: the compile of the 5-layer gradient
def test_logits_routing_and_gradients_match_transformers(ref, model):
    logits, aux, grads = run(model, ref.tokens, ref.r)
    assert rel_err(logits, ref.logits) < TOL
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), ref.expert_counts)
    want = v4.from_hf(ref.grad_path)  # torch's gradients, in zoo's layout
    got = grads_by_path(grads)
    assert [k for k, _ in got] == [k for k, _ in params(want)]
    for (path, g), (_, w) in zip(got, params(want)):
        assert close(g, w), f"gradient of {path} differs: rel {rel_err(g, w):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "cp"])  # ep_as_cp: the load-balanced test
def test_sharded_logits_match_transformers(ref, strategy, devices):
    overrides = {"fsdp": {"remat_policy": "full"}, "cp": {"scan_layers": False}}[strategy]
    sharded = v4.from_hf(ref.path, partitioner=partitioner(strategy), inputs_shape=(B, L),
                         config_overrides=overrides)
    assert rel_err(forward(sharded, jnp.asarray(ref.tokens)), ref.logits) < TOL


SEGMENTS = [(9, 5), (3, 13), (16, 0), (7, 7)]  # two documents and padding per row


@pytest.mark.slow
def test_ep_as_cp_load_balanced_packed_rows_match_transformers(ref, devices):
    """Rows packing two documents (lengths 9, 5, 3, 13, 16, 7, 7: not multiples of 4 or 8) and
    padding, reordered by `zoo.data.load_balance` for ep_as_cp's 4 context shards: each
    document's logits equal transformers' on that document alone."""
    from conformance import hf_logits
    tokens, positions, segments, docs = [], [], [], []
    for row, (n, m) in enumerate(SEGMENTS):
        a, b = ref.tokens[row, :n], ref.tokens[(row + 1) % B, :m]
        pad = L - n - m
        tokens.append(np.concatenate([a, b, np.zeros(pad, int)]))
        positions.append(np.concatenate([np.arange(n), np.arange(m), np.zeros(pad, int)]))
        segments.append(np.array([1] * n + [2] * m + [0] * pad))
        docs += [(row, 0, a), (row, n, b)]
    p = partitioner("ep_as_cp")
    bal = zoo.data.load_balance(dict(tokens=np.stack(tokens), positions=np.stack(positions),
                                     segment_ids=np.stack(segments),
                                     index=np.broadcast_to(np.arange(L), (B, L))),
                                p.context_size("attention"), strategy="document")
    assert not np.array_equal(bal["index"], np.broadcast_to(np.arange(L), (B, L)))
    sharded = v4.from_hf(ref.path, partitioner=p)
    fwd = jax.jit(lambda m, t, q, s: m(t, positions=q, segment_ids=s)[0])
    got = np.asarray(fwd(sharded, *(jnp.asarray(bal[k]) for k in
                                    ("tokens", "positions", "segment_ids"))))
    back = np.take_along_axis(got, np.argsort(bal["index"], 1)[..., None], 1)
    for row, start, doc in docs:
        if len(doc):
            want = hf_logits(ref.model, doc[None])[0]
            assert rel_err(back[row, start:start + len(doc)], want) < TOL, (row, start)


def test_packed_documents(ref, model):
    check_packed_documents(SPEC, ref, model)


# prompts shorter than, across and beyond the sliding window (4) and the compression rates
# (4 and 8), generated past further window closes: 2 + 14 .. 9 + 14 tokens (32 positions)
GEN_PROMPTS = [[5, 17, 33, 2, 40, 9, 11, 30, 3], [21, 8], [3, 60, 14, 27, 50]]
GEN_NEW = 14


@pytest.fixture(scope="module")
def hf_greedy(ref):
    """transformers' greedy continuation of each of `GEN_PROMPTS` alone."""
    want = []
    with torch.no_grad():
        for prompt in GEN_PROMPTS:
            seq = ref.model.generate(torch.tensor([prompt]), max_new_tokens=GEN_NEW,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            want.append(seq[0, len(prompt):].tolist())
    return want


@pytest.mark.slow  # ~35 s on a loaded 2-core box: the prefill and decode compiles
def test_greedy_equals_transformers_and_cached_logits_equal_full_forward(ref, model,
                                                                           hf_greedy):
    """`zoo.inference.generate` over the layers' states (each sliding window's ring, the
    compressed entries written as windows close, the open windows, CSA's overlap and its
    indexer's entries), the prompts left-padded in one batch: greedy tokens equal
    transformers' generate of each prompt alone, and every step's logits the model's own
    full forward over prompt + continuation."""
    tokens, logits = zoo.inference.generate_with_logits(model, GEN_PROMPTS,
                                                        max_new_tokens=GEN_NEW)
    assert tokens == hf_greedy
    batch = np.zeros((len(GEN_PROMPTS), max(map(len, GEN_PROMPTS)) + GEN_NEW), np.int32)
    for i, (p, t) in enumerate(zip(GEN_PROMPTS, tokens)):
        batch[i, :len(p) + GEN_NEW] = p + t  # right-padded: causal, the padding is unseen
    full = np.asarray(jax.jit(lambda m, t: m(t)[0])(model, jnp.asarray(batch)))
    for i, p in enumerate(GEN_PROMPTS):
        assert rel_err(logits[i], full[i, len(p) - 1:len(p) - 1 + GEN_NEW]) < 1e-5, i


@pytest.mark.slow  # ~20 s each on a 2-core box (40-45 s at load 14): the sharded compiles
@pytest.mark.parametrize("strategy", ["fsdp", "ep_as_cp"])
def test_sharded_greedy_equals_transformers(ref, hf_greedy, strategy, devices):
    """Under fsdp (parameters over fsdp x tensor, rows over the batch axes) and ep_as_cp
    (the prefill's compression windows, indexer top-k and sliding keys across 4 context
    shards; decode over the batch-sharded states) greedy tokens equal transformers'."""
    sharded = zoo.models.from_hf(ref.path, partitioner=partitioner(strategy))
    assert zoo.inference.generate(sharded, GEN_PROMPTS, max_new_tokens=GEN_NEW) == hf_greedy


@pytest.mark.slow  # ~25 s on a loaded 2-core box
def test_round_trip_tied(ref, tmp_path):
    """`conformance.check_round_trip` with the model created inside `jax.jit` (eager creation
    of this model costs more than its compile): a zoo-initialised model with tied embeddings
    -> to_hf (several shards) -> transformers (equal logits) -> from_hf exact, scanned and
    unrolled (the same tensors)."""
    from conformance import check_round_trip
    check_round_trip(SPEC, ref, tmp_path,
                     make=lambda cfg: jax.jit(lambda: v4.DeepSeekV4(cfg, rngs=nnx.Rngs(7)))())


@pytest.mark.parametrize("preset", ["deepseek_v4_flash", "deepseek_v4_pro", "mini"])
def test_param_count(preset):
    n = check_param_count(SPEC, preset)
    if preset == "deepseek_v4_flash":
        assert 280e9 < n < 290e9  # "284B"
    if preset == "deepseek_v4_pro":
        assert 1.55e12 < n < 1.65e12  # "1.6T"


def test_presets_scan_as_cycles():
    flash = v4.DeepSeekV4Config.deepseek_v4_flash()
    assert flash.layer_types[:5] == ("sliding_attention", "sliding_attention",
                                     "compressed_sparse_attention",
                                     "heavily_compressed_attention",
                                     "compressed_sparse_attention")
    spans = layer_cycles(v4.DeepSeekV4DecoderLayer, flash, scan=True)
    assert spans == [(0, 2, 1), (2, 1, 1), (3, 40, 2)]
    pro = v4.DeepSeekV4Config.deepseek_v4_pro()
    assert layer_cycles(v4.DeepSeekV4DecoderLayer, pro, scan=True) == [(0, 3, 1), (3, 58, 2)]


def test_config_json_spellings(ref):
    from_hf = v4.DeepSeekV4Config.from_hf_config(ref.config.to_dict())
    assert v4.DeepSeekV4Config.from_hf_config(from_hf.to_hf_config()) == from_hf
    # the published spelling: per-layer compress_ratios, num_hash_layers, a flat rope_scaling
    published = {k: v for k, v in from_hf.to_hf_config().items()
                 if k not in ("layer_types", "mlp_layer_types", "rope_parameters",
                              "compress_rates", "partial_rotary_factor")}
    published.update(compress_ratios=[0, 4, 8, 4, 8, 0], num_hash_layers=1,
                     compress_rate_csa=4, compress_rate_hca=8, qk_rope_head_dim=8,
                     rope_scaling=dict(type="yarn", factor=4.0,
                                       original_max_position_embeddings=8, beta_fast=32,
                                       beta_slow=1))
    again = v4.DeepSeekV4Config.from_hf_config(published)
    assert again == from_hf


def test_published_keys_are_transformers_checkpoint_names():
    assert v4.published_key("model.layers.3.self_attn.compressor.indexer.scorer.weights_proj"
                            ".weight") == "model.layers.3.attn.indexer.weights_proj.weight"
    assert v4.published_key("model.layers.0.mlp.experts.5.up_proj.weight") == \
        "model.layers.0.ffn.experts.5.w3.weight"
    assert v4.published_key("model.layers.2.ffn_hc.fn") == "model.layers.2.hc_ffn_fn"
    assert v4.published_key("model.norm.weight") == "model.norm.weight"


def test_errors():
    with pytest.raises(ValueError, match="layer_types has 2 entries but num_hidden_layers=4"):
        v4.DeepSeekV4Config.mini(layer_types=("sliding_attention",) * 2)
    with pytest.raises(ValueError, match=r"mlp_layer_types entries \['dense'\]"):
        v4.DeepSeekV4Config.mini(mlp_layer_types=("dense",) * 4)
    with pytest.raises(ValueError, match="one shared key/value head"):
        v4.DeepSeekV4Config.mini(num_key_value_heads=2)
    with pytest.raises(ValueError, match="scoring_func='relu'"):
        v4.DeepSeekV4Config.mini(scoring_func="relu")
    cfg = v4.DeepSeekV4Config.mini()
    m = v4.DeepSeekV4.abstract(cfg, inputs_shape=(1, 16))
    with pytest.raises(ValueError, match="streams"):
        m.layers[0].attn_hc.collapse(jnp.zeros((1, 16, cfg.hidden_size)))
