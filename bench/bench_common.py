"""Helpers the claim benchmarks share: machine info, markdown tables, writing results."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Date, CPU, cores, versions and the load average: timings are only comparable with these next to them."""
    import pagedkv
    import torch
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "cpu": cpu_model(), "usable_cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "pagedkv": pagedkv.__version__,
            "python": platform.python_version(), "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]}


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; the first column left-aligned, the others right-aligned (numbers)."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(stem: str | Path, markdown: str, data: dict[str, Any]) -> None:
    """`stem`.md and `stem`.json (the folder is created)."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))


def publish(lines: list[str], out: str | Path | None, data: dict[str, Any], info: dict[str, Any], args) -> None:
    """Prints a report, and with `out` writes it (`write_results`) with its data, the machine and the arguments."""
    text = "\n".join(lines)
    print(text)
    if out:
        write_results(out, text, data | {"machine": info, "args": vars(args)})


def header_lines(title: str, info: dict[str, Any]) -> list[str]:
    """A report's title, the machine lines and the command that produced it."""
    return [f"# {title}", ""] + [f"- {k}: {v}" for k, v in info.items()] + [
        f"- command: python3 {' '.join(sys.argv)}", ""]


def vllm_malloc_env(env: dict[str, str], choice: str) -> str:
    """Gives vLLM's processes the allocator setting pagedkv's engine makes for itself; returns a note for the table.

    choice "tuned": glibc keeps a step's freed activations (pagedkv.host_memory's
    thresholds, through GLIBC_TUNABLES, which vLLM's engine-core process inherits),
    as the tcmalloc its CPU docs advise would; "glibc": glibc's defaults.
    """
    if choice != "tuned":
        return "glibc malloc defaults"
    from pagedkv import host_memory
    tunables = (f"glibc.malloc.mmap_threshold={host_memory.MMAP_THRESHOLD_BYTES}:"
                f"glibc.malloc.trim_threshold={host_memory.TRIM_THRESHOLD_BYTES}")
    env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), tunables]))
    return "malloc tuned as pagedkv's"


def add_side_by_side_args(p, vllm_python: str | None) -> None:
    """The options of a pagedkv-beside-vLLM offline bench: interleaved rounds, which systems, the step budget and
    KV budget both get, vLLM's venv (default `vllm_python`) and CPU binding, the seed, where results go."""
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--systems", default="pagedkv,vllm")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--vllm-omp-bind", default="all")
    p.add_argument("--vllm-python", default=vllm_python)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    p.add_argument("--json")


def systems_to_run(systems: str, vllm_python: str | None) -> list[str]:
    """The comma-separated --systems, less "vllm" when its venv is missing (said on stderr)."""
    chosen = systems.split(",")
    if "vllm" in chosen and not (vllm_python and Path(vllm_python).exists()):
        print("no vLLM venv ($PAGEDKV_VLLM_PYTHON): running pagedkv alone", file=sys.stderr, flush=True)
        chosen = [s for s in chosen if s != "vllm"]
    return chosen
