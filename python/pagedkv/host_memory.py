"""Host (CPU) tensors backed by transparent huge pages, for the paged KV cache.

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

import ctypes
import functools
import math
import os
import re
import sys

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


def _madvise_huge(address: int, length: int) -> bool:
    rc = _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return rc == 0


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
