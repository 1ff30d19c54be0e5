"""The capacity picture of a `benchmarks.serve --sweep`: achieved throughput against P50/P99 TTFT
and TPOT, one point per offered request rate, with the SLO lines of `--goodput`.

Read it left to right: latency stays flat while the server keeps up; past the knee the achieved
throughput stops growing with the offered rate and TTFT climbs (requests queue), while TPOT grows
with the batch. The SLO lines show the highest throughput that still meets them.
"""
from __future__ import annotations

from typing import Any

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"))


def plot_sweep(summaries: list[dict[str, Any]], slos: dict[str, float], path: str) -> Any:
    """Write the PNG; returns the matplotlib Figure (its lines are the plotted values, in ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["request_throughput"] for s in summaries]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(10, 4), constrained_layout=True)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
