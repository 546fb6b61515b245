"""The pre-norm decoder shared by Mixtral and DeepSeek-V3: `DecoderLayer` and `CausalLM`.

* `DecoderLayer` -- ``h = x + self_attn(input_layernorm(x))``; ``y = h + mlp(post_attention_
  layernorm(h))`` where ``mlp`` is an `MoE` (returning an aux dict) or a dense `MLP`. It builds
  its pieces through factory methods (`make_attention`, `make_moe`, `make_mlp`, `make_norm`)
  that read the class attributes ``attention_cls``, ``moe_cls``, ``mlp_cls``, ``norm_cls``, so a
  subclass swaps one piece by setting one attribute::

      class MyLayer(MixtralDecoderLayer):
          attention_cls = MyAttention
      model = Mixtral(config, decoder_layer_cls=MyLayer, rngs=nnx.Rngs(0))

* `CausalLM` -- embedding, the decoder layers (class attribute ``decoder_layer_cls`` or the
  ``decoder_layer_cls=`` argument), final RMSNorm and an ``lm_head`` (none with
  ``tie_word_embeddings``: the logits go through the embedding table);
  ``logits, aux = model(tokens, positions=None, segment_ids=None)``. Positions default to
  ``arange(L)``; ``aux["load_balance_loss"]`` is summed over the MoE layers (Hugging Face's
  Mixtral averages it over layers: its ``router_aux_loss_coef`` equals ours times
  ``num_moe_layers``) and every other aux entry (``expert_counts`` [num_moe_layers, E],
  ``dropped_fraction``) is stacked per layer.
  The residual stream is constrained to ``("batch", "length", "act_embed")`` after every
  layer; each layer runs under ``jax.named_scope("layer_{i}")`` and, when the config names a
  ``remat_policy``, under `jax.checkpoint`. With ``scan_layers`` (the default) each run of
  identical layers (`layer_cycles`: DeepSeek-V3's dense and MoE layers form separate runs) is
  one stacked module scanned by `run_layers`; layers whose kinds repeat in a cycle (gpt-oss's
  sliding, full, sliding, full, ...) are one stack per place in the cycle, scanned together
  a cycle a step (`run_cycle`); state a layer's forward pass changes (RNG counts, counters,
  sown intermediates) is written back per layer, as the unrolled model
  (``scan_layers=False``) keeps it in each layer; ``model.layer(i)`` is layer ``i`` either way.
* Hugging Face interop: `CausalLM.from_hf` / `CausalLM.to_hf` with the key map the modules
  compose (`zoo.layers.hf_keys`: every layer names its own parameters' keys, `DecoderLayer`
  and `CausalLM` compose them; a family only renames what differs, via ``hf_names``).

Attribute names follow Hugging Face (``embed_tokens``, ``layers``, ``self_attn``, ``mlp``,
``input_layernorm``, ``post_attention_layernorm``, ``norm``, ``lm_head``).

Legend: B batch, L length, D embed (hidden_size), V vocab, E experts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import spmd
from jax.ad_checkpoint import checkpoint_name

from zoo import _flax_compat
from zoo.layers.embed import Embed
from zoo.layers.linear import Fp8Stats, Linear, prequantized_weights  # noqa: F401
from zoo.layers.mlp import MLP
from zoo.layers.moe import MoE
from zoo.layers.norm import RMSNorm
from zoo.layers import hf_keys as hfk
from zoo.models import hf
from zoo.models.config import DecoderConfig
from zoo.ops.moe_execution import choose_grouped_matmul
from zoo.models.stacks import (STACK_METADATA, build_stack, interleave_aux, layer_cycles,
                               layer_groups, run_cycle, run_layers)
from zoo.partitioning import Partitioner, resolve

ACT = ("batch", "length", "act_embed")

def count_params(model: nnx.Module) -> int:
    """Number of `nnx.Param` entries (works on `nnx.eval_shape` models: no memory)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return int(sum(math.prod(x.shape) for x in leaves))


def abstract_rngs(seed: int = 0) -> nnx.Rngs:
    """`nnx.Rngs` for building a model under `nnx.eval_shape`: on the flax versions where a jax
    draw counter makes that quadratic in the parameter count, with a numpy counter
    (`zoo._flax_compat.NUMPY_RNG_COUNTER`)."""
    rngs = nnx.Rngs(seed)
    if _flax_compat.NUMPY_RNG_COUNTER:
        rngs.params.count.set_raw_value(np.zeros((), np.uint32))
    return rngs


def nominal_inputs_shape(p: Partitioner) -> tuple[int, int]:
    """The smallest ``(batch, length)`` every layer accepts under `p`.

    ``from_hf(..., inputs_shape=None)`` builds the layers with it; at call time they re-check
    the real shape, so any batch and length the mesh divides work. The attention kernel choice
    (``"auto"``) does not depend on the length (it compares K/V with the local query side).
    """
    cp = p.context_size("attention")
    batch = math.lcm(p.size("batch"), p.size("batch", "attention"))
    length = math.lcm(2 * cp if cp > 1 else 1, p.size("length"))
    return batch, length


# -- decoder layer ---------------------------------------------------------------------------

class DecoderLayer(nnx.Module):
    """Pre-norm residual block: self-attention, then an MoE or a dense MLP.

    Subclasses set ``attention_cls``/``moe_cls``/``mlp_cls``/``norm_cls`` or override the
    ``make_*`` factories; the families implement `make_attention`, `make_moe` and `uses_moe`.
    ``inputs_shape`` is ``(batch, length, hidden_size)``.

    In a scanned model (``config.scan_layers``) one instance holds a whole run of identical
    layers: every variable has a leading ``"layers"`` axis of ``stack_size`` and ``layer_idx``
    is the run's first layer; in a cycle of ``stack_stride`` > 1 kinds the stack holds every
    ``stack_stride``-th layer from ``layer_idx``. Unrolled, ``stack_size`` is None.
    """

    attention_cls: ClassVar[type] = nnx.Module  # set by each family
    moe_cls: ClassVar[type] = MoE
    mlp_cls: ClassVar[type] = MLP
    norm_cls: ClassVar[type] = RMSNorm
    hf_names: ClassVar[dict[str, str]] = {}  # submodule -> Hugging Face name where they differ

    def __init__(self, config, *, layer_idx: int, inputs_shape: Sequence[int],
                 partitioner: Partitioner | None = None, rngs: nnx.Rngs):
        p = resolve(partitioner)
        self.layer_idx = layer_idx
        self.stack_size: int | None = None
        self.stack_stride = 1
        self.partitioner = p
        shape = tuple(inputs_shape)
        kw = dict(inputs_shape=shape, partitioner=p, rngs=rngs)
        self.input_layernorm = self.make_norm(config, partitioner=p, rngs=rngs)
        self.self_attn = self.make_attention(config, **kw)
        self.post_attention_layernorm = self.make_norm(config, partitioner=p, rngs=rngs)
        self.is_moe = bool(self.uses_moe(config, layer_idx))
        self.mlp = self.make_moe(config, **kw) if self.is_moe else self.make_mlp(config, **kw)

    # -- factories a subclass may override -----------------------------------------------------
    @classmethod
    def uses_moe(cls, config, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is an MoE layer (a classmethod: the model groups the
        layers into scanned runs before building any)."""
        return True

    @classmethod
    def layer_kind(cls, config, layer_idx: int) -> Any:
        """What makes layers differ in structure (only layers of one kind share a scanned
        stack): `uses_moe` here; a family whose layers also differ in their attention
        (gpt-oss's sliding and full layers) returns a tuple of both."""
        return cls.uses_moe(config, layer_idx)

    def make_norm(self, config, *, partitioner: Partitioner, rngs: nnx.Rngs) -> nnx.Module:
        return self.norm_cls(config.hidden_size, eps=config.rms_norm_eps, partitioner=partitioner,
                             param_dtype=config.param_dtype, rngs=rngs)

    def make_attention(self, config, *, inputs_shape, partitioner, rngs) -> nnx.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement make_attention")

    def make_moe(self, config, *, inputs_shape, partitioner, rngs) -> nnx.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement make_moe")

    def make_mlp(self, config, *, inputs_shape, partitioner, rngs) -> nnx.Module:
        return self.mlp_cls(embed_dim=config.hidden_size, mlp_dim=config.intermediate_size,
                            partitioner=partitioner, dtype=config.dtype,
                            param_dtype=config.param_dtype, fp8=config.fp8, rngs=rngs)

    # -- Hugging Face keys ---------------------------------------------------------------------
    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """The layer's rows, composed from its pieces' own ``hf_keys`` (so a swapped
        ``attention_cls`` brings its keys along); ``hf_names`` renames a piece (Mixtral's
        ``mlp`` is ``block_sparse_moe`` in its checkpoints)."""
        return hfk.children(self, prefix, ("input_layernorm", "self_attn",
                                           "post_attention_layernorm", "mlp"))

    # -- forward -------------------------------------------------------------------------------
    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """x [B, L, D] -> (x [B, L, D], the MoE's aux dict or None for a dense layer).

        The attention and MLP/MoE outputs are tagged ``attention_out`` / ``mlp_out``
        (`jax.ad_checkpoint.checkpoint_name`) for the ``save_layer_outputs`` remat policies.
        """
        return self.block(x, lambda h: self.self_attn(h, positions=positions,
                                                      segment_ids=segment_ids))

    def block(self, x: jax.Array, attention) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """The layer with ``attention(h [B, L, D]) -> [B, L, D]`` in place of ``self_attn``:
        `__call__` passes the layer's own attention, `zoo.inference` one that reads and
        writes a KV cache."""
        c = self.partitioner.constrain
        with jax.named_scope(f"layer_{self.layer_idx}"):
            h = attention(self.input_layernorm(x))
            h = checkpoint_name(h.astype(x.dtype), "attention_out")
            x = c(x + h, ACT)
            h = self.post_attention_layernorm(x)
            aux = None
            if self.is_moe:
                h, aux = self.mlp(h)
            else:
                h = self.mlp(h)
            h = checkpoint_name(h.astype(x.dtype), "mlp_out")
            return c(x + h, ACT), aux


# -- model -----------------------------------------------------------------------------------

# `CausalLM.for_inference`'s structures, by model class, config, partitioner and shape
_INFERENCE_VIEWS: dict[Any, Any] = {}


class CausalLM(nnx.Module):
    """Embedding -> decoder layers -> RMSNorm -> lm_head (or the tied embedding); see the
    module docstring.

    Args:
      config: the family's config.
      inputs_shape: ``(batch, length)`` the model will see (validated by every layer at
        construction); None: the smallest shape the partitioner accepts, and any batch/length
        it divides works at call time.
      partitioner: how the mesh cuts parameters and activations (None: unsharded).
      decoder_layer_cls: overrides the class attribute ``decoder_layer_cls``.

    ``self.layers``: with ``config.scan_layers`` one stacked `DecoderLayer` per run of
    identical layers, or per place in a cycle of kinds (`layer_cycles`), else one
    `DecoderLayer` per layer.
    """

    config_cls: ClassVar[type[DecoderConfig]] = DecoderConfig  # set by each family
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    final_norm_cls: ClassVar[type] = RMSNorm  # the norm before lm_head
    hf_names: ClassVar[dict[str, str]] = {"embed_tokens": "model.embed_tokens",
                                          "norm": "model.norm", "layers": "model.layers"}

    def __init__(self, config, *, inputs_shape: Sequence[int] | None = None,
                 partitioner: Partitioner | None = None, rngs: nnx.Rngs,
                 decoder_layer_cls: type[DecoderLayer] | None = None):
        p = resolve(partitioner)
        name = type(self).__name__
        if not isinstance(config, DecoderConfig):
            raise ValueError(f"{name}: config={config!r} must be a zoo.models.DecoderConfig "
                             f"(the family's config class, e.g. {type(self).config_cls.__name__})")
        if inputs_shape is None:
            inputs_shape = nominal_inputs_shape(p)
        shape = tuple(inputs_shape)
        if len(shape) != 2 or not all(isinstance(n, (int, np.integer)) and n > 0 for n in shape):
            raise ValueError(f"{name}: inputs_shape={inputs_shape!r} must be (batch, length), two "
                             f"positive ints (the token array's shape), or None")
        layer_cls = decoder_layer_cls or type(self).decoder_layer_cls
        if not (isinstance(layer_cls, type) and issubclass(layer_cls, DecoderLayer)):
            raise ValueError(f"{name}: decoder_layer_cls={layer_cls!r} must be a subclass of "
                             f"zoo.models.decoder.DecoderLayer")
        self.config = config
        self.partitioner = p
        self.inputs_shape = (int(shape[0]), int(shape[1]))
        D, V = config.hidden_size, config.vocab_size
        layer_shape = (*self.inputs_shape, D)
        self.embed_tokens = Embed(V, D, partitioner=p, dtype=config.dtype,
                                  param_dtype=config.param_dtype, rngs=rngs)
        kw = dict(inputs_shape=layer_shape, partitioner=p, rngs=rngs)
        scan = bool(getattr(config, "scan_layers", False))
        self.layers = nnx.List([
            build_stack(layer_cls, config, first=first + j, count=count // period,
                        stride=period, **kw) if scan else
            layer_cls(config, layer_idx=first, **kw)
            for first, count, period in layer_cycles(layer_cls, config, scan)
            for j in range(period)])
        self.norm = self.final_norm_cls(D, eps=config.rms_norm_eps, partitioner=p,
                                        param_dtype=config.param_dtype, rngs=rngs)
        # tied: no lm_head, the logits come from the embedding table (`Embed.attend`)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            D, V, in_axes=("embed",), out_axes=("vocab",), partitioner=p, dtype=config.dtype,
            param_dtype=config.param_dtype, rngs=rngs)

    @property
    def num_moe_layers(self) -> int:
        return sum(layer.stack_size or 1 for layer in self.layers if layer.is_moe)

    def layer_indices(self, layer: DecoderLayer) -> range:
        """The model-layer indices an entry of ``self.layers`` holds."""
        return range(layer.layer_idx, layer.layer_idx + layer.stack_stride *
                     (layer.stack_size or 1), layer.stack_stride)

    def moe_rows(self) -> list[list[int]]:
        """For each MoE entry of ``self.layers`` (`moe_modules` order), its rows of
        ``aux["expert_counts"]``, whose rows follow the MoE layers' order."""
        order = sorted(i for layer in self.layers if layer.is_moe
                       for i in self.layer_indices(layer))
        rank = {i: r for r, i in enumerate(order)}
        return [[rank[i] for i in self.layer_indices(layer)]
                for layer in self.layers if layer.is_moe]

    def layer(self, i: int) -> DecoderLayer:
        """Model layer `i` as a `DecoderLayer` of its own: unrolled, the module itself; scanned,
        a new module holding slice `i` of its stack (for inspection and per-layer tests)."""
        for layer in self.layers:
            where = self.layer_indices(layer)
            if i not in where:
                continue
            if layer.stack_size is None:
                return layer
            graphdef, state = nnx.split(layer)
            state = jax.tree.map(lambda v, row=where.index(i): v[row], state)
            one = nnx.merge(graphdef, spmd.remove_axis(state, 0, STACK_METADATA))
            one.layer_idx, one.stack_size, one.stack_stride = i, None, 1
            return one
        raise IndexError(f"layer {i} out of range: the model has "
                         f"{self.config.num_hidden_layers} layers")

    def run_layer(self, layer: DecoderLayer, x: jax.Array, positions: jax.Array,
                  segment_ids: jax.Array | None):
        """One entry of ``self.layers`` under the config's `remat_policy`: see `run_layers`."""
        return run_layers(layer, x, positions=positions, segment_ids=segment_ids,
                          remat=self.config.remat_policy)

    def run_group(self, group: Sequence[DecoderLayer], x: jax.Array, positions: jax.Array,
                  segment_ids: jax.Array | None):
        """One entry of `layer_groups`: a stack alone (`run_layer`), or a cycle's stacks
        (`run_cycle`, their aux rows interleaved into layer order)."""
        if len(group) == 1:
            return self.run_layer(group[0], x, positions, segment_ids)
        x, auxes = run_cycle(group, x, positions=positions, segment_ids=segment_ids,
                             remat=self.config.remat_policy)
        return x, interleave_aux(auxes)

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """tokens [B, L] int -> (logits [B, L, V], aux); positions/segment_ids [B, L]."""
        name = type(self).__name__
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"{name}: tokens must be an int array [batch, length], got "
                             f"{tokens.dtype}{tuple(tokens.shape)}")
        B, L = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        for what, a in (("positions", positions), ("segment_ids", segment_ids)):
            if a is not None and tuple(a.shape) != (B, L):
                raise ValueError(f"{name}: {what} has shape {tuple(a.shape)}; expected the "
                                 f"tokens' shape {(B, L)}")
        with jax.named_scope(name.lower()):
            x, auxes = self.trunk(tokens, positions, segment_ids)
            logits = self.head(x)
        return logits, self.collect_aux(auxes)

    def stream_in(self, tokens: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        """tokens [B, L] -> (the residual stream the layers run on, the keyword inputs each
        layer's ``block`` takes beside it): here the embedding ``[B, L, D]`` and none. A
        family whose layers run on more (hyper-connections' ``[B, L, n, D]`` streams, token
        ids for hash routing) overrides this and `stream_out`; `zoo.inference` uses both."""
        return self.embed_tokens(tokens), {}

    def stream_out(self, x: jax.Array) -> jax.Array:
        """The residual stream after the last layer -> hidden ``[B, L, D]`` for the final norm
        and head (`stream_in`): here the stream itself."""
        return x

    def trunk(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None
              ) -> tuple[jax.Array, list[dict[str, jax.Array]]]:
        """Embedding and every layer: ``(hidden [B, L, D] before the final norm, per-group aux
        dicts, rows in layer order)`` (what `__call__` and multi-token prediction build on)."""
        x = self.embed_tokens(tokens)
        auxes = []
        for group in layer_groups(self.layers):
            x, aux = self.run_group(group, x, positions, segment_ids)
            if aux is not None:
                auxes.append(aux)
        return x, auxes

    def head(self, x: jax.Array, norm: nnx.Module | None = None) -> jax.Array:
        """Logits ``[B, L, V]`` of hidden states: the final norm (or `norm`), then ``lm_head``
        (the embedding table when tied)."""
        with jax.named_scope("head"):
            x = (norm or self.norm)(x)
            logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
            return self.partitioner.constrain(logits, ("batch", "length", "act_vocab"))

    def collect_aux(self, auxes: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
        """Per-run aux dicts (entries ``[n, ...]``) -> ``load_balance_loss`` summed over the MoE
        layers, every other entry concatenated to ``[num_moe_layers, ...]``."""
        if not auxes:
            return {"load_balance_loss": jnp.zeros((), jnp.float32),
                    "expert_counts": jnp.zeros((0, self.config.num_experts), jnp.int32)}
        out = {"load_balance_loss": sum(jnp.sum(a["load_balance_loss"]) for a in auxes)}
        for key in auxes[0]:
            if key != "load_balance_loss":
                out[key] = jnp.concatenate([a[key] for a in auxes])
        return out

    # -- Hugging Face interop ------------------------------------------------------------------
    def hf_keys(self, prefix: str = "") -> list[hf.Tensor]:
        """Rows mapping every variable to its Hugging Face key(s), each module contributing its
        own (`zoo.layers.hf_keys`): embedding, final norm, ``lm_head`` (none when tied) and
        every layer's `DecoderLayer.hf_keys` -- prefixed with ``("layers", i)`` when unrolled,
        stacked per run (`hf.LayerStack`, one row per layer) when scanned."""
        rows = hfk.children(self, prefix, ("embed_tokens", "norm", "lm_head"))
        layers = hfk.join(prefix, hfk.hf_name(self, "layers"))
        for s, layer in enumerate(self.layers):
            per_layer = [hfk.keys_of(layer, f"{layers}.{i}") for i in self.layer_indices(layer)]
            if layer.stack_size is None:
                rows += [dataclasses.replace(r, path=("layers", s, *r.path))
                         for r in per_layer[0]]
            else:
                rows += [hf.LayerStack(("layers", s, *group[0].path), tuple(group))
                         for group in zip(*per_layer)]
        return rows

    def hf_key_map(self) -> list[hf.Tensor]:
        """`hf_keys` of the whole checkpoint (no prefix)."""
        return self.hf_keys("")

    def hf_load_map(self, keys: Sequence[str]) -> list[hf.Tensor]:
        """The rows `from_hf` loads from a checkpoint holding `keys`: `hf_key_map` (a model
        with optional parts a checkpoint may lack, e.g. DeepSeek-V3's MTP modules, makes the
        missing ones zoo-only)."""
        del keys
        return self.hf_key_map()

    # -- the inference view (zoo.inference) ----------------------------------------------------
    def inference_config(self, *, unsharded: bool = False):
        """The config `for_inference` rebuilds with: MoE dropless whatever the training
        settings (no capacity factor, no buffer factor, ``moe_overflow="auto"``, which is
        lossless without a buffer factor), the attention's token layout unknown (prompts are
        not in the training data's order); with `unsharded` also the schemes a model without a
        mesh takes (``moe_dispatch="auto"``, ``attention_implementation="reference"``), the
        experts' grouped matmul kept as settled for the mesh's platform (a TPU slice's kernel
        when compiling for one on a CPU host)."""
        changes: dict[str, Any] = dict(capacity_factor=None, moe_buffer_factor=None,
                                       moe_overflow="auto", attention_layout=None)
        if unsharded:
            changes.update(moe_dispatch="auto", attention_implementation="reference",
                           moe_grouped_matmul="fp8_blockwise" if self.config.fp8 == "blockwise"
                           else choose_grouped_matmul(self.config.moe_grouped_matmul,
                                                      self.partitioner.platform))
        return dataclasses.replace(self.config, **changes)

    def speculative_support(self) -> str | None:
        """None when `zoo.inference`'s speculative decoding (``speculative="mtp"``) can draft
        with this model, else why not (a clause the caller completes with its own fix). A
        family with multi-token-prediction modules overrides this, with `draft_input` and
        `draft_hidden` (the seams the verify step calls)."""
        return (f"drafts come from multi-token-prediction modules and this "
                f"{type(self).__name__} has none (DeepSeek-V3, DeepSeek-V3.2, GLM-5 and "
                f"DeepSeek-V4 have them, with num_nextn_predict_layers >= 1); build one of "
                f"those with num_nextn_predict_layers=1")

    def for_inference(self, *, unsharded: bool = False) -> CausalLM:
        """A copy of this model configured for generation (`zoo.inference`), sharing its
        parameters: rebuilt under `inference_config` (dropless MoE), with the same class,
        decoder layer class, partitioner and inputs shape. With `unsharded`, every module's
        partitioner is the unsharded one: the layers run their unsharded code on the
        (sharded) parameters and XLA partitions the program from the arguments' shardings
        (decode). The structure is built once per configuration (`nnx.eval_shape`); each call
        merges this model's current state into it."""
        key = (type(self), type(self.layers[0]) if len(self.layers) else None,
               repr(self.config), self.partitioner, self.inputs_shape, bool(unsharded))
        graphdef = _INFERENCE_VIEWS.get(key)
        if graphdef is None:
            config = self.inference_config(unsharded=unsharded)
            kw = {} if key[1] is None else dict(decoder_layer_cls=key[1])
            view = nnx.eval_shape(lambda: type(self)(
                config, inputs_shape=self.inputs_shape,
                partitioner=None if unsharded else self.partitioner, rngs=abstract_rngs(),
                **kw))
            graphdef = nnx.graphdef(view)
            if len(_INFERENCE_VIEWS) >= 16:
                _INFERENCE_VIEWS.clear()
            _INFERENCE_VIEWS[key] = graphdef
        return nnx.merge(graphdef, nnx.state(self))

    @classmethod
    def abstract(cls, config, *, inputs_shape: Sequence[int] | None = None,
                 partitioner: Partitioner | None = None,
                 decoder_layer_cls: type[DecoderLayer] | None = None):
        """The model built by `nnx.eval_shape`: shapes, dtypes and shardings, no memory."""
        return nnx.eval_shape(lambda: cls(config, inputs_shape=inputs_shape,
                                          partitioner=partitioner, rngs=abstract_rngs(),
                                          decoder_layer_cls=decoder_layer_cls))

    @classmethod
    def from_hf(cls, path, *, partitioner: Partitioner | None = None,
                inputs_shape: Sequence[int] | None = None, dtype=jnp.float32,
                param_dtype=None, config_overrides: dict[str, Any] | None = None,
                decoder_layer_cls: type[DecoderLayer] | None = None):
        """Load a local Hugging Face checkpoint folder into a (sharded) model of this class.

        The model is created abstractly and each tensor is read and placed straight into its
        shards (see `zoo.models.hf.load_into`); a scanned model (``scan_layers``, the default)
        receives each layer's tensors into its slice of the stacked parameters. ``dtype`` is
        the compute dtype, ``param_dtype`` the storage dtype (None: float32);
        ``config_overrides`` replaces config fields (e.g. ``{"scan_layers": False}``).
        """
        what = f"{cls.__name__}.from_hf"
        raw = hf.read_config(path, cls.hf_model_types, loader=what)
        config = cls.config_cls.from_hf_config(raw)
        param_dtype = jnp.float32 if param_dtype is None else param_dtype
        config = dataclasses.replace(config, **{"dtype": dtype, "param_dtype": param_dtype,
                                                **(config_overrides or {})})
        def make(rngs):
            return cls(config, inputs_shape=inputs_shape, partitioner=partitioner, rngs=rngs,
                       decoder_layer_cls=decoder_layer_cls)

        model = nnx.eval_shape(lambda: make(abstract_rngs()))
        quant = raw.get("quantization_config") or {}
        reader = hf.CheckpointReader(path, block_size=quant.get("weight_block_size", (128, 128)))
        table = model.hf_load_map(list(reader.keys()))
        zoo_only = [row.path for row in table if row.zoo_only]
        initial = initial_values(lambda: make(abstract_rngs()), zoo_only) if zoo_only else {}
        return hf.load_into(model, table, reader, what=what, initial=initial)

    def to_hf(self, path, *, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> None:
        """Write ``config.json`` + safetensors that transformers' ``from_pretrained`` loads.

        The folder is replaced whole (an earlier export's shards never linger); a folder
        holding other files is refused unless ``overwrite=True`` (`zoo.models.hf.save_checkpoint`).
        """
        hf.save_checkpoint(path, hf.export_tensors(self, self.hf_key_map()),
                           self.config.to_hf_config(), max_shard_bytes=max_shard_bytes,
                           overwrite=overwrite)


def family_io(model_cls: type[CausalLM], name: str, layout: str):
    """A family's module-level ``from_hf(path, *, partitioner=None, inputs_shape=None, ...)``
    and ``to_hf(model, path)`` over `CausalLM.from_hf` / `CausalLM.to_hf`; ``name`` and
    ``layout`` (what the folder may hold) go into their docstrings."""

    def from_hf(path, *, partitioner: Partitioner | None = None,
                inputs_shape: Sequence[int] | None = None, dtype=jnp.float32, param_dtype=None,
                config_overrides: dict[str, Any] | None = None,
                model_cls: type[CausalLM] = model_cls,
                decoder_layer_cls: type[DecoderLayer] | None = None):
        return model_cls.from_hf(path, partitioner=partitioner, inputs_shape=inputs_shape,
                                 dtype=dtype, param_dtype=param_dtype,
                                 config_overrides=config_overrides,
                                 decoder_layer_cls=decoder_layer_cls)

    def to_hf(model: CausalLM, path, *, max_shard_bytes: int = 5 * 2**30,
              overwrite: bool = False) -> None:
        model.to_hf(path, max_shard_bytes=max_shard_bytes, overwrite=overwrite)

    from_hf.__doc__ = f"""Load a local {name} checkpoint folder (config.json + *.safetensors).

    Args:
      path: the folder ({layout}).
      partitioner: shards the parameters as they are read (None: one device).
      inputs_shape: ``(batch, length)``, or None for any shape the partitioner divides.
      dtype: computation dtype; param_dtype: storage dtype (None: float32).
      config_overrides: config fields to replace, e.g. ``{{"remat_policy": "full"}}`` or
        ``{{"scan_layers": False}}`` (the unrolled layout).
      model_cls, decoder_layer_cls: load into a subclass (a module that adds a parameter
        names its key in its ``hf_keys`` or declares it ``hf_zoo_only``).
    """
    to_hf.__doc__ = (f"Write a {name} model as a Hugging Face checkpoint folder (safetensors + "
                     f"config.json), replacing an earlier export there whole; a folder holding "
                     f"other files is refused unless overwrite=True.")
    module = model_cls.__module__
    for fn in (from_hf, to_hf):
        fn.__module__, fn.__qualname__ = module, fn.__name__
    return from_hf, to_hf


def initial_values(make, paths: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], jax.Array]:
    """The constructor's values of the variables at `paths` (zoo-only parameters that a
    checkpoint does not hold): one jitted build returning only them, so XLA drops the rest
    of the initialisation."""
    def build():
        flat = dict(nnx.to_flat_state(nnx.state(make())))
        return [flat[p].get_value() for p in paths]
    return dict(zip(paths, jax.jit(build)()))
