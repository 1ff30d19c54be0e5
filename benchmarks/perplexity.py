"""Perplexity and teacher-forced top-1 agreement on real English: fp32 vs bf16 vs the fp8 KV formats.

    python -m benchmarks.perplexity --model smollm2-135m-instruct [--max-tokens 10240] [--context 512]

The text is docs/data/eval_text.txt: the prose of the kit's own lab notebooks (markdown cells, code
and tables left out), written by this project, so it ships with the kit (`--write-text` rebuilds
it from solutions/). It is cut into windows of `--context` tokens; every window is one prefill
through the engine's own model and KV cache (fp8 caches quantize K/V as they are written and the
attention reads them back from the cache), and each position predicts the next token of the text.

Each row reports, over every predicted position: the perplexity exp(mean NLL of the text's next
token), and top-1 agreement: how often the row's argmax equals the fp32 run's argmax. The fp32
run (fp32 weights, fp32 KV cache) is the reference. Rows: bf16 (weights, activations and KV cache),
then each fp8 format (e4m3, e5m2) with each scale mode:

- `dynamic` / `dynamic per-head`: `calculate_kv_scales=True`, scales set from the first batch the
  cache sees, which (as in serving) is a short chat prompt: SmolLM2's template with its default
  system prompt and one question, run before the text;
- `calibrated` / `calibrated per-head`: `kv_cache_scales=` a file from `engine_core.calibrate`
  (its 16 built-in prompts, not the text);
- `dynamic amax/200 K amax/100 V` (vLLM's older fixed headroom; a benchmark-only observer): the
  first batch's amax divided by 200 (K) and 100 (V) instead of the format's max, so values up to
  2.2x (K) and 4.5x (V) the first batch's still fit in e4m3.

With `--quantization int8,rtn-g32,...` the rows are weight quantization instead (docs/weight_quantization.md):
the fp32 reference, then each scheme's projections (fp32 activations and KV cache, dense LM head):
`int8` (W8A8), `rtn-gG` (W4A16, group G), `rtn8-gG` (W8A16, group G); `bf16` (dense bf16) and `gguf-bf16` (the real
preset's Q4_1 blocks served as int4, `quantization="gguf"`) in bf16, the others in fp32.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import teacher_forced_hidden
from engine_core.calibrate import calibrate, calibrate_kv_amax
from engine_core.engine import LLMEngine
from engine_core.models.quantization.smoothquant import save_linear_amax
from engine_core.request import SamplingParams
from engine_core.worker.kv_scales import DynamicScales, amax_per_head, save_kv_amax

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "docs" / "data" / "eval_text.txt"
FORMATS = ("fp8_e4m3", "fp8_e5m2")
MODES = ("dynamic", "dynamic per-head", "calibrated", "calibrated per-head", "dynamic amax/200 K amax/100 V")
FIRST_BATCH = [{"role": "user", "content": "What is the capital of France?"}]
BLOCK_SIZE = 16
WINDOWS_PER_FORWARD = 4
QUANT_SCHEMES = ("int8", "int8-sq", "rtn-g32", "rtn-g64", "rtn-g128", "rtn8-g32", "rtn8-g128", "bf16", "gguf-bf16",
                 "fp8-tensor", "fp8-channel")
# fp8: per-tensor weights and activations (vLLM's online default), or per-channel weights and per-token activations
_FP8_SCHEMES = {"fp8-tensor": ("tensor", "tensor"), "fp8-channel": ("channel", "token")}
_BF16_SCHEMES = ("bf16", "gguf-bf16")  # rows in bf16 (the int4 kernel's activations); the others fp32


@dataclass
class Row:
    label: str
    perplexity: float
    top1_agreement: float  # argmax equal to the fp32 reference's argmax
    seconds: float


def _prose(markdown: str) -> str:
    """Markdown minus fenced code, indented code and table lines."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not (fenced or line.lstrip().startswith("|") or line.startswith("    ")):
            lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def collect_text(solutions: Path = ROOT / "solutions") -> str:
    """The markdown prose of every lab notebook under `solutions`, in lab order."""
    parts = []
    for nb in sorted(solutions.rglob("*.ipynb")):
        for cell in json.loads(nb.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "markdown" and (text := _prose("".join(cell["source"]))):
                parts.append(text)
    return "\n\n".join(parts) + "\n"


def windows(token_ids: list[int], context: int, max_tokens: int) -> list[list[int]]:
    """The first `max_tokens` ids cut into windows of `context` (a shorter last one kept if >= 2 ids)."""
    ids = token_ids[:max_tokens]
    return [ids[i:i + context] for i in range(0, len(ids), context) if len(ids[i:i + context]) >= 2]


class HeadroomScales(DynamicScales):
    """vLLM's older dynamic scales: first batch's amax / 200 for K and / 100 for V (per tensor)."""

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        cache = self.kv_cache
        for scale, x, divisor in ((cache.k_scale[layer], key, 200.0), (cache.v_scale[layer], value, 100.0)):
            amax = amax_per_head(x).amax()
            scale.copy_(torch.where(amax > 0, amax / divisor, torch.ones_like(amax)))
        if layer == cache.num_layers - 1:
            cache.observer = None


@torch.inference_mode()
def score(engine: LLMEngine, wins: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(NLL of each next token, argmax at each position), over positions 0..n-2 of every window,
    each window one prefill through the engine's model and KV cache (blocks 0.. of the cache)."""
    model, device = engine.runner.model, engine.runner.device
    nll, top1 = [], []
    for b in range(0, len(wins), WINDOWS_PER_FORWARD):
        batch = wins[b:b + WINDOWS_PER_FORWARD]
        hidden, qsl = teacher_forced_hidden(engine, batch)
        for i, w in enumerate(batch):
            rows = hidden[int(qsl[i]):int(qsl[i + 1]) - 1]
            logp = torch.log_softmax(model.compute_logits(rows).float(), -1)
            target = torch.tensor(w[1:], device=device)
            nll.append(-logp.gather(1, target[:, None])[:, 0].double().cpu())
            top1.append(logp.argmax(-1).cpu())
    return torch.cat(nll), torch.cat(top1)


def quantization_kwargs(scheme: str, linear_amax: Path | None = None) -> dict[str, Any]:
    """`int8` / `int8-sq` (SmoothQuant alpha 0.5, maxima from `linear_amax`) / `rtn-g32` / `rtn8-g128` -> the
    engine's quantization arguments."""
    if scheme == "int8":
        return dict(quantization="int8")
    if scheme == "bf16":
        return {}
    if scheme == "gguf-bf16":  # the real preset's own Q4_1 / Q8_0 blocks as llama.cpp computes them
        from engine_core.presets_real import gguf_path
        return dict(quantization="gguf", quantization_config={"file": str(gguf_path())})
    if scheme in _FP8_SCHEMES:
        weights, activations = _FP8_SCHEMES[scheme]
        return dict(quantization="fp8", quantization_config={"weight_strategy": weights,
                                                             "activation_strategy": activations})
    if scheme == "int8-sq":
        return dict(quantization="int8", quantization_config={"smoothquant": str(linear_amax), "alpha": 0.5})
    kind, group = scheme.split("-g")
    return dict(quantization="rtn", quantization_config={"bits": 8 if kind == "rtn8" else 4, "group_size": int(group)})


def build_engine(model: str, context: int, dtype: str, kv_cache_dtype: str = "auto", mode: str = "",
                 scales_file: Path | None = None, device: str = "auto", quant: str | None = None,
                 linear_amax: Path | None = None) -> LLMEngine:
    """An engine whose cache holds one forward's windows; fp8 modes get their scales, and dynamic ones
    see the chat prompt FIRST_BATCH before the text; `quant`: one of QUANT_SCHEMES."""
    blocks = WINDOWS_PER_FORWARD * -(-context // BLOCK_SIZE)
    kw: dict[str, Any] = quantization_kwargs(quant, linear_amax) if quant else {}
    if kv_cache_dtype != "auto":
        if mode.startswith("dynamic"):
            kw.update(calculate_kv_scales=True, kv_scales_per_head=mode == "dynamic per-head")
        else:
            kw.update(kv_cache_scales=str(scales_file), kv_scales_per_head=mode.endswith("per-head"))
    engine = LLMEngine.from_kwargs(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK_SIZE,
                                   num_gpu_blocks=blocks, max_num_seqs=4, swap_space=0, enforce_eager=True,
                                   device=device, **kw)
    if mode == "dynamic amax/200 K amax/100 V":
        engine.runner.kv_cache.observer = HeadroomScales(engine.runner.kv_cache, per_head=False)
    if engine.tokenizer is not None and getattr(engine.tokenizer, "chat_template", None):
        prompt = engine.tokenizer.apply_chat_template(FIRST_BATCH, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        engine.add_request("first-batch", prompt, SamplingParams(max_tokens=8, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
    return engine


def evaluate(model: str, text: str, context: int, max_tokens: int, formats: list[str], modes: list[str],
             device: str = "auto", bf16: bool = True, quant: list[str] | None = None) -> tuple[list[Row], int]:
    """The fp32 reference row, then bf16 and one row per format x mode, or (`quant`) one row per weight
    quantization scheme; and the number of scored positions."""
    t0 = time.perf_counter()
    reference = build_engine(model, context, "float32", device=device)
    if reference.tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer: the text cannot be scored")
    ids = list(reference.tokenizer.encode(text, add_special_tokens=False))
    wins = windows(ids, context, max_tokens)
    if not wins:
        raise ValueError(f"the text has {len(ids)} tokens: too few for one window")

    def row(label: str, engine: LLMEngine, start: float) -> tuple[Row, torch.Tensor]:
        nll, top1 = score(engine, wins)
        agree = 1.0 if ref_top1 is None else (top1 == ref_top1).double().mean().item()
        r = Row(label, math.exp(nll.mean().item()), agree, time.perf_counter() - start)
        print(line(r), flush=True)
        return r, top1

    ref_top1 = None
    fp32, ref_top1 = row("fp32 (reference)", reference, t0)
    del reference
    rows = [fp32]
    if quant:
        with tempfile.TemporaryDirectory() as tmp:
            linear_amax = Path(tmp) / "linear_amax.json"
            if "int8-sq" in quant:  # SmoothQuant's maxima from the calibration prompts, not from the scored text
                save_linear_amax(linear_amax, calibrate(model, device=device, dtype="float32", swap_space=0,
                                                        kv_cache_memory_bytes=64 << 20)[1], model)
            for scheme in quant:
                t = time.perf_counter()
                dtype = "bfloat16" if scheme in _BF16_SCHEMES else "float32"
                engine = build_engine(model, context, dtype, device=device, quant=scheme, linear_amax=linear_amax)
                r, _ = row(f"{scheme} ({engine.stats()['weight_bytes'] / 2**20:.0f} MiB of weights)", engine, t)
                rows.append(r)
        return rows, sum(len(w) - 1 for w in wins)
    if bf16:
        t = time.perf_counter()
        rows.append(row("bf16 weights + KV cache", build_engine(model, context, "bfloat16", device=device), t)[0])
    with tempfile.TemporaryDirectory() as tmp:
        scales_file = Path(tmp) / "scales.json"
        if any(m.startswith("calibrated") for m in modes):
            save_kv_amax(scales_file, calibrate_kv_amax(model, device=device, dtype="float32", swap_space=0,
                                                        kv_cache_memory_bytes=64 << 20), model)
        for fmt in formats:
            for mode in modes:
                t = time.perf_counter()
                engine = build_engine(model, context, "float32", fmt, mode, scales_file, device)
                rows.append(row(f"{fmt}, {mode}", engine, t)[0])
    return rows, sum(len(w) - 1 for w in wins)


HEADER = "| weights / KV cache | perplexity | top-1 agreement with fp32 | seconds |\n|---|---|---|---|"


def line(r: Row) -> str:
    return f"| {r.label} | {r.perplexity:.3f} | {100 * r.top1_agreement:.2f}% | {r.seconds:.0f} |"


def _choices(allowed: tuple[str, ...], name: str):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{name} must be a comma-separated subset of {list(allowed)}, "
                                             f"got {text!r}")
        return items
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a preset name or a checkpoint folder")
    ap.add_argument("--text", type=Path, default=TEXT, help="a UTF-8 text file (default: the kit's lab prose)")
    ap.add_argument("--context", type=int, default=512, help="tokens per window (each window one prefill)")
    ap.add_argument("--max-tokens", type=int, default=10240,
                    help="score the text's first N tokens (default: 20 windows of 512, ~2 min a row on 2 shared cores)")
    ap.add_argument("--formats", type=_choices(FORMATS, "--formats"), default=list(FORMATS))
    ap.add_argument("--modes", type=_choices(MODES, "--modes"), default=list(MODES),
                    help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--no-bf16", action="store_true", help="leave out the bf16 row")
    ap.add_argument("--quantization", type=_choices(QUANT_SCHEMES, "--quantization"), default=None,
                    help=f"weight quantization rows instead of the bf16 / fp8 KV rows, comma-separated, of "
                         f"{list(QUANT_SCHEMES)}")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--write-text", action="store_true", help="rebuild --text from solutions/ and exit")
    a = ap.parse_args(argv)
    if a.context < 2 or a.max_tokens < 2:
        ap.error("--context and --max-tokens must be >= 2")
    if a.write_text:
        a.text.parent.mkdir(parents=True, exist_ok=True)
        a.text.write_text(collect_text(), encoding="utf-8")
        print(f"wrote {a.text}")
        return 0
    rows, n = evaluate(a.model, a.text.read_text(encoding="utf-8"), a.context, a.max_tokens, a.formats, a.modes,
                       a.device, bf16=not a.no_bf16, quant=a.quantization)
    print(f"\n{a.model}: {n} predicted positions of {a.text.name}, windows of {a.context} tokens\n")
    print(HEADER)
    for r in rows:
        print(line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
