"""The length-aware policy: long prompts to the long-context pool, short ones elsewhere, each side by least
load, a side with nobody up borrowing the other; the prompt's length as the router estimates it; the Router's
arguments and its choice."""
from __future__ import annotations

import pytest

from engine_core.entrypoints.router.app import Router
from engine_core.entrypoints.router.policies import CHARS_PER_TOKEN, ReplicaLoad, length_aware, prompt_tokens

URLS = [f"http://127.0.0.1:{8001 + i}" for i in range(4)]
LONG = {URLS[2], URLS[3]}


def loads(in_flight: list[int]) -> list[ReplicaLoad]:
    return [ReplicaLoad(url, in_flight=n) for url, n in zip(URLS, in_flight)]


@pytest.mark.parametrize("tokens, in_flight, expected", [
    (10, [3, 1, 0, 0], URLS[1]),     # short: the least loaded of the short side, though the long side idles
    (100, [3, 1, 2, 0], URLS[3]),    # exactly the threshold is long
    (99, [0, 5, 0, 0], URLS[0]),
    (5000, [0, 0, 4, 2], URLS[3]),
])
def test_length_aware_routes_by_length_then_load(tokens, in_flight, expected):
    assert length_aware(loads(in_flight), tokens, 100, LONG).url == expected


def test_a_side_with_nobody_up_borrows_the_other():
    short_only = loads([2, 1])  # the long pool is down
    assert length_aware(short_only, 500, 100, LONG).url == URLS[1]
    long_only = [ReplicaLoad(URLS[2], in_flight=3), ReplicaLoad(URLS[3], in_flight=1)]
    assert length_aware(long_only, 5, 100, LONG).url == URLS[3]


def test_length_aware_rejects_bad_input():
    with pytest.raises(ValueError, match="no replica is up"):
        length_aware([], 5, 100, LONG)
    with pytest.raises(ValueError, match="threshold"):
        length_aware(loads([0, 0, 0, 0]), 5, 0, LONG)


def test_prompt_tokens_counts_ids_or_estimates_text():
    assert prompt_tokens({"prompt": [5, 6, 7]}) == 3
    assert prompt_tokens({"prompt": "x" * (4 * CHARS_PER_TOKEN + 1)}) == 5
    assert prompt_tokens({"messages": [{"role": "user", "content": "abcdef"}]}) == 4  # "user: abcdef\n": 13 chars
    assert prompt_tokens({"prompt": [[1, 2], [3]]}) == 2  # a batch: the first prompt
    assert prompt_tokens({"prompt": []}) == 0 and prompt_tokens(None) == 0


def test_router_length_aware_arguments_and_choice():
    with pytest.raises(ValueError, match="long_pool: the length_aware policy needs"):
        Router(URLS, policy="length_aware")
    with pytest.raises(ValueError, match="long_pool: each URL must be a replica"):
        Router(URLS[:2], policy="length_aware", long_pool=[URLS[3]])
    with pytest.raises(ValueError, match="long_threshold must be >= 1"):
        Router(URLS, policy="length_aware", long_pool=[URLS[3]], long_threshold=0)
    router = Router(URLS, policy="length_aware", long_pool=[URLS[3] + "/"], long_threshold=64)
    assert router.choose({"prompt": list(range(64))}).url == URLS[3]
    assert router.choose({"prompt": "short"}).url == URLS[0]
    router.replicas[3].mark_down(60.0)
    assert router.choose({"prompt": list(range(500))}).url == URLS[0]  # the pool is down: the short side serves it
