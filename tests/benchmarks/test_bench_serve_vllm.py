"""benchmarks.serve_vs_vllm without vLLM: the rotation of the servers over the sweep, the CPU accounting
and its quiet/loaded label at the boundary, the greedy sanity line, the table, the picture, and the
server processes' life (healthy, CPU counted per session, every process of the session gone after
stop, even one that ignores SIGINT; a server that dies says why; SIGTERM or Ctrl-C to the benchmark
leaves none of its servers' processes behind)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.server_procs import ServerProcess, free_port, session_cpu_seconds, session_members
from benchmarks.serve_vs_vllm import (Accounting, Point, format_table, greedy_check, knee, load_label, rotation,
                                      run_summary, schedule)

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]

# /health after ~0.2 s of CPU; a forked child that ignores SIGINT stays in the session
FAKE_SERVER = '''
import os, signal, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
t = time.process_time()
while time.process_time() - t < 0.2:
    pass
if os.fork() == 0:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        time.sleep(1)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def test_rotation_alternates_who_goes_first_and_runs_every_pair_once() -> None:
    names = ["engine", "vllm serve"]
    assert rotation(names, 0) == names and rotation(names, 1) == names[::-1] and rotation(names, 2) == names
    order = schedule(names, [1.0, 2.0, 4.0, float("inf")])
    assert order == [("engine", 1.0), ("vllm serve", 1.0), ("vllm serve", 2.0), ("engine", 2.0),
                     ("engine", 4.0), ("vllm serve", 4.0), ("vllm serve", float("inf")), ("engine", float("inf"))]
    assert [o[0] for o in schedule(["a", "b", "c"], [1.0, 2.0, 3.0])[::3]] == ["a", "b", "c"]


def test_others_cpu_is_the_machine_minus_client_and_servers_and_labels_at_the_boundary() -> None:
    before = Accounting(100.0, 10.0, {"engine": 5.0, "vllm serve": 7.0})
    after = Accounting(112.0, 11.0, {"engine": 9.0, "vllm serve": 8.0})
    used = after - before
    assert (used.machine, used.client, used.servers) == (12.0, 1.0, {"engine": 4.0, "vllm serve": 1.0})
    assert used.others == pytest.approx(6.0)
    assert Accounting(1.0, 1.0, {"a": 0.5}).others == 0.0  # counters tick separately: never negative
    # 10 s on 2 cores, quiet share 10%: others may take 2.0 CPU s
    assert load_label(2.0, 10.0, 2) == "quiet" and load_label(2.01, 10.0, 2) == "loaded"
    assert load_label(0.0, 1.0, 1, quiet_share=0.0) == "quiet"
    with pytest.raises(ValueError, match="wall_s"):
        load_label(1.0, 0.0, 2)


def _summary(req_s: float, ttft_p99: float, goodput: float) -> dict:
    d = {"mean_ms": 1.0, "p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": ttft_p99}
    return {"request_throughput": req_s, "output_throughput": 40 * req_s, "ttft": d, "tpot": dict(d, p99_ms=9.0),
            "itl": dict(d, p99_ms=8.0), "goodput": goodput, "failed": 0}


def _points() -> list[Point]:
    servers = {"engine": 3.0, "vllm serve": 0.5}
    return [Point("engine", 1.0, _summary(0.9, 50.0, 0.9), 10.0, 1.0, servers, 0.5, "quiet"),
            Point("vllm serve", 1.0, _summary(0.95, 40.0, 0.95), 10.0, 1.0, {"engine": 0.2, "vllm serve": 4.0},
                  6.0, "loaded"),
            Point("vllm serve", float("inf"), _summary(3.0, 2000.0, 1.5), 5.0, 1.0, servers, 1.0, "quiet"),
            Point("engine", float("inf"), _summary(2.5, 3000.0, 1.0), 5.0, 1.0, servers, 1.0, "quiet")]


def test_table_knee_and_run_line(tmp_path: Path) -> None:
    points = _points()
    table = format_table(points, 2)
    assert table.splitlines()[2] == ("| 1 | engine | 0.90 | 36.0 | 1 / 2 / 50 | 1 / 2 / 9 | 1 / 2 / 8 | 0.90 | 0 | "
                                     "3.0 / 0.5 / 1.0 / 0.5 | quiet (2%) |")
    assert "| inf | vllm serve | 3.00 | 120.0 |" in table and table.count("\n") == 5
    assert table.splitlines()[3].endswith("| 4.0 / 0.2 / 1.0 / 6.0 | loaded (30%) |")  # 6 CPU s of 2 x 10 s
    assert knee(points, "vllm serve", {"ttft": 1.0}).startswith("vllm serve: goodput peaks at 1.50 req/s (offered inf/s")
    assert knee(points, "engine", {}) == "engine: -"
    line = run_summary(points, 2)  # others 8.5 CPU s over 30 s on 2 cores: 14% > 10%
    assert "4 timed points, 30 s" in line and "1 of 4 points loaded" in line and line.endswith("LOADED")
    from benchmarks.serve_plot import offered_x, plot_side_by_side

    assert offered_x([1.0, 4.0, float("inf")]) == [1.0, 4.0, 8.0] and offered_x([float("inf")]) == [1.0]
    fig = plot_side_by_side(points, {"ttft": 1.0, "tpot": 0.1}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    ttft_lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
    assert ttft_lines["engine P99"] == [50.0, 3000.0] and ttft_lines["vllm serve P99"] == [40.0, 2000.0]
    assert list(fig.axes[2].get_lines()[0].get_xdata()) == [1.0, 2.0]  # inf drawn at 2x the highest finite


def test_greedy_check_compares_ids_where_every_server_gives_them() -> None:
    same = {"engine": [{"text": "ab", "token_ids": None}], "vllm serve": [{"text": "ab", "token_ids": [5, 6]}]}
    assert greedy_check(same).endswith("1/1 prompts identical, compared by text (a server returned no token ids): OK")
    ids = {"a": [{"text": "x", "token_ids": [1, 2]}, {"text": "y", "token_ids": [2, 5, 6, 7]}],
           "b": [{"text": "x", "token_ids": [1, 2]}, {"text": "y", "token_ids": [2, 5, 9, 7]}]}
    # 2 + 2 of the 6 tokens before each first difference
    assert greedy_check(ids).endswith("1/2 prompts identical, compared by token ids, 66.7% of tokens agree up to "
                                      "each first difference: MISMATCH")


def test_server_process_is_healthy_counted_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    server = ServerProcess("fake", [sys.executable, str(script), str(port)], port)
    try:
        assert 0 < server.wait_healthy(30.0) < 30.0
        deadline = time.monotonic() + 5
        while len(session_members(server.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = session_members(server.proc.pid)
        assert len(members) == 2 and server.proc.pid in members
        assert server.cpu_seconds() >= 0.15 and server.cpu_seconds() == pytest.approx(
            session_cpu_seconds(server.proc.pid), abs=0.05)
    finally:
        server.stop(grace_s=1.0)
    assert session_members(server.proc.pid) == [] and server.proc.returncode is not None
    for pid in members:  # gone, or a zombie waiting for init to reap it (it runs nothing)
        assert _state(pid) in ("gone", "Z")
    server.stop(grace_s=1.0)  # twice is harmless


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except FileNotFoundError:
        return "gone"


def test_a_server_that_dies_says_so_with_its_log(tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess("broken", [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"], port)
    try:
        with pytest.raises(RuntimeError, match=r"broken exited with status 3 (.|\n)*no such model"):
            server.wait_healthy(30.0)
    finally:
        server.stop(grace_s=1.0)


# Python's own SIGINT handler first, as a terminal's foreground job has it: a test run started in the background
# from a script (`make test &`) ignores SIGINT, and a child Python would inherit that and never see Ctrl-C
HOLDER = '''
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from benchmarks.serve_vs_vllm import torn_down
from benchmarks.server_procs import ServerProcess, free_port
with torn_down() as servers:
    port = free_port()
    servers.append(ServerProcess("fake", [sys.executable, sys.argv[1], str(port)], port))
    servers[0].wait_healthy(30.0)
    print(servers[0].proc.pid, flush=True)
    time.sleep(60)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["timeout's SIGTERM", "Ctrl-C"])
def test_a_signal_to_the_benchmark_tears_its_servers_down(tmp_path: Path, sig: int) -> None:
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "fake_server.py")], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        sid = int(holder.stdout.readline())
        deadline = time.monotonic() + 5
        while len(session_members(sid)) < 2 and time.monotonic() < deadline:  # the forked child is up
            time.sleep(0.05)
        assert len(session_members(sid)) == 2
        holder.send_signal(sig)
        assert holder.wait(30) != 0  # it left through the exception, not the end of its sleep
        assert session_members(sid) == [], "a server process outlived the benchmark"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
