"""Where an offline run's time goes: bench_throughput.py's workload on pagedkv, op by op.

Runs the workload twice after the warm-up: once under torch.profiler (self CPU time per op: the
GEMMs, the attention kernels, the fused ops, what is left), once with every packed GEMM timed by
its output width and by prefill (more than 256 rows) or decode, with the GFLOP/s each reached.
The GEMM table says how far the linear layers are from the GEMM library's peak on this machine,
which an engine built on the same library cannot beat.

    python bench/bench_offline_profile.py --dtype bfloat16 [--out bench/results/offline_profile_cpu.md]
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import bench_throughput  # the workload and its arguments
import pagedkv.model.cpu_linear as cpu_linear
import torch
from bench_common import header_lines, machine_info
from pagedkv import LLM, SamplingParams
from pagedkv.model.default_model import ensure_default_model

PREFILL_ROWS = 256  # a GEMM with more rows than this is counted as prefill


class GemmTimer:
    """Wraps cpu_linear.packed_linear (while on) to add up seconds, calls, rows and FLOPs per (width, phase)."""

    def __init__(self) -> None:
        self.on = False
        self.stats: dict[tuple[int, str], list[float]] = collections.defaultdict(lambda: [0.0, 0, 0, 0.0])
        self._inner = cpu_linear.packed_linear

    def __call__(self, x: torch.Tensor, packed: cpu_linear.PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.on:
            return self._inner(x, packed, bias)
        start = time.perf_counter()
        y = self._inner(x, packed, bias)
        row = self.stats[(y.shape[-1], "prefill" if x.shape[0] > PREFILL_ROWS else "decode")]
        row[0] += time.perf_counter() - start
        row[1] += 1
        row[2] += x.shape[0]
        row[3] += 2.0 * x.shape[0] * x.shape[1] * y.shape[-1]
        return y


def generate(llm: LLM, wl: bench_throughput.Workload) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def op_table(prof, elapsed: float, rows: int) -> str:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    lines = ["| op | self s | share of op time | calls | mean us |", "|---|---:|---:|---:|---:|"]
    for e in events[:rows]:
        s = e.self_cpu_time_total / 1e6
        lines.append(f"| {e.key} | {s:.3f} | {100 * s / total:.1f}% | {e.count} | {1e6 * s / e.count:.1f} |")
    lines.append(f"\nop time {total:.2f} s of {elapsed:.2f} s elapsed under the profiler")
    return "\n".join(lines)


def gemm_table(timer: GemmTimer) -> str:
    lines = ["| output width | phase | s | calls | mean rows | GFLOP/s |", "|---:|---|---:|---:|---:|---:|"]
    for (width, phase), (s, calls, rows, flops) in sorted(timer.stats.items()):
        lines.append(f"| {width} | {phase} | {s:.3f} | {calls} | {rows / calls:.0f} | {flops / s / 1e9:.0f} |")
    total = sum(v[0] for v in timer.stats.values())
    lines.append(f"\nGEMMs {total:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=12, help="ops listed, by self time")
    p.add_argument("--out", help="write the markdown report here")
    args = p.parse_args(argv)
    wargs = bench_throughput.parse_args(["--dtype", args.dtype])
    wl = bench_throughput.make_workload(wargs.num_requests, wargs.seed, tuple(wargs.prompt_len),
                                        tuple(wargs.output_len), tuple(wargs.token_range))
    timer = GemmTimer()
    cpu_linear.packed_linear = timer  # the layers look it up at call time
    llm = LLM(model=str(ensure_default_model()), dtype=args.dtype, device="cpu",
              kv_cache_memory=wargs.kv_cache_gib << 30, max_num_seqs=wargs.max_num_seqs,
              max_num_batched_tokens=wargs.max_num_batched_tokens, block_size=wargs.block_size,
              enable_prefix_caching=False, seed=wargs.seed, skip_tokenizer_init=True)
    generate(llm, bench_throughput.make_warmup(wargs))
    plain = generate(llm, wl)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = generate(llm, wl)
    timer.on = True
    timed = generate(llm, wl)
    report = "\n".join(header_lines(f"Offline run, op by op ({args.dtype})", machine_info())[:-1] + [
        f"- workload: {bench_throughput.workload_line(wl, wargs)}",
        f"- elapsed: {plain:.2f} s plain, {profiled:.2f} s under the profiler, {timed:.2f} s with the GEMMs timed\n",
        "## Self CPU time per op (torch.profiler)\n", op_table(prof, profiled, args.rows),
        "\n## The GEMMs by output width and phase\n", gemm_table(timer), ""])
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
