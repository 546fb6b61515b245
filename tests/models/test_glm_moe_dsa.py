"""GLM-5 (``glm_moe_dsa``) beyond the conformance suite (tests/models/test_conformance.py runs
its HF logits and gradients with indexers full, shared, full, shared, full keeping 6 of 16
keys, fsdp, cp, ep_as_cp, packed documents, round trip, attention swap, parameter counts and
recipe):

* `zoo.models.from_hf` dispatches ``glm_moe_dsa``; shared layers hold no indexer (neither
  parameters nor keys), full ones rotate in the interleaved layout; scanned, the (shared,
  full) layers form one cycle;
* ``indexer_types`` from transformers' other spellings (``index_topk_freq`` /
  ``index_skip_topk_offset``, ``index_topk_pattern``) and back, equal to transformers' own;
* greedy generation of a model whose layers are all full (GLM-5 as published) equals
  transformers' ``generate``; a model with shared layers refuses generation by name;
* construction errors.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import zoo
from conformance import reference
from zoo.models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaAttention, GlmMoeDsaConfig

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from test_conformance import FAMILIES, GLM_MOE_DSA_CONFIG  # noqa: E402 -- needs transformers

SPEC = next(f for f in FAMILIES if f.name == "glm_moe_dsa")
PROMPTS = [[5, 17, 33, 2, 40, 9, 11], [21, 8], [3, 60, 14, 27, 50]]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(SPEC, tmp_path_factory)


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


def test_generation_all_full_equals_transformers_and_shared_refuses(ref, tmp_path):
    import zoo.inference as G
    # shared layers: refused by name, not a silently dense cache
    with pytest.raises(NotImplementedError, match="shared DSA layer"):
        G.generate(zoo.models.from_hf(ref.path), PROMPTS, max_new_tokens=2)
    # every layer full (GLM-5 as published): greedy tokens equal transformers'
    torch.manual_seed(1)
    cfg = transformers.GlmMoeDsaConfig(**{**GLM_MOE_DSA_CONFIG, "num_hidden_layers": 2,
                                          "indexer_types": ["full", "full"],
                                          "max_position_embeddings": 64})
    hf_model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager").float().eval()
    hf_model.save_pretrained(tmp_path)
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            seq = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
            want.append(seq[0, len(prompt):].tolist())
    assert G.generate(zoo.models.from_hf(tmp_path), PROMPTS, max_new_tokens=12) == want


def test_construction_errors():
    with pytest.raises(ValueError, match="indexer_types has 3 entries but num_hidden_layers=5"):
        GlmMoeDsaConfig.mini(indexer_types=("full", "shared", "full"))
    with pytest.raises(ValueError, match=r"indexer_types\[0\]='shared'.*must be 'full'"):
        GlmMoeDsaConfig.mini(num_hidden_layers=2, indexer_types=("shared", "full"))
    with pytest.raises(ValueError, match="must be a list of"):
        GlmMoeDsaConfig.mini(num_hidden_layers=2, indexer_types=("full", "dense"))
    with pytest.raises(ValueError, match=r"index_stage='warmup'.*not supported for glm_moe_dsa"):
        GlmMoeDsaConfig.mini(index_stage="warmup")
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
