"""Grades a learner's notebook code by plugging it into the reference engine.

`check` is what notebook test cells call; `load_notebook` builds a module from a notebook's
graded cells; `python -m grader batch` grades a folder of submissions. Official tests plug the
learner's functions in with `grader.plug.plug` (seams in grader/seams.py) and check them with
`grader.observe.expect_*`.
"""
from grader.check import CheckFailed, check
from grader.loader import StudentCodeError, load_notebook

__all__ = ["CheckFailed", "StudentCodeError", "check", "load_notebook"]
