"""Where a decode step's time goes, host work against compute, with the engine core's IPC included.

48 sequences decode together (random-id prompts of 32 tokens, streamed
DELTA outputs as the server asks for them, sampling at temperature 0.8). A
step is taken apart into the phases `LLMEngine.step` runs, each timed:

    schedule   begin_step + Scheduler.schedule (block bookkeeping in C++)
    metadata   ModelRunner.build_batch + check_batch (the flat batch on the host)
    forward    block copies + the model's forward + the logits rows (compute)
    sampling   the sampler on the logits (compute) / its per-row parameters (host)
    update     Scheduler.update_from_output + the engine's outputs
    ipc core   the outputs as wire structs + msgpack encoding (the core's side)
    ipc front  msgpack decoding + the front end's detokenization and outputs (the front end's side, which
               runs in the other process, beside the core's next step)

Host work = schedule + metadata + sampling parameters + update + ipc core
(the core's critical path); the issue's target is under 5% of the step.
`--structured REGEX` adds, per dtype, a column where every sequence is
constrained to that regex (structured outputs), measured in the same run:
the sampler then also fills and applies each row's grammar mask (in
"sampling") and the update feeds each matcher its token.
The front end's share is reported beside it: on a machine with a spare core
it overlaps the next step, on 2 cores it competes with it.

    python bench/bench_engine_core.py --out bench/results/engine_core_cpu.md --json bench/results/engine_core_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from pagedkv.config import EngineArgs
from pagedkv.core.sequence import OutputKind
from pagedkv.core.step_batch import BlockOps
from pagedkv.engine.core_messages import StepOutputs, WireStats, encoder, from_core_decoder
from pagedkv.engine.core_process import stats_to_wire, to_delta
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.output_processor import OutputProcessor, RequestState
from pagedkv.model.default_model import ensure_default_model
from pagedkv.model.loader import LoadedModel, load_tokenizer, resolve_model
from pagedkv.outputs import RequestMetrics
from pagedkv.sampling_params import SamplingParams
from pagedkv.structured_outputs import GrammarCompiler, StructuredOutputsParams

PHASES = ("schedule", "metadata", "forward", "sampling", "sampling params", "update", "ipc core", "ipc front")
HOST = ("schedule", "metadata", "sampling params", "update", "ipc core")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed_step(engine: LLMEngine, processor: OutputProcessor, t: dict[str, list[float]]) -> None:
    """One LLMEngine.step, phase by phase (the same calls in the same order), plus the IPC both sides do."""
    enc, dec = encoder(), from_core_decoder()
    runner, sched = engine.runner, engine.scheduler
    c0 = time.perf_counter()
    engine.block_manager.begin_step()
    out = sched.schedule()
    c1 = time.perf_counter()
    batch, rows, _ = runner.build_batch(out)
    runner.check_batch(batch)
    c2 = time.perf_counter()
    logits = runner.run_batch(BlockOps(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy), batch,
                              checked=True)
    c3 = time.perf_counter()
    params = runner.sampling_batch(rows)
    c4 = time.perf_counter()
    sampled = runner.sampler(logits, params)
    c5 = time.perf_counter()
    now = time.time()
    update = sched.update_from_output(out, rows, sampled, [None] * len(rows), now)
    outputs = engine._process_outputs(update, now)
    c6 = time.perf_counter()
    frame = enc.encode(StepOutputs([to_delta(o) for o in outputs], WireStats(stats_to_wire(engine.get_stats()))))
    c7 = time.perf_counter()
    processor.process(dec.decode(frame).outputs)
    c8 = time.perf_counter()
    for name, dt in zip(PHASES, (c1 - c0, c2 - c1, c3 - c2, c5 - c4, c4 - c3, c6 - c5, c7 - c6, c8 - c7),
                        strict=True):
        t[name].append(dt)


def run(dtype: str, args: argparse.Namespace, model_dir: Path, regex: str | None = None) -> dict:
    engine_args = EngineArgs(model=str(model_dir), device="cpu", dtype=dtype, kv_cache_memory=512 << 20,
                             max_num_seqs=args.num_seqs, max_model_len=1024, skip_tokenizer_init=True)
    engine = LLMEngine(engine_args, LoadedModel.load(engine_args, with_tokenizer=False))
    tokenizer = load_tokenizer(resolve_model(str(model_dir)))
    processor = OutputProcessor(tokenizer)
    gen = torch.Generator().manual_seed(0)
    steps = args.warmup_steps + args.steps
    constraint = {"regex": regex} if regex else None
    # The engine has no tokenizer here (as an engine core): its grammars come compiled, as from a front end.
    grammar = (GrammarCompiler(tokenizer, engine.model_config.vocab_size).compile(StructuredOutputsParams(**constraint))
               if constraint else None)
    for i in range(args.num_seqs):
        ids = torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()
        p = SamplingParams(temperature=args.temperature, max_tokens=steps + 4, ignore_eos=True, seed=i,
                           structured_outputs=constraint)
        engine.add_request(f"r{i}", ids, p, output_kind=OutputKind.DELTA, grammar=grammar)
        processor.add(RequestState(f"r{i}", None, ids, p, OutputKind.DELTA, RequestMetrics(time.time())))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        processor.process([to_delta(o) for o in engine.step()])
    t: dict[str, list[float]] = {name: [] for name in PHASES}
    for i in range(steps):
        timed_step(engine, processor, t)
        if i < args.warmup_steps:
            for v in t.values():
                v.clear()
    med = {name: 1e3 * statistics.median(v) for name, v in t.items()}
    step = sum(med[n] for n in PHASES if n != "ipc front")
    host = sum(med[n] for n in HOST)
    name = f"{dtype} + regex" if regex else dtype
    log(f"{name}: step {step:.1f} ms, host {host:.2f} ms ({100 * host / step:.2f}%)")
    return {"dtype": name, "phases_ms": med, "step_ms": step, "host_ms": host, "host_pct": 100 * host / step,
            "front_pct": 100 * med["ipc front"] / step, "threads": torch.get_num_threads()}


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    head = (f"Engine step breakdown: {args.num_seqs} sequences decoding (prompts {args.prompt_len} tokens, "
            f"temperature {args.temperature}, DELTA outputs"
            f"{f'; + regex: every sequence constrained to {args.structured!r}' if args.structured else ''}), "
            f"median of {args.steps} steps after "
            f"{args.warmup_steps}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.2f}, torch threads {rows[0]['threads']}.")
    lines = [head, "", "| phase (ms) | " + " | ".join(r["dtype"] for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for name in PHASES:
        kind = "host" if name in HOST else "front end" if name == "ipc front" else "compute"
        lines.append(f"| {name} ({kind}) | " + " | ".join(f"{r['phases_ms'][name]:.3f}" for r in rows) + " |")
    lines.append("| **step (core)** | " + " | ".join(f"{r['step_ms']:.1f}" for r in rows) + " |")
    lines.append("| **host work, % of the step** | " + " | ".join(f"{r['host_pct']:.2f}%" for r in rows) + " |")
    lines.append("| front end, % of the step | " + " | ".join(f"{r['front_pct']:.2f}%" for r in rows) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--num-seqs", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--structured", help="constrain every sequence to this regex (structured outputs)")
    p.add_argument("--out")
    p.add_argument("--json")
    args = p.parse_args(argv)
    model_dir = ensure_default_model()
    regexes = [None, args.structured] if args.structured else [None]
    rows = [run(d, args, model_dir, regex) for d in args.dtypes.split(",") for regex in regexes]
    report = markdown(rows, args)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
