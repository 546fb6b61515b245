"""zoo.train units: schedule, the train step against plain optax/jax references, sharded against
unsharded, sharded creation, the DeepSeek bias update and checkpoints (roundtrip, corrupt
fallback). Recipe-level behaviour (resume, signals, processes) is in test_recipes.py."""

import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zoo
from zoo.data import load_balance, text_dataset
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
from zoo.models.mixtral import Mixtral, MixtralConfig
from zoo.train import step as S
from zoo.train.checkpoint import Checkpointer, shape_differences

B, L = 4, 32
TINY_MIXTRAL = MixtralConfig.mini(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                                  num_attention_heads=4, head_dim=8)
TINY_DS = DeepSeek3Config.mini(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                               moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=16,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


def _batch(cp=1):
    it = text_dataset(seq_len=L, batch_size=B, context_parallel=cp, seed=3)
    out = next(it)
    it.close()
    return out


# -- schedule ----------------------------------------------------------------------------------

def test_lr_schedule_warmup_then_cosine_to_ten_percent():
    lr, steps = 1e-2, 200
    sched = S.lr_schedule(lr, steps)
    warm = S.default_warmup(steps)
    assert warm == 20 and S.default_warmup(20) == 2 and S.default_warmup(10**6) == 100
    np.testing.assert_allclose([sched(t) for t in range(warm)],
                               lr * np.arange(1, warm + 1) / warm, rtol=1e-12)
    assert sched(warm) == pytest.approx(lr)
    mid = warm + (steps - warm) // 2
    assert sched(mid) == pytest.approx((lr + 0.1 * lr) / 2)   # cosine half-way
    assert sched(steps) == pytest.approx(0.1 * lr) and sched(steps + 50) == pytest.approx(0.1 * lr)
    tail = [sched(t) for t in range(warm, steps + 1)]
    assert all(a >= b for a, b in itertools.pairwise(tail))
    with pytest.raises(ValueError, match="warmup=30"):
        S.lr_schedule(lr, 20, warmup=30)


# -- the step against an independent reference -------------------------------------------------

def test_train_step_matches_plain_optax_adamw():
    """Two updates of the jitted step (donating model and optimizer) == hand-written weighted
    CE + jax.grad + optax.adamw."""
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    aux_w, lrs = 0.02, [1e-3, 2e-3]

    def make():
        return Mixtral(TINY_MIXTRAL, inputs_shape=(B, L), rngs=nnx.Rngs(1))

    model, opt = S.create_sharded(make, S.make_tx(weight_decay=0.1))
    step = S.make_train_step(aux_loss_weight=aux_w, donate=True)
    old_kernel = model.lm_head.kernel[...]

    ref = make()
    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)

    def ref_loss(p):
        logits, aux = nnx.merge(graphdef, p, rest)(batch["inputs"], positions=batch["positions"],
                                                 segment_ids=batch["segment_ids"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        w = batch["loss_weights"]
        return jnp.sum(nll * w) / jnp.sum(w) + aux_w * aux["load_balance_loss"], nll

    p = nnx.to_pure_dict(params)
    mask = jax.tree.map(lambda x: x.ndim > 1, p)

    @jax.jit
    def ref_step(p, opt_state, lr):
        tx = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask))
        (value, _), g = jax.value_and_grad(ref_loss, has_aux=True)(p)
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value, optax.tree.norm(g)

    opt_state = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(0.0, weight_decay=0.1, mask=mask)).init(p)
    for lr in lrs:
        p, opt_state, value, gnorm = ref_step(p, opt_state, lr)
        model, opt, m = step(model, opt, batch, np.float32(lr))
        np.testing.assert_allclose(m["objective"], value, rtol=1e-5)
        np.testing.assert_allclose(m["grad_norm"], gnorm, rtol=1e-5)
        assert float(m["lr"]) == pytest.approx(lr)
        assert float(m["weight_sum"]) == float(batch["loss_weights"].sum())
        assert m["expert_counts"].shape == (1, TINY_MIXTRAL.num_local_experts)
        assert int(m["expert_counts"].sum()) == B * L * TINY_MIXTRAL.num_experts_per_tok
    assert old_kernel.is_deleted()  # donated: the step reused the buffers
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, p)


@pytest.fixture(scope="module")
def ds_runs(devices):
    """One step of a tiny DeepSeek-V3 unsharded and on 8 devices (ep_as_cp, cp=4)."""
    out = {}
    for name, part in (("unsharded", None),
                       ("sharded", zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2),
                                                   "ep_as_cp"))):
        cp = 1 if part is None else part.context_size("attention")
        local = _batch(cp)
        sharding = None if part is None else part.sharding(("batch", "length"))
        batch = S.make_global_batch(local, sharding)

        def make(part=part):
            return DeepSeek3(TINY_DS, inputs_shape=(B, L), partitioner=part, rngs=nnx.Rngs(0))

        model, opt = S.create_sharded(make, S.make_tx())
        step = S.make_train_step(aux_loss_weight=1e-4, expert_bias_rate=1e-2)
        model, opt, m = step(model, opt, batch, np.float32(1e-3))
        out[name] = dict(model=model, opt=opt, metrics=jax.device_get(m), part=part, local=local)
    return out


def test_sharded_step_matches_unsharded(ds_runs):
    """Same loss, gradient norm, expert counts and updated parameters on 8 devices with the
    sequence load-balanced for cp=4 as on one device with the plain order."""
    a, b = ds_runs["unsharded"], ds_runs["sharded"]
    np.testing.assert_array_equal(load_balance(a["local"], 4, axis=1)["inputs"],
                                  b["local"]["inputs"])
    for k in ("loss", "aux_loss", "grad_norm", "param_norm"):
        np.testing.assert_allclose(b["metrics"][k], a["metrics"][k], rtol=2e-5, err_msg=k)
    np.testing.assert_array_equal(b["metrics"]["expert_counts"], a["metrics"]["expert_counts"])
    pa = nnx.to_pure_dict(nnx.state(a["model"]))
    pb = jax.device_get(nnx.to_pure_dict(nnx.state(b["model"])))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(y, x, rtol=1e-4, atol=2e-6), pa, pb)


def test_expert_bias_update_follows_counts(ds_runs):
    """bias (zeros at init) == rate * sign(mean(counts) - counts), per MoE layer."""
    run = ds_runs["sharded"]
    counts = np.asarray(run["metrics"]["expert_counts"], np.float64)
    assert counts.shape == (TINY_DS.num_moe_layers, TINY_DS.n_routed_experts)
    layers = [run["model"].layer(i) for i in range(TINY_DS.num_hidden_layers)]
    moe = [layer.mlp for layer in layers if layer.is_moe]
    got = np.stack([np.asarray(m.e_score_correction_bias[...]) for m in moe])
    want = 1e-2 * np.sign(counts.mean(-1, keepdims=True) - counts)
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert np.any(got != 0)


def test_parameters_and_moments_created_sharded(ds_runs):
    run = ds_runs["sharded"]
    part, mesh = run["part"], run["part"].mesh
    state = nnx.state(run["model"], nnx.Param)
    wanted = nnx.get_named_sharding(state, mesh)
    for (path, var), (_, want) in zip(nnx.to_flat_state(state), nnx.to_flat_state(wanted)):
        assert var[...].sharding.is_equivalent_to(want.get_value(), var[...].ndim), path
    moe = next(run["model"].layer(i).mlp for i in range(TINY_DS.num_hidden_layers)
               if run["model"].layer(i).is_moe)
    shard = moe.wi_gate[...].addressable_shards[0].data.shape
    assert shard[0] == TINY_DS.n_routed_experts // part.size("experts", "moe")  # EP really splits
    moments = nnx.to_flat_state(nnx.state(run["opt"]))
    mu = next(v for path, v in moments if "mu" in path and path[-2:] == ("embed_tokens",
                                                                          "embedding"))
    assert mu[...].sharding.is_equivalent_to(run["model"].embed_tokens.embedding[...].sharding, 2)


# -- custom optimizers and after-step hooks -----------------------------------------------------

SCHEDULE = optax.warmup_cosine_decay_schedule(1e-3, 1e-2, warmup_steps=2, decay_steps=6)


def _tiny_mixtral():
    return Mixtral(TINY_MIXTRAL, inputs_shape=(B, L), rngs=nnx.Rngs(1))


@pytest.mark.parametrize("how", ["inject_hyperparams", "schedule_argument"])
def test_custom_optax_optimizer_is_applied_and_its_rate_logged(how):
    """A user's optax optimizer with its own schedule: three steps change the parameters
    exactly as optax applied by hand to the same gradients, and the logged lr is the
    schedule's rate at each step, never the (ignored) lr argument."""
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    if how == "inject_hyperparams":
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=0.1)
        step = S.make_train_step()
    else:
        tx = optax.adamw(SCHEDULE, weight_decay=0.1)
        step = S.make_train_step(schedule=SCHEDULE)
    model, opt = S.create_sharded(_tiny_mixtral, tx)

    graphdef, params, rest = nnx.split(_tiny_mixtral(), nnx.Param, ...)
    p = nnx.to_pure_dict(params)

    @jax.jit
    def ref_step(p, opt_state):
        def loss(p):
            return S.loss_fn(nnx.merge(graphdef, p, rest), batch)[0]
        updates, opt_state = tx.update(jax.grad(loss)(p), opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    opt_state = tx.init(p)
    for t in range(3):
        p, opt_state = ref_step(p, opt_state)
        model, opt, m = step(model, opt, batch, np.float32(123.0))
        assert float(m["lr"]) == pytest.approx(float(SCHEDULE(t)), rel=1e-6), t
    assert len({float(SCHEDULE(t)) for t in range(3)}) == 3  # the rate really moved
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, p)


def test_unknown_rate_is_not_logged_and_lr_conflicts_are_refused():
    """An optimizer whose rate the step cannot read logs no lr; make_tx needs the lr
    argument, and refuses a schedule= it would not apply."""
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    model, opt = S.create_sharded(_tiny_mixtral, optax.adamw(SCHEDULE))
    model, opt, m = S.make_train_step()(model, opt, batch, np.float32(123.0))
    assert "lr" not in m and int(opt.step[...]) == 1
    model, opt = S.create_sharded(_tiny_mixtral, S.make_tx())
    with pytest.raises(ValueError, match="does not apply: it applies the lr argument"):
        S.make_train_step(schedule=SCHEDULE)(model, opt, batch, np.float32(1e-3))
    with pytest.raises(ValueError, match="lr=None; pass this update's rate"):
        S.make_train_step()(model, opt, batch)


def test_after_step_hook_runs_after_the_update():
    """``after_step(model, aux, *, expert_bias_rate)`` sees the updated model and the aux
    dict; expert_bias_rate without a hook takes the family's, and Mixtral registers none.
    step.py reaches the bias update only through the registry."""
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    seen = {}

    def after_step(model, aux, *, expert_bias_rate):
        seen["aux"] = set(aux)
        model.lm_head.kernel[...] = jnp.full_like(model.lm_head.kernel[...], expert_bias_rate)

    model, opt = S.create_sharded(_tiny_mixtral, S.make_tx())
    step = S.make_train_step(after_step=after_step, expert_bias_rate=0.5)
    for _ in range(2):  # the second update starts from the hook's kernel and moves it again
        model, opt, _ = step(model, opt, batch, np.float32(1e-3))
        np.testing.assert_array_equal(model.lm_head.kernel[...], 0.5)
    assert {"expert_counts", "load_balance_loss"} <= seen["aux"]
    with pytest.raises(ValueError, match="family 'mixtral' registers none"):
        S.make_train_step(expert_bias_rate=1e-3)(model, opt, batch, np.float32(1e-3))
    source = open(S.__file__).read()
    assert "zoo.layers" not in source and "update_expert_bias" not in source


# -- checkpoints -------------------------------------------------------------------------------

def test_checkpoint_roundtrip_and_corrupt_fallback(tmp_path):
    def make():
        return Mixtral(TINY_MIXTRAL, inputs_shape=(B, L), rngs=nnx.Rngs(0))

    tx = S.make_tx()
    model, opt = S.create_sharded(make, tx)
    ck = Checkpointer(tmp_path / "ck", async_save=True)
    saved = {}
    for step in (1, 2):
        # make the states differ per step
        nnx.update(model, jax.tree.map(lambda x, s=step: x + s, nnx.state(model, nnx.Param)))
        ck.save(step, model, opt, data_state={"next": step}, config={"model": {"a": 1}})
        saved[step] = jax.device_get(nnx.to_pure_dict(nnx.state(model)))
    ck.wait()
    assert ck.steps() == [1, 2]
    assert os.path.exists(tmp_path / "ck" / "2" / "data" / "process_0-of-1.json")

    am, ao = S.abstract_state(make, tx)
    r = ck.restore(am, ao)
    assert r.step == 2 and r.data == {"next": 2} and r.config == {"model": {"a": 1}}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(nnx.to_pure_dict(
        nnx.state(r.model))), saved[2])

    # truncate every array file of the latest checkpoint: restore must fall back to step 1
    for root, _, files in os.walk(tmp_path / "ck" / "2" / "state"):
        for f in files:
            with open(os.path.join(root, f), "r+b") as fh:
                fh.truncate(max(os.path.getsize(fh.name) // 3, 1))
    with pytest.warns(UserWarning, match="cannot be read"):
        r = Checkpointer(tmp_path / "ck").restore(am, ao)
    assert r.step == 1 and r.data == {"next": 1}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(nnx.to_pure_dict(
        nnx.state(r.model))), saved[1])
    assert sorted(os.listdir(tmp_path / "ck")) == ["1", "corrupt-2"]
    ck.close()


def test_shape_differences_names_paths():
    a = {"model": {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}}
    b = {"model": {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32),
                   "v": jax.ShapeDtypeStruct((1,), jnp.float32)}}
    assert shape_differences(a, b) == ["model/w: saved (2, 3) vs now (2, 4)",
                                       "model/v: not in the checkpoint"]
    assert shape_differences(a, a) == []


def test_global_batch_is_one_array_over_the_mesh(devices):
    part = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    local = _batch(part.context_size("attention"))
    batch = S.make_global_batch(local, part.sharding(("batch", "length")))
    assert set(batch) == set(S.BATCH_KEYS)
    x = batch["inputs"]
    assert x.shape == (B, L) and x.sharding.spec == part.spec(("batch", "length"))
    np.testing.assert_array_equal(np.asarray(x), local["inputs"])
    assert json.dumps(jax.device_get(batch["loss_weights"]).sum().item())


# -- the loop ----------------------------------------------------------------------------------

def test_the_loop_runs_ahead_of_its_metrics(tmp_path, devices):
    """Step n+1 is dispatched before step n's metrics are read (no per-step host sync), except
    at a checkpoint step, whose own metrics are read before its state is saved."""
    from types import SimpleNamespace

    from test_recipes import COMMON, TINY, recipe
    from zoo.train import Trainer, cli, hooks, read_metrics

    s, _ = cli.setup(recipe("mini_mixtral").RECIPE, ["--steps", "8", *COMMON,
                                                     *TINY["mini_mixtral"]])
    events = []

    class Counting:  # the loop compiles train_step.lower(...).compile() and calls the result
        def __init__(self, jitted):
            self.jitted = jitted

        def lower(self, *args):
            compiled = self.jitted.lower(*args).compile()

            def call(*a):
                events.append("dispatch")
                return compiled(*a)
            return SimpleNamespace(compile=lambda: call)

    config = s.config.replace(steps=8, checkpoint_every=4, progress=False,
                              run_dir=str(tmp_path))
    with Trainer(dataclasses.replace(s, config=config, train_step=Counting(s.train_step)),
                 hooks=[hooks.OnStep(lambda step, row: events.append(step))],
                 name="mini_mixtral") as trainer:
        trainer.train()
    dispatched_before = {e: events[:i].count("dispatch") for i, e in enumerate(events)
                         if e != "dispatch"}
    assert list(dispatched_before) == list(range(1, 9))
    for step, n in dispatched_before.items():
        assert n == (step if step in (4, 8) else step + 1), (step, events)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))
    # run.json records the TrainConfig as dataclasses.asdict (JSON: tuples become lists)
    info = json.loads((tmp_path / "run.json").read_text())["config"]
    assert info["train"] == json.loads(json.dumps(dataclasses.asdict(config)))
    assert info["model"] == s.record["model"] and info["recipe"] == "mini_mixtral"
