"""Disk tier of the prefix cache: file format, verification, prefix rule, eviction, errors, sharing."""

import builtins
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from pagedkv.core import kv_disk_store
from pagedkv.core.kv_disk_store import DiskKVStore, DiskTierStats, fingerprint_digest

FP = {"model": "tiny-llama", "dtype": "float16", "block_size": 16, "kv_cache_dtype": "auto", "layers": [0, 1]}
LOGGER = "pagedkv.core.kv_disk_store"
MODULE_PATH = kv_disk_store.__file__


def key(i, nbytes=32):
    return hashlib.sha256(f"block {i}".encode()).digest()[:nbytes]


def block_of(k, nbytes):
    """Content determined by the key, as in the engine: every writer of a key writes the same bytes."""
    return np.frombuffer(hashlib.shake_256(k).digest(nbytes), dtype=np.uint8)


def blocks(keys, nbytes):
    return np.stack([block_of(k, nbytes) for k in keys]) if keys else np.empty((0, nbytes), np.uint8)


@pytest.fixture
def make_store(tmp_path):
    """Factory of stores under tmp_path/root; every store is closed at teardown."""
    made = []

    def make(fingerprint=FP, block_nbytes=1000, root=None, **kw):
        s = DiskKVStore(root or tmp_path / "root", fingerprint, block_nbytes, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(timeout=5)


def write(store, keys):
    assert store.store(keys, blocks(keys, store.block_nbytes)) == len(keys)
    assert store.flush(timeout=10)


def file_of(store, k):
    return store.directory / k.hex()[:2] / (k.hex() + ".kvb")


def header_len(store, k):
    return int.from_bytes(file_of(store, k).read_bytes()[5:7], "little")


# --- format and round trip -------------------------------------------------------

@pytest.mark.parametrize("block_nbytes,key_nbytes", [(1000, 32), (777, 16)])
def test_round_trip_in_key_order(make_store, block_nbytes, key_nbytes):
    s = make_store(block_nbytes=block_nbytes)
    keys = [key(i, key_nbytes) for i in range(6)]
    payload = np.random.default_rng(0).integers(0, 256, (6, block_nbytes), dtype=np.uint8)
    assert s.store(keys, payload) == 6
    assert s.flush(timeout=10)
    order = [3, 0, 5, 1]
    out = s.load([keys[i] for i in order])
    assert out.dtype == np.uint8 and out.shape == (4, block_nbytes) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, payload[order])
    st = s.stats_snapshot()
    assert (st.files_written, st.files_loaded, st.files_rejected) == (6, 4, 0)
    size = file_of(s, keys[0]).stat().st_size
    assert st.bytes_written == 6 * size and st.bytes_loaded == 4 * size
    assert st.write_seconds > 0 and st.load_seconds > 0
    assert s.num_files == 6 and s.num_bytes == 6 * size


def test_file_format_is_documented_layout(make_store):
    s = make_store(block_nbytes=777)
    k = key(0)
    write(s, [k])
    data = file_of(s, k).read_bytes()
    assert data[:4] == b"PKVB" and data[4] == 1
    hlen = int.from_bytes(data[5:7], "little")
    header = json.loads(data[7 : 7 + hlen])
    assert header == {"fingerprint": s.fingerprint_digest, "key": k.hex(), "nbytes": 777}
    assert data[7 + hlen : 7 + hlen + 777] == block_of(k, 777).tobytes()
    assert data[-32:] == hashlib.sha256(data[:-32]).digest()
    assert len(data) == 7 + hlen + 777 + 32 == file_nbytes(FP, 777, k)


def test_load_returns_the_verified_prefix_only(make_store):
    s = make_store()
    a, b, c = key(0), key(1), key(2)
    write(s, [a, c])
    out = s.load([a, b, c])
    np.testing.assert_array_equal(out, blocks([a], 1000))
    assert s.load([b, a]).shape == (0, 1000)
    assert s.load([]).shape == (0, 1000)
    assert s.stats.files_rejected == 0  # a missing file is a plain miss


def test_restart_finds_and_loads_previous_files(make_store, tmp_path):
    keys = [key(i) for i in range(5)]
    s1 = make_store()
    write(s1, keys)
    s1.close()
    s2 = make_store()
    assert s2.num_files == 5 and s2.num_bytes == s1.num_bytes
    assert all(s2.contains(k) for k in keys)
    np.testing.assert_array_equal(s2.load(keys), blocks(keys, 1000))
    assert s2.store(keys, blocks(keys, 1000)) == 0  # already on disk


def test_fingerprint_digest_is_canonical():
    d = fingerprint_digest(FP)
    assert d == fingerprint_digest(dict(reversed(list(FP.items()))))
    assert d == hashlib.sha256(json.dumps(FP, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert d != fingerprint_digest({**FP, "dtype": "bfloat16"})
    with pytest.raises(TypeError, match="JSON-able"):
        fingerprint_digest({"model": object()})


def test_different_fingerprint_uses_another_directory(make_store):
    keys = [key(i) for i in range(3)]
    s1 = make_store()
    write(s1, keys)
    s2 = make_store(fingerprint={**FP, "kv_cache_dtype": "fp8"})
    assert s2.directory != s1.directory and s2.directory.parent == s1.directory.parent
    assert s1.directory.name == s1.fingerprint_digest[:32]
    assert s2.num_files == 0 and not s2.contains(keys[0])
    assert s2.load(keys).shape == (0, 1000)
    assert json.loads((s2.directory / "fingerprint.json").read_text()) == {**FP, "kv_cache_dtype": "fp8"}


def test_permissions_are_private(make_store):
    s = make_store()
    k = key(0)
    write(s, [k])

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    assert mode(s.directory) == 0o700
    assert mode(file_of(s, k).parent) == 0o700
    assert mode(file_of(s, k)) == 0o600
    assert mode(s.directory / "fingerprint.json") == 0o600


# --- verification ----------------------------------------------------------------

def assert_rejected(s, k, reason):
    assert s.load([k]).shape == (0, 1000)
    st = s.stats_snapshot()
    assert st.files_rejected == 1 and st.rejected_by_reason[reason] == 1
    assert sum(st.rejected_by_reason.values()) == 1
    assert not file_of(s, k).exists()  # deleted, so it is not tried again
    assert not s.contains(k)
    assert s.load([k]).shape == (0, 1000) and s.stats.files_rejected == 1  # now a plain miss


def test_corrupt_payload_byte_is_rejected(make_store):
    s = make_store()
    a, b = key(0), key(1)
    write(s, [a, b])
    path = file_of(s, a)
    data = bytearray(path.read_bytes())
    data[7 + header_len(s, a) + 500] ^= 0x01
    path.write_bytes(bytes(data))
    assert s.load([a, b]).shape == (0, 1000)  # the first block is bad: no prefix at all
    assert_rejected(s, a, "checksum")
    np.testing.assert_array_equal(s.load([b]), blocks([b], 1000))
    assert s.num_files == 1


@pytest.mark.parametrize("size", [0, 5, 600, -1, "long"])
def test_truncated_or_long_file_is_rejected(make_store, size):
    s = make_store()
    k = key(0)
    write(s, [k])
    path = file_of(s, k)
    data = path.read_bytes()
    path.write_bytes(data + b"\0" if size == "long" else data[:size])
    assert_rejected(s, k, "truncated")


def test_file_under_another_keys_name_is_rejected(make_store):
    s = make_store()
    a, b = key(0), key(1)
    write(s, [a, b])
    shutil.copyfile(file_of(s, a), file_of(s, b))
    assert_rejected(s, b, "key")
    np.testing.assert_array_equal(s.load([a]), blocks([a], 1000))


def test_file_from_another_fingerprint_is_rejected(make_store):
    s = make_store()
    other = make_store(fingerprint={**FP, "model": "other-llama"})
    k = key(0)
    write(other, [k])
    file_of(s, k).parent.mkdir(mode=0o700)
    shutil.copyfile(file_of(other, k), file_of(s, k))
    assert_rejected(s, k, "fingerprint")


@pytest.mark.parametrize("what", ["magic", "version", "json", "not_object", "hlen", "nbytes"])
def test_header_garbage_is_rejected(make_store, what):
    s = make_store()
    k = key(0)
    write(s, [k])
    path = file_of(s, k)
    data = bytearray(path.read_bytes())
    hlen = header_len(s, k)
    if what == "magic":
        data[:4] = b"XXXX"
    elif what == "version":
        data[4] = 2
    elif what == "json":
        data[7 : 7 + hlen] = b"{" * hlen
    elif what == "not_object":
        data[7 : 7 + hlen] = b"[" + b" " * (hlen - 2) + b"]"
    elif what == "hlen":
        data[5:7] = (hlen - 1).to_bytes(2, "little")
    else:  # a well-formed header that claims another block size, same length
        header = json.loads(data[7 : 7 + hlen])
        header["nbytes"] = 9999
        new = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        assert len(new) == hlen
        data[7 : 7 + hlen] = new
    path.write_bytes(bytes(data))
    assert_rejected(s, k, "header")


def test_io_error_is_rejected(make_store):
    s = make_store()
    k = key(0)
    path = file_of(s, k)
    path.parent.mkdir(mode=0o700)
    path.mkdir()  # opening a directory as the block file fails with IsADirectoryError
    assert s.load([k]).shape == (0, 1000)
    assert s.stats.rejected_by_reason["io"] == 1


def test_each_reject_reason_warns_once(make_store, caplog):
    s = make_store()
    keys = [key(i) for i in range(3)]
    write(s, keys)
    for k in keys:
        file_of(s, k).write_bytes(b"short")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for k in keys:
            s.load([k])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "rejected" in r.getMessage()]
    debugs = [r for r in caplog.records if r.levelno == logging.DEBUG and "rejected" in r.getMessage()]
    assert len(warnings) == 1 and len(debugs) == 2
    assert s.stats.rejected_by_reason["truncated"] == 3


# --- size limit --------------------------------------------------------------------

def file_nbytes(fingerprint, block_nbytes, k):
    """Size of a block file, from the documented format."""
    header = json.dumps(
        {"fingerprint": fingerprint_digest(fingerprint), "key": k.hex(), "nbytes": block_nbytes},
        sort_keys=True, separators=(",", ":"),
    ).encode()
    return 7 + len(header) + block_nbytes + 32


def test_max_bytes_evicts_least_recently_used(make_store):
    k0, k1, k2, k3, k4 = (key(i) for i in range(5))
    size = file_nbytes(FP, 1000, k0)  # the same for every key of one length
    s = make_store(max_bytes=3 * size)
    write(s, [k0, k1, k2])
    assert s.num_files == 3 and s.stats.files_evicted == 0
    assert s.load([k0]).shape == (1, 1000)  # k0 is now the most recently used: k1 goes first
    write(s, [k3])
    assert s.stats.files_evicted == 1 and not file_of(s, k1).exists()
    assert all(file_of(s, k).exists() for k in (k0, k2, k3))
    write(s, [k4])
    assert not file_of(s, k2).exists() and s.stats.files_evicted == 2
    assert s.num_files == 3 and s.num_bytes == 3 * size <= s.max_bytes


def test_max_bytes_at_start_evicts_oldest_by_mtime(make_store):
    keys = [key(i) for i in range(4)]
    s1 = make_store()
    write(s1, keys)
    s1.close()
    size = file_of(s1, keys[0]).stat().st_size
    now = time.time()
    for age, k in zip([10, 40, 20, 30], keys, strict=True):
        os.utime(file_of(s1, k), (now - age, now - age))
    s2 = make_store(max_bytes=2 * size)
    assert s2.stats.files_evicted == 2 and s2.num_files == 2
    assert [file_of(s2, k).exists() for k in keys] == [True, False, True, False]


# --- write errors and the queue ----------------------------------------------------

@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions (see the ENOSPC test)")
def test_read_only_directory_counts_write_errors(make_store):
    s = make_store()
    bad, good = key(0), key(1)
    os.chmod(s.directory, 0o500)
    try:
        write(s, [bad])
        assert s.stats.write_errors == 1 and s.stats.files_written == 0
    finally:
        os.chmod(s.directory, 0o700)
    write(s, [good])
    np.testing.assert_array_equal(s.load([good]), blocks([good], 1000))


class _FailingFile:
    """Stands in for the temp file's writer: the temp file exists, its writes fail."""

    def __init__(self, fd, code):
        self.fd, self.code = fd, code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)

    def write(self, data):
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("where,code", [("open", errno.ENOSPC), ("write", errno.EIO), ("replace", errno.EROFS)])
def test_write_errors_are_counted_and_serving_goes_on(make_store, monkeypatch, caplog, where, code):
    """Disk full, I/O error, read-only disk, simulated (the tests may run as root)."""
    s = make_store()
    failing = threading.Event()
    failing.set()
    real_open, real_replace = os.open, os.replace

    def fake_os_open(path, *a, **kw):
        if failing.is_set() and ".tmp." in os.fspath(path):
            raise OSError(code, os.strerror(code))
        return real_open(path, *a, **kw)

    def fake_open(file, *a, **kw):
        if failing.is_set() and isinstance(file, int):
            return _FailingFile(file, code)
        return builtins.open(file, *a, **kw)

    def fake_replace(src, dst, *a, **kw):
        if failing.is_set():
            raise OSError(code, os.strerror(code))
        return real_replace(src, dst, *a, **kw)

    if where == "open":
        monkeypatch.setattr(os, "open", fake_os_open)
    elif where == "write":
        monkeypatch.setattr(kv_disk_store, "open", fake_open, raising=False)
    else:
        monkeypatch.setattr(os, "replace", fake_replace)

    keys = [key(i) for i in range(3)]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert s.store(keys, blocks(keys, 1000)) == 3
        assert s.flush(timeout=10)
    st = s.stats_snapshot()
    assert st.write_errors == 3 and st.files_written == 0 and s.num_files == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and errno.errorcode[code] in warnings[0].getMessage()
    assert not any(".tmp." in p.name for p in s.directory.rglob("*"))  # temp files cleaned up

    failing.clear()
    good = key(10)
    write(s, [good])  # the writer is still alive and the store still accepts blocks
    np.testing.assert_array_equal(s.load([good]), blocks([good], 1000))
    assert s.store(keys, blocks(keys, 1000)) == 3  # failed blocks may be offered again
    assert s.flush(timeout=10) and s.stats.files_written == 4


def test_unexpected_writer_exception_does_not_kill_the_writer(make_store, monkeypatch):
    s = make_store()
    monkeypatch.setattr(s, "_write_file", lambda *a: 1 / 0)
    write(s, [key(0)])
    assert s.stats.write_errors == 1
    monkeypatch.undo()
    write(s, [key(1)])
    assert s.load([key(1)]).shape == (1, 1000)


def test_full_queue_drops_blocks_without_blocking(make_store, monkeypatch):
    s = make_store(max_queued_blocks=1)
    started, release = threading.Event(), threading.Event()
    real = s._write_file

    def slow(*a):
        started.set()
        assert release.wait(10)
        return real(*a)

    monkeypatch.setattr(s, "_write_file", slow)
    keys = [key(i) for i in range(5)]
    assert s.store(keys[:1], blocks(keys[:1], 1000)) == 1
    assert started.wait(10)  # the writer holds block 0; the queue is empty again
    t0 = time.perf_counter()
    assert s.store(keys[1:], blocks(keys[1:], 1000)) == 1  # block 1 queued, 2..4 dropped
    assert time.perf_counter() - t0 < 1.0
    assert s.stats.queue_dropped == 3
    assert not s.flush(timeout=0.05)
    release.set()
    assert s.flush(timeout=10)
    np.testing.assert_array_equal(s.load(keys), blocks(keys[:2], 1000))


def test_store_skips_keys_on_disk_or_queued(make_store):
    s = make_store()
    keys = [key(i) for i in range(3)]
    write(s, keys)
    assert s.store(keys, blocks(keys, 1000)) == 0
    dup = [key(5), key(5), key(0)]
    assert s.store(dup, blocks(dup, 1000)) == 1
    assert s.flush(timeout=10) and s.stats.files_written == 4


def test_writer_skips_a_file_another_server_wrote(make_store):
    s1, s2 = make_store(), make_store()
    k = key(0)
    write(s1, [k])
    mtime = file_of(s1, k).stat().st_mtime_ns
    assert s2.store([k], blocks([k], 1000)) == 1  # s2 does not know it yet: the writer stats
    assert s2.flush(timeout=10)
    assert s2.stats.files_written == 0 and s2.num_files == 1
    assert file_of(s1, k).stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda n: np.zeros((n, 1000), np.float32), "dtype uint8"),
        (lambda n: np.zeros((n, 999), np.uint8), "shape"),
        (lambda n: np.zeros((n + 1, 1000), np.uint8), "shape"),
        (lambda n: np.zeros(n * 1000, np.uint8), "shape"),
        (lambda n: np.zeros((n, 2000), np.uint8)[:, ::2], "C-contiguous"),
        (lambda n: [[0] * 1000] * n, "numpy array"),
    ],
)
def test_store_rejects_a_bad_payload(make_store, bad, match):
    s = make_store()
    with pytest.raises(ValueError, match=match):
        s.store([key(0), key(1)], bad(2))
    assert s.flush(timeout=1) and s.num_files == 0


def test_bad_keys_and_arguments(make_store, tmp_path):
    s = make_store()
    with pytest.raises(TypeError, match="bytes"):
        s.contains("ab" * 16)
    with pytest.raises(ValueError, match="bytes"):
        s.load([b""])
    with pytest.raises(ValueError, match="block_nbytes"):
        DiskKVStore(tmp_path, FP, 0)
    with pytest.raises(ValueError, match="max_queued_blocks"):
        DiskKVStore(tmp_path, FP, 10, max_queued_blocks=0)


# --- sharing a directory -----------------------------------------------------------

def test_contains_sees_a_file_written_by_another_store(make_store):
    s1, s2 = make_store(), make_store()
    k = key(0)
    assert not s1.contains(k)
    write(s2, [k])
    assert s1.num_files == 0
    assert s1.contains(k) and s1.num_files == 1
    np.testing.assert_array_equal(s1.load([k]), blocks([k], 1000))


def test_two_stores_write_one_directory_concurrently(make_store):
    s1, s2 = make_store(), make_store()
    shared = [key(i) for i in range(40)]
    mine = {s1: [key(100 + i) for i in range(20)], s2: [key(200 + i) for i in range(20)]}

    def run(s):
        ks = shared + mine[s]
        for i in range(0, len(ks), 5):
            s.store(ks[i : i + 5], blocks(ks[i : i + 5], 1000))

    threads = [threading.Thread(target=run, args=(s,)) for s in (s1, s2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s1.flush(timeout=10) and s2.flush(timeout=10)
    every = shared + mine[s1] + mine[s2]
    for s in (s1, s2):
        np.testing.assert_array_equal(s.load(every), blocks(every, 1000))
        assert s.stats.files_rejected == 0 and s.stats.write_errors == 0
    assert s1.stats.files_written + s2.stats.files_written >= 80
    assert not any(".tmp." in p.name for p in s1.directory.rglob("*"))


CHILD = """
import hashlib, importlib.util, sys, time
import numpy as np
spec = importlib.util.spec_from_file_location("kv_disk_store", {module!r})
mod = importlib.util.module_from_spec(spec)
sys.modules["kv_disk_store"] = mod
spec.loader.exec_module(mod)
FP = {fp!r}

def key(i):
    return hashlib.sha256(f"block {{i}}".encode()).digest()

def blocks(keys):
    return np.stack([np.frombuffer(hashlib.shake_256(k).digest(1000), np.uint8) for k in keys])

s = mod.DiskKVStore({root!r}, FP, 1000)
"""


def run_child(tmp_path, body, timeout=30):
    code = CHILD.format(module=MODULE_PATH, fp=FP, root=str(tmp_path / "root")) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_two_processes_write_one_directory(make_store, tmp_path):
    s = make_store()
    shared = [key(i) for i in range(30)]
    theirs = [key(300 + i) for i in range(15)]
    ours = [key(400 + i) for i in range(15)]
    body = """
    ks = [key(i) for i in range(30)] + [key(300 + i) for i in range(15)]
    for i in range(0, len(ks), 3):
        s.store(ks[i : i + 3], blocks(ks[i : i + 3]))
    assert s.flush(10)
    deadline = time.time() + 20
    ours = [key(400 + i) for i in range(15)]
    while not all(s.contains(k) for k in ours):
        assert time.time() < deadline, "the parent's files never appeared"
        time.sleep(0.01)
    every = ks + ours
    assert (s.load(every) == blocks(every)).all()
    assert s.stats.files_rejected == 0 and s.stats.write_errors == 0
    s.close()
    print("child ok")
    """
    code = CHILD.format(module=MODULE_PATH, fp=FP, root=str(tmp_path / "root")) + textwrap.dedent(body)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ks = shared + ours
    for i in range(0, len(ks), 3):
        s.store(ks[i : i + 3], blocks(ks[i : i + 3], 1000))
    assert s.flush(timeout=10)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0 and "child ok" in out, err
    every = shared + theirs + ours
    np.testing.assert_array_equal(s.load(every), blocks(every, 1000))
    assert s.stats.files_rejected == 0


# --- start-up and shutdown -----------------------------------------------------------

def test_stale_temp_files_are_removed_at_start_fresh_ones_kept(make_store):
    s1 = make_store()
    write(s1, [key(0)])
    s1.close()
    sub = file_of(s1, key(0)).parent
    stale, fresh = sub / ".tmp.123.456.0", sub / ".tmp.123.456.1"
    top_stale = s1.directory / ".tmp.123.456.2"
    for p in (stale, fresh, top_stale):
        p.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    for p in (stale, top_stale):
        os.utime(p, (old, old))
    (sub / "notes.txt").write_text("not a block")
    s2 = make_store()
    assert not stale.exists() and not top_stale.exists() and fresh.exists()
    assert s2.num_files == 1 and s2.contains(key(0))


def test_close_is_idempotent_and_flushes(make_store, monkeypatch):
    s = make_store()
    real = s._write_file
    monkeypatch.setattr(s, "_write_file", lambda *a: (time.sleep(0.02), real(*a))[1])
    keys = [key(i) for i in range(5)]
    assert s.store(keys, blocks(keys, 1000)) == 5
    s.close()
    assert s.stats.files_written == 5 and all(file_of(s, k).exists() for k in keys)
    assert not s._thread.is_alive()
    s.close()
    with pytest.raises(RuntimeError, match="close"):
        s.store([key(9)], blocks([key(9)], 1000))
    np.testing.assert_array_equal(s.load(keys), blocks(keys, 1000))  # reads still work


def test_interpreter_exit_flushes_an_unclosed_store(make_store, tmp_path):
    body = """
    real = s._write_file
    def slow(*a):
        time.sleep(0.1)
        return real(*a)
    s._write_file = slow
    s.store([key(i) for i in range(3)], blocks([key(i) for i in range(3)]))
    """  # exits without close() or flush()
    r = run_child(tmp_path, body)
    assert r.returncode == 0, r.stderr
    keys = [key(i) for i in range(3)]
    np.testing.assert_array_equal(make_store().load(keys), blocks(keys, 1000))


def test_interpreter_exit_does_not_hang_on_a_stuck_writer(tmp_path):
    body = """
    import threading
    mod.EXIT_TIMEOUT_SECONDS = 0.3
    s._write_file = lambda *a: threading.Event().wait()  # a disk that never answers
    s.store([key(0)], blocks([key(0)]))
    """
    t0 = time.perf_counter()
    r = run_child(tmp_path, body, timeout=20)
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t0 < 10
    assert "not written" in r.stderr


def test_stats_snapshot_is_a_copy(make_store):
    s = make_store()
    write(s, [key(0)])
    snap = s.stats.snapshot()
    assert isinstance(snap, DiskTierStats) and snap == s.stats
    snap.rejected_by_reason["checksum"] += 1
    snap.files_written += 1
    assert s.stats.rejected_by_reason["checksum"] == 0 and s.stats.files_written == 1
    assert set(s.stats.rejected_by_reason) == {"checksum", "truncated", "header", "key", "fingerprint", "io"}


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_writer_runs_in_the_background_until_its_queue_fills(make_store, monkeypatch):
    """The writer thread starts as SCHED_IDLE (it takes no core the engine wants), goes to normal scheduling
    when a quarter of its queue is waiting, and back to the background once the queue is empty."""
    store = make_store(block_nbytes=64, max_queued_blocks=8)
    deadline = time.monotonic() + 5
    while store._writer_tid is None and time.monotonic() < deadline:
        time.sleep(0.01)
    tid = store._writer_tid
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    gate = threading.Event()
    real_write = store._write_block

    def held_write(key, row):
        gate.wait(5)
        real_write(key, row)

    monkeypatch.setattr(store, "_write_block", held_write)
    rng = np.random.default_rng(0)
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    store.store(keys, rng.integers(0, 256, (4, 64), dtype=np.uint8))
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER  # 3 waiting of 8: past the quarter
    gate.set()
    assert store.flush(5)
    deadline = time.monotonic() + 5
    while os.sched_getscheduler(tid) != os.SCHED_IDLE and time.monotonic() < deadline:
        store.store([bytes([99]) * 16], rng.integers(0, 256, (1, 64), dtype=np.uint8))
        store.flush(5)
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
