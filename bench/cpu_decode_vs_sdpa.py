"""CPU decode attention: pagedkv v1 vs torch SDPA, on the same K/V.

Three ways to attend one query token per sequence to its context:
  paged:        pagedkv.ops.paged_attention_v1 over a block table of shuffled block ids;
  sdpa:         torch SDPA over K/V already laid out contiguously [B, Hkv, L, D];
  gather+sdpa:  gather K/V through the block table, then SDPA (what a paged cache costs
                without a paged kernel).
Prints one row per (dtype, heads, context) with times, the K/V bytes read per second by
the paged kernel, and the speed-ups. Best of several runs, wall clock.

    PYTHONPATH=python python bench/cpu_decode_vs_sdpa.py [--threads 2] [--batch 32] [--context 1024 4096]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from pagedkv import ops  # importing pagedkv registers torch.ops.pagedkv.*

SHAPES = [(32, 8, 128), (9, 3, 64)]  # (num_heads, num_kv_heads, head_size): Llama-3-8B-like, SmolLM2-135M
DTYPES = [torch.float32, torch.bfloat16]


def best_time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_one(dtype, num_heads, num_kv_heads, head_size, batch, context, block_size):
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_size, generator=gen).to(dtype)
    out = torch.empty_like(query)
    scale = head_size**-0.5
    k = torch.randn(batch, num_kv_heads, context, head_size, generator=gen).to(dtype)
    v = torch.randn_like(k)
    q4 = query[:, :, None]

    def paged():
        ops.paged_attention_v1(out, query, key_cache, value_cache, block_tables, seq_lens, scale, context)

    def sdpa():
        F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    def gather_sdpa():
        ids = block_tables.long()
        kg = key_cache[ids].view(batch, context, num_kv_heads, head_size).transpose(1, 2)
        vg = value_cache[ids].view(batch, context, num_kv_heads, head_size).transpose(1, 2)
        F.scaled_dot_product_attention(q4, kg, vg, scale=scale, enable_gqa=True)

    t_paged, t_sdpa, t_gather = best_time(paged), best_time(sdpa), best_time(gather_sdpa)
    kv_bytes = 2 * key_cache.numel() * key_cache.element_size()
    return t_paged, t_sdpa, t_gather, kv_bytes / t_paged / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} batch={args.batch} block_size={args.block_size} "
          f"cpu_capability={torch.ops.pagedkv.cpu_capability()}")
    print(f"{'dtype':9} {'heads':10} {'context':>7} {'paged ms':>9} {'GB/s':>5} {'sdpa ms':>8} "
          f"{'gather ms':>9} {'vs sdpa':>7} {'vs gather':>9}")
    for dtype in DTYPES:
        for num_heads, num_kv_heads, head_size in SHAPES:
            for context in args.context:
                t_paged, t_sdpa, t_gather, gbps = bench_one(dtype, num_heads, num_kv_heads, head_size, args.batch,
                                                            context, args.block_size)
                heads = f"{num_heads}/{num_kv_heads}x{head_size}"
                print(f"{str(dtype).removeprefix('torch.'):9} {heads:10} {context:7} {t_paged * 1e3:9.2f} "
                      f"{gbps:5.1f} {t_sdpa * 1e3:8.2f} {t_gather * 1e3:9.2f} {t_sdpa / t_paged:7.2f} "
                      f"{t_gather / t_paged:9.2f}", flush=True)


if __name__ == "__main__":
    main()
