"""What the model runner hands back each step (vLLM v1's `ModelRunnerOutput`, `vllm/v1/outputs.py`).

A leaf module: the scheduler reads it in `update_from_output` without importing the worker, so with
workers in other processes the same object is what the sampling rank sends back.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    """One step's result: the tokens of every request whose chunk emits, or why its step failed."""

    # request id -> its emitted tokens: one, or with draft tokens the accepted drafts and the target's token
    # after them (1 to k + 1)
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> what failed, naming the request
    # kv_eviction "h2o": request id -> the attention each block of its runner row (its resident blocks, oldest
    # first) received this step, summed over layers, heads and query rows
    block_scores: dict[str, list[float]] = field(default_factory=dict)
