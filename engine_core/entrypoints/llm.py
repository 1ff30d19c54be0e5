"""The offline facade: `LLM(model=..., **engine args).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from engine_core.engine import LLMEngine
from engine_core.lora.request import LoRARequest
from engine_core.request import RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    """`model` is a checkpoint folder or a preset name (engine_core.presets); keyword arguments are
    EngineConfig fields (vLLM's names)."""

    def __init__(self, model: str = "tiny-llama", **engine_args: Any) -> None:
        self.engine = LLMEngine.from_kwargs(model, **engine_args)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. Prompts are strings or token-id lists (mixed
        is fine); one SamplingParams for all, or one per prompt; likewise one LoRARequest (or None: the
        base model) for all, or one per prompt. Every prompt is validated before any is queued: a
        ValueError leaves the engine as it was."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, sp, lora in zip(ids, prompts, params, loras):
                self.engine.add_request(rid, prompt, sp, lora_request=lora)
                added.append(rid)
        except ValueError as e:
            for rid in added:
                self.engine.abort_request(rid)
            raise ValueError(f"prompt {len(added)}: {e}") from e
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        start, num_tokens = time.perf_counter(), 0
        while pending:
            for out in self.engine.step():
                if out.request_id in pending:
                    num_tokens += 1  # each step's output is one new token for its request
                    if out.finished:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        bar.update(1)
            rate = num_tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        bar.close()
        return [done[rid] for rid in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt of token ids
        return [prompts]
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per prompt), "
                         f"got {len(params)}")
    return params


def _as_lora_list(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"lora_request must be one LoRARequest, None, or a list of {n} (one per prompt), "
                         f"got {len(lora)}")
    return lora
