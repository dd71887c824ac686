"""Benchmark: C++ block manager vs its pure-Python twin, same API, same run.

For 256 and 1024 concurrent sequences (prompt 512 tokens, block_size 16):
  - allocate: every sequence's prompt blocks (per call);
  - append (per seq): one append_slots call per sequence per decode step;
  - append (batch): one append_slots_batch call per decode step;
  - free: every sequence (per call);
  - metadata: one decode step's block_tables / slot_mapping / seq_lens,
    filled into preallocated buffers (numpy, or CPU torch tensors via their
    numpy views), the cost the engine pays every step.
Targets: metadata for 256 sequences <= 200 us; C++ >= 10x Python.

    PYTHONPATH=python python bench/bench_block_manager.py [--quick] [--json bench/results/block_manager_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_common import cpu_model  # noqa: E402  (bench/ is on sys.path when a script runs)
from pagedkv.core import BlockManager

BLOCK_SIZE = 16
PROMPT_LEN = 512


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of one call, in microseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(times)


def cycle(backend: str, num_seqs: int, decode_steps: int) -> dict[str, float]:
    """allocate -> decode steps (per-seq, then batched appends) -> free, timed per operation."""
    blocks = num_seqs * (-(-(PROMPT_LEN + 2 * decode_steps) // BLOCK_SIZE) + 1)
    bm = BlockManager(BLOCK_SIZE, blocks, 0, watermark=0.0, backend=backend)
    ids = list(range(num_seqs))
    out = {}
    t0 = time.perf_counter_ns()
    for s in ids:
        bm.allocate(s, PROMPT_LEN)
    out["allocate_us_per_seq"] = (time.perf_counter_ns() - t0) / num_seqs / 1e3
    t0 = time.perf_counter_ns()
    for _ in range(decode_steps):
        for s in ids:
            bm.append_slots(s)
    out["append_us_per_seq"] = (time.perf_counter_ns() - t0) / (num_seqs * decode_steps) / 1e3
    t0 = time.perf_counter_ns()
    for _ in range(decode_steps):
        bm.append_slots_batch(ids)
    out["append_batch_us_per_step"] = (time.perf_counter_ns() - t0) / decode_steps / 1e3
    t0 = time.perf_counter_ns()
    for s in ids:
        bm.free(s)
    out["free_us_per_seq"] = (time.perf_counter_ns() - t0) / num_seqs / 1e3
    assert bm.num_free_gpu_blocks == blocks
    return out


def metadata(backend: str, num_seqs: int, repeats: int, use_torch: bool) -> float:
    """us for one decode step's metadata of `num_seqs` sequences of ~PROMPT_LEN tokens."""
    bm = BlockManager(BLOCK_SIZE, num_seqs * (PROMPT_LEN // BLOCK_SIZE + 2), 0, watermark=0.0, backend=backend)
    rng = np.random.default_rng(0)
    ids = list(range(num_seqs))
    for s in ids:
        bm.allocate(s, int(rng.integers(PROMPT_LEN // 2, PROMPT_LEN)))
    max_blocks = PROMPT_LEN // BLOCK_SIZE
    if use_torch:
        import torch

        bt = torch.zeros((num_seqs, max_blocks), dtype=torch.int32)
        sm = torch.zeros(num_seqs, dtype=torch.int64)
        sl = torch.zeros(num_seqs, dtype=torch.int32)
    else:
        bt = np.zeros((num_seqs, max_blocks), np.int32)
        sm = np.zeros(num_seqs, np.int64)
        sl = np.zeros(num_seqs, np.int32)
    return per_call_us(lambda: bm.fill_metadata(ids, bt, sm, sl), calls=10, repeats=repeats)


def run(quick: bool) -> dict:
    steps = 8 if quick else 32
    repeats = 5 if quick else 30
    rows = []
    for num_seqs in (256, 1024):
        results = {b: cycle(b, num_seqs, steps) for b in ("cpp", "python")}
        for key in results["cpp"]:
            rows.append({"op": key, "num_seqs": num_seqs, "cpp_us": results["cpp"][key],
                         "python_us": results["python"][key]})
        for use_torch in (False, True):
            key = "metadata_us_per_step" + ("_torch" if use_torch else "_numpy")
            rows.append({"op": key, "num_seqs": num_seqs,
                         "cpp_us": metadata("cpp", num_seqs, repeats, use_torch),
                         "python_us": metadata("python", num_seqs, max(3, repeats // 5), use_torch)})
    for r in rows:
        r["speedup"] = r["python_us"] / r["cpp_us"]
    return {
        "benchmark": "block_manager",
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": cpu_model(), "platform": platform.platform(), "python": platform.python_version()},
        "config": {"block_size": BLOCK_SIZE, "prompt_len": PROMPT_LEN, "decode_steps": steps, "quick": quick},
        "rows": rows,
    }


def print_table(report: dict) -> None:
    print(f"block manager benchmark, {report['date_utc']}, {report['machine']['cpu']}, "
          f"Python {report['machine']['python']}")
    print(f"block_size {BLOCK_SIZE}, prompt {PROMPT_LEN} tokens, {report['config']['decode_steps']} decode steps")
    print(f"{'operation':<30}{'seqs':>6}{'C++ us':>12}{'Python us':>12}{'speedup':>9}")
    for r in report["rows"]:
        print(f"{r['op']:<30}{r['num_seqs']:>6}{r['cpp_us']:>12.3f}{r['python_us']:>12.2f}{r['speedup']:>8.1f}x")
    meta = next(r for r in report["rows"] if r["op"] == "metadata_us_per_step_numpy" and r["num_seqs"] == 256)
    print(f"target: metadata for 256 seqs <= 200 us: {meta['cpp_us']:.1f} us "
          f"({'met' if meta['cpp_us'] <= 200 else 'MISSED'}); C++ >= 10x Python: {meta['speedup']:.0f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    report = run(args.quick)
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
