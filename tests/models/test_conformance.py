"""Every model family against Hugging Face transformers: the checks of `conformance`, per spec.

To add a family, add one `FamilySpec` to `FAMILIES` (checks: tests/models/conformance.py).
"""

import pytest
from conformance import (STRATEGIES, FamilySpec, check_attention_swap, check_loads_exactly,
                         check_packed_documents, check_param_count, check_recipe,
                         check_round_trip, check_strategy, load, reference)

from zoo.models import (deepseek3, deepseek_v32, glm4_moe, glm_moe_dsa, gpt_oss, mixtral,
                        qwen3_5_moe, qwen3_moe, qwen3_next)

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

# recipe flags shared with tests/train/test_recipes.py, so the two reuse compiled steps
MIXTRAL_TINY = ("--set", "num_hidden_layers=1", "--set", "hidden_size=32",
                "--set", "intermediate_size=32", "--set", "num_attention_heads=4",
                "--set", "head_dim=8")
DEEPSEEK_TINY = ("--set", "num_hidden_layers=2", "--set", "hidden_size=32",
                 "--set", "intermediate_size=64", "--set", "moe_intermediate_size=16",
                 "--set", "kv_lora_rank=16", "--set", "q_lora_rank=16",
                 "--set", "qk_rope_head_dim=8", "--set", "qk_nope_head_dim=8",
                 "--set", "v_head_dim=8")
GPT_OSS_TINY = ("--set", "num_hidden_layers=2", "--set", "hidden_size=32",
                "--set", "intermediate_size=16", "--set", "num_attention_heads=4",
                "--set", "head_dim=8")
QWEN3_MOE_TINY = ("--set", "num_hidden_layers=2", "--set", "hidden_size=32",
                  "--set", "intermediate_size=32", "--set", "moe_intermediate_size=16",
                  "--set", "num_attention_heads=4", "--set", "head_dim=8")
QWEN3_NEXT_TINY = ("--set", "hidden_size=32", "--set", "num_attention_heads=4",
                   "--set", "head_dim=8", "--set", "linear_key_head_dim=8",
                   "--set", "linear_value_head_dim=8", "--set", "moe_intermediate_size=16",
                   "--set", "shared_expert_intermediate_size=16")
# the recipe's 3 steps with DSA keeping 8 of 32 keys (no MTP module: a smaller program)
DEEPSEEK_V32_TINY = (*DEEPSEEK_TINY, "--set", "index_topk=8", "--set", "index_n_heads=4",
                     "--set", "index_head_dim=16", "--set", "num_nextn_predict_layers=0")
# GLM-5: V3.2's recipe flags with a full then a shared layer (the shared one reuses the top-k)
GLM_MOE_DSA_TINY = (*DEEPSEEK_V32_TINY, "--set", 'indexer_types=["full", "shared"]')
GLM_MOE_DSA_CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    first_k_dense_replace=1, index_topk=6, index_n_heads=16, index_head_dim=16,
    max_position_embeddings=32, indexer_types=["full", "shared", "full", "shared", "full"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# gated DeltaNet 3:1 gated attention (partial rotary 0.5), shared expert behind a sigmoid gate
QWEN3_NEXT_CONFIG = dict(
    vocab_size=64, hidden_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)

FAMILIES = [
    FamilySpec(
        name="mixtral", config_cls=mixtral.MixtralConfig, model_cls=mixtral.Mixtral,
        from_hf=mixtral.from_hf, to_hf=mixtral.to_hf,
        hf_config=lambda: transformers.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=6, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        presets={"mixtral_8x7b": mixtral.MixtralConfig.mixtral_8x7b,
                 "mixtral_8x22b": mixtral.MixtralConfig.mixtral_8x22b,
                 "mini": mixtral.MixtralConfig.mini},
        recipe="mini_mixtral", recipe_flags=MIXTRAL_TINY),
    FamilySpec(
        name="deepseek3", config_cls=deepseek3.DeepSeek3Config, model_cls=deepseek3.DeepSeek3,
        from_hf=deepseek3.from_hf, to_hf=deepseek3.to_hf,
        # MLA with a query LoRA and YaRN, one dense layer, group-limited sigmoid routing with a
        # random e_score_correction_bias, a shared expert
        hf_config=lambda: transformers.DeepseekV3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
            n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
            num_nextn_predict_layers=0,  # transformers builds and saves no MTP layer
            max_position_embeddings=32, rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0,
                original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0,
                beta_fast=32, beta_slow=1)),
        # transformers builds no MTP layer: its count is the preset with none
        presets={"deepseek_v3": lambda: deepseek3.DeepSeek3Config.deepseek_v3(
                     num_nextn_predict_layers=0),
                 "kimi_k2": deepseek3.DeepSeek3Config.kimi_k2,
                 "mini": deepseek3.DeepSeek3Config.mini},
        recipe="mini_deepseek3", recipe_flags=DEEPSEEK_TINY, bias_scale=0.05),
    FamilySpec(
        name="deepseek_v32", config_cls=deepseek_v32.DeepSeekV32Config,
        model_cls=deepseek_v32.DeepSeekV32, from_hf=deepseek_v32.from_hf,
        to_hf=deepseek_v32.to_hf,
        # DeepSeek-V3's tiny shape (MLA with YaRN, grouped sigmoid routing with a random bias)
        # plus an indexer keeping 6 keys of a 16-token row, so the selection matters; 16 index
        # heads, so exact ties at score 0 (every head's ReLU zero) are vanishingly rare
        hf_config=lambda: transformers.DeepseekV32Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
            n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, index_topk=6,
            index_n_heads=16, index_head_dim=16, max_position_embeddings=32,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=8, mscale=1.0,
                                 mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
        # transformers builds no MTP layer: its count is the preset with none
        presets={"deepseek_v3_2": lambda: deepseek_v32.DeepSeekV32Config.deepseek_v3_2(
                     num_nextn_predict_layers=0),
                 "mini": deepseek_v32.DeepSeekV32Config.mini},
        recipe="mini_deepseek_v32", recipe_flags=DEEPSEEK_V32_TINY, bias_scale=0.05),
    FamilySpec(
        name="glm_moe_dsa", config_cls=glm_moe_dsa.GlmMoeDsaConfig,
        model_cls=glm_moe_dsa.GlmMoeDsa, from_hf=glm_moe_dsa.from_hf, to_hf=glm_moe_dsa.to_hf,
        # DeepSeek-V3.2's tiny shape without YaRN (GLM-5 has none), rms_norm_eps 1e-5 (MLA's
        # own norms keep 1e-6), the indexer's interleaved RoPE, and indexers full, shared,
        # full, shared, full: each shared layer attends to the 6 keys (of up to 16) the full
        # layer before it chose; scanned, layers 1-4 are one cycle of (shared, full)
        hf_config=lambda: transformers.GlmMoeDsaConfig(**GLM_MOE_DSA_CONFIG),
        # transformers builds no MTP layer: its count is the preset with none
        presets={"glm5": lambda: glm_moe_dsa.GlmMoeDsaConfig.glm5(num_nextn_predict_layers=0),
                 "mini": glm_moe_dsa.GlmMoeDsaConfig.mini},
        recipe="mini_glm_moe_dsa", recipe_flags=GLM_MOE_DSA_TINY, bias_scale=0.05),
    FamilySpec(
        name="qwen3_moe", config_cls=qwen3_moe.Qwen3MoeConfig, model_cls=qwen3_moe.Qwen3Moe,
        from_hf=qwen3_moe.from_hf, to_hf=qwen3_moe.to_hf,
        # q/k norms, top-k weights left unnormalised, a dense last layer (mlp_only_layers):
        # two scanned runs of different kinds
        hf_config=lambda: transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2],
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        presets={"qwen3_30b_a3b": qwen3_moe.Qwen3MoeConfig.qwen3_30b_a3b,
                 "mini": qwen3_moe.Qwen3MoeConfig.mini},
        recipe="mini_qwen3_moe", recipe_flags=QWEN3_MOE_TINY),
    FamilySpec(
        name="glm4_moe", config_cls=glm4_moe.Glm4MoeConfig, model_cls=glm4_moe.Glm4Moe,
        from_hf=glm4_moe.from_hf, to_hf=glm4_moe.to_hf,
        # q/k/v biases (none on o_proj), q/k norms, half-rotary heads, a dense first layer,
        # grouped sigmoid routing with a random selection bias, a shared expert
        hf_config=lambda: transformers.Glm4MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            attention_bias=True, use_qk_norm=True, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5}),
        presets={"glm4_5": glm4_moe.Glm4MoeConfig.glm4_5,
                 "glm4_5_air": glm4_moe.Glm4MoeConfig.glm4_5_air,
                 "mini": glm4_moe.Glm4MoeConfig.mini},
        recipe="mini_glm4_moe", recipe_flags=QWEN3_MOE_TINY, bias_scale=0.05),
    FamilySpec(
        name="gpt_oss", config_cls=gpt_oss.GptOssConfig, model_cls=gpt_oss.GptOss,
        from_hf=gpt_oss.from_hf, to_hf=gpt_oss.to_hf,
        # sliding (window 6 of 16 tokens) and full layers alternating, sinks, biases on q/k/v/o,
        # router and experts, YaRN without truncation, a clamp low enough to bite both ways
        hf_config=lambda: transformers.GptOssConfig(
            vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=6, swiglu_limit=0.1,
            max_position_embeddings=32, rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0,
                beta_slow=1.0, truncate=False, original_max_position_embeddings=8)),
        presets={"gpt_oss_20b": gpt_oss.GptOssConfig.gpt_oss_20b,
                 "gpt_oss_120b": gpt_oss.GptOssConfig.gpt_oss_120b,
                 "mini": gpt_oss.GptOssConfig.mini},
        recipe="mini_gpt_oss", recipe_flags=GPT_OSS_TINY),
    FamilySpec(
        name="qwen3_next", config_cls=qwen3_next.Qwen3NextConfig, model_cls=qwen3_next.Qwen3Next,
        from_hf=qwen3_next.from_hf, to_hf=qwen3_next.to_hf,
        hf_config=lambda: transformers.Qwen3NextConfig(
            **QWEN3_NEXT_CONFIG, intermediate_size=48, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        presets={"qwen3_next_80b_a3b": qwen3_next.Qwen3NextConfig.qwen3_next_80b_a3b,
                 "mini": qwen3_next.Qwen3NextConfig.mini},
        recipe="mini_qwen3_next", recipe_flags=QWEN3_NEXT_TINY),
    FamilySpec(
        name="qwen3_5_moe", config_cls=qwen3_5_moe.Qwen3_5MoeConfig,
        model_cls=qwen3_5_moe.Qwen3_5Moe, from_hf=qwen3_5_moe.from_hf, to_hf=qwen3_5_moe.to_hf,
        hf_config=lambda: transformers.Qwen3_5MoeTextConfig(**QWEN3_NEXT_CONFIG),
        presets={"qwen3_5_35b_a3b": qwen3_5_moe.Qwen3_5MoeConfig.qwen3_5_35b_a3b,
                 "qwen3_5_397b_a17b": qwen3_5_moe.Qwen3_5MoeConfig.qwen3_5_397b_a17b,
                 "mini": qwen3_5_moe.Qwen3_5MoeConfig.mini},
        recipe="mini_qwen3_5_moe", recipe_flags=QWEN3_NEXT_TINY),
]
# the published totals, as a cross-check of the transformers count itself
PUBLISHED = {"mixtral_8x7b": 46_702_792_704, "mixtral_8x22b": 140_630_071_296,
             "deepseek_v3": 671_026_404_352,  # DeepSeek-V3 without its MTP layer
             # V3's trunk plus 61 indexers of 13,959,424 (transformers' count, no MTP layer)
             "deepseek_v3_2": 671_877_929_216,
             # GLM-5 / GLM-5.1 ("744B"): transformers' count, no MTP layer
             "glm5": 743_911_199_232,
             "qwen3_30b_a3b": 30_532_122_624,
             "gpt_oss_20b": 20_914_757_184, "gpt_oss_120b": 116_829_156_672,
             # transformers' counts (language models, no MTP layer)
             "qwen3_next_80b_a3b": 79_674_391_296, "qwen3_5_35b_a3b": 34_660_610_688,
             "qwen3_5_397b_a17b": 396_346_350_336}

PRESETS = [(f, name) for f in FAMILIES for name in f.presets]


@pytest.fixture(scope="module", params=FAMILIES, ids=repr)
def spec(request):
    return request.param


@pytest.fixture(scope="module")
def ref(spec, tmp_path_factory):
    return reference(spec, tmp_path_factory)


@pytest.fixture(scope="module")
def zoo_model(spec, ref):
    """Unsharded, with the swapped attention (see conformance.STRATEGIES)."""
    return load(spec, ref, "unsharded")


def test_loads_exactly(spec, ref, zoo_model):
    check_loads_exactly(spec, ref, zoo_model)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_logits_and_gradients(spec, ref, zoo_model, strategy, devices):
    model = zoo_model if strategy == "unsharded" else load(spec, ref, strategy)
    check_strategy(spec, ref, strategy, model)


def test_packed_documents(spec, ref, zoo_model):
    check_packed_documents(spec, ref, zoo_model)


def test_round_trip_tied(spec, ref, tmp_path):
    check_round_trip(spec, ref, tmp_path)


def test_attention_swap(spec, ref, zoo_model, tmp_path):
    check_attention_swap(spec, ref, zoo_model, tmp_path)


@pytest.mark.parametrize("family,preset", PRESETS, ids=[f"{f.name}-{p}" for f, p in PRESETS])
def test_param_count(family, preset):
    n = check_param_count(family, preset)
    assert n == PUBLISHED.get(preset, n)


@pytest.mark.parametrize("family", FAMILIES, ids=repr)
def test_recipe_trains(family, tmp_path, devices):
    check_recipe(family, tmp_path)
