"""The engine with LoRA adapters on the Triton kernels (SGMV / BGMV and attention) gives the same
greedy tokens as on the reference ops. On CPU the kernels run under the interpreter (slow): a
tiny model, a few tokens; one prompt long enough to be chunked next to decode rows, requests with
two adapters and one without in the same steps."""
from __future__ import annotations

import pytest
import torch

from engine_core import LLM, LoRARequest, SamplingParams
from engine_core.lora.presets import adapter_path

PROMPTS = [[5, 9, 14], list(range(3, 43)), [7, 7, 8, 9]]


def _greedy_tokens(backend: str) -> list[list[int]]:
    llm = LLM(model="tiny-llama", attention_backend=backend, block_size=8, max_num_batched_tokens=24,
              num_gpu_blocks=32, enable_lora=True, max_loras=2)
    loras = [LoRARequest(a, i + 1, str(adapter_path("tiny-llama", a))) for i, a in enumerate(["r8-attn", "r16-all"])]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False,
                        lora_request=[loras[0], loras[1], None])
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow  # every attention and LoRA op of every step runs in the interpreter
def test_triton_backend_generates_the_reference_tokens_with_adapters() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; on CUDA the engine's default backend is already Triton")
    reference = _greedy_tokens("torch")
    assert _greedy_tokens("triton") == reference
