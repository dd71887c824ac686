"""bf16 on the CPU: the attention kernels' bf16 dot products (avx512_bf16) and a 48-sequence decode step.

Two parts, each comparing fp32, bf16 on the AVX-512 kernels (the bf16 path before
vdpbf16ps: bf16 rows widened to fp32, FMAs) and bf16 on the avx512_bf16 kernels:

  kernels  paged decode attention (48 sequences x --contexts tokens) and paged
           prefill (4 prompts of 256 tokens) on the default model's heads (9 query /
           3 KV heads of 64, block 16); the contenders run interleaved rep after rep,
           a 96 MiB buffer read before every timed call (K/V from memory, not L3);
           each reports its fastest rep (the box is shared: a rep that lost its
           time slice measures the neighbours)
  step     the default model (SmolLM2-135M) decoding 48 sequences at once: the
           median engine step over the decode steps of LLM.generate (48 prompts of
           --prompt-len tokens, --decode-steps new tokens each, greedy); bf16 loads
           the model once and alternates the two kernel variants
           (ops.set_cpu_capability), fp32 loads it again

Usage:
    python3 bench/bench_bf16_cpu.py                  # both parts
    python3 bench/bench_bf16_cpu.py --part kernels --reps 15
Stdout is markdown; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, markdown_table  # noqa: E402
from pagedkv import ops, reference  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
# (name, dtype, kernel variant)
CONTENDERS = [("fp32", torch.float32, "avx512"), ("bf16 avx512", torch.bfloat16, "avx512"),
              ("bf16 avx512_bf16", torch.bfloat16, "avx512_bf16")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def flush_llc(buf: torch.Tensor) -> None:
    buf.sum()


def kernel_inputs(num_seqs: int, ctx: int, q_tokens: int, gen: torch.Generator, block_size: int = 16):
    heads, kv_heads, d = 9, 3, 64
    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = num_seqs * blocks_per_seq + 8
    table = torch.randperm(num_blocks, generator=gen)[: num_seqs * blocks_per_seq].view(num_seqs, -1).int()
    kc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    q = torch.randn(num_seqs * q_tokens, heads, d, generator=gen)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32)
    return q, kc, vc, table, lens


def run_kernels(args) -> str:
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(96 << 20, dtype=torch.uint8).view(torch.float32).fill_(1)
    rows = []
    cases = [("decode", 48, ctx, 1) for ctx in args.contexts] + [("prefill", 4, 256, 256)]
    for kind, num_seqs, ctx, q_tokens in cases:
        q32, kc32, vc32, table, lens = kernel_inputs(num_seqs, ctx, q_tokens, gen)
        scale = 64**-0.5
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * q_tokens
        calls = {}
        for name, dtype, variant in CONTENDERS:
            q, kc, vc = q32.to(dtype), kc32.to(dtype), vc32.to(dtype)
            out = torch.empty_like(q)
            if kind == "decode":
                args_ = (out, q, kc, vc, table, lens, scale, ctx)
                call = lambda a=args_: ops.paged_attention_v1(*a)  # noqa: E731
                expected = reference.paged_attention(q, kc, vc, table, lens, scale)
            else:
                args_ = (out, q, kc, vc, table, qsl, lens, scale, q_tokens, ctx)
                call = lambda a=args_: ops.paged_prefill_attention(*a)  # noqa: E731
                expected = reference.paged_prefill_attention(q, kc, vc, table, qsl, lens, scale)
            ops.set_cpu_capability(variant)
            call()
            err = (out.float() - expected.float()).abs().max().item()
            if err > TOL[dtype] * 4:
                raise RuntimeError(f"{kind} {name}: max |diff| {err} vs the reference")
            calls[name] = (call, variant, err)
        times = {name: [] for name in calls}
        with ops.index_checks(False):
            for _ in range(args.reps):
                for name, (call, variant, _) in calls.items():
                    ops.set_cpu_capability(variant)
                    flush_llc(flush)
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
        med = {name: min(t) * 1e3 for name, t in times.items()}
        label = f"{kind} {num_seqs} x {ctx}" + (f" ({q_tokens} new)" if kind == "prefill" else "")
        rows.append([label] + [f"{med[n]:.3f}" for n, _, _ in CONTENDERS]
                    + [f"{med['bf16 avx512'] / med['bf16 avx512_bf16']:.2f}x",
                       f"{med['fp32'] / med['bf16 avx512_bf16']:.2f}x",
                       f"{calls['bf16 avx512_bf16'][2]:.1e}"])
        log(f"kernels: {label} done")
    ops.set_cpu_capability("avx512_bf16")
    return markdown_table(["case (9/3 x 64 heads, block 16)", "fp32 ms", "bf16 avx512 ms", "bf16 avx512_bf16 ms",
                           "avx512_bf16 vs avx512 (bf16)", "bf16 avx512_bf16 vs fp32",
                           "max abs err vs reference (avx512_bf16)"], rows)


def run_steps(args) -> str:
    from pagedkv import LLM, SamplingParams
    from pagedkv.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()}
               for _ in range(48)]
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps, ignore_eos=True)
    results: dict[str, list[float]] = {}
    outputs = {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(model=str(model_dir), dtype=dtype, device="cpu", kv_cache_memory=1 << 30, max_num_seqs=48,
                  enable_prefix_caching=False, skip_tokenizer_init=True, seed=0)
        variants = ["avx512", "avx512_bf16"] * args.rounds if dtype == "bfloat16" else ["avx512"] * args.rounds
        with llm:
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
            for variant in variants:
                ops.set_cpu_capability(variant)
                counters = llm.llm_engine.counters
                before = counters.num_steps
                outs = llm.generate(prompts, params, use_tqdm=False)
                steps = list(counters.step_times)[-(counters.num_steps - before):]
                # The last decode_steps - 1 steps decode all 48 sequences (the first ones prefill).
                decode = steps[-(args.decode_steps - 1):]
                name = "fp32" if dtype == "float32" else f"bf16 {variant}"
                results.setdefault(name, []).append(statistics.median(decode) * 1e3)
                outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
                log(f"step: {name} {results[name][-1]:.1f} ms")
    ops.set_cpu_capability("avx512_bf16")
    med = {name: statistics.median(v) for name, v in results.items()}
    same = sum(a == b for a, b in zip(outputs["bf16 avx512"], outputs["bf16 avx512_bf16"], strict=True))
    same32 = sum(a == b for a, b in zip(outputs["fp32"], outputs["bf16 avx512_bf16"], strict=True))
    rows = [[name, f"{med[name]:.1f}", " / ".join(f"{x:.1f}" for x in results[name]),
             f"{med['fp32'] / med[name]:.2f}x", f"{48e3 / med[name]:.0f}"] for name in med]
    return (markdown_table(["48-sequence decode step", "median ms", "per round ms", "speed vs fp32", "tok/s"],
                           rows)
            + f"\n\nPrompts {args.prompt_len} tokens, {args.decode_steps} new tokens each (context "
            f"{args.prompt_len}-{args.prompt_len + args.decode_steps}); greedy outputs identical: bf16 avx512 vs "
            f"avx512_bf16 {same}/48, fp32 vs bf16 avx512_bf16 {same32}/48.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["kernels", "step", "all"], default="all")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2, help="step: generate runs per contender (alternated for bf16)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        ops.set_cpu_capability("avx512_bf16")
    except RuntimeError as e:
        sys.exit(f"this benchmark compares the avx512_bf16 kernels: {e}")
    print("\n".join(f"- {k}: {v}" for k, v in machine_info().items()) + "\n")
    if args.part in ("kernels", "all"):
        print(run_kernels(args) + "\n")
    if args.part in ("step", "all"):
        print(run_steps(args))
    print(f"\n- load average after: {[round(x, 2) for x in os.getloadavg()]}")


if __name__ == "__main__":
    main()
