"""Quantized KV caches on the CPU: how far each kv_cache_dtype moves the model's outputs, and what it buys.

Every row is one pagedkv `kv_cache_dtype` on the default model (SmolLM2-135M-Instruct), fp32 compute, measured
against pagedkv's own unquantized cache ("auto": fp32 K/V) in the same run:

  fidelity   teacher-forced next-token distributions over --num-tokens tokens of real English text
             (bench/data/python_reference.txt), cut into sequences of --seq-len tokens, each run as chunked
             prefill (--chunk tokens a step) through a paged cache: every chunk writes its K/V into the cache and
             attends to everything before it by reading the cache back, so later positions see the quantized
             K/V. Mean KL(p_auto || p_quant) and top-1 agreement over every position; perplexity of the text's
             next token (the last position of a sequence has none). The model is driven directly
             (load_model, one KVCache per layer from allocate_layer_cache, AttentionMetadata built here), the
             variants in lockstep, so the reference logits of a chunk are compared as soon as they exist.
  greedy     the 19 prompts of bench/data/prompts.txt, 32 greedy tokens each (ignore_eos), through
             pagedkv.LLM(kv_cache_dtype=...).generate: tokens (of 32) equal to the unquantized cache's output at
             the same position, and the common-prefix length, averaged over the prompts.
  vllm       the same prompts and metric on vLLM's CPU backend against its own unquantized cache, kv_cache_dtype
             auto / fp8_e4m3 / fp8_e5m2 at its default scales (1.0: the checkpoint has none), one subprocess
             per dtype under its venv (bench/vllm_runner.py, VLLM_CPU_KVCACHE_SPACE=4).
  capacity   bytes per token (K and V of every layer, the per-token-head scale planes included:
             pagedkv.kv_cache.KVCacheFormat.bytes_per_token_head) and blocks of --block-size tokens in a
             --kv-cache-gib budget, relative to the unquantized cache in fp32 and in bf16.

fp8 rows come twice: per-tensor scales 1.0 (vLLM's default), and calibrated as vLLM's calculate_kv_scales
does: per layer k_scale = amax|k| / 200, v_scale = amax|v| / 100 (its K_SCALE_CONSTANT / V_SCALE_CONSTANT).
In the fidelity run they come from the text's first chunk, read from the unquantized cache after that
chunk (the rotated keys and the values the layer cached); in the greedy run the engine computes them from its
first step (LLM(calculate_kv_scales=True)).

A dtype the installed kernels or engine do not take yet gets its error in the table; the others still run.
--vllm-from JSON takes vLLM's rows from an earlier run's JSON (same prompts and model), since they do not depend
on pagedkv.

Usage:
    python3 bench/bench_kv_fidelity.py --out bench/results/kv_fidelity_cpu
    python3 bench/bench_kv_fidelity.py --vllm-from bench/results/kv_fidelity_cpu.json \
        --out bench/results/kv_fidelity_cpu
    python3 bench/bench_kv_fidelity.py --parts fidelity --kv-cache-dtypes auto --num-tokens 1024 --seq-len 512
Stdout is the markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import header_lines, machine_info, markdown_table, write_results  # noqa: E402
from bench_throughput import (  # noqa: E402  (bench/ is on sys.path when a script runs)
    VLLM_RUNNER,
    VLLM_SETUP,
    common_prefix,
    default_vllm_python,
    stream_lines,
    vllm_bind,
    vllm_log_notes,
)

GiB = 1 << 30
DATA_DIR = Path(__file__).with_name("data")
TEXT_FILE = DATA_DIR / "python_reference.txt"
PROMPTS_FILE = DATA_DIR / "prompts.txt"
PARTS = ("fidelity", "greedy", "vllm")
PAGEDKV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "int4_per_token_head")
VLLM_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
# vLLM's calculate_kv_scales divisors (vllm/envs.py K_SCALE_CONSTANT, V_SCALE_CONSTANT): headroom below fp8's
# largest value for keys and values larger than the calibration batch's.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
SCALE_ONE, SCALE_CALIBRATED = "1.0", "calibrated"


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags (vLLM CPU's fp8 KV cache needs AVX-512)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- what runs ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Variant:
    """One cache to compare: a kv_cache_dtype and, for fp8, where its per-tensor scales come from."""

    kv_cache_dtype: str
    scales: str = ""  # fp8 only: SCALE_ONE or SCALE_CALIBRATED

    @property
    def label(self) -> str:
        return f"{self.kv_cache_dtype} (scales {self.scales})" if self.scales else self.kv_cache_dtype


def variants(dtypes: list[str]) -> list[Variant]:
    """"auto" first (the reference), then each dtype; fp8 twice (scales 1.0 and calibrated)."""
    from pagedkv.kv_cache import kv_cache_format

    out = [Variant("auto")]
    for name in dict.fromkeys(kv_cache_format(d).name for d in dtypes):  # "fp8" is fp8_e4m3: run it once
        if name == "auto":
            continue
        if kv_cache_format(name).is_fp8:
            out += [Variant(name, SCALE_ONE), Variant(name, SCALE_CALIBRATED)]
        else:
            out.append(Variant(name))
    return out


# --- data -----------------------------------------------------------------------------------------------------

def text_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first num_tokens tokens of the shipped text (no special tokens: it is a document, not a chat)."""
    ids = tokenizer(TEXT_FILE.read_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise SystemExit(f"{TEXT_FILE} has {len(ids)} tokens, fewer than --num-tokens {num_tokens}")
    return ids[:num_tokens]


def prompt_token_ids(tokenizer) -> list[list[int]]:
    """bench/data/prompts.txt: one prompt per paragraph (blank-line separated)."""
    paragraphs = [p.strip() for p in PROMPTS_FILE.read_text().split("\n\n") if p.strip()]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in paragraphs]


# --- teacher-forced fidelity ------------------------------------------------------------------------------------

class PagedSequence:
    """One sequence at a time in its own paged cache: a KVCache per layer, blocks in a shuffled order."""

    def __init__(self, model, variant: Variant, max_len: int, block_size: int, seed: int) -> None:
        from pagedkv.kv_cache import allocate_layer_cache, kv_cache_format

        cfg, fmt = model.config, kv_cache_format(variant.kv_cache_dtype)
        num_blocks = -(-max_len // block_size)
        # Zeroed, not empty: runs stay deterministic even if a kernel read a slot before writing it.
        self.caches = [allocate_layer_cache(fmt, num_blocks, block_size, model.num_kv_heads, cfg.head_dim,
                                            torch.float32, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
                       for _ in range(cfg.num_hidden_layers)]
        # A shuffled block table: the sequence's K/V are scattered over the pool as the engine would place them.
        self.block_table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
        self.block_size, self.model, self.variant = block_size, model, variant

    def slots(self, start: int, n: int) -> torch.Tensor:
        """Cache slots (block * block_size + offset) of positions [start, start + n)."""
        pos = torch.arange(start, start + n)
        return self.block_table[pos // self.block_size].long() * self.block_size + pos % self.block_size

    def metadata(self, start: int, n: int):
        """A step holding one prefill chunk: positions [start, start + n) of a sequence with start cached."""
        from pagedkv.model.attention import AttentionMetadata

        seq_len = start + n
        width = -(-seq_len // self.block_size)
        return AttentionMetadata(
            num_decode_tokens=0, slot_mapping=self.slots(start, n),
            decode_block_tables=torch.zeros((0, width), dtype=torch.int32),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32), decode_max_seq_len=0,
            num_prefills=1, prefill_block_tables=self.block_table[:width].unsqueeze(0).contiguous(),
            prefill_seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32), prefill_max_query_len=n,
            prefill_max_seq_len=seq_len)

    @torch.inference_mode()
    def prefill(self, tokens: list[int], start: int) -> torch.Tensor:
        """Runs a chunk at positions [start, start + len(tokens)); float32 logits of every row."""
        n = len(tokens)
        hidden = self.model(torch.tensor(tokens, dtype=torch.int64), torch.arange(start, start + n),
                            self.caches, self.metadata(start, n))
        return self.model.compute_logits(hidden)

    def cached_amax(self, start: int, n: int) -> list[tuple[float, float]]:
        """Per layer (amax|k|, amax|v|) over the cached positions [start, start + n) (an unquantized cache)."""
        slots = self.slots(start, n)
        out = []
        for cache in self.caches:
            k, v = (t.flatten(0, 1)[slots] for t in cache)
            out.append((k.abs().max().item(), v.abs().max().item()))
        return out

    def set_fp8_scales(self, amax: list[tuple[float, float]]) -> None:
        """vLLM's calculate_kv_scales from per-layer amax: amax/200 for K, amax/100 for V (1.0 for all-zero)."""
        for cache, (k, v) in zip(self.caches, amax, strict=True):
            cache.k_scale.fill_(k / K_SCALE_CONSTANT if k > 0 else 1.0)
            cache.v_scale.fill_(v / V_SCALE_CONSTANT if v > 0 else 1.0)


@dataclass(slots=True)
class Fidelity:
    """Running sums of one variant's distance from the reference logits."""

    positions: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    top1_same: int = 0
    nll_sum: float = 0.0
    nll_positions: int = 0
    seconds: float = 0.0
    error: str | None = None

    def add(self, logp_ref: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> None:
        """logp_ref, logp: log-probabilities [n, vocab]; targets: the next token of the first len(targets) rows."""
        kl = F.kl_div(logp, logp_ref, log_target=True, reduction="none").sum(-1)  # KL(p_ref || p) per row
        self.positions += logp.shape[0]
        self.kl_sum += kl.sum().item()
        self.kl_max = max(self.kl_max, kl.max().item())
        self.top1_same += (logp.argmax(-1) == logp_ref.argmax(-1)).sum().item()
        self.add_nll(logp, targets)

    def add_nll(self, logp: torch.Tensor, targets: torch.Tensor) -> None:
        n = targets.shape[0]
        self.nll_sum -= logp[:n].gather(1, targets[:, None]).sum().item()
        self.nll_positions += n

    def summary(self) -> dict:
        if self.error:
            return {"error": self.error}
        n = max(self.positions, 1)
        return {"positions": self.positions, "mean_kl": self.kl_sum / n, "max_kl": self.kl_max,
                "top1_agreement": self.top1_same / n,
                "perplexity": math.exp(self.nll_sum / max(self.nll_positions, 1)), "seconds": self.seconds}


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def run_fidelity(model, ids: list[int], vs: list[Variant], args: argparse.Namespace) -> dict[Variant, dict]:
    """Every variant over the text, sequence by sequence and chunk by chunk, in lockstep with the reference."""
    seqs = [ids[i:i + args.seq_len] for i in range(0, len(ids), args.seq_len)]
    runs = {v: PagedSequence(model, v, args.seq_len, args.block_size, args.seed) for v in vs}
    stats = {v: Fidelity() for v in vs}
    ref = vs[0]
    for s, seq in enumerate(seqs):
        for start in range(0, len(seq), args.chunk):
            chunk = seq[start:start + args.chunk]
            targets = torch.tensor(seq[start + 1:start + args.chunk + 1], dtype=torch.int64)
            t0 = time.perf_counter()
            logp_ref = runs[ref].prefill(chunk, start).log_softmax(-1)
            stats[ref].seconds += time.perf_counter() - t0
            stats[ref].add(logp_ref, logp_ref, targets)  # KL 0, top-1 100%: its perplexity is the news
            if s == 0 and start == 0:  # calibrate from the text's first chunk, before any quantized write
                amax = runs[ref].cached_amax(0, len(chunk))
                for v in vs:
                    if v.scales == SCALE_CALIBRATED:
                        runs[v].set_fp8_scales(amax)
            for v in vs[1:]:
                step_variant(runs[v], stats[v], chunk, start, logp_ref, targets)
            log(f"   sequence {s + 1}/{len(seqs)}, positions {start}-{start + len(chunk) - 1}: "
                + ", ".join(f"{v.label} KL {stats[v].kl_sum / max(stats[v].positions, 1):.2e}"
                            for v in vs[1:] if not stats[v].error))
            del logp_ref
    return {v: stats[v].summary() for v in vs}


def step_variant(run: PagedSequence, stat: Fidelity, chunk: list[int], start: int, logp_ref: torch.Tensor,
                 targets: torch.Tensor) -> None:
    """One chunk of one quantized variant; its first failure (a dtype the kernels lack) ends that variant."""
    if stat.error:
        return
    try:
        t0 = time.perf_counter()
        logp = run.prefill(chunk, start).log_softmax(-1)
        stat.seconds += time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - one unsupported dtype must not lose the others' numbers
        stat.error = error_text(e)
        log(f"   {run.variant.label}: {stat.error}")
        return
    stat.add(logp_ref, logp, targets)


def fidelity_part(model_dir: Path, ids: list[int], vs: list[Variant], args: argparse.Namespace) -> dict:
    from pagedkv.model.loader import ModelSource, load_model

    log(f"== fidelity: {len(ids)} tokens in sequences of {args.seq_len}, chunks of {args.chunk}, "
        f"{len(vs)} caches: {', '.join(v.label for v in vs)}")
    model = load_model(ModelSource(model_dir), torch.float32, torch.device("cpu"), max_model_len=args.seq_len)
    try:
        return run_fidelity(model, ids, vs, args)
    finally:
        del model
        gc.collect()


# --- greedy agreement ---------------------------------------------------------------------------------------------

@dataclass(slots=True)
class GreedyRun:
    """One system's greedy outputs for one cache (None and an error if it could not run)."""

    token_ids: list[list[int]] | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float | None = None


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Mean tokens equal to the reference's at the same position, mean common prefix, identical outputs."""
    n = max(len(reference), 1)
    same = [sum(a == b for a, b in zip(o, r, strict=False)) for o, r in zip(outputs, reference, strict=True)]
    return {"mean_matching_tokens": sum(same) / n,
            "mean_common_prefix": sum(common_prefix(o, r) for o, r in zip(outputs, reference, strict=True)) / n,
            "identical": sum(o == r for o, r in zip(outputs, reference, strict=True)), "prompts": len(reference)}


def pagedkv_kwargs(v: Variant) -> dict:
    """LLM keyword arguments for a variant; a clear error if this pagedkv's engine does not take them yet."""
    from pagedkv.config import EngineArgs

    kwargs = {}
    if v.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = v.kv_cache_dtype
    if v.scales:  # fp8; the engine calibrates by default when the checkpoint has no scales: 1.0 must be asked for
        kwargs["calculate_kv_scales"] = v.scales == SCALE_CALIBRATED
    missing = sorted(set(kwargs) - {f.name for f in dataclasses.fields(EngineArgs)})
    if missing:
        raise RuntimeError(f"this pagedkv's EngineArgs has no {', '.join(missing)} yet (the engine side of "
                           "quantized KV caches has not landed)")
    return kwargs


def run_pagedkv_greedy(model_dir: Path, prompts: list[list[int]], v: Variant, args: argparse.Namespace) -> GreedyRun:
    from pagedkv import LLM, SamplingParams

    run = GreedyRun()
    try:
        kwargs = pagedkv_kwargs(v)
    except RuntimeError as e:  # an engine without the kwarg: say so, no traceback
        run.error = str(e)
        return run
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        with LLM(model=str(model_dir), dtype="float32", device="cpu", kv_cache_memory=args.kv_cache_gib * GiB,
                 block_size=args.block_size, seed=args.seed, skip_tokenizer_init=True, **kwargs) as llm:
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            run.seconds = time.perf_counter() - t0
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"pagedkv refused {len(errors)} requests: {errors[0]}")
        run.token_ids = [list(o.outputs[0].token_ids) for o in outs]
    except Exception as e:  # noqa: BLE001 - an unsupported dtype is a row's error, not the run's end
        traceback.print_exc(file=sys.stderr)
        run.error = error_text(e)
    finally:
        gc.collect()
    return run


def run_vllm_greedy(model_dir: Path, prompts: list[list[int]], kv_cache_dtype: str,
                    args: argparse.Namespace) -> GreedyRun:
    """vLLM's CPU backend in its venv (bench/vllm_runner.py), greedy, ignore_eos, fp32, this kv_cache_dtype."""
    python = args.vllm_python
    if not python or not Path(python).exists():
        return GreedyRun(error=f"skipped: no vLLM venv ({python or '$PAGEDKV_VLLM_PYTHON'}); create one with: "
                               f"{VLLM_SETUP}, then pass --vllm-python V/bin/python")
    with tempfile.TemporaryDirectory(prefix="pagedkv-kvq-") as tmp:
        workload, result = Path(tmp, "workload.json"), Path(tmp, "result.json")
        workload.write_text(json.dumps({
            "prompts": prompts, "output_lens": [args.max_tokens] * len(prompts), "warmup_prompts": [],
            "warmup_output_lens": [], "max_num_seqs": 256, "max_num_batched_tokens": 2048, "seed": args.seed,
            "dtype": "float32", "kv_cache_dtype": kv_cache_dtype}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=vllm_bind(args.vllm_omp_bind))
        cmd = [python, str(VLLM_RUNNER), "--model", str(model_dir), "--workload", str(workload), "--out", str(result)]
        log(f"== vllm kv_cache_dtype={kv_cache_dtype}: {' '.join(cmd)} (the cold start takes a minute or two)")
        rc, lines = stream_lines(cmd, env)
        if rc != 0 or not result.exists():
            tail = "".join(lines[-5:]).strip().replace("\n", " | ")
            return GreedyRun(error=f"vLLM runner failed (exit code {rc}): {tail[-300:]}")
        out = json.loads(result.read_text())
    notes = [f"vllm {out['vllm_version']}, torch {out['torch_version']}"] + vllm_log_notes(lines)
    return GreedyRun(token_ids=out["token_ids"], notes=notes, seconds=out["elapsed_s"])


def greedy_summary(runs: dict[str, GreedyRun], reference: str) -> dict[str, dict]:
    """Each run's agreement with the reference run of the same system (an error where either failed)."""
    ref = runs.get(reference)
    out = {}
    for key, run in runs.items():
        if run.error or ref is None or ref.error:
            out[key] = {"error": run.error or f"no reference: {ref.error if ref else 'not run'}"}
        else:
            out[key] = agreement(run.token_ids, ref.token_ids) | {"seconds": run.seconds, "notes": run.notes}
    return out


def vllm_part(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> tuple[dict, dict | None]:
    """vLLM's runs per kv_cache_dtype ("auto" first: the reference), and the machine info of the run that made
    them when they come from --vllm-from (None: this run)."""
    if args.vllm_from:
        return vllm_from_json(args.vllm_from, prompts, model_dir)
    if "vllm" not in args.parts:
        return {}, None
    dtypes = ["auto"] + [d for d in args.vllm_kv_cache_dtypes if d != "auto"]
    return {d: run_vllm_greedy(model_dir, prompts, d, args) for d in dtypes}, None


def vllm_from_json(path: str, prompts: list[list[int]], model_dir: Path) -> tuple[dict[str, GreedyRun], dict]:
    """vLLM's runs from an earlier --out JSON and the machine info of the run that made them; refused if its
    prompts or model differ from this run's."""
    data = json.loads(Path(path).read_text())
    if data.get("prompt_token_ids") != prompts or Path(data.get("model", "")).name != model_dir.name:
        raise SystemExit(f"{path} was run on other prompts or another model: rerun vLLM (--parts vllm)")
    machine = data.get("vllm_machine") or data["machine"] | {"command": " ".join(data["command"])}
    return {k: GreedyRun(**r) for k, r in data["vllm_runs"].items()}, machine


# --- capacity -------------------------------------------------------------------------------------------------------

def bytes_per_token(model_cfg, kv_cache_dtype: str, compute_dtype: torch.dtype) -> int:
    """K and V of every layer and kv head for one token, scale planes included (pagedkv's own sizing)."""
    from pagedkv.kv_cache import kv_cache_format

    per_head = kv_cache_format(kv_cache_dtype).bytes_per_token_head(model_cfg.head_dim, compute_dtype)
    return 2 * model_cfg.num_hidden_layers * model_cfg.num_key_value_heads * per_head


def capacity(model_cfg, kv_cache_dtype: str, args: argparse.Namespace) -> dict:
    """Blocks in the budget for this dtype (fp32 compute) and their ratio to the unquantized fp32 / bf16 cache."""
    def blocks(per_token: int) -> int:
        return args.kv_cache_gib * GiB // (per_token * args.block_size)

    per_token = bytes_per_token(model_cfg, kv_cache_dtype, torch.float32)
    n = blocks(per_token)
    return {"bytes_per_token": per_token, "blocks": n,
            "vs_fp32": n / blocks(bytes_per_token(model_cfg, "auto", torch.float32)),
            "vs_bf16": n / blocks(bytes_per_token(model_cfg, "auto", torch.bfloat16))}


# --- report ---------------------------------------------------------------------------------------------------------

def table_rows(vs: list[Variant], cap: dict, fid: dict, greedy: dict, vllm: dict, args) -> list[list]:
    """One row per variant: capacity, fidelity, pagedkv's greedy agreement and vLLM's for the same dtype."""
    rows = []
    for v in vs:
        c, f, g = cap[v.kv_cache_dtype], fid.get(v.label, {}), greedy.get(v.label, {})
        # vLLM runs fp8 at its default scales only: its numbers sit on the scales-1.0 rows.
        w = vllm.get(v.kv_cache_dtype, {}) if v.scales in ("", SCALE_ONE) else {}
        rows.append([v.kv_cache_dtype, v.scales or "—", c["bytes_per_token"], f"{c['blocks']:,}",
                     f"{c['vs_fp32']:.2f}x", f"{c['vs_bf16']:.2f}x"]
                    + fidelity_cells(f, v) + greedy_cells(g, args) + greedy_cells(w, args))
    return rows


def fidelity_cells(f: dict, v: Variant) -> list[str]:
    if not f:
        return ["—"] * 3
    if f.get("error"):
        return ["error (notes)", "—", "—"]
    if v.kv_cache_dtype == "auto":
        return ["(reference)", "(reference)", f"{f['perplexity']:.3f}"]
    return [f"{f['mean_kl']:.2e}", f"{100 * f['top1_agreement']:.2f}%", f"{f['perplexity']:.3f}"]


def greedy_cells(g: dict, args: argparse.Namespace) -> list[str]:
    if not g:
        return ["—", "—"]
    if g.get("error"):
        return ["error (notes)", "—"]
    return [f"{g['mean_matching_tokens']:.1f} / {args.max_tokens}", f"{g['mean_common_prefix']:.1f}"]


HEADER = ["kv_cache_dtype", "fp8 scales", "bytes / token", "blocks in budget", "vs fp32 cache", "vs bf16 cache",
          "mean KL(auto ‖ quant)", "top-1 agreement", "perplexity", "pagedkv greedy: matching tokens",
          "pagedkv: common prefix", "vLLM greedy: matching tokens", "vLLM: common prefix"]


def notes(args: argparse.Namespace, n_tokens: int, prompts: list[list[int]], vllm_runs: dict,
          paged_runs: dict, errors: dict[str, str]) -> list[str]:
    lines = [
        "Notes:",
        f"- fidelity: {n_tokens} tokens of {TEXT_FILE.name} (bench/data/README.md) in sequences of {args.seq_len}, "
        f"chunked prefill of {args.chunk} tokens a step through a paged cache (block {args.block_size}, shuffled "
        "block table); KL and top-1 over every position, perplexity over every position with a next token. "
        "Reference: the same model and kernels with kv_cache_dtype auto (fp32 K/V).",
        f"- greedy: {len(prompts)} prompts ({PROMPTS_FILE.name}, {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens), {args.max_tokens} tokens each (ignore_eos), all submitted together; "
        "matching tokens: positions where the output equals the same system's auto-cache output; common prefix: "
        "tokens equal from the start. vLLM's reference is vLLM's own auto cache.",
        "- fp8 scales: 1.0, or calibrated as vLLM's calculate_kv_scales (per layer amax|k| / 200, amax|v| / 100): "
        "from the text's first chunk in the fidelity run, from the engine's first step in pagedkv's greedy run "
        "(calculate_kv_scales=True). vLLM runs fp8 at its default scales (1.0) only.",
        f"- capacity: bytes / token = 2 x layers x kv heads x KVCacheFormat.bytes_per_token_head (per-token-head "
        f"formats: head_size codes + a 4-byte fp16 (scale, zero) pair); blocks of {args.block_size} tokens in "
        f"{args.kv_cache_gib} GiB; vs fp32 / bf16: blocks over the unquantized cache's in that compute dtype.",
    ]
    ref_paged, ref_vllm = paged_runs.get("auto"), vllm_runs.get("auto")
    if ref_paged and ref_vllm and not ref_paged.error and not ref_vllm.error:
        a = agreement(ref_paged.token_ids, ref_vllm.token_ids)
        lines.append(f"- the two unquantized references against each other: pagedkv auto vs vLLM auto "
                     f"{a['identical']}/{a['prompts']} identical, {a['mean_matching_tokens']:.1f} / "
                     f"{args.max_tokens} matching tokens")
    for key, run in vllm_runs.items():
        if run.notes:
            lines.append(f"- vLLM {key}: {'; '.join(run.notes)}")
    return lines + error_notes(errors)


def error_notes(errors: dict[str, str]) -> list[str]:
    """The table's errors, one line per message, naming the cells that got it."""
    by_message: dict[str, list[str]] = {}
    for where, message in errors.items():
        by_message.setdefault(message, []).append(where)
    return [f"- error in {', '.join(where)}: {message}" for message, where in by_message.items()]


def report(info: dict, args, vs, cap, fid, greedy, vllm, n_tokens, prompts, vllm_runs, paged_runs) -> str:
    title = "Quantized KV cache fidelity and capacity, default model, fp32 compute (bench/bench_kv_fidelity.py)"
    md = header_lines(title, info)
    md += [markdown_table(HEADER, table_rows(vs, cap, fid, greedy, vllm, args)), ""]
    errors = {f"{part} {key}": r["error"] for part, results in (("fidelity", fid), ("pagedkv greedy", greedy),
                                                                 ("vLLM greedy", vllm))
              for key, r in results.items() if r.get("error")}
    md += notes(args, n_tokens, prompts, vllm_runs, paged_runs, errors)
    return "\n".join(md) + "\n"


# --- main -----------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)}")
    p.add_argument("--kv-cache-dtypes", default=",".join(PAGEDKV_DTYPES), help="pagedkv dtypes to measure")
    p.add_argument("--vllm-kv-cache-dtypes", default=",".join(VLLM_DTYPES))
    p.add_argument("--num-tokens", type=int, default=4096, help="text tokens of the fidelity run")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence of the fidelity run")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens a step) of the fidelity run")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV budget (GiB) of the engines and the capacity "
                   "column (an integer: VLLM_CPU_KVCACHE_SPACE is one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="checkpoint folder (default: the default model)")
    p.add_argument("--vllm-python", default=default_vllm_python())
    p.add_argument("--vllm-omp-bind", default="all", help="VLLM_CPU_OMP_THREADS_BIND: 'all' (every usable CPU), "
                   "'auto' (vLLM's default) or a CPU list")
    p.add_argument("--vllm-from", metavar="JSON", help="take vLLM's runs from an earlier --out JSON instead")
    p.add_argument("--threads", type=int, help="torch threads for pagedkv (default: torch's own choice)")
    p.add_argument("--out", help="write STEM.md and STEM.json, e.g. bench/results/kv_fidelity_cpu")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if set(args.parts) - set(PARTS):
        p.error(f"unknown parts {sorted(set(args.parts) - set(PARTS))}; choose from {','.join(PARTS)}")
    args.kv_cache_dtypes = [s.strip() for s in args.kv_cache_dtypes.split(",") if s.strip()]
    # vLLM reads "fp8" as fp8_e4m3 too: one name per format, so its rows line up with pagedkv's.
    args.vllm_kv_cache_dtypes = list(dict.fromkeys("fp8_e4m3" if s.strip() == "fp8" else s.strip()
                                                   for s in args.vllm_kv_cache_dtypes.split(",") if s.strip()))
    if args.chunk <= 0 or args.seq_len <= 0 or args.num_tokens <= 0:
        p.error("--chunk, --seq-len and --num-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedkv.config import ModelConfig
    from pagedkv.model.default_model import ensure_default_model
    from transformers import AutoTokenizer

    info = machine_info()  # the load average before the run; the one after goes beside it
    model_dir = Path(args.model) if args.model else ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids, prompts = text_token_ids(tokenizer, args.num_tokens), prompt_token_ids(tokenizer)
    vs = variants(args.kv_cache_dtypes)
    model_cfg = ModelConfig.from_pretrained(model_dir)
    cap = {v.kv_cache_dtype: capacity(model_cfg, v.kv_cache_dtype, args) for v in vs}

    fid = {}
    if "fidelity" in args.parts:
        fid = {v.label: s for v, s in fidelity_part(model_dir, ids, vs, args).items()}
    paged_runs = {}
    if "greedy" in args.parts:
        for v in vs:
            log(f"== pagedkv greedy: {v.label}")
            paged_runs[v.label] = run_pagedkv_greedy(model_dir, prompts, v, args)
    vllm_runs, vllm_machine = vllm_part(model_dir, prompts, args)
    greedy, vllm = greedy_summary(paged_runs, "auto"), greedy_summary(vllm_runs, "auto")

    info |= {"avx512": "avx512f" in cpu_flags(), "load_average_after": [round(x, 2) for x in os.getloadavg()],
             "model": model_dir.name}
    md = report(info, args, vs, cap, fid, greedy, vllm, len(ids), prompts, vllm_runs, paged_runs)
    if vllm_machine:
        md += (f"- vLLM's rows come from an earlier run (`python3 {vllm_machine.get('command')}`, "
               f"{vllm_machine.get('date_utc')} UTC, load {vllm_machine.get('load_average_1m_5m_15m')})\n")
    print(md)
    if args.out:
        data = {"machine": info, "command": sys.argv, "model": str(model_dir), "args": vars(args),
                "capacity": cap, "fidelity": fid, "pagedkv_greedy": greedy, "vllm_greedy": vllm,
                "prompt_token_ids": prompts,
                "pagedkv_runs": {k: dataclasses.asdict(r) for k, r in paged_runs.items()},
                "vllm_runs": {k: dataclasses.asdict(r) for k, r in vllm_runs.items()},
                "vllm_machine": vllm_machine or (info | {"command": " ".join(sys.argv)} if vllm_runs else None)}
        write_results(args.out, md, data)
        log(f"wrote {args.out}.md and {args.out}.json")


if __name__ == "__main__":
    main()
