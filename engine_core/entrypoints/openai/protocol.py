"""The OpenAI API's request and response bodies, with vLLM's field names (vllm/entrypoints/openai/protocol.py).

Requests are checked by pydantic for types; ranges are checked once, by SamplingParams and
add_request, whose ValueError names the parameter. Fields the engine cannot honour (logprobs,
penalties, best_of, echo, suffix, tools) are refused by name rather than silently ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False


class SamplingRequest(OpenAIModel):
    """The fields completions and chat share (vLLM's names, its extras `top_k`, `ignore_eos`,
    `stop_token_ids`, `priority` included)."""

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    # refused unless left at the default: the engine has no such feature
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {"logprobs": None, "top_logprobs": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "logit_bias": None, "best_of": 1}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    return_token_ids: bool = False  # vLLM's extra: each choice's token ids (not streamed)
    suffix: str | None = None


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponseChoice(OpenAIModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's field)


class CompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIModel):
    index: int
    message: ResponseMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "inference-labs"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
