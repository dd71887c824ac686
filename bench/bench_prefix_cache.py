"""Prefix caching through the real engine: a shared system prompt, caching off vs on, and the timestamp pitfall.

The design notes' scenario (64 requests, ~500-token shared system prompt, 1000 tokens of history each) scaled
to a 2-core CPU and the default model (SmolLM2-135M-Instruct, fp32):

  N requests (default 24), all submitted together; each prompt is
      the shared system prompt (S tokens, default 500: a real English system prompt, tokenized)
      + its own history (H seeded random token ids, default 64)
  and gets a short greedy answer (G tokens, default 16, ignore_eos).

Runs, each a fresh LLM on the same loaded weights, after an untimed 2-request warm-up:
  off        enable_prefix_caching=False
  on         enable_prefix_caching=True: the system prompt's blocks are computed once and shared
  timestamp  caching on, but the system prompt's first line is "Current time: <a per-request timestamp>":
             every block from the first one differs, the hit rate collapses; the engine's divergence
             diagnostic (pagedkv.core.prefix_diagnostics) should fire and name the token position
  vllm-off / vllm-on
             vLLM's CPU backend on the same token ids (bench/vllm_runner.py in its own venv, as in
             bench_throughput.py); skipped with a note when the venv is missing or --no-vllm

Reported: wall time of generate(), output and total tokens/s, speed-up vs off, peak KV blocks in use
(EngineStats.peak_used_gpu_blocks), prefix-cache hit rate (hit / queried prompt tokens), prompt tokens
actually computed, divergence warnings, and whether the greedy outputs are identical to the off run.
Timings on a shared machine move with its load: the 1/5/15-minute load averages are recorded.

Usage: python3 bench/bench_prefix_cache.py [--num-requests 24] [--no-vllm] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import random
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_common import header_lines, machine_info, markdown_table, write_results

GiB = 1 << 30
TARGET_SPEEDUP = 3.0  # the notes: 3.1x (850 -> 2600 tok/s)
TARGET_BLOCK_RATIO = 2.5  # the notes: 38 GB -> 15 GB of KV cache

# A realistic system prompt; repeated as needed and cut to exactly --system-tokens tokens.
SYSTEM_TEXT = (
    "You are the support assistant of a company that runs large language models in production for other "
    "businesses. Answer questions from engineers about deployment, capacity planning, latency, throughput and "
    "cost. Be precise and brief: prefer concrete numbers, commands and configuration values to adjectives. When "
    "a question is ambiguous, state the assumption you make before answering. Never invent benchmark results; "
    "if you do not know a figure, say how to measure it. Explain the memory used by the key-value cache in "
    "terms of layers, key-value heads, head dimension, data type and sequence length, and remind users that "
    "the cache grows with every generated token. Recommend paged memory management for the cache, continuous "
    "batching for throughput, and prefix caching when many requests share a long system prompt. Warn that "
    "prefix caching only helps when the shared text is byte-for-byte identical at the start of every prompt, "
    "so dynamic fields such as dates, request identifiers or user names belong after the shared part. When "
    "users report out-of-memory errors, ask for the model, the data type, the maximum model length, the GPU "
    "memory utilization setting and the number of concurrent sequences before suggesting a change. When they "
    "report high latency, ask whether it is the time to the first token or the time per output token that is "
    "too high, because the remedies differ: long prompts and large batches slow the first, memory bandwidth "
    "limits the second. Format answers as short paragraphs or numbered steps, and include the exact flag names "
    "of the serving engine. Do not discuss pricing, legal matters or other customers. ")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- workload ------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class PrefixWorkload:
    prompts: list[list[int]]
    output_len: int
    system_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return self.output_len * len(self.prompts)


def system_prompt_ids(tokenizer, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(SYSTEM_TEXT, add_special_tokens=False)
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def timestamp_line(i: int, seed: int) -> str:
    """A per-request first line, as a prompt template with `{now}` would give (requests a few seconds apart)."""
    t = datetime.datetime(2026, 11, 30, 12, 0, 0) + datetime.timedelta(seconds=37 * i + seed, milliseconds=113 * i)
    return f"Current time: {t.isoformat(sep=' ', timespec='milliseconds')} UTC\n"


def make_workloads(tokenizer, args: argparse.Namespace) -> tuple[PrefixWorkload, PrefixWorkload]:
    """(shared system prompt, same with a timestamp first line): the same histories in both."""
    rng = random.Random(args.seed)
    system = system_prompt_ids(tokenizer, args.system_tokens)
    histories = [[rng.randrange(100, 40000) for _ in range(args.history_tokens)] for _ in range(args.num_requests)]
    shared = [system + h for h in histories]
    stamped = [tokenizer.encode(timestamp_line(i, args.seed), add_special_tokens=False) + system + h
               for i, h in enumerate(histories)]
    return (PrefixWorkload(shared, args.output_tokens, args.system_tokens),
            PrefixWorkload(stamped, args.output_tokens, args.system_tokens))


# --- runs ------------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class RunResult:
    name: str
    token_ids: list[list[int]] | None = None
    elapsed_s: float | None = None
    peak_blocks: int | None = None
    num_blocks: int | None = None
    hit_rate: float | None = None
    prompt_tokens_computed: int | None = None
    divergence_warnings: int | None = None
    warnings_logged: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


class _Capture(logging.Handler):
    """Keeps the diagnostic's log lines, to quote them in the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_pagedkv(name: str, wl: PrefixWorkload, caching: bool, loaded, args: argparse.Namespace,
                kv_cache_dtype: str = "auto") -> RunResult:
    from pagedkv import LLM, SamplingParams

    llm = LLM(dtype="float32", device="cpu", kv_cache_memory=args.kv_cache_gib * GiB, block_size=args.block_size,
              enable_prefix_caching=caching, seed=args.seed, loaded_model=loaded, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=wl.output_len, ignore_eos=True)
    warm = [list(range(7000 + 50 * k, 7000 + 50 * k + 24)) for k in range(2)]  # shares nothing with the workload
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    before = llm.get_stats()
    capture = _Capture()
    diag_logger = logging.getLogger("pagedkv.core.prefix_diagnostics")
    diag_logger.addHandler(capture)
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        diag_logger.removeHandler(capture)
    s = llm.get_stats()
    queried, hits = s.prefix_cache_queries - before.prefix_cache_queries, s.prefix_cache_hits - before.prefix_cache_hits
    return RunResult(name, [list(o.outputs[0].token_ids) for o in outs], elapsed, s.peak_used_gpu_blocks,
                     s.num_gpu_blocks, hits / queried if caching and queried else None,
                     s.prompt_tokens - before.prompt_tokens,
                     s.prefix_divergence_warnings - before.prefix_divergence_warnings, capture.lines)


def run_vllm(name: str, wl: PrefixWorkload, caching: bool, model_dir: Path, args: argparse.Namespace) -> RunResult:
    """vLLM's CPU backend through bench_throughput's runner (its own venv, a subprocess)."""
    import bench_throughput as bt

    ns = argparse.Namespace(vllm_python=args.vllm_python, max_num_seqs=256, max_num_batched_tokens=2048,
                            seed=args.seed, kv_cache_gib=args.kv_cache_gib, vllm_omp_bind=args.vllm_omp_bind,
                            vllm_ld_preload="", vllm_prefix_caching=caching)
    warm = bt.Workload([list(range(7000, 7024)), list(range(7050, 7074))], [4, 4])
    r = bt.run_vllm(bt.Workload(wl.prompts, [wl.output_len] * len(wl.prompts)), warm, ns, model_dir)
    return RunResult(name, r.token_ids, r.elapsed_s, notes=r.notes, error=r.error)


# --- report ----------------------------------------------------------------------------------------------------

def identical(a: RunResult, b: RunResult) -> str:
    if a.token_ids is None or b.token_ids is None:
        return "—"
    return f"{sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True))}/{len(b.token_ids)}"


def rows_for(results: list[RunResult], wl: PrefixWorkload) -> list[dict]:
    base = {r.name.removesuffix("-off"): r for r in results if r.name.endswith("off") and r.elapsed_s}
    rows = []
    for r in results:
        ref = base.get("vllm") if r.name.startswith("vllm") else base.get("off")
        row = {"run": r.name, "error": r.error, "notes": r.notes, "peak_blocks": r.peak_blocks,
               "num_blocks": r.num_blocks, "hit_rate": r.hit_rate, "prompt_tokens_computed": r.prompt_tokens_computed,
               "divergence_warnings": r.divergence_warnings, "elapsed_s": r.elapsed_s}
        if r.elapsed_s:
            row.update(output_tok_s=wl.output_tokens / r.elapsed_s,
                       total_tok_s=(wl.prompt_tokens + wl.output_tokens) / r.elapsed_s,
                       speedup=ref.elapsed_s / r.elapsed_s if ref else None,
                       # the timestamp run's prompts differ from off's: nothing to compare
                       identical_to_off=identical(r, ref) if ref and r.name != "timestamp" else "—")
        if ref is not None and ref.peak_blocks and r.peak_blocks:
            row["block_ratio"] = ref.peak_blocks / r.peak_blocks
        rows.append(row)
    return rows


def fmt(v, spec: str, suffix: str = "") -> str:
    return "—" if v is None else format(v, spec) + suffix


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["error"]:
            out.append([r["run"]] + ["—"] * 9 + [r["error"]])
            continue
        hit = None if r["hit_rate"] is None else 100 * r["hit_rate"]
        out.append([r["run"], fmt(r["elapsed_s"], ".2f"), fmt(r.get("output_tok_s"), ".1f"),
                    fmt(r.get("total_tok_s"), ".0f"), fmt(r.get("speedup"), ".2f", "x"), fmt(r["peak_blocks"], "d"),
                    fmt(r.get("block_ratio"), ".2f", "x"), fmt(hit, ".1f", "%"), fmt(r["prompt_tokens_computed"], "d"),
                    fmt(r["divergence_warnings"], "d"), r.get("identical_to_off", "—") + (
                        "" if not r["notes"] else "; " + "; ".join(r["notes"]))])
    return markdown_table(["run", "elapsed s", "output tok/s", "total tok/s", "speed-up vs off", "peak KV blocks",
                           "fewer blocks vs off", "hit rate", "prompt tokens computed", "divergence warnings",
                           "identical to off; notes"], out)


def verdict(rows: list[dict]) -> list[str]:
    by = {r["run"]: r for r in rows}
    on, ts = by.get("on"), by.get("timestamp")
    lines = []
    if on and on.get("speedup"):
        lines.append(f"- caching on: {on['speedup']:.2f}x the throughput of off (target >= {TARGET_SPEEDUP}x: "
                     f"{'met' if on['speedup'] >= TARGET_SPEEDUP else 'MISSED'}), "
                     f"{on.get('block_ratio', 0):.2f}x fewer peak KV blocks (target >= {TARGET_BLOCK_RATIO}x: "
                     f"{'met' if on.get('block_ratio', 0) >= TARGET_BLOCK_RATIO else 'MISSED'}), "
                     f"outputs identical to off: {on.get('identical_to_off')}")
    if ts and ts.get("hit_rate") is not None and on:
        lines.append(f"- timestamp in the first line: hit rate {100 * on['hit_rate']:.1f}% -> "
                     f"{100 * ts['hit_rate']:.1f}%, {ts['divergence_warnings']} divergence warnings")
    vo = by.get("vllm-on")
    if vo and vo.get("speedup"):
        lines.append(f"- vLLM CPU: caching on {vo['speedup']:.2f}x its own off run")
    return lines


def plot(rows: list[dict], path: Path, note: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r["error"]]
    names = [r["run"] for r in ok]
    colors = ["#868e96" if n.endswith("off") else "#c92a2a" if n == "timestamp" else "#1971c2" for n in names]
    panels = [("output tok/s", [r.get("output_tok_s") or 0 for r in ok], "{:.1f}"),
              ("peak KV blocks in use", [r["peak_blocks"] or 0 for r in ok], "{:.0f}"),
              ("prefix-cache hit rate %", [100 * (r["hit_rate"] or 0) for r in ok], "{:.1f}")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (title, vals, f) in zip(axes, panels, strict=True):
        ax.bar(names, vals, color=colors)
        for x, v in enumerate(vals):
            ax.text(x, v, f.format(v) if v else "n/a", ha="center", va="bottom", fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle("\n".join(textwrap.wrap(note, 160)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import bench_throughput as bt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--history-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's CPU backend")
    p.add_argument("--vllm-python", default=bt.default_vllm_python())
    p.add_argument("--vllm-omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (see bench_throughput.py)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--kv-cache-dtypes", default="",
                   help="comma-separated quantized kv_cache_dtype values: each adds a caching-on run 'on[<dtype>]'")
    return p.parse_args(argv)


def workload_line(wl: PrefixWorkload, args: argparse.Namespace) -> str:
    return (f"{len(wl.prompts)} requests, each {args.system_tokens} shared system-prompt tokens + "
            f"{args.history_tokens} own history tokens (seed {args.seed}), {args.output_tokens} greedy output tokens "
            f"(ignore_eos); fp32, default model, block_size {args.block_size}, KV budget {args.kv_cache_gib} GiB; "
            f"{wl.prompt_tokens} prompt tokens in all")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from pagedkv.config import EngineArgs
    from pagedkv.model.default_model import ensure_default_model
    from pagedkv.model.loader import LoadedModel

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_default_model()
    loaded = LoadedModel.load(EngineArgs(model=str(model_dir), device="cpu", dtype="float32"))
    shared, stamped = make_workloads(loaded.tokenizer, args)
    log(f"workload: {workload_line(shared, args)}")
    runs = [("off", shared, False, "auto"), ("on", shared, True, "auto"), ("timestamp", stamped, True, "auto")]
    runs += [(f"on[{d}]", shared, True, d) for d in args.kv_cache_dtypes.split(",") if d.strip()]
    results = []
    for name, wl, caching, kv_dtype in runs:
        log(f"== {name}")
        results.append(run_pagedkv(name, wl, caching, loaded, args, kv_dtype))
        results[-1].notes.append(f"load {os.getloadavg()[0]:.2f} after")  # timings move with the box's load
        log(f"   {results[-1].elapsed_s:.2f} s")
    if not args.no_vllm:
        for name, caching in (("vllm-off", False), ("vllm-on", True)):
            log(f"== {name}")
            results.append(run_vllm(name, shared, caching, model_dir, args))
            results[-1].notes.append(f"load {os.getloadavg()[0]:.2f} after")
    rows = rows_for(results, shared)
    info = machine_info()
    tab, lines = table(rows), verdict(rows)
    diag = next((r.warnings_logged for r in results if r.warnings_logged), [])
    print(f"{tab}\n\n" + "\n".join(lines) + ("\n\ndiagnostic: " + diag[0] if diag else ""))
    md = header_lines("Prefix caching: shared system prompt, off vs on, and the timestamp pitfall "
                      "(bench/bench_prefix_cache.py)", info)
    md += [f"- workload: {workload_line(shared, args)}", f"- timestamp run's first line, e.g.: "
           f"`{timestamp_line(0, args.seed).strip()}`", "", tab, "", *lines, ""]
    if diag:
        md += ["The engine's diagnostic during the timestamp run (logged once per block of divergence):", "",
               f"> {diag[0]}", ""]
    out = Path(args.out_dir)
    write_results(out / "prefix_cache_cpu", "\n".join(md),
                  {"machine": info, "workload": workload_line(shared, args), "rows": rows,
                   "diagnostic_log": diag, "results": [asdict(r) | {"token_ids": None} for r in results],
                   "args": vars(args)})
    if not args.no_plot:
        plot(rows, out / "prefix_cache.png", f"{workload_line(shared, args)}; {info['date_utc']} UTC, load "
             f"{info['load_average_1m_5m_15m']}")


if __name__ == "__main__":
    main()
