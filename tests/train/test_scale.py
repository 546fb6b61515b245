"""At-scale machinery on small shapes: scanned layers, remat, bf16, the rehearsal's HLO counter.

* `hlo_stats` against programs whose work is known by hand: a scan of N matmuls is N matmuls
  (forward and backward), an all-gather inside a loop moves N times its buffer.
* Scanned layers equal unrolled ones (logits and every gradient, matched through the Hugging
  Face key map) when both load the same checkpoint; the HF round trip is exact with scan; any
  run of layers may be empty; program size does not grow with depth.
* ``remat_policy="full"`` cuts an 8-layer train step's temporaries at least 2x (XLA memory
  analysis); every policy gives the same numbers; unknown names are refused.
* A bf16-compute run with fp32 parameters trains; the rehearsal of a bf16 step finds its
  matmuls bf16 except where fp32 is intended.
* A decode step's rehearsal (`rehearse_decode`): XLA's argument bytes per device are the bf16
  parameters' and the KV cache's shards as computed from the shapes (on CPU exactly; for a TPU
  slice at least, its layouts pad), the donated cache is aliased; bad batch or context sizes
  are refused before anything compiles.
"""

import dataclasses
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.models import deepseek3, hf, mixtral
from zoo.partitioning import Partitioner, make_mesh
from zoo.shardings import sharding_table
from zoo.train import step as S
from zoo.train.rehearse import hlo_stats, rehearse, rehearse_step

DS = deepseek3.DeepSeek3Config.mini(
    num_hidden_layers=3, vocab_size=64, hidden_size=32, intermediate_size=64,
    moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=16, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=8)
MX = mixtral.MixtralConfig.mini(vocab_size=64, hidden_size=64, intermediate_size=64,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_local_experts=4)


# -- the HLO counter ---------------------------------------------------------------------------

def test_hlo_stats_multiplies_loop_bodies():
    n, m, k = 5, 16, 64

    def f(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0].sum()

    x = jax.ShapeDtypeStruct((m, k), jnp.float32)
    ws = jax.ShapeDtypeStruct((n, k, k), jnp.float32)
    one = 2 * m * k * k
    fwd = jax.jit(f).lower(x, ws).compile()
    assert hlo_stats(fwd.as_text()).flops == n * one
    assert fwd.cost_analysis()["flops"] < 2 * one  # XLA's own count sees the body once
    both = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, ws)
    stats = hlo_stats(both.compile().as_text())
    assert stats.flops == 3 * n * one and stats.unknown_trip_counts == 0
    lowered = hlo_stats(jax.jit(f).lower(x.update(dtype=jnp.bfloat16),
                                         ws.update(dtype=jnp.bfloat16)).as_text(dialect="hlo"))
    assert lowered.dots_by_dtype == {"bf16": 1}


def test_hlo_stats_counts_collective_bytes_per_trip(devices):
    mesh = make_mesh(fsdp=8)
    n = 3

    def f(xs):  # xs [n, 64] sharded over 8 devices: each trip gathers a [64] f32 row
        def body(c, x):
            return c, jax.lax.all_gather(x, "fsdp", tiled=True)
        return jax.lax.scan(body, 0, xs)[1]

    g = jax.shard_map(f, mesh=mesh, in_specs=P(None, "fsdp"), out_specs=P(), check_vma=False)
    text = jax.jit(g).lower(jax.ShapeDtypeStruct((n, 64), jnp.float32)).compile().as_text()
    stats = hlo_stats(text)
    assert stats.collective_bytes["all-gather"] == n * 64 * 4
    assert stats.collective_counts["all-gather"] == n


# -- scanned layers ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ds_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds_scan")
    model = deepseek3.DeepSeek3(dataclasses.replace(DS, scan_layers=False), rngs=nnx.Rngs(0))
    # a non-zero selection bias, so its mapping into the stacked bias is checked too
    for i in (1, 2):
        model.layers[i].mlp.e_score_correction_bias[...] = jnp.linspace(-0.1, 0.1, 8) * i
    deepseek3.to_hf(model, path)
    return path


def _grads_by_hf_key(model, tokens):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits, aux = nnx.merge(graphdef, params, rest)(tokens)
        return jnp.mean(jnp.sin(logits)) + aux["load_balance_loss"], (logits, aux)

    (_, (logits, aux)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    as_model = nnx.merge(graphdef, grads, rest)
    by_key = dict(hf.export_tensors(as_model, model.hf_key_map()))
    return logits, aux, by_key


@pytest.mark.slow
def test_scanned_equals_unrolled_from_one_checkpoint(ds_ckpt):
    scanned = deepseek3.from_hf(ds_ckpt)
    unrolled = deepseek3.from_hf(ds_ckpt, config_overrides={"scan_layers": False})
    assert [la.stack_size for la in scanned.layers] == [1, 2]
    assert [la.stack_size for la in unrolled.layers] == [None] * 3
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 16)))
    ls, aux_s, gs = _grads_by_hf_key(scanned, tokens)
    lu, aux_u, gu = _grads_by_hf_key(unrolled, tokens)
    np.testing.assert_allclose(ls, lu, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(aux_s["expert_counts"], aux_u["expert_counts"])
    assert aux_s["expert_counts"].shape == (2, 8)
    np.testing.assert_allclose(aux_s["load_balance_loss"], aux_u["load_balance_loss"], rtol=1e-6)
    assert gs.keys() == gu.keys() and "model.layers.2.mlp.experts.7.down_proj.weight" in gs
    for key in gu:
        if key.endswith("e_score_correction_bias"):
            continue  # a buffer, not a parameter: no gradient in either layout
        np.testing.assert_allclose(gs[key], gu[key], rtol=1e-4, atol=1e-7, err_msg=key)
    assert np.abs(gu["model.layers.1.self_attn.kv_b_proj.weight"]).max() > 0


def test_hf_round_trip_with_scan(ds_ckpt, tmp_path):
    scanned = deepseek3.from_hf(ds_ckpt)
    deepseek3.to_hf(scanned, tmp_path)
    a, b = hf.CheckpointReader(ds_ckpt), hf.CheckpointReader(tmp_path)
    assert sorted(a.keys()) == sorted(b.keys())
    for key in a.keys():
        np.testing.assert_array_equal(a.get(key), b.get(key), err_msg=key)
    bias = np.asarray(scanned.layers[1].mlp.e_score_correction_bias[...])  # stacked [2, E]
    np.testing.assert_allclose(bias, np.stack([np.linspace(-0.1, 0.1, 8) * i for i in (1, 2)]),
                               rtol=1e-6)


def test_sharded_scanned_load_places_layer_slices(ds_ckpt, devices):
    p = Partitioner(make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    model = deepseek3.from_hf(ds_ckpt, partitioner=p)
    reader = hf.CheckpointReader(ds_ckpt)
    wo = model.layers[1].mlp.wo[...]  # [layers 2, E 8, F, D]: experts over `expert`
    assert wo.addressable_shards[0].data.shape[:2] == (2, 4)
    np.testing.assert_array_equal(np.asarray(wo)[1, 5],
                                  reader.get("model.layers.2.mlp.experts.5.down_proj.weight").T)
    rows = {r.path: r for r in sharding_table(model)}  # the stacked axis is shown, unsharded
    row = rows["layers/1/mlp/wo"]
    assert row.logical_axes == ("layers", "experts", "mlp", "embed")
    assert row.shape[0] == 2 and row.shard_shape[0] == 2 and row.spec[0] is None


@pytest.mark.parametrize("dense", [0, 3])
def test_any_stack_may_be_empty(dense):
    cfg = dataclasses.replace(DS, first_k_dense_replace=dense)
    model = deepseek3.DeepSeek3.abstract(cfg, inputs_shape=(1, 8))
    assert [(la.stack_size, la.is_moe) for la in model.layers] == [(3, dense == 0)]
    logits, aux = nnx.eval_shape(lambda m: m(jnp.zeros((1, 8), jnp.int32)), model)
    assert logits.shape == (1, 8, 64) and aux["expert_counts"].shape == (3 - dense, 8)
    assert model.num_moe_layers == 3 - dense


# -- program size and remat (compiled train steps, XLA memory analysis) --------------------------

def _compiled_step(devices, layers, remat, batch=4, length=256):
    cfg = dataclasses.replace(MX, num_hidden_layers=layers, remat_policy=remat)
    p = Partitioner(make_mesh(devices=devices[:1]))
    return rehearse_step(
        make_model=lambda: mixtral.Mixtral(cfg, inputs_shape=(batch, length), partitioner=p,
                                           rngs=nnx.Rngs(0)),
        tx=S.make_tx(), partitioner=p, batch_size=batch, seq_len=length,
        flops_per_token=cfg.flops_per_token(length))


@pytest.mark.slow
def test_scanned_program_size_does_not_grow_with_depth(devices):
    two, sixteen = (_compiled_step(devices, n, "full") for n in (2, 16))
    assert sixteen.hlo_instructions <= 1.3 * two.hlo_instructions
    # the counter sees all 16 layers' work: HLO FLOPs follow the model's own count at any depth.
    # Above 1: remat recomputes the forward, the flash backward recomputes the scores, and the
    # kernel computes the masked tiles inside a partially masked sub-block (at this tiny width
    # attention is most of the work).
    assert 1.0 < sixteen.flops_ratio < 2.2 and 1.0 < two.flops_ratio < 2.2
    assert abs(sixteen.flops_ratio / two.flops_ratio - 1) < 0.1


@pytest.mark.slow
def test_remat_full_cuts_temporaries(devices):
    none, full = (_compiled_step(devices, 8, policy) for policy in ("none", "full"))
    assert none.temp_bytes >= 2 * full.temp_bytes, (none.temp_bytes, full.temp_bytes)
    assert full.hlo_flops > 1.2 * none.hlo_flops  # the forward really runs twice


@pytest.mark.slow
def test_remat_policies_match_numerically():
    """``save_layer_outputs`` (the tagged policy) against no remat; ``full`` is checked in
    test_models_common."""
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 64, (2, 16)))
    out = []
    for name in ("none", "save_layer_outputs"):
        model = deepseek3.DeepSeek3(dataclasses.replace(DS, remat_policy=name),
                                    inputs_shape=(2, 16), rngs=nnx.Rngs(3))
        out.append(_grads_by_hf_key(model, tokens))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5, atol=1e-6)
    for key, g in out[0][2].items():
        np.testing.assert_allclose(out[1][2][key], g, rtol=1e-4, atol=1e-7, err_msg=key)


def test_unknown_remat_policy_is_refused():
    with pytest.raises(ValueError, match=r"remat_policy='everything'.*'save_layer_outputs'"):
        mixtral.MixtralConfig.mini(remat_policy="everything")
    if jax.default_backend() == "cpu":
        cfg = dataclasses.replace(MX, remat_policy="offload_layer_outputs")
        model = mixtral.Mixtral.abstract(cfg, inputs_shape=(1, 8))
        with pytest.raises(ValueError, match="pinned host memory"):
            nnx.eval_shape(lambda m: m(jnp.zeros((1, 8), jnp.int32)), model)


# -- mixed precision ---------------------------------------------------------------------------

@pytest.mark.slow
def test_bf16_compute_trains(devices):
    """bf16 compute, fp32 parameters: the recipes' train step makes the loss fall."""
    cfg = dataclasses.replace(MX, num_hidden_layers=2, dtype=jnp.bfloat16)
    assert cfg.param_dtype == jnp.float32
    B, L = 4, 32

    def make():
        return mixtral.Mixtral(cfg, inputs_shape=(B, L), rngs=nnx.Rngs(0))

    model, opt = S.create_sharded(make, S.make_tx())
    assert model.embed_tokens(jnp.zeros((B, L), jnp.int32)).dtype == jnp.bfloat16
    rows = np.tile(np.arange(L + 1) % 7, (B, 1))  # a learnable periodic sequence
    batch = S.make_global_batch(dict(
        inputs=rows[:, :-1], targets=rows[:, 1:],
        positions=np.broadcast_to(np.arange(L), (B, L)), segment_ids=np.ones((B, L), np.int32),
        loss_weights=np.ones((B, L), np.float32)), None)
    step = S.make_train_step(aux_loss_weight=0.02)
    losses = []
    for _ in range(5):
        model, opt, metrics = step(model, opt, batch, np.float32(1e-2))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0], losses
    assert model.layers[0].mlp.wi_gate[...].dtype == jnp.float32  # parameters stay fp32


@pytest.mark.slow
def test_rehearsal_reports_the_step(devices):
    """A bf16 DeepSeek-V3 step on 8 devices: bytes, FLOPs, collectives, dots by dtype."""
    r = rehearse(DS, mesh="fsdp=2,expert=2,context=2", strategy="ep_as_cp", batch_size=8,
                 seq_len=32, dtype="bfloat16", remat="full")
    assert (r.devices, r.dtype, r.param_dtype, r.remat) == (8, "bfloat16", "float32", "full")
    n_params = sum(x.size for x in jax.tree.leaves(
        nnx.state(deepseek3.DeepSeek3.abstract(DS), nnx.Param)))
    # fp32 parameters sharded 8 ways (small vectors replicated): between 1/8 and 1x of the total
    assert n_params * 4 / 8 <= r.param_bytes < n_params * 4
    assert r.optimizer_bytes >= 2 * r.param_bytes * 0.99  # Adam's two moments
    assert r.temp_bytes > 0 and r.compile_s > 0 and r.hlo_instructions > 1000
    assert 1.0 < r.flops_ratio < 4.0
    assert r.collective_bytes["all-gather"] > 0 and r.collective_bytes["reduce-scatter"] > 0
    assert r.dots_by_dtype.get("bf16", 0) > 10 * r.dots_by_dtype.get("f32", 0)
    # fp32 matmuls only where the design wants them (router, loss) -- and, by name, the
    # attention backward's delta = sum(dO * O) (zoo/ops, owned by the attention layer)
    assert not r.fp32_dots(allowed=("router", "loss", "blnv,blnv->bnl")), r.dot_names["f32"]
    assert "rehearsal:" in str(r) and r.row()["HLO/model FLOPs"] == r.flops_ratio


def test_every_registered_preset_is_a_rehearsal_preset():
    """The rehearsal's presets are the registry's (so a new family's cannot be missing), and
    each resolves to its family's config, looked up only (no model is built)."""
    import importlib
    import sys
    from pathlib import Path

    from zoo.models import registry
    R = importlib.import_module("zoo.train.rehearse")  # zoo.train.rehearse is also the function
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import scale

    names = registry.preset_names()
    assert set(R.PRESETS) == set(R.presets()) == set(names)
    assert {"gpt_oss_20b", "gpt_oss_120b", "glm4_5", "glm4_5_air", "kimi_k2"} <= set(names)
    for name in names:
        label, config = R.model_config(name)
        family, expected = registry.resolve(name)
        assert label == name and registry.family_of(config) is family and config == expected
        assert scale.parse_args(["--model", name]).model == name
    with pytest.raises(ValueError, match="valid presets are"):
        R.model_config("gpt_oss_999b")
    with pytest.raises(SystemExit):
        scale.parse_args(["--model", "gpt_oss_999b"])



# -- a decode step, compiled ahead of time -------------------------------------------------------

DECODE = dict(mesh="fsdp=4,expert=2", batch_size=8, context=64)
DS_DECODE = dataclasses.replace(DS, vocab_size=264)  # the default tokenizer's ids (else raised)


def _decode_argument_bytes(config, batch: int, context: int) -> tuple[int, int]:
    """``(parameter bytes, cache + tokens bytes)`` per device of `DECODE`'s mesh, from the
    shapes: each parameter (bf16, the serving dtype) divided by the sizes of the mesh axes its
    spec names; the MLA cache ``[n, B, S, Rkv + Hr]`` in bf16 with its int32 positions, segment
    ids, slot counter and next positions, and the tokens, rows over fsdp x expert."""
    sizes = dict(fsdp=4, expert=2)
    cfg = dataclasses.replace(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    p = Partitioner(make_mesh(**sizes), "fsdp")
    model = deepseek3.DeepSeek3.abstract(cfg, inputs_shape=(batch, context), partitioner=p)
    params = 0
    for _, x in nnx.to_flat_state(nnx.state(model)):
        spec = x.sharding.spec if getattr(x, "sharding", None) is not None else ()
        n = math.prod(x.shape)
        for entry in spec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                n //= sizes[axis]
        params += n * x.dtype.itemsize
    rows = batch // (sizes["fsdp"] * sizes["expert"])
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    cache = cfg.num_hidden_layers * rows * context * width * 2
    cache += 2 * rows * context * 4 + 4 + rows * 4
    return params, cache + rows * 4


def test_decode_rehearsal_arguments_are_params_and_cache(devices):
    """One decode step of a small DeepSeek-V3 on 8 CPU devices: XLA's argument bytes per
    device are exactly the bf16 parameters' and the cache's shards (computed from shapes), the
    donated cache is aliased to the output, and nothing is optimizer state."""
    from zoo.inference.rehearsal import rehearse_decode
    r = rehearse_decode(DS_DECODE, **DECODE)
    params, cache = _decode_argument_bytes(DS_DECODE, DECODE["batch_size"], DECODE["context"])
    assert (r.step, r.devices, r.param_dtype, r.dtype) == ("decode", 8, "bfloat16", "bfloat16")
    assert r.param_bytes == params and r.optimizer_bytes == 0
    assert r.argument_bytes == params + cache, (r.argument_bytes, params, cache)
    assert r.cache_bytes == cache - 4  # the tokens are no part of the cache
    assert r.alias_bytes == r.cache_bytes  # donated: the new cache reuses the old one's buffers
    assert r.temp_bytes > 0 and r.hlo_flops > 0 and r.seq_len == DECODE["context"]
    row = r.row()
    assert row["batch x context"] == "8 x 64" and row["cache GiB"] == r.cache_bytes / 2 ** 30
    assert str(r).startswith("decode rehearsal: ")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_decode_rehearsal_for_a_tpu_slice(devices):
    """The same decode step compiled by the TPU compiler for 8 v5p chips: the shards from the
    shardings are the shapes' (as on CPU); XLA's arguments hold at least them (TPU layouts pad
    small dimensions to tiles), the donated cache is aliased, the MoE runs the Mosaic ragged dot
    and the step fits a chip."""
    from zoo import targets
    from zoo.inference.rehearsal import rehearse_decode
    r = rehearse_decode(DS_DECODE, target="tpu:v5p:2x2x2", **DECODE)
    params, cache = _decode_argument_bytes(DS_DECODE, DECODE["batch_size"], DECODE["context"])
    assert (r.target, r.device_kind, r.devices) == ("tpu", "TPU v5", 8)
    assert r.param_bytes == params and r.cache_bytes == cache - 4
    assert r.argument_bytes >= params + cache and r.alias_bytes >= r.cache_bytes
    assert r.custom_calls.get("tpu_custom_call", 0) > 0, r.custom_calls
    assert r.hbm_bytes == targets.hbm_bytes("TPU v5") and r.fits is True
    assert r.row()["target"] == "TPU v5" and "of 95.74 GiB: fits" in str(r)


def test_scale_script_prints_the_decode_row(devices, capsys):
    """``benchmarks/scale.py --decode`` prints the decode table (cache column, batch x
    context), parameters bf16 unless asked."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import scale
    assert scale.main(["--decode", "--model", "deepseek3_mini", "--devices", "8", "--mesh",
                       "fsdp=8", "--batch-size", "8", "--context", "32",
                       "--set", "num_hidden_layers=2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| " + " | ".join(scale.DECODE_COLUMNS) + " |"
    cells = dict(zip(scale.DECODE_COLUMNS, (c.strip() for c in table[2].strip("|").split("|")),
                     strict=True))
    assert cells["batch x context"] == "8 x 32" and cells["dtype"] == "bfloat16/bfloat16"
    assert cells["model"] == "deepseek3_mini (num_hidden_layers=2)" and cells["fits"] == "?"


@pytest.mark.parametrize("kw, match", [
    (dict(batch_size=6), r"batch=6 is not divisible by its 8 shards.*multiple of 8"),
    (dict(context=0), r"context=0 must be an int >= 1"),
    (dict(batch_size=0), r"batch_size=0 must be an int >= 1"),
])
def test_decode_rehearsal_refuses_bad_input_before_compiling(devices, monkeypatch, kw, match):
    module = importlib.import_module("zoo.inference.rehearsal")

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled despite bad input")

    monkeypatch.setattr(module, "measure", no_compile)
    with pytest.raises(ValueError, match=match):
        module.rehearse_decode(DS_DECODE, **{**DECODE, **kw})


def test_no_large_parameter_of_a_published_preset_is_replicated(devices):
    """Under FSDP every parameter array of a published preset over 16M values is sharded
    (built abstractly: shapes and shardings only). Regression: DeepSeek-V4's grouped output
    projection ``o_a_proj`` ([N*H/G, G, Ro] a layer, 1.4B values in V4-Flash) was replicated on
    every chip, with its gradient and both Adam moments."""
    from zoo.models import registry
    p = Partitioner(make_mesh(fsdp=8), "fsdp")
    replicated = []
    for family in registry.families():
        for name in family.presets:
            if name == "mini":
                continue
            model = family.model_cls.abstract(family.preset(name), partitioner=p)
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
                value = v.get_value()
                if value.size > 2 ** 24 and all(s is None for s in value.sharding.spec):
                    replicated.append((name, ".".join(map(str, path)), value.shape))
    assert not replicated, replicated
