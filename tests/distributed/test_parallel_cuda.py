"""The parallel engine on CUDA (`make gpu-check`'s NCCL line): tensor_parallel_size=2 and
pipeline_parallel_size=2 over NCCL, one process per GPU, against the one-GPU engine on the CPU tests'
workload (chunked prefill, prefix caching, recompute preemption): the same greedy tokens and the logits
within the CPU tests' fp32 tolerance (TF32 is off for fp32 matmuls by default, so the reduction order is
again the only difference), and the collectives counted as on CPU. Skipped, with the reason, on a machine
with fewer than two CUDA devices."""
from __future__ import annotations

import pytest
import torch

from parallel_helpers import engine_logits, engine_pair, generate_tokens, stress_prompts

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(GPUS < 2, reason=f"NCCL tests need at least 2 CUDA devices, this machine has {GPUS}")]
TOL = 1e-4  # test_parallel_tp.py's TP_TOL: two fp32 reduction orders


@pytest.fixture(scope="module", params=[dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                ids=["tp2", "pp2"])
def engines(request):
    yield from engine_pair("tiny-llama", both=dict(device="cuda"), **request.param)  # its teardown: no process left


def test_greedy_tokens_and_logits_equal_one_gpu(engines):
    _, one, parallel, _ = engines
    prompts = stress_prompts(one.engine.vocab_size)
    assert generate_tokens(parallel, prompts) == generate_tokens(one, prompts)
    assert (engine_logits(one, prompts) - engine_logits(parallel, prompts)).abs().max().item() <= TOL
    stats = parallel.engine.stats()
    assert stats["num_preemptions_recompute"] > 0 and stats["prefix_cache_hits"] > 0, stats
    tp = parallel.engine.config.engine.tensor_parallel_size
    assert (stats["comm_num_all_reduces"] > 0) == (tp > 1) and (stats["comm_num_sends"] > 0) == (tp == 1), stats

