"""LLMEngine / LLM behaviour: validation before any state change, aborts, stop conditions,
outputs in vLLM's shape, and the KV pool left whole after every workload."""
from __future__ import annotations

import json
import shutil

import pytest

from engine_core import LLM, LLMEngine, SamplingParams
from engine_core.presets import preset_path
from engine_helpers import pool_is_whole, run_to_end

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(**kw) -> LLMEngine:
    return LLMEngine.from_kwargs("tiny-llama", **{"num_gpu_blocks": 64, **kw})


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt=[]), "prompt must have at least 1 token"),
    (dict(prompt=[5] * 2048), "max_model_len=2048"),
    (dict(prompt=[5, 512]), r"vocab_size=512\), got 512"),
    (dict(prompt=[-1]), r"\[0, vocab_size=512\), got -1"),
    (dict(prompt=[5], request_id="good"), "request_id 'good' is already in use"),
    (dict(prompt=[5] * 1000, sampling_params=SamplingParams(max_tokens=100)), "can never fit"),
    (dict(prompt=[5.0]), r"prompt\[0\] must be an int, got 5.0 \(float\)"),
])
def test_bad_request_is_rejected_before_any_state_change(kwargs, match):
    engine = _engine()
    engine.add_request("good", [7, 8, 9], SamplingParams(max_tokens=6, **GREEDY))
    engine.step()  # "good" is mid-flight when the bad one arrives
    args = {"request_id": "bad", "sampling_params": SamplingParams(max_tokens=4, **GREEDY), **kwargs}
    with pytest.raises(ValueError, match=match):
        engine.add_request(**args)
    assert list(engine.requests) == ["good"] and engine.scheduler.get_num_unfinished_requests() == 1
    reference = _engine()
    reference.add_request("good", [7, 8, 9], SamplingParams(max_tokens=6, **GREEDY))
    assert run_to_end(engine) == run_to_end(reference)  # the good request is undisturbed
    assert pool_is_whole(engine)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be a finite number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a finite number in \(0, 1\]"),
])
def test_bad_sampling_params_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_text_prompt_without_a_tokenizer(tmp_path):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(preset_path("tiny-llama"), folder, ignore=shutil.ignore_patterns("tokenizer*"))
    engine = LLMEngine.from_kwargs(str(folder), num_gpu_blocks=16)
    with pytest.raises(ValueError, match="prompt is text but model folder .* has no tokenizer"):
        engine.add_request("t", "hello")
    assert not engine.has_unfinished_requests()
    engine.add_request("ids", [5, 6])  # token ids still work
    out = run_to_end(engine)
    assert len(out["ids"]) == 16


def test_prompt_plus_one_token_must_fit_max_model_len():
    engine = _engine(max_model_len=32)
    with pytest.raises(ValueError, match="at most 31 prompt tokens"):
        engine.add_request("a", [5] * 32)
    engine.add_request("b", [5] * 31, SamplingParams(max_tokens=10, **GREEDY))
    engine.add_request("c", [5] * 20, SamplingParams(max_tokens=50, **GREEDY))
    out = run_to_end(engine)
    assert len(out["b"]) == 1 and len(out["c"]) == 12  # capped at max_model_len tokens in total


def test_abort_frees_blocks_running_and_waiting():
    engine = _engine(max_num_seqs=1)
    engine.add_request("run", list(range(3, 60)), SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("wait", [5, 6], SamplingParams(max_tokens=5, **GREEDY))
    engine.step()
    engine.step()
    kvm = engine.scheduler.kv_cache_manager
    assert kvm.num_free_blocks < kvm.num_gpu_blocks
    engine.abort_request("run")
    assert pool_is_whole(engine)
    engine.abort_request("wait")
    engine.abort_request("never-existed")  # ignored
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.stats()["num_finished_requests"] == 2


def test_abort_takes_a_list_of_ids_as_in_vllm():
    engine = _engine()
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    engine.abort_request(["a", "c", "unknown"])
    assert list(engine.requests) == ["b"] and list(run_to_end(engine)) == ["b"]
    assert pool_is_whole(engine) and engine.stats()["num_finished_requests"] == 3


def test_abort_mid_workload_leaves_others_intact():
    engine = _engine()
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i] * (10 + 7 * i), SamplingParams(max_tokens=8, **GREEDY))
    engine.step()
    engine.abort_request("r2")
    out = run_to_end(engine)
    assert sorted(out) == ["r0", "r1", "r3"] and all(len(t) == 8 for t in out.values())
    assert pool_is_whole(engine)


def test_stop_token_and_eos_list():
    prompt = [9, 8, 7, 6]
    free = LLM("tiny-llama", num_gpu_blocks=16).generate([prompt], SamplingParams(max_tokens=12, **GREEDY),
                                                         use_tqdm=False)[0].outputs[0].token_ids
    stop = free[3]
    first = free.index(stop)
    out = LLM("tiny-llama", num_gpu_blocks=16).generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free[:first + 1] and out.outputs[0].finish_reason == "stop"


def test_eos_from_generation_config_may_be_a_list(tmp_path):
    prompt = [9, 8, 7, 6]
    free = LLM("tiny-llama", num_gpu_blocks=16).generate([prompt], SamplingParams(max_tokens=12, **GREEDY),
                                                         use_tqdm=False)[0].outputs[0].token_ids
    folder = tmp_path / "eos"
    shutil.copytree(preset_path("tiny-llama"), folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, free[4]]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(folder), num_gpu_blocks=16)
    stops, ignores = llm.generate([prompt, prompt], [SamplingParams(max_tokens=12, temperature=0.0),
                                                      SamplingParams(max_tokens=12, **GREEDY)], use_tqdm=False)
    assert stops.outputs[0].token_ids == free[:free.index(free[4]) + 1]
    assert stops.outputs[0].finish_reason == "stop"
    assert ignores.outputs[0].token_ids == free and ignores.outputs[0].finish_reason == "length"


def test_generate_outputs_in_prompt_order_with_text_and_metrics():
    llm = LLM("tiny-llama", num_gpu_blocks=64, max_num_batched_tokens=16)
    prompts = ["a longer text prompt, chunked over several steps", [5, 6, 7], "hi"]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (3, 9, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    assert outs[0].prompt == prompts[0] and outs[1].prompt is None
    assert outs[0].prompt_token_ids == list(llm.engine.tokenizer.encode(prompts[0]))
    assert outs[1].prompt_token_ids == [5, 6, 7]
    for o in outs:
        m = o.metrics
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == llm.engine.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.ttft > 0 and m.mean_tpot(len(o.outputs[0].token_ids)) >= 0
    stats = llm.engine.stats()
    assert stats["num_generated_tokens"] == 17 and stats["num_steps"] >= 9 and stats["generation_tokens_per_s"] > 0
    assert stats["num_requests_running"] == 0


def test_generate_rejects_the_batch_before_queuing_any():
    llm = LLM("tiny-llama", num_gpu_blocks=64)
    with pytest.raises(ValueError, match="prompt 1: prompt must have at least 1 token"):
        llm.generate([[5, 6], [], [7]], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and pool_is_whole(llm.engine)
    with pytest.raises(ValueError, match="sampling_params must be one SamplingParams or a list of 2"):
        llm.generate([[5], [6]], [SamplingParams()], use_tqdm=False)
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=2), use_tqdm=False)) == 1  # one id-list prompt


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_seqs'\]"):
        LLM("tiny-llama", max_seqs=4)


def test_prometheus_text_has_vllm_names_and_latency_histograms():
    llm = LLM("tiny-llama", device="cpu")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    text = llm.engine.prometheus_metrics()
    # vLLM's counts: 3 tokens generated, the first included; the 3-token prompt once; 2 gaps, 1 request TPOT
    assert "vllm:generation_tokens_total 3.0" in text and "vllm:prompt_tokens_total 3.0" in text
    assert 'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1' in text
    assert "vllm:inter_token_latency_seconds_count 2" in text
    assert "vllm:request_time_per_output_token_seconds_count 1" in text


def test_step_info_and_stats_count_decode_tokens_the_same_way():
    llm = LLM("tiny-llama", device="cpu", max_num_batched_tokens=8)
    engine = llm.engine
    for i, n in enumerate((3, 12, 5)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    prefill = decode = 0
    while engine.has_unfinished_requests():
        engine.step()
        prefill += engine.last_step.num_prefill_tokens
        decode += engine.last_step.num_decode_tokens
    stats = engine.stats()
    assert (prefill, decode) == (stats["num_prefill_tokens"], stats["num_decode_tokens"]) == (20, 9)
