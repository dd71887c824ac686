"""KV-cache traces: snapshots of a run (pagedkv.engine.kv_snapshot) saved as JSON lines, to replay offline.

    recorder = KVTraceRecorder("run.jsonl.gz")    # gzip when the name ends in .gz
    engine.kv_trace = recorder                    # LLMEngine.step() calls maybe_record after each step
    ...
    recorder.close()                              # writes the last step's snapshot if it was skipped
    snapshots = read_trace("run.jsonl.gz")        # what `pagedkv kv-view` serves

A snapshot is taken at most every `interval_s` seconds (it costs O(blocks)
in C++ plus O(sequences) in Python), so a long run stays cheap. `close()`
always takes one more from the engine it last saw: the step's hook runs
before the step's outputs free finished sequences, so only this one shows the
state the run ended in.
"""

from __future__ import annotations

import gzip
import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

_GZIP_MAGIC = b"\x1f\x8b"


class SnapshotSource(Protocol):
    """Anything that can describe its KV cache (an LLMEngine, or a stand-in in tests)."""

    def kv_snapshot(self) -> dict[str, Any]: ...


def _open_new(path: Path) -> IO[str]:
    """A fresh file (one trace is one run: an old one at the path is replaced)."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "wt", encoding="utf-8")
    return open(path, "w", encoding="utf-8")


class KVTraceRecorder:
    """Appends an engine's KV snapshots to `path` (JSON lines), at most one every `interval_s` seconds."""

    def __init__(self, path: str | Path, interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self.num_records = 0
        self._clock = clock
        self._file: IO[str] | None = _open_new(self.path)
        self._last_time: float | None = None
        self._engine: SnapshotSource | None = None  # the engine last seen: close() snapshots its final state

    def maybe_record(self, engine: SnapshotSource) -> bool:
        """After a step: records a snapshot if `interval_s` has passed since the last one. True if it did."""
        now = self._clock()
        self._engine = engine
        if self._last_time is not None and now - self._last_time < self.interval_s:
            return False
        self._last_time = now
        self.record(engine.kv_snapshot())
        return True

    def record(self, snapshot: dict[str, Any]) -> None:
        """Appends one snapshot as it is (also for snapshots fetched from a server)."""
        if self._file is None:
            raise ValueError(f"the trace {self.path} is closed")
        self._file.write(json.dumps(snapshot, separators=(",", ":")) + "\n")
        self.num_records += 1

    def close(self) -> None:
        """Records the engine's final state (if it stepped at all), then closes the file (idempotent)."""
        if self._file is None:
            return
        if self._engine is not None:
            self.record(self._engine.kv_snapshot())
        self._file.close()
        self._file = None

    def __enter__(self) -> KVTraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text_of(path: Path) -> str:
    """The trace's text, gzip or not (told by its first bytes, not its name). A gzip stream cut short (a run
    that was killed) gives what it holds so far, as zlib decompresses what it has."""
    raw = path.read_bytes()
    parts = []
    while raw.startswith(_GZIP_MAGIC):  # one gzip member after another
        member = zlib.decompressobj(wbits=31)
        parts.append(member.decompress(raw))
        raw = member.unused_data
    if not parts:
        return raw.decode("utf-8")
    return b"".join(parts).decode("utf-8", errors="ignore")


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The snapshots of a trace file, in order. A last line cut mid-write is dropped; a bad line elsewhere
    raises ValueError naming it."""
    lines = _text_of(Path(path)).splitlines()
    snapshots = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            snapshots.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not a snapshot: {e}") from e
    return snapshots
