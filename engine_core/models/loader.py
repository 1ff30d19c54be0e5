"""Read a Hugging Face checkpoint folder with safetensors directly: no transformers model class.

A folder holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Errors name the file and the tensor, so a broken
checkpoint says what is wrong instead of failing deep inside a forward pass.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json as a dict (the text config of a multimodal wrapper is not supported)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model folder {str(folder)!r} has no config.json")
    with open(path) as f:
        return json.load(f)


def read_eos_token_ids(folder: str | Path, config: dict[str, Any]) -> list[int]:
    """EOS ids: generation_config.json wins over config.json; either may hold an int or a list."""
    eos: Any = None
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: folder / fname for name, fname in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"model folder {str(folder)!r} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


class CheckpointReader:
    """Hands out tensors by name, converting dtype on the way; remembers which file each came from."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: torch.device) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        self.device = device
        self.files = _tensor_files(self.folder)

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            where = sorted({p.name for p in self.files.values()}) or ["(no tensors)"]
            raise ValueError(f"checkpoint {str(self.folder)!r} ({', '.join(where)}) is missing tensor {name!r}")
        path = self.files[name]
        if not path.is_file():
            raise ValueError(f"tensor {name!r} is mapped to {str(path)!r}, which does not exist")
        with safe_open(path, framework="pt", device="cpu") as f:
            if name not in f.keys():
                raise ValueError(f"file {str(path)!r} is missing tensor {name!r} named in its index")
            return f.get_tensor(name).to(device=self.device, dtype=self.dtype)
