"""benchmarks.serve's queue depth: `vllm:num_requests_waiting` parsed from a /metrics text, sampled
while a point runs, aggregated per point, printed and drawn; n/a for a server without the gauge."""
from __future__ import annotations

import asyncio

import httpx2
import pytest

from benchmarks.serve import format_sweep, summarize
from benchmarks.serve_plot import plot_sweep
from benchmarks.serve_queue import parse_waiting, queue_summary, sample_waiting
from tests.benchmarks.test_bench_serve import _results

pytestmark = pytest.mark.timeout(30)

VLLM_TEXT = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
"""


def test_the_waiting_gauge_is_parsed_with_or_without_labels():
    assert parse_waiting(VLLM_TEXT) == 5.0  # summed over vLLM's engine labels; running is not counted
    assert parse_waiting("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 4\n") == 4.0
    assert parse_waiting("# TYPE other gauge\nother 1\n") is None  # a server without the gauge
    assert parse_waiting("<html>not found</html>") is None


def test_sampling_until_stopped_keeps_only_the_polls_that_answered():
    waiting = [0, 2, None, 6, 4]  # None: a poll answered 500
    served: list[int] = []

    async def go() -> list[float]:
        stop = asyncio.Event()

        def handler(request: httpx2.Request) -> httpx2.Response:
            assert request.url.path == "/metrics"
            value = waiting[len(served)]
            served.append(1)
            if len(served) == len(waiting):
                stop.set()  # the sampler keeps this last answer, then sees the stop
            if value is None:
                return httpx2.Response(500, text="oops")
            return httpx2.Response(200, text=f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {value}\n")

        async with httpx2.AsyncClient(transport=httpx2.MockTransport(handler)) as client:
            return await asyncio.wait_for(sample_waiting(client, "http://fake", stop, interval=0.01), 10)

    assert asyncio.run(go()) == [0, 2, 6, 4]
    assert queue_summary([0, 2, 6, 4]) == {"mean": 3.0, "max": 6, "samples": 4}
    assert queue_summary([]) is None


def test_a_server_without_metrics_gives_no_samples():
    async def go() -> list[float]:
        stop = asyncio.Event()
        transport = httpx2.MockTransport(lambda request: httpx2.Response(404, text="Not Found"))
        async with httpx2.AsyncClient(transport=transport) as client:
            task = asyncio.create_task(sample_waiting(client, "http://fake", stop, interval=0.01))
            await asyncio.sleep(0.05)
            stop.set()
            return await task

    assert asyncio.run(go()) == []


def test_the_table_and_the_plot_show_the_queue_and_n_a_where_there_is_none(tmp_path):
    summaries = [{"request_rate": 1.0, **summarize(_results(), 4.0), "queue_waiting": queue_summary([0, 1, 2])},
                 {"request_rate": 4.0, **summarize(_results(), 2.0), "queue_waiting": queue_summary([3, 9])},
                 {"request_rate": 8.0, **summarize(_results(), 1.0), "queue_waiting": None}]
    table = format_sweep(summaries).splitlines()
    assert table[0].split()[-4:] == ["wait", "mean", "wait", "max"]
    assert table[1].split()[-2:] == ["1.0", "2"] and table[2].split()[-2:] == ["6.0", "9"]
    assert table[3].split()[-2:] == ["n/a", "n/a"]
    fig = plot_sweep(summaries, {}, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    queue = fig.axes[2]
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in queue.lines}
    # 3 completed requests in 4 s and in 2 s; the n/a point is left out
    assert lines["waiting mean"] == ([0.75, 1.5], pytest.approx([1.0, 6.0]))
    assert lines["waiting max"] == ([0.75, 1.5], [2, 9])
