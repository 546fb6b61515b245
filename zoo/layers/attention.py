"""`Attention`: grouped-query self-attention with rotary positions, context-parallel from birth.

* ``q_proj`` D -> (N, H), ``k_proj``/``v_proj`` D -> (K, H), ``o_proj`` (N, H) -> D, kernels
  laid out so a Hugging Face ``[out, in]`` weight becomes ours by ``W.T.reshape(...)``.
* RoPE on q and k (half-split layout by default, as Llama/Mixtral checkpoints), then
  `zoo.ops.attention` (masks from positions and segment ids; ``"ring"``/``"all_gather"``
  context parallelism over the partitioner's attention sequence axes), then the output projection.
* Everything that can be checked before tracing is checked at construction from
  ``inputs_shape=(batch, length, embed)``, and the kernel (``implementation="auto"``) is chosen
  there once.
* Written to be subclassed: `project`, `apply_rope`, `attend` and `out` are the steps
  `__call__` composes; override one (e.g. ``class MyAttention(Attention): def attend(...)``).
  The mask is a value (`zoo.ops.masks`): ``mask=`` in the constructor, or one line in a
  subclass, ``class Local(Attention): mask = Chunked(512) & Causal() & Document()``.
* ``qk_norm=True`` (Qwen3): an `RMSNorm` over ``head_dim`` on every q and k head after the
  projection, before RoPE (parameters ``q_norm``/``k_norm``, [H] each, replicated: a head's
  normalisation never crosses a shard).
* Score modifiers: ``logits_soft_cap`` (Gemma-2) and ``sinks=True`` (gpt-oss: a learned
  [num_heads] logit in every row's softmax, parameter ``sinks``; off by default, so checkpoints
  without sinks load unchanged).
* The cached call (`zoo.inference`): each layer kind owns its KV cache. `AttentionBlock`
  gives ``cache_slots`` and ``prefill_cache`` (``__call__`` that also returns the cache
  arrays) and ``decode_step`` (new tokens over the cache through a ``put`` callback); a kind
  declares ``cache_axes`` and defines ``cache_shape``, ``cache_entry`` and ``attend_cache``
  (here: ``k``/``v`` [B, K, S, H] per kv head). `reshard` moves a small activation to the
  cache's sharding.

Legend: B batch, L length, S kv length (= L here), D embed, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.layers.linear import Linear
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import RoPE
from zoo.ops.attention import IMPLEMENTATIONS, choose_implementation, dot_product_attention
from zoo.ops.ring import LAYOUTS
from zoo.ops.attention import attention as attention_op
from zoo.ops.kernels import get_kernel
from zoo.ops.masks import Mask, default_mask
from zoo.partitioning import Partitioner, resolve

SCOPE = "attention"


# -- construction-time checks shared with MLA ------------------------------------------------

def check_inputs_shape(inputs_shape: Sequence[int], p: Partitioner, *, num_heads: int,
                       num_kv_heads: int, what: str = "Attention") -> tuple[int, int, int]:
    """Validate ``(batch, length, embed)`` against the partitioner; return it as ints.

    The rules are the Partitioner's (`Partitioner.check_tokens`, `check_split`,
    `check_heads`): the batch splits over the attention batch shards, the sequence into
    ``2*cp`` load-balanced chunks, ``embed`` over the parameters' embed shards, and the heads
    follow the grouped-query / tensor-axis rules. Each raises a `ValueError` naming the fix.
    """
    batch, length, embed = p.check_inputs_shape(inputs_shape, what=what)
    p.check_heads(num_heads, num_kv_heads, SCOPE, what=what)
    p.check_tokens(batch, length, SCOPE, what=what, balanced=True)
    p.check_split("embed", embed, "embed", SCOPE, what=what,
                  role="the parameters' embed axis")
    return batch, length, embed


def resolve_implementation(implementation: str, p: Partitioner, *, length: int, num_heads: int,
                           num_kv_heads: int, head_dim: int, v_head_dim: int,
                           what: str = "Attention") -> str:
    """Check ``implementation`` and resolve ``"auto"`` once, at construction."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{what}: implementation={implementation!r}; valid values are "
                         f"{', '.join(repr(i) for i in IMPLEMENTATIONS)}")
    if implementation == "auto":
        return choose_implementation(partitioner=p, q_length=length, kv_length=length,
                                     num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, v_head_dim=v_head_dim)
    return implementation


def resolve_scores(module, what: str, *, mask, sliding_window, logits_soft_cap, sinks, kernel,
                   num_heads: int, p: Partitioner, param_dtype, rngs: nnx.Rngs,
                   layout: str | None = None) -> None:
    """Check and store the mask, soft cap, sinks parameter, kernel and token layout of an
    attention layer.

    A ``mask`` given here replaces the class attribute ``mask`` (None: causal, with
    ``sliding_window``, within documents); ``mask`` and ``sliding_window`` do not combine.
    ``layout`` (`zoo.ops.attention`'s: ``"contiguous"``, ``"balanced"`` or None) lets the ring
    move only the hops a bounded mask can see.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"{what}: layout={layout!r}; valid values are {LAYOUTS} (how the "
                         f"sequence lies on the context shards; None: unknown)")
    module.layout = layout
    if mask is not None:
        if not isinstance(mask, Mask):
            raise ValueError(f"{what}: mask={mask!r} must be a zoo.ops.masks.Mask, e.g. "
                             f"Causal() & Document()")
        module.mask = mask
    if module.mask is not None and sliding_window is not None:
        raise ValueError(f"{what}: mask={module.mask!r} is the whole mask; fold "
                         f"sliding_window={sliding_window} into it (& SlidingWindow(w))")
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float))
                                            and logits_soft_cap > 0):
        raise ValueError(f"{what}: logits_soft_cap={logits_soft_cap!r} must be a positive "
                         f"number or None")
    module.logits_soft_cap = logits_soft_cap
    try:
        get_kernel(kernel)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    module.kernel = kernel
    module.sinks = (nnx.Param(p.param(nnx.initializers.zeros, ("heads",), SCOPE)(
        rngs.params(), (num_heads,), param_dtype)) if sinks else None)


def score_kwargs(module) -> dict:
    """The mask / modifier / kernel keyword arguments of `zoo.ops.attention` for a layer."""
    kw = dict(logits_soft_cap=module.logits_soft_cap, kernel=module.kernel,
              sinks=None if module.sinks is None else module.sinks[...],
              layout=getattr(module, "layout", None))
    if module.mask is None:
        kw["sliding_window"] = getattr(module, "sliding_window", None)
    else:
        kw["mask"] = module.mask
    return kw


def cached_score_kwargs(module) -> dict:
    """`score_kwargs` for `zoo.ops.dot_product_attention` over a cache (no kernel, no token
    layout: the cached products are the reference ones)."""
    kw = score_kwargs(module)
    kw.pop("kernel"), kw.pop("layout")
    return kw


def check_call(module, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None):
    """Static checks of ``__call__``'s arguments (shapes are known while tracing)."""
    what = type(module).__name__
    if x.ndim != 3 or x.shape[-1] != module.embed_dim:
        raise ValueError(f"{what}: x has shape {x.shape}; expected [B, L, D={module.embed_dim}]")
    for name, a in (("positions", positions), ("segment_ids", segment_ids)):
        if a is not None and tuple(a.shape) != x.shape[:2]:
            raise ValueError(f"{what}: {name} has shape {tuple(a.shape)}; expected [B, L] = "
                             f"{x.shape[:2]}")
    if x.shape != module.inputs_shape:  # other shapes are allowed if they shard as well
        check_inputs_shape(x.shape, module.partitioner, num_heads=module.num_heads,
                           num_kv_heads=module.num_kv_heads, what=what)


def qk_norms(qk_norm, eps, head_dim: int, p: Partitioner, param_dtype, rngs: nnx.Rngs):
    """``(q_norm, k_norm)``: two `RMSNorm` over ``head_dim`` when `qk_norm`, else None twice."""
    if not isinstance(qk_norm, bool):
        raise ValueError(f"Attention: qk_norm={qk_norm!r} must be True (Qwen3's per-head RMSNorm "
                         f"on q and k) or False")
    if not qk_norm:
        return None, None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"Attention: qk_norm_eps={eps!r} must be a positive number (Qwen3 uses "
                         f"its rms_norm_eps, 1e-6)")
    return tuple(RMSNorm(head_dim, eps=float(eps), partitioner=p, param_dtype=param_dtype,
                         rngs=rngs) for _ in range(2))


# -- the cached call's layouts (zoo.inference) -----------------------------------------------

# what a cached call's ``put`` takes: (cache array name, the new slots [B, K, T, F]) -> the
# layer's whole cache array [B, K, S, F] with them written
CachePut = Callable[[str, jax.Array], jax.Array]


class LayerCache(Protocol):
    """What a cached call (``decode_step``) gets from the decode loop: a `CachePut` for arrays
    with per-token slots, plus whole-array access for a layer's state (arrays whose
    ``cache_axes`` name no ``"length"``: a recurrent state, a convolution window)."""

    def __call__(self, name: str, new: jax.Array) -> jax.Array:
        """Write the new slots [B, K, T, F] of array `name`; return its [B, K, S, F]."""

    def read(self, name: str) -> jax.Array:
        """This layer's array `name` as the cache holds it now (leading layer axis dropped)."""

    def replace(self, name: str, value: jax.Array) -> None:
        """Store `value` as this layer's array `name` (same shape). A layer given T > 1 tokens
        a step (speculative decoding's verify step) with a state cache says so with the
        attribute ``replaces_state_per_token = True`` and replaces its state after each token
        in turn: the loop keeps the state after the first, for rows whose draft is
        rejected (`zoo.inference.engine.cached_layers`). A state layer without it is refused
        T > 1."""


def splittable_axes(p: Partitioner, axes: Sequence[str | None],
                    shape: Sequence[int]) -> tuple[str | None, ...]:
    """`axes` with None for each dimension of `shape` that its mesh axes (attention scope) do
    not divide: that dimension is kept whole."""
    return tuple(None if logical is None or size % p.size(logical, SCOPE) else logical
                 for logical, size in zip(axes, shape, strict=True))


def reshard(p: Partitioner, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``x`` constrained to `axes` (`splittable_axes`) through a replicated layout: between a
    weight-derived sharding (over the embed or kv_lora axis) and a cache's batch sharding that
    is one all-gather of a small activation then a local slice; asked in one step, XLA's SPMD
    partitioner finds no collective for it and replicates the tensor itself, warning
    "Involuntary full rematerialization". A no-op without a mesh."""
    return p.constrain(p.constrain(x, (None,) * x.ndim), splittable_axes(p, axes, x.shape))


# -- the layer -------------------------------------------------------------------------------


class AttentionBlock(nnx.Module):
    """What `Attention` and `MLA` share: the step composition in `__call__` and `out`.

    Subclasses provide ``project``, ``apply_rope``, ``attend``, an ``o_proj`` and
    ``partitioner``; ``block_name`` names the `jax.named_scope` of the block. ``mask``: None
    (causal within documents) or a `zoo.ops.masks.Mask` -- a subclass sets it in one line.
    """

    block_name = "attention"
    mask: Mask | None = None
    hf_projections: tuple[str, ...] = ()  # the projection submodules, in checkpoint order

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """The projections under their own names (``q_proj`` ...) and ``prefix.sinks``; a
        subclass that adds a parameter extends this or lists it in ``hf_zoo_only``."""
        rows = hfk.children(self, prefix, self.hf_projections)
        if self.sinks is not None:
            rows.append(hfk.copy(("sinks",), f"{prefix}.sinks"))
        return rows

    def run_op(self, op, *operands, positions: jax.Array, segment_ids: jax.Array | None,
               **kw) -> jax.Array:
        """Self-attention through `op` (`zoo.ops.attention` or `zoo.ops.mla_attention`) with
        this layer's mask, score modifiers, strategy and kernel -> [B, L, N, Hv], sharded."""
        o = op(*operands, q_positions=positions, kv_positions=positions,
               q_segment_ids=segment_ids, kv_segment_ids=segment_ids, scale=self.scale,
               partitioner=self.partitioner, implementation=self.implementation,
               **score_kwargs(self), **kw)
        return self.partitioner.constrain(o, ("batch", "length", "act_heads", "act_head_dim"),
                                          SCOPE)

    def out(self, o: jax.Array) -> jax.Array:
        """o [B, L, N, Hv] -> [B, L, D]."""
        return self.partitioner.constrain(self.o_proj(o), ("batch", "length", "act_embed"),
                                          SCOPE)


    # -- the cached call (zoo.inference): each layer kind owns its cache ----------------------
    # logical axes of each cache array [B, K, S, F] (K: the heads the cache keeps, S: slots)
    cache_axes: ClassVar[dict[str, tuple[str | None, ...]]] = {}

    def cache_slots(self, max_length: int) -> int:
        """Slots this layer's cache keeps for a sequence of `max_length`: all of them, or for
        a mask whose reach back is bounded (``sliding_window=W``: a query sees keys less than
        W positions back, itself included, so W keys; ``Chunked(c)``: c) that many, as a ring
        written at ``slot % slots``. Cache rows hold one sequence at consecutive positions, so
        a bound in positions is one in slots."""
        mask = self.mask if self.mask is not None else default_mask(
            None, getattr(self, "sliding_window", None), None)
        back = mask.reach().back
        return max_length if back is None else min(back + 1, max_length)

    def cache_shape(self, batch: int, max_length: int) -> dict[str, tuple[int, ...]]:
        """The shape ``[B, K, S, F]`` of each array of this layer's cache (names as
        `cache_axes`) for `batch` rows of `max_length` tokens (S: `cache_slots`)."""
        raise NotImplementedError(f"{type(self).__name__} must define cache_shape")

    def cache_entry(self, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
        """`project` + `apply_rope`'s k and v over L tokens -> the cache arrays [B, K, L, F]
        they leave (heads before slots, as the cached products read them)."""
        raise NotImplementedError(f"{type(self).__name__} must define cache_entry")

    def prefill_cache(self, x: jax.Array, *, positions: jax.Array,
                      segment_ids: jax.Array | None = None
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`__call__` that also returns the layer's cache arrays over the L tokens:
        x [B, L, D] -> (out [B, L, D], `cache_entry` {name: [B, K, L, F]})."""
        check_call(self, x, positions, segment_ids)
        with jax.named_scope(self.block_name):
            x = self.partitioner.constrain(x, ("batch", "length", "act_embed"), SCOPE)
            q, k, v = self.project(x)
            q, k = self.apply_rope(q, k, positions)
            o = self.attend(q, k, v, positions=positions, segment_ids=segment_ids)
            return self.out(o), self.cache_entry(k, v)

    def decode_step(self, x: jax.Array, put: CachePut, *, q_positions: jax.Array,
                    kv_positions: jax.Array, kv_segment_ids: jax.Array,
                    partitioner: Partitioner | None = None) -> jax.Array:
        """T new tokens per row over the cache: x [B, T, D] at ``q_positions [B, T]`` ->
        [B, T, D]. ``put(name, new [B, K, T, F])`` writes this step's cache arrays and
        returns the layer's whole array [B, K, S, F] with them; ``kv_positions`` and
        ``kv_segment_ids`` [B, S] describe its slots (segment 0: empty). `partitioner`: how
        the cache is sharded (the layer itself may run its unsharded code on sharded
        parameters); new arrays meet the cache through `reshard`."""
        p = resolve(partitioner)
        with jax.named_scope(self.block_name):
            q, k, v = self.project(x)
            q, k = self.apply_rope(q, k, q_positions)
            kw = self.cached_kwargs(q_positions, kv_positions, kv_segment_ids)
            o = self.attend_cache(q, k, v, put, p, **kw)
            return self.out(o.astype(q.dtype))

    def cached_kwargs(self, q_positions: jax.Array, kv_positions: jax.Array,
                      kv_segment_ids: jax.Array) -> dict:
        """`attend_cache`'s keyword arguments for `decode_step`'s queries over the cache."""
        return dict(q_positions=q_positions, kv_positions=kv_positions,
                    q_segment_ids=jnp.ones(q_positions.shape, jnp.int32),
                    kv_segment_ids=kv_segment_ids, scale=self.scale, kv_heads_major=True,
                    **cached_score_kwargs(self))

    def attend_cache(self, q: jax.Array, k: jax.Array, v: jax.Array, put: CachePut,
                     p: Partitioner, **kw) -> jax.Array:
        """`decode_step`'s attention of q [B, T, N, H] over the cache after writing this
        step's k/v through ``put``; ``kw``: `zoo.ops.dot_product_attention`'s positions,
        segment ids, scale and score arguments (``kv_heads_major``)."""
        raise NotImplementedError(f"{type(self).__name__} must define attend_cache")

    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """x [B, L, D], positions [B, L] (int), segment_ids [B, L] (0 = padding) -> [B, L, D]."""
        check_call(self, x, positions, segment_ids)
        with jax.named_scope(self.block_name):
            x = self.partitioner.constrain(x, ("batch", "length", "act_embed"), SCOPE)
            with jax.named_scope("project"):
                q, k, v = self.project(x)
            with jax.named_scope("rope"):
                q, k = self.apply_rope(q, k, positions)
            with jax.named_scope("attend"):
                o = self.attend(q, k, v, positions=positions, segment_ids=segment_ids)
            with jax.named_scope("out"):
                return self.out(o)


class Attention(AttentionBlock):
    """Causal self-attention with grouped-query heads and rotary positions.

    Args:
      num_heads, num_kv_heads, head_dim: N, K (N a multiple of K: GQA; K=1: MQA; K=N: MHA), H.
      inputs_shape: ``(batch, length, embed)`` the layer will see; validated here.
      partitioner: how the mesh cuts parameters and activations (None: unsharded).
      rope: a `RoPE` (None: ``RoPE(theta=10000.0)``, half-split layout).
      sliding_window: a query sees keys less than this many positions back (None: all).
      implementation: ``"auto"`` (resolved here), ``"reference"``, ``"all_gather"`` or
        ``"ring"``; see `zoo.ops.attention`.
      mask: a `zoo.ops.masks.Mask` replacing the default (causal within documents, with
        ``sliding_window``); None keeps the class attribute ``mask``.
      logits_soft_cap: ``cap * tanh(logits / cap)`` before the softmax (None: off).
      sinks: learn one sink logit per head (parameter ``sinks``, zeros at init).
      kernel: the block kernel (``"auto"``, ``"flash"``, ``"pallas_tpu"``, ``"tokamax"``,
        registered, instance).
      use_bias: biases on the q/k/v projections (and o, unless ``out_bias`` says otherwise).
      out_bias: a bias on ``o_proj`` (None: ``use_bias``; GLM-4.5 has q/k/v biases only).
      qk_norm: RMSNorm (eps ``qk_norm_eps``) over head_dim on each q and k head before RoPE.
      dtype: computation dtype (None: the input's); param_dtype: storage dtype.
      fp8: "blockwise": the four projections in blockwise-scaled FP8 (`zoo.layers.Linear`); the
        scores and the softmax-weighted sum stay in the compute dtype.
    """

    hf_projections = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")  # norms: if set

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 inputs_shape: Sequence[int], partitioner: Partitioner | None,
                 rope: RoPE | None = None, sliding_window: int | None = None,
                 implementation: str = "auto", use_bias: bool = False, dtype=None,
                 param_dtype=jnp.float32, mask: Mask | None = None,
                 logits_soft_cap: float | None = None, sinks: bool = False,
                 kernel="auto", qk_norm: bool = False, qk_norm_eps: float = 1e-6,
                 layout: str | None = None, out_bias: bool | None = None,
                 fp8: str | None = None, rngs: nnx.Rngs):
        p = resolve(partitioner)
        _, length, embed = check_inputs_shape(inputs_shape, p, num_heads=num_heads,
                                              num_kv_heads=num_kv_heads, what="Attention")
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"Attention: head_dim={head_dim} must be even (RoPE rotates pairs "
                             f"of dimensions)")
        if rope is not None:
            rope.rotary_dim(head_dim)  # a partial rotary slice must be even too
        if sliding_window is not None and (
                not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"Attention: sliding_window={sliding_window!r} must be a positive "
                             f"int (a query sees keys less than that many positions back) or "
                             f"None")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.inputs_shape = tuple(inputs_shape)
        self.embed_dim = embed
        self.partitioner = p
        self.rope = RoPE(theta=10000.0) if rope is None else rope
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5
        self.implementation = resolve_implementation(
            implementation, p, length=length, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=head_dim, what="Attention")
        resolve_scores(self, "Attention", mask=mask, sliding_window=sliding_window,
                       logits_soft_cap=logits_soft_cap, sinks=sinks, kernel=kernel,
                       num_heads=num_heads, p=p, param_dtype=param_dtype, rngs=rngs,
                       layout=layout)
        # Fewer kv heads than tensor shards: kv heads stay whole (replicated), the op repeats them.
        split_kv = num_kv_heads % p.size("act_heads", SCOPE) == 0
        kv_axis = "kv_heads" if split_kv else None
        self.kv_act_axis = "act_kv_heads" if split_kv else None

        kw = dict(partitioner=p, scope=SCOPE, use_bias=use_bias, dtype=dtype,
                  param_dtype=param_dtype, fp8=fp8, rngs=rngs)
        self.q_proj = Linear(embed, (num_heads, head_dim), in_axes=("embed",),
                             out_axes=("heads", "head_dim"), **kw)
        self.k_proj = Linear(embed, (num_kv_heads, head_dim), in_axes=("embed",),
                             out_axes=(kv_axis, "head_dim"), **kw)
        self.v_proj = Linear(embed, (num_kv_heads, head_dim), in_axes=("embed",),
                             out_axes=(kv_axis, "head_dim"), **kw)
        kw["use_bias"] = use_bias if out_bias is None else out_bias
        self.o_proj = Linear((num_heads, head_dim), embed, in_axes=("heads", "head_dim"),
                             out_axes=("embed",), **kw)
        self.q_norm, self.k_norm = qk_norms(qk_norm, qk_norm_eps, head_dim, p, param_dtype, rngs)

    # -- steps a subclass may override --------------------------------------------------------
    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, L, D] -> q [B, L, N, H], k [B, L, K, H], v [B, L, K, H]."""
        c = self.partitioner.constrain
        q = c(self.q_proj(x), ("batch", "length", "act_heads", "act_head_dim"), SCOPE)
        kv_axes = ("batch", "length", self.kv_act_axis, "act_head_dim")
        k = c(self.k_proj(x), kv_axes, SCOPE)
        v = c(self.v_proj(x), kv_axes, SCOPE)
        if self.q_norm is not None:  # per head, over H: the heads' sharding is unchanged
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def apply_rope(self, q: jax.Array, k: jax.Array,
                   positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rotate q and k by their tokens' positions [B, L]."""
        return self.rope.apply(q, positions), self.rope.apply(k, positions)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array,
               segment_ids: jax.Array | None) -> jax.Array:
        """Attention of q over k/v under ``self.mask`` -> [B, L, N, H] (`zoo.ops.attention`)."""
        return self.run_op(attention_op, q, k, v, positions=positions, segment_ids=segment_ids)


    # -- the cached call (zoo.inference) ------------------------------------------------------
    cache_axes: ClassVar[dict[str, tuple[str | None, ...]]] = {
        "k": ("batch", "act_kv_heads", "length", "act_head_dim"),
        "v": ("batch", "act_kv_heads", "length", "act_head_dim")}

    def cache_shape(self, batch: int, max_length: int) -> dict[str, tuple[int, ...]]:
        """``k`` and ``v`` [B, K, S, H] per kv head (after RoPE and the q/k norms)."""
        kv = (batch, self.num_kv_heads, self.cache_slots(max_length), self.head_dim)
        return {"k": kv, "v": kv}

    def cache_entry(self, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
        return {"k": jnp.swapaxes(k, 1, 2), "v": jnp.swapaxes(v, 1, 2)}

    def attend_cache(self, q: jax.Array, k: jax.Array, v: jax.Array, put: CachePut,
                     p: Partitioner, **kw) -> jax.Array:
        """The new k/v [B, T, K, H] into the cache; q over all its slots."""
        axes = ("batch", "act_kv_heads", None, None)
        k, v = (reshard(p, jnp.swapaxes(a, 1, 2), axes) for a in (k, v))
        return dot_product_attention(q, put("k", k), put("v", v), **kw)
