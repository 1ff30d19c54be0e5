"""benchmarks.serve's chat workload: request bodies to /v1/chat/completions whose system prompts
repeat (a shared prefix), deterministic given the seed, and a streamed chat timed like a completion."""
from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from benchmarks.serve import chunk_text, request_body, send
from benchmarks.serve_chat import SYSTEM_PROMPTS, chat_workload

pytestmark = pytest.mark.timeout(30)


def test_chat_bodies_share_a_few_system_prompts_and_vary_the_question():
    conversations, lens = chat_workload(60, 3, (4, 9), seed=5)
    bodies = [request_body("m", c, n) for c, n in zip(conversations, lens)]
    assert {path for path, _ in bodies} == {"/v1/chat/completions"}
    systems = [b["messages"][0] for _, b in bodies]
    assert all(m["role"] == "system" for m in systems)
    assert {m["content"] for m in systems} == set(SYSTEM_PROMPTS[:3])  # 60 draws of 3 hit each one
    users = [b["messages"][1] for _, b in bodies]
    assert all(m["role"] == "user" and m["content"] for m in users)
    assert len({m["content"] for m in users}) > 20  # varied questions, not one repeated
    body = bodies[0][1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert body["max_tokens"] == lens[0] and all(4 <= n <= 9 for n in lens) and "prompt" not in body


def test_chat_workload_is_deterministic_given_the_seed():
    assert chat_workload(20, 4, (2, 8), seed=1) == chat_workload(20, 4, (2, 8), seed=1)
    assert chat_workload(20, 4, (2, 8), seed=1) != chat_workload(20, 4, (2, 8), seed=2)
    for bad in (0, len(SYSTEM_PROMPTS) + 1):
        with pytest.raises(ValueError, match="--system-prompts must be in"):
            chat_workload(4, bad, (2, 8), seed=0)


def test_token_id_prompts_still_go_to_completions():
    path, body = request_body("m", [5, 6, 7], 3)
    assert path == "/v1/completions" and body["prompt"] == [5, 6, 7] and "messages" not in body


def _chat_stream(request: httpx2.Request) -> httpx2.Response:
    assert request.url.path == "/v1/chat/completions"
    assert json.loads(request.content)["messages"][0]["role"] == "system"
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},  # the role chunk: no text
              {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
              {"choices": [{"index": 0, "delta": {"content": " there"}}]},
              {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 57, "completion_tokens": 3}}]
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx2.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_a_streamed_chat_is_timed_from_its_delta_chunks():
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"text": "a"}]}) == "a" and chunk_text({"choices": []}) == ""

    async def go():
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(_chat_stream)) as client:
            return await send(client, "http://fake", "m", chat_workload(1, 1, (3, 3), seed=0)[0][0], 3)

    result = asyncio.run(go())
    assert result.success, result.error
    assert (result.prompt_len, result.output_len) == (57, 3)  # the server's usage, not the message count
    assert len(result.itl) == 2 and result.ttft > 0 and result.e2e >= result.ttft  # 3 text chunks: 2 gaps
