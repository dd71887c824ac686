"""Mixture-of-experts benchmark (CPU): `ops.fused_moe` vs the per-expert PyTorch loop HF runs.

Contenders, on the same hidden states, weights and routing (the router itself is not timed):
  fused       `torch.ops.pagedkv.fused_moe`: counting sort by expert, one gather, two grouped
              GEMMs (the loop over experts in C++, at::mm_out into preallocated slices), fp32 combine;
  hf_loop     HF's MixtralExperts / Qwen3MoeExperts forward, written out: one_hot mask, the hit
              experts from a nonzero(), per expert torch.where, index, two F.linear, scale, index_add_;
  fused+packed the same op given each expert's weights prepacked for oneDNN
              (`torch.ops.mkldnn._reorder_linear_weight`, as layers.py packs dense linears;
              FusedMoE.pack_for_cpu, the layer's default): experts with >= 2 rows run on
              oneDNN with them instead of at::mm;
  packed_loop (--packed-loop) hf_loop with the packed per-expert weights.
Shapes: Mixtral-like scaled down (H=1024, I=3584, E=8, top-2) and Qwen3-MoE-like (H=1024,
I=768, E=64 and 128, top-8), T in {1, 16, 64, 256}, float32 and bfloat16. The contenders of
a row run interleaved, rep after rep, each reporting its median (the box may be shared).
Ratios > 1: the op is faster than hf_loop. Every row checks both op forms against hf_loop.

    python bench/bench_moe.py [--reps 5] [--packed-loop] [--out bench/results/moe_cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import header_lines, machine_info, markdown_table, write_results  # noqa: E402
from pagedkv import ops, reference  # noqa: E402

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


def time_interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each callable, run round-robin after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_shape(label, H, inter, E, K, dtype, reps, with_packed_loop, gen):
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter ** 0.5).to(dtype)
    packs = ([torch.ops.mkldnn._reorder_linear_weight(w13[e], 1) for e in range(E)],
             [torch.ops.mkldnn._reorder_linear_weight(w2[e], 1) for e in range(E)])
    rows = []
    for T in TOKENS:
        hidden = torch.randn(T, H, generator=gen).to(dtype)
        weights, ids = reference.moe_routing(torch.randn(T, E, generator=gen), K, renormalize=True)
        call = (hidden, weights, ids)  # bound now: the lambdas run within this iteration only
        fns = {"fused": lambda c=call: ops.fused_moe(c[0], w13, w2, c[1], c[2]),
               "fused+packed": lambda c=call: ops.fused_moe(c[0], w13, w2, c[1], c[2], *packs),
               "hf_loop": lambda c=call: hf_loop(c[0], w13, w2, c[1], c[2])}
        if with_packed_loop:
            fns["packed_loop"] = lambda c=call: packed_loop(*packs, *c)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        want = fns["hf_loop"]().float()
        ok = all(torch.allclose(fns[n]().float(), want, atol=tol, rtol=tol) for n in ("fused", "fused+packed"))
        t = time_interleaved(fns, reps)
        row = [f"{label} E={E} top-{K}", str(dtype).removeprefix("torch."), T, f"{t['hf_loop'] * 1e3:.2f}",
               f"{t['fused'] * 1e3:.2f}", f"{t['fused+packed'] * 1e3:.2f}", f"{t['hf_loop'] / t['fused']:.2f}x",
               f"{t['hf_loop'] / t['fused+packed']:.2f}x"]
        if with_packed_loop:
            row += [f"{t['packed_loop'] * 1e3:.2f}"]
        rows.append(row + ["ok" if ok else "MISMATCH"])
        print(" | ".join(map(str, row)), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--packed-loop", action="store_true", help="add the oneDNN-packed per-expert Python loop")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe_cpu"))
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    header = ["shape (H=1024)", "dtype", "T", "hf_loop ms", "fused ms", "fused+packed ms", "hf_loop / fused",
              "hf_loop / fused+packed"]
    if args.packed_loop:
        header += ["packed_loop ms"]
    header += ["check"]
    rows = []
    with torch.no_grad():
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            for label, H, inter, E, K in SHAPES:
                rows += bench_shape(label, H, inter, E, K, dtype, args.reps, args.packed_loop, gen)
    info = machine_info() | {"load_average_after": [round(x, 2) for x in os.getloadavg()]}
    md = "\n".join(header_lines("Fused MoE vs the per-expert loop (CPU)", info)
                   + [markdown_table(header, rows), ""])
    print(md)
    write_results(args.out, md, {"machine": info, "header": header, "rows": rows})


if __name__ == "__main__":
    main()
