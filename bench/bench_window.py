"""Sliding-window and soft-capped attention: what the `sliding_window` / `logits_soft_cap` kernel arguments cost.

Rows, each against baselines timed interleaved in the same run (bench_kernels' timer):
  decode   ops.paged_attention over a long context with a window W, vs the plain op (no window: what a
           sliding model cost before, every key read) and vs SDPA over only the last W keys laid out
           contiguously (the best an unpaged kernel can do);
  prefill  ops.paged_prefill_attention of a chunk after a long cached context with a window, vs the plain
           op, and vs SDPA with the sliding causal mask as a boolean tensor (what a PyTorch user writes);
  softcap  both ops with logits_soft_cap=50 (Gemma 2) vs the plain op: the cost of the tanh per score.
Every row's output is checked against pagedkv.reference with the same arguments.

Usage:
    python bench/bench_window.py --out bench/results/window_cpu.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import machine_info, markdown_table  # noqa: E402  (bench/ is on sys.path)
from bench_kernels import CacheFlusher, index_checks_off, time_interleaved, timer, within_tolerance
from pagedkv import ops, reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCK = 16


def paged_kv(num_seqs: int, context: int, kv_heads: int, head: int, dtype: torch.dtype, gen):
    """A shuffled paged cache holding `context` tokens per sequence: (key_cache, value_cache, block_tables)."""
    per_seq = -(-context // BLOCK)
    num_blocks = num_seqs * per_seq
    key_cache = torch.randn(num_blocks, BLOCK, kv_heads, head, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, BLOCK, kv_heads, head, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_seqs, per_seq)
    return key_cache, value_cache, tables


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of every sequence as [num_seqs, kv_heads, end - start, head] (SDPA's layout)."""
    rows = cache[tables.long()].flatten(1, 2)[:, start:end]  # [S, context, Hkv, D]
    return rows.transpose(1, 2).contiguous()


def decode_row(dtype: str, num_seqs: int, context: int, window: int, cap: float, shape, args, gen) -> dict:
    heads, kv_heads, head = shape
    key_cache, value_cache, tables = paged_kv(num_seqs, context, kv_heads, head, DTYPES[dtype], gen)
    query = torch.randn(num_seqs, heads, head, generator=gen).to(DTYPES[dtype])
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    scale = head ** -0.5
    common = (query, key_cache, value_cache, tables, lens, scale, context, None)
    k_last = contiguous_kv(key_cache, tables, context - window, context)
    v_last = contiguous_kv(value_cache, tables, context - window, context)
    q4 = query.unsqueeze(2)
    contenders = {
        "ours": lambda: torch.ops.pagedkv.paged_attention(*common, sliding_window=window, logits_soft_cap=cap),
        "plain": lambda: torch.ops.pagedkv.paged_attention(*common),
    }
    if not cap:
        contenders["sdpa_last_w"] = lambda: F.scaled_dot_product_attention(q4, k_last, v_last, scale=scale,
                                                                           enable_gqa=True)
    got = contenders["ours"]()
    expected = reference.paged_attention(query, key_cache, value_cache, tables, lens, scale, sliding_window=window,
                                         logits_soft_cap=cap)
    return finish_row("decode", dtype, f"{num_seqs} x {context}", window, cap, contenders, got, expected, args)


def prefill_row(dtype: str, context: int, chunk: int, window: int, cap: float, shape, args, gen) -> dict:
    heads, kv_heads, head = shape
    key_cache, value_cache, tables = paged_kv(1, context, kv_heads, head, DTYPES[dtype], gen)
    query = torch.randn(chunk, heads, head, generator=gen).to(DTYPES[dtype])
    qsl = torch.tensor([0, chunk], dtype=torch.int32)
    lens = torch.tensor([context], dtype=torch.int32)
    scale = head ** -0.5
    out, scratch = torch.empty_like(query), torch.empty_like(query)
    common = (query, key_cache, value_cache, tables, qsl, lens, scale)
    pos_q = torch.arange(context - chunk, context)[:, None]
    pos_k = torch.arange(context)[None, :]
    mask = (pos_k <= pos_q) & (pos_k > pos_q - window)
    k_all, v_all = contiguous_kv(key_cache, tables, 0, context), contiguous_kv(value_cache, tables, 0, context)
    q4 = query.transpose(0, 1).unsqueeze(0)
    contenders = {
        "ours": lambda: ops.paged_prefill_attention(out, *common, chunk, context, sliding_window=window,
                                                    logits_soft_cap=cap),
        "plain": lambda: ops.paged_prefill_attention(scratch, *common, chunk, context),
    }
    if not cap:
        contenders["sdpa_masked"] = lambda: F.scaled_dot_product_attention(q4, k_all, v_all, attn_mask=mask,
                                                                           scale=scale, enable_gqa=True)
    contenders["ours"]()
    expected = reference.paged_prefill_attention(*common, sliding_window=window, logits_soft_cap=cap)
    return finish_row("prefill", dtype, f"{chunk} after {context - chunk}", window, cap, contenders, out.clone(),
                      expected, args)


def finish_row(kind, dtype, size, window, cap, contenders, got, expected, args) -> dict:
    max_diff, ok = within_tolerance(got, expected, dtype)
    with index_checks_off():
        times = time_interleaved({n: timer(f, "cpu", args.flush) for n, f in contenders.items()}, args.budget_s,
                                 5, 200)
    row = {"op": kind, "dtype": dtype, "size": size, "window": window or "-", "soft_cap": cap or "-",
           "ours_us": round(times["ours"] * 1e6, 1), "plain_us": round(times["plain"] * 1e6, 1),
           "plain_over_ours": round(times["plain"] / times["ours"], 2)}
    for base in ("sdpa_last_w", "sdpa_masked"):
        if base in times:
            row["sdpa_us"], row["sdpa_over_ours"] = round(times[base] * 1e6, 1), round(times[base] / times["ours"], 2)
    row["check"] = "ok" if ok else f"FAIL ({max_diff:.2g})"
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--budget-s", type=float, default=1.0, help="seconds per row")
    p.add_argument("--quick", action="store_true", help="fewer rows")
    args = p.parse_args()
    args.flush = CacheFlusher("cpu")
    gen = torch.Generator().manual_seed(0)
    shape = (32, 8, 128)  # Mistral-7B's heads
    dtypes = ["bf16"] if args.quick else ["fp32", "bf16"]
    rows = []
    for dtype in dtypes:
        rows.append(decode_row(dtype, 16, 4096, 512, 0.0, shape, args, gen))
        rows.append(decode_row(dtype, 16, 4096, 1024, 0.0, shape, args, gen))
        rows.append(prefill_row(dtype, 4096, 512, 1024, 0.0, shape, args, gen))
        rows.append(decode_row(dtype, 16, 4096, 0, 50.0, shape, args, gen))
        rows.append(prefill_row(dtype, 2048, 512, 0, 50.0, shape, args, gen))
        print(f"{dtype} done", file=sys.stderr)
    header = list(dict.fromkeys(k for r in rows for k in r))
    table = markdown_table(header, [[r.get(k, "") for k in header] for r in rows])
    info = machine_info()
    text = "\n".join(["# Sliding-window and soft-capped attention (bench/bench_window.py)", "",
                      *[f"- {k}: {v}" for k, v in info.items()],
                      f"- heads {shape[0]} / KV heads {shape[1]} / head size {shape[2]}, block size {BLOCK}; "
                      "times are medians of interleaved reps (µs); `plain` = the same op with neither window nor "
                      "cap; ratios > 1: ours faster", "", table, ""])
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
