"""What the scheduler needs to price a preemption: the model's shape, the KV dtype, and two rates.

Recompute costs prefill FLOPs at `prefill_flops_per_s`; swap moves the request's KV bytes out
and back at `swap_bytes_per_s` (the formulas are lab 01's `memory.recompute_seconds` /
`memory.swap_seconds`; `Scheduler.choose_preemption_mode` compares them). The engine builds one
from the checkpoint and the device; scheduler tests build one for a toy shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core import memory


@dataclass(frozen=True)
class PreemptionCostModel:
    model_spec: memory.ModelSpec
    kv_cache_dtype: torch.dtype | str  # what a swap copies: fp8 KV moves half the bytes of bf16
    prefill_flops_per_s: float
    swap_bytes_per_s: float  # host link, one direction

    @classmethod
    def for_device(cls, model_spec: memory.ModelSpec, kv_cache_dtype: torch.dtype | str, device_type: str,
                   prefill_flops_per_s: float | None = None,
                   swap_bytes_per_s: float | None = None) -> "PreemptionCostModel":
        """Rates given, or `memory.DEFAULT_RATES` of the device type for those left None."""
        if device_type not in memory.DEFAULT_RATES:
            raise ValueError(f"device_type must be one of {sorted(memory.DEFAULT_RATES)}, got {device_type!r}")
        default_flops, default_bandwidth = memory.DEFAULT_RATES[device_type]
        return cls(model_spec, kv_cache_dtype, prefill_flops_per_s or default_flops,
                   swap_bytes_per_s or default_bandwidth)
