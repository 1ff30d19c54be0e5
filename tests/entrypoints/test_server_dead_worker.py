"""A tensor-parallel server whose worker process dies says so: a real server (`python -m
engine_core.entrypoints.openai --tensor-parallel-size 2`) with two requests in flight (one streamed, one
not), one worker SIGKILLed; both requests end with an error naming the dead worker, `/health` answers
503, and a new request is refused with a 503 naming it, each within a bounded time (no fixed sleep:
every wait polls for the event with a generous deadline)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx2
import psutil
import pytest
from server_helpers import Server

pytestmark = pytest.mark.timeout(300)
BOUND_S = 60.0  # generous on a loaded machine: the failure is seen at once (a sentinel), not after a timeout
BODY = {"model": "m", "prompt": "the dead worker", "max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}


def workers_of(server: Server) -> list[psutil.Process]:
    """The server's spawned worker processes (multiprocessing's resource tracker aside)."""
    found = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        cmdline = " ".join(p.cmdline())
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(p)
    return found


def poll(check, what: str, bound_s: float = BOUND_S):
    deadline = time.monotonic() + bound_s
    while True:
        if (result := check()) is not None:
            return result
        assert time.monotonic() < deadline, f"{what} within {bound_s:g} s"
        time.sleep(0.05)


def test_a_dead_worker_fails_the_requests_in_flight_and_the_server_says_it_is_down():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two worker processes need two CPU cores")
    server = Server("tiny-llama", "--tensor-parallel-size", "2")
    try:
        workers = workers_of(server)
        assert len(workers) == 2, workers
        streamed: dict = {"lines": []}
        first_chunk = threading.Event()
        plain: dict = {}

        def stream() -> None:
            with httpx2.stream("POST", f"{server.url}/v1/completions", json={**BODY, "stream": True},
                               timeout=BOUND_S + 60) as response:
                streamed["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        streamed["lines"].append(line[6:])
                        first_chunk.set()
            streamed["ended"] = time.monotonic()

        def request() -> None:
            response = httpx2.post(f"{server.url}/v1/completions", json=BODY, timeout=BOUND_S + 60)
            plain.update(status=response.status_code, body=response.json(), ended=time.monotonic())

        threads = [threading.Thread(target=stream), threading.Thread(target=request)]
        for t in threads:
            t.start()
        assert first_chunk.wait(BOUND_S), "the streamed request produced no token"
        poll(lambda: True if server.metrics()["vllm:num_requests_running"] == 2 else None, "both requests running")

        victim = workers[1]
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(BOUND_S + 90)
            assert not t.is_alive(), "a request in flight hung after its worker died"

        # in flight: the plain request is a 503 naming the worker; the stream (200 sent) ends with an error event
        assert plain["status"] == 503 and plain["ended"] - killed < BOUND_S, plain
        assert f"pid {victim.pid}" in plain["body"]["error"]["message"] and "SIGKILL" in plain["body"]["error"]["message"]
        events = [json.loads(x) for x in streamed["lines"] if x != "[DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        assert streamed["status"] == 200 and len(errors) == 1 and "SIGKILL" in errors[0]["message"], events[-3:]
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", [])), "it finished anyway"
        assert streamed["ended"] - killed < BOUND_S

        # the server says it is down, and refuses new work with a reason
        poll(lambda: True if httpx2.get(f"{server.url}/health", timeout=10).status_code == 503 else None,
             "/health answering 503")
        t0 = time.monotonic()
        refused = httpx2.post(f"{server.url}/v1/completions", json={**BODY, "max_tokens": 4}, timeout=BOUND_S)
        assert refused.status_code == 503 and time.monotonic() - t0 < BOUND_S
        message = refused.json()["error"]["message"]
        assert "dead" in message and f"worker 1 (pid {victim.pid}) died (killed by SIGKILL)" in message, message
        poll(lambda: True if not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
             else None, "the surviving worker stopped")
    finally:
        server.stop()

