"""N-gram (prompt lookup) draft proposer: `propose` (C++) and its Python twin.

Text often repeats itself (code, quoted documents, lists), so the tokens that
followed an earlier occurrence of a sequence's last few tokens are a cheap
guess at its next ones. `propose` runs the C++ scan in
pagedkv._block_manager; `reference_propose` is the brute-force statement of
the same rule that the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv._block_manager import propose_ngram


def _check_args(min_n: int, max_n: int, k: int, max_len: int) -> None:
    # Same checks and messages as the C++ side, so both twins fail alike.
    if min_n < 1:
        raise ValueError(f"propose_ngram: min_n must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"propose_ngram: max_n must be >= min_n, got max_n={max_n} < min_n={min_n}")
    if k < 0:
        raise ValueError(f"propose_ngram: k must be >= 0, got {k}")
    if max_len < 0:
        raise ValueError(f"propose_ngram: max_len must be >= 0, got {max_len}")


def _first_occurrence(tokens: list[int], n: int) -> int | None:
    """Smallest j with tokens[j:j+n] == tokens[-n:] and j + n < len(tokens), or None."""
    length = len(tokens)
    suffix = tokens[length - n:]
    for j in range(length - n):
        if tokens[j:j + n] == suffix:
            return j
    return None


def reference_propose(tokens: Sequence[int], min_n: int, max_n: int, k: int, max_len: int) -> list[int]:
    """Draft tokens for a sequence by prompt lookup, the rule of vLLM's ngram proposer.

    `tokens` is the sequence's whole context (prompt + output so far), of
    length L. Find the longest n in [min_n, max_n] whose suffix tokens[L-n:]
    also occurs earlier, as tokens[j:j+n] with j + n < L (it may overlap the
    suffix but not be the suffix itself); take the earliest such j; return
    tokens[j+n : j+n+kk] with kk = min(k, max_len - L), clipped at L.
    Returns [] when L < min_n, when no n matches, or when kk <= 0 (the
    sequence is at the model's max length `max_len`). Brute force, O(L^2 * max_n):
    for tests, not for the engine.
    """
    _check_args(min_n, max_n, k, max_len)
    tokens = [int(t) for t in tokens]
    num_drafts = min(k, max_len - len(tokens))
    if len(tokens) < min_n or num_drafts <= 0:
        return []
    # Longest first: the first n that matches anywhere wins.
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        j = _first_occurrence(tokens, n)
        if j is not None:
            return tokens[j + n:j + n + num_drafts]
    return []


def propose(tokens: Sequence[int], min_n: int, max_n: int, k: int, max_len: int) -> list[int]:
    """Same as `reference_propose`, in C++: about one comparison per token, O(L * max_n) at worst.

    `tokens` may be a list of ints or a 1-D integer numpy array (cast to int64).
    Raises ValueError on bad arguments.
    """
    return propose_ngram(tokens, min_n, max_n, k, max_len)
