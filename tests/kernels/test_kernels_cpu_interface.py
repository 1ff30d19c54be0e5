"""kernels/cpu/interface.py mirrors csrc/kernels_cpu.h: the same structs field for field (name and C type, in
order, so the layouts agree), the same status codes, and a signature for every exported function, each
taking the struct the header says. A field added on one side only fails here, not as garbage in a kernel."""
from __future__ import annotations

import ctypes
import re

from kernels.cpu import interface
from kernels.cpu.build import CSRC

HEADER = (CSRC / "kernels_cpu.h").read_text()
CTYPES = {"void *": ctypes.c_void_p, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
STRUCTS = {"paged_attention_args": interface.PagedAttentionArgs, "reshape_and_cache_args": interface.ReshapeAndCacheArgs,
           "rotary_embedding_args": interface.RotaryEmbeddingArgs,
           "decode_attention_block_args": interface.DecodeAttentionBlockArgs,
           "skinny_gemm_args": interface.SkinnyGemmArgs, "ggml_mul_mat_a8_args": interface.GgmlMulMatA8Args,
           "fp8_gemm_args": interface.Fp8GemmArgs}


def _c_fields(body: str) -> list[tuple[str, type]]:
    """`const int32_t *a, *b; int64_t c;` -> [(a, void *), (b, void *), (c, int64_t)] as ctypes types."""
    fields = []
    for decl in filter(None, (d.strip() for d in re.sub(r"/\*.*?\*/", "", body, flags=re.S).split(";"))):
        base, *rest = re.split(r",", decl)
        ctype, first = re.match(r"(?:const\s+)?(\w+)\s+(.*)", base).groups()
        for name in [first, *rest]:
            name = name.strip()
            fields.append((name.lstrip("*").strip(), CTYPES["void *" if name.startswith("*") else ctype]))
    return fields


def test_every_struct_matches_the_header_field_for_field() -> None:
    found = dict((name, body) for body, name in re.findall(r"typedef struct \{(.*?)\} (\w+);", HEADER, flags=re.S))
    assert found.keys() == STRUCTS.keys()
    for name, struct in STRUCTS.items():
        assert _c_fields(found[name]) == list(struct._fields_), name


def test_the_status_codes_are_the_headers() -> None:
    codes = {int(v): k for k, v in re.findall(r"(KERNELS_CPU_\w+) = (\d+)", HEADER)}
    assert codes.keys() - {0} == interface.STATUS.keys() and codes[interface.NO_MEMORY] == "KERNELS_CPU_NO_MEMORY"


def test_every_exported_function_has_its_signature() -> None:
    prototypes = {name: (ret, params) for ret, name, params in re.findall(r"^(int|void) (\w+)\((.*?)\);", HEADER,
                                                                           flags=re.M | re.S)}
    assert prototypes.keys() == interface.SIGNATURES.keys()
    for name, (ret, params) in prototypes.items():
        argtypes, restype = interface.SIGNATURES[name]
        assert restype is {"int": ctypes.c_int, "void": None}[ret], name
        if struct := re.match(r"const (\w+_args) \*a$", params):
            assert argtypes == [ctypes.POINTER(STRUCTS[struct.group(1)])], name
        else:
            assert len(argtypes) == len(params.split(",")), name
