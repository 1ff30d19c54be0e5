"""The grading kit (grader/batch/kit.py): no expected value reaches the learner's process, line numbers stay,
and the lab's seam bodies are gone from the engine."""
from __future__ import annotations

import ast
import textwrap

import pytest

from grader.delegation import DelegationError
from grader.batch.kit import _find_function, comparisons_left, kit_files, kit_tests_source, remove_seam_bodies
from grader import labs
from grader.seams import labs_with_seams, module_of, seams_of

TESTS = textwrap.dedent('''\
    """Tests of a lab: 42 is the answer (the docstring goes)."""
    from grader.observe import expect_equal, expect_raises

    SECRET = 42  # a constant only expected values use


    def spec(n):
        """The specification, only used in expected values."""
        return SECRET + n


    def helper(student):
        return student.f(1)


    def test_f(student):
        """f(1) is 43."""
        got = helper(student)
        assert got == spec(1), f"expected {spec(1)}"
        expect_equal(got,
                     spec(1),
                     f"f(1): {spec(1)}")  # a comment that goes
        expect_raises(ValueError, student.f, -1, match="n", message="f(-1)")
    ''')


def test_expected_values_messages_asserts_and_specs_leave_the_kit():
    kit = kit_tests_source(TESTS)
    assert "42" not in kit and "spec" not in kit and "SECRET" not in kit and "assert" not in kit
    assert "#" not in kit and '"""' not in kit
    assert "expect_equal(got,\n                 ...,\n                 ...)" in kit
    assert "expect_raises(..., student.f, -1, match=..., message=...)" in kit
    assert "def helper(student)" in kit, "helpers the test body still calls stay"
    assert len(kit.splitlines()) == len(TESTS.splitlines())
    for number, (before, after) in enumerate(zip(TESTS.splitlines(), kit.splitlines()), 1):
        if "expect_equal(got," in before or "def test_f" in before or "expect_raises" in before:
            assert before.split("(")[0] == after.split("(")[0], f"line {number} moved"
    ast.parse(kit)


CONVERTED = [lab for lab in labs.available_labs() if not comparisons_left(labs.tests_path(lab).read_text())]


def test_the_first_converted_labs_stay_converted():
    assert set(CONVERTED) == set(labs.available_labs()), "every lab grades by observations"


@pytest.mark.parametrize("lab", CONVERTED)
def test_converted_labs_kit_holds_no_comparison(lab):
    """In a converted lab every graded check is an observation: its kit module compares nothing."""
    source = labs.tests_path(lab).read_text()
    kit = kit_tests_source(source)
    assert "def expected_blocks" not in kit and "def _reference" not in kit, "spec helpers of expected values stay out"


def test_comparisons_left_counts_checks_of_the_learner_not_of_the_test():
    source = textwrap.dedent('''\
        def test_x(student):
            assert setup_ok(), "the workload must preempt (a test bug)"
            assert student.f() == 1, "f()"
            with pytest.raises(ValueError):
                student.f(-1)
        ''')
    assert comparisons_left(source) == ["assert on line 3", "pytest.raises on line 4"]


def test_seam_bodies_are_removed_and_raise_kit_removed():
    source = textwrap.dedent('''\
        class Pool:
            def take(self, n):
                """Docstring stays."""
                x = n + 1
                return x

            def keep(self):
                return 1


        def cdiv(a, b):
            return -(-a // b)
        ''')
    kit = remove_seam_bodies(source, {"Pool.take": "lab 99's seam Pool.take", "cdiv": "lab 98's seam cdiv"})
    namespace: dict = {}
    exec(compile(kit, "engine.py", "exec"), namespace)
    assert namespace["Pool"]().keep() == 1 and '"""Docstring stays."""' in kit and "n + 1" not in kit
    with pytest.raises(RuntimeError, match="removed from the grading kit: lab 98's seam cdiv was reached from"):
        namespace["cdiv"](1, 2)  # reached by grading code alone: a kit error, not delegation
    learner = compile("def learner():\n    return cdiv(1, 2)\n", "cell 3 of lab.ipynb", "exec")
    exec(learner, namespace)
    with pytest.raises(DelegationError, match="uses the reference implementation: lab 98's seam cdiv"):
        namespace["learner"]()


def test_the_kit_of_a_lab_has_only_its_tests_and_no_seam_body():
    files = kit_files("02_paged_kv_blocks")
    labtests = sorted(name for name in files if name.startswith("grader/labtests/"))
    assert labtests == ["grader/labtests/__init__.py", "grader/labtests/lab02_paged_kv_blocks.py"]
    pool = files["engine_core/core/block_pool.py"].decode()
    assert "kit_removed(\"lab 02_paged_kv_blocks's seam BlockPool.get_new_blocks\")" in pool
    assert "popitem(last=False)" not in pool and "def touch" in pool
    assert "kit_removed" not in files["engine_core/core/scheduler.py"].decode()


@pytest.mark.parametrize("lab", labs_with_seams())
def test_every_seam_and_helper_of_a_lab_is_only_a_raise_in_its_kit(lab):
    """In the lab's kit, each seam and each helper declared for it (grader/seams.py) keeps its docstring and
    nothing but `raise kit_removed(...)`: a submission that calls the engine's own code there reaches no
    answer, which batch grading reports as delegation (proven end to end by tests/adversarial for lab 00
    and by tests/grader/test_grader_batch.py). The engine's own copy keeps a real body."""
    files = kit_files(lab)
    for seam in seams_of(lab):
        for dotted in (seam.dotted, *seam.helpers):
            module = module_of(dotted)
            path, qualname = module.replace(".", "/") + ".py", dotted[len(module) + 1:]
            if path not in files:  # a package: its __init__.py
                path = module.replace(".", "/") + "/__init__.py"
            kit_fn = _find_function(ast.parse(files[path].decode()), qualname)
            body = kit_fn.body[1:] if ast.get_docstring(kit_fn) is not None else kit_fn.body
            assert len(body) == 1 and isinstance(body[0], ast.Raise) and "kit_removed" in ast.unparse(body[0]) \
                and f"lab {lab}'s seam {seam.qualname}" in ast.unparse(body[0]), f"{dotted} in {lab}'s kit: {ast.unparse(kit_fn)[:300]}"
            engine_fn = _find_function(ast.parse((labs.REPO_ROOT / path).read_text()), qualname)
            assert "kit_removed" not in ast.unparse(engine_fn), f"{dotted}: the engine's own body is gone"
