"""Property-based (hypothesis, stateful): random add / step / abort sequences over random configs.

Invariants after every rule: a GPU block's ref count equals the number of block tables holding
it, and it sits in the free queue exactly when that is 0; a block in two tables is a cached
full block at the same position of two requests with the same token prefix (and LoRA); the
prefix-cache map points at blocks carrying that hash; CPU blocks belong to swapped requests
only; each request sits in the queue its status names. At the end every request finishes with
exactly its cache-free reference output (or was aborted) and every GPU and CPU block is free.
"""
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from grader.harness import EOS, FakeRunner, make_request, make_scheduler, reference_output

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
    def blocks_are_consistent(self):
        kvm = self.sched.kv_cache_manager
        holders = Counter()
        where: dict = {}
        for rid, table in kvm.req_to_blocks.items():
            for i, b in enumerate(table):
                holders[b.block_id] += 1
                where.setdefault(b.block_id, []).append((rid, i))
        for b in kvm.block_pool.blocks:
            assert b.ref_cnt == holders[b.block_id], f"{b}: held by {where.get(b.block_id)}"
            assert (b.ref_cnt == 0) == (b.block_id in kvm.block_pool.free_queue), b
        bs = kvm.block_size
        for block_id, places in where.items():
            if len(places) > 1:
                block = kvm.block_pool.blocks[block_id]
                assert block.block_hash is not None, f"block {block_id} shared without a hash: {places}"
                (r0, i0), rest = places[0], places[1:]
                prefix0 = self.sched.requests[r0].all_token_ids[:(i0 + 1) * bs]
                for r, i in rest:
                    assert i == i0 and self.sched.requests[r].all_token_ids[:(i + 1) * bs] == prefix0
                    assert self.sched.requests[r].lora_id == self.sched.requests[r0].lora_id
                assert block.block_hash.token_ids == tuple(prefix0[-bs:])
        for h, b in kvm.block_pool.cached_blocks.items():
            assert b.block_hash == h
        cpu_holders = Counter(b.block_id for t in kvm.req_to_cpu_blocks.values() for b in t)
        for b in kvm.cpu_block_pool.blocks:
            assert b.ref_cnt == cpu_holders[b.block_id] <= 1

    @invariant()
    def queues_match_statuses(self):
        s = self.sched
        assert {r.status for r in s.running} <= {RequestStatus.RUNNING}
        assert {r.status for r in s.swapped} <= {RequestStatus.SWAPPED}
        assert {r.status for r in s.waiting} <= {RequestStatus.WAITING, RequestStatus.PREEMPTED}
        queued = [r.request_id for q in (s.running, s.waiting, s.swapped) for r in q]
        assert sorted(queued) == sorted(s.requests)
        assert set(s.kv_cache_manager.req_to_cpu_blocks) <= {r.request_id for r in s.swapped}
        assert len(s.running) <= s.max_num_seqs

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
TestSchedulerInvariants.settings = settings(max_examples=250, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
