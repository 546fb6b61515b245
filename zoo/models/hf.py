"""Hugging Face checkpoint interop shared by the model families: config.json and safetensors.

* `read_config` -- ``config.json`` of a local checkpoint folder, with a clear error for a folder
  without one and for a ``model_type`` the caller does not handle.
* `rope_from_hf` / `rope_to_hf` -- the rotary settings in both spellings: transformers 5.x
  ``rope_parameters`` and the published ``rope_theta`` + ``rope_scaling`` (YaRN or none).
* `CheckpointReader` -- reads one tensor at a time with `safetensors.safe_open` (numpy), from a
  single file or a sharded folder (``model.safetensors.index.json``); FP8 tensors with a
  ``*_scale_inv`` block scale (the published DeepSeek-V3 weights) are dequantised on the fly,
  and so are MXFP4 tensors (gpt-oss's experts: ``X_blocks`` + ``X_scales`` read as ``X``)
  and DeepSeek-V4's release (``X.weight`` + ``X.scale``: FP8 e4m3 with one ue8m0 scale per
  block, or FP4 e2m1 packed two a byte with one per 32 inputs). The decoders
  (`dequantize_fp8`, `dequantize_fp4`, `dequantize_mxfp4`) and the rule that a quantised weight
  needs its scale are `zoo.models.hf_quant`'s (the decoders re-exported here). A tensor holding
  NaN or Inf is refused (`BadCheckpoint`, naming it).
* `Tensor` -- one row of a model's key map (`zoo.layers.hf_keys`, re-exported here with its
  helpers `linear`, `copy`, `stacked_linear`, `zoo_only`): a zoo variable path, its Hugging Face
  key (or one key per expert, stacked on the leading axis, or none: zoo-only) and the layout
  (``nn.Linear`` weights are ``[out, in]``; zoo kernels are ``[*in, *out]``). The layers own
  their rows (``hf_keys(prefix)``); a model composes them.
* `LayerStack` -- a scanned model's stacked ``[layers, ...]`` variable: one `Tensor` row per
  layer (the unrolled model's row), read and written a layer at a time.
* `check_checkpoint` / `check_tensors` -- a checkpoint folder against a model from the
  safetensors headers alone: every key there with its parameter's shape (a transposed tensor
  of the same size is refused), unreadable files named, unused tensors warned about.
* `load_into` -- fills an abstract model (`nnx.eval_shape`) variable by variable: each array is
  assembled with `jax.make_array_from_callback` straight into its sharding, every device
  receiving only its shard (a stacked expert tensor reads only the experts a shard holds), so
  the model is never materialised whole on one device.
* `save_checkpoint` -- writes ``config.json`` and safetensors shards (+ index) tensor by tensor,
  flushing a shard every ``max_shard_bytes``, into a temporary folder beside the target that
  then replaces it whole: an earlier export's shards and index never linger. A folder holding
  anything else than such an export is refused unless ``overwrite=True`` (`export_files`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import shutil
import struct
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from zoo.layers.hf_keys import Tensor, copy, linear, stacked_linear, zoo_only
from zoo.layers.rope import YaRN, yarn_get_mscale
from zoo.models.hf_quant import (FP4_BLOCK, dequantize_fp4, dequantize_fp8,
                                 dequantize_mxfp4, scale_keys, weight_quantisation)

# dequantize_fp4 / _fp8 / _mxfp4 are zoo.models.hf_quant's, re-exported
__all__ = ["BadCheckpoint", "CheckpointReader", "LayerStack", "Tensor", "check_checkpoint",
           "check_tensors", "copy", "dequantize_fp4", "dequantize_fp8", "dequantize_mxfp4",
           "expected_shapes", "export_files",
           "export_tensors", "linear", "load_into", "read_config", "rope_from_hf", "rope_to_hf",
           "save_checkpoint", "stacked_linear", "zoo_only"]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
# the files of an export `save_checkpoint` writes (one file, or numbered shards + index)
_EXPORT_FILE = re.compile(r"(config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                          r"model-\d{5}-of-\d{5}\.safetensors)")


class BadCheckpoint(ValueError):
    """A checkpoint whose tensor values zoo refuses to load (NaN or Inf weights)."""


# -- config.json -----------------------------------------------------------------------------

def read_config(path: str | os.PathLike, model_types: Sequence[str], *,
                loader: str) -> dict[str, Any]:
    """The parsed ``config.json`` of checkpoint folder `path`; its model_type must be known."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{loader}: {path!r} is not a directory; pass the local folder of a "
                         f"Hugging Face checkpoint (config.json + *.safetensors)")
    cfg_file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{loader}: {path!r} has no {CONFIG_NAME}; a Hugging Face checkpoint "
                         f"folder holds config.json beside its *.safetensors (download the whole "
                         f"repository, e.g. `huggingface-cli download REPO --local-dir DIR`)")
    cfg = _read_json(cfg_file, loader)
    model_type = cfg.get("model_type")
    if model_type not in model_types:
        raise ValueError(f"{loader}: {cfg_file} has model_type={model_type!r}, which this "
                         f"loader does not handle (it reads {', '.join(map(repr, model_types))})"
                         f"; use the loader of that family, e.g. zoo.models.mixtral.from_hf for "
                         f"'mixtral' and zoo.models.deepseek3.from_hf for 'deepseek_v3'")
    return cfg


def _read_json(name: str, what: str) -> dict[str, Any]:
    """A JSON object from file `name`; an unreadable one is a `ValueError` naming it."""
    try:
        with open(name, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{what}: {name} cannot be read as JSON ({type(e).__name__}: "
                         f"{str(e)[:200]}); download the checkpoint folder again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: {name} holds {type(value).__name__}, not a JSON object; "
                         f"download the checkpoint folder again")
    return value


_ROPE_NUMBERS = frozenset({"rope_theta", "factor", "original_max_position_embeddings",
                           "max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                           "mscale_all_dim", "attention_factor"})


def rope_from_hf(cfg: dict[str, Any], *, default_theta: float,
                 what: str) -> tuple[float, YaRN | None]:
    """``(rope_theta, YaRN or None)`` from either spelling of a config's rotary settings.

    transformers 5.x writes ``rope_parameters = {"rope_type", "rope_theta", ...}``; published
    checkpoints write ``rope_theta`` and ``rope_scaling = {"type" | "rope_type", ...}``.
    Defaults follow transformers: a missing YaRN ``factor`` is ``max_position_embeddings /
    original_max_position_embeddings``; a missing ``original_max_position_embeddings`` is
    ``max_position_embeddings``.
    """
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{what}: rope settings {params!r} must be a JSON object")
    for name, value in [*params.items(), ("rope_theta", cfg.get("rope_theta")),
                        ("max_position_embeddings", cfg.get("max_position_embeddings"))]:
        if name not in _ROPE_NUMBERS or value is None or (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value)):
            continue
        raise ValueError(f"{what}: config.json has rope setting {name}={value!r} "
                         f"({type(value).__name__}), which must be a finite JSON number; write "
                         f"it without quotes, e.g. \"{name}\": 10000.0")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{what}: per-layer-type rope_parameters {params!r} are not supported "
                         f"(these families use one rotary setting for every layer)")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or default_theta)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"{what}: rope type {rope_type!r} is not supported; zoo implements "
                         f"'default' and 'yarn'")
    max_pos = cfg.get("max_position_embeddings")
    original = params.get("original_max_position_embeddings") or max_pos
    if not original:
        raise ValueError(f"{what}: YaRN needs original_max_position_embeddings (or "
                         f"max_position_embeddings) in config.json")
    factor = params.get("factor")
    if factor is None:
        if not max_pos:
            raise ValueError(f"{what}: YaRN without 'factor' needs max_position_embeddings")
        factor = max_pos / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None and not mscale and mscale_all_dim:
        # transformers uses mscale(factor) when `mscale` is absent, whatever mscale_all_dim says;
        # YaRN's mscale defaults to 1.0, so pin the cos/sin factor explicitly.
        attention_factor = yarn_get_mscale(float(factor))
    return theta, YaRN(
        factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(mscale) if mscale is not None else 1.0,
        mscale_all_dim=float(mscale_all_dim or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)))


def rope_to_hf(theta: float, scaling: YaRN | None) -> dict[str, Any]:
    """The transformers 5.x ``rope_parameters`` of a rotary setting."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": float(theta)}
    out = {"rope_type": "yarn", "rope_theta": float(theta), "factor": scaling.factor,
           "original_max_position_embeddings": scaling.original_max_position_embeddings,
           "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow,
           "mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim}
    if scaling.attention_factor is not None:
        out["attention_factor"] = scaling.attention_factor
    if not scaling.truncate:
        out["truncate"] = False
    return out


def check_fields(cfg: dict[str, Any], expected: dict[str, Any], *, what: str) -> None:
    """Raise if config.json asks for a feature zoo does not implement (e.g. a bias, gelu)."""
    for key, allowed in expected.items():
        if key in cfg and cfg[key] is not None and cfg[key] not in allowed:
            raise ValueError(f"{what}: config.json has {key}={cfg[key]!r}; zoo supports "
                             f"{' or '.join(map(repr, allowed))}")


# -- reading safetensors ---------------------------------------------------------------------

_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
               "F8_E8M0": ml_dtypes.float8_e8m0fnu,
               "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
               "F64": np.float64, "I64": np.int64, "I32": np.int32, "I16": np.int16,
               "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ML_FLOATS = frozenset(np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
                                             ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu))


class CheckpointReader:
    """Tensor-by-tensor access to the ``*.safetensors`` of one checkpoint folder.

    ``get(key)`` returns a numpy array; FP8 weights that have a ``key + "_scale_inv"`` tensor
    are dequantised with it in ``block_size`` blocks (DeepSeek-V3's published format). A pair
    ``key + "_blocks"`` / ``key + "_scales"`` (MXFP4, gpt-oss's published experts) is the
    tensor ``key``: `dequantize_mxfp4`, then the last two axes swapped (the blocks are stored
    ``[..., out, in / 32, 16]``; the tensor is ``[..., in, out]``, as transformers' parameter);
    ``keys()`` lists ``key`` in their place. DeepSeek-V4's release stores ``X.weight`` with its
    scale as ``X.scale`` (`scale_key`): an e4m3 weight is dequantised like V3's
    (`dequantize_fp8`, ue8m0 or float scales), an int8 one holds FP4 e2m1 codes two a byte
    (`dequantize_fp4`; ``shape`` is the unpacked ``[out, in]``). A quantised weight without
    its scale, or a scale of another shape, is a `ValueError` naming both tensors.
    """

    def __init__(self, path: str | os.PathLike, *, block_size: Sequence[int] = (128, 128)):
        self.path = os.fspath(path)
        self.block_size = tuple(block_size)
        index = os.path.join(self.path, INDEX_NAME)
        self._headers: dict[str, tuple[dict, int]] = {}
        if os.path.isfile(index):
            weight_map = _read_json(index, "checkpoint").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"checkpoint: {index} has no \"weight_map\" object; download "
                                 f"the checkpoint folder again")
            self._file = {k: os.path.join(self.path, v) for k, v in weight_map.items()}
            lost = sorted({f for f in self._file.values() if not os.path.isfile(f)})
            if lost:
                keys = [k for k, f in self._file.items() if f == lost[0]]
                raise ValueError(f"checkpoint: {len(lost)} shard(s) that {index} lists are "
                                 f"missing: {', '.join(lost[:4])} (holding e.g. {keys[:2]}); "
                                 f"download the missing files again")
        else:
            files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
            if not files:
                raise ValueError(f"{self.path!r} holds no *.safetensors files; zoo reads the "
                                 f"safetensors format only (convert *.bin with transformers' "
                                 f"save_pretrained(safe_serialization=True))")
            self._file = {key: name for name in files for key in self._header(name)[0]}
        self._mxfp4 = {k[:-len("_blocks")] for k in self._file
                       if k.endswith("_blocks") and k[:-len("_blocks")] + "_scales" in self._file}

    def _header(self, name: str) -> tuple[dict, int]:
        if name not in self._headers:
            self._headers[name] = _read_header(name)
        return self._headers[name]

    def _info(self, key: str) -> dict[str, Any]:
        name = self._file[key]
        info = self._header(name)[0].get(key)
        if info is None:
            raise ValueError(f"checkpoint: {INDEX_NAME} places {key!r} in {name}, which does "
                             f"not hold it; download the checkpoint folder again")
        return info

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor `key` from its file's header (no tensor data is read); a packed
        FP4 weight's is the unpacked ``[out, in]``."""
        if key in self._mxfp4:
            *lead, rows, groups, half = self.shape(key + "_blocks")
            return (*lead, groups * 2 * half, rows)
        shape = tuple(self._info(key)["shape"])
        if self.quantisation(key) == "fp4":
            return (*shape[:-1], 2 * shape[-1])
        return shape

    def scale_key(self, key: str) -> str | None:
        """The block scale stored beside weight `key`: ``key + "_scale_inv"`` (DeepSeek-V3's
        release) or, for ``X.weight``, ``X.scale`` (DeepSeek-V4's); None without one."""
        return next((k for k in scale_keys(key) if k in self._file), None)

    def quantisation(self, key: str) -> str | None:
        """``"fp8"`` (a block-scaled weight), ``"fp4"`` (e2m1 codes two a byte, one scale per
        `FP4_BLOCK` inputs) or None (read as stored), from the header's dtype and the scale
        beside it; a FP8 or packed FP4 weight without its scale is a `ValueError`."""
        if key in self._mxfp4 or key not in self._file:
            return None
        return weight_quantisation(key, self._info(key)["dtype"], self.scale_key(key),
                                   where=self.path)

    def keys(self) -> list[str]:
        packed = {k + suffix for k in self._mxfp4 for suffix in ("_blocks", "_scales")}
        return [k for k in self._file if k not in packed] + sorted(self._mxfp4)

    def __contains__(self, key: str) -> bool:
        return key in self._file or key in self._mxfp4

    def get(self, key: str) -> np.ndarray:
        if key in self._mxfp4:
            w = dequantize_mxfp4(self._read(key + "_blocks"), self._read(key + "_scales"))
            return self._finite(key, np.ascontiguousarray(np.swapaxes(w, -1, -2)))
        if key not in self._file:
            raise KeyError(f"checkpoint {self.path!r} has no tensor {key!r}")
        kind = self.quantisation(key)
        arr = self._read(key)
        if kind == "fp8":  # block-quantised FP8 weight (DeepSeek-V3, V4)
            if arr.ndim != 2:
                raise ValueError(f"checkpoint {self.path!r}: block-quantised weight {key!r} "
                                 f"{tuple(arr.shape)} must be 2-D [out, in]")
            want = tuple(-(-n // b) for n, b in zip(arr.shape, self.block_size))
            arr = dequantize_fp8(arr, self._scale(key, want, f"blocks of {self.block_size} "
                                                            f"(quantization_config."
                                                            f"weight_block_size)"),
                                 self.block_size)
        elif kind == "fp4":  # DeepSeek-V4's experts
            half = arr.shape[-1]
            if (2 * half) % FP4_BLOCK:
                raise ValueError(f"checkpoint {self.path!r}: packed FP4 weight {key!r} "
                                 f"{tuple(arr.shape)} holds {2 * half} inputs a row, not a "
                                 f"multiple of the FP4 block ({FP4_BLOCK})")
            want = (*arr.shape[:-1], 2 * half // FP4_BLOCK)
            arr = dequantize_fp4(arr, self._scale(key, want, f"one per {FP4_BLOCK} inputs"))
        return self._finite(key, arr)

    def _scale(self, key: str, want: tuple[int, ...], rule: str) -> np.ndarray:
        """The scale of weight `key` as float32, checked: shape `want`, finite, positive."""
        name = self.scale_key(key)
        scale = self._read(name)
        if tuple(scale.shape) != tuple(want):
            raise ValueError(f"checkpoint {self.path!r}: scale {name!r} of weight {key!r} has "
                             f"shape {tuple(scale.shape)}, expected {tuple(want)} ({rule}); "
                             f"is quantization_config from the same checkpoint as the weights?")
        scale = scale.astype(np.float32)
        bad = ~(np.isfinite(scale) & (scale > 0))
        if bad.any():
            first = [int(i) for i in np.argwhere(bad)[0]]
            raise BadCheckpoint(f"checkpoint {self.path!r}: scale {name!r} of weight {key!r} "
                                f"holds {int(bad.sum())} value(s) that are not finite and "
                                f"positive, the first {scale[tuple(first)]} at {first}; a block "
                                f"scale must be > 0: download the checkpoint again")
        return scale

    def _finite(self, key: str, arr: np.ndarray) -> np.ndarray:
        """`arr`, unless a floating tensor holds NaN or Inf: then `BadCheckpoint` naming it."""
        if arr.dtype.kind != "f" and arr.dtype not in _ML_FLOATS:
            return arr
        finite = np.isfinite(arr)
        if finite.all():
            return arr
        bad = np.argwhere(~finite)
        first = tuple(int(i) for i in bad[0])
        raise BadCheckpoint(
            f"checkpoint {self.path!r}: tensor {key!r} {tuple(arr.shape)} holds {len(bad)} "
            f"non-finite value(s) (NaN or Inf), the first {arr[first]} at index {list(first)}; "
            f"zoo loads finite weights only: download the checkpoint again, or export it "
            f"again from a good one")

    def _read(self, key: str) -> np.ndarray:
        name = self._file[key]
        self.shape(key)  # the header is whole and holds the key
        try:
            from safetensors import safe_open
            with safe_open(name, framework="numpy") as f:
                return f.get_tensor(key)
        except (AttributeError, TypeError, ValueError):
            # numpy lacks some dtypes (FP8): map the bytes with ml_dtypes instead
            return self._read_raw(name, key)
        except Exception as e:  # safetensors' own errors do not always name the file
            raise ValueError(f"checkpoint: tensor {key!r} cannot be read from {name} "
                             f"({type(e).__name__}: {str(e)[:200]})") from None

    def _read_raw(self, name: str, key: str) -> np.ndarray:
        header, data_start = self._header(name)
        info = header[key]
        dtype = _RAW_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {key!r} in {name} has dtype {info['dtype']}, which zoo "
                             f"cannot read")
        begin, end = info["data_offsets"]
        raw = np.memmap(name, dtype=np.uint8, mode="r", offset=data_start + begin,
                        shape=(end - begin,))
        return np.asarray(raw).view(dtype).reshape(info["shape"])


def _read_header(name: str) -> tuple[dict[str, Any], int]:
    """``({key: {"dtype", "shape", "data_offsets"}}, data start)`` of a safetensors file; a
    truncated or garbled file is a `ValueError` naming it."""
    size = os.path.getsize(name)
    try:
        with open(name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"a {n}-byte header in a {size}-byte file")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (struct.error, ValueError, TypeError, KeyError, IndexError) as e:
        raise ValueError(f"checkpoint: {name} is not a readable safetensors file ({e}); it is "
                         f"truncated or damaged: download it again") from None
    if 8 + n + end > size:
        raise ValueError(f"checkpoint: {name} is truncated: its header places tensor data up "
                         f"to byte {8 + n + end}, but the file has {size} bytes; download it "
                         f"again")
    return header, 8 + n


# -- the key map -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerStack:
    """A scanned model's stacked variable ``[layers, ...]``: slice ``i`` is ``rows[i]``, the
    row the unrolled model has for that layer (itself possibly stacked per expert)."""

    path: tuple[Any, ...]
    rows: tuple[Tensor, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for r in self.rows for k in r.keys)

    @property
    def zoo_only(self) -> bool:
        return all(r.zoo_only for r in self.rows)

    def describe(self) -> str:
        return (f"zoo {'.'.join(map(str, self.path))} <- {self.rows[0].keys[0]} .. "
                f"{self.rows[-1].keys[-1]} ({len(self.rows)} layers)")


def _flat_variables(model: nnx.Module) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
    _, state = nnx.split(model)
    return list(nnx.to_flat_state(state))


def _sharding_of(var: nnx.Variable) -> NamedSharding | None:
    meta = var.get_metadata()
    mesh, spec = meta.get("mesh"), meta.get("out_sharding")
    if mesh is None or spec is None or isinstance(mesh, jax.sharding.AbstractMesh):
        return None
    return NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # scanned: a tuple


def _owner(model: nnx.Module, path: tuple[Any, ...]) -> str:
    """The class of the innermost module holding the variable at `path` (for error messages)."""
    node, owner = model, type(model).__name__
    for part in path[:-1]:
        node = node[part] if isinstance(part, int) else getattr(node, part, None)
        if isinstance(node, nnx.Module):
            owner = type(node).__name__
    return owner


def uncovered(model: nnx.Module, table: Iterable[Tensor | LayerStack], *, what: str) -> None:
    """Raise unless every variable of `model` has exactly one row in `table` and every row
    names a variable: the message names each uncovered variable, the class that holds it and
    the two fixes (a key in that class's ``hf_keys``, or ``hf_zoo_only``)."""
    flat = _flat_variables(model)
    rows = {t.path for t in table}
    missing = [(".".join(map(str, p)), _owner(model, p), p[-1]) for p, _ in flat
               if p not in rows]
    if missing:
        listed = "; ".join(f"{path} (held by {owner})" for path, owner, _ in missing[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        _, owner, name = missing[0]
        raise ValueError(f"{what}: no Hugging Face key covers zoo variable(s) {listed}{more}. "
                         f"A subclass that adds a parameter names its key in its own "
                         f"hf_keys(prefix) (e.g. `return super().hf_keys(prefix) + "
                         f"[hf.copy(({name!r},), f'{{prefix}}.{name}')]` in {owner}) or declares "
                         f"it zoo-only (`hf_zoo_only = ({name!r},)`: initialised, never saved)")
    known = {p for p, _ in flat}
    extra = [t.describe() for t in table if t.path not in known]
    if extra:
        raise ValueError(f"{what}: the key map names variables the model lacks: {extra[:4]}")


def _hf_shape(row: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face tensor shape of one zoo row of `shape` (`Tensor.to_hf`'s output)."""
    if row.in_ndim is None:
        return (math.prod(shape),) if row.flat else shape
    return (math.prod(shape[row.in_ndim:]), math.prod(shape[:row.in_ndim]))


def expected_shapes(model: nnx.Module, table: Iterable[Tensor | LayerStack]
                    ) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{Hugging Face key: (the shape it must have, the row it fills)}`` for abstract `model`."""
    values = dict(_flat_variables(model))
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for row in table:
        if row.zoo_only or row.path not in values:
            continue
        shape = tuple(values[row.path].get_value().shape)
        name = ".".join(map(str, row.path))
        stack = isinstance(row, LayerStack)
        for i, r in enumerate(row.rows if stack else (row,)):
            where = f"{name}[{i}]" if stack else name
            want = _hf_shape(r, shape[1 + stack:] if r.stacked else shape[stack:])
            out.update({k: (want, f"zoo {where}[{e}]" if r.stacked else f"zoo {where}")
                        for e, k in enumerate(r.keys)})
    return out


def check_tensors(model: nnx.Module, table: Iterable[Tensor | LayerStack],
                  reader: CheckpointReader, *, what: str) -> None:
    """Every tensor `table` names is in the checkpoint with the shape of the parameter it
    fills (from the safetensors headers: no tensor is read). A tensor transposed or reshaped to
    the same size is refused like a missing one; tensors no parameter takes are ignored with a
    warning (an FP8 weight's ``*_scale_inv`` is taken with its weight)."""
    table = list(table)
    uncovered(model, table, what=what)
    want = expected_shapes(model, table)
    missing = [k for k in want if k not in reader]
    if missing:
        raise ValueError(f"{what}: checkpoint {reader.path!r} lacks {len(missing)} tensor(s) "
                         f"the model's key map names, e.g. {missing[:4]}; is config.json "
                         f"from the same checkpoint as the weights, and does every swapped layer "
                         f"map its parameters to this checkpoint's names?")
    wrong = [f"{k}: checkpoint {tuple(reader.shape(k))}, expected {shape} ({row})"
             for k, (shape, row) in want.items() if tuple(reader.shape(k)) != shape]
    if wrong:
        raise ValueError(f"{what}: {len(wrong)} tensor(s) of checkpoint {reader.path!r} have "
                         f"another shape than the parameter they fill: {'; '.join(wrong[:4])}"
                         f"{' ...' if len(wrong) > 4 else ''}. A transposed or reshaped tensor "
                         f"is not loaded; is config.json from the same checkpoint as the "
                         f"weights, and were the tensors saved in Hugging Face's layout?")
    extra = [k for k in reader.keys() if k not in want
             and not (k.endswith("_scale_inv") and k[:-len("_scale_inv")] in want)
             and not (k.endswith(".scale") and k[:-len("scale")] + "weight" in want)]
    if extra:
        warnings.warn(f"{what}: ignoring {len(extra)} tensor(s) of checkpoint {reader.path!r} "
                      f"that no zoo parameter takes, e.g. {extra[:4]}", stacklevel=3)


def check_checkpoint(path: str | os.PathLike, make_model: Callable[[], nnx.Module], *,
                     what: str = "from_hf") -> None:
    """Check the checkpoint folder `path` against the model `make_model` builds (abstractly,
    `nnx.eval_shape`): config.json and the index readable, every shard present and whole,
    every tensor there with its parameter's shape. Reads headers only, no tensor data, so it
    runs in seconds before anything is compiled; raises a `ValueError` naming the file or the
    key (see `check_tensors`)."""
    model = nnx.eval_shape(make_model)
    raw = read_config(path, type(model).hf_model_types, loader=what)
    quant = raw.get("quantization_config") or {}
    reader = CheckpointReader(path, block_size=quant.get("weight_block_size", (128, 128)))
    check_tensors(model, model.hf_load_map(list(reader.keys())), reader, what=what)


def load_into(model: nnx.Module, table: Iterable[Tensor | LayerStack], reader: CheckpointReader,
              *, what: str, initial: dict[tuple[Any, ...], jax.Array] | None = None
              ) -> nnx.Module:
    """Fill every variable of the abstract `model` from `reader` according to `table`.

    Each array is built with `jax.make_array_from_callback` into the sharding its variable's
    metadata names, so a device receives only its shard; stacked (per-expert) tensors read
    only the experts a shard needs. Zoo-only rows (no key) take their value from `initial`.
    Raises (`uncovered`) if a variable has no row, and if the checkpoint lacks a key.
    """
    table = list(table)
    check_tensors(model, table, reader, what=what)
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    rows: dict[tuple[Any, ...], Tensor | LayerStack] = {}
    for t in table:  # a variable's first row is the one read (later ones: shared copies)
        rows.setdefault(t.path, t)
    initial = initial or {}
    for path, var in flat:
        row = rows[path]
        sharding = _sharding_of(var)
        if row.zoo_only:
            if path not in initial:
                raise ValueError(f"{what}: zoo-only variable {'.'.join(map(str, path))} has no "
                                 f"initial value")
            value = initial[path]
            var.set_value(value if sharding is None else jax.device_put(value, sharding))
            continue
        abstract = var.get_value()
        shape, dtype = tuple(abstract.shape), abstract.dtype
        fetch = _fetcher(row, reader, shape, dtype)
        if sharding is None:
            arr = jax.device_put(fetch((slice(None),) * len(shape)))
        else:
            arr = jax.make_array_from_callback(shape, sharding, fetch)
        var.set_value(arr)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _fetcher(row: Tensor | LayerStack, reader: CheckpointReader, shape: tuple[int, ...],
             dtype) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """``index -> the part of the zoo array at index`` (numpy, target dtype)."""
    cache: dict[Any, np.ndarray] = {}
    if isinstance(row, LayerStack):
        if len(row.rows) != shape[0]:
            raise ValueError(f"{row.describe()}: {len(row.rows)} layers for a stack of "
                             f"{shape[0]}")
        per_layer = [_fetcher(r, reader, shape[1:], dtype) for r in row.rows]

        def fetch_layers(index):  # only the layers (and, inside, experts) this shard holds
            index = tuple(index) + (slice(None),) * (len(shape) - len(index))
            layers = range(*index[0].indices(shape[0]))
            return np.stack([per_layer[i](index[1:]) for i in layers])
        return fetch_layers
    if row.stacked:
        if len(row.keys) != shape[0]:
            raise ValueError(f"{row.describe()}: {len(row.keys)} per-expert tensors for a "
                             f"stack of {shape[0]}")

        def fetch(index):
            index = tuple(index) + (slice(None),) * (len(shape) - len(index))
            experts = range(*index[0].indices(shape[0]))
            key = (experts.start, experts.stop, experts.step)
            if key not in cache:  # devices that share an expert range share the read
                cache.clear()
                cache[key] = np.stack([row.to_zoo(reader.get(row.keys[e]), shape[1:])
                                       for e in experts]).astype(dtype)
            return cache[key][(slice(None), *index[1:])]
        return fetch

    def fetch(index):
        if "full" not in cache:
            cache["full"] = row.to_zoo(reader.get(row.keys[0]), shape).astype(dtype)
        return cache["full"][tuple(index)]
    return fetch


# -- writing ---------------------------------------------------------------------------------

def _host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def export_tensors(model: nnx.Module, table: Iterable[Tensor]) -> Iterable[tuple[str, np.ndarray]]:
    """``(Hugging Face key, numpy array)`` for every row of `table`, one variable at a time
    (zoo-only rows are skipped). Raises first if a variable has no row (`uncovered`)."""
    table = list(table)
    uncovered(model, table, what="to_hf")
    values = {p: v for p, v in _flat_variables(model)}
    for row in table:
        if row.zoo_only:
            continue
        if row.path not in values:
            raise ValueError(f"to_hf: the model has no variable {'.'.join(map(str, row.path))}")
        value = values[row.path].get_value()
        if isinstance(row, LayerStack):  # one layer at a time: never the whole stack on a host
            for i, r in enumerate(row.rows):
                yield from _export_row(r, _host(value[i]))
        else:
            yield from _export_row(row, _host(value))


def _export_row(row: Tensor, z: np.ndarray) -> Iterable[tuple[str, np.ndarray]]:
    if row.stacked:
        for e, key in enumerate(row.keys):
            yield key, row.to_hf(z[e])
    else:
        yield row.keys[0], row.to_hf(z)


def export_files(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """``(export files, other entries)`` of folder `path`: the names `save_checkpoint` writes
    (``config.json``, ``model.safetensors``, ``model-NNNNN-of-NNNNN.safetensors`` and the
    index) and everything else in it, each sorted."""
    names = sorted(os.listdir(path))
    ours = [n for n in names if _EXPORT_FILE.fullmatch(n)
            and os.path.isfile(os.path.join(path, n))]
    return ours, [n for n in names if n not in ours]


def _refusal(path: str, overwrite: bool) -> str | None:
    """Why `save_checkpoint` may not replace `path` (None: it may)."""
    if overwrite or not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return (f"to_hf: {path} exists and is not a folder; pass overwrite=True to replace it, "
                f"or choose another path")
    others = export_files(path)[1]
    if not others:
        return None
    shown = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
    return (f"to_hf: {path} holds {len(others)} file(s) that are not part of a Hugging Face "
            f"export zoo writes ({shown}); to_hf replaces the folder whole, so pass "
            f"overwrite=True to delete them, or choose another folder")


def _agree_on_refusal(problem: str | None) -> None:
    """Raise `problem` (process 0's verdict on the folder) on every process, before any
    process starts the collective gathers of the export."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        refused = multihost_utils.broadcast_one_to_all(np.int32(problem is not None))
        if int(refused) and problem is None:
            problem = "to_hf: process 0 refused the folder (see its message)"
    if problem is not None:
        raise ValueError(problem)


def _temporary_folder(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        name = os.path.join(parent, f".{os.path.basename(os.path.abspath(path))}."
                                    f"{os.getpid()}-{uuid.uuid4().hex[:8]}.zoo-tmp")
        os.mkdir(name)  # (not mkdtemp: the export gets the umask's permissions, not 0700)
        return name
    except OSError as e:
        raise ValueError(f"to_hf: cannot create a temporary folder beside {path} in {parent} "
                         f"({type(e).__name__}: {e}); make {parent} writable or choose "
                         f"another path") from None


def _replace(path: str, new: str) -> None:
    """Put the finished export `new` (a folder beside `path`) in `path`'s place."""
    if not os.path.lexists(path):
        os.rename(new, path)
        return
    if not os.path.isdir(path) or os.path.islink(path):
        os.remove(path)
        os.rename(new, path)
        return
    old = new[:-len(".zoo-tmp")] + ".zoo-old"
    try:
        os.rename(path, old)
    except OSError:  # a mount point or a folder in use: replace its files one by one instead
        for name in os.listdir(path):
            target = os.path.join(path, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.remove(target)
        for name in sorted(os.listdir(new), key=lambda n: n == CONFIG_NAME):  # config last
            os.replace(os.path.join(new, name), os.path.join(path, name))
        os.rmdir(new)
        return
    os.rename(new, path)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(path: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]],
                    config: dict[str, Any], *, max_shard_bytes: int = 5 * 2**30,
                    overwrite: bool = False) -> None:
    """Write ``config.json`` and the tensors as safetensors shards (+ index when > 1 shard).

    The files are written into a temporary folder beside `path`, which then takes `path`'s
    place: an earlier export there is replaced whole (no stale shard or index remains), and a
    failure midway leaves it as it was. A `path` holding anything else than such an export
    (see `export_files`) is a `ValueError` naming the files, unless ``overwrite=True``.
    Only process 0 writes (all processes must call it: gathering a sharded array is collective).
    """
    path = os.fspath(path)
    writer = jax.process_index() == 0
    _agree_on_refusal(_refusal(path, overwrite) if writer else None)
    tmp = _temporary_folder(path) if writer else ""
    try:
        _write(tmp, tensors, config, max_shard_bytes, writer)
        if writer:
            _replace(path, tmp)
    finally:
        if writer and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _write(folder: str, tensors: Iterable[tuple[str, np.ndarray]], config: dict[str, Any],
           max_shard_bytes: int, writer: bool) -> None:
    """The export's files in `folder` (process 0; the others only take part in the gathers)."""
    from safetensors.numpy import save_file
    shards: list[list[str]] = []
    pending: dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        nonlocal pending, size
        if pending and writer:
            save_file(pending, os.path.join(folder, f"part-{len(shards):05d}.safetensors"),
                      metadata={"format": "pt"})
        if pending:
            shards.append(list(pending))
        pending, size = {}, 0

    for key, arr in tensors:
        arr = np.ascontiguousarray(arr)
        if size and size + arr.nbytes > max_shard_bytes:
            flush()
        pending[key] = arr
        size += arr.nbytes
        total += arr.nbytes
    flush()
    if not writer:
        return
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(folder, f"part-{i:05d}.safetensors"),
                   os.path.join(folder, final))
        weight_map.update({k: final for k in shard})
    if n > 1:
        with open(os.path.join(folder, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(folder, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
