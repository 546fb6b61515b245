"""Smoke tests of the benchmark scripts: `benchmarks/train_step.py --quick --profile` runs,
prints its table and its profile, and their figures agree with each other and with the model
config's own FLOP count; `benchmarks/moe.py --overflow` at tiny shapes counts the rounds and
drops the worst routing must give."""

import itertools
import os
import re
import subprocess
import sys

import pytest

from zoo.models.mixtral import MixtralConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "train_step.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the scripts' own helper modules

pytestmark = pytest.mark.e2e  # every test runs the benchmark script in a subprocess


def _number(text: str) -> float:
    return float(re.sub(r"[^0-9.]", "", text))


@pytest.fixture(scope="module")
def quick_run():
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--profile"], capture_output=True,
                          text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_quick_prints_a_consistent_table(quick_run):
    lines = quick_run.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    assert lines[header + 1].startswith("|---|")
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[header + 2:]))
    assert len(rows) == 1, quick_run  # --quick: one model x one strategy
    row = dict(zip(columns, (c.strip() for c in rows[0].strip("|").split("|"))))

    assert row["model"] == "mini_mixtral"
    assert row["strategy"].startswith("ep_as_cp")
    assert row["mesh"] == "fsdp=2,expert=2,context=2" and row["attention CP"] == "4"
    compile_s, step_ms = _number(row["compile s"]), _number(row["step ms (median)"])
    tokens_per_s, model_gflops = _number(row["tokens/s"]), _number(row["model GFLOP/s"])
    machine_gflops, mfu = _number(row["machine GFLOP/s"]), _number(row["MFU"]) / 100
    assert compile_s > 0 and step_ms > 0 and machine_gflops > 0
    assert row["vs base"] == "1.00x"

    # --quick is batch 8 x seq_len 64 of the mini Mixtral with one layer (printed in the header)
    assert "batch 8 x seq_len 64" in quick_run
    flops_per_token = MixtralConfig.mini(num_hidden_layers=1).flops_per_token(64)
    assert f"{flops_per_token / 1e6:.2f} MFLOP/token" in quick_run
    # the columns follow from each other (up to the printed rounding)
    assert tokens_per_s == pytest.approx(8 * 64 / (step_ms / 1e3), rel=0.01)
    assert model_gflops == pytest.approx(flops_per_token * tokens_per_s / 1e9, rel=0.01)
    assert mfu == pytest.approx(model_gflops / machine_gflops, rel=0.03, abs=6e-4)
    assert 0 < mfu < 1


def test_the_profile_adds_up_to_the_step(quick_run):
    """--profile: one row per part; the shares add up to the whole and the rows' times to the
    step; the matmul parts ran dots and the collectives none; the dots that ran hold at least
    the model's own FLOPs (the padded expert blocks and partial attention blocks add some)."""
    from _profile import CATEGORIES

    lines = quick_run.splitlines()
    title = next(line for line in lines if line.startswith("mini_mixtral ep_as_cp ("))
    step_ms = float(re.search(r"step (\d+) ms", title).group(1))
    start = lines.index(title) + 2
    assert lines[start] == "| part | share | ms of the step | GFLOP | GFLOP/s | MFU |"
    rows = {}
    for line in lines[start + 2:start + 2 + len(CATEGORIES)]:
        part, share, ms, gflop, _, _ = (c.strip() for c in line.strip("|").split("|"))
        rows[part] = dict(share=_number(share) / 100, ms=_number(ms), gflop=_number(gflop))
    assert list(rows) == list(CATEGORIES)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1, abs=0.01)
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(step_ms, abs=len(rows))
    assert rows["grouped matmul"]["gflop"] > 0 and rows["dense matmuls"]["gflop"] > 0
    assert rows["collectives"]["gflop"] == 0
    model = MixtralConfig.mini(num_hidden_layers=1).flops_per_token(64) * 8 * 64 / 1e9
    ran = sum(r["gflop"] for r in rows.values())
    assert model * 0.9 < ran < model * 4, (ran, model)


def test_categories_follow_scope_and_opcode():
    from _profile import categorize
    step = "jit(step)/transpose(jvp(layers_0_to_1))/layer_0"
    assert categorize("all-to-all", f"{step}/moe/experts", 0) == "collectives"
    assert categorize("fusion", f"{step}/self_attn/attend/attention_ring", 1e6) == "attention"
    assert categorize("fusion", f"{step}/moe/experts/grouped_matmul/dot", 1e6) == "grouped matmul"
    assert categorize("fusion", f"{step}/moe/shared_experts/mlp/dot", 1e6) == "dense matmuls"
    assert categorize("sort", f"{step}/moe/experts/sort", 0) == "MoE dispatch"
    assert categorize("fusion", "jit(step)/optimizer/add", 0) == "optimizer"
    assert categorize("fusion", f"{step}/input_layernorm/mul", 0) == "other"


def test_bad_flags_name_the_fix():
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--strategies", "tp"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "unknown strategy 'tp'; valid: fsdp, cp, ep_as_cp" in proc.stderr


def test_moe_overflow_table_counts_rounds_and_drops():
    """Every copy to the first device's experts (``one_device``), buffers of the balanced share
    (factor 1) on 8 devices: drop keeps 1/8 of the copies, exact needs 8 rounds and drops none,
    and the dropless baseline is its own ratio 1.00."""
    script = os.path.join(ROOT, "benchmarks", "moe.py")
    proc = subprocess.run([sys.executable, script, "--overflow", "--experts", "16", "--batch",
                           "8", "--length", "8", "--embed", "16", "--mlp", "16", "--iters", "1",
                           "--rounds", "1", "--factors", "1", "--routings", "one_device"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| routing |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = [dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
            for line in lines[header + 2:] if line.startswith("|")]
    by = {r["overflow"]: r for r in rows}
    assert sorted(by) == ["drop", "dropless", "exact"] and len(rows) == 3
    assert all(r["routing"] == "one_device" and r["busiest device (x balanced share)"] == "8.00"
               for r in rows)
    assert by["dropless"]["vs dropless"] == "1.00" and by["dropless"]["buffer_factor"] == "-"
    assert by["drop"]["dropped copies"] == "87.50%" and by["drop"]["moe_rounds"] == "-"
    assert by["exact"]["dropped copies"] == "0.00%" and by["exact"]["moe_rounds"] == "8"
    assert all(_number(r["tokens/s"]) > 0 for r in rows)


def test_vs_maxtext_names_the_venv_it_needs_and_zoo_has_its_fields():
    """benchmarks/vs_maxtext.py: without MaxText's Python it says how to make one; every zoo
    field of its shape is a DeepSeek-V3 config field (the MaxText run itself needs the venv,
    which is not a dependency)."""
    import dataclasses

    import vs_maxtext
    from zoo.models.deepseek3 import DeepSeek3Config

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "vs_maxtext.py"),
                           "--maxtext-python", "/nonexistent/python"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "pip install 'maxtext[tpu]==0.2.5'" in proc.stderr
    fields = {f.name for f in dataclasses.fields(DeepSeek3Config)}
    assert set(vs_maxtext.SHAPE) | set(vs_maxtext.ZOO_ONLY) <= fields
    config = DeepSeek3Config.mini(**{k: v for k, (_, v) in vs_maxtext.SHAPE.items()},
                                  **vs_maxtext.ZOO_ONLY)
    assert config.hidden_size == 256 and config.n_routed_experts == 16
    # --goal-row: zoo's side is a command benchmarks/scale.py takes, on MaxText's row
    import scale
    goal = scale.parse_args(vs_maxtext.ZOO_GOAL_ROW)
    assert (goal.target, goal.mesh, goal.batch_size, goal.seq_len) == (
        "tpu-v5p-256", "fsdp=4,expert=64", 256, 4096)
    assert vs_maxtext.MAXTEXT_GOAL_ROW["ici_expert_parallelism"] == 64
    assert vs_maxtext.MAXTEXT_GOAL_ROW["max_target_length"] == goal.seq_len
    # MaxText prints jax's CompiledMemoryStats; the host_ fields must not overwrite the chip's
    printed = ("Memory analysis: CompiledMemoryStats(argument_size_in_bytes=31821012480, "
               "temp_size_in_bytes=28835577856, host_argument_size_in_bytes=0, "
               "host_temp_size_in_bytes=0)")
    assert dict(vs_maxtext.MEMORY_FIELD.findall(printed)) == {"argument": "31821012480",
                                                              "temp": "28835577856"}
    # the TPU compiler's own time: the longest END_TO_END stage in libtpu's log
    import tempfile
    with tempfile.TemporaryDirectory() as logs:
        assert vs_maxtext.compiler_seconds(logs) is None
        with open(os.path.join(logs, "tpu_driver.host.log.INFO.1"), "w") as f:
            f.write("I1206 deepsea_compiler_base.cc:1017] END_TO_END stage duration: 96.65ms\n"
                    "I1206 deepsea_compiler_base.cc:1017] END_TO_END stage duration: "
                    "1m15.5s\nI1206 x.cc:1] END_TO_END stage duration: 2.5s\n")
        assert abs(vs_maxtext.compiler_seconds(logs) - 75.5) < 1e-9


def test_stacks_names_each_environments_versions_and_refuses_a_missing_python():
    """benchmarks/stacks.py: a missing --python is refused by name; a stack is named by the
    jax, flax and tokamax versions its Python imports."""
    import importlib.metadata

    import stacks

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stacks.py"),
                           "--python", "/nonexistent/python"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--python /nonexistent/python: no such file" in proc.stderr
    assert stacks.versions(sys.executable) == " ".join(
        f"{p} {importlib.metadata.version(p)}" for p in ("jax", "flax", "tokamax"))


def test_accelerator_check_memory_section_runs_dry():
    """`benchmarks/accelerator_check.py --dry-run` (the CPU path of a script meant for a GPU or
    TPU): its memory section rehearses the mini's step, runs it, and prints one row whose
    rehearsal figures add up; the chip columns stay empty on a CPU."""
    script = os.path.join(ROOT, "benchmarks", "accelerator_check.py")
    proc = subprocess.run([sys.executable, script, "--dry-run", "--skip", "losses", "layers",
                           "parts"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model | target |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    row = dict(zip(columns, (c.strip() for c in lines[header + 2].strip("|").split("|"))))
    assert row["model"] == "deepseek3_mini" and row["target"] == "cpu-8"
    args, temp, peak = (float(row[f"rehearsal_{k}_GiB"]) for k in ("args", "temp", "peak"))
    assert 0 < args and 0 < temp and peak >= temp
    assert row["chip_total_GiB"] == "-"


def test_sparse_attention_counts_the_attention_it_compiles():
    """`benchmarks/sparse_attention.py` at tiny widths under cp=2: the compiled FLOPs of the
    sparse op and of the indexer are their formulas (L·k pairs; the indexer's projections and
    full L x L scores), written here from the widths; the dense causal program holds at least
    the causal pairs and at most every pair; the ratios follow; every program moves bytes under
    CP, the sparse op fewer than the dense one (the latent once, not as both K and V); the
    forward ran."""
    L, cp, N, R, Hn, Hr, Hv, k = 256, 2, 4, 32, 16, 8, 16, 32
    Ni, Hi, Rq, D = 4, 16, 24, 32
    script = os.path.join(ROOT, "benchmarks", "sparse_attention.py")
    proc = subprocess.run(
        [sys.executable, script, "--lengths", str(L), "--cps", str(cp), "--heads", str(N),
         "--kv-lora-rank", str(R), "--nope", str(Hn), "--rope", str(Hr), "--v-head-dim",
         str(Hv), "--index-heads", str(Ni), "--index-head-dim", str(Hi), "--q-lora-rank",
         str(Rq), "--embed", str(D), "--topk", str(k), "--time-heads", "2", "--time-up-to",
         str(L), "--iters", "1", "--dtype", "float32"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| length | cp |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = [dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
            for line in lines[header + 2:] if line.startswith("|")]
    by = {r["program"]: r for r in rows}
    assert sorted(by) == ["dense", "indexer", "sparse"] and len(rows) == 3
    gflop = {name: float(r["GFLOP (compiled)"]) for name, r in by.items()}
    absorb = 2 * L * N * (Hn * R + R * Hv)
    sparse = (2 * N * (R + Hr + R) * L * k + absorb) / cp / 1e9
    causal = (2 * N * (R + Hr + R) * L * (L + 1) / 2 + absorb) / cp / 1e9
    every_pair = (2 * N * (R + Hr + R) * L * L + absorb) / cp / 1e9
    indexer = (2 * L * (Rq * Ni * Hi + D * Hi + D * Ni) + 2 * L * L * (Ni * Hi + Ni)) / cp / 1e9
    assert gflop["sparse"] == pytest.approx(sparse, rel=1e-3)
    assert gflop["indexer"] == pytest.approx(indexer, rel=1e-3)
    assert causal * 0.999 <= gflop["dense"] <= every_pair * 1.001
    for name, expected in (("sparse", sparse), ("dense", causal), ("indexer", indexer)):
        assert float(by[name]["GFLOP (formula)"]) == pytest.approx(expected, rel=1e-3)
        assert float(by[name]["FLOPs / dense causal"]) == pytest.approx(
            gflop[name] / causal, rel=2e-3)
    wire = {name: float(r["wire MiB"]) for name, r in by.items()}
    assert all(w > 0 for w in wire.values()) and wire["sparse"] < wire["dense"]
    assert by["dense"]["wire / dense"] == "1.000" and by["dense"]["memory / dense"] == "1.000"
    assert all(_number(r["CPU ms (2 MLA heads)"].split()[0]) > 0 for r in rows)


@pytest.mark.slow
def test_linear_attention_counts_memory_and_the_summaries_on_the_wire():
    """`benchmarks/linear_attention.py` at tiny widths under cp=2: the layer's mixing moves at
    least its state summaries (cp * max_pieces of [Hv, Dk, Dk + Dv] float32, counted from the
    compiled HLO) and the same bytes at both lengths, while the all-gather K/V column is the
    formula, doubling with L; memory grows with L; the short length is timed, the long one
    compiled only."""
    script = os.path.join(ROOT, "benchmarks", "linear_attention.py")
    hk, hv, d, cp, pieces = 1, 2, 8, 2, 4
    proc = subprocess.run([sys.executable, script, "--lengths", "64,128", "--cps", str(cp),
                           "--hidden", "16", "--heads", f"{hk},{hv}", "--head-dim", str(d),
                           "--time-up-to", "64", "--iters", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| length | cp |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = [dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
            for line in lines[header + 2:] if line.startswith("|")]
    assert [(r["length"], r["cp"]) for r in rows] == [("64", "2"), ("128", "2")]
    short, long = rows

    def nbytes(cell):
        return _number(cell) * {"KiB": 2**10, "MiB": 2**20}[cell.split()[-1]]

    for n, row in ((64, short), (128, long)):
        assert row[f"vs cp={cp}"] == "1.000x"  # the first --cps is the base
        assert nbytes(row["all-gather K/V"]) == pytest.approx(n * (hk * d + hv * d) * 4,
                                                              rel=0.01)
        assert nbytes(row["mixing on the wire"]) >= cp * pieces * hv * d * (d + d) * 4
        assert nbytes(row["FSDP weights on the wire"]) > 0
        assert _number(row["vs all-gather K/V"]) == pytest.approx(
            nbytes(row["mixing on the wire"]) / nbytes(row["all-gather K/V"]), rel=0.05)
    assert short["mixing on the wire"] == long["mixing on the wire"]
    assert nbytes(long["memory per device"]) > nbytes(short["memory per device"]) > 0
    assert _number(short["time fwd+bwd"]) > 0 and long["time fwd+bwd"] == "compile only"
    assert f"Goal: mixing bytes flat in L at cp={cp}: holds" in proc.stdout
