"""A PEFT LoRA folder read and checked against the base model: `adapter_config.json` +
`adapter_model.safetensors`, the format `peft`'s `save_pretrained` writes.

Every check runs when the adapter is first loaded (at `add_request`), so a bad folder is a
ValueError naming the file, the key and the allowed values before the engine changes. The
weights are kept per HF module (`q_proj` ... `down_proj`): A `[r, in]`, B `[out, r]`, and the
delta of a module is `scaling * x @ A.T @ B.T` with scaling = alpha / r (rsLoRA: alpha / sqrt(r)).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine_core.lora.request import LoRARequest
from engine_core.models.config import LlamaArgs
from engine_core.models.loader import check_finite, open_safetensors, read_json
from engine_core.models.lora import FUSED_MODULES, module_shapes
from engine_core.validation import check_int, check_real

if TYPE_CHECKING:
    from engine_core.models.llama import LlamaForCausalLM

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
TARGET_MODULES = tuple(m for mods in FUSED_MODULES.values() for m in mods)  # q_proj ... down_proj
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# Options that change the math beyond plain LoRA: their value must be the default.
_PLAIN = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
          "lora_bias": (False, None), "use_qalora": (False, None), "rank_pattern": ({}, None),
          "alpha_pattern": ({}, None), "modules_to_save": (None, []), "layer_replication": (None,),
          "target_parameters": (None, []), "alora_invocation_tokens": (None,), "trainable_token_indices": (None,)}


@dataclass
class LoRAAdapter:
    """One loaded adapter in host memory, in the model's dtype."""

    lora_int_id: int
    lora_name: str
    path: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A [r, in], B [out, r])

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.weights}, key=TARGET_MODULES.index)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(request: LoRARequest, args: LlamaArgs, max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check `request.lora_path`; raises ValueError naming what is wrong."""
    folder = Path(request.lora_path).expanduser()
    where = f"LoRA adapter {request.lora_name!r} (lora_path {str(folder)!r})"
    if not folder.is_dir():
        raise ValueError(f"{where}: lora_path is not a folder; a PEFT adapter folder holds {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE}")
    config = _read_config(folder, where)
    rank = check_int(f"{where}: {CONFIG_FILE} 'r'", config.get("r"), 1)
    if rank > max_lora_rank:
        raise ValueError(f"{where}: rank r={rank} exceeds max_lora_rank={max_lora_rank}; raise max_lora_rank "
                         f"to at least {rank}")
    alpha = check_real(f"{where}: {CONFIG_FILE} 'lora_alpha'", config.get("lora_alpha", 8))
    _check_targets(config.get("target_modules"), where)
    weights = _read_weights(folder, where, rank, args, dtype)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return LoRAAdapter(request.lora_int_id, request.lora_name, folder, rank, float(scaling), weights)


@torch.no_grad()
def merge_adapter(model: LlamaForCausalLM, adapter: LoRAAdapter) -> None:
    """W += scaling * B @ A for every module the adapter targets, into the model's fused weights: the
    merged serving that unmerged batching is measured against (lab 09, `make bench-lora`)."""
    shapes = module_shapes(model.args)
    for i, layer in enumerate(model.layers):
        fused = {"qkv": layer.attn.qkv_proj.weight, "o": layer.attn.o_proj.weight,
                 "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight}
        for name, modules in FUSED_MODULES.items():
            row = 0
            for m in modules:
                size = shapes[m][1]
                if (i, m) in adapter.weights:
                    a, b = (t.to(fused[name].device) for t in adapter.weights[(i, m)])
                    fused[name][row:row + size] += adapter.scaling * (b @ a)
                row += size


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{where}: missing {CONFIG_FILE}")
    try:
        config = read_json(path)
    except ValueError as e:  # names the file and the line
        raise ValueError(f"{where}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{where}: {CONFIG_FILE} peft_type must be 'LORA', got {config.get('peft_type')!r}")
    for key, allowed in _PLAIN.items():
        if config.get(key, allowed[0]) not in allowed:
            raise ValueError(f"{where}: {CONFIG_FILE} {key}={config[key]!r} is not supported (allowed: "
                             f"{' or '.join(repr(a) for a in allowed)})")
    return config


def _check_targets(targets: Any, where: str) -> None:
    """A list must name supported modules only; a regex string is checked through the tensor names."""
    if isinstance(targets, (list, tuple)):
        if not all(isinstance(t, str) for t in targets):
            raise ValueError(f"{where}: {CONFIG_FILE} target_modules must hold module names (str), got {targets!r}")
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"{where}: target_modules {unknown} not supported; supported: {list(TARGET_MODULES)}")
    elif not isinstance(targets, str):
        raise ValueError(f"{where}: {CONFIG_FILE} target_modules must be a list or a str, got {targets!r}")


def _read_weights(folder: Path, where: str, rank: int, args: LlamaArgs,
                  dtype: torch.dtype) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        hint = ""
        if (folder / "adapter_model.bin").is_file():
            hint = " (only safetensors is read: save with safe_serialization=True)"
        raise ValueError(f"{where}: missing {WEIGHTS_FILE}{hint}")
    shapes = module_shapes(args)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        opened = open_safetensors(path)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    with opened as f:
        for key in f.keys():
            m = _KEY.fullmatch(key)
            if m is None or m.group(3) not in TARGET_MODULES:
                raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight of a supported module; supported: "
                                 f"{list(TARGET_MODULES)} of model.layers.N")
            layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
            if layer >= args.num_layers:
                raise ValueError(f"{where}: tensor {key!r}: layer {layer} but the base model has {args.num_layers}")
            tensor = f.get_tensor(key)
            if not tensor.is_floating_point():
                raise ValueError(f"{where}: tensor {key!r} is stored as {tensor.dtype}; LoRA weights must be "
                                 f"floating point")
            in_f, out_f = shapes[module]
            expected = (rank, in_f) if ab == "A" else (out_f, rank)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{where}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {expected} "
                                 f"(r={rank}, the base model's {module} is {in_f} -> {out_f})")
            found.setdefault((layer, module), {})[ab] = _finite(tensor, key, path, dtype, where)
    if not found:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{'A' if 'A' in ab else 'B'} but no "
                             f"lora_{'B' if 'A' in ab else 'A'}")
    return {k: (v["A"], v["B"]) for k, v in sorted(found.items())}


def _finite(tensor: torch.Tensor, key: str, path: Path, dtype: torch.dtype, where: str) -> torch.Tensor:
    """`tensor` in `dtype`; NaN or infinite values (also those the conversion overflows into) are a
    ValueError: they would make every request of the adapter fail at its first step."""
    try:
        check_finite(tensor, key, path, "")
        converted = tensor.to(dtype)
        if torch.finfo(dtype).max < torch.finfo(tensor.dtype).max:
            check_finite(converted, key, path, f" after conversion to {dtype} (values out of its range)")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return converted
