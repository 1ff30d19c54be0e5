"""benchmarks/spec_decode.py: the step-cost fit recovers known costs, its break-even batch is where the
predicted speedup falls to 1, the measured crossing is read off the points, the workloads are distinct, and
a short run on tiny-llama prints the table (outputs checked equal inside)."""
from __future__ import annotations

import pytest

from benchmarks import spec_decode


def test_fit_recovers_the_step_costs():
    steps = [(0.05 + 0.002 * rows + 0.01 * drafting, rows, True, drafting)
             for rows, drafting in [(1, 0), (4, 1), (16, 4), (64, 0), (64, 16), (200, 50)]]
    steps.append((9.0, 500, False, 0))  # a prefill step: not fitted
    a, b, c = spec_decode.fit_step_cost(steps)
    assert (a, b, c) == pytest.approx((0.05, 0.002, 0.01), rel=1e-9)


def test_break_even_is_where_the_predicted_speedup_is_one():
    cost, shape = (0.05, 0.002, 0.01), (3.0, 3.0, 1.0)  # L = 3 tokens per step for 3 drafts, always drafting
    b_star = spec_decode.break_even(cost, shape)
    assert b_star == pytest.approx(0.05 * 2 / (0.002 * 1 + 0.01))
    assert spec_decode.predicted_speedup(cost, shape, b_star) == pytest.approx(1.0)
    assert spec_decode.predicted_speedup(cost, shape, 1) > 1 > spec_decode.predicted_speedup(cost, shape, 2 * b_star)
    assert spec_decode.break_even((0.05, 0.002, 0.0), (4.0, 3.0, 1.0)) is None  # all accepted, free drafts: never
    assert spec_decode.break_even(cost, (1.0, 0.0, 0.0)) == 0.0  # nothing accepted: never above 1


def test_measured_crossing():
    assert spec_decode.measured_crossing([1, 4, 16, 64], [2.0, 1.5, 1.0, 0.5]) == "16"
    assert spec_decode.measured_crossing([1, 4], [2.0, 0.0]) == "2"  # log-linear: halfway in log batch
    assert spec_decode.measured_crossing([1, 4], [0.9, 0.8]) == "< 1"
    assert spec_decode.measured_crossing([1, 4], [1.2, 1.1]) == "> 4"


def test_the_workloads_are_distinct_conversations():
    for name in ("repetitive", "open-ended"):
        texts = [c[0]["content"] for c in spec_decode.workload(name, 64)]
        assert len(set(texts)) == 64
    assert all(p in c[0]["content"] for p, c in zip(spec_decode.PASSAGES, spec_decode.workload("repetitive", 8)))


def test_a_short_run_prints_the_table(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(spec_decode, "tokenize", lambda engine, convs: [[5 + i, 6, 7, 5 + i, 6, 7] for i in range(len(convs))])
    spec_decode.main(["--model", "tiny-llama", "--batch-sizes", "1,2", "--max-tokens", "6",
                      "--plot", str(tmp_path / "img" / "speedup.png")])
    out = capsys.readouterr().out
    assert "repetitive     1" in out and "open-ended     2" in out and "step-cost model over" in out
    assert (tmp_path / "img" / "speedup.png").stat().st_size > 0
