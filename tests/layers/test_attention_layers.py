"""`Attention` and `MLA` against a plain jnp reference written here from the modules' own
parameters (forward, input and parameter gradients), unsharded and under several partitioners,
plus Hugging Face parity (Mixtral / DeepSeek-V3 attention in torch fp32), construction errors
and subclass overrides.

Inputs are packed documents of uneven lengths that cross the load-balancing chunk boundaries,
with trailing padding and one fully padded row; context-parallel runs feed the load-balanced
order (shard r holds chunks r and 2*cp-1-r), which the reference handles for free because its
mask is built from positions and segment ids.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

import zoo
import zoo.ops
from support import assert_close
from zoo.layers.attention import Attention
from zoo.layers.mla import MLA
from zoo.ops.attention import CPU_FLOPS_PER_WIRE_BYTE
from zoo.layers.rope import RoPE, YaRN

B, L, D = 4, 32, 32
DOCS = ([5, 13, 9], [20, 12], [3, 7, 11, 6], [])  # the rest of each row is padding
YARN = RoPE(theta=10000.0, interleaved=True,
            scaling=YaRN(factor=4.0, original_max_position_embeddings=8, mscale=1.0,
                         mscale_all_dim=0.8))

CONFIGS = {  # name -> (class, constructor kwargs)
    "gqa_window": (Attention, dict(num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=6)),
    "mqa": (Attention, dict(num_heads=4, num_kv_heads=1, head_dim=8)),
    "mha_bias": (Attention, dict(num_heads=4, num_kv_heads=4, head_dim=8, use_bias=True,
                                 rope=RoPE(theta=500.0))),
    "mla_qlora_yarn": (MLA, dict(num_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                 rope=YARN)),
    "mla": (MLA, dict(num_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=6,
                      qk_rope_head_dim=8, v_head_dim=8)),
}

MESHES = {  # name -> (strategy, mesh sizes, implementation, load-balanced order)
    "cp8_ring": ("cp", dict(context=8), "ring", True),
    "cp4_data2_allgather_contiguous": ("cp", dict(data=2, context=4), "all_gather", False),
    "ep_as_cp_allgather": ("ep_as_cp", dict(fsdp=2, expert=2, context=2), "all_gather", True),
    "fsdp4_tp2": ("fsdp", dict(fsdp=4, tensor=2), "auto", False),
}

CASES = [  # (config, mesh or None)
    ("gqa_window", None), ("mha_bias", None), ("mla_qlora_yarn", None), ("mla", None),
    ("gqa_window", "cp8_ring"), ("mla_qlora_yarn", "cp8_ring"),
    ("mha_bias", "cp4_data2_allgather_contiguous"),
    ("mqa", "ep_as_cp_allgather"), ("mla", "ep_as_cp_allgather"),
    ("mqa", "fsdp4_tp2"), ("mla_qlora_yarn", "fsdp4_tp2"),
    # MLA with the expanded K/V on the wire (these small dims resolve "auto" to the latent)
    ("mla_qlora_yarn", "cp8_ring", "expanded"), ("mla", "ep_as_cp_allgather", "expanded"),
]


# -- inputs ----------------------------------------------------------------------------------

def packed_inputs():
    pos = np.zeros((B, L), np.int32)
    seg = np.zeros((B, L), np.int32)
    for b, docs in enumerate(DOCS):
        start = 0
        for i, n in enumerate(docs):
            pos[b, start:start + n] = np.arange(n)
            seg[b, start:start + n] = i + 1
            start += n
    x = np.random.default_rng(0).normal(size=(B, L, D)).astype(np.float32)
    ct = np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)
    return x, pos, seg, ct


def load_balance(cp: int) -> np.ndarray:
    """Token order of the load-balanced layout: shard r holds chunks r and 2*cp-1-r."""
    chunks = np.arange(L).reshape(2 * cp, L // (2 * cp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]])
                           for r in range(cp)])


def numpy_mask(pos, seg, window):
    qp, kp = pos[:, :, None], pos[:, None, :]
    qs, ks = seg[:, :, None], seg[:, None, :]
    m = (qs == ks) & (qs != 0) & (kp <= qp)
    if window is not None:
        m &= (qp - kp) < window
    return m


# -- the plain reference ---------------------------------------------------------------------

def rotate(x, pos, rope: RoPE):
    """RoPE written out: angle pos*inv_freq; pairs (i, i+H/2) or (2i, 2i+1)."""
    if x.shape[-1] == 0:
        return x
    inv = jnp.asarray(rope.inv_freq(x.shape[-1]))
    ang = pos[..., None].astype(jnp.float32) * inv
    cos = (jnp.cos(ang) * rope.cos_sin_factor())[:, :, None]
    sin = (jnp.sin(ang) * rope.cos_sin_factor())[:, :, None]
    if rope.interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return jnp.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(x.shape)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def softmax_attend(q, k, v, mask, scale):
    """q [B,L,N,H], k [B,S,N,H], v [B,S,N,Hv]; rows that see nothing are zero."""
    s = jnp.einsum("blnh,bsnh->bnls", q, k, precision="highest") * scale
    s = jnp.where(mask[:, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1) * mask[:, None]
    return jnp.einsum("bnls,bsnh->blnh", p, v, precision="highest")


def dense(x, p, n_in=1):
    y = jnp.tensordot(x, p["kernel"], axes=n_in, precision="highest")
    return y + p["bias"] if "bias" in p else y


def rms(x, p, eps=1e-6):
    return p["scale"] * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


def attention_reference(params, x, pos, mask, *, kw, rope=True):
    N, K, H = kw["num_heads"], kw["num_kv_heads"], kw["head_dim"]
    q, k, v = (dense(x, params[n]) for n in ("q_proj", "k_proj", "v_proj"))
    if rope:
        r = kw.get("rope") or RoPE(theta=10000.0)
        q, k = rotate(q, pos, r), rotate(k, pos, r)
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)  # head n -> n // (N/K)
    return dense(softmax_attend(q, k, v, mask, H ** -0.5), params["o_proj"], 2)


def mla_reference(params, x, pos, mask, *, kw):
    N, Hn, Hr = kw["num_heads"], kw["qk_nope_head_dim"], kw["qk_rope_head_dim"]
    R = kw["kv_lora_rank"]
    r = kw.get("rope") or RoPE(theta=10000.0, interleaved=True)
    if kw["q_lora_rank"] is None:
        q = dense(x, params["q_proj"])
    else:
        q = dense(rms(dense(x, params["q_a_proj"]), params["q_a_layernorm"]), params["q_b_proj"])
    kv_a = dense(x, params["kv_a_proj_with_mqa"])
    kv = dense(rms(kv_a[..., :R], params["kv_a_layernorm"]), params["kv_b_proj"])
    k_pe = rotate(kv_a[..., None, R:], pos, r)  # one rotary key for all heads
    q = jnp.concatenate([q[..., :Hn], rotate(q[..., Hn:], pos, r)], -1)
    k = jnp.concatenate([kv[..., :Hn], jnp.broadcast_to(k_pe, (B, L, N, Hr))], -1)
    scale = (Hn + Hr) ** -0.5 * r.softmax_scale_multiplier()
    return dense(softmax_attend(q, k, kv[..., Hn:], mask, scale), params["o_proj"], 2)


def reference_for(cls):
    return attention_reference if cls is Attention else mla_reference


# -- running a module ------------------------------------------------------------------------

def build(name, partitioner=None, implementation="auto", cls=None, **extra):
    base, kw = CONFIGS[name]
    return (cls or base)(**kw, **extra, inputs_shape=(B, L, D), partitioner=partitioner,
                         implementation=implementation, rngs=nnx.Rngs(0))


def value_and_grads(module, x, pos, seg, ct):
    """Output, d(params) and dx of sum(module(x) * ct), jitted."""
    graphdef, params = nnx.split(module, nnx.Param)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x, positions=pos, segment_ids=seg)
        return jnp.sum(y * ct), y

    (_, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    host = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    return np.asarray(y), nnx.to_pure_dict(gp), np.asarray(gx), host


_REFERENCE_FNS = {}


def reference_grads(name, params, x, pos, seg, ct):
    """Reference output, d(params) and dx; one compiled function per config (mask is an arg)."""
    if name not in _REFERENCE_FNS:
        cls, kw = CONFIGS[name]
        ref = reference_for(cls)

        def loss(params, x, pos, mask, ct):
            y = ref(params, x, pos, mask, kw=kw)
            return jnp.sum(y * ct), y

        _REFERENCE_FNS[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    mask = numpy_mask(pos, seg, CONFIGS[name][1].get("sliding_window"))
    (_, y), (gp, gx) = _REFERENCE_FNS[name](params, x, pos, mask, ct)
    return np.asarray(y), gp, np.asarray(gx)


def assert_tree_close(actual, expected, what):
    flat_a = dict(jax.tree_util.tree_leaves_with_path(actual))
    flat_e = dict(jax.tree_util.tree_leaves_with_path(expected))
    assert flat_a.keys() == flat_e.keys(), f"{what}: {set(flat_a) ^ set(flat_e)}"
    for path, value in flat_e.items():
        assert_close(flat_a[path], value, f"{what} {jax.tree_util.keystr(path)}")


def strip(spec):
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


# expected kernel shardings, written out by hand per mesh (only sharded dims named)
EXPECTED_SPECS = {
    "cp8_ring": {"q_proj": ("context",), "o_proj": (None, None, "context"),
                 "kv_b_proj": ("context",), "q_b_proj": ("context",), "q_a_proj": ("context",)},
    "cp4_data2_allgather_contiguous": {"q_proj": ("context",), "o_proj": (None, None, "context")},
    "ep_as_cp_allgather": {"q_proj": (("fsdp", "context", "expert"),),
                           "kv_a_proj_with_mqa": (("fsdp", "context", "expert"),),
                           "o_proj": (None, None, ("fsdp", "context", "expert"))},
    "fsdp4_tp2": {"q_proj": ("fsdp", "tensor"), "o_proj": ("tensor", None, "fsdp"),
                  "k_proj": ("fsdp",),  # the MQA case: 1 kv head < 2 tensor shards: replicated
                  "q_b_proj": ("fsdp", "tensor"), "kv_b_proj": ("fsdp", "tensor"),
                  "q_a_proj": ("fsdp",)},
}


@pytest.mark.parametrize("name,mesh,kv_wire", [(*c, "auto")[:3] for c in CASES],
                         ids=["-".join(str(e or "unsharded") for e in c) for c in CASES])
def test_matches_reference(name, mesh, kv_wire):
    x, pos, seg, ct = packed_inputs()
    if mesh is None:
        partitioner, impl = None, "auto"
    else:
        strategy, sizes, impl, balanced = MESHES[mesh]
        partitioner = zoo.Partitioner(zoo.make_mesh(**sizes), strategy)
        if balanced:
            order = load_balance(partitioner.context_size("attention"))
            x, pos, seg, ct = x[:, order], pos[:, order], seg[:, order], ct[:, order]
    if name == "mha_bias" and mesh is None:
        seg = None  # the segment_ids=None path: one document per row, no padding
        pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    module = build(name, partitioner, impl, **({} if kv_wire == "auto" else {"kv_wire": kv_wire}))
    if isinstance(module, MLA):  # the default, "auto", is resolved at construction
        assert module.kv_wire == (kv_wire if kv_wire != "auto" else zoo.ops.choose_mla_wire(
            partitioner=partitioner, kv_lora_rank=module.kv_lora_rank, num_heads=4,
            qk_nope_head_dim=module.qk_nope_head_dim, qk_rope_head_dim=module.qk_rope_head_dim,
            v_head_dim=module.v_head_dim, itemsize=4))
        assert module.kv_wire in ("latent", "expanded")
    # "auto" is resolved once, at construction
    assert module.implementation == (impl if impl != "auto" else zoo.ops.choose_implementation(
        partitioner=partitioner, q_length=L, kv_length=L, num_heads=4,
        num_kv_heads=module.num_kv_heads, head_dim=module.q_proj.out_features[-1]
        if hasattr(module, "q_proj") else module.qk_head_dim,
        v_head_dim=module.o_proj.in_features[-1]))
    y, gp, gx, params = value_and_grads(module, x, pos, seg, ct)
    seg_ref = np.ones((B, L), np.int32) if seg is None else seg
    y_ref, gp_ref, gx_ref = reference_grads(name, params, x, pos, seg_ref, ct)
    assert_close(y, y_ref, "output")
    assert_close(gx, gx_ref, "dx")
    assert_tree_close(gp, gp_ref, "param grad")
    if seg is not None and not CONFIGS[name][1].get("use_bias"):
        assert np.all(y[seg == 0] == 0), "padding rows must be exactly zero"
    if mesh is not None:
        for sub, expected in EXPECTED_SPECS[mesh].items():
            if hasattr(module, sub):
                spec = getattr(module, sub).kernel[...].sharding.spec
                assert strip(spec) == expected, f"{sub} kernel {spec} != {expected}"


def test_bfloat16_compute_matches_fp32_reference():
    """dtype=bfloat16: bf16 activations (fp32 softmax in the op), within bf16 tolerance."""
    x, pos, seg, _ = packed_inputs()
    _, kw = CONFIGS["mla_qlora_yarn"]
    m = MLA(**kw, inputs_shape=(B, L, D), partitioner=None, dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0))
    y = jax.jit(lambda m: m(x, positions=pos, segment_ids=seg))(m)
    assert y.dtype == jnp.bfloat16
    params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    y_ref = mla_reference(params, x, pos, jnp.asarray(numpy_mask(pos, seg, None)), kw=kw)
    assert_close(np.asarray(y, np.float32), y_ref, "bf16 MLA output", rtol=2e-2)


# -- subclasses ------------------------------------------------------------------------------

def test_subclass_overrides_are_used():
    x, pos, seg, _ = packed_inputs()

    class NoPE(Attention):  # a research variant: no rotary embedding at all
        def apply_rope(self, q, k, positions):
            return q, k

    m = build("gqa_window", cls=NoPE)
    params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    y = jax.jit(lambda m: m(x, positions=pos, segment_ids=seg))(m)
    kw = CONFIGS["gqa_window"][1]
    y_ref = attention_reference(params, x, pos, jnp.asarray(numpy_mask(pos, seg, 6)), kw=kw,
                                rope=False)
    assert_close(y, y_ref, "NoPE output")
    y_rope = jax.jit(lambda m: m(x, positions=pos, segment_ids=seg))(build("gqa_window"))
    assert not np.allclose(y, y_rope, atol=1e-3), "the override changed nothing"

    calls = []

    class Doubled(MLA):  # overriding attend: the output projection is linear, so y doubles
        def attend(self, q, k, v, *, positions, segment_ids):
            calls.append(q.shape)
            return 2 * super().attend(q, k, v, positions=positions, segment_ids=segment_ids)

    run = jax.jit(lambda m: m(x, positions=pos, segment_ids=seg))
    y2, y1 = run(build("mla", cls=Doubled)), run(build("mla"))
    assert calls == [(B, L, 4, 14)]
    assert_close(y2, 2 * y1, "overridden attend")


# -- construction errors ---------------------------------------------------------------------

def _attn(p=None, **kw):
    args = dict(num_heads=4, num_kv_heads=2, head_dim=8, inputs_shape=(B, L, D), partitioner=p,
                rngs=nnx.Rngs(0))
    return Attention(**{**args, **kw})


def _mla(p=None, **kw):
    args = dict(num_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8, inputs_shape=(B, L, D), partitioner=p,
                rngs=nnx.Rngs(0))
    return MLA(**{**args, **kw})


def _p(strategy, **sizes):
    return zoo.Partitioner(zoo.make_mesh(**sizes), strategy)


ERRORS = [  # (what, thunk, message pattern)
    ("heads not a multiple of kv heads", lambda: _attn(num_heads=6, num_kv_heads=4),
     r"num_heads=6 is not a multiple of num_kv_heads=4; choose num_kv_heads among \[1, 2, 3, 6\]"),
    ("length vs 2*cp", lambda: _attn(_p("cp", context=8), inputs_shape=(B, 24, D)),
     r"length=24 is not divisible by 2\*context = 16.*pad it to 32 \(or cut it to 16\)"),
    ("length vs 2*cp, ep_as_cp", lambda: _mla(_p("ep_as_cp", fsdp=2, expert=2, context=2),
                                              inputs_shape=(B, 36, D)),
     r"length=36 is not divisible by 2\*context = 8.*pad it to 40"),
    ("heads vs tensor", lambda: _attn(_p("fsdp", fsdp=4, tensor=2), num_heads=3, num_kv_heads=1),
     r"num_heads=3 is not divisible by the tensor axis size 2"),
    ("kv heads vs tensor", lambda: _attn(_p("fsdp", fsdp=2, tensor=4), num_heads=12,
                                         num_kv_heads=6),
     r"num_kv_heads=6 and the tensor axis size 4 must divide one another"),
    ("mla heads vs tensor", lambda: _mla(_p("fsdp", fsdp=2, tensor=4), num_heads=6),
     r"MLA: num_heads=6 is not divisible by the tensor axis size 4"),
    ("batch vs shards", lambda: _attn(_p("fsdp", fsdp=8), inputs_shape=(2, L, D)),
     r"batch=2 is not divisible by its 8 shards.*multiple of 8"),
    ("embed vs shards", lambda: _attn(_p("fsdp", fsdp=8), inputs_shape=(8, L, 36)),
     r"embed=36 is not divisible by its 8 shards"),
    ("bad inputs_shape", lambda: _attn(inputs_shape=(B, L)), r"three positive ints"),
    ("bad implementation", lambda: _attn(implementation="flash"),
     r"implementation='flash'; valid values are"),
    ("mask with sliding window", lambda: _attn(mask=zoo.ops.Causal(), sliding_window=4),
     r"is the whole mask; fold sliding_window=4 into it"),
    ("bad kernel", lambda: _mla(kernel="fast"), r"MLA: kernel='fast' is not registered"),
    ("bad soft cap", lambda: _attn(logits_soft_cap=-1.0), r"logits_soft_cap=-1.0 must be"),
    ("bad sliding window", lambda: _attn(sliding_window=0), r"sliding_window=0 must be"),
    ("odd head_dim", lambda: _attn(head_dim=7), r"head_dim=7 must be even"),
    ("odd rope dim", lambda: _mla(qk_rope_head_dim=5), r"qk_rope_head_dim=5 must be even"),
    ("bad q_lora_rank", lambda: _mla(q_lora_rank=0), r"q_lora_rank=0 must be a positive int"),
    ("bad layout", lambda: _attn(layout="striped"), r"Attention: layout='striped'; valid values"),
    ("bad mla layout", lambda: _mla(layout="rows"), r"MLA: layout='rows'; valid values"),
    ("bad kv_wire", lambda: _mla(kv_wire="latents"),
     r"MLA: kv_wire='latents' must be one of \('auto', 'latent', 'expanded'\)"),
]


def test_mla_kv_wire_auto_rule():
    """kv_wire="auto": the expanded K/V under context parallelism on a CPU mesh when the
    expansion FLOPs it saves exceed CPU_FLOPS_PER_WIRE_BYTE times the bytes it adds (the mini
    DeepSeek-V3's attention: 196,608 FLOPs against 4,480 bytes per received token); the latent
    without sequence shards, where it pays less, and on accelerator meshes."""
    mini = dict(num_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, inputs_shape=(8, 32, 32), rngs=nnx.Rngs(0))
    rule = dict(kv_lora_rank=64, num_heads=8, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=32, itemsize=4)
    flops, added = 3 * 2 * 64 * 8 * 64, 2 * (8 * 80 - 80) * 4
    assert (flops, added) == (196_608, 4_480)
    assert flops > CPU_FLOPS_PER_WIRE_BYTE * added
    epcp = _p("ep_as_cp", fsdp=2, expert=4)
    auto = dict(mini, kv_wire="auto")
    assert MLA(**auto, partitioner=epcp).kv_wire == "expanded"
    assert MLA(**auto, partitioner=_p("cp", fsdp=2, context=4)).kv_wire == "expanded"
    assert MLA(**auto, partitioner=_p("fsdp", fsdp=8)).kv_wire == "latent"  # nothing crosses
    assert MLA(**auto, partitioner=None).kv_wire == "latent"
    assert MLA(**mini, partitioner=epcp).kv_wire == "expanded"  # the default is "auto"
    assert MLA(**mini, kv_wire="latent", partitioner=epcp).kv_wire == "latent"
    # a narrow latent (rank 8) expanding into many heads: 24,576 FLOPs against 4,928 bytes,
    # the bytes outweigh the FLOPs
    assert zoo.ops.choose_mla_wire(partitioner=epcp, **{**rule, "kv_lora_rank": 8}) == "latent"
    # TPU: the latent (the chip's FLOPs per wire byte are not CPU's)
    tpu = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=4, devices=_tpu_devices(8)),
                          "ep_as_cp")
    assert zoo.ops.choose_mla_wire(partitioner=tpu, **rule) == "latent"


def _tpu_devices(n):
    pytest.importorskip("libtpu", reason="the TPU compiler: pip install -e '.[test]'")
    from zoo.train import target_devices
    return target_devices(f"tpu-v5p-{n}")


@pytest.mark.parametrize("what,thunk,pattern", ERRORS, ids=[e[0] for e in ERRORS])
def test_construction_errors(what, thunk, pattern):
    with pytest.raises(ValueError, match=pattern):
        thunk()


def test_call_checks_shapes():
    m = _attn()
    x, pos, _, _ = packed_inputs()
    with pytest.raises(ValueError, match=r"expected \[B, L, D=32\]"):
        m(x[..., :16], positions=pos)
    with pytest.raises(ValueError, match=r"positions has shape \(4, 16\)"):
        m(x, positions=pos[:, :16])
    m = _attn(_p("cp", context=8))
    with pytest.raises(ValueError, match=r"length=24 is not divisible by 2\*context = 16"):
        jax.eval_shape(lambda x, pos: m(x, positions=pos), x[:, :24], pos[:, :24])


# -- Hugging Face parity ---------------------------------------------------------------------

def _torch_mask(mask):
    import torch
    additive = np.where(mask, 0.0, np.finfo(np.float32).min).astype(np.float32)
    return torch.tensor(additive[:, None])


def _hf_run(hf_attn, rotary, x, pos, mask, ct, valid):
    """HF forward and dx of sum(y * ct) over non-padding rows."""
    import torch
    xt = torch.tensor(x, requires_grad=True)
    cos, sin = rotary(xt, torch.tensor(pos, dtype=torch.long))
    y = hf_attn(xt, position_embeddings=(cos, sin), attention_mask=_torch_mask(mask))[0]
    (y * torch.tensor(ct * valid[..., None])).sum().backward()
    return y.detach().numpy(), xt.grad.numpy()


def _zoo_run(module, x, pos, seg, ct, valid):
    def loss(x):
        y = module(x, positions=pos, segment_ids=seg)
        return jnp.sum(y * ct * valid[..., None]), y

    (_, y), gx = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    return np.asarray(y), np.asarray(gx)


def _set(linear, weight, shape):
    """HF nn.Linear weight [out, in] -> our kernel [*in, *out]."""
    linear.kernel[...] = jnp.asarray(weight.detach().numpy().T.reshape(shape))


def test_hf_mixtral_attention_parity():
    torch = pytest.importorskip("torch")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import (MixtralAttention,
                                                              MixtralRotaryEmbedding)
    N, K, H, W = 4, 2, 8, 6
    cfg = MixtralConfig(hidden_size=D, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
                        sliding_window=W, max_position_embeddings=64, rope_theta=10000.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = MixtralAttention(cfg, layer_idx=0).float()
    rotary = MixtralRotaryEmbedding(cfg)
    m = Attention(num_heads=N, num_kv_heads=K, head_dim=H, inputs_shape=(B, L, D),
                  partitioner=None, sliding_window=W, rngs=nnx.Rngs(0))
    _set(m.q_proj, hf.q_proj.weight, (D, N, H))
    _set(m.k_proj, hf.k_proj.weight, (D, K, H))
    _set(m.v_proj, hf.v_proj.weight, (D, K, H))
    _set(m.o_proj, hf.o_proj.weight, (N, H, D))
    x, pos, seg, ct = packed_inputs()
    valid = (seg != 0).astype(np.float32)
    y_hf, gx_hf = _hf_run(hf, rotary, x, pos, numpy_mask(pos, seg, W), ct, valid)
    y, gx = _zoo_run(m, x, pos, seg, ct, valid)
    keep = seg != 0  # HF's additive mask gives fully padded rows a uniform softmax instead of 0
    assert_close(y[keep], y_hf[keep], "Mixtral attention output", rtol=1e-4)
    assert_close(gx, gx_hf, "Mixtral attention dx", rtol=1e-4)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_hf_deepseek_v3_attention_parity(q_lora_rank):
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention, DeepseekV3RotaryEmbedding)
    N, R, Hn, Hr, Hv = 4, 16, 8, 4, 6
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                mscale_all_dim=0.8)
    cfg = DeepseekV3Config(hidden_size=D, num_attention_heads=N, num_key_value_heads=N,
                           q_lora_rank=q_lora_rank, kv_lora_rank=R, qk_nope_head_dim=Hn,
                           qk_rope_head_dim=Hr, v_head_dim=Hv, rope_interleave=True,
                           max_position_embeddings=32, rope_parameters=yarn)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = DeepseekV3Attention(cfg, layer_idx=0).float()
    with torch.no_grad():  # non-trivial norm scales
        for norm in (hf.kv_a_layernorm, hf.q_a_layernorm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    rotary = DeepseekV3RotaryEmbedding(cfg)
    m = MLA(num_heads=N, q_lora_rank=q_lora_rank, kv_lora_rank=R, qk_nope_head_dim=Hn,
            qk_rope_head_dim=Hr, v_head_dim=Hv, inputs_shape=(B, L, D), partitioner=None,
            rope=YARN, rngs=nnx.Rngs(0))
    if q_lora_rank is None:
        _set(m.q_proj, hf.q_proj.weight, (D, N, Hn + Hr))
    else:
        _set(m.q_a_proj, hf.q_a_proj.weight, (D, q_lora_rank))
        m.q_a_layernorm.scale[...] = jnp.asarray(hf.q_a_layernorm.weight.detach().numpy())
        _set(m.q_b_proj, hf.q_b_proj.weight, (q_lora_rank, N, Hn + Hr))
    _set(m.kv_a_proj_with_mqa, hf.kv_a_proj_with_mqa.weight, (D, R + Hr))
    m.kv_a_layernorm.scale[...] = jnp.asarray(hf.kv_a_layernorm.weight.detach().numpy())
    _set(m.kv_b_proj, hf.kv_b_proj.weight, (R, N, Hn + Hv))
    _set(m.o_proj, hf.o_proj.weight, (N, Hv, D))
    assert m.scale == pytest.approx(hf.scaling, rel=1e-7)
    x, pos, seg, ct = packed_inputs()
    valid = (seg != 0).astype(np.float32)
    y_hf, gx_hf = _hf_run(hf, rotary, x, pos, numpy_mask(pos, seg, None), ct, valid)
    y, gx = _zoo_run(m, x, pos, seg, ct, valid)
    keep = seg != 0
    assert_close(y[keep], y_hf[keep], "DeepSeek-V3 MLA output", rtol=1e-4)
    assert_close(gx, gx_hf, "DeepSeek-V3 MLA dx", rtol=1e-4)


# -- masks and score modifiers in the layers -------------------------------------------------

def test_mask_soft_cap_and_sinks_in_the_layer():
    """A mask value, a soft cap and learned sinks under ring CP, against the same layer run by
    the reference implementation (output, input and parameter gradients, sinks included)."""
    x, pos, seg, ct = packed_inputs()
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=8, inputs_shape=(B, L, D),
              mask=zoo.ops.Chunked(8) & zoo.ops.Causal() & zoo.ops.Document(),
              logits_soft_cap=3.0, sinks=True)
    ref = Attention(partitioner=None, implementation="reference", rngs=nnx.Rngs(0), **kw)
    p = zoo.Partitioner(zoo.make_mesh(context=4, fsdp=2), "cp")
    cp = Attention(partitioner=p, implementation="ring", rngs=nnx.Rngs(0), **kw)
    assert ref.sinks[...].shape == (4,)
    for m in (ref, cp):  # non-zero sinks, the same in both
        m.sinks[...] = jnp.asarray([0.5, -1.0, 1.5, 0.0])
    perm = load_balance(4)

    def run(m, x, pos, seg, ct):
        def loss(m, x):
            return jnp.sum(m(x, positions=pos, segment_ids=seg) * ct)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(m, x)

    (y_ref, (g_ref, gx_ref)), (y_cp, (g_cp, gx_cp)) = (
        run(ref, x, pos, seg, ct), run(cp, *(a[:, perm] for a in (x, pos, seg, ct))))
    np.testing.assert_allclose(float(y_cp), float(y_ref), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx_cp), np.asarray(gx_ref)[:, perm], rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_cp.sinks[...]), np.asarray(g_ref.sinks[...]),
                               rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(g_ref.sinks[...]).max()) > 1e-4
    np.testing.assert_allclose(np.asarray(g_cp.q_proj.kernel[...]),
                               np.asarray(g_ref.q_proj.kernel[...]), rtol=1e-4, atol=1e-5)
