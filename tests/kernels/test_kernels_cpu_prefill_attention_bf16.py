"""The bf16 prefill tile on AVX512-BF16 (kernels/cpu/csrc/paged_attention_avx512bf16.h) against the float64
oracle: every head size it specialises and the generic one, odd chunk ends (a token pair half past the chunk);
the 8-wide bf16 tile that CPUs without AVX512-BF16 run, within the tighter bound of an fp32 P; and bugs planted
in the tile's C source, each failing these checks."""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch
from kernel_cases import assert_attention_close, awkward_lengths, max_abs_value, oracle_attention

from grader.harness import make_paged_kv
from kernels import cpu
from kernels.cpu.build import CSRC, build, detected
from kernels.cpu.interface import SIGNATURES, declare

CPU = torch.device("cpu")
NATIVE = "avx512_bf16" in open("/proc/cpuinfo").read()


def _check(seed: int, head_dim: int, group: int, block_size: int, rounds_p: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    lens = awkward_lengths(gen, 4, max(block_size, 2), max_len=45)
    q_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens]
    q_lens[1] = lens[1]  # a whole prompt
    kv = make_paged_kv(gen, lens, 2, head_dim, block_size, torch.bfloat16, CPU)
    query = torch.randn(sum(q_lens), 2 * group, head_dim, generator=gen).bfloat16()
    starts = torch.tensor([0] + q_lens).cumsum(0)
    scale = head_dim ** -0.5
    out = cpu.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, starts, scale)
    assert out.shape == query.shape and out.dtype == torch.bfloat16
    assert_attention_close(out, oracle_attention(query, kv, q_lens, scale), torch.bfloat16, seed,
                           f"bf16 prefill head_dim={head_dim} group={group} block_size={block_size} "
                           f"seq_lens={lens} q_lens={q_lens}", max_abs_value(kv), rounds_p=rounds_p)


CASES = [(64, 2, 16), (64, 1, 5), (128, 2, 16), (32, 4, 8), (48, 2, 16), (16, 2, 8), (24, 2, 16)]  # 48, 16: generic; 24: 8-wide


@pytest.mark.skipif(not NATIVE, reason="the tile runs on AVX512-BF16 only")
@pytest.mark.parametrize("head_dim,group,block_size", CASES)
def test_bf16_prefill_tile_matches_the_oracle(seed: int, head_dim: int, group: int, block_size: int) -> None:
    assert cpu.load() is not None, f"the C kernels did not build: {cpu.load_error()}"
    _check(seed, head_dim, group, block_size, rounds_p=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_prefill_without_avx512bf16_keeps_p_in_fp32(seed: int, head_dim: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8-wide bf16 tile (CPUs without AVX512-BF16), built and checked here too, within the fp32-P bound."""
    lib = ctypes.CDLL(str(build(("-mno-avx512bf16",))))
    declare(lib)
    monkeypatch.setattr(cpu, "load", lambda: lib)
    _check(seed, head_dim, 2, 16, rounds_p=False)


# bugs planted in the tile's source: (what, the line's text, its planted form)
PLANTED = [("V pairs swapped", "_mm256_unpacklo_epi16(v0, v1)", "_mm256_unpacklo_epi16(v1, v0)"),
           ("an odd chunk's last token dropped", "pairs = (cn + 1) / 2", "pairs = cn / 2"),
           ("odd key pairs dropped", "_mm256_add_ps(s0[t], s1[t])", "_mm256_add_ps(s0[t], _mm256_setzero_ps())"),
           ("dims not put back in order", "_mm256_permute2f128_ps(lo, hi, 0x20)", "_mm256_permute2f128_ps(hi, lo, 0x20)"),
           ("rescale skipped", "lo[r] = _mm256_mul_ps(_mm256_loadu_ps(&o[r][8 * j]), _mm256_set1_ps(a[r]));",
            "lo[r] = _mm256_loadu_ps(&o[r][8 * j]);"),
           ("second key pair from the first's place", "krow[t] + 2 * d2 + 2, 4", "krow[t] + 2 * d2, 4")]
HEADER = "paged_attention_avx512bf16.h"


@pytest.mark.skipif(not NATIVE, reason="the planted lines are in the AVX512-BF16 tile")
def test_planted_bugs_in_the_tile_fail_the_oracle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bug compiled into paged_attention.c alone fails the float64 bound; the file as it is passes."""
    source = (CSRC / HEADER).read_text()
    for name in ("paged_attention.c", "paged_attention.h"):
        (tmp_path / name).write_text((CSRC / name).read_text())
    tc = detected()
    for i, (what, line, planted) in enumerate([("nothing", "", ""), *PLANTED]):
        assert not line or source.count(line) == 1, what
        (tmp_path / HEADER).write_text(source.replace(line, planted) if line else source)
        out = tmp_path / f"planted{i}.so"
        done = subprocess.run([tc.cc, *tc.flags, f"-I{CSRC}", str(tmp_path / "paged_attention.c"), "-o", str(out)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        lib = ctypes.CDLL(str(out))
        for fn in ("paged_attention_f32", "paged_attention_bf16"):
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = SIGNATURES[fn]
        monkeypatch.setattr(cpu, "load", lambda lib=lib: lib)
        try:
            for seed, head_dim in ((0, 64), (1, 128), (2, 48)):
                _check(seed, head_dim, 2, 16, rounds_p=True)
            caught = False
        except AssertionError:
            caught = True
        assert caught == bool(line), f"planted bug not caught: {what}" if line else "the file as it is failed"
