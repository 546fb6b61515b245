"""Qwen3-MoE's own pieces against transformers (torch fp32): per-head q/k RMSNorm attention and
the softmax top-k MoE block with both ``norm_topk_prob`` values, forward and gradients (input
and every parameter), unsharded and on meshes that shard heads / experts; the construction
errors of the qk-norm option. The whole model's parity, round trip, strategies and parameter
count are the conformance suite's (``tests/models/conformance.py``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

import zoo
from support import assert_close as _assert_close
from zoo.layers.attention import Attention
from zoo.layers.moe import MoE
from zoo.layers.rope import RoPE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3  # noqa: E402

B, L, D = 4, 16, 32
N, K, H = 4, 2, 8  # heads, kv heads, head dim
E, TOPK, F = 8, 2, 12  # experts, experts per token, expert width
EPS = 1e-6
TOL = 1e-4  # fp32, relative to the largest reference value (observed ~1e-7)


def assert_close(actual, expected, what):
    _assert_close(actual, expected, what, rtol=TOL)


def hf_config(**kw):
    kw = dict(dict(hidden_size=D, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
                   num_experts=E, num_experts_per_tok=TOPK, moe_intermediate_size=F,
                   rms_norm_eps=EPS, max_position_embeddings=64,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), **kw)
    cfg = transformers.Qwen3MoeConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    ct = rng.normal(size=(B, L, D)).astype(np.float32)
    return x, ct


def perturb_norms(module: torch.nn.Module):
    """Norm scales away from 1, so a missing or misplaced norm cannot hide."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))


def torch_value_and_grads(module, x, ct, **kw):
    """y, dx and {param name: grad} of sum(module(x) * ct)."""
    module.zero_grad()
    xt = torch.tensor(x, requires_grad=True)
    y = module(xt, **kw)
    y = y[0] if isinstance(y, tuple) else y
    (y * torch.tensor(ct)).sum().backward()
    grads = {n: p.grad.numpy().copy() for n, p in module.named_parameters()}
    return y.detach().numpy(), xt.grad.numpy(), grads


def zoo_value_and_grads(module, x, ct, **kw):
    """y, dx and d(params) (a pure dict) of sum(module(x) * ct), jitted."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params, x):
        y = nnx.merge(graphdef, params, rest)(x, **kw)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y * ct), y

    (_, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, jnp.asarray(x))
    return np.asarray(y), np.asarray(gx), nnx.to_pure_dict(gp)


MESHES = {  # name -> (strategy, mesh sizes)
    "fsdp2_tp4": ("fsdp", dict(fsdp=2, tensor=4)),  # q heads split 4 ways, kv heads replicated
    "cp2_tp2_data2": ("cp", dict(data=2, context=2, tensor=2)),
    "ep4_tp2": ("fsdp", dict(expert=4, tensor=2)),  # experts 4 ways, their width 2 ways
}


def partitioner(mesh):
    if mesh is None:
        return None
    strategy, sizes = MESHES[mesh]
    return zoo.Partitioner(zoo.make_mesh(**sizes), strategy)


# -- attention: per-head RMSNorm on q and k --------------------------------------------------

@pytest.fixture(scope="module")
def hf_attention():
    torch.manual_seed(0)
    cfg = hf_config()
    attn = hf_qwen3.Qwen3MoeAttention(cfg, layer_idx=0).float()
    perturb_norms(attn)
    x, ct = inputs()
    pos = np.broadcast_to(np.arange(L), (B, L))
    cos, sin = hf_qwen3.Qwen3MoeRotaryEmbedding(cfg)(torch.tensor(x), torch.tensor(pos))
    causal = np.where(np.tril(np.ones((L, L), bool)), 0.0, np.finfo(np.float32).min)
    mask = torch.tensor(np.broadcast_to(causal, (B, 1, L, L)).astype(np.float32))
    ref = torch_value_and_grads(attn, x, ct, position_embeddings=(cos, sin),
                                attention_mask=mask)
    return attn, ref


def put(variable: nnx.Variable, value: np.ndarray):
    """Replace a (possibly sharded) parameter's value, keeping its sharding."""
    assert variable.shape == value.shape, (variable.shape, value.shape)
    variable.set_value(jax.device_put(value, variable[...].sharding))


def load_attention(attn, module: Attention):
    w = {n: p.detach().numpy() for n, p in attn.named_parameters()}
    put(module.q_proj.kernel, w["q_proj.weight"].T.reshape(D, N, H))
    put(module.k_proj.kernel, w["k_proj.weight"].T.reshape(D, K, H))
    put(module.v_proj.kernel, w["v_proj.weight"].T.reshape(D, K, H))
    put(module.o_proj.kernel, w["o_proj.weight"].T.reshape(N, H, D))
    put(module.q_norm.scale, w["q_norm.weight"])
    put(module.k_norm.scale, w["k_norm.weight"])


@pytest.mark.parametrize("mesh", [None, "fsdp2_tp4", "cp2_tp2_data2"])
def test_qk_norm_attention_matches_hugging_face(hf_attention, mesh):
    attn, (y_hf, gx_hf, g_hf) = hf_attention
    p = partitioner(mesh)
    module = Attention(num_heads=N, num_kv_heads=K, head_dim=H, inputs_shape=(B, L, D),
                       partitioner=p, rope=RoPE(theta=10000.0), qk_norm=True, qk_norm_eps=EPS,
                       rngs=nnx.Rngs(0))
    load_attention(attn, module)
    x, ct = inputs()
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    y, gx, g = zoo_value_and_grads(module, x, ct, positions=pos)
    assert_close(y, y_hf, "output")
    assert_close(gx, gx_hf, "dx")
    for name in ("q_proj", "k_proj", "v_proj"):  # kernels [D, *out]; HF weights [out, D]
        assert_close(g[name]["kernel"].reshape(D, -1).T, g_hf[f"{name}.weight"], f"d {name}")
    assert_close(g["o_proj"]["kernel"].reshape(N * H, D).T, g_hf["o_proj.weight"], "d o_proj")
    assert_close(g["q_norm"]["scale"], g_hf["q_norm.weight"], "d q_norm")
    assert_close(g["k_norm"]["scale"], g_hf["k_norm.weight"], "d k_norm")
    if p is not None:  # the norm scales are whole on every device
        assert module.q_norm.scale[...].sharding.is_fully_replicated


def test_qk_norm_off_by_default_and_errors():
    kw = dict(num_heads=N, num_kv_heads=K, head_dim=H, inputs_shape=(B, L, D),
              partitioner=None, rngs=nnx.Rngs(0))
    plain = Attention(**kw)
    assert plain.q_norm is None and plain.k_norm is None
    assert "q_norm" not in nnx.to_pure_dict(nnx.state(plain, nnx.Param))
    with pytest.raises(ValueError, match=r"qk_norm='yes' must be True"):
        Attention(**kw, qk_norm="yes")
    with pytest.raises(ValueError, match=r"qk_norm_eps=0.0 must be a positive number"):
        Attention(**kw, qk_norm=True, qk_norm_eps=0.0)


# -- the sparse MoE block: softmax top-k, norm_topk_prob --------------------------------------

def load_moe(block, module: MoE):
    w = {n: p.detach().numpy() for n, p in block.named_parameters()}
    gate_up = w["experts.gate_up_proj"]  # [E, 2F, D]: gate rows, then up rows
    put(module.router, w["gate.weight"].T)
    put(module.wi_gate, gate_up[:, :F].transpose(0, 2, 1))
    put(module.wi_up, gate_up[:, F:].transpose(0, 2, 1))
    put(module.wo, w["experts.down_proj"].transpose(0, 2, 1))


@pytest.mark.parametrize("norm_topk_prob,mesh", [(True, None), (False, None),
                                                 (False, "ep4_tp2")])
def test_sparse_moe_block_matches_hugging_face(norm_topk_prob, mesh):
    torch.manual_seed(0)
    block = hf_qwen3.Qwen3MoeSparseMoeBlock(hf_config(norm_topk_prob=norm_topk_prob)).float()
    with torch.no_grad():  # transformers leaves these uninitialised (torch.empty)
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    x, ct = inputs()
    y_hf, gx_hf, g_hf = torch_value_and_grads(block, x, ct)
    module = MoE(num_experts=E, num_experts_per_tok=TOPK, mlp_dim=F, inputs_shape=(B, L, D),
                 partitioner=partitioner(mesh), scoring="softmax",
                 norm_topk_prob=norm_topk_prob, rngs=nnx.Rngs(0))
    load_moe(block, module)
    y, gx, g = zoo_value_and_grads(module, x, ct)
    assert_close(y, y_hf, "output")
    assert_close(gx, gx_hf, "dx")
    assert_close(g["router"].T, g_hf["gate.weight"], "d router")
    g_gate_up = np.concatenate([g["wi_gate"], g["wi_up"]], -1).transpose(0, 2, 1)
    assert_close(g_gate_up, g_hf["experts.gate_up_proj"], "d gate_up_proj")
    assert_close(g["wo"].transpose(0, 2, 1), g_hf["experts.down_proj"], "d down_proj")
    if not norm_topk_prob:  # the weights of a token then sum to less than one
        weights, _, _ = module.route(jnp.asarray(x))
        assert float(jnp.max(weights.sum(-1))) < 1 - 1e-3


# -- which layers are sparse ------------------------------------------------------------------

PATTERNS = [  # (num_hidden_layers, decoder_sparse_step, mlp_only_layers, num_experts)
    (4, 1, (), E), (5, 2, (), E), (6, 3, (0, 5), E), (4, 1, (0, 1), E), (3, 1, (), 0)]


@pytest.mark.parametrize("layers,step,mlp_only,experts", PATTERNS)
def test_layer_kinds_and_runs_follow_transformers(layers, step, mlp_only, experts):
    from zoo.models.stacks import layer_cycles
    from zoo.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig, Qwen3MoeDecoderLayer
    cfg = hf_config(num_hidden_layers=layers, decoder_sparse_step=step,
                    mlp_only_layers=list(mlp_only), num_experts=experts, vocab_size=64)
    with torch.device("meta"):
        hf_model = transformers.Qwen3MoeForCausalLM(cfg)
    hf_kinds = [isinstance(layer.mlp, hf_qwen3.Qwen3MoeSparseMoeBlock)
                for layer in hf_model.model.layers]
    config = Qwen3MoeConfig.from_hf_config(cfg.to_dict())
    assert [config.is_moe_layer(i) for i in range(layers)] == hf_kinds
    cycles = layer_cycles(Qwen3MoeDecoderLayer, config, scan=True)
    # spans covering every layer once, each a run of one kind (period 1) or whole cycles of
    # kinds repeating with their period (decoder_sparse_step=2: dense, MoE, dense, MoE, ...)
    assert [i for first, n, _ in cycles for i in range(first, first + n)] == list(range(layers))
    assert all(hf_kinds[i] == hf_kinds[first + (i - first) % period]
               for first, n, period in cycles for i in range(first, first + n))
    # maximal: two runs of one kind side by side differ in kind
    assert all(hf_kinds[a] != hf_kinds[b] for (a, _, p), (b, _, q) in itertools.pairwise(cycles)
               if p == q == 1)
    model = Qwen3Moe.abstract(config)
    assert [(layer.layer_idx, layer.stack_size, layer.is_moe) for layer in model.layers] == [
        (first + j, n // period, hf_kinds[first + j]) for first, n, period in cycles
        for j in range(period)]
    assert config.num_params() == sum(p.numel() for p in hf_model.parameters())
    # what one token multiplies with: every matmul weight but the experts', plus k/E of those
    named = list(hf_model.named_parameters())
    experts = sum(p.numel() for n, p in named if ".experts." in n)
    others = sum(p.numel() for n, p in named
                 if "norm" not in n and "embed_tokens" not in n and ".experts." not in n)
    active = others + experts * TOPK // E  # experts: E per MoE layer, TOPK of them used
    assert config.active_matmul_params() == active


def test_flops_per_token_by_hand():
    from zoo.models.qwen3_moe import Qwen3MoeConfig
    c = Qwen3MoeConfig.qwen3_30b_a3b()
    attn_w = 2048 * 128 * (2 * 32 + 2 * 4)  # q, k, v, o projections
    active = 48 * (attn_w + 2048 * 128 + 8 * 3 * 2048 * 768) + 2048 * 151936
    assert c.active_matmul_params() == active  # ~3.3B: the "A3B"
    attn = 48 * 2 * 32 * 256 * 2048.5  # scores + values, 2048.5 keys on average at 4096
    assert c.flops_per_token(4096) == pytest.approx(6 * active + 3 * attn)
    windowed = Qwen3MoeConfig.qwen3_30b_a3b(use_sliding_window=True, sliding_window=1024)
    assert windowed.flops_per_token(4096) == pytest.approx(6 * active + 3 * attn / 2048.5 * 1024)
    # a window in config.json without use_sliding_window is not in effect (as in transformers)
    assert Qwen3MoeConfig.qwen3_30b_a3b(sliding_window=1024).window is None


def test_config_errors():
    from zoo.models.qwen3_moe import Qwen3MoeConfig
    with pytest.raises(ValueError, match=r"mlp_only_layers holds \[4\], not layer indices"):
        Qwen3MoeConfig.mini(mlp_only_layers=[0, 4])
    with pytest.raises(ValueError, match=r"num_experts_per_tok=20 exceeds num_experts=16"):
        Qwen3MoeConfig.mini(num_experts_per_tok=20)
    with pytest.raises(ValueError, match=r"decoder_sparse_step=0 must be a positive int"):
        Qwen3MoeConfig.mini(decoder_sparse_step=0)
    with pytest.raises(ValueError, match=r"attention_bias=True; zoo supports False"):
        Qwen3MoeConfig.from_hf_config({"attention_bias": True})
