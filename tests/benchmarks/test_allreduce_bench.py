"""benchmarks/allreduce.py: the alpha-beta fit recovers known numbers, its model column is lab 01's formula, and a
short run on two processes prints the table and the fit."""
from __future__ import annotations

import pytest

from benchmarks import allreduce


def test_fit_recovers_alpha_and_beta():
    sizes = [4, 1024, 65536, 1 << 20]
    for p in (2, 4):
        seconds = [50e-6 + 2 * (p - 1) / p * b / 2e9 for b in sizes]
        alpha, beta = allreduce.fit_alpha_beta(p, sizes, seconds)
        assert alpha == pytest.approx(50e-6, rel=1e-9) and 1 / beta == pytest.approx(2e9, rel=1e-9)


def test_model_column_is_lab01s_alpha_beta():
    assert allreduce.model_seconds(2, 4096, 30e-6, 1e-9) == pytest.approx(30e-6 + 4096 * 1e-9, rel=1e-12)
    assert allreduce.model_seconds(4, 4096, 30e-6, 1e-9) == pytest.approx(30e-6 + 1.5 * 4096 * 1e-9, rel=1e-12)


def test_fit_needs_two_points():
    with pytest.raises(ValueError, match="at least two"):
        allreduce.fit_alpha_beta(2, [4], [1e-5])


@pytest.mark.timeout(300)
def test_short_run_prints_the_table_and_the_fit(capsys):
    allreduce.main(["--sizes", "4,65536,1048576", "--repeats", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    assert "gloo all-reduce, 2 processes" in out and "fit: alpha = " in out
    assert len([line for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]) == 3
