"""Official tests of lab 12_serving: priority scheduling, latency metrics with SLO goodput, a prefix-aware router.

The learner writes eight engine pieces as plain functions (the seams in grader/seams.py):
`PriorityRequestQueue.append(self, request)` (the waiting queue's order under scheduling_policy
"priority") and `Scheduler._select_victim(self)` (the preemption victim); `request_metrics` (a
contract-only task), `percentile` and `meets_slos` of `engine_core.entrypoints.request_metrics`
(what the load generator reports); `HashRing.lookup(self, key, allowed)`, `load_bound` and
`prefix_aware` of the router's policies, plus three numeric predictions. Every test that runs the
learner's code does it inside `plug(student, LAB)`. Expected values come from hand arithmetic in the
docstrings, numpy's float64 percentiles (an independent reference), a sorted-list model of the hash
ring written here (`_ring_owner`), or the reference engine run in `functools.cache` helpers after the
plug block. The ordering is observed in the engine's own queue and schedule (the model-free scheduler
with its fake runner, and tiny-llama), the routing in the real router's `Router.choose`.
"""
import functools
import math
import random

import numpy as np
import pytest

from grader.harness import (FakeRunner, HashRing, PriorityRequestQueue, ReplicaLoad, LatencyMetrics, SamplingParams,
                            make_engine, make_request, make_router, make_scheduler, reference_output)
from grader.observe import expect_close, expect_equal, expect_prediction, expect_raises
from grader.plug import plug

LAB = "12_serving"
PRIORITY = ["append", "_select_victim"]  # a priority scheduler runs both
ROUTER = ["lookup", "prefix_aware"]  # the router calls these; your prefix_aware calls your own load_bound

# ---- task 1: the predictions -------------------------------------------------------------------

# M/M/1 with arrival rate 8/s, service rate 10/s: mean queueing wait Wq = lam / (mu (mu - lam)) = 0.4 s;
# TTFT = Wq + 50 ms of prefill; Little's law: mean number waiting Lq = lam * Wq = 3.2.
MM1_LAMBDA, MM1_MU, MM1_PREFILL_S = 8.0, 10.0, 0.05


def _replicas_for_p99_ttft() -> int:
    """10,000 RPS, 2,000-token prompts and 500-token outputs; one replica prefills 25,000 tokens/s and
    decodes 5,000 tokens/s: 0.18 s of replica time per request, mu = 5.556/s. As an M/M/1 queue,
    P(wait > t) = rho * exp(-(mu - lam) t); P99 TTFT <= 1 s leaves t = 1 - 0.08 s for the wait. The
    largest lam with rho * exp(-(mu - lam) t) <= 0.01, by bisection: 1.7844/s (rho 0.32); 10,000 / 1.7844
    = 5604.1, so 5,605 replicas."""
    mu, t = 1 / (2000 / 25000 + 500 / 5000), 1.0 - 2000 / 25000
    lo, hi = 0.0, mu
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (mid / mu) * math.exp(-(mu - mid) * t) < 0.01 else (lo, mid)
    return math.ceil(10_000 / lo)


@pytest.mark.points(2)
@pytest.mark.task("predictions")
def test_predicted_queueing(student):
    """M/M/1 at 8 req/s against a measured service rate of 10 req/s, 50 ms of prefill: the queue is
    0.4 / 0.45 = 0.889 of the mean TTFT, and Little's law puts 8 x 0.4 = 3.2 requests in the queue.

    Tolerance 1%: exact arithmetic; rejects the sojourn time 1 / (mu - lam) = 0.5 s for the wait (share
    0.909, 2.3% off; 4.0 waiting), the utilization 0.8 for the share, and Lq = rho^2/(1-rho) misread."""
    wq = MM1_LAMBDA / (MM1_MU * (MM1_MU - MM1_LAMBDA))
    expect_prediction(student.predicted_queueing_share(), wq / (wq + MM1_PREFILL_S),
                 "predicted_queueing_share(): M/M/1, lam = 8/s, mu = 10/s, 50 ms prefill: mean wait / mean TTFT",
                 rtol=0.01)
    expect_prediction(student.predicted_mean_waiting(), MM1_LAMBDA * wq,
                 "predicted_mean_waiting(): the same queue, Little's law: mean number of requests waiting", rtol=0.01)


@pytest.mark.points(2)
@pytest.mark.task("predictions")
def test_predicted_replicas(student):
    """Replicas for 10,000 RPS under P99 TTFT <= 1 s: 5,605 (see `_replicas_for_p99_ttft`).

    Tolerance 0.5% (28 replicas): admits a coarse bisection; rejects sizing on throughput alone
    (10,000 x 0.18 = 1,800), the mean wait instead of the P99 (about 2,000), prefill or decode left out."""
    expect_prediction(student.predicted_replicas(), _replicas_for_p99_ttft(),
                 "predicted_replicas(): 10,000 RPS, 2,000-token prompts, 500-token outputs, 25,000 prefill and 5,000 "
                 "decode tokens/s per replica, M/M/1 per replica, P99 TTFT <= 1 s", rtol=0.005)


# ---- task 2: PriorityRequestQueue.append --------------------------------------------------------

def _queue(student, specs) -> PriorityRequestQueue:
    """An empty priority queue (written directly), then your append for each (id, priority, arrival)."""
    q = PriorityRequestQueue()
    with plug(student, LAB, only=["append"]):
        for rid, priority, arrival in specs:
            q.append(make_request(rid, 3, priority=priority, arrival=arrival))
    return q


def _drain(q: PriorityRequestQueue) -> list[str]:
    """The engine's own popleft until empty: the admission order your append left."""
    return [q.popleft().request_id for _ in range(len(q))]


@pytest.mark.points(2)
@pytest.mark.task("append")
def test_append_orders_by_priority_then_arrival(student):
    """Lower `priority` first, then earlier arrival, whatever the order of the appends."""
    specs = [("c", 0, 3.0), ("a", 1, 0.0), ("b", 0, 1.0), ("d", 2, 0.5), ("e", 0, 2.0)]
    q = _queue(student, specs)
    expect_equal([r.request_id for r in q], ["b", "e", "c", "a", "d"],
                 f"appends of (id, priority, arrival) {specs}: the queue's order")
    expect_equal(_drain(q), ["b", "e", "c", "a", "d"], "the same queue: the engine's popleft order (self._keys "
                                                       "must stay in step with self._requests)")


@pytest.mark.points(1)
@pytest.mark.task("append")
def test_append_equal_keys_keep_insertion_order(student):
    """Two requests with the same (priority, arrival): the first appended is admitted first."""
    specs = [("x", 1, 5.0), ("y", 1, 5.0), ("w", 0, 9.0), ("z", 1, 5.0)]
    expect_equal(_drain(_queue(student, specs)), ["w", "x", "y", "z"],
                 f"appends of (id, priority, arrival) {specs}: the engine's popleft order")


@pytest.mark.points(1)
@pytest.mark.task("append")
def test_append_into_an_empty_queue_and_after_pops(student):
    """Appends interleaved with the engine's popleft: an empty queue, one request, a late important one."""
    q = PriorityRequestQueue()
    order = []
    with plug(student, LAB, only=["append"]):
        q.append(make_request("a", 3, priority=1, arrival=0.0))
        order.append(q.popleft().request_id)
        q.append(make_request("b", 3, priority=1, arrival=1.0))
        q.append(make_request("c", 3, priority=1, arrival=2.0))
        order.append(q.popleft().request_id)
        q.append(make_request("d", 3, priority=0, arrival=3.0))
        q.appendleft(make_request("p", 3, priority=1, arrival=0.5))  # a preempted request: its place by key
    order += _drain(q)
    expect_equal(order, ["a", "b", "d", "p", "c"], "append a, pop, append b and c, pop, append d (priority 0, "
                                                   "arrival 3), appendleft p (priority 1, arrival 0.5), pop all")


ARRIVALS = [("a", 1, 0.0), ("b", 0, 1.0), ("c", 2, 2.0), ("d", 1, 3.0)]  # before the first step
LATE = ("e", 0, 4.0)  # arrives after step 2
ADMISSION = ["b", "e", "a", "d", "c"]


def _admission_in_scheduler() -> list[str]:
    """max_num_seqs=1, 4-token prompts, 2 tokens each (prefill in one step, one decode): the order in
    which the model-free scheduler first schedules each request."""
    sched = make_scheduler(64, scheduling_policy="priority", max_num_seqs=1)
    runner = FakeRunner.for_scheduler(sched)
    for rid, priority, arrival in ARRIVALS:
        sched.add_request(make_request(rid, 4, max_tokens=2, priority=priority, arrival=arrival))
    order: list[str] = []
    for k in range(40):
        if k == 2:
            rid, priority, arrival = LATE
            sched.add_request(make_request(rid, 4, max_tokens=2, priority=priority, arrival=arrival))
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        order += [c.request.request_id for c in out.scheduled if c.request.request_id not in order]
        sched.update_from_output(out, runner.execute(out))
    return order


@pytest.mark.points(2)
@pytest.mark.task("append")
def test_admission_order_in_the_scheduler(student):
    """The scheduler admits from the head of your queue: b (priority 0) first; e (priority 0) arrives
    after step 2 and overtakes a, d (priority 1) and c (priority 2), which keep their order."""
    with plug(student, LAB, only=PRIORITY) as plugged:
        order = _admission_in_scheduler()
    expect_equal(plugged.uncalled(), ["_select_victim"], "your functions the scheduler never called (nothing is "
                                                         "preempted here)")
    expect_equal(order, ADMISSION, f"max_num_seqs=1, (id, priority, arrival) {ARRIVALS} queued, then {LATE} after "
                                   "step 2: the order in which requests are first scheduled")


# ---- task 3: Scheduler._select_victim -----------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("select_victim")
def test_victim_is_lowest_priority_then_latest_arrival(student):
    """Largest `priority` value first; among equal priorities the latest arrival."""
    sched = make_scheduler(32, scheduling_policy="priority")
    specs = [("a", 0, 1.0), ("b", 1, 0.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", 2, 0.5)]
    sched.running = [make_request(rid, 3, priority=p, arrival=t) for rid, p, t in specs]
    victims = []
    with plug(student, LAB, only=["_select_victim"]):
        while sched.running:
            victim = sched._select_victim()
            victims.append(victim.request_id)
            sched.running.remove(victim)
    expect_equal(victims, ["e", "c", "b", "d", "a"],
                 f"running (id, priority, arrival) {specs}: the victims of repeated _select_victim calls")


@pytest.mark.points(1)
@pytest.mark.task("select_victim")
def test_victim_leaves_running_unchanged(student):
    """_select_victim only chooses: the scheduler's _preempt removes the victim, so the list is untouched, whichever
    request is chosen (which one is test_victim_is_lowest_priority_then_latest_arrival's business)."""
    sched = make_scheduler(32, scheduling_policy="priority")
    sched.running = [make_request(rid, 3, priority=p, arrival=t) for rid, p, t in [("a", 0, 0.0), ("b", 0, 1.0)]]
    with plug(student, LAB, only=["_select_victim"]):
        sched._select_victim()
    expect_equal([r.request_id for r in sched.running], ["a", "b"],
                 "running a (priority 0, arrival 0) and b (priority 0, arrival 1): running after _select_victim")


PRESSURE = [("lo", 3, 0.0, 10), ("mid", 1, 1.0, 10), ("hi", 0, 2.0, 10), ("mid2", 1, 3.0, 10)]


def _preemptions(engine_functions: bool = False) -> tuple[list[list[str]], dict[str, list[int]]]:
    """6 GPU blocks of 4 tokens, four 6-token prompts with 10 output tokens each: blocks run out during
    decode. (preempted ids per step, tokens by request)."""
    sched = make_scheduler(6, scheduling_policy="priority", max_num_batched_tokens=32)
    runner = FakeRunner.for_scheduler(sched)
    for rid, priority, arrival, max_tokens in PRESSURE:
        sched.add_request(make_request(rid, [3 + len(rid), 4, 5, 6, 7, 8], max_tokens=max_tokens, priority=priority,
                                       arrival=arrival))
    preempted, outputs = [], {}
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        preempted.append(list(out.preempted_request_ids))
        for req in sched.update_from_output(out, runner.execute(out)):
            outputs[req.request_id] = list(req.output_token_ids)
    return preempted, outputs


@pytest.mark.points(2)
@pytest.mark.task("select_victim")
def test_victims_under_memory_pressure_in_the_scheduler(student):
    """Under block pressure the scheduler preempts by recompute the victims your rule picks: the
    least important request, never `hi`; every request still gets its exact tokens."""
    with plug(student, LAB, only=PRIORITY) as plugged:
        preempted, outputs = _preemptions()
    setup = (f"6 blocks of 4, (id, priority, arrival, max_tokens) {PRESSURE}, 6-token prompts, "
             "scheduling_policy='priority'")
    expect_equal(plugged.uncalled(), [], f"{setup}: your functions the scheduler never called")
    expect_equal("hi" in {rid for step in preempted for rid in step}, False, f"{setup}: was `hi` (priority 0) "
                                                                            "ever preempted?")
    expect_equal([s for s in preempted if s], [s for s in _reference_preemptions()[0] if s],
                 f"{setup}: the preempted request ids of each step that preempted")
    expect_equal(outputs, {rid: reference_output([3 + len(rid), 4, 5, 6, 7, 8], n) for rid, _, _, n in PRESSURE},
                 f"{setup}: each request's tokens")


# ---- task 4: request_metrics (contract only) ----------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("request_metrics")
def test_request_metrics_by_hand(student):
    """Sent at 10.0 s; chunks at 10.25, 10.30, 10.45, 10.50; stream ended at 10.55; 6 output tokens:
    TTFT 0.25, ITL [0.05, 0.15, 0.05] (the first chunk's wait is TTFT, not an ITL), E2E 0.55,
    TPOT (0.55 - 0.25) / 5 = 0.06."""
    with plug(student, LAB, only=["request_metrics"]):
        m = student.request_metrics(10.0, [10.25, 10.30, 10.45, 10.50], 10.55, 6)
    expect_close([m.ttft, *m.itl, m.tpot, m.e2el], [0.25, 0.05, 0.15, 0.05, 0.06, 0.55],
                 "request_metrics(10.0, [10.25, 10.30, 10.45, 10.50], 10.55, 6): [ttft, *itl, tpot, e2el]", atol=1e-9)


@pytest.mark.points(1)
@pytest.mark.task("request_metrics")
def test_request_metrics_merged_chunks_and_one_token(student):
    """3 chunks carrying 7 tokens (the server merged deltas): 2 ITLs, TPOT over the 6 tokens after the
    first. One chunk of one token: no ITL, no TPOT (None)."""
    with plug(student, LAB, only=["request_metrics"]):
        merged = student.request_metrics(0.0, [0.2, 0.5, 0.8], 0.8, 7)
        one = student.request_metrics(1.0, [1.5], 1.6, 1)
    expect_close([merged.ttft, *merged.itl, merged.tpot, merged.e2el], [0.2, 0.3, 0.3, 0.1, 0.8],
                 "request_metrics(0.0, [0.2, 0.5, 0.8], 0.8, 7): [ttft, *itl, tpot, e2el]", atol=1e-9)
    expect_equal((one.itl, one.tpot), ([], None), "request_metrics(1.0, [1.5], 1.6, 1): (itl, tpot)")
    expect_close((one.ttft, one.e2el), (0.5, 0.6), "request_metrics(1.0, [1.5], 1.6, 1): (ttft, e2el)", atol=1e-9)


@pytest.mark.points(1)
@pytest.mark.task("request_metrics")
def test_request_metrics_bad_input(student):
    """No chunk, or no output token: ValueError naming the parameter."""
    with plug(student, LAB, only=["request_metrics"]):
        expect_raises(ValueError, student.request_metrics, 0.0, [], 1.0, 3, match="chunk_times",
                      message="request_metrics(0.0, [], 1.0, 3): no chunk")
        expect_raises(ValueError, student.request_metrics, 0.0, [0.5], 1.0, 0, match="num_output_tokens",
                      message="request_metrics(0.0, [0.5], 1.0, 0): no output token")


# ---- task 5: percentile -------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("percentile")
def test_percentile_by_hand(student):
    """Linear between order statistics, rank q/100 * (n - 1) of the sorted values:
    [300, 100, 200]: P0 100, P50 200, P90 at rank 1.8 = 280, P100 300; [1, 2, 3, 4]: P50 at rank 1.5 =
    2.5 (nearest-rank gives 2 or 3), P99 at 2.97 = 3.97; one value is every percentile of itself.
    The caller's list stays as it was (a `values.sort()` reorders the caller's latencies)."""
    cases = [([300, 100, 200], 0), ([300, 100, 200], 50), ([300, 100, 200], 90), ([300, 100, 200], 100),
             ([1, 2, 3, 4], 50), ([1, 2, 3, 4], 99), ([5.0], 0), ([5.0], 99)]
    given = [list(v) for v, _ in cases]
    with plug(student, LAB, only=["percentile"]):
        got = [student.percentile(v, q) for v, (_, q) in zip(given, cases)]
    expect_close(got, [100, 200, 280, 300, 2.5, 3.97, 5.0, 5.0], f"percentile(values, q) for {cases}", atol=1e-9)
    expect_equal(given, [v for v, _ in cases], "the callers' lists after percentile(values, q): unchanged (the "
                                               "function must not sort them in place)")


def _random_percentile_cases(n: int, seed: int) -> list[tuple[list[float], float]]:
    """n (values, q): 1 to 40 values in [0, 1e4), q in [0, 100] with the ends and integers included."""
    rng = random.Random(seed)
    cases = []
    for k in range(n):
        values = [rng.uniform(0, 1e4) if rng.random() < 0.8 else float(rng.randrange(5)) for _ in range(rng.randint(1, 40))]
        cases.append((values, [0.0, 100.0, float(rng.randrange(101)), rng.uniform(0, 100)][k % 4]))
    return cases


@pytest.mark.points(2)
@pytest.mark.task("percentile")
def test_percentile_matches_numpy(student):
    """200 random lists and q (seeded: the same cases in every run) against numpy's linear percentile
    in float64, an independent reference."""
    cases = _random_percentile_cases(200, seed=20241212)
    with plug(student, LAB, only=["percentile"]):
        got = [student.percentile(list(values), q) for values, q in cases]
    want = [float(np.percentile(np.asarray(values, dtype=np.float64), q)) for values, q in cases]
    bad = next((i for i, (g, w) in enumerate(zip(got, want)) if not math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-9)), 0)
    expect_close(got, want, f"200 random (values, q); the first that differs, if any: percentile{cases[bad]}",
                 rtol=1e-9, atol=1e-9)


@pytest.mark.points(1)
@pytest.mark.task("percentile")
def test_percentile_bad_input(student):
    """No values, or q outside [0, 100]: ValueError naming the parameter."""
    with plug(student, LAB, only=["percentile"]):
        expect_raises(ValueError, student.percentile, [], 50, match="values", message="percentile([], 50)")
        expect_raises(ValueError, student.percentile, [1.0], 101, match="q", message="percentile([1.0], 101)")


# ---- task 6: meets_slos -------------------------------------------------------------------------

GOODPUT_RUN = [LatencyMetrics(0.10, [0.1] * 4, 0.10, 0.50), LatencyMetrics(0.20, [0.2] * 2, 0.20, 0.60),
               LatencyMetrics(0.30, [], None, 0.30), LatencyMetrics(0.25, [0.15], 0.15, 0.40)]


@pytest.mark.points(2)
@pytest.mark.task("meets_slos")
def test_goodput_counts_a_request_only_if_it_meets_every_slo(student):
    """SLOs TTFT <= 250 ms and TPOT <= 150 ms: r0 meets both, r1 misses TPOT, r2 misses TTFT (its
    missing TPOT is not held against it), r3 meets both at the limit (<= meets)."""
    slos = {"ttft": 0.25, "tpot": 0.15}
    with plug(student, LAB, only=["meets_slos"]):
        got = [student.meets_slos(m, slos) for m in GOODPUT_RUN]
        tpot_only = [student.meets_slos(m, {"tpot": 0.15}) for m in GOODPUT_RUN]
        none = [student.meets_slos(m, {}) for m in GOODPUT_RUN]
    expect_equal(got, [True, False, False, True], f"{GOODPUT_RUN} against {slos}: meets every SLO?")
    expect_equal(tpot_only, [True, False, True, True], "the same requests against TPOT <= 150 ms alone (a "
                                                       "one-token request has no TPOT)")
    expect_equal(none, [True] * 4, "the same requests against no SLO at all")


@pytest.mark.points(1)
@pytest.mark.task("meets_slos")
def test_meets_slos_e2el_and_bad_key(student):
    """E2E SLO 450 ms: r2 (300) and r3 (400) meet it; a key that is no SLO metric is a ValueError."""
    with plug(student, LAB, only=["meets_slos"]):
        got = [student.meets_slos(m, {"e2el": 0.45}) for m in GOODPUT_RUN]
        expect_raises(ValueError, student.meets_slos, GOODPUT_RUN[0], {"ttfb": 0.1}, match="slos",
                      message="meets_slos(r0, {'ttfb': 0.1})")
    expect_equal(got, [False, False, True, True], "the requests against E2E <= 450 ms")


# ---- task 7: HashRing.lookup --------------------------------------------------------------------

URLS = [f"http://127.0.0.1:{8001 + i}" for i in range(4)]


def _ring_owner(ring: HashRing, key_hash: int, allowed: set[str]) -> str | None:
    """The reference: the first point clockwise with hash > key_hash (wrapping past the top) whose
    replica is allowed; written with sorted lists, no bisect."""
    points = list(zip(ring._hashes, ring._urls))
    after = [u for h, u in points if h > key_hash] + [u for h, u in points if h <= key_hash]
    return next((u for u in after if u in allowed), None)


def _key_hash(key: str) -> int:
    from engine_core.entrypoints.router.policies import _hash

    return _hash(key)


def _key_above(ring: HashRing) -> str:
    """A key whose hash lies past the ring's last point (its owner is the first point: the wrap)."""
    return next(k for k in (f"prompt-{i}" for i in range(100_000)) if _key_hash(k) > ring._hashes[-1])


def _key_on_a_point(ring: HashRing) -> tuple[str, int]:
    """A key whose hash equals ring point j, the next point (j + 1) belonging to another replica: (key, j)."""
    j = next(j for j in range(len(ring._urls) - 1) if ring._urls[j + 1] != ring._urls[j])
    url = ring._urls[j]
    return next(k for k in (f"{url}#{i}" for i in range(len(ring._urls))) if _key_hash(k) == ring._hashes[j]), j


@pytest.mark.points(2)
@pytest.mark.task("lookup")
def test_lookup_wraps_around_and_skips_an_equal_point(student):
    """2 replicas x 2 points: a key hashed past the last point belongs to the first point's replica; a key whose
    hash equals a point belongs to the next point ("greater than", strictly: `bisect_right`, not `bisect_left`)."""
    ring = HashRing(URLS[:2], virtual_nodes=2)
    key = _key_above(ring)
    others = set(URLS[:2]) - {ring._urls[0]}
    tie, j = _key_on_a_point(ring)
    with plug(student, LAB, only=["lookup"]):
        got = ring.lookup(key, set(URLS[:2]))
        skip = ring.lookup(key, others)
        on_point = ring.lookup(tie, set(URLS[:2]))
    points = list(zip(ring._hashes, ring._urls))
    expect_equal(got, ring._urls[0], f"ring points {points}, key hash {_key_hash(key)} (past the last point): lookup")
    expect_equal(skip, _ring_owner(ring, _key_hash(key), others),
                 f"the same ring and key, allowed only {sorted(others)}: lookup")
    expect_equal(on_point, ring._urls[j + 1], f"ring points {points}, key {tie!r} whose hash {_key_hash(tie)} equals "
                                              f"point {j}: lookup (the first point greater than the hash)")


@pytest.mark.points(2)
@pytest.mark.task("lookup")
def test_lookup_matches_the_reference(student):
    """300 random keys and allowed sets (seeded) on a 4-replica ring of 8 points each, against `_ring_owner`."""
    ring = HashRing(URLS, virtual_nodes=8)
    rng = random.Random(20241213)
    cases = [("".join(rng.choice("abcxyz /:0123") for _ in range(rng.randint(0, 30))),
              sorted(u for u in URLS if rng.random() < 0.6)) for _ in range(300)]
    with plug(student, LAB, only=["lookup"]):
        got = [ring.lookup(key, set(allowed)) for key, allowed in cases]
    want = [_ring_owner(ring, _key_hash(key), set(allowed)) for key, allowed in cases]
    bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), 0)
    expect_equal(got, want, f"4 replicas x 8 points, 300 random (key, allowed); the first that differs, if any: "
                            f"lookup{cases[bad]}")


@pytest.mark.points(1)
@pytest.mark.task("lookup")
def test_lookup_empty_ring_and_nobody_allowed(student):
    """An empty ring, or no allowed replica: None."""
    with plug(student, LAB, only=["lookup"]):
        got = (HashRing([], virtual_nodes=4).lookup("k", set(URLS)), HashRing(URLS).lookup("k", set()))
    expect_equal(got, (None, None), "(lookup on a ring of no replica, lookup with allowed=set())")


class _Counted(list):
    """A list that counts the items read (by index or by iteration)."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


@pytest.mark.points(1)
@pytest.mark.task("lookup")
def test_lookup_binary_searches_the_ring(student):
    """A ring of 4 x 1,024 points: finding the key's point reads O(log n) hashes (bisect), not all of them.
    Bound 200 reads: log2(4096) = 12 for the search, the rest for walking past disallowed replicas."""
    ring = HashRing(URLS, virtual_nodes=1024)
    ring._hashes = _Counted(ring._hashes)
    with plug(student, LAB, only=["lookup"]):
        for i in range(10):
            ring.lookup(f"key-{i}", set(URLS))
    expect_equal(ring._hashes.reads <= 200, True, f"10 lookups on 4,096 points read {ring._hashes.reads} hashes: "
                                                  "at most 200?")


@pytest.mark.points(2)
@pytest.mark.task("lookup")
def test_a_dead_replica_moves_only_its_own_keys(student):
    """Consistent hashing: with replica 3 routed around, its keys move and every other key stays."""
    ring = HashRing(URLS, virtual_nodes=64)
    keys = [f"system prompt {i}" for i in range(300)]
    with plug(student, LAB, only=["lookup"]):
        before = {k: ring.lookup(k, set(URLS)) for k in keys}
        after = {k: ring.lookup(k, set(URLS[:3])) for k in keys}
    moved = sorted({before[k] for k in keys if before[k] != after[k]})
    expect_equal(moved, [URLS[3]], "4 replicas x 64 points, 300 keys, then replica 3 not allowed: the replicas "
                                   "whose keys moved")
    expect_equal(after, {k: _ring_owner(ring, _key_hash(k), set(URLS[:3])) for k in keys},
                 "the same keys without replica 3: their replicas")


# ---- task 8: load_bound and prefix_aware --------------------------------------------------------

def _loads(in_flight: list[int]) -> list[ReplicaLoad]:
    return [ReplicaLoad(URLS[i], in_flight=n) for i, n in enumerate(in_flight)]


@pytest.mark.points(1)
@pytest.mark.task("bounded_load")
def test_load_bound_by_hand(student):
    """ceil(c * (in-flight + 1) / replicas), the new request counted: [3, 1, 0] c=1.25: ceil(2.08) = 3;
    [0, 0] c=1: ceil(0.5) = 1; [4, 4, 4, 4] c=1.25: ceil(5.31) = 6; [2, 2] c=1.5: ceil(3.75) = 4."""
    cases = [([3, 1, 0], 1.25), ([0, 0], 1.0), ([4, 4, 4, 4], 1.25), ([2, 2], 1.5)]
    with plug(student, LAB, only=["load_bound"]):
        got = [student.load_bound(_loads(n), c) for n, c in cases]
    expect_equal(got, [3, 1, 6, 4], f"load_bound for (in-flight, c) {cases}")


@pytest.mark.points(2)
@pytest.mark.task("bounded_load")
def test_prefix_aware_affinity_then_fallback(student):
    """The ring's replica while it stays within the bound with this request; else the least loaded."""
    ring = HashRing(URLS[:3], virtual_nodes=16)
    key = "You are a helpful assistant."
    owner = _ring_owner(ring, _key_hash(key), set(URLS[:3]))
    k = URLS.index(owner)
    cases = [[0, 0, 0], [2, 2, 2], [3, 3, 3]]
    hot = [0, 0, 0]
    hot[k] = 3  # bound ceil(1.25 * (4 + 1) / 3) = 3: the owner would hold 4
    hot[(k + 1) % 3] = 1
    cases.append(hot)
    with plug(student, LAB, only=["load_bound", "prefix_aware", "lookup"]):
        got = [student.prefix_aware(_loads(n), key, ring, 1.25).url for n in cases]
    expect_equal(got, [owner, owner, owner, URLS[(k + 2) % 3]],
                 f"3 replicas, key {key!r} (ring owner {owner}), c=1.25, in-flight {cases}: the chosen replica")


@pytest.mark.points(1)
@pytest.mark.task("bounded_load")
def test_prefix_aware_bad_input(student):
    """No replica up, or c < 1: ValueError."""
    ring = HashRing(URLS[:2])
    with plug(student, LAB, only=["load_bound", "prefix_aware", "lookup"]):
        expect_raises(ValueError, student.prefix_aware, [], "k", ring, 1.25, match="replica",
                      message="prefix_aware([], 'k', ring, 1.25)")
        expect_raises(ValueError, student.prefix_aware, _loads([0, 0]), "k", ring, 0.5, match="c",
                      message="prefix_aware(two replicas, 'k', ring, 0.5)")


def _route(prompts: list[str], lifetime: int) -> tuple[list[str], list[int], list[int]]:
    """The real router (prefix_aware, c=1.25, 3 replicas): each request stays in flight for `lifetime`
    later arrivals. (chosen replica per request, in-flight of the chosen one counting it, the bound then)."""
    router = make_router(URLS[:3], balance_factor=1.25)
    live: list[tuple[int, object]] = []
    chosen, loads, bounds = [], [], []
    for i, prompt in enumerate(prompts):
        for _, done in [x for x in live if x[0] <= i]:
            done.in_flight -= 1
        live = [x for x in live if x[0] > i]
        bounds.append(math.ceil(1.25 * (sum(r.in_flight for r in router.replicas) + 1) / 3))  # the rule, by hand
        replica = router.choose({"prompt": prompt})
        replica.in_flight += 1
        live.append((i + lifetime, replica))
        chosen.append(replica.url)
        loads.append(replica.in_flight)
    return chosen, loads, bounds


HOT = "You are a support agent for ACME. " * 4


@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_router_balance_and_affinity(student):
    """Through the real router's `choose`: 60 requests, 4 of 5 sharing a hot system prompt, each in
    flight for 6 arrivals. Balance: no replica ever holds more than the bound. Affinity: at light load
    (each request done before the next), every request goes to its prefix's ring replica."""
    prompts = [HOT + f"question {i}" if i % 5 else f"unique {i} " * 40 for i in range(60)]
    with plug(student, LAB, only=ROUTER) as plugged:
        chosen, loads, bounds = _route(prompts, lifetime=6)
        light, _, _ = _route(prompts, lifetime=1)
    expect_equal(plugged.uncalled(), [], "the router: your functions it never called")
    expect_equal([i for i, (n, b) in enumerate(zip(loads, bounds)) if n > b], [],
                 "60 requests (80% one hot prefix), 3 replicas, c=1.25, 6 in flight: the requests placed above the bound")
    expect_equal(len(set(c for c, p in zip(chosen, prompts) if p.startswith(HOT))) > 1, True,
                 "the same run: did the hot prefix spill over to more than one replica once its owner was full?")
    ring = HashRing(URLS[:3])
    expect_equal(light, [_ring_owner(ring, _key_hash(p[:256]), set(URLS[:3])) for p in prompts],
                 "the same prompts at light load (each done before the next arrives): the chosen replicas")


# ---- end to end: priority admission in tiny-llama ----------------------------------------------

def _engine_first_tokens() -> list[str]:
    """tiny-llama, scheduling_policy='priority', max_num_seqs=1: ARRIVALS queued, LATE added after step
    2; the order in which requests emit their first token."""
    engine = make_engine("tiny-llama", scheduling_policy="priority", max_num_seqs=1, num_gpu_blocks=64)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for rid, priority, arrival in ARRIVALS:
        engine.add_request(rid, [5, 6, 7, 8], params, priority=priority, arrival_time=arrival)
    order: list[str] = []
    for k in range(40):
        if k == 2:
            rid, priority, arrival = LATE
            engine.add_request(rid, [5, 6, 7, 8], params, priority=priority, arrival_time=arrival)
        if not engine.has_unfinished_requests():
            break
        order += [o.request_id for o in engine.step() if o.outputs[0].token_ids and o.request_id not in order]
    return order


@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_admits_by_priority(student):
    """The real engine (tiny-llama) with your queue: the same crafted arrivals as the
    scheduler test, observed as the order of first tokens."""
    with plug(student, LAB, only=["append"]) as plugged:  # nothing is preempted: the victim rule is not asked
        order = _engine_first_tokens()
    expect_equal(plugged.uncalled(), [], "tiny-llama: your functions the engine never called")
    expect_equal(order, ADMISSION, f"tiny-llama, max_num_seqs=1, (id, priority, arrival) {ARRIVALS}, then {LATE} "
                                   "after step 2: the order of first tokens")


@functools.cache
def _reference_preemptions() -> tuple[list[list[str]], dict[str, list[int]]]:
    return _preemptions()


# ---- task 9: length-aware routing -----------------------------------------------------------------------

def _policies():
    """The router's policies module (imported here: labs without a router do not load it)."""
    from engine_core.entrypoints.router import policies

    return policies


def _long_threshold() -> int:
    """The longest n with prefill_lower_bound(Llama-3-8B, bf16, n, H100) / 0.4 <= 0.2 s: 5166 tokens (2 x 8.03e9
    FLOPs per token plus causal attention, at 40% of 989 TFLOP/s), found by scanning down from a safe bound."""
    from engine_core import capacity_planner, memory

    spec = memory.ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=14336, vocab_size=128256)
    h100 = capacity_planner.GPUS["H100-80GB"]
    n = int(0.2 * 0.4 * h100.bf16_flops / (2 * 6.98e9))  # the dense FLOPs alone: an upper bound (5666)
    while capacity_planner.prefill_lower_bound(spec, "bf16", n, h100) / 0.4 > 0.2:
        n -= 1
    return n


@pytest.mark.points(1)
@pytest.mark.task("length_aware")
def test_predicted_long_threshold(student):
    """Llama-3-8B, bf16, one H100 at 40% of peak, 200 ms: 5166 tokens (within 1%: prefill at 100% of peak gives
    12.9k, the attention term left out about 5.6k)."""
    expect_prediction(student.predicted_long_threshold(), _long_threshold(),
                      "predicted_long_threshold(): the longest prompt (tokens) whose prefill on one H100 at 40% of "
                      "peak fits 200 ms", rtol=0.01)


LONG_POOL = {URLS[2], URLS[3]}


def _loads(in_flight):
    return [ReplicaLoad(url, in_flight=n) for url, n in zip(URLS, in_flight)]


# (prompt tokens, in-flight per replica of URLS, the replicas up (indices)) -> the expected replica, threshold 100,
# replicas 2 and 3 the long pool
LENGTH_CASES = [
    ((10, [3, 1, 0, 0], (0, 1, 2, 3)), 1),  # short: the least loaded short replica, though the long side idles
    ((100, [3, 1, 2, 0], (0, 1, 2, 3)), 3),  # exactly the threshold is long
    ((99, [0, 5, 0, 0], (0, 1, 2, 3)), 0),  # one below it is short
    ((5000, [0, 0, 4, 2], (0, 1, 2, 3)), 3),
    ((5000, [0, 0, 2, 2], (0, 1, 2, 3)), 2),  # equal loads: the first listed
    ((500, [2, 1, 0, 0], (0, 1)), 1),  # the long pool is down: the least loaded of all
    ((5, [0, 0, 3, 1], (2, 3)), 3),  # the short side is down: the long pool serves it
]


@pytest.mark.points(3)
@pytest.mark.task("length_aware")
def test_length_aware_by_hand(student):
    """Threshold 100, replicas 2 and 3 the long pool: short prompts to the least loaded of 0 and 1, long ones (100
    tokens included) to the least loaded of 2 and 3; a side with nobody up borrows the other."""
    for (tokens, in_flight, up), expected in LENGTH_CASES:
        replicas = [r for i, r in enumerate(_loads(in_flight)) if i in up]
        with plug(student, LAB, only=["length_aware"]):
            got = _policies().length_aware(replicas, tokens, 100, LONG_POOL).url
        expect_equal(got, URLS[expected], f"length_aware({tokens} tokens, in flight {in_flight}, replicas up "
                     f"{list(up)}, threshold 100, long pool = replicas 2 and 3)")


@pytest.mark.points(1)
@pytest.mark.task("length_aware")
def test_length_aware_bad_input(student):
    """No replica up: ValueError "no replica is up"; threshold 0: ValueError naming threshold."""
    with plug(student, LAB, only=["length_aware"]):
        fn = _policies().length_aware
        expect_raises(ValueError, fn, [], 5, 100, LONG_POOL, match="no replica is up",
                      message="length_aware([], 5, 100, pool): no replica")
        expect_raises(ValueError, fn, _loads([0, 0, 0, 0]), 5, 0, LONG_POOL, match="threshold",
                      message="length_aware(4 replicas, 5, threshold=0, pool): a ValueError naming threshold")


def _length_bodies():
    """40 request bodies: token-id prompts of 4..400 ids and text prompts of 20..2000 characters (5..500 tokens
    as the router estimates them, 4 characters a token), seeded."""
    rng = random.Random(9)
    bodies = []
    for i in range(40):
        n = rng.choice([4, 16, 63, 64, 65, 200, 400])
        bodies.append({"prompt": [3 + (i + k) % 500 for k in range(n)]} if i % 2 else {"prompt": "w" * (4 * n)})
    return bodies


def _length_reference(bodies, lifetime):
    """The rule, written here: by the estimated length (>= 64 tokens: long), then the fewest in flight among the
    side's replicas (the first listed among equals); each request in flight for `lifetime` arrivals."""
    in_flight, live, chosen = [0, 0, 0, 0], [], []
    for i, body in enumerate(bodies):
        for _, k in [x for x in live if x[0] <= i]:
            in_flight[k] -= 1
        live = [x for x in live if x[0] > i]
        prompt = body["prompt"]
        tokens = len(prompt) if isinstance(prompt, list) else -(-len(prompt) // 4)
        side = [2, 3] if tokens >= 64 else [0, 1]
        k = min(side, key=lambda j: in_flight[j])
        in_flight[k] += 1
        live.append((i + lifetime, k))
        chosen.append(URLS[k])
    return chosen


@pytest.mark.points(2)
@pytest.mark.task("length_aware")
@pytest.mark.end_to_end
def test_router_routes_by_length(student):
    """Through the real router's `choose` (policy length_aware, threshold 64 tokens, replicas 2 and 3 the long
    pool): 40 token-id and text prompts of 4 to 400 tokens, each in flight for 3 arrivals, land where the rule
    says; then with the long pool down, every request goes to replica 0 or 1."""
    bodies = _length_bodies()
    with plug(student, LAB, only=["length_aware"]) as plugged:
        router = make_router(URLS, policy="least_loaded")
        router.policy, router.long_pool, router.long_threshold = "length_aware", LONG_POOL, 64
        live, chosen = [], []
        for i, body in enumerate(bodies):
            for _, done in [x for x in live if x[0] <= i]:
                done.in_flight -= 1
            live = [x for x in live if x[0] > i]
            replica = router.choose(body)
            replica.in_flight += 1
            live.append((i + 3, replica))
            chosen.append(replica.url)
        for replica in router.replicas:
            replica.in_flight = 0
        router.replicas[2].mark_down(60.0)
        router.replicas[3].mark_down(60.0)
        pool_down = set()
        for body in bodies:  # nothing finishes: the load spreads over whatever replicas the rule allows
            replica = router.choose(body)
            replica.in_flight += 1
            pool_down.add(replica.url)
    expect_equal(plugged.uncalled(), [], "the router: your functions it never called")
    expect_equal(chosen, _length_reference(bodies, 3), "40 prompts of 4-400 tokens through Router.choose "
                 "(length_aware, threshold 64, long pool = replicas 2 and 3, 3 arrivals in flight): the replicas")
    expect_equal(sorted(pool_down), URLS[:2], "the same 40 prompts with replicas 2 and 3 down, none finishing: the "
                 "replicas used")


# ---- task 10: the capstone (Custom GPTs) ------------------------------------------------------------------

CAPSTONE = {"sessions": 100_000, "long_share": 0.05, "short_tokens": 2000, "long_tokens": 32_000,
            "num_gpts": 2000, "lora_rank": 16, "lora_slots": 16}


@functools.cache
def _capstone():
    """Written from the kit's functions: Llama-3-8B, H100, 0.9, blocks of 16, 8192 batched tokens. KV 131072 B per
    token x 2000 = 262.1 MB; an adapter 16 x (8192 + 2 x 5120 + 8192 + 3 x 18432) x 32 layers x 2 B = 83.9 MB;
    224 short sessions per GPU beside 16 slots: 425 GPUs; 32,000-token sessions: 14 per GPU (358 GPUs) or 32 per
    TP=2 group (314 GPUs); 2,000 adapters: 167.8 GB."""
    from engine_core import capacity_planner, memory

    spec = memory.ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=14336, vocab_size=128256)
    h100 = capacity_planner.GPUS["H100-80GB"]
    adapter = 16 * (8192 + 2 * 5120 + 8192 + 3 * 18432) * 32 * 2

    def fits(gpus, context):
        return capacity_planner.max_concurrent_requests(gpus * h100.memory_bytes, 0.9, spec, context, "bf16", 16, 8192,
                                                        non_torch_bytes=16 * adapter)

    return {"kv_bytes_per_session": 2 * 32 * 8 * 128 * 2 * 2000, "adapter_bytes": adapter,
            "short_gpus": math.ceil(95_000 / fits(1, 2000)), "long_gpus_tp1": math.ceil(5000 / fits(1, 32_000)),
            "long_gpus_tp2": 2 * math.ceil(5000 / fits(2, 32_000)), "host_cache_gb": 2000 * adapter / 1e9}


CAPSTONE_KEYS = ["adapter_bytes", "host_cache_gb", "kv_bytes_per_session", "long_gpus_tp1", "long_gpus_tp2",
                 "short_gpus"]


def _capstone_answer(student):
    got = student.predicted_capstone_plan()
    expect_equal(sorted(got), CAPSTONE_KEYS, "predicted_capstone_plan(): its keys")
    return got


# Tolerance 1%: the kit's arithmetic. Rejected slips: KV in fp32 (x2), LoRA on q and v only (-73% adapter bytes),
# TP=2 counted in groups instead of GPUs (-50%), the host cache in GiB (-7%).
CAPSTONE_RTOL = 0.01


@pytest.mark.points(2)
@pytest.mark.task("capstone")
def test_predicted_capstone_memory(student):
    """KV of a 2,000-token session 262.1 MB, one rank-16 adapter on all seven projections 83.9 MB, the 2,000
    adapters in host memory 167.8 GB."""
    got = _capstone_answer(student)
    for key, what in [("kv_bytes_per_session", "bytes of KV of one 2,000-token session, bf16"),
                      ("adapter_bytes", "bytes of one rank-16 LoRA on q, k, v, o, gate, up, down, bf16"),
                      ("host_cache_gb", "GB of host memory for the 2,000 GPTs' adapters")]:
        expect_prediction(got[key], _capstone()[key], f"predicted_capstone_plan()['{key}']: {what}",
                          rtol=CAPSTONE_RTOL)


@pytest.mark.points(2)
@pytest.mark.task("capstone")
def test_predicted_capstone_gpus(student):
    """95,000 sessions of 2,000 tokens: 425 H100s at TP=1; 5,000 of 32,000: 358 at TP=1, 314 at TP=2."""
    got = _capstone_answer(student)
    for key, what in [("short_gpus", "H100s for 95,000 sessions of 2,000 tokens, TP=1, 16 LoRA slots each"),
                      ("long_gpus_tp1", "H100s for 5,000 sessions of 32,000 tokens at TP=1"),
                      ("long_gpus_tp2", "H100s for 5,000 sessions of 32,000 tokens at TP=2 (GPUs, not groups)")]:
        expect_prediction(got[key], _capstone()[key], f"predicted_capstone_plan()['{key}']: {what}",
                          rtol=CAPSTONE_RTOL)


def _failover_owners(allowed: set[str], keys: list[str]) -> list[str | None]:
    """The reference ring's owner of each key among `allowed` (the sorted-list model, no bisect)."""
    ring = HashRing(URLS[:3])
    return [_ring_owner(ring, _key_hash(k), allowed) for k in keys]


@pytest.mark.points(2)
@pytest.mark.task("capstone")
@pytest.mark.end_to_end
def test_router_failover_moves_only_the_dead_keys(student):
    """Three replicas, 300 sessions (distinct prompts, light load) through the real router's `choose` with your
    lookup and prefix_aware; replica 2 dies (marked down): every session on replicas 0 and 1 stays where it was,
    and replica 2's sessions (about a third) spread over the survivors by the ring."""
    prompts = [f"session {i}: you are custom GPT number {i % 97}" for i in range(300)]
    with plug(student, LAB, only=ROUTER) as plugged:
        router = make_router(URLS[:3], balance_factor=1.25)
        before = [router.choose({"prompt": p}).url for p in prompts]
        router.replicas[2].mark_down(60.0)
        after = [router.choose({"prompt": p}).url for p in prompts]
    expect_equal(plugged.uncalled(), [], "the router: your functions it never called")
    keys = [p[:256] for p in prompts]
    expect_equal(before, _failover_owners(set(URLS[:3]), keys), "300 sessions on 3 replicas: the chosen replicas")
    expect_equal(after, _failover_owners(set(URLS[:2]), keys),
                 "the same sessions after replica 2 died: the chosen replicas (replica 0's and 1's unchanged)")
