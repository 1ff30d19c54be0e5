"""The router's policies as pure functions against fake loads: turns, least load, and prefix
affinity under the bounded-loads rule (load <= ceil(c * average)); the router's replica state."""
from __future__ import annotations

import asyncio
import math
import time

import httpx2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.entrypoints.router.app import Router
from engine_core.entrypoints.router.policies import (
    HashRing, ReplicaLoad, least_loaded, load_bound, prefix_aware, prefix_key, round_robin)
from engine_core.entrypoints.router.replicas import parse_load, poll_once

URLS = [f"http://127.0.0.1:{8001 + i}" for i in range(4)]


def loads(in_flight: list[int], **polled: list[float]) -> list[ReplicaLoad]:
    return [ReplicaLoad(url, in_flight=n, **{k: v[i] for k, v in polled.items()})
            for i, (url, n) in enumerate(zip(URLS, in_flight))]


@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 100))
def test_round_robin_gives_every_replica_the_same_number_of_turns(n, rounds, start):
    replicas = loads([0] * n)
    picks = [round_robin(replicas, start + k).url for k in range(n * rounds)]
    assert all(picks.count(r.url) == rounds for r in replicas)


@given(st.lists(st.integers(0, 20), min_size=1, max_size=4), st.lists(st.integers(0, 20), min_size=4, max_size=4),
       st.lists(st.floats(0, 1), min_size=4, max_size=4))
def test_least_loaded_picks_a_minimum_of_queued_work_then_kv_usage(in_flight, polled, kv):
    replicas = loads(in_flight, num_requests_waiting=polled, kv_cache_usage_perc=kv)
    pick = least_loaded(replicas)
    work = [max(p, n) for p, n in zip(polled, in_flight)]
    best = min(work[:len(replicas)])
    i = replicas.index(pick)
    assert work[i] == best and kv[i] == min(k for w, k in zip(work, kv) if w == best)


def test_least_loaded_counts_the_routers_own_in_flight_requests_between_polls():
    """The poll said idle everywhere, but the router just sent 3 requests to the first replica."""
    assert least_loaded(loads([3, 0], num_requests_running=[0, 0])).url == URLS[1]
    assert least_loaded(loads([0, 0], num_requests_waiting=[4, 1], kv_cache_usage_perc=[0.0, 0.9])).url == URLS[1]
    assert least_loaded(loads([0, 0], kv_cache_usage_perc=[0.5, 0.2])).url == URLS[1]


def test_prefix_aware_is_affine_and_spreads_distinct_prefixes():
    ring = HashRing(URLS)
    idle = loads([0, 0, 0, 0])
    for key in ("system: you are a pirate", "system: you are a poet", "0,1,2,3"):
        assert len({prefix_aware(idle, key, ring).url for _ in range(5)}) == 1
    counts = {u: 0 for u in URLS}
    for k in range(400):
        counts[prefix_aware(idle, f"tenant-{k}: shared system prompt", ring).url] += 1
    assert min(counts.values()) >= 400 * 0.10, counts  # 64 virtual nodes each: no replica left out


def test_a_replica_that_goes_away_moves_only_its_own_keys():
    ring = HashRing(URLS)
    keys = [f"prefix {k}" for k in range(200)]
    before = {k: prefix_aware(loads([0] * 4), k, ring).url for k in keys}
    survivors = [r for r in loads([0] * 4) if r.url != URLS[2]]
    after = {k: prefix_aware(survivors, k, ring).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == URLS[2] for k in moved)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hot", "hot", "hot", "warm", "a", "b", "c"]), st.booleans()),
                min_size=1, max_size=60),
       st.sampled_from([1.0, 1.25, 2.0]), st.integers(1, 4))
def test_bounded_loads_no_replica_ever_exceeds_ceil_c_times_the_average(ops, c, n):
    """A skewed key stream (a hot prefix), requests finishing at random: after every placement the
    chosen replica holds at most ceil(c * average), the average counting the new request."""
    ring = HashRing(URLS[:n])
    in_flight = {u: 0 for u in URLS[:n]}
    for key, finish in ops:
        replicas = [ReplicaLoad(u, in_flight=k) for u, k in in_flight.items()]
        bound = load_bound(replicas, c)
        assert bound == math.ceil(c * (sum(in_flight.values()) + 1) / n)
        url = prefix_aware(replicas, key, ring, c).url
        in_flight[url] += 1
        assert in_flight[url] <= bound
        if finish:
            busiest = max(in_flight, key=in_flight.get)
            in_flight[busiest] -= 1


def test_over_its_bound_the_ring_choice_falls_back_to_the_least_loaded():
    ring = HashRing(URLS[:2])
    home = prefix_aware(loads([0, 0]), "hot", ring).url
    other = next(u for u in URLS[:2] if u != home)
    busy = [ReplicaLoad(home, in_flight=3), ReplicaLoad(other, in_flight=0)]  # bound ceil(1.25 * 4 / 2) = 3
    assert load_bound(busy, 1.25) == 3 and prefix_aware(busy, "hot", ring, 1.25).url == other
    # home would hold 3: over ceil(1.25 * 3 / 2) = 2, within ceil(2 * 3 / 2) = 3
    two = [ReplicaLoad(home, in_flight=2), ReplicaLoad(other, in_flight=0)]
    assert prefix_aware(two, "hot", ring, 1.25).url == other and prefix_aware(two, "hot", ring, 2.0).url == home
    with pytest.raises(ValueError, match=r"c \(the bounded-loads factor\) must be >= 1, got 0.5"):
        prefix_aware(busy, "hot", ring, 0.5)
    with pytest.raises(ValueError, match="no replica is up"):
        least_loaded([])


def test_prefix_key_reads_the_leading_characters_of_chat_completion_and_token_prompts():
    system = {"role": "system", "content": "You are terse. " * 30}
    one = prefix_key({"messages": [system, {"role": "user", "content": "hi"}]}, 256)
    two = prefix_key({"messages": [system, {"role": "user", "content": "bye"}]}, 256)
    assert one == two and len(one) == 256 and one.startswith("system: You are terse.")
    assert prefix_key({"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}, 9) == "user: abc"
    assert prefix_key({"prompt": "abcdef"}, 3) == "abc"
    assert prefix_key({"prompt": [5, 6, 7, 8]}, 2) == "5,6"
    assert prefix_key({"prompt": ["first", "second"]}, 3) == "fir"
    assert prefix_key({"prompt": 7}, 3) == prefix_key([1, 2], 3) == prefix_key(None, 3) == ""


def test_router_skips_a_replica_marked_down_until_its_time_is_up():
    router = Router(URLS[:2], "round_robin", down_seconds=60.0)
    router.replicas[0].mark_down(60.0)
    assert {router.choose({}).url for _ in range(4)} == {URLS[1]}
    assert router.choose({}, exclude={URLS[1]}) is None
    router.replicas[0].down_until = time.monotonic() - 1
    assert {router.choose({}).url for _ in range(4)} == set(URLS[:2])


@pytest.mark.parametrize("kwargs, message", [
    (dict(urls=[]), "replica: give at least one replica URL"),
    (dict(urls=[URLS[0], URLS[0]]), "replica: each URL once"),
    (dict(urls=URLS, policy="random"), r"policy must be one of \('round_robin', 'least_loaded', 'prefix_aware', 'length_aware'\)"),
    (dict(urls=URLS, prefix_length=0), "prefix_length must be >= 1, got 0"),
    (dict(urls=URLS, balance_factor=0.9), r"balance_factor must be >= 1 \(c in load <= ceil\(c \* average\)\)"),
])
def test_router_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Router(**kwargs)


def test_parse_load_reads_vllms_gauges():
    text = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3.0\n"
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2.0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
            "# TYPE vllm:request_success counter\nvllm:request_success_total{finished_reason=\"stop\"} 9.0\n")
    assert parse_load(text) == {"num_requests_waiting": 3.0, "num_requests_running": 2.0, "kv_cache_usage_perc": 0.25}


def test_a_poll_reads_the_load_marks_a_refusing_replica_down_and_a_good_poll_brings_it_back():
    waiting = {URLS[0]: 2.0, URLS[1]: 0.0}
    refusing = {URLS[1]}

    def answer(request: httpx2.Request) -> httpx2.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if url in refusing:
            raise httpx2.ConnectError("connection refused", request=request)
        return httpx2.Response(200, text=f"# TYPE vllm:num_requests_waiting gauge\n"
                                         f"vllm:num_requests_waiting {waiting[url]}\n")

    router = Router(URLS[:2], "least_loaded", down_seconds=60.0)
    good, bad = router.replicas

    async def poll() -> None:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(answer)) as client:
            for r in router.replicas:
                await poll_once(client, r, timeout=1.0, down_seconds=60.0)

    asyncio.run(poll())
    assert good.polled == {"num_requests_waiting": 2.0} and good.is_up()
    assert not bad.is_up() and bad.failures == 1 and router.choose({}).url == good.url
    refusing.clear()
    asyncio.run(poll())
    assert bad.is_up() and router.choose({}).url == bad.url  # back, and idle: the least loaded
