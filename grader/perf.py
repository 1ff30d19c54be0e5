"""Throughput targets for `perf` tests: correctness first, then speed relative to the reference.

The learner's kernel and the reference kernel run alternately in one process (order flipped
every pair, so clock boost and cache warmth favour neither), each timed with CUDA events; the
grade is the median over pairs of reference_time / learner_time, a ratio that survives a
noisy machine far better than an absolute time. Achieved GB/s is reported against the
device's copy bandwidth, measured in the same run. The timer is a parameter, so the logic
is tested on CPU with fake clocks.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Protocol

COPY_BUFFER_BYTES = 256 * 2**20  # large enough to stream from HBM, not from L2


class Timer(Protocol):
    def __call__(self, fn: Callable[[], Any]) -> float:
        """Runs `fn` once and returns its duration in seconds."""


class CudaEventTimer:
    """Times one call with CUDA events on the current stream (device time, not host time)."""

    def __call__(self, fn: Callable[[], Any]) -> float:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass(frozen=True)
class ThroughputReport:
    learner_s: float  # median time of one learner call
    reference_s: float
    ratio: float  # median over pairs of reference_time / learner_time: > 1 means faster than the reference
    bytes_moved: int
    copy_gbps: float

    @property
    def learner_gbps(self) -> float:
        return self.bytes_moved / self.learner_s / 1e9

    @property
    def reference_gbps(self) -> float:
        return self.bytes_moved / self.reference_s / 1e9

    def summary(self) -> str:
        return (
            f"learner {self.learner_s * 1e3:.3f} ms ({self.learner_gbps:.0f} GB/s, "
            f"{self.learner_gbps / self.copy_gbps:.0%} of the measured copy bandwidth {self.copy_gbps:.0f} GB/s), "
            f"reference {self.reference_s * 1e3:.3f} ms ({self.reference_gbps:.0f} GB/s): "
            f"speed {self.ratio:.2f}x the reference (median over pairs)"
        )


def measure_copy_bandwidth(timer: Timer, device: str = "cuda", nbytes: int = COPY_BUFFER_BYTES, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written), median of `repeats`."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    seconds = statistics.median(timer(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / seconds / 1e9


def compare_throughput(
    learner: Callable[[], Any],
    reference: Callable[[], Any],
    *,
    bytes_moved: int,
    copy_gbps: float,
    timer: Timer,
    warmup: int = 5,
    repeats: int = 30,
) -> ThroughputReport:
    """Times both alternately (`repeats` pairs after `warmup` untimed calls of each)."""
    for _ in range(warmup):
        learner()
        reference()
    learner_times, reference_times, ratios = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            t_learner, t_reference = timer(learner), timer(reference)
        else:
            t_reference, t_learner = timer(reference), timer(learner)
        learner_times.append(t_learner)
        reference_times.append(t_reference)
        ratios.append(t_reference / t_learner)
    return ThroughputReport(
        statistics.median(learner_times), statistics.median(reference_times), statistics.median(ratios),
        bytes_moved, copy_gbps,
    )


def _assert_close(out: Any, expected: Any) -> None:
    import torch

    torch.testing.assert_close(out, expected)


def assert_throughput(
    learner: Callable[[], Any],
    reference: Callable[[], Any],
    *,
    bytes_moved: int,
    min_ratio: float,
    check: Callable[[Any, Any], None] = _assert_close,
    timer: Timer | None = None,
    copy_gbps: float | None = None,
    warmup: int = 5,
    repeats: int = 30,
) -> ThroughputReport:
    """Fails unless `learner()` matches `reference()` and runs at >= `min_ratio` x its speed.

    `bytes_moved`: bytes one call must read and write at least (for GB/s). `check(out, ref)`
    raises when the outputs differ (default `torch.testing.assert_close`).
    """
    if not min_ratio > 0:
        raise ValueError(f"min_ratio must be > 0 (1.0 = as fast as the reference), got {min_ratio}")
    if bytes_moved <= 0:
        raise ValueError(f"bytes_moved must be > 0, got {bytes_moved}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    try:
        check(learner(), reference())
    except AssertionError as exc:
        raise AssertionError(f"correctness first: the output differs from the reference, so no speed credit:\n{exc}") from None
    timer = timer or CudaEventTimer()
    if copy_gbps is None:
        copy_gbps = measure_copy_bandwidth(timer)
    report = compare_throughput(learner, reference, bytes_moved=bytes_moved, copy_gbps=copy_gbps,
                                timer=timer, warmup=warmup, repeats=repeats)
    assert report.ratio >= min_ratio, f"too slow: {report.summary()}; the target is {min_ratio:.2f}x"
    print(report.summary())
    return report
