"""Where an fp8 KV cache's scales come from: one K and one V scale per layer, per tensor or per KV head.

A scale maps the range of the values a cache will hold onto the format's (`kernels.fp8`), so every
source is a record of that range, the largest |K| and |V| per layer and KV head (`KVAmax`), turned
into scales for the cache's format. In this order of precedence:

1. `calculate_kv_scales=True`, dynamic: the first real batch's K/V set the scales, which then stay
   fixed (`DynamicScales`). Cheap, but a later token larger than anything in that batch saturates:
   the batch's max maps onto the format's max, no headroom (vLLM's releases with this flag divided
   max |K| by 200 and max |V| by 100 instead; vLLM 0.32 has no runtime calculation,
   docs/fp8_kv_cache.md compares them).
2. `kv_cache_scales=path`: a calibration file written by `python -m engine_core.calibrate`
   (`save_kv_amax` / `load_kv_amax`): the maxima over a prompt set, recorded with a model-dtype cache.
3. The checkpoint's `model.layers.N.self_attn.k_scale` / `v_scale` tensors, the names vLLM reads
   from FP8 checkpoints: e4m3 scales (amax / 448), a scalar or one per KV head.
4. None of these: scale 1.0, as vLLM (values past 448 saturate; tiny ones lose precision).

Per-tensor scales are the default; `kv_scales_per_head=True` keeps one per KV head, because one
outlier head sets a per-tensor scale that squeezes every other head into the format's subnormals.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_core.models.loader import CheckpointReader
from kernels.fp8 import fp8_max, kv_storage_dtype, scale_from_amax
from kernels.int8_kv import int8_scale_from_amax

FILE_FORMAT = "inference-labs.kv_amax"
CHECKPOINT_FORMAT = torch.float8_e4m3fn  # what FP8 checkpoints' k_scale / v_scale were computed for


@dataclass
class KVAmax:
    """The largest |K| and |V| per layer: `[num_layers, num_kv_heads]`, or `[num_layers, 1]` when the
    source only knows one per layer. `source` names where it came from, for error messages."""

    key: torch.Tensor
    value: torch.Tensor
    source: str

    @property
    def per_head(self) -> bool:
        return self.key.shape[1] > 1

    # seam: lab 08 (grader/seams.py)
    def scales(self, dtype: torch.dtype, per_head: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the K and V scales for an fp8 or int8 `dtype` cache: shape `[num_kv_heads]` if `per_head`,
        else `[]` (the layer's largest value over its heads). A per-tensor source gives `[1]` rows."""
        k, v = (x if per_head else x.amax(dim=1) for x in (self.key, self.value))
        return list(_scale_from_amax(k, dtype)), list(_scale_from_amax(v, dtype))


def _scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale for a cache of `dtype`: int8's amax / 127, or fp8's `scale_from_amax`."""
    return int8_scale_from_amax(amax) if dtype == torch.int8 else scale_from_amax(amax, dtype)


# seam: lab 08 (grader/seams.py)
def amax_per_head(x: torch.Tensor) -> torch.Tensor:
    """max |x| per KV head of `[num_tokens, num_kv_heads, head_dim]`, in fp32: `[num_kv_heads]`."""
    return x.abs().amax(dim=(0, 2)).float()


class DynamicScales:
    """`calculate_kv_scales`: an observer of the KV cache (`KVCache.observer`) that sets each layer's
    scales from the first batch it sees (device ops only: no host sync), then detaches itself."""

    def __init__(self, kv_cache: Any, per_head: bool) -> None:
        self.kv_cache, self.per_head = kv_cache, per_head

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        cache = self.kv_cache
        for scale, x in ((cache.k_scale[layer], key), (cache.v_scale[layer], value)):
            amax = amax_per_head(x)
            scale.copy_(_scale_from_amax(amax if self.per_head else amax.amax(), cache.dtype))
        if layer == cache.num_layers - 1:
            cache.observer = None


class AmaxRecorder:
    """A calibration run's observer: the running max |K| and |V| per layer and KV head over every batch."""

    def __init__(self, num_layers: int, num_kv_heads: int, device: torch.device) -> None:
        self.key = torch.zeros(num_layers, num_kv_heads, device=device)
        self.value = torch.zeros(num_layers, num_kv_heads, device=device)

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        torch.maximum(self.key[layer], amax_per_head(key), out=self.key[layer])
        torch.maximum(self.value[layer], amax_per_head(value), out=self.value[layer])

    def result(self, source: str) -> KVAmax:
        return KVAmax(self.key.cpu(), self.value.cpu(), source)


def static_kv_amax(kv_cache_dtype: str, calculate_kv_scales: bool, kv_cache_scales: str | None, per_head: bool,
                   folder: str | Path, num_layers: int, num_kv_heads: int) -> KVAmax | None:
    """The maxima a cache's scales start from (file, else checkpoint), checked against the model before
    anything is built; None when the scales are dynamic, the cache is not fp8, or nothing gives any."""
    if kv_storage_dtype(kv_cache_dtype) is None or calculate_kv_scales:
        return None
    if kv_cache_scales is not None:
        amax = load_kv_amax(kv_cache_scales, num_layers, num_kv_heads)
    else:
        amax = checkpoint_kv_amax(CheckpointReader(folder, torch.float32, torch.device("cpu")), num_layers,
                                  num_kv_heads)
    if amax is not None and per_head and not amax.per_head and num_kv_heads > 1:
        raise ValueError(f"kv_scales_per_head=True needs one scale per KV head, but {amax.source} has one per layer; "
                         f"recalibrate (python -m engine_core.calibrate writes per-head maxima) or use per-tensor "
                         f"scales")
    return amax


# ---- the calibration file ---------------------------------------------------------------------------
def save_kv_amax(path: str | Path, amax: KVAmax, model: str, notes: dict[str, Any] | None = None) -> None:
    """Write `amax` as JSON: the maxima, not scales, so one file serves e4m3 and e5m2 caches alike."""
    doc = dict(format=FILE_FORMAT, version=1, model=model, num_layers=amax.key.shape[0],
               num_kv_heads=amax.key.shape[1], k_amax=amax.key.tolist(), v_amax=amax.value.tolist(), **(notes or {}))
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_kv_amax(path: str | Path, num_layers: int, num_kv_heads: int) -> KVAmax:
    """Read and check a calibration file against the model: `k_amax` / `v_amax` must hold one row per
    layer, each a number or a list of one finite value >= 0 per KV head. Errors name the file and entry."""
    where = f"kv_cache_scales file {str(path)!r}"
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} is not readable JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
        raise ValueError(f"{where} is not a KV scales file (its \"format\" must be {FILE_FORMAT!r}; write one with "
                         f"python -m engine_core.calibrate)")
    rows = [_amax_rows(doc.get(name), name, where, num_layers, num_kv_heads) for name in ("k_amax", "v_amax")]
    return KVAmax(*_widen(rows[0] + rows[1], num_layers), where)


def _amax_rows(value: Any, name: str, where: str, num_layers: int, num_kv_heads: int) -> list[torch.Tensor]:
    if not isinstance(value, list) or len(value) != num_layers:
        got = f"{len(value)} rows" if isinstance(value, list) else repr(type(value).__name__)
        raise ValueError(f"{where}: {name} must be a list of one entry per layer ({num_layers} for this model), "
                         f"got {got}")
    rows = []
    for layer, row in enumerate(value):
        row = [row] if _is_number(row) else row
        if not isinstance(row, list) or len(row) not in (1, num_kv_heads) or not all(map(_is_number, row)):
            raise ValueError(f"{where}: {name}[{layer}] must be a number or a list of {num_kv_heads} numbers "
                             f"(one per KV head), got {row!r}")
        bad = next((x for x in row if not math.isfinite(x) or x < 0), None)
        if bad is not None:
            raise ValueError(f"{where}: {name}[{layer}] holds {bad!r}; every max |value| must be finite and >= 0")
        rows.append(torch.tensor(row, dtype=torch.float32))
    return rows


def _widen(rows: list[torch.Tensor], num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K rows then V rows (each 1 or num_kv_heads values) -> K and V `[num_layers, width]`: if any row is
    per head, per-tensor rows are repeated across heads (the same scale for each: nothing changes)."""
    width = max(r.numel() for r in rows)
    full = torch.stack([r.expand(width) for r in rows])
    return full[:num_layers], full[num_layers:]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ---- the checkpoint --------------------------------------------------------------------------------
def checkpoint_kv_amax(ckpt: CheckpointReader, num_layers: int, num_kv_heads: int) -> KVAmax | None:
    """The checkpoint's `k_scale` / `v_scale` per attention layer as maxima (scale * 448: they are e4m3
    scales), or None if it has none. `ckpt` reads fp32 (a bf16 read would round the scales)."""
    names = [(f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale") for i in range(num_layers)]
    present = [ckpt.has(n) for pair in names for n in pair]
    if not any(present):
        return None
    where = f"checkpoint {str(ckpt.folder)!r}"
    if not all(present):
        missing = next(n for pair in names for n in pair if not ckpt.has(n))
        raise ValueError(f"{where} has k_scale/v_scale tensors for some attention layers but not {missing!r}")
    rows = []
    for name in [k for k, _ in names] + [v for _, v in names]:
        t = ckpt.get(name).float().flatten()
        if t.numel() not in (1, num_kv_heads) or not torch.isfinite(t).all() or (t < 0).any():
            raise ValueError(f"{where}: {name} must hold 1 or {num_kv_heads} finite values >= 0, got {t.tolist()}")
        rows.append(t * fp8_max(CHECKPOINT_FORMAT))
    return KVAmax(*_widen(rows, num_layers), where)
