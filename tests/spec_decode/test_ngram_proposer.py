"""The n-gram (prompt lookup) proposer on crafted token streams: vLLM's semantics (the longest suffix of
length in [min, max] that appeared before; its first earlier occurrence; the k tokens that followed)."""
from engine_core.spec_decode.ngram_proposer import NgramProposer


def propose(min_n: int, max_n: int, k: int, tokens: list[int], max_tokens: int | None = None) -> list[int]:
    return NgramProposer(min_n, max_n, k).propose(tokens, max_tokens)


def test_no_match_gives_no_draft():
    assert propose(2, 2, 2, [1, 2, 3, 4, 5]) == []
    assert propose(4, 4, 2, [1, 2, 3, 4, 1, 2, 3]) == []  # the 3-gram repeats, but min is 4
    assert propose(1, 3, 2, []) == [] and propose(1, 3, 2, [7]) == []


def test_a_shorter_ngram_matches_when_the_longer_does_not():
    assert propose(3, 4, 2, [1, 2, 3, 4, 1, 2, 3]) == [4, 1]


def test_the_longest_match_wins():
    assert propose(3, 4, 2, [2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4]) == [1, 2]  # the 4-gram's, not the 3-gram's [5, 1]
    assert propose(2, 4, 2, [3, 4, 5, 2, 3, 4, 1, 2, 3, 4]) == [1, 2]  # the 3-gram [2, 3, 4], not [3, 4]'s [5, 2]


def test_the_first_earlier_occurrence_wins():
    assert propose(3, 3, 2, [1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3]) == [100, 1]


def test_k_and_max_tokens_cap_the_draft_and_the_context_end_shortens_it():
    tokens = [9, 1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(2, 2, 3, tokens) == [3, 4, 5]
    assert propose(2, 2, 5, tokens) == [3, 4, 5, 6, 1]
    assert propose(2, 2, 3, tokens, max_tokens=1) == [3]
    assert propose(2, 2, 3, tokens, max_tokens=0) == []
    # the match [7, 8] at 1 is followed by only 2 tokens: the suffix itself
    assert propose(2, 2, 5, [0, 7, 8, 7, 8]) == [7, 8]


def test_a_repeating_run_proposes_its_continuation():
    assert propose(1, 3, 4, [5, 5, 5, 5]) == [5]  # [5, 5, 5] first at 0: one token follows before the suffix
    assert propose(1, 2, 4, [5, 5, 5, 5]) == [5, 5]
