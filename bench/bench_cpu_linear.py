"""The model's linear layers on the CPU: fp32 vs bf16, plain F.linear vs oneDNN's prepacked weight.

Shapes are SmolLM2-135M's (hidden 576, MLP 1536, 9 query / 3 KV heads of 64):
qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, the LM head
576->49152, at M = 1, 48 and 256 tokens (one decode row, a 48-sequence decode
step, a prefill chunk). Paths:

  linear   torch.nn.functional.linear(x, w)         (ATen: MKL sgemm for fp32, oneDNN for bf16)
  packed   torch.ops.mkldnn._linear_pointwise with the weight reordered once by
           torch.ops.mkldnn._reorder_linear_weight(w, 64) (what pagedkv's layers run on the CPU,
           python/pagedkv/model/layers.py)

Each cell is the fastest of --reps timed calls after warm-up (the box is
shared: a call that lost its time slice measures the neighbours, not the
GEMM), the weights resident (the LM head's 113 MB fp32 / 57 MB bf16 do not
fit in L3 anyway).

Usage:
    python3 bench/bench_cpu_linear.py --reps 30
Stdout is the markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, markdown_table  # noqa: E402

SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 48, 256])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info()
    info["mkldnn_bf16_supported"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        w32 = torch.randn(n, k, generator=gen) * k**-0.5
        for m in args.tokens:
            x32 = torch.randn(m, k, generator=gen)
            cell = {}
            for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                w, x = w32.to(dtype), x32.to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)  # the batch hint the layers use
                cell[f"{tag} linear"] = time_ms(lambda w=w, x=x: F.linear(x, w), args.reps)
                cell[f"{tag} packed"] = time_ms(
                    lambda p=packed, x=x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), args.reps)
            best32 = min(cell["fp32 linear"], cell["fp32 packed"])
            rows.append([f"{name} {k}->{n}", m] + [f"{v:.3f}" for v in cell.values()]
                        + [f"{best32 / cell['bf16 packed']:.2f}x", f"{cell['bf16 linear'] / cell['bf16 packed']:.2f}x"])
            print(f"{name} M={m} done", file=sys.stderr)
    print("\n".join(f"- {k}: {v}" for k, v in info.items()) + "\n")
    print(markdown_table(["shape", "M", "fp32 linear ms", "fp32 packed ms", "bf16 linear ms", "bf16 packed ms",
                          "bf16 packed vs best fp32", "bf16 packed vs bf16 linear"], rows))


if __name__ == "__main__":
    main()
