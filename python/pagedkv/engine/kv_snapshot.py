"""A picture of the KV cache between two steps: the block pool, each sequence's block table, the queues, the stats.

`build_snapshot(engine)` takes one bulk call into the block manager
(`BlockManager.core.snapshot()`: per block its reference count, cached flag
and key prefix; per sequence its table) and the scheduler's sequences, and
returns a plain JSON-able dict, so it crosses the engine-core process
boundary and goes to the `/dashboard` page (and to `--kv-trace` files) as it
is. Schema (version 1):

    version       1
    time          time.time() when taken
    step          the engine's step count
    block_size    tokens per block
    num_blocks    blocks in the pool
    blocks        {"state": base64 of uint8 [num_blocks], "ref": base64 of uint8 [num_blocks] (reference counts,
                   capped at 255), "hash": base64 of little-endian uint64 [num_blocks] (first 8 bytes of a cached
                   block's chain hash, 0 if uncached)}
                  state: 0 free, 1 in use (one holder), 2 shared (reference count > 1), 3 cached and evictable
                  (free, its prefix still findable); BLOCK_STATES names them
    counts        {"free", "used", "shared", "cached"}: blocks per state
    seqs          per sequence the manager holds, by sequence id: {"seq_id", "request_id", "index" (sample),
                   "status" ("running" | "swapped" | ...), "prompt_tokens", "output_tokens", "cached_tokens"
                   (prompt tokens served from the prefix cache and its tiers), "num_tokens" (tokens with KV),
                   "table": physical block ids, -1 where a sliding window released one; a swapped sequence's ids
                   are CPU swap-pool blocks}
    queues        {"running", "waiting", "swapped"}: sequences per queue
    stats         EngineStats' fields (cumulative since start), as numbers
    warnings      {"prefix_divergence": prompts flagged so far, "positions": {token position: count}}
    advice        the tuning advice in force (pagedkv.engine.kv_advice, when the engine has an advisor)

Cost: O(num_blocks) in C++ plus O(sequences) in Python; no Python loop over blocks.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from typing import Any

import numpy as np

SNAPSHOT_VERSION = 1
BLOCK_FREE, BLOCK_USED, BLOCK_SHARED, BLOCK_CACHED = 0, 1, 2, 3
BLOCK_STATES = ("free", "used", "shared", "cached")


def block_states(ref_counts: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """uint8 state per block (BLOCK_STATES) from the manager's bulk arrays, vectorized."""
    states = np.where(ref_counts > 1, BLOCK_SHARED, BLOCK_USED).astype(np.uint8)
    free = ref_counts == 0
    states[free] = np.where(cached[free] != 0, BLOCK_CACHED, BLOCK_FREE)
    return states


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def decode_blocks(blocks: dict[str, str]) -> dict[str, np.ndarray]:
    """The arrays of a snapshot's "blocks" entry (for tests and trace readers)."""
    return {"state": np.frombuffer(base64.b64decode(blocks["state"]), dtype=np.uint8),
            "ref": np.frombuffer(base64.b64decode(blocks["ref"]), dtype=np.uint8),
            "hash": np.frombuffer(base64.b64decode(blocks["hash"]), dtype="<u8")}


def _seq_views(engine: Any, raw: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    by_id = {s.seq_id: s for s in (*engine.scheduler.running, *engine.scheduler.swapped)}
    offsets, blocks = raw["table_offsets"], raw["table_blocks"]
    views = []
    for i, seq_id in enumerate(raw["seq_ids"].tolist()):
        seq = by_id.get(seq_id)
        if seq is None:  # held by the manager but not scheduled (between a finish and the next schedule)
            continue
        req = seq.request
        views.append({
            "seq_id": seq_id, "request_id": req.request_id, "index": seq.index, "status": seq.status.value,
            "prompt_tokens": req.num_prompt_tokens, "output_tokens": seq.num_output_tokens,
            "cached_tokens": req.metrics.num_cached_tokens or 0, "num_tokens": int(raw["num_tokens"][i]),
            "table": blocks[offsets[i]:offsets[i + 1]].tolist(), "swapped": bool(raw["swapped"][i]),
        })
    return views


def build_snapshot(engine: Any) -> dict[str, Any]:
    """An LLMEngine's KV cache now, as the schema above (call it between steps; the engine is duck-typed, so
    this module stays below the engine it describes)."""
    bm = engine.block_manager
    raw = bm.core.snapshot()
    states = block_states(raw["ref_counts"], raw["cached"])
    counts = np.bincount(states, minlength=len(BLOCK_STATES))
    stats = engine.get_stats()
    diag = engine.prefix_diagnostics
    advisor = getattr(engine, "kv_advisor", None)
    return {
        "version": SNAPSHOT_VERSION, "time": time.time(), "step": engine.counters.num_steps,
        "block_size": bm.block_size, "num_blocks": int(states.size),
        "blocks": {"state": _b64(states), "ref": _b64(np.minimum(raw["ref_counts"], 255).astype(np.uint8)),
                   "hash": _b64(raw["key_prefix"].astype("<u8"))},
        "counts": {name: int(counts[i]) for i, name in enumerate(BLOCK_STATES)},
        "seqs": _seq_views(engine, raw),
        "queues": {"running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped},
        "stats": dataclasses.asdict(stats),
        "warnings": {"prefix_divergence": diag.num_warnings if diag else 0,
                     "positions": {str(k): v for k, v in (diag.positions.items() if diag else ())}},
        "advice": advisor.current() if advisor is not None else [],
    }
