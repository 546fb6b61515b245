"""The recipes end to end (tiny configs via --set, CPU, 8 devices): learning, outputs, resume
after SIGTERM, corrupt-checkpoint fallback, NaN guard, refusal of another model shape, every
strategy x attention implementation, 2 processes x 4 devices == 1 x 8, flag errors.

Runs share work: one straight 12-step Mixtral run is the reference of the resume, fallback,
NaN and multi-process scenarios. Nothing comes from a persistent compile cache (8 CPU
devices: `zoo.train.launch.cache_is_safe`), so each process compiles its own step.
"""

import contextlib
import dataclasses
import importlib.util
import io
import json
import math
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import typing

import jax
import numpy as np
import pytest

from zoo.models.mixtral import Mixtral, MixtralDecoderLayer
from zoo.train import TrainConfig, cli
from zoo.train.checkpoint import Checkpointer
from zoo.train import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMON = ["--batch-size", "4", "--seq-len", "32", "--no-progress", "--sample-tokens", "0"]
TINY = {
    "mini_mixtral": ["--set", "num_hidden_layers=1", "--set", "hidden_size=32",
                     "--set", "intermediate_size=32", "--set", "num_attention_heads=4",
                     "--set", "head_dim=8"],
    "mini_deepseek3": ["--set", "num_hidden_layers=2", "--set", "hidden_size=32",
                       "--set", "intermediate_size=64", "--set", "moe_intermediate_size=16",
                       "--set", "kv_lora_rank=16", "--set", "q_lora_rank=16",
                       "--set", "qk_rope_head_dim=8", "--set", "qk_nope_head_dim=8",
                       "--set", "v_head_dim=8"],
}
# the reference scenario: 12 planned steps of a tiny Mixtral (ep_as_cp, auto attention = ring)
STRAIGHT = ["--steps", "12", *COMMON, *TINY["mini_mixtral"]]


def recipe(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_main(name, argv, stdout=None):
    """main() in this process; returns (exit code, steps run). ``stdout``: a list that receives
    what main printed to stdout."""
    steps, buf = [], io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = recipe(name).main(list(argv), on_step=lambda s, row: steps.append(s))
    if stdout is not None:
        stdout.append(buf.getvalue())
    return code, steps


def losses(run_dir):
    rows = read_metrics(run_dir)
    return [r["step"] for r in rows], np.array([r["loss"] for r in rows])


def sub_env():
    env = dict(os.environ)
    # no persistent compile cache for 8 CPU devices (`zoo.train.launch.cache_is_safe`)
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_COORDINATOR_ADDRESS"):
        env.pop(name, None)
    return env


# A subprocess that SIGTERMs itself when step N's metrics are logged: the signal arrives mid-run
# through the real handler, deterministically (an outside kill would race a ~30 ms step). The
# loop reads step N's metrics while step N+1 runs, so the run stops after step N+1.
SELF_TERM = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("recipe", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
at = int(sys.argv[2])
def hook(step, row):
    if step == at:
        os.kill(os.getpid(), signal.SIGTERM)
sys.exit(mod.main(sys.argv[3:], on_step=hook))
"""


@pytest.fixture(scope="module")
def straight(tmp_path_factory, devices):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    code, steps = run_main("mini_mixtral", [*STRAIGHT, "--run-dir", str(run_dir),
                                            "--checkpoint-every", "6"])
    assert code == 0 and steps == list(range(1, 13))
    return run_dir


# -- learning and outputs ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def learned(tmp_path_factory, devices):
    run_dir = tmp_path_factory.mktemp("learn") / "run"
    out = []
    code, _ = run_main("mini_deepseek3", ["--steps", "20", *COMMON, *TINY["mini_deepseek3"],
                                          "--attention", "all_gather", "--run-dir", str(run_dir),
                                          "--sample-tokens", "8"], stdout=out)
    assert code == 0
    (run_dir / "stdout.txt").write_text(out[0])
    return run_dir


def test_twenty_steps_lower_the_loss(learned):
    steps, loss = losses(learned)
    assert steps == list(range(1, 21))
    assert loss[-3:].mean() < loss[:3].mean() - 1.0, loss


def test_run_outputs(learned):
    rows = read_metrics(learned)
    for key in ("step", "loss", "aux_loss", "lr", "grad_norm", "tokens_per_s",
                "model_flops_per_s", "expert_counts", "mtp_loss"):
        assert all(key in r for r in rows), key
    # the end-of-run sample: 8 greedy tokens after the default prompt, decoded
    out = (learned / "stdout.txt").read_text()
    assert "mini_deepseek3: sample (8 greedy tokens after 'def'):\ndef" in out, out[-500:]
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in rows)
    # tokens/s is the global batch over the step's wall time
    r = rows[-1]
    assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"])
    assert r["model_flops_per_s"] > 6 * r["tokens_per_s"]
    warmup = 2  # min(100, 20 // 10)
    assert rows[0]["lr"] == pytest.approx(3e-3 / warmup, rel=1e-6)
    assert rows[-1]["lr"] < rows[warmup]["lr"]
    info = json.loads((learned / "run.json").read_text())
    assert info["device_count"] == 8 and info["process_count"] == 1
    assert set(info["versions"]) >= {"zoo", "jax", "flax"}
    assert info["config"]["model"]["hidden_size"] == 32
    assert info["config"]["moe"]["dispatch"] in ("all_to_all", "all_gather")  # "auto" resolved
    assert all(r["dropped_tokens"] == 0 for r in rows)  # dropless by default, and logged
    saved = info["config"]["train"]  # dataclasses.asdict of the TrainConfig, defaults resolved
    assert set(saved) == {f.name for f in dataclasses.fields(TrainConfig)}  # the sections
    assert json.loads(json.dumps(dataclasses.asdict(TrainConfig(**saved)))) == saved
    train = TrainConfig(**saved).flat()
    assert (train["steps"], train["batch_size"], train["seq_len"]) == (20, 4, 32)
    # --attention is --set attention_implementation=: recorded in the overrides and the model
    assert train["overrides"][-1] == "attention_implementation=all_gather"
    assert info["config"]["model"]["attention_implementation"] == "all_gather"
    assert (train["mesh"], train["strategy"], train["load_balance"], train["run_dir"]) == (
        "fsdp=2,expert=2,context=2", "ep_as_cp", "auto", str(learned))
    assert train["aux_loss_weight"] == info["config"]["model"]["aux_loss_alpha"]
    assert info["config"]["context_parallel"] == 4
    assert (learned / "loss.png").stat().st_size > 1000
    assert Checkpointer(learned / "checkpoints").steps() == [20]
    summary = [line for line in (learned / "stdout.txt").read_text().splitlines()
               if line.startswith("mini_deepseek3: finished")][-1]  # the sample follows it
    assert summary.startswith("mini_deepseek3: finished 20/20 steps; loss ")
    assert "tokens/s" in summary and summary.endswith(f"run dir {learned}")


def test_finished_run_has_nothing_to_do(tmp_path, straight, capsys):
    """A rerun of a finished run says so without compiling the step first."""
    run_dir = tmp_path / "copy"
    shutil.copytree(straight, run_dir)
    out = []
    code, steps = run_main("mini_mixtral", [*STRAIGHT, "--run-dir", str(run_dir)], stdout=out)
    assert code == 0 and steps == []  # already done: nothing to run
    err = capsys.readouterr().err
    assert "already at step 12 of the planned 12" in out[0], out[0]
    assert "compiling" not in err and "compiled" not in err and "sample" not in out[0], err


# -- resume ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sigterm_scenario(tmp_path_factory, straight):
    """12 planned steps, SIGTERM while step 7 runs (subprocess), then the same command again."""
    run_dir = tmp_path_factory.mktemp("sigterm") / "run"
    argv = [*STRAIGHT, "--run-dir", str(run_dir), "--checkpoint-every", "100"]
    proc = subprocess.run([sys.executable, "-c", SELF_TERM,
                           str(ROOT / "recipes" / "mini_mixtral.py"), "6", *argv],
                          env=sub_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    after_signal = dict(code=proc.returncode, err=proc.stderr, out=proc.stdout,
                        ckpt_steps=Checkpointer(run_dir / "checkpoints").steps(),
                        metric_steps=losses(run_dir)[0])
    code, resumed_steps = run_main("mini_mixtral", argv)
    return dict(run_dir=run_dir, after_signal=after_signal, code=code, resumed=resumed_steps)


@pytest.mark.e2e
def test_sigterm_saves_the_step_reached_and_exits_cleanly(sigterm_scenario):
    s = sigterm_scenario["after_signal"]
    assert s["code"] == 0, s["err"][-3000:]
    assert "SIGTERM received" in s["err"] and "stopped by SIGTERM at step 7/12" in s["out"]
    assert s["ckpt_steps"] == [7] and s["metric_steps"] == list(range(1, 8))


@pytest.mark.e2e
def test_rerun_continues_from_the_next_step(sigterm_scenario):
    assert sigterm_scenario["code"] == 0
    assert sigterm_scenario["resumed"] == list(range(8, 13))
    assert Checkpointer(sigterm_scenario["run_dir"] / "checkpoints").steps() == [7, 12]


@pytest.mark.e2e
def test_resumed_losses_equal_a_straight_run(sigterm_scenario, straight):
    steps, got = losses(sigterm_scenario["run_dir"])
    ref_steps, want = losses(straight)
    assert steps == ref_steps == list(range(1, 13))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_corrupt_latest_checkpoint_falls_back(tmp_path, straight):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    for root, _, files in os.walk(run_dir / "checkpoints" / "12" / "state"):
        for f in files:
            os.truncate(os.path.join(root, f), 0)
    with pytest.warns(UserWarning, match="cannot be read"):
        code, steps = run_main("mini_mixtral", [*STRAIGHT, "--run-dir", str(run_dir)])
    assert code == 0 and steps == list(range(7, 13))
    np.testing.assert_allclose(losses(run_dir)[1], losses(straight)[1], atol=1e-5, rtol=0)
    assert "corrupt-12" in os.listdir(run_dir / "checkpoints")


@pytest.mark.slow
def test_nan_guard_keeps_the_last_good_checkpoint(tmp_path, straight, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    ckpt = run_dir / "checkpoints" / "12"
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    code, steps = run_main("mini_mixtral", [*STRAIGHT, "--steps", "16", "--lr", "1e30",
                                            "--checkpoint-every", "1", "--run-dir", str(run_dir)])
    assert code == cli.EXIT_DIVERGED and steps == []
    err = capsys.readouterr().err
    assert "training diverged" in err and "last good checkpoint is step 12" in err
    assert Checkpointer(run_dir / "checkpoints").steps() == [6, 12]
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before
    assert losses(run_dir)[0] == list(range(1, 13))
    # and the good checkpoint still resumes
    code, steps = run_main("mini_mixtral", [*STRAIGHT, "--steps", "13", "--run-dir", str(run_dir)])
    assert code == 0 and steps == [13]


def test_other_model_shape_is_refused_naming_the_fields(tmp_path, straight, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    code, steps = run_main("mini_mixtral", [*STRAIGHT, "--set", "intermediate_size=64",
                                            "--run-dir", str(run_dir)])
    assert code == 2 and steps == []
    err = capsys.readouterr().err
    assert "intermediate_size: 32 -> 64" in err and "wi_gate" in err


# -- strategies, attention, processes ----------------------------------------------------------

@pytest.mark.parametrize("strategy,attention,name,extra", [
    ("fsdp", "all_gather", "mini_mixtral", []),
    ("fsdp", "ring", "mini_mixtral", ["--dtype", "bfloat16"]),
    ("cp", "all_gather", "mini_mixtral", ["--data", "TEXT"]),
    ("cp", "ring", "mini_deepseek3", ["--no-load-balance"]),
    ("ep_as_cp", "all_gather", "mini_deepseek3", []),
    # row-balanced data: the layers know the layout, so a window's unseen hops stay home
    ("ep_as_cp", "ring", "mini_mixtral", ["--load-balance", "row", "--set", "sliding_window=4"])])
def test_every_strategy_and_attention_trains(tmp_path, devices, strategy, attention, name,
                                             extra):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (text / "b.md").write_text("# notes\n" + "lorem ipsum dolor sit amet " * 50)
    extra = [str(text) if e == "TEXT" else e for e in extra]
    # fsdp puts the batch over all 8 devices: 8 rows
    batch = ["--batch-size", "8"] if strategy == "fsdp" else []
    run_dir = tmp_path / "run"
    code, steps = run_main(name, ["--steps", "3", *COMMON, *batch, *TINY[name], *extra,
                                  "--strategy", strategy, "--attention", attention,
                                  "--run-dir", str(run_dir)])
    assert code == 0 and steps == [1, 2, 3]
    _, loss = losses(run_dir)
    assert np.all(np.isfinite(loss))
    info = json.loads((run_dir / "run.json").read_text())["config"]
    train = TrainConfig(**info["train"])
    assert train.strategy == strategy
    assert info["model"]["attention_implementation"] == attention
    if "--dtype" in extra:
        assert info["model"]["dtype"] == "bfloat16" and info["model"]["param_dtype"] == "float32"
    if "--data" in extra:
        assert info["train"]["data"]["data"] == [str(text)]
    balance = ("none" if "--no-load-balance" in extra else
               "row" if "row" in extra else "auto")
    assert train.load_balance == balance
    assert info["model"]["attention_layout"] == {"none": "contiguous", "row": "balanced",
                                                 "auto": None}[balance]


@pytest.mark.slow
def test_from_hf_starts_from_the_checkpoint(tmp_path, learned):
    """A tiny DeepSeek-V3 written in the Hugging Face layout and trained with --from-hf gives
    the same losses as the run that initialised the same weights itself (seed 0)."""
    from flax import nnx

    from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config, to_hf
    overrides = [v for k, v in zip(TINY["mini_deepseek3"][::2], TINY["mini_deepseek3"][1::2])]
    # the recipe's own overrides (its MTP module) come first, as on the command line
    config = cli.apply_overrides(DeepSeek3Config.mini(), ["num_nextn_predict_layers=1", *overrides])
    to_hf(DeepSeek3(config, inputs_shape=(4, 32), rngs=nnx.Rngs(0)), tmp_path / "hf")
    run_dir = tmp_path / "run"
    code, steps = run_main("mini_deepseek3", ["--steps", "20", *COMMON, "--attention",
                                              "all_gather", "--from-hf", str(tmp_path / "hf"),
                                              "--run-dir", str(run_dir)])
    assert code == 0 and steps == list(range(1, 21))
    got, want = losses(run_dir)[1], losses(learned)[1]
    print("from-hf losses", got[:3], "straight", want[:3])
    # the trunk starts from the checkpoint's weights, the same as the seed's: the first loss
    # (before any update) is the same; the MTP module (not in the Hub layout) starts afresh
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)
    assert got[-1] < got[0] - 0.5  # and it trains


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_two_processes_match_one(tmp_path, straight):
    """2 processes x 4 devices (gloo) == 1 process x 8 devices, step by step. The environment
    says 8 devices (XLA_FLAGS from conftest); --devices 4 must override it."""
    port = _free_port()
    run_dir = tmp_path / "run"
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "recipes" / "mini_mixtral.py"), *STRAIGHT, "--devices", "4",
         "--mesh", "fsdp=2,expert=2,context=2", "--run-dir", str(run_dir),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=sub_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    info = json.loads((run_dir / "run.json").read_text())
    assert (info["device_count"], info["local_device_count"], info["process_count"]) == (8, 4, 2)
    steps, got = losses(run_dir)
    assert steps == list(range(1, 13))
    np.testing.assert_allclose(got, losses(straight)[1], atol=1e-5, rtol=0)
    data = os.listdir(run_dir / "checkpoints" / "12" / "data")
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data)


def _documented_two_process_commands(port: int, steps: int | None = None):
    """docs/training.md's two-process example, one argv per process, on `port` (and for
    `steps` steps, its own --steps replaced, when given)."""
    text = (ROOT / "docs" / "training.md").read_text()
    lines = [line.rstrip(" &").split() for line in text.splitlines()
             if line.startswith("python recipes/") and "--num-processes 2" in line]
    assert len(lines) == 2, lines
    out = []
    for argv in lines:
        argv = [f"127.0.0.1:{port}" if a.startswith("127.0.0.1:") else a for a in argv]
        if steps is not None and "--steps" in argv:
            del argv[argv.index("--steps"):argv.index("--steps") + 2]
        more = [] if steps is None else ["--steps", str(steps)]
        out.append([sys.executable, str(ROOT / argv[1]), *argv[2:], *more])
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_the_documented_two_process_command_ends_cleanly(tmp_path):
    """docs/training.md's two-process run as written (5 steps; a free port, its run dir under
    a fresh working folder): both processes exit 0, the summary and the closing greedy sample
    (every process computes it, process 0 prints it) appear once, no traceback."""
    procs = [subprocess.Popen(argv, env=sub_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
             for argv in _documented_two_process_commands(_free_port())]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    both = "\n".join(outs)
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    assert "Traceback" not in both, both[-3000:]
    assert both.count("mini_deepseek3: finished 5/5 steps") == 1, both[-3000:]
    assert both.count("sample (48 greedy tokens after 'def')") == 1, both[-3000:]
    assert (tmp_path / "runs" / "mini_deepseek3" / "checkpoints" / "5").is_dir()


# -- flags -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--set", "hiden_size=64"], "has no field 'hiden_size'; valid fields: vocab_size, "
                                 "hidden_size, intermediate_size"),
    (["--set", "hidden_size=big"], "expected int"),
    (["--set", "hidden_size"], "write FIELD=VALUE"),
    (["--mesh", "fsdp=3"], "multiply to 3, but there are 8 devices"),
    (["--mesh", "fsdp=2,pipeline=4"], "bad mesh entry 'pipeline=4'"),
    (["--seq-len", "36"], "not divisible by 2*context = 8"),
    (["--batch-size", "3"], "batch=3 is not divisible"),
    (["--devices", "4"], "already started with 8 CPU devices"),
    (["--steps", "0"], "--steps 0: must be an integer >= 1"),
    (["--final-lr-fraction", "-1"], "--final-lr-fraction -1.0: must be in [0, 1]"),
    (["--adam-eps", "-1"], "--adam-eps -1.0: must be a finite number > 0"),
    (["--clip", "nan"], "--clip nan: must be a number"),
    (["--adam-b1", "nan"], "--adam-b1 nan: must be in [0, 1)"),
    (["--aux-loss-weight", "nan"], "--aux-loss-weight nan: must be a finite number >= 0"),
    (["--expert-bias-rate", "nan"], "--expert-bias-rate nan: must be a finite number >= 0"),
    (["--weight-decay", "nan"], "--weight-decay nan: must be a finite number >= 0"),
    (["--peer-timeout", "0"], "--peer-timeout 0.0: must be a finite number of seconds > 0"),
    (["--aux-loss-field", "bogus"], "--aux-loss-field bogus: MixtralConfig has no such field; "
                                    "valid fields holding a weight:"),
    (["--data"], "--data (no paths): needs at least one file"),
    (["--dtype", "float33"], "argument --dtype: 'float33' is not valid for the model config's "
                             "dtype: expected a dtype name (e.g. float32, bfloat16)"),
    (["--dtype", "bfloat16", "--set", "dtype=float32"],
     "--dtype bfloat16 and --set dtype=float32 both set the model config's dtype; pass one of "
     "them (--dtype X is the same as --set dtype=X)"),
    (["--steps", "ten"], "argument --steps/--run.steps: 'ten' is not valid for "
                         "TrainConfig.steps: expected int"),
    (["--strategy", "tp"], "'tp' is not valid for TrainConfig.strategy: expected one of fsdp, "
                           "cp, ep_as_cp or none"),
    (["--set", "scan_layers=maybe"], "--set scan_layers=maybe: expected true or false (the "
                                     "field MixtralConfig.scan_layers is true or false)"),
    (["--steps", "12", "--warmup", "50"], "--warmup 50: must be in [0, --steps 12]"),
    (["--steps", "-5"], "--steps -5: must be an integer >= 1"),
    (["--data", "nothere.txt"], "--data: nothere.txt (does not exist)"),
    (["--data", "{tmp}/binary.txt"], "1 of 1 files are not text"),
])
def test_flag_errors_are_clear(tmp_path, devices, capsys, argv, message):
    """A refused flag or input: exit 2, one line naming the flag, the value and the fix, then
    "see --help" (no usage block, no traceback), and no run dir created."""
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 8)
    run_dir = tmp_path / "run"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as e:
        run_main("mini_mixtral", [*COMMON, *TINY["mini_mixtral"], *argv,
                                  "--run-dir", str(run_dir)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "cuda" not in line and line.strip()]
    assert message in err
    assert len(lines) == 1 and lines[0].endswith("(see --help)"), err
    assert "usage:" not in err and "Traceback" not in err
    assert not run_dir.exists()  # nothing written for a refused run


def test_set_parses_values_by_field():
    from zoo.models.deepseek3 import DeepSeek3Config
    cfg = cli.apply_overrides(DeepSeek3Config.mini(), [
        "hidden_size=64", "routed_scaling_factor=1.5", "q_lora_rank=None", "dtype=bfloat16",
        "norm_topk_prob=false", "attention_implementation=ring",
        'rope_scaling={"factor": 2.0, "original_max_position_embeddings": 512}'])
    assert (cfg.hidden_size, cfg.routed_scaling_factor, cfg.q_lora_rank) == (64, 1.5, None)
    assert cfg.dtype == jax.numpy.bfloat16 and cfg.norm_topk_prob is False
    assert cfg.attention_implementation == "ring" and cfg.rope_scaling.factor == 2.0
    assert cli.config_to_json(cfg)["dtype"] == "bfloat16"


def test_default_mesh():
    assert cli.default_mesh(8, "cpu") == "fsdp=2,expert=2,context=2"
    assert cli.default_mesh(4, "cpu") == "fsdp=1,expert=2,context=2"
    assert cli.default_mesh(1, "cpu") == "fsdp=1,expert=1,context=1"
    assert cli.default_mesh(16, "gpu") == "fsdp=16"


# -- TrainConfig: generated flags, typed values, a research recipe -----------------------------

def test_help_lists_every_train_config_field_with_its_default(capsys):
    """`--help` has one flag per TrainConfig field, its help text the field's doc and its
    default the recipe's value."""
    mod = recipe("mini_deepseek3")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    text = "".join(out.split())  # argparse wraps lines (also after hyphens)
    for section in dataclasses.fields(TrainConfig):
        assert f"{section.name} (TrainConfig.{section.name})" in out
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else
                                    type(getattr(mod.RECIPE.train, section.name))):
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            default = getattr(getattr(mod.RECIPE.train, section.name), f.name)
            default = list(default) if isinstance(default, tuple) else default
            help_text = "".join(f.metadata["help"].split())
            assert f"  {flag}" in out, flag
            assert f"--{section.name}.{f.name.replace('_', '-')}" in out, flag
            assert f"{help_text}(default:{default})" in text, (flag, default)
    assert "--set FIELD=VALUE" in out and "--no-load-balance" in out
    from zoo.train.config import MODEL_FLAGS  # the model settings' flags: spellings of --set
    for name, spec in MODEL_FLAGS.items():
        assert f"  --{name.replace('_', '-')} " in out and f"--set{spec.field}=VALUE" in text
    assert "(default:0.01)" in text and "(default:deepseek3)" in text  # the recipe's
    # the description is the docstring's whole first paragraph
    first = "".join(mod.__doc__.split("\n\n")[0].split())
    assert first.endswith("module).") and first in text


def test_the_training_guide_lists_every_section_and_field():
    """docs/training.md's table of sections names each TrainConfig field, in its section."""
    table = {}
    for line in (ROOT / "docs" / "training.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`") and cells[0] != "`section`":
            table[cells[0].strip("`")] = [c.strip(" `") for c in cells[1].split(",")]
    config = TrainConfig()
    want = {s.name: [f.name for f in dataclasses.fields(getattr(config, s.name))]
            for s in dataclasses.fields(TrainConfig)}
    assert {k: table.get(k) for k in want} == want


def test_values_are_parsed_from_the_field_types():
    """`parse_text` follows the resolved annotation: ints, floats, bools, optionals, tuples,
    Literals, dtype names, nested dataclasses; a bad value names what was expected."""
    from typing import Any, Literal

    import jax.numpy as jnp

    from zoo.layers.rope import YaRN
    from zoo.train.config import DTypeName, parse_text
    cases = [(int, "12", 12), (float, "1e-3", 1e-3), (float, "inf", float("inf")),
             (bool, "no", False), (int | None, "None", None), (int | None, "4", 4),
             (int | str, "3", 3), (int | str, "x3", "x3"), (tuple[int, ...], "1,2,3", (1, 2, 3)),
             (tuple[int, ...], "[4, 5]", (4, 5)), (tuple[str, float], "a,2", ("a", 2.0)),
             (Literal["fsdp", "cp"] | None, "cp", "cp"), (DTypeName, "f4", "float32"),
             (Any, "bfloat16", jnp.bfloat16), (YaRN | None, '{"factor": 2, '
              '"original_max_position_embeddings": 64}', YaRN(2, 64))]
    for tp, text, want in cases:
        got = parse_text(tp, text, jnp.float32 if tp is Any else None)
        if tp is Any:  # a dtype field (its current value is one): a numpy scalar type
            assert jnp.dtype(got) == jnp.dtype(want), got
        else:
            assert got == want and type(got) is type(want), (tp, text, got)
    for tp, text, expected in [(int, "1.5", "expected int"), (bool, "maybe", "true or false"),
                               (int | None, "x", "expected int or none"),
                               (tuple[int, ...], "1,b", "expected int"),
                               (Literal["a", "b"], "c", "expected one of a, b"),
                               (DTypeName, "float33", "a dtype name"),
                               (YaRN, "[1]", "a JSON object of YaRN fields")]:
        with pytest.raises(ValueError, match=expected):
            parse_text(tp, text)
    # TrainConfig's choices are the library's own
    from zoo.models.config import REMAT_POLICIES
    from zoo.ops.attention import IMPLEMENTATIONS
    from zoo.partitioning import STRATEGIES
    from zoo.train.config import MODEL_FLAGS, ParallelismSection
    hints = typing.get_type_hints(ParallelismSection)
    assert set(typing.get_args(typing.get_args(hints["strategy"])[0])) == set(STRATEGIES)
    assert set(typing.get_args(MODEL_FLAGS["attention"].type)) == set(IMPLEMENTATIONS)
    assert all(p in MODEL_FLAGS["remat"].help for p in REMAT_POLICIES)


class ResearchLayer(MixtralDecoderLayer):
    """A research layer: the same computation, and a record that it was built."""

    built: typing.ClassVar[list[int]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ResearchLayer.built.append(kwargs["layer_idx"])


class ResearchMixtral(Mixtral):
    pass


def test_a_research_recipe_names_its_model_and_layer_classes(tmp_path, straight):
    """A recipe of the mini ones' shape with its own model class and ``decoder_layer_cls``
    trains with them (here they compute what Mixtral does, so the losses equal the straight
    run's: the compiled program is even shared)."""
    from zoo.models.mixtral import MixtralConfig
    TRAIN = TrainConfig(steps=12, batch_size=4, seq_len=32, checkpoint_every=50,
                        aux_loss_field="router_aux_loss_coef", progress=False)
    RECIPE = cli.Recipe(name="research", model_cls=ResearchMixtral,
                        config=MixtralConfig.mini(), train=TRAIN,
                        decoder_layer_cls=ResearchLayer)
    ResearchLayer.built.clear()
    # step 2's loss follows the first update only: lr(0) = --lr under --warmup 1 in both runs
    argv = [*TINY["mini_mixtral"], "--steps", "2", "--warmup", "1", "--run-dir", str(tmp_path)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(RECIPE, argv) == 0
    assert ResearchLayer.built  # the recipe's layer class built the layers
    info = json.loads((tmp_path / "run.json").read_text())["config"]
    assert (info["model_cls"], info["decoder_layer_cls"]) == (
        f"{__name__}:ResearchMixtral", f"{__name__}:ResearchLayer")  # importable paths
    np.testing.assert_allclose(losses(tmp_path)[1], losses(straight)[1][:2], atol=1e-5, rtol=0)


DEVICE_COUNTS = """
import jax, sys
from zoo.train.launch import set_cpu_devices
want = None if sys.argv[1] == "default" else int(sys.argv[1])
set_cpu_devices(want)
print(jax.device_count())
set_cpu_devices(want)  # the same request again, after the start: accepted
try:
    set_cpu_devices(jax.device_count() + 1)
except ValueError as e:
    print(e)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("env,arg,count", [
    ({}, "default", 8), ({"JAX_NUM_CPU_DEVICES": "2"}, "default", 2),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=6"}, "3", 3)])
def test_cpu_device_count_through_jax_config(env, arg, count):
    """`set_cpu_devices` (jax_num_cpu_devices): 8 by default, the environment's count when it
    names one, an explicit count over both; after the backend started, another count is
    refused naming the fix."""
    base = {k: v for k, v in sub_env().items()
            if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    proc = subprocess.run([sys.executable, "-c", DEVICE_COUNTS, arg], env=base | env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == str(count)
    assert lines[1] == (f"--devices {count + 1}: jax already started with {count} CPU devices "
                        f"(something touched a device first); run the recipe as a script, or "
                        f"set JAX_NUM_CPU_DEVICES={count + 1} before starting Python")


LATE_PEER = """
import sys, time
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from zoo.train.launch import relax_cpu_collective_timeouts, set_cpu_devices
if sys.argv[1] == "short":
    relax_cpu_collective_timeouts(warn_s=1, terminate_s=1)
set_cpu_devices(4)  # adds the default limits where none are set yet
mesh = jax.make_mesh((4,), ("x",))

def late(i, x):
    if i == 0:
        time.sleep(4)
    return x

def body(x):  # the sum needs device 0's late value
    x = jax.pure_callback(late, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          jax.lax.axis_index("x"), x)
    return jax.lax.psum(x, "x")

f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))
x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
print(float(f(x)[0]))
"""


@pytest.mark.e2e
def test_a_late_virtual_device_does_not_abort_the_process():
    """XLA:CPU aborts when a peer reaches a collective 20 + 40 s late (shared cores make that
    happen); `set_cpu_devices` raises the limits through XLA_FLAGS. Shown with a peer 4 s late:
    under 1 s limits the process aborts naming the rendezvous, under the defaults it finishes."""
    base = {k: v for k, v in sub_env().items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    runs = {mode: subprocess.run([sys.executable, "-c", LATE_PEER, mode], env=base,
                                 capture_output=True, text=True, timeout=120, cwd=ROOT)
            for mode in ("short", "default")}
    assert runs["short"].returncode != 0
    assert "Termination timeout for `all reduce" in runs["short"].stderr
    assert runs["default"].returncode == 0, runs["default"].stderr[-2000:]
    assert runs["default"].stdout.split()[-1] == "6.0"


def test_no_compile_cache_on_several_cpu_devices():
    """Executables read back from jax's persistent cache deadlock now and then on several CPU
    devices, so the recipes' `enable_compile_cache` keeps it off there, even when
    JAX_COMPILATION_CACHE_DIR names one."""
    from zoo.train.launch import cache_is_safe, enable_compile_cache
    assert not cache_is_safe()  # 8 CPU devices (conftest)
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        enable_compile_cache()
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", False)


@pytest.mark.e2e
@pytest.mark.parametrize("recipe", ["mini_glm4_moe", "mini_gpt_oss"])
def test_new_family_recipes_describe_themselves(recipe):
    """``--help`` in a fresh process names the recipe's family and preset defaults."""
    out = subprocess.run([sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), "--help"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--family" in out.stdout and "--set FIELD=VALUE" in out.stdout
