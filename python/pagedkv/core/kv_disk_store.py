"""Disk tier of the prefix cache: KV blocks as files keyed by their chain hash.

A block is identified by its chained prefix hash (an opaque `bytes` digest,
see pagedkv.core.prefix_cache), so a file written by one server is valid for
any later server running the same model with the same KV settings. The engine
hands this module raw bytes (`block_nbytes` per block, fixed per store); the
store never sees torch.

Layout::

    root/
      <fingerprint digest hex[:32]>/      0700, one per model + KV setting
        fingerprint.json                  0600, the full mapping (for humans)
        ab/                               0700, fan-out on key.hex()[:2]
          ab12...ef.kvb                   0600, one block
          .tmp.<pid>.<thread id>.<n>      0600, a write in progress

File format (version 1, lengths little-endian)::

    offset  size         field
    0       4            magic b"PKVB"
    4       1            version (u8) = 1
    5       2            header length H (u16)
    7       H            header: compact JSON with sorted keys
                         {"fingerprint": <digest hex>, "key": <key hex>, "nbytes": <block_nbytes>}
    7+H     block_nbytes payload
    7+H+N   32           sha256 of every byte before it (SHA-NI makes it the fastest stdlib digest here)

Rules:
- **Fingerprint.** `fingerprint_digest` is the sha256 of the canonical JSON
  of the mapping the engine passes (model, dtype, block size, ...). A
  different mapping gives a different directory, which is never read; every
  file also carries the digest in its header, and a file whose digest is not
  ours is rejected.
- **Verified or unused.** `load` reads each file whole and checks its size,
  magic, version, header (fingerprint, key, nbytes) and checksum. A file that
  fails is rejected: counted in `stats` by reason, deleted (best effort) and
  never returned. `load` returns the longest verified prefix of the keys
  asked for, stopping at the first miss or rejected file, since a KV block
  is useless without every block before it.
- **Writes never block serving.** `store` only queues (a bounded queue; when
  it is full the block is dropped and counted); one daemon thread writes.
  Each write goes to a unique temp file (O_EXCL) in the final file's
  subdirectory and is renamed onto the final name, so a reader sees the whole
  file or none. No fsync: after a crash the checksum rejects a torn file.
  An I/O error (disk full, read-only disk, permissions) is logged, counted in
  `write_errors`, and the writer goes on.
- **Shared directories.** Several processes may use one directory: names are
  unique per pid and thread, renames are atomic and a key already on disk is
  not written again (same key, same content). Each process keeps its own
  index of the files and falls back to `os.stat` for a key it does not know.
- **Size limit.** With `max_bytes`, after each write (and at start-up) the
  least recently used files are deleted until this process's view of the
  directory fits; use is a store or a load by this process, and files found
  at start-up are ordered by mtime. Another process reading a file deleted
  under it sees a miss or a truncated file and recomputes.
- **Start-up** indexes the `*.kvb` files (name and size, by mtime) without
  reading them, and removes temp files older than an hour (a fresh one may be
  a live write by another server).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import itertools
import json
import logging
import os
import pathlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"PKVB"
VERSION = 1
CHECKSUM_NBYTES = 32
WRITER_NICE = 10  # the writer thread's nice value when it must catch up (see _set_priority)
# The writer runs in the background (SCHED_IDLE) until the queue is this full, then at normal priority until
# it is empty again: idle cores do the writing, and a busy machine still cannot starve it.
BOOST_FRACTION = 0.25
FILE_SUFFIX = ".kvb"
TMP_PREFIX = ".tmp."
FINGERPRINT_FILE = "fingerprint.json"
STALE_TMP_SECONDS = 3600.0
EXIT_TIMEOUT_SECONDS = 10.0
MAX_KEY_NBYTES = 64  # a 128-character hex name stays far below NAME_MAX

REJECT_REASONS: tuple[str, ...] = ("checksum", "truncated", "header", "key", "fingerprint", "io")

_PREFIX_NBYTES = len(MAGIC) + 1 + 2  # magic, u8 version, u16 header length
_DIR_MODE = 0o700
_FILE_MODE = 0o600


class _Rejected(Exception):
    """A block file that must not be used; `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _zero_reasons() -> dict[str, int]:
    return dict.fromkeys(REJECT_REASONS, 0)


@dataclass(slots=True)
class DiskTierStats:
    """Counters of one store; bytes are file sizes (header and checksum included)."""

    files_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    write_errors: int = 0
    files_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    files_rejected: int = 0  # corrupt, truncated, foreign, wrong key: never used
    rejected_by_reason: dict[str, int] = field(default_factory=_zero_reasons)
    files_evicted: int = 0  # deleted to respect max_bytes
    queue_dropped: int = 0  # blocks dropped because the write queue was full

    def snapshot(self) -> DiskTierStats:
        """A copy. Each counter is read whole (the GIL), but two counters may come from
        slightly different moments; `DiskKVStore.stats_snapshot` takes the store's lock."""
        return replace(self, rejected_by_reason=dict(self.rejected_by_reason))


def _canonical_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def fingerprint_digest(fingerprint: Mapping[str, object]) -> str:
    """sha256 hex of the canonical JSON (sorted keys, compact separators) of the mapping."""
    try:
        data = _canonical_json(dict(fingerprint))
    except (TypeError, ValueError) as e:
        raise TypeError(f"fingerprint values must be JSON-able (str, int, float, bool, list, None): {e}") from e
    return hashlib.sha256(data).hexdigest()


def _check_key(key: object) -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"keys must be bytes digests, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_NBYTES:
        raise ValueError(f"keys must be 1..{MAX_KEY_NBYTES} bytes, got {len(key)}")
    return key


def _mkdir_private(path: pathlib.Path) -> None:
    """Create a 0700 directory; chmod only one we created (umask may have stripped bits)."""
    try:
        os.mkdir(path, _DIR_MODE)
    except FileExistsError:
        return
    os.chmod(path, _DIR_MODE)


def _set_priority(tid: int | None, background: bool) -> bool:
    """Linux scheduling of the writer thread `tid` (a thread is a task with its own policy): `background` is
    SCHED_IDLE, which runs only on a core nothing else wants, so writing through never takes a core from the
    engine's compute threads; else normal scheduling at nice WRITER_NICE, for when the queue must drain.
    Returns whether it took effect (not Linux, or not allowed: the writer keeps what it has)."""
    if tid is None:
        return False
    try:
        if background:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
        return True
    except (AttributeError, OSError):
        return False


def _unlink_quiet(path: pathlib.Path | str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # best effort: already gone, or not ours to delete


class DiskKVStore:
    """KV blocks on disk for one fingerprint (model + KV settings); see the module docstring.

    `contains`, `load`, `store` and `flush` are meant for one engine thread; the
    writer thread shares the index and the stats under one lock, never held
    during I/O. Call `close()` (or use the store as a context manager): an
    unclosed store lives until interpreter exit, where it is flushed with a
    bounded wait.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: Mapping[str, object],
        block_nbytes: int,
        max_bytes: int | None = None,
        max_queued_blocks: int = 4096,
    ) -> None:
        if isinstance(block_nbytes, bool) or not isinstance(block_nbytes, int) or block_nbytes < 1:
            raise ValueError(f"block_nbytes must be a positive int, got {block_nbytes!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be None or >= 0, got {max_bytes}")
        if max_queued_blocks < 1:
            raise ValueError(f"max_queued_blocks must be >= 1, got {max_queued_blocks}")
        self.fingerprint: dict[str, object] = dict(fingerprint)
        self.fingerprint_digest: str = fingerprint_digest(self.fingerprint)
        self.block_nbytes = block_nbytes
        self.max_bytes = max_bytes
        self.max_queued_blocks = max_queued_blocks
        self._writer_tid: int | None = None  # the writer's native thread id, once it runs
        self._writer_background = False
        self.root = pathlib.Path(root)
        self.directory = self.root / self.fingerprint_digest[:32]
        self.stats = DiskTierStats()

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the writer waits for blocks
        self._idle = threading.Condition(self._lock)  # flush waits for in_flight == 0
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._index_bytes = 0
        self._queue: deque[tuple[bytes, np.ndarray]] = deque()
        self._queued: set[bytes] = set()  # in _queue or being written
        self._in_flight = 0
        self._closed = False
        self._stop = False
        self._warned: set[object] = set()
        self._tmp_counter = itertools.count()

        os.makedirs(self.root, mode=_DIR_MODE, exist_ok=True)
        _mkdir_private(self.directory)
        self._write_fingerprint_file()
        self._scan()
        self._evict()

        self._thread = threading.Thread(
            target=self._writer_loop, name=f"pagedkv-disk-writer-{self.fingerprint_digest[:8]}", daemon=True
        )
        self._thread.start()
        # The writer is a daemon thread (a stuck disk must not hang exit), so flush
        # queued blocks at exit ourselves, with a bounded wait.
        atexit.register(self._close_at_exit)

    # --- paths and format ----------------------------------------------------

    def _path(self, key: bytes) -> pathlib.Path:
        name = key.hex()
        return self.directory / name[:2] / (name + FILE_SUFFIX)

    def _header(self, key: bytes) -> bytes:
        return _canonical_json({"fingerprint": self.fingerprint_digest, "key": key.hex(), "nbytes": self.block_nbytes})

    def _file_prefix(self, key: bytes) -> bytes:
        """Everything before the payload: magic, version, header length, header."""
        header = self._header(key)
        return MAGIC + VERSION.to_bytes(1, "little") + len(header).to_bytes(2, "little") + header

    def _file_nbytes(self, key: bytes) -> int:
        return _PREFIX_NBYTES + len(self._header(key)) + self.block_nbytes + CHECKSUM_NBYTES

    def _verify(self, key: bytes, data: bytes | bytearray) -> memoryview:
        """The payload of a block file's bytes, or _Rejected; checks in the order a reader can."""
        expected = self._file_nbytes(key)
        if len(data) != expected:
            raise _Rejected("truncated", f"{len(data)} bytes, expected {expected}")
        if data[:4] != MAGIC or data[4] != VERSION:
            raise _Rejected("header", f"bad magic or version {data[:5]!r}")
        hlen = int.from_bytes(data[5:7], "little")
        if _PREFIX_NBYTES + hlen + self.block_nbytes + CHECKSUM_NBYTES != len(data):
            raise _Rejected("header", f"header length {hlen} does not match the file size")
        try:
            header = json.loads(data[_PREFIX_NBYTES : _PREFIX_NBYTES + hlen].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise _Rejected("header", f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise _Rejected("header", "header is not a JSON object")
        if header.get("fingerprint") != self.fingerprint_digest:
            raise _Rejected("fingerprint", f"written for fingerprint {header.get('fingerprint')!r}")
        if header.get("key") != key.hex():
            raise _Rejected("key", f"holds key {header.get('key')!r}")
        if header.get("nbytes") != self.block_nbytes:
            raise _Rejected("header", f"nbytes {header.get('nbytes')!r}, expected {self.block_nbytes}")
        body = memoryview(data)[:-CHECKSUM_NBYTES]
        if hashlib.sha256(body).digest() != data[-CHECKSUM_NBYTES:]:
            raise _Rejected("checksum", "checksum mismatch")
        return body[_PREFIX_NBYTES + hlen :]

    # --- start-up ------------------------------------------------------------

    def _write_fingerprint_file(self) -> None:
        """fingerprint.json, for humans: written once, atomically, by whoever comes first."""
        path = self.directory / FINGERPRINT_FILE
        if path.exists():
            return
        tmp = self._tmp_path(self.directory)
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, _FILE_MODE)
            with open(fd, "wb") as f:
                f.write(json.dumps(self.fingerprint, sort_keys=True, indent=2).encode() + b"\n")
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as e:
            _unlink_quiet(tmp)
            logger.warning("disk KV tier: could not write %s: %s", path, e)

    def _scan(self) -> None:
        """Index the block files already on disk (oldest mtime first); drop stale temp files."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for sub in self._scandir(self.directory):
            if sub.name.startswith(TMP_PREFIX):
                self._remove_if_stale(sub, now)
            elif len(sub.name) == 2 and sub.is_dir(follow_symlinks=False):
                for entry in self._scandir(sub.path):
                    if entry.name.startswith(TMP_PREFIX):
                        self._remove_if_stale(entry, now)
                    elif entry.name.endswith(FILE_SUFFIX):
                        item = self._index_entry(entry, sub.name)
                        if item is not None:
                            found.append(item)
        found.sort(key=lambda item: item[0])
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._index_bytes += size

    @staticmethod
    def _scandir(path: pathlib.Path | str) -> list[os.DirEntry]:
        try:
            with os.scandir(path) as it:
                return list(it)
        except OSError as e:
            logger.warning("disk KV tier: cannot list %s: %s", path, e)
            return []

    @staticmethod
    def _index_entry(entry: os.DirEntry, fan_out: str) -> tuple[float, bytes, int] | None:
        """(mtime, key, size) of a block file, or None for a name that is not one we write."""
        name = entry.name[: -len(FILE_SUFFIX)]
        try:
            key = bytes.fromhex(name)
            st = entry.stat(follow_symlinks=False)
        except (ValueError, OSError):
            return None  # not one of ours, or gone meanwhile
        if not key or key.hex() != name or name[:2] != fan_out:
            return None
        return st.st_mtime, key, st.st_size

    @staticmethod
    def _remove_if_stale(entry: os.DirEntry, now: float) -> None:
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                os.unlink(entry.path)
        except OSError:
            pass  # another server cleaned it up, or finished it

    # --- reads (engine thread) -------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """Whether the block is on disk as far as this process knows, else by os.stat
        (another server may have written it). Queued, unwritten blocks are not on disk yet."""
        key = _check_key(key)
        with self._lock:
            if key in self._index:
                return True
        try:
            st = os.stat(self._path(key))
        except OSError:
            return False
        if st.st_size != self._file_nbytes(key):
            return False  # load would reject it; leave that (and the delete) to load
        self._remember(key, st.st_size)
        return True

    def load(self, keys: Sequence[bytes]) -> np.ndarray:
        """uint8 [m, block_nbytes]: the blocks of the longest verified prefix of `keys`."""
        rows = self.load_blocks(keys)
        out = np.empty((len(rows), self.block_nbytes), dtype=np.uint8)
        for i, row in enumerate(rows):
            out[i] = np.frombuffer(row, dtype=np.uint8)
        return out

    def load_blocks(self, keys: Sequence[bytes]) -> list[memoryview]:
        """`load` without the stacking: one read-only buffer of block_nbytes per block of the verified prefix.

        What the engine uses: it copies each block straight into the cache, and a fresh [m, block_nbytes]
        array would cost a page fault per 4 KiB on top of the reads.
        """
        keys = [_check_key(k) for k in keys]
        t0 = time.perf_counter()
        rows: list[memoryview] = []
        nbytes = 0
        for key in keys:
            data = self._read_verified(key)
            if data is None:
                break
            payload, size = data
            rows.append(payload)
            self._remember(key, size)
            nbytes += size
        elapsed = time.perf_counter() - t0
        with self._lock:
            self.stats.files_loaded += len(rows)
            self.stats.bytes_loaded += nbytes
            self.stats.load_seconds += elapsed
        return rows

    def _read_verified(self, key: bytes) -> tuple[memoryview, int] | None:
        """(payload, file size) of a verified file; None on a miss or a rejected file."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                # One byte more than expected, so a too-long file is seen as wrong too. A bytearray, so the
                # payload handed on is a writable buffer (torch.frombuffer wants one).
                data = bytearray(self._file_nbytes(key) + 1)
                del data[f.readinto(data):]
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            self._reject(key, path, _Rejected("io", str(e)))
            return None
        try:
            return self._verify(key, data), len(data)
        except _Rejected as r:
            self._reject(key, path, r)
            return None

    def _reject(self, key: bytes, path: pathlib.Path, rejected: _Rejected) -> None:
        _unlink_quiet(path)  # so that neither we nor another server tries it again
        reason = rejected.reason
        with self._lock:
            self._drop_from_index(key)
            self.stats.files_rejected += 1
            self.stats.rejected_by_reason[reason] = self.stats.rejected_by_reason.get(reason, 0) + 1
        self._warn_once(reason, f"{reason!r} rejections", "disk KV tier: rejected %s (%s: %s)", path, reason, rejected)

    def _warn_once(self, kind: object, later: str, message: str, *args: object) -> None:
        """Logs `message` as a warning the first time `kind` happens and at debug level after that, so a disk
        that keeps failing the same way does not flood the log."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            logger.warning(message + "; later %s are logged at debug level", *args, later)
        else:
            logger.debug(message, *args)

    # --- index (under the lock) ----------------------------------------------

    def _remember(self, key: bytes, size: int) -> None:
        """Mark a file on disk as the most recently used."""
        with self._lock:
            self._add_to_index(key, size)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._drop_from_index(key)

    def _add_to_index(self, key: bytes, size: int) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self._index_bytes -= old
        self._index[key] = size
        self._index_bytes += size

    def _drop_from_index(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._index_bytes -= size

    def _pick_victims(self) -> list[bytes]:
        victims = []
        while self.max_bytes is not None and self._index_bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._index_bytes -= size
            victims.append(key)
        self.stats.files_evicted += len(victims)
        return victims

    def _evict(self) -> None:
        with self._lock:
            victims = self._pick_victims()
        for key in victims:
            _unlink_quiet(self._path(key))

    @property
    def num_files(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._index_bytes

    def stats_snapshot(self) -> DiskTierStats:
        """A consistent copy of the stats (taken under the store's lock)."""
        with self._lock:
            return self.stats.snapshot()

    # --- writes ----------------------------------------------------------------

    def store(self, keys: Sequence[bytes], payload: np.ndarray) -> int:
        """Queue blocks for writing; returns how many were queued.

        `payload` is uint8 [len(keys), block_nbytes], C-contiguous, and is not
        copied: the caller hands over a fresh array it will not modify. Keys
        already on disk (as far as this process knows) or queued are skipped;
        when the queue is full a block is dropped (`stats.queue_dropped`).
        """
        keys = [_check_key(k) for k in keys]
        self._check_payload(payload, len(keys))
        queued = 0
        with self._lock:
            if self._closed:
                raise RuntimeError("DiskKVStore.store after close()")
            for i, key in enumerate(keys):
                if key in self._index or key in self._queued:
                    continue
                if len(self._queue) >= self.max_queued_blocks:
                    self.stats.queue_dropped += 1
                    continue
                self._queue.append((key, payload[i]))
                self._queued.add(key)
                self._in_flight += 1
                queued += 1
            if queued:
                self._work.notify()
            boost = self._writer_background and len(self._queue) >= BOOST_FRACTION * self.max_queued_blocks
        if boost:
            self._foreground()
        return queued

    def _foreground(self) -> None:
        """The writer must catch up (a filling queue, a flush): normal priority until its queue is empty."""
        if _set_priority(self._writer_tid, background=False):
            self._writer_background = False

    def _check_payload(self, payload: object, num_keys: int) -> None:
        if not isinstance(payload, np.ndarray):
            raise ValueError(f"payload must be a numpy array, got {type(payload).__name__}")
        if payload.dtype != np.uint8:
            raise ValueError(f"payload must have dtype uint8, got {payload.dtype}")
        if payload.shape != (num_keys, self.block_nbytes):
            raise ValueError(
                f"payload must have shape [len(keys), block_nbytes] = {[num_keys, self.block_nbytes]}, "
                f"got {list(payload.shape)}"
            )
        if not payload.flags.c_contiguous:
            raise ValueError("payload must be C-contiguous (np.ascontiguousarray)")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or failed); True if the queue drained."""
        if self._writer_background:
            self._foreground()
        with self._lock:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def _writer_loop(self) -> None:
        self._writer_tid = threading.get_native_id()
        self._writer_background = _set_priority(self._writer_tid, background=True)
        while True:
            with self._lock:
                self._work.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    return
                key, row = self._queue.popleft()
                drained = not self._queue
            if drained and not self._writer_background:  # caught up: back to the idle cores
                self._writer_background = _set_priority(self._writer_tid, background=True)
            try:
                self._write_block(key, row)
            except Exception:  # a bug must not kill the writer: serving goes on without it
                logger.exception("disk KV tier: unexpected error writing %s", key.hex())
                with self._lock:
                    self.stats.write_errors += 1
            finally:
                with self._lock:
                    self._queued.discard(key)
                    self._in_flight -= 1
                    if self._in_flight == 0:
                        self._idle.notify_all()

    def _write_block(self, key: bytes, row: np.ndarray) -> None:
        path = self._path(key)
        t0 = time.perf_counter()
        try:
            size = os.stat(path).st_size  # another server wrote it: same key, same content
            self._remember(key, size)
            return
        except FileNotFoundError:
            pass
        except OSError as e:
            self._write_error(path, e)
            return
        try:
            size = self._write_file(key, row, path)
        except OSError as e:
            self._write_error(path, e)
            return
        elapsed = time.perf_counter() - t0
        with self._lock:
            self._add_to_index(key, size)
            self.stats.files_written += 1
            self.stats.bytes_written += size
            self.stats.write_seconds += elapsed
            victims = self._pick_victims()
        for victim in victims:
            _unlink_quiet(self._path(victim))

    def _tmp_path(self, directory: pathlib.Path) -> pathlib.Path:
        # Unique per process, thread and write, so that two servers never share one.
        return directory / f"{TMP_PREFIX}{os.getpid()}.{threading.get_ident()}.{next(self._tmp_counter)}"

    def _write_file(self, key: bytes, row: np.ndarray, path: pathlib.Path) -> int:
        """Write one block file atomically (temp file + rename); returns its size."""
        _mkdir_private(path.parent)
        prefix = self._file_prefix(key)
        checksum = hashlib.sha256(prefix)
        checksum.update(row)
        tmp = self._tmp_path(path.parent)
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, _FILE_MODE)
        try:
            with open(fd, "wb") as f:
                f.write(prefix)
                f.write(row)
                f.write(checksum.digest())
            os.replace(tmp, path)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        return len(prefix) + row.nbytes + CHECKSUM_NBYTES

    def _write_error(self, path: pathlib.Path, e: OSError) -> None:
        code = e.errno
        with self._lock:
            self.stats.write_errors += 1
        name = errno.errorcode.get(code, str(code)) if code is not None else "?"
        self._warn_once(("write", code), f"{name} errors", "disk KV tier: cannot write %s (%s: %s), serving goes on",
                        path, name, e)

    # --- shutdown --------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Flush (waiting up to `timeout` seconds, None: as long as it takes), then stop
        the writer. Idempotent; blocks still queued when the wait ends are not written."""
        atexit.unregister(self._close_at_exit)
        self._shutdown(timeout)

    def _close_at_exit(self) -> None:
        self._shutdown(EXIT_TIMEOUT_SECONDS)

    def _shutdown(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._closed = True
        self.flush(timeout)
        with self._lock:
            self._stop = True
            unwritten = self._in_flight  # only non-zero when the wait timed out
            for key, _ in self._queue:
                self._queued.discard(key)
            self._in_flight -= len(self._queue)
            self._queue.clear()
            if self._in_flight == 0:
                self._idle.notify_all()
            self._work.notify_all()
        if unwritten:
            logger.warning("disk KV tier: closed with %d block(s) not written (the disk is slow or stuck)", unwritten)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._thread is not threading.current_thread():
            self._thread.join(remaining)

    def __enter__(self) -> DiskKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DiskKVStore({str(self.directory)!r}, block_nbytes={self.block_nbytes}, "
            f"files={self.num_files}, bytes={self.num_bytes}, max_bytes={self.max_bytes})"
        )
