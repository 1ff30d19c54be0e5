"""How much an fp8 KV cache changes a model's outputs (`make fp8-accuracy`, docs/fp8_kv_cache.md).

    python -m benchmarks.fp8_accuracy [--presets tiny-llama,small-llama] [--num-prompts 256] [--output-len 64]

For each model, one fp32-KV run (`kv_cache_dtype="auto"`) is the reference, then every fp8 format
(e4m3, e5m2) with dynamic scales (`calculate_kv_scales`), static per-tensor and static per-head
scales (calibrated with `engine_core.calibrate` on its default prompt set, not the test prompts):

- free-running greedy agreement: the share of output tokens equal up to each prompt's first
  difference (paths diverge after it), and the share of prompts with identical outputs;
- teacher forcing: both caches read the fp32 run's own sequence (one prefill of prompt + output,
  every row's logits): top-1 agreement per position and KL(p_fp32 || p_fp8), mean and max;
- attention outputs, with quantisation the only difference: in the fp8 teacher-forced pass, each
  layer's attention over the fp8 cache against float64 attention over the same, unrounded q/k/v;
  the max abs error, and the relative error ||err|| / ||exact|| of the worst query head.

`--outlier` adds a Llama variant whose KV head 0 is `--outlier-gain` (2^16) times larger in every
layer (K and V), with the matching q_proj rows and o_proj columns divided by as much: in fp32 the
model is exactly the same (a power of two), but a per-tensor scale sized for the outlier squeezes
the other heads into fp8's subnormals. A floating-point format absorbs smaller gains in its
exponent, unlike int8: e4m3 spans 2^-9..448 (about 2^18) from its smallest subnormal to its max,
so it takes a gain near 2^16 to break it, and e5m2 (2^-16..57344, about 2^32) shrugs that off too.
`--formats` and `--scales` pick a subset of the configurations (the smoke test runs a few).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.nn.functional as F

import kernels
from benchmarks.workload import Workload, make_prompts, run_engine, teacher_forced_hidden, token_agreement
from engine_core.calibrate import calibrate_kv_amax
from engine_core.engine import LLMEngine
from engine_core.presets import resolve_model
from engine_core.worker.kv_scales import save_kv_amax

FORMATS = ("fp8_e4m3", "fp8_e5m2")
SCALES = ("dynamic", "static per-tensor", "static per-head")
OUTLIER_GAIN = 65536.0  # 2^16, a power of two: the fp32 model is unchanged bit for bit
FORCED_BATCH = 8  # sequences per teacher-forced forward
BLOCK_SIZE = 16


@dataclass
class Row:
    model: str
    kv_cache_dtype: str
    scales: str
    token_agreement: float  # free-running: tokens equal up to each prompt's first difference
    identical_outputs: float  # share of prompts with the fp32 run's whole output
    forced_top1: float  # teacher forcing: top-1 equal at each position
    kl_mean: float
    kl_max: float
    attn_max_abs: float
    attn_rel: float  # ||err|| / ||exact|| of the worst query head (in one layer and batch)
    seconds: float


class AttentionRecorder:
    """Wraps a backend's ops to keep each layer's new K/V (the write) and its q and output (the read)."""

    def __init__(self) -> None:
        self.writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.reads: list[tuple[torch.Tensor, torch.Tensor]] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        real = kernels.kernel_ops

        def ops(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> kernels.KernelOps:
            base = real(backend, device, dtype)

            def write(key: torch.Tensor, value: torch.Tensor, *args: Any) -> None:
                self.writes.append((key.clone(), value.clone()))
                base.reshape_and_cache(key, value, *args)

            def prefill(query: torch.Tensor, *args: Any) -> torch.Tensor:
                out = base.paged_attention(query, *args)
                self.reads.append((query.clone(), out.clone()))
                return out

            return dataclasses.replace(base, reshape_and_cache=write, paged_attention=prefill)

        with mock.patch.object(kernels, "kernel_ops", ops):
            yield


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of whole sequences (rows concatenated) in float64, GQA."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))  # [heads, n, d]
        out.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1))
        start += n
    return torch.cat(out)


@torch.inference_mode()
def teacher_forced(engine: LLMEngine, seqs: list[list[int]], prompt_lens: list[int],
                   measure_attention: bool) -> tuple[list[torch.Tensor], float, float]:
    """Log-probs of each sequence's continuation (positions prompt_len-1 .. end-1), read through the
    engine's own KV cache (and scales) in one prefill per FORCED_BATCH sequences; with
    `measure_attention`, the attention error against float64 over unrounded q/k/v: the max abs error,
    and the worst relative error ||err|| / ||exact|| of one query head (one layer, one batch), so a
    head squeezed by another's scale shows even when that head's values are far smaller."""
    model, device = engine.runner.model, engine.runner.device
    scale = model.layers[0].attn.scale
    logprobs, max_abs, worst_rel = [], 0.0, 0.0
    for b in range(0, len(seqs), FORCED_BATCH):
        batch, plens = seqs[b:b + FORCED_BATCH], prompt_lens[b:b + FORCED_BATCH]
        lens = [len(s) for s in batch]
        recorder = AttentionRecorder()
        with recorder.recording():
            hidden, qsl = teacher_forced_hidden(engine, batch)
        rows = torch.cat([torch.arange(int(qsl[i]) + p - 1, int(qsl[i + 1]) - 1) for i, p in enumerate(plens)])
        lp = torch.log_softmax(model.compute_logits(hidden[rows.to(device)]).double(), -1).cpu()
        logprobs += list(lp.split([n - p for n, p in zip(lens, plens)]))
        if measure_attention:
            for (k, v), (q, out) in zip(recorder.writes, recorder.reads, strict=True):
                exact = exact_attention(q.cpu(), k.cpu(), v.cpu(), lens, scale)
                err = out.cpu().double() - exact
                max_abs = max(max_abs, err.abs().max().item())
                per_head = err.norm(dim=(0, 2)) / exact.norm(dim=(0, 2)).clamp_min(1e-30)  # [heads]
                worst_rel = max(worst_rel, per_head.max().item())
    return logprobs, max_abs, worst_rel


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(tokens equal up to each first difference / all tokens, prompts with identical outputs / prompts)."""
    return token_agreement(ref, got), sum(x == y for x, y in zip(ref, got)) / len(ref)


def compare_logprobs(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL(ref || got), max KL) over every position."""
    r, g = torch.cat(ref), torch.cat(got)
    kl = (r.exp() * (r - g)).sum(-1)
    return (r.argmax(-1) == g.argmax(-1)).double().mean().item(), kl.mean().item(), kl.max().item()


def make_outlier_checkpoint(model: str, out: Path, head: int = 0, gain: float = OUTLIER_GAIN) -> Path:
    """A copy of a Llama checkpoint whose KV head `head` holds `gain` x larger K and V in every layer:
    k_proj / v_proj rows of that head times gain, the q_proj rows of its query heads and the o_proj
    columns they feed divided by gain. Same fp32 model (gain a power of two), an outlier KV head."""
    from safetensors.torch import load_file, save_file

    src = resolve_model(model)
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"the outlier variant needs a Llama checkpoint (no q/k RMSNorm to undo the gain), got "
                         f"{config.get('architectures')}")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["hidden_size"] // heads
    group = heads // kv_heads
    shutil.copytree(src, out)
    w = load_file(out / "model.safetensors")
    kv_rows = slice(head * dim, (head + 1) * dim)
    q_rows = slice(head * group * dim, (head + 1) * group * dim)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn"
        w[f"{p}.k_proj.weight"][kv_rows] *= gain
        w[f"{p}.v_proj.weight"][kv_rows] *= gain
        w[f"{p}.q_proj.weight"][q_rows] /= gain
        w[f"{p}.o_proj.weight"][:, q_rows] /= gain
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    """fp32 model, every prompt in flight at once, and a KV cache just large enough for them (the
    default 1 GiB CPU budget would cost more to allocate than a tiny model's whole run)."""
    blocks = a.num_prompts * -(-(a.input_max + a.output_len) // BLOCK_SIZE)
    return dict(max_num_seqs=min(a.num_prompts, 256), max_num_batched_tokens=2048, device=a.device, dtype="float32",
                block_size=BLOCK_SIZE, num_gpu_blocks=blocks, swap_space=0)


def evaluate(model: str, label: str, a: argparse.Namespace, workdir: Path) -> list[Row]:
    """The fp32-KV reference run of `model`, then one row per selected fp8 format and scale mode."""
    kwargs = engine_args(a)
    t0 = time.perf_counter()
    reference = LLMEngine.from_kwargs(model, **kwargs)
    prompts = make_prompts(a.num_prompts, (a.input_min, a.input_max), reference.vocab_size, a.seed)
    w = Workload(prompts, [a.output_len] * len(prompts))
    ref_out = run_engine(reference, w)
    seqs = [p + o for p, o in zip(prompts, ref_out)]
    plens = [len(p) for p in prompts]
    ref_lp, _, _ = teacher_forced(reference, seqs, plens, measure_attention=False)
    print(f"{label}: fp32 KV reference, {len(prompts)} prompts x {a.output_len} tokens, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    del reference
    scales_file = workdir / f"{label}.scales.json"
    # calibration runs its own 16 prompts: a 64 MiB cache holds them all at once for these models
    calibration = calibrate_kv_amax(model, **{**kwargs, "num_gpu_blocks": None, "kv_cache_memory_bytes": 64 << 20})
    save_kv_amax(scales_file, calibration, model)
    rows = []
    for fmt in a.formats:
        for mode in a.scales:
            t0 = time.perf_counter()
            kw = dict(calculate_kv_scales=True) if mode == "dynamic" else dict(
                kv_cache_scales=str(scales_file), kv_scales_per_head=mode.endswith("per-head"))
            engine = LLMEngine.from_kwargs(model, kv_cache_dtype=fmt, **kw, **kwargs)
            out = run_engine(engine, w)
            lp, max_abs, rel = teacher_forced(engine, seqs, plens, measure_attention=True)
            row = Row(label, fmt, mode, *agreement(ref_out, out), *compare_logprobs(ref_lp, lp), max_abs, rel,
                      time.perf_counter() - t0)
            print(_line(row), flush=True)
            rows.append(row)
    return rows


HEADER = ("| model | KV cache | scales | greedy tokens agree | outputs identical | forced top-1 | KL mean | KL max "
          "| attn max abs err | attn rel err |\n|---|---|---|---|---|---|---|---|---|---|")


def _line(r: Row) -> str:
    return (f"| {r.model} | {r.kv_cache_dtype} | {r.scales} | {100 * r.token_agreement:.1f}% | "
            f"{100 * r.identical_outputs:.1f}% | {100 * r.forced_top1:.2f}% | {r.kl_mean:.2e} | {r.kl_max:.2e} | "
            f"{r.attn_max_abs:.2e} | {r.attn_rel:.2e} |")


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of `allowed`, in the order given."""
    def parse(text: str) -> list[str]:
        picked = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in picked if x not in allowed]
        if bad or not picked:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return picked
    return parse


def _power_of_two(text: str) -> float:
    """argparse type: a gain > 1 that is an exact power of two, so the outlier model equals the original in fp32."""
    gain = float(text)
    if not (gain > 1 and math.isfinite(gain) and math.frexp(gain)[0] == 0.5):
        raise argparse.ArgumentTypeError(f"must be a power of two > 1 (2, 4, ..., 65536), got {text!r}")
    return gain


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # the tiny presets: about 2 minutes on 2 CPU cores (small-llama takes ~2.5 min per row there)
    ap.add_argument("--presets", default="tiny-llama,tiny-llama3,tiny-qwen2,tiny-qwen3")
    ap.add_argument("--outlier", default="tiny-llama", help="a Llama preset for the outlier variant ('' to skip)")
    ap.add_argument("--outlier-gain", type=_power_of_two, default=OUTLIER_GAIN, help="a power of two > 1")
    ap.add_argument("--formats", type=_choices(FORMATS), default=list(FORMATS), help="comma-separated subset")
    ap.add_argument("--scales", type=_choices(SCALES), default=list(SCALES), help="comma-separated subset")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-min", type=int, default=16)
    ap.add_argument("--input-max", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    a = ap.parse_args(argv)
    for name in ("num_prompts", "output_len", "input_min"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.input_max < a.input_min:
        ap.error(f"--input-max ({a.input_max}) must be >= --input-min ({a.input_min})")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for preset in [p for p in a.presets.split(",") if p]:
            rows += evaluate(preset, preset, a, workdir)
        if a.outlier:
            folder = make_outlier_checkpoint(a.outlier, workdir / "outlier", gain=a.outlier_gain)
            rows += evaluate(str(folder), f"{a.outlier} + outlier KV head (x{a.outlier_gain:g})", a, workdir)
    print(f"\n{len(rows)} configurations, {a.num_prompts} prompts of {a.input_min}..{a.input_max} tokens x "
          f"{a.output_len} greedy tokens each, seed {a.seed}, device {a.device}\n")
    print(HEADER)
    for r in rows:
        print(_line(r))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
