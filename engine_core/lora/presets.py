"""Built-in random LoRA adapters for the model presets, written by `peft` itself (`save_pretrained`),
so tests and benchmarks use real PEFT folders and nothing downloads.

`adapter_path(model, adapter, seed)` builds one on first use into
`$INFERENCE_LABS_CACHE/adapters/<model>-v<preset version>/<adapter>-s<seed>-v<ADAPTER_VERSION>`
(file-locked like the model presets; two builds are byte-identical). Different seeds give different
adapters of one shape: the multi-adapter benchmark serves many of them.

Init scale: PEFT starts B at zero (the adapter is a no-op). Here A is N(0, 1/in), so each rank
coordinate of A x is about unit size, and B is N(0, 1/r) * gain / scaling, so the module's delta
scaling * B A x is about `gain` times a unit output: large enough that the adapter changes greedy
tokens, small enough that greedy top-2 logit margins stay healthy (tests/lora/test_lora_presets.py
measures both).
"""
from __future__ import annotations

import functools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_core.presets import PRESET_VERSION, PRESETS, build_once, cache_root, preset_path

ADAPTER_VERSION = 1  # bump when an adapter's files change: it names the cache folder
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterPreset:
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    gain: float = 0.5

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


ADAPTER_PRESETS: dict[str, AdapterPreset] = {
    "r8-attn": AdapterPreset(8, 16, ATTN),
    "r16-all": AdapterPreset(16, 32, ATTN + MLP),
    "r4-mlp": AdapterPreset(4, 8, MLP),
    "r16-rslora-qv": AdapterPreset(16, 8, ("q_proj", "v_proj"), use_rslora=True, gain=1.0),
}


def adapter_path(model: str, adapter: str, seed: int = 0) -> Path:
    """The folder of adapter preset `adapter` (seed `seed`) for model preset `model`, built on first use."""
    if model not in PRESETS:
        raise ValueError(f"unknown model preset {model!r}; presets: {sorted(PRESETS)}")
    if adapter not in ADAPTER_PRESETS:
        raise ValueError(f"unknown adapter preset {adapter!r}; adapter presets: {sorted(ADAPTER_PRESETS)}")
    target = cache_root() / "adapters" / f"{model}-v{PRESET_VERSION}" / f"{adapter}-s{seed}-v{ADAPTER_VERSION}"
    return build_once(target, "adapter_config.json", lambda out: build_adapter(model, adapter, seed, out))


@functools.lru_cache(maxsize=1)
def _base_model(model: str) -> Any:
    """The preset's HF model, loaded once per process: building 64 adapters of a large preset
    (the GPU benchmark) would otherwise reload it 64 times."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(preset_path(model), dtype=torch.float32)


def build_adapter(model: str, adapter: str, seed: int, out_dir: Path) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` with peft's `save_pretrained`."""
    import peft
    import torch

    spec = ADAPTER_PRESETS[adapter]
    base = _base_model(model)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.lora_alpha, target_modules=list(spec.target_modules),
                             use_rslora=spec.use_rslora, lora_dropout=0.0)
    lora_model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{model}/{adapter}/{seed}".encode()))
    with torch.no_grad():
        for name, p in sorted(lora_model.named_parameters()):
            if ".lora_A." in name:  # [r, in]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:  # [out, r]
                p.copy_(torch.randn(p.shape, generator=gen) * spec.gain / (spec.scaling * p.shape[1] ** 0.5))
    lora_model.save_pretrained(out_dir)
    lora_model.unload()  # the cached base model, without LoRA layers again
    # peft writes target_modules in set order and the base model's local path: make the file
    # byte-identical across builds and machines.
    path = out_dir / "adapter_config.json"
    saved = json.loads(path.read_text())
    saved.update(target_modules=sorted(saved["target_modules"]), base_model_name_or_path=model)
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
