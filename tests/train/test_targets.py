"""Compile targets: the TPU compiler on this CPU host (libtpu, no TPU), and programs that
follow their mesh's platform (`zoo.targets`, `zoo.train.rehearse.rehearse(target=...)`)."""

import importlib.util
import re

import pytest

from zoo import targets

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU_COMPILER = importlib.util.find_spec("jax_cuda12_plugin") is not None


def test_parse_target():
    T = targets.Target
    assert targets.parse("cpu") == T("cpu")
    assert targets.parse("tpu:v5p:4x8x8") == T("tpu", "v5p", "4x8x8", 1, 256)
    assert targets.parse("v6e:4x4") == T("tpu", "v6e", "4x4", 1, 16)
    for bad in ("tpu", "v9:2x2", "v5p-256", "gpu:h100", "tpu-v9-8"):
        with pytest.raises(ValueError, match="tpu:v5p:4x8x8"):
            targets.parse(bad)
    # by chips: zoo's tpu-v5p-256 is 256 chips (Cloud's v5p-512), multi-slice as 128x2
    assert targets.parse("tpu-v5p-256") == T("tpu", "v5p", "4x8x8", 1, 256)  # Cloud's grid
    assert targets.parse("tpu-v5p-128x2") == T("tpu", "v5p", "4x4x8", 2, 256)
    assert targets.parse("tpu-v6e-8") == T("tpu", "v6e", "2x4", 1, 8)
    assert targets.parse("tpu:v5p:2x2x2") == T("tpu", "v5p", "2x2x2", 1, 8)
    assert targets.parse("cpu-8") == T("cpu", count=8) and targets.parse("cpu") == T("cpu")
    assert targets.parse("h100-256") == T("gpu", "h100", count=256)
    with pytest.raises(ValueError, match=r"'tpu-v5p-12'.*chips per slice must be one of"):
        targets.parse("tpu-v5p-12")


def test_slices_wrap_around_as_the_real_ones_do():
    """A v4/v5p slice of full 4x4x4 cubes is a torus, a smaller one an open grid; a v5e/v6e
    side wraps where it spans the 16-chip pod edge (Cloud TPU's slice shapes)."""
    assert targets.wraparound("v5p", "4x8x8") == (True, True, True)
    assert targets.wraparound("v5p", "4x4x4") == (True, True, True)
    assert targets.wraparound("v5p", "2x4x4") == (False, False, False)
    assert targets.wraparound("v5e", "16x16") == (True, True, False)
    assert targets.wraparound("v6e", "8x16") == (False, True, False)
    assert targets.wraparound("v5e", "2x4") == (False, False, False)


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_a_whole_slice_gather_is_an_all_gather_on_the_torus():
    """On the 256-chip v5p torus the compiler keeps a weight's all-gather over the whole
    slice; on the same chips without wraparound links it builds it from a zero-padded
    all-reduce (what zoo's targets compiled before they described the torus)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zoo

    def collectives(devices):
        mesh = zoo.make_mesh(fsdp=4, expert=64, devices=devices)
        fe = NamedSharding(mesh, P(("fsdp", "expert"), None))
        w = jax.ShapeDtypeStruct((7168, 2048), jnp.float32, sharding=fe)
        x = jax.ShapeDtypeStruct((256 * 16, 7168), jnp.bfloat16, sharding=fe)
        f = jax.jit(lambda w, x: jnp.sum((x @ w.astype(jnp.bfloat16)).astype(jnp.float32)))
        _, text = targets.compile_with_text(f.lower(w, x), "tpu")
        return {op: len(re.findall(rf"= \S+ {op}\(", text)) for op in ("all-gather",
                                                                        "all-reduce")}
    torus = collectives(targets.target_devices("tpu-v5p-256"))
    assert torus["all-gather"] == 1, torus
    grid = topologies.get_topology_desc(platform="tpu", topology_name="v5p:4x8x8",
                                        chip_config_name="megacore", num_slices=1).devices
    open_grid = collectives(list(grid))
    assert open_grid["all-gather"] == 0 and open_grid["all-reduce"] == 2, open_grid


def test_cpu_and_gpu_targets_say_what_they_need(devices, monkeypatch):
    from zoo.train import target_devices
    assert target_devices("cpu-4") == devices[:4] and target_devices("cpu") == devices
    with pytest.raises(ValueError, match="device_count=64"):
        target_devices("cpu-64")
    with pytest.raises(ValueError, match=r"'h100-12'.*multiple of 8"):
        target_devices("h100-12")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax_cuda12_plugin" else
                        find_spec(name, *a))
    with pytest.raises(ValueError, match=r"'h100-8'.*pip install -e '\.\[gpu-compile\]'"):
        target_devices("h100-8")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs pip install -e '.[gpu-compile]'")
def test_gpu_target_compiles_the_gpu_program():
    """The mini DeepSeek-V3 step (EP-as-CP) compiled by XLA's GPU compiler for 16 H100s on two
    hosts of 8: the device description's memory is the verdict's capacity, a Mosaic GPU
    kernel is in the program, and the bytes of collectives spanning the two hosts are split
    off (some, not all: the context and expert axes stay within a host) for the roofline's
    network term."""
    from zoo.train.rehearse import rehearse
    r = rehearse("deepseek3_mini", target="h100-16", mesh="fsdp=4,expert=2,context=2",
                 strategy="ep_as_cp", batch_size=16, seq_len=256,
                 overrides={"num_hidden_layers": 2})
    assert (r.target, r.device_kind, r.devices) == ("gpu", "NVIDIA H100 80GB HBM3", 16)
    assert r.hbm_bytes == targets.GPUS["h100"].memory_bytes and r.fits is True
    assert "of 79.10 GiB: fits" in str(r)
    assert any(k.startswith("mosaic_gpu") for k in r.custom_calls), r.custom_calls
    cross, total = sum(r.cross_host_bytes.values()), sum(r.collective_bytes.values())
    assert 0 < cross < total
    b = r.roofline()
    assert b["links"] == "NVLink, 100 GB/s between hosts"
    want = sum((v - r.cross_host_bytes[k]) / 900e9 + r.cross_host_bytes[k] / 100e9
               for k, v in r.collective_bytes.items())
    assert sum(b["collective_s"].values()) == pytest.approx(want)
    h200 = targets.target_devices("h200-8")
    assert len(h200) == 8 and h200[0].device_kind == "NVIDIA H200"
    assert {d.process_index for d in targets.target_devices("h100-16")} == {0, 1}


def test_out_of_memory_is_read_from_the_compilers_message():
    err = RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory "
                       "in memory space hbm. Used 192.43G of 95.74G hbm. Exceeded hbm capacity "
                       "by 96.69G. ... HLO temporaries (162.79G) exceeds available HBM (95.74G)")
    temp, avail = targets.out_of_memory(err)
    assert temp == int(162.79 * 2 ** 30) and avail == int(95.74 * 2 ** 30)
    assert targets.out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes")) is None
    assert targets.hbm_bytes("TPU v5") == int(95.74 * 2 ** 30)
    assert targets.hbm_bytes("NVIDIA H100") is None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_tpu_target_compiles_the_tpu_program(devices):
    """The mini DeepSeek-V3 step (EP-as-CP) compiled by the TPU compiler for a v5p slice of 8
    chips: its MoE runs tokamax's Mosaic ragged dot (``tpu_custom_call``), which a CPU mesh
    never gets, and the compiler's memory verdict is reported. The same step for the CPU mesh
    has no TPU kernel."""
    from zoo.train.rehearse import rehearse
    kw = dict(mesh="fsdp=2,expert=2,context=2", strategy="ep_as_cp", batch_size=8,
              seq_len=256, overrides={"num_hidden_layers": 2})
    tpu = rehearse("deepseek3_mini", target="tpu:v5p:2x2x2", **kw)
    assert (tpu.target, tpu.device_kind, tpu.devices) == ("tpu", "TPU v5", 8)
    assert tpu.custom_calls.get("tpu_custom_call", 0) > 0, tpu.custom_calls
    assert tpu.hbm_bytes == targets.hbm_bytes("TPU v5") and tpu.fits is True
    assert tpu.device_memory_bytes == tpu.hbm_bytes
    assert tpu.row()["target"] == "TPU v5" and "of 95.74 GiB: fits" in str(tpu)
    cpu = rehearse("deepseek3_mini", **kw)
    assert cpu.target == "cpu" and cpu.fits is None
    assert "tpu_custom_call" not in cpu.custom_calls


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_tpu_targets_by_chips_and_slices():
    from zoo.train import target_devices
    d = target_devices("tpu-v5p-8")
    assert len(d) == 8 and d[0].device_kind == "TPU v5"
    two = target_devices("tpu-v5p-8x2")
    assert len(two) == 16 and {x.slice_index for x in two} == {0, 1}
    assert len(target_devices("tpu-v6e-4")) == 4
    one = target_devices("tpu-v5e-1")  # smaller than a 2x2 host: one host of its own size
    assert len(one) == 1 and one[0].device_kind == "TPU v5 lite"


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_tpu_program_text_comes_from_the_compiler():
    """libtpu 0.0.52 writes HLO that jaxlib 0.10's reader refuses (with a logged stack trace);
    `compile_with_text` returns the optimized module's text as the compiler dumped it: on a
    program jaxlib can read, the same module as ``compiled.as_text()``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from zoo.train import target_devices

    mesh = Mesh(np.array(target_devices("tpu-v5p-8")), ("x",))
    sharded = NamedSharding(mesh, P("x"))
    lowered = jax.jit(lambda a: jnp.sin(a) * 2, in_shardings=sharded,
                      out_shardings=sharded).lower(jax.ShapeDtypeStruct((1024, 128), jnp.float32))
    compiled, dumped = targets.compile_with_text(lowered, "tpu")
    text = compiled.as_text()
    assert dumped.startswith("HloModule jit__lambda") and "sine" in dumped
    assert dumped.count(" = ") == text.count(" = ")
    assert sorted(re.findall(r" = \S+ (\w[\w-]*)\(", dumped)) == sorted(
        re.findall(r" = \S+ (\w[\w-]*)\(", text))


def test_target_setting_is_checked_when_parsed():
    from zoo.train.config import TrainConfig
    with pytest.raises(ValueError, match="needs --rehearse"):
        TrainConfig(target="tpu:v5p:2x2x2")
    with pytest.raises(ValueError, match=r"--target 'v5p-8'.*tpu:v5p:4x8x8"):
        TrainConfig(target="v5p-8", rehearse=True)
    assert TrainConfig(target="tpu:v5p:2x2x2", rehearse=True).target == "tpu:v5p:2x2x2"


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_a_cpu_host_with_the_tpu_compiler_starts_on_cpu_quietly():
    """With libtpu installed and no TPU chip, a script that imports zoo and asks for virtual
    CPU devices starts jax on its CPU without libtpu's probe warnings (no accelerator type,
    no worker hostnames); naming a platform is still the user's choice."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    script = ("import zoo; zoo.set_cpu_devices(2); import jax; "
              "print(jax.default_backend(), jax.device_count())")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "2"]
    assert "TPU" not in out.stderr and "InitGoogle" not in out.stderr, out.stderr
    # without zoo, jax itself probes libtpu first (what the call above avoids)
    bare = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert bare.stdout.split() == ["cpu"] and "TPU" in bare.stderr


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs pip install -e '.[gpu-compile]'")
def test_a_cpu_host_with_the_gpu_compiler_imports_zoo_quietly(capfd):
    """With the CUDA plugin installed and no GPU, `import zoo` prints none of the plugin's
    "Could not find cuda drivers" lines (nor absl's notice before each), which a bare
    `import jax` prints; other output to stderr inside `quiet_cuda_stub` passes through."""
    import os
    import subprocess
    import sys
    stub = "Could not find cuda drivers"
    bare = subprocess.run([sys.executable, "-c", "import jax"], capture_output=True, text=True,
                          timeout=120)
    if stub not in bare.stderr:
        pytest.skip("jax imports the CUDA plugin quietly here (a GPU, or CUDA's runtime)")
    out = subprocess.run([sys.executable, "-c", "import zoo, jax; print(jax.default_backend())"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["cpu"], out.stderr
    assert stub not in out.stderr and "cudart_stub" not in out.stderr, out.stderr
    assert "absl::InitializeLog" not in out.stderr, out.stderr
    capfd.readouterr()
    with targets.quiet_cuda_stub():
        os.write(2, b"a line before\n" + bare.stderr.encode() + b"a line after\n")
    err = capfd.readouterr().err
    assert stub not in err and "absl::InitializeLog" not in err, err
    assert err.splitlines() == ["a line before", "a line after"], err


def test_roofline_bounds_the_step_from_the_reports_counts():
    """`Rehearsal.roofline`: the larger of the dot FLOPs (at least the model's) at the chip's
    bf16 peak and the collective bytes at its ICI bandwidth; MFU and tokens/s at that bound;
    nothing for a device whose peaks are not known."""
    import dataclasses

    from zoo.train.rehearse import Rehearsal
    r = Rehearsal(label="m", devices=256, mesh="fsdp=4,expert=64", strategy="fsdp",
                  batch_size=256, seq_len=4096, dtype="bfloat16", param_dtype="float32",
                  remat="full", compile_s=1.0, hlo_instructions=1, param_bytes=0,
                  optimizer_bytes=0, argument_bytes=0, output_bytes=0, alias_bytes=0,
                  temp_bytes=0, hlo_flops=459e12, model_flops=306e12, xla_flops=0.0,
                  collective_bytes={"all-gather": 360e9, "all-to-all": 240e9},
                  dots_by_dtype={}, dot_names={}, target="tpu", device_kind="TPU v5")
    b = r.roofline()
    assert b["compute_s"] == pytest.approx(1.0) and b["bound_by"] == "compute"
    assert b["collective_s"] == {"all-gather": pytest.approx(0.3), "all-to-all": pytest.approx(0.2)}
    assert b["bound_s"] == pytest.approx(1.0) and b["mfu"] == pytest.approx(2 / 3)
    assert b["tokens_per_s"] == pytest.approx(4096)  # 256 x 4096 tokens over 256 chips, 1 s
    assert "roofline BOUND (not a measurement): step >= 1,000.0 ms" in str(r)
    wire = dataclasses.replace(r, collective_bytes={"all-to-all": 2400e9}).roofline()
    assert wire["bound_s"] == pytest.approx(2.0) and wire["bound_by"] == "collectives"
    assert wire["mfu"] == pytest.approx(1 / 3)
    # kernels' FLOPs (custom calls) are not in the HLO count: the model's are the floor
    kernel = dataclasses.replace(r, hlo_flops=100e12).roofline()
    assert kernel["compute_s"] == pytest.approx(306 / 459) and kernel["mfu"] == pytest.approx(1)
    decode = dataclasses.replace(r, step="decode", batch_size=128, seq_len=32768)
    assert decode.tokens_per_device == 0.5  # one token per row a step
    cpu = dataclasses.replace(r, target="cpu", device_kind="cpu")
    assert cpu.roofline() is None and "BOUND" not in str(cpu)
    # a program the compiler refused (out of memory) has only its unpartitioned counts
    refused = dataclasses.replace(r, oom=True)
    assert refused.roofline() is None and "not per device" in str(refused)
    row = refused.row()
    assert row["HLO/model FLOPs"] == "-" and row["all-to-all GB"] == "-" and row["fits"] == "no"
    assert r.row()["all-to-all GB"] == pytest.approx(240)
    assert targets.chip("TPU v5").peak_flops == 459e12 and targets.chip("TPU v4") is None


def test_roofline_takes_the_fp8_peak_for_an_fp8_program_where_the_chip_has_one():
    """An ``fp8="blockwise"`` program is bounded at the chip's dense FP8 peak (H100: 1,979
    TFLOP/s, twice its bf16 989) and its MFU is against that peak; a bf16 program, or an FP8
    program on a chip with no published FP8 peak (TPU v5p), at the bf16 peak, saying so."""
    import dataclasses

    from zoo.train.rehearse import Rehearsal
    h100 = targets.GPUS["h100"].device_kind
    bf16 = Rehearsal(label="m", devices=8, mesh="fsdp=8", strategy="fsdp", batch_size=8,
                     seq_len=1024, dtype="bfloat16", param_dtype="float32", remat="full",
                     compile_s=1.0, hlo_instructions=1, param_bytes=0, optimizer_bytes=0,
                     argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0,
                     hlo_flops=1979e12, model_flops=989e12, xla_flops=0.0,
                     collective_bytes={"all-gather": 90e9}, dots_by_dtype={}, dot_names={},
                     target="gpu", device_kind=h100)
    fp8 = dataclasses.replace(bf16, fp8="blockwise")
    b, f = bf16.roofline(), fp8.roofline()
    assert (b["peak"], b["peak_flops"], f["peak"], f["peak_flops"]) == ("bf16", 989e12,
                                                                         "fp8", 1979e12)
    assert b["compute_s"] == pytest.approx(1979 / 989) and f["compute_s"] == pytest.approx(1.0)
    assert b["mfu"] == pytest.approx(989 / 1979) and f["mfu"] == pytest.approx(989 / 1979)
    assert "1,979 TFLOP/s (FP8 peak)" in str(fp8) and "989 TFLOP/s (bf16 peak)" in str(bf16)
    tpu = dataclasses.replace(fp8, target="tpu", device_kind="TPU v5").roofline()
    assert tpu["peak"] == "bf16" and tpu["peak_flops"] == 459e12
    assert tpu["peak_note"] == "bf16 peak: TPU v5 has no published FP8 peak"
    assert [targets.chip(k).fp8_peak_flops for k in ("TPU v5", "TPU v5 lite", "TPU v6 lite",
                                                      targets.GPUS["h200"].device_kind)] == [
        None, None, None, 1979e12]


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_LIBTPU and HAS_GPU_COMPILER),
                    reason="needs libtpu and jax-cuda12-plugin (the test extra)")
def test_targets_script_compiles_one_step_for_each_target(devices, capsys):
    """``benchmarks/targets.py`` compiles the same step for CPU, TPU and GPU devices in one
    process and prints one row each: the TPU and GPU rows carry their device's memory, a
    verdict, their kernels and a roofline bound; the CPU row has none of those."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import targets as script
    assert script.main(["--targets", "cpu-8,tpu-v5p-8,h100-8", "--model", "deepseek3_mini",
                        "--mesh", "fsdp=2,expert=4", "--batch-size", "8", "--seq-len", "256",
                        "--set", "num_hidden_layers=2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("|")]
    assert lines[0] == "| " + " | ".join(script.COLUMNS) + " |"
    rows = {r["target"]: r for r in (dict(zip(script.COLUMNS, (c.strip() for c in
                                                                  x.strip("|").split("|")),
                                              strict=True)) for x in lines[2:])}
    assert list(rows) == ["cpu-8", "tpu-v5p-8", "h100-8"]
    cpu, tpu, gpu = rows.values()
    assert (cpu["device"], cpu["fits"], cpu["bound ms"]) == ("cpu", "-", "-")
    assert not any(k in cpu["kernels"] for k in ("mosaic", "tpu_custom_call"))
    assert tpu["device"] == "TPU v5" and tpu["memory GiB"] == "95.74" and tpu["fits"] == "yes"
    assert gpu["device"] == "NVIDIA H100 80GB HBM3" and gpu["memory GiB"] == "79.10"
    assert "mosaic_gpu" in gpu["kernels"] and float(gpu["bound ms"].replace(",", "")) > 0
    assert gpu["MFU at bound"].endswith("%") and tpu["bound by"] in ("compute", "collectives")


@pytest.mark.skipif(not (HAS_LIBTPU and HAS_GPU_COMPILER),
                    reason="needs libtpu and jax-cuda12-plugin (pip install -e '.[test]')")
def test_moe_settles_its_grouped_matmul_by_its_mesh(devices):
    """"auto" becomes the blocked matmul on a CPU mesh, XLA's ragged dot on a TPU mesh and
    tokamax on a GPU mesh, at construction: the TPU program then holds XLA's ragged-dot
    kernel, and its backward needs fewer temporaries than tokamax's XLA fallback (which
    copies every row once per local expert for the weight gradients)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from zoo import make_mesh
    from zoo.layers.moe import MoE
    from zoo.ops.moe_execution import choose_grouped_matmul
    from zoo.partitioning import Partitioner
    from zoo.targets import compile_with_text
    from zoo.train import target_devices
    from zoo.train.step import abstract_state

    assert choose_grouped_matmul("auto", "tpu") == "ragged_dot"
    assert choose_grouped_matmul("blocked", "tpu") == "blocked"
    shape = (8, 512, 256)

    def layer(devs, **kw):  # abstract: a target's devices hold nothing
        p = Partitioner(make_mesh(expert=8, devices=devs), "fsdp")
        make = lambda: MoE(num_experts=32, num_experts_per_tok=2, mlp_dim=256,
                           inputs_shape=shape, partitioner=p, dtype=jnp.bfloat16,
                           rngs=nnx.Rngs(0), **kw)
        return abstract_state(make, optax.sgd(0.1), p.mesh)[0], p

    tpu = target_devices("tpu-v5p-8")
    assert layer(devices)[0].grouped_matmul == "blocked"
    assert layer(target_devices("h100-8"))[0].grouped_matmul == "tokamax"
    temps = {}
    for impl in ("auto", "tokamax"):
        moe, p = layer(tpu, grouped_matmul=impl)
        graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

        def loss(params, x, graphdef=graphdef, rest=rest):
            return jnp.sum(nnx.merge(graphdef, params, rest)(x)[0].astype(jnp.float32) ** 2)
        x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=p.sharding(
            ("batch", "length", "act_embed")))
        compiled, text = compile_with_text(jax.jit(jax.grad(loss)).lower(params, x), "tpu")
        temps[impl] = compiled.memory_analysis().temp_size_in_bytes
        if impl == "auto":
            assert moe.grouped_matmul == "ragged_dot"
            assert "ragged-dot" in text
    assert temps["auto"] < temps["tokamax"], temps
