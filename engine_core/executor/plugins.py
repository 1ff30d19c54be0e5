"""General plugins: code every worker process runs once, before it loads its shard of the model.

vLLM's `load_general_plugins()` (its `vllm.general_plugins` entry points, filtered by VLLM_PLUGINS):
a spawned worker starts a fresh interpreter, so whatever the engine process patched or registered
(a custom op, a replacement function) is not there. Here the entries are named directly:
ENGINE_CORE_PLUGINS="package.module:function,..." (the environment is inherited by spawned workers
and must be set on every node of a multi-node run). Each function is called with no arguments.
"""
from __future__ import annotations

import importlib
import os

PLUGINS_ENV = "ENGINE_CORE_PLUGINS"


def load_general_plugins() -> list[str]:
    """Import and call each entry of ENGINE_CORE_PLUGINS, in order; returns the entries called. A
    malformed entry is a ValueError naming it (a worker sends it back as its startup error)."""
    entries = [e.strip() for e in os.environ.get(PLUGINS_ENV, "").split(",") if e.strip()]
    for entry in entries:
        module, sep, name = entry.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"{PLUGINS_ENV} entries must be 'package.module:function', got {entry!r}")
        getattr(importlib.import_module(module), name)()
    return entries
