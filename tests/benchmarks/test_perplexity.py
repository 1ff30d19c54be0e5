"""benchmarks.perplexity: the shipped text, the scoring pass against Hugging Face, the vLLM-headroom
observer, and a smoke run of the command on tiny-llama (the real model's table is docs/real_model.md)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks.perplexity import TEXT, HeadroomScales, _prose, build_engine, main, score, windows
from engine_core.presets import resolve_model


def test_shipped_text_is_over_20k_tokens_of_prose() -> None:
    from tokenizers import Tokenizer

    text = TEXT.read_text(encoding="utf-8")
    tok = Tokenizer.from_file(str(resolve_model("smollm2-135m-instruct") / "tokenizer.json"))
    assert len(tok.encode(text, add_special_tokens=False).ids) >= 20_000
    assert "```" not in text and not any(line.lstrip().startswith("|") for line in text.splitlines())


def test_prose_drops_code_and_tables() -> None:
    md = "Intro text.\n\n```python\nx = 1\n```\n| a | b |\n|---|---|\n    indented code\nOutro."
    assert _prose(md) == "Intro text.\n\nOutro."


def test_windows_cut_the_text() -> None:
    assert windows(list(range(10)), 4, 9) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # [8] alone predicts nothing
    assert windows(list(range(10)), 4, 10) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_score_matches_hf_next_token_log_likelihood() -> None:
    """The engine's teacher-forced NLL per position against transformers' forward, fp32."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    wins = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (40, 17, 33, 2, 25)]
    nll, top1 = score(build_engine("tiny-llama", 40, "float32"), wins)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama"), dtype=torch.float32).eval()
    ref_nll, ref_top1 = [], []
    with torch.no_grad():
        for w in wins:
            logp = torch.log_softmax(hf(torch.tensor([w])).logits[0, :-1].double(), -1)
            ref_nll.append(-logp.gather(1, torch.tensor(w[1:])[:, None])[:, 0])
            ref_top1.append(logp.argmax(-1))
    torch.testing.assert_close(nll, torch.cat(ref_nll), atol=1e-4, rtol=1e-5)  # fp32 matmul order differs
    assert torch.equal(top1, torch.cat(ref_top1))


def test_headroom_scales_divide_amax_by_200_and_100() -> None:
    cache = SimpleNamespace(k_scale=[torch.zeros(())], v_scale=[torch.zeros(())], num_layers=1, observer=None)
    cache.observer = HeadroomScales(cache, per_head=False)
    key = torch.tensor([[[1.0, -4.0]], [[2.0, 3.0]]])  # [tokens, kv heads, head dim]
    cache.observer(0, key, 2 * key)
    assert cache.k_scale[0] == torch.tensor(4.0) / 200 and cache.v_scale[0] == torch.tensor(8.0) / 100  # fp32
    assert cache.observer is None  # the first batch only, like calculate_kv_scales


def test_command_runs_on_a_tiny_preset(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    assert main(["--model", "tiny-llama", "--text", str(text), "--context", "64", "--max-tokens", "256",
                 "--formats", "fp8_e4m3", "--modes", "calibrated,dynamic amax/200 K amax/100 V", "--no-bf16"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| fp")]
    assert len(rows) == 2 * 3  # printed as measured, then in the table
    ref = rows[3].split(" | ")
    assert ref[0] == "| fp32 (reference)" and ref[2] == "100.00%" and math.isfinite(float(ref[1]))
    with pytest.raises(SystemExit):
        main(["--modes", "static"])


def test_quantization_rows(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """`--quantization`: the fp32 row, then one row per scheme, each with its weight bytes; the int8 row is
    not the reference's numbers (the scheme ran), and agreement is a fraction."""
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    assert main(["--model", "tiny-llama", "--text", str(text), "--context", "64", "--max-tokens", "256",
                 "--quantization", "int8,rtn-g32"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = out[out.index("| weights / KV cache | perplexity | top-1 agreement with fp32 | seconds |"):]
    rows = [line.split(" | ") for line in table[2:] if line.startswith("| ")]
    assert [r[0] for r in rows] == ["| fp32 (reference)", "| int8 (0 MiB of weights)", "| rtn-g32 (0 MiB of weights)"]  # tiny
    assert rows[1][1] != rows[0][1] and 0 < float(rows[2][2].rstrip("%")) <= 100
    with pytest.raises(SystemExit):
        main(["--quantization", "gptq"])
