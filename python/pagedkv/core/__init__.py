"""pagedkv.core: block manager, prefix cache (and, later, scheduler and sequences)."""

from pagedkv._block_manager import (
    AllocStatus,
    BlockManagerError,
    BlockPool,
    BlockRefCountError,
    InvalidSequenceStateError,
    NoFreeBlocksError,
    SequenceExistsError,
    UnknownSequenceError,
)
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.prefix_cache import PrefixCache, PrefixCacheStats, block_hashes, hash_block_tokens
from pagedkv.core.py_block_manager import PyBlockManager, PyBlockPool

__all__ = [
    "AllocStatus",
    "BlockManager",
    "BlockManagerError",
    "BlockPool",
    "BlockRefCountError",
    "InvalidSequenceStateError",
    "NoFreeBlocksError",
    "PrefixCache",
    "PrefixCacheStats",
    "PyBlockManager",
    "PyBlockPool",
    "SequenceExistsError",
    "UnknownSequenceError",
    "block_hashes",
    "hash_block_tokens",
]
