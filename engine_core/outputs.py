"""What the model runner hands back each step (vLLM v1's `ModelRunnerOutput`, `vllm/v1/outputs.py`).

A leaf module: the scheduler reads it in `update_from_output` without importing the worker, so with
workers in other processes the same object is what the sampling rank sends back.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    """One step's result: a token for every request whose chunk emits, or why its step failed."""

    sampled: dict[str, int] = field(default_factory=dict)  # request id -> sampled token
    failed: dict[str, str] = field(default_factory=dict)  # request id -> what failed, naming the request
