"""The OpenAI-compatible server, started for real (`python -m engine_core.entrypoints.openai`) on a
free loopback port, driven by the real `openai` client.

Texts are checked against `LLM.generate` greedy on the same tokens (an engine of its own), decoded
with the model's tokenizer; errors must be OpenAI's JSON naming the parameter and leave the server
serving; a client that leaves mid-stream must leave no request running and no KV block in use.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest

from benchmarks.serve import run, summarize, synthetic_workload
from server_helpers import ROOT, TEMPLATE, Server, chat_model
from engine_core import LLM, SamplingParams
from engine_core.presets import preset_path

pytestmark = pytest.mark.timeout(180)
PROMPTS = ["Hello, my name is", "The capital of France", "abc", "0123456789", "def f(x):", "Once upon"]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
# A request that holds the only seat until the test closes its stream: tiny-llama writes 1000 tokens in under a
# second, less than a loaded machine may take to queue the next requests, so the holder's model copy takes 64k
# positions (RoPE has no limit of its own; only the holder goes past 2048) and it asks for 60k tokens.
HOLD_POSITIONS, HOLD_TOKENS = 65536, 60000
HOLD_ARGS = ("--num-gpu-blocks", str(HOLD_POSITIONS // 16 + 64))


def long_context(model: Path, where: Path) -> Path:
    """A copy of `model` whose config allows HOLD_POSITIONS positions."""
    folder = where / f"{model.name}-long"
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": HOLD_POSITIONS}))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return chat_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(str(model_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(str(model_dir), device="cpu", num_gpu_blocks=128)
    tok = llm.engine.tokenizer

    def greedy(prompt: str | list[int], max_tokens: int) -> tuple[str, list[int]]:
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
        out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        return tok.decode(out.token_ids, skip_special_tokens=True), out.token_ids

    greedy.tokenizer = tok
    return greedy


def test_models_health_and_tokenize(server, offline):
    assert [m.id for m in server.client.models.list().data] == ["m"]
    assert httpx2.get(f"{server.url}/health").status_code == 200
    body = httpx2.post(f"{server.url}/tokenize", json={"prompt": "abc"}).json()
    assert body["tokens"] == offline.tokenizer.encode("abc") and body["count"] == 3 and body["max_model_len"] == 2048


def test_completion_matches_offline_greedy(server, offline):
    resp = server.client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, **GREEDY)
    text, ids = offline(PROMPTS[0], 12)
    assert resp.choices[0].text == text and resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(PROMPTS[0]) and resp.usage.completion_tokens == 12 == len(ids)
    assert resp.object == "text_completion" and resp.model == "m"


def test_streaming_with_and_without_usage(server, offline):
    text, _ = offline(PROMPTS[1], 16)
    for include_usage in (False, True):
        chunks = list(server.client.completions.create(
            model="m", prompt=PROMPTS[1], max_tokens=16, stream=True,
            stream_options={"include_usage": include_usage} if include_usage else None, **GREEDY))
        content = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in content) == text
        assert content[-1].choices[0].finish_reason == "length"
        usage = [c.usage for c in chunks if c.usage is not None]
        if include_usage:
            assert not chunks[-1].choices and usage == [chunks[-1].usage]
            assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (len(PROMPTS[1]), 16)
        else:
            assert usage == []


def test_n_choices_and_seeded_sampling(server, offline):
    resp = server.client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=8, n=2, **GREEDY)
    text, _ = offline(PROMPTS[2], 8)
    assert sorted(c.index for c in resp.choices) == [0, 1] and {c.text for c in resp.choices} == {text}
    assert resp.usage.completion_tokens == 16
    seeded = [server.client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=8, n=2, temperature=1.0,
                                               seed=7, extra_body={"ignore_eos": True}) for _ in range(2)]
    texts = [[c.text for c in sorted(r.choices, key=lambda c: c.index)] for r in seeded]
    assert texts[0] == texts[1], "a seed makes every choice reproducible"


def test_return_token_ids_gives_the_greedy_ids_up_to_the_stop(server, offline):
    """vLLM's `return_token_ids`: what benchmarks.serve_vs_vllm compares the two servers by."""
    text, ids = offline(PROMPTS[4], 10)
    asked = dict(model="m", prompt=PROMPTS[4], max_tokens=10, temperature=0.0,
                 extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = server.client.completions.create(**asked).choices[0]
    assert choice.text == text and choice.token_ids == list(ids)
    plain = server.client.completions.create(model="m", prompt=PROMPTS[4], max_tokens=10, **GREEDY).choices[0]
    assert plain.token_ids is None, "only when asked"
    tok = offline.tokenizer
    texts = [tok.decode([i], skip_special_tokens=True) for i in ids]
    stop = next(t for t in texts[1:] if t and "\ufffd" not in t)  # a later token's text: the ids end at it
    first = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n], skip_special_tokens=True))
    cut = server.client.completions.create(**asked, stop=stop).choices[0]
    assert cut.finish_reason == "stop" and cut.token_ids == list(ids[:first])
    server.wait_idle()


def test_stop_strings_cut_the_text_and_count_tokens_up_to_the_stop(server, offline):
    full, ids = offline(PROMPTS[3], 24)
    k = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[k:k + 2]
    want = full[:full.find(stop)]
    tok = offline.tokenizer
    num = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n], skip_special_tokens=True))
    resp = server.client.completions.create(model="m", prompt=PROMPTS[3], max_tokens=24, stop=[stop, "\x00never"],
                                            **GREEDY)
    choice = resp.choices[0]
    assert (choice.text, choice.finish_reason, resp.usage.completion_tokens) == (want, "stop", num)
    streamed = list(server.client.completions.create(model="m", prompt=PROMPTS[3], max_tokens=24, stop=stop,
                                                     stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == want, "a stream never shows the stop string"
    server.wait_idle()


def test_chat_uses_the_template_and_streams(server, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = offline.tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                                     add_generation_prompt=True)
    text, _ = offline(offline.tokenizer.encode(rendered, add_special_tokens=False), 10)
    resp = server.client.chat.completions.create(model="m", messages=messages, max_tokens=10, **GREEDY)
    assert resp.choices[0].message.content == text and resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(rendered)
    chunks = list(server.client.chat.completions.create(model="m", messages=messages, max_tokens=10, stream=True,
                                                        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 10


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=3000), "max_tokens"),
    (dict(prompt="x" * 2100), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[10**6]), "prompt"),
    (dict(n=0), "n"),
    (dict(extra_body={"priority": "high"}), "priority"),
    (dict(extra_body={"priority": 1}), "priority"),  # the server's engine is fcfs: priority must be 0
    (dict(logprobs=2), "logprobs"),
])
def test_bad_input_is_a_400_naming_the_parameter_and_the_server_goes_on(server, offline, kwargs, param):
    args = dict(model="m", prompt="hello", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        server.client.completions.create(**args)
    error = info.value.response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError", error
    assert error["message"]
    text, _ = offline(PROMPTS[4], 4)
    assert server.client.completions.create(model="m", prompt=PROMPTS[4], max_tokens=4, **GREEDY).choices[0].text == text


def test_unknown_model_is_a_404_and_chat_on_a_bad_message_a_400(server):
    with pytest.raises(openai.NotFoundError) as info:
        server.client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    assert info.value.response.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        server.client.chat.completions.create(model="m", messages=[], max_tokens=2)
    assert info.value.response.json()["error"]["param"] == "messages"


def test_concurrent_clients_each_get_their_greedy_text(server, offline):
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            stream = i % 2 == 1
            resp = server.client.completions.create(model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=6 + i,
                                                    stream=stream, **GREEDY)
            results[i] = "".join(c.choices[0].text for c in resp if c.choices) if stream else resp.choices[0].text
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i in range(8):
        assert results[i] == offline(PROMPTS[i % len(PROMPTS)], 6 + i)[0], i
    server.wait_idle()


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    before = server.metrics()
    aborted_before = before.get('vllm:request_success_total{finished_reason=abort}', 0.0)
    stream = server.client.completions.create(model="m", prompt=PROMPTS[5], max_tokens=1500, stream=True, **GREEDY)
    next(iter(stream))
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0
    stream.close()
    m = server.wait_idle()
    assert m['vllm:request_success_total{finished_reason=abort}'] == aborted_before + 1
    generated = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 1000, f"{generated} tokens: the engine request ran on after the client left"


def test_a_client_that_leaves_a_plain_request_frees_its_blocks(server):
    """The client gives up after 0.5 s; the request asked for 1,900 tokens (about 3 s of this engine's
    fastest single-request decode on tiny-llama), so it must end as an abort, well short of them: the
    bound does not depend on how loaded the machine is, the abort count observes the server's decision."""
    before = server.metrics()
    aborted_before = before.get('vllm:request_success_total{finished_reason=abort}', 0.0)
    max_tokens = 1900  # max_model_len 2048 minus the prompt
    with pytest.raises(httpx2.TimeoutException):  # the client gives up and closes the connection
        httpx2.post(f"{server.url}/v1/completions", timeout=httpx2.Timeout(10.0, read=0.5),
                    json=dict(model="m", prompt=PROMPTS[5], max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    m = server.wait_idle()
    assert m['vllm:request_success_total{finished_reason=abort}'] == aborted_before + 1
    generated = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 0 < generated < max_tokens, f"{generated} tokens: the engine request ran on after the client left"


def test_a_priority_server_runs_the_most_important_waiting_request_first(model_dir, offline, tmp_path):
    """--scheduling-policy priority, one seat: while a long stream holds it, a low-priority request
    and then an urgent one queue; when the seat frees, the urgent one (lower value) runs first."""
    srv = Server(str(long_context(model_dir, tmp_path)), "--scheduling-policy", "priority", "--max-num-seqs", "1",
                 *HOLD_ARGS)
    try:
        blocker = srv.client.completions.create(model="m", prompt="a", max_tokens=HOLD_TOKENS, stream=True,
                                                **GREEDY)
        next(iter(blocker))
        done: dict[str, tuple[float, str]] = {}

        def ask(name: str, priority: int, prompt: str) -> None:
            resp = srv.client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0.0,
                                                 extra_body={"ignore_eos": True, "priority": priority})
            done[name] = (time.monotonic(), resp.choices[0].text)

        threads = []
        for name, priority, prompt in (("low", 5, PROMPTS[1]), ("urgent", -3, PROMPTS[0])):
            threads.append(threading.Thread(target=ask, args=(name, priority, prompt)))
            threads[-1].start()
            deadline = time.monotonic() + 20
            while srv.metrics()["vllm:num_requests_waiting"] < len(threads):
                assert time.monotonic() < deadline, "the request never queued"
                time.sleep(0.02)
        blocker.close()  # frees the seat
        for t in threads:
            t.join(30)
        assert done["urgent"][0] < done["low"][0], "the low-priority request ran first"
        assert done["urgent"][1] == offline(PROMPTS[0], 6)[0] and done["low"][1] == offline(PROMPTS[1], 6)[0]
        srv.wait_idle()
    finally:
        srv.stop()


def test_metrics_parse_and_count_what_was_served(server):
    server.client.completions.create(model="m", prompt="abc", max_tokens=3, **GREEDY)
    m = server.metrics()
    for name in ("vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert name in m, name
    assert m["vllm:e2e_request_latency_seconds_count"] >= 1 and m["vllm:time_to_first_token_seconds_count"] >= 1


def test_the_load_generator_against_the_server(server):
    """benchmarks.serve end to end: every request succeeds with the asked output length, timings ordered."""
    prompts, output_lens = synthetic_workload(6, (4, 24), (2, 12), vocab=256, seed=0)
    results, duration = asyncio.run(run(server.url, "m", prompts, output_lens, request_rate=20.0,
                                    max_concurrency=3))
    assert all(r.success for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == output_lens
    assert all(0 < r.ttft <= r.e2e <= duration for r in results)
    assert summarize(results, duration)["completed"] == 6
    server.wait_idle()


def test_the_load_generator_sweeps_rates_and_plots(server, tmp_path):
    """`python -m benchmarks.serve --sweep ... --plot ...` against the server: a row per offered
    rate, every request served, the PNG and the JSON written."""
    png, result = tmp_path / "sweep.png", tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--base-url", server.url, "--model", "m",
                           "--num-prompts", "4", "--input-len", "4:16", "--output-len", "2:6", "--sweep", "20,inf",
                           "--max-concurrency", "2", "--goodput", "ttft:5000", "--plot", str(png),
                           "--result-file", str(result)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()[1:3]]
    assert [r[0] for r in rows] == ["20", "inf"] and [r[-1] for r in rows] == ["0", "0"], done.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    sweep = json.loads(result.read_text())["sweep"]
    assert [s["completed"] for s in sweep] == [4, 4] and all(s["goodput"] > 0 for s in sweep)
    server.wait_idle()


def test_a_model_without_a_template_and_a_full_queue(tmp_path):
    """The preset has no chat template: chat is a clear 400. One seat, one waiting place: a third
    request is refused with a 503 while the first two are in the engine."""
    srv = Server(str(long_context(preset_path("tiny-llama"), tmp_path)), "--max-num-seqs", "1",
                 "--max-waiting-requests", "1", *HOLD_ARGS)
    try:
        with pytest.raises(openai.BadRequestError, match="chat template") as info:
            srv.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert info.value.response.json()["error"]["param"] == "messages"
        first = srv.client.completions.create(model="m", prompt="a", max_tokens=HOLD_TOKENS, stream=True, **GREEDY)
        next(iter(first))
        waiting: dict = {}
        t = threading.Thread(target=lambda: waiting.setdefault("resp", srv.client.completions.create(
            model="m", prompt="b", max_tokens=4, **GREEDY)))
        t.start()
        deadline = time.monotonic() + 20
        while srv.metrics()["vllm:num_requests_waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.InternalServerError) as info:
            srv.client.completions.create(model="m", prompt="c", max_tokens=4)
        assert info.value.status_code == 503 and "max_waiting_requests=1" in info.value.response.json()["error"]["message"]
        first.close()  # frees the seat: the waiting request runs
        t.join(30)
        assert waiting["resp"].choices[0].finish_reason == "length"
        srv.wait_idle()
    finally:
        srv.stop()
