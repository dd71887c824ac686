"""Registers, spills, shared memory and occupancy of every CUDA attention kernel, from ptxas.

Compiles csrc/attention/*.cu for one architecture (default sm_90, the H100/H200)
with the flags CMakeLists.txt uses, plus --resource-usage, and prints a Markdown
table per kernel instantiation: registers per thread, spill bytes, static and
dynamic shared memory, and resident CTAs / warps per SM. Needs nvcc only (no
GPU, no torch); a few minutes on 2 cores.

    python scripts/ptxas_report.py [--arch sm_90] [--check-spills]

--check-spills exits 1 when any kernel spills (for CI / gpu_check.sh).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["csrc/attention/paged_attention.cu", "csrc/attention/prefill_attention.cu"]
FLAGS = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr", "-std=c++17"]

# Per-SM limits of sm_80 / sm_90 (CUDA occupancy rules): register file, allocation unit per
# warp, max warps and CTAs, shared memory per SM usable by CTAs and reserved per CTA.
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256
MAX_WARPS = {"sm_80": 64, "sm_90": 64}
MAX_CTAS = 32
SMEM_PER_SM = {"sm_80": 164 * 1024, "sm_90": 228 * 1024}
SMEM_RESERVED_PER_CTA = 1024

# Threads per CTA of each kernel family, and dynamic shared memory (bytes) per instantiation,
# mirroring the Shape structs of the .cu files.
THREADS = {"paged_decode_kernel": 128, "paged_decode_reduce_kernel": 128, "paged_prefill_kernel": 128,
           "paged_prefill_mma_kernel": 128}


def dynamic_smem(kernel: str, dtype: str, head_size: int) -> int:
    if kernel == "paged_prefill_mma_kernel":  # MmaPrefillShape: Q + 2 stages of K and V (T) + flags
        ld = head_size + 8
        return 2 * 64 * ld + 4 * 2 * 32 * ld + 4 * 2 * 32
    if kernel == "paged_prefill_kernel":  # PrefillShape (fp32)
        rows = 64 if head_size <= 128 else 32
        ld = head_size + 4
        return 4 * (rows * ld + 2 * 32 * ld + rows * 33 + 3 * rows) + 4 * 32
    return 0


def occupancy(regs: int, smem: int, threads: int, arch: str) -> tuple[int, int]:
    warps = threads // 32
    regs_per_warp = -(-regs * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = REGS_PER_SM // (regs_per_warp * warps)
    by_smem = SMEM_PER_SM[arch] // (smem + SMEM_RESERVED_PER_CTA) if smem else MAX_CTAS
    ctas = min(by_regs, by_smem, MAX_CTAS, MAX_WARPS[arch] // warps)
    return ctas, ctas * warps


ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
USAGE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def demangle(names: list[str]) -> list[str]:
    if not shutil.which("c++filt"):
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def parse(log: str) -> list[dict]:
    rows, current = [], None
    for line in log.splitlines():
        if m := ENTRY.search(line):
            current = {"mangled": m.group(1)}
            rows.append(current)
        elif current is not None and (m := SPILL.search(line)):
            current["stack"], current["spill_st"], current["spill_ld"] = map(int, m.groups())
        elif current is not None and (m := USAGE.search(line)):
            current["regs"], current["smem"] = int(m.group(1)), int(m.group(2) or 0)
    for row, name in zip(rows, demangle([r["mangled"] for r in rows]), strict=True):
        row["name"] = name
    return rows


# KVCacheDType values (csrc/common/kv_cache_dtype.h), as the cache-format template argument.
KV_FORMATS = {"0": "auto", "1": "fp8_e4m3", "2": "fp8_e5m2", "3": "int8", "4": "int4",
              "kAuto": "auto", "kFp8E4M3": "fp8_e4m3", "kFp8E5M2": "fp8_e5m2", "kInt8PerTokenHead": "int8",
              "kInt4PerTokenHead": "int4"}


def kv_format(params: list[str]) -> str:
    """The cache format of a kernel's template arguments ("auto" when it has none)."""
    for p in params:
        if "KVCacheDType" in p:
            return KV_FORMATS.get(re.split(r"[):]+", p)[-1].strip(), p)
    return "auto"


def describe(row: dict, arch: str) -> str:
    m = re.search(r"(paged_\w+_kernel)<([^>]*)>", row["name"])
    kernel, params = (m.group(1), [p.strip() for p in m.group(2).split(",")]) if m else (row["name"], [])
    fmt = kv_format(params)
    params = [p for p in params if "KVCacheDType" not in p]
    dtype = {"float": "fp32", "__half": "fp16", "__nv_bfloat16": "bf16"}.get(params[0], params[0]) if params else "-"
    head_size = int(params[1]) if len(params) > 1 else 0
    heads = params[2] if len(params) > 2 else "-"
    dyn = dynamic_smem(kernel, dtype, head_size)
    ctas, warps = occupancy(row.get("regs", 0), row.get("smem", 0) + dyn, THREADS.get(kernel, 128), arch)
    spills = row.get("spill_st", 0) + row.get("spill_ld", 0)
    return (f"| {kernel} | {dtype} | {head_size or '-'} | {heads} | {fmt} | {row.get('regs', '?')} | {spills} | "
            f"{row.get('smem', 0)} | {dyn} | {ctas} | {warps} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--check-spills", action="store_true")
    args = parser.parse_args()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in SOURCES:
            cmd = [nvcc, f"-arch={args.arch}", *FLAGS, f"-I{ROOT / 'csrc'}", "--resource-usage", "-c",
                   str(ROOT / src), "-o", str(Path(tmp) / "k.o")]
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                print(result.stdout + result.stderr, file=sys.stderr)
                return 2
            rows += [r for r in parse(result.stdout + result.stderr) if r["mangled"].count("kernel")]
    print(f"ptxas resource usage, {args.arch}, 128 threads per CTA (CTAs/warps: resident per SM)\n")
    print("| kernel | dtype | head_size | heads/CTA | kv cache | registers | spill bytes | static smem | "
          "dynamic smem | CTAs/SM | warps/SM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: r["name"]):
        print(describe(row, args.arch))
    spilled = [r["name"] for r in rows if r.get("spill_st", 0) + r.get("spill_ld", 0) > 0]
    if spilled:
        print(f"\nSPILLS in {len(spilled)} kernels: " + ", ".join(spilled), file=sys.stderr)
    return 1 if args.check_spills and spilled else 0


if __name__ == "__main__":
    sys.exit(main())
