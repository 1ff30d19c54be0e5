"""benchmarks.serve's statistics against values computed by hand (numpy's linear percentiles:
P_q of sorted x at index q/100 * (n - 1), interpolated), and its arrival process."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.serve import (
    RequestResult, arrival_offsets, format_sweep, meets, parse_goodput, parse_range, parse_rates, prefix_workload,
    summarize)
from benchmarks.serve_plot import plot_sweep

pytestmark = pytest.mark.timeout(30)


def _results() -> list[RequestResult]:
    return [
        RequestResult(prompt_len=10, output_len=5, success=True, ttft=0.1, itl=[0.1] * 4, e2e=0.5),  # tpot 0.1
        RequestResult(prompt_len=20, output_len=3, success=True, ttft=0.2, itl=[0.2] * 2, e2e=0.6),  # tpot 0.2
        RequestResult(prompt_len=30, output_len=1, success=True, ttft=0.3, itl=[], e2e=0.3),  # no tpot
        RequestResult(prompt_len=40, success=False, error="HTTP 503"),
    ]


def test_summary_by_hand():
    s = summarize(_results(), duration_s=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(9 / 2)
    assert s["total_token_throughput"] == pytest.approx((60 + 9) / 2)
    # ttft [100, 200, 300] ms: P90 at index 1.8 = 200 + 0.8 * 100
    assert s["ttft"] == pytest.approx({"mean_ms": 200, "p50_ms": 200, "p90_ms": 280, "p99_ms": 298})
    # tpot: (500 - 100) / 4 = 100 and (600 - 200) / 2 = 200; the 1-token request has none
    assert s["tpot"] == pytest.approx({"mean_ms": 150, "p50_ms": 150, "p90_ms": 190, "p99_ms": 199})
    # itl [100 x4, 200 x2]: P50 at index 2.5 (both 100), P90 at 4.5 (both 200)
    assert s["itl"] == pytest.approx({"mean_ms": 800 / 6, "p50_ms": 100, "p90_ms": 200, "p99_ms": 200})
    # e2el sorted [300, 500, 600]
    assert s["e2el"] == pytest.approx({"mean_ms": 1400 / 3, "p50_ms": 500, "p90_ms": 580, "p99_ms": 598})
    assert "goodput" not in s


def test_goodput_counts_requests_that_meet_every_slo():
    results = _results()
    both = parse_goodput(["ttft:250", "tpot:150"])
    assert both == pytest.approx({"ttft": 0.25, "tpot": 0.15})
    # r1 meets both; r2 misses tpot (200 ms); r3 misses ttft (300 ms); r4 failed
    assert [meets(r, both) for r in results] == [True, False, False, False]
    s = summarize(results, 2.0, both)
    assert (s["goodput"], s["slo_attainment"]) == pytest.approx((0.5, 0.25))
    # a 1-token request has no TPOT: a TPOT-only SLO does not hold it against it
    assert summarize(results, 2.0, parse_goodput(["tpot:150"]))["goodput"] == pytest.approx(1.0)
    assert summarize(results, 2.0, parse_goodput(["e2el:550"]))["goodput"] == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [["ttfb:100"], ["ttft:0"], ["ttft:x"]])
def test_bad_goodput_is_refused(bad):
    with pytest.raises(ValueError):
        parse_goodput(bad)


def test_ranges():
    assert parse_range("16") == (16, 16) and parse_range("16:512") == (16, 512)
    with pytest.raises(ValueError):
        parse_range("9:3")


def test_arrivals_poisson_and_bursty():
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0)):  # gamma gaps: coefficient of variation 1/sqrt(shape)
        gaps = np.diff(arrival_offsets(20000, 10.0, burstiness, seed=1))
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)
    assert arrival_offsets(50, 10.0, seed=3) == arrival_offsets(50, 10.0, seed=3)


def test_sweep_rates_are_parsed_and_checked():
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, float("inf")]
    for bad, message in (("1,0", "must be > 0, got '0'"), ("1,fast", "like 1,2,4,inf, got 'fast'"), ("-1", "> 0")):
        with pytest.raises(ValueError, match=message):
            parse_rates(bad)


def test_the_sweep_plot_draws_p50_and_p99_against_achieved_throughput_with_the_slo_lines(tmp_path):
    summaries = [{"request_rate": rate, **summarize(_results(), duration)} for rate, duration in ((1.0, 4.0), (4.0, 2.0))]
    slos = parse_goodput(["ttft:250"])
    fig = plot_sweep(summaries, slos, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ttft, tpot, _queue = fig.axes  # the queue panel: tests/benchmarks/test_bench_serve_queue.py
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ttft.lines}
    # 3 completed requests in 4 s and in 2 s; ttft P50 200 ms and P99 298 ms in both runs (by hand above)
    assert lines["TTFT P50"] == ([0.75, 1.5], pytest.approx([200, 200]))
    assert lines["TTFT P99"] == ([0.75, 1.5], pytest.approx([298, 298]))
    assert list(lines["SLO 250 ms"][1]) == [250, 250]
    assert {line.get_label() for line in tpot.lines} == {"TPOT P50", "TPOT P99"}  # no TPOT SLO given
    table = format_sweep(summaries).splitlines()
    assert len(table) == 3 and table[2].split()[:3] == ["4", "1.50", "4.5"]


def test_prefix_workload_shares_leading_blocks():
    prompts, lens = prefix_workload(40, 3, 16, (4, 8), (2, 5), vocab=256, seed=7)
    heads = {tuple(p[:16]) for p in prompts}
    assert len(heads) == 3 and len(lens) == 40 and all(2 <= n <= 5 for n in lens)
    assert all(20 <= len(p) <= 24 and all(3 <= t < 256 for t in p) for p in prompts)
    assert prefix_workload(40, 3, 16, (4, 8), (2, 5), 256, 7) == (prompts, lens)
    with pytest.raises(ValueError, match="--prefix-groups"):
        prefix_workload(4, 0, 16, (4, 8), (2, 5), 256, 7)
