"""The prefix cache's tiers below the KV pool (host memory, disk): restart TTFT, reuse beyond the pool, and cost.

Three measurements on the default model (SmolLM2-135M-Instruct), all side by side in one run (the box is shared:
only the ratios within a run are meant to be compared), each run a fresh LLM on the same loaded weights:

1. restart   a shared system prompt (S tokens, default 2000, of CPython's Language Reference text in
             bench/data/) + a short user suffix, greedy, 16 tokens.
             cold      a fresh LLM, prefix caching on, no tiers: its first request's TTFT
                       (metrics.first_token_time - metrics.arrival_time)
             first     once: an LLM with kv_cache_dir (a fresh temp dir), the same request, shutdown() (flushes)
             restart   a NEW LLM on that kv_cache_dir: its first request (the system prompt + another suffix) ->
                       TTFT, the disk tier's hits, bytes read and load seconds; then the cold run's exact prompt,
                       whose token ids must equal the cold run's
             cold and restart alternate --restart-reps times (default 3); medians are reported. Every LLM gets
             an untimed 8-token warm-up request first (sharing nothing) so TTFT is the prefill, not first-call
             costs of a new engine.
2. reuse     C conversations (default 8), each starting with its own 512 tokens of the reference text; every
             turn appends the previous answer (16 greedy tokens, ignore_eos) and a new 48-token user message
             (more of the text); turns go round-robin, one request at a time, so each conversation's prefix is
             evicted from the pool before its next turn. The pool (kv_cache_memory) holds about 1/4 of the
             distinct prefix tokens; the host tier (kv_offloading_size) holds them all. The turns are built from
             the first system's answers (pagedkv, no tiers), so every system sees the same token ids.
             Systems: pagedkv without tiers, pagedkv with the host tier, and vLLM's CPU backend (prefix caching
             on, block size 32: its CPU attention refuses 16; kv_cache_memory_bytes = pagedkv's pool bytes) in its
             own venv (--vllm-python) as a subprocess running this file in --vllm-runner mode, with --vllm (~4 min).
3. cost      no reuse at all: N distinct prompts (default 16) of seeded random token ids (256 each), 64 greedy
             output tokens, one generate() call; prefix caching on in every run, the pool large enough that
             nothing is evicted; tiers off vs host tier vs host + disk tier (a fresh dir per run). Each runs
             --cost-reps times (default 5), interleaved; the median run of each is reported.

Threads: --threads 1 by default for pagedkv and (OMP_NUM_THREADS, no pinning) vLLM: on a shared 2-core box two
OpenMP threads beside another busy process run many times slower, and unevenly.

Usage: python3 bench/bench_kv_tiers.py [--quick] [--vllm] [--out bench/results/kv_tiers_cpu.md]
Stdout gets the markdown tables; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20
DATA = Path(__file__).with_name("data")
TARGET_RESTART_RATIO = 0.25  # TTFT after a restart <= 0.25x the cold TTFT
TARGET_COST = 0.03  # tiers on within 3% of tiers off when nothing is reused
WARM_PROMPT = list(range(7000, 7008))  # shares no block with the workloads
SUFFIX_1 = "\n\nQuestion: In one sentence, what is an object's identity?\nAnswer:"
SUFFIX_2 = "\n\nQuestion: What does the `is` operator compare?\nAnswer:"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- shared ------------------------------------------------------------------------------------------------------

def text_tokens(tokenizer) -> list[int]:
    """The benchmark text (bench/data: the Language Reference, then the prompts file), tokenized once."""
    text = (DATA / "python_reference.txt").read_text() + "\n\n" + (DATA / "prompts.txt").read_text()
    return tokenizer.encode(text, add_special_tokens=False)


def make_llm(loaded, args: argparse.Namespace, kv_cache_memory: int, **tiers):
    """Prefix caching on; max_model_len: what the pool holds, at most 4096 (the model's 8192 needs a bigger pool)."""
    from pagedkv import LLM
    return LLM(loaded_model=loaded, dtype=args.dtype, device="cpu", kv_cache_memory=kv_cache_memory,
               block_size=args.block_size, enable_prefix_caching=True, seed=args.seed,
               max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=max_model_len(kv_cache_memory, args), **tiers)


def max_model_len(kv_cache_memory: int, args) -> int:
    return min(4096, (kv_cache_memory // args.bytes_per_block - 2) * args.block_size)  # a block or so is reserved


def greedy(n: int):
    from pagedkv import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def warm_up(llm) -> None:
    llm.generate([{"prompt_token_ids": WARM_PROMPT}], greedy(2), use_tqdm=False)


def generate_one(llm, prompt: list[int], max_tokens: int):
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(max_tokens), use_tqdm=False)[0]
    if out.error:
        raise RuntimeError(f"pagedkv refused a request: {out.error}")
    return out


def ttft(out) -> float:
    return out.metrics.first_token_time - out.metrics.arrival_time


def delta(after, before, name: str):
    return getattr(after, name) - getattr(before, name)


def fmt(v, spec: str, suffix: str = "") -> str:
    return "—" if v is None else format(v, spec) + suffix


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


# --- 1. restart --------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class RestartRun:
    kind: str  # "cold", "first", "restart"
    init_s: float
    ttft_s: float
    ids_1: list[int]  # the output of system + SUFFIX_1
    ids_2: list[int] | None = None  # the output of system + SUFFIX_2
    stats: dict = field(default_factory=dict)
    shutdown_s: float = 0.0


TIER_FIELDS = ("tier_queries", "tier_hits_host", "tier_hits_disk", "kv_offloaded_blocks", "kv_restored_blocks_host",
               "kv_restored_blocks_disk", "kv_host_bytes_moved", "kv_disk_files_written", "kv_disk_bytes_written",
               "kv_disk_bytes_read", "kv_disk_load_seconds", "kv_disk_files_rejected", "kv_disk_write_errors",
               "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "num_preemptions")


def stats_delta(after, before) -> dict:
    return {k: delta(after, before, k) for k in TIER_FIELDS}


def restart_one(kind: str, loaded, args, pool: int, system: list[int], s1: list[int], s2: list[int],
                kv_dir: str | None) -> RestartRun:
    start = time.perf_counter()
    llm = make_llm(loaded, args, pool, **({"kv_cache_dir": kv_dir} if kv_dir else {}))
    init_s = time.perf_counter() - start
    warm_up(llm)
    before = llm.get_stats()
    first, second = (s2, s1) if kind == "restart" else (s1, s2)
    a = generate_one(llm, system + first, args.restart_output_tokens)  # the timed first request
    stats = stats_delta(llm.get_stats(), before)
    b = generate_one(llm, system + second, args.restart_output_tokens) if kind != "first" else None
    ids_a, ids_b = list(a.outputs[0].token_ids), None if b is None else list(b.outputs[0].token_ids)
    stats["num_cached_tokens"] = a.num_cached_tokens
    start = time.perf_counter()
    llm.shutdown()
    run = RestartRun(kind, init_s, ttft(a), ids_a if first is s1 else ids_b, ids_b if first is s1 else ids_a,
                     stats, time.perf_counter() - start)
    log(f"   {kind}: TTFT {1e3 * run.ttft_s:.0f} ms, LLM() {run.init_s:.2f} s, cached {a.num_cached_tokens}, "
        f"disk hits {stats['tier_hits_disk']}, files written {stats['kv_disk_files_written']}")
    return run


def measure_restart(loaded, tokens: list[int], args) -> dict:
    tok = loaded.tokenizer
    system = tokens[:args.system_tokens]
    s1, s2 = (tok.encode(s, add_special_tokens=False) for s in (SUFFIX_1, SUFFIX_2))
    pool = args.restart_pool_mib * MiB
    kv_dir = tempfile.mkdtemp(prefix="pagedkv-bench-kvdir-")
    try:
        log("== restart: first server (writes the disk tier)")
        first = restart_one("first", loaded, args, pool, system, s1, s2, kv_dir)
        cold, warm = [], []
        for rep in range(args.restart_reps):
            log(f"== restart: rep {rep + 1}/{args.restart_reps}")
            cold.append(restart_one("cold", loaded, args, pool, system, s1, s2, None))
            warm.append(restart_one("restart", loaded, args, pool, system, s1, s2, kv_dir))
        dir_bytes = sum(f.stat().st_size for f in Path(kv_dir).rglob("*") if f.is_file())
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
    return {"system": system, "s1": s1, "s2": s2, "first": first, "cold": cold, "restart": warm,
            "dir_bytes": dir_bytes, "pool": pool}


def restart_table(r: dict) -> tuple[str, list[str]]:
    from bench_common import markdown_table

    cold, warm, first = r["cold"], r["restart"], r["first"]
    rows = []
    for i, (c, w) in enumerate(zip(cold, warm, strict=True)):
        st = w.stats
        rows.append([f"rep {i + 1}", f"{1e3 * c.ttft_s:.0f}", f"{1e3 * w.ttft_s:.0f}", f"{w.ttft_s / c.ttft_s:.3f}x",
                     st["num_cached_tokens"], st["tier_hits_disk"], st["kv_restored_blocks_disk"],
                     f"{st['kv_disk_bytes_read'] / MiB:.1f}", f"{st['kv_disk_load_seconds']:.3f}",
                     st["kv_disk_files_rejected"], f"{c.init_s:.2f} / {w.init_s:.2f}",
                     "yes" if w.ids_1 == c.ids_1 else "NO", "yes" if w.ids_2 == c.ids_2 else "NO"])
    med_c, med_w = statistics.median(c.ttft_s for c in cold), statistics.median(w.ttft_s for w in warm)
    ratio = med_w / med_c
    same = all(w.ids_1 == cold[0].ids_1 and c.ids_1 == cold[0].ids_1 for c, w in zip(cold, warm, strict=True))
    same_2 = all(w.ids_2 == c.ids_2 for c, w in zip(cold, warm, strict=True))
    med = lambda k: statistics.median(w.stats[k] for w in warm)  # noqa: E731
    rows.append(["**median**", f"**{1e3 * med_c:.0f}**", f"**{1e3 * med_w:.0f}**", f"**{ratio:.3f}x**",
                 f"{med('num_cached_tokens'):.0f}", f"{med('tier_hits_disk'):.0f}",
                 f"{med('kv_restored_blocks_disk'):.0f}", f"{med('kv_disk_bytes_read') / MiB:.1f}",
                 f"{med('kv_disk_load_seconds'):.3f}", f"{med('kv_disk_files_rejected'):.0f}",
                 f"{statistics.median(c.init_s for c in cold):.2f} / {statistics.median(w.init_s for w in warm):.2f}",
                 "yes" if same else "NO", "yes" if same_2 else "NO"])
    tab = markdown_table(["run", "TTFT cold ms", "TTFT after restart ms", "restart / cold", "cached tokens",
                          "disk hit tokens", "blocks restored", "MiB read", "disk load s", "files rejected",
                          "LLM() s cold / restart", "identical output (same prompt)",
                          "identical output (other suffix)"], rows)
    fs = first.stats
    lines = [f"- restart TTFT {ratio:.3f}x the cold TTFT (median of {len(cold)}; target <= "
             f"{TARGET_RESTART_RATIO}x: {met(ratio <= TARGET_RESTART_RATIO)}); the restart's output of the cold "
             f"run's exact prompt identical to the cold run's token ids: {'yes' if same else 'NO'}",
             f"- first server (write-through): TTFT {1e3 * first.ttft_s:.0f} ms, {fs['kv_disk_files_written']} "
             f"files written by the end of its first request ({fs['kv_disk_bytes_written'] / MiB:.1f} MiB), "
             f"shutdown() (flush) {first.shutdown_s:.2f} s; its output identical to the cold run's: "
             f"{'yes' if first.ids_1 == cold[0].ids_1 else 'NO'}; the directory held "
             f"{r['dir_bytes'] / MiB:.1f} MiB at the end"]
    return tab, lines


# --- 2. reuse beyond the pool ------------------------------------------------------------------------------------

@dataclass(slots=True)
class ConvRun:
    name: str
    prompts: list[list[int]] | None = None  # in submission order
    token_ids: list[list[int]] | None = None
    elapsed_s: float | None = None
    cached_tokens: int | None = None  # sum of the requests' num_cached_tokens
    stats: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


def conv_sources(tokens: list[int], args) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's first prompt and its later user messages: distinct slices of the text (cycled)."""
    n, first, user = args.conversations, args.conv_first_tokens, args.conv_user_tokens
    pos = args.system_tokens  # after the restart's system prompt
    take = lambda k: [tokens[(pos + j) % len(tokens)] for j in range(k)]  # noqa: E731
    firsts = []
    for _ in range(n):
        firsts.append(take(first))
        pos += first
    users = []
    for _ in range(n):
        msgs = []
        for _ in range(args.conv_turns - 1):
            msgs.append(take(user))
            pos += user
        users.append(msgs)
    return firsts, users


def conv_sizes(args, bytes_per_block: int) -> dict:
    """Distinct prefix tokens (every conversation's last prompt and answer), the pool and the host tier."""
    last = args.conv_first_tokens + (args.conv_turns - 1) * (args.conv_output_tokens + args.conv_user_tokens)
    distinct = args.conversations * (last + args.conv_output_tokens)
    bs = args.block_size
    pool_blocks = max(math.ceil(distinct * args.conv_pool_fraction / bs), math.ceil((last + 64) / bs) + 2)
    working_set = math.ceil(distinct / bs) * bytes_per_block
    host_gib = math.ceil(1.5 * working_set / GiB * 100) / 100
    return {"last_prompt": last, "distinct_tokens": distinct, "pool_blocks": pool_blocks,
            "pool_bytes": pool_blocks * bytes_per_block, "host_gib": host_gib, "working_set_bytes": working_set}


def run_conversations(name: str, loaded, args, sizes: dict, firsts, users, replay: list[list[int]] | None,
                      **tiers) -> ConvRun:
    llm = make_llm(loaded, args, sizes["pool_bytes"], **tiers)
    warm_up(llm)
    before = llm.get_stats()
    run = ConvRun(name, [], [], cached_tokens=0)
    convs = [list(f) for f in firsts]
    start = time.perf_counter()
    for t in range(args.conv_turns):
        for c in range(args.conversations):
            prompt = replay[len(run.prompts)] if replay else convs[c]
            out = generate_one(llm, prompt, args.conv_output_tokens)
            ids = list(out.outputs[0].token_ids)
            run.prompts.append(prompt)
            run.token_ids.append(ids)
            run.cached_tokens += out.num_cached_tokens
            if not replay and t + 1 < args.conv_turns:
                convs[c] = prompt + ids + users[c][t]
    run.elapsed_s = time.perf_counter() - start
    after = llm.get_stats()
    run.stats = stats_delta(after, before) | {"num_gpu_blocks": after.num_gpu_blocks}
    llm.shutdown()
    log(f"   {name}: {run.elapsed_s:.1f} s, cached {run.cached_tokens} tokens, computed {run.stats['prompt_tokens']}")
    return run


def vllm_conversations(prompts: list[list[int]], args, sizes: dict, model_dir: Path) -> ConvRun:
    """The same requests, one at a time, on vLLM's CPU backend: this file under the vLLM venv's python."""
    import bench_throughput as bt

    run = ConvRun("vllm (no tiers)")
    python = args.vllm_python
    if not python or not Path(python).exists():
        run.error = f"skipped: no vLLM venv at {python or bt.DEFAULT_VLLM_PYTHON} (see bench_throughput.py)"
        return run
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as tmp:
        wl_file, out_file = Path(tmp, "workload.json"), Path(tmp, "result.json")
        wl_file.write_text(json.dumps({
            "prompts": prompts, "max_tokens": args.conv_output_tokens, "warmup_prompt": WARM_PROMPT,
            "seed": args.seed, "dtype": args.dtype, "block_size": args.vllm_block_size,
            "kv_cache_memory_bytes": sizes["pool_bytes"], "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": max_model_len(sizes["pool_bytes"], args)}))
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=bt.vllm_bind(args.vllm_omp_bind))
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [python, str(Path(__file__).resolve()), "--vllm-runner", str(wl_file), str(out_file),
               "--model-dir", str(model_dir)]
        log(f"vllm: {' '.join(cmd)} (VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}; "
            "the cold start takes minutes)")
        start = time.perf_counter()
        rc, lines = bt.stream_lines(cmd, env)
        total_s = time.perf_counter() - start
        if rc != 0 or not out_file.exists():
            tail = "".join(lines[-5:]).strip().replace("\n", " | ")
            run.error = f"vLLM runner failed (exit code {rc}): {tail[-300:]}"
            return run
        out = json.loads(out_file.read_text())
    run.prompts, run.token_ids, run.elapsed_s = prompts, out["token_ids"], out["elapsed_s"]
    run.cached_tokens = sum(out["num_cached_tokens"])
    run.notes.append(f"vllm {out['vllm_version']}, torch {out['torch_version']}, "
                     f"VLLM_CPU_OMP_THREADS_BIND={args.vllm_omp_bind}, OMP_NUM_THREADS={args.threads or 'unset'}, "
                     f"block_size {out['block_size']}; "
                     f"load {out['load_s']:.0f} s, subprocess {total_s:.0f} s in all (untimed)")
    run.notes.extend(bt.vllm_log_notes(lines))
    return run


def vllm_runner(workload: str, out_path: str, model_dir: str) -> None:
    """--vllm-runner mode, under the vLLM venv's python: imports vllm and the standard library only."""
    with open(workload) as f:
        wl = json.load(f)
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=model_dir, dtype=wl["dtype"], seed=wl["seed"], max_num_seqs=256,
              max_num_batched_tokens=wl["max_num_batched_tokens"], enable_prefix_caching=True,
              block_size=wl["block_size"], kv_cache_memory_bytes=wl["kv_cache_memory_bytes"],
              max_model_len=wl["max_model_len"])
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=wl["max_tokens"], ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": wl["warmup_prompt"]}], params, use_tqdm=False)
    token_ids, cached = [], []
    start = time.perf_counter()
    for p in wl["prompts"]:
        o = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        token_ids.append(list(o.outputs[0].token_ids))
        cached.append(o.num_cached_tokens or 0)
    elapsed = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump({"token_ids": token_ids, "num_cached_tokens": cached, "elapsed_s": elapsed, "load_s": load_s,
                   "vllm_version": vllm.__version__, "torch_version": torch.__version__,
                   "block_size": wl["block_size"]}, f)


def reuse_table(runs: list[ConvRun], args, sizes: dict) -> tuple[str, list[str]]:
    from bench_common import markdown_table

    base = runs[0]
    prompt_tokens = sum(len(p) for p in base.prompts)
    output_tokens = len(base.prompts) * args.conv_output_tokens
    vbase = None
    rows = []
    for r in runs:
        if r.error:
            rows.append([r.name] + ["—"] * 10 + [r.error])
            continue
        st = r.stats
        is_vllm = r.name.startswith("vllm")
        tier_hits = st.get("tier_hits_host", 0) + st.get("tier_hits_disk", 0)
        hit_rate = (st["prefix_cache_hits"] + tier_hits) / st["prefix_cache_queries"] if st else None
        computed = st["prompt_tokens"] if st else prompt_tokens - r.cached_tokens
        if is_vllm:
            vbase = r
        same = sum(a == b for a, b in zip(r.token_ids, base.token_ids, strict=True))
        rows.append([r.name, f"{r.elapsed_s:.1f}", f"{output_tokens / r.elapsed_s:.2f}",
                     f"{(prompt_tokens + output_tokens) / r.elapsed_s:.0f}", f"{base.elapsed_s / r.elapsed_s:.2f}x",
                     fmt(None if hit_rate is None else 100 * hit_rate, ".1f", "%"),
                     f"{100 * r.cached_tokens / prompt_tokens:.1f}%", computed,
                     st.get("tier_hits_host", "—") if st else "—",
                     f"{st['kv_offloaded_blocks']} / {st['kv_restored_blocks_host']}" if st else "—",
                     f"{same}/{len(base.token_ids)}", "; ".join(r.notes)])
    tab = markdown_table(["system", "elapsed s", "output tok/s", "total tok/s", "throughput vs no tiers",
                          "hit rate (pool + tiers, stats)", "cached tokens / prompt tokens", "prompt tokens computed",
                          "host-tier hit tokens", "blocks offloaded / restored", "identical to no tiers", "notes"],
                         rows)
    by = {r.name: r for r in runs if not r.error}
    host = by.get("pagedkv + host tier")
    lines = []
    if host:
        lines.append(f"- host tier: {base.elapsed_s / host.elapsed_s:.2f}x the throughput of no tiers; prompt "
                     f"tokens computed {base.stats['prompt_tokens']} -> {host.stats['prompt_tokens']}; outputs "
                     f"identical: {sum(a == b for a, b in zip(host.token_ids, base.token_ids, strict=True))}/"
                     f"{len(base.token_ids)}")
    if vbase:
        lines.append(f"- vLLM CPU (no tiers) {vbase.elapsed_s:.1f} s vs pagedkv no tiers {base.elapsed_s:.1f} s "
                     f"({base.elapsed_s / vbase.elapsed_s:.2f}x)" + (
                         f", vs pagedkv + host tier {host.elapsed_s:.1f} s ({vbase.elapsed_s / host.elapsed_s:.2f}x "
                         "faster)" if host else ""))
    return tab, lines


# --- 3. cost when nothing is reused --------------------------------------------------------------------------------

@dataclass(slots=True)
class CostRun:
    name: str
    elapsed_s: float
    token_ids: list[list[int]]
    decode_step_ms: float
    stats: dict
    shutdown_s: float


def run_cost(name: str, loaded, args, prompts: list[list[int]], pool: int, host_gib: float | None,
             disk: bool) -> CostRun:
    kv_dir = tempfile.mkdtemp(prefix="pagedkv-bench-kvdir-") if disk else None
    tiers = {}
    if host_gib:
        tiers["kv_offloading_size"] = host_gib
    if kv_dir:
        tiers["kv_cache_dir"] = kv_dir
    try:
        llm = make_llm(loaded, args, pool, **tiers)
        warm_up(llm)
        before, counters = llm.get_stats(), llm.llm_engine.counters
        first_step = counters.num_steps
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(args.cost_output_tokens),
                            use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = list(counters.step_times)[-(counters.num_steps - first_step):]
        # decode steps: all but the prefill steps (the prompts take ceil(tokens / max_num_batched_tokens) steps)
        n_prefill = math.ceil(sum(len(p) for p in prompts) / args.max_num_batched_tokens)
        decode = steps[n_prefill:] or steps
        stats = stats_delta(llm.get_stats(), before)
        start = time.perf_counter()
        llm.shutdown()
        shutdown_s = time.perf_counter() - start
    finally:
        if kv_dir:
            shutil.rmtree(kv_dir, ignore_errors=True)
    for o in outs:
        if o.error:
            raise RuntimeError(f"pagedkv refused a request: {o.error}")
    run = CostRun(name, elapsed, [list(o.outputs[0].token_ids) for o in outs], 1e3 * statistics.median(decode),
                  stats, shutdown_s)
    log(f"   {name}: {elapsed:.2f} s, median decode step {run.decode_step_ms:.1f} ms")
    return run


def measure_cost(loaded, args, bytes_per_block: int) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.cost_prompt_tokens)] for _ in range(args.cost_requests)]
    per_seq = math.ceil((args.cost_prompt_tokens + args.cost_output_tokens) / args.block_size)
    pool_blocks = 2 * per_seq * args.cost_requests + 16
    pool = pool_blocks * bytes_per_block
    host_gib = math.ceil(1.5 * pool / GiB * 100) / 100
    configs = [("tiers off", None, False), ("host tier", host_gib, False), ("host + disk tiers", host_gib, True)]
    runs: dict[str, list[CostRun]] = {name: [] for name, _, _ in configs}
    for rep in range(args.cost_reps):
        log(f"== cost: rep {rep + 1}/{args.cost_reps}")
        for name, h, d in configs:
            runs[name].append(run_cost(name, loaded, args, prompts, pool, h, d))
    return {"runs": runs, "pool_blocks": pool_blocks, "host_gib": host_gib, "prompts": prompts}


def cost_table(c: dict, args) -> tuple[str, list[str]]:
    from bench_common import markdown_table

    runs = c["runs"]
    # The median run of each (by elapsed time): on 2 shared cores one run in several is slowed by the machine.
    best = {name: sorted(rs, key=lambda r: r.elapsed_s)[len(rs) // 2] for name, rs in runs.items()}
    off = best["tiers off"]
    out_tokens = args.cost_requests * args.cost_output_tokens
    rows, lines = [], []
    for name, b in best.items():
        st = b.stats
        same = sum(a == x for a, x in zip(b.token_ids, off.token_ids, strict=True))
        rows.append([name, f"{b.elapsed_s:.2f}", f"{out_tokens / b.elapsed_s:.1f}",
                     f"{off.elapsed_s / b.elapsed_s:.3f}x",
                     f"{b.decode_step_ms:.1f}", f"{off.decode_step_ms / b.decode_step_ms:.3f}x",
                     ", ".join(f"{r.elapsed_s:.2f}" for r in runs[name]),
                     f"{st['kv_offloaded_blocks']} / {st['kv_disk_files_written']}", f"{b.shutdown_s:.2f}",
                     f"{same}/{len(off.token_ids)}"])
        if name != "tiers off":
            ratio = off.elapsed_s / b.elapsed_s
            lines.append(f"- {name}: {ratio:.3f}x the throughput of tiers off ({100 * (ratio - 1):+.1f}%), decode "
                         f"step {off.decode_step_ms / b.decode_step_ms:.3f}x (target within {100 * TARGET_COST:.0f}%: "
                         f"{met(ratio >= 1 - TARGET_COST)})")
    tab = markdown_table(["tiers", "median elapsed s", "output tok/s", "throughput vs off", "median decode step ms",
                          "decode step speed vs off", "all runs s", "blocks offloaded / disk files written",
                          "shutdown() s", "identical to off"], rows)
    return tab, lines


# --- main --------------------------------------------------------------------------------------------------------

QUICK = {"system_tokens": 256, "restart_reps": 1, "conversations": 8, "conv_turns": 3, "conv_first_tokens": 96,
         "conv_user_tokens": 32, "conv_output_tokens": 8, "cost_requests": 4, "cost_prompt_tokens": 64,
         "cost_output_tokens": 16, "cost_reps": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, one rep, no vLLM unless --vllm (a smoke run)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype (the other CPU benches default to float32)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core box, 2 OpenMP threads beside another busy "
                        "process run many times slower; 0 = torch's choice); vLLM gets as many (OMP_NUM_THREADS)")
    p.add_argument("--skip", default="", help="comma-separated measurements to skip: restart,reuse,cost")
    g = p.add_argument_group("1. restart")
    g.add_argument("--system-tokens", type=int, default=2000)
    g.add_argument("--restart-output-tokens", type=int, default=16)
    g.add_argument("--restart-reps", type=int, default=3)
    g.add_argument("--restart-pool-mib", type=int, default=512, help="the pool of the restart runs (MiB)")
    g = p.add_argument_group("2. reuse beyond the pool")
    g.add_argument("--conversations", type=int, default=8)
    g.add_argument("--conv-turns", type=int, default=8)
    g.add_argument("--conv-first-tokens", type=int, default=512)
    g.add_argument("--conv-user-tokens", type=int, default=48)
    g.add_argument("--conv-output-tokens", type=int, default=16)
    g.add_argument("--conv-pool-fraction", type=float, default=0.25,
                   help="pool tokens / distinct prefix tokens of all conversations")
    g.add_argument("--vllm", action="store_true",
                   help="also run vLLM's CPU backend on the conversations (its cold start and the same requests: "
                        "about 4 minutes more)")
    g.add_argument("--vllm-block-size", type=int, default=32,
                   help="vLLM's block size (its CPU attention takes multiples of 32 only, so not pagedkv's 16)")
    g.add_argument("--vllm-python", default=None, help="the vLLM venv's python (default: bench_throughput's)")
    g.add_argument("--vllm-omp-bind", default="nobind",
                   help="VLLM_CPU_OMP_THREADS_BIND (default nobind: no pinning, OMP_NUM_THREADS=--threads, as "
                        "pagedkv; see bench_throughput.py for 'auto' and 'all')")
    g = p.add_argument_group("3. cost when nothing is reused")
    g.add_argument("--cost-requests", type=int, default=16)
    g.add_argument("--cost-prompt-tokens", type=int, default=256)
    g.add_argument("--cost-output-tokens", type=int, default=128)
    g.add_argument("--cost-reps", type=int, default=5)
    p.add_argument("--out", default=None, help="the markdown report (default: bench/results/kv_tiers_cpu.md; "
                   "none with --quick unless given)")
    p.add_argument("--vllm-runner", nargs=2, metavar=("WORKLOAD", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        defaults = {a.dest: a.default for a in p._actions}
        for k, v in QUICK.items():
            if getattr(args, k) == defaults[k]:
                setattr(args, k, v)
    if args.out is None and not args.quick:
        args.out = "bench/results/kv_tiers_cpu.md"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.vllm_runner:
        vllm_runner(*args.vllm_runner, args.model_dir)
        return
    t_start = time.perf_counter()
    import bench_throughput as bt
    import torch
    from bench_common import header_lines, machine_info
    from pagedkv.config import EngineArgs, ModelConfig
    from pagedkv.engine.memory_pool import kv_cache_spec
    from pagedkv.model.default_model import ensure_default_model
    from pagedkv.model.loader import LoadedModel

    if args.threads:
        torch.set_num_threads(args.threads)
    args.vllm_python = args.vllm_python or bt.default_vllm_python()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    model_dir = ensure_default_model()
    loaded = LoadedModel.load(EngineArgs(model=str(model_dir), device="cpu", dtype=args.dtype))
    tokens = text_tokens(loaded.tokenizer)
    bytes_per_block = kv_cache_spec(ModelConfig.from_pretrained(model_dir), loaded.dtype, args.block_size, 1,
                                    "auto").bytes_per_block
    args.bytes_per_block = bytes_per_block
    log(f"text: {len(tokens)} tokens; {bytes_per_block} bytes per KV block of {args.block_size} tokens")
    sections: list[tuple[str, list[str], str, list[str]]] = []  # (title, settings, table, verdict lines)

    if "restart" not in skip:
        r = measure_restart(loaded, tokens, args)
        tab, lines = restart_table(r)
        sections.append(("1. Restart: TTFT of a 2,000-token system prompt, cold vs from the disk tier", [
            f"system prompt: the first {args.system_tokens} tokens of bench/data/python_reference.txt, + a "
            f"{len(r['s1'])}-token question (cold and first server) / a {len(r['s2'])}-token other question (the "
            f"restart's first request; then the cold question, whose output is compared)",
            f"{args.restart_output_tokens} greedy tokens (ignore_eos); pool {args.restart_pool_mib} MiB; restart: "
            "kv_cache_dir (a fresh temp dir, written once by the first server, then shutdown()), no size limit, "
            "no host tier; cold: prefix caching on, no tiers",
            f"{args.restart_reps} reps, cold and restart interleaved, each a fresh LLM after an untimed 8-token "
            "warm-up request; TTFT = metrics.first_token_time - metrics.arrival_time of the first request"],
            tab, lines))

    if "reuse" not in skip:
        sizes = conv_sizes(args, bytes_per_block)
        firsts, users = conv_sources(tokens, args)
        log(f"== reuse: {sizes}")
        runs = [run_conversations("pagedkv (no tiers)", loaded, args, sizes, firsts, users, None)]
        runs.append(run_conversations("pagedkv + host tier", loaded, args, sizes, firsts, users, runs[0].prompts,
                                      kv_offloading_size=sizes["host_gib"]))
        n_req = len(runs[0].prompts)
        sections.append(("2. Reuse beyond the pool: multi-turn conversations, working set ~4x the pool", [
            f"{args.conversations} conversations x {args.conv_turns} turns = {n_req} requests, one at a time, "
            f"round-robin; first prompt {args.conv_first_tokens} tokens of the text (each its own), each later turn "
            f"+ the previous answer ({args.conv_output_tokens} greedy tokens, ignore_eos) + a "
            f"{args.conv_user_tokens}-token user message; last prompt {sizes['last_prompt']} tokens; "
            f"{sum(len(p) for p in runs[0].prompts)} prompt tokens in all",
            f"distinct prefix tokens {sizes['distinct_tokens']}; pool {sizes['pool_blocks']} blocks = "
            f"{sizes['pool_blocks'] * args.block_size} tokens ({sizes['pool_bytes'] / MiB:.1f} MiB; "
            f"{sizes['distinct_tokens'] / (sizes['pool_blocks'] * args.block_size):.2f}x smaller than the working "
            f"set); host tier kv_offloading_size={sizes['host_gib']} GiB (working set "
            f"{sizes['working_set_bytes'] / MiB:.0f} MiB)",
            "turns built from the first row's answers; every row gets the same token ids; hit rate (stats): "
            "(pool hits + tier hits) / prompt tokens looked up; vLLM: kv_cache_memory_bytes = the same pool bytes, "
            f"enable_prefix_caching, block_size {args.vllm_block_size} (vLLM CPU refuses 16), the same requests one "
            "at a time (its hit rate from num_cached_tokens)"],
            "REUSE", []))

    if "cost" not in skip:
        c = measure_cost(loaded, args, bytes_per_block)
        tab, lines = cost_table(c, args)
        sections.append(("3. Cost when nothing is reused: decode throughput, tiers off vs on", [
            f"{args.cost_requests} distinct prompts of {args.cost_prompt_tokens} seeded random token ids, "
            f"{args.cost_output_tokens} greedy output tokens each (ignore_eos), one generate() call; prefix caching "
            f"on in every run; pool {c['pool_blocks']} blocks (nothing evicted); host tier {c['host_gib']} GiB; "
            "disk tier: a fresh temp dir per run, written through, no size limit",
            f"{args.cost_reps} runs of each, interleaved, each a fresh LLM after an untimed warm-up; the median "
            "run (by elapsed time) is reported; decode step = the median engine step after the prefill steps; "
            "shutdown() (the disk flush) is outside the timed generate()"], tab, lines))

    if "reuse" not in skip:  # vLLM last: its cold start takes minutes, and a failure only costs its row
        if args.vllm:
            log("== reuse: vLLM")
            runs.append(vllm_conversations(runs[0].prompts, args, sizes, model_dir))
        tab, lines = reuse_table(runs, args, sizes)
        sections = [(t, st, tab, lines) if tb == "REUSE" else (t, st, tb, ln) for t, st, tb, ln in sections]
    runtime = time.perf_counter() - t_start
    info = machine_info()
    md = header_lines("Prefix-cache tiers below the KV pool: restart, reuse beyond the pool, cost "
                      "(bench/bench_kv_tiers.py)", info)
    md += [f"- dtype: {args.dtype} (compute and KV cache), default model ({model_dir.name}), block_size "
           f"{args.block_size}, max_num_batched_tokens {args.max_num_batched_tokens}, {bytes_per_block} bytes per "
           "KV block", f"- runtime of this run: {runtime:.0f} s", ""]
    for title, settings, tab, lines in sections:
        md += [f"## {title}", ""] + [f"- {s}" for s in settings] + ["", tab, ""] + lines + [""]
    text = "\n".join(md)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")


if __name__ == "__main__":  # required in --vllm-runner mode: vLLM starts its engine core in a child process
    main()
