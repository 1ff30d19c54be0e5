"""Property-based (hypothesis, stateful): random add / step / abort sequences over random configs.

The rules, the invariant and the teardown are `scheduler_machine.SchedulerMachine`'s: after every rule the
scheduler's state is whole, and at the end every request finishes with exactly its cache-free reference output (or
was aborted) and every GPU and CPU block is free. Here: the random configs (block size, GPU and CPU blocks, budget,
chunking, prefix caching, preemption mode), and requests that share prefixes, with priorities and a LoRA, each
accepted exactly when it fits. FUZZ_SCHEDULER_EXAMPLES sets the number of examples.
"""
import os

from grader.harness import FakeRunner, make_scheduler
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from scheduler_machine import SchedulerMachine

from engine_core.core.kv_cache_manager import cdiv

PREFIXES = [[], [3] * 8, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9, 7, 8, 9]]


class RandomConfigMachine(SchedulerMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_gpu_blocks=st.integers(4, 40),
        num_cpu_blocks=st.integers(0, 24),
        budget=st.integers(1, 48),
        max_num_seqs=st.integers(1, 6),
        chunked=st.booleans(),
        prefix=st.booleans(),
        mode=st.sampled_from(["auto", "recompute", "swap"]),
        threshold=st.sampled_from([0, 0, 3, 8]),
        max_model_len=st.sampled_from([16, 40, 96]),
    )
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, budget, max_num_seqs, chunked, prefix, mode,
              threshold, max_model_len):
        self.sched = make_scheduler(num_gpu_blocks, num_cpu_blocks, block_size=block_size, max_model_len=max_model_len,
                                    max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                    enable_chunked_prefill=chunked, enable_prefix_caching=prefix,
                                    preemption_mode=mode, long_prefill_token_threshold=threshold)
        self.runner = FakeRunner(num_gpu_blocks, block_size, num_cpu_blocks)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 9), min_size=0, max_size=30),
          max_tokens=st.integers(1, 24), priority=st.integers(0, 2), lora=st.sampled_from([None, None, 1]))
    def add(self, prefix, suffix, max_tokens, priority, lora):
        prompt = (prefix + suffix) or [5]
        s = self.sched
        fits = len(prompt) <= s.max_model_len and \
            cdiv(min(len(prompt) + max_tokens, s.max_model_len), s.block_size) <= s.kv_cache_manager.num_gpu_blocks
        rid = self.submit(prompt, max_tokens, priority=priority, lora_id=lora)
        assert (rid is not None) == fits, f"r{self.n - 1}: fits={fits}, accepted={rid is not None}"


TestSchedulerInvariants = RandomConfigMachine.TestCase
# `make fuzz` sets FUZZ_SCHEDULER_EXAMPLES to thousands; `make test` keeps the default.
TestSchedulerInvariants.settings = settings(max_examples=int(os.environ.get("FUZZ_SCHEDULER_EXAMPLES", "250")),
                                            stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
