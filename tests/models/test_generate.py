"""`zoo.generate`: cached generation against independent references.

* transformers' ``generate(do_sample=False)`` on the conformance suite's tiny random Mixtral
  (sliding window 6), DeepSeek-V3 (MLA with a query LoRA, YaRN, group-limited sigmoid routing
  with a perturbed bias) and Qwen3-MoE checkpoints: 32 greedy tokens for a batch of prompts
  of different lengths (each prompt run alone by transformers);
* every step's cached logits against the model's own no-cache forward over prompt +
  continuation (fp32, relative error < 1e-5);
* the MLA cache's bytes (``kv_lora_rank + qk_rope_head_dim`` per token per layer);
* sampling: a seed is reproducible, another seed differs, temperature 1 differs from greedy,
  top-k=1 equals greedy; stop tokens;
* sliding-window layers (gpt-oss's alternating ones, Mixtral's): ring caches of W slots,
  bytes per token, and cached logits equal to the no-cache forward with prompts longer than
  the window, scanned and unrolled;
* scanned and unrolled layers agree; fsdp, cp and ep_as_cp on 8 virtual devices equal the
  unsharded tokens; the cache's sharding (length over the context axes under cp/ep_as_cp, kv
  heads over tensor); a sharded decode compiles without XLA's "Involuntary full
  rematerialization" warnings;
* ``python -m zoo.generate --run DIR`` on a run the recipe just trained, and its exit 2 on bad
  input.

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

import conformance
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_conformance import DEEPSEEK_TINY
from test_conformance import FAMILIES as conformance_families

import zoo.inference as G
from zoo.inference.cache import cache_axes
from zoo.inference.prompts import pad_prompts
from zoo.layers.attention import Attention
from zoo.models import deepseek3, deepseek_v32, glm4_moe, gpt_oss, mixtral, qwen3_moe
from zoo.partitioning import Partitioner, make_mesh

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEW = 32
PROMPTS = [[5, 17, 33, 2, 40, 9, 11], [21, 8], [3, 60, 14, 27, 50]]


FAMILIES = {spec.name: spec for spec in conformance_families}
MODULES = {"mixtral": mixtral, "deepseek3": deepseek3, "qwen3_moe": qwen3_moe,
           "glm4_moe": glm4_moe, "gpt_oss": gpt_oss,
           "deepseek_v32": deepseek_v32}  # DSA: top-6 of up to 39 cached keys


@dataclasses.dataclass
class Ref:
    family: object
    path: object
    hf_tokens: list[list[int]]


def _reference(name, tmp_path_factory) -> Ref:
    """The conformance suite's tiny transformers model (norms and router biases perturbed;
    Mixtral with a sliding window of 6) with room for 64 positions, and its greedy tokens for
    each prompt run alone (no padding semantics in the reference)."""
    if name in _REFS:
        return _REFS[name]
    spec = FAMILIES[name]

    def hf_config():
        cfg = spec.hf_config()
        cfg.max_position_embeddings = 64
        return cfg

    ref = conformance.reference(dataclasses.replace(spec, hf_config=hf_config),
                                tmp_path_factory)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            seq = ref.model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(prompt):].tolist())
    _REFS[name] = Ref(MODULES[name], ref.path, out)
    return _REFS[name]


_REFS: dict[str, Ref] = {}


@pytest.fixture(scope="module", params=list(MODULES))
def ref(request, tmp_path_factory):
    return request.param, _reference(request.param, tmp_path_factory)


_forward = jax.jit(lambda model, tokens: model(tokens)[0])


def _check_cached_logits(name, model, prompts, tokens, logits):
    """Every step's cached logits against the no-cache forward over each prompt + its
    continuation, right-padded (causal: padding after is unseen); fp32, rel err < 1e-5."""
    n = len(tokens[0])
    batch = np.zeros((len(prompts), max(len(p) for p in prompts) + n), np.int32)
    for i, (p, t) in enumerate(zip(prompts, tokens)):
        batch[i, :len(p) + n] = p + t
    full = np.asarray(_forward(model, jnp.asarray(batch)))
    for i, p in enumerate(prompts):
        want = full[i, len(p) - 1:len(p) - 1 + n]
        err = np.abs(logits[i] - want).max(axis=-1) / np.abs(want).max(axis=-1)
        assert err.max() < 1e-5, f"{name} prompt {i}: step {err.argmax()} rel err {err.max()}"


def test_greedy_equals_transformers_and_cache_logits_equal_full_forward(ref):
    name, r = ref
    model = r.family.from_hf(r.path)
    tokens, logits = G.generate_with_logits(model, PROMPTS, max_new_tokens=NEW)
    assert tokens == r.hf_tokens, name
    assert all(len(t) == NEW for t in tokens)
    _check_cached_logits(name, model, PROMPTS, tokens, logits)


# -- sliding-window layers: ring caches of W slots ------------------------------------------

W = 6  # the conformance checkpoints' sliding window (gpt-oss: every other layer; Mixtral: all)
# rows shorter than, as long as and longer than the window, padded to 13 > W
RING_PROMPTS = [[5, 17, 33, 2, 40, 9, 11, 3, 60, 14, 27, 50, 8], [21, 8], [3, 60, 14, 27, 50, 9]]
RING_NEW = 20


@pytest.mark.parametrize("name", ["gpt_oss", "mixtral"])
@pytest.mark.parametrize("scan", [True, False])
def test_window_layers_keep_a_ring_of_window_slots(name, scan, tmp_path_factory):
    r = _reference(name, tmp_path_factory)
    model = r.family.from_hf(r.path, config_overrides={"scan_layers": scan})
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    assert set(windows) == ({W, None} if name == "gpt_oss" else {W})
    # scanned, gpt-oss's alternating layers are two stacks of one cycle (an odd last alone)
    assert (name == "gpt_oss" and scan) <= (model.layers[0].stack_stride == 2)
    tokens, logits = G.generate_with_logits(model, RING_PROMPTS, max_new_tokens=RING_NEW)
    _check_cached_logits(name, model, RING_PROMPTS, tokens, logits)
    # the cache generate decodes from: a window layer's arrays have W slots, the rest S
    L, S = 13, 13 + RING_NEW - 1
    ids = np.zeros((3, L), np.int32)
    for i, p in enumerate(RING_PROMPTS):
        ids[i, L - len(p):] = p
    _, cache = G.prefill(model, ids, (ids > 0).astype(np.int32), max_length=S)
    c = model.config
    per_slot = 2 * c.num_key_value_heads * c.head_dim * 4  # k and v, fp32, one layer
    total = 0
    for layer, entry, w in zip(model.layers, cache.layers, windows):
        n = layer.stack_size or 1
        want = (n, 3, c.num_key_value_heads, S if w is None else W, c.head_dim)
        assert entry["k"].shape == entry["v"].shape == want
        total += n * want[3] * per_slot
    assert cache.bytes_per_token() == total // S
    assert G.KVCache.shapes(model, 3, S).bytes_per_token() == total // S
    layers = c.num_hidden_layers
    full = sum(layer.stack_size or 1 for layer, w in zip(model.layers, windows) if w is None)
    assert full == (layers // 2 if name == "gpt_oss" else 0)
    assert G.cache_bytes_per_token(model) == layers * per_slot  # one token: every layer
    assert G.cache_bytes_per_token(model, context=60) == \
        (full * 60 + (layers - full) * W) * per_slot // 60
    assert [e["k"].shape[3] for e in G.KVCache.shapes(model, 1, 4).layers] == \
        [4] * len(model.layers)  # a window longer than the cache: the cache's length
    with pytest.raises(ValueError, match="context=0 must be an int >= 1"):
        G.cache_bytes_per_token(model, context=0)


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
    # a real cache has those bytes too (the shapes `generate` prefills: compiled already)
    tokens = np.zeros((len(PROMPTS), 7), np.int32)
    tokens[:, -2:] = 1
    _, cache = G.prefill(model, tokens, (tokens > 0).astype(np.int32), max_length=7 + NEW - 1)
    assert cache.bytes_per_token() == want
    assert cache.layers[0]["latent_pe"].shape == (1, 3, 1, 7 + NEW - 1, 16 + 8)
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


def _spec(a):
    spec = tuple(a.sharding.spec)
    return spec + (None,) * (a.ndim - len(spec))


def _axes(entry):
    return entry if isinstance(entry, tuple) else () if entry is None else (entry,)


@pytest.mark.parametrize("strategy", list(MESHES))
def test_mla_cache_shards_its_length_over_the_context_axes(ds, strategy, devices):
    """prefill's and decode's latent cache: batch over the batch axes and, under cp and
    ep_as_cp, slots over the context axes (those that shard the attention's length)."""
    r, _, _ = ds
    p = Partitioner(make_mesh(**MESHES[strategy]), strategy)
    model = deepseek3.from_hf(r.path, partitioner=p)
    tokens, segs = pad_prompts(model, PROMPTS)
    S = tokens.shape[1] + 8
    logits, cache = G.prefill(model, tokens, segs, max_length=S)
    context = p.sequence_axes()
    assert (strategy != "fsdp") == bool(context)
    for c in (cache, G.decode(model, cache, np.argmax(np.asarray(logits), -1))[1]):
        for entry in c.layers:
            spec = _spec(entry["latent_pe"])
            assert _axes(spec[1]) == p.batch_axes("attention") and spec[2] is None
            assert spec[4] is None and _axes(spec[3]) == context, (strategy, spec)
        assert _axes(_spec(c.positions)[1]) == ()


def test_gqa_cache_shards_kv_heads_over_tensor_and_length_over_context(devices,
                                                                       tmp_path_factory):
    """Mixtral (every layer a window of 6: rings of 6 slots, split by context=2) and gpt-oss
    (rings and full layers) under cp with a tensor axis: k/v heads over ``tensor``, slots over
    ``context``, a ring the context does not divide kept whole; greedy tokens still
    transformers'."""
    for name, mesh in (("mixtral", dict(fsdp=2, context=2, tensor=2)),
                       ("gpt_oss", dict(data=2, context=2, tensor=2))):
        r = _reference(name, tmp_path_factory)
        p = Partitioner(make_mesh(**mesh), "cp")
        model = r.family.from_hf(r.path, partitioner=p)
        assert G.generate(model, PROMPTS, max_new_tokens=NEW) == r.hf_tokens, name
        tokens, segs = pad_prompts(model, PROMPTS)
        _, cache = G.prefill(model, tokens, segs, max_length=tokens.shape[1] + 8)
        slots = {e["k"].shape[3] for e in cache.layers}
        assert slots == ({W, tokens.shape[1] + 8} if name == "gpt_oss" else {W})
        for entry in cache.layers:
            for a in (entry["k"], entry["v"]):
                spec = _spec(a)
                assert spec[2] == "tensor" and spec[4] is None, (name, spec)
                assert spec[3] == "context", (name, a.shape, spec)
        # a ring of 3 slots does not split over context=2: kept whole on the length
        k_axes = ("layers", *Attention.cache_axes["k"])
        assert cache_axes(p, k_axes, (1, 4, 2, 3, 8))[3] is None
        assert cache_axes(p, k_axes, (1, 4, 2, 4, 8))[3] == "length"
        assert cache_axes(p, k_axes, (1, 4, 1, 4, 8))[2] is None  # 1 kv head, tensor 2


# the recipe's closing sample (`zoo.train.cli`): a mini DeepSeek-V3 on its default mesh
REMAT_SCRIPT = """
import zoo
zoo.set_cpu_devices(8)
from flax import nnx
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
p = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
config = DeepSeek3Config.mini(num_hidden_layers=2, hidden_size=64, n_routed_experts=8)
model = DeepSeek3(config, inputs_shape=(8, 64), partitioner=p, rngs=nnx.Rngs(0))
print(zoo.generate.generate(model, [[1, 72, 105, 33]], max_new_tokens=2))
"""


@pytest.mark.e2e  # a fresh process, so XLA compiles (and warns) with no compilation cache
def test_sharded_decode_compiles_without_involuntary_rematerialization():
    """Decode runs the layers' unsharded code on FSDP-sharded parameters: without explicit
    layouts XLA carries the embedding's and ``kv_b_proj``'s shardings into the activations
    and replicates them to meet the batch-sharded cache, warning "[SPMD] Involuntary full
    rematerialization" (on MLA's absorbed ``blnh,rnh->blnr`` and the embedding lookup)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}  # compile, and print
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", REMAT_SCRIPT], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("[["), proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "Involuntary full rematerialization" in ln]
    assert not lines, "\n".join(ln[:400] for ln in lines[:3])


# -- command line -----------------------------------------------------------------------------

@pytest.mark.e2e  # trains a run, then runs the command in a subprocess
def test_command_line(tmp_path, devices, capsys):
    spec = importlib.util.spec_from_file_location("recipe", ROOT / "recipes" / "mini_deepseek3.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert recipe.main(["--steps", "1", "--batch-size", "4", "--seq-len", "32",
                            "--no-progress", "--sample-tokens", "0", *DEEPSEEK_TINY,
                            "--run-dir", str(run)]) == 0
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
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
            (["--run", str(run), "--prompt", "x" * 5000], "exceeds the model's 4096"),
            (["--run", str(run), "--prompt", "x", "--step", "99"], "--step 99: "),
            (["--run", str(run), "--prompt", "x", "--max-new-tokens", "0"],
             "nothing to generate")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
