"""The CPU offload tier behind the OpenAI server: a returning session streamed through a real socket by the real
`openai` client gets the tokens the engine gives without the tier, and its blocks come back from the tier (the
offload counters on /metrics move). Its TTFT over HTTP: `make bench-kv-offload BENCH_ARGS=--server`."""
from __future__ import annotations

import pytest

from server_helpers import Server
from engine_core import LLMEngine, SamplingParams

pytestmark = pytest.mark.timeout(180)
A = list(range(1, 31))  # 30 tokens: 7 full blocks of 4
B = list(range(200, 230))
ARGS = ["--enable-prefix-caching", "--block-size", "4", "--num-gpu-blocks", "12"]  # B's blocks push A's out


def _offline() -> tuple[list[int], str]:
    """A's first 4 tokens and the returning session's text, from the engine without the tier."""
    e = LLMEngine.from_kwargs("tiny-llama", device="cpu", enable_prefix_caching=True, block_size=4, num_gpu_blocks=12)
    try:
        outs = {}
        for rid, prompt, n in (("a1", A, 4), ("b1", B, 4), ("a2", None, 8)):
            prompt = prompt or A + outs["a1"].token_ids + [77, 78, 79, 80, 81]
            e.add_request(rid, {"prompt_token_ids": prompt},
                          SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            while e.has_unfinished_requests():
                outs.update((o.request_id, o.outputs[0]) for o in e.step() if o.finished)
        return list(outs["a1"].token_ids), outs["a2"].text
    finally:
        e.shutdown()


def test_returning_session_streams_the_same_tokens_with_the_tier_on():
    first, again = _offline()
    srv = Server("tiny-llama", *ARGS, "--kv-offload-bytes", str(1 << 20))
    try:
        def complete(prompt: list[int], n: int) -> list[int]:
            out = srv.client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0.0,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
            return out.choices[0].token_ids

        assert complete(A, 4) == first
        complete(B, 4)
        before = srv.metrics()
        stream = srv.client.completions.create(model="m", prompt=A + first + [77, 78, 79, 80, 81], max_tokens=8,
                                               temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in stream if c.choices)
        after = srv.metrics()
        assert text == again != ""
        # counters: prometheus_client's parser names their samples `_total`
        assert before["inference_labs:kv_offload_saved_blocks_total"] >= 16  # A's 8 full blocks and B's 8
        moved = {k: after[f"inference_labs:kv_offload_{k}_total"] - before[f"inference_labs:kv_offload_{k}_total"]
                 for k in ("hit_blocks", "loaded_blocks", "failed_loads")}
        assert moved == {"hit_blocks": 5, "loaded_blocks": 5, "failed_loads": 0}  # as in the engine's own test
    finally:
        srv.stop()
