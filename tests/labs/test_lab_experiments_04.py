"""Lab 04's experiment under a CPU hog: its lesson is drawn from a deterministic measure (tokens per
step priced with lab 01's roofline for Llama-3-8B on an H100), so it must hold on a loaded machine,
where the wall clock of tiny-llama on a CPU says nothing (chunked steps are even slower there)."""
from __future__ import annotations

from cpu_hog import cpu_hog

from engine_core import LLM, SamplingParams
from engine_core.capacity_planner import GPUS
from engine_core.memory import ModelSpec, num_params

LLAMA3_8B = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
                      intermediate_size=14336, vocab_size=128256)
H100 = GPUS["H100-80GB"]
LONG_PROMPT = [3 + (17 * k) % 500 for k in range(768)]
NUM_STEPS, ARRIVAL, BUDGET = 24, 3, 64


def modelled_step_ms(num_tokens: int) -> float:
    params = num_params(LLAMA3_8B)
    return 1e3 * max(2 * params / H100.hbm_bytes_per_s, 2 * params * num_tokens / H100.bf16_flops)


def run(chunked: bool) -> tuple[list[int], list[float]]:
    """The notebook's experiment, shortened: four streams decode, a 768-token prompt arrives at step 3.
    Returns the tokens of each step and stream0's modelled inter-token latencies (ms)."""
    llm = LLM("tiny-llama", device="cpu", num_gpu_blocks=256, swap_space=0, max_num_batched_tokens=BUDGET,
              enable_chunked_prefill=chunked, max_model_len=1024)
    engine, greedy = llm.engine, dict(temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"stream{i}", [3 + i, 40, 41, 42], SamplingParams(max_tokens=NUM_STEPS, **greedy))
    tokens, clock, stream0 = [], 0.0, []
    for k in range(NUM_STEPS):
        if k == ARRIVAL:
            engine.add_request("long", LONG_PROMPT, SamplingParams(max_tokens=2, **greedy))
        outputs = engine.step()
        n = engine.last_step.num_decode_tokens + engine.last_step.num_prefill_tokens
        tokens.append(n)
        clock += modelled_step_ms(n)
        if any(o.request_id == "stream0" for o in outputs):
            stream0.append(clock)
    return tokens, [b - a for a, b in zip(stream0, stream0[1:])]


def test_chunking_flattens_the_modelled_itl_under_a_cpu_hog():
    with cpu_hog():
        on_tokens, on_itl = run(chunked=True)
        off_tokens, off_itl = run(chunked=False)
    assert max(on_tokens) == BUDGET and max(off_tokens) == 768 + 4, (on_tokens, off_tokens)
    assert len(on_itl) == len(off_itl) == NUM_STEPS - 1, "every stream gets a token every step in both modes"
    # the worst gap: one weight read (4.8 ms) against a compute-bound 772-token step (12.5 ms)
    assert max(off_itl) > 2.5 * max(on_itl), (max(on_itl), max(off_itl))
    # mean TPOT hides the stall: one long gap among 23 moves the mean by under 10%
    mean_on, mean_off = sum(on_itl) / len(on_itl), sum(off_itl) / len(off_itl)
    assert 1.0 < mean_off / mean_on < 1.1, (mean_on, mean_off)
