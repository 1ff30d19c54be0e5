"""Loading checkpoints from a local folder: every supported family, both rope formats, shards,
and clear errors (naming the file and the tensor) for what is not supported or is broken."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from engine_helpers import one_torch_thread
from safetensors.torch import load_file, save_file

from engine_core import LLM, SamplingParams
from engine_core.models.llama import LlamaArgs, rope_inv_freq
from engine_core.models.loader import read_config
from engine_core.presets import PRESETS, Preset, _TINY, build_preset, preset_path


def _copy_preset(name: str, dst: Path) -> Path:
    shutil.copytree(preset_path(name), dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def _hf_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _engine_greedy(folder: Path, prompts: list[list[int]], n: int, **kw) -> list[list[int]]:
    llm = LLM(str(folder), num_gpu_blocks=64, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[5], list(range(3, 40)), [7, 300, 12, 9, 400, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]


@pytest.mark.parametrize("name,config", [
    ("tiny-mistral", dict(_TINY, sliding_window=None)),
    ("tiny-llama-bias", dict(_TINY, attention_bias=True, mlp_bias=True)),
])
def test_extra_families_match_hf(tmp_path, monkeypatch, name, config):
    """Mistral (sliding_window None = full attention) and Llama with q/k/v/o and MLP biases."""
    arch = "MistralConfig" if "mistral" in name else "LlamaConfig"
    monkeypatch.setitem(PRESETS, name, Preset(arch, config))
    build_preset(name, tmp_path / name)
    assert _engine_greedy(tmp_path / name, PROMPTS, 6) == _hf_greedy(tmp_path / name, PROMPTS, 6)


def test_a_sliding_window_on_kernels_without_one_is_refused(tmp_path):
    """The window runs on the torch backend (tests/engine/test_sliding_window_engine.py); the C kernels are refused."""
    folder = _copy_preset("tiny-llama", tmp_path / "m")
    _edit_config(folder, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32)
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot honour the model's sliding_window=32"):
        LLM(str(folder), num_gpu_blocks=8, attention_backend="cpu")
    LLM(str(folder), num_gpu_blocks=8, max_model_len=32, attention_backend="cpu")  # the window never matters: fine


def test_sharded_checkpoint_gives_the_same_tokens(tmp_path):
    src = preset_path("tiny-llama")
    folder = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert _engine_greedy(folder, PROMPTS, 5) == _engine_greedy(src, PROMPTS, 5)


def test_old_rope_format_is_read_like_rope_parameters(tmp_path):
    """rope_theta + rope_scaling (older checkpoints) and transformers 5's rope_parameters agree."""
    new = read_config(preset_path("tiny-llama3"))
    old = dict(new)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = dict(params, type=params.pop("rope_type"))  # the oldest spelling: "type"
    a, b = LlamaArgs.from_config(new), LlamaArgs.from_config(old)
    assert a == b
    folder = _copy_preset("tiny-llama3", tmp_path / "old")
    (folder / "config.json").write_text(json.dumps(old))
    assert _engine_greedy(folder, PROMPTS, 5) == _engine_greedy(preset_path("tiny-llama3"), PROMPTS, 5)


@pytest.mark.parametrize("rope", [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64),
])
def test_rope_inv_freq_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(**dict(_TINY, rope_parameters=dict(rope)))
    if rope["rope_type"] == "default":
        ref = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg).inv_freq
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    ours = rope_inv_freq(LlamaArgs.from_config({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    assert torch.equal(ours, ref)


def test_unsupported_rope_type_names_it(tmp_path):
    cfg = read_config(preset_path("tiny-llama"))
    cfg["rope_parameters"] = dict(rope_type="yarn", rope_theta=10000.0, factor=2.0)
    with pytest.raises(ValueError, match="rope_type 'yarn' not supported"):
        LlamaArgs.from_config(cfg)


def test_unknown_architecture_names_config_file(tmp_path):
    folder = _copy_preset("tiny-llama", tmp_path / "gpt")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"config\.json.*GPT2LMHeadModel.*not supported"):
        LLM(str(folder), num_gpu_blocks=8)


def test_missing_tensor_names_file_and_tensor(tmp_path):
    folder = _copy_preset("tiny-llama", tmp_path / "broken")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors.*'model\.layers\.1\.mlp\.up_proj\.weight'"):
        LLM(str(folder), num_gpu_blocks=8)


def test_folder_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="model must be an existing checkpoint folder or one of the presets"):
        LLM("no-such-model")


def test_tied_embeddings_share_the_lm_head():
    """Qwen3 preset: no lm_head.weight in the file; the LM head is the embedding matrix."""
    llm = LLM("tiny-qwen3", num_gpu_blocks=8)
    assert llm.engine.runner.model.lm_head is llm.engine.runner.model.embed


def test_max_model_len_beyond_the_checkpoint_is_refused():
    with pytest.raises(ValueError, match="max_model_len must be <= the checkpoint's max_position_embeddings=2048"):
        LLM("tiny-llama", max_model_len=4096, num_gpu_blocks=8)


@pytest.mark.usefixtures(one_torch_thread.__name__)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama-bias"])
def test_the_checked_shapes_are_the_tensors_the_decoder_reads(tmp_path, monkeypatch, name):
    """check_weights compares config.json with the headers using LlamaArgs.weight_shapes: it must
    name exactly the tensors models/llama.py reads, with the shapes they have."""
    from engine_core.models.config import ModelConfig
    from engine_core.models.loader import CheckpointReader

    if name == "tiny-llama-bias":
        monkeypatch.setitem(PRESETS, name, Preset("LlamaConfig", dict(_TINY, attention_bias=True, mlp_bias=True)))
        build_preset(name, tmp_path / name)
        folder = tmp_path / name
    else:
        folder = preset_path(name)
    read: dict[str, tuple[int, ...]] = {}
    get = CheckpointReader.get

    def recording_get(reader: CheckpointReader, tensor_name: str) -> torch.Tensor:
        tensor = get(reader, tensor_name)
        read[tensor_name] = tuple(tensor.shape)
        return tensor

    monkeypatch.setattr(CheckpointReader, "get", recording_get)
    LLM(str(folder), device="cpu", num_gpu_blocks=8)
    shapes = ModelConfig.load(str(folder)).args.weight_shapes()
    if "lm_head.weight" not in read:  # tied: the LM head is the embedding
        del shapes["lm_head.weight"]
    assert read == shapes
