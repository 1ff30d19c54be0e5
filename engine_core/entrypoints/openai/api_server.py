"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions, /v1/models, plus vLLM's
/health, /tokenize and /metrics, over one AsyncLLM.

Every client error is OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`)
naming the parameter, raised before the engine holds anything of the request; a full waiting
queue is a 503 (retry later). A streamed answer is SSE (`data: {json}`, then `data: [DONE]`);
the response starts once the engine has accepted every choice, so a refusal still gets its
status code. A client that goes away (the stream closed, or the connection of a plain request)
cancels its choices, which aborts their engine requests and frees their blocks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from engine_core.engine import LLMEngine
from engine_core.entrypoints.async_llm import AsyncLLM, QueueFullError
from engine_core.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionStreamChoice,
    ChatCompletionStreamResponse, ChatMessage, CompletionRequest, CompletionResponse, CompletionResponseChoice,
    DeltaMessage, ErrorInfo, ErrorResponse, ModelCard, ModelList, ResponseMessage, SamplingRequest, TokenizeRequest,
    UsageInfo)
from engine_core.entrypoints.openai.serving import (
    ChoiceEvent, Merged, OpenAIError, TextTracker, Timings, build_sampling_params, choice_seed, param_of,
    run_choice, stop_strings)
from engine_core.exceptions import EngineDeadError
from engine_core.lora.request import LoRARequest

E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """What the server sees (vLLM's names for the metrics its engine does not export itself)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no `_created` series (vLLM turns them off too)
        self.registry = CollectorRegistry()
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "arrival to the last token of a choice",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "choices finished, by finish_reason",
                               ["finished_reason"], registry=self.registry)

    def finished(self, timings: Timings, finish_reason: str | None) -> None:
        self.e2e.observe(time.monotonic() - timings.start)
        self.success.labels(finish_reason or "abort").inc()

    def aborted(self, timings: list["Timings"], ended: dict[int, Any]) -> None:
        """The choices that did not end (the client left, or one failed): counted as aborts."""
        for index, timing in enumerate(timings):
            if index not in ended:
                self.finished(timing, None)


class ChatTemplate:
    """The chat template: `--chat-template` if given, else the tokenizer's; a model without one
    answers chat requests with a 400 saying how to give one."""

    def __init__(self, tokenizer: Any, template: str | None) -> None:
        self.tokenizer = tokenizer
        self.template = template or getattr(tokenizer, "chat_template", None)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool,
               kwargs: dict[str, Any] | None) -> str:
        if self.tokenizer is None or not self.template:
            raise OpenAIError("this model has no chat template: start the server with --chat-template FILE "
                              "(a Jinja template), or use /v1/completions", "messages")
        if not messages:
            raise OpenAIError("messages must hold at least one message", "messages")
        try:
            return self.tokenizer.apply_chat_template([_message_dict(m) for m in messages], chat_template=self.template,
                                                      add_generation_prompt=add_generation_prompt, tokenize=False,
                                                      **(kwargs or {}))
        except OpenAIError:
            raise
        except Exception as e:  # a template that raises (raise_exception) or cannot render these messages
            raise OpenAIError(f"messages could not be rendered by the chat template: {type(e).__name__}: {e}",
                              "messages") from None


def _message_dict(message: ChatMessage) -> dict[str, str]:
    content = message.content
    if isinstance(content, list):  # OpenAI's content parts: only text is served here
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
            raise OpenAIError("messages: only text content parts ({'type': 'text', 'text': ...}) are supported",
                              "messages")
        content = "".join(part["text"] for part in content)
    return {"role": message.role, "content": content or ""}


def build_app(llm: AsyncLLM, served_model_name: str, chat_template: str | None = None,
              lora_modules: dict[str, LoRARequest] | None = None) -> FastAPI:
    """The app; `lora_modules` (vLLM's `--lora-modules`): adapter names a request's `model` may give instead of
    the base model's, each served as its LoRARequest (the engine needs enable_lora)."""
    adapters = dict(lora_modules or {})
    app = FastAPI(title="inference-labs OpenAI-compatible server")
    metrics = ServerMetrics()
    template = ChatTemplate(llm.tokenizer, chat_template)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:  # in flight when a worker died
        return _error(OpenAIError(str(e), None, 503, "ServiceUnavailableError"))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:  # a fault of ours: still OpenAI's JSON
        return _error(OpenAIError(f"{type(e).__name__}: {e}", None, 500, "InternalServerError"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = next((p for p in loc if not p.isdigit()), None)
        return _error(OpenAIError(f"{'.'.join(loc) or 'body'}: {first.get('msg')}", param))

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name and model not in adapters:
            raise OpenAIError(f"The model `{model}` does not exist (this server serves "
                              f"{', '.join(f'`{m}`' for m in [served_model_name, *adapters])})", "model", 404,
                              "NotFoundError")

    def tokenize(text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if llm.tokenizer is None:
            raise OpenAIError(f"{param} is text but the model has no tokenizer: pass token ids", param)
        try:
            return list(llm.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as e:
            raise OpenAIError(f"{param} cannot be tokenized: {type(e).__name__}: {e}", param) from None

    def prompt_list(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [tokenize(prompt, "prompt")]
        if not prompt:
            raise OpenAIError("prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [tokenize(p, "prompt") if isinstance(p, str) else list(p) for p in prompt]

    def max_tokens_for(asked: int | None, prompts: list[list[int]], default: int | None, prompt_param: str) -> int:
        longest = max(len(p) for p in prompts)
        room = llm.max_model_len - longest
        if room < 1:
            raise OpenAIError(f"{prompt_param} has {longest} tokens; with the first generated token it must fit "
                              f"max_model_len={llm.max_model_len}", prompt_param)
        if asked is None:
            return max(1, room if default is None else min(default, room))
        if isinstance(asked, int) and asked >= 1 and longest + asked > llm.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {llm.max_model_len} tokens. However, you "
                              f"requested {longest + asked} tokens ({longest} in the prompt, {asked} in the "
                              f"completion). Please reduce the prompt or max_tokens.", "max_tokens")
        return asked

    async def start(req: SamplingRequest, prompts: list[list[int]], max_tokens: int, prefix: str,
                    prompt_param: str) -> tuple[Merged, list[Timings]]:
        """Every choice's engine request added; OpenAIError (400/503) if the engine refused one."""
        params = build_sampling_params(req, max_tokens)
        stops = stop_strings(req.stop)
        loop = asyncio.get_running_loop()
        streams, firsts, timings = [], [], []
        base = f"{prefix}-{uuid.uuid4().hex}"
        for p, prompt in enumerate(prompts):
            for i in range(req.n):
                index = p * req.n + i
                first = loop.create_future()
                timing = Timings()
                choice_params = params if req.seed is None else _with_seed(params, choice_seed(req.seed, i))
                streams.append(run_choice(llm, f"{base}-{index}", prompt, choice_params, req.priority,
                                          TextTracker(llm.tokenizer, stops), index, first, adapters.get(req.model)))
                firsts.append(first)
                timings.append(timing)
        merged = Merged(streams)
        try:
            results = await asyncio.gather(*firsts, return_exceptions=True)
        except BaseException:  # cancelled while waiting
            await merged.aclose()
            raise
        refused = next((r for r in results if isinstance(r, BaseException)), None)
        if refused is not None:
            await merged.aclose()
            raise _as_openai_error(refused, prompt_param) from None
        return merged, timings

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=served_model_name, root=served_model_name, max_model_len=llm.max_model_len)]
        cards += [ModelCard(id=name, root=lora.lora_path, max_model_len=llm.max_model_len)
                  for name, lora in adapters.items()]
        return ModelList(data=cards)

    @app.post("/tokenize")
    async def tokenize_endpoint(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            tokens = tokenize(template.render(req.messages, req.add_generation_prompt, None), "messages", False)
        else:
            tokens = tokenize(req.prompt, "prompt", req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        engine_text = await asyncio.wrap_future(llm.run_in_engine(LLMEngine.prometheus_metrics))
        body = engine_text + generate_latest(metrics.registry).decode()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        if req.echo or req.suffix is not None:
            raise OpenAIError("echo and suffix are not supported by this server", "echo" if req.echo else "suffix")
        prompts = prompt_list(req.prompt)
        merged, timings = await start(req, prompts, max_tokens_for(req.max_tokens, prompts, 16, "prompt"), "cmpl", "prompt")
        num_prompt = sum(map(len, prompts))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(event: ChoiceEvent) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=served_model_name, choices=[
                CompletionResponseChoice(index=event.index, text=event.delta, finish_reason=event.finish_reason,
                                         stop_reason=event.stop_reason)])

        if req.stream:
            return _sse(merged, chunk, lambda u: CompletionResponse(id=rid, created=created, model=served_model_name,
                                                                   choices=[], usage=u),
                        num_prompt, req, timings, metrics, first=None)
        finals = await _until_disconnected(raw, _collect(merged, timings, metrics))
        choices = [CompletionResponseChoice(index=i, text=text, finish_reason=fr, stop_reason=sr,
                                            token_ids=ids if req.return_token_ids else None)
                   for i, (text, fr, sr, _, ids) in sorted(finals.items())]
        return JSONResponse(CompletionResponse(id=rid, created=created, model=served_model_name, choices=choices,
                                               usage=_usage(num_prompt, finals)).model_dump())

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        text = template.render(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        prompts = [tokenize(text, "messages", add_special_tokens=False)]
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        merged, timings = await start(req, prompts, max_tokens_for(asked, prompts, None, "messages"), "chatcmpl", "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(event: ChoiceEvent) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=rid, created=created, model=served_model_name, choices=[
                ChatCompletionStreamChoice(index=event.index, delta=DeltaMessage(content=event.delta),
                                           finish_reason=event.finish_reason, stop_reason=event.stop_reason)])

        if req.stream:
            role_chunks = [ChatCompletionStreamResponse(id=rid, created=created, model=served_model_name, choices=[
                ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(req.n)]
            return _sse(merged, chunk, lambda u: ChatCompletionStreamResponse(
                id=rid, created=created, model=served_model_name, choices=[], usage=u),
                len(prompts[0]), req, timings, metrics, first=role_chunks)
        finals = await _until_disconnected(raw, _collect(merged, timings, metrics))
        choices = [ChatCompletionResponseChoice(index=i, message=ResponseMessage(content=text), finish_reason=fr,
                                                stop_reason=sr) for i, (text, fr, sr, _, _) in sorted(finals.items())]
        return JSONResponse(ChatCompletionResponse(id=rid, created=created, model=served_model_name, choices=choices,
                                                   usage=_usage(len(prompts[0]), finals)).model_dump())

    return app


def _with_seed(params: Any, seed: int | None) -> Any:
    return dataclasses.replace(params, seed=seed)


def _error(e: OpenAIError) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=e.message, type=e.type, param=e.param, code=e.status))
    return JSONResponse(body.model_dump(), status_code=e.status)


def _as_openai_error(e: BaseException, prompt_param: str) -> BaseException:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, QueueFullError):
        return OpenAIError(str(e), None, 503, "ServiceUnavailableError")
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), None, 503, "ServiceUnavailableError")
    if isinstance(e, ValueError):  # add_request's checks: the prompt's length and ids, or a sampling field
        return OpenAIError(str(e), param_of(str(e), ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                                     "stop_token_ids", "priority"), prompt_param))
    return e


async def _collect(merged: Merged, timings: list[Timings], metrics: ServerMetrics) -> dict[int, tuple]:
    """index -> (text, finish_reason, stop_reason, completion tokens, token ids) once every choice has ended."""
    texts: dict[int, list[str]] = {}
    ends: dict[int, ChoiceEvent] = {}
    try:
        async for event in merged:
            texts.setdefault(event.index, []).append(event.delta)
            if event.finish_reason is not None:
                ends[event.index] = event
                metrics.finished(timings[event.index], event.finish_reason)
    finally:
        metrics.aborted(timings, ends)
    return {i: ("".join(texts[i]), e.finish_reason, e.stop_reason, e.num_tokens, e.token_ids) for i, e in ends.items()}


def _usage(num_prompt: int, finals: dict[int, tuple]) -> UsageInfo:
    completion = sum(f[3] for f in finals.values())
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=completion, total_tokens=num_prompt + completion)


async def _until_disconnected(raw: Request, coro: Any, poll_s: float = 0.1) -> Any:
    """Run `coro`; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()


def _sse(merged: Merged, chunk: Callable[[ChoiceEvent], Any], usage_chunk: Callable[[UsageInfo], Any],
         num_prompt: int, req: SamplingRequest, timings: list[Timings], metrics: ServerMetrics,
         first: list[Any] | None) -> StreamingResponse:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        completion_tokens: dict[int, int] = {}
        ends: dict[int, ChoiceEvent] = {}
        try:
            for c in first or []:
                yield f"data: {c.model_dump_json()}\n\n"
            async for event in merged:
                completion_tokens[event.index] = event.num_tokens
                if event.finish_reason is not None:
                    ends[event.index] = event
                    metrics.finished(timings[event.index], event.finish_reason)
                if event.delta or event.finish_reason is not None:
                    yield f"data: {chunk(event).model_dump_json()}\n\n"
            if include_usage:
                total = sum(completion_tokens.values())
                usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total)
                yield f"data: {usage_chunk(usage).model_dump_json()}\n\n"
        except Exception as e:  # mid-stream: the status is sent already; the error goes in an event
            error = ErrorResponse(error=ErrorInfo(message=f"{type(e).__name__}: {e}", type="InternalServerError",
                                                  code=500))
            yield f"data: {json.dumps(error.model_dump())}\n\n"
        finally:
            metrics.aborted(timings, ends)
            await merged.aclose()  # the client went away (CancelledError here) or we are done
        yield "data: [DONE]\n\n"

    return _ClosingStreamingResponse(events(), merged, media_type="text/event-stream")


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the choices however the response ends: also when the client left before the body's
    first chunk was asked for (then the generator above never starts and its `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], merged: Merged, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._merged = merged

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._merged.aclose())  # goes on even if this task is being cancelled
