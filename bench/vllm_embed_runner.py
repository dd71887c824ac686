"""Embeds a workload of token-id prompts with vLLM's CPU backend; started by bench_embeddings.py.

It runs under the vLLM venv's python, so it imports vllm and the standard library only. The model runs as an
embedding model (runner "pooling", convert "embed"), pooled as the workload says, normalized.

    V/bin/python bench/vllm_embed_runner.py --model DIR --workload W.json --out R.json

W.json: {"prompts": [[ids]], "warmup_prompts": [[ids]], "max_num_seqs": int, "max_num_batched_tokens": int,
         "seed": int, "dtype": str, "pooling_type": "LAST" | "MEAN" | "CLS", "enable_prefix_caching": bool}
R.json: {"embeddings": [[floats]], "elapsed_s": float, "load_s": float, "vllm_version": str}
Only llm.embed() of the workload is timed; loading and the warm-up are not.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.workload) as f:
        wl = json.load(f)

    import vllm
    from vllm import LLM
    from vllm.config import PoolerConfig

    start = time.perf_counter()
    llm = LLM(model=args.model, runner="pooling", convert="embed", dtype=wl["dtype"], seed=wl["seed"],
              max_num_seqs=wl["max_num_seqs"], max_num_batched_tokens=wl["max_num_batched_tokens"],
              enable_prefix_caching=bool(wl.get("enable_prefix_caching", False)),
              pooler_config=PoolerConfig(pooling_type=wl["pooling_type"]))
    load_s = time.perf_counter() - start

    def embed(prompts: list[list[int]]) -> list[list[float]]:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        return [list(o.outputs.embedding) for o in outs]

    if wl.get("warmup_prompts"):
        embed(wl["warmup_prompts"])
    start = time.perf_counter()
    vectors = embed(wl["prompts"])
    elapsed = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump({"embeddings": vectors, "elapsed_s": elapsed, "load_s": load_s, "vllm_version": vllm.__version__}, f)


if __name__ == "__main__":  # required: vLLM starts its engine core in a child process
    main()
