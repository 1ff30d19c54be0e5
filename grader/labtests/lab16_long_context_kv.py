"""Official tests of lab 16_long_context_kv: predictions on long-context KV (a 128K request on Llama-3-70B and
-8B against their weights, a 50-turn chat against five-turn truncation, a 4K sliding window at 32K, MLA's latent
against GQA, restoring a session's KV over a link against its prefill), the sliding window's block release
`num_blocks_out_of_window`, StreamingLLM / H2O `evict_tokens`, and the CPU offload tier's `save` and `load`
(contract only) plans.

The seams (grader/seams.py): `engine_core.core.sliding_window.num_blocks_out_of_window`,
`engine_core.core.kv_eviction.evict_tokens` (pure functions the KV cache manager calls through their modules: an
end-to-end test each runs tiny-mistral-swa's window, or tiny-llama with StreamingLLM, through the engine with the
learner's function plugged) and `OffloadTier.save` / `OffloadTier.load`, which the engine's offload connector calls
(`kv_offload_bytes`): the end-to-end test runs a returning session through the real engine with the learner's two
plugged. Expected values come from hand arithmetic on public config.json values (written in the
docstrings), from the contracts written out here (`_spec_*`), and from the reference engine run in a
`functools.cache` helper after the plug block. Every graded check is an `expect_*` observation.
"""
import functools

import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from grader.harness import BlockHash, OffloadTier, lab_settings, memory, run_engine
from grader.observe import expect_equal, expect_prediction, expect_raises
from grader.plug import plug

LAB = "16_long_context_kv"
LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
LLAMA3_8B_WEIGHT_BYTES = 16_060_522_496  # 8,030,261,248 parameters in bf16
H100_BF16_FLOPS, H100_HBM = 989e12, 3.35e12


# ---- task 1: predictions ---------------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("kv_bytes")
def test_predicted_kv_128k(student):
    """2 (K, V) x layers x KV heads x head_dim x 2 bytes x 131,072 tokens. Llama-3-70B: 80 layers, 8 KV heads of
    128: 327,680 B/token, 42,949,672,960 B (40 GiB). Llama-3-8B: 32 layers: 131,072 B/token, 17,179,869,184 B.
    Counting the 64 query heads instead of the 8 KV heads is 8x; forgetting V is 0.5x."""
    expect_prediction([student.kv_bytes(80, 8, 128, 131072), student.kv_bytes(32, 8, 128, 131072)],
                      [2 * 80 * 8 * 128 * 2 * 131072, 2 * 32 * 8 * 128 * 2 * 131072],
                      "[kv_bytes(80, 8, 128, 131072), kv_bytes(32, 8, 128, 131072)]: bf16 KV of one 128K request "
                      "on Llama-3-70B and Llama-3-8B", rtol=1e-6)
    expect_prediction(student.kv_bytes(61, 1, 576, 1000, 1), 61 * 576 * 1000 * 2,
                      "kv_bytes(61, 1, 576, 1000, dtype_bytes=1): K and V, one byte each", rtol=1e-6)


@pytest.mark.points(2)
@pytest.mark.task("kv_bytes")
def test_predicted_kv_over_weights(student):
    """KV of one 128K request over the bf16 weights: 42,949,672,960 / (70,553,706,496 x 2) = 0.3044 for
    Llama-3-70B (GQA keeps it under a third), 17,179,869,184 / (8,030,261,248 x 2) = 1.0697 for Llama-3-8B (more
    than the model). Within 1 %."""
    got = student.kv_over_weights()
    expect_prediction([got["Llama-3-70B"], got["Llama-3-8B"]],
                      [42_949_672_960 / (70_553_706_496 * 2), 17_179_869_184 / (8_030_261_248 * 2)],
                      "kv_over_weights() ['Llama-3-70B', 'Llama-3-8B']: KV of a 128K request / bf16 weights",
                      rtol=0.01)


@pytest.mark.points(2)
@pytest.mark.task("chat_kv_bytes")
def test_predicted_chat_kv(student):
    """A 500-token system prompt and 50 turns of 300 tokens on Llama-3-8B (131,072 B/token): 15,500 tokens,
    2,031,616,000 B. Five-turn truncation keeps the system prompt and the last 5 turns: 2,000 tokens, 262,144,000 B
    (7.75x less). Dropping the system prompt too is 196,608,000 (wrong: the model loses its instructions)."""
    expect_prediction([student.chat_kv_bytes(50, 300, 500, 131072), student.chat_kv_bytes(50, 300, 500, 131072, 5)],
                      [15_500 * 131072, 2_000 * 131072],
                      "[chat_kv_bytes(50, 300, 500, 131072), chat_kv_bytes(..., keep_last_turns=5)]: "
                      "the whole chat's KV, and the truncated one's", rtol=1e-6)
    expect_prediction(student.chat_kv_bytes(3, 100, 0, 10, 5), 3000,
                      "chat_kv_bytes(3, 100, 0, 10, keep_last_turns=5): fewer turns than kept", rtol=1e-6)


@pytest.mark.points(2)
@pytest.mark.task("window_kv_bytes")
def test_predicted_window_kv(student):
    """Mistral-7B (W = 4,096, 131,072 B/token), blocks of 16. At 32,768 computed tokens the first (32,768 - 4,096 +
    1) // 16 = 1,792 of 2,048 blocks are out of the window: 256 blocks = 4,096 tokens stay, 536,870,912 B (8x less
    than 4,294,967,296 without the window). At 4,098 tokens no block is out yet: 257 blocks, 538,968,064 B (the
    bound: one block more than W / 16)."""
    expect_prediction([student.window_kv_bytes(32768, 4096, 16, 131072),
                       student.window_kv_bytes(4098, 4096, 16, 131072)],
                      [256 * 16 * 131072, 257 * 16 * 131072],
                      "[window_kv_bytes(32768, 4096, 16, 131072), window_kv_bytes(4098, ...)]: resident KV bytes "
                      "with a 4K sliding window, in whole blocks", rtol=1e-6)
    expect_prediction(student.window_kv_bytes(100, 4096, 16, 131072), 7 * 16 * 131072,
                      "window_kv_bytes(100, 4096, 16, 131072): shorter than the window (7 blocks)", rtol=1e-6)


@pytest.mark.points(2)
@pytest.mark.task("mla_bytes_per_token")
def test_predicted_mla(student):
    """DeepSeek-V3: 61 layers cache one latent of kv_lora_rank 512 plus the shared RoPE key of 64 per token:
    576 x 61 x 2 bytes = 70,272 B/token, against Llama-3-70B's GQA 327,680 (0.2145x), and against 128 heads of
    full K (192) and V (128) the same model would cache without MLA: 4,997,120 (71x more)."""
    expect_prediction(student.mla_bytes_per_token(61, 512, 64), 61 * 576 * 2,
                      "mla_bytes_per_token(61, 512, 64): DeepSeek-V3's latent KV per token, bf16", rtol=1e-6)
    expect_prediction(student.mla_vs_gqa(), 70_272 / 327_680,
                      "mla_vs_gqa(): DeepSeek-V3's bytes per token / Llama-3-70B's", rtol=0.01)


def _spec_prefill_seconds(n):
    return max(memory.prefill_flops(LLAMA3_8B, n) / H100_BF16_FLOPS, LLAMA3_8B_WEIGHT_BYTES / H100_HBM)


@functools.cache
def _spec_slower_range(link):
    slower = [n for n in range(1, 32769) if n * 131072 / link > _spec_prefill_seconds(n)]
    return None if not slower else (slower[0], slower[-1])


@pytest.mark.points(2)
@pytest.mark.task("restore_vs_prefill")
def test_predicted_restore_and_prefill_seconds(student):
    """Llama-3-8B, one H100. Restoring 2,048 tokens over PCIe Gen5 (64 GB/s): 2,048 x 131,072 / 64e9 = 4.19 ms;
    their prefill: memory.prefill_flops / 989e12 = 33.0 TFLOP... = 0.0300 s (compute-bound; the weight read
    16.06 GB / 3.35e12 = 4.79 ms is the floor below ~300 tokens). At 131,072 tokens: 0.268 s against 6.40 s.
    Within 2 %."""
    expect_prediction([student.restore_seconds(2048, 131072, 64e9), student.restore_seconds(131072, 131072, 64e9)],
                      [2048 * 131072 / 64e9, 131072 * 131072 / 64e9],
                      "[restore_seconds(2048, 131072, 64e9), restore_seconds(131072, ...)]: KV over PCIe Gen5",
                      rtol=0.02)
    expect_prediction([student.prefill_seconds(2048), student.prefill_seconds(131072), student.prefill_seconds(16)],
                      [_spec_prefill_seconds(2048), _spec_prefill_seconds(131072), _spec_prefill_seconds(16)],
                      "[prefill_seconds(2048), prefill_seconds(131072), prefill_seconds(16)]: Llama-3-8B on one H100, "
                      "roofline", rtol=0.02)


@pytest.mark.points(3)
@pytest.mark.task("restore_vs_prefill")
def test_predicted_crossover(student):
    """Over PCIe Gen5 restoring never loses to recomputing (131,072 B/token at 64 GB/s is 2.0 us a token,
    the prefill 15.7 us and more): None. From an NVMe tier at 7 GB/s (18.7 us a token) it loses from 257 tokens
    (above the weight-read floor's 4.79 ms) up to 17,393 (where attention's quadratic FLOPs make the prefill
    slower again). Within 5 %."""
    expect_prediction(student.slower_than_prefill(64e9), None,
                      "slower_than_prefill(64e9): the lengths where restoring over PCIe Gen5 loses to a prefill")
    assert _spec_slower_range(64e9) is None and _spec_slower_range(7e9) == (257, 17393), "the docstring (a test bug)"
    expect_prediction(list(student.slower_than_prefill(7e9)), list(_spec_slower_range(7e9)),
                      "slower_than_prefill(7e9): (first, last) length where restoring from NVMe loses",
                      rtol=0.05)


# ---- task 2: the sliding window's block release ---------------------------------------------------------

def _spec_out_of_window(n, window, block_size):
    """Leading blocks all of whose tokens sit below the first key the query at position n still sees."""
    first_visible = n - window + 1
    count = 0
    while (count + 1) * block_size - 1 < first_visible:
        count += 1
    return count


@pytest.mark.points(2)
@pytest.mark.task("num_blocks_out_of_window")
def test_window_release_examples(student):
    """W = 8, blocks of 4. Next position 11: keys 4..11 visible, block 0 (0..3) out: 1. Next position 12: keys
    5..12, block 1 (4..7) still holds 5..7: 1. Next position 15: keys 8..15: 2. Before the window fills (n = 7): 0."""
    with plug(student, LAB, only=["num_blocks_out_of_window"]):
        got = [student.num_blocks_out_of_window(n, 8, 4) for n in (7, 11, 12, 15, 16)]
    expect_equal(got, [_spec_out_of_window(n, 8, 4) for n in (7, 11, 12, 15, 16)],
                 "num_blocks_out_of_window(n, window=8, block_size=4) for n = 7, 11, 12, 15, 16")


@pytest.mark.points(2)
@pytest.mark.task("num_blocks_out_of_window")
@lab_settings(80)
@seed(20261203)
@given(st.integers(0, 300), st.integers(1, 64), st.integers(1, 16))
def test_window_release_matches_the_rule(student, n, window, block_size):
    """Any next position, window and block size: the blocks wholly below the first visible key."""
    with plug(student, LAB, only=["num_blocks_out_of_window"]):
        got = student.num_blocks_out_of_window(n, window, block_size)
    expect_equal(got, _spec_out_of_window(n, window, block_size),
                 "num_blocks_out_of_window(n, window, block_size) on a random case")


@pytest.mark.points(1)
@pytest.mark.task("num_blocks_out_of_window")
def test_window_release_refuses_bad_window(student):
    """A window of 0 or less would free blocks a query still reads: refused, naming the parameter."""
    with plug(student, LAB, only=["num_blocks_out_of_window"]):
        expect_raises(ValueError, student.num_blocks_out_of_window, 10, 0, 4, match="window",
                      message="num_blocks_out_of_window(10, window=0, block_size=4)")
        expect_raises(ValueError, student.num_blocks_out_of_window, 10, 4, 0, match="block_size",
                      message="num_blocks_out_of_window(10, window=4, block_size=0)")


def _prompt(n, seed):
    """n token ids in 3..502, fixed by the seed (no tokenizer: the tiny presets' vocabulary is 512)."""
    return [3 + (seed * 131 + i * 37) % 500 for i in range(n)]


def _engine_observed(run, stat):
    return {"tokens": run.tokens, stat: run.stats[stat], "held": run.held}


WINDOWED = [[("w0", _prompt(5, 0), 16), ("w1", _prompt(13, 1), 16), ("w2", _prompt(30, 2), 16)]]
WINDOWED_ENGINE = dict(model="tiny-mistral-swa", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16)


@functools.cache
def _reference_windowed():
    run = run_engine(WINDOWED, **WINDOWED_ENGINE)
    run.engine.shutdown()
    return _engine_observed(run, "num_blocks_out_of_window")


@pytest.mark.points(2)
@pytest.mark.task("num_blocks_out_of_window")
@pytest.mark.end_to_end
def test_engine_windowed_model_with_your_release(student):
    """tiny-mistral-swa (every layer sees its last 12 tokens), blocks of 4, prompts of 5, 13 and 30 tokens, 16 new
    tokens each, chunks of 16: before every step the engine frees the blocks your function says are out of the
    window (NULL in their table slots). The reference engine's run: the same greedy tokens, the same number of
    blocks freed out of the window (the engine counts them, not your function), none held at the end."""
    with plug(student, LAB, only=["num_blocks_out_of_window"]) as plugged:
        run = run_engine(WINDOWED, **WINDOWED_ENGINE)
        run.engine.shutdown()
        uncalled = plugged.uncalled()
    assert _reference_windowed()["num_blocks_out_of_window"] > 0, "no block left the window (a test bug)"
    expect_equal(_engine_observed(run, "num_blocks_out_of_window"), _reference_windowed(),
                 "the windowed model through the engine with your num_blocks_out_of_window: tokens by request, "
                 "blocks freed out of the window, blocks held at the end")
    expect_equal(uncalled, [], "seams the engine never called")


# ---- task 3: StreamingLLM and H2O at block granularity ------------------------------------------------------

def _spec_evict(policy, num_blocks, budget, sinks, recent, scores=None):
    """Keep sinks and the recent blocks; fill the rest of the budget with the latest (streaming) or the highest
    scores, the later block winning a tie (h2o); evict the others, ascending."""
    if num_blocks <= budget:
        return []
    middle = list(range(sinks, num_blocks - recent))
    room = budget - sinks - recent
    if policy == "streaming_llm":
        kept = set(middle[len(middle) - room:]) if room else set()
    else:
        kept = set(sorted(middle, key=lambda i: (-scores[i], -i))[:room])
    return [i for i in middle if i not in kept]


@pytest.mark.points(2)
@pytest.mark.task("evict_tokens")
def test_streaming_llm_keeps_sinks_and_the_recent_window(student):
    """10 blocks, budget 5, 1 sink, 2 recent: keep 0 and 7..9 plus the latest middle block 6; evict 1..5.
    Within budget already (5 blocks): nothing."""
    with plug(student, LAB, only=["evict_tokens"]):
        got = [student.evict_tokens("streaming_llm", 10, 5, 1, 2), student.evict_tokens("streaming_llm", 5, 5, 1, 2),
               student.evict_tokens("streaming_llm", 9, 4, 0, 4)]
    expect_equal(got, [_spec_evict("streaming_llm", 10, 5, 1, 2), [], _spec_evict("streaming_llm", 9, 4, 0, 4)],
                 "evict_tokens('streaming_llm', ...) for (10 blocks, budget 5, 1 sink, 2 recent), (5, 5, 1, 2), "
                 "(9, 4, 0 sinks, 4 recent)")


@pytest.mark.points(2)
@pytest.mark.task("evict_tokens")
def test_h2o_keeps_heavy_hitters(student):
    """8 blocks, budget 5, 1 sink, 2 recent: room for 2 of the middle blocks 1..5 by score [.., 0.1, 0.9, 0.3,
    0.9, 0.2, ..]: blocks 2 and 4 (a tie, both kept); evict 1, 3, 5. With scores 0.5 on 1..5 the tie goes to the
    most recent: keep 4 and 5."""
    scores = [9.0, 0.1, 0.9, 0.3, 0.9, 0.2, 0.0, 0.0]
    flat = [9.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0]
    with plug(student, LAB, only=["evict_tokens"]):
        got = [student.evict_tokens("h2o", 8, 5, 1, 2, scores), student.evict_tokens("h2o", 8, 5, 1, 2, flat)]
    expect_equal(got, [_spec_evict("h2o", 8, 5, 1, 2, scores), _spec_evict("h2o", 8, 5, 1, 2, flat)],
                 "evict_tokens('h2o', 8, 5, 1, 2, scores) with distinct-ish scores, then with equal middle scores")


@pytest.mark.points(2)
@pytest.mark.task("evict_tokens")
@lab_settings(60)
@seed(20261204)
@given(st.sampled_from(["streaming_llm", "h2o"]), st.integers(0, 40), st.integers(0, 4), st.integers(1, 4),
       st.integers(0, 8), st.lists(st.integers(0, 5), min_size=40, max_size=40))
def test_evict_tokens_matches_the_policies(student, policy, num_blocks, sinks, recent, extra, raw_scores):
    """Random sizes and integer scores (ties happen): the evicted blocks equal the policy's rule."""
    budget = sinks + recent + extra
    scores = [float(s) for s in raw_scores[:num_blocks]]
    with plug(student, LAB, only=["evict_tokens"]):
        got = student.evict_tokens(policy, num_blocks, budget, sinks, recent, scores)
    expect_equal(got, _spec_evict(policy, num_blocks, budget, sinks, recent, scores),
                 "evict_tokens(policy, num_blocks, budget, sinks, recent, scores) on a random case")


@pytest.mark.points(1)
@pytest.mark.task("evict_tokens")
def test_evict_tokens_refuses_bad_settings(student):
    """Sinks and the recent window larger than the budget, no recent block, an unknown policy, H2O without a
    score per block: each a ValueError naming the parameter."""
    with plug(student, LAB, only=["evict_tokens"]):
        expect_raises(ValueError, student.evict_tokens, "streaming_llm", 10, 3, 2, 2, match="budget_blocks",
                      message="evict_tokens('streaming_llm', 10, budget 3, 2 sinks, 2 recent)")
        expect_raises(ValueError, student.evict_tokens, "streaming_llm", 10, 3, 1, 0, match="num_recent_blocks",
                      message="evict_tokens('streaming_llm', 10, 3, 1 sink, 0 recent)")
        expect_raises(ValueError, student.evict_tokens, "lru", 10, 3, 1, 1, match="policy",
                      message="evict_tokens('lru', ...)")
        expect_raises(ValueError, student.evict_tokens, "h2o", 4, 3, 1, 1, [1.0], match="block_scores",
                      message="evict_tokens('h2o', 4 blocks, ..., block_scores of length 1)")


EVICTING = [[("e0", _prompt(3, 3), 16), ("e1", _prompt(10, 4), 16), ("e2", _prompt(29, 5), 16)]]
EVICTING_ENGINE = dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=8, kv_eviction="streaming_llm",
                       kv_budget_tokens=20, kv_sink_tokens=4, kv_recent_tokens=4)


@functools.cache
def _reference_evicting():
    run = run_engine(EVICTING, **EVICTING_ENGINE)
    run.engine.shutdown()
    return _engine_observed(run, "num_blocks_evicted")


@functools.cache
def _unevicted_tokens():
    run = run_engine(EVICTING, **{**EVICTING_ENGINE, "kv_eviction": None, "kv_budget_tokens": None,
                                  "kv_sink_tokens": 0, "kv_recent_tokens": None})
    run.engine.shutdown()
    return run.tokens


@pytest.mark.points(2)
@pytest.mark.task("evict_tokens")
@pytest.mark.end_to_end
def test_engine_streaming_llm_with_your_eviction(student):
    """tiny-llama with kv_eviction="streaming_llm": a budget of 20 tokens (5 blocks of 4), 1 sink block, 1 recent
    block, prompts of 3, 10 and 29 tokens (the last evicted while it is prefilled in chunks of 8), 16 new tokens
    each. Before every step the engine frees the blocks your function drops: the reference engine's greedy tokens
    (which depend on which blocks stayed), the same number of blocks evicted, none held at the end."""
    with plug(student, LAB, only=["evict_tokens"]) as plugged:
        run = run_engine(EVICTING, **EVICTING_ENGINE)
        run.engine.shutdown()
        uncalled = plugged.uncalled()
    assert _reference_evicting()["num_blocks_evicted"] > 0, "no block evicted (a test bug)"
    assert _reference_evicting()["tokens"] != _unevicted_tokens(), "eviction changed no token (a test bug)"
    expect_equal(_engine_observed(run, "num_blocks_evicted"), _reference_evicting(),
                 "StreamingLLM through the engine with your evict_tokens: tokens by request, blocks evicted, "
                 "blocks held at the end")
    expect_equal(uncalled, [], "seams the engine never called")


# ---- task 4: the offload tier's save and load ---------------------------------------------------------------

def _h(value, *tokens):
    return BlockHash(value, tuple(tokens))


def _tier(num_slots, stored=(), free=None):
    """A tier holding `stored` [(hash value, tokens, slot)] in LRU order, written directly (no seam runs)."""
    tier = OffloadTier(num_slots)
    for value, tokens, slot in stored:
        tier.entries[value] = (slot, _h(value, *tokens))
    used = {slot for _, _, slot in stored}
    tier.free_slots = [s for s in range(num_slots - 1, -1, -1) if s not in used] if free is None else list(free)
    return tier


def _state(tier):
    return {"entries": [(v, slot, list(h.token_ids)) for v, (slot, h) in tier.entries.items()],
            "free_slots": sorted(tier.free_slots), "saved": tier.counters.num_saved_blocks}


@pytest.mark.points(2)
@pytest.mark.task("save")
def test_save_plans_only_new_blocks(student):
    """Empty 4-slot tier, chain a, b, c from device blocks 5, 6, 2: copies (5, 0), (6, 1), (2, 2). Saving a, b, d
    again from blocks 9, 8, 7: a and b are stored (no copy, refreshed), d takes slot 3."""
    tier = _tier(4)
    with plug(student, LAB, only=["save"]):
        first = student.save(tier, [_h(10, 1), _h(11, 2), _h(12, 3)], [5, 6, 2])
        second = student.save(tier, [_h(10, 1), _h(11, 2), _h(13, 4)], [9, 8, 7])
    expect_equal([first, second, _state(tier)],
                 [[(5, 0), (6, 1), (2, 2)], [(7, 3)],
                  {"entries": [(12, 2, [3]), (10, 0, [1]), (11, 1, [2]), (13, 3, [4])], "free_slots": [],
                   "saved": 4}],
                 "save a, b, c into an empty 4-slot tier, then a, b, d: [plan 1, plan 2, tier state]")


@pytest.mark.points(2)
@pytest.mark.task("save")
def test_save_evicts_least_recently_used_never_its_own(student):
    """A full 2-slot tier [x (slot 0), y (slot 1)], LRU first. Saving p, q, r: p takes x's slot, q takes y's, r
    finds only p and q, saved by this call: not stored. The plan is the first two."""
    tier = _tier(2, [(50, (7,), 0), (51, (8,), 1)])
    with plug(student, LAB, only=["save"]):
        plan = student.save(tier, [_h(60, 1), _h(61, 2), _h(62, 3)], [4, 5, 6])
    expect_equal([plan, _state(tier)],
                 [[(4, 0), (5, 1)], {"entries": [(60, 0, [1]), (61, 1, [2])], "free_slots": [], "saved": 2}],
                 "save p, q, r into a full 2-slot tier [x, y]: [plan, tier state]")


@pytest.mark.points(1)
@pytest.mark.task("save")
def test_save_replaces_a_collision(student):
    """Stored: hash value 70 with tokens (1, 2) in slot 1. Saving hash value 70 with tokens (9, 9): another block,
    same value: it takes slot 1 (the stored one can never be served for it)."""
    tier = _tier(3, [(70, (1, 2), 1)])
    with plug(student, LAB, only=["save"]):
        plan = student.save(tier, [_h(70, 9, 9)], [8])
    expect_equal([plan, _state(tier)], [[(8, 1)], {"entries": [(70, 1, [9, 9])], "free_slots": [0, 2], "saved": 1}],
                 "save a block whose hash value collides with a stored one: [plan, tier state]")


def _load_state(tier):
    c = tier.counters
    return {"order": list(tier.entries), "queries": c.external_prefix_cache_queries,
            "hits": c.external_prefix_cache_hits, "collisions": c.num_collisions}


@pytest.mark.points(2)
@pytest.mark.task("load")
def test_load_returns_the_stored_run(student):
    """Stored a (slot 2), b (slot 0), c (slot 1), LRU first. Loading a, b, x, c: slots [2, 0] (x is not stored: the
    run stops); a and b become the most recent; 4 blocks queried, 2 hits."""
    tier = _tier(4, [(10, (1,), 2), (11, (2,), 0), (12, (3,), 1)])
    with plug(student, LAB, only=["load"]):
        got = student.load(tier, [_h(10, 1), _h(11, 2), _h(99, 5), _h(12, 3)])
    expect_equal([got, _load_state(tier)],
                 [[2, 0], {"order": [12, 10, 11], "queries": 4, "hits": 2, "collisions": 0}],
                 "load a, b, x (not stored), c: [slots, tier state]")


@pytest.mark.points(2)
@pytest.mark.task("load")
def test_load_never_serves_a_collision(student):
    """Stored: value 10 with tokens (1,), value 11 with tokens (2,). Loading value 10 with tokens (1,), then value
    11 with tokens (7,): the second is a collision, a miss: [slot of the first], one collision counted. Another
    LoRA's block (other extra keys) is a collision too."""
    tier = _tier(3, [(10, (1,), 2), (11, (2,), 0)])
    with plug(student, LAB, only=["load"]):
        first = student.load(tier, [_h(10, 1), _h(11, 7)])
        second = student.load(tier, [BlockHash(10, (1,), (3,))])
    expect_equal([first, second, _load_state(tier)],
                 [[2], [], {"order": [11, 10], "queries": 3, "hits": 1, "collisions": 2}],
                 "load (10, (1,)), (11, (7,)) then (10, (1,), lora 3): [slots, slots, tier state]")


@pytest.mark.points(1)
@pytest.mark.task("load")
def test_load_empty_and_first_miss(student):
    """Nothing asked: []. The first block missing: [] even if later ones are stored (a block without its parent is
    no use)."""
    tier = _tier(2, [(11, (2,), 1)])
    with plug(student, LAB, only=["load"]):
        got = [student.load(tier, []), student.load(tier, [_h(10, 1), _h(11, 2)])]
    expect_equal([got, _load_state(tier)], [[[], []], {"order": [11], "queries": 2, "hits": 0, "collisions": 0}],
                 "load [] and load [missing, stored]: [slots], tier state")


# ---- end to end: a returning session through the engine ---------------------------------------------------

A = list(range(1, 31))  # 30 tokens: 7 full blocks of 4
B = list(range(200, 230))
SESSION = ([("a1", A, 4)], [("b1", B, 4)], [("a2", A + [77, 78, 79, 80, 81], 4)])
ENGINE = dict(enable_prefix_caching=True, num_gpu_blocks=12, block_size=4, kv_offload_bytes=1 << 20)


def _observed(run):
    s = run.stats
    return {"tokens": run.tokens, "cached": run.cached, "loaded": s["kv_offload_loaded_blocks"],
            "saved": s["kv_offload_saved_blocks"], "failed": s["kv_offload_failed_loads"], "held": run.held}


@functools.cache
def _reference_session():
    run = run_engine(SESSION, **ENGINE)
    run.engine.shutdown()
    return _observed(run)


@functools.cache
def _recomputed_session():
    run = run_engine(SESSION, **{**ENGINE, "kv_offload_bytes": 0})
    run.engine.shutdown()
    return run.tokens


@pytest.mark.points(3)
@pytest.mark.task("load")
@pytest.mark.end_to_end
def test_engine_returning_session_with_your_tier(student):
    """Session A (30 tokens), then B (its blocks push A's out of the 12-block device cache), then A returns with 5
    new tokens: the engine saves finished requests' blocks with your `save`, finds A's lost blocks with your `load`
    and copies them back: the same greedy tokens as without offload, A's 7 prompt blocks served (3 still on the
    device, 4 loaded: 28 cached tokens), no block held at the end."""
    with plug(student, LAB, only=["save", "load"]) as plugged:
        run = run_engine(SESSION, **ENGINE)
        run.engine.shutdown()
        uncalled = plugged.uncalled()
    assert _reference_session()["tokens"] == _recomputed_session(), "offload changed the tokens (a test bug)"
    expect_equal(_observed(run), _reference_session(),
                 "the returning session through the engine with your save and load: tokens, cached tokens by "
                 "request, blocks loaded, saved, failed, held")
    expect_equal(uncalled, [], "seams the engine never called")
