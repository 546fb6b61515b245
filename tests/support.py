"""Helpers shared by the test packages (importable as ``support``: pytest puts ``tests/`` on
the path for its ``conftest.py``). Fixtures live in ``tests/conftest.py``."""

from __future__ import annotations

import jax
import numpy as np


def packed_rows(docs, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions and segment ids [len(docs), length] int32 of rows packing documents of the
    given lengths (``docs[b]``: row b's, numbered 1, 2, ... from the row's start), the rest
    of each row padding (segment id 0)."""
    pos, seg = np.zeros((len(docs), length), np.int32), np.zeros((len(docs), length), np.int32)
    for b, lengths in enumerate(docs):
        at = 0
        for d, n in enumerate(lengths, start=1):
            pos[b, at:at + n], seg[b, at:at + n] = np.arange(n), d
            at += n
    return pos, seg


def rel_err(a, b) -> float:
    """Max absolute error relative to the reference's largest magnitude."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def assert_close(actual, expected, what: str, rtol: float = 2e-5) -> None:
    """Finite, and within `rtol` of the reference's largest magnitude (floored at 1e-6)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    err = float(np.max(np.abs(actual.astype(np.float64) - expected))) / scale
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    assert err < rtol, f"{what}: max error {err:.2e} (relative to max |ref|) >= {rtol}"


def attention_fwd_bwd(fn, q, k, v, pos, seg, w):
    """``(out, dq, dk, dv)`` of `fn` over packed rows (same positions/segments for q and kv),
    the output weighted by `w` (cast to the output's dtype)."""
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, q_positions=pos, kv_positions=pos,
                                          q_segment_ids=seg, kv_segment_ids=seg), q, k, v)
    return (out, *vjp(w.astype(out.dtype)))


def weight_block_amaxes(jaxpr) -> int:
    """The ``reduce_max`` over 128x128 blocks (``[..., nr, 128, nc, 128]`` over axes -3 and -1:
    weights; activations' 1x128 and gradients' 128x1 tiles have other shapes) in `jaxpr` and
    every jaxpr nested in it (scan, while, remat, custom_vjp, shard_map, pjit)."""
    n = 0
    for eqn in jaxpr.eqns:
        shape = eqn.invars[0].aval.shape if eqn.invars else ()
        nd = len(shape)
        if (eqn.primitive.name == "reduce_max" and nd >= 4 and shape[-3] == shape[-1] == 128
                and tuple(eqn.params["axes"]) == (nd - 3, nd - 1)):
            n += 1
        for p in eqn.params.values():
            for inner in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    n += weight_block_amaxes(inner)
    return n


@jax.jit
def loss_and_grads(model, data):
    """The train step's loss (`zoo.train.step.loss_fn`) and its gradients w.r.t. the model's
    parameters."""
    from flax import nnx

    from zoo.train import step
    return nnx.value_and_grad(lambda m: step.loss_fn(m, data), has_aux=True,
                              argnums=nnx.DiffState(0, nnx.Param))(model)


def split_indexer_grads(grads) -> tuple[list[float], list[float]]:
    """The largest |gradient| of each parameter outside the indexers, and of each inside."""
    from flax import nnx

    flat = nnx.to_flat_state(grads)
    main = [float(np.max(np.abs(v[...]))) for p, v in flat if "indexer" not in p]
    index = [float(np.max(np.abs(v[...]))) for p, v in flat if "indexer" in p]
    return main, index


def sown_indexer_loss(m, x, pos, seg):
    """(out, the layer's sown indexer loss) of an attention layer with an indexer -- popped,
    so the layer keeps no intermediates."""
    from flax import nnx

    from zoo.layers.indexer import IndexerLoss
    out = m(x, positions=pos, segment_ids=seg)
    (loss,) = jax.tree.leaves(nnx.pop(m, IndexerLoss))
    return out, loss


def lm_and_indexer_losses(r, pos, seg, sown=sown_indexer_loss):
    """Two losses ``fn(layer, x) -> (loss, out)`` over packed rows: `both`, an LM-like loss
    ``sum(out * r)`` plus the layer's sown indexer loss (`sown`); `lm`, the LM-like loss of
    the plain forward."""
    import jax.numpy as jnp

    def both(m, x):
        out, loss = sown(m, x, pos, seg)
        return jnp.sum(out * r) + loss, out

    def lm(m, x):
        out = m(x, positions=pos, segment_ids=seg)
        return jnp.sum(out * r), out

    return both, lm


def value_and_grads(fn, wrt, has_aux=False):
    """A jitted ``value_and_grad`` of ``fn(layer, x)`` with respect to ``wrt``."""
    from flax import nnx
    return nnx.jit(nnx.value_and_grad(fn, argnums=wrt, has_aux=has_aux))


def assert_trees_close(a, b, rtol, atol=0.0):
    """Two NNX states with the same paths, leaf by leaf within `rtol`/`atol`."""
    from flax import nnx
    fa, fb = nnx.to_flat_state(a), nnx.to_flat_state(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, va), (_, vb) in zip(fa, fb):
        np.testing.assert_allclose(np.asarray(va[...]), np.asarray(vb[...]), rtol=rtol,
                                   atol=atol, err_msg=str(path))


def visible_keys(pos, seg, b: int, i: int) -> np.ndarray:
    """The keys query `i` of row `b` may see in packed rows: causal, same document, neither
    padding (segment id 0)."""
    return np.flatnonzero((seg[b] == seg[b, i]) & (pos[b] <= pos[b, i]) & (seg[b] != 0))


def visible_mask(idx, pos, seg, window=None) -> np.ndarray:
    """[B, L, S] bool by a plain loop over each query's selected keys `idx` [B, L, k] (-1:
    an empty slot): selected, causal, same document, neither is padding, and with `window`
    fewer than `window` positions back."""
    B, L = seg.shape
    vis = np.zeros((B, L, L), bool)
    for b in range(B):
        for i in range(L):
            for j in idx[b, i]:
                if j < 0 or seg[b, i] == 0 or seg[b, j] != seg[b, i] or pos[b, j] > pos[b, i]:
                    continue
                if window is not None and pos[b, i] - pos[b, j] >= window:
                    continue
                vis[b, i, j] = True
    return vis
