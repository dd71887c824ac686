"""Prefix-cache hash index: chained block hashes, per-sequence hash state, hit counters.

Every **full** block of a sequence gets a chained hash

    h_i = H(h_{i-1}, token_ids of block i, extra_keys_i)

so one digest names a whole prefix: two blocks share a hash only if every
token before and in them matches. The block manager keeps the digest ->
physical block index (in C++, `pagedkv._block_manager`); this module computes
the digests and keeps, per sequence, the hashes of its full blocks plus the
tokens of its partial last block, so that a block is registered the moment
it fills.

Rules users should know:
- **Exact match only.** One differing token (a timestamp or request id in a
  system prompt) changes that block's hash and every hash after it.
- **Partial blocks are never shared.** Only full blocks are hashed, so a
  prefix shorter than one block (block_size tokens) never gets a hit, and the
  tail of any prefix past its last full block is always recomputed.
- **The last prompt token is always recomputed** (its logits are needed): a
  prompt whose length is a multiple of block_size reuses at most all but its
  last block.
- `extra_keys` (request level: a `cache_salt` for tenants who must not share
  cache, a LoRA id, multimodal ids) go into the hash of the first block; the
  chain carries them into every later one. Different keys, no sharing.
- Blocks are indexed when they are allocated (or filled by an append), i.e.
  before the forward pass writes their KV: a hit in the same step must be
  computed in that step's batch, which writes every KV before reading any.
- Default hash: SHA-256 over a canonical byte encoding (Python's `hash()` is
  seeded per process and its collisions can be forced). `hash_algo="xxhash"`
  (128-bit XXH3, needs the `xxhash` package) is faster but not collision
  resistant against an adversary: use it only when all prompts are trusted.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

HashAlgo = Literal["sha256", "xxhash"]
ExtraKey = str | bytes | int | None
HASH_ALGOS: tuple[str, ...] = ("sha256", "xxhash")

_INT64 = struct.Struct("<q")
_U32 = struct.Struct("<I")


def _digest_fn(hash_algo: str):
    if hash_algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if hash_algo == "xxhash":
        try:
            import xxhash
        except ImportError as e:
            raise ImportError("hash_algo='xxhash' needs the xxhash package: pip install xxhash") from e
        return lambda data: xxhash.xxh3_128_digest(data)
    raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")


def encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> bytes:
    """Canonical bytes of extra keys: per key a type tag, a length and the payload.

    The tag keeps "1" (str) and 1 (int) apart; lengths keep ("ab", "c") and
    ("a", "bc") apart.
    """
    parts = [_U32.pack(len(extra_keys))]
    for key in extra_keys:
        if key is None:
            tag, payload = b"n", b""
        elif isinstance(key, bool) or not isinstance(key, (str, bytes, int)):
            raise ValueError(f"extra keys must be str, bytes, int or None, got {type(key).__name__}: {key!r}")
        elif isinstance(key, str):
            tag, payload = b"s", key.encode("utf-8")
        elif isinstance(key, bytes):
            tag, payload = b"b", key
        else:
            tag, payload = b"i", str(key).encode("ascii")
        parts += [tag, _U32.pack(len(payload)), payload]
    return b"".join(parts)


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be int64 integers, got {list(token_ids)[:8]}...: {e}") from None


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
    hash_algo: HashAlgo = "sha256",
) -> bytes:
    """Digest of one block: H(parent digest, its token ids, extra keys).

    Encoding: u8 parent length + parent bytes, u32 count + little-endian
    int64 tokens, then `encode_extra_keys`. Returns 32 bytes (sha256) or 16 (xxhash).
    """
    parent = parent_hash or b""
    data = bytes([len(parent)]) + parent + _encode_tokens(token_ids) + encode_extra_keys(extra_keys)
    return _digest_fn(hash_algo)(data)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKey] = (),
    hash_algo: HashAlgo = "sha256",
) -> list[bytes]:
    """Chained digests of the full blocks of `token_ids` (a trailing partial block gets none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    digest = _digest_fn(hash_algo)
    extra = encode_extra_keys(extra_keys)
    empty = encode_extra_keys(())
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = bytes([len(parent)]) + parent + _encode_tokens(token_ids[start:start + block_size])
        parent = digest(data + (extra if start == 0 else empty))
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters in prompt tokens: `queries` looked up, `hits` served from the cache."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit

    def reset(self) -> None:
        self.queries = 0
        self.hits = 0


class PrefixIndex(Protocol):
    """The digest -> block index a manager core keeps (C++ or pure Python)."""

    def lookup_prefix(self, keys: list[bytes], max_blocks: int) -> list[int]: ...

    def cache_blocks(self, seq_id: int, first_block: int, keys: list[bytes]) -> int: ...


@dataclass(slots=True)
class _SeqHashes:
    hashes: list[bytes]  # one per full block
    tail: list[int]  # tokens of the partial last block
    extra_keys: tuple[ExtraKey, ...]
    tokens: list[int] | None = None  # every token, kept only while recording blocks (KV events)


@dataclass(slots=True)
class PrefixCache:
    """Hashing side of prefix caching for one block manager.

    `match` finds the cached blocks of a new prompt; `on_allocate` /
    `on_append` register blocks as they fill. The index itself lives in the
    manager core and is passed in.
    """

    block_size: int
    hash_algo: HashAlgo = "sha256"
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # record_blocks: keep, for the blocks offered to the index, their parent hash and tokens (KV events'
    # BlockStored); `take_recorded` empties it once per step.
    record_blocks: bool = False
    _seqs: dict[int, _SeqHashes] = field(default_factory=dict)
    _recorded: dict[bytes, tuple[bytes | None, list[int]]] = field(default_factory=dict)
    _recorded_keys: dict[bytes, tuple] = field(default_factory=dict)  # their requests' extra keys, where any

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        _digest_fn(self.hash_algo)  # fail now on an unknown or missing algorithm

    def prompt_hashes(self, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        return block_hashes(token_ids, self.block_size, extra_keys, self.hash_algo)

    def match(self, index: PrefixIndex, num_tokens: int, hashes: list[bytes]) -> list[int]:
        """Longest chain of cached blocks for a prompt, leaving its last token to recompute."""
        return index.lookup_prefix(hashes, (num_tokens - 1) // self.block_size)

    def on_allocate(self, index: PrefixIndex, seq_id: int, token_ids: Sequence[int], hashes: list[bytes],
                    num_hits: int, extra_keys: Sequence[ExtraKey], num_queried: int | None = None) -> None:
        """After allocate: register the new full blocks of `token_ids` (the tokens given slots), count the lookup.

        num_queried: prompt tokens looked up (default len(token_ids); more when
        only a first chunk of the prompt got slots).
        """
        index.cache_blocks(seq_id, num_hits, hashes[num_hits:])
        tail = list(token_ids[len(hashes) * self.block_size:])
        self._seqs[seq_id] = _SeqHashes(list(hashes), tail, tuple(extra_keys),
                                        list(token_ids) if self.record_blocks else None)
        if self.record_blocks:
            self._record(self._seqs[seq_id], num_hits)
        self.stats.record(len(token_ids) if num_queried is None else num_queried, num_hits * self.block_size)

    def on_append(self, index: PrefixIndex, seq_id: int, token_ids: Sequence[int]) -> None:
        """After append_slots: hash and register every block the new tokens filled."""
        state = self._seqs[seq_id]
        state.tail.extend(token_ids)
        if state.tokens is not None:
            state.tokens.extend(token_ids)
        first_new = len(state.hashes)
        while len(state.tail) >= self.block_size:
            parent = state.hashes[-1] if state.hashes else None
            extra = state.extra_keys if not state.hashes else ()
            state.hashes.append(hash_block_tokens(parent, state.tail[:self.block_size], extra, self.hash_algo))
            del state.tail[:self.block_size]
        if len(state.hashes) > first_new:
            index.cache_blocks(seq_id, first_new, state.hashes[first_new:])
            if state.tokens is not None:
                self._record(state, first_new)

    def on_fork(self, parent_id: int, child_id: int) -> None:
        s = self._seqs[parent_id]
        self._seqs[child_id] = _SeqHashes(list(s.hashes), list(s.tail), s.extra_keys,
                                          None if s.tokens is None else list(s.tokens))

    def on_swap_in(self, index: PrefixIndex, seq_id: int) -> None:
        """Swapped-in blocks are new GPU blocks: offer them to the index again."""
        index.cache_blocks(seq_id, 0, self._seqs[seq_id].hashes)
        if self._seqs[seq_id].tokens is not None:
            self._record(self._seqs[seq_id], 0)

    def _record(self, state: _SeqHashes, first: int) -> None:
        """Remembers (parent hash, tokens) of the sequence's blocks from `first` on (offered to the index now)."""
        bs = self.block_size
        for i in range(first, len(state.hashes)):
            parent = state.hashes[i - 1] if i else None
            self._recorded[state.hashes[i]] = (parent, state.tokens[i * bs:(i + 1) * bs])
            if state.extra_keys:
                self._recorded_keys[state.hashes[i]] = state.extra_keys

    def take_recorded(self) -> dict[bytes, tuple[bytes | None, list[int]]]:
        """hash -> (parent hash, token ids) of the blocks offered to the index since the last call."""
        out, self._recorded = self._recorded, {}
        return out

    def take_recorded_keys(self) -> dict[bytes, tuple]:
        """hash -> the extra keys (cache_salt, adapter) of the recorded blocks that had any; emptied per step."""
        out, self._recorded_keys = self._recorded_keys, {}
        return out

    def on_free(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def seq_hashes(self, seq_id: int) -> list[bytes]:
        """Digests of a sequence's full blocks (a copy)."""
        return list(self._seqs[seq_id].hashes)
