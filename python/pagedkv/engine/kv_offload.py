"""The engine's side of the prefix-cache tiers: sizing, the disk fingerprint, write-through, statistics.

`KVOffload.build` reads the cache config: `kv_offloading_size` GiB becomes
host slots of the pool's block size (their bytes allocated by the model
runner, in the cache's format), `kv_cache_dir` a `DiskKVStore` under a
directory named by the model's fingerprint. After each successful step,
`after_step` queues the blocks that step computed (and cached) for the disk,
so a crash loses at most what was still queued; `close` flushes.

The fingerprint is everything that decides a block's bytes: the weights'
identity (file names, sizes and sampled contents of the checkpoint), the
compute dtype, the KV cache dtype and fp8 scales, block size, layers, KV
heads and head size, and the prefix hash algorithm. A change to any of them
opens another directory, so no setting ever reads another's blocks. With an
fp8 cache whose scales are computed from the first batch, the scales exist
only after that batch: the disk tier opens then, and since a restart
calibrates again (to other scales), it reads back only the blocks of runs
with the same scales; give `calculate_kv_scales=False` (checkpoint scales or
1.0) for restarts that reuse the disk.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from pagedkv.config import CacheConfig, GiB
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.kv_tiers import KVTiers
from pagedkv.engine.memory_pool import KVCacheSpec
from pagedkv.kv_cache import block_nbytes, kv_cache_format

logger = logging.getLogger(__name__)

_SAMPLE = 1 << 20  # bytes hashed at each sampled offset of a weight file
_SAMPLES = 8
DISK_QUEUE_BYTES = 512 << 20  # blocks waiting for the disk writer at most (beyond that they are dropped, counted)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _file_identity(path: Path) -> str:
    """Name, size and a hash of sampled 1 MiB windows (start, end and evenly between): two checkpoints that
    differ anywhere but in a few bytes differ here, without reading gigabytes at every start."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _SAMPLE) * i // (_SAMPLES - 1)))
            h.update(f.read(_SAMPLE))
    return f"{path.name}:{size}:{h.hexdigest()}"


def weights_identity(source: Path | None) -> list[str]:
    """The identity of a checkpoint folder or file: its config and weight files (see _file_identity)."""
    if source is None or not source.exists():
        return []
    files = [source] if source.is_file() else sorted(
        p for p in source.iterdir() if p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES)
    return [_file_identity(p) for p in files]


class KVOffload:
    """Host and disk tiers of one engine (either may be off)."""

    def __init__(self, tiers: KVTiers, runner: Any, cache_config: CacheConfig, fingerprint: dict[str, Any],
                 block_nbytes: int) -> None:
        self.tiers, self.runner, self.cache_config = tiers, runner, cache_config
        self.fingerprint, self.block_nbytes = fingerprint, block_nbytes
        self.disk = None
        self._open_disk_when_ready()

    @classmethod
    def build(cls, cache_config: CacheConfig, spec: KVCacheSpec, bm: BlockManager, runner: Any, model_config: Any,
              dtype: Any, source: Path | None) -> KVOffload | None:
        """The tiers `cache_config` asks for (None when it asks for none); logs what they hold."""
        cc = cache_config
        if not cc.kv_offloading_size and cc.kv_cache_dir is None:
            return None
        slots = int(cc.kv_offloading_size * GiB // spec.bytes_per_block) if cc.kv_offloading_size else 0
        if cc.kv_offloading_size and slots == 0:
            raise ValueError(f"kv_offloading_size={cc.kv_offloading_size} GiB holds no block of "
                             f"{spec.bytes_per_block} bytes: give at least {spec.bytes_per_block / GiB:.6f} GiB")
        if slots:
            runner.allocate_host_tier(slots)
            logger.info("KV offloading: host tier of %d blocks (%.2f GiB, %d bytes a block)", slots,
                        slots * spec.bytes_per_block / GiB, spec.bytes_per_block)
        tiers = bm.attach_tiers(slots)
        fingerprint = {
            "layout": 1, "weights": weights_identity(source), "dtype": str(dtype),
            "kv_cache_dtype": cc.cache_dtype, "block_size": cc.block_size, "hash_algo": cc.hash_algo,
            "num_layers": model_config.num_hidden_layers, "num_kv_heads": runner.model.num_kv_heads,
            "head_dim": model_config.head_dim, "architectures": list(getattr(model_config, "architectures", []) or []),
        }
        if kv_cache_format(cc.cache_dtype).rotated:  # rows stored rotated: files of unrotated int4 never match
            fingerprint["row_rotation"] = "walsh-hadamard"
        return cls(tiers, runner, cc, fingerprint, block_nbytes(runner.kv_caches))

    @property
    def _disk_pending(self) -> bool:
        """A disk tier is asked for but not open yet (an fp8 cache's scales are still to be computed)."""
        return self.cache_config.kv_cache_dir is not None and self.disk is None

    def _open_disk_when_ready(self) -> None:
        """Opens the disk tier once the block bytes are final (an fp8 cache's computed scales exist)."""
        if not self._disk_pending or self.runner.kv_scales_pending:
            return
        from pagedkv.core.kv_disk_store import DiskKVStore

        cc = self.cache_config
        fp = dict(self.fingerprint)
        if cc.cache_dtype.startswith("fp8"):
            fp["kv_scales"] = [list(pair) for pair in self.runner.kv_scales()]
        max_bytes = int(cc.kv_cache_dir_size * GiB) if cc.kv_cache_dir_size else None
        queued = max(16, DISK_QUEUE_BYTES // self.block_nbytes)
        self.disk = DiskKVStore(os.path.expanduser(cc.kv_cache_dir), fp, self.block_nbytes, max_bytes, queued)
        self.tiers.disk = self.disk
        logger.info("KV cache directory %s: %d blocks on disk for this model and setting (%.2f GiB%s)",
                    self.disk.directory, self.disk.num_files, self.disk.num_bytes / GiB,
                    f" of {cc.kv_cache_dir_size} GiB" if max_bytes else "")

    def after_step(self, entries: list[tuple[int, bytes]]) -> None:
        """After a successful step: queues for the disk the blocks it computed (`entries`: (block, key))."""
        if self._disk_pending:
            self._open_disk_when_ready()
        if self.disk is None or not entries:
            return
        new = [(b, k) for b, k in entries if not self.disk.contains(k)]
        if new:
            self.disk.store([k for _, k in new], self.runner.block_bytes([b for b, _ in new]))

    def stats_fields(self) -> dict[str, int | float]:
        """The tiers' counters under EngineStats' field names (cumulative since start)."""
        t = self.tiers.stats
        out: dict[str, int | float] = {
            "tier_queries": t.queries, "tier_hits_host": t.hits_host, "tier_hits_disk": t.hits_disk,
            "kv_offloaded_blocks": t.offloaded_blocks, "kv_restored_blocks_host": t.restored_blocks_host,
            "kv_restored_blocks_disk": t.restored_blocks_disk,
            "kv_host_bytes_moved": (t.offloaded_blocks + t.restored_blocks_host) * self.block_nbytes}
        if self.disk is not None:
            d = self.disk.stats_snapshot()  # every counter from one moment (the writer thread moves them)
            out.update(kv_disk_files_written=d.files_written, kv_disk_bytes_written=d.bytes_written,
                       kv_disk_bytes_read=d.bytes_loaded, kv_disk_load_seconds=d.load_seconds,
                       kv_disk_files_rejected=d.files_rejected, kv_disk_write_errors=d.write_errors)
        return out

    def close(self) -> None:
        """Flushes the disk tier's queue (a clean shutdown loses nothing) and stops its writer."""
        if self.disk is not None:
            self.disk.close()
