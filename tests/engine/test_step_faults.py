"""No poisoned engine: a request whose step raises (a fault in its forward, NaN logits) finishes with
finish_reason "error" naming it, its blocks freed, while the other requests get exactly the tokens
they get without it; a step that raises part-way is rolled back and the engine serves on; the
finished requests such a step did not report come with the next step.
"""
from __future__ import annotations

import shutil

import pytest
from engine_helpers import check_engine, one_torch_thread, pool_is_whole, run_to_end

from engine_core import LLM, GenerationError, LLMEngine, LoRARequest, SamplingParams
from engine_core.lora.presets import adapter_path

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9] * 13, [13], [21, 22]]
POISON = 13  # the prompt token the injected faults look for
# the ids of these cases in docs/bad_inputs.md (tests/engine/test_bad_inputs.py checks the table)
CASE_IDS = ["forward-fault", "nan-logits", "tiny-temperature", "lora-adapter-unreadable-at-step",
            "lora-more-adapters-than-slots"]


def _llm() -> LLM:
    return LLM("tiny-llama", device="cpu", num_gpu_blocks=64, block_size=4, max_num_batched_tokens=16)


def _alone(prompt: list[int], n: int = 6) -> list[int]:
    return _llm().generate([prompt], SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids


def _poison_forward(llm: LLM) -> None:
    model = llm.engine.runner.model
    forward = model.forward

    def faulty(input_ids, *args, **kwargs):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected fault")
        return forward(input_ids, *args, **kwargs)

    model.forward = faulty


def test_forward_fault_fails_only_its_request():
    llm = _llm()
    _poison_forward(llm)
    with pytest.raises(GenerationError, match=r"1 of 4 request\(s\) failed: prompt 2: request 'gen-2': its forward "
                                              r"raised RuntimeError: injected fault") as info:
        llm.generate(PROMPTS, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    outs = info.value.outputs
    assert info.value.failed == [2] and outs[2].finished and outs[2].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2] == [_alone(p) for p in PROMPTS if p != [13]]
    assert not llm.engine.has_unfinished_requests() and pool_is_whole(llm.engine)
    stats = llm.engine.stats()
    assert stats["num_failed_requests"] == 1 and stats["num_failed_steps"] == 0


def test_nan_logits_fail_only_their_request():
    engine = _llm().engine
    runner = engine.runner
    forward, logits_of = runner._forward, runner.model.compute_logits
    emitting = []

    def remember_rows(batch):
        emitting[:] = batch.emitting
        return forward(batch)

    def nan_for_poison(hidden):
        logits = logits_of(hidden)
        for row, request in enumerate(emitting):
            if POISON in request.prompt_token_ids:
                logits[row, 7] = float("nan")
        return logits

    runner._forward, runner.model.compute_logits = remember_rows, nan_for_poison
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, **GREEDY))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        check_engine(engine)
    bad = outs.pop("r2")
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert bad.error == ("request 'r2': its logits are NaN or infinite, so no token can be sampled (the weights "
                         "or activations overflow in torch.float32?)")
    assert [outs[f"r{i}"].outputs[0].token_ids for i in (0, 1, 3)] == [_alone(PROMPTS[i]) for i in (0, 1, 3)]
    assert pool_is_whole(engine) and engine.stats()["num_failed_requests"] == 1


def test_tiny_temperature_is_greedy():
    """1e-38 used to overflow logits / T to inf, and softmax to NaN: token 0 every step."""
    llm = _llm()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1e-38, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_alone(p) for p in PROMPTS]


@pytest.mark.parametrize("where", ["schedule", "update_from_output"])
def test_a_step_that_raises_is_rolled_back(where):
    """An exception in the middle of the scheduler's work: the step raises, the engine is consistent,
    and every request still ends with its own tokens."""
    engine = LLMEngine.from_kwargs("tiny-llama", device="cpu", num_gpu_blocks=12, block_size=4,
                                   max_num_batched_tokens=8, preemption_mode="swap", swap_space=1e-5)
    requests = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, **GREEDY)) for i, p in enumerate(PROMPTS)]
    scheduler = engine.scheduler
    real = getattr(scheduler, where)
    calls = []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 4:
            real(*args)  # the work happens, then the step fails
            raise TypeError("injected")
        return real(*args)

    setattr(scheduler, where, flaky)
    for _ in range(3):
        engine.step()
    with pytest.raises(TypeError, match="injected"):
        engine.step()
    check_engine(engine)
    run_to_end(engine, check=True)
    assert [r.output_token_ids for r in requests] == [_alone(p, 8) for p in PROMPTS]
    assert engine.stats()["num_failed_steps"] == 1 and pool_is_whole(engine)


def test_requests_a_failed_step_finished_come_with_the_next_step():
    engine = LLMEngine.from_kwargs("tiny-llama", device="cpu", num_gpu_blocks=16)
    engine.add_request("short", [5, 6], SamplingParams(max_tokens=1, **GREEDY))
    engine.add_request("long", [7, 8], SamplingParams(max_tokens=4, **GREEDY))
    make_output = engine.make_output

    def fail_once(*args):
        engine.make_output = make_output
        raise RuntimeError("after update_from_output")

    engine.make_output = fail_once
    with pytest.raises(RuntimeError):
        engine.step()  # "short" finished inside it
    assert engine.has_unfinished_requests() and "short" in engine.requests
    first = engine.step()
    assert [(o.request_id, o.finished) for o in first][0] == ("short", True)
    assert first[0].outputs[0].token_ids == _alone([5, 6], 1)
    assert run_to_end(engine)["long"] == _alone([7, 8], 4)
    assert not engine.requests and pool_is_whole(engine)


def _lora_engine(**kw) -> LLMEngine:
    return LLMEngine.from_kwargs("tiny-llama", **{"device": "cpu", "num_gpu_blocks": 64, "block_size": 4,
                                                  "enable_lora": True, "max_loras": 1, **kw})


def _lora_alone(prompt: list[int], lora: LoRARequest | None, n: int = 6) -> list[int]:
    engine = _lora_engine()
    engine.add_request("alone", prompt, SamplingParams(max_tokens=n, **GREEDY), lora_request=lora)
    return run_to_end(engine)["alone"]


def test_an_adapter_that_no_longer_loads_fails_only_its_request(tmp_path):
    """max_cpu_loras=2: adding b and c evicts a from the host cache, so a is read from disk again
    when its request first runs; its folder is gone by then. a's request fails naming the folder (it
    used to take a slot before the read and then run with whatever that slot held); the base, b and
    c requests get their own tokens; with its folder back, a serves again."""
    folder = tmp_path / "a"
    shutil.copytree(adapter_path("tiny-llama", "r8-attn"), folder)
    a = LoRARequest("a", 1, str(folder))
    b, c = (LoRARequest(rid, i, str(adapter_path("tiny-llama", name))) for rid, i, name in (("b", 2, "r4-mlp"),
                                                                                               ("c", 3, "r16-all")))
    engine = _lora_engine(max_loras=2, max_cpu_loras=2)
    params = SamplingParams(max_tokens=6, **GREEDY)
    engine.add_request("base", [9, 9], params)
    for lora in (a, b, c):
        engine.add_request(lora.lora_name, [5, 6, 7], params, lora_request=lora)
    assert list(engine.runner.lora.cache.adapters) == [2, 3], "a was evicted from the host cache"
    shutil.rmtree(folder)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        check_engine(engine)
    assert outs["a"].outputs[0].finish_reason == "error", outs["a"]
    assert outs["a"].error.startswith("request 'a': its forward raised ValueError: LoRA adapter 'a' (lora_path ")
    assert "lora_path is not a folder" in outs["a"].error
    assert {rid: outs[rid].outputs[0].token_ids for rid in ("base", "b", "c")} == {
        "base": _lora_alone([9, 9], None), "b": _lora_alone([5, 6, 7], b), "c": _lora_alone([5, 6, 7], c)}
    assert pool_is_whole(engine) and engine.stats()["num_failed_requests"] == 1
    shutil.copytree(adapter_path("tiny-llama", "r8-attn"), folder)
    engine.add_request("again", [5, 6, 7], params, lora_request=a)
    assert run_to_end(engine)["again"] == _lora_alone([5, 6, 7], a)


def test_more_adapters_than_slots_is_not_an_error():
    """Three adapters, max_loras=1: the scheduler's slot rule runs them in turn (as vLLM does), each
    request with the tokens it gets alone."""
    loras = [LoRARequest(name, i + 1, str(adapter_path("tiny-llama", name)))
             for i, name in enumerate(["r8-attn", "r4-mlp", "r16-all"])]
    llm = LLM("tiny-llama", device="cpu", num_gpu_blocks=64, block_size=4, enable_lora=True, max_loras=1)
    prompts = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [9, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False, lora_request=loras + [None])
    assert [o.outputs[0].token_ids for o in outs] == [_lora_alone(p, r) for p, r in zip(prompts, loras + [None])]
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3, "each adapter must change the tokens"
