"""The router's view of its replicas: up or down, loads from `/metrics`, requests routed and in flight.

A replica is down for `down_seconds` after a connection error (a request's or a poll's); a poll
that succeeds brings it back at once. Polls read vLLM's gauges (`vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`) with a timeout, so one slow replica delays
no decision: the last values are used until the next poll answers.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from engine_core.entrypoints.router.policies import ReplicaLoad

GAUGES = {"vllm:num_requests_waiting": "num_requests_waiting", "vllm:num_requests_running": "num_requests_running",
          "vllm:kv_cache_usage_perc": "kv_cache_usage_perc"}


@dataclass
class Replica:
    url: str
    routed: int = 0  # requests it answered (a retried request counts where it went)
    in_flight: int = 0
    failures: int = 0  # connection errors seen
    down_until: float = 0.0  # time.monotonic() before which it is skipped
    polled: dict[str, float] = field(default_factory=dict)  # GAUGES' fields, from the last good poll

    def is_up(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.down_until

    def mark_down(self, seconds: float) -> None:
        self.failures += 1
        self.down_until = time.monotonic() + seconds

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.url, in_flight=self.in_flight, **self.polled)


def parse_load(metrics_text: str) -> dict[str, float]:
    """GAUGES' values in a Prometheus exposition (the unlabelled samples; missing ones left out)."""
    found = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in GAUGES and not sample.labels:
                found[GAUGES[sample.name]] = float(sample.value)
    return found


async def poll_once(client: httpx2.AsyncClient, replica: Replica, timeout: float, down_seconds: float) -> None:
    """Read one replica's /metrics: loads updated and the replica up, or down on a connection error."""
    try:
        resp = await client.get(f"{replica.url}/metrics", timeout=timeout)
        resp.raise_for_status()
        replica.polled = parse_load(resp.text)
        replica.down_until = 0.0
    except (httpx2.TransportError, httpx2.HTTPStatusError, ValueError):
        replica.mark_down(down_seconds)


async def poll_forever(client: httpx2.AsyncClient, replicas: list[Replica], interval: float, timeout: float,
                       down_seconds: float) -> None:
    while True:
        await asyncio.gather(*(poll_once(client, r, timeout, down_seconds) for r in replicas))
        await asyncio.sleep(interval)
