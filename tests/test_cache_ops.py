"""Block-copy ops (reshape_and_cache, copy_blocks, swap_blocks) on the CPU vs pagedkv.reference.

These ops only move bytes, so every comparison is exact (`torch.equal`) in
every dtype: a tolerance would hide a wrong offset that happens to land on a
similar value.
"""

from __future__ import annotations

import pytest
import torch
from pagedkv import ops, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _caches(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (not zero) caches, so a missed write or a write to the wrong slot shows."""
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return _rand(shape, dtype, gen), _rand(shape, dtype, gen)


def _random_slots(num_tokens: int, num_slots: int, gen: torch.Generator, num_skipped: int = 0) -> torch.Tensor:
    """Distinct slots (duplicates would make the result order-dependent), some set to -1 (padding)."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens].clone()
    if num_skipped:
        skipped = torch.randperm(num_tokens, generator=gen)[:num_skipped]
        slots[skipped] = -1
    return slots


def _block_pairs(num_pairs: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """(src, dst) pairs with distinct dsts that are never also a src, as copy-on-write produces."""
    perm = torch.randperm(num_blocks, generator=gen)
    src = perm[:num_pairs]
    dst = perm[num_pairs : 2 * num_pairs]
    # Two pairs may share a source (one block forked twice).
    src[-1] = src[0]
    return torch.stack([src, dst], dim=1).contiguous()


# ---- reshape_and_cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_blocks,block_size,num_kv_heads,head_size",
    [(17, 97, 16, 3, 64), (1, 5, 8, 1, 128), (64, 11, 32, 2, 80), (33, 40, 8, 8, 256)],
)
def test_reshape_and_cache_matches_reference(dtype, num_tokens, num_blocks, block_size, num_kv_heads, head_size):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_blocks)
    key = _rand((num_tokens, num_kv_heads, head_size), dtype, gen)
    value = _rand((num_tokens, num_kv_heads, head_size), dtype, gen)
    key_cache, value_cache = _caches(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    slots = _random_slots(num_tokens, num_blocks * block_size, gen, num_skipped=num_tokens // 4)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()

    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)

    assert torch.equal(key_cache, ref_k)
    assert torch.equal(value_cache, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_strided_key_value(dtype):
    """key/value as slices of a fused QKV projection, and with padded head rows (stride(1) > head_size)."""
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_heads, num_kv_heads, head_size, block_size, num_blocks = 19, 6, 2, 64, 16, 13
    qkv = _rand((num_tokens, num_heads + 2 * num_kv_heads, head_size), dtype, gen)
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    # Value with a gap between heads: a view of a wider buffer.
    value = _rand((num_tokens, num_kv_heads, 2 * head_size), dtype, gen)[:, :, :head_size]
    assert not key.is_contiguous() and not value.is_contiguous()
    assert value.stride(1) == 2 * head_size
    key_cache, value_cache = _caches(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    slots = _random_slots(num_tokens, num_blocks * block_size, gen, num_skipped=3)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()

    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)

    assert torch.equal(key_cache, ref_k)
    assert torch.equal(value_cache, ref_v)


def test_reshape_and_cache_skips_negative_slots():
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache = _caches(4, 8, 2, 64, torch.float32, gen)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    key = _rand((3, 2, 64), torch.float32, gen)
    value = _rand((3, 2, 64), torch.float32, gen)

    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([-1, 9, -5]))

    assert torch.equal(key_cache[1, 1], key[1]) and torch.equal(value_cache[1, 1], value[1])
    key_cache[1, 1], value_cache[1, 1] = before_k[1, 1], before_v[1, 1]
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_reshape_and_cache_zero_tokens_is_a_no_op():
    gen = torch.Generator().manual_seed(4)
    key_cache, value_cache = _caches(2, 16, 1, 64, torch.float16, gen)
    key_before, value_before = key_cache.clone(), value_cache.clone()
    empty = torch.empty(0, 1, 64, dtype=torch.float16)
    ops.reshape_and_cache(empty, empty, key_cache, value_cache, torch.empty(0, dtype=torch.long))
    assert torch.equal(key_cache, key_before)
    assert torch.equal(value_cache, value_before)


# ---- copy_blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_layers,num_blocks,num_pairs", [(3, 97, 11), (1, 8, 1), (5, 33, 16)])
def test_copy_blocks_matches_reference(dtype, num_layers, num_blocks, num_pairs):
    gen = torch.Generator().manual_seed(num_layers * 100 + num_blocks)
    layers = [_caches(num_blocks, 16, 3, 64, dtype, gen) for _ in range(num_layers)]
    key_caches = [k for k, _ in layers]
    value_caches = [v for _, v in layers]
    ref_keys = [k.clone() for k in key_caches]
    ref_values = [v.clone() for v in value_caches]
    mapping = _block_pairs(num_pairs, num_blocks, gen)

    ops.copy_blocks(key_caches, value_caches, mapping)
    reference.copy_blocks(ref_keys, ref_values, mapping)

    for got, want in zip(key_caches + value_caches, ref_keys + ref_values, strict=True):
        assert torch.equal(got, want)


def test_copy_blocks_empty_mapping_is_a_no_op():
    gen = torch.Generator().manual_seed(5)
    k, v = _caches(4, 8, 1, 64, torch.bfloat16, gen)
    before = (k.clone(), v.clone())
    ops.copy_blocks([k], [v], torch.empty(0, 2, dtype=torch.long))
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_copy_and_swap_accept_a_non_contiguous_block_mapping():
    """torch.stack([src, dst]).T is a natural way to build the mapping; it is a strided view."""
    gen = torch.Generator().manual_seed(8)
    k, v = _caches(10, 8, 1, 64, torch.float32, gen)
    ref_k, ref_v = k.clone(), v.clone()
    mapping = torch.stack([torch.tensor([0, 2, 4]), torch.tensor([7, 8, 9])]).T
    assert not mapping.is_contiguous()
    ops.copy_blocks([k], [v], mapping)
    reference.copy_blocks([ref_k], [ref_v], mapping)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    dst = torch.zeros(10, 8, 1, 64)
    want = dst.clone()
    ops.swap_blocks(k, dst, mapping)
    reference.swap_blocks(k, want, mapping)
    assert torch.equal(dst, want)


# ---- swap_blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_src_blocks,num_dst_blocks,num_pairs", [(97, 31, 17), (4, 50, 4), (9, 9, 1)])
def test_swap_blocks_cpu_to_cpu_matches_reference(dtype, num_src_blocks, num_dst_blocks, num_pairs):
    gen = torch.Generator().manual_seed(num_src_blocks + 10 * num_dst_blocks)
    src, _ = _caches(num_src_blocks, 16, 3, 64, dtype, gen)
    dst, _ = _caches(num_dst_blocks, 16, 3, 64, dtype, gen)
    src_ids = torch.randperm(num_src_blocks, generator=gen)[:num_pairs]
    dst_ids = torch.randperm(num_dst_blocks, generator=gen)[:num_pairs]
    mapping = torch.stack([src_ids, dst_ids], dim=1).contiguous()
    want = dst.clone()
    src_before = src.clone()

    ops.swap_blocks(src, dst, mapping)
    reference.swap_blocks(src, want, mapping)

    assert torch.equal(dst, want)
    assert torch.equal(src, src_before)


def test_swap_blocks_accepts_any_block_shape():
    """swap_blocks moves whole blocks of any trailing shape (e.g. a fused K/V block)."""
    gen = torch.Generator().manual_seed(6)
    src = _rand((10, 2, 8, 5, 7), torch.float32, gen)
    dst = torch.zeros(6, 2, 8, 5, 7)
    mapping = torch.tensor([[9, 0], [3, 5]])
    ops.swap_blocks(src, dst, mapping)
    assert torch.equal(dst[0], src[9]) and torch.equal(dst[5], src[3])
    assert not dst[1:5].any()


# ---- bad input: each raises a RuntimeError that names the problem ---------------------------------


def _valid_write_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(11)
    key = _rand((3, 2, 64), dtype, gen)
    value = _rand((3, 2, 64), dtype, gen)
    key_cache, value_cache = _caches(4, 16, 2, 64, dtype, gen)
    return {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
            "slot_mapping": torch.tensor([0, 17, 63])}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"slot_mapping": torch.tensor([0, 17, 63], dtype=torch.int32)}, r"slot_mapping must be Long, got Int"),
        ({"slot_mapping": torch.tensor([[0, 17, 63]])}, r"slot_mapping must be 1-D, got shape \[1, 3\]"),
        ({"slot_mapping": torch.tensor([0, 17])}, r"slot_mapping has 2 entries but key has 3 tokens"),
        ({"slot_mapping": torch.tensor([0, 64, 1])},
         r"slot_mapping\[1\] = 64 is outside the cache \(num_blocks \* block_size = 64\)"),
        ({"slot_mapping": torch.tensor([0, 9, 1, 5, 2, 7])[::2]}, r"slot_mapping must be contiguous"),
        ({"key": torch.randn(3, 2, 64, dtype=torch.float16)}, r"key dtype Half differs from the cache dtype Float"),
        ({"value": torch.randn(3, 2, 64, dtype=torch.float64)},
         r"value dtype Double differs from the cache dtype Float"),
        ({"key": torch.randn(3, 4, 64)}, r"key must be \[num_tokens, num_kv_heads=2, head_size=64\], got shape"),
        ({"value": torch.randn(3, 2, 128)}, r"value must be \[num_tokens, num_kv_heads=2, head_size=64\]"),
        ({"value": torch.randn(5, 2, 64)}, r"key has 3 tokens, value has 5"),
        ({"key": torch.randn(3, 64, 2).transpose(1, 2)}, r"key must have a contiguous last dim"),
        ({"value_cache": torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)},
         r"value_cache dtype BFloat16 differs from key_cache dtype Float"),
        ({"value_cache": torch.zeros(5, 16, 2, 64)}, r"value_cache shape \[5, 16, 2, 64\] differs from key_cache"),
        ({"key_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float64),
          "value_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float64)},
         r"key_cache dtype Double is not supported; supported: float32, float16, bfloat16"),
        ({"key_cache": torch.zeros(4, 7, 2, 64), "value_cache": torch.zeros(4, 7, 2, 64)},
         r"block_size 7 is not supported; supported block sizes: 8, 16, 32"),
        ({"key_cache": torch.zeros(64, 2, 64), "value_cache": torch.zeros(64, 2, 64)},
         r"key_cache must be 4-D \[num_blocks, block_size, num_kv_heads, head_size\]"),
        ({"key_cache": torch.zeros(4, 2, 16, 64).transpose(1, 2),
          "value_cache": torch.zeros(4, 2, 16, 64).transpose(1, 2)},
         r"key_cache and value_cache must be contiguous"),
    ],
    ids=lambda x: None if isinstance(x, dict) else x[:40],
)
def test_reshape_and_cache_rejects_bad_input(change, message):
    args = _valid_write_inputs() | change
    with pytest.raises(RuntimeError, match=r"reshape_and_cache: " + message):
        ops.reshape_and_cache(**args)


def test_reshape_and_cache_bad_slot_writes_nothing():
    """Validation runs before any copy: a bad slot at the end leaves the cache untouched."""
    args = _valid_write_inputs() | {"slot_mapping": torch.tensor([0, 1, 10_000])}
    before = args["key_cache"].clone()
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 10000 is outside the cache"):
        ops.reshape_and_cache(**args)
    assert torch.equal(args["key_cache"], before)


def _two_layers(num_blocks=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(12)
    layers = [_caches(num_blocks, 16, 2, 64, dtype, gen) for _ in range(2)]
    return [k for k, _ in layers], [v for _, v in layers]


@pytest.mark.parametrize(
    "mapping,message",
    [
        (torch.tensor([[0, 1]], dtype=torch.int32), r"block_mapping must be int64, got Int"),
        (torch.tensor([0, 1]), r"block_mapping must be \[num_pairs, 2\] \(src, dst\), got shape \[2\]"),
        (torch.tensor([[0, 1, 2]]), r"block_mapping must be \[num_pairs, 2\] \(src, dst\), got shape \[1, 3\]"),
        (torch.tensor([[0, 1], [8, 2]]), r"block_mapping\[1\] source block 8 is outside the source cache \(8 blocks\)"),
        (torch.tensor([[-1, 2]]), r"block_mapping\[0\] source block -1 is outside the source cache"),
        (torch.tensor([[3, 99]]), r"block_mapping\[0\] destination block 99 is outside the destination cache"),
        (torch.tensor([[0, 5], [1, 5]]), r"block_mapping writes block 5 twice"),
        (torch.tensor([[0, 5], [5, 6]]), r"block_mapping\[0\] writes block 5, which another pair reads"),
    ],
    ids=["int32", "1-D", "3-cols", "src-too-big", "src-negative", "dst-too-big", "dst-twice", "dst-is-a-src"],
)
def test_copy_blocks_rejects_bad_mapping(mapping, message):
    key_caches, value_caches = _two_layers()
    before = [t.clone() for t in key_caches + value_caches]
    with pytest.raises(RuntimeError, match=r"copy_blocks: " + message):
        ops.copy_blocks(key_caches, value_caches, mapping)
    for got, want in zip(key_caches + value_caches, before, strict=True):
        assert torch.equal(got, want)


def test_copy_blocks_rejects_mismatched_layer_lists():
    key_caches, value_caches = _two_layers()
    with pytest.raises(RuntimeError, match=r"copy_blocks: got 2 key caches but 1 value caches"):
        ops.copy_blocks(key_caches, value_caches[:1], torch.tensor([[0, 1]]))


def test_copy_blocks_rejects_layers_of_different_shape_or_dtype():
    key_caches, value_caches = _two_layers()
    smaller = torch.zeros(6, 16, 2, 64)
    with pytest.raises(RuntimeError, match=r"copy_blocks: layer 1 cache shape/dtype \[6, 16, 2, 64\] Float differs"):
        ops.copy_blocks([key_caches[0], smaller], [value_caches[0], smaller.clone()], torch.tensor([[0, 1]]))
    half = torch.zeros(8, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"copy_blocks: layer 1 cache shape/dtype \[8, 16, 2, 64\] Half differs"):
        ops.copy_blocks([key_caches[0], half], [value_caches[0], half.clone()], torch.tensor([[0, 1]]))


def test_copy_blocks_rejects_key_value_dtype_mismatch():
    key_caches, value_caches = _two_layers()
    with pytest.raises(RuntimeError, match=r"copy_blocks: value_cache dtype Half differs from key_cache dtype Float"):
        ops.copy_blocks(key_caches, [value_caches[0], value_caches[1].half()], torch.tensor([[0, 1]]))


def _swap_inputs():
    gen = torch.Generator().manual_seed(13)
    return _rand((6, 16, 2, 64), torch.float32, gen), torch.zeros(4, 16, 2, 64)


@pytest.mark.parametrize(
    "dst,mapping,message",
    [
        (torch.zeros(4, 16, 2, 32), torch.tensor([[0, 1]]), r"src and dst must hold blocks of one shape"),
        (torch.zeros(4, 16, 64), torch.tensor([[0, 1]]), r"src and dst must hold blocks of one shape"),
        (torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), torch.tensor([[0, 1]]),
         r"src dtype Float differs from dst dtype BFloat16"),
        (torch.zeros(4, 2, 16, 64).transpose(1, 2), torch.tensor([[0, 1]]), r"src and dst must be contiguous"),
        (None, torch.tensor([[0, 4]]), r"block_mapping\[0\] destination block 4 is outside the destination cache"),
        (None, torch.tensor([[6, 0]]), r"block_mapping\[0\] source block 6 is outside the source cache \(6 blocks\)"),
        (None, torch.tensor([[0, 1]], dtype=torch.int32), r"block_mapping must be int64"),
        (None, torch.tensor([[[0, 1]]]), r"block_mapping must be \[num_pairs, 2\]"),
    ],
    ids=["head-size", "rank", "dtype", "non-contiguous", "dst-range", "src-range", "int32", "3-D"],
)
def test_swap_blocks_rejects_bad_input(dst, mapping, message):
    src, default_dst = _swap_inputs()
    dst = default_dst if dst is None else dst
    before = dst.clone()
    with pytest.raises(RuntimeError, match=r"swap_blocks: " + message):
        ops.swap_blocks(src, dst, mapping)
    assert torch.equal(dst, before)
