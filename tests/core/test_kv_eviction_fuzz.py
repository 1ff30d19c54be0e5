"""Property-based (hypothesis, stateful): random add / step / abort sequences under kv_eviction.

The fake model's next token chains on the KV of the previous position only, which eviction always keeps (the
recent block): so every request must still end with its cache-free reference output, which checks the kept-blocks
rows and `num_evicted_tokens` the runner gets. The step and abort rules, the invariant (the state is whole after
every rule) and the teardown (every block free at the end: no block leaked; one freed twice raises in `free_blocks`)
are `scheduler_machine.SchedulerMachine`'s; here every running request also holds at most its budget of computed
blocks at each plan. FUZZ_SCHEDULER_EXAMPLES sets the number of examples."""
import os

from grader.harness import FakeRunner, make_scheduler, mix, verify_greedy, VOCAB
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from scheduler_machine import SchedulerMachine

from engine_core.core.kv_cache_manager import NULL_BLOCK, cdiv
from engine_core.outputs import ModelRunnerOutput


class EvictingFakeRunner(FakeRunner):
    """FakeRunner over the kept-blocks rows: a token's slot is at its position less the chunk's evicted tokens.
    It reports a made-up attention score per block (H2O ranks by them)."""

    def execute(self, out):
        self.tables.apply(out)
        sampled, scores = {}, {}
        for chunk in out.scheduled:
            rid, table = chunk.request.request_id, self.tables.update(chunk)
            off = chunk.num_evicted_tokens
            end = chunk.start + chunk.num_tokens - off
            assert len(table) * self.bs >= end, f"request {rid}: row {table} is too short for {end} cached tokens"
            if chunk.start > 0:  # the previous position's KV, at its cache position
                slot = self.gpu[table[(chunk.start - 1 - off) // self.bs]][(chunk.start - 1 - off) % self.bs]
                assert slot is not None and slot[0] == chunk.start - 1, (rid, chunk.start - 1, off, table, slot)
            kv = -1 if chunk.start == 0 else slot[1]
            for pos, tok in enumerate(chunk.token_ids, start=chunk.start):
                kv = mix(kv, tok)
                self.gpu[table[(pos - off) // self.bs]][(pos - off) % self.bs] = (pos, kv)
            if chunk.emits:
                sampled[rid] = verify_greedy([], [kv % VOCAB])
            scores[rid] = [float((b * 7 + chunk.start) % 5) for b in table]
        return ModelRunnerOutput(sampled, block_scores=scores)


class EvictionMachine(SchedulerMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_gpu_blocks=st.integers(8, 40), budget=st.integers(1, 24),
                max_num_seqs=st.integers(1, 4), chunked=st.booleans(), policy=st.sampled_from(["streaming_llm", "h2o"]),
                sinks=st.integers(0, 2), recent=st.integers(1, 3), extra=st.integers(0, 3))
    def setup(self, block_size, num_gpu_blocks, budget, max_num_seqs, chunked, policy, sinks, recent, extra):
        self.budget_blocks = sinks + recent + 1 + extra
        self.sched = make_scheduler(num_gpu_blocks, 0, block_size=block_size, max_model_len=96,
                                    max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                    enable_chunked_prefill=chunked, preemption_mode="recompute", kv_eviction=policy,
                                    kv_budget_tokens=self.budget_blocks * block_size,
                                    kv_sink_tokens=sinks * block_size, kv_recent_tokens=recent * block_size)
        self.runner = EvictingFakeRunner(num_gpu_blocks, block_size)

    @rule(prompt=st.lists(st.integers(1, 9), min_size=1, max_size=40), max_tokens=st.integers(1, 40))
    def add(self, prompt, max_tokens):
        self.submit(prompt, max_tokens)

    def check_scheduled(self, out):
        """Every running request is within its budget once evicted (the partial block counted)."""
        kvm = self.sched.kv_cache_manager
        for request in self.sched.running:
            table = kvm.req_to_blocks.get(request.request_id, [])
            written = table[:cdiv(request.num_computed_tokens, self.sched.block_size)]
            assert sum(b is not NULL_BLOCK for b in written) <= self.budget_blocks, (request.request_id, written)


TestEvictionInvariants = EvictionMachine.TestCase
TestEvictionInvariants.settings = settings(max_examples=int(os.environ.get("FUZZ_SCHEDULER_EXAMPLES", "60")),
                                           stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
