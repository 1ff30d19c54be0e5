"""Grades a learner's notebook code by plugging it into the reference engine.

`check` is what notebook test cells call; `load_notebook` builds a module from a notebook's
graded cells; `python -m grader batch` grades a folder of submissions.
"""
from grader.check import CheckFailed, check
from grader.loader import StudentCodeError, load_notebook

__all__ = ["CheckFailed", "StudentCodeError", "check", "load_notebook"]
