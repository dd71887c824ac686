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

--kernels compares the two GEMMs the layers can be packed for
(pagedkv/model/cpu_linear.py) on what one engine step multiplies: the default
model's 120 layer weights (30 layers x qkv, o, gate_up, down; distinct weights,
so they come from memory as in a step) and its LM head, at each --tokens row
count, pagedkv's `packed_linear` and oneDNN's prepacked GEMM interleaved call by
call (the VM's speed drifts), median of --reps. Rows 1-64 are decode steps,
257 a 256-token prefill chunk beside one decode, 512-2048 prefill chunks.
In float32 a third GEMM runs in the same rotation: OpenBLAS's sgemm (numpy's
matmul on the weight stored [in, out]; the BLAS pip's numpy ships, with
hand-written kernels per CPU family, Zen included), so pagedkv's GEMM is also
measured against a tuned BLAS that is not the one torch links.

Usage:
    python3 bench/bench_cpu_linear.py --reps 30
    python3 bench/bench_cpu_linear.py --kernels --dtype float32 --out bench/results/cpu_linear_kernels_avx2_cpu
Stdout is the markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# OpenBLAS's worker threads spin for 2^28 cycles after each call (its default THREAD_TIMEOUT) before they
# sleep: interleaved with the torch kernels on the same cores they kept a core from them (one 576->3072
# product at 16 rows: pagedkv 6.1 ms after an OpenBLAS call, 1.0 ms with the spin cut to 2^4 cycles; Zen 3,
# 2026-12-07). Set before numpy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from pagedkv import ops  # noqa: E402
from pagedkv.model import cpu_linear  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import header_lines, machine_info, markdown_table, write_results  # noqa: E402

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


LAYER_SHAPES = ("qkv", "o_proj", "gate_up", "down")
NUM_LAYERS = 30  # the default model's


def model_gemms(dtype: torch.dtype, gen: torch.Generator) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Per group ("layers": 120 weights, "lm_head": 1), the (in_features, weight [out, in]) pairs of one step."""
    layers = [(SHAPES[name][0], torch.randn(SHAPES[name][::-1], generator=gen).to(dtype) * SHAPES[name][0] ** -0.5)
              for _ in range(NUM_LAYERS) for name in LAYER_SHAPES]
    k, n = SHAPES["lm_head"]
    return {"layers": layers, "lm_head": [(k, torch.randn(n, k, generator=gen).to(dtype) * 0.05)]}


def run_gemms(kernel: str, packed: list[tuple[int, object, int]], xs: dict[int, object]) -> None:
    """Every (in_features, packed weight, out_features) of one step on `kernel`, input xs[in_features]
    (numpy arrays for "openblas", tensors otherwise)."""
    for k, weight, n in packed:
        if kernel == "pagedkv":
            ops.packed_linear(xs[k], weight, None, n)
        elif kernel == "openblas":
            np.matmul(xs[k], weight)
        else:
            cpu_linear.onednn_linear(xs[k], weight, None)


def openblas_version() -> str:
    """The BLAS numpy runs on, as numpy's build config names it, and the OpenBLAS settings in the environment."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        name = f"{blas.get('name', '?')} {blas.get('version', '?')}"
    except (TypeError, KeyError):
        name = "numpy's BLAS"
    names = ("OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT")
    env = " ".join(f"{k}={os.environ[k]}" for k in names if k in os.environ)
    return f"{name}, {env or 'default threads'}"


def compare_kernels(args: argparse.Namespace) -> None:
    """pagedkv's packed_linear vs oneDNN on one step's GEMMs, interleaved; a table per group."""
    dtype = getattr(torch, args.dtype)
    with_blas = dtype == torch.float32 and not args.no_openblas
    info = machine_info() | {"cpu_capability": ops.cpu_capability(), "dtype": args.dtype, "reps": args.reps}
    if with_blas:
        info["openblas"] = openblas_version()
    gen = torch.Generator().manual_seed(0)
    lines = header_lines("The linear layers' GEMM: pagedkv's packed_linear vs oneDNN"
                         + (" and OpenBLAS" if with_blas else "") + " (bench_cpu_linear.py --kernels)", info)
    data: dict = {"info": info, "rows": []}
    for group, weights in model_gemms(dtype, gen).items():
        packed = {"pagedkv": [(k, ops.pack_linear_weight(w), w.shape[0]) for k, w in weights],
                  "onednn": [(k, cpu_linear.pack_onednn_weight(w, bf16_as_fp32=True), w.shape[0]) for k, w in weights]}
        if with_blas:
            packed["openblas"] = [(k, w.t().contiguous().numpy(), w.shape[0]) for k, w in weights]
        weight_bytes = sum(w.numel() * w.element_size() for _, w in weights)
        flops_per_row = 2 * sum(w.numel() for _, w in weights)
        rows = []
        for m in args.tokens:
            xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for k, _ in weights}}
            xs_np = {k: x.numpy() for k, x in xs.items()} if with_blas else {}
            times: dict[str, list[float]] = {name: [] for name in packed}
            for rep in range(args.reps + 2):
                for name in packed if rep % 2 == 0 else reversed(packed):
                    start = time.perf_counter()
                    run_gemms(name, packed[name], xs_np if name == "openblas" else xs)
                    if rep >= 2:  # two warm-up rounds
                        times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) for name, t in times.items()}
            row = {"group": group, "rows": m, **{f"{name}_ms": 1e3 * t for name, t in med.items()},
                   "speedup": med["onednn"] / med["pagedkv"]}
            blas_ms, blas_ratio = [], []
            if with_blas:
                row["speedup_openblas"] = med["openblas"] / med["pagedkv"]
                blas_ms, blas_ratio = [f"{row['openblas_ms']:.2f}"], [f"{row['speedup_openblas']:.2f}x"]
            data["rows"].append(row)
            rows.append([m, f"{row['onednn_ms']:.2f}", *blas_ms, f"{row['pagedkv_ms']:.2f}", f"{row['speedup']:.2f}x",
                         *blas_ratio, f"{weight_bytes / med['pagedkv'] / 1e9:.1f}",
                         f"{flops_per_row * m / med['pagedkv'] / 1e9:.0f}"])
            print(f"{group} M={m}: {row['speedup']:.2f}x", file=sys.stderr)
        title = ("the default model's 120 layer GEMMs (30 layers x qkv 576->960, o 576->576, gate_up 576->3072, "
                 "down 1536->576)" if group == "layers" else "the LM head 576->49152")
        blas_ms_col, blas_ratio_col = (["OpenBLAS ms"], ["OpenBLAS / pagedkv"]) if with_blas else ([], [])
        lines += [f"## {title}", "", markdown_table(
            ["rows", "oneDNN ms", *blas_ms_col, "pagedkv ms", "oneDNN / pagedkv", *blas_ratio_col,
             "pagedkv weights GB/s", "pagedkv GFLOP/s"], rows), ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        write_results(args.out, report, data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 48, 256])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--kernels", action="store_true", help="pagedkv's GEMM vs oneDNN on one step's weights (above)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="--kernels: the dtype")
    p.add_argument("--out", help="--kernels: write STEM.md and STEM.json")
    p.add_argument("--no-openblas", action="store_true", help="--kernels: leave numpy's OpenBLAS column out")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernels:
        return compare_kernels(args)
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
