"""Sliding-window attention (tiny-mistral-swa: every layer sees its last 12 tokens): greedy tokens equal Hugging
Face `generate` for prompts shorter and longer than the window, with chunking, prefix caching and preemption; the
blocks out of the window are freed as the request runs (KV bounded), none leaked; bad combinations refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from engine_helpers import check_engine, pool_is_whole, run_to_end

from engine_core import LLM, LLMEngine, SamplingParams
from engine_core.core.kv_cache_manager import NULL_BLOCK
from engine_core.presets import PRESETS, preset_path

PRESET = "tiny-mistral-swa"
WINDOW = PRESETS[PRESET].config["sliding_window"]
PROMPT_LENS = [1, 5, 11, 12, 13, 16, 30, 47, 64]
NUM_NEW = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(path, prompts) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def hf_tokens():
    return _hf_greedy(preset_path(PRESET), _prompts())


def test_the_window_changes_the_tokens(hf_tokens, tmp_path_factory):
    """Not vacuous: the same weights with full attention give other tokens once the context passes the window."""
    folder = tmp_path_factory.mktemp("full") / "m"
    shutil.copytree(preset_path(PRESET), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = None
    (folder / "config.json").write_text(json.dumps(cfg))
    full = _hf_greedy(folder, _prompts())
    assert sum(a != b for a, b in zip(full, hf_tokens)) >= len(PROMPT_LENS) // 2


@pytest.mark.parametrize("block_size, chunked, caching", [(4, True, False), (16, True, True), (5, False, True),
                                                          (1, True, False)])
def test_greedy_matches_hf(hf_tokens, block_size, chunked, caching):
    llm = LLM(PRESET, block_size=block_size, num_gpu_blocks=512, max_num_batched_tokens=16 if chunked else 64,
              enable_chunked_prefill=chunked, enable_prefix_caching=caching)
    for _ in range(2 if caching else 1):  # with caching, the second round is served from the first's blocks
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    stats = llm.engine.stats()
    assert stats["num_blocks_out_of_window"] > 0
    if caching:
        assert stats["prefix_cache_hits"] > 0
    assert pool_is_whole(llm.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_hf_under_preemption(hf_tokens, mode):
    """Too few blocks for the batch: requests are preempted (a table with freed slots is recomputed, not swapped)."""
    llm = LLM(PRESET, block_size=4, num_gpu_blocks=24, swap_space=0.01, max_num_batched_tokens=16,
              preemption_mode=mode)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    stats = llm.engine.stats()
    assert stats["num_preemptions_recompute"] + stats["num_preemptions_swap"] > 0
    assert pool_is_whole(llm.engine)


def test_kv_held_is_bounded_by_the_window():
    """A request far longer than the window holds at most cdiv(window, block_size) + 1 blocks after each step."""
    block_size = 4
    llm = LLM(PRESET, block_size=block_size, num_gpu_blocks=64, max_num_batched_tokens=8)
    engine, kvm = llm.engine, llm.engine.scheduler.kv_cache_manager
    engine.add_request("r", _prompts()[-1], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    most = span = 0
    while engine.has_unfinished_requests():
        engine.step()
        table = kvm.req_to_blocks.get("r", [])
        live = [b for b in table if b is not NULL_BLOCK]
        most, span = max(most, len(live)), max(span, len(table))
        assert all(b.ref_cnt >= 1 for b in live)
    assert most <= -(-WINDOW // block_size) + 2  # the window's blocks, a partial one, this step's chunk
    assert span >= (64 + 99) // block_size  # the table spans the whole request, its old slots null
    assert pool_is_whole(engine)


def test_bad_combinations_are_refused_before_load():
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot honour the model's sliding_window=12"):
        LLM(PRESET, num_gpu_blocks=8, attention_backend="cpu")
    with pytest.raises(ValueError, match="draft_model.*sliding_window=12"):
        LLM(PRESET, num_gpu_blocks=8, speculative_config=dict(method="draft_model", model="tiny-llama-draft",
                                                              num_speculative_tokens=2))


def test_qwen2_with_full_attention_layers_is_refused(tmp_path):
    folder = tmp_path / "q"
    shutil.copytree(preset_path("tiny-qwen2"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="max_window_layers=1"):
        LLM(str(folder), num_gpu_blocks=8)


def test_a_failed_step_is_recovered_with_the_same_tokens(hf_tokens):
    """A step that raises after the scheduler freed out-of-window blocks: every request is recomputed (windowed KV
    depends on the tokens alone), ends with HF's tokens, and no block leaks."""
    engine = LLMEngine.from_kwargs(PRESET, block_size=4, num_gpu_blocks=128, max_num_batched_tokens=16)
    requests = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(_prompts())]
    real, calls = engine.scheduler.update_from_output, []

    def flaky(*args):
        calls.append(1)
        out = real(*args)
        if len(calls) == 8:
            raise TypeError("injected")
        return out

    engine.scheduler.update_from_output = flaky
    with pytest.raises(TypeError, match="injected"):
        for _ in range(8):
            engine.step()
    assert engine.stats()["num_blocks_out_of_window"] > 0
    check_engine(engine)
    run_to_end(engine, check=True)
    assert [r.output_token_ids for r in requests] == hf_tokens and pool_is_whole(engine)
