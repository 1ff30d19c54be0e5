"""Servers a benchmark starts and must not leave behind: each in its own session on a free loopback
port, healthy within a deadline, its CPU time read per session, torn down with its whole tree.

A session (`start_new_session`) holds every process the server forks (vLLM's front end, engine
core and worker; uvicorn's), so one `killpg` reaches them all and /proc's session field counts
their CPU time, the reaped children's included (cutime, cstime).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_stats(sid: int) -> list[tuple[int, str, list[str]]]:
    """(pid, state, the stat fields after the state) of every process in session `sid`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
        if int(fields[3]) == sid:  # field 6 of proc(5): session
            found.append((int(entry.name), fields[0], fields))
    return found


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds (user + system, reaped children included) of every live process in session `sid`."""
    return sum(sum(int(x) for x in f[11:15]) for _, _, f in _session_stats(sid)) / _TICK  # utime..cstime


def session_members(sid: int) -> list[int]:
    """The pids of session `sid` that still run (zombies excluded: they are only waiting to be reaped)."""
    return [pid for pid, state, _ in _session_stats(sid) if state != "Z"]


class ServerProcess:
    """`argv` (which must listen on `port`) in its own session; its output goes to a log file, whose
    tail is shown when it fails to come up."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None) -> None:
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name.replace(' ', '_')}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True)
        self.started = time.monotonic()

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until GET /health answered 200; RuntimeError (with the log's tail) if it exits or
        the deadline passes first."""
        deadline = self.started + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} before it was healthy; "
                                   f"its log ({self.log.name}) ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s; its log ({self.log.name}) "
                                   f"ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def cpu_seconds(self) -> float:
        return session_cpu_seconds(self.proc.pid)

    def log_tail(self, chars: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGINT to the server (it shuts down its own children on it), then SIGKILL to every process of
        its session still there after `grace_s`; returns once none is left. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        deadline, orphans_since = time.monotonic() + grace_s, None
        while (self.proc.poll() is None or session_members(self.proc.pid)) and time.monotonic() < deadline:
            if self.proc.returncode is not None:  # the leader is gone: what it left gets 2 s, not the whole grace
                orphans_since = orphans_since or time.monotonic()
                if time.monotonic() - orphans_since > 2.0:
                    break
            time.sleep(0.1)
        for _ in range(50):  # what ignored SIGINT (or forked meanwhile): by pid, the session's own
            left = session_members(self.proc.pid)
            if not left and self.proc.poll() is not None:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.poll()
            time.sleep(0.1)
        self.proc.wait(10)
        self.log.close()
