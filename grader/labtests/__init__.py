"""Official tests, one module per lab (`labNN_name.py`), and planted bugs (`labNN_name_bugs.py`).

They live here, inside the grader package, so grading never runs a copy found next to a
submission. docs/authoring_labs.md describes how a test module looks.
"""
