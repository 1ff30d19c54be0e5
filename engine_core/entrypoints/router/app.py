"""The router's FastAPI app: an OpenAI-compatible proxy in front of data-parallel replicas.

`/v1/completions` and `/v1/chat/completions` (streamed or not) go to one replica picked by the
policy (engine_core/entrypoints/router/policies.py); the body is forwarded as it came and the
replica's answer (status, body, SSE events) is passed back as it comes, with the replica's URL in
`x-router-replica`. A connection error before the replica answered marks it down and the request
is retried once on another one (nothing reached the client yet, and a replica that never got the
request ran nothing of it). A client that leaves closes the upstream response, so the replica sees
the disconnect and aborts. `/health` is 200 while one replica is up; `/metrics` counts the requests
routed to each replica, its state and load; `/v1/models` is any up replica's.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import Any, AsyncIterator, Callable, Sequence

import httpx2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

from engine_core.entrypoints.router import policies
from engine_core.entrypoints.router.replicas import Replica, poll_forever

_CONNECT_ERRORS = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.RemoteProtocolError)


class Router:
    """The replicas, the policy and its state (round-robin counter, hash ring)."""

    def __init__(self, urls: list[str], policy: str = "round_robin", prefix_length: int = 256,
                 balance_factor: float = 1.25, down_seconds: float = 5.0, long_pool: Sequence[str] = (),
                 long_threshold: int = 4096) -> None:
        if not urls:
            raise ValueError("replica: give at least one replica URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"replica: each URL once, got {urls}")
        if policy not in policies.POLICIES:
            raise ValueError(f"policy must be one of {policies.POLICIES}, got {policy!r}")
        if prefix_length < 1:
            raise ValueError(f"prefix_length must be >= 1, got {prefix_length}")
        if balance_factor < 1.0:
            raise ValueError(f"balance_factor must be >= 1 (c in load <= ceil(c * average)), got {balance_factor}")
        long_pool = {url.rstrip("/") for url in long_pool}
        if policy == "length_aware" and not long_pool:
            raise ValueError("long_pool: the length_aware policy needs at least one long-context replica URL")
        if not long_pool <= {url.rstrip("/") for url in urls}:
            raise ValueError(f"long_pool: each URL must be a replica, got {sorted(long_pool)}")
        if long_threshold < 1:
            raise ValueError(f"long_threshold must be >= 1 (prompt tokens), got {long_threshold}")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.policy, self.prefix_length, self.balance_factor = policy, prefix_length, balance_factor
        self.down_seconds = down_seconds
        self.long_pool, self.long_threshold = long_pool, long_threshold
        self.ring = policies.HashRing([r.url for r in self.replicas])
        self._turn = itertools.count()
        self.retries = 0

    def choose(self, body: Any, exclude: set[str] = frozenset()) -> Replica | None:
        """The policy's replica among those up and not excluded (None if there is none)."""
        up = [r for r in self.replicas if r.is_up() and r.url not in exclude]
        if not up:
            return None
        loads = [r.load() for r in up]
        if self.policy == "round_robin":
            pick = policies.round_robin(loads, next(self._turn))
        elif self.policy == "least_loaded":
            pick = policies.least_loaded(loads)
        elif self.policy == "length_aware":
            pick = policies.length_aware(loads, policies.prompt_tokens(body), self.long_threshold, self.long_pool)
        else:
            key = policies.prefix_key(body, self.prefix_length)
            pick = policies.prefix_aware(loads, key, self.ring, self.balance_factor)
        return next(r for r in up if r.url == pick.url)


def build_app(router: Router, poll_interval: float = 0.5, poll_timeout: float = 1.0) -> FastAPI:
    client = httpx2.AsyncClient(timeout=httpx2.Timeout(None, connect=poll_timeout))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        poller = asyncio.ensure_future(poll_forever(client, router.replicas, poll_interval, poll_timeout,
                                                    router.down_seconds))
        try:
            yield
        finally:
            poller.cancel()
            await client.aclose()

    app = FastAPI(title="inference-labs router", lifespan=lifespan)
    registry, refresh = _metrics(router)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if any(r.is_up() for r in router.replicas) else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        refresh()
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await _proxy(raw, b"", None)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        body = await raw.body()
        return await _proxy(raw, body, _json_or_none(body))

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        body = await raw.body()
        return await _proxy(raw, body, _json_or_none(body))

    async def _proxy(raw: Request, body: bytes, parsed: Any) -> Response:
        tried: set[str] = set()
        for _ in range(2):  # the first choice, then one retry elsewhere after a connection error
            replica = router.choose(parsed, tried)
            if replica is None:
                break
            tried.add(replica.url)
            upstream = client.build_request(raw.method, replica.url + raw.url.path, content=body,
                                            headers={"content-type": raw.headers.get("content-type",
                                                                                     "application/json")})
            replica.in_flight += 1
            try:
                resp = await client.send(upstream, stream=True)
            except _CONNECT_ERRORS:
                replica.in_flight -= 1
                replica.mark_down(router.down_seconds)
                router.retries += 1
                continue
            except BaseException:
                replica.in_flight -= 1
                raise
            replica.routed += 1
            headers = {"x-router-replica": replica.url}
            return _Relay(resp, replica, status_code=resp.status_code, headers=headers,
                          media_type=resp.headers.get("content-type"))
        return JSONResponse({"error": {"message": "no replica is up (tried: " + ", ".join(sorted(tried)) + ")",
                                       "type": "ServiceUnavailable", "param": None, "code": 503}}, status_code=503)

    return app


class _Relay(StreamingResponse):
    """The replica's response passed through chunk by chunk; closed however it ends (also when the
    client left before the first chunk), which ends the request's in-flight count."""

    def __init__(self, upstream: httpx2.Response, replica: Replica, **kwargs: Any) -> None:
        super().__init__(upstream.aiter_raw(), **kwargs)
        self._upstream, self._replica = upstream, replica

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._replica.in_flight -= 1
            await asyncio.shield(self._upstream.aclose())


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None  # forwarded as it is: the replica answers with its 400


def _metrics(router: Router) -> tuple[CollectorRegistry, Callable[[], None]]:
    """The router's Prometheus metrics and the function that sets them from its state (at each scrape)."""
    disable_created_metrics()
    registry = CollectorRegistry()
    routed = Counter("router_requests_routed", "requests each replica answered (a retried one counts where it went)",
                     ["replica"], registry=registry)
    up = Gauge("router_replica_up", "1 while the replica is routed to, 0 while it is marked down",
               ["replica"], registry=registry)
    in_flight = Gauge("router_requests_in_flight", "requests sent and not finished", ["replica"], registry=registry)
    waiting = Gauge("router_replica_num_requests_waiting", "vllm:num_requests_waiting at the last poll",
                    ["replica"], registry=registry)
    failures = Counter("router_replica_connection_errors", "connection errors (requests and polls)",
                       ["replica"], registry=registry)
    retries = Counter("router_retries", "requests retried on another replica after a connection error",
                      registry=registry)
    seen = {"retries": 0, **{r.url: (0, 0) for r in router.replicas}}

    def refresh() -> None:
        for r in router.replicas:  # counters only go up: add what happened since the last scrape
            last_routed, last_failures = seen[r.url]
            routed.labels(r.url).inc(r.routed - last_routed)
            failures.labels(r.url).inc(r.failures - last_failures)
            seen[r.url] = (r.routed, r.failures)
            up.labels(r.url).set(1 if r.is_up() else 0)
            in_flight.labels(r.url).set(r.in_flight)
            waiting.labels(r.url).set(r.polled.get("num_requests_waiting", 0.0))
        retries.inc(router.retries - seen["retries"])
        seen["retries"] = router.retries

    return registry, refresh
