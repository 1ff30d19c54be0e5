"""The router for real: two OpenAI servers as subprocesses on 127.0.0.1 behind the router's
subprocess (`python -m engine_core.entrypoints.router --policy prefix_aware`), driven by the real
`openai` client. Requests with the same system prompt land on one replica (the one the pure policy
predicts), answers pass through unchanged (plain and streamed), a killed replica is routed around
(the request that met it retried once elsewhere), and nothing is left running afterwards."""
from __future__ import annotations

import psutil
import pytest
from server_helpers import Process, Server, chat_model

from engine_core.entrypoints.router.policies import HashRing, ReplicaLoad, prefix_aware, prefix_key

pytestmark = pytest.mark.timeout(300)
PREFIX = 64
GREEDY = dict(max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})


def _messages(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _predicted(urls: list[str], system: str) -> str:
    """Where the policy, as a pure function, sends a chat with this system prompt to idle replicas."""
    key = prefix_key({"messages": _messages(system, "")}, PREFIX)
    return prefix_aware([ReplicaLoad(u) for u in urls], key, HashRing(urls)).url


def test_prefix_affinity_and_a_killed_replica_routed_around(tmp_path):
    model = str(chat_model(tmp_path))
    started: list[Process] = []
    try:
        for _ in range(2):
            started.append(Server(model))
        a, b = started
        urls = [a.url, b.url]
        started.append(Process("engine_core.entrypoints.router", "--replica", a.url, "--replica", b.url,
                               "--policy", "prefix_aware", "--prefix-length", str(PREFIX),
                               "--poll-interval", "60", "--down-seconds", "60"))  # only requests find the dead
        router = started[-1]
        # one system prompt per replica (longer than the routed prefix, so the user turn does not matter)
        candidates = [f"You are assistant number {k}; answer every question briefly and politely. " * 2
                      for k in range(40)]
        home = {u: next(s for s in candidates if _predicted(urls, s) == u) for u in urls}

        served: dict[str, list[str]] = {u: [] for u in urls}
        for user in ("hi", "what is a KV cache?", "bye"):
            for url, system in home.items():
                raw = router.client.chat.completions.with_raw_response.create(
                    model="m", messages=_messages(system, user), **GREEDY)
                served[url].append(raw.headers["x-router-replica"])
                direct = started[urls.index(url)].client.chat.completions.create(
                    model="m", messages=_messages(system, user), **GREEDY)  # the replica itself, no router
                assert raw.parse().choices[0].message.content == direct.choices[0].message.content
        assert served == {u: [u, u, u] for u in urls}, served  # affinity: same system prompt, same replica

        stream = router.client.chat.completions.create(model="m", messages=_messages(home[b.url], "hi"), stream=True,
                                                       stream_options={"include_usage": True}, **GREEDY)
        chunks = list(stream)
        plain = b.client.chat.completions.create(model="m", messages=_messages(home[b.url], "hi"), **GREEDY)
        assert chunks[-1].usage.completion_tokens == 5
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content

        m = router.metrics()
        assert m[f"router_requests_routed_total{{replica={a.url}}}"] == 3
        assert m[f"router_requests_routed_total{{replica={b.url}}}"] == 4

        a.kill()  # a crash: its connections are refused from now on
        for user in ("after the crash", "and again"):
            raw = router.client.chat.completions.with_raw_response.create(
                model="m", messages=_messages(home[a.url], user), **GREEDY)
            assert raw.headers["x-router-replica"] == b.url and raw.parse().choices[0].finish_reason == "length"
        m = router.metrics()
        assert m[f"router_replica_up{{replica={a.url}}}"] == 0 and m[f"router_replica_up{{replica={b.url}}}"] == 1
        assert m["router_retries_total"] == 1  # the first request met the dead replica; the second skipped it
        assert m[f"router_requests_routed_total{{replica={b.url}}}"] == 6
        assert m[f"router_requests_in_flight{{replica={b.url}}}"] == 0  # every relayed response closed
        assert router.client.with_options(max_retries=0).models.list().data[0].id == "m"
    finally:
        family = [p.pid for proc in started if proc.proc.poll() is None
                  for p in [psutil.Process(proc.proc.pid), *psutil.Process(proc.proc.pid).children(recursive=True)]]
        for proc in reversed(started):
            proc.stop()
    alive = [pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {alive}"
