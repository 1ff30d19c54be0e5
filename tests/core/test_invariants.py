"""Property-based (hypothesis, stateful): random add / step / abort sequences over random configs.

After every rule the scheduler's state is whole (`grader.harness.check_invariants`: ref counts,
the free queue, shared blocks, the prefix-cache map, CPU blocks, queues against statuses). At the
end every request finishes with exactly its cache-free reference output (or was aborted) and
every GPU and CPU block is free. FUZZ_SCHEDULER_EXAMPLES sets the number of examples.
"""
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from grader.harness import EOS, FakeRunner, check_invariants, make_request, make_scheduler, reference_output

from engine_core.core.kv_cache_manager import cdiv
from engine_core.request import RequestStatus

PREFIXES = [[], [3] * 8, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9, 7, 8, 9]]


class SchedulerMachine(RuleBasedStateMachine):
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
        self.all: dict = {}
        self.aborted: set = set()
        self.n = 0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 9), min_size=0, max_size=30),
          max_tokens=st.integers(1, 24), priority=st.integers(0, 2), lora=st.sampled_from([None, None, 1]))
    def add(self, prefix, suffix, max_tokens, priority, lora):
        prompt = (prefix + suffix) or [5]
        rid = f"r{self.n}"
        self.n += 1
        req = make_request(rid, prompt, max_tokens, priority=priority, arrival=float(self.n), eos=EOS, lora_id=lora)
        s = self.sched
        fits = len(prompt) <= s.max_model_len and \
            cdiv(min(len(prompt) + max_tokens, s.max_model_len), s.block_size) <= s.kv_cache_manager.num_gpu_blocks
        before = s.get_num_unfinished_requests()
        try:
            s.add_request(req)
        except ValueError:
            assert not fits and s.get_num_unfinished_requests() == before
            return
        assert fits, f"{rid} fits but was rejected"
        self.all[rid] = req

    @rule()
    def step(self):
        out = self.sched.schedule()
        assert out.total_num_scheduled_tokens <= self.sched.max_num_batched_tokens
        assert len({c.request.request_id for c in out.scheduled}) == len(out.scheduled)
        self.sched.update_from_output(out, self.runner.execute(out))

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(rid)

    @invariant()
    def state_is_consistent(self):
        check_invariants(self.sched)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(5000):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        s = self.sched
        assert not s.has_unfinished_requests(), f"stuck: {s.stats()} running={s.running} waiting={list(s.waiting)}"
        kvm = s.kv_cache_manager
        assert kvm.block_pool.num_free_blocks == kvm.num_gpu_blocks
        assert kvm.cpu_block_pool.num_free_blocks == kvm.num_cpu_blocks
        for rid, req in self.all.items():
            if rid in self.aborted:
                assert req.status == RequestStatus.FINISHED_ABORTED
                continue
            assert req.is_finished and req.status != RequestStatus.FINISHED_ABORTED
            expected = reference_output(req.prompt_token_ids, req.sampling_params.max_tokens, EOS, s.max_model_len)
            assert req.output_token_ids == expected, f"{rid} after {req.num_preemptions} preemptions"


TestSchedulerInvariants = SchedulerMachine.TestCase
# `make fuzz` sets FUZZ_SCHEDULER_EXAMPLES to thousands; `make test` keeps the default.
TestSchedulerInvariants.settings = settings(max_examples=int(os.environ.get("FUZZ_SCHEDULER_EXAMPLES", "250")),
                                            stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
