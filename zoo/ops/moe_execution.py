"""How a mixture-of-experts layer executes, as one value: `MoEExecution`.

`zoo.layers.MoE` builds it from its arguments and its mesh at construction
(`MoEExecution.resolve`: ``"auto"`` settled for the mesh's platform, the combination rules
checked in one place with their fixes); the expert functions of `zoo.ops.moe` and
`zoo.ops.moe_rounds` read it as a static value, and ``run.json`` records it (`as_dict`).

* `MoEExecution` -- dispatch scheme, capacity and buffer factors, overflow, grouped-matmul
  kernel (and why, where it falls back to XLA's) and the target device its kernels are traced
  for; ``dropless()`` for generation.
* `choose_grouped_matmul` -- a grouped-matmul choice with ``"auto"`` settled for a platform.
* `a2a_capacity`, `dispatch_bytes` -- the sizes the choice rests on: receive rows per peer of
  the all_to_all scheme, and the analytic bytes of either scheme (what ``dispatch="auto"``
  compares).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

__all__ = ["DISPATCHES", "GROUPED_MATMULS", "GROUPED_MATMUL_BY_PLATFORM", "MoEExecution",
           "OVERFLOWS", "ROUNDS_BUFFER_FACTOR", "TRITON_FP32_REASON", "a2a_capacity",
           "choose_grouped_matmul", "dispatch_bytes"]


# -- grouped matmul ------------------------------------------------------------------------------
GROUPED_MATMULS = ("auto", "blocked", "ragged_dot", "tokamax", "fp8_blockwise")
# "auto" by the platform a program is built for (`grouped_swiglu`'s docstring says why)
GROUPED_MATMUL_BY_PLATFORM = {"cpu": "blocked", "tpu": "ragged_dot", "gpu": "tokamax"}


def choose_grouped_matmul(impl: str, platform: str) -> str:
    """`impl`, with ``"auto"`` settled for `platform` (``"cpu"``/``"tpu"``/``"gpu"``, a mesh's):
    a layer that knows its mesh settles it at construction, so the program traces only that
    platform's path (``jax.lax.platform_dependent`` traces every branch, and tokamax's Mosaic
    TPU kernel fails inside a ``shard_map`` when traced on a TPU host)."""
    if impl not in GROUPED_MATMULS:
        raise ValueError(f"grouped matmul {impl!r} is not one of {GROUPED_MATMULS}")
    return GROUPED_MATMUL_BY_PLATFORM.get(platform, "tokamax") if impl == "auto" else impl


# -- execution -----------------------------------------------------------------------------------
DISPATCHES = ("auto", "all_to_all", "all_gather")
OVERFLOWS = ("auto", "drop", "exact")
# overflow="auto" on a dropless all_to_all: receive buffers of this multiple of the balanced
# share, overflow in further rounds (`zoo.ops.moe_rounds`), when that is under half the
# worst-case buffers of one round
ROUNDS_BUFFER_FACTOR = 1.25
# why a grouped-matmul choice falls back to XLA's ragged dot (`MoEExecution.kernel_reason`)
TRITON_FP32_REASON = ("tokamax's float32 ragged dot on GPU is its Triton kernel, whose "
                      "pallas_call cannot state its output's shard_map varying axes (check_vma "
                      "refuses it); XLA's ragged dot runs instead (bfloat16 keeps tokamax)")


@dataclasses.dataclass(frozen=True)
class MoEExecution:
    """How a MoE layer runs, as one value (like the `zoo.Partitioner`): chosen once from the
    mesh at construction (`MoEExecution.resolve`), validated there, passed down as a static
    value (the kernels, the exchange and their backward passes read it; nothing global) and
    recorded in ``run.json`` (`as_dict`).

    * ``dispatch``: ``"all_gather"`` or ``"all_to_all"`` (`zoo.layers.moe`'s docstring).
    * ``capacity_factor``: all_gather's slots per expert (None: dropless).
    * ``buffer_factor``: the all_to_all receive buffers asked for (None: dropless);
      ``exchange_buffer_factor`` the ones the exchange runs with (the rounds' buffers when
      ``overflow="auto"`` chose them; None: one round of worst-case buffers).
    * ``overflow``: ``"drop"`` (copies beyond the buffers are dropped; with no buffer factor
      and no capacity nothing is) or ``"exact"`` (they travel in further rounds).
    * ``grouped_matmul``: the experts' kernel (`grouped_swiglu`'s ``impl``), settled for
      ``platform``; ``kernel_reason``: why it is not the platform's default (a kernel that
      cannot run in this configuration falls back to XLA's path), else None.
    * ``platform``: ``"cpu"``/``"gpu"``/``"tpu"`` of the mesh's devices; ``device``: one of
      them when tokamax's kernels must be traced for it (a GPU mesh on another host's
      platform, `zoo.Partitioner.target_device`), else None.
    * ``requested_dispatch``, ``requested_overflow``: what was asked (``"auto"`` or a scheme).
    * ``fp8_dispatch``: the tokens cross the all_to_all wire as FP8 tiles with their float32
      scales (`all_to_all_experts`); their gradients and the expert outputs travel in the
      compute dtype. On by default wherever the experts run ``"fp8_blockwise"`` behind the
      all_to_all dispatch on a mesh (``fp8_dispatch=None`` asked), else off.

    ``dropless()`` is the same execution with nothing dropped (what generation runs).
    """
    dispatch: str = "all_gather"
    capacity_factor: float | None = None
    buffer_factor: float | None = None
    overflow: str = "drop"
    exchange_buffer_factor: float | None = None
    grouped_matmul: str = "blocked"
    kernel_reason: str | None = None
    platform: str = "cpu"
    device: Any = None
    requested_dispatch: str = "auto"
    requested_overflow: str = "auto"
    fp8_dispatch: bool = False

    @staticmethod
    def check(*, dispatch: str = "auto", capacity_factor: float | None = None,
              buffer_factor: float | None = None, overflow: str = "auto",
              grouped_matmul: str = "auto", plain: bool = True,
              fp8_dispatch: bool | None = None) -> None:
        """The requested options and the rules between them, with the fix in each message
        (``plain``: the experts are SwiGLU without biases, which the rounds need)."""
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0, or None for "
                             f"dropless dispatch")
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch={dispatch!r} must be one of {DISPATCHES}")
        if grouped_matmul not in GROUPED_MATMULS:
            raise ValueError(f"grouped_matmul={grouped_matmul!r} must be one of "
                             f"{GROUPED_MATMULS}")
        if buffer_factor is not None and not buffer_factor > 0:
            raise ValueError(f"buffer_factor={buffer_factor} must be > 0, or None for dropless "
                             f"all-to-all buffers")
        if buffer_factor is not None and dispatch == "all_gather":
            raise ValueError(f"buffer_factor={buffer_factor} sizes all_to_all receive buffers; "
                             f"dispatch='all_gather' has none (use capacity_factor there)")
        if overflow not in OVERFLOWS:
            raise ValueError(f"overflow={overflow!r} must be one of {OVERFLOWS}: 'drop' drops "
                             f"the copies beyond the all_to_all buffers, 'exact' sends them in "
                             f"further rounds, 'auto' picks (see zoo.layers.moe)")
        if overflow == "exact" and dispatch == "all_gather":
            raise ValueError("overflow='exact' runs all_to_all in rounds; dispatch='all_gather' "
                             "has no buffers to overflow (pass dispatch='all_to_all' with a "
                             "buffer_factor)")
        if capacity_factor is not None and dispatch == "all_to_all":
            raise ValueError("capacity_factor belongs to dispatch='all_gather' (per-expert "
                             "capacity after the gather); with dispatch='all_to_all' bound the "
                             "buffers with buffer_factor instead")
        if overflow == "exact" and not plain:
            raise ValueError("overflow='exact' runs the plain SwiGLU experts; expert_bias and a "
                             "clamped activation need overflow='drop' (with buffer_factor=None "
                             "nothing is dropped)")
        if fp8_dispatch not in (None, True, False):
            raise ValueError(f"fp8_dispatch={fp8_dispatch!r} must be None (FP8 tokens on the "
                             f"all_to_all wire whenever the experts run in FP8), True or False")
        if fp8_dispatch and grouped_matmul != "fp8_blockwise":
            raise ValueError(f"fp8_dispatch=True sends the tokens as FP8 tiles for the FP8 "
                             f"grouped matmul, but grouped_matmul={grouped_matmul!r}; set "
                             f"fp8='blockwise' (grouped_matmul 'fp8_blockwise') or "
                             f"fp8_dispatch=None")
        if fp8_dispatch and (dispatch == "all_gather" or capacity_factor is not None):
            raise ValueError("fp8_dispatch=True is the all_to_all wire's; dispatch='all_gather' "
                             "(or a capacity_factor, which only it has) gathers the tokens in "
                             "the compute dtype; use dispatch='all_to_all' or fp8_dispatch=None")

    @classmethod
    def resolve(cls, *, dispatch: str = "auto", capacity_factor: float | None = None,
                buffer_factor: float | None = None, overflow: str = "auto",
                grouped_matmul: str = "auto", plain: bool = True, dtype: Any = None,
                platform: str = "cpu", device: Any = None, sharded: bool = False,
                expert_shards: int = 1, unsharded_token_axes: tuple = (),
                tokens_per_device: int = 1, num_experts: int = 1, k: int = 1,
                embed: int = 1, fp8_dispatch: bool | None = None) -> MoEExecution:
        """The execution the requested options stand for on a mesh: `check`, then ``"auto"``
        settled (dispatch by `dispatch_bytes`; overflow by the rounds' buffers, see
        `zoo.layers.moe`; the grouped matmul by ``platform``, falling back to XLA's ragged dot
        where tokamax's kernel cannot run). ``sharded``: a mesh is given; ``expert_shards``:
        the expert axes' size; ``unsharded_token_axes``: expert axes that shard no token
        dimension (all_to_all needs each device's own tokens); ``tokens_per_device``,
        ``num_experts``, ``k``, ``embed``: the sizes "auto" weighs; ``dtype``: the experts'
        computation dtype (None: the input's); ``fp8_dispatch``: see the class docstring
        (True where the dispatch resolves to no all_to_all wire is an error)."""
        cls.check(dispatch=dispatch, capacity_factor=capacity_factor,
                  buffer_factor=buffer_factor, overflow=overflow,
                  grouped_matmul=grouped_matmul, plain=plain, fp8_dispatch=fp8_dispatch)
        scheme = dispatch
        if not sharded:
            scheme = "all_gather" if dispatch == "auto" else dispatch
        elif unsharded_token_axes:
            if dispatch == "all_to_all":
                raise ValueError(f"dispatch='all_to_all' needs the tokens sharded over every "
                                 f"expert axis, but {unsharded_token_axes} shards none of them; "
                                 f"use dispatch='all_gather' or a strategy that shards tokens "
                                 f"over 'expert'")
            scheme = "all_gather"
        elif dispatch == "auto":
            if expert_shards == 1 or capacity_factor is not None:
                scheme = "all_gather"
            else:
                dims = dict(tokens=tokens_per_device, k=k, embed=embed, num_shards=expert_shards)
                a2a, ag = (dispatch_bytes(s, **dims) for s in ("all_to_all", "all_gather"))
                scheme = "all_to_all" if a2a < ag else "all_gather"
        flow, exchange = overflow, buffer_factor
        if overflow == "auto":
            flow = "drop"
            if buffer_factor is None and scheme == "all_to_all" and plain:
                args = (tokens_per_device, k, num_experts // expert_shards, expert_shards)
                if 2 * a2a_capacity(*args, ROUNDS_BUFFER_FACTOR) < a2a_capacity(*args, None):
                    flow, exchange = "exact", ROUNDS_BUFFER_FACTOR
        kernel = choose_grouped_matmul(grouped_matmul, platform)
        reason = None
        floating = None if dtype is None else jnp.dtype(dtype)
        if (platform == "gpu" and sharded and kernel == "tokamax"
                and floating != jnp.dtype(jnp.bfloat16)):
            kernel, reason = "ragged_dot", TRITON_FP32_REASON
        wire = sharded and scheme == "all_to_all"
        if fp8_dispatch and not wire:
            raise ValueError(f"fp8_dispatch=True needs the all_to_all wire, but dispatch="
                             f"{dispatch!r} resolves to {scheme!r}" + ("" if sharded else
                             " without a mesh") + "; pass dispatch='all_to_all' on a mesh "
                             "that shards the experts, or fp8_dispatch=None")
        return cls(dispatch=scheme, capacity_factor=capacity_factor,
                   buffer_factor=buffer_factor, overflow=flow, exchange_buffer_factor=exchange,
                   grouped_matmul=kernel, kernel_reason=reason, platform=platform,
                   device=device if platform == "gpu" else None, requested_dispatch=dispatch,
                   requested_overflow=overflow,
                   fp8_dispatch=wire and kernel == "fp8_blockwise" and fp8_dispatch is not False)

    @property
    def drops(self) -> bool:
        """Whether copies can be dropped (a capacity, or all_to_all buffers with overflow
        dropped)."""
        if self.dispatch == "all_gather":
            return self.capacity_factor is not None
        return self.overflow == "drop" and self.exchange_buffer_factor is not None

    def dropless(self) -> MoEExecution:
        """This execution with nothing dropped: no capacity, and all_to_all in one round of
        worst-case buffers (its exchange, kernel and device kept). What generation runs,
        whatever the training settings."""
        return dataclasses.replace(self, capacity_factor=None, buffer_factor=None,
                                   overflow="drop", exchange_buffer_factor=None)

    def as_dict(self) -> dict[str, Any]:
        """The fields as ``run.json`` records them (the device by its kind)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["device"] = None if self.device is None else str(
            getattr(self.device, "device_kind", self.device))
        return d


# -- sizes ---------------------------------------------------------------------------------------
def a2a_capacity(tokens: int, k: int, num_local: int, num_shards: int,
                 buffer_factor: float | None) -> int:
    """Rows each device reserves per peer in `all_to_all_experts`: dropless (None) the most
    that can arrive from ``tokens`` tokens, ``tokens * min(k, E_local)`` (a token sends at
    most one copy to each of a peer's experts); else ``ceil(f * tokens * k / EP)``, ``f``
    times the balanced share, capped at the dropless size."""
    most = tokens * min(k, num_local)
    if buffer_factor is None:
        return most
    return max(1, min(most, math.ceil(buffer_factor * tokens * k / num_shards)))


def dispatch_bytes(scheme: str, *, tokens: int, k: int, embed: int, num_shards: int,
                   itemsize: int = 2) -> float:
    """Analytic bytes one device sends per MoE layer and train step (forward and backward),
    with ``tokens`` tokens per device and balanced routing.

    ``all_gather``: tokens gathered over the expert axis, outputs reduce-scattered back
    (``(EP - 1) * T * D`` each way; the transposes repeat both in the backward pass).
    ``all_to_all``: the copies bound for other devices, ``T * k * (EP - 1) / EP`` rows each
    way and again in the backward pass -- the minimum for any scheme that moves activations.
    """
    ep, row = num_shards, embed * itemsize
    if scheme == "all_gather":
        return 2 * 2 * (ep - 1) * tokens * row
    if scheme == "all_to_all":
        return 2 * 2 * tokens * k * (ep - 1) / ep * row
    raise ValueError(f"dispatch scheme {scheme!r} must be 'all_gather' or 'all_to_all'")
