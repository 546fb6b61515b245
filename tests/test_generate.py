"""`zoo.generate`: cached generation against independent references.

* transformers' ``generate(do_sample=False)`` on tiny random Mixtral, DeepSeek-V3 (MLA with a
  query LoRA, YaRN, group-limited sigmoid routing with a perturbed bias) and Qwen3-MoE
  checkpoints: 32 greedy tokens for a batch of prompts of different lengths (each prompt run
  alone by transformers);
* every step's cached logits against the model's own no-cache forward over prompt +
  continuation (fp32, relative error < 1e-5);
* the MLA cache's bytes (``kv_lora_rank + qk_rope_head_dim`` per token per layer);
* sampling: a seed is reproducible, another seed differs, temperature 1 differs from greedy,
  top-k=1 equals greedy; stop tokens;
* scanned and unrolled layers agree; fsdp, cp and ep_as_cp on 8 virtual devices equal the
  unsharded tokens.

Module-scoped fixtures share each reference and the compiled programs (one prompt batch and
one ``max_new_tokens`` throughout, so the prefill and decode steps compile once per model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo.generate as G
from zoo.models import deepseek3, mixtral, qwen3_moe
from zoo.partitioning import Partitioner, make_mesh

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

NEW = 32
PROMPTS = [[5, 17, 33, 2, 40, 9, 11], [21, 8], [3, 60, 14, 27, 50]]


def hf_configs():
    return {
        "mixtral": (mixtral, transformers.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
            num_experts_per_tok=2, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "deepseek3": (deepseek3, transformers.DeepseekV3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
            n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
            max_position_embeddings=64, rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0,
                original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0,
                beta_fast=32, beta_slow=1))),
        "qwen3_moe": (qwen3_moe, transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2],
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    }


@dataclasses.dataclass
class Ref:
    family: object
    path: object
    hf_tokens: list[list[int]]


def _reference(name, tmp_path_factory) -> Ref:
    family, cfg = hf_configs()[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:
                b.copy_(0.05 * torch.randn_like(b))
    path = tmp_path_factory.mktemp(f"{name}_gen")
    model.save_pretrained(path)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:  # alone: no padding semantics in the reference
            seq = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(prompt):].tolist())
    return Ref(family, path, out)


@pytest.fixture(scope="module", params=["mixtral", "deepseek3", "qwen3_moe"])
def ref(request, tmp_path_factory):
    return request.param, _reference(request.param, tmp_path_factory)


_forward = jax.jit(lambda model, tokens: model(tokens)[0])


def test_greedy_equals_transformers_and_cache_logits_equal_full_forward(ref):
    name, r = ref
    model = r.family.from_hf(r.path)
    tokens, logits = G.generate_with_logits(model, PROMPTS, max_new_tokens=NEW)
    assert tokens == r.hf_tokens, name
    assert all(len(t) == NEW for t in tokens)
    # no cache: each prompt + continuation, right-padded (causal: padding after is unseen)
    width = max(len(p) for p in PROMPTS) + NEW
    batch = np.zeros((len(PROMPTS), width), np.int32)
    for i, (p, t) in enumerate(zip(PROMPTS, tokens)):
        batch[i, :len(p) + NEW] = p + t
    full = np.asarray(_forward(model, jnp.asarray(batch)))
    for i, p in enumerate(PROMPTS):
        want = full[i, len(p) - 1:len(p) - 1 + NEW]
        err = np.abs(logits[i] - want).max(axis=-1) / np.abs(want).max(axis=-1)
        assert err.max() < 1e-5, f"{name} prompt {i}: step {err.argmax()} rel err {err.max()}"


# -- DeepSeek-V3 (MLA) ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    r = _reference("deepseek3", tmp_path_factory)
    model = deepseek3.from_hf(r.path)
    return r, model, G.generate(model, PROMPTS, max_new_tokens=NEW)


def test_mla_cache_holds_latent_and_rotary_key(ds):
    _, model, _ = ds
    c = model.config
    shapes = G.KVCache.shapes(model, 2, 10)
    assert [list(e) for e in shapes.layers] == [["latent_pe"]] * len(model.layers)
    want = (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers * 4  # fp32
    assert G.cache_bytes_per_token(model) == shapes.bytes_per_token() == want
    full = deepseek3.DeepSeek3.abstract(deepseek3.DeepSeek3Config.deepseek_v3())
    assert G.cache_bytes_per_token(full, jnp.bfloat16) == 576 * 61 * 2
    # a real cache after prefill has those bytes too, and its latent is normalised
    tokens = np.asarray([PROMPTS[0]], np.int32)
    _, cache = G.prefill(model, tokens, np.ones_like(tokens), max_length=12)
    assert cache.bytes_per_token() == want
    gqa = mixtral.Mixtral.abstract(mixtral.MixtralConfig.mixtral_8x7b())
    assert G.cache_bytes_per_token(gqa, jnp.bfloat16) == 2 * 8 * 128 * 32 * 2


def test_sampling(ds):
    _, model, greedy = ds
    kw = dict(max_new_tokens=NEW)
    a = G.generate(model, PROMPTS, temperature=1.0, seed=1, **kw)
    assert a == G.generate(model, PROMPTS, temperature=1.0, seed=1, **kw)
    assert a != G.generate(model, PROMPTS, temperature=1.0, seed=2, **kw)
    assert a != greedy
    assert G.generate(model, PROMPTS, temperature=1.0, top_k=1, seed=3, **kw) == greedy
    assert G.generate(model, PROMPTS, temperature=0.7, top_p=1e-6, seed=4, **kw) == greedy
    nucleus = G.generate(model, PROMPTS, temperature=1.0, top_k=8, top_p=0.9, seed=1, **kw)
    assert all(len(t) == NEW for t in nucleus) and nucleus != greedy
    stop = greedy[0][3]
    cut = G.generate(model, PROMPTS, stop=[stop], **kw)
    for row, full in zip(cut, greedy):
        want = full[:full.index(stop) + 1] if stop in full else full
        assert row == want


def test_scanned_and_unrolled_agree(ds):
    r, _, greedy = ds
    unrolled = deepseek3.from_hf(r.path, config_overrides={"scan_layers": False})
    assert all(layer.stack_size is None for layer in unrolled.layers)
    assert G.generate(unrolled, PROMPTS, max_new_tokens=NEW) == greedy == r.hf_tokens


def test_bad_input(ds):
    _, model, _ = ds
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        G.generate(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        G.generate(model, [[1] * 40], max_new_tokens=30)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        G.generate(model, [[64]], max_new_tokens=2)
    assert G.generate(model, [[1, 2]], max_new_tokens=0) == [[]]


# -- partitioners -----------------------------------------------------------------------------

MESHES = {"fsdp": dict(fsdp=4, tensor=2), "cp": dict(data=2, context=4),
          "ep_as_cp": dict(fsdp=2, expert=2, context=2)}


@pytest.mark.parametrize("strategy", list(MESHES))
def test_partitioned_greedy_equals_unsharded(ds, strategy, devices):
    r, _, greedy = ds
    p = Partitioner(make_mesh(**MESHES[strategy]), strategy)
    model = deepseek3.from_hf(r.path, partitioner=p)
    assert G.generate(model, PROMPTS, max_new_tokens=NEW) == greedy


# -- command line -----------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_DEEPSEEK = ["--set", "num_hidden_layers=2", "--set", "hidden_size=32",
                 "--set", "intermediate_size=64", "--set", "moe_intermediate_size=16",
                 "--set", "kv_lora_rank=16", "--set", "q_lora_rank=16",
                 "--set", "qk_rope_head_dim=8", "--set", "qk_nope_head_dim=8",
                 "--set", "v_head_dim=8"]


def test_command_line(tmp_path, devices, capsys):
    spec = importlib.util.spec_from_file_location("recipe", ROOT / "recipes" / "mini_deepseek3.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert recipe.main(["--steps", "2", "--batch-size", "4", "--seq-len", "32",
                            "--no-progress", *TINY_DEEPSEEK, "--run-dir", str(run)]) == 0
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    proc = subprocess.run(
        [sys.executable, "-m", "zoo.generate", "--run", str(run), "--prompt", "def fib(n):",
         "--max-new-tokens", "5"], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text, stats = proc.stdout.strip().splitlines()[-2:]
    assert text.startswith("def fib(n):")
    width = (16 + 8) * 2 * 4  # MLA: (kv_lora_rank + qk_rope_head_dim) x layers x fp32
    assert "tokens/s" in stats and f"cache {width:,} bytes/token" in stats
    # bad input: exit 2 with the reason
    from zoo.generate import main
    (tmp_path / "empty").mkdir()
    for argv, message in (
            (["--run", str(tmp_path / "empty"), "--prompt", "x"], "holds no checkpoint"),
            (["--run", str(run), "--prompt", ""], "--prompt is empty"),
            (["--run", str(run), "--prompt", "x" * 5000], "exceeds the model's 4096")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
