"""The C kernels' tests again, on the builds other machines make: the portable path (no ISA flags: what Linux
on ARM runs, forced here on x86, where it leaves every AVX branch out) and clang without OpenMP (a Mac
without libomp; Debian's clang, .ci/run installs it), each against the same float64 oracles and formulas.

The tests are the other modules' own, imported: this module's fixture binds the other library first."""
from __future__ import annotations

import ctypes
import shutil

import pytest
from test_kernels_cpu import (  # noqa: F401 (collected here)
    test_bf16_rms_norm_rounds_as_the_formula,
    test_bf16_rotary_embedding_matches_the_formula_bit_for_bit,
    test_bf16_silu_and_mul_rounds_as_the_formula,
    test_cache_write_in_bf16_is_a_copy,
    test_cache_write_matches_the_reference_and_skips_minus_one,
    test_decode_bf16_at_every_head_size_and_group,
    test_decode_matches_oracle,
    test_decode_reads_a_strided_query,
    test_decode_rejects_a_block_outside_the_cache,
    test_rms_norm_matches_the_formula,
    test_rotary_embedding_rotates_in_place_like_the_formula,
    test_silu_and_mul_matches_the_formula,
)
from test_kernels_cpu_fused import (  # noqa: F401
    test_block_equals_the_three_kernels_bit_for_bit,
    test_block_matches_the_pytorch_chain_in_float64,
)
from test_kernels_cpu_prefill import test_prefill_head_dims, test_prefill_matches_oracle  # noqa: F401
from test_kernels_cpu_skinny_gemm import (  # noqa: F401
    test_matches_the_float64_product,
    test_the_fused_residual_is_the_separate_add_bit_for_bit,
)
from test_kernels_ggml_a8 import test_matches_the_reference_sums  # noqa: F401

from kernels import cpu
from kernels.cpu.interface import declare
from kernels.cpu.build import build, detect


@pytest.fixture(autouse=True, scope="module", params=["portable", "clang-no-openmp"])
def other_build(request: pytest.FixtureRequest):
    if request.param == "portable":
        path = build(portable=True)
    else:
        if shutil.which("clang") is None:
            pytest.skip("clang is not installed (Debian's clang; .ci/run installs it)")
        with pytest.MonkeyPatch.context() as env:
            env.setenv("CC", "clang")
            toolchain = detect(openmp=False)
        assert toolchain.kind == "clang" and toolchain.openmp_flags is None
        path = build(toolchain=toolchain)
    lib = ctypes.CDLL(str(path))
    with pytest.MonkeyPatch.context() as patch:
        declare(lib)
        patch.setattr(cpu, "_lib", lib)
        yield request.param
