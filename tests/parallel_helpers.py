"""Parallel-engine test kit: a probe the workers run (`collective_rpc`: module-level, so it pickles by
name), a workload that exercises chunked prefill, prefix caching and recompute preemption at once,
and the processes a test leaves behind."""
from __future__ import annotations

import time
from typing import Any, Iterator

import psutil
import torch

from engine_core import LLM, SamplingParams
from engine_core.core.kv_cache_manager import cdiv
from engine_core.core.scheduler_output import ScheduledChunk
from engine_core.request import Request
from engine_core.worker.input_batch import InputBatch
from engine_core.worker.model_runner import ModelRunner, build_model_input

# Small blocks and budget: every prompt is chunked (> 16 tokens), prompts share a 12-token prefix
# (3 full blocks: prefix hits), and 6 requests of ~40 tokens need ~60 of the 24 blocks (preemption).
STRESS = dict(block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16, max_num_seqs=6,
              enable_prefix_caching=True, preemption_mode="recompute")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def stress_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, vocab_size, (12,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (9, 14, 20, 25, 17, 28)]


def engine_pair(preset: str, both: dict[str, Any] | None = None,
                **parallel: Any) -> Iterator[tuple[str, LLM, LLM, float]]:
    """A module fixture's body: (preset, the one-process engine, the parallel one, its startup seconds)
    with the STRESS settings (`parallel` may override them for both; `both`: more settings for both, e.g.
    the device); the parallel engine is shut down after, leaving no process."""
    settings = {**STRESS, **{k: v for k, v in parallel.items() if k in STRESS}, **(both or {})}
    reference = LLM(preset, **settings)
    t0 = time.perf_counter()
    llm = LLM(preset, **{**settings, **parallel})
    yield preset, reference, llm, time.perf_counter() - t0
    llm.shutdown()
    assert not child_processes()


def generate_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def last_row_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor | None]:
    """Each prompt's last-row fp32 logits from one whole-prompt forward on a scratch KV cache (the
    runner's own cache and tables untouched); None on the ranks that do not sample."""
    out = []
    for ids in prompts:
        n, bs = len(ids), runner.block_size
        scratch = runner._new_kv_cache(cdiv(n, bs), 0)
        chunk = ScheduledChunk(Request("probe", ids, SamplingParams(max_tokens=1)), 0, n, list(range(cdiv(n, bs))),
                               True)
        batch = InputBatch(1, cdiv(n, bs))
        model_input = build_model_input([chunk], [batch.add_chunk(chunk)], batch, bs, runner.device,
                                        runner.config.engine.kv_cache_dtype, runner.attention_backend)
        with torch.inference_mode():
            hidden = runner.model(model_input.input_ids, model_input.positions, scratch, model_input.attn_metadata)
            logits = None if hidden is None else runner.model.compute_logits(hidden)
        out.append(None if logits is None else logits[0].clone().cpu())  # a CUDA rank replies with host tensors
    return out


def engine_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), vocab] from the sampling rank (rank 0 of a one-process engine)."""
    executor = llm.engine.executor
    results = executor.collective_rpc(last_row_logits, prompts)
    return torch.stack(results[getattr(executor, "output_rank", 0)])


def kv_cache_shape(runner: ModelRunner) -> tuple[tuple[int, ...], int]:
    """(one layer's K cache shape, the number of layers) of this rank's KV cache."""
    return tuple(runner.kv_cache.key[0].shape), len(runner.kv_cache.key)


def child_processes() -> list[psutil.Process]:
    """Live (not zombie) descendants of this process that belong to a parallel engine: workers spawned by
    multiprocessing (`spawn_main`) and another node's launcher (`engine_core.executor.launch`), but
    multiprocessing's resource tracker (started with the first spawned process, shared by all, it lives as
    long as this process). Other children are not the engine's: under `make test` the first xdist worker
    also runs the labs' selftests as subprocesses while these tests run."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(p.cmdline())
            ours = "spawn_main" in cmdline or "engine_core.executor.launch" in cmdline
            if ours and p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in cmdline:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found
