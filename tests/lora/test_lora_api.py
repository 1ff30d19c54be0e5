"""The LoRA API's boundary: bad adapter folders, ids and arguments are ValueErrors naming the
file / parameter and the allowed values, raised before anything in the engine changes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine_core import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine_core.lora.presets import adapter_path
from engine_helpers import run_to_end

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(**kw) -> LLMEngine:
    return LLMEngine.from_kwargs("tiny-llama", **{"num_gpu_blocks": 64, "enable_lora": True, "max_loras": 2, **kw})


def _copy(tmp_path: Path, adapter: str = "r8-attn", model: str = "tiny-llama") -> Path:
    folder = tmp_path / "adapter"
    shutil.copytree(adapter_path(model, adapter), folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_weights(folder: Path, edit) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file({k: v.clone() for k, v in tensors.items()}, path)


# name -> (how to break a good folder, the error it must give)
BAD = {
    "no folder": (lambda f: shutil.rmtree(f), "lora_path is not a folder"),
    "no config": (lambda f: (f / "adapter_config.json").unlink(), "missing adapter_config.json"),
    "no weights": (lambda f: (f / "adapter_model.safetensors").unlink(), "missing adapter_model.safetensors"),
    "not json": (lambda f: (f / "adapter_config.json").write_text("{"), "not valid JSON"),
    "not lora": (lambda f: _edit_config(f, peft_type="IA3"), "peft_type must be 'LORA'"),
    "dora": (lambda f: _edit_config(f, use_dora=True), "use_dora=True is not supported"),
    "rank pattern": (lambda f: _edit_config(f, rank_pattern={"q_proj": 4}), "rank_pattern"),
    "unknown target": (lambda f: _edit_config(f, target_modules=["q_proj", "embed_tokens"]),
                       r"target_modules \['embed_tokens'\] not supported"),
    "unknown tensor": (lambda f: _edit_weights(f, lambda t: t.update({
        "base_model.model.lm_head.lora_A.weight": t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]})),
        "'base_model.model.lm_head.lora_A.weight' is not a LoRA weight of a supported module"),
    "missing B": (lambda f: _edit_weights(f, lambda t: t.pop("base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight")),
                  "layer 1 o_proj has lora_A but no lora_B"),
    "layer past the model": (lambda f: _edit_weights(f, lambda t: t.update({
        "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
        "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]})),
        "layer 7 but the base model has 2"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_folder_is_rejected_before_any_state_change(tmp_path: Path, case: str):
    folder = _copy(tmp_path)
    breaks, match = BAD[case]
    breaks(folder)
    engine = _engine()
    engine.add_request("good", [7, 8, 9], GREEDY, lora_request=LoRARequest("good", 1, str(adapter_path("tiny-llama", "r16-all"))))
    engine.step()  # "good" is mid-flight when the bad one arrives
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", [5, 6], GREEDY, lora_request=LoRARequest("bad", 2, str(folder)))
    lora = engine.runner.lora
    assert list(engine.requests) == ["good"] and engine.scheduler.get_num_unfinished_requests() == 1
    assert set(lora.known) == {1} and set(lora.cache.adapters) == {1}
    reference = _engine()
    reference.add_request("good", [7, 8, 9], GREEDY, lora_request=LoRARequest("good", 1, str(adapter_path("tiny-llama", "r16-all"))))
    assert run_to_end(engine) == run_to_end(reference)  # the good request is undisturbed


def test_rank_above_max_lora_rank_names_both(tmp_path: Path):
    with pytest.raises(ValueError, match=r"rank r=16 exceeds max_lora_rank=8"):
        _engine(max_lora_rank=8).add_request("r", [5], GREEDY,
                                             lora_request=LoRARequest("big", 1, str(adapter_path("tiny-llama", "r16-all"))))


def test_shape_mismatch_with_the_base_model():
    """A tiny-llama adapter on tiny-qwen3 (head_dim 32: k_proj is 64 -> 64 there, 64 -> 32 in tiny-llama)."""
    engine = LLMEngine.from_kwargs("tiny-qwen3", num_gpu_blocks=16, enable_lora=True)
    with pytest.raises(ValueError, match=r"k_proj.lora_B.weight' has shape \(32, 8\), expected \(64, 8\)"):
        engine.add_request("r", [5], GREEDY, lora_request=LoRARequest("other", 1, str(adapter_path("tiny-llama", "r8-attn"))))


def test_lora_request_without_enable_lora_is_an_error():
    engine = LLMEngine.from_kwargs("tiny-llama", num_gpu_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=False"):
        engine.add_request("r", [5], GREEDY, lora_request=LoRARequest("a", 1, str(adapter_path("tiny-llama", "r8-attn"))))
    assert not engine.has_unfinished_requests()


def test_one_id_names_one_adapter():
    engine = _engine()
    engine.add_lora(LoRARequest("a", 1, str(adapter_path("tiny-llama", "r8-attn"))))
    engine.add_lora(LoRARequest("a", 1, str(adapter_path("tiny-llama", "r8-attn"))))  # the same again: fine
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'a'"):
        engine.add_request("r", [5], GREEDY, lora_request=LoRARequest("b", 1, str(adapter_path("tiny-llama", "r4-mlp"))))
    with pytest.raises(ValueError, match=r"lora_request must be a LoRARequest or None, got 1 \(int\)"):
        engine.add_request("r", [5], GREEDY, lora_request=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lora_name="", lora_int_id=1, lora_path="x"), "lora_name must be a non-empty str"),
    (dict(lora_name="a", lora_int_id=0, lora_path="x"), "lora_int_id must be an int >= 1, got 0"),
    (dict(lora_name="a", lora_int_id=True, lora_path="x"), "lora_int_id must be an int >= 1"),
    (dict(lora_name="a", lora_int_id=1, lora_path=None), "lora_path must be a non-empty str"),
])
def test_lora_request_fields_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_loras=0), "max_loras must be an int >= 1"),
    (dict(max_lora_rank=0), "max_lora_rank must be an int >= 1"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras must be None or an int >= 4 \(max_loras=4: .*\), got 2"),
    (dict(enable_lora="yes"), "enable_lora must be True or False, got 'yes' \\(str\\)"),
])
def test_engine_lora_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_generate_takes_one_lora_request_or_one_per_prompt():
    llm = LLM("tiny-llama", num_gpu_blocks=32, enable_lora=True)
    a = LoRARequest("a", 1, str(adapter_path("tiny-llama", "r8-attn")))
    with pytest.raises(ValueError, match="lora_request must be one LoRARequest, None, or a list of 2"):
        llm.generate([[5, 6], [7]], GREEDY, use_tqdm=False, lora_request=[a])
    both = llm.generate([[5, 6], [5, 6]], GREEDY, use_tqdm=False, lora_request=a)
    mixed = llm.generate([[5, 6], [5, 6]], GREEDY, use_tqdm=False, lora_request=[a, None])
    assert both[0].outputs[0].token_ids == both[1].outputs[0].token_ids == mixed[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids != mixed[0].outputs[0].token_ids, "the adapter must change the tokens"
