"""Starts the labs' selftests (tests/test_labs_meta.py) as soon as collection is done, when any of
their tests is selected: they then run beside the rest of the suite instead of after it."""
from __future__ import annotations

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    meta = next((item for item in session.items if item.nodeid.startswith("tests/test_labs_meta.py")), None)
    if meta is not None:
        meta.module.selftests()
