"""The capacity picture of a `benchmarks.serve --sweep`: achieved throughput against P50/P99 TTFT
and TPOT, one point per offered request rate, with the SLO lines of `--goodput`, and the server's
queue depth (mean and max waiting requests) in a third panel.

Read it left to right: latency stays flat while the server keeps up; past the knee the achieved
throughput stops growing with the offered rate and TTFT climbs (requests queue: the third panel
shows the queue), while TPOT grows with the batch. The SLO lines show the highest throughput that
still meets them. Points without a queue sample (a server without the gauge) are left out of it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"))


def plot_sweep(summaries: list[dict[str, Any]], slos: dict[str, float], path: str) -> Any:
    """Write the PNG; returns the matplotlib Figure (its lines are the plotted values, in ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["request_throughput"] for s in summaries]
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(14, 4), constrained_layout=True)
    for ax, (key, title) in zip(axes, PANELS):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [s[key][f"{q}_ms"] for s in summaries], style, label=f"{title} {q.upper()}")
        for s, xi in zip(summaries, x):
            ax.annotate(f"{s['request_rate']:g}/s", (xi, s[key]["p99_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        if key in slos:
            ax.axhline(slos[key] * 1000.0, color="tab:red", linestyle=":", label=f"SLO {slos[key] * 1000.0:g} ms")
        ax.set_xlabel("achieved throughput (requests/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs throughput (labels: offered rate)")
        ax.legend(fontsize=8)
    plot_queue(axes[-1], summaries)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def plot_queue(ax: Any, summaries: list[dict[str, Any]]) -> None:
    """Mean and max waiting requests against achieved throughput (the points that have samples)."""
    sampled = [s for s in summaries if s.get("queue_waiting")]
    x = [s["request_throughput"] for s in sampled]
    for key, style in (("mean", "o-"), ("max", "s--")):
        ax.plot(x, [s["queue_waiting"][key] for s in sampled], style, label=f"waiting {key}")
    if not sampled:
        ax.text(0.5, 0.5, "n/a: no vllm:num_requests_waiting", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("achieved throughput (requests/s)")
    ax.set_ylabel("requests waiting")
    ax.set_title("queue depth (sampled every 0.25 s)")
    ax.legend(fontsize=8)


SIDE_COLORS = ("tab:blue", "tab:orange", "tab:green")


def offered_x(rates: list[float]) -> list[float]:
    """Where to draw each offered rate on a log axis: 'all at once' (inf) at twice the highest finite one."""
    finite = [r for r in rates if r != float("inf")]
    return [2 * max(finite, default=0.5) if r == float("inf") else r for r in rates]


def plot_side_by_side(points: list[Any], slos: dict[str, float], path: str, title: str = "") -> Any:
    """Several servers' sweeps on one picture (benchmarks.serve_vs_vllm's Points): P50/P99 TTFT and
    TPOT against achieved throughput, and goodput against the offered rate, one colour per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(p.server for p in points))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    for server, color in zip(servers, SIDE_COLORS):
        mine = sorted((p for p in points if p.server == server), key=lambda p: p.request_rate)
        x = [p.summary["request_throughput"] for p in mine]
        for ax, (key, label) in zip(axes, PANELS):
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot(x, [p.summary[key][f"{q}_ms"] for p in mine], style, color=color,
                        label=f"{server} {q.upper()}")
        axes[2].plot(offered_x([p.request_rate for p in mine]), [p.summary.get("goodput", 0.0) for p in mine], "o-", color=color, label=server)
    for ax, (key, label) in zip(axes, PANELS):
        if key in slos:
            ax.axhline(slos[key] * 1000.0, color="tab:red", linestyle=":", label=f"SLO {slos[key] * 1000.0:g} ms")
        ax.set_yscale("log")
        ax.set_xlabel("achieved throughput (requests/s)")
        ax.set_ylabel(f"{label} (ms, log)")
        ax.set_title(f"{label} vs achieved throughput")
        ax.legend(fontsize=7)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("offered rate (requests/s, log; 'inf' at 2x the highest)")
    axes[2].set_ylabel("goodput (requests/s meeting every SLO)")
    axes[2].set_title("goodput vs offered rate")
    axes[2].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
