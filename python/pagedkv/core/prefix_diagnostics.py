"""Spotting prompts that defeat the prefix cache: a long shared prefix broken early by a dynamic field.

Prefix caching matches whole blocks from the first token on, so a field that
changes per request near the start of a prompt (a timestamp or a request id
in a system prompt's first line) makes every block after it a miss, even
though the rest of the system prompt is identical. The symptom is easy to
miss (outputs stay right, only throughput and memory suffer), so the engine
watches for its signature and says so once, naming the token position.

The signature, for a new prompt P against a recent prompt R:
1. P and R first differ at position d, inside the first
   `max_divergence_blocks` blocks (later divergences already share d // block_size blocks);
2. a little later they agree again: a run of `anchor_tokens` tokens of P
   starting 1, 2, 4, ... (up to `max_gap_tokens`) tokens after d occurs in R,
   shifted by at most `max_shift_tokens` (a field can tokenize to a different length);
3. from that anchor on they agree for at least `min_shared_tokens` tokens:
   a long shared text the cache cannot reuse.
A prompt is flagged when at least `min_matches` of the last `window` prompts
(with the same cache salt: different salts never share) show it. The counter
counts flagged prompts; the warning is logged once per block index of the
divergence (a timestamp's changing digit moves the position by a token or two).
`LLMEngine.add_request` feeds every prompt to one detector when prefix
caching is on; the count is `EngineStats.prefix_divergence_warnings`.

Cost: only the first `probe_tokens` tokens of a prompt are looked at, as
int32 bytes, against a ring of `window` earlier prompts. Prefix lengths are
binary searches of memcmp's and the resync search is a few `bytes.find`s at
anchors 1, 2, 4, ... tokens past the divergence, all at C speed: a request
costs ~20 us against 16 recent prompts that share its prefix and ~0.2 ms
against 16 unrelated ones (2-core EPYC), whatever its length.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_ITEM = 4  # bytes per token in the int32 encoding
_ANCHOR_OFFSETS = (1, 2, 4, 8, 16, 32, 64)  # where after the divergence to look for resync (a field's width)


@dataclass(slots=True, frozen=True)
class Divergence:
    """Where two prompts part (`position`), and how much they share again afterwards."""

    position: int
    shared_after: int  # tokens that match again from the resync anchor on (within the probe)
    shift: int  # R's position minus P's for the shared text (a field of a different token length)


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as int32 bytes: prefixes compare with memcmp and runs are found with bytes.find."""
    return array("i", token_ids).tobytes()


def common_prefix_len(a: bytes, b: bytes) -> int:
    """Tokens a and b (int32 bytes) share from the start: a binary search over prefix equality (memcmp)."""
    lo, hi = 0, min(len(a), len(b)) // _ITEM
    if a[:hi * _ITEM] == b[:hi * _ITEM]:
        return hi
    while lo < hi:  # invariant: the first lo tokens match, the first hi do not
        mid = (lo + hi + 1) // 2
        if a[:mid * _ITEM] == b[:mid * _ITEM]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _find_token_run(haystack: bytes, needle: bytes, lo: int, hi: int) -> int:
    """Token index where `needle` occurs in haystack[lo:hi] (token indices) on a token boundary, or -1."""
    at = haystack.find(needle, lo * _ITEM, hi * _ITEM)
    while at >= 0 and at % _ITEM:
        at = haystack.find(needle, at + 1, hi * _ITEM)
    return -1 if at < 0 else at // _ITEM


def find_divergence_bytes(p: bytes, r: bytes, max_divergence: int, max_gap: int, max_shift: int,
                          anchor: int) -> Divergence | None:
    """find_divergence on int32 token bytes (what the detector keeps)."""
    n_p, n_r = len(p) // _ITEM, len(r) // _ITEM
    d = common_prefix_len(p, r)
    if d >= min(n_p, n_r) or d >= max_divergence:
        return None  # one is a prefix of the other, or they share >= max_divergence tokens: the cache works
    for offset in _ANCHOR_OFFSETS:  # geometric: finds a resync at most ~2x past the field's end, in few probes
        start = d + offset
        if offset > max_gap or start + anchor > n_p:
            break
        needle = p[start * _ITEM:(start + anchor) * _ITEM]
        q = _find_token_run(r, needle, max(0, start - max_shift), min(n_r, start + max_shift + anchor))
        if q >= 0:
            return Divergence(d, common_prefix_len(p[start * _ITEM:], r[q * _ITEM:]), q - start)
    return None


def find_divergence(p: Sequence[int], r: Sequence[int], max_divergence: int, max_gap: int, max_shift: int,
                    anchor: int) -> Divergence | None:
    """The early divergence of token sequences p and r followed by a shared run, or None.

    None when one is a prefix of the other, they differ only after
    `max_divergence` tokens, or they never agree again (unrelated prompts).
    The resync is looked for `anchor` tokens at a time, 1, 2, 4, ... up to
    `max_gap` tokens after the divergence, at most `max_shift` tokens away.
    """
    return find_divergence_bytes(encode_tokens(p), encode_tokens(r), max_divergence, max_gap, max_shift, anchor)


class PrefixDivergenceDetector:
    """Watches incoming prompts for the dynamic-field pitfall (see the module docstring).

    Args:
        block_size: the KV block size (divergence limits are in blocks of it).
        window: recent prompts kept for comparison.
        min_matches: recent prompts that must show the pattern with a new one to flag it.
        max_divergence_blocks: the divergence must fall inside these first blocks.
        min_shared_tokens: tokens the prompts must share again after the divergence.
        probe_tokens: tokens of each prompt looked at (bounds memory and time).
    """

    def __init__(self, block_size: int, window: int = 16, min_matches: int = 3, max_divergence_blocks: int = 4,
                 min_shared_tokens: int = 64, probe_tokens: int = 256, max_gap_tokens: int = 32,
                 max_shift_tokens: int = 4, anchor_tokens: int = 8) -> None:
        if min_shared_tokens < anchor_tokens:
            raise ValueError(f"min_shared_tokens ({min_shared_tokens}) must be >= anchor_tokens ({anchor_tokens})")
        self.block_size = block_size
        self.min_matches = min_matches
        self.max_divergence = max_divergence_blocks * block_size
        self.min_shared = min_shared_tokens
        self.probe = probe_tokens
        self.max_gap, self.max_shift, self.anchor = max_gap_tokens, max_shift_tokens, anchor_tokens
        self.recent: deque[tuple[tuple, bytes]] = deque(maxlen=window)
        self.num_warnings = 0  # prompts flagged
        self.positions: dict[int, int] = {}  # divergence position -> prompts flagged there
        self._logged_blocks: set[int] = set()

    def observe(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> Divergence | None:
        """Checks a new prompt against the recent ones, then remembers it; returns the divergence if flagged."""
        p = encode_tokens(token_ids[:self.probe])
        hits = [d for keys, r in self.recent if keys == extra_keys
                and (d := find_divergence_bytes(p, r, self.max_divergence, self.max_gap, self.max_shift, self.anchor))
                and d.shared_after >= self.min_shared]
        self.recent.append((extra_keys, p))
        if len(hits) < self.min_matches:
            return None
        first = min(hits, key=lambda d: d.position)  # the earliest part defeats the most blocks
        self._report(first, len(hits))
        return first

    def _report(self, div: Divergence, matches: int) -> None:
        self.num_warnings += 1
        self.positions[div.position] = self.positions.get(div.position, 0) + 1
        block = div.position // self.block_size
        if block not in self._logged_blocks:  # once per block: a stream of such prompts must not flood the log
            self._logged_blocks.add(block)
            logger.warning(
                "prefix cache: %d recent prompts differ from this one at token position %d (block %d) but share "
                "%d+ tokens again after it, so the cache reuses at most %d block(s) of their common text; a "
                "per-request field (timestamp, id?) early in a shared prompt defeats prefix caching: move it after "
                "the shared part",
                matches, div.position, block, div.shared_after, block)
