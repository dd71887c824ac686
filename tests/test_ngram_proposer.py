"""N-gram (prompt lookup) draft proposer: the C++ scan against its brute-force Python twin.

The rule: the longest n in [min_n, max_n] whose suffix also occurs earlier,
its earliest occurrence, the up to min(k, max_len - L) tokens after it.
"""

import random

import numpy as np
import pytest
from pagedkv.spec_decode.ngram import propose, reference_propose

# (vocabulary size, cases): tiny vocabularies make matches, long ones and ties
# common; large ones (ids past 2**32 too) make them rare.
VOCABS = [(1, 200), (2, 800), (3, 800), (5, 800), (50, 400), (32_000, 300), (2**40, 200)]


def random_case(rng: random.Random, vocab: int) -> tuple[list[int], int, int, int, int]:
    length = rng.randint(0, 300)
    if rng.random() < 0.3:
        # A repeated phrase with a few edits: matches longer than max_n.
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        tokens = (phrase * (length // len(phrase) + 1))[:length]
        for _ in range(rng.randint(0, 3)):
            if tokens:
                tokens[rng.randrange(len(tokens))] = rng.randrange(vocab)
    else:
        tokens = [rng.randrange(vocab) for _ in range(length)]
    min_n = rng.randint(1, 5)
    max_n = rng.randint(min_n, min_n + 6)
    k = rng.randint(0, 10)
    # Mostly near the end of the context, where the max_len clip bites.
    max_len = rng.choice([max(0, length + rng.randint(-3, 12)), 1 << 20, 0])
    return tokens, min_n, max_n, k, max_len


@pytest.mark.parametrize("vocab,cases", VOCABS)
def test_matches_reference_on_random_sequences(vocab, cases):
    rng = random.Random(vocab)
    found = 0
    for _ in range(cases):
        args = random_case(rng, vocab)
        got = propose(*args)
        assert got == reference_propose(*args), args
        found += bool(got)
    if vocab <= 5:
        assert found > cases // 4  # The comparison exercised real matches, not only [].


@pytest.mark.parametrize("propose_fn", [propose, reference_propose])
class TestKnownCases:
    def test_earliest_occurrence_of_longest_match_wins(self, propose_fn):
        # [1, 2] occurs at 0 and at 3: the first one's follower is drafted.
        assert propose_fn([1, 2, 9, 1, 2, 8, 1, 2], 1, 2, 1, 100) == [9]

    def test_longer_match_beats_earlier_shorter_one(self, propose_fn):
        # [3] occurs first at 0, but [5, 6, 3] occurs at 2.
        tokens = [3, 9, 5, 6, 3, 8, 5, 6, 3]
        assert propose_fn(tokens, 1, 3, 3, 100) == [8, 5, 6]
        assert propose_fn(tokens, 1, 1, 3, 100) == [9, 5, 6]

    def test_match_longer_than_max_n_counts_as_max_n(self, propose_fn):
        # With max_n=2 the earliest [2, 3] wins although [1, 2, 3] matches longer later.
        tokens = [2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
        assert propose_fn(tokens, 1, 2, 1, 100) == [7]
        assert propose_fn(tokens, 1, 3, 1, 100) == [8]

    def test_occurrence_may_overlap_the_suffix(self, propose_fn):
        # [1, 2, 1] at 0 overlaps the suffix [1, 2, 1] at 2.
        assert propose_fn([1, 2, 1, 2, 1], 1, 3, 5, 100) == [2, 1]
        assert propose_fn([7, 7, 7, 7], 1, 3, 2, 100) == [7]

    def test_suffix_itself_is_no_occurrence(self, propose_fn):
        assert propose_fn([4, 5, 6], 1, 3, 2, 100) == []
        assert propose_fn([5], 1, 1, 2, 100) == []

    def test_min_n_excludes_short_matches(self, propose_fn):
        assert propose_fn([5, 1, 6, 1], 2, 3, 2, 100) == []
        assert propose_fn([5, 1, 6, 1], 1, 3, 2, 100) == [6, 1]

    def test_k_clipped_by_end_of_tokens(self, propose_fn):
        assert propose_fn([1, 2, 3, 1], 1, 1, 10, 100) == [2, 3, 1]

    def test_k_clipped_by_max_len(self, propose_fn):
        tokens = [1, 2, 3, 1, 2]
        assert propose_fn(tokens, 1, 2, 3, 100) == [3, 1, 2]
        assert propose_fn(tokens, 1, 2, 3, 7) == [3, 1]
        assert propose_fn(tokens, 1, 2, 3, 6) == [3]
        # At or past the model's max length no draft could be kept.
        assert propose_fn(tokens, 1, 2, 3, 5) == []
        assert propose_fn(tokens, 1, 2, 3, 4) == []
        assert propose_fn(tokens, 1, 2, 3, 0) == []

    def test_k_zero(self, propose_fn):
        assert propose_fn([1, 2, 1], 1, 2, 0, 100) == []

    def test_no_match(self, propose_fn):
        assert propose_fn([1, 2, 3, 4], 1, 4, 3, 100) == []

    def test_shorter_than_min_n(self, propose_fn):
        assert propose_fn([1, 1], 3, 4, 3, 100) == []
        assert propose_fn([], 1, 1, 3, 100) == []

    def test_large_k_and_max_len(self, propose_fn):
        # No overflow when k and max_len are near the int64 limit.
        big = 2**63 - 1
        assert propose_fn([1, 2, 1], 1, 1, big, big) == [2, 1]


@pytest.mark.parametrize("propose_fn", [propose, reference_propose])
@pytest.mark.parametrize(
    "min_n,max_n,k,max_len,message",
    [
        (0, 2, 1, 10, "min_n must be >= 1, got 0"),
        (3, 2, 1, 10, r"max_n must be >= min_n, got max_n=2 < min_n=3"),
        (1, 2, -1, 10, "k must be >= 0, got -1"),
        (1, 2, 1, -1, "max_len must be >= 0, got -1"),
    ],
)
def test_bad_arguments(propose_fn, min_n, max_n, k, max_len, message):
    with pytest.raises(ValueError, match=message):
        propose_fn([1, 2, 1], min_n, max_n, k, max_len)
    # Checked before anything is looked at, also on an empty context.
    with pytest.raises(ValueError, match=message):
        propose_fn([], min_n, max_n, k, max_len)


def test_tokens_must_be_1d():
    with pytest.raises(ValueError, match="tokens must be 1-D, got 2-D"):
        propose(np.zeros((2, 3), dtype=np.int64), 1, 2, 1, 10)


def test_numpy_and_list_inputs_agree():
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens = rng.integers(0, 4, size=int(rng.integers(0, 200)))
        expected = propose(tokens.tolist(), 1, 3, 4, 10_000)
        assert expected == reference_propose(tokens.tolist(), 1, 3, 4, 10_000)
        for arr in (tokens.astype(np.int64), tokens.astype(np.int32), tuple(tokens.tolist())):
            assert propose(arr, 1, 3, 4, 10_000) == expected
    # A non-contiguous view is copied, not misread.
    strided = np.array([1, 0, 2, 0, 1, 0, 2, 0, 1, 0], dtype=np.int64)[::2]
    assert propose(strided, 1, 2, 2, 100) == [2, 1]


def test_returns_python_ints():
    drafts = propose(np.array([1, 2, 1], dtype=np.int64), 1, 1, 2, 100)
    assert drafts == [2, 1] and all(type(t) is int for t in drafts)


def test_long_sequences():
    # 100k tokens: random text (the scan runs to the end), a run of one token
    # (the first end stops it), and a repeat only at the far end.
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 32_000, size=100_000)
    assert propose(tokens, 1, 4, 5, 200_000) == reference_propose(tokens.tolist(), 1, 4, 5, 200_000)
    assert propose(np.full(100_000, 7), 1, 4, 5, 200_000) == [7] * 5
    distinct = np.arange(100_000)
    assert propose(distinct, 1, 4, 5, 200_000) == []
    assert propose(np.append(distinct, [99_998, 99_999]), 1, 4, 5, 200_000) == [99_998, 99_999]
