"""evict_tokens against cases worked by hand: StreamingLLM (sinks + recent) and H2O (sinks + heavy + recent)."""
import pytest

from engine_core.core.kv_eviction import evict_tokens


@pytest.mark.parametrize("num_blocks, budget, sinks, recent, expected", [
    (4, 4, 1, 1, []),                 # fits: nothing to evict
    (3, 4, 1, 1, []),
    (5, 4, 1, 1, [1]),                # keep 0 | 2 3 4
    (10, 4, 1, 1, [1, 2, 3, 4, 5, 6]),  # keep 0 | 7 8 9
    (10, 4, 0, 1, [0, 1, 2, 3, 4, 5]),  # no sinks: a plain recent window 6..9
    (10, 4, 2, 2, [2, 3, 4, 5, 6, 7]),  # keep 0 1 | 8 9
    (6, 3, 2, 1, [2, 3, 4]),          # keep 0 1 | 5
])
def test_streaming_llm(num_blocks, budget, sinks, recent, expected):
    assert evict_tokens("streaming_llm", num_blocks, budget, sinks, recent) == expected


@pytest.mark.parametrize("num_blocks, budget, sinks, recent, scores, expected", [
    # 6 blocks, budget 4, no sinks, 1 recent: the 3 best of blocks 0..4 stay (scores 5, 1, 9, 2, 7 -> 2, 4, 0)
    (6, 4, 0, 1, [5, 1, 9, 2, 7, 0], [1, 3]),
    # one sink (block 0 whatever its score), 1 recent (5), 2 heavy of 1..4 (scores 1, 9, 2, 7 -> 2, 4)
    (6, 4, 1, 1, [0, 1, 9, 2, 7, 0], [1, 3]),
    # the recent window is kept even with the lowest scores; 1 heavy of 0..3: block 1
    (6, 3, 0, 2, [3, 8, 1, 2, 0, 0], [0, 2, 3]),
    # a tie: the more recent block wins (blocks 1 and 3 score 4; one heavy slot)
    (5, 2, 0, 1, [0, 4, 1, 4, 0], [0, 1, 2]),
    # fits the budget: nothing, whatever the scores
    (3, 3, 0, 1, [0, 0, 0], []),
    # budget == sinks + recent: H2O has no heavy slot and is StreamingLLM
    (6, 2, 1, 1, [9, 9, 9, 9, 9, 9], [1, 2, 3, 4]),
])
def test_h2o(num_blocks, budget, sinks, recent, scores, expected):
    assert evict_tokens("h2o", num_blocks, budget, sinks, recent, scores) == expected


def test_what_stays_is_within_budget_and_keeps_sinks_and_recent():
    for policy in ("streaming_llm", "h2o"):
        for n in range(0, 12):
            scores = [(7 * i) % 5 for i in range(n)]
            evicted = evict_tokens(policy, n, 5, 1, 2, scores)
            kept = [i for i in range(n) if i not in evicted]
            assert len(kept) == min(n, 5) and evicted == sorted(set(evicted))
            if n > 5:
                assert 0 in kept and {n - 2, n - 1} <= set(kept)


@pytest.mark.parametrize("args, match", [
    (("lru", 4, 2, 0, 1), "policy"),
    (("streaming_llm", 4, 2, 2, 1), "budget_blocks"),      # sinks + recent > budget
    (("streaming_llm", 4, 2, 0, 0), "num_recent_blocks"),
    (("streaming_llm", -1, 2, 0, 1), "num_blocks"),
    (("streaming_llm", 4, 2, -1, 1), "num_sink_blocks"),
    (("h2o", 4, 2, 0, 1), "block_scores"),                 # no scores
    (("h2o", 4, 2, 0, 1, [1.0, 2.0]), "block_scores"),     # one per block
])
def test_bad_arguments_name_the_parameter(args, match):
    with pytest.raises(ValueError, match=match):
        evict_tokens(*args)
