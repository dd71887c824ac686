"""Decode-step time of the default model with and without the fused per-layer ops.

48 sequences (prompts of 16-64 random token ids, greedy, ignore_eos) run through
LLMEngine; every step after the prompts' prefill is a 48-token decode step, and
its time comes from the engine's `counters.step_times`. The two settings
(`pagedkv.ops.set_fused_ops`) alternate step by step on one loaded model, so
load on a shared machine spreads evenly over both; the table gives each
setting's median and 10th percentile (the least disturbed steps).

    python bench/bench_fused_decode.py [--dtype float32|bfloat16] [--rounds 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess

import torch
from pagedkv import LLM, SamplingParams, ops
from pagedkv.config import EngineArgs
from pagedkv.model.loader import LoadedModel


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def decode_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[bool, list[float]]:
    """Runs the prompts with the fused ops on and off on alternate steps; decode step seconds per setting."""
    engine = llm.llm_engine
    step = engine.step
    samples: dict[bool, list[float]] = {False: [], True: []}
    count = 0

    def alternating_step():
        nonlocal count
        fused = count % 2 == 1
        previous = ops.set_fused_ops(fused)
        try:
            outputs = step()
        finally:
            ops.set_fused_ops(previous)
        if count >= 2:  # steps 0-1: the prefill of every prompt and the first decode after it
            samples[fused].append(engine.counters.step_times[-1])
        count += 1
        return outputs

    engine.step = alternating_step
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del engine.step
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3, help="generate calls (each alternates the setting per step)")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per sequence (decode steps per round + 1)")
    p.add_argument("--num-seqs", type=int, default=48)
    args = p.parse_args()
    engine_args = EngineArgs(dtype=args.dtype, device="cpu", kv_cache_memory=1 << 30, seed=0)
    loaded = LoadedModel.load(engine_args)
    llm = LLM(dtype=args.dtype, device="cpu", kv_cache_memory=1 << 30, loaded_model=loaded)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (int(torch.randint(16, 65, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(args.num_seqs)]
    decode_steps(llm, prompts, 4)  # warm-up
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for fused, times in decode_steps(llm, prompts, args.tokens).items():
            samples[fused] += times
    before, after = (statistics.median(samples[f]) * 1e3 for f in (False, True))
    print(f"- date_utc: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}")
    print(f"- cpu: {cpu_model()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}")
    print(f"- model: {loaded.name} ({args.dtype}), {args.num_seqs} sequences decoding, "
          f"{len(samples[True])} decode steps per setting, alternating step by step, over {args.rounds} runs\n")
    print("| setting | median decode step ms | p10 ms | p90 ms |")
    print("|---|---:|---:|---:|")
    for fused, name in ((False, "unfused (before)"), (True, "fused ops (after)")):
        q = statistics.quantiles(samples[fused], n=10)
        print(f"| {name} | {statistics.median(samples[fused]) * 1e3:.2f} | {q[0] * 1e3:.2f} | {q[-1] * 1e3:.2f} |")
    p10 = [statistics.quantiles(samples[f], n=10)[0] for f in (False, True)]
    print(f"\nspeedup (before / after): median {before / after:.3f}x, 10th percentile {p10[0] / p10[1]:.3f}x")
    llm.shutdown()


if __name__ == "__main__":
    main()
