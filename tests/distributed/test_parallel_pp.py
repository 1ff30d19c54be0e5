"""Pipeline parallelism end to end: pipeline_parallel_size=2 (two worker processes, gloo, fp32, CPU):
layer 0 on stage 0, layer 1 on stage 1 (vLLM's split), the hidden state of every row sent from stage 0
to stage 1 each step, the last stage sampling. The same greedy tokens as one process under chunked
prefill, prefix caching and recompute preemption (one scheduler decides a preemption once; every stage
forgets the request's rows from the same message), and the same logits: a stage runs exactly the
arithmetic the whole model runs, so the only tolerance is for GEMM blocking with another thread count
(bit-identical on the 2-core test machine; 1e-5 allowed). A worker whose call raises ends the engine
with its traceback, leaving no process (last test: it stops this file's engine). This file's engine runs
one step at a time (`max_concurrent_batches=1`), so its schedule, preemptions included, is one process's;
the stages overlapping is test_parallel_pp_overlap.py's."""
from __future__ import annotations

import pytest

from engine_core import SamplingParams
from engine_core.exceptions import EngineDeadError
from parallel_helpers import child_processes, engine_logits, engine_pair, kv_cache_shape, stress_prompts
from test_parallel_tp import test_greedy_tokens_equal_tp1_under_chunking_prefix_caching_and_preemption

pytestmark = pytest.mark.timeout(600)
__all__ = ["test_greedy_tokens_equal_tp1_under_chunking_prefix_caching_and_preemption"]
PP_TOL = 1e-5


@pytest.fixture(scope="module")
def engines():
    yield from engine_pair("tiny-llama", pipeline_parallel_size=2, max_concurrent_batches=1)


def test_logits_match_one_process(engines):
    _, one, pp, _ = engines
    prompts = stress_prompts(one.engine.vocab_size)
    assert (engine_logits(one, prompts) - engine_logits(pp, prompts)).abs().max().item() <= PP_TOL


def test_one_step_at_a_time_when_the_config_says_so(engines):
    _, one, pp, _ = engines
    assert pp.engine.batch_queue_size == 1 and pp.engine.executor.max_concurrent_batches == 1
    pp.generate(stress_prompts(one.engine.vocab_size), use_tqdm=False)
    assert pp.engine.stats()["max_batches_in_flight"] == 1


def test_each_stage_caches_its_own_layers(engines):
    _, one, pp, _ = engines
    (shape, layers), = one.engine.executor.collective_rpc(kv_cache_shape)
    assert layers == 2
    assert pp.engine.executor.collective_rpc(kv_cache_shape) == [(shape, 1), (shape, 1)]
    assert pp.engine.kv_cache_config.block_bytes * 2 == one.engine.kv_cache_config.block_bytes


def test_hidden_states_cross_once_per_step(engines):
    """A 5-token prompt, 4 tokens: stage 0 sends every row of each forward (5, then 1), stage 1 receives it."""
    _, one, pp, _ = engines
    hidden = one.engine.model_config.args.hidden_size
    before = pp.engine.stats()
    pp.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    after = pp.engine.stats()
    delta = {k: after[k] - before[k] for k in after if k.startswith("comm_")}
    assert delta["comm_num_sends"] == delta["comm_num_recvs"] == 4
    assert delta["comm_bytes"] == (5 + 3) * hidden * 4 and delta["comm_num_all_reduces"] == 0


def raise_on_last_stage(runner):
    if runner.parallel.pp.is_last_rank:
        raise RuntimeError("planted fault on the last stage")
    return "ok"


def test_a_worker_that_raises_stops_the_engine(engines):
    _, one, pp, _ = engines
    with pytest.raises(EngineDeadError, match=r"worker 1 raised:(.|\n)*planted fault on the last stage"):
        pp.engine.executor.collective_rpc(raise_on_last_stage)
    assert not child_processes()
    with pytest.raises(EngineDeadError, match="planted fault"):  # and says so again on every later call
        pp.generate([[5, 6]], use_tqdm=False)
