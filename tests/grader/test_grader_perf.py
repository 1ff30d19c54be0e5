"""grader.perf's logic with fake clocks (the CUDA-event timer itself needs a GPU: see the gpu test)."""
from __future__ import annotations

import pytest
import torch

from grader.perf import CudaEventTimer, assert_throughput, compare_throughput, measure_copy_bandwidth


class FakeTimer:
    """Returns scripted durations per function (or `default`) and records the call order."""

    def __init__(self, durations: dict, default: float | None = None) -> None:
        self.durations = {fn: list(times) for fn, times in durations.items()}
        self.default = default
        self.calls: list = []

    def __call__(self, fn) -> float:
        self.calls.append(fn)
        fn()
        return self.durations[fn].pop(0) if fn in self.durations else self.default


def learner():
    return torch.ones(3)


def reference():
    return torch.ones(3)


def test_calls_alternate_and_the_ratio_is_the_median_over_pairs():
    # learner 2 ms except one 50 ms hiccup; reference 3 ms: median ratio 1.5 despite the outlier
    timer = FakeTimer({learner: [2e-3, 2e-3, 50e-3, 2e-3, 2e-3], reference: [3e-3] * 5})
    report = compare_throughput(learner, reference, bytes_moved=6_000_000, copy_gbps=10.0, timer=timer,
                                warmup=2, repeats=5)
    assert timer.calls == [learner, reference, reference, learner, learner, reference,
                           reference, learner, learner, reference]
    assert report.ratio == pytest.approx(1.5)
    assert report.learner_s == pytest.approx(2e-3) and report.reference_s == pytest.approx(3e-3)
    assert report.learner_gbps == pytest.approx(3.0)  # 6e6 bytes / 2e-3 s
    assert "30% of the measured copy bandwidth 10 GB/s" in report.summary()


def test_a_fast_enough_kernel_passes_and_a_slow_one_fails_with_the_numbers():
    fast = FakeTimer({learner: [1e-3] * 4, reference: [1e-3] * 4})
    assert assert_throughput(learner, reference, bytes_moved=1000, min_ratio=0.9, timer=fast, copy_gbps=1.0,
                             warmup=0, repeats=4).ratio == pytest.approx(1.0)
    slow = FakeTimer({learner: [4e-3] * 4, reference: [1e-3] * 4})
    with pytest.raises(AssertionError, match=r"too slow: .*speed 0.25x the reference.*the target is 0.90x"):
        assert_throughput(learner, reference, bytes_moved=1000, min_ratio=0.9, timer=slow, copy_gbps=1.0,
                          warmup=0, repeats=4)


def test_correctness_comes_before_any_timing():
    timer = FakeTimer({})
    with pytest.raises(AssertionError, match="correctness first"):
        assert_throughput(lambda: torch.zeros(3), reference, bytes_moved=1, min_ratio=0.5, timer=timer, copy_gbps=1.0)
    assert timer.calls == []


def test_copy_bandwidth_counts_read_and_write():
    nbytes = 4096
    timer = FakeTimer({}, default=1e-6)
    assert measure_copy_bandwidth(timer, device="cpu", nbytes=nbytes, repeats=3) == pytest.approx(2 * nbytes / 1e-6 / 1e9)
    assert len(timer.calls) == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"min_ratio": 0}, "min_ratio must be > 0"),
    ({"bytes_moved": 0}, "bytes_moved must be > 0"),
    ({"repeats": 0}, "repeats must be >= 1"),
])
def test_bad_arguments_are_value_errors(kwargs, match):
    args = {"bytes_moved": 1, "min_ratio": 1.0, "timer": FakeTimer({}), "copy_gbps": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        assert_throughput(learner, reference, **args)


@pytest.mark.gpu
def test_cuda_event_timer_measures_a_copy_near_the_device_bandwidth():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False here)")
    gbps = measure_copy_bandwidth(CudaEventTimer())
    assert 50 < gbps < 20_000, f"copy bandwidth {gbps:.0f} GB/s is not a plausible device figure"
    x = torch.randn(2**24, device="cuda")
    report = assert_throughput(lambda: x * 2, lambda: x + x, bytes_moved=2 * x.numel() * 4, min_ratio=0.5)
    assert 0.5 < report.ratio < 2.0, report.summary()
