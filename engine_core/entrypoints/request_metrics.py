"""A streamed request's latency metrics from its timestamps, their percentiles, and SLO goodput.

What `benchmarks.serve` reports per request (as `vllm bench serve` does), from times taken on the
client's side of the socket: when the request was sent, when each streamed chunk that carried text
arrived, when the stream ended, and the number of output tokens the server reported.

- TTFT: first chunk - send (queueing + prefill + one sampling step + the network).
- ITL: the gaps between consecutive chunks, every one (the first chunk's wait is TTFT, not an ITL).
  A chunk may carry several tokens when the server merges deltas, so an ITL is per chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), the mean time per output token after the first; None
  for a one-token output (no token after the first).
- E2E: end - send.

Percentiles are linear between order statistics (numpy's default, as vLLM): P_q of the sorted
values x at rank q/100 * (n - 1). Goodput counts a request only if it met every SLO given; a metric
a request does not have (the TPOT of a one-token output) does not count against it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

SLO_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys


@dataclass(frozen=True)
class LatencyMetrics:
    """One request's latencies in seconds."""

    ttft: float
    itl: list[float] = field(default_factory=list)
    tpot: float | None = None
    e2el: float = 0.0


# seam: lab 12 (grader/seams.py)
def request_metrics(send_time: float, chunk_times: Sequence[float], end_time: float,
                    num_output_tokens: int) -> LatencyMetrics:
    """TTFT, every ITL, TPOT and E2E of one streamed request from its timestamps (seconds)."""
    if not chunk_times:
        raise ValueError("chunk_times: a request's metrics need at least one streamed chunk, got none")
    if num_output_tokens < 1:
        raise ValueError(f"num_output_tokens must be >= 1, got {num_output_tokens}")
    ttft = chunk_times[0] - send_time
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    e2el = end_time - send_time
    tpot = (e2el - ttft) / (num_output_tokens - 1) if num_output_tokens > 1 else None
    return LatencyMetrics(ttft=ttft, itl=itl, tpot=tpot, e2el=e2el)


# seam: lab 12 (grader/seams.py)
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of values, linear between order statistics (numpy's default)."""
    if not values:
        raise ValueError("values: a percentile of no values is undefined")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])


# seam: lab 12 (grader/seams.py)
def meets_slos(metrics: LatencyMetrics, slos: dict[str, float]) -> bool:
    """Did the request meet every SLO of `slos` ({"ttft" | "tpot" | "e2el": seconds})? A metric the
    request does not have (None) is not held against it."""
    for name, limit in slos.items():
        if name not in SLO_METRICS:
            raise ValueError(f"slos: keys are {SLO_METRICS}, got {name!r}")
        value = getattr(metrics, name)
        if value is not None and value > limit:
            return False
    return True
