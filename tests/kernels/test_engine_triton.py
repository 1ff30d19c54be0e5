"""The engine on the Triton kernels gives the same greedy tokens as on the reference ops.

On CPU this runs the kernels under the Triton interpreter (tests/kernels/conftest.py sets
TRITON_INTERPRET=1 before any kernel is imported): slow, so a tiny model and a few tokens. The
prompts cover a multi-block prefill, chunked prefill (a budget smaller than the longest
prompt, so a chunk runs over a cached prefix next to decode rows) and decode batches.
"""
from __future__ import annotations

import pytest
import torch

from engine_core.entrypoints.llm import LLM
from engine_core.request import SamplingParams

PROMPTS = ["The paged KV cache keeps every block", "Hi", "Flash-decoding splits a long context across programs"]


def _greedy_tokens(backend: str, num_sms: int = 0) -> list[list[int]]:
    llm = LLM(model="tiny-llama", attention_backend=backend, block_size=8, max_num_batched_tokens=32,
              num_gpu_blocks=32, seed=0)
    llm.engine.runner.num_sms = num_sms  # > 0: the runner asks the split policy each step
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow  # ~15 s on one core: every attention op of every step runs in the interpreter
def test_triton_backend_generates_the_reference_tokens() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; on CUDA the engine's default backend is already Triton")
    reference = _greedy_tokens("torch")
    triton = _greedy_tokens("triton")
    assert all(len(t) == 5 for t in reference), reference
    assert triton == reference, f"triton {triton} != torch {reference}"


@pytest.mark.slow  # ~15 s on one core, as above
def test_triton_backend_with_flash_decoding_splits_generates_the_reference_tokens(monkeypatch) -> None:
    """The split policy forced to 3 splits (a seam a lab may replace): every decode-op call of the
    engine runs the split kernel and the merge, and the tokens stay the reference ones."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; on CUDA the GPU tests cover the engine's own policy")
    from kernels import split_policy

    reference = _greedy_tokens("torch")
    calls = []
    monkeypatch.setattr(split_policy, "choose_num_splits", lambda *args: calls.append(args) or 3)
    triton = _greedy_tokens("triton", num_sms=132)
    assert calls and triton == reference, f"triton with 3 splits {triton} != torch {reference}"
