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

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engine_core.memory import ModelSpec
from engine_core.models.loader import check_float_dtype, read_config, read_eos_token_ids, read_tensor_infos
from engine_core.presets import resolve_model
from engine_core.validation import check_bool, check_int, check_real, describe

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
        """Parse config.json's fields, each checked for type and range; errors name `source` and the field."""
        archs = c.get("architectures") or []
        if not isinstance(archs, list):
            raise ValueError(f"{source}: architectures must be a list of class names, got {describe(archs)}")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: architectures {archs} not supported; "
                             f"supported: {list(SUPPORTED_ARCHITECTURES)}")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {c['hidden_act']!r} not supported (only 'silu')")
        f = _Fields(c, source)
        heads, hidden = f.integer("num_attention_heads"), f.integer("hidden_size")
        kv_heads = f.integer("num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads={heads} must be a multiple of num_key_value_heads="
                             f"{kv_heads} (each KV head serves a whole group of query heads)")
        head_dim = f.integer("head_dim", None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                                 f"give head_dim")
            head_dim = hidden // heads
        if head_dim % 2:
            raise ValueError(f"{source}: the head dimension must be even for rotary embeddings, got {head_dim}")
        qwen2, qwen3 = arch.startswith("Qwen2"), arch.startswith("Qwen3")
        bias = f.flag("attention_bias") and arch != "MistralForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=f.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_layers=f.integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            max_position_embeddings=f.integer("max_position_embeddings", 2048),
            qkv_bias=qwen2 or bias,
            o_bias=bias and not qwen2,
            mlp_bias=f.flag("mlp_bias"),
            qk_norm=qwen3,
            tie_word_embeddings=f.flag("tie_word_embeddings"),
            sliding_window=_sliding_window(f, arch),
            rope=_rope_params(c, source),
        )

    def window(self, max_model_len: int) -> int | None:
        """The sliding window that matters at `max_model_len` (None: every query sees its whole context)."""
        return self.sliding_window if self.sliding_window is not None and self.sliding_window < max_model_len else None

    def check_sliding_window(self, max_model_len: int, attention_backend: str, speculative_method: str | None,
                             kv_eviction: str | None = None) -> None:
        """A window that matters runs on the `torch` backend's windowed attention (kernels/reference.py;
        "auto" picks it); the cpu and triton kernels and a draft model attend to the whole context: refused."""
        window = self.window(max_model_len)
        if window is None:
            return
        if attention_backend not in ("auto", "torch"):
            raise ValueError(f"attention_backend={attention_backend!r} cannot honour the model's sliding_window="
                             f"{window} (its kernels attend to the whole context): use 'torch' or 'auto' (which "
                             f"picks 'torch' for a windowed model), or max_model_len <= {window}")
        if kv_eviction is not None:
            raise ValueError(f"kv_eviction={kv_eviction!r} is not supported with the model's sliding_window={window} "
                             f"< max_model_len={max_model_len} (the window already bounds the KV): use None")
        if speculative_method == "draft_model":
            raise ValueError(f"speculative_config method 'draft_model' is not supported with the model's "
                             f"sliding_window={window} < max_model_len={max_model_len}: use method 'ngram'")

    def model_spec(self) -> ModelSpec:
        """The shape numbers the capacity model (lab 01) and the preemption cost model use."""
        return ModelSpec(num_layers=self.num_layers, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                         tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.qkv_bias,
                         o_proj_bias=self.o_bias, qk_norm=self.qk_norm)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the decoder reads (models/llama.py), by checkpoint name, with its shape.
        `lm_head.weight` is listed even when tied (a tied checkpoint may omit it)."""
        hidden, inter, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        shapes = {"model.embed_tokens.weight": (self.vocab_size, hidden), "model.norm.weight": (hidden,),
                  "lm_head.weight": (self.vocab_size, hidden)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                     "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
                     "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
                     "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
                     "mlp.down_proj.weight": (hidden, inter)}
            if self.qkv_bias:
                layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                              "self_attn.v_proj.bias": (kv,)})
            if self.o_bias:
                layer["self_attn.o_proj.bias"] = (hidden,)
            if self.qk_norm:
                layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
            if self.mlp_bias:
                layer.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (hidden,)})
            shapes.update({f"{p}.{name}": shape for name, shape in layer.items()})
        return shapes


def _sliding_window(f: "_Fields", arch: str) -> int | None:
    """Mistral applies `sliding_window` to every layer when set; Qwen2/3 only with `use_sliding_window`, and
    only to the layers from `max_window_layers` on (`layer_types`): a mix of full and windowed layers is refused."""
    if arch.startswith("Qwen"):
        if not f.flag("use_sliding_window"):
            return None
        num_layers = f.integer("num_hidden_layers")
        first = f.integer("max_window_layers", 28, lo=0)
        types = f.c.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(num_layers)]
        if any(t != "sliding_attention" for t in types):
            raise ValueError(f"{f.source}: use_sliding_window with full-attention layers (layer_types / "
                             f"max_window_layers={first} > 0) is not supported: every layer must be windowed")
    return f.integer("sliding_window", None, lo=0) or None


def _rope_params(c: dict[str, Any], source: str) -> dict[str, Any]:
    """Accept transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters / rope_scaling must be an object, got {describe(params)}")
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    if params["rope_type"] not in _ROPE_TYPES:
        raise ValueError(f"{source}: rope_type {params['rope_type']!r} not supported; supported: {list(_ROPE_TYPES)}")
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", c.get("max_position_embeddings", 2048))
    f = _Fields(params, f"{source}: rope_parameters")
    f.number("rope_theta", lo_open=True)
    if params["rope_type"] in ("linear", "llama3"):
        f.number("factor", lo_open=True)
    if params["rope_type"] == "llama3":
        f.integer("original_max_position_embeddings")
        if not f.number("low_freq_factor", lo_open=True) < f.number("high_freq_factor", lo_open=True):
            raise ValueError(f"{source}: rope_parameters low_freq_factor must be < high_freq_factor, got "
                             f"{params['low_freq_factor']} and {params['high_freq_factor']}")
    return params


_REQUIRED: Any = object()


class _Fields:
    """A config dict's fields read with types: errors name the file and the field."""

    def __init__(self, c: dict[str, Any], source: str) -> None:
        self.c, self.source = c, source

    def _get(self, key: str, default: Any, allowed: str) -> Any:
        value = self.c.get(key, default)
        if value is _REQUIRED:
            raise ValueError(f"{self.source}: missing field {key!r} ({allowed})")
        return value

    def integer(self, key: str, default: Any = _REQUIRED, lo: int = 1) -> Any:
        value = self._get(key, default, f"an int >= {lo}")
        return value if value is None else _prefixed(self.source, check_int, key, value, lo)

    def number(self, key: str, default: Any = _REQUIRED, lo_open: bool = True) -> float:
        return _prefixed(self.source, check_real, key, self._get(key, default, "a finite number > 0"), 0.0,
                         lo_open=lo_open)

    def flag(self, key: str) -> bool:
        value = self.c.get(key)
        return False if value is None else _prefixed(self.source, check_bool, key, value)


def _prefixed(source: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return check(*args, **kwargs)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


@dataclass(frozen=True)
class ModelConfig:
    """One model folder, read once: where it is, its parsed args, EOS ids, stored dtype, tokenizer presence."""

    path: Path
    args: LlamaArgs
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: torch.dtype | None  # config.json's `dtype` / `torch_dtype`, when a float type
    has_tokenizer: bool

    @classmethod
    def load(cls, folder: str | Path) -> "ModelConfig":
        """`folder`: a Hugging Face checkpoint folder (a preset name goes through `presets.resolve_model` first,
        so parsing never builds a preset). config.json is checked against the weights' headers here, before
        anything is built (see `check_weights`)."""
        path = Path(folder)
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json (a preset name is resolved to its folder "
                             f"by engine_core.presets.resolve_model)")
        hf_config = read_config(path)
        args = LlamaArgs.from_config(hf_config, source=str(path / "config.json"))
        check_weights(path, args, packed_quant_method(hf_config) is not None)
        eos, eos_source = read_eos_token_ids(path, hf_config)
        bad = [e for e in eos if e >= args.vocab_size]
        if bad:
            raise ValueError(f"{eos_source!r}: eos_token_id {bad[0]} is outside the vocabulary "
                             f"(vocab_size={args.vocab_size} in config.json)")
        stored = getattr(torch, str(hf_config.get("dtype") or hf_config.get("torch_dtype") or ""), None)
        return cls(path=path, args=args, eos_token_ids=tuple(eos),
                   checkpoint_dtype=stored if isinstance(stored, torch.dtype) else None,
                   has_tokenizer=(path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file())

    def load_tokenizer(self) -> Any:
        """The folder's tokenizer, or None when it has none (token-id prompts only)."""
        if not self.has_tokenizer:
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path)
        except Exception as e:  # a malformed tokenizer.json surfaces as anything from JSON to Rust errors
            raise ValueError(f"model folder {str(self.path)!r}: its tokenizer files (tokenizer.json, "
                             f"tokenizer_config.json) cannot be loaded: {type(e).__name__}: {e}") from None


_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.[kv]_scale")


def _is_kv_scale(name: str, num_layers: int) -> bool:
    """An FP8 checkpoint's k_scale / v_scale of a layer that exists: read (and checked) by
    engine_core.worker.kv_scales, not by the decoder."""
    match = _KV_SCALE.fullmatch(name)
    return match is not None and int(match.group(1)) < num_layers


_PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def packed_quant_method(hf_config: dict[str, Any]) -> str | None:
    """"gptq" or "awq" when config.json's `quantization_config` says the projections are stored packed."""
    options = hf_config.get("quantization_config")
    method = str(options.get("quant_method", "")).lower() if isinstance(options, dict) else ""
    return method if method in ("gptq", "awq") else None


def check_weights(folder: Path, args: LlamaArgs, packed: bool = False) -> None:
    """config.json against the safetensors headers (no tensor data is read): every tensor the decoder
    reads exists, is floating point and has the shape the config implies; no weights are left over
    (a layer beyond num_hidden_layers, a bias the config switches off), which would otherwise load
    silently and compute something else. Errors name the tensor, its file and the config field.
    `packed` (a GPTQ/AWQ checkpoint): each projection's `weight` is its `qweight`, `qzeros`, `scales`,
    `g_idx`, checked by models/quantization/packed.py as they load."""
    infos = read_tensor_infos(folder)
    expected = args.weight_shapes()
    if packed:
        projections = [n for n in expected if n.endswith(tuple(f"{p}.weight" for p in _PROJECTIONS))]
        for name in projections:
            del expected[name]
        allowed = {f"{n.removesuffix('.weight')}.{part}" for n in projections for part in _PACKED_PARTS}
        infos = {n: i for n, i in infos.items() if n not in allowed}
    for name, shape in expected.items():
        info = infos.get(name)
        if info is None:
            if name == "lm_head.weight" and args.tie_word_embeddings:
                continue
            files = sorted({i.file.name for i in infos.values()}) or ["(no tensors)"]
            raise ValueError(f"checkpoint {str(folder)!r} ({', '.join(files)}) is missing tensor {name!r}")
        check_float_dtype(name, info)
        if info.shape != shape:
            raise ValueError(f"tensor {name!r} in {str(info.file)!r} has shape {list(info.shape)}, but config.json "
                             f"({_shape_fields(name)}) implies {list(shape)}")
    extra = sorted(n for n in infos if n not in expected and not n.endswith("rotary_emb.inv_freq")
                   and not _is_kv_scale(n, args.num_layers))
    if extra:
        layers = sorted({int(n.split(".")[2]) for n in extra if n.startswith("model.layers.")
                         and n.split(".")[2].isdigit()})
        if layers and layers[-1] >= args.num_layers:
            raise ValueError(f"checkpoint {str(folder)!r} has weights for layer {layers[-1]}, but config.json "
                             f"num_hidden_layers={args.num_layers}")
        raise ValueError(f"checkpoint {str(folder)!r} has tensors the model would ignore: {extra[:4]}"
                         f"{' ...' if len(extra) > 4 else ''} (check config.json's attention_bias, mlp_bias, "
                         f"architectures)")


def _shape_fields(tensor_name: str) -> str:
    """The config.json fields a tensor's shape follows from."""
    if tensor_name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "vocab_size, hidden_size"
    if any(p in tensor_name for p in ("q_proj", "o_proj")):
        return "num_attention_heads, head_dim, hidden_size"
    if any(p in tensor_name for p in ("k_proj", "v_proj")):
        return "num_key_value_heads, head_dim, hidden_size"
    if any(p in tensor_name for p in ("q_norm", "k_norm")):
        return "head_dim"
    return "intermediate_size, hidden_size" if ".mlp." in tensor_name else "hidden_size"


def check_draft_model(model: str, vocab_size: int, max_model_len: int) -> ModelConfig:
    """The draft checkpoint's config, checked against the target: the same vocab_size (drafts are target
    token ids, q and p the same support) and a context of at least max_model_len."""
    try:
        draft = ModelConfig.load(resolve_model(model))  # a draft preset is built here, on first use
    except ValueError as error:
        raise ValueError(f"speculative_config['model']: {error}") from None
    if draft.args.vocab_size != vocab_size:
        raise ValueError(f"speculative_config['model']={model!r} has vocab_size {draft.args.vocab_size}; a draft "
                         f"model needs the target's vocabulary, vocab_size {vocab_size}")
    if draft.args.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config['model']={model!r} has max_position_embeddings "
                         f"{draft.args.max_position_embeddings}, shorter than max_model_len {max_model_len}: the "
                         f"draft must cover the target's context (pass a smaller max_model_len)")
    return draft
