"""The conformance suite of a model family: the same checks for every family, from a short spec.

A family is one `FamilySpec` in ``tests/models/test_conformance.py``::

    FamilySpec(name="mixtral", config_cls=MixtralConfig, model_cls=Mixtral,
               from_hf=mixtral.from_hf, to_hf=mixtral.to_hf,
               hf_config=lambda: transformers.MixtralConfig(...tiny...),
               presets={"mixtral_8x7b": MixtralConfig.mixtral_8x7b, "mini": MixtralConfig.mini},
               recipe="mini_mixtral", recipe_flags=("--set", "hidden_size=32", ...))

The checks (tests/models/test_conformance.py runs each for every spec):

* the Hugging Face reference: a tiny random transformers model (fp32, eager attention, norm
  scales and router biases perturbed) saved with ``save_pretrained``; its logits, its
  gradients of ``sum(logits * R)`` (written in checkpoint layout with ``save_pretrained`` of a
  copy whose weights are the gradients, so `from_hf` puts every gradient where its parameter
  lives) and its routing (forward hooks on the routers);
* `from_hf` reads exactly the checkpoint's tensors (the key map covers the checkpoint both
  ways, values bit-equal);
* logits and the gradient of every parameter equal transformers' unsharded and under every
  strategy in `STRATEGIES` (8 virtual devices; with the scanned and unrolled layouts and a
  remat policy), parameters arrive sharded as their metadata says; routing counts equal;
  packed documents equal separate runs;
* `to_hf` / `from_hf` round trip of a zoo-initialised model with tied embeddings, scanned and
  unrolled: transformers loads it with equal logits, zoo reads back every variable exactly;
* an attention subclass with one extra parameter: zoo-only it loads the Hugging Face
  checkpoint unchanged (the unsharded run above uses it: equal logits and gradients, the new
  parameter gets one too); with its own key it round-trips through Hugging Face format; with
  neither, from_hf/to_hf name it;
* the exact ``nnx.eval_shape`` parameter count of each preset equals transformers' own
  (the model built on torch's meta device);
* the family's recipe trains 3 steps in-process.

Module-scoped fixtures in the test file share the reference model and compiled programs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import pathlib
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from support import rel_err
from zoo.layers import hf_keys as hfk
from zoo.models import hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
B, L = 4, 16
TOL = 1e-4  # fp32 relative error (observed ~1e-7)

# name -> (mesh axes or None, strategy, inputs_shape=None?, config overrides): each run also
# varies the layout, so one compile per strategy covers scanned/unrolled and remat as well; the
# unsharded run uses a swapped attention class (`gated_attention`, zoo-only gate = identity)
STRATEGIES = {
    "unsharded": (None, None, False, {}),
    "fsdp": (dict(fsdp=4, tensor=2), "fsdp", False, {"remat_policy": "full"}),
    "cp": (dict(data=2, context=4), "cp", False, {"scan_layers": False}),
    "ep_as_cp": (dict(fsdp=2, expert=2, context=2), "ep_as_cp", True, {}),
}


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """What the suite needs to know about a family.

    Attributes:
      name: test id.
      config_cls, model_cls: the family's `DecoderConfig` subclass and `CausalLM` subclass.
      from_hf, to_hf: the family module's functions.
      hf_config: the tiny transformers config of the reference (every strategy in
        `STRATEGIES` must divide it: 4 heads, 2+ kv heads, batch 4, length 16 work).
      presets: full-size (and mini) presets whose parameter count is checked against
        transformers' (name -> zero-argument constructor).
      recipe: ``recipes/<recipe>.py``; recipe_flags: tiny ``--set`` flags for its 3 steps.
      bias_scale: randomise router-bias buffers (``e_score_correction_bias``) this much.
    """

    name: str
    config_cls: type
    model_cls: type
    from_hf: Callable[..., Any]
    to_hf: Callable[..., Any]
    hf_config: Callable[[], Any]
    presets: dict[str, Callable[[], Any]]
    recipe: str
    recipe_flags: Sequence[str] = ()
    bias_scale: float = 0.0

    def __repr__(self) -> str:  # the pytest id
        return self.name


# -- small helpers ---------------------------------------------------------------------------

def close(a, b, tol: float = TOL) -> bool:
    """Max error within `tol` of the reference's largest magnitude (exactly-zero references,
    e.g. an expert no token chose, must then be matched to 1e-9)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) <= tol * max(float(np.abs(b).max()), 1e-5)


def params(model) -> list[tuple[str, np.ndarray]]:
    """``(path, value)`` of every `nnx.Param`, in path order."""
    return [(".".join(map(str, p)), np.asarray(v.get_value()))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def variables(model) -> list[tuple[str, np.ndarray]]:
    return [(".".join(map(str, p)), np.asarray(v.get_value()))
            for p, v in nnx.to_flat_state(nnx.state(model))]


def assert_same_variables(a, b) -> None:
    va, vb = variables(a), variables(b)
    assert [p for p, _ in va] == [p for p, _ in vb]
    for (path, x), (_, y) in zip(va, vb):
        np.testing.assert_array_equal(x, y, err_msg=path)


def partitioner(strategy: str):
    from zoo.partitioning import Partitioner, make_mesh
    mesh, name, _, _ = STRATEGIES[strategy]
    return None if mesh is None else Partitioner(make_mesh(**mesh), name)


def unpacked(tokens: np.ndarray):
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return positions, np.ones(tokens.shape, np.int32)


@jax.jit
def logits_and_grads(model, tokens, positions, segment_ids, r):
    """``(logits, aux, d sum(logits * r) / d params)``: one compiled program per model
    structure and mesh, shared by every check that runs that model."""
    graphdef, ps, rest = nnx.split(model, nnx.Param, ...)

    def loss(ps):
        logits, aux = nnx.merge(graphdef, ps, rest)(tokens, positions=positions,
                                                    segment_ids=segment_ids)
        return jnp.sum(logits * r), (logits, aux)

    (_, (logits, aux)), grads = jax.value_and_grad(loss, has_aux=True)(ps)
    return logits, aux, grads


def _forward(model, tokens):
    return model(tokens)[0]


forward = jax.jit(_forward)


def run(model, tokens, r, positions=None, segment_ids=None):
    if positions is None:
        positions, segment_ids = unpacked(tokens)
    return logits_and_grads(model, *map(jnp.asarray, (tokens, positions, segment_ids, r)))


def grads_by_path(grads) -> list[tuple[str, np.ndarray]]:
    return [(".".join(map(str, p)), np.asarray(v.get_value()))
            for p, v in nnx.to_flat_state(grads)]


# -- the Hugging Face reference --------------------------------------------------------------

def reference(spec: FamilySpec, tmp_path_factory) -> types.SimpleNamespace:
    """The tiny transformers model, saved; its logits, gradients (as a checkpoint folder in the
    weights' own layout) and, per MoE layer, the experts its routers chose."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = spec.hf_config()
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # a mixed-up norm, bias or sink cannot hide behind unit scales or zeros
            if "norm" in name or name.endswith((".bias", "_bias", "sinks")):
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if spec.bias_scale and "e_score_correction_bias" in name:
                b.copy_(spec.bias_scale * torch.randn_like(b))
    path = tmp_path_factory.mktemp(f"{spec.name}_hf")
    model.save_pretrained(path)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (B, L))
    r = rng.randn(B, L, cfg.vocab_size).astype(np.float32)
    chosen, hooks = [], []
    for name, module in model.named_modules():
        if name.endswith(("mlp.gate", "mlp.router")):  # routers: (..., indices), indices last
            hooks.append(module.register_forward_hook(
                lambda m, i, out: chosen.append(out[-1].detach().numpy().copy())))
    out = model(torch.tensor(tokens)).logits
    for h in hooks:
        h.remove()
    (out * torch.tensor(r)).sum().backward()
    grads = copy.deepcopy(model)
    with torch.no_grad():
        for (_, p), (_, g) in zip(model.named_parameters(), grads.named_parameters()):
            # no gradient reaches a parameter only a no_grad path reads (DSA's indexer): zero
            g.copy_(p.grad) if p.grad is not None else g.zero_()
    grad_path = tmp_path_factory.mktemp(f"{spec.name}_hf_grads")
    grads.save_pretrained(grad_path)
    counts = np.stack([np.bincount(c.ravel(), minlength=_num_experts(cfg)) for c in chosen]) \
        if chosen else None
    return types.SimpleNamespace(path=path, grad_path=grad_path, model=model, config=cfg,
                                 tokens=tokens, r=r, logits=out.detach().numpy(),
                                 expert_counts=counts)


def _num_experts(cfg) -> int:
    for name in ("num_local_experts", "n_routed_experts", "num_experts"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    raise ValueError(f"cannot tell the number of experts of {type(cfg).__name__}")


def hf_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.numpy()


# -- checks ----------------------------------------------------------------------------------

def check_loads_exactly(spec: FamilySpec, ref, model) -> None:
    """The key map names exactly the checkpoint's tensors, and every one arrives bit-equal."""
    reader = hf.CheckpointReader(ref.path)
    table = model.hf_key_map()
    assert set(reader.keys()) == {k for row in table for k in row.keys}
    exported = dict(hf.export_tensors(model, table))
    for key in reader.keys():
        np.testing.assert_array_equal(exported[key], reader.get(key), err_msg=key)


def load(spec: FamilySpec, ref, strategy: str):
    """The reference checkpoint loaded as `strategy` says (unsharded: with the swapped attention
    of `gated_attention`, whose zoo-only gate starts as the identity)."""
    _, _, free_shape, overrides = STRATEGIES[strategy]
    layer = gated_layer(spec.model_cls.decoder_layer_cls, "zoo_only") \
        if strategy == "unsharded" else None
    return spec.from_hf(ref.path, partitioner=partitioner(strategy), config_overrides=overrides,
                        inputs_shape=None if free_shape else (B, L), decoder_layer_cls=layer)


def check_strategy(spec: FamilySpec, ref, strategy: str, model) -> None:
    """Logits, every parameter's gradient and (unsharded) the routing equal transformers';
    `model` is `load(spec, ref, strategy)`."""
    overrides = STRATEGIES[strategy][3]
    p = partitioner(strategy)
    if p is not None:  # parameters arrive sharded as their metadata says, some really split
        split = 0
        for _, var in nnx.to_flat_state(nnx.state(model)):
            value, want = var.get_value(), hf._sharding_of(var)
            assert value.sharding.is_equivalent_to(want, value.ndim)
            split += value.addressable_shards[0].data.shape != value.shape
        assert split > 0
    if overrides.get("remat_policy"):  # the policy really wraps the layers in a checkpoint
        jaxpr = str(jax.make_jaxpr(_forward)(model, jnp.asarray(ref.tokens)))
        assert "remat" in jaxpr.replace("remat_opt", "")
    if p is not None:
        # Sharded: logits only (gradients are checked unsharded; sharded gradients in
        # test_attention_layers, test_moe and test_train).
        assert rel_err(forward(model, jnp.asarray(ref.tokens)), ref.logits) < TOL
        return
    logits, aux, grads = run(model, ref.tokens, ref.r)
    assert rel_err(logits, ref.logits) < TOL
    want = spec.from_hf(ref.grad_path, config_overrides=overrides)  # torch grads, zoo layout
    got = grads_by_path(grads)
    gate = [g for path, g in got if path.endswith("head_gate")]  # the swapped attention's
    assert all(np.abs(g).max() > 0 for g in gate) and bool(gate) == (strategy == "unsharded")
    got = [(path, g) for path, g in got if not path.endswith("head_gate")]
    assert [k for k, _ in got] == [k for k, _ in params(want)]
    for (path, g), (_, w) in zip(got, params(want)):
        assert close(g, w), f"{strategy}: gradient of {path} differs: rel {rel_err(g, w):.2e}"
    if ref.expert_counts is not None and p is None:
        np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), ref.expert_counts)


def check_packed_documents(spec: FamilySpec, ref, model) -> None:
    """Rows packing two documents and padding = each document run alone by transformers."""
    tokens, positions, segments, docs = [], [], [], []
    for row, (n, m) in enumerate([(9, 5), (3, 13), (16, 0), (7, 7)]):
        a, b = ref.tokens[row, :n], ref.tokens[(row + 1) % B, :m]
        pad = L - n - m
        tokens.append(np.concatenate([a, b, np.zeros(pad, int)]))
        positions.append(np.concatenate([np.arange(n), np.arange(m), np.zeros(pad, int)]))
        segments.append(np.array([1] * n + [2] * m + [0] * pad))
        docs += [(row, 0, a), (row, n, b)]
    logits, _, _ = run(model, np.stack(tokens), ref.r, np.stack(positions), np.stack(segments))
    for row, start, doc in docs:
        if len(doc):
            want = hf_logits(ref.model, doc[None])[0]
            assert rel_err(logits[row, start:start + len(doc)], want) < TOL


def perturbed(model, seed: int = 7):
    """`model` with random norm scales, biases and sinks (a unit scale or a zero bias would
    hide a mixed-up key); returns the model."""
    key = jax.random.key(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[-1] in ("scale", "e_score_correction_bias", "bias", "sinks") or \
                str(path[-1]).endswith("_bias"):
            key, sub = jax.random.split(key)
            base = 1.0 if path[-1] == "scale" else 0.0
            var.set_value(base + 0.3 * jax.random.normal(sub, var.get_value().shape))
    return model


def check_round_trip(spec: FamilySpec, ref, tmp_path: pathlib.Path, make=None) -> None:
    """A zoo-initialised model with tied embeddings: to_hf -> transformers (equal logits) ->
    from_hf exact, in the scanned and the unrolled layout. ``make(config)`` builds the model
    (default ``spec.model_cls(config, rngs=nnx.Rngs(7))``)."""
    import transformers
    cfg = spec.config_cls.from_hf_config(ref.config.to_dict(), tie_word_embeddings=True)
    make = make or (lambda c: spec.model_cls(c, rngs=nnx.Rngs(7)))
    model = perturbed(make(cfg))
    assert model.lm_head is None
    spec.to_hf(model, tmp_path / "scanned", max_shard_bytes=40_000)  # several shards + index
    assert (tmp_path / "scanned" / hf.INDEX_NAME).exists()
    assert "lm_head.weight" not in hf.CheckpointReader(tmp_path / "scanned").keys()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "scanned", attn_implementation="eager").eval()
    assert hf_model.config.tie_word_embeddings
    tokens = np.random.RandomState(5).randint(0, cfg.vocab_size, (B, L))
    assert rel_err(forward(model, jnp.asarray(tokens)), hf_logits(hf_model, tokens)) < TOL
    back = spec.from_hf(tmp_path / "scanned")
    assert back.config == model.config
    assert_same_variables(model, back)
    unrolled = spec.from_hf(tmp_path / "scanned", config_overrides={"scan_layers": False})
    assert all(layer.stack_size is None for layer in unrolled.layers)
    spec.to_hf(unrolled, tmp_path / "unrolled")
    a, b = hf.CheckpointReader(tmp_path / "scanned"), hf.CheckpointReader(tmp_path / "unrolled")
    assert sorted(a.keys()) == sorted(b.keys())
    for key in a.keys():
        np.testing.assert_array_equal(a.get(key), b.get(key), err_msg=key)
    assert_same_variables(model, spec.from_hf(tmp_path / "unrolled"))


def gated_attention(base: type, mode: str) -> type:
    """`base` (the family's attention class) with a learnable per-head output gate
    ``1 + tanh(g)`` (zeros: the identity): one extra parameter, mapped per `mode` --
    ``"key"`` (its own Hugging Face key), ``"zoo_only"`` or ``"none"`` (an error)."""

    class GatedAttention(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.head_gate = nnx.Param(jnp.zeros((self.num_heads,), jnp.float32))

        def out(self, o):
            return super().out(o * (1 + jnp.tanh(self.head_gate[...]))[:, None])

        if mode == "key":
            def hf_keys(self, prefix):
                return [*super().hf_keys(prefix), hfk.copy(("head_gate",),
                                                           f"{prefix}.head_gate")]
        elif mode == "zoo_only":
            hf_zoo_only = ("head_gate",)

    GatedAttention.__name__ = GatedAttention.__qualname__ = f"Gated{base.__name__}_{mode}"
    return GatedAttention


@functools.cache  # one class per (layer, mode): a model's structure, hence its compile, is shared
def gated_layer(base: type, mode: str) -> type:
    """The decoder layer `base` with ``attention_cls = gated_attention(...)``."""
    return type(f"Gated{base.__name__}", (base,),
                {"attention_cls": gated_attention(base.attention_cls, mode)})


def check_attention_swap(spec: FamilySpec, ref, model, tmp_path: pathlib.Path) -> None:
    """Swapping ``attention_cls`` keeps Hugging Face interop (see `gated_attention`). `model`:
    the unsharded `load` (zoo-only gate), whose logits and gradients `check_strategy` checks."""
    import pytest
    base = spec.model_cls.decoder_layer_cls
    # zoo-only: loaded from the Hugging Face checkpoint (check_strategy: same logits and
    # gradients, the gate trains), never written back
    # (layers whose mixer is another class, e.g. Qwen3-Next's gated DeltaNet, are not swapped)
    swapped = [la for la in model.layers if isinstance(la.self_attn, base.attention_cls)]
    assert swapped and all(type(la.self_attn).hf_zoo_only == ("head_gate",) for la in swapped)
    spec.to_hf(model, tmp_path / "zoo_only")
    assert not any("head_gate" in k for k in hf.CheckpointReader(tmp_path / "zoo_only").keys())
    # its own key: saved and reloaded through Hugging Face format, both layouts
    layer = gated_layer(base, "key")
    for scan in (True, False):
        cfg = dataclasses.replace(spec.config_cls.from_hf_config(ref.config.to_dict()),
                                  scan_layers=scan)
        model = spec.model_cls(cfg, decoder_layer_cls=layer, rngs=nnx.Rngs(3))
        for la in model.layers:
            if isinstance(la.self_attn, base.attention_cls):
                la.self_attn.head_gate.set_value(jax.random.normal(
                    jax.random.key(la.layer_idx), la.self_attn.head_gate.get_value().shape))
        out = tmp_path / f"keyed_{scan}"
        spec.to_hf(model, out)
        assert any(k.startswith("model.layers.") and k.endswith(".self_attn.head_gate")
                   for k in hf.CheckpointReader(out).keys())
        back = spec.from_hf(out, decoder_layer_cls=layer, config_overrides={"scan_layers": scan})
        assert_same_variables(model, back)
    # neither: a clear error naming the parameter, the class and both fixes
    layer = gated_layer(base, "none")
    message = r"self_attn\.head_gate \(held by Gated.*hf_keys.*hf_zoo_only"
    with pytest.raises(ValueError, match=message):
        spec.from_hf(ref.path, decoder_layer_cls=layer)
    bare = spec.model_cls(spec.config_cls.from_hf_config(ref.config.to_dict()),
                          decoder_layer_cls=layer, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        spec.to_hf(bare, tmp_path / "bare")


def hf_param_count(config) -> int:
    """transformers' own count of the model `config` describes (built on the meta device)."""
    import torch
    import transformers
    hf_cfg = transformers.AutoConfig.for_model(**config.to_hf_config())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return sum(p.numel() for p in model.parameters())


def check_param_count(spec: FamilySpec, preset: str) -> int:
    from zoo.models import count_params
    config = spec.presets[preset]()
    n = count_params(spec.model_cls.abstract(config))
    assert n == config.num_params() == hf_param_count(config)
    return n


def check_recipe(spec: FamilySpec, tmp_path: pathlib.Path) -> None:
    """The family's recipe trains 3 steps in this process (tiny flags), loss finite."""
    import io

    from zoo.train import read_metrics
    path = ROOT / "recipes" / f"{spec.recipe}.py"
    module_spec = importlib.util.spec_from_file_location(f"recipe_{spec.recipe}", path)
    recipe = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(recipe)
    steps = []
    argv = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--no-progress",
            "--sample-tokens", "0", *spec.recipe_flags, "--run-dir", str(tmp_path / "run")]
    with contextlib.redirect_stdout(io.StringIO()):
        code = recipe.main(argv, on_step=lambda s, row: steps.append(s))
    assert code == 0 and steps[-1] == 3
    losses = [row["loss"] for row in read_metrics(tmp_path / "run")]
    assert len(losses) == 3 and np.isfinite(losses).all()
