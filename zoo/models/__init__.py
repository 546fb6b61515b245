"""Model families composed from `zoo.layers`: one file per family (config presets, model, HF map).

* `zoo.models.mixtral` -- `MixtralConfig`, `Mixtral`, `from_hf`, `to_hf`.
* `zoo.models.deepseek3` -- `DeepSeek3Config`, `DeepSeek3`, `from_hf`, `to_hf`.
* `zoo.models.deepseek_v32` -- `DeepSeekV32Config`, `DeepSeekV32`, `from_hf`, `to_hf`
  (DeepSeek-V3.2: sparse attention with a lightning indexer).
* `zoo.models.deepseek_v4` -- `DeepSeekV4Config`, `DeepSeekV4`, `from_hf`, `to_hf` (DeepSeek-V4:
  compressed attention, hyper-connections, hash-routed experts).
* `zoo.models.qwen3_moe` -- `Qwen3MoeConfig`, `Qwen3Moe`, `from_hf`, `to_hf`.
* `zoo.models.glm4_moe` -- `Glm4MoeConfig`, `Glm4Moe`, `from_hf`, `to_hf` (GLM-4.5).
* `zoo.models.glm_moe_dsa` -- `GlmMoeDsaConfig`, `GlmMoeDsa`, `from_hf`, `to_hf` (GLM-5: DSA
  with top-k shared across layers).
* `zoo.models.gpt_oss` -- `GptOssConfig`, `GptOss`, `from_hf`, `to_hf` (MXFP4 read).
* `zoo.models.qwen3_next` -- `Qwen3NextConfig`, `Qwen3Next`, `from_hf`, `to_hf` (gated DeltaNet).
* `zoo.models.qwen3_5_moe` -- `Qwen3_5MoeConfig`, `Qwen3_5Moe`, `from_hf`, `to_hf` (Qwen3.5).
* `zoo.models.from_hf(path)` / `zoo.models.to_hf(model, path)` -- any family, by config.json's
  ``model_type`` (`zoo.models.auto`).
* `zoo.models.config` -- `DecoderConfig`, the base of every family's config.
* `zoo.models.decoder` -- the shared `DecoderLayer` / `CausalLM` (subclass to swap a layer).
* `zoo.models.hf` -- config.json / safetensors helpers shared by the families.
"""

from zoo.models.auto import from_hf, to_hf
from zoo.models.config import DecoderConfig
from zoo.models.decoder import CausalLM, DecoderLayer, count_params
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config, DeepSeek3DecoderLayer
from zoo.models.deepseek_v32 import DeepSeekV32, DeepSeekV32Config, DeepSeekV32DecoderLayer
from zoo.models.deepseek_v4 import DeepSeekV4, DeepSeekV4Config, DeepSeekV4DecoderLayer
from zoo.models.glm4_moe import Glm4Moe, Glm4MoeConfig, Glm4MoeDecoderLayer
from zoo.models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaConfig, GlmMoeDsaDecoderLayer
from zoo.models.gpt_oss import GptOss, GptOssConfig, GptOssDecoderLayer
from zoo.models.mixtral import Mixtral, MixtralConfig, MixtralDecoderLayer
from zoo.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig, Qwen3MoeDecoderLayer
from zoo.models.qwen3_next import Qwen3Next, Qwen3NextConfig, Qwen3NextDecoderLayer
from zoo.models.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeConfig, Qwen3_5MoeDecoderLayer

__all__ = ["CausalLM", "DecoderConfig", "DecoderLayer", "count_params", "DeepSeek3",
           "DeepSeek3Config", "DeepSeek3DecoderLayer", "DeepSeekV32", "DeepSeekV32Config",
           "DeepSeekV32DecoderLayer", "Glm4Moe", "Glm4MoeConfig",
           "Glm4MoeDecoderLayer", "GptOss", "GptOssConfig",
           "GptOssDecoderLayer", "Mixtral", "MixtralConfig",
           "MixtralDecoderLayer", "Qwen3Moe", "Qwen3MoeConfig", "Qwen3MoeDecoderLayer",
           "Qwen3Next", "Qwen3NextConfig", "Qwen3NextDecoderLayer", "Qwen3_5Moe",
           "Qwen3_5MoeConfig", "Qwen3_5MoeDecoderLayer", "from_hf", "to_hf"]
__all__ += ["DeepSeekV4", "DeepSeekV4Config", "DeepSeekV4DecoderLayer"]
__all__ += ["GlmMoeDsa", "GlmMoeDsaConfig", "GlmMoeDsaDecoderLayer"]
