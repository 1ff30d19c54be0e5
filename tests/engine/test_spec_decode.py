"""Speculative decoding end to end, for both methods ("ngram" and "draft_model", the tests parametrized
over them): greedy output with speculation equals the output without, token for token, under chunked
prefill, prefix caching, both preemption modes, LoRA (and fp8 KV, n-gram); stop tokens, max_tokens and
max_model_len inside an accepted run end the request there; the KV blocks add up after rejections; no
prefix-cache block holds an unverified token; bad speculative_config values are refused by name. The
prompts repeat themselves, so the drafts hit (acceptance > 0 is asserted: a run where nothing is accepted
would test only the rejection path). Then what one method alone promises: seeded n-gram sampling gives
the tokens of plain sampling; a draft with the target's weights is always accepted; a draft model's
seeded runs repeat; a draft of another vocabulary or a shorter context is refused. The sampled
distribution with a draft model is tested where it is decided, in tests/worker/test_draft_model.py."""
from __future__ import annotations

import json
import random
import shutil

import pytest
from engine_helpers import check_engine, pool_is_whole

from grader.harness import make_scheduler

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig
from engine_core.core.scheduler import Scheduler
from engine_core.engine import LLMEngine
from engine_core.lora.presets import adapter_path
from engine_core.lora.request import LoRARequest
from engine_core.outputs import ModelRunnerOutput
from engine_core.presets import resolve_model
from engine_core.request import Request, RequestStatus

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": 3}
METHODS = {"ngram": SPEC, "draft_model": DRAFT}
RNG = random.Random(25)
PROMPTS = [list(range(10, 20)) * 3, [5, 6, 7, 8] * 5, [RNG.randrange(3, 512) for _ in range(20)],
           list(range(10, 20)) * 2 + [77, 78]]  # shares a prefix with the first: prefix-cache hits
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 18, 14, 20)]
# A KV cache sized for the workload (4 requests of up to 128 tokens: 128 blocks of 4): the CPU default (1 GiB,
# and 4 GiB of swap) is a million tiny-llama blocks, whose Python objects took ~1 s per engine, 50 s in this file
BASE = dict(block_size=4, max_model_len=128, max_num_batched_tokens=32, num_gpu_blocks=256, swap_space=0.01)


def generate(spec: dict | None, model: str = "tiny-llama", lora=None, params=PARAMS, **kw
             ) -> tuple[list[list[int]], dict]:
    llm = LLM(model, speculative_config=spec, **{**BASE, **kw})
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    assert pool_is_whole(llm.engine), llm.engine.stats()
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats()


@pytest.fixture(scope="module")
def plain():
    return generate(None)[0]


@pytest.fixture(params=list(METHODS))
def spec(request) -> dict:
    return METHODS[request.param]


def _assert_speculated(stats: dict) -> None:
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats  # rejections too


@pytest.mark.parametrize("kw", [{}, {"enable_chunked_prefill": False}, {"enable_prefix_caching": True},
                                {"max_num_batched_tokens": 8}],
                         ids=["chunked", "unchunked", "prefix-caching", "small-budget"])
def test_greedy_output_with_speculation_equals_the_output_without(plain, spec, kw):
    outs, stats = generate(spec, **kw)
    assert outs == plain
    _assert_speculated(stats)
    if kw.get("enable_prefix_caching"):
        assert stats["prefix_cache_hits"] > 0, stats


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_output_survives_preemption_with_drafts(plain, spec, mode):
    outs, stats = generate(spec, num_gpu_blocks=20, preemption_mode=mode, enable_prefix_caching=True)
    key = {"recompute": "num_preemptions_recompute", "swap": "num_preemptions_swap"}[mode]
    assert stats[key] > 0, stats
    assert outs == plain
    _assert_speculated(stats)


def test_fp8_kv_cache():
    """n-gram only: a draft model never touches the target's cache (its own is in the model dtype), and the
    verify path is the same for both methods; on CPU each fp8 run costs ~25 s."""
    plain_fp8, _ = generate(None, kv_cache_dtype="fp8")
    outs, stats = generate(SPEC, kv_cache_dtype="fp8")
    assert outs == plain_fp8
    _assert_speculated(stats)


def test_lora_requests(spec):
    """The target verifies with its adapter; a draft model (the base weights, no adapter) only changes which
    drafts are accepted, never the greedy output."""
    lora = LoRARequest("r8-attn", 1, str(adapter_path("tiny-llama", "r8-attn")))
    plain_lora, _ = generate(None, lora=lora, enable_lora=True, max_lora_rank=16)
    outs, stats = generate(spec, lora=lora, enable_lora=True, max_lora_rank=16)
    assert outs == plain_lora
    _assert_speculated(stats)


def test_stop_tokens_max_tokens_and_max_model_len_inside_an_accepted_run(plain, spec):
    """Stop at a token the plain run emits mid-output, a max_tokens and a max_model_len that land inside
    accepted runs: the same tokens and finish reasons as without speculation."""
    stop = [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[out[len(out) // 2]]) for out in plain]
    short = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 6, 7, 9)]
    to_the_end = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    got: dict[bool, list] = {True: [], False: []}
    for config in (None, spec):
        llm = LLM("tiny-llama", speculative_config=config, **{**BASE, "max_model_len": 50})
        for params in (stop, short, to_the_end):
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            got[config is None].append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        assert pool_is_whole(llm.engine)
        if config:
            _assert_speculated(llm.engine.stats())
    assert got[False] == got[True]
    assert {r for _, r in got[True][0]} == {"stop"} and "length" in {r for _, r in got[True][1]}
    assert all(len(p) + len(t) <= 50 for run in got[False] for p, (t, _) in zip(PROMPTS, run))
    assert all(len(p) + len(t) == 50 for p, (t, _) in zip(PROMPTS, got[False][2]))  # max_model_len reached


def test_invariants_budget_and_prefix_cache_every_step(spec):
    """After every step: the scheduler's invariants (block ref counts, queues), the step's rows (drafts
    included) within the budget, and every block the prefix cache publishes holds verified tokens only."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", speculative_config=spec, enable_prefix_caching=True,
                                    **{**BASE, "num_gpu_blocks": 24}))
    sched = engine.scheduler
    schedule = sched.schedule
    steps = []

    def checked_schedule():
        out = schedule()
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            request = sched.requests[rid]
            table = sched.kv_cache_manager.req_to_blocks[rid]
            assert len(table) * sched.block_size >= request.num_tokens + len(drafts)  # the lookahead slots
            assert request.num_tokens + len(drafts) <= sched.max_model_len
        steps.append(len(out.scheduled_spec_decode_tokens))
        return out

    sched.schedule = checked_schedule
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", prompt, params)
    kvm = sched.kv_cache_manager
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        check_engine(engine)
        for request in sched.running:
            rid, bs = request.request_id, sched.block_size
            assert kvm.num_cached_blocks.get(rid, 0) * bs <= request.num_computed_tokens
            for j, block in enumerate(kvm.req_to_blocks[rid]):
                if block.block_hash is not None:  # published: verified tokens only, the request's own
                    assert (j + 1) * bs <= request.num_computed_tokens, (request, j)
                    assert block.block_hash.token_ids == tuple(request.all_token_ids[j * bs:(j + 1) * bs])
    assert not engine.has_unfinished_requests() and pool_is_whole(engine)
    assert sum(steps) > 0


def test_seeded_sampling_with_speculation_equals_the_output_without():
    """n-gram drafts are verified against the row's own seeded sample, so a seeded request's tokens do not
    depend on the drafts: with and without speculation, at any budget, the same tokens."""
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=7 + i) for i in range(len(PROMPTS))]
    runs = []
    for spec, batch in ((None, 32), (SPEC, 32), (SPEC, 9)):
        llm = LLM("tiny-llama", speculative_config=spec, **{**BASE, "max_num_batched_tokens": batch})
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        if spec:
            _assert_speculated(llm.engine.stats())
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_metrics_use_vllms_names():  # the scheduler counts both methods' drafts alike
    llm = LLM("tiny-llama", speculative_config=SPEC, **BASE)
    llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)
    stats = llm.engine.scheduler.make_stats()
    text = llm.engine.prometheus_metrics()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert f"\n{name} " in text
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == SPEC["num_speculative_tokens"] and sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # a draft's j-th token is accepted only after the earlier ones
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {float(per_pos[0])}' in text
    d = llm.engine.stats()
    assert d["spec_decode_mean_acceptance_length"] == 1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts


# ---- a draft model alone ---------------------------------------------------------------------------------------

def test_a_draft_with_the_targets_weights_is_always_accepted(plain):
    """Greedy, draft == target: every draft is the target's argmax, so acceptance is exactly 1.0 and each
    verify step emits k + 1 tokens (fewer only where max_tokens caps the drafts)."""
    outs, stats = generate({**DRAFT, "model": "tiny-llama"})
    assert outs == plain
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_decode_mean_acceptance_length"] > 3.5, stats  # k = 3: 4 but for the capped last drafts


def test_seeded_sampled_runs_with_a_draft_model_repeat_and_accept_some_drafts():
    """Seeded sampling with draft-model drafts: the same seeds give the same tokens in another batch
    order, and with draft == target at T = 1 (q = p) every draft is accepted (min(1, p/q) = 1). The
    budget gives every decode its k drafts in either order: a seeded request's tokens depend on how its
    drafts fall into steps (position m drawn as a draft from q or as a bonus token from p), and with the
    tight BASE budget the two orders cap different steps' drafts."""
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3, 4)]
    roomy = dict(max_num_batched_tokens=256)
    first, _ = generate(DRAFT, params=params, **roomy)
    llm = LLM("tiny-llama", speculative_config=DRAFT, **{**BASE, **roomy})
    again = llm.generate(PROMPTS[::-1], params[::-1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again][::-1] == first
    _, stats = generate({**DRAFT, "model": "tiny-llama"}, params=params)
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0, stats


def test_a_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]='small-llama' has vocab_size 8192.*"
                                         r"vocab_size 512"):
        LLM("tiny-llama", speculative_config={**DRAFT, "model": "small-llama"}, **BASE)


def test_a_draft_with_a_shorter_context_is_refused(tmp_path):
    folder = tmp_path / "short-draft"
    shutil.copytree(resolve_model("tiny-llama-draft"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=r"max_position_embeddings 64, shorter than max_model_len 128"):
        LLM("tiny-llama", speculative_config={**DRAFT, "model": str(folder)}, **BASE)
    LLM("tiny-llama", speculative_config={**DRAFT, "model": str(folder)}, **{**BASE, "max_model_len": 64})


# ---- the scheduler alone: lookahead slots, rollback of rejected drafts, fallback ------------------------------

def _scheduler(budget: int = 64, num_gpu_blocks: int = 64, k: int = 3) -> Scheduler:
    return make_scheduler(num_gpu_blocks, block_size=4, max_model_len=64, max_num_batched_tokens=budget,
                          speculative_config={**SPEC, "num_speculative_tokens": k})


def test_rejected_drafts_roll_back_and_their_slots_are_reused():
    sched = _scheduler()
    request = Request("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=20, temperature=0.0))
    sched.add_request(request)
    kvm = sched.kv_cache_manager
    out = sched.schedule()  # the prompt
    sched.update_from_output(out, ModelRunnerOutput({"a": [2]}))
    out = sched.schedule()  # a decode of token 2 with drafts [3, 1, 2] (after [1, 2]: [3, 1, 2])
    assert out.scheduled_spec_decode_tokens == {"a": [3, 1, 2]}
    assert len(kvm.req_to_blocks["a"]) == 3  # 8 + 3 positions: the lookahead slots in a third block
    assert out.scheduled[0].new_block_ids == kvm.get_block_ids("a")[2:]  # the lookahead block handed over
    # the target accepts 3, rejects 1 and emits 9 instead: tokens [3, 9], num_computed covers 2 and 3
    sched.update_from_output(out, ModelRunnerOutput({"a": [3, 9]}))
    assert request.output_token_ids == [2, 3, 9] and request.num_computed_tokens == 9
    assert sched.counters.spec_decode_num_accepted_tokens == 1 and sched.counters.spec_decode_num_draft_tokens == 3
    out = sched.schedule()  # the next step starts at position 9: the rejected slots are written again
    assert out.scheduled[0].start == 9 and out.scheduled[0].token_ids == [9]
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert kvm.block_pool.num_free_blocks == kvm.num_gpu_blocks


def test_drafts_fall_back_to_a_plain_decode_without_budget_or_blocks():
    # budget: two decodes fill a budget of 2, so no row is left for a draft
    sched = _scheduler(budget=2)
    for rid in "ab":
        sched.add_request(Request(rid, [1, 2, 1], SamplingParams(max_tokens=20, temperature=0.0)))
    out = sched.schedule()
    while any(c.num_tokens > 1 for c in out.scheduled) or len(out.scheduled) < 2:
        sched.update_from_output(out, ModelRunnerOutput({c.request.request_id: [2] for c in out.scheduled if c.emits}))
        out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {} and out.total_num_scheduled_tokens == 2
    # blocks: 3 blocks of 4 for two requests of 4 tokens; the first decode's lookahead takes the free one
    sched = _scheduler(num_gpu_blocks=3)
    for rid in "cd":
        sched.add_request(Request(rid, [1, 2, 1], SamplingParams(max_tokens=5, temperature=0.0)))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput({"c": [2], "d": [2]}))
    out = sched.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["c", "d"]
    assert out.scheduled_spec_decode_tokens == {"c": [1, 2]}  # d decodes plainly: no block for its drafts
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 0


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, match", [
    ({**SPEC, "num_speculative_tokens": 0}, r"speculative_config\['num_speculative_tokens'\] must be an int in \[1, 16\]"),
    ({**SPEC, "num_speculative_tokens": 17}, r"num_speculative_tokens'\] must be an int in \[1, 16\]"),
    ({**SPEC, "num_speculative_tokens": True}, r"num_speculative_tokens"),
    ({**SPEC, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_max'\] must be an int >= 4"),
    ({**SPEC, "prompt_lookup_min": 0}, r"prompt_lookup_min'\] must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2}, r"needs prompt_lookup_min or prompt_lookup_max"),
    ({**SPEC, "method": "eagle"}, r"speculative_config\['method'\] must be one of \('ngram', 'draft_model'\)"),
    ({**SPEC, "model": "x"}, r"unknown key\(s\) \['model'\]"),
    ("ngram", r"speculative_config must be None or a dict"),
    ({**DRAFT, "model": ""}, r"speculative_config\['model'\] must be a preset name or a model folder"),
    ({**DRAFT, "model": None}, r"speculative_config\['model'\]"),
    ({**DRAFT, "prompt_lookup_max": 3}, r"unknown key\(s\) \['prompt_lookup_max'\] for method 'draft_model'"),
    ({**DRAFT, "num_speculative_tokens": 0}, r"num_speculative_tokens'\] must be an int in \[1, 16\]"),
])
def test_bad_speculative_config_is_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=spec)


def test_one_lookup_size_takes_the_other():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.speculative_config.prompt_lookup_min, config.speculative_config.prompt_lookup_max) == (3, 3)
