"""FP8 numerics made visible: `zoo.ops.fp8.quantize_stats` against a NumPy count written here
(outliers, tiny blocks, zeros, partial blocks, both FP8 dtypes), the layers' recorded
`Fp8Stats`, and the train step's ``fp8/saturated_blocks`` / ``fp8/underflow`` metrics (absent
without FP8) as the Trainer logs them."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from zoo.layers import Linear, MoE
from zoo.layers.linear import Fp8Stats
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
from zoo.ops import fp8
from zoo.train.hooks import SCALARS, metrics_row
from zoo.train.step import fp8_metrics, make_train_step, make_tx, pop_fp8_stats

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
TINY = np.float32(np.finfo(np.float32).tiny)


def np_stats(x, block, dtype=E4M3, power_of_two=False):
    """(blocks, saturated blocks, nonzero values, underflowed values) by a loop over the blocks
    of each 2-D slice: the block's scale as DeepSeek-V3 sets it, the values cast with
    ml_dtypes; a block saturates when its scale is at an extreme (the scale-1 fallback of a
    nonzero block, a non-finite value) or a value clips."""
    x = np.asarray(x, np.float32)
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    out = np.zeros(4)
    for sl in x.reshape(-1, *x.shape[-2:]):
        (rows, cols), (br, bc) = sl.shape, block
        for i in range(math.ceil(rows / br)):
            for j in range(math.ceil(cols / bc)):
                blk = sl[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                amax = np.abs(blk).max()
                s = amax * np.float32(1 / fmax)
                if power_of_two and 0 < s < np.inf:
                    s = np.float32(2.0 ** math.ceil(math.log2(float(s))))
                fallback = not s >= TINY
                s = np.float32(1) if fallback else s
                quot = blk * (np.float32(1) / s)
                clipped = np.any(np.abs(quot) > fmax * (1 + 2.0 ** -20))
                q = np.clip(quot, -fmax, fmax).astype(dtype).astype(np.float32)
                out[0] += 1
                out[1] += (fallback and amax > 0) or not np.isfinite(amax) or clipped
                out[2] += np.sum(blk != 0)
                out[3] += np.sum((blk != 0) & (q == 0))
    return out


def crafted(shape, seed=0):
    """Normal values with, per block row, an outlier that crushes its neighbours, a row of
    tiny values whose amax/448 is below the smallest normal float32, and a zero row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 0, 5] = 3e4          # outlier: the other values of its tile scale down to 0
    x[..., 1, :] *= 1e-4        # small values: some fall under e4m3's smallest subnormal
    x[..., 1, 7] = 1.0          # ... next to a normal one in the same tile
    # amax/448 < the smallest normal float32 (the values themselves normal: XLA flushes
    # float32 subnormals to zero): scale 1, every value underflows
    x[..., 2, :] = 1e-37 * (1 + np.abs(x[..., 2, :]))
    x[..., 3, :] = 0            # an all-zero row: exact, not saturated
    return x


@pytest.mark.parametrize("block,dtype,p2,shape", [
    ((1, 128), jnp.float8_e4m3fn, False, (6, 300)),
    ((1, 128), jnp.float8_e5m2, False, (6, 300)),
    ((1, 128), jnp.float8_e4m3fn, True, (6, 300)),
    ((128, 128), jnp.float8_e4m3fn, False, (2, 130, 260)),  # experts' weights: batch dim
    ((128, 1), jnp.float8_e4m3fn, False, (8, 130)),  # wgrad's dy tiles: transposed below
])
def test_quantize_stats_counts_like_numpy(block, dtype, p2, shape):
    x = crafted(shape)
    if block == (128, 1):
        x = x.T.copy()
    if block == (128, 128):  # a whole weight block of tiny values
        x[0, :128, :128] = 1e-37 * (1 + np.minimum(np.abs(x[0, :128, :128]), 1))
    got = np.asarray(fp8.quantize_stats(jnp.asarray(x), block=block, dtype=dtype,
                                        power_of_two=p2))
    want = np_stats(x, block, E4M3 if dtype == jnp.float8_e4m3fn else E5M2, p2)
    np.testing.assert_array_equal(got, want)
    assert want[1] > 0 and want[3] > 0  # the crafted input saturates and underflows
    assert fp8.STATS == ("blocks", "saturated_blocks", "nonzero", "underflow")


def test_non_finite_and_clean_inputs():
    x = np.ones((2, 256), np.float32)
    np.testing.assert_array_equal(fp8.quantize_stats(jnp.asarray(x)), [4, 0, 512, 0])
    x[1, 200] = np.inf  # no finite scale holds this tile
    np.testing.assert_array_equal(fp8.quantize_stats(jnp.asarray(x))[:2], [4, 1])
    np.testing.assert_array_equal(fp8.quantize_stats(jnp.zeros((3, 128))), [3, 0, 0, 0])


def test_linear_records_its_operands_and_metrics_are_fractions():
    layer = Linear(192, (2, 80), in_axes=("embed",), out_axes=("heads", "head_dim"),
                   fp8="blockwise", rngs=nnx.Rngs(0))
    k = layer.kernel[...]  # rows 0-127 tiny (normal) values: those blocks take scale 1
    layer.kernel[...] = k.at[:128].set(jnp.sign(k[:128]) * 1e-37 * (1 + jnp.abs(k[:128])))
    x = jnp.asarray(crafted((2, 5, 192)))
    layer(x)
    want = np_stats(np.asarray(x).reshape(10, 192), (1, 128)) + np_stats(
        np.asarray(layer.kernel[...]).reshape(192, 160), (128, 128))
    np.testing.assert_array_equal(np.asarray(layer.fp8_stats[...]), want)
    assert want[1] >= 2  # the two weight blocks of the scaled-down rows
    m = fp8_metrics(jnp.asarray(want, jnp.float32))
    np.testing.assert_allclose(m["fp8/saturated_blocks"], want[1] / want[0], rtol=1e-6)
    np.testing.assert_allclose(m["fp8/underflow"], want[3] / want[2], rtol=1e-6)
    # a layer without FP8 records nothing
    plain = Linear(192, 160, in_axes=("embed",), out_axes=("mlp",), rngs=nnx.Rngs(0))
    plain(x)
    assert not jax.tree.leaves(nnx.state(plain, Fp8Stats))
    # a jax transform that closes over an FP8 layer runs it; the layer records nothing
    closed = Linear(192, 160, in_axes=("embed",), out_axes=("mlp",), fp8="blockwise",
                    rngs=nnx.Rngs(0))
    assert jax.jit(lambda x: closed(x))(x).shape == (2, 5, 160)
    assert not jax.tree.leaves(nnx.state(closed, Fp8Stats))


B, L, V = 2, 16, 64


class TinyLM(nnx.Module):
    """Embedding -> one `Linear` (FP8 or not) -> a float32 head: the smallest model the train
    step takes (``logits, aux = model(tokens, positions=, segment_ids=)``)."""

    def __init__(self, fp8_mode, *, rngs):
        self.embed = nnx.Embed(V, 160, rngs=rngs)
        self.proj = Linear(160, 96, in_axes=("embed",), out_axes=("mlp",), fp8=fp8_mode,
                           rngs=rngs)
        self.head = nnx.Linear(96, V, rngs=rngs)

    def __call__(self, tokens, *, positions=None, segment_ids=None):
        return self.head(jax.nn.gelu(self.proj(self.embed(tokens)))), {}


def _batch():
    tok = jax.random.randint(jax.random.key(1), (B, L), 0, V)
    return dict(inputs=tok, targets=jnp.roll(tok, -1, axis=1),
                positions=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
                segment_ids=jnp.ones((B, L), jnp.int32), loss_weights=jnp.ones((B, L)))


def test_train_step_reports_fp8_metrics():
    model = TinyLM("blockwise", rngs=nnx.Rngs(0))
    table = np.asarray(model.embed.embedding[...]).copy()
    table[3] = 1e-37 * (1 + np.minimum(np.abs(table[3]), 1))  # token 3: tiles at scale 1
    model.embed.embedding[...] = jnp.asarray(table)
    k = np.asarray(model.proj.kernel[...]).copy()
    k[:, :10] *= 1e-4  # small weights beside normal ones in their blocks: some underflow
    model.proj.kernel[...] = jnp.asarray(k)
    batch = _batch()
    batch["inputs"] = batch["inputs"].at[0, :4].set(3)
    step = make_train_step()
    _, _, metrics = step(model, nnx.Optimizer(model, make_tx(), wrt=nnx.Param), batch, 1e-3)
    # the FP8 operands, recomputed in NumPy: the embedded tokens and the kernel
    x = table[np.asarray(batch["inputs"]).reshape(-1)]
    blocks, sat, nonzero, under = np_stats(x, (1, 128)) + np_stats(k, (128, 128))
    assert sat >= 4 * 2 and under > 0  # token 3's two tiles at four places, at least
    np.testing.assert_allclose(metrics["fp8/saturated_blocks"], sat / blocks, rtol=1e-6)
    np.testing.assert_allclose(metrics["fp8/underflow"], under / nonzero, rtol=1e-6)
    assert not jax.tree.leaves(nnx.state(model, Fp8Stats))  # popped inside the step

    # as the Trainer logs them: metrics.jsonl columns and the scalar loggers' list
    class Feed:
        step, t_data = 1, 0.0
    out = {k: np.asarray(v) for k, v in metrics.items()}
    row = metrics_row(Feed, out, dt=1.0, tokens_per_step=B * L, flops_per_token=1.0)
    assert row["fp8/saturated_blocks"] == pytest.approx(sat / blocks, rel=1e-6)
    assert row["fp8/underflow"] == pytest.approx(under / nonzero, rel=1e-6)
    assert {"fp8/saturated_blocks", "fp8/underflow"} <= set(SCALARS)

    # without FP8 the step computes no statistics and reports none
    plain = TinyLM(None, rngs=nnx.Rngs(0))
    shapes = jax.eval_shape(step, plain, nnx.Optimizer(plain, make_tx(), wrt=nnx.Param),
                            batch, 1e-3)[2]
    assert "loss" in shapes and not any(k.startswith("fp8/") for k in shapes)


DEEPSEEK = DeepSeek3Config.mini(vocab_size=V, hidden_size=64, intermediate_size=96,
                                moe_intermediate_size=32, num_hidden_layers=2,
                                n_routed_experts=4, n_group=2, topk_group=1,
                                num_experts_per_tok=2, fp8="blockwise")


def expected_blocks(model, tokens):
    """Blocks quantised in one forward, counted from the shapes: each FP8 `Linear` quantises
    its input per 1x128 tile and its kernel per 128x128 block (per stacked layer); each MoE
    its tokens and its experts' three weights."""
    total = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, Linear) and m.fp8:
            k, n = math.prod(m.in_features), math.prod(m.out_features)
            layers = m.kernel[...].size // (k * n)
            total += layers * (tokens * -(-k // 128) + -(-k // 128) * -(-n // 128))
        if isinstance(m, MoE):
            e, f, d = m.wo.shape[-3:]
            layers = m.wo[...].size // (e * f * d)
            total += layers * (tokens * -(-d // 128) + 3 * e * -(-d // 128) * -(-f // 128))
    return total


@pytest.mark.slow
def test_every_fp8_product_of_deepseek3_is_counted():
    """The mini DeepSeek-V3 (scanned layers, MTP): one forward records every FP8 operand --
    the Linears (MLA's projections, the dense MLP, the shared experts, MTP's eh_proj), MLA's
    latent expansion (inside its attention op) and the routed experts' grouped matmul."""
    model = DeepSeek3(DEEPSEEK, rngs=nnx.Rngs(0))
    batch = _batch()
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state):
        m = nnx.merge(graphdef, state)
        m(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
        return pop_fp8_stats(m), nnx.state(m, Fp8Stats)

    counts, left = forward(state)
    assert not jax.tree.leaves(left)  # popped: the model keeps no intermediates
    assert counts[0] == expected_blocks(model, B * L)
    assert counts[1] == 0 and counts[3] < 1e-3 * counts[2]  # healthy at initialisation
