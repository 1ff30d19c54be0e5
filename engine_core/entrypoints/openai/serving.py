"""What the server does with one API request: engine requests for each choice, stop strings, text.

A request becomes one engine request per (prompt, choice) (`n` choices each; with a `seed`,
choice i samples with seed + i). The engine knows stop *tokens*; stop *strings* are found here in
the decoded text: the first match ends the choice (finish_reason "stop", `stop_reason` the
string), its text cut before it, and its engine request is aborted. `completion_tokens` counts
the tokens up to the one that completed the stop, so usage does not depend on how late the
reader saw it. A streamed delta never shows text that may still turn out to be the start of a
stop string, nor a half-decoded UTF-8 character.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine_core.entrypoints.async_llm import AsyncLLM
from engine_core.lora.request import LoRARequest
from engine_core.request import SamplingParams
from engine_core.entrypoints.openai.protocol import SamplingRequest
from engine_core.validation import SEED_RANGE

REPLACEMENT_CHAR = "\ufffd"  # a partial UTF-8 sequence at the end decodes to this
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")


class OpenAIError(Exception):
    """An error the client caused (400, 404) or the server cannot serve now (503), as OpenAI's JSON."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type


def param_of(message: str, known: tuple[str, ...], default: str | None) -> str | None:
    """The parameter a ValueError names: validation messages start with it ("top_p must be ...")."""
    word = message.split(" ", 1)[0]
    return word if word in known else default


def build_sampling_params(req: SamplingRequest, max_tokens: int) -> SamplingParams:
    """SamplingParams from the request, unsupported fields refused by name (OpenAIError 400)."""
    for name, default in req.UNSUPPORTED.items():
        value = getattr(req, name)
        if value not in (None, default, False):
            raise OpenAIError(f"{name} is not supported by this server (got {value!r})", name)
    if req.n < 1:
        raise OpenAIError(f"n must be an int >= 1, got {req.n}", "n")
    kwargs: dict[str, Any] = dict(max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                  temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                                  seed=req.seed, stop_token_ids=list(req.stop_token_ids or []))
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise OpenAIError(str(e), param_of(str(e), SAMPLING_FIELDS, None)) from None


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise OpenAIError("stop strings must be non-empty", "stop")
    return stops


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: distinct choices, each reproducible."""
    if seed is None:
        return None
    lo, hi = SEED_RANGE
    return lo + (seed - lo + index) % (hi - lo + 1)


@dataclass
class ChoiceEvent:
    """One update of one choice: the text since the last event, and how it ended (if it did)."""

    index: int
    delta: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_tokens: int = 0  # completion tokens so far
    token_ids: list[int] | None = None  # on the last event only: the choice's ids, up to the stop if one cut it


@dataclass
class TextTracker:
    """The text of one choice from its cumulative token ids: stop strings, the held-back tail."""

    tokenizer: Any
    stops: list[str]
    sent: str = ""  # text already handed out in deltas

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, token_ids: list[int], finish_reason: str | None, index: int) -> ChoiceEvent:
        text = self.decode(token_ids)
        num_tokens, stop_reason = len(token_ids), None
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, stop = min(hits)
            text, finish_reason, stop_reason = text[:at], "stop", stop
            num_tokens = self._first_prefix_with(token_ids, stop)
        elif finish_reason is None:  # hold back what may still change or start a stop string
            text = text.rstrip(REPLACEMENT_CHAR)
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[:max(len(self.sent), len(text) - hold)]
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        ids = list(token_ids[:num_tokens]) if finish_reason is not None else None
        return ChoiceEvent(index, delta, finish_reason, stop_reason, num_tokens, ids)

    def _first_prefix_with(self, token_ids: list[int], stop: str) -> int:
        """The fewest leading tokens whose text contains `stop` (binary search: containment only grows)."""
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in self.decode(token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo


@dataclass
class Timings:
    """When a choice arrived, for /metrics' end-to-end latency (the engine exports the inter-token latency)."""

    start: float = field(default_factory=time.monotonic)


async def run_choice(llm: AsyncLLM, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     priority: int, tracker: TextTracker, index: int, first: asyncio.Future,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[ChoiceEvent]:
    """One choice's events. `first` is resolved once the engine accepted the request (with its
    ValueError / QueueFullError otherwise), so the caller can answer 400/503 before streaming."""
    try:
        async for out in llm.generate({"prompt_token_ids": prompt_ids}, params, request_id, priority, lora_request):
            if not first.done():
                first.set_result(None)
            completion = out.outputs[0]
            event = tracker.update(completion.token_ids, completion.finish_reason, index)
            if event.finish_reason == "error":
                raise RuntimeError(out.error or f"request {request_id} failed")
            yield event
            if event.finish_reason is not None:
                return  # a stop string: leaving aborts the engine request
    except BaseException as e:
        if not first.done():
            first.set_exception(e)
        raise


class Merged:
    """The events of every choice as they come (vLLM's merge_async_iterators), its tasks started at
    once so the caller can wait for the engine to accept them. The queue holds one event per choice
    at most, so a slow client makes the choices wait on their one-slot mailboxes (which merge)
    instead of piling events up here. `aclose()` (or leaving the iteration) cancels every choice."""

    _DONE = object()

    def __init__(self, streams: list[AsyncIterator[ChoiceEvent]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=max(1, len(streams)))
        self._tasks = [asyncio.create_task(self._pump(s)) for s in streams]

    async def _pump(self, stream: AsyncIterator[ChoiceEvent]) -> None:
        try:
            async for event in stream:
                await self._queue.put(event)
        except Exception as e:  # handed to the reader, which re-raises it
            await self._queue.put(e)
            return
        await self._queue.put(self._DONE)

    async def __aiter__(self) -> AsyncIterator[ChoiceEvent]:
        try:
            remaining = len(self._tasks)
            while remaining:
                item = await self._queue.get()
                if item is self._DONE:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
