"""The scheduler's hypothesis state machine, shared by the stateful fuzzers (test_invariants.py,
test_kv_eviction_fuzz.py): the step and abort rules, the invariant, and the teardown that drains the scheduler.

A subclass's `@initialize` rule sets `self.sched` and `self.runner` (a `grader.harness.FakeRunner`), and its
`add` rule submits requests through `submit`. After every rule the scheduler's state is whole
(`grader.harness.check_invariants`: ref counts, the free queue, shared blocks, the prefix-cache map, CPU blocks,
queues against statuses). At the end every request finishes with exactly its cache-free reference output (or was
aborted) and every GPU and CPU block is free.
"""
from grader.harness import EOS, check_invariants, make_request, reference_output
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.core.scheduler_output import SchedulerOutput
from engine_core.request import RequestStatus


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort sequences; subclasses add the `@initialize` and `add` rules."""

    def __init__(self) -> None:
        super().__init__()
        self.all: dict = {}  # every accepted request, by id
        self.aborted: set = set()
        self.n = 0

    def submit(self, prompt: list[int], max_tokens: int, **kwargs) -> str | None:
        """Add a request (`make_request`'s keyword arguments); its id, or None if `add_request` refused it, which
        must leave the scheduler as it was."""
        rid = f"r{self.n}"
        self.n += 1
        req = make_request(rid, prompt, max_tokens, arrival=float(self.n), eos=EOS, **kwargs)
        before = self.sched.get_num_unfinished_requests()
        try:
            self.sched.add_request(req)
        except ValueError:
            assert self.sched.get_num_unfinished_requests() == before, f"{rid} was refused but left a trace"
            return None
        self.all[rid] = req
        return rid

    def check_scheduled(self, out: SchedulerOutput) -> None:
        """A subclass's checks of a plan, before the runner executes it."""

    @rule()
    def step(self):
        out = self.sched.schedule()
        assert out.total_num_scheduled_tokens <= self.sched.max_num_batched_tokens
        assert len({c.request.request_id for c in out.scheduled}) == len(out.scheduled)
        self.check_scheduled(out)
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
