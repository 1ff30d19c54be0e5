"""One reader of llama GGUF files (the `gguf` package underneath): tensor names mapped to Hugging Face's, q/k rows
un-permuted, config.json from the metadata, and the tensors either dequantized (`read_state_dict`: the real preset's
converter, presets_real.py) or as their quantized blocks (`read_quant_blocks`: the gguf scheme,
models/quantization/gguf_q4_1.py)."""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """A GGUF llama tensor name -> its Hugging Face LlamaForCausalLM name."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.weight"
    raise ValueError(f"gguf_name {gguf_name!r} is not a llama tensor this converter knows")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a q_proj / k_proj weight [n_head * head_dim, hidden]: within each head
    it stored rows (0, d/2, 1, d/2+1, ...) so RoPE rotates adjacent pairs; HF rotates halves, rows (0..d-1)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"w has {rows} rows, not a multiple of 2 * n_head = {2 * n_head}")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str) -> Any:
    """A scalar or string metadata value of a GGUFReader."""
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"the GGUF file has no metadata key {key!r}")
    return field.contents()


def read_llama_config(reader: Any) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from a llama GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"the GGUF file's general.architecture must be 'llama', got {arch!r}")
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, "llama.attention.head_count"))
    vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32",
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=int(_field(reader, "llama.embedding_length")) // heads,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters=dict(rope_type="default", rope_theta=float(_field(reader, "llama.rope.freq_base"))),
        vocab_size=vocab, hidden_act="silu", attention_bias=False, mlp_bias=False,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id")),
    )


def read_state_dict(reader: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor dequantized to fp32 (`gguf.quants.dequantize`), under its HF name, q/k un-permuted."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        # GGUF lists dims innermost first (ne0 = the input dimension); numpy wants [out, in]
        w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)]).astype(np.float32)
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def read_quant_blocks(path: str, num_heads: int, num_kv_heads: int) -> dict[str, tuple[str, torch.Tensor]]:
    """Every Q4_1 and Q8_0 matrix of a llama GGUF file -> ("Q4_1" or "Q8_0", its blocks uint8 `[N, K / 32 * bytes
    a block]`) under its Hugging Face name (Q4_1: 20 bytes a block, Q8_0: 34), q_proj / k_proj rows un-permuted as
    `read_state_dict` does (a row's blocks move with it): what the gguf scheme serves as stored."""
    from gguf import GGMLQuantizationType, GGUFReader

    out = {}
    for t in GGUFReader(path).tensors:
        if t.tensor_type not in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
            continue
        name, data = hf_name(t.name), np.array(t.data)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            data = unpermute_qk(data, num_heads if name.endswith("q_proj.weight") else num_kv_heads)
        out[name] = (t.tensor_type.name, torch.from_numpy(np.ascontiguousarray(data)))
    return out
