"""Beam search on shared blocks: pagedkv's in-engine beam search vs vLLM's LLM.beam_search, and its KV blocks.

The prompts of bench/data/prompts.txt (19 paragraphs of the Python Language Reference, tokenized with the
default model's tokenizer, no special tokens), beam_width 4, max_tokens 16, fp32, the default model
(SmolLM2-135M-Instruct), prefix caching on in both engines (vLLM's default; pagedkv's beams share their blocks
either way):

  agreement  pagedkv's top beam (sequences[0].tokens, prompt included) vs vLLM CPU's, per prompt; for a
             mismatch, the two top beams' scores (cum_logprob / length ** length_penalty, vLLM's rule) and
             whether they are a near-tie (|difference| < --tie-tol, default 1e-3), with the common prefix
  time       wall time of one beam_search() call over all prompts, after an untimed warm-up call; pagedkv on
             torch threads --threads (default 2), vLLM with VLLM_CPU_OMP_THREADS_BIND over every usable core
             (bench/vllm_beam_runner.py in its own venv, as bench_throughput.py runs vLLM); ratio vLLM / pagedkv
  memory     pagedkv only, at engine level, one request (the longest prompt) per beam width (--memory-widths,
             default 2,4,8): after each engine.step() the live beams' block tables
             (engine.block_manager.get_block_table); "shared" counts the distinct physical blocks they hold,
             "unshared" the sum of their table lengths (the same beams if each had its own copy). Peaks of both
             over the run and their ratio
  picture    bench/results/beam_search_blocks.png: one prompt, beam width 4, step by step, the live beams'
             distinct blocks stacked by how many beams share each (4, 3, 2, 1), and the unshared sum

Timings on a shared 2-core machine move with its load: the load averages are recorded.

Usage: python3 bench/bench_beam_search.py [--quick] [--no-vllm] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_common import header_lines, machine_info, markdown_table, write_results

BENCH = Path(__file__).resolve().parent
DATA = BENCH / "data"
VLLM_BEAM_RUNNER = BENCH / "vllm_beam_runner.py"
GiB = 1 << 30


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompt_token_ids(tokenizer, limit: int | None) -> list[list[int]]:
    """bench/data/prompts.txt: one prompt per paragraph (blank-line separated), as bench_kv_fidelity.py."""
    paragraphs = [p.strip() for p in (DATA / "prompts.txt").read_text().split("\n\n") if p.strip()]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in paragraphs]
    return ids[:limit] if limit else ids


WARMUP = [list(range(7000, 7024)), list(range(7050, 7090))]  # shares nothing with the prompts


def score(tokens: list[int], cum_logprob: float, eos: int | None, length_penalty: float) -> float:
    """vLLM's sort key (and pagedkv.beam_search.beam_search_score): a final EOS does not count in the length."""
    n = len(tokens) - (1 if eos is not None and tokens and tokens[-1] == eos else 0)
    return cum_logprob / (max(n, 1) ** length_penalty)


# --- pagedkv ---------------------------------------------------------------------------------------------------

def make_llm(args, loaded):
    from pagedkv import LLM
    return LLM(dtype="float32", device="cpu", kv_cache_memory=args.kv_cache_gib * GiB, block_size=args.block_size,
               enable_prefix_caching=not args.no_prefix_caching, seed=args.seed, loaded_model=loaded)


def run_pagedkv(llm, prompts: list[list[int]], args) -> dict:
    from pagedkv.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                              length_penalty=args.length_penalty)
    start = time.perf_counter()
    llm.beam_search([{"prompt_token_ids": p} for p in WARMUP], params, use_tqdm=False)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "warmup_s": warmup_s,
            "outputs": [[{"tokens": list(s.tokens), "cum_logprob": float(s.cum_logprob), "text": s.text}
                         for s in o.sequences] for o in outs]}


def live_tables(engine, rid: str) -> list[list[int]]:
    req = engine.requests.get(rid)
    if req is None:
        return []
    tables = []
    for seq in req.seqs:
        if seq.is_finished or seq.seq_id not in engine.block_manager:
            continue
        tables.append([b for b in engine.block_manager.get_block_table(seq.seq_id) if b >= 0])
    return tables


def trace_blocks(llm, prompt: list[int], width: int, args, rid: str) -> list[dict]:
    """One beam search through engine.add_request / step(): per step, the live beams' block tables."""
    from pagedkv.beam_search import BeamSearchParams

    engine = llm.llm_engine
    engine.add_request(rid, {"prompt_token_ids": prompt},
                       BeamSearchParams(beam_width=width, max_tokens=args.max_tokens,
                                        length_penalty=args.length_penalty))
    steps = []
    n = 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
        tables = live_tables(engine, rid)
        counts = Counter(b for t in tables for b in t)
        steps.append({"step": n, "beams": len(tables), "shared": len(counts), "unshared": sum(map(len, tables)),
                      "used_gpu_blocks": engine.block_manager.num_used_gpu_blocks,
                      "by_sharers": dict(Counter(counts.values()))})
        if n > 10 * args.max_tokens + 100:
            raise RuntimeError(f"beam search {rid} still unfinished after {n} steps")
    return steps


def memory_rows(llm, prompt: list[int], args) -> list[dict]:
    rows = []
    for w in args.memory_widths:
        steps = trace_blocks(llm, prompt, w, args, f"mem-w{w}")
        peak_s = max((s["shared"] for s in steps), default=0)
        peak_u = max((s["unshared"] for s in steps), default=0)
        rows.append({"beam_width": w, "prompt_tokens": len(prompt), "steps": len(steps),
                     "max_live_beams": max((s["beams"] for s in steps), default=0), "peak_shared_blocks": peak_s,
                     "peak_unshared_blocks": peak_u, "ratio": peak_u / peak_s if peak_s else None,
                     "peak_used_gpu_blocks": max((s["used_gpu_blocks"] for s in steps), default=0),
                     "trace": steps})
        log(f"   width {w}: peak {peak_s} shared vs {peak_u} unshared blocks")
    return rows


# --- vLLM (subprocess) -------------------------------------------------------------------------------------------

def run_vllm(prompts: list[list[int]], model_dir: Path, args) -> dict:
    import bench_throughput as bt

    python = args.vllm_python
    if not python or not Path(python).exists():
        return {"error": f"skipped: no vLLM venv at {python or '$PAGEDKV_VLLM_PYTHON'}; create one with: "
                         f"{bt.VLLM_SETUP}, then pass --vllm-python V/bin/python"}
    with tempfile.TemporaryDirectory(prefix="pagedkv-beam-") as tmp:
        wl_file, out_file = Path(tmp, "workload.json"), Path(tmp, "result.json")
        wl_file.write_text(json.dumps({
            "prompts": prompts, "warmup_prompts": WARMUP, "beam_width": args.beam_width,
            "max_tokens": args.max_tokens, "length_penalty": args.length_penalty, "ignore_eos": False,
            "seed": args.seed, "enable_prefix_caching": not args.no_prefix_caching, "dtype": "float32",
            "block_size": args.vllm_block_size}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=bt.vllm_bind(args.vllm_omp_bind))
        cmd = [python, str(VLLM_BEAM_RUNNER), "--model", str(model_dir), "--workload", str(wl_file),
               "--out", str(out_file)]
        log(f"vllm: {' '.join(cmd)} (VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}, "
            f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}; the cold start takes a minute or two)")
        rc, lines = bt.stream_lines(cmd, env)
        if rc != 0 or not out_file.exists():
            tail = "".join(lines[-5:]).strip().replace("\n", " | ")
            return {"error": f"vLLM runner failed (exit code {rc}): {tail[-300:]}"}
        out = json.loads(out_file.read_text())
    out["notes"] = [f"vllm {out['vllm_version']}, torch {out['torch_version']}, block_size {out.get('block_size')}, "
                    f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}"] + bt.vllm_log_notes(lines)
    return out


# --- comparison ------------------------------------------------------------------------------------------------

def compare(prompts, ours: list[list[dict]], theirs: list[list[dict]], eos, args) -> list[dict]:
    rows = []
    for i, (p, a, b) in enumerate(zip(prompts, ours, theirs, strict=True)):
        ta, tb = a[0]["tokens"], b[0]["tokens"]
        sa = score(ta, a[0]["cum_logprob"], eos, args.length_penalty)
        sb = score(tb, b[0]["cum_logprob"], eos, args.length_penalty)
        common = next((k for k, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
        # where vLLM's top beam stands in pagedkv's list (1-based), if it is there at all
        rank = next((k + 1 for k, s in enumerate(a) if s["tokens"] == tb), None)
        rows.append({"prompt": i, "prompt_tokens": len(p), "identical": ta == tb, "pagedkv_score": sa,
                     "vllm_score": sb, "score_diff": sa - sb, "near_tie": abs(sa - sb) < args.tie_tol,
                     "common_generated_prefix": max(common - len(p), 0), "vllm_top_rank_in_pagedkv": rank,
                     "identical_all_beams": [s["tokens"] for s in a] == [s["tokens"] for s in b]})
    return rows


# --- picture ---------------------------------------------------------------------------------------------------

def plot(steps: list[dict], width: int, prompt_len: int, block_size: int, path: Path, note: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s in steps if s["beams"]]  # the last step finishes the request: no live beams left
    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    bottom = [0] * len(steps)
    cmap = plt.get_cmap("viridis")
    for k in range(width, 0, -1):
        vals = [s["by_sharers"].get(k, s["by_sharers"].get(str(k), 0)) for s in steps]
        ax.bar(x, vals, bottom=bottom, color=cmap((k - 1) / max(width - 1, 1)),
               label=f"shared by {k} beam{'s' if k > 1 else ''}", edgecolor="white", linewidth=0.3)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(x, [s["unshared"] for s in steps], "k--", marker=".", label="without sharing (sum of table lengths)")
    ax.set_xlabel("engine step (1 = prefill)")
    ax.set_ylabel("KV blocks held by the live beams")
    ax.set_title(f"Beam search on shared blocks: beam width {width}, {prompt_len}-token prompt, "
                 f"block_size {block_size}", fontsize=10)
    ax.set_ylim(0, 1.1 * max([s["unshared"] for s in steps] + [1]))
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.text(0.01, 0.01, note, fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- report ----------------------------------------------------------------------------------------------------

def fmt(v, spec: str, suffix: str = "") -> str:
    return "—" if v is None else format(v, spec) + suffix


def parse_args(argv=None) -> argparse.Namespace:
    import bench_throughput as bt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="6 prompts, memory widths 2,4")
    p.add_argument("--num-prompts", type=int, help="the first N prompts of bench/data/prompts.txt (default all)")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--memory-widths", default="2,4,8")
    p.add_argument("--picture-prompt", type=int, default=None,
                   help="index of the picture's prompt (default: the shortest with >= 6 blocks)")
    p.add_argument("--tie-tol", type=float, default=1e-3)
    p.add_argument("--block-size", type=int, default=16, help="pagedkv's block size")
    p.add_argument("--vllm-block-size", type=int, default=None,
                   help="vLLM's block size (a multiple of 32 on its CPU backend; default its own)")
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--no-prefix-caching", action="store_true", help="both engines without prefix caching")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="pagedkv's torch threads")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--vllm-python", default=bt.default_vllm_python())
    p.add_argument("--vllm-omp-bind", default="all", help="VLLM_CPU_OMP_THREADS_BIND ('all': every usable core)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="beam_search_cpu", help="results file name, without .md/.json")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts = args.num_prompts or 6
        args.memory_widths = "2,4"
    args.memory_widths = [int(w) for w in str(args.memory_widths).split(",") if w.strip()]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from pagedkv.config import EngineArgs
    from pagedkv.model.default_model import ensure_default_model
    from pagedkv.model.loader import LoadedModel

    torch.set_num_threads(args.threads)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    model_dir = ensure_default_model()
    loaded = LoadedModel.load(EngineArgs(model=str(model_dir), device="cpu", dtype="float32"))
    tok = loaded.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    prompts = prompt_token_ids(tok, args.num_prompts)
    lens = [len(p) for p in prompts]
    workload = (f"{len(prompts)} prompts of bench/data/prompts.txt ({min(lens)}-{max(lens)} tokens, "
                f"{sum(lens)} in all), beam_width {args.beam_width}, max_tokens {args.max_tokens}, "
                f"length_penalty {args.length_penalty}, EOS on (ignore_eos False), fp32, default model, "
                f"prefix caching {'off' if args.no_prefix_caching else 'on'} in both")
    log(f"workload: {workload}")

    llm = make_llm(args, loaded)
    log("== pagedkv beam_search")
    ours = run_pagedkv(llm, prompts, args)
    log(f"   {ours['elapsed_s']:.2f} s (warm-up {ours['warmup_s']:.2f} s)")
    load_after_pagedkv = os.getloadavg()[0]

    log("== pagedkv blocks per step")
    long_i = max(range(len(prompts)), key=lambda i: lens[i])
    mem = memory_rows(llm, prompts[long_i], args)
    pic_i = args.picture_prompt
    if pic_i is None:
        cand = [i for i in range(len(prompts)) if lens[i] >= 6 * args.block_size] or list(range(len(prompts)))
        pic_i = min(cand, key=lambda i: lens[i])
    pic_steps = trace_blocks(llm, prompts[pic_i], args.beam_width, args, "picture")
    llm.shutdown()
    del llm

    vllm = None
    if not args.no_vllm:
        log("== vllm beam_search")
        vllm = run_vllm(prompts, model_dir, args)
        if vllm.get("error"):
            log(f"   {vllm['error']}")
        else:
            log(f"   {vllm['elapsed_s']:.2f} s (warm-up {vllm['warmup_s']:.2f} s, load {vllm['load_s']:.1f} s)")
    load_after_vllm = os.getloadavg()[0]

    info = machine_info()
    info["load_average_at_start_1m_5m_15m"] = load_at_start
    md = header_lines("Beam search on shared blocks: pagedkv vs vLLM CPU (bench/bench_beam_search.py)", info)
    md += [f"- workload: {workload}", ""]

    # 1 + 2: agreement and time
    cmp_rows, summary = [], {"pagedkv_elapsed_s": ours["elapsed_s"]}
    md += ["## Top beam and time", ""]
    trow = [["pagedkv", fmt(ours["elapsed_s"], ".2f"), fmt(ours["warmup_s"], ".2f"),
             f"torch threads {args.threads}; load {load_after_pagedkv:.2f} after"]]
    if vllm and not vllm.get("error"):
        cmp_rows = compare(prompts, ours["outputs"], vllm["outputs"], eos, args)
        same = sum(r["identical"] for r in cmp_rows)
        mism = [r for r in cmp_rows if not r["identical"]]
        ties = sum(r["near_tie"] for r in mism)
        ratio = vllm["elapsed_s"] / ours["elapsed_s"]
        summary.update(vllm_elapsed_s=vllm["elapsed_s"], ratio_vllm_over_pagedkv=ratio, identical_top_beams=same,
                       prompts=len(cmp_rows), mismatches=len(mism), mismatches_near_tie=ties,
                       identical_all_beams=sum(r["identical_all_beams"] for r in cmp_rows))
        trow.append(["vllm", fmt(vllm["elapsed_s"], ".2f"), fmt(vllm["warmup_s"], ".2f"),
                     "; ".join(vllm["notes"] + [f"load {load_after_vllm:.2f} after"])])
        md += [markdown_table(["engine", "beam_search s", "warm-up s", "notes"], trow), "",
               f"- time ratio vLLM / pagedkv: **{ratio:.2f}x**",
               f"- identical top beams (sequences[0].tokens): **{same}/{len(cmp_rows)}**; mismatches: {len(mism)}, "
               f"of them near-ties (|score difference| < {args.tie_tol:g}): {ties}; all {args.beam_width} beams "
               f"identical and in the same order: {summary['identical_all_beams']}/{len(cmp_rows)}", ""]
        if mism:
            md += [markdown_table(
                ["prompt", "prompt tokens", "pagedkv score", "vLLM score", "difference", "near-tie",
                 "common generated tokens", "vLLM's top beam in pagedkv's list"],
                [[r["prompt"], r["prompt_tokens"], f"{r['pagedkv_score']:.6f}", f"{r['vllm_score']:.6f}",
                  f"{r['score_diff']:+.2e}", "yes" if r["near_tie"] else "NO", r["common_generated_prefix"],
                  fmt(r["vllm_top_rank_in_pagedkv"], "d")] for r in mism]), ""]
    else:
        md += [markdown_table(["engine", "beam_search s", "warm-up s", "notes"], trow), "",
               f"- vLLM: {vllm['error'] if vllm else 'not run (--no-vllm)'}", ""]

    # 3: memory
    md += ["## KV blocks: shared vs unshared (pagedkv, engine level)", "",
           f"Prompt {long_i} ({lens[long_i]} tokens, {-(-lens[long_i] // args.block_size)} blocks of "
           f"{args.block_size}), max_tokens {args.max_tokens}. After each `engine.step()`: shared = distinct physical "
           "blocks in the live beams' tables, unshared = the sum of their table lengths (what the same beams "
           "would hold each with its own copy, as a beam search that runs every beam as its own request without "
           "prefix caching would).", "",
           markdown_table(["beam width", "steps", "max live beams", "peak blocks shared", "peak blocks unshared",
                           "unshared / shared", "peak used GPU blocks (engine)"],
                          [[r["beam_width"], r["steps"], r["max_live_beams"], r["peak_shared_blocks"],
                            r["peak_unshared_blocks"], fmt(r["ratio"], ".2f", "x"), r["peak_used_gpu_blocks"]]
                           for r in mem]), ""]
    pic_note = (f"prompt {pic_i} of bench/data/prompts.txt; {info['date_utc']} UTC, {info['cpu']}, "
                f"load at start {load_at_start}")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    if not args.no_plot:
        plot(pic_steps, args.beam_width, lens[pic_i], args.block_size, Path(args.out_dir) / "beam_search_blocks.png",
             pic_note)
        md += [f"The picture (results/beam_search_blocks.png): prompt {pic_i} ({lens[pic_i]} tokens), beam width "
               f"{args.beam_width}; per step the "
               "live beams' distinct blocks stacked by how many beams share each, the dashed line the unshared "
               "sum.", ""]
    md += [f"Total run {time.perf_counter() - t0:.0f} s.", ""]
    out = Path(args.out_dir)
    write_results(out / args.name, "\n".join(md),
                  {"machine": info, "workload": workload, "summary": summary, "mismatches_detail": cmp_rows,
                   "pagedkv": ours, "vllm": vllm, "memory": mem,
                   "picture": {"prompt": pic_i, "prompt_tokens": lens[pic_i], "trace": pic_steps},
                   "args": vars(args)})
    print("\n".join(md))


if __name__ == "__main__":
    main()
