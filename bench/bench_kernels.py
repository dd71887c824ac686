"""Kernel benchmark: pagedkv decode attention vs SDPA, v1 vs v2, and the block-copy ops.

Decode rows compare `pagedkv.ops.paged_attention` (the op that picks v1/v2)
with two PyTorch baselines on the same K/V values:
  sdpa        `scaled_dot_product_attention` on K/V already laid out contiguously
              as [batch, num_kv_heads, context, head_size] (the best case, not paged);
              both GQA forms are timed (`enable_gqa=True`, and heads pre-expanded
              outside the timed region) and the faster is reported;
  gather      the naive paged approach: index the cache with the block table,
              reshape, then SDPA (enable_gqa=True).
Every sequence of a row has the full context length; block ids are a random
permutation (non-contiguous). Ratios > 1 mean pagedkv is faster.

The three contenders of a row run interleaved, rep after rep, and each reports
its median: the box may be shared, and interleaving spreads any noise evenly.

Usage:
    python bench/bench_kernels.py                 # decode table + block-copy ops
    python bench/bench_kernels.py --v1-vs-v2      # v1 vs v2 sweep, checks should_use_v2
    python bench/bench_kernels.py --all --json bench/results/kernels_cpu.json
    python bench/bench_kernels.py --device cuda --all
Stdout is markdown (tables); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from pagedkv import ops, reference

HEAD_CONFIGS = [(9, 3, 64), (32, 8, 128)]  # (num_heads, num_kv_heads, head_size): SmolLM2-135M, Llama-3-8B
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK_SIZE = 16
V2_PARTITION_SIZE = 512

# Targets (decode, batch 32, context 1024-4096): within 10% of SDPA on contiguous
# K/V, twice as fast as gather+SDPA; on a GPU, 80% of copy bandwidth at the
# batch 32 x 4096 bf16 32/8x128 row.
TARGET_VS_SDPA = 0.9
TARGET_VS_GATHER = 2.0
TARGET_CUDA_BW_FRACTION = 0.8


@dataclass(frozen=True, slots=True)
class DecodeCase:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int = BLOCK_SIZE

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the kernel must read: 2 * sum(seq_lens) * num_kv_heads * head_size * elem_size."""
        elem = torch.empty(0, dtype=DTYPES[self.dtype]).element_size()
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_size * elem

    @property
    def is_target(self) -> bool:
        return self.batch == 32 and 1024 <= self.context <= 4096

    @property
    def heads(self) -> str:
        return f"{self.num_heads}/{self.num_kv_heads}x{self.head_size}"


@dataclass(slots=True)
class DecodeInputs:
    """A paged cache and the same K/V laid out contiguously for SDPA."""

    query: torch.Tensor  # [batch, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [batch, blocks_per_seq], a random permutation of the blocks
    seq_lens: torch.Tensor  # int32 [batch], all = context
    scale: float
    key: torch.Tensor = field(default=None)  # [batch, num_kv_heads, context, head_size], contiguous
    value: torch.Tensor = field(default=None)


# ---- timing ---------------------------------------------------------------------------------------


def time_once(fn: Callable[[], object], device: str) -> float:
    """Seconds for one call (CUDA: device time between two events)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def time_interleaved(fns: dict[str, Callable[[], object]], device: str, budget_s: float, min_reps: int,
                     max_reps: int) -> dict[str, float]:
    """Median seconds per contender; each rep runs every contender once, in rotating order.

    The first call of each is a warm-up (page faults, lazy init) and sizes the
    number of reps so a row takes about budget_s.
    """
    names = list(fns)
    first = {name: time_once(fns[name], device) for name in names}
    reps = int(min(max_reps, max(min_reps, budget_s / max(sum(first.values()), 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(time_once(fns[name], device))
    return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Measured copy bandwidth in GB/s, counting bytes read + written (the ceiling for a streaming kernel)."""
    buffers = torch.ones(2, nbytes, dtype=torch.uint8, device=device)
    seconds = time_interleaved({"copy": lambda: buffers[1].copy_(buffers[0])}, device, budget_s=1.0, min_reps=5,
                               max_reps=20)
    return 2 * nbytes / seconds["copy"] / 1e9


# ---- inputs ---------------------------------------------------------------------------------------


def make_decode_inputs(case: DecodeCase, device: str, seed: int, contiguous_kv: bool = True) -> DecodeInputs:
    # Random values are drawn on the device (fast on a GPU); the block permutation on the CPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[case.dtype]
    blocks_per_seq = math.ceil(case.context / case.block_size)
    num_blocks = case.batch * blocks_per_seq
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    key_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    inputs = DecodeInputs(
        query=torch.randn(case.batch, case.num_heads, case.head_size, generator=gen, device=device, dtype=dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.view(case.batch, blocks_per_seq).to(device=device, dtype=torch.int32),
        seq_lens=torch.full((case.batch,), case.context, dtype=torch.int32, device=device),
        scale=1.0 / math.sqrt(case.head_size),
    )
    if contiguous_kv:
        inputs.key = gather_kv(inputs, case).contiguous()
        inputs.value = gather_kv(inputs, case, value=True).contiguous()
    return inputs


def gather_kv(inputs: DecodeInputs, case: DecodeCase, value: bool = False) -> torch.Tensor:
    """The naive paged read: index the cache with the block table -> [batch, num_kv_heads, context, head_size]."""
    cache = inputs.value_cache if value else inputs.key_cache
    blocks = inputs.block_tables.long()
    gathered = cache[blocks].flatten(1, 2)[:, : case.context]  # [batch, context, num_kv_heads, head_size]
    return gathered.transpose(1, 2)


# ---- decode attention -----------------------------------------------------------------------------


def decode_contenders(inputs: DecodeInputs, case: DecodeCase, max_expand_bytes: int) -> dict[str, Callable]:
    """Our op, SDPA in both GQA forms (expanded only if it fits max_expand_bytes), gather + SDPA."""
    q = inputs.query.unsqueeze(2)  # [batch, num_heads, 1, head_size]
    group = case.num_heads // case.num_kv_heads
    contenders = {
        "ours": lambda: ops.paged_attention(inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
                                            inputs.seq_lens, inputs.scale, case.context),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, inputs.key, inputs.value, scale=inputs.scale,
                                                           enable_gqa=True),
        "gather": lambda: F.scaled_dot_product_attention(q, gather_kv(inputs, case), gather_kv(inputs, case, True),
                                                         scale=inputs.scale, enable_gqa=True),
    }
    if group > 1 and 2 * group * inputs.key.nbytes <= max_expand_bytes:
        key_expanded = inputs.key.repeat_interleave(group, dim=1)
        value_expanded = inputs.value.repeat_interleave(group, dim=1)
        contenders["sdpa_expand"] = lambda: F.scaled_dot_product_attention(q, key_expanded, value_expanded,
                                                                           scale=inputs.scale)
    return contenders


def check_agreement(contenders: dict[str, Callable], case: DecodeCase) -> float:
    """max |ours - sdpa| over the outputs: a fast but wrong kernel must not look good."""
    ours = contenders["ours"]().float()
    sdpa = contenders["sdpa_gqa"]().squeeze(2).float()
    return (ours - sdpa).abs().max().item()


def bench_decode_case(case: DecodeCase, args: argparse.Namespace, copy_gbps: float) -> dict:
    inputs = make_decode_inputs(case, args.device, seed=case.batch * 7919 + case.context)
    contenders = decode_contenders(inputs, case, args.max_expand_bytes)
    max_diff = check_agreement(contenders, case)
    times = time_interleaved(contenders, args.device, args.budget_s, args.min_reps, args.max_reps)
    sdpa_form = min((n for n in times if n.startswith("sdpa_")), key=times.__getitem__)
    ours, sdpa, gather = times["ours"], times[sdpa_form], times["gather"]
    gbps = case.kv_bytes / ours / 1e9
    row = asdict(case) | {
        "heads": case.heads,
        "kv_MiB": case.kv_bytes / 2**20,
        "ours_us": ours * 1e6,
        "sdpa_us": sdpa * 1e6,
        "sdpa_form": sdpa_form.removeprefix("sdpa_") + ("" if "sdpa_expand" in times else " (expand not run)"),
        "gather_us": gather * 1e6,
        "all_us": {name: t * 1e6 for name, t in times.items()},
        "ours_GBps": gbps,
        "pct_copy_bw": 100 * gbps / copy_gbps,
        "sdpa_over_ours": sdpa / ours,
        "gather_over_ours": gather / ours,
        "max_abs_diff": max_diff,
        "target": case.is_target,
    }
    row["verdict"] = decode_verdict(row, args.device)
    return row


def decode_verdict(row: dict, device: str) -> str:
    if not row["target"]:
        return ""
    ok = row["sdpa_over_ours"] >= TARGET_VS_SDPA and row["gather_over_ours"] >= TARGET_VS_GATHER
    if device == "cuda" and row["context"] == 4096 and row["dtype"] == "bf16" and row["heads"] == "32/8x128":
        ok = ok and row["pct_copy_bw"] >= 100 * TARGET_CUDA_BW_FRACTION
    return "PASS" if ok else "MISS"


def decode_cases(args: argparse.Namespace) -> list[DecodeCase]:
    return [DecodeCase(b, ctx, h, kv, d, dt) for dt in args.dtypes for h, kv, d in HEAD_CONFIGS
            for b in args.batches for ctx in args.contexts]


def run_decode(args: argparse.Namespace, copy_gbps: float) -> list[dict]:
    rows = []
    for case in decode_cases(args):
        log(f"decode {case}")
        rows.append(bench_decode_case(case, args, copy_gbps))
        gc.collect()
    print("## Decode attention: pagedkv.ops.paged_attention vs SDPA (contiguous K/V) vs gather+SDPA\n")
    print(f"Ratios are baseline time / ours (> 1: pagedkv faster). Target rows (*): >= {TARGET_VS_SDPA}x SDPA and "
          f">= {TARGET_VS_GATHER}x gather+SDPA"
          + (f", and >= {100 * TARGET_CUDA_BW_FRACTION:.0f}% of copy bandwidth at batch 32 x 4096 bf16 32/8x128."
             if args.device == "cuda" else ".") + "\n")
    print_table(rows, [
        ("dtype", "dtype", "{}"), ("heads", "heads", "{}"), ("batch", "batch", "{}"), ("ctx", "context", "{}"),
        ("K/V MiB", "kv_MiB", "{:.1f}"), ("ours us", "ours_us", "{:.0f}"), ("GB/s", "ours_GBps", "{:.1f}"),
        ("% copy bw", "pct_copy_bw", "{:.0f}"), ("sdpa us", "sdpa_us", "{:.0f}"), ("sdpa form", "sdpa_form", "{}"),
        ("sdpa/ours", "sdpa_over_ours", "{:.2f}"), ("gather us", "gather_us", "{:.0f}"),
        ("gather/ours", "gather_over_ours", "{:.2f}"), ("max abs diff", "max_abs_diff", "{:.1e}"),
        ("target", "verdict", "{}"),
    ])
    targets = [r for r in rows if r["target"]]
    if targets:
        passed = sum(r["verdict"] == "PASS" for r in targets)
        print(f"\nTarget rows: {passed}/{len(targets)} PASS.\n")
    return rows


# ---- v1 vs v2 -------------------------------------------------------------------------------------


def variant_chosen_by_op(inputs: DecodeInputs, max_seq_len: int) -> str:
    """Which kernel paged_attention dispatches to for this shape (the C++ should_use_v2 rule), read from the
    profiler's record of dispatcher calls rather than re-implemented here."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.paged_attention(inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
                            inputs.seq_lens, inputs.scale, max_seq_len)
    names = {event.name for event in prof.events()}
    if "pagedkv::paged_attention_v2" in names:
        return "v2"
    if "pagedkv::paged_attention_v1" in names:
        return "v1"
    return "?"


def bench_v1_v2_case(case: DecodeCase, args: argparse.Namespace) -> dict:
    inputs = make_decode_inputs(case, args.device, seed=case.batch * 31 + case.context, contiguous_kv=False)
    q = inputs.query
    num_partitions = math.ceil(case.context / V2_PARTITION_SIZE)
    exp_sums = torch.empty(case.batch, case.num_heads, num_partitions, device=args.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(case.batch, case.num_heads, num_partitions, case.head_size, dtype=q.dtype,
                          device=args.device)
    out = torch.empty_like(q)
    common = (q, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.seq_lens, inputs.scale,
              case.context)
    contenders = {
        "v1": lambda: ops.paged_attention_v1(out, *common),
        "v2": lambda: ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, *common,
                                             partition_size=V2_PARTITION_SIZE),
    }
    times = time_interleaved(contenders, args.device, args.budget_s, args.min_reps, args.max_reps)
    faster = "v2" if times["v2"] < times["v1"] else "v1"
    chosen = variant_chosen_by_op(inputs, case.context)
    # Within 5% the two are a tie on a noisy box: either choice is right.
    tie = abs(times["v1"] - times["v2"]) <= 0.05 * min(times.values())
    return asdict(case) | {
        "heads": case.heads,
        "work_items": case.batch * case.num_kv_heads,  # what v1 parallelizes over
        "v1_us": times["v1"] * 1e6,
        "v2_us": times["v2"] * 1e6,
        "v1_over_v2": times["v1"] / times["v2"],
        "faster": faster,
        "rule_picks": chosen,
        "rule_ok": "yes" if chosen == faster else ("tie" if tie else "NO"),
    }


def run_v1_vs_v2(args: argparse.Namespace) -> list[dict]:
    rows = []
    for dtype in args.v2_dtypes:
        for h, kv, d in HEAD_CONFIGS:
            for batch in args.v2_batches:
                for context in args.v2_contexts:
                    case = DecodeCase(batch, context, h, kv, d, dtype)
                    log(f"v1-vs-v2 {case}")
                    rows.append(bench_v1_v2_case(case, args))
                    gc.collect()
    print(f"## v1 vs v2 (partition {V2_PARTITION_SIZE}), and what paged_attention picks (should_use_v2)\n")
    print(f"v1/v2 > 1: v2 faster. rule ok: the op's choice is the faster kernel (tie: within 5%). "
          f"{torch.get_num_threads()} threads.\n")
    print_table(rows, [
        ("dtype", "dtype", "{}"), ("heads", "heads", "{}"), ("batch", "batch", "{}"), ("ctx", "context", "{}"),
        ("seqs x kv heads", "work_items", "{}"), ("v1 us", "v1_us", "{:.0f}"), ("v2 us", "v2_us", "{:.0f}"),
        ("v1/v2", "v1_over_v2", "{:.2f}"),
        ("faster", "faster", "{}"), ("op picks", "rule_picks", "{}"), ("rule ok", "rule_ok", "{}"),
    ])
    wrong = [r for r in rows if r["rule_ok"] == "NO"]
    print(f"\nRule matches the faster kernel (or ties) in {len(rows) - len(wrong)}/{len(rows)} rows.\n")
    return rows


# ---- block-copy ops -------------------------------------------------------------------------------


def index_copy_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    """reshape_and_cache in plain PyTorch with index_copy_ into the flattened slots (vs the reference's index_put)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.flatten(0, 1).index_copy_(0, slots, key[keep])
    value_cache.flatten(0, 1).index_copy_(0, slots, value[keep])


def index_copy_blocks(key_caches, value_caches, block_mapping) -> None:
    """copy_blocks in plain PyTorch with one index_copy_ per cache (vs the reference's loop over pairs)."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst, cache[src])


def bench_reshape_and_cache(args: argparse.Namespace, dtype_name: str, shape: tuple, gen) -> list[dict]:
    dtype, rows = DTYPES[dtype_name], []
    key_cache = torch.zeros(shape, dtype=dtype, device=args.device)
    value_cache = torch.zeros_like(key_cache)
    num_slots = shape[0] * shape[1]
    for num_tokens in (32, 2048):
        key = torch.randn(num_tokens, *shape[2:], generator=gen).to(args.device, dtype)
        value = torch.randn(num_tokens, *shape[2:], generator=gen).to(args.device, dtype)
        slots = torch.randperm(num_slots, generator=gen)[:num_tokens].to(args.device)
        a = (key, value, key_cache, value_cache, slots)
        times = time_interleaved({"ours": lambda a=a: ops.reshape_and_cache(*a),
                                  "reference": lambda a=a: reference.reshape_and_cache(*a),
                                  "index_copy": lambda a=a: index_copy_write(*a)},
                                 args.device, args.budget_s / 2, args.min_reps, args.max_reps)
        rows.append(cache_op_row("reshape_and_cache", f"{num_tokens} tokens", dtype_name, times, 2 * 2 * key.nbytes))
    return rows


def bench_copy_blocks(args: argparse.Namespace, dtype_name: str, shape: tuple, gen, num_layers: int = 8) -> list:
    dtype, rows = DTYPES[dtype_name], []
    layers = [torch.zeros(shape, dtype=dtype, device=args.device) for _ in range(2 * num_layers)]
    kc, vc = layers[:num_layers], layers[num_layers:]
    for num_pairs in (4, 128):
        perm = torch.randperm(shape[0], generator=gen)
        mapping = torch.stack([perm[:num_pairs], perm[num_pairs : 2 * num_pairs]], dim=1).to(args.device)
        times = time_interleaved({"ours": lambda m=mapping: ops.copy_blocks(kc, vc, m),
                                  "reference": lambda m=mapping: reference.copy_blocks(kc, vc, m),
                                  "index_copy": lambda m=mapping: index_copy_blocks(kc, vc, m)},
                                 args.device, args.budget_s / 2, args.min_reps, args.max_reps)
        bytes_moved = 2 * 2 * num_layers * num_pairs * layers[0][0].nbytes
        rows.append(cache_op_row("copy_blocks", f"{num_layers} layers x {num_pairs} pairs", dtype_name, times,
                                 bytes_moved))
    return rows


def bench_cache_ops(args: argparse.Namespace) -> list[dict]:
    """reshape_and_cache and copy_blocks vs pagedkv.reference and vs index_copy_ (Llama-3-8B-like layer)."""
    shape = (1024, BLOCK_SIZE, 8, 128)  # [num_blocks, block_size, num_kv_heads, head_size]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype_name in args.dtypes:
        log(f"cache ops {dtype_name}")
        rows += bench_reshape_and_cache(args, dtype_name, shape, gen)
        rows += bench_copy_blocks(args, dtype_name, shape, gen)
        gc.collect()
    print("## Block-copy ops vs pagedkv.reference and vs index_copy_ (8 KV heads x 128, block 16, 1024 blocks)\n")
    print("reference: pagedkv.reference (index_put for reshape_and_cache, a loop over pairs for copy_blocks); "
          "index_copy: the same with index_copy_. best torch/ours uses the faster of the two; > 1: pagedkv "
          "faster.\n")
    print_table(rows, [
        ("op", "op", "{}"), ("shape", "shape", "{}"), ("dtype", "dtype", "{}"), ("ours us", "ours_us", "{:.1f}"),
        ("GB/s (r+w)", "ours_GBps", "{:.1f}"), ("reference us", "reference_us", "{:.1f}"),
        ("ref/ours", "ref_over_ours", "{:.1f}"), ("index_copy us", "index_copy_us", "{:.1f}"),
        ("best torch/ours", "best_torch_over_ours", "{:.2f}"),
    ])
    print()
    return rows


def cache_op_row(op: str, shape: str, dtype: str, times: dict[str, float], bytes_moved: int) -> dict:
    ours = times["ours"]
    return {"op": op, "shape": shape, "dtype": dtype, "ours_us": ours * 1e6, "ours_GBps": bytes_moved / ours / 1e9,
            "reference_us": times["reference"] * 1e6, "ref_over_ours": times["reference"] / ours,
            "index_copy_us": times["index_copy"] * 1e6,
            "best_torch_over_ours": min(times["reference"], times["index_copy"]) / ours}


# ---- output ---------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """A markdown table; columns are (title, row key, format)."""
    cells = [[fmt.format(row[key]) for _, key, fmt in columns] for row in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _, _) in enumerate(columns)]
    print("| " + " | ".join(t.ljust(w) for (t, _, _), w in zip(columns, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)) + " |")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: str) -> dict:
    info = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device": device,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    capability = getattr(torch.ops.pagedkv, "cpu_capability", None)
    if capability is not None:
        info["pagedkv_cpu_kernels"] = capability()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def print_header(info: dict, copy_gbps: float, args: argparse.Namespace) -> None:
    print("# pagedkv kernel benchmark\n")
    for key, value in info.items():
        print(f"- {key}: {value}")
    print(f"- measured copy bandwidth ({args.copy_bytes / 2**20:.0f} MiB, read+write): {copy_gbps:.1f} GB/s")
    print(f"- timing: median of interleaved reps ({args.min_reps}-{args.max_reps} per row, ~{args.budget_s}s "
          f"per row), {'torch.cuda.Event' if args.device == 'cuda' else 'time.perf_counter'}")
    print(f"- command: {' '.join(sys.argv)}\n")


def plot_decode(results: dict, path: str) -> None:
    """Decode time against context length: the paged kernel, SDPA on contiguous K/V, gather + SDPA.

    One panel per (dtype, head shape, batch) of the --json "decode" rows; log-log axes.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.get("decode") or []
    if not rows:
        raise SystemExit("no decode rows to plot (run with the decode table, e.g. --all)")
    kinds = sorted({(r["dtype"], r["heads"]) for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(kinds), len(batches), figsize=(4 * len(batches), 3 * len(kinds)), squeeze=False)
    lines = [("ours_us", "paged_attention (ours)", "#1971c2"), ("sdpa_us", "SDPA, contiguous K/V", "#868e96"),
             ("gather_us", "gather + SDPA", "#f08c00")]
    for i, (dtype, heads) in enumerate(kinds):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            sel = sorted((r for r in rows if (r["dtype"], r["heads"], r["batch"]) == (dtype, heads, batch)),
                         key=lambda r: r["context"])
            for key, label, color in lines:
                pts = [(r["context"], r[key]) for r in sel if r.get(key)]
                ax.plot([c for c, _ in pts], [t for _, t in pts], "o-", label=label, color=color, ms=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{dtype}, heads {heads} (q/kv x dim), batch {batch}", fontsize=8)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("decode time (us)")
    axes[0][0].legend(fontsize=7)
    m = results.get("machine", {})
    fig.suptitle(f"Decode attention, {m.get('device', '?')}: {m.get('cpu', '?')}, {m.get('date_utc', '?')} UTC",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="a short run: fewer shapes and reps")
    p.add_argument("--v1-vs-v2", action="store_true", help="only the v1 vs v2 sweep")
    p.add_argument("--all", action="store_true", help="decode table, v1 vs v2 sweep and block-copy ops")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw decode time vs context length (PNG) here")
    p.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier --json file; run nothing")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=None)
    p.add_argument("--batches", nargs="+", type=int, default=None)
    p.add_argument("--contexts", nargs="+", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--budget-s", type=float, default=None, help="target seconds of timing per row")
    p.add_argument("--max-expand-bytes", type=int, default=2 << 30,
                   help="largest pre-expanded K+V for the expanded SDPA form (memory bound)")
    args = p.parse_args(argv)
    quick = args.quick
    # The v1/v2 trade-off is about parallelism, not dtype: one dtype keeps the sweep short.
    args.v2_dtypes = args.dtypes or ["bf16"]
    args.dtypes = args.dtypes or (["bf16"] if quick else ["fp32", "bf16"])
    args.batches = args.batches or ([1, 32] if quick else [1, 8, 32])
    args.contexts = args.contexts or ([512, 2048] if quick else [128, 512, 1024, 2048, 4096])
    args.v2_batches = [1, 4, 32] if quick else [1, 2, 4, 8, 16, 32]
    args.v2_contexts = [1024, 4096] if quick else [1024, 2048, 4096, 8192]
    # GPU timings are steady: half the CPU budget is plenty (and keeps a full CUDA run near a minute).
    args.budget_s = args.budget_s or (0.2 if quick else 1.0) * (0.5 if args.device == "cuda" else 1.0)
    args.min_reps, args.max_reps = (3, 20) if quick else (3, 40)
    args.copy_bytes = (2 << 30) if args.device == "cuda" else (512 << 20)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot_decode(json.load(f), args.plot or "bench/results/kernels_cpu.png")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible to torch")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = machine_info(args.device)
    copy_gbps = copy_bandwidth(args.device, args.copy_bytes)
    print_header(info, copy_gbps, args)
    results: dict = {"machine": info, "copy_bandwidth_GBps": copy_gbps, "args": {
        k: v for k, v in vars(args).items() if k != "json"}}
    started = time.perf_counter()
    with torch.inference_mode():
        if not args.v1_vs_v2 or args.all:
            results["decode"] = run_decode(args, copy_gbps)
        if args.v1_vs_v2 or args.all:
            results["v1_vs_v2"] = run_v1_vs_v2(args)
        if not args.v1_vs_v2 or args.all:
            results["cache_ops"] = bench_cache_ops(args)
    results["elapsed_s"] = time.perf_counter() - started
    results["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(f"Total benchmark time: {results['elapsed_s']:.0f} s; 1-minute load average at the end: "
          f"{results['load_average_1m_at_end']:.1f} (at the start: {info['load_average_1m']:.1f}).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        log(f"wrote {args.json}")
    if args.plot and "decode" in results:
        plot_decode(results, args.plot)


if __name__ == "__main__":
    main()
