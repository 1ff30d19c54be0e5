"""The CPU-speed benchmarks without vLLM or llama.cpp: step_overhead on tiny-llama (both variants, the
phase table), the process-tree CPU count behind the quiet/loaded labels, and the two reports."""
from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import step_overhead
from benchmarks.vs_llamacpp import report as llamacpp_report
from benchmarks.vs_vllm import Side, report, tree_cpu_seconds, vllm_env
from benchmarks.workload import Workload


def test_step_overhead_runs_both_variants_and_times_each_phase(capsys) -> None:
    step_overhead.main(["--model", "tiny-llama", "--formats", "fp32", "--threads", "1", "--rounds", "2",
                        "--input-len", "6", "--output-len", "5", "--phases", "--machine", "--bandwidth-mb", "8"])
    text = capsys.readouterr().out
    assert "| fp32 | 1 | separate ops |" in text and "| fp32 | 1 | fused block |" in text
    assert "| C decode_attention_block | 2 |" in text  # tiny-llama's 2 layers, once each per decode step
    assert "| rest (Python, dispatch, scheduler, sampler) |" in text
    assert "| fp32 | 1 |" in text.split("Against the machine")[1]


@pytest.mark.timeout(120)
def test_tree_cpu_seconds_counts_a_busy_child() -> None:
    """The child says when it has burnt 0.5 CPU s (a line on its pipe): waited on, not guessed with a sleep,
    since a loaded machine may give it a fraction of a core."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\nprint('burnt', flush=True)\n"
                              "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "burnt\n"  # a child that never gets there: the timeout
        mine = tree_cpu_seconds([])
        assert tree_cpu_seconds([child.pid]) - mine >= 0.4
    finally:
        child.kill()
        child.wait()


def test_vllm_env_sets_and_clears_the_preloads(monkeypatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/x.so")
    assert vllm_env(["/a.so", "/b.so"])["LD_PRELOAD"] == "/a.so:/b.so:/x.so"
    assert "LD_PRELOAD" not in vllm_env(None)


def test_report_splits_quiet_from_loaded_runs(capsys) -> None:
    w = Workload(prompts=[[1]], output_lens=[4])
    sides = [Side("vLLM CPU", lambda: (0.0, []), [1.0, 2.0], [0.1, 0.1], [[3]], [0.0, 100.0]),
             Side("engine", lambda: (0.0, []), [2.0, 1.0], [0.1, 0.1], [[3]], [0.0, 0.0])]
    report(sides, w)
    text = capsys.readouterr().out
    assert "| vLLM CPU | 1 | 4.0 | 1 | 2.0 | 0.0, 100.0 |" in text
    assert "| engine | 2 | 3.0 | 0 | nan | 0.0, 0.0 |" in text


def test_llamacpp_report_gives_ms_per_token_and_ratios(capsys) -> None:
    run = lambda wall, quiet: {"wall_s": wall, "token_ids": [[1] * 11], "first_token_s": [0.1],  # noqa: E731
                               "decode_s": [wall - 0.1], "quiet": quiet}
    runs = {("llama.cpp", "batch 1"): [run(1.1, True), run(2.1, False)],
            ("engine", "batch 1"): [run(2.1, True), run(4.1, False)]}
    out = llamacpp_report(runs, {"batch 1": {}}, ["llama.cpp", "engine"])
    text = capsys.readouterr().out
    assert "| llama.cpp | 150.0 / 100.0 | 6.7 | 100 | 1 / 2 |" in text
    assert out["engine"]["decode_ms"] == 300.0 and "batch-1 decode 2.00x llama.cpp's ms/token" in text


def test_thread_scaling_prints_a_row_per_thread_count(capsys) -> None:
    from benchmarks import thread_scaling

    rows = thread_scaling.main(["--model", "tiny-llama", "--num-requests", "3", "--input-len", "4:8", "--output-len",
                                "3:4", "--dtypes", "float32", "--threads", "1,2", "--rounds", "2"])
    text = capsys.readouterr().out
    assert set(rows) == {("float32", 1), ("float32", 2)} and "| float32 | 1 |" in text and "1.00x |" in text


FAKE_LLAMA_CPP = '''
__version__ = "0.0-test"
from llama_cpp import llama_cpp as bindings
class Llama:
    def __init__(self, model_path, **kw):
        if not bindings.llama_model_default_params().use_extra_bufts:
            raise SystemExit(7)  # the driver asked for no extra buffer types: the test reads this status
        self.resets = 0
    def reset(self):
        self.resets += 1
    def generate(self, tokens, **kw):
        assert kw["top_k"] == 1 and kw["temp"] == 0.0
        t = tokens[-1]
        while True:
            t = (t * 7 + 1) % 50
            yield t
'''


FAKE_BINDINGS = '''
class Params:
    use_extra_bufts = True
def llama_model_default_params():
    return Params()
'''


def test_llamacpp_driver_protocol_with_a_stand_in_llama_cpp(tmp_path) -> None:
    import os

    from benchmarks.vs_llamacpp import DRIVER
    from benchmarks.vs_vllm import VllmProcess

    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (tmp_path / "llama_cpp" / "llama_cpp.py").write_text(FAKE_BINDINGS)
    spec = {"gguf": "x.gguf", "threads": 1, "n_ctx": 64, "warm_up_prompts": [[1]],
            "workloads": {"batch 1": {"prompts": [[3, 4]], "output_lens": [3]},
                          "batch 2": {"prompts": [[5], [6]], "output_lens": [2, 1]}}}
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = VllmProcess(sys.executable, spec, env, driver=DRIVER)
    try:
        one = proc.run_reply("run batch 1")
        assert one["token_ids"] == [[29, 4, 29]] and len(one["decode_s"]) == 1 and one["wall_s"] > 0
        assert proc.run_reply("run batch 2")["token_ids"] == [[36, 3], [43]]
    finally:
        proc.close()
    # without extra buffer types (the fallback after a crash in llama.cpp's AMX path) Llama sees the flag off
    with pytest.raises(RuntimeError, match="exited with status 7"):
        VllmProcess(sys.executable, dict(spec, extra_buffer_types=False), env, driver=DRIVER)


def test_cpu_attention_bench_prints_both_ops_and_refuses_a_wrong_kernel(monkeypatch, capsys) -> None:
    from benchmarks import cpu_attention
    from kernels import cpu
    monkeypatch.setattr(cpu_attention, "DECODE", ((3, 40),))
    monkeypatch.setattr(cpu_attention, "PREFILL", ((2, 20),))
    monkeypatch.setattr(cpu_attention, "CACHE_MB", 1)
    cpu_attention.main(["--repeats", "1", "--shapes", "smollm2", "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert len(rows) == 4 and "| decode | smollm2 | bfloat16 | 3 x 40 |" in "\n".join(rows)
    monkeypatch.setattr(cpu, "paged_attention", lambda q, *a: q.clone())  # a kernel that returns its query
    with pytest.raises(AssertionError, match="prefill: the C kernel is"):
        cpu_attention.main(["--repeats", "1", "--shapes", "smollm2", "--threads", "1"])


def test_skinny_gemm_bench_prints_every_row_count_and_refuses_a_wrong_kernel(monkeypatch, capsys) -> None:
    from benchmarks import skinny_gemm as bench
    monkeypatch.setattr(bench, "LM_HEAD", (64, 576))
    bench.main(["--repeats", "1", "--rows", "1,3", "--layers", "1", "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| float32", "| bfloat16"))]
    assert sum(line.startswith("| float32 |") for line in rows) == 2 and "| float32 | 3 |" in "\n".join(rows)
    monkeypatch.setattr(bench, "skinny_gemm", lambda x, w: x @ w[:, :x.shape[1]].T * 2)  # twice the product
    with pytest.raises(AssertionError, match="skinny_gemm is"):
        bench.main(["--repeats", "1", "--rows", "1", "--layers", "1", "--threads", "1"])
