"""Queue depth during a sweep point: the server's waiting-request count, sampled from its `/metrics`.

The capacity knee is where requests start to queue: TTFT climbs because requests wait for
admission, not because a step got slower. Sampling `vllm:num_requests_waiting` (vLLM's gauge; this
engine's server exposes the same name) every `interval` seconds while the point runs shows that
queue directly. A server without the gauge (or without `/metrics`) yields no samples, reported as
"n/a", never a failed run.
"""
from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

WAITING = "vllm:num_requests_waiting"
INTERVAL_S = 0.25


def parse_waiting(metrics_text: str) -> float | None:
    """The waiting count in a Prometheus exposition, summed over label sets (vLLM labels it by
    model_name and engine); None when the gauge is absent or the text does not parse."""
    try:
        values = [sample.value for family in text_string_to_metric_families(metrics_text)
                  for sample in family.samples if sample.name == WAITING]
    except ValueError:
        return None
    return float(sum(values)) if values else None


async def sample_waiting(client: Any, base_url: str, stop: asyncio.Event, interval: float = INTERVAL_S,
                         timeout: float = 2.0) -> list[float]:
    """GET {base_url}/metrics every `interval` s until `stop` is set; the waiting counts read (a failed
    or metric-less poll adds nothing)."""
    samples: list[float] = []
    while not stop.is_set():
        try:
            resp = await client.get(f"{base_url}/metrics", timeout=timeout)
            value = parse_waiting(resp.text) if resp.status_code == 200 else None
        except Exception:  # a refused connection or a timeout: no sample this time
            value = None
        if value is not None:
            samples.append(value)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return samples


def queue_summary(samples: list[float]) -> dict[str, float] | None:
    """mean and max waiting over a point's samples; None (shown as n/a) when there are none."""
    if not samples:
        return None
    return {"mean": sum(samples) / len(samples), "max": max(samples), "samples": len(samples)}
