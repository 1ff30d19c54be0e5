"""SmoothQuant's migration (Xiao et al. 2023): move activation outliers into the weights before W8A8.

A few input channels of some projections carry values 100-1000x the others (SmolLM2-135M's
`down_proj` input: 3,732x the median channel in layer 11), so one int8 scale per token spends its 255
levels on them and rounds every other channel to a few levels. Per input channel j,

    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha),    X' = X / s,    W' = W * s (each column j)

leaves X' @ W'.T = X @ W.T exactly in real arithmetic and evens the channels' ranges out (alpha 0.5
splits the difficulty between the two). `max|X_j|` comes from calibration prompts. The division
is folded offline into whatever produces X (an RMSNorm's weight, or `up_proj`'s rows for `down_proj`,
whose input silu(gate) * up is no norm's output).

`quantization="int8", quantization_config={"smoothquant": FILE, "alpha": 0.5}` serves it
(`SmoothQuantInt8LinearMethod`): FILE holds the maxima per projection input, from
`python -m engine_core.calibrate --linear-out FILE`. The engine does not fold: it multiplies x by
1 / s before quantizing it (one elementwise pass per projection), which is the same arithmetic as a
folded checkpoint up to the fp32 rounding of that product.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from engine_core.models.quantization.int8 import Int8LinearMethod

# Where each projection's input comes from in a checkpoint, by the first checkpoint name of the engine's
# Linear (q|k|v share an input, so do gate|up): the keys of an activation-maxima file.
PROJECTION_INPUTS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


# seam: lab 13 (grader/seams.py)
def smoothquant_scales(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Calibrated max|X_j| `[in]` and the weight `[out, in]` -> s `[in]` (fp32); a channel that is zero on
    either side (never active, or no weight reads it) gets s = 1: nothing to migrate."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (the share of the difficulty moved into the weights), got {alpha}")
    if act_amax.shape != (weight.shape[1],):
        raise ValueError(f"act_amax must hold one maximum per input channel ([{weight.shape[1]}]), got "
                         f"{list(act_amax.shape)}")
    a, w = act_amax.float(), weight.float().abs().amax(dim=0)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


class SmoothQuantInt8LinearMethod(Int8LinearMethod):
    """W8A8 after SmoothQuant's migration: W * s quantized per channel at load, x / s quantized per token."""

    def __init__(self, act_amax: torch.Tensor, alpha: float) -> None:
        self.act_amax, self.alpha = act_amax, alpha

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.detach()
        s = smoothquant_scales(self.act_amax.to(w.device), w, self.alpha)
        layer.weight = nn.Parameter((w.float() * s).to(w.dtype), requires_grad=False)  # the loaded one may be mmapped
        layer.register_buffer("smooth_inv", (1.0 / s).to(w.dtype))
        super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return super().apply(layer, x * layer.smooth_inv, residual)

    def weight_bytes(self, layer: nn.Module) -> int:
        return super().weight_bytes(layer) + layer.smooth_inv.nbytes


def save_linear_amax(path: str | Path, amax: dict[str, torch.Tensor], source: str) -> None:
    """{checkpoint name of a projection: max |input| per channel} as JSON."""
    Path(path).write_text(json.dumps({"source": source, "linear_input_amax": {k: v.tolist() for k, v in amax.items()}}))


@functools.lru_cache(maxsize=4)
def load_linear_amax(path: str) -> dict[str, torch.Tensor]:
    """A file of `save_linear_amax`, read once per path (every projection of a model asks)."""
    try:
        data = json.loads(Path(path).read_text())["linear_input_amax"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"quantization_config['smoothquant'] {path!r} is not a file of activation maxima written by "
                         f"python -m engine_core.calibrate --linear-out: {e}") from None
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in data.items()}


def linear_amax_of(path: str, prefix: str, in_features: int) -> torch.Tensor:
    """The maxima of the projection whose first checkpoint name is `prefix`, checked against its input size."""
    amax = load_linear_amax(path)
    if prefix not in amax or amax[prefix].shape != (in_features,):
        found = list(amax[prefix].shape) if prefix in amax else "nothing"
        raise ValueError(f"quantization_config['smoothquant'] {path!r} has no maxima of {in_features} input channels "
                         f"for {prefix!r} (found {found}): calibrate this model again")
    return amax[prefix]
