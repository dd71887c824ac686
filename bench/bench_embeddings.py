"""Embeddings offline: pagedkv's LLM.embed vs vLLM's CPU backend (runner "pooling") vs HF transformers, in one run.

    python3 bench/bench_embeddings.py [--num-prompts 256] [--min-tokens 16] [--max-tokens 512]
        [--pooling-type LAST] [--hf-batch-size 32] [--rounds 2] [--systems pagedkv,vllm,hf] [--out PATH]
        [--queries [--enable-prefix-caching]]

The workload: --num-prompts passages of real prose (the paragraphs of bench/data's text files, joined up to
--min-tokens..--max-tokens tokens of the default model's tokenizer; varied lengths, as a document index sees
them), embedded by the default model (SmolLM2-135M-Instruct, fp32) with --pooling-type pooling and L2
normalization. Each system gets every prompt in one call:

  pagedkv  LLM.embed: pooling requests in flat batches (no padding), long prompts in chunks of
           max_num_batched_tokens, the final norm only on the pooled rows
  vllm     vLLM CPU 0.32's LLM(runner="pooling", convert="embed").embed (bench/vllm_embed_runner.py), both
           cores (VLLM_CPU_OMP_THREADS_BIND=0,1), the same step budget
  hf       transformers' AutoModel as sentence-transformers runs it: prompts sorted by length, padded batches of
           --hf-batch-size, the pooled row read from the last real token (the fidelity reference too)

--queries embeds search queries instead, as retrieval models are asked to (Qwen3-Embedding, e5-mistral): every
prompt is the instruction QUERY_INSTRUCTION followed by a different sentence of the same prose (a short
query), so all prompts share a prefix; --enable-prefix-caching lets pagedkv and vLLM compute it once (LAST pooling reads
cached blocks; HF has no such cache).

Prompts/s and tokens/s over the wall time of that call (loading and a warm-up on the first prompts run first,
untimed); the best of --rounds interleaved rounds. Fidelity: each system's vectors against HF's, as the
smallest cosine similarity and the largest absolute difference over all prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import (
    add_side_by_side_args,
    header_lines,
    machine_info,
    markdown_table,
    publish,
    systems_to_run,
    vllm_malloc_env,
)
from bench_spec_decode import TEXT_FILES, error_message, paragraphs
from bench_throughput import default_vllm_python, stream_lines, vllm_bind

VLLM_RUNNER = Path(__file__).with_name("vllm_embed_runner.py")
QUERY_INSTRUCTION = ("Instruct: Given a question about Python, retrieve the passages of its documentation that "
                     "answer it\nQuery: ")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(tokenizer, num_prompts: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    """Token ids of consecutive paragraphs joined until each passage reaches a target length, the targets cycling
    through min_tokens .. max_tokens (geometrically), the paragraphs through bench/data's files."""
    paras = [p for path in TEXT_FILES for p in paragraphs(path)]
    targets = np.geomspace(min_tokens, max_tokens, 8).astype(int).tolist()
    prompts, at = [], 0
    while len(prompts) < num_prompts:
        target, ids = targets[len(prompts) % len(targets)], []
        while len(ids) < target:
            ids += tokenizer(paras[at % len(paras)] + "\n\n", add_special_tokens=True)["input_ids"]
            at += 1
        prompts.append(ids[:target])
    return prompts


def queries(tokenizer, num_prompts: int) -> list[list[int]]:
    """QUERY_INSTRUCTION + one sentence of bench/data prose (8 to 40 tokens), every query a different sentence (the
    sentences cycle only when there are fewer than num_prompts)."""
    prefix = tokenizer(QUERY_INSTRUCTION, add_special_tokens=True)["input_ids"]
    sentences = []
    for para in (p for path in TEXT_FILES for p in paragraphs(path)):
        for sentence in para.split(". "):
            ids = tokenizer(sentence.strip(), add_special_tokens=False)["input_ids"]
            if len(ids) >= 8:
                sentences.append(ids[:40])
    return [prefix + sentences[i % len(sentences)] for i in range(num_prompts)]


def run_pagedkv(prompts, args, model_dir: Path) -> tuple[float, np.ndarray]:
    from pagedkv import LLM

    with LLM(model=str(model_dir), dtype="float32", device="cpu", kv_cache_memory=args.kv_cache_gib << 30,
             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
             max_model_len=args.max_model_len, runner="pooling", pooler_config={"pooling_type": args.pooling_type},
             enable_prefix_caching=args.enable_prefix_caching, skip_tokenizer_init=True) as llm:
        llm.embed(prompts[:args.warmup], use_tqdm=False)
        start = time.perf_counter()
        outs = llm.embed(prompts, use_tqdm=False)
        elapsed = time.perf_counter() - start
    for o in outs:
        if o.error:
            raise RuntimeError(f"pagedkv refused {o.request_id}: {o.error}")
    return elapsed, np.array([o.outputs.embedding for o in outs], dtype=np.float32)


def run_vllm(prompts, args, model_dir: Path) -> tuple[float, np.ndarray]:
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as tmp:
        wl_file, out_file = Path(tmp, "workload.json"), Path(tmp, "result.json")
        wl_file.write_text(json.dumps({"prompts": prompts, "warmup_prompts": prompts[:args.warmup],
                                       "max_num_seqs": args.max_num_seqs,
                                       "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed,
                                       "dtype": "float32", "pooling_type": args.pooling_type,
                                       "enable_prefix_caching": args.enable_prefix_caching}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=vllm_bind(args.vllm_omp_bind))
        vllm_malloc_env(env, "tuned")
        rc, lines = stream_lines([args.vllm_python, str(VLLM_RUNNER), "--model", str(model_dir), "--workload",
                                  str(wl_file), "--out", str(out_file)], env)
        if not out_file.exists():
            raise RuntimeError(f"vLLM runner failed (exit code {rc}): {error_message(lines)}")
        if rc != 0:  # vLLM 0.32's CPU workers sometimes abort at shutdown, after the result was written
            log(f"  vLLM runner exited with code {rc} after writing its result")
        out = json.loads(out_file.read_text())
    return out["elapsed_s"], np.array(out["embeddings"], dtype=np.float32)


def hf_embed(model, prompts: list[list[int]], batch_size: int, pooling_type: str):
    """sentence-transformers' way: length-sorted padded batches, pooled over the attention mask, normalized."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out = [None] * len(prompts)
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, :len(prompts[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            lens = mask.sum(1)
            if pooling_type == "LAST":
                pooled = hidden[torch.arange(len(idx)), lens - 1]
            elif pooling_type == "CLS":
                pooled = hidden[:, 0]
            else:
                pooled = (hidden * mask[..., None]).sum(1) / lens[:, None]
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            for r, i in enumerate(idx):
                out[i] = pooled[r].numpy()
    return np.stack(out)


def run_hf(prompts, args, model_dir: Path) -> tuple[float, np.ndarray]:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf_embed(model, prompts[:args.warmup], args.hf_batch_size, args.pooling_type)
    start = time.perf_counter()
    vectors = hf_embed(model, prompts, args.hf_batch_size, args.pooling_type)
    return time.perf_counter() - start, vectors


def fidelity(vectors: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(smallest cosine similarity, largest absolute difference) of matching rows."""
    cos = (vectors * reference).sum(1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1))
    return float(cos.min()), float(np.abs(vectors - reference).max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--pooling-type", default="LAST", choices=["LAST", "MEAN", "CLS"])
    p.add_argument("--queries", action="store_true", help="short queries behind one shared instruction")
    p.add_argument("--enable-prefix-caching", action="store_true", help="pagedkv's and vLLM's")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=8)
    add_side_by_side_args(p, default_vllm_python())
    p.set_defaults(systems="pagedkv,vllm,hf")
    args = p.parse_args(argv)
    from pagedkv.model.default_model import ensure_default_model
    from transformers import AutoTokenizer

    model_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = (queries(tok, args.num_prompts) if args.queries
               else workload(tok, args.num_prompts, args.min_tokens, args.max_tokens))
    tokens = sum(len(x) for x in prompts)
    systems = systems_to_run(args.systems, args.vllm_python)
    runners = {"pagedkv": run_pagedkv, "vllm": run_vllm, "hf": run_hf}
    best: dict[str, float] = {}
    vectors: dict[str, np.ndarray] = {}
    for r in range(args.rounds):
        for system in systems[r % len(systems):] + systems[:r % len(systems)]:
            log(f"round {r + 1}: {system}")
            elapsed, vecs = runners[system](prompts, args, model_dir)
            log(f"  {len(prompts) / elapsed:.1f} prompts/s, {tokens / elapsed:.0f} tok/s in {elapsed:.2f} s, load "
                f"average {os.getloadavg()[0]:.2f}")
            best[system] = min(best.get(system, elapsed), elapsed)
            vectors[system] = vecs
    ref = vectors.get("hf")
    header = ["system", "prompts/s", "tokens/s", "time s", "x HF", "x vLLM", "min cosine vs HF", "max |diff| vs HF"]
    rows, data = [], {"prompts": len(prompts), "tokens": tokens, "systems": {}}
    for s in systems:
        cos, diff = fidelity(vectors[s], ref) if ref is not None else (None, None)
        rows.append([s, f"{len(prompts) / best[s]:.1f}", f"{tokens / best[s]:.0f}", f"{best[s]:.2f}",
                     f"{best['hf'] / best[s]:.2f}x" if "hf" in best else "—",
                     f"{best['vllm'] / best[s]:.2f}x" if "vllm" in best else "—",
                     f"{cos:.6f}" if cos is not None else "—", f"{diff:.2e}" if diff is not None else "—"])
        data["systems"][s] = {"elapsed_s": best[s], "min_cosine_vs_hf": cos, "max_abs_diff_vs_hf": diff}
    info = machine_info()
    lens = [len(x) for x in prompts]
    lines = header_lines("Embeddings offline (bench/bench_embeddings.py)", info)
    distinct = len(set(map(tuple, prompts)))
    what = (f"queries ({distinct} distinct: the shared instruction {QUERY_INSTRUCTION!r} + a sentence of "
            f"bench/data prose)"
            if args.queries else "passages of bench/data prose")
    lines += [f"{len(prompts)} {what}, {min(lens)}-{max(lens)} tokens (mean "
              f"{tokens / len(prompts):.0f}, {tokens} in all), the default model in fp32, {args.pooling_type} "
              f"pooling, normalized; pagedkv and vLLM with max_num_batched_tokens {args.max_num_batched_tokens}, "
              f"max_num_seqs {args.max_num_seqs}, prefix caching {'on' if args.enable_prefix_caching else 'off'}; "
              f"HF in length-sorted padded batches of {args.hf_batch_size}; "
              f"vLLM with VLLM_CPU_OMP_THREADS_BIND={vllm_bind(args.vllm_omp_bind)}; best of {args.rounds} "
              f"interleaved rounds.", "", markdown_table(header, rows)]
    publish(lines, args.out or args.json, data, info, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
