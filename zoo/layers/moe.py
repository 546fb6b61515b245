"""`MoE`: the mixture-of-experts block of Mixtral and DeepSeek-V3, expert-parallel from birth.

* Router (float32): ``logits = x @ router``; Mixtral (``scoring="softmax"``) or DeepSeek-V3
  (``scoring="sigmoid"``: a `RouterBias` for selection only, group-limited top-k, weights
  normalised and scaled). Semantics of Hugging Face's routers; see `zoo.ops.moe.route`.
  DeepSeek-V4: ``scoring="sqrtsoftplus"`` (``sqrt(softplus(logits))``, with a `RouterBias`
  as sigmoid) and hash routing (``hash_vocab_size=V``): a fixed ``tid2eid [V, k]`` table
  (`ExpertTable`, loaded from the checkpoint, never trained) picks each token's experts from
  its token id, ``y, aux = moe(x, tokens=ids)``; the router still weights them.
* Routed experts: SwiGLU per expert, weights stacked ``wi_gate``/``wi_up`` ``[E, D, F]`` and
  ``wo`` ``[E, F, D]``; dropless (sort token copies by expert, grouped matmul) or, with
  ``capacity_factor`` (all_gather only), fixed capacity per expert that drops overflow.
* Shared experts (DeepSeek-V3): a dense SwiGLU `MLP` of width ``shared_mlp_dim or
  num_shared_experts * mlp_dim`` added to the routed output.
* gpt-oss's options (off by default, so other checkpoints load unchanged): ``router_bias``
  (a learned ``[E]`` bias on the router logits), ``expert_bias`` (learned per-expert biases
  on the gate/up projections, added before the activation, and on the down projection,
  added per routed copy and weighted with it), ``activation`` (a `zoo.ops.grouped.GLU`: the
  clamped SwiGLU) and ``gate_up="interleaved"`` (one ``wi_gate_up [E, D, 2F]`` whose even
  columns are the gate and odd ones the up projection, Hugging Face's fused
  ``experts.gate_up_proj``; a tensor shard keeps whole pairs).
* ``y, aux = moe(x)``; aux holds ``load_balance_loss`` (``E * sum_e f_e P_e``, see
  `zoo.ops.moe.load_balance_loss`), ``expert_counts`` (int32 [E], over the global batch),
  ``dropped_tokens`` (int32: token copies dropped, global; 0 when dropless) and
  ``dropped_fraction``. `update_expert_bias` applies DeepSeek-V3's aux-loss-free balancing
  ``bias += rate * sign(mean(counts) - counts)`` to a layer or a model.

Expert parallelism. Tokens arrive sharded like every other activation (default scope
``("batch", "length", "act_embed")``); the ``expert`` mesh axis shards them by batch (``fsdp``,
``cp``) or by sequence (``ep_as_cp``). Routing runs outside the `shard_map` (a small
``[B, L, E]`` op XLA partitions by itself, and the balance statistics come out global). Inside
one `shard_map` over the whole mesh each device all-gathers its local experts' weights over
the FSDP axes of ``embed`` (the transpose is a reduce-scatter: weight gradients come back
FSDP-sharded), then dispatches by the constructor's ``dispatch``:

* ``"all_to_all"`` (`zoo.ops.moe.all_to_all_experts`): each token copy goes only to the device
  holding its expert and comes back the same way -- ``T * k * (EP - 1) / EP`` rows each way
  when balanced. GPU/TPU: `jax.lax.ragged_all_to_all` (only real rows travel). XLA:CPU has
  none, so there a padded `jax.lax.all_to_all` runs the same algorithm; the choice is made
  when the program is lowered (`jax.lax.platform_dependent`), so a program lowered here for
  ``cuda`` is the accelerator one. Receive buffers: dropless by default (``EP * T *
  min(k, E_local)`` rows, what can arrive at worst); ``buffer_factor=f`` reserves ``f`` times
  the balanced share per peer, keeps first choices before second choices, and counts the rest
  in ``aux["dropped_tokens"]``. Temporaries follow local work: flat in EP at fixed tokens per
  device. ``overflow="exact"`` sends what overflows ``buffer_factor``'s buffers in further
  rounds instead (`zoo.ops.moe_rounds`); ``overflow="auto"`` (the default)
  drops with a ``buffer_factor`` and, dropless, runs rounds of
  `ROUNDS_BUFFER_FACTOR` times the balanced share when those buffers are under half the worst
  case's and the experts are plain SwiGLU without biases (the rounds' limits), else the one
  round of worst-case buffers. The trade: balanced routing needs one round over buffers ``EP *
  min(k, E_local) / (1.25 k)`` times smaller (3.2x at EP 4, k 2: the exchange, the receiver's
  sort and the gathers around the grouped matmul run over that many fewer rows), while skewed
  routing takes more rounds, each a full exchange (the most any device ran is
  ``aux["moe_rounds"]``). ``MoE.overflow`` and ``MoE.exchange_buffer_factor`` hold the resolved
  choice (recorded in ``run.json``).
* ``"all_gather"``: all-gather tokens over ``expert``, run the local experts on all of them
  (`zoo.ops.moe.dropless_experts`), reduce-scatter back: ``(EP - 1) * T`` rows each way and a
  sort over ``EP * T * k`` copies -- right when EP <= k on fast links.
* ``"auto"``: the one with fewer analytic bytes per device (`zoo.ops.moe_execution.dispatch_bytes`,
  i.e. all_to_all when EP > k); all_gather without expert parallelism or with a capacity.
  ``MoE.dispatch`` holds the resolved choice (recorded in ``run.json``).

Partial outputs are summed over ``tensor`` (``mlp`` is sharded there; SwiGLU is elementwise
in F). With a capacity, the capacity is per dispatch group: the tokens one device holds after
the all-gather (unsharded: the whole batch), as in GShard, so which copies drop depends on the
mesh.

Grouped matmul (``grouped_matmul=``, `zoo.ops.grouped.grouped_swiglu`): ``"auto"`` runs the
blocked grouped matmul on CPU (loops of block matmuls, FLOPs within ~1.25x of the useful ones),
XLA's own ragged-dot kernel on TPU (`jax.lax.ragged_dot`) and ``tokamax.ragged_dot`` on GPU,
chosen from the mesh; ``"blocked"``, ``"tokamax"`` and ``"ragged_dot"`` force one. Where a
kernel cannot run (tokamax in float32 on a GPU mesh: its Triton kernel fails the shard_map's
varying-axes check) XLA's ragged dot runs, and the execution says why.

FP8 (``fp8="blockwise"``): the experts' grouped matmul in blockwise-scaled FP8 and, under
``"all_to_all"``, the tokens on the wire as FP8 tiles with their scales (``fp8_dispatch``,
recorded in the execution; the combine stays in the compute dtype): docs/fp8.md. Inside
`zoo.layers.linear.prequantized_weights` (the train step) the expert weights are quantised
once per step (`MoE.fp8_weights`) and every grouped matmul takes those copies.

Execution. The arguments that choose how the layer runs (``dispatch``, ``capacity_factor``,
``buffer_factor``, ``overflow``, ``grouped_matmul``, with ``dtype`` and the mesh) build one
frozen value, ``MoE.execution`` (`zoo.ops.moe_execution.MoEExecution`): resolved and
validated once at construction, passed to the kernels as a static value (its target device
reaches their backward pass), recorded in ``run.json``. ``MoE.dispatch``, ``MoE.overflow``,
... read it; ``m.execution = m.execution.dropless()`` makes a layer drop nothing.

Legend: B batch, L length, D embed, E experts, F mlp, k experts per token.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.layers import hf_keys as hfk
from zoo.layers.linear import prequantized, record_fp8_stats
from zoo.layers.mlp import MLP
from zoo.ops import fp8 as fp8_ops
from zoo.ops import moe as ops
from zoo.ops.grouped import GLU, SWIGLU
from zoo.ops import moe_execution as execution
from zoo.ops.moe_rounds import all_to_all_rounds
from zoo.ops.rows import mark_varying, varying_axes
from zoo.partitioning import COMPUTE_DTYPE, Partitioner, resolve

ACT = ("batch", "length", "act_embed")
DISPATCHES, OVERFLOWS = execution.DISPATCHES, execution.OVERFLOWS
GATE_UPS = ("separate", "interleaved")
ROUNDS_BUFFER_FACTOR = execution.ROUNDS_BUFFER_FACTOR


class RouterBias(nnx.Variable):
    """DeepSeek-V3's ``e_score_correction_bias``: updated by `update_expert_bias`, not by
    gradients (not an `nnx.Param`, so ``nnx.Optimizer(..., wrt=nnx.Param)`` never sees it)."""


class ExpertTable(nnx.Variable):
    """DeepSeek-V4's hash routing table ``tid2eid [vocab, k]`` (int32): token id -> its k
    experts. Fixed (not an `nnx.Param`): its values come from the checkpoint."""


def hash_table_init(num_experts: int):
    """The initial ``tid2eid``: token ``t``'s experts ``(t * k + j) % E`` for ``j < k`` --
    distinct per token, every expert equally often over a vocabulary of a multiple of E / k
    (transformers starts from zeros, every token on expert 0; a checkpoint brings the real
    table)."""
    def init(key, shape, dtype=jnp.int32):
        del key
        vocab, k = shape
        table = (np.arange(vocab)[:, None] * k + np.arange(k)[None, :]) % num_experts
        return jnp.asarray(table, dtype)
    return init


def _entry_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


class MoE(nnx.Module):
    """Mixture of SwiGLU experts with top-k routing; see the module docstring.

    Args:
      num_experts: E; num_experts_per_tok: k; mlp_dim: F, each expert's width.
      inputs_shape: ``(batch, length, embed)`` the layer will see (validated against the mesh).
      partitioner: shards parameters and tokens (None: unsharded).
      scoring: ``"softmax"`` (Mixtral), ``"sigmoid"`` (DeepSeek-V3) or ``"sqrtsoftplus"``
        (DeepSeek-V4); the last two add a `RouterBias` (unless hashed).
      hash_vocab_size: DeepSeek-V4's hash routing: an `ExpertTable` ``tid2eid
        [hash_vocab_size, k]`` chooses the experts from the token ids passed as ``tokens=``
        (no `RouterBias`, no groups); None: the router chooses.
      shared_limit: the shared experts' SwiGLU clamp (`zoo.layers.MLP`'s ``limit``;
        DeepSeek-V4 clamps them as its routed experts, ``activation=GLU(limit=...)``).
      n_group, topk_group: group-limited selection (``n_group=1``: off).
      routed_scaling_factor, norm_topk_prob: see `zoo.ops.moe.route`.
      num_shared_experts, shared_mlp_dim: shared experts' MLP width is
        ``shared_mlp_dim or num_shared_experts * mlp_dim`` (none when that is 0).
      capacity_factor: None for dropless; else ``ceil(factor * tokens * k / E)`` slots per
        expert in each dispatch group (all_gather only).
      dispatch: ``"all_to_all"``, ``"all_gather"`` or ``"auto"`` (see the module docstring).
      grouped_matmul: ``"auto"`` (blocked on CPU, XLA's ragged dot on TPU, tokamax on GPU),
        ``"blocked"``, ``"tokamax"`` or ``"ragged_dot"`` (XLA's ragged dot where tokamax cannot
        run: `zoo.ops.moe_execution.MoEExecution`).
      buffer_factor: all_to_all receive rows per peer as a multiple of the balanced share
        (None: dropless); overflow is dropped and counted in ``aux["dropped_tokens"]``.
      overflow: what all_to_all does with copies beyond ``buffer_factor``'s buffers: ``"drop"``,
        ``"exact"`` (`zoo.ops.moe_rounds.all_to_all_rounds`: they travel in further rounds over
        the same buffers, nothing is dropped; ``aux["moe_rounds"]`` is the most rounds any
        device ran) or ``"auto"`` (the default; see the module docstring). It adds no
        parameters or variables.
      router_bias: a learned bias on the router logits (gpt-oss).
      expert_bias: learned per-expert biases on the gate/up and down projections (gpt-oss).
        With a capacity or buffers that drop copies, a dropped copy still adds its down bias.
      activation: the experts' gated activation (`zoo.ops.grouped.GLU`; default SwiGLU).
      gate_up: ``"separate"`` (``wi_gate``/``wi_up``) or ``"interleaved"`` (``wi_gate_up``,
        gate in the even columns: gpt-oss's fused layout).
      dtype: computation dtype of the experts, None for the input's (the router is always
        float32);
        param_dtype: storage dtype.
      fp8: "blockwise": the routed experts' grouped matmul (``grouped_matmul="fp8_blockwise"``,
        `zoo.ops.fp8.ragged_dot`) and the shared experts' products (`zoo.layers.Linear`) in
        blockwise-scaled FP8; the router stays float32 (docs/fp8.md).
      fp8_dispatch: whether the tokens cross the all_to_all wire as FP8 tiles with their
        scales (`zoo.ops.moe_execution.MoEExecution.fp8_dispatch`): None (the default) wherever the
        experts run in FP8 behind the all_to_all dispatch, False never, True insists (an
        error where the dispatch resolves to no all_to_all wire).

    Hugging Face names (``hf_names``, the DeepSeek/Qwen layout): router ``gate.weight``,
    ``gate.e_score_correction_bias``, experts ``experts.{e}.gate_proj|up_proj|down_proj``,
    ``shared_experts``; a family with other names overrides entries (Mixtral: ``w1/w3/w2``).
    """

    hf_names: ClassVar[dict[str, str]] = {"router": "gate", "wi_gate": "gate_proj",
                                          "wi_up": "up_proj", "wo": "down_proj"}

    def __init__(self, *, num_experts: int, num_experts_per_tok: int, mlp_dim: int,
                 inputs_shape: Sequence[int], partitioner: Partitioner | None,
                 scoring: str = "softmax", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                 num_shared_experts: int = 0, shared_mlp_dim: int | None = None,
                 capacity_factor: float | None = None, dispatch: str = "auto",
                 grouped_matmul: str = "auto", buffer_factor: float | None = None,
                 overflow: str = "auto", router_bias: bool = False, expert_bias: bool = False,
                 activation: GLU = SWIGLU, gate_up: str = "separate",
                 dtype=jnp.float32, param_dtype=jnp.float32, fp8: str | None = None,
                 hash_vocab_size: int | None = None, shared_limit: float | None = None,
                 fp8_dispatch: bool | None = None, rngs: nnx.Rngs):
        p = resolve(partitioner)
        batch, length, embed = p.check_inputs_shape(inputs_shape, what="MoE")
        if hash_vocab_size is not None and (isinstance(hash_vocab_size, bool) or not isinstance(
                hash_vocab_size, (int, np.integer)) or hash_vocab_size < 1):
            raise ValueError(f"MoE: hash_vocab_size={hash_vocab_size!r} must be a positive int "
                             f"(the vocabulary the tid2eid table covers) or None (no hashing)")
        if hash_vocab_size is not None and n_group > 1:
            raise ValueError(f"MoE: hash routing (hash_vocab_size={hash_vocab_size}) takes its "
                             f"experts from tid2eid, so n_group={n_group} has no meaning; "
                             f"leave n_group=1")
        E, k = num_experts, num_experts_per_tok
        if scoring not in ops.SCORINGS:
            raise ValueError(f"scoring={scoring!r} must be one of {ops.SCORINGS}")
        if E < 1 or not 1 <= k <= E:
            raise ValueError(f"num_experts_per_tok={k} must be between 1 and num_experts={E}; "
                             f"lower num_experts_per_tok or add experts")
        if n_group < 1 or E % n_group:
            raise ValueError(f"num_experts={E} is not divisible by n_group={n_group}; choose "
                             f"n_group among the divisors of {E}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be between 1 and n_group="
                             f"{n_group}; lower topk_group")
        if k > topk_group * (E // n_group):
            raise ValueError(f"num_experts_per_tok={k} exceeds the {topk_group * (E // n_group)}"
                             f" experts in the topk_group={topk_group} best groups of "
                             f"{E // n_group}; raise topk_group or lower num_experts_per_tok")
        if not isinstance(activation, GLU):
            raise ValueError(f"activation={activation!r} must be a zoo.ops.grouped.GLU (e.g. GLU() "
                             f"for SwiGLU, GLU(alpha=1.702, limit=7.0, up_offset=1.0) for gpt-oss)")
        if gate_up not in GATE_UPS:
            raise ValueError(f"gate_up={gate_up!r} must be one of {GATE_UPS} ('interleaved': one "
                             f"[E, D, 2F] weight, gate in the even columns, as gpt-oss)")
        plain = not expert_bias and activation == SWIGLU
        fp8_ops.check_target(fp8_ops.check_mode(fp8, what="MoE(fp8=)"), p.mesh)
        if fp8_ops.check_mode(fp8, what="MoE(fp8=)") == "blockwise":
            if grouped_matmul not in ("auto", "fp8_blockwise"):
                raise ValueError(f"MoE: fp8='blockwise' runs the experts' grouped matmul as "
                                 f"'fp8_blockwise', but grouped_matmul={grouped_matmul!r} "
                                 f"asks for another; leave it 'auto' or set fp8=None")
            grouped_matmul = "fp8_blockwise"
        execution.MoEExecution.check(dispatch=dispatch, capacity_factor=capacity_factor,
                               buffer_factor=buffer_factor, overflow=overflow,
                               grouped_matmul=grouped_matmul, plain=plain,
                               fp8_dispatch=fp8_dispatch)
        shared_dim = shared_mlp_dim or num_shared_experts * mlp_dim
        p.check_split("num_experts", E, "experts", "moe", what="MoE",
                      role="experts are sharded over them",
                      fix="change the expert-axis size or the number of experts")
        p.check_tokens(batch, length, what="MoE")
        p.check_split("embed", embed, "embed", "moe", what="MoE",
                      role="expert weights are FSDP-sharded over them")
        p.check_split("mlp_dim", mlp_dim, "mlp", "moe", what="MoE",
                      role="the expert width is sharded over them",
                      fix="change mlp_dim or the tensor-axis size")

        self.partitioner = p
        self.num_experts, self.num_experts_per_tok, self.mlp_dim = E, k, mlp_dim
        self.inputs_shape, self.embed_dim = (batch, length, embed), embed
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
        self.activation, self.gate_up = activation, gate_up
        # how it runs, settled for the mesh: the program traces that platform's path alone
        self.execution = self.resolve_execution(
            dispatch=dispatch, capacity_factor=capacity_factor, buffer_factor=buffer_factor,
            overflow=overflow, grouped_matmul=grouped_matmul, plain=plain, dtype=dtype,
            fp8_dispatch=fp8_dispatch)
        if buffer_factor is not None and self.dispatch == "all_gather" and self.overflow == "drop":
            # "auto" chose the scheme without receive buffers: say so rather than ignore it
            # (with overflow="exact", as the full-size presets set, nothing is lost: all_gather
            # drops nothing either)
            warnings.warn(
                f"MoE: buffer_factor={buffer_factor} has no effect, dispatch={dispatch!r} "
                f"resolved to 'all_gather' (expert shards {p.size('experts', 'moe')}, "
                f"num_experts_per_tok={k}), which keeps no receive buffers; pass "
                f"dispatch='all_to_all' to bound them, or leave buffer_factor=None",
                UserWarning, stacklevel=2)
        self.dtype, self.param_dtype = dtype, param_dtype

        kernel_init = nnx.initializers.lecun_normal()
        # every device routes its tokens against all experts, so E is not sharded here
        self.router = nnx.Param(p.param(kernel_init, ("embed", None), "moe")(
            rngs.params(), (embed, E), jnp.float32))
        expert_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        zeros = nnx.initializers.zeros_init()
        self.router_bias = (nnx.Param(p.param(zeros, (None,), "moe")(
            rngs.params(), (E,), jnp.float32)) if router_bias else None)
        w_in, w_out = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")

        # the experts' weights are only ever used cast to `dtype`: a scanned stack casts them
        # once before its scan (`zoo.partitioning.COMPUTE_DTYPE`)
        cast = {} if dtype is None or jnp.dtype(dtype) == jnp.dtype(param_dtype) else \
            {COMPUTE_DTYPE: jnp.dtype(dtype).name}

        def param(init, axes, shape, on=True):
            return nnx.Param(p.param(init, axes, "moe")(rngs.params(), shape, param_dtype),
                             **cast) if on else None
        fused = gate_up == "interleaved"
        self.wi_gate_up = param(expert_init, w_in, (E, embed, 2 * mlp_dim), fused)
        self.wi_gate = param(expert_init, w_in, (E, embed, mlp_dim), not fused)
        self.wi_up = param(expert_init, w_in, (E, embed, mlp_dim), not fused)
        self.wo = param(expert_init, w_out, (E, mlp_dim, embed))
        b_in = ("experts", "mlp")
        self.wi_gate_up_bias = param(zeros, b_in, (E, 2 * mlp_dim), fused and expert_bias)
        self.wi_gate_bias = param(zeros, b_in, (E, mlp_dim), not fused and expert_bias)
        self.wi_up_bias = param(zeros, b_in, (E, mlp_dim), not fused and expert_bias)
        self.wo_bias = param(zeros, ("experts", "embed"), (E, embed), expert_bias)
        self.e_score_correction_bias = (RouterBias(p.param(
            nnx.initializers.zeros_init(), (None,), "moe")(rngs.params(), (E,), jnp.float32))
            if scoring != "softmax" and hash_vocab_size is None else None)
        self.tid2eid = None if hash_vocab_size is None else ExpertTable(p.param(
            hash_table_init(E), (None, None), "moe")(
                rngs.params(), (hash_vocab_size, k), jnp.int32))
        # Shared experts are a dense MLP: default scope, so their tokens stay sharded over
        # `expert` too (the "moe" scope would replicate them there and repeat the work).
        self.shared_experts = (MLP(embed_dim=embed, mlp_dim=shared_dim, partitioner=p,
                                   dtype=dtype, param_dtype=param_dtype,
                                   kernel_init=kernel_init, fp8=fp8, limit=shared_limit,
                                   rngs=rngs)
                               if shared_dim else None)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """Router and bias under ``hf_names["router"]``, one ``nn.Linear`` per expert under
        ``experts.{e}``, the shared experts' MLP."""
        router = hfk.join(prefix, hfk.hf_name(self, "router"))
        rows = [hfk.linear(("router",), f"{router}.weight")]
        if self.router_bias is not None:
            rows.append(hfk.copy(("router_bias",), f"{router}.bias"))
        if self.e_score_correction_bias is not None:
            rows.append(hfk.copy(("e_score_correction_bias",),
                                 f"{router}.e_score_correction_bias"))
        if self.tid2eid is not None:
            rows.append(hfk.copy(("tid2eid",), f"{router}.tid2eid"))
        if self.gate_up == "interleaved":  # the fused layout: one [E, in, out] tensor each
            for attr in ("wi_gate_up", "wo"):
                key = f"{prefix}.experts.{hfk.hf_name(self, attr)}"
                rows.append(hfk.copy((attr,), key))
                if getattr(self, f"{attr}_bias") is not None:
                    rows.append(hfk.copy((f"{attr}_bias",), f"{key}_bias"))
            return rows + hfk.child(self, "shared_experts", prefix)
        for attr in ("wi_gate", "wi_up", "wo"):
            name = hfk.hf_name(self, attr)
            keys = [f"{prefix}.experts.{e}.{name}" for e in range(self.num_experts)]
            rows.append(hfk.stacked_linear((attr,), [f"{k}.weight" for k in keys]))
            if getattr(self, f"{attr}_bias") is not None:
                rows.append(hfk.Tensor((f"{attr}_bias",), tuple(f"{k}.bias" for k in keys),
                                       stacked=True))
        return rows + hfk.child(self, "shared_experts", prefix)

    # -- pieces a subclass may override ----------------------------------------------------
    def route(self, x: jax.Array, tokens: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [B, L, D]`` -> ``(weights [B, L, k], indices [B, L, k], scores [B, L, E])``;
        hashed (``tid2eid``), the experts of ``tokens [B, L]``."""
        # full fp32 products (a TPU rounds fp32 matmul inputs to bf16 by default): which
        # experts a token gets must not hinge on bf16 rounding; [D, E] is a small product
        logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32),
                            self.router[...].astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        fixed = None if self.tid2eid is None else self.hashed_experts(tokens, x.shape[:2])
        return ops.route(logits, k=self.num_experts_per_tok, scoring=self.scoring, bias=bias,
                         indices=fixed,
                         n_group=self.n_group, topk_group=self.topk_group,
                         norm_topk_prob=self.norm_topk_prob,
                         routed_scaling_factor=self.routed_scaling_factor)

    def hashed_experts(self, tokens: jax.Array | None, shape) -> jax.Array:
        """``tid2eid[tokens]`` ``[B, L, k]`` int32, sharded as the tokens."""
        if tokens is None or tuple(tokens.shape) != tuple(shape):
            got = None if tokens is None else tuple(tokens.shape)
            raise ValueError(f"MoE: hash routing (tid2eid) needs the token ids of the input, "
                             f"tokens= of shape {tuple(shape)}, got {got}; call "
                             f"moe(x, tokens=ids)")
        ids = jnp.take(self.tid2eid[...], tokens.astype(jnp.int32), axis=0)
        return self.partitioner.constrain(ids, ("batch", "length", None))

    def _token_plan(self):
        """``(tok spec, [(expert axis, token dim it shards)], expert axes sharding no token
        dimension)`` for the `shard_map` over the whole mesh."""
        p = self.partitioner
        tok = p.spec(ACT)
        tok = P(tok[0], tok[1], None)
        ep_axes = p.mesh_axes("experts", "moe")
        plan = [(a, d) for a in ep_axes for d in (0, 1) if a in _entry_axes(tok[d])]
        replicated = tuple(a for a in ep_axes if a not in {a for a, _ in plan})
        return tok, plan, replicated

    def resolve_execution(self, **requested) -> execution.MoEExecution:
        """The `zoo.ops.moe_execution.MoEExecution` the requested options (`MoE`'s arguments
        of the same names, ``plain`` and ``dtype``) stand for on this layer's mesh and
        sizes."""
        p = self.partitioner
        ep = p.size("experts", "moe")
        batch, length, embed = self.inputs_shape
        replicated = self._token_plan()[2] if p.mesh is not None else ()
        return execution.MoEExecution.resolve(
            **requested, platform=p.platform, device=p.target_device, sharded=p.mesh is not None,
            expert_shards=ep, unsharded_token_axes=replicated,
            tokens_per_device=batch * length // (p.size("batch") * p.size("length")),
            num_experts=self.num_experts, k=self.num_experts_per_tok, embed=embed)

    # the execution's fields, as the layer's own; setting one replaces it in ``execution``
    # (which research code may also replace whole, e.g. ``m.execution.dropless()``)
    def _field(name, field=None):
        field = field or name

        def put(self, value):
            self.execution = dataclasses.replace(self.execution, **{field: value})
        return property(lambda self: getattr(self.execution, field), put)

    dispatch = _field("dispatch")
    dispatch_requested = _field("dispatch_requested", "requested_dispatch")
    overflow = _field("overflow")
    overflow_requested = _field("overflow_requested", "requested_overflow")
    exchange_buffer_factor = _field("exchange_buffer_factor")
    buffer_factor = _field("buffer_factor")
    capacity_factor = _field("capacity_factor")
    grouped_matmul = _field("grouped_matmul")
    del _field

    def local_experts(self, x, indices, weights, wi_gate, wi_up, wo, expert_offset, bias=None):
        """all_gather's per-device work: ``x [T, D]``, ``indices/weights [T, k]``, local expert
        weights ``[E_local, ...]`` (and gate/up biases) -> ``(y [T, D] float32, dropped
        copies int32)``."""
        kw = dict(expert_offset=expert_offset, activation=self.activation, bias=bias)
        if self.capacity_factor is None:
            return ops.dropless_experts(
                x, indices, weights, wi_gate, wi_up, wo, impl=self.grouped_matmul,
                device=self.execution.device,
                expected_rows=max(1, x.shape[0] * self.num_experts_per_tok * wi_gate.shape[0]
                                  // self.num_experts), **kw)
        capacity = ops.expert_capacity(x.shape[0], self.num_experts_per_tok, self.num_experts,
                                       self.capacity_factor)
        return ops.capacity_experts(x, indices, weights, wi_gate, wi_up, wo, capacity=capacity,
                                    **kw)

    def _expert_arrays(self) -> list[tuple[nnx.Param, tuple[str, ...]]]:
        """The expert parameters the dispatch takes, with their logical axes (gate/up weights,
        down weights, then the gate/up biases if any); `_split_experts` reads them back."""
        names = ["wi_gate_up"] if self.gate_up == "interleaved" else ["wi_gate", "wi_up"]
        biases = [f"{n}_bias" for n in names if getattr(self, f"{n}_bias") is not None]
        axes = {"wo": ("experts", "mlp", "embed"), **{b: ("experts", "mlp") for b in biases}}
        return [(getattr(self, n), axes.get(n, ("experts", "embed", "mlp")))
                for n in [*names, "wo", *biases]]

    def _split_experts(self, arrays):
        """``(wi_gate, wi_up, wo, (gate_bias, up_bias) or None)`` of `_expert_arrays`' values
        (local shards inside the `shard_map`: a tensor shard holds whole gate/up pairs)."""
        if self.gate_up == "interleaved":
            wgu, wo, *b = arrays
            bias = (b[0][..., 0::2], b[0][..., 1::2]) if b else None
            return wgu[..., 0::2], wgu[..., 1::2], wo, bias
        wg, wu, wo, *b = arrays
        return wg, wu, wo, (tuple(b) or None)

    _W_IN, _W_OUT = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")

    def _split_copies(self, arrays):
        """`_split_experts` when the gate, up and down weights are FP8 copies (`fp8_weights`:
        gate and up apart, also for ``gate_up="interleaved"``), then the biases."""
        wg, wu, wo, *b = arrays
        if self.gate_up == "interleaved":
            return wg, wu, wo, ((b[0][..., 0::2], b[0][..., 1::2]) if b else None)
        return wg, wu, wo, (tuple(b) or None)

    def _copy_spec(self, copy: fp8_ops.QuantizedWeight, spec: P) -> fp8_ops.QuantizedWeight:
        """The `jax.shard_map` specs of an expert weight's FP8 copy sharded as the weight
        (``spec``): the float8 values as the weight; the 128x128 blocks' scales on the same
        axes where the shards hold whole blocks, else whole along that dimension (its
        shards hold every scale they may need; `fp8_weights` makes no copies where a tensor
        shard would cut a block); the counts by expert."""
        spec = tuple(spec) + (None,) * (copy.w.ndim - len(spec))
        scale = tuple(e if e is None or fp8_ops.whole_blocks(dim, self.partitioner.axis_size(e))
                      else None for dim, e in zip(copy.w.shape, spec))
        return fp8_ops.QuantizedWeight(P(*spec), P(*spec), P(spec[0], *scale[1:]),
                                       P(spec[0], None))

    def fp8_copies_cross(self) -> bool:
        """Whether the routed experts' FP8 copies can be made once for the whole weight: each
        tensor shard of the expert width (``mlp``) holds whole 128-column blocks, so the
        blocks of the whole weight are those each shard quantises (FSDP shards of ``embed``
        are gathered before the product, so they never cut one)."""
        tensor = self.partitioner.size("mlp", "moe")
        return tensor == 1 or fp8_ops.whole_blocks(self.mlp_dim, tensor)

    def fp8_weights(self) -> dict[str, fp8_ops.QuantizedWeight]:
        """The FP8 copies of the routed experts' weights (`zoo.layers.linear.
        prequantized_weights` makes them once per step; the forward pass takes them through
        `zoo.layers.linear.prequantized`): ``{"wi_gate", "wi_up", "wo":
        zoo.ops.fp8.prequantize(weight in the compute dtype)}``, each ``[*stack, E, K, N]``
        (leading dims: a stack's layers; ``gate_up="interleaved"``: its gate and up columns
        apart). They cross the expert `jax.shard_map` sharded as the weights (their scales
        on the same axes where the shards hold whole 128-blocks, else whole), and every
        grouped matmul -- both dispatches, every exact round, forward and backward -- takes
        them instead of quantising again. ``{}`` (each use quantises its weight, per shard)
        without FP8, with a capacity, with a subclass's own `experts`, with ``dtype=None``
        (the compute dtype is the input's) or where a tensor shard of the expert width
        holds a partial 128-block (`fp8_copies_cross`)."""
        if (self.grouped_matmul != "fp8_blockwise" or self.capacity_factor is not None
                or type(self).experts is not MoE.experts or self.dtype is None
                or not self.fp8_copies_cross()):
            return {}
        cast = lambda w: w[...].astype(self.dtype)
        if self.gate_up == "interleaved":
            wgu = cast(self.wi_gate_up)
            weights = dict(wi_gate=wgu[..., 0::2], wi_up=wgu[..., 1::2])
        else:
            weights = dict(wi_gate=cast(self.wi_gate), wi_up=cast(self.wi_up))
        weights["wo"] = cast(self.wo)
        return {name: fp8_ops.prequantize(w) for name, w in weights.items()}

    def _output_bias(self, weights: jax.Array, indices: jax.Array) -> jax.Array:
        """``sum_j weights[j] * wo_bias[indices[j]]`` ``[B, L, D]`` float32, as one matmul."""
        dense = jnp.einsum("blk,blke->ble", weights.astype(jnp.float32),
                           jax.nn.one_hot(indices, self.num_experts, dtype=jnp.float32))
        return jnp.einsum("ble,ed->bld", dense, self.wo_bias[...].astype(jnp.float32))

    def experts(self, x: jax.Array, weights: jax.Array, indices: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
        """Routed experts on ``x [B, L, D]``: ``(y [B, L, D], dropped copies, global)``."""
        y, dropped, _ = self._experts(x, weights, indices)
        return y, dropped

    def _experts(self, x, weights, indices):
        """`experts` and the most all_to_all rounds any device ran (1 unless exact)."""
        one = jnp.ones((), jnp.int32)
        B, L, D = x.shape
        k = self.num_experts_per_tok
        dtype = self.dtype or x.dtype
        arrays = [(w[...].astype(dtype), axes) for w, axes in self._expert_arrays()]
        split = self._split_experts
        copies = [prequantized(self, n) for n in ("wi_gate", "wi_up", "wo")]
        if all(c is not None and c.dtype == dtype for c in copies):
            # FP8 copies made once per step (`fp8_weights`) in place of gate/up and down
            biases = arrays[2 if self.gate_up == "interleaved" else 3:]
            arrays = [*zip(copies, (self._W_IN, self._W_IN, self._W_OUT)), *biases]
            split = self._split_copies
        p = self.partitioner
        if p.mesh is None:
            wg, wu, wo, bias = split([a for a, _ in arrays])
            y, dropped = self.local_experts(x.reshape(B * L, D), indices.reshape(B * L, k),
                                            weights.reshape(B * L, k), wg, wu, wo, 0, bias=bias)
            return y.reshape(B, L, D).astype(dtype), dropped, one

        tok, plan, replicated = self._token_plan()
        specs = [p.spec(axes, "moe") for _, axes in arrays]
        in_specs = [self._copy_spec(a, spec) if isinstance(a, fp8_ops.QuantizedWeight) else spec
                    for (a, _), spec in zip(arrays, specs)]
        ep_axes = p.mesh_axes("experts", "moe")
        mlp_axes = p.mesh_axes("mlp", "moe")
        token_axes = tuple(dict.fromkeys(
            (*_entry_axes(tok[0]), *_entry_axes(tok[1]), *ep_axes)))
        n_ep = p.size("experts", "moe")
        num_local = self.num_experts // n_ep

        def gather_weights(local):
            # FSDP: whole local experts; the transpose of this all-gather is a reduce-scatter
            out = []
            for w, (_, axes), spec, in_spec in zip(local, arrays, specs, in_specs):
                d = axes.index("embed") if "embed" in axes else None
                if d is not None and _entry_axes(spec[d]):
                    gather = lambda a, d=d, spec=spec: jax.lax.all_gather(
                        a, _entry_axes(spec[d]), axis=d, tiled=True)
                    if isinstance(w, fp8_ops.QuantizedWeight):  # a scale unsharded stays
                        w = w.gathered(gather, scale=bool(len(in_spec.scale) > d
                                                          and in_spec.scale[d]))
                    else:
                        w = gather(w)
                out.append(w)
            return split(out)

        def all_gather_body(x, weights, indices, *local):
            wg, wu, wo, bias = gather_weights(local)
            # each expert-sharding axis either shards a token dimension (gather/scatter it
            # there) or leaves tokens replicated (then every shard saw all tokens: plain psum)
            for a, d in plan:
                x, weights, indices = (jax.lax.all_gather(v, a, axis=d, tiled=True)
                                       for v in (x, weights, indices))
            nb, nl = x.shape[:2]
            offset = jax.lax.axis_index(ep_axes) * num_local if ep_axes else 0
            y, dropped = self.local_experts(x.reshape(nb * nl, D), indices.reshape(nb * nl, k),
                                            weights.reshape(nb * nl, k), wg, wu, wo, offset,
                                            bias=bias)
            y = y.reshape(nb, nl, D).astype(dtype)
            if mlp_axes:
                y = jax.lax.psum(y, mlp_axes)
            for a, d in reversed(plan):
                y = jax.lax.psum_scatter(y, a, scatter_dimension=d, tiled=True)
            if replicated:
                y = jax.lax.psum(y, replicated)
            dropped = jax.lax.psum(dropped, token_axes) if token_axes else dropped
            return y, jnp.stack([dropped, jnp.ones((), jnp.int32)])

        def all_to_all_body(x, weights, indices, *local):
            wg, wu, wo, bias = gather_weights(local)
            nb, nl = x.shape[:2]
            t = nb * nl
            cap = execution.a2a_capacity(t, k, num_local, n_ep, self.exchange_buffer_factor)
            extra = {} if self.overflow == "exact" else dict(activation=self.activation,
                                                             bias=bias)
            exchange = ops.all_to_all_experts if self.overflow == "drop" else all_to_all_rounds
            y, stat = exchange(
                x.reshape(t, D), indices.reshape(t, k), weights.reshape(t, k), wg, wu, wo,
                axis_name=ep_axes[0] if len(ep_axes) == 1 else ep_axes, num_shards=n_ep,
                capacity=cap, impl=self.grouped_matmul, device=self.execution.device,
                fp8_dispatch=self.execution.fp8_dispatch, **extra)
            y = y.reshape(nb, nl, D).astype(dtype)
            if mlp_axes:
                y = jax.lax.psum(y, mlp_axes)
            if self.overflow == "drop":  # stat: this device's dropped copies
                return y, jnp.stack([jax.lax.psum(stat, token_axes), jnp.ones((), jnp.int32)])
            # stat (the rounds) is already the same over the expert axes, and over the tensor
            # axes (the routing is); jax 0.12's pmax wants every axis it reduces to be one its
            # input varies over
            axes = tuple(sorted(set(token_axes) | varying_axes(stat)))
            rounds = jax.lax.pmax(mark_varying(stat, axes), axes)
            return y, jnp.stack([jnp.zeros((), jnp.int32), rounds])

        body = all_to_all_body if self.dispatch == "all_to_all" else all_gather_body
        fn = jax.shard_map(body, mesh=p.mesh, in_specs=(tok, tok, tok, *in_specs),
                           out_specs=(tok, P()))
        y, stats = fn(x.astype(dtype), weights, indices, *(a for a, _ in arrays))
        return y, stats[0], stats[1]

    def _record_fp8_stats(self, x: jax.Array) -> None:
        """`zoo.layers.linear.record_fp8_stats` of the grouped matmul's FP8 operands: the
        tokens (each copy a token sends is its row, quantised alike: the fractions are the
        tokens') and the experts' gate, up and down weights. The down projection's input
        (the activation between them, inside the dispatch) is not counted."""
        dtype = self.dtype or x.dtype
        copies = [prequantized(self, n) for n in ("wi_gate", "wi_up", "wo")]
        if all(c is not None and c.dtype == dtype for c in copies):  # counted once, with them
            w_stats = [jnp.sum(c.stats.reshape(-1, len(fp8_ops.STATS)), 0) for c in copies]
        else:
            wg, wu, wo, _ = self._split_experts([w[...].astype(dtype)
                                                 for w, _ in self._expert_arrays()])
            w_stats = [fp8_ops.quantize_stats(w, block=fp8_ops.WEIGHT_BLOCK)
                       for w in (wg, wu, wo)]
        record_fp8_stats(self, fp8_ops.quantize_stats(x.astype(dtype).reshape(-1, x.shape[-1])),
                         *w_stats)

    # -- forward -------------------------------------------------------------------------------
    def __call__(self, x: jax.Array, tokens: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"MoE expects [batch, length, {self.embed_dim}] inputs, got "
                             f"{x.shape}")
        p = self.partitioner
        B, L, _ = x.shape
        p.check_tokens(B, L, what="MoE")
        with jax.named_scope("moe"):
            x = p.constrain(x, ACT)
            with jax.named_scope("router"):
                weights, indices, scores = (self.route(x) if self.tid2eid is None
                                            else self.route(x, tokens))
            with jax.named_scope("balance"):
                counts = ops.expert_counts(indices, self.num_experts)
                loss = ops.load_balance_loss(scores, counts, k=self.num_experts_per_tok,
                                             scoring=self.scoring)
            with jax.named_scope("experts"):
                if type(self).experts is MoE.experts:
                    y, dropped, rounds = self._experts(x, weights, indices)
                else:  # a subclass's own experts
                    y, dropped = self.experts(x, weights, indices)
                    rounds = jnp.ones((), jnp.int32)
                if self.wo_bias is not None:
                    y = y + self._output_bias(weights, indices).astype(y.dtype)
                if self.grouped_matmul == "fp8_blockwise" and self.capacity_factor is None:
                    self._record_fp8_stats(x)
            if self.shared_experts is not None:
                with jax.named_scope("shared_experts"):
                    y = y + self.shared_experts(x).astype(y.dtype)
            y = p.constrain(y, ACT)
        copies = B * L * self.num_experts_per_tok
        aux = dict(load_balance_loss=loss, expert_counts=counts, dropped_tokens=dropped,
                   dropped_fraction=dropped.astype(jnp.float32) / copies, moe_rounds=rounds)
        return y, aux


# -- aux-loss-free balancing -------------------------------------------------------------------
def moe_modules(module: nnx.Module, *, with_bias: bool = True) -> list[MoE]:
    """The `MoE` layers of `module` in `nnx.iter_modules` order (for an `nnx.List` of layers:
    layer order); with ``with_bias`` only those with a `RouterBias` (``scoring="sigmoid"``)."""
    return [m for _, m in nnx.iter_modules(module) if isinstance(m, MoE)
            and (m.e_score_correction_bias is not None or not with_bias)]


def _as_counts(counts: Any) -> Any:
    if isinstance(counts, Mapping) and "expert_counts" in counts:
        return counts["expert_counts"]
    return counts


def _stacked_rows(m: MoE) -> int:
    """Layers a MoE module holds: its stack size when scanned (weights ``[n, E, D, F]``)."""
    shape = m.wo[...].shape
    return int(shape[0]) if len(shape) == 4 else 1


def _rows_by_module(module: nnx.Module, rows: list[int]) -> list[list[int]]:
    """The rows of ``[num_moe_layers, E]`` counts each module of `moe_modules` holds: one run
    after another, except where the model says (``moe_rows``: a model whose stacks hold
    layers of a cycle, whose rows interleave in layer order)."""
    ends = np.cumsum(rows)
    picks = [list(range(e - n, e)) for n, e in zip(rows, ends)]
    model_rows = getattr(module, "moe_rows", None)
    return picks if model_rows is None else [*model_rows(), *picks[len(model_rows()):]]


def update_expert_bias(module: nnx.Module, expert_counts: Any, rate: float = 1e-3) -> None:
    """DeepSeek-V3's aux-loss-free balancing, in place: ``bias += rate * sign(mean - counts)``.

    Overloaded experts become less likely to be selected, idle ones more; the combine weights
    never see the bias. Call it after each training step (eagerly or inside the jitted step).

    Args:
      module: a sigmoid-scored `MoE`, or a model containing such layers.
      expert_counts: the ``aux`` dict or its ``"expert_counts"``; for a model either an array
        ``[num_moe_layers, E]`` or a sequence (of arrays or aux dicts), one entry per layer in
        `moe_modules` order -- one per MoE layer (rows of layers without a bias are skipped)
        or one per layer with a bias. A layer whose bias is stacked (e.g. ``[layers, E]``
        under `nnx.scan`) takes counts of the same shape.
      rate: the bias update speed (DeepSeek-V3 uses 1e-3).
    """
    every = moe_modules(module, with_bias=False)
    layers = [m for m in every if m.e_score_correction_bias is not None]
    if not layers:
        raise ValueError(f"{type(module).__name__} holds no MoE layer with scoring='sigmoid'; "
                         f"only those carry a selection bias to update (use rate 0 otherwise)")
    counts = _as_counts(expert_counts)
    if isinstance(counts, Sequence) and not isinstance(counts, (jax.Array, np.ndarray)):
        per_layer = [jnp.asarray(_as_counts(c)) for c in counts]
    else:
        counts = jnp.asarray(counts)
        rows = [_stacked_rows(m) for m in every]
        if len(layers) == 1 and counts.shape == layers[0].e_score_correction_bias.shape:
            per_layer = [counts]
        elif counts.ndim == 2 and counts.shape[0] == sum(rows) and len(every) > 1:
            # stacked (scanned) layers among them: each takes its own rows
            per_layer = [counts[np.asarray(pick)].reshape(m.e_score_correction_bias.shape)
                         for m, pick in zip(every, _rows_by_module(module, rows))
                         if m.e_score_correction_bias is not None]
        else:
            per_layer = list(counts) if counts.ndim >= 2 else [counts]
    if len(per_layer) == len(every) != len(layers):
        per_layer = [c for m, c in zip(every, per_layer) if m.e_score_correction_bias is not None]
    if len(per_layer) != len(layers):
        raise ValueError(f"got expert counts for {len(per_layer)} layer(s) but the module has "
                         f"{len(every)} MoE layer(s), {len(layers)} with a selection bias; pass "
                         f"one row per MoE layer (or per biased layer) in moe_modules() order")
    for layer, c in zip(layers, per_layer):
        bias = layer.e_score_correction_bias
        if c.shape != bias.shape:
            raise ValueError(f"expert counts of shape {c.shape} do not match the bias of shape "
                             f"{bias.shape}")
        c = c.astype(jnp.float32)
        step = jnp.sign(c.mean(-1, keepdims=True) - c) * rate
        bias[...] = (bias[...] + step).astype(bias.dtype)
