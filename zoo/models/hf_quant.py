"""Quantised weights of Hugging Face checkpoints, decoded to float32 on load (numpy).

* FP8 with block scales -- DeepSeek-V3's release (``X_scale_inv``, float32) and V4's
  (``X.scale``, ue8m0): `dequantize_fp8`.
* FP4 e2m1 codes packed two a byte, one scale per `FP4_BLOCK` inputs of a row -- DeepSeek-V4's
  experts (``X.weight`` int8 beside ``X.scale``): `dequantize_fp4`.
* MXFP4 (OCP microscaling) -- gpt-oss's experts (``X_blocks`` + ``X_scales``):
  `dequantize_mxfp4`.

`scale_keys` names where a weight's block scale is stored; `weight_quantisation` tells from a
weight's stored dtype and its scale how it decodes, and refuses a FP8 or packed FP4 weight
without a scale. `zoo.models.hf.CheckpointReader` reads the tensors, checks each scale's shape
and values, and calls these.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FP4_BLOCK", "FP4_E2M1", "FP4_PACKED_DTYPES", "FP8_DTYPES", "dequantize_fp4",
           "dequantize_fp8", "dequantize_mxfp4", "scale_keys", "weight_quantisation"]

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP4_PACKED_DTYPES = ("I8", "U8")  # DeepSeek-V4's experts: two e2m1 codes a byte
FP4_BLOCK = 32  # DeepSeek-V4's FP4 experts: one scale per 32 inputs of a row


def scale_keys(key: str) -> list[str]:
    """Where weight `key`'s block scale may be stored: ``key + "_scale_inv"`` (DeepSeek-V3's
    release) and, for ``X.weight``, ``X.scale`` (DeepSeek-V4's)."""
    candidates = [key + "_scale_inv"]
    if key.endswith(".weight"):
        candidates.append(key[:-len("weight")] + "scale")
    return candidates


def weight_quantisation(key: str, dtype: str, scale: str | None, *, where: str) -> str | None:
    """``"fp8"`` (a block-scaled weight), ``"fp4"`` (e2m1 codes two a byte, one scale per
    `FP4_BLOCK` inputs) or None (read as stored) for weight `key` stored as safetensors `dtype`
    with the scale tensor `scale` beside it (None: none); a FP8 or packed FP4 weight without
    its scale is a `ValueError` naming the checkpoint `where`."""
    packed = dtype in FP4_PACKED_DTYPES and key.endswith(".weight")
    if scale is None and (packed or dtype in FP8_DTYPES):
        names = scale_keys(key)
        raise ValueError(
            f"checkpoint {where!r}: weight {key!r} is stored as {dtype} "
            f"({'packed FP4 e2m1' if packed else 'FP8'}) but has no block scale beside it "
            f"({' or '.join(map(repr, names))}); zoo cannot dequantise it: download the "
            f"checkpoint folder again (every shard the index lists)")
    if scale is None or (scale.endswith(".scale") and not (packed or dtype in FP8_DTYPES)):
        return None  # (a float weight beside a parameter that happens to be named scale)
    return "fp4" if packed else "fp8"


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, ...]) -> np.ndarray:
    """``w * scale_inv`` broadcast over ``block``-sized tiles (DeepSeek-V3 and V4 FP8 weights:
    ``w [out, in]`` e4m3, ``scale_inv [ceil(out / bo), ceil(in / bi)]``, float32 or ue8m0;
    edge tiles partial) -> float32."""
    if w.ndim != 2 or scale_inv.ndim != 2:
        raise ValueError(f"block-quantised weight {w.shape} / scale {scale_inv.shape} must be 2-D")
    bo, bi = block
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)
    return w.astype(np.float32) * full[:w.shape[0], :w.shape[1]]


# FP4 (e2m1) code -> value: sign bit 3, two exponent bits, one mantissa bit
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP microscaling) to float32: ``blocks [..., G, 16]`` uint8, two FP4 codes a
    byte (low nibble first), ``scales [..., G]`` uint8 exponents (bias 127) shared by each
    group of 32 values -> ``[..., G * 32]``."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype}{blocks.shape} / scales "
                         f"{scales.dtype}{scales.shape} must be uint8 [..., G, 16] and [..., G]")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)
    values = FP4_E2M1[codes]  # [..., G, 32]
    out = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """DeepSeek-V4's FP4 experts to float32: ``packed [..., out, in / 2]`` int8 or uint8, two
    e2m1 codes a byte (the low nibble is the even input, the high one the odd), ``scale
    [..., out, in / B]`` (ue8m0 or float; B = in / scale columns, `FP4_BLOCK` in the release)
    shared by each run of B inputs of a row -> ``[..., out, in]``."""
    if packed.dtype not in (np.int8, np.uint8) or scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"FP4 weight {packed.dtype}{packed.shape} / scale {scale.dtype}"
                         f"{scale.shape} must be int8 or uint8 [..., out, in / 2] and "
                         f"[..., out, in / block]")
    codes = packed.view(np.uint8)
    values = np.stack([FP4_E2M1[codes & 0x0F], FP4_E2M1[codes >> 4]], axis=-1)
    values = values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    groups = scale.shape[-1]
    if values.shape[-1] % groups:
        raise ValueError(f"FP4 weight of {values.shape[-1]} inputs a row cannot share "
                         f"{groups} scales a row evenly")
    blocks = values.reshape(*values.shape[:-1], groups, -1) * scale.astype(np.float32)[..., None]
    return blocks.reshape(values.shape)
