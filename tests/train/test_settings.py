"""One place per setting: the model settings ``attention``, ``dtype``, ``param_dtype`` and
``remat`` live in the model config only. The flags that name them (``--attention``,
``--dtype``, ``--param-dtype``, ``--remat``) are spellings of ``--set FIELD=VALUE``; a flag and
a ``--set`` that disagree are refused; the platform default dtype applies in one place; the
preset and the overrides are resolved once on the way from the flags to the built model.
(An old run.json with these settings in ``parallelism`` loads: test_load_classes.py.)
"""

import dataclasses
import importlib

import jax.numpy as jnp
import pytest

from zoo.models.mixtral import MixtralConfig
from zoo.train import TrainConfig, Trainer, cli
from zoo.train.load import saved_train_config

# the module: the attribute zoo.train.build is the function
build_lib = importlib.import_module("zoo.train.build")

TINY = ("num_hidden_layers=1", "hidden_size=32", "intermediate_size=32",
        "num_attention_heads=4", "head_dim=8")
RECIPE = cli.Recipe(name="settings", train=TrainConfig(
    family="mixtral", preset="mini", overrides=TINY, batch_size=4, seq_len=32, progress=False,
    sample_tokens=0))


def _parse(argv):
    _, args, train = cli.parse(RECIPE, argv)
    return args.model_choice, train


@pytest.mark.parametrize("flag,value,field,want", [
    ("--dtype", "bfloat16", "dtype", jnp.bfloat16),
    ("--param-dtype", "bfloat16", "param_dtype", jnp.bfloat16),
    ("--attention", "ring", "attention_implementation", "ring"),
    ("--remat", "full", "remat_policy", "full"),
    ("--remat", "none", "remat_policy", None)])
def test_a_model_flag_is_its_set(flag, value, field, want):
    """``--dtype X`` and ``--set dtype=X`` give the same settings and the same model config;
    the value reaches the model config's field and nothing else changes."""
    by_flag, train_flag = _parse([flag, value])
    by_set, train_set = _parse(["--set", f"{field}={value}"])
    assert train_flag == train_set
    assert train_flag.overrides == (*TINY, f"{field}={value}")
    assert by_flag.config == by_set.config
    assert getattr(by_flag.config, field) == want
    plain = MixtralConfig.mini(**{o.split("=")[0]: int(o.split("=")[1]) for o in TINY})
    assert by_flag.config == dataclasses.replace(plain, **{field: want})


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "bfloat16", "--set", "dtype=float32"],
     "--dtype bfloat16 and --set dtype=float32 both set the model config's dtype; pass one of "
     "them (--dtype X is the same as --set dtype=X)"),
    (["--set", "remat_policy=full", "--remat", "none"],
     "--set remat_policy=full and --remat none both set the model config's remat_policy; pass "
     "one of them (--remat X is the same as --set remat_policy=X)")])
def test_a_flag_and_a_set_that_disagree_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_agreeing_spellings_and_the_recipes_own_value_are_not_conflicts():
    """The same value twice is no conflict (``float32`` is ``f4``); a flag overrides the
    recipe's own ``overrides`` item (the recipe's values are defaults, not the user's)."""
    chosen, _ = _parse(["--dtype", "float32", "--set", "dtype=f4"])
    assert chosen.config.dtype == jnp.float32
    recipe = dataclasses.replace(RECIPE, train=RECIPE.train.replace(
        overrides=(*TINY, "dtype=bfloat16")))
    _, args, _ = cli.parse(recipe, ["--dtype", "float32"])
    assert args.model_choice.config.dtype == jnp.float32


def test_the_training_config_refuses_model_settings_naming_the_replacement():
    with pytest.raises(TypeError, match=r"TrainConfig got dtype=: a model setting lives in the "
                                        r"model config .* pass overrides=\['dtype=bfloat16'\]"):
        TrainConfig(dtype="bfloat16")
    with pytest.raises(TypeError, match=r"overrides=\['remat_policy=full'\]"):
        TrainConfig(parallelism={"remat": "full"})
    with pytest.raises(TypeError, match=r"ParallelismSection got param_dtype=.*"
                                        r"overrides=\['param_dtype=bfloat16'\]"):
        from zoo.train.config import ParallelismSection
        ParallelismSection(param_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="attention_implementation=ring"):
        RECIPE.train.replace(attention="ring")
    with pytest.raises(AttributeError, match="the model config's field 'remat_policy'"):
        RECIPE.train.remat  # noqa: B018


@pytest.mark.parametrize("platform,rehearse,overrides,want", [
    ("cpu", False, (), jnp.float32),           # the model config's
    ("cpu", True, (), jnp.bfloat16),           # the rehearsal of an accelerator run
    ("gpu", False, (), jnp.bfloat16),
    ("tpu", False, (), jnp.bfloat16),
    ("gpu", False, ("dtype=float32",), jnp.float32),  # a dtype set is never replaced
    ("cpu", True, ("dtype=float16",), jnp.float16)])
def test_the_platform_default_dtype(platform, rehearse, overrides, want):
    """bfloat16 compute on GPU/TPU and under --rehearse unless a dtype was set; parameters keep
    the model config's dtype."""
    train = RECIPE.train.replace(overrides=(*TINY, *overrides), rehearse=rehearse)
    chosen = build_lib.choose_model(train)
    got = build_lib.resolve_model_config(train, chosen.config, platform=platform)
    assert got.dtype == want and got.param_dtype == jnp.float32
    assert build_lib.PLATFORM_DTYPE == "bfloat16"


def test_an_old_train_section_folds_its_model_settings_into_overrides():
    """run.json from before: ``parallelism`` held attention/dtype/param_dtype/remat. They become
    overrides of the model fields, after the run's own (they took precedence then)."""
    saved = dataclasses.asdict(RECIPE.train.replace(overrides=(*TINY, "dtype=float16")))
    saved["parallelism"].update(attention="ring", dtype="bfloat16", param_dtype=None,
                                remat="none")
    train = saved_train_config(saved)
    assert train.overrides == (*TINY, "dtype=float16", "attention_implementation=ring",
                               "dtype=bfloat16", "remat_policy=none")
    config = build_lib.choose_model(train).config
    assert (config.dtype, config.param_dtype, config.remat_policy,
            config.attention_implementation) == (jnp.bfloat16, jnp.float32, None, "ring")
    assert saved_train_config(dataclasses.asdict(RECIPE.train)) == RECIPE.train  # today's


def test_the_model_config_is_resolved_once_and_the_spellings_record_the_same(tmp_path,
                                                                           devices,
                                                                           monkeypatch):
    """From the flags to the built model (`cli.setup`), the preset and the overrides are
    resolved once (one `choose_model`, one `apply_overrides`, one `resolve_model_config`);
    ``--dtype bfloat16`` and ``--set dtype=bfloat16`` build equal model configs and record
    equal run.json configs."""
    calls = {"choose_model": 0, "apply_overrides": 0, "resolve_model_config": 0}
    for name in calls:
        real = getattr(build_lib, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(build_lib, name, counted)
    records, configs = [], []
    for argv in (["--dtype", "bfloat16"], ["--set", "dtype=bfloat16"]):
        built, _ = cli.setup(RECIPE, [*argv, "--run-dir", str(tmp_path / "run")])
        assert calls == {"choose_model": 1, "apply_overrides": 1, "resolve_model_config": 1}
        calls.update(dict.fromkeys(calls, 0))
        built.data.close()
        configs.append(built.model_config)
        records.append(Trainer(built, default_hooks=False, lock=False).record)
    assert configs[0] == configs[1] and configs[0].dtype == jnp.bfloat16
    assert records[0] == records[1]
    assert records[0]["model"]["dtype"] == "bfloat16"
    assert records[0]["train"]["model"]["overrides"][-1] == "dtype=bfloat16"
    assert "dtype" not in records[0]["train"]["parallelism"]


def test_build_refuses_a_choice_made_for_other_overrides():
    """A `ModelChoice` carries the overrides it applied: handing `build` one made for another
    config is refused, not silently built."""
    choice = build_lib.choose_model(RECIPE.train)
    other = RECIPE.train.replace(overrides=(*TINY, "dtype=bfloat16"))
    with pytest.raises(ValueError, match=r"build: the ModelChoice applied the overrides .* "
                                         r"pass choose_model\(config\) of this config"):
        build_lib.build(other, model_config=choice, with_data=False)
