"""AWQ's per-input-channel scale search (Lin et al. 2023, AutoAWQ's `_search_best_scale`), for one linear layer.

A few input channels carry large activations; the weights they multiply matter most. AWQ multiplies weight column
j by s_j > 1 before quantizing (so its relative rounding error shrinks) and divides it back after, which in a served
model folds into the previous op (an RMSNorm's weight, the previous linear's rows): `x W^T = (x / s) (W * s)^T`.
The scales come from the activations alone, s = mean|x_j|^alpha (normalized so max(s) * min(s) = 1), and alpha is
searched on a grid, i / n_grid for i in 0 .. n_grid - 1, keeping the one whose layer output
`x (Q(W * s) / s)^T` is closest (mean squared error) to `x W^T`. Alpha 0 is plain round-to-nearest, so the search
never loses to RTN on the calibration inputs. The quantizer is rtn.py's group-wise one, at the same bits and group.
"""
from __future__ import annotations

import torch

from engine_core.models.quantization.rtn import dequantize_groupwise, quantize_groupwise


def awq_fake_quantize(w: torch.Tensor, s: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Q(W * s) / s in fp32 `[N, K]`: the weight the layer computes with after AWQ's scaling."""
    scaled = w.float() * s.float()[None, :]
    q, scales, zeros = quantize_groupwise(scaled, bits, group_size)
    return dequantize_groupwise(q, scales, zeros, group_size) / s.float()[None, :]


# seam: lab 13 (grader/seams.py)
def awq_search_scale(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int,
                     n_grid: int = 20) -> tuple[float, torch.Tensor]:
    """w `[N, K]`, calibration inputs x `[M, K]` -> (the best alpha, its scales s fp32 `[K]`)."""
    exact = x.double() @ w.double().t()
    x_mean = x.float().abs().reshape(-1, x.shape[-1]).mean(dim=0)
    best = (float("inf"), 0.0, torch.ones_like(x_mean))
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = (x.double() @ awq_fake_quantize(w, s, bits, group_size).double().t() - exact).pow(2).mean().item()
        if loss < best[0]:
            best = (loss, alpha, s)
    return best[1], best[2]
