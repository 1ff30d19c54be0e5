"""Lab 05's TTFT experiment on a loaded machine: its lesson comes from the prefill tokens, which no load can change.

The notebook runs waves of a warm-up request and six requests sharing a P-token system prompt (P = 0, 120,
248, 500, blocks of 16) through tiny-llama with prefix caching on and off, and plots the mean TTFT (wall
clock: not even monotonic in P on a busy machine) beside the prefill tokens computed (exact). Here the same
waves run through the scheduler with the model-free runner of grader/harness.py while a busy-looping process
occupies every core: the cache must save prefill tokens, more for a longer shared prefix, exactly the whole
blocks of the prefix, and give the hit rate of the notebook's prediction at P = 248.
"""
from __future__ import annotations

from cpu_hog import cpu_hog

from grader.harness import FakeRunner, make_request, make_scheduler

PREFIX_LENS, NUM_REQUESTS, QUESTION_LEN, BLOCK_SIZE = (0, 120, 248, 500), 6, 16, 16


def _drain(sched, runner) -> None:
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    raise AssertionError("the wave did not finish")


def wave(prefix_len: int, caching: bool) -> tuple[int, float]:
    """(prefill tokens of the six requests, hit rate of the seven) of one wave, as in the notebook."""
    system = [(13 * k) % 400 + 3 for k in range(prefix_len)]
    prompts = [system + [(31 * i + 7 * k) % 400 + 3 for k in range(QUESTION_LEN)] for i in range(NUM_REQUESTS + 1)]
    sched = make_scheduler(512, block_size=BLOCK_SIZE, max_model_len=1024, max_num_batched_tokens=8192,
                           enable_prefix_caching=caching)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("warm-up", prompts[0], max_tokens=4))
    _drain(sched, runner)
    before = sched.stats()["num_prefill_tokens"]
    for i, prompt in enumerate(prompts[1:]):
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=4, arrival=float(i + 1)))
    _drain(sched, runner)
    s = sched.stats()
    return s["num_prefill_tokens"] - before, s["prefix_cache_hits"] / max(s["prefix_cache_queries"], 1)


def test_prefill_tokens_saved_grow_with_the_shared_prefix_under_a_cpu_hog():
    with cpu_hog():
        runs = {(p, caching): wave(p, caching) for p in PREFIX_LENS for caching in (True, False)}
    saved = [runs[p, False][0] - runs[p, True][0] for p in PREFIX_LENS]
    assert saved == [NUM_REQUESTS * (p // BLOCK_SIZE * BLOCK_SIZE) for p in PREFIX_LENS], (saved, runs)
    assert saved == sorted(saved) and saved[0] == 0 < saved[1], saved
    assert abs(runs[248, True][1] - 6 * 240 / (7 * 264)) < 1e-9, runs[248, True]


def test_real_chat_workload_hits_the_template_prefix_in_whole_blocks():
    """The notebook's real-chat experiment (smollm2-135m-instruct, the engine's own pieces): the hits are exactly
    the whole blocks of the tokens all seven chat prompts share, six times (24 shared tokens, one block, with
    SmolLM2's default system prompt; 80, five blocks, with the notebook's longer one). ~15 s on 2 CPU cores."""
    import json
    from pathlib import Path

    from engine_core import LLM, SamplingParams

    nb = json.loads((Path(__file__).parents[2] / "solutions" / "05_prefix_caching" / "05_prefix_caching.ipynb")
                    .read_text())
    code = next("".join(c["source"]) for c in nb["cells"] if "def chat_wave" in "".join(c["source"]))
    scope = {"LLM": LLM, "SamplingParams": SamplingParams}
    exec(code[:code.index("for owner, name, fn in plugged")], scope)  # the constants and chat_wave only
    llm = LLM("smollm2-135m-instruct", block_size=BLOCK_SIZE, enable_prefix_caching=True,
              kv_cache_memory_bytes=64 << 20)
    for system, want_shared in ((None, 24), (scope["LONG_SYSTEM"], 80)):
        lens, shared, hits, queries, outs = scope["chat_wave"](llm, system)
        assert shared == want_shared, (system, shared)
        assert hits == 6 * (shared // BLOCK_SIZE * BLOCK_SIZE) and queries == sum(lens), (hits, queries, lens)
        assert all(o.outputs[0].text for o in outs)
