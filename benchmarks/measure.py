"""What every benchmark measures the same way: the machine's busy CPU seconds (/proc/stat), this process's and a
process tree's CPU seconds (to tell how much of the machine other processes took during a run), functions timed
in turn, and the cache and memory numbers a roofline needs. Imports no torch at module level (a serving client
uses it)."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Callable

_TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """Every CPU's busy seconds since boot (/proc/stat: user nice system irq softirq steal; guest time is inside
    user and nice already, idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _TICK


def busy_seconds() -> tuple[float, float]:
    """(the whole machine's busy CPU seconds, this process's CPU seconds, every thread): the difference of two
    readings, minus this process's share, is what other processes took meanwhile."""
    t = os.times()
    return machine_busy_seconds(), t.user + t.system


def tree_cpu_seconds(roots: list[int]) -> float:
    """CPU seconds of this process (every thread, reaped children) and of `roots` and all their descendants."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    parent: dict[int, int] = {}
    times: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(fields[1])
        times[int(d.name)] = sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
    for pid in times:
        p = pid
        while p > 1 and p not in roots:
            p = parent.get(p, 0)
        if p in roots:
            total += times[pid]
    return total


def alternate(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions called in turn `repeats` times (2 untimed first)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + 2):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


# /proc/cpuinfo flags that choose a CPU kernel path (kernels/cpu, oneDNN): the best path differs by CPU
CPU_FLAGS = {"AMX": "amx_bf16", "AVX512-BF16": "avx512_bf16", "AVX512-VNNI": "avx512_vnni", "AVX-512": "avx512f"}


def cpu_line(cpuinfo: str | None = None) -> str:
    """The CPU's model name and which of CPU_FLAGS it has, for the line above a benchmark's table."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    def first(key: str) -> str:
        return next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith(key)), "")

    model, flags = first("model name") or "unknown CPU", set(first("flags").split())
    return f"CPU: {model}, {os.cpu_count()} CPUs; " + ", ".join(
        f"{name} {'yes' if flag in flags else 'no'}" for name, flag in CPU_FLAGS.items())


def l3_bytes() -> int:
    """The largest cache's size from sysfs (32 MiB when sysfs does not say)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
    return max(sizes, default=32 * 2**20)


def stream_bandwidth(l3: int, reps: int = 5) -> float:
    """Bytes per second of a streaming read (a sum over a buffer 8x the L3), best of `reps`."""
    import torch

    buf = torch.ones(8 * l3 // 4)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best


def crossover(times: dict[int, float], base: dict[int, float]) -> int | None:
    """The smallest M from which on the scheme is no faster than the base at every M measured (None: it is
    faster at the largest M); a single noisy slow point below a faster one does not count."""
    ms = sorted(times)
    return next((m for i, m in enumerate(ms) if all(times[n] >= base[n] for n in ms[i:])), None)
