"""The mini MoE families' train steps compiled for accelerator targets on this CPU host: what
the programs hold, and that no program decision reads the process's backend.

DeepSeek-V3's and Mixtral's mini presets (MLA and GQA attention; sequence 2048, two
layers) under fsdp, cp and ep_as_cp (`CASES`) compile for 8 TPU v5p chips (``"tpu-v5p-8"``,
libtpu) and 8 H100s (``"h100-8"``, the CUDA plugin) through the public building blocks
(`zoo.make_mesh(devices=...)`, `zoo.Partitioner`, `zoo.train.step.abstract_state`, `make_tx`,
`make_train_step(donate=True)`, `BATCH_KEYS`).
The TPU programs hold zoo's Mosaic attention kernels and the grouped matmul as
``tpu_custom_call``s named inside the layer's scope; the GPU programs tokamax's kernels; the
all-to-all dispatch (ep_as_cp) is a ``ragged-all-to-all``. The CPU program built afterwards in
the same process equals a fresh CPU-only process's, instruction for instruction.
"""

import functools
import importlib.util
import json
import re
import subprocess
import sys

import pytest

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU_COMPILER = importlib.util.find_spec("jax_cuda12_plugin") is not None
pytestmark = pytest.mark.skipif(not (HAS_LIBTPU and HAS_GPU_COMPILER),
                                reason="needs libtpu and jax-cuda12-plugin (the test extra: "
                                       "pip install -e '.[test]')")

# MLA (DeepSeek-V3) and GQA attention (Mixtral; Qwen3-MoE builds the same `Attention` and
# `MoE`, and compiles for both targets in tests/train/test_moe_target_matrix.py)
FAMILIES = ("deepseek3_mini", "mixtral_mini")
MESHES = {"fsdp": "fsdp=8", "cp": "fsdp=2,context=4", "ep_as_cp": "fsdp=2,expert=4"}
SEQ, BATCH = 2048, 8
# every attention layer's scope: MLA for DeepSeek-V3, GQA attention for the others
SCOPES = {"deepseek3_mini": "mla", "mixtral_mini": "attention"}
# the kernels test and the CPU-program test share deepseek3_mini's accelerator programs
SHARED = pytest.mark.xdist_group("target_programs")


def program(preset: str, strategy: str, devices, mesh: str | None = None,
            lower_only: bool = False, **overrides) -> str:
    """The optimized HLO text of `preset`'s train step (two layers, bf16, all-to-all dispatch
    under ep_as_cp, config `overrides`) for `devices` (`mesh`: the strategy's by default),
    built from the public pieces; `lower_only`: the lowered program's text instead."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import zoo
    from zoo.models import registry
    from zoo.partitioning import mesh_platform
    from zoo.targets import compile_with_text
    from zoo.train.step import BATCH_KEYS, abstract_state, make_train_step, make_tx

    family, config = registry.resolve(preset)
    sizes = dict(kv.split("=") for kv in (mesh or MESHES[strategy]).split(","))
    mesh = zoo.make_mesh(devices=devices, **{k: int(v) for k, v in sizes.items()})
    p = zoo.Partitioner(mesh, strategy)
    config = dataclasses.replace(config, num_hidden_layers=2, dtype="bfloat16",
                                 **({"moe_dispatch": "all_to_all"} if strategy == "ep_as_cp"
                                    else {}), **overrides)

    def make():
        return family.model_cls(config, inputs_shape=(BATCH, SEQ), partitioner=p,
                                rngs=nnx.Rngs(0))
    model, opt = abstract_state(make, make_tx(), mesh)
    sharding = p.sharding(("batch", "length"))
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.float32 if k == "loss_weights"
                                     else jnp.int32, sharding=sharding) for k in BATCH_KEYS}
    lowered = make_train_step(donate=True).lower(model, opt, batch,
                                                 jax.ShapeDtypeStruct((), jnp.float32))
    return lowered.as_text() if lower_only else compile_with_text(lowered,
                                                                  mesh_platform(mesh))[1]


@functools.cache
def target_program(preset: str, strategy: str, target: str) -> str:
    """`program` for the compile-only target named `target` (``"tpu-v5p-8"``, ``"h100-8"``),
    compiled once per process."""
    from zoo.train import target_devices
    return program(preset, strategy, target_devices(target))


def _fingerprint(text: str) -> dict:
    """What must not change between processes: instruction count and custom-call targets."""
    calls = re.findall(r'custom_call_target="([^"]+)"', text)
    return {"instructions": sum(" = " in line for line in text.splitlines()),
            "custom_calls": sorted(set(calls))}


def _kernel_scopes(text: str, target: str) -> set[str]:
    """op_name paths of `target` custom calls."""
    return {m.group(1) for line in text.splitlines() if f'custom_call_target="{target}' in line
            for m in [re.search(r'op_name="([^"]*)"', line)] if m}


# The programs compiled for the kernels test: every strategy of DeepSeek-V3's mini on the TPU
# (its MLA kernels in each mesh), Mixtral's GQA attention under cp on the TPU, and the
# all-to-all (ep_as_cp) programs of both on the GPU. Each program takes a minute to compile on
# this host; the other pairs of family, strategy and target compile in the pairwise matrix
# (tests/train/test_moe_target_matrix.py), which checks the MoE's kernel in each.
CASES = [*(("deepseek3_mini", s, "tpu-v5p-8") for s in MESHES),
         ("mixtral_mini", "cp", "tpu-v5p-8"),
         *((f, "ep_as_cp", "h100-8") for f in FAMILIES)]


@pytest.mark.slow
@SHARED
@pytest.mark.parametrize("preset,strategy,target", CASES,
                         ids=["-".join(c) for c in CASES])
def test_mini_steps_hold_the_accelerator_kernels(preset, strategy, target):
    text = target_program(preset, strategy, target)
    if target.startswith("tpu"):
        names = _kernel_scopes(text, "tpu_custom_call")
        # attention (forward, dK/dV, dQ) and the MoE's grouped matmul, inside their layers
        for kernel in ("zoo_attention_fwd", "zoo_attention_dkv", "zoo_attention_dq"):
            assert any(f"/{SCOPES[preset]}/" in n and kernel in n for n in names), \
                (strategy, kernel, names)
    else:
        kernels = {c for c in re.findall(r'custom_call_target="([^"]+)"', text)}
        assert any(k.startswith(("mosaic_gpu", "__gpu$xla.gpu.triton")) for k in kernels), \
            (strategy, kernels)
    if strategy == "ep_as_cp":
        assert "ragged-all-to-all" in text, strategy


@pytest.mark.slow
def test_exact_rounds_backward_runs_the_gpu_kernels():
    """The exact dropless dispatch (``moe_overflow="exact"``: rounds over factor-2 buffers)
    has its own backward, traced after the layer's target scope has closed; it still traces
    tokamax's kernels for the GPU target (tokamax's own backward, traced for the CPU host
    instead, failed its varying-axes check inside the MoE's shard_map). DeepSeek-V3's widths
    (the mini's fall to tokamax's XLA fallback), two layers, 32 experts, 8 H100s."""
    from zoo.train import rehearse
    r = rehearse("deepseek_v3", target="h100-8", mesh="fsdp=2,expert=4", strategy="fsdp",
                 batch_size=8, seq_len=4096, dtype="bfloat16", param_dtype="float32",
                 remat="full", overrides=["num_nextn_predict_layers=0", "num_hidden_layers=2",
                                          "first_k_dense_replace=1", "n_routed_experts=32",
                                          "n_group=8", "topk_group=4",
                                          "moe_dispatch=all_to_all", "moe_overflow=exact",
                                          "moe_buffer_factor=2"])
    assert r.fits and r.custom_calls.get("mosaic_gpu_v2", 0) >= 6, r.custom_calls


CPU_ONLY = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, {tests!r})
import zoo, jax
from test_target_programs import program, _fingerprint
print(json.dumps(_fingerprint(program({preset!r}, "ep_as_cp", jax.devices()[:8]))))
"""


@pytest.mark.slow
@SHARED
def test_cpu_program_is_the_same_after_accelerator_programs(devices):
    """The CPU program built after TPU and GPU programs in this process (this test's, or the
    kernels test's before it on the same worker) equals the one a fresh CPU-only process
    builds; the TPU program differs from it (its kernels)."""
    from pathlib import Path

    preset = "deepseek3_mini"
    tpu_text = target_program(preset, "ep_as_cp", "tpu-v5p-8")
    target_program(preset, "ep_as_cp", "h100-8")
    here = _fingerprint(program(preset, "ep_as_cp", devices[:8]))
    code = CPU_ONLY.format(tests=str(Path(__file__).parent), preset=preset)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    fresh = json.loads(run.stdout.strip().splitlines()[-1])
    assert here == fresh
    assert "tpu_custom_call" in _fingerprint(tpu_text)["custom_calls"]
    assert "tpu_custom_call" not in here["custom_calls"]
