"""Host (CPU) memory for the engine: the KV cache on transparent huge pages, its pages backed ahead of use
(BackgroundPrefault), and glibc's malloc kept from returning a step's activations (keep_freed_activations).

Decode reads the cache one scattered block at a time. With 4 KiB pages every
block starts on pages the TLB has not seen, and in a virtual machine each miss
is a two-level page walk; 2 MiB pages cover a whole run of blocks. On a 2-core
AMD EPYC VM (2026-11-30, LLC flushed between calls) huge pages made CPU decode
attention 1.03-1.27x faster on the kernel benchmark's target rows.

The pages are asked for with ``madvise(MADV_HUGEPAGE)`` on a 2 MiB-aligned
stretch before anything touches it, so the kernel backs it with huge pages
as it is first written. That works where transparent huge pages are
``always`` or ``madvise`` (the usual default); elsewhere, or where madvise
fails, the tensor is an ordinary one. ``PAGEDKV_CPU_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=1)
def huge_pages_available() -> bool:
    """True where madvise can ask for transparent huge pages (Linux, THP not 'never'), unless turned off."""
    if os.environ.get("PAGEDKV_CPU_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        with open(_THP_ENABLED) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _madvise(address: int, length: int, advice: int) -> bool:
    """madvise over [address, address + length), its start rounded down to a page; whether it succeeded."""
    start = address - address % 4096
    return _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length + address - start), advice) == 0


def _madvise_huge(address: int, length: int) -> bool:
    return _madvise(address, length, _MADV_HUGEPAGE)


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor whose memory starts on a 2 MiB boundary and is advised as huge pages.

    Smaller than one huge page, or where huge pages are not available, it is a
    plain ``torch.empty``. The tensor is a view into a byte buffer one huge page
    larger (the slack before the aligned start is never touched, so it takes no
    memory); the view keeps the buffer alive.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or not huge_pages_available():
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    length = min(math.ceil(nbytes / HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, raw.numel() - offset)
    if not _madvise_huge(raw.data_ptr() + offset, length):
        return torch.empty(shape, dtype=dtype)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def advised_huge(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding `tensor`'s first byte is advised as huge pages ('hg' in /proc/self/smaps)."""
    address = tensor.data_ptr()
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                mapping = _MAPPING.match(line)
                if mapping:
                    inside = int(mapping[1], 16) <= address < int(mapping[2], 16)
                elif inside and line.startswith("VmFlags:"):
                    return "hg" in line.split()[1:]
    except OSError:
        return False
    return False


# --- the allocator under the engine's activations -------------------------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>, glibc
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit hosts; larger blocks are mapped and unmapped whatever we ask.
MMAP_THRESHOLD_BYTES = 32 << 20
# Freed memory at the top of the heap kept for the next step rather than handed back to the kernel.
TRIM_THRESHOLD_BYTES = 512 << 20


@functools.lru_cache(maxsize=1)
def keep_freed_activations() -> bool:
    """Has glibc's malloc keep freed activation buffers for the next step instead of returning their pages.

    A step allocates its activations (logits, MLP intermediates: up to tens
    of MiB) and frees them at its end. glibc maps blocks above its mmap
    threshold afresh each time and trims the heap's free top back to the
    kernel, so the next step faults the same pages in again, each zeroed:
    ~300,000 minor faults and 0.5 s of system time in the 48-request offline
    bench (bf16, 2-core Xeon, 2026-12-06). Serving blocks up to 32 MiB from
    the heap and keeping up to 512 MiB of its free top removed both: 0.04 s,
    and the run 7-8% faster. vLLM gets the same from the tcmalloc it preloads.

    The process's resident size then stays at its activation peak. Once per
    process (the setting is the process's); a no-op off glibc or under
    ``PAGEDKV_CPU_MALLOC_TUNING=0``. Returns whether the setting took.
    """
    if os.environ.get("PAGEDKV_CPU_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False  # another C library (musl): its allocator has no such knobs
    took = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and took


# --- the KV cache's pages, backed ahead of use ------------------------------------------------------------------

_MADV_POPULATE_WRITE = 23  # <sys/mman.h>, Linux 5.14+
POPULATE_CHUNK_BYTES = HUGE_PAGE_BYTES


class IdleClock:
    """Whether the engine has been between steps for a while: the time background work may take."""

    def __init__(self) -> None:
        self._depth = 0
        self._since = time.monotonic()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around a step."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._since = time.monotonic()

    def idle_for(self, seconds: float) -> bool:
        return self._depth == 0 and time.monotonic() - self._since >= seconds


def prefault_enabled() -> bool:
    """Whether CPU KV caches are backed in the background (``PAGEDKV_CPU_KV_PREFAULT=0`` turns it off)."""
    return os.environ.get("PAGEDKV_CPU_KV_PREFAULT", "1") != "0" and sys.platform.startswith("linux")


class BackgroundPrefault:
    """Backs the pages of host tensors (a KV cache) from a low-priority thread, without writing to them.

    The cache is allocated untouched (fast start-up, nothing committed that is
    never used), so the step that first writes a block pays for its pages. On
    a VM that is the hypervisor backing them too: 0.36-0.6 GB/s on the 2-core
    Xeon VM (2026-12-06), so a 2048-token prefill step that reached new blocks
    took 640 ms instead of 400, inside the first burst of requests a server saw.
    vLLM zeroes its whole cache at start-up instead (4 GiB: ~7 s there).

    ``madvise(MADV_POPULATE_WRITE)`` makes the pages present as if written,
    leaving their contents alone, so it may run while the engine writes the
    same blocks. The thread runs at nice 19 (it takes idle CPU only) and goes
    through every tensor a 2 MiB stretch at a time, lowest block indexes
    first, as the block pool hands blocks out. It holds the tensors only by
    weak reference and stops once they are freed (or on `stop()`), and quietly
    where the kernel lacks the call.

    idle: an engine's IdleClock; then a stretch is backed only once no step has
    run for IDLE_S. A populate call is not preempted (a 2 MiB stretch took 3-5 ms
    there), and one landing inside back-to-back steps stalled their OpenMP
    threads: the offline workload ran 3% slower with the thread free to run.
    Between a server's requests it has the idle time it needs.
    """

    IDLE_S = 0.05

    def __init__(self, tensors: list[torch.Tensor], chunk_bytes: int = POPULATE_CHUNK_BYTES,
                 idle: IdleClock | None = None) -> None:
        self._refs = [weakref.ref(t) for t in tensors]
        self._chunk = chunk_bytes
        self._idle = idle
        self._stop = threading.Event()
        self.bytes_done = 0
        self.total_bytes = sum(t.nbytes for t in tensors)
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-prefault", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass  # still correct at normal priority
        try:
            offset, pending = 0, True
            while pending and not self._stop.is_set():
                pending = False
                for ref in self._refs:
                    if self._stop.is_set():
                        return
                    tensor = ref()
                    if tensor is None:
                        continue
                    nbytes = tensor.nbytes
                    if offset < nbytes:
                        pending = True
                        if not self._wait_idle():
                            return
                        if not self._populate(tensor.data_ptr() + offset, min(self._chunk, nbytes - offset)):
                            return
                    del tensor
                offset += self._chunk
        finally:
            self.finished.set()

    def _wait_idle(self) -> bool:
        """Until the engine is idle; False once stopped."""
        while self._idle is not None and not self._idle.idle_for(self.IDLE_S):
            if self._stop.wait(0.01):
                return False
        return not self._stop.is_set()

    def _populate(self, address: int, length: int) -> bool:
        if not _madvise(address, length, _MADV_POPULATE_WRITE):
            return False  # EINVAL: a kernel before 5.14
        self.bytes_done += length
        return True
