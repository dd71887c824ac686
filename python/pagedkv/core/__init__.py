"""pagedkv.core: block manager and prefix cache (later also scheduler and sequences).

`BlockManager` is the API; `PyBlockManager` / `PyBlockPool` are the pure-Python
twins of the compiled core; `prefix_cache` computes the chained block hashes.
Prefix caching shares full blocks only: a prefix shorter than one block never
gets a hit, and matches are exact (see pagedkv.core.prefix_cache).
"""

from pagedkv._block_manager import (
    DROPPED_BLOCK,
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
from pagedkv.core.prefix_cache import (
    PrefixCache,
    PrefixCacheStats,
    block_hashes,
    hash_block_tokens,
)
from pagedkv.core.py_block_manager import PyBlockManager, PyBlockPool

__all__ = [
    "DROPPED_BLOCK",
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
