"""The prompt-lookup proposer: the longest suffix (lookup_max down to lookup_min) found earlier,
its earliest occurrence, the tokens after it."""
from __future__ import annotations

from kvmesh.engine.spec_decode.ngram import propose_ngram


def test_the_tokens_after_the_earliest_match_of_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 6, 7]
    # suffix [6, 7] occurs at 1 and 5: the earliest wins, then up to k tokens
    assert propose_ngram(tokens, 3, 1, 2) == [8, 9, 6]
    # suffix of 3 [1, 6, 7] never occurred: the 2-gram is used
    assert propose_ngram(tokens, 2, 2, 3) == [8, 9]
    # with only 3-grams allowed there is no match
    assert propose_ngram(tokens, 2, 3, 3) == []


def test_a_longer_suffix_is_preferred_over_an_earlier_shorter_one():
    tokens = [3, 4, 9, 2, 3, 4, 5, 2, 3, 4]
    # 1..2-gram [3, 4] first at 0 -> 9; the 3-gram [2, 3, 4] at 3 -> 5
    assert propose_ngram(tokens, 1, 1, 2) == [9]
    assert propose_ngram(tokens, 1, 1, 3) == [5]


def test_drafts_stop_at_the_known_tokens_and_respect_k():
    tokens = [1, 2, 3, 1, 2]
    assert propose_ngram(tokens, 8, 1, 2) == [3, 1, 2]
    assert propose_ngram(tokens, 0, 1, 2) == []
    assert propose_ngram([4], 3, 1, 1) == []
    assert propose_ngram([4, 4], 3, 1, 1) == [4]


def test_a_repeating_sequence_proposes_its_period():
    period = [10, 11, 12, 13]
    assert propose_ngram(period * 3, 6, 2, 3) == [10, 11, 12, 13, 10, 11]
