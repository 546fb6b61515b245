"""The temporaries live at their peak, read from the compiler's buffer assignment
(`zoo.targets.peak_breakdown`): real compiles (XLA:CPU, and libtpu where installed) checked
against the compiler's own temporaries and against hand-computed buffer sizes."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from zoo import targets

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
M, K, N = 256, 128, 1024


def loss(w, x):
    with jax.named_scope("wide"):
        h = jnp.tanh(x @ w)            # [M, N] f32: kept by the forward pass for tanh's grad
    with jax.named_scope("narrow"):
        y = jnp.sin(h @ w.T)
    return (y ** 2).sum()


def compiled_breakdown(platform, **sharding):
    w = jax.ShapeDtypeStruct((K, N), jnp.float32, **sharding)
    x = jax.ShapeDtypeStruct((M, K), jnp.float32, **sharding)
    return targets.compile_with_buffers(jax.jit(jax.grad(loss)).lower(w, x), platform)


def check(compiled, peak):
    # the heap the peak is read from is the compiler's temporaries
    assert peak.temp_bytes == compiled.memory_analysis().temp_size_in_bytes
    groups = peak.groups()
    assert sum(b for _, b, _ in groups) == peak.peak_bytes == sum(b.bytes for b in peak.buffers)
    assert sum(c for _, _, c in groups) == len(peak.buffers)
    assert 0 < peak.peak_bytes <= peak.temp_bytes
    # tanh's output, saved by the forward pass, is live while the backward pass runs
    saved = [b for b in peak.buffers if b.group == "fwd wide" and b.shape != "(tuple)"]
    assert [(b.shape, b.bytes) for b in saved] == [(f"f32[{M},{N}]", M * N * 4)], peak.buffers
    assert "jvp(wide)" in saved[0].op_name, saved
    return groups


def test_cpu_peak_is_the_compilers_temporaries_by_scope():
    compiled, text, peak = compiled_breakdown("cpu")
    assert "ENTRY" in text
    groups = check(compiled, peak)
    # XLA:CPU packs this program's heap tightly: the live buffers are nearly all of it
    assert peak.peak_bytes >= 0.9 * peak.temp_bytes, (peak.peak_bytes, peak.temp_bytes)
    # the backward pass's [M, N] cotangent of the narrow block is the other large buffer
    assert ("bwd narrow", M * N * 4, 1) in groups, groups


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_tpu_peak_from_libtpus_dump():
    from jax.sharding import NamedSharding, PartitionSpec as P
    devices = targets.target_devices("tpu-v5p-8")
    mesh = jax.sharding.Mesh(devices[:1], ("x",))
    compiled, _, peak = compiled_breakdown("tpu", sharding=NamedSharding(mesh, P()))
    check(compiled, peak)


def test_scope_group_names_the_sublayer_and_the_pass():
    g = targets.scope_group
    op = ("jit(train_step)/transpose(jvp(deepseekv4))/layers_1_to_41/while/body/closed_call/"
          "checkpoint/rematted_computation/layer_7/moe/experts/shard_map/grouped_matmul/gather")
    assert g(op) == "bwd deepseekv4/layer/moe/experts"
    assert g(op, depth=5) == "bwd deepseekv4/layer/moe/experts/grouped_matmul"
    assert g("jit(train_step)/jvp(deepseekv4)/layers_1_to_41/while") == \
        "fwd deepseekv4 [scan carry]"
    assert g("jit(train_step)/add") == "(top)"
    assert g("") == "(no op_name)"
    assert g("broadcast.1093") == "(compiler: broadcast)"
    assert g("model.layers[2].self_attn.o_proj.kernel.value") == \
        "param model.layers[*].self_attn.o_proj.kernel"


def test_peak_breakdown_refuses_a_file_without_the_heap():
    with pytest.raises(ValueError, match="preallocated-temp"):
        targets.peak_breakdown("BufferAssignment:\nallocation 0: size 4, constant:\n", "", "")


def test_breakdown_table_rows():
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import targets as bench
    _, _, peak = compiled_breakdown("cpu")
    rows = bench.breakdown_rows("cpu", peak, 1)
    assert len(rows) == 2 and rows[0]["GiB"] == peak.groups()[0][1] / 2 ** 30
    assert rows[-1]["count"] == len(peak.buffers)
    assert rows[-1]["GiB"] == peak.peak_bytes / 2 ** 30


@pytest.mark.slow
def test_rehearsal_breaks_down_the_train_steps_peak():
    """A one-layer mini DeepSeek-V3 train step on 8 CPU devices: the breakdown reads the heap
    the rehearsal reports, and its groups name the model's scopes in both passes."""
    from zoo.train.rehearse import rehearse
    r = rehearse("deepseek3_mini", mesh="fsdp=8", batch_size=8, seq_len=16, remat="full",
                 overrides={"num_hidden_layers": 1}, breakdown=True)
    peak = r.peak_breakdown
    assert peak.temp_bytes == r.temp_bytes and 0 < peak.peak_bytes <= r.temp_bytes
    groups = [g for g, _, _ in peak.groups()]
    assert any(g.startswith("bwd deepseek") for g in groups), groups
