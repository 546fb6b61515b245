"""Hugging Face checkpoints that could mislead: exports written over exports, config.json values
of the wrong type, weights that are not finite.

* ``to_hf`` into a folder replaces an earlier export whole (transformers' ``from_pretrained``
  then loads the new weights, no stale shard or index remains), refuses a folder holding other
  files unless ``overwrite=True``, and leaves the old export intact when it fails midway.
* config.json values are checked against the config dataclass's annotations
  (``"rms_norm_eps": "1e-5"`` is refused, naming the field, the value and the type).
* NaN/Inf weights are refused on load, naming the tensor; ``python -m zoo.generate --hf`` and
  ``--from-hf`` training exit 2 with that message, no traceback.
"""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from zoo.models import hf, mixtral, qwen3_moe

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = mixtral.MixtralConfig.mini(vocab_size=300, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8)
EMBED = "model.embed_tokens.weight"


def snapshot(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


def tensors_of(folder):
    reader = hf.CheckpointReader(folder)
    return {k: reader.get(k) for k in reader.keys()}


@pytest.fixture(scope="module")
def models():
    return mixtral.Mixtral(TINY, rngs=nnx.Rngs(0)), mixtral.Mixtral(TINY, rngs=nnx.Rngs(1))


def embedding(model):
    return np.asarray(model.embed_tokens.embedding[...])


# -- exports -----------------------------------------------------------------------------------

def test_an_export_over_an_export_replaces_it_whole(tmp_path, models):
    """A then B (sharded) into one folder: transformers loads B; no file of A is left."""
    transformers = pytest.importorskip("transformers")
    a, b = models
    path = tmp_path / "export"
    mixtral.to_hf(a, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    mixtral.to_hf(b, path, max_shard_bytes=20_000)
    names = sorted(os.listdir(path))
    assert "model.safetensors" not in names and hf.INDEX_NAME in names
    index = json.loads((path / hf.INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == [n for n in names if n.startswith("model-")]
    assert [n for n in os.listdir(tmp_path)] == ["export"]  # no temporary folder beside it
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    np.testing.assert_array_equal(ref.model.embed_tokens.weight.detach().numpy(), embedding(b))
    assert not np.array_equal(embedding(a), embedding(b))
    # and back to one file: the shards and the index go
    mixtral.to_hf(a, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(tensors_of(path)[EMBED], embedding(a))


def test_a_folder_holding_other_files_is_refused(tmp_path, models):
    a, b = models
    path = tmp_path / "export"
    mixtral.to_hf(a, path)
    (path / "notes.txt").write_text("mine")
    (path / "tokenizer.json").write_text("{}")
    before = snapshot(path)
    with pytest.raises(ValueError) as e:
        mixtral.to_hf(b, path)
    for words in (str(path), "2 file(s)", "notes.txt", "tokenizer.json", "overwrite=True"):
        assert words in str(e.value), (words, str(e.value))
    assert snapshot(path) == before
    mixtral.to_hf(b, path, overwrite=True)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(tensors_of(path)[EMBED], embedding(b))
    # a file where the folder should be
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"is not a folder.*overwrite=True"):
        mixtral.to_hf(a, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"


def test_a_failed_export_leaves_the_earlier_one_intact(tmp_path, models):
    path = tmp_path / "export"
    mixtral.to_hf(models[0], path, max_shard_bytes=20_000)
    before = snapshot(path)

    def failing():
        yield from list(hf.export_tensors(models[1], models[1].hf_key_map()))[:3]
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        hf.save_checkpoint(path, failing(), {"model_type": "mixtral"}, max_shard_bytes=20_000)
    assert snapshot(path) == before
    assert os.listdir(tmp_path) == ["export"]


def test_a_folder_that_cannot_be_moved_has_its_files_replaced(tmp_path, models, monkeypatch):
    """A mount point cannot be renamed (EBUSY): its export files are replaced one by one."""
    path = tmp_path / "mount"
    mixtral.to_hf(models[0], path, max_shard_bytes=20_000)
    rename = os.rename

    def busy(src, dst):
        if os.fspath(src) == os.fspath(path):
            raise OSError(16, "Device or resource busy")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", busy)
    mixtral.to_hf(models[1], path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(tensors_of(path)[EMBED], embedding(models[1]))
    assert os.listdir(tmp_path) == ["mount"]


# -- config.json values ------------------------------------------------------------------------

@pytest.mark.parametrize("cls,field,value,words", [
    (mixtral.MixtralConfig, "rms_norm_eps", "1e-5",
     ["rms_norm_eps='1e-5' (str)", "a finite number", 'without quotes', '"rms_norm_eps": 1e-5']),
    (mixtral.MixtralConfig, "rms_norm_eps", float("nan"), ["rms_norm_eps=nan", "finite"]),
    (mixtral.MixtralConfig, "num_hidden_layers", 2.0, ["num_hidden_layers=2.0 (float)",
                                                       "an integer"]),
    (mixtral.MixtralConfig, "num_local_experts", "8", ["num_local_experts='8'", '": 8']),
    (mixtral.MixtralConfig, "tie_word_embeddings", "false", ["tie_word_embeddings='false'",
                                                             "true or false"]),
    (mixtral.MixtralConfig, "sliding_window", "4096", ["sliding_window='4096'", "or null"]),
    (qwen3_moe.Qwen3MoeConfig, "mlp_only_layers", [0, "1"], ["mlp_only_layers=[0, '1']",
                                                             "a list"]),
    (mixtral.MixtralConfig, "rope_theta", "1e6", ["rope_theta='1e6'", "finite JSON number"]),
])
def test_config_values_of_the_wrong_type_are_refused(cls, field, value, words):
    raw = cls.mini().to_hf_config()
    with pytest.raises(ValueError) as e:
        cls.from_hf_config({**raw, field: value})
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    # the same config with a value of the right type loads (the check is the only difference)
    cls.from_hf_config(raw)


# -- weights that are not finite ---------------------------------------------------------------

def write_nan_checkpoint(model, path, key, value=np.nan, index=(0, 1)):
    model.to_hf(path)
    from safetensors.numpy import load_file, save_file
    name = str(path / "model.safetensors")
    tensors = load_file(name)
    tensors[key][index] = value
    save_file(tensors, name, metadata={"format": "pt"})


@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, models, value):
    key = "model.layers.0.self_attn.k_proj.weight"
    write_nan_checkpoint(models[0], tmp_path / "bad", key, value)
    with pytest.raises(hf.BadCheckpoint) as e:
        mixtral.from_hf(tmp_path / "bad")
    for w in (key, "1 non-finite value(s)", f"the first {value}", "index [0, 1]",
              "download the checkpoint again"):
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.e2e  # python -m zoo.generate in a subprocess
def test_generate_hf_exits_2_on_non_finite_weights_and_mistyped_config(tmp_path, models):
    write_nan_checkpoint(models[0], tmp_path / "nan", EMBED, np.inf)
    models[0].to_hf(tmp_path / "eps")
    raw = json.loads((tmp_path / "eps" / "config.json").read_text())
    (tmp_path / "eps" / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": "1e-5"}))
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    for folder, words in (("nan", [EMBED, "non-finite", "Inf"]),
                          ("eps", ["rms_norm_eps='1e-5'", "a finite number"])):
        proc = subprocess.run(
            [sys.executable, "-m", "zoo.generate", "--hf", str(tmp_path / folder), "--prompt",
             "hi", "--max-new-tokens", "1"], capture_output=True, text=True, env=env, cwd=ROOT,
            timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        for w in words:
            assert w in proc.stderr, (w, proc.stderr[-2000:])


# -- --from-hf training ------------------------------------------------------------------------

SETS = ["num_hidden_layers=1", "hidden_size=32", "intermediate_size=32",
        "num_attention_heads=4", "head_dim=8"]
RECIPE_FLAGS = ["--steps", "2", "--batch-size", "4", "--seq-len", "32", "--no-progress",
                "--sample-tokens", "0", *(x for s in SETS for x in ("--set", s))]


def recipe_main(argv):
    import contextlib
    import importlib.util
    import io
    spec = importlib.util.spec_from_file_location("recipe_mini_mixtral",
                                                  ROOT / "recipes" / "mini_mixtral.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):
        return module.main(argv)


@pytest.mark.slow  # compiles the train step before the weights are read
def test_from_hf_training_exits_2_on_non_finite_weights_or_a_mistyped_config(
        tmp_path, devices, capsys):
    from zoo.train import cli
    config = cli.apply_overrides(mixtral.MixtralConfig.mini(), SETS)
    model = mixtral.Mixtral(config, inputs_shape=(4, 32), rngs=nnx.Rngs(0))
    key = "model.layers.0.self_attn.o_proj.weight"
    write_nan_checkpoint(model, tmp_path / "nan", key)
    model.to_hf(tmp_path / "eps")
    raw = json.loads((tmp_path / "eps" / "config.json").read_text())
    (tmp_path / "eps" / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": "1e-5"}))
    # the config: refused with the flag errors, before anything is built
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        recipe_main([*RECIPE_FLAGS, "--from-hf", str(tmp_path / "eps"), "--run-dir",
                     str(tmp_path / "run_eps")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "rms_norm_eps='1e-5'" in err and "a finite number" in err, err
    # the weights: refused as they are read, not blamed on the learning rate
    code = recipe_main([*RECIPE_FLAGS, "--from-hf", str(tmp_path / "nan"), "--run-dir",
                        str(tmp_path / "run_nan")])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert key in err and "non-finite" in err and "Traceback" not in err
    assert "--lr" not in err
    assert not (tmp_path / "run_nan" / "checkpoints").exists() or not os.listdir(
        tmp_path / "run_nan" / "checkpoints")
