"""Mixture-of-experts benchmark (CPU): `ops.fused_moe` vs the per-expert PyTorch loop HF runs.

Contenders, on the same hidden states, weights and routing (the router itself is not timed):
  fused       `torch.ops.pagedkv.fused_moe`: counting sort by expert, one gather, two grouped
              GEMMs (the loop over experts in C++, at::mm_out into preallocated slices), fp32 combine;
  hf_loop     HF's MixtralExperts / Qwen3MoeExperts forward, written out: one_hot mask, the hit
              experts from a nonzero(), per expert torch.where, index, two F.linear, scale, index_add_;
  fused+onednn the same op given each expert's weights prepacked for oneDNN
              (`torch.ops.mkldnn._reorder_linear_weight`; bf16 only where oneDNN has a bf16
              path): every expert with rows runs on oneDNN with them instead of at::mm;
  fused+pagedkv the same op on weights packed for pagedkv's own GEMM (`pack_linear_weight`,
              the kernel of the dense linear layers; every expert's product in one grouped
              call); FusedMoE.pack_for_cpu, the layer's default, packs for the one
              `cpu_linear.linear_kernel` picks on this CPU ("layer");
  packed_loop (--packed-loop) hf_loop with the packed per-expert weights;
  vllm        vLLM CPU's own fused MoE op (`cpu_fused_moe`, its "vec" grouped GEMMs on weights
              prepacked by `cpu_prepack_moe_weight`), on the same weights and routing, in the vLLM
              venv (--vllm-python, default /work/vllm-venv/bin/python when present) through
              bench/vllm_moe_runner.py: a process of its own, so timed after ours, not interleaved;
              both cores (VLLM_CPU_OMP_THREADS_BIND=all).
Shapes: Mixtral-like scaled down (H=1024, I=3584, E=8, top-2) and Qwen3-MoE-like (H=1024,
I=768, E=64 and 128, top-8), T in {1, 16, 64, 256}, float32 and bfloat16. The contenders of
a row run interleaved, rep after rep, each reporting its median (the box may be shared); every
timed call, vLLM's too, comes after a 96 MiB read that flushes the last-level cache, as a model's
layers find their experts in memory (a model's experts are far more than the cache holds).
Ratios > 1: the second contender is faster (hf_loop / fused; fused+onednn / fused+pagedkv; vllm /
the layer's packing). Every row checks each op form against hf_loop.

    python bench/bench_moe.py [--reps 5] [--packed-loop] [--vllm-python PY] [--out bench/results/moe_cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import header_lines, machine_info, markdown_table, write_results  # noqa: E402
from pagedkv import ops, reference  # noqa: E402
from pagedkv.model import cpu_linear  # noqa: E402

SHAPES = [("mixtral-like", 1024, 3584, 8, 2), ("qwen3-moe-like", 1024, 768, 64, 8),
          ("qwen3-moe-like", 1024, 768, 128, 8)]
TOKENS = [1, 16, 64, 256]


def hf_loop(hidden, w13, w2, topk_weights, topk_ids):
    """HF transformers 5's experts forward (MixtralExperts.forward), stacked weights."""
    out = torch.zeros_like(hidden)
    num_experts = w13.shape[0]
    with torch.no_grad():
        mask = F.one_hot(topk_ids, num_classes=num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        slot, token = torch.where(mask[e])
        gate, up = F.linear(hidden[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def packed_loop(packed13, packed2, hidden, topk_weights, topk_ids):
    """hf_loop with oneDNN-packed per-expert weights."""
    out = torch.zeros_like(hidden)
    mask = F.one_hot(topk_ids, num_classes=len(packed13)).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
        slot, token = torch.where(mask[e])
        gate_up = torch.ops.mkldnn._linear_pointwise(hidden[token], packed13[e], None, "none", [], "")
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.ops.mkldnn._linear_pointwise(F.silu(gate) * up, packed2[e], None, "none", [], "")
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(out.dtype))
    return out


# Read before every timed call, here and in vllm_moe_runner.py: a model's experts are far more
# than the last-level cache holds, so in a forward pass each layer finds its experts in memory.
FLUSH_BYTES = 96 << 20
_flush_buffer = torch.ones(FLUSH_BYTES // 4)


def time_interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each callable, run round-robin after one warm-up each, the LLC flushed before each call."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _flush_buffer.sum()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def vllm_times(vllm_python: str | None, w13, w2, cases: list[dict], reps: int) -> list[dict] | None:
    """vLLM's cpu_fused_moe on the same weights and cases (bench/vllm_moe_runner.py); None without its venv."""
    if not vllm_python or not Path(vllm_python).exists():
        return None
    with tempfile.TemporaryDirectory(prefix="pagedkv-moe-") as tmp:
        inputs, out = Path(tmp) / "in.pt", Path(tmp) / "out.json"
        torch.save({"w13": w13, "w2": w2, "cases": cases, "flush_bytes": FLUSH_BYTES}, inputs)
        env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "all"}
        runner = Path(__file__).resolve().parent / "vllm_moe_runner.py"
        proc = subprocess.run([vllm_python, str(runner), str(inputs), str(out), str(reps)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"vllm runner failed: {proc.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(out.read_text())["cases"]


def expert_packs(w13, w2, pack) -> tuple[list, list] | None:
    """Each expert's w13[e] and w2[e] packed by `pack`, or None where it cannot pack them."""
    try:
        return [pack(w) for w in w13], [pack(w) for w in w2]
    except RuntimeError:
        return None


def fmt_ratio(times: dict, slower: str, faster: str) -> str:
    return f"{times[slower] / times[faster]:.2f}x" if slower in times and faster in times else ""


def fmt_ms(times: dict, name: str) -> str:
    return f"{times[name] * 1e3:.2f}" if name in times else ""


def bench_shape(label, H, inter, E, K, dtype, reps, with_packed_loop, gen, vllm_python=None):
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter ** 0.5).to(dtype)
    packs = {"fused+onednn": expert_packs(w13, w2, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 1)),
             "fused+pagedkv": expert_packs(w13, w2, ops.pack_linear_weight)}
    layer = f"fused+{cpu_linear.linear_kernel(dtype)}"
    if packs[layer] is None:  # pack_for_cpu leaves such experts plain
        layer = "fused"
    rows, cases, layer_times = [], [], []
    for T in TOKENS:
        hidden = torch.randn(T, H, generator=gen).to(dtype)
        weights, ids = reference.moe_routing(torch.randn(T, E, generator=gen), K, renormalize=True)
        call = (hidden, weights, ids)  # bound now: the lambdas run within this iteration only
        fns = {"fused": lambda c=call: ops.fused_moe(c[0], w13, w2, c[1], c[2]),
               "hf_loop": lambda c=call: hf_loop(c[0], w13, w2, c[1], c[2])}
        for name, pack in packs.items():
            if pack is not None:
                fns[name] = lambda c=call, p=pack: ops.fused_moe(c[0], w13, w2, c[1], c[2], *p)
        if with_packed_loop and packs["fused+onednn"] is not None:
            fns["packed_loop"] = lambda c=call: packed_loop(*packs["fused+onednn"], *c)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        want = fns["hf_loop"]().float()
        ok = all(torch.allclose(fns[n]().float(), want, atol=tol, rtol=tol) for n in fns if n.startswith("fused"))
        cases.append({"hidden": hidden, "weights": weights, "ids": ids, "expected": want, "tol": tol})
        t = time_interleaved(fns, reps)
        layer_times.append(t[layer])
        row = [f"{label} E={E} top-{K}", str(dtype).removeprefix("torch."), T, fmt_ms(t, "hf_loop"),
               fmt_ms(t, "fused"), fmt_ms(t, "fused+onednn"), fmt_ms(t, "fused+pagedkv"), layer.removeprefix("fused+"),
               fmt_ratio(t, "hf_loop", "fused"), fmt_ratio(t, "hf_loop", layer),
               fmt_ratio(t, "fused+onednn", "fused+pagedkv")]
        if with_packed_loop:
            row += [fmt_ms(t, "packed_loop")]
        rows.append(row + ["ok" if ok else "MISMATCH"])
        print(" | ".join(map(str, row)), file=sys.stderr, flush=True)
    theirs = vllm_times(vllm_python, w13, w2, cases, reps)
    for row, case, case_times, layer_s in zip(rows, cases, theirs or [None] * len(rows), layer_times, strict=True):
        if case_times is None:
            row[-1:-1] = ["", ""]
            continue
        bound = case["tol"] * (1 + case["expected"].abs().max().item())
        mark = "" if case_times["max_abs_diff"] <= bound else " (diff)"
        row[-1:-1] = [f"{case_times['median_s'] * 1e3:.2f}{mark}", f"{case_times['median_s'] / layer_s:.2f}x"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--packed-loop", action="store_true", help="add the oneDNN-packed per-expert Python loop")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    default_vllm = "/work/vllm-venv/bin/python"
    parser.add_argument("--vllm-python", default=default_vllm if Path(default_vllm).exists() else None,
                        help="the vLLM CPU venv's python, for its cpu_fused_moe as a contender ('' to skip)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe_cpu"))
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    header = ["shape (H=1024)", "dtype", "T", "hf_loop ms", "fused ms", "fused+onednn ms", "fused+pagedkv ms",
              "layer", "hf_loop / fused", "hf_loop / layer", "onednn / pagedkv"]
    if args.packed_loop:
        header += ["packed_loop ms"]
    header += ["vllm ms", "vllm / layer", "check"]
    rows = []
    with torch.no_grad():
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            for label, H, inter, E, K in SHAPES:
                rows += bench_shape(label, H, inter, E, K, dtype, args.reps, args.packed_loop, gen,
                                    args.vllm_python)
    info = machine_info() | {"load_average_after": [round(x, 2) for x in os.getloadavg()]}
    md = "\n".join(header_lines("Fused MoE vs the per-expert loop (CPU)", info)
                   + [markdown_table(header, rows), ""])
    print(md)
    write_results(args.out, md, {"machine": info, "header": header, "rows": rows})


if __name__ == "__main__":
    main()
