"""Lab 02's experiments under a CPU hog: their measures (slots held against tokens stored, requests running)
are deterministic, so the lessons hold on a loaded machine: paging keeps internal fragmentation under one
block per request (about half a block on average) and runs more requests than contiguous reservations."""
from __future__ import annotations

import numpy as np

from cpu_hog import cpu_hog

from engine_core.core.kv_cache_manager import KVCacheManager, cdiv
from engine_core.request import Request, SamplingParams
from grader.harness import FakeRunner, make_request, make_scheduler, step

MAX_MODEL_LEN, MAX_TOKENS = 4096, 1024


def held_and_stored(prompts, outputs, block_size):
    """The notebook's utilization experiment with the engine's allocator: slots held and tokens stored,
    summed over every request and decode step."""
    kvm = KVCacheManager(num_gpu_blocks=cdiv(MAX_MODEL_LEN, block_size), block_size=block_size)
    held = stored = 0
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        req = Request(f"r{i}", [1] * p, SamplingParams(max_tokens=MAX_TOKENS))
        kvm.allocate_slots(req, p)
        req.num_computed_tokens = p
        for _ in range(o):
            held += len(kvm.get_block_ids(req.request_id)) * block_size
            stored += req.num_computed_tokens
            kvm.allocate_slots(req, 1)
            req.num_computed_tokens += 1
        kvm.free(req)
    return held, stored


def test_paging_wastes_under_one_block_per_request_under_a_cpu_hog():
    rng = np.random.default_rng(0)
    prompts = np.clip(rng.lognormal(np.log(200), 1.0, 60), 4, MAX_MODEL_LEN - MAX_TOKENS).astype(int).tolist()
    outputs = np.clip(rng.lognormal(np.log(120), 1.0, 60), 1, MAX_TOKENS).astype(int).tolist()
    steps = sum(outputs)
    with cpu_hog():
        measured = {bs: held_and_stored(prompts, outputs, bs) for bs in (1, 16, 128)}
    for bs, (held, stored) in measured.items():
        waste = (held - stored) / steps
        assert 0 <= waste < bs, f"block size {bs}: {waste:.1f} empty slots per request, at most {bs - 1}"
    assert measured[1][0] == measured[1][1], "blocks of 1 slot waste nothing"
    held16, stored = measured[16]
    assert abs((held16 - stored) / steps - 7.5) < 1.0, "about half a block of 16 per request"
    contiguous = MAX_MODEL_LEN * steps
    assert stored / held16 > 0.9 > 0.2 > stored / contiguous, (stored / held16, stored / contiguous)


def test_the_scheduler_runs_more_requests_than_contiguous_reservations_under_a_cpu_hog():
    """The notebook's engine run, model-free (the running count does not depend on the model's tokens)."""
    blocks, block_size, max_len = 64, 16, 512
    with cpu_hog():
        sched = make_scheduler(blocks, block_size=block_size, max_model_len=max_len, max_num_batched_tokens=256)
        rng = np.random.default_rng(1)
        for i in range(24):
            sched.add_request(make_request(f"r{i}", int(rng.integers(10, 120)), max_tokens=int(rng.integers(2, 40))))
        runner, most = FakeRunner.for_scheduler(sched), 0
        for _ in range(2000):
            if not sched.has_unfinished_requests():
                break
            step(sched, runner)
            most = max(most, len(sched.running))
    assert not sched.has_unfinished_requests()
    assert most > blocks * block_size // max_len, f"at most {most} requests ran at once"
