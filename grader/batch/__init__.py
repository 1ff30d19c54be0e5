"""Batch grading of a class's untrusted submissions (`python -m grader batch`): `grade` runs each
submission's `child` process in its `sandbox` against the grading `kit`, `compare`s its observation
log with the solution's, checks the kit's `integrity` and writes the `report`. Imports nothing, so
the child started inside a sandbox loads only what it uses."""
