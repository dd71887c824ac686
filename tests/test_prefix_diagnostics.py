"""The dynamic-field diagnostic (pagedkv.core.prefix_diagnostics), on token lists alone: no model."""

from __future__ import annotations

import logging
import random

import pytest
from pagedkv.core.prefix_diagnostics import (
    Divergence,
    PrefixDivergenceDetector,
    common_prefix_len,
    encode_tokens,
    find_divergence,
)

BLOCK = 16
_RNG = random.Random(0)
SYSTEM = [_RNG.randrange(100, 40000) for _ in range(400)]  # a shared "system prompt"


def own(seed: int, n: int = 40) -> list[int]:
    """A request's own part (history, question): different for every request."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def stamped(i: int, at: int = 5, width: int = 3) -> list[int]:
    """The system prompt with a per-request field of `width` tokens at position `at` (a timestamp)."""
    return SYSTEM[:at] + [50_000 + i * 7 + k for k in range(width)] + SYSTEM[at + width:] + own(i)


def test_timestamp_in_the_first_line_is_flagged_with_its_position(caplog):
    det = PrefixDivergenceDetector(BLOCK)
    with caplog.at_level(logging.WARNING, logger="pagedkv.core.prefix_diagnostics"):
        results = [det.observe(stamped(i)) for i in range(10)]
    assert results[:3] == [None, None, None]  # fewer than min_matches=3 earlier prompts to compare with
    assert all(r is not None and r.position == 5 for r in results[3:])
    assert det.num_warnings == 7
    assert det.positions == {5: 7}
    warnings = [r for r in caplog.records if "token position 5 (block 0)" in r.getMessage()]
    assert len(warnings) == 1  # logged once per block, counted every time


def test_field_of_varying_token_length_still_resyncs():
    """A field that tokenizes to 2, 3 or 4 tokens shifts the rest; the shared text is still found."""
    det = PrefixDivergenceDetector(BLOCK)
    prompts = [SYSTEM[:9] + [60_000 + i] * (2 + i % 3) + SYSTEM[9:] + own(i) for i in range(6)]
    flagged = [det.observe(p) for p in prompts]
    assert flagged[-1] is not None and flagged[-1].position == 9
    assert abs(flagged[-1].shift) <= 2


def test_identical_system_prompts_are_not_flagged():
    det = PrefixDivergenceDetector(BLOCK)
    assert all(det.observe(SYSTEM + own(i)) is None for i in range(20))
    assert det.num_warnings == 0


def test_unrelated_prompts_are_not_flagged():
    det = PrefixDivergenceDetector(BLOCK)
    assert all(det.observe(own(i, 300)) is None for i in range(20))
    assert det.num_warnings == 0


def test_late_divergence_is_not_flagged():
    """Differing after max_divergence_blocks: the cache already reuses the blocks before it."""
    det = PrefixDivergenceDetector(BLOCK, max_divergence_blocks=4)
    assert all(det.observe(stamped(i, at=4 * BLOCK)) is None for i in range(10))
    det = PrefixDivergenceDetector(BLOCK, max_divergence_blocks=4)
    assert det.observe(stamped(0, at=4 * BLOCK - 1)) is None
    assert [det.observe(stamped(i, at=4 * BLOCK - 1)) is not None for i in range(1, 5)] == [False, False, True, True]


def test_short_shared_tail_is_not_flagged():
    """Prompts that agree again only briefly (a chat template's closing tokens) are not the pattern."""
    det = PrefixDivergenceDetector(BLOCK, min_shared_tokens=64)
    tail = SYSTEM[:20]
    assert all(det.observe(SYSTEM[:3] + own(i, 30) + tail + own(100 + i, 30)) is None for i in range(10))


def test_different_cache_salts_are_not_compared():
    det = PrefixDivergenceDetector(BLOCK)
    assert all(det.observe(stamped(i), (f"tenant-{i}",)) is None for i in range(10))
    assert det.observe(stamped(99), ("tenant-1",)) is None  # only one earlier prompt with this salt


def test_window_bounds_memory_and_probe_bounds_work():
    det = PrefixDivergenceDetector(BLOCK, window=4, probe_tokens=128)
    for i in range(50):
        det.observe(stamped(i) * 10)
    assert len(det.recent) == 4
    assert all(len(p) == 128 * 4 for _, p in det.recent)  # int32 bytes of the first probe_tokens tokens


def test_find_divergence_reports_shared_run():
    p = SYSTEM[:100]
    r = p[:10] + [1, 2] + p[12:]
    d = find_divergence(p, r, max_divergence=64, max_gap=32, max_shift=4, anchor=8)
    assert (d.position, d.shift) == (10, 0)
    assert d.shared_after == 100 - 12  # from the first anchor after the field to the end
    assert find_divergence(p, list(p), 64, 32, 4, 8) is None
    assert find_divergence(p, p[:50], 64, 32, 4, 8) is None  # a prefix: no divergence
    shifted = p[:10] + [1, 2, 3] + p[12:]  # one token longer field: the rest is shifted by one
    assert find_divergence(p, shifted, 64, 32, 4, 8) == Divergence(10, 100 - 12, 1)


def test_common_prefix_len():
    for n in (0, 1, 5, 63, 64, 100):
        a = SYSTEM[:100]
        b = a[:n] + [7] + a[n + 1:]
        assert common_prefix_len(encode_tokens(a), encode_tokens(b)) == n
    assert common_prefix_len(encode_tokens(SYSTEM[:30]), encode_tokens(SYSTEM[:50])) == 30


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="min_shared_tokens"):
        PrefixDivergenceDetector(BLOCK, min_shared_tokens=4, anchor_tokens=8)
