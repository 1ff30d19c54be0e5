"""kernels.* dispatch: which backend runs, how it is forced, and what happens when it cannot run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import reference


def _decode_inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 8, 2, 16, generator=gen)
    return (torch.randn(2, 4, 16, generator=gen), cache, cache.flip(0).contiguous(),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([9, 16], dtype=torch.int32))


def _spy_triton_decode(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from kernels.triton import decode_attention
    calls: list[int] = []
    real = decode_attention.paged_attention_decode
    monkeypatch.setattr(decode_attention, "paged_attention_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_cpu_tensors_default_to_the_c_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` on CPU runs kernels.cpu (the C kernels), which agree with the reference to fp32 rounding."""
    from kernels import cpu
    monkeypatch.delenv("KERNELS_BACKEND", raising=False)
    calls = _spy_triton_decode(monkeypatch)
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "cpu"
    q, kc, vc, bt, sl = _decode_inputs()
    out = kernels.paged_attention_decode(q, kc, vc, bt, sl, 0.25)
    assert calls == [] and kernels.kernel_ops("auto", q.device).paged_attention_decode is cpu.paged_attention_decode
    torch.testing.assert_close(out, reference.paged_attention_decode(q, kc, vc, bt, sl, 0.25))


def test_torch_backend_is_the_reference_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    q, kc, vc, bt, sl = _decode_inputs()
    out = kernels.paged_attention_decode(q, kc, vc, bt, sl, 0.25, backend="torch")
    assert torch.equal(out, reference.paged_attention_decode(q, kc, vc, bt, sl, 0.25))
    monkeypatch.setenv("KERNELS_BACKEND", "torch")
    assert kernels.kernel_ops("auto", q.device).paged_attention_decode is reference.paged_attention_decode


def test_the_fused_elementwise_ops_come_with_the_cpu_backend_at_fp32_and_bf16() -> None:
    """One place picks the step's kernels: the model reads its fused RMSNorm, SiLU-and-mul and RoPE from
    the ops object (the C kernels exactly where they round as the model's formulas: fp32 and bf16 on the cpu
    backend; fp16 and the torch backend keep the formulas)."""
    from kernels import cpu
    if cpu.load() is None:
        pytest.skip(f"the C kernels could not be built here: {cpu.load_error()}")
    device = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        ops = kernels.kernel_ops("cpu", device, dtype)
        assert (ops.rms_norm, ops.silu_and_mul, ops.rotary_embedding) == (cpu.rms_norm, cpu.silu_and_mul,
                                                                          cpu.rotary_embedding), dtype
    for ops in (kernels.kernel_ops("cpu", device, torch.float16), kernels.kernel_ops("torch", device, torch.float32)):
        assert (ops.rms_norm, ops.silu_and_mul, ops.rotary_embedding) == (None, None, None), ops.backend


def test_cpu_backend_refuses_cuda_tensors() -> None:
    with pytest.raises(RuntimeError, match="the cpu backend got cuda tensors"):
        kernels.resolve_backend("cpu", torch.device("cuda"))


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_triton_can_be_forced(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("on CUDA machines the kernel tests run compiled kernels on GPU tensors, not CPU ones")
    calls = _spy_triton_decode(monkeypatch)
    q, kc, vc, bt, sl = _decode_inputs()
    if how == "environment":
        monkeypatch.setenv("KERNELS_BACKEND", "triton")
        out = kernels.paged_attention_decode(q, kc, vc, bt, sl, 0.25)
    else:
        monkeypatch.setenv("KERNELS_BACKEND", "torch")  # the argument wins over the environment
        out = kernels.paged_attention_decode(q, kc, vc, bt, sl, 0.25, backend="triton")
    assert calls == [1]
    torch.testing.assert_close(out, reference.paged_attention_decode(q, kc, vc, bt, sl, 0.25))


def test_bad_backend_names_are_value_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    q, kc, vc, bt, sl = _decode_inputs()
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.paged_attention_decode(q, kc, vc, bt, sl, 0.25, backend="cuda")
    monkeypatch.setenv("KERNELS_BACKEND", "tritonn")
    with pytest.raises(ValueError, match="KERNELS_BACKEND must be one of"):
        kernels.paged_attention_decode(q, kc, vc, bt, sl, 0.25)


def test_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, kc, vc, bt, sl = _decode_inputs()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.paged_attention_decode(q, kc, vc, bt, sl, 0.25, backend="triton")


def test_import_kernels_does_not_import_triton() -> None:
    code = "import sys, kernels; sys.exit('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "KERNELS_BACKEND"}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0, "import kernels pulled in triton"
