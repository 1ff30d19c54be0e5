"""benchmarks.vs_vllm without vLLM (the driver protocol through a stand-in driver, the report), and a
smoke run of benchmarks.profile_steps."""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.vs_vllm import Side, VllmProcess, report
from benchmarks.workload import Workload

FAKE_DRIVER = '''
import json, sys
spec = json.loads(sys.stdin.readline())
print("vLLM-style log line on stdout")
print("@@" + json.dumps({"ready": True, "start_s": 1.5}), flush=True)
for _ in sys.stdin:
    print("@@" + json.dumps({"wall_s": 2.0, "token_ids": [p[:n] for p, n in zip(spec["prompts"], spec["output_lens"])]}),
          flush=True)
'''


def test_driver_protocol_skips_log_lines_and_returns_timed_tokens(tmp_path: Path) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(FAKE_DRIVER)
    spec = {"prompts": [[5, 6, 7], [8, 9]], "output_lens": [2, 1]}
    proc = VllmProcess(sys.executable, spec, {}, driver=driver)
    try:
        assert proc.start_s == 1.5
        assert proc.run() == (2.0, [[5, 6], [8]]) and proc.run()[0] == 2.0
    finally:
        proc.close()


def test_report_gives_medians_spreads_loads_and_agreement(capsys) -> None:
    w = Workload(prompts=[[1], [2]], output_lens=[2, 2])  # 4 output tokens
    sides = [Side("vLLM CPU", lambda: (0.0, []), [1.0, 2.0, 4.0], [1.0, 1.5, 2.0], [[3, 4], [5, 6]]),
             Side("engine", lambda: (0.0, []), [1.0, 1.0, 2.0], [0.5, 0.5, 0.5], [[3, 4], [5, 7]]),
             Side("HF generate, batch 32", lambda: (0.0, []), [4.0, 4.0, 4.0], [0.1, 0.2, 0.3], [[3, 4], [5, 6]])]
    r = report(sides, w)
    text = capsys.readouterr().out
    assert r["tok_s"] == {"vLLM CPU": 2.0, "engine": 4.0, "HF generate, batch 32": 1.0}
    assert "| vLLM CPU | 2.0 | 1.0-4.0 | 1.00, 1.50, 2.00 |" in text
    assert "engine / vLLM CPU: 2.00x" in text and "engine / HF best (HF generate, batch 32): 4.00x" in text
    assert r["vllm_identical_requests"] == 1 and "1/2 requests identical, 75.0% of tokens" in text


def test_profile_steps_prints_the_split_and_the_gemm_rates(capsys) -> None:
    from benchmarks import profile_steps

    profile_steps.main(["--model", "tiny-llama", "--num-requests", "6", "--input-len", "4:20", "--output-len", "8:12",
                        "--profile-steps", "3"])
    text = capsys.readouterr().out
    assert "| GEMM (linear layers) |" in text and "| decode attention |" in text and "Python and dispatch" in text
    assert "oneDNN packed (engine):" in text and "% of the machine's best rate at" in text
