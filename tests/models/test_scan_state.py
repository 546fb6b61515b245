"""State a layer's forward pass changes (RNG counts, counters, sown intermediates) survives the
scan over stacked layers and remat exactly as in the unrolled model, which is the reference:
``scan_layers=False`` without remat, each layer a module of its own that NNX updates in place.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zoo.models.mixtral import Mixtral, MixtralConfig, MixtralDecoderLayer, MixtralMoE
from zoo.ops import moe as moe_ops

CONFIG = MixtralConfig.mini(num_hidden_layers=3, vocab_size=64, hidden_size=16,
                            intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, num_local_experts=4, num_experts_per_tok=2)
B, L = 2, 8
STEPS = 2
# the first test sows outside nnx.capture, as a layer that keeps its intermediates does
pytestmark = pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")


class NoisyMoE(MixtralMoE):
    """Unit Gaussian noise on the router logits, from the layer's own `nnx.Rngs` stream."""

    def __init__(self, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(rngs=rngs, **kwargs)
        self.noise = nnx.Rngs(noise=rngs.params())

    def route(self, x):
        logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32), self.router[...])
        logits = logits + jax.random.normal(self.noise.noise(), logits.shape)
        return moe_ops.route(logits, k=self.num_experts_per_tok, scoring=self.scoring)


class Calls(nnx.Variable):
    """How many times the layer ran (a counter the forward pass increments)."""


class NoisySowingLayer(MixtralDecoderLayer):
    """The noisy router, a call counter, and the output's RMS sown as an intermediate."""

    moe_cls = NoisyMoE

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.calls = Calls(jnp.zeros((), jnp.int32))

    def __call__(self, x, **kwargs):
        y, aux = super().__call__(x, **kwargs)
        self.calls[...] += 1
        self.sow(nnx.Intermediate, "out_rms", jnp.sqrt(jnp.mean(jnp.square(y))))
        return y, aux


def _model(scan: bool, remat=None, layer_cls=NoisySowingLayer):
    config = dataclasses.replace(CONFIG, scan_layers=scan, remat_policy=remat)
    return Mixtral(config, inputs_shape=(B, L), decoder_layer_cls=layer_cls, rngs=nnx.Rngs(0))


def _copy_unrolled_into_stacked(unrolled, scanned):
    """Every variable of `unrolled` (parameters, noise keys and counts, counters) into
    `scanned`: layer i goes to slice i of its stack, so both start from the same state."""
    flat = dict(nnx.to_flat_state(nnx.state(unrolled)))
    out = []
    for path, var in nnx.to_flat_state(nnx.state(scanned)):
        if path[0] == "layers":
            rows = scanned.layer_indices(scanned.layers[path[1]])
            value = jnp.stack([flat[("layers", i, *path[2:])].get_value() for i in rows])
        else:
            value = flat[path].get_value()
        out.append((path, var.copy(value)))
    nnx.update(scanned, nnx.from_flat_state(out))


@jax.jit
def _train_forward(model, tokens):
    """The model after a forward + backward pass (as in the train step), the logits, the
    gradient's norm (which a remat that redrew other noise in the backward would change) and
    the pass's expert counts (a row per layer)."""
    def loss(m):
        logits, aux = m(tokens)
        return (jnp.mean(jnp.square(logits)) + aux["load_balance_loss"],
                (logits, aux["expert_counts"]))

    grad_fn = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
    (_, (logits, counts)), grads = grad_fn(model)
    return model, logits, optax.tree.norm(grads), counts


def _out_rms(model, i):
    return np.asarray(model.layer(i).out_rms.get_value())


@pytest.mark.parametrize("remat", [None, "full"])
def test_noisy_router_counters_and_sown_values_scanned_as_unrolled(remat):
    """Same logits step after step (the noise changes every step and follows the unrolled
    model's sequence), same counters, same sown values per layer (stacked like the
    parameters in the scanned model, accumulating across calls like the unrolled model's);
    with remat, the unrolled model under remat too."""
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, CONFIG.vocab_size)
    reference = _model(scan=False)
    models = {"scanned": _model(scan=True, remat=remat)}
    _copy_unrolled_into_stacked(reference, models["scanned"])
    if remat:
        models["unrolled"] = _model(scan=False, remat=remat)
        nnx.update(models["unrolled"], nnx.state(reference))
    ref_logits = []
    for step in range(STEPS):
        reference, want, want_norm, _ = _train_forward(reference, tokens)
        ref_logits.append(want)
        for name, model in models.items():
            models[name], got, norm, _ = _train_forward(model, tokens)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}, step {step}")
            np.testing.assert_allclose(norm, want_norm, rtol=1e-5, err_msg=f"{name}, {step}")
            for i in range(CONFIG.num_hidden_layers):
                layer = models[name].layer(i)
                assert int(layer.calls[...]) == int(reference.layer(i).calls[...]) == step + 1
                assert int(layer.mlp.noise.noise.count[...]) == step + 1
                np.testing.assert_allclose(_out_rms(models[name], i), _out_rms(reference, i),
                                           rtol=1e-5, err_msg=f"{name}, layer {i}")
        assert _out_rms(reference, 0).shape == (step + 1,)  # sow appends a value per call
    for step in range(1, STEPS):  # the noise moves on: another routing, other logits
        assert not np.allclose(ref_logits[step], ref_logits[0])
    stacked = nnx.state(models["scanned"], nnx.Intermediate)["layers"][0]["out_rms"]
    assert [v.shape for v in stacked.get_value()] == [(CONFIG.num_hidden_layers,)] * STEPS


def test_captured_intermediates_are_stacked_per_layer():
    """`nnx.capture` of a scanned model gives each layer's sown value along the stack's axis,
    the values the unrolled model gives layer by layer."""
    tokens = jax.random.randint(jax.random.key(2), (B, L), 0, CONFIG.vocab_size)
    unrolled, scanned = _model(scan=False), _model(scan=True)
    _copy_unrolled_into_stacked(unrolled, scanned)
    captured = [nnx.capture(lambda m: m(tokens)[0], nnx.Intermediate)(m)[1]
                for m in (unrolled, scanned)]
    want = [captured[0]["layers"][i]["out_rms"].get_value()[0]
            for i in range(CONFIG.num_hidden_layers)]
    (got,) = captured[1]["layers"][0]["out_rms"].get_value()
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5)


class ParamWritingLayer(MixtralDecoderLayer):
    def __call__(self, x, **kwargs):
        self.input_layernorm.scale[...] = self.input_layernorm.scale[...] * 2
        return super().__call__(x, **kwargs)


def test_a_parameter_written_in_the_forward_is_refused_when_scanned():
    """A stack's parameters are the scan's inputs only: writing one in the forward pass would
    be lost, so it is an error naming the parameter; unrolled under remat it is written back
    as without remat."""
    tokens = jnp.zeros((B, L), jnp.int32)
    with pytest.raises(ValueError, match=r"sets the nnx\.Param at input_layernorm\.scale"):
        _model(scan=True, layer_cls=ParamWritingLayer)(tokens)
    for remat in (None, "full"):
        model = _model(scan=False, remat=remat, layer_cls=ParamWritingLayer)
        model(tokens)
        np.testing.assert_array_equal(model.layer(2).input_layernorm.scale[...], 2.0)


def _top_level_scan_outputs(model, tokens) -> int:
    jaxpr = jax.make_jaxpr(lambda m: m(tokens))(model)
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    return len(scan.outvars)


def test_scan_returns_only_the_state_the_forward_changes():
    """The scan's outputs are the residual stream, the MoE aux entries and, per changed
    variable, one stacked value: the noise counts, the call counter and the sown value --
    never the parameters or the RNG keys; a layer that changes nothing adds no output."""
    tokens = jnp.zeros((B, L), jnp.int32)
    aux_entries = 5  # load_balance_loss, expert_counts, dropped_tokens, dropped_fraction,
    # moe_rounds
    plain = _model(scan=True, layer_cls=MixtralDecoderLayer)
    assert _top_level_scan_outputs(plain, tokens) == 1 + aux_entries
    assert _top_level_scan_outputs(_model(scan=True), tokens) == 1 + aux_entries + 3


class CycledLayer(NoisySowingLayer):
    """Layers of two kinds alternating (identical in structure, so the unrolled model's state
    copies into the stacks), sigmoid routers with a selection bias: scanned, the model is two
    stacks of one cycle (`layer_cycles`) and a trailing layer alone."""

    @classmethod
    def layer_kind(cls, config, layer_idx):
        return layer_idx % 2

    def make_moe(self, config, *, inputs_shape, partitioner, rngs):
        return self.moe_cls(
            num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.intermediate_size, inputs_shape=inputs_shape, partitioner=partitioner,
            scoring="sigmoid", rngs=rngs)


@pytest.mark.parametrize("remat", [None, "full"])
def test_a_cycle_of_stacks_runs_as_the_unrolled_layers(remat):
    """Scanned a cycle a step, the alternating layers give the unrolled model's logits,
    gradient norm, counters, sown values and expert counts (rows in layer order), and the
    selection-bias update reaches each layer with its own row."""
    from zoo.layers.moe import update_expert_bias
    n = 5
    config = dataclasses.replace(CONFIG, num_hidden_layers=n)
    make = lambda scan: Mixtral(dataclasses.replace(config, scan_layers=scan,
                                                    remat_policy=remat if scan else None),
                                inputs_shape=(B, L), decoder_layer_cls=CycledLayer,
                                rngs=nnx.Rngs(0))
    reference, scanned = make(False), make(True)
    assert [(la.layer_idx, la.stack_size, la.stack_stride) for la in scanned.layers] == \
        [(0, 2, 2), (1, 2, 2), (4, 1, 1)]
    _copy_unrolled_into_stacked(reference, scanned)
    tokens = jax.random.randint(jax.random.key(3), (B, L), 0, CONFIG.vocab_size)
    for step in range(STEPS):
        reference, want, want_norm, want_counts = _train_forward(reference, tokens)
        scanned, got, norm, counts = _train_forward(scanned, tokens)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        np.testing.assert_allclose(norm, want_norm, rtol=1e-5, err_msg=f"step {step}")
        for i in range(n):
            assert int(scanned.layer(i).calls[...]) == step + 1
            np.testing.assert_allclose(_out_rms(scanned, i), _out_rms(reference, i), rtol=1e-5)
    # the last step's counts (its forward is the train step's: the same call, the same noise)
    counts = [np.asarray(want_counts), np.asarray(counts)]
    np.testing.assert_array_equal(counts[1], counts[0])
    assert len(set(map(bytes, counts[0]))) > 1  # the rows differ, so their order is checked
    rows = np.arange(n * 4).reshape(n, 4) % 7  # a distinct row per layer
    for m in (reference, scanned):
        update_expert_bias(m, rows, rate=0.5)
    for i in range(n):
        want = np.sign(rows[i].mean() - rows[i]) * 0.5
        for m in (reference, scanned):
            np.testing.assert_allclose(m.layer(i).mlp.e_score_correction_bias[...], want)


@pytest.mark.parametrize("remat", [None, "full"])
def test_compute_dtype_parameters_enter_the_scan_cast(remat, monkeypatch):
    """The experts' weights carry `COMPUTE_DTYPE` metadata: a stack on an accelerator mesh
    casts them to bf16 once, before its scan (the scan's inputs hold bf16 expert stacks, the
    router stays fp32), and the loss and every fp32 gradient equal those of the same model
    casting inside each layer (as on CPU meshes). Run here on CPU with the accelerators' rule
    switched on. (The unrolled bf16 model is no exact reference: XLA fuses its bf16 ops
    differently, 2e-4 apart even between its own eager and jitted runs.)"""
    from zoo.models import stacks
    from zoo.partitioning import COMPUTE_DTYPE

    assert stacks.cast_before_scan("tpu") and stacks.cast_before_scan("gpu")
    assert not stacks.cast_before_scan("cpu")
    monkeypatch.setattr(stacks, "cast_before_scan", lambda platform: True)

    config = dataclasses.replace(CONFIG, scan_layers=True, remat_policy=remat,
                                 dtype=jnp.bfloat16)
    model = Mixtral(config, inputs_shape=(B, L), rngs=nnx.Rngs(0))
    meta = model.layers[0].mlp.wi_gate.get_metadata()
    assert meta[COMPUTE_DTYPE] == "bfloat16", meta
    assert COMPUTE_DTYPE not in model.layers[0].mlp.router.get_metadata()
    params = nnx.state(model.layers[0], nnx.Param)
    cast = dict(nnx.to_flat_state(stacks._cast_for_compute(params)))
    for path, v in nnx.to_flat_state(params):
        want = jnp.bfloat16 if COMPUTE_DTYPE in v.get_metadata() else jnp.float32
        assert cast[path].get_value().dtype == want, path
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, CONFIG.vocab_size)

    def loss_and_grads(m):  # a new function per call: its own trace
        def loss(m):
            logits, aux = m(tokens)
            return jnp.mean(jnp.square(logits.astype(jnp.float32))) + aux["load_balance_loss"]
        return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(m)

    def scan_inputs(m):
        jaxpr = jax.make_jaxpr(lambda m: m(tokens))(m)
        (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        return [v.aval for v in scan.invars  # expert stacks [layers, E, in, out]
                if v.aval.ndim == 4 and v.aval.shape[1] == CONFIG.num_local_experts]

    got_loss, got = loss_and_grads(model)
    assert [a.dtype for a in scan_inputs(model)] == [jnp.bfloat16] * 3
    monkeypatch.setattr(stacks, "cast_before_scan", lambda platform: False)
    want_loss, want = loss_and_grads(model)
    assert [a.dtype for a in scan_inputs(model)] == [jnp.float32] * 3
    np.testing.assert_array_equal(np.asarray(got_loss), np.asarray(want_loss))
    flat = dict(nnx.to_flat_state(want))
    for path, g in nnx.to_flat_state(got):
        assert g.get_value().dtype == flat[path].get_value().dtype == jnp.float32, path
        np.testing.assert_array_equal(np.asarray(g.get_value()),
                                      np.asarray(flat[path].get_value()), err_msg=str(path))
