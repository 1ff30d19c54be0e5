"""A checkpoint's config, parsed once: the decoder's switches and shapes (`LlamaArgs`) and the
folder's other facts the engine needs (EOS ids, tokenizer, stored dtype) in a `ModelConfig`.

The Llama family differs in a few switches, all read from config.json:
- qkv bias (Qwen2 always; Llama/Qwen3 when `attention_bias`), o_proj bias (Llama/Qwen3 `attention_bias`);
- per-head RMSNorm of q and k before RoPE (Qwen3), `head_dim` that is not hidden/heads;
- tied embeddings (the LM head is the embedding matrix);
- RoPE: default, linear or llama3 scaling, from `rope_parameters` (transformers >= 5) or
  `rope_theta` + `rope_scaling` (older checkpoints).
The capacity model's `ModelSpec` is derived from `LlamaArgs` (`model_spec()`), never parsed again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine_core.memory import ModelSpec
from engine_core.models.loader import read_config, read_eos_token_ids
from engine_core.presets import resolve_model

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaArgs:
    """The switches and shapes of one checkpoint, normalised across the family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    rope: dict[str, Any] = field(default_factory=dict)  # rope_type, rope_theta, and the type's own keys

    @classmethod
    def from_config(cls, c: dict[str, Any], source: str = "config.json") -> "LlamaArgs":
        archs = c.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: architectures {archs} not supported; "
                             f"supported: {list(SUPPORTED_ARCHITECTURES)}")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {c['hidden_act']!r} not supported (only 'silu')")
        heads = c["num_attention_heads"]
        qwen2, qwen3 = arch.startswith("Qwen2"), arch.startswith("Qwen3")
        bias = bool(c.get("attention_bias", False)) and arch != "MistralForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            qkv_bias=qwen2 or bias,
            o_bias=bias and not qwen2,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=qwen3,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(c, arch),
            rope=_rope_params(c, source),
        )

    def check_max_model_len(self, max_model_len: int) -> None:
        """Sliding-window attention is not implemented: refuse a window that would matter."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ValueError(f"sliding_window={self.sliding_window} < max_model_len={max_model_len} is not supported "
                             f"(full attention only); set max_model_len <= {self.sliding_window}")

    def model_spec(self) -> ModelSpec:
        """The shape numbers the capacity model (lab 01) and the preemption cost model use."""
        return ModelSpec(num_layers=self.num_layers, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                         tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.qkv_bias,
                         o_proj_bias=self.o_bias, qk_norm=self.qk_norm)


def _sliding_window(c: dict[str, Any], arch: str) -> int | None:
    """Mistral applies `sliding_window` when set; Qwen2/3 only with `use_sliding_window`."""
    window = c.get("sliding_window")
    if arch.startswith("Qwen") and not c.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _rope_params(c: dict[str, Any], source: str) -> dict[str, Any]:
    """Accept transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    if params["rope_type"] not in _ROPE_TYPES:
        raise ValueError(f"{source}: rope_type {params['rope_type']!r} not supported; supported: {list(_ROPE_TYPES)}")
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", c.get("max_position_embeddings", 2048))
    return params


@dataclass(frozen=True)
class ModelConfig:
    """One model folder, read once: where it is, its parsed args, EOS ids, stored dtype, tokenizer presence."""

    path: Path
    args: LlamaArgs
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: torch.dtype | None  # config.json's `dtype` / `torch_dtype`, when a float type
    has_tokenizer: bool

    @classmethod
    def load(cls, model: str) -> "ModelConfig":
        """`model` is a preset name or a Hugging Face checkpoint folder."""
        path = resolve_model(model)
        hf_config = read_config(path)
        args = LlamaArgs.from_config(hf_config, source=str(path / "config.json"))
        stored = getattr(torch, str(hf_config.get("dtype") or hf_config.get("torch_dtype") or ""), None)
        return cls(path=path, args=args, eos_token_ids=tuple(read_eos_token_ids(path, hf_config)),
                   checkpoint_dtype=stored if isinstance(stored, torch.dtype) else None,
                   has_tokenizer=(path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file())

    def load_tokenizer(self) -> Any:
        """The folder's tokenizer, or None when it has none (token-id prompts only)."""
        if not self.has_tokenizer:
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)
