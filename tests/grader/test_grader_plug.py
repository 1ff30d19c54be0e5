"""`plug` (grader/plug.py): the learner's functions in, counted, the engine's own tripwired, all restored."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from grader.delegation import DelegationError, scan_source
from grader.harness import BlockPool, build_pool
from grader.loader import StudentCodeError, module_from_namespace
from grader.plug import PLUG_LOG, plug
from grader.seams import BLOCK_POOL, resolve, seams_of

LAB = "02_paged_kv_blocks"
ORIGINAL_GET = BlockPool.get_new_blocks  # captured at import, as a delegating notebook would


def own_get_new_blocks(self, num_blocks):
    return [self.free_queue.popitem(last=False)[1] for _ in range(num_blocks)]


def student(**functions):
    base = {"get_new_blocks": own_get_new_blocks, "free_blocks": lambda self, blocks: None,
            "allocate_slots": lambda self, request, n, hits=None: []}
    return SimpleNamespace(**{**base, **functions})


def test_plugged_functions_are_called_counted_and_restored():
    before = {s.attr: vars(resolve(s.owner))[s.attr] for s in seams_of(LAB)}
    with plug(student(), LAB) as plugged:
        pool = build_pool(3)
        assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]
        assert plugged.calls == {"get_new_blocks": 1, "free_blocks": 0, "allocate_slots": 0}
        assert plugged.uncalled() == ["allocate_slots", "free_blocks"]
    assert {s.attr: vars(resolve(s.owner))[s.attr] for s in seams_of(LAB)} == before
    assert PLUG_LOG[-1].calls["get_new_blocks"] == 1
    assert [b.block_id for b in build_pool(3).get_new_blocks(1)] == [0], "the engine's own works again"


def test_a_captured_original_trips_even_when_the_learner_swallows_the_error():
    def delegating(self, num_blocks):
        try:
            return ORIGINAL_GET(self, num_blocks)
        except Exception:  # noqa: BLE001 - the trick under test
            return own_get_new_blocks(self, num_blocks)

    with pytest.raises(DelegationError, match="uses the reference implementation: the engine's own "
                                              "BlockPool.get_new_blocks"):
        with plug(student(get_new_blocks=delegating), LAB):
            build_pool(3).get_new_blocks(1)
    assert ORIGINAL_GET is vars(BlockPool)["get_new_blocks"] and build_pool(2).get_new_blocks(1)


def test_calling_the_seam_by_name_from_inside_is_delegation_not_recursion():
    def by_name(self, num_blocks):
        return BlockPool.get_new_blocks(self, num_blocks)

    with pytest.raises(DelegationError, match="calls the engine's BlockPool.get_new_blocks"):
        with plug(student(get_new_blocks=by_name), LAB):
            build_pool(3).get_new_blocks(1)


def test_a_seam_left_out_of_only_raises_when_reached():
    with pytest.raises(DelegationError), plug(student(), LAB, only=["free_blocks"]):
        build_pool(3).get_new_blocks(1)
    with pytest.raises(ValueError, match="not seams of lab"):
        plug(student(), LAB, only=["nope"])


def test_a_missing_function_changes_nothing():
    learner = module_from_namespace({"free_blocks": lambda self, blocks: None})
    with pytest.raises(StudentCodeError, match="get_new_blocks"):
        with plug(learner, LAB):
            pass
    assert vars(BlockPool)["get_new_blocks"] is ORIGINAL_GET and ORIGINAL_GET.__code__.co_name == "get_new_blocks"


def test_suspended_lets_only_the_test_run_the_reference():
    guard = plug(student(), LAB)
    with guard:
        with guard.suspended():
            assert [b.block_id for b in ORIGINAL_GET(build_pool(2), 1)] == [0]
    with pytest.raises(DelegationError), guard:
        ORIGINAL_GET(build_pool(2), 1)


def test_graded_cells_that_load_code_are_flagged():
    findings = scan_source({"cell 3 of lab.ipynb": "import inspect\nsrc = inspect.getsource(f)\nexec(src)\n",
                            "cell 4 of lab.ipynb": "x = open('engine_core/core/block_pool.py').read()\n",
                            "cell 5 of lab.ipynb": "def f(n):\n    return n + 1\n"})
    assert findings == ["cell 3 of lab.ipynb, line 1: `import inspect`", "cell 3 of lab.ipynb, line 2: `.getsource`",
                        "cell 3 of lab.ipynb, line 3: `exec`", "cell 4 of lab.ipynb, line 1: `open`"]
    learner = module_from_namespace({"get_new_blocks": own_get_new_blocks})
    learner.__sources__ = {"cell 7 of lab.ipynb": "import inspect\n"}
    with pytest.raises(DelegationError, match="read, load or rebuild code .cell 7 of lab.ipynb, line 1"):
        with plug(learner, LAB):
            pass


def test_owners_are_dotted_strings():
    assert resolve(BLOCK_POOL) is BlockPool


def test_plugging_an_attention_plan_seam_switches_the_fused_decode_block_off():
    """The engine's fused decode block runs in place of write_kv and attend: while a grader plugs either (a
    learner's function, or lab 14's slow variant) it is off, so the plugged function is what runs; a plug of
    any other seam leaves it on; leaving the block restores it."""
    from engine_core.models.attention import AttentionPlan
    from grader.slow_engine import slow_engine

    assert AttentionPlan.fused_decode_block
    with plug(SimpleNamespace(write_kv=lambda self, key, value, kv: None), "14_find_the_bottleneck",
              only=["write_kv"]):
        assert not AttentionPlan.fused_decode_block
    assert AttentionPlan.fused_decode_block
    with plug(student(), LAB):
        assert AttentionPlan.fused_decode_block
    with slow_engine():
        assert not AttentionPlan.fused_decode_block
    with slow_engine(keep=("write_kv", "attend")):  # only the other slowdowns: the engine's block may run
        assert AttentionPlan.fused_decode_block
    assert AttentionPlan.fused_decode_block
