"""GPTQ and AWQ checkpoints (`quantization="gptq"` / `"awq"`): pre-quantized 4/8-bit weights loaded by
their tensor names and layouts, the scheme's options read from config.json's `quantization_config` (as
vLLM and Hugging Face read them).

Each projection `P` stores `P.qweight`, `P.qzeros`, `P.scales` (and GPTQ's `P.g_idx`) instead of
`P.weight`. Both unpack to (q `[N, K]`, scales `[G, N]`, zeros `[G, N]`, g_idx `[K]`), the weight
w[n, k] = (q[n, k] - zeros[g_idx[k], n]) * scales[g_idx[k], n]:

- GPTQ (AutoGPTQ): qweight packs along K (rtn.py's layout), qzeros along N storing z - 1 (gptq.py), unless
  `checkpoint_format` is "gptq_v2" (GPTQModel: the zeros as they are). With `desc_act` (act-order) the
  groups are not contiguous: column k belongs to group g_idx[k].
- AWQ (AutoAWQ GEMM): both pack along N in an interleaved order (awq.py); groups are contiguous.

From there the layer is an `RTNLinearMethod`'s (the same reference path, CPU int4 kernel and Triton W4A16
kernel). Act-order weights are stored with K permuted by `argsort(g_idx)` (exllama's and Marlin's trick:
the groups become contiguous, so the grouped kernels apply) and each call reads x's columns in that order
(`layer.perm`); a g_idx whose groups are not all `group_size` long (no such permutation) keeps the per-column
reference path.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from engine_core.config import QuantizationConfig
from engine_core.models.loader import read_config
from engine_core.models.quantization import gptq, rtn
from engine_core.models.quantization.awq import unpack_awq
from engine_core.models.quantization.rtn import RTNLinearMethod
from kernels.quant_reference import act_order_permutation

PACKED_METHODS = ("gptq", "awq")
Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _pick(options: dict, keys: tuple[str, ...], default: object = None) -> object:
    """The first of `keys` present (AutoAWQ's `w_bit` / `q_group_size` are HF's `bits` / `group_size`)."""
    return next((options[k] for k in keys if k in options), default)


def resolve_packed_config(folder: str | Path, quant: QuantizationConfig) -> QuantizationConfig:
    """`quant` ("gptq" / "awq", bits unknown) completed from `folder`'s config.json `quantization_config`."""
    options = read_config(folder).get("quantization_config")
    where = f"config.json's quantization_config in {str(folder)!r}"
    if not isinstance(options, dict):
        raise ValueError(f"quantization={quant.method!r} loads a pre-quantized checkpoint, but {where} is missing "
                         f"(a dense checkpoint quantizes online with quantization='rtn')")
    if str(options.get("quant_method", "")).lower() != quant.method:
        raise ValueError(f"{where} has quant_method {options.get('quant_method')!r}, but quantization="
                         f"{quant.method!r}")
    bits = _pick(options, ("bits", "w_bit"))
    allowed = (4, 8) if quant.method == "gptq" else (4,)
    if type(bits) is not int or bits not in allowed:
        raise ValueError(f"{where}: bits must be one of {allowed} for {quant.method}, got {bits!r}")
    group = _pick(options, ("group_size", "q_group_size"), -1)
    if type(group) is not int or not (group == -1 or group > 0):
        raise ValueError(f"{where}: group_size must be a positive int or -1 (one group per row), got {group!r}")
    if quant.method == "awq":
        if str(options.get("version", "gemm")).lower() != "gemm" or not options.get("zero_point", True):
            raise ValueError(f"{where}: only AutoAWQ's GEMM layout with zero points is supported (version 'gemm', "
                             f"zero_point true), got version {options.get('version')!r}, zero_point "
                             f"{options.get('zero_point')!r}")
        return dataclasses.replace(quant, bits=bits, group_size=group)
    return dataclasses.replace(quant, bits=bits, group_size=group, desc_act=bool(options.get("desc_act", False)),
                               zeros_minus_one=options.get("checkpoint_format", "gptq") != "gptq_v2")


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"tensor {name!r}: {what}")


def _input_size(name: str, k: int, group_size: int) -> int:
    group = k if group_size == -1 else group_size
    _check(k % group == 0, name, f"quantization_config's group_size {group_size} must divide the input size K = {k}")
    return group


def projection_tensors(get: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str,
                       quant: QuantizationConfig) -> Tensors:
    """One projection's (q `[N, K]`, scales fp32 `[G, N]`, zeros int32 `[G, N]`, g_idx `[K]`), checked."""
    bits, per = quant.bits, 32 // quant.bits
    for part in ("qweight", "qzeros", "scales"):
        _check(has(f"{prefix}.{part}"), f"{prefix}.{part}", f"missing from the {quant.method} checkpoint (every "
               f"projection stores qweight, qzeros and scales)")
    qweight, qzeros, scales = (get(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales"))
    for part, t in (("qweight", qweight), ("qzeros", qzeros)):
        _check(t.dtype == torch.int32 and t.dim() == 2, f"{prefix}.{part}", f"must be 2-D int32 (packed words), "
               f"got {t.dtype} {tuple(t.shape)}")
    _check(scales.is_floating_point() and scales.dim() == 2, f"{prefix}.scales", f"must be 2-D floating point, got "
           f"{scales.dtype} {tuple(scales.shape)}")
    if quant.method == "gptq":
        k, n = qweight.shape[0] * per, qweight.shape[1]
        q = rtn.unpack_along_k(qweight, bits)  # module lookups: lab 13's seams reach the loader
        zeros = gptq.unpack_gptq_qzeros(qzeros, bits) - (0 if quant.zeros_minus_one else 1)
    else:
        k, n = qweight.shape[0], qweight.shape[1] * per
        q, zeros = unpack_awq(qweight).t().contiguous(), unpack_awq(qzeros)
    group = _input_size(f"{prefix}.qweight", k, quant.group_size)
    g = k // group
    for part, t in (("qzeros", zeros), ("scales", scales)):
        _check(tuple(t.shape) == (g, n), f"{prefix}.{part}", f"unpacks to {tuple(t.shape)}, expected (K / group_size, "
               f"N) = ({g}, {n}) for qweight's K = {k}, N = {n}")
    g_idx = torch.arange(k, device=q.device, dtype=torch.int32) // group
    if has(f"{prefix}.g_idx"):
        stored = get(f"{prefix}.g_idx")
        _check(tuple(stored.shape) == (k,) and not stored.is_floating_point() and bool(
            ((stored >= 0) & (stored < g)).all()), f"{prefix}.g_idx", f"must be K = {k} group indices in [0, {g}), "
               f"got {stored.dtype} {tuple(stored.shape)}")
        g_idx = stored.to(torch.int32)
    return q, scales.float(), zeros.to(torch.int32), g_idx


def fused_tensors(get: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefixes: list[str],
                  quant: QuantizationConfig) -> Tensors:
    """q|k|v or gate|up: the projections' tensors stacked along N (they share the input, so its g_idx)."""
    parts = [projection_tensors(get, has, p, quant) for p in prefixes]
    for prefix, part in zip(prefixes[1:], parts[1:]):
        _check(torch.equal(part[3], parts[0][3]), f"{prefix}.g_idx", f"must equal {prefixes[0]}.g_idx (the fused "
               f"projections share one input)")
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], dim=1),
            torch.cat([p[2] for p in parts], dim=1), parts[0][3])


class PackedLinearMethod(RTNLinearMethod):
    """A GPTQ/AWQ projection: the checkpoint's integers and scales as `RTNLinearMethod` holds them, act-order's
    K permutation `perm` (or, where no permutation makes the groups contiguous, `g_idx`: the reference path)."""

    def __init__(self, quant: QuantizationConfig, tensors: Tensors, dtype: torch.dtype, cpu_kernel: bool = True
                 ) -> None:
        k = tensors[0].shape[1]
        super().__init__(quant.bits, k if quant.group_size == -1 else quant.group_size, cpu_kernel)
        self.tensors, self.dtype = tensors, dtype

    def create_weights(self, layer: nn.Module, weight: nn.Parameter | None, bias: nn.Parameter | None) -> None:
        q = self.tensors[0]
        layer.bias, layer.input_size, layer.output_size = bias, q.shape[1], q.shape[0]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scales, zeros, g_idx = self.tensors
        del self.tensors
        contiguous = torch.equal(g_idx, torch.arange(q.shape[1], device=q.device, dtype=torch.int32) // self.group_size)
        perm = None if contiguous else act_order_permutation(g_idx, self.group_size)
        layer.g_idx = None if contiguous or perm is not None else g_idx
        self.cpu_kernel = self.cpu_kernel and layer.g_idx is None  # one method per layer (get_linear_method)
        self.store(layer, q if perm is None else q[:, perm], scales, zeros, self.dtype)
        layer.perm = None if perm is None else perm.to(torch.int32)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The checkpoint's weight `[N, K]` in its own K order (act-order's stored columns put back)."""
        if layer.perm is not None:
            stored = super().dequantized_weight(layer)
            w = torch.empty_like(stored)
            w[:, layer.perm.long()] = stored
            return w
        if layer.g_idx is None:
            return super().dequantized_weight(layer)
        q = rtn.unpack_along_k(layer.qweight, self.bits).float()
        z, s = layer.zeros.float()[layer.g_idx].t(), layer.scales.float()[layer.g_idx].t()  # [N, K] by each k's group
        return ((q - z) * s).to(layer.dtype)

    def weight_bytes(self, layer: nn.Module) -> int:
        return super().weight_bytes(layer) + sum(t.nbytes for t in (layer.g_idx, layer.perm) if t is not None)
