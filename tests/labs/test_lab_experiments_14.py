"""Lab 14's slow engine and its speedup target hold on a loaded machine.

The slow engine serves the reference engine's tokens, with every slow variant together and each alone (so a
learner's fix changes speed, never tokens). Under a busy-looping process on every core, the official speedup
test passes the solution and fails a partial fix that leaves the per-token KV write in place: the target is a
ratio measured in one process with alternating runs, so load moves both sides of it."""
from __future__ import annotations

from pathlib import Path

import pytest
from cpu_hog import cpu_hog

from grader.labtests import lab14_find_the_bottleneck as lab14
from grader.loader import load_notebook
from grader.slow_engine import SLOW, slow_engine

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / lab14.LAB / f"{lab14.LAB}.ipynb"
WORKLOAD = dict(num=10, prompt_len=7, max_tokens=6)
ARGS = dict(max_num_batched_tokens=24, num_gpu_blocks=64)  # chunked prefill beside decodes


def test_the_slow_engine_serves_the_reference_tokens():
    workload = lab14._workload(**WORKLOAD)
    reference = lab14._run(workload, **ARGS)
    runs = {}
    for name in [None, *SLOW]:
        with slow_engine(keep=[k for k in SLOW if k != name] if name else ()):
            runs[name or "all"] = lab14._run(workload, **ARGS)
    assert {name: tokens == reference for name, tokens in runs.items()} == {name: True for name in runs}


def test_slow_engine_rejects_unknown_seams():
    with pytest.raises(ValueError, match="keep"):
        with slow_engine(keep=["write_kv", "forward"]):
            pass


def _speedup_passes(student) -> bool | str:
    """True, or the message of the target the run missed."""
    try:
        lab14.test_engine_speedup_over_the_slow_engine(student)
    except AssertionError as exc:
        return str(exc).splitlines()[0]
    return True


def test_speedup_target_under_a_cpu_hog():
    solution = load_notebook(SOLUTION)
    partial = load_notebook(SOLUTION, edits=[(
        "    self.ops.reshape_and_cache(key, value, kv.key_cache, kv.value_cache, self.meta.slot_mapping,\n",
        "    from grader.slow_engine import variants\n    return variants.write_kv(self, key, value, kv)\n"
        "    self.ops.reshape_and_cache(key, value, kv.key_cache, kv.value_cache, self.meta.slot_mapping,\n")])
    with cpu_hog():
        solution_passes, partial_passes = _speedup_passes(solution), _speedup_passes(partial)
    assert solution_passes is True, f"the solution misses the speedup target under a CPU hog: {solution_passes}"
    assert partial_passes is not True, "a fix that leaves the per-token KV write in place meets the speedup target"
