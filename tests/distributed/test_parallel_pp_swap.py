"""Pipeline parallelism with swap preemption and the batch queue (two steps in flight): each stage copies
its own layers' blocks to its own CPU pool from the one swap plan of the message, in the order the steps
arrive, so a request swapped out while another batch is in flight resumes from the KV it had. Greedy
tokens equal one process's (the shared check of test_parallel_tp.py: chunked prefill, prefix caching,
preemption by swapping in both engines)."""
from __future__ import annotations

import pytest

from parallel_helpers import engine_pair
from test_parallel_tp import test_greedy_tokens_equal_tp1_under_chunking_prefix_caching_and_preemption

pytestmark = pytest.mark.timeout(600)
__all__ = ["test_greedy_tokens_equal_tp1_under_chunking_prefix_caching_and_preemption"]


@pytest.fixture(scope="module")
def engines():
    yield from engine_pair("tiny-llama", pipeline_parallel_size=2, preemption_mode="swap")


def test_the_queue_filled(engines):
    """After the shared test above ran: two batches were in flight at once."""
    _, one, pp, _ = engines
    assert pp.engine.stats()["max_batches_in_flight"] == 2 and one.engine.stats()["max_batches_in_flight"] == 1
