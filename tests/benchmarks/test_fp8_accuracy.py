"""benchmarks.fp8_accuracy on a handful of prompts: the table's invariants, and the outlier variant
showing what it is there to show (per-tensor scales break, per-head scales do not care)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from benchmarks import fp8_accuracy

GAIN = 2.0**16


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """(stdout, the JSON rows) of one small run: tiny-llama and its outlier variant, e4m3, static scales."""
    out = tmp_path_factory.mktemp("acc") / "rows.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert fp8_accuracy.main(["--presets", "tiny-llama", "--outlier", "tiny-llama", "--outlier-gain", str(GAIN),
                                  "--num-prompts", "4", "--output-len", "8", "--formats", "fp8_e4m3",
                                  "--scales", "static per-tensor,static per-head", "--json", str(out)]) == 0
    return printed.getvalue(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def rows(run: tuple[str, list[dict]]) -> dict[tuple[str, str], dict]:
    """The rows by (model, scales), the outlier variant named "tiny-llama outlier"."""
    return {("tiny-llama outlier" if "outlier" in r["model"] else r["model"], r["scales"]): r for r in run[1]}


def test_one_row_per_model_and_scale_mode_printed_as_a_markdown_table(run, rows):
    assert sorted(rows) == [("tiny-llama", "static per-head"), ("tiny-llama", "static per-tensor"),
                            ("tiny-llama outlier", "static per-head"), ("tiny-llama outlier", "static per-tensor")]
    table = run[0].split(fp8_accuracy.HEADER)[1].strip().splitlines()
    assert len(table) == len(rows)
    assert all(line.startswith("| tiny-llama") and line.count("|") == 11 for line in table), table


def test_shares_are_shares_and_kl_is_a_divergence(rows):
    for key, r in rows.items():
        for name in ("token_agreement", "identical_outputs", "forced_top1"):
            assert 0.0 <= r[name] <= 1.0, (key, name, r[name])
        # every output has the same length, so each identical prompt adds a full share of equal tokens
        assert r["identical_outputs"] <= r["token_agreement"], (key, r)
        assert 0.0 <= r["kl_mean"] <= r["kl_max"], (key, r)
        assert r["attn_max_abs"] > 0 and 0 < r["attn_rel"] < 1, (key, r)  # fp8 is lossy, but not noise


def test_per_head_scales_do_not_see_a_power_of_two_outlier(rows):
    """The outlier model is the same fp32 model; with per-head scales, the outlier head's codes are the
    same bytes, so every metric but the absolute error (in that head's units) is unchanged."""
    base, outlier = rows["tiny-llama", "static per-head"], rows["tiny-llama outlier", "static per-head"]
    for name in ("token_agreement", "identical_outputs", "forced_top1"):
        assert outlier[name] == base[name], name
    for name in ("kl_mean", "kl_max", "attn_rel"):
        assert outlier[name] == pytest.approx(base[name], rel=1e-6), name


def test_per_tensor_scales_break_on_the_outlier_and_per_head_fixes_them(rows):
    tensor, head = rows["tiny-llama outlier", "static per-tensor"], rows["tiny-llama outlier", "static per-head"]
    assert tensor["attn_rel"] > 5 * head["attn_rel"], (tensor, head)
    assert tensor["kl_mean"] > 10 * head["kl_mean"], (tensor, head)
    # without the outlier, per-tensor scales are as good as per-head ones
    plain = rows["tiny-llama", "static per-tensor"]
    assert plain["attn_rel"] < 2 * head["attn_rel"], (plain, head)


@pytest.mark.parametrize("args, message", [
    (["--outlier-gain", "3"], "power of two"),
    (["--formats", "fp8_e4m3,int8"], "comma-separated subset"),
    (["--scales", ""], "comma-separated subset"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--input-min", "32", "--input-max", "16"], "--input-max (16) must be >= --input-min (32)"),
])
def test_bad_arguments_are_refused_before_any_work(args, message, capsys):
    with pytest.raises(SystemExit):
        fp8_accuracy.parse_args(args)
    assert message in capsys.readouterr().err
