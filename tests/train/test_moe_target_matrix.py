"""The MoE execution value (`zoo.ops.moe_execution.MoEExecution`) and the accelerator program space:
every family's mini x strategy x dispatch x overflow x dtype x target compiles.

The fast tests check the value (the fallback rule and its reason, ``dropless()``, the record)
and the covering set; the slow ones compile the pairwise covering set of
``benchmarks/targets.py`` (`pairwise_cells`: every pair of values of two axes in some cell,
the float32 all_to_all cells of the three original minis among them) for 8 TPU v5p chips and
8 H100s, two layers, 256 tokens a row.
"""

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import pytest

HAS_COMPILERS = (importlib.util.find_spec("libtpu") is not None
                 and importlib.util.find_spec("jax_cuda12_plugin") is not None)
needs_compilers = pytest.mark.skipif(not HAS_COMPILERS,
                                     reason="needs libtpu and jax-cuda12-plugin (the test "
                                            "extra: pip install -e '.[test]')")


def _script():
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import targets
    return targets


def test_pairwise_cells_cover_every_pair_of_valid_values():
    """Each pair of values of two axes that some valid cell holds is in a chosen cell (checked
    against a plain enumeration of the whole space), the chosen cells are valid, and the
    float32 all_to_all cells of deepseek3, mixtral and qwen3_moe are among them."""
    t = _script()
    chosen = t.pairwise_cells()
    assert all(t.valid(c) for c in chosen) and len(chosen) <= 25
    space = [dict(zip(t.MATRIX_AXES, v)) for v in itertools.product(*t.MATRIX_AXES.values())]
    assert len(space) == 360
    for a, b in itertools.combinations(t.MATRIX_AXES, 2):
        held = {(c[a], c[b]) for c in space if t.valid(c)}
        got = {(c[a], c[b]) for c in chosen}
        assert held <= got, (a, b, held - got)
    # the rules' holes: rounds need all_to_all and plain SwiGLU experts
    assert not any(c["overflow"] == "exact" and (c["dispatch"] == "all_gather"
                                                 or c["family"] == "gpt_oss") for c in chosen)
    seeds = {(c["family"], c["dispatch"], c["dtype"]) for c in chosen
             if c["strategy"] == "ep_as_cp" and c["target"] == "h100-8"}
    assert {(f, "all_to_all", "float32") for f in ("deepseek3", "mixtral", "qwen3_moe")} <= seeds


def test_execution_is_resolved_and_validated_in_one_place():
    """``MoEExecution.resolve``: "auto" settled per platform, float32 tokamax on a GPU mesh
    falls back to XLA's ragged dot with its reason, bfloat16 keeps tokamax; the combination
    rules raise with their fix; ``dropless()`` keeps the scheme and kernel and drops nothing;
    the record is JSON."""
    from zoo.ops.moe_execution import TRITON_FP32_REASON, MoEExecution
    sizes = dict(sharded=True, expert_shards=4, tokens_per_device=512, num_experts=8, k=2,
                 embed=64)
    gpu = dict(platform="gpu", device="h100", **sizes)
    f32 = MoEExecution.resolve(dispatch="all_to_all", buffer_factor=2.0, overflow="drop",
                               dtype="float32", **gpu)
    assert (f32.grouped_matmul, f32.kernel_reason) == ("ragged_dot", TRITON_FP32_REASON)
    assert f32.device == "h100" and f32.drops
    bf16 = MoEExecution.resolve(dispatch="all_to_all", dtype="bfloat16", **gpu)
    assert (bf16.grouped_matmul, bf16.kernel_reason) == ("tokamax", None)
    assert (bf16.overflow, bf16.exchange_buffer_factor) == ("exact", 1.25)  # auto: rounds
    tpu = MoEExecution.resolve(dispatch="auto", dtype="float32", platform="tpu", device="d",
                               **sizes)
    assert (tpu.dispatch, tpu.grouped_matmul, tpu.device) == ("all_to_all", "ragged_dot", None)
    assert MoEExecution.resolve().grouped_matmul == "blocked"  # unsharded, on this CPU
    dropless = f32.dropless()
    assert not dropless.drops and dropless.exchange_buffer_factor is None
    assert (dropless.dispatch, dropless.grouped_matmul) == (f32.dispatch, f32.grouped_matmul)
    assert json.loads(json.dumps(f32.as_dict()))["kernel_reason"] == TRITON_FP32_REASON
    rules = [(dict(dispatch="all_gather", overflow="exact"), "overflow='exact' runs all_to_all"),
             (dict(dispatch="all_to_all", capacity_factor=1.0), "capacity_factor belongs"),
             (dict(dispatch="all_gather", buffer_factor=2.0), "dispatch='all_gather' has none"),
             (dict(overflow="exact", plain=False), "runs the plain SwiGLU experts"),
             (dict(overflow="spill"), "overflow='spill' must be one of"),
             (dict(grouped_matmul="cutlass"), "grouped_matmul='cutlass' must be one of")]
    for kw, match in rules:
        with pytest.raises(ValueError, match=match):
            MoEExecution.resolve(**kw)
    with pytest.raises(ValueError, match="needs the tokens sharded over every expert axis"):
        MoEExecution.resolve(dispatch="all_to_all", unsharded_token_axes=("expert",), **sizes)


@needs_compilers
def test_layer_on_a_gpu_mesh_records_its_fallback(devices):
    """A float32 MoE layer on an H100 mesh holds the XLA fallback and the mesh's device (no
    compile); the layer's arguments built it, and replacing the value changes the layer."""
    from flax import nnx

    import zoo
    from zoo.layers.moe import MoE
    from zoo.train import target_devices
    gpu = target_devices("h100-8")
    p = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=4, devices=gpu), "ep_as_cp")
    args = dict(num_experts=8, num_experts_per_tok=2, mlp_dim=64, inputs_shape=(8, 64, 32),
                partitioner=p, dispatch="all_to_all", buffer_factor=1.0, overflow="drop")
    moe = nnx.eval_shape(lambda: MoE(dtype="float32", rngs=nnx.Rngs(0), **args))
    e = moe.execution
    assert (e.grouped_matmul, e.platform, e.device) == ("ragged_dot", "gpu", gpu[0])
    assert e.kernel_reason and "Triton" in e.kernel_reason
    bf16 = nnx.eval_shape(lambda: MoE(dtype="bfloat16", rngs=nnx.Rngs(0), **args))
    assert bf16.grouped_matmul == "tokamax"
    moe.execution = e.dropless()
    assert (moe.buffer_factor, moe.exchange_buffer_factor, moe.overflow) == (None, None, "drop")


def _cells():
    t = _script()
    return [pytest.param(c, id="-".join(c.values())) for c in t.pairwise_cells()]


@pytest.mark.slow
@needs_compilers
@pytest.mark.parametrize("cell", _cells())
def test_pairwise_cell_compiles(cell):
    """A cell of the covering set compiles for its target: the float32 GPU cells with XLA's
    ragged dot and the reason recorded, the others with the platform's kernel (tokamax on
    the GPU, XLA's ragged dot on the TPU)."""
    from zoo.train import target_devices
    t = _script()
    r = t.run_cell(cell, target_devices(cell["target"]))
    assert r["verdict"] == "compiles", r
    gpu_f32 = r["target"] == "h100-8" and r["dtype"] == "float32"
    assert r["grouped matmul"] == ("tokamax" if r["target"] == "h100-8" and not gpu_f32
                                   else "ragged_dot"), r
    assert (r["why"] != "-") == gpu_f32, r


def test_matrix_shards_partition_the_cells_and_saved_rows_resume(tmp_path, capsys):
    """``--shard I/N`` splits the cells into N disjoint slices whose union is the whole set;
    with ``--rows``, cells already in the file are not compiled again (every cell saved: the
    table comes from the file alone, no compile), and ``--set`` merges over the goal row's
    overrides by field."""
    t = _script()
    cells = [c for c in t.all_cells() if c["family"] == "mixtral" and c["dtype"] == "float32"
             and c["target"] == "tpu-v5p-8"]
    slices = [cells[i::3] for i in range(3)]
    assert sorted(map(t.cell_key, itertools.chain(*slices))) == sorted(map(t.cell_key, cells))
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for c in cells:
            f.write(json.dumps({**c, "verdict": "compiles", "grouped matmul": "ragged_dot",
                                "why": "-", "compile s": 1.0}) + "\n")
    args = t.parse_args(["--matrix", "--only", "family=mixtral,dtype=float32,target=tpu-v5p-8",
                         "--shard", "1/3", "--rows", str(rows)])
    t.run_cell = None  # a compile would fail loudly: every cell must come from the file
    try:
        assert t.matrix(args) == 0
    finally:
        del sys.modules["targets"]
    out = capsys.readouterr().out
    assert f"{len(slices[1])} cells, 0 failing" in out and "shard 1/3" in out
    assert t.merged_overrides(["moe_overflow=exact", "fp8=blockwise"]) == [
        "moe_buffer_factor=2", "num_nextn_predict_layers=0", "moe_overflow=exact",
        "fp8=blockwise"]
    # a default the model's config has no field for is left out; a given field is kept
    assert t.merged_overrides(["dtype=float32"], {"moe_buffer_factor", "dtype"}) == [
        "moe_buffer_factor=2", "dtype=float32"]
