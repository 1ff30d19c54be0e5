"""GPTQ's error-compensating quantization of one linear layer (Frantar et al. 2022, AutoGPTQ's `fasterquant`).

Round-to-nearest (rtn.py) rounds every weight on its own. GPTQ rounds the K input columns of W `[N, K]` one after
another and, after each, moves the rounding error onto the columns not yet quantized, weighted by how the layer's
inputs correlate, so the layer's *output* `X W^T` on calibration inputs X `[M, K]` changes as little as it can
(the OBS update). The correlation is the Hessian of that squared output error, H = 2 X^T X / M `[K, K]`.

    H += damp_percent * mean(diag H) * I          (damping: X^T X is singular when M < K or inputs repeat)
    U = the upper Cholesky factor of H^-1          (U^T U = H^-1; row i of U is column i's update direction)
    for i in 0 .. K-1:                             (at i % group_size == 0: the group's scale and zero, rtn's
        q_i = quant(W[:, i])                        rule, from the columns as they are now, updated)
        e   = (W[:, i] - q_i) / U[i, i]
        W[:, i:] -= e[:, None] * U[i, i:][None, :]

The result is stored exactly like RTN's (q, scales, zeros in GPTQ's layout), so the same kernels serve it. AutoGPTQ
runs the same update in blocks of 128 columns (lazy batch updates, equal up to rounding) and, with `desc_act`,
in order of decreasing diag H (act-order); this module keeps the natural order. Computed in float64.
"""
from __future__ import annotations

import torch


def gptq_hessian(x: torch.Tensor) -> torch.Tensor:
    """Calibration inputs x `[M, K]` -> H = 2 X^T X / M, float64 `[K, K]`."""
    x = x.reshape(-1, x.shape[-1]).double()
    return 2.0 * x.t() @ x / max(x.shape[0], 1)


# seam: lab 13 (grader/seams.py)
def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                  damp_percent: float = 0.01) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w `[N, K]`, H `[K, K]` -> (q int32 `[N, K]`, scales fp32 `[K / g, N]`, zeros int32 `[K / g, N]`), rtn's
    layout, each group's scale and zero taken from its columns after the updates of the columns before it."""
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a weight [{n}, {k}], got {list(hessian.shape)}")
    if k % group_size:
        raise ValueError(f"group_size must divide the input size {k}, got {group_size}")
    maxq = 2**bits - 1
    weight = w.double().clone()
    h = hessian.double().clone()
    h.diagonal().add_(damp_percent * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(n, k, dtype=torch.int32)
    scales = torch.empty(k // group_size, n, dtype=torch.float64)
    zeros = torch.empty(k // group_size, n, dtype=torch.float64)
    for i in range(k):
        g = i // group_size
        if i % group_size == 0:
            group = weight[:, i:i + group_size]
            lo, hi = group.amin(dim=1).clamp(max=0), group.amax(dim=1).clamp(min=0)
            scale = (hi - lo) / maxq
            scales[g] = torch.where(scale > 0, scale, torch.ones_like(scale))
            zeros[g] = torch.round(-lo / scales[g])
        code = torch.clamp(torch.round(weight[:, i] / scales[g]) + zeros[g], 0, maxq)
        q[:, i] = code.to(torch.int32)
        err = (weight[:, i] - (code - zeros[g]) * scales[g]) / u[i, i]
        weight[:, i:] -= err[:, None] * u[i, i:][None, :]
    return q, scales.float(), zeros.to(torch.int32)
