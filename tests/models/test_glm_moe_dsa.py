"""GLM-5 (``glm_moe_dsa``) beyond the conformance suite (tests/models/test_conformance.py runs
its HF logits and gradients with indexers full, shared, full, shared, full keeping 6 of 16
keys, fsdp, cp, ep_as_cp, packed documents, round trip, attention swap, parameter counts and
recipe):

* `zoo.models.from_hf` dispatches ``glm_moe_dsa``; shared layers hold no indexer (neither
  parameters nor keys), full ones rotate in the interleaved layout; scanned, the (shared,
  full) layers form one cycle;
* ``indexer_types`` from transformers' other spellings (``index_topk_freq`` /
  ``index_skip_topk_offset``, ``index_topk_pattern``) and back, equal to transformers' own;
* greedy generation through shared layers (the full layers' top-k carried to them at
  prefill and at every decode step) equals transformers' ``generate``, each step's logits
  transformers' full forward; with every layer full (GLM-5 as published) too;
* construction errors.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import zoo
from conformance import reference
from support import rel_err
from zoo.models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaAttention, GlmMoeDsaConfig

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from test_conformance import FAMILIES, GLM_MOE_DSA_CONFIG  # noqa: E402 -- needs transformers

SPEC = next(f for f in FAMILIES if f.name == "glm_moe_dsa")
PROMPTS = [[5, 17, 33, 2, 40, 9, 11], [21, 8], [3, 60, 14, 27, 50]]
GEN_NEW = 12


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(SPEC, tmp_path_factory)


def hf_greedy(hf_model, new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt of `PROMPTS` alone."""
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            seq = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(prompt):].tolist())
    return out


def test_loads_by_model_type_shared_layers_without_indexer(ref):
    model = zoo.models.from_hf(ref.path)  # dispatches on model_type
    assert isinstance(model, GlmMoeDsa)
    assert model.config.indexer_types == ("full", "shared", "full", "shared", "full")
    # scanned: layer 0 (dense) alone, then layers 1-4 as one cycle of (shared, full) stacks
    assert [(la.layer_idx, la.stack_size, la.stack_stride) for la in model.layers] == \
        [(0, 1, 1), (1, 2, 2), (2, 2, 2)]
    for i in range(5):
        attn = model.layer(i).self_attn
        assert attn.index_topk == 6 and attn.index_shared == (i % 2 == 1)
        assert (attn.indexer is None) == (i % 2 == 1)
        if attn.indexer is not None:
            assert attn.indexer.rope.interleaved and attn.indexer.num_heads == 16
    keys = {k for row in model.hf_key_map() for k in row.keys}
    for i in range(5):
        assert (f"model.layers.{i}.self_attn.indexer.wq_b.weight" in keys) == (i % 2 == 0)
    eps = {model.layer(1).self_attn.q_a_layernorm.eps, model.layer(1).self_attn.kv_a_layernorm.eps}
    assert eps == {1e-6} and model.config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("kw", [{}, dict(index_topk_freq=3, index_skip_topk_offset=1),
                                dict(index_topk_freq=2), dict(index_topk_pattern="FSSFSSF")])
def test_indexer_types_from_transformers_spellings(kw):
    want = transformers.GlmMoeDsaConfig(num_hidden_layers=7, **kw).indexer_types
    config = GlmMoeDsaConfig.from_hf_config({"num_hidden_layers": 7, **kw})
    assert [config.indexer_type(i) for i in range(7)] == list(want)
    back = transformers.GlmMoeDsaConfig(**{k: v for k, v in config.to_hf_config().items()
                                           if k not in ("architectures", "model_type")})
    assert back.indexer_types == list(want)
    assert GlmMoeDsaConfig.from_hf_config(back.to_dict()) == config


@pytest.mark.slow  # ~25 s on a loaded 2-core box: the prefill and decode compiles
def test_generation_through_shared_layers_equals_transformers_and_full_forward(ref):
    """`zoo.inference.generate` with indexers full, shared, full, shared, full keeping 6 keys
    (fewer than every prompt + continuation but the shortest prompt's first steps: the
    selection matters), the prompts left-padded in one batch: each full layer's top-k, at
    prefill and at every decode step, reaches the next shared layer through the stream.
    Greedy tokens equal transformers' generate of each prompt alone, and every step's logits
    transformers' full forward (no cache) over that prompt + continuation."""
    model = zoo.models.from_hf(ref.path)
    want = hf_greedy(ref.model, GEN_NEW)
    tokens, logits = zoo.inference.generate_with_logits(model, PROMPTS, max_new_tokens=GEN_NEW)
    assert tokens == want
    with torch.no_grad():
        for i, (p, t) in enumerate(zip(PROMPTS, tokens)):
            full = ref.model(torch.tensor([p + t])).logits[0].numpy()
            assert rel_err(logits[i], full[len(p) - 1:len(p) - 1 + GEN_NEW]) < 1e-5, i


@pytest.mark.slow  # ~25 s on a loaded 2-core box: the sharded prefill and decode compiles
def test_sharded_generation_through_shared_layers_equals_transformers(ref, devices):
    """Shared layers cache the latent alone (full ones the index keys beside it), and under
    ``ep_as_cp`` (the prefill's top-k global over the row's shards, carried to the shared
    layers with its queries; decode over the sharded cache) greedy tokens still equal
    transformers'."""
    import zoo.inference as G
    want = hf_greedy(ref.model, GEN_NEW)
    p = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    model = zoo.models.from_hf(ref.path, partitioner=p)
    kinds = [sorted(e) for e in G.KVCache.shapes(model, 2, 10).layers]
    # scanned: layer 0 (full), then the cycle's (shared, full) stacks
    assert kinds == [["index_k", "latent_pe"], ["latent_pe"], ["index_k", "latent_pe"]]
    c = model.config
    assert G.cache_bytes_per_token(model) == 4 * (
        (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers
        + c.index_head_dim * c.num_full_layers)
    assert G.generate(model, PROMPTS, max_new_tokens=GEN_NEW) == want


def test_generation_all_full_equals_transformers(tmp_path):
    """Every layer full (GLM-5 as published): greedy tokens equal transformers'."""
    torch.manual_seed(1)
    cfg = transformers.GlmMoeDsaConfig(**{**GLM_MOE_DSA_CONFIG, "num_hidden_layers": 2,
                                          "indexer_types": ["full", "full"],
                                          "max_position_embeddings": 64})
    hf_model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager").float().eval()
    hf_model.save_pretrained(tmp_path)
    want = hf_greedy(hf_model, 12)
    assert zoo.inference.generate(zoo.models.from_hf(tmp_path), PROMPTS,
                                  max_new_tokens=12) == want


def test_construction_errors():
    with pytest.raises(ValueError, match="indexer_types has 3 entries but num_hidden_layers=5"):
        GlmMoeDsaConfig.mini(indexer_types=("full", "shared", "full"))
    with pytest.raises(ValueError, match=r"indexer_types\[0\]='shared'.*must be 'full'"):
        GlmMoeDsaConfig.mini(num_hidden_layers=2, indexer_types=("shared", "full"))
    with pytest.raises(ValueError, match="must be a list of"):
        GlmMoeDsaConfig.mini(num_hidden_layers=2, indexer_types=("full", "dense"))
    with pytest.raises(ValueError, match=r"index_topk_pattern=.FX."):
        GlmMoeDsaConfig.from_hf_config({"num_hidden_layers": 2, "index_topk_pattern": "FX"})
    kw = dict(num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=8, inputs_shape=(2, 16, 32), partitioner=None,
              rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="index_shared=True needs index_topk"):
        GlmMoeDsaAttention(index_shared=True, **kw)
    shared = GlmMoeDsaAttention(index_shared=True, index_topk=4, **kw)
    x = np.zeros((2, 16, 32), np.float32)
    pos = np.broadcast_to(np.arange(16), (2, 16))
    with pytest.raises(ValueError, match="needs the selection of a full layer before it"):
        shared(x, positions=pos)
    with pytest.raises(ValueError, match="needs the selection of a full layer before it"):
        shared.prefill_cache(x, positions=pos)  # generation, too, needs a full layer first
    narrow = np.zeros((2, 16, 3), np.int32)  # the carried width below this layer's 4 keys
    with pytest.raises(ValueError, match="carried selection holds 3 keys per query, fewer "
                                         "than this layer's 4"):
        shared.attend_with(x, narrow, positions=pos)
