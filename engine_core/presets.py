"""Built-in tiny models: real Hugging Face checkpoints with random weights, so nothing downloads.

Each preset is written once with `save_pretrained` (plus a byte-level tokenizer) to
`$INFERENCE_LABS_CACHE/presets/<name>-v<version>` (default `~/.cache/inference-labs`) and then
loaded through the same local-folder path as any checkpoint. Weights come from a fixed seed,
so two builds give byte-identical safetensors files.

Init scale: Hugging Face's default (std 0.02) makes every logit nearly equal, so greedy
decoding would follow fp32 rounding noise. Linear weights here are N(0, 1/fan_in), embeddings
N(0, 1), and the LM head (or the tied embedding) is scaled so logits have std `logit_gain`:
the median top-1/top-2 logit margin over greedy steps is then 0.7 to 1.3 and margins under
1e-4 are rarer than 1 in 4096 steps (tests/models/test_presets.py measures it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_core.cache import build_once, cache_root

PRESET_VERSION = 2  # bump when a preset's files change: it names the cache folder
VOCAB_SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2; the 256 byte symbols follow


@dataclass(frozen=True)
class Preset:
    architecture: str  # the Hugging Face config class name
    config: dict[str, Any]
    dtype: str = "float32"
    logit_gain: float = 4.0
    residual_gain: float = 1.0  # scales o_proj / down_proj: > 1 keeps tied models from echoing their input
    seed: int = 0
    description: str = ""


_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)

PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("LlamaConfig", dict(_TINY), description="Llama, GQA 4:2, 2 layers, hidden 64"),
    "tiny-llama3": Preset("LlamaConfig", dict(_TINY, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)), description="Llama 3 rope scaling (original context 64)"),
    "tiny-qwen2": Preset("Qwen2Config", dict(_TINY, num_key_value_heads=1),
                         description="Qwen2: qkv bias, GQA 4:1"),
    "tiny-qwen3": Preset("Qwen3Config", dict(_TINY, head_dim=32, tie_word_embeddings=True), residual_gain=4.0,
                         description="Qwen3: q/k RMSNorm, head_dim 32 != hidden/heads, tied embeddings"),
    "tiny-mistral-swa": Preset("MistralConfig", dict(_TINY, sliding_window=12),
                               description="Mistral, sliding-window attention over the last 12 tokens"),
    # the same seed and parameter order as tiny-llama, so its embedding, layer 0 and LM head are
    # tiny-llama's: a self-draft with the last layer dropped (speculative_config method "draft_model")
    "tiny-llama-draft": Preset("LlamaConfig", dict(_TINY, num_hidden_layers=1),
                               description="tiny-llama's first layer alone: its draft model"),
    "small-llama": Preset("LlamaConfig", dict(_TINY, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                              num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                                              max_position_embeddings=4096),
                          description="Llama, 8 layers, hidden 512, vocab 8k: for CPU benchmarks"),
    "qwen3-0.6b-shape": Preset("Qwen3Config", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        bos_token_id=1, eos_token_id=2, pad_token_id=0), dtype="bfloat16", residual_gain=4.0,
        description="Qwen3-0.6B's public shape, random weights: GPU benchmarks only"),
}


def preset_names() -> list[str]:
    """Every preset name: the random ones here and the real ones (engine_core.presets_real)."""
    from engine_core.presets_real import DRAFT_PRESETS, REAL_PRESETS

    return sorted([*PRESETS, *REAL_PRESETS, *DRAFT_PRESETS])


def resolve_model(model: str | os.PathLike) -> Path:
    """A model folder (must hold config.json) or a preset name -> a local checkpoint folder."""
    from engine_core.presets_real import DRAFT_PRESETS, REAL_PRESETS, draft_preset_path, real_preset_path

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json; a model is a Hugging Face "
                             f"checkpoint folder or one of the presets {preset_names()}")
        return path
    if str(model) in PRESETS:
        return preset_path(str(model))
    if str(model) in REAL_PRESETS:
        return real_preset_path(str(model))
    if str(model) in DRAFT_PRESETS:
        return draft_preset_path(str(model))
    raise ValueError(f"model must be an existing checkpoint folder or one of the presets {preset_names()}, "
                     f"got {str(model)!r}")


def preset_path(name: str) -> Path:
    """The preset's folder, built on first use (safe when several processes ask at once)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    target = cache_root() / "presets" / f"{name}-v{PRESET_VERSION}"
    return build_once(target, "config.json", lambda out: build_preset(name, out))


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level tokenizer: 3 specials, one token per byte, no merges; ids past those decode as
    `<id>` so text output shows every token a random model emits (encoding never produces them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = [f"<{i}>" for i in range(len(VOCAB_SPECIALS) + len(alphabet), vocab_size)]
    vocab = {tok: i for i, tok in enumerate(VOCAB_SPECIALS + alphabet + fillers)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)


def build_preset(name: str, out_dir: Path) -> None:
    """Write preset `name` to `out_dir` as config.json + model.safetensors + tokenizer files."""
    import torch
    import transformers

    spec = PRESETS[name]
    config = getattr(transformers, spec.architecture)(**spec.config)
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif pname.endswith("bias"):
                w = 0.1 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in pname:  # tied: it is also the LM head, so scale it like one
                w = torch.randn(p.shape, generator=gen)
                if config.tie_word_embeddings:
                    w *= spec.logit_gain / p.shape[1] ** 0.5
            else:  # [out, in] linear weights
                w = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
                if pname == "lm_head.weight":
                    w *= spec.logit_gain
                elif pname.endswith(("o_proj.weight", "down_proj.weight")):
                    w *= spec.residual_gain
            p.copy_(w.to(dtype))
    model.save_pretrained(out_dir)
    if spec.config["vocab_size"] >= len(VOCAB_SPECIALS) + 256:
        build_tokenizer(out_dir, spec.config["vocab_size"])
