"""Block kernels: attention of one query block against one key/value block, pluggable.

The context-parallel strategies (`zoo.ops.ring`: all-gather, ring) own communication, block
classification and the online-softmax merge; a *block kernel* owns the arithmetic of one block
pair. Its contract (`BlockKernel`):

* ``forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, scores, masked) -> (out, lse)``:
  ``out`` [B,L,N,V] fp32 normalised over this block's keys, ``lse`` [B,N,L] fp32 their
  log-sum-exp (-inf, with ``out`` 0, for rows that see no key here).
* ``backward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, dout, *, scores, masked)
  -> (dq, dk, dv)`` fp32, where ``out`` and ``lse`` are the *global* ones (over every block and
  the sinks): then exp(s - lse) are the true probabilities and ``sum(dout * out)`` the true
  softmax-Jacobian term, so every block's gradients are exact on their own and simply add up.
  This is the signature flash-attention backward kernels already have (tokamax's VJP ops take
  the output and the softmax residuals).

``scores`` (`Scores`) carries the mask, scale, soft cap and `ScoreMod`; ``masked=False`` (a
Python bool) says the strategy proved the block fully visible: the kernel must not evaluate the
mask there; otherwise it is True or one of the kernel's own `BlockKernel.partial_plans`.
Kernels are frozen dataclasses (hashable: they are part of the compiled program's key).
Kernels here: `zoo.ops.flash.FlashKernel` (``"flash"``, pure JAX, any platform),
`zoo.ops.pallas_tpu.PallasTpuKernel` (``"pallas_tpu"``, Mosaic TPU) and `TokamaxKernel`
(``"tokamax"``); `register_kernel` adds a user's, `get_kernel` resolves a name (``"auto"``:
tokamax on GPU, pallas_tpu on TPU, flash on CPU).

Legend: B batch, L queries, S keys, N query heads, K kv heads, H q/k head dim, V value head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zoo.ops.masks import Mask, evaluate

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    """A logit modifier ``fn(score, q_pos, kv_pos, q_seg, kv_seg, head) -> score``, elementwise
    and differentiable (kernels take its exact VJP). ``score`` is the scaled q.k logit, fp32;
    ``head`` the query head index. Applied before the soft cap and the mask."""
    fn: Callable


@dataclasses.dataclass(frozen=True)
class Scores:
    """How a block's logits are made: ``mask(scale * q.k -> score_mod -> soft cap)``."""
    mask: Mask
    scale: float
    soft_cap: float | None = None
    score_mod: ScoreMod | None = None

    @property
    def modified(self) -> bool:
        return self.soft_cap is not None or self.score_mod is not None

    def modify(self, s, q_pos, kv_pos, q_seg, kv_seg, head):
        """The score modifiers on fp32 logits ``s`` (elementwise, broadcasting)."""
        if self.score_mod is not None:
            s = self.score_mod.fn(s, q_pos, kv_pos, q_seg, kv_seg, head).astype(F32)
        if self.soft_cap is not None:
            s = self.soft_cap * jnp.tanh(s / self.soft_cap)
        return s


class BlockKernel:
    """Base class documenting the contract (see the module docstring).

    Optional: a kernel that can walk a partially masked block in several static ways says so
    with ``partial_plans(L, S) -> (plan, ...)`` (hashable values passed as ``masked``; the
    last must take any block) and ``pick_plan(plans, scores, q_pos, kv_pos, q_seg, kv_seg)
    -> int32`` (which one fits this block, from the data); the strategy makes each plan one
    way of its per-sub-block decision. The default is one plan, ``masked=True``.

    Optional too: ``windowed = True`` says that ``forward``/``backward`` take
    ``window=(q_start, L, kv_start, S)`` (starts int32, possibly traced; lengths static): q,
    k, v, out, lse, dout and the positions/segments are then the strategy's whole arrays and
    the kernel works on queries [q_start, q_start + L) and keys [kv_start, kv_start + S), so
    no sub-block copy is materialised (memory).

    And ``takes_delta = True`` says that ``backward`` takes ``delta=`` ([B, N, L] fp32,
    ``sum(dout * out)`` over the value dim of the *global* out, computed once by the strategy;
    windowed like lse) and gets ``out=None``: the strategy then holds no q-sized out during the
    backward's loop (memory).

    And ``accumulates = True`` (with ``windowed``) says that the kernel adds into the
    strategy's accumulators in place: ``forward(..., into=(out, lse))`` merges the window's
    queries into the running fp32 ``out`` [B, L', N, V] (normalised) and ``lse`` [B, N, L']
    (whole arrays, at the window's query offset) and returns them; ``backward(..., into=(dq,
    dk, dv))`` adds the window's gradients into whole fp32 accumulators at the window's
    offsets and returns them. No sub-block result exists then (memory); the strategy runs each
    way in a 0-or-1-trip loop instead of a `lax.switch` (see `zoo.ops.ring`). A subclass of
    such a kernel (`zoo.ops.flash.FlashKernel`) that overrides ``forward`` or ``backward``
    without ``into=`` sets ``accumulates = False``.

    And ``classifies_tiles = True`` says that the kernel classifies its own tiles from the
    positions and segment ids (skipping empty ones, evaluating the mask only on partial
    ones): the strategy then hands it each block pair whole with ``masked=True`` -- no
    sub-blocks, no classification, no branch -- so the program holds one call per pass
    (`zoo.ops.pallas_tpu`).
    """

    windowed = False
    takes_delta = False
    accumulates = False
    classifies_tiles = False

    def for_platform(self, platform: str, device: Any = None) -> BlockKernel:
        """This kernel with its platform-dependent defaults settled for `platform` (the mesh's,
        `zoo.partitioning.mesh_platform`; `device`: one of the mesh's devices when they are
        not the process's default platform, e.g. a TPU topology's on a CPU host); the base
        class has none."""
        return self

    def partial_plans(self, L: int, S: int) -> tuple:
        return (True,)

    def pick_plan(self, plans, scores, q_pos, kv_pos, q_seg, kv_seg):
        return jnp.int32(0)

    def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, scores: Scores, masked: bool):
        raise NotImplementedError

    def backward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, dout, *,
                 scores: Scores, masked: bool):
        raise NotImplementedError


_KERNELS: dict[str, BlockKernel] = {}


def register_kernel(name: str, kernel: BlockKernel) -> None:
    """Make ``kernel`` available as ``zoo.ops.attention(..., kernel=name)``."""
    if not isinstance(name, str) or name == "auto":
        raise ValueError(f"kernel name {name!r} must be a string other than 'auto'")
    if not (callable(getattr(kernel, "forward", None))
            and callable(getattr(kernel, "backward", None))):
        raise ValueError(f"kernel {kernel!r} needs forward(...) and backward(...) methods; see "
                         f"zoo.ops.kernels.BlockKernel")
    _KERNELS[name] = kernel


def kernel_names() -> tuple[str, ...]:
    return ("auto", *_KERNELS)


def get_kernel(kernel: str | BlockKernel, platform: str | None = None,
               device: Any = None) -> BlockKernel:
    """A kernel instance from a name (``"auto"``, ``"flash"``, ``"tokamax"``, registered ones)
    or the instance itself, settled for `platform` (``"cpu"``/``"gpu"``/``"tpu"``, the mesh's;
    None: the default device's). ``"auto"`` is tokamax on GPU, zoo's Mosaic kernel
    (`zoo.ops.pallas_tpu`, ``"pallas_tpu"``) on TPU and flash on CPU. Not tokamax on TPU: its
    Mosaic kernel takes only unbatched masks ("Only unbatched boolean masks are supported",
    tokamax 0.0.12), so packed documents would send it to its XLA implementation, which builds
    each block's whole logits; zoo's Mosaic kernel evaluates zoo's masks in the kernel."""
    if platform is None:
        from zoo.partitioning import mesh_platform
        platform = mesh_platform(None)
    if not isinstance(kernel, str):
        if not callable(getattr(kernel, "forward", None)):
            raise ValueError(f"kernel={kernel!r} is neither a registered name "
                             f"{kernel_names()} nor an object with forward/backward methods")
        return kernel.for_platform(platform, device)
    if kernel == "auto":
        kernel = {"gpu": "tokamax", "tpu": "pallas_tpu"}.get(platform, "flash")
    if kernel not in _KERNELS:
        raise ValueError(f"kernel={kernel!r} is not registered; valid names are "
                         f"{', '.join(map(repr, kernel_names()))} (or register_kernel(name, k))")
    return _KERNELS[kernel].for_platform(platform, device)


# -- tokamax ---------------------------------------------------------------------------------

def _dense_mask(scores, q_pos, kv_pos, q_seg, kv_seg):
    """[B, 1, L, S] bool of this block (tokamax takes a boolean mask)."""
    return evaluate(scores.mask, q_pos[:, None, :, None], kv_pos[:, None, None, :],
                    q_seg[:, None, :, None], kv_seg[:, None, None, :])


@dataclasses.dataclass(frozen=True)
class TokamaxKernel(BlockKernel):
    """tokamax's dot-product attention as a block kernel.

    Forward: the op with ``return_residuals=True`` (residuals (max, denominator) give the lse).
    Backward: the op's own VJP op (Pallas Triton / Mosaic GPU / Mosaic TPU), given the global
    output and residuals ``(lse, 1)``: it computes ``delta = sum(dout * out)`` and
    ``p = exp(s - max) / denominator`` from them, which are then the global quantities.

    tokamax's XLA implementation (what runs on CPU) has no VJP op: its backward is autodiff of
    the forward, which recomputes a *block-local* softmax. There the kernel makes the local
    softmax equal the global one by appending, per query, one extra key with a zero key vector
    whose logit (a bias) carries the mass of every other block and the sinks and whose value is
    their mean value, ``(out - w * out_block) / (1 - w)``; autodiff of that augmented call is
    the exact block gradient. That costs one forward and an [L, S+L] logit block: a testing
    path, and one that cannot take a soft cap (the cap would bend the extra logit).

    ``implementation``: tokamax's names, tried in order (None: Mosaic (GPU/TPU), Triton (GPU),
    then XLA). ``device``: a device of the target mesh when it is not of the process's default
    platform (`zoo.Partitioner.target_device`, as `zoo.ops.moe_execution.MoEExecution.device`
    for the MoE's kernels: a static field, so the backward, traced later, sees it too); the ops are
    traced with it as the default device, which is where tokamax looks for the platform (its
    Mosaic kernels refuse a CPU default device even for a TPU mesh).
    The mask is passed as a dense boolean [B, 1, L, S] block; `ScoreMod` is not supported.

    ``pad_to``: block lengths are padded to a multiple of it with keys and queries the mask
    hides (outputs and gradients sliced back), for kernels that need whole tiles (Mosaic TPU's
    splash attention: 128; set on TPU by `for_platform`). The XLA backward runs unpadded.
    """
    implementation: tuple[str, ...] | None = None
    device: Any = dataclasses.field(default=None, compare=False)
    pad_to: int | None = None

    def for_platform(self, platform: str, device: Any = None) -> TokamaxKernel:
        names = self.implementation or (
            ("mosaic_gpu", "triton", "xla") if platform == "gpu"
            else ("mosaic_tpu", "xla") if platform == "tpu" else ("xla",))
        pad = self.pad_to or (128 if platform == "tpu" else None)
        return dataclasses.replace(self, implementation=names, device=device or self.device,
                                   pad_to=pad)

    def _pads(self, L: int, S: int) -> tuple[int, int]:
        if not self.pad_to:
            return 0, 0
        return -L % self.pad_to, -S % self.pad_to

    def _padded_mask(self, mask, B: int, L: int, S: int, pq: int, pk: int):
        mask = jnp.ones((B, 1, L, S), bool) if mask is None else mask
        return jnp.pad(mask, ((0, 0), (0, 0), (0, pq), (0, pk)))

    def _ops(self):
        from absl import flags

        from zoo._jax_compat import tokamax_attention_implementations
        if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; the host program may not
            flags.FLAGS.mark_as_parsed()  # use absl (pytest's own -q would be "unknown")
        from zoo.partitioning import mesh_platform
        names = self.implementation or self.for_platform(mesh_platform(None)).implementation
        implementations = tokamax_attention_implementations()  # imported lazily: optional
        return [implementations[n] for n in names]

    def _kwargs(self, scores, masked, q_pos, kv_pos, q_seg, kv_seg):
        if scores.score_mod is not None:
            raise ValueError("kernel='tokamax' does not take a ScoreMod; use kernel='flash'")
        mask = _dense_mask(scores, q_pos, kv_pos, q_seg, kv_seg) if masked else None
        return mask, dict(logits_scale=scores.scale, logits_soft_cap=scores.soft_cap)

    def _call(self, fn):
        errors = []
        for op in self._ops():
            try:
                with self._on_device():
                    return op, fn(op)
            except NotImplementedError as e:
                errors.append(e)
        raise NotImplementedError(f"no tokamax implementation runs here: {errors}")

    def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, scores, masked):
        mask, kw = self._kwargs(scores, masked, q_pos, kv_pos, q_seg, kv_seg)
        (B, L), S = q.shape[:2], k.shape[1]
        pq, pk = self._pads(L, S)
        if pq or pk:  # whole tiles: hidden queries and keys, sliced off
            mask = self._padded_mask(mask, B, L, S, pq, pk)
            q = _pad_length(q, pq)
            k, v = _pad_length(k, pk), _pad_length(v, pk)
            out, lse = self._forward(q, k, v, mask, kw)
            return out[:, :L], lse[..., :L]
        return self._forward(q, k, v, mask, kw)

    def _forward(self, q, k, v, mask, kw):
        op, (out, (m, second)) = self._call(
            lambda op: op(q, k, v, mask=mask, return_residuals=True, **kw))
        lse = (second.astype(F32) if _lse_residuals(op)
               else m.astype(F32) + jnp.log(second.astype(F32)))
        out = out.astype(F32)
        if mask is not None:  # tokamax masks with a finite minimum: empty rows are not empty
            seen = jnp.any(mask, axis=-1)  # [B, 1, L]
            lse = jnp.where(seen, lse, -jnp.inf)
            out = jnp.where(jnp.moveaxis(seen, 1, 2)[..., None], out, 0.0)
        return out, lse

    def backward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, dout, *, scores,
                 masked):
        mask, kw = self._kwargs(scores, masked, q_pos, kv_pos, q_seg, kv_seg)
        (B, L), S = q.shape[:2], k.shape[1]
        pq, pk = self._pads(L, S)
        lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        if pq or pk:
            padded = self._padded_mask(mask, B, L, S, pq, pk)
            qp, kp, vp = _pad_length(q, pq), _pad_length(k, pk), _pad_length(v, pk)
            op, _ = self._call(lambda op: op(qp, kp, vp, mask=padded, **kw))
            if op.vjp is not None:
                dq, dk, dv = self._vjp(op, qp, kp, vp, padded, kw, jnp.pad(
                    lse_safe, ((0, 0), (0, 0), (0, pq))), _pad_length(out, pq),
                    _pad_length(dout, pq))
                return dq[:, :L], dk[:, :S], dv[:, :S]
        else:  # the op whose forward runs here (an unused forward call is removed by XLA)
            op, _ = self._call(lambda op: op(q, k, v, mask=mask, **kw))
            if op.vjp is not None:
                return self._vjp(op, q, k, v, mask, kw, lse_safe, out, dout)
        # an op without a VJP op (XLA's, any length): autodiff of an augmented call
        if scores.soft_cap is not None:
            raise ValueError("kernel='tokamax' on its XLA implementation (CPU) cannot take "
                             "logits_soft_cap under context parallelism; use kernel='flash'")
        return self._xla_backward(op, q, k, v, mask, out, lse_safe, dout, scores,
                                  (q_pos, kv_pos, q_seg, kv_seg))

    def _on_device(self):
        """Trace with the target mesh's device as the default one (tokamax reads it there)."""
        return (contextlib.nullcontext() if self.device is None
                else jax.default_device(self.device))

    def _vjp(self, op, q, k, v, mask, kw, lse_safe, out, dout):
        """The op's own VJP op, given the global output and the global log-sum-exp as its
        residuals (``(lse, 1)`` as max and denominator, or ``(lse, lse)`` for an op whose
        second residual is the log-sum-exp)."""
        with self._on_device():
            return self._vjp_call(op, q, k, v, mask, kw, lse_safe, out, dout)

    def _vjp_call(self, op, q, k, v, mask, kw, lse_safe, out, dout):
        ba = op.bind(q, k, v, mask=mask, **kw)
        kwargs = dict(ba.kwargs)
        kwargs.pop("return_residuals", None)
        second = lse_safe if _lse_residuals(op) else jnp.ones_like(lse_safe)
        grads = op.vjp((lse_safe, second), out.astype(q.dtype),
                       dout.astype(q.dtype), *ba.args, return_residuals=False, **kwargs)
        grads = grads[0] if isinstance(grads, tuple) else grads
        return tuple(grads[n].astype(F32) for n in ("q", "k", "v"))

    def _xla_backward(self, op, q, k, v, mask, out, lse, dout, scores, tokens):
        B, L, N, H = q.shape
        _, S, K, _ = v.shape
        G = N // K
        o_b, lse_b = self.forward(q, k, v, *tokens, scores=scores, masked=mask is not None)
        w = jnp.exp(lse_b - lse)  # this block's share of each row's softmax mass, [B, N, L]
        rest = 1.0 - w
        ok = rest > 1e-6
        extra_logit = jnp.where(ok, lse + jnp.log(jnp.where(ok, rest, 1.0)), -1e30)
        wt, rt = (jnp.moveaxis(x, 1, 2)[..., None] for x in (w, jnp.where(ok, rest, 1.0)))
        v_extra = jnp.where(jnp.moveaxis(ok, 1, 2)[..., None],
                            (out.astype(F32) - wt * o_b) / rt, 0.0).astype(v.dtype)
        eye = jnp.eye(L, dtype=bool)
        bias = jnp.concatenate([jnp.zeros((B, N, L, S), F32),
                                jnp.where(eye, extra_logit[..., None], 0.0)], axis=-1)
        mask_aug = jnp.concatenate([jnp.ones((B, 1, L, S), bool) if mask is None else mask,
                                    jnp.broadcast_to(eye, (B, 1, L, L))], axis=-1)

        def attend(q, k, v):
            k = jnp.concatenate([jnp.repeat(k, G, axis=2), jnp.zeros((B, L, N, H), k.dtype)], 1)
            v = jnp.concatenate([jnp.repeat(v, G, axis=2), v_extra], 1)
            return op(q, k, v, bias=bias, mask=mask_aug, logits_scale=scores.scale)

        _, vjp = jax.vjp(attend, q, k, v)
        return tuple(g.astype(F32) for g in vjp(dout.astype(q.dtype)))


def _lse_residuals(op) -> bool:
    """Whether a tokamax attention op's residuals are ``(max, log-sum-exp)`` (Mosaic TPU, whose
    VJP reads the second as the log-sum-exp) rather than ``(max, denominator)`` (the others);
    checked on a TPU v5e, where reading Mosaic TPU's as a denominator gave NaN."""
    return type(op).__name__.startswith("PallasMosaicTpu")


def _pad_length(x, n: int):
    """`x` [B, L, ...] with `n` zero rows appended along the length."""
    return x if not n else jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))


register_kernel("tokamax", TokamaxKernel())
