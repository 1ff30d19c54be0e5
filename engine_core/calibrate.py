"""Static fp8 KV scales from a calibration run: the largest |K| and |V| per layer and KV head over a
small prompt set, written to a file that `LLM(..., kv_cache_scales=path)` loads.

    python -m engine_core.calibrate --model tiny-llama --out scales.json [--prompts prompts.txt]
                                    [--linear-out act_amax.json]

`--linear-out` also records, in the same run, every decoder projection's largest |input| per channel:
the file `quantization_config={"smoothquant": FILE}` reads (SmoothQuant's calibration).

The run uses a model-dtype KV cache (`kv_cache_dtype="auto"`, no CUDA graphs) with an observer on
it (`worker.kv_scales.AmaxRecorder`) that sees every layer's K and V for every prompt token and the
`--max-tokens` generated after it. The file holds maxima, not scales: one file serves e4m3 and
e5m2 caches, per-tensor (the max over heads) and per-head scales alike. Calibrated scales are
fixed before the first request, unlike `calculate_kv_scales=True` (dynamic: the first batch's
maxima), so no later token is larger than what they were sized for, as long as the prompt set is
like the traffic.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from engine_core.engine import LLMEngine
from engine_core.models.quantization.smoothquant import save_linear_amax
from engine_core.request import SamplingParams
from engine_core.worker.kv_scales import AmaxRecorder, KVAmax, save_kv_amax

# The default prompt set: varied English, a few hundred tokens in all.
DEFAULT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In a paged KV cache, every sequence owns a list of fixed-size blocks.",
    "Write a short poem about the sea at night.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Question: what is the capital of France? Answer:",
    "Once upon a time, in a village at the edge of a forest, there lived an old clockmaker.",
    "1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144,",
    "Summarize: the meeting was moved to Thursday because the projector was broken.",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
    "Les modèles de langage prédisent le mot suivant à partir du contexte.",
    "Translate to German: the weather is nice today.",
    "A list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29,",
    "<html><body><h1>Hello</h1><p>World</p></body></html>",
    "Dear team, thank you all for the hard work on this release.",
    "The mitochondria is the powerhouse of the cell, producing ATP through respiration.",
    "To be, or not to be, that is the question.",
]


def calibrate_kv_amax(model: str, prompts: Sequence[str | list[int]] | None = None, max_tokens: int = 16,
                      **engine_args: Any) -> KVAmax:
    """Per layer and KV head, the largest |K| and |V| over `prompts` (default: DEFAULT_PROMPTS) and
    `max_tokens` greedy tokens after each. `engine_args` are EngineConfig fields (device, dtype, ...)."""
    return calibrate(model, prompts, max_tokens, **engine_args)[0]


def calibrate(model: str, prompts: Sequence[str | list[int]] | None = None, max_tokens: int = 16,
              **engine_args: Any) -> tuple[KVAmax, dict[str, torch.Tensor]]:
    """One calibration run: the KV maxima of `calibrate_kv_amax`, and each decoder projection's largest
    |input| per channel under its first checkpoint name (q|k|v under q_proj, gate|up under gate_proj)."""
    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    engine = LLMEngine.from_kwargs(model, **{**engine_args, "kv_cache_dtype": "auto", "enforce_eager": True})
    args = engine.model_config.args
    recorder = AmaxRecorder(args.num_layers, args.num_kv_heads, engine.config.device)
    engine.runner.kv_cache.observer = recorder
    linear_amax: dict[str, torch.Tensor] = {}
    hooks = [proj.register_forward_pre_hook(_amax_hook(linear_amax, name))
             for name, proj in _projections(engine.runner.model)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"calibrate-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    for hook in hooks:
        hook.remove()
    return recorder.result(f"calibration of {model!r} on {len(prompts)} prompts"), linear_amax


def _projections(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(first checkpoint name, Linear) of every decoder projection, as models/llama.py builds them."""
    out = []
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj", layer.attn.qkv_proj), (f"{p}.self_attn.o_proj", layer.attn.o_proj),
                (f"{p}.mlp.gate_proj", layer.mlp.gate_up_proj), (f"{p}.mlp.down_proj", layer.mlp.down_proj)]
    return out


def _amax_hook(into: dict[str, torch.Tensor], name: str):
    def hook(module: torch.nn.Module, args: tuple) -> None:
        x = args[0]
        if x.numel():
            seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float().cpu()
            into[name] = seen if name not in into else torch.maximum(into[name], seen)
    return hook


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a preset name or a checkpoint folder")
    ap.add_argument("--out", required=True, help="the JSON file to write (LLM(..., kv_cache_scales=OUT) reads it)")
    ap.add_argument("--prompts", help="a text file, one prompt per line (default: a built-in set of 16)")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated after each prompt")
    ap.add_argument("--linear-out", help="also write each projection's input maxima here (for SmoothQuant)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args(argv)
    prompts = None
    if a.prompts:
        prompts = [line for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    amax, linear_amax = calibrate(a.model, prompts, a.max_tokens, device=a.device, dtype=a.dtype)
    save_kv_amax(a.out, amax, a.model, dict(num_prompts=len(prompts or DEFAULT_PROMPTS), max_tokens=a.max_tokens))
    if a.linear_out:
        save_linear_amax(a.linear_out, linear_amax, a.model)
        print(f"wrote {a.linear_out}: input maxima of {len(linear_amax)} projections")
    print(f"wrote {a.out}: max |K| per layer {[round(x, 3) for x in amax.key.amax(1).tolist()]}, "
          f"max |V| per layer {[round(x, 3) for x in amax.value.amax(1).tolist()]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
