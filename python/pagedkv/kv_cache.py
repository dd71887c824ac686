"""The KV cache's storage formats (`kv_cache_dtype`, vLLM's names) and one layer's cache.

Every format keeps vLLM's block layout of the unquantized cache, one tensor for
K and one for V per layer, each [num_blocks, block_size, num_kv_heads, X]:

==========================  =================  =====  =====================================
kv_cache_dtype              element            X      scales (k_scale / v_scale)
==========================  =================  =====  =====================================
auto                        compute dtype      D      none
fp8, fp8_e4m3               float8_e4m3fn      D      fp32 [1] per layer (per tensor)
fp8_e5m2                    float8_e5m2        D      fp32 [1] per layer (per tensor)
int8_per_token_head         uint8 code         D      fp16 [num_blocks, block_size, num_kv_heads, 2]
int4_per_token_head         uint8, 2 codes     D / 2  fp16 [num_blocks, block_size, num_kv_heads, 2]
==========================  =================  =====  =====================================

(D = head_size.) fp8 stores x / scale rounded to nearest even and saturated
at the format's largest finite value (448 for e4m3, 57344 for e5m2) and reads
code * scale. The per-token-head formats are asymmetric: each token's
head_size values of one kv head get a (scale, zero) pair, zero = min, scale =
(max - min) / (2^bits - 1), both rounded to fp16; the code of x is
round((x - zero) / scale) clamped to [0, 2^bits - 1] and reads code * scale +
zero. int4 packs element 2i in the low nibble of byte i and 2i + 1 in the
high one. int4 rows are stored rotated: each token's head_size values of one
kv head are first multiplied by the normalized Walsh-Hadamard matrix H
(block-diagonal, blocks of the largest power of two dividing head_size), and
the codes are those of the rotated row. H is orthonormal and symmetric, so the
attention ops rotate the query by H, attend, and rotate the output back: the
result is attention over the dequantized rows rotated back. The rotation
spreads a head's outlier channels over the row, where 16 levels per (scale,
zero) pair could not resolve the other channels beside them
(`pagedkv.reference.hadamard_rows` is the rule; csrc/common/row_rotation.h).
The scale plane is indexed by block id exactly like the values, so a
block is its value rows plus its plane rows: copy-on-write and swapping move
both, and the pool counts both (4 bytes per token and kv head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    """How one `kv_cache_dtype` stores K/V. element: the cache tensors' dtype (None: the compute dtype)."""

    name: str
    element: torch.dtype | None
    values_per_element: int = 1  # codes per stored element (2 for int4)
    per_tensor_scale: bool = False  # fp8: one fp32 k_scale / v_scale per layer
    per_token_scale: bool = False  # (scale, zero) fp16 pair per token and kv head
    bits: int = 0  # code width of the per-token-head formats
    rotated: bool = False  # rows stored rotated by the Walsh-Hadamard matrix (int4; see the module docstring)

    @property
    def quantized(self) -> bool:
        return self.element is not None

    @property
    def is_fp8(self) -> bool:
        return self.per_tensor_scale

    def element_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return self.element if self.element is not None else compute_dtype

    def last_dim(self, head_size: int) -> int:
        """The cache tensors' last dimension for this head size."""
        return head_size // self.values_per_element

    def bytes_per_token_head(self, head_size: int, compute_dtype: torch.dtype) -> int:
        """Bytes one token of one kv head takes in K (or V): the values, plus the scale pair when per token."""
        itemsize = torch.empty((), dtype=self.element_dtype(compute_dtype)).element_size()
        return self.last_dim(head_size) * itemsize + (SCALE_PAIR_BYTES if self.per_token_scale else 0)


SCALE_PAIR_BYTES = 4  # fp16 (scale, zero)

KV_CACHE_FORMATS: dict[str, KVCacheFormat] = {
    "auto": KVCacheFormat("auto", None),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", torch.float8_e4m3fn, per_tensor_scale=True),
    "fp8_e5m2": KVCacheFormat("fp8_e5m2", torch.float8_e5m2, per_tensor_scale=True),
    "int8_per_token_head": KVCacheFormat("int8_per_token_head", torch.uint8, per_token_scale=True, bits=8),
    "int4_per_token_head": KVCacheFormat("int4_per_token_head", torch.uint8, values_per_element=2,
                                         per_token_scale=True, bits=4, rotated=True),
}
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "int4_per_token_head")


def kv_cache_format(kv_cache_dtype: str) -> KVCacheFormat:
    """The format of a `kv_cache_dtype` value ("fp8" is "fp8_e4m3"); ValueError naming the valid ones."""
    name = KV_CACHE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    return KV_CACHE_FORMATS[name]


@dataclass(slots=True, eq=False)
class KVCache:
    """One layer's paged cache: key/value [num_blocks, block_size, num_kv_heads, X] and their scales.

    Unpacks as (key, value), like the plain pair it replaces. `op_args` are the
    keyword arguments every cache-reading or -writing op takes for this format
    (empty for "auto", so unquantized calls are the ops' defaults).
    """

    key: torch.Tensor
    value: torch.Tensor
    kv_cache_dtype: str = "auto"
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    op_args: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.kv_cache_dtype = kv_cache_format(self.kv_cache_dtype).name
        self.op_args = ({} if self.kv_cache_dtype == "auto" else
                        {"kv_cache_dtype": self.kv_cache_dtype, "k_scale": self.k_scale, "v_scale": self.v_scale})

    def __iter__(self):
        yield self.key
        yield self.value

    def __getitem__(self, i: int) -> torch.Tensor:
        return (self.key, self.value)[i]

    @property
    def format(self) -> KVCacheFormat:
        return KV_CACHE_FORMATS[self.kv_cache_dtype]

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id (values, then the per-token scale planes): what a block copy moves."""
        out = [self.key, self.value]
        if self.format.per_token_scale:
            out += [self.k_scale, self.v_scale]
        return out


def allocate_layer_cache(fmt: KVCacheFormat, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                         compute_dtype: torch.dtype, make) -> KVCache:
    """One layer's KVCache. make(shape, dtype) allocates a block-indexed tensor (the caller picks the memory);
    per-tensor fp8 scales start at 1.0 on the values' device."""
    shape = (num_blocks, block_size, num_kv_heads, fmt.last_dim(head_size))
    dtype = fmt.element_dtype(compute_dtype)
    key, value = make(shape, dtype), make(shape, dtype)
    k_scale = v_scale = None
    if fmt.per_token_scale:
        plane = (num_blocks, block_size, num_kv_heads, 2)
        k_scale, v_scale = make(plane, torch.float16), make(plane, torch.float16)
    elif fmt.per_tensor_scale:
        k_scale = torch.ones(1, dtype=torch.float32, device=key.device)
        v_scale = torch.ones(1, dtype=torch.float32, device=key.device)
    return KVCache(key, value, fmt.name, k_scale, v_scale)


# --- a block's bytes (the prefix cache's disk tier) -----------------------------------------------------------------
def _byte_rows(caches: list[KVCache]) -> list[torch.Tensor]:
    """Every block-indexed tensor of every layer as uint8 [num_blocks, bytes per block] (views, no copy)."""
    rows = []
    for kv in caches:
        for t in kv.block_tensors():
            rows.append(t.view(torch.uint8).view(t.shape[0], -1))
    return rows


def block_nbytes(caches: list[KVCache]) -> int:
    """Bytes of one block across all layers: values, then per-token scale planes, layer by layer."""
    return sum(r.shape[1] for r in _byte_rows(caches))


def gather_block_bytes(caches: list[KVCache], blocks: list[int]) -> np.ndarray:
    """The bytes of `blocks`: uint8 [len(blocks), block_nbytes] on the host, a fresh array (the caller owns it).

    Layout of a row: for each layer, its key rows, value rows and (per-token-head formats) the key and value
    (scale, zero) planes of that block, each as stored. fp8's per-layer scales are not block data.
    """
    rows = _byte_rows(caches)
    idx = torch.tensor(blocks, dtype=torch.int64, device=rows[0].device)
    return torch.cat([r.index_select(0, idx) for r in rows], dim=1).cpu().numpy()


def scatter_block_bytes(caches: list[KVCache], blocks: list[int], payload: np.ndarray | list) -> None:
    """Writes blocks in `gather_block_bytes`'s layout into `blocks`: payload uint8 [len(blocks), block_nbytes],
    or one buffer of block_nbytes bytes per block (what the disk tier reads)."""
    rows = _byte_rows(caches)
    total = sum(r.shape[1] for r in rows)
    srcs = [payload[j] for j in range(len(payload))] if isinstance(payload, np.ndarray) else list(payload)
    if len(srcs) != len(blocks) or any(memoryview(b).nbytes != total for b in srcs) or (
            isinstance(payload, np.ndarray) and payload.dtype != np.uint8):
        shape = list(payload.shape) if isinstance(payload, np.ndarray) else f"{len(srcs)} buffers"
        raise ValueError(f"scatter_block_bytes: payload must be uint8 [{len(blocks)}, {total}], got {shape}")
    device = rows[0].device
    # Block by block: each copy is one contiguous run on both sides (index_copy_ from strided column slices
    # measured 3x slower on the CPU).
    for block, buf in zip(blocks, srcs, strict=True):
        src = torch.frombuffer(buf, dtype=torch.uint8).to(device)
        offset = 0
        for r in rows:
            width = r.shape[1]
            r[block].copy_(src[offset:offset + width])
            offset += width
