"""KV-cache sizing without loading a model: `pagedkv kv-calc [MODEL]`.

From a model's HF `config.json` (no weights are read) this answers the
questions one asks before a launch: how many bytes a token and a block of
KV cache take, how many blocks a memory budget holds, and how many
sequences of a given context fit at once. The per-token figure comes from
`pagedkv.engine.memory_pool.kv_cache_spec`, the function the engine sizes
its own pool with, so the tool and the engine cannot disagree; it counts
the cache in `--kv-cache-dtype`'s format (fp8: one byte a value; int8/int4
per token head: one or half a byte a value plus a 4-byte scale pair).

The budget is either `--kv-cache-memory` bytes, or a device of
`--gpu-memory` bytes of which `--gpu-memory-utilization` goes to weights +
KV cache (vLLM's rule). The weights are subtracted: their parameter count
comes from the safetensors headers when the folder has them (exact), else
from pagedkv's own model for the config built on the meta device (exact for
the supported families, no memory), times the dtype's bytes. The
engine also subtracts the activation peak it measures at start-up, which a
config cannot tell; `--activation-memory` lets one subtract an estimate.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedkv.config import SUPPORTED_BLOCK_SIZES, ModelConfig, parse_json_object, resolve_dtype
from pagedkv.engine.memory_pool import kv_cache_spec, tokens_held_at_most
from pagedkv.kv_cache import SCALE_PAIR_BYTES, kv_cache_format
from pagedkv.model.registry import model_class
from pagedkv.supported import kv_cache_format_refusal

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'80GiB', '80GB', '1.5e9', '536870912' -> bytes (GiB/MiB: powers of 2; GB/MB: powers of 10)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte count: {text!r} (examples: 536870912, 16GiB, 80GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def find_config(model: str | Path | None) -> Path:
    """The config.json of a model given as a config file, a checkpoint folder, or None (the default model)."""
    if model is None:
        from pagedkv.model.default_model import ensure_default_model
        return ensure_default_model() / "config.json"
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}: give a HF config.json, a checkpoint folder or no model")
    return path


def count_params_from_config(cfg: ModelConfig) -> int:
    """Parameters of the model pagedkv would build for `cfg`, counted on the meta device (no memory, ~ms).

    The count is that of the engine's own modules (tied LM head once, q/k norms, biases, experts), so it
    cannot drift from what the engine loads; it equals transformers' count for every supported family.
    """
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    return sum(p.numel() for p in model.parameters())


def count_params_from_safetensors(folder: Path) -> int | None:
    """Parameters listed in the folder's safetensors headers (only the JSON header of each file is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


@dataclass(slots=True)
class KVCalcResult:
    """Everything `pagedkv kv-calc` prints; per device when tensor_parallel_size > 1."""

    model: str
    dtype: str
    block_size: int
    kv_cache_dtype: str  # the cache's storage format (canonical name); "auto" stores `dtype`
    tensor_parallel_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_token: int
    bytes_per_block: int
    context: int
    bytes_per_sequence: int  # one `context`-token sequence, whole blocks
    num_params: int
    params_source: str  # "safetensors" or "config"
    weight_bytes: int  # per device
    budget_bytes: int | None
    budget_source: str
    num_blocks: int | None = None
    num_tokens: int | None = None
    max_concurrent_seqs: int | None = None  # at `context` tokens each
    sliding_window: int | None = None  # every layer slides: a decoding sequence holds only about a window

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def kv_budget(weight_bytes: int, kv_cache_memory: int | None, gpu_memory: int | None,
              gpu_memory_utilization: float, activation_memory: int) -> tuple[int | None, str]:
    """(KV bytes per device, how they were reached): an explicit budget, else utilization x device - weights."""
    if kv_cache_memory is not None:
        return kv_cache_memory, "--kv-cache-memory"
    if gpu_memory is None:
        return None, "none given"
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    budget = int(gpu_memory * gpu_memory_utilization) - weight_bytes - activation_memory
    how = f"{gpu_memory_utilization} x {gpu_memory} - weights {weight_bytes}" + (
        f" - activations {activation_memory}" if activation_memory else "")
    if budget <= 0:
        raise ValueError(f"no room for a KV cache: {how} = {budget} bytes; raise --gpu-memory-utilization, "
                         f"use more devices (--tensor-parallel-size) or a smaller dtype")
    return budget, how


def kv_calc(model: str | Path | None = None, dtype: str = "auto", block_size: int = 16, context: int | None = None,
            kv_cache_memory: int | None = None, gpu_memory: int | None = None,
            gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
            activation_memory: int = 0, kv_cache_dtype: str = "auto",
            hf_overrides: str | dict | None = None) -> KVCalcResult:
    """Sizes the KV cache of `model` (see the module docstring). context: default the model's max length.

    dtype: the compute dtype (the weights' bytes, and the cache's under kv_cache_dtype "auto").
    hf_overrides: keys set over the config.json, as the engine's (e.g. YaRN's rope_scaling, which moves the
    model's max length).
    """
    fmt = kv_cache_format(kv_cache_dtype)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")
    config_path = find_config(model)
    overrides = parse_json_object("hf_overrides", hf_overrides) or {}
    cfg = ModelConfig.from_hf(json.loads(config_path.read_text()) | overrides)
    cfg.check_tensor_parallel_size(tensor_parallel_size)
    problem = kv_cache_format_refusal(fmt, cfg.head_dim, block_size)
    if problem:
        raise ValueError(problem)
    # "auto": the checkpoint's own dtype (float16 when the config names none), i.e. what it was trained/stored in.
    torch_dtype = resolve_dtype((cfg.torch_dtype or torch.float16) if dtype == "auto" else dtype, None,
                                torch.device("cpu"))
    context = context or cfg.position_limit
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    spec = kv_cache_spec(cfg, torch_dtype, block_size, tensor_parallel_size, fmt.name)
    window = cfg.kv_sliding_window
    # A decoding sequence of an all-sliding model keeps the blocks of its window only (the block manager frees
    # the others), however long its context.
    held = tokens_held_at_most(context, block_size, window, 1)
    num_params = count_params_from_safetensors(config_path.parent)
    source = "safetensors" if num_params is not None else "config"
    if num_params is None:
        num_params = count_params_from_config(cfg)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    weight_bytes = -(-num_params * itemsize // tensor_parallel_size)  # sharded evenly (norms are a rounding error)
    budget, how = kv_budget(weight_bytes, kv_cache_memory, gpu_memory, gpu_memory_utilization, activation_memory)
    result = KVCalcResult(
        model=str(config_path.parent), dtype=str(torch_dtype).removeprefix("torch."), block_size=block_size,
        kv_cache_dtype=fmt.name,
        tensor_parallel_size=tensor_parallel_size, num_layers=cfg.num_hidden_layers,
        num_kv_heads=max(1, cfg.num_key_value_heads // tensor_parallel_size), head_dim=cfg.head_dim,
        bytes_per_token=spec.bytes_per_token, bytes_per_block=spec.bytes_per_block, context=context,
        bytes_per_sequence=spec.bytes_for(held), num_params=num_params, params_source=source,
        weight_bytes=weight_bytes, budget_bytes=budget, budget_source=how, sliding_window=window)
    if budget is not None:
        result.num_blocks = spec.num_blocks(budget)
        result.num_tokens = result.num_blocks * block_size
        result.max_concurrent_seqs = result.num_blocks // -(-held // block_size)
    return result


def _per_token_rule(kv_cache_dtype: str) -> str:
    """How a token's bytes add up in this format."""
    fmt = kv_cache_format(kv_cache_dtype)
    if fmt.per_token_scale:
        values = "head_dim" if fmt.values_per_element == 1 else f"head_dim / {fmt.values_per_element}"
        return f"2 x layers x KV heads x ({values} bytes + {SCALE_PAIR_BYTES}-byte scale pair)"
    return "2 x layers x KV heads x head_dim x " + ("1 byte" if fmt.quantized else "dtype bytes")


def _gib(n: int) -> str:
    return f"{n:,} bytes ({n / (1 << 30):.2f} GiB)"


def format_report(r: KVCalcResult) -> str:
    """The human-readable table `pagedkv kv-calc` prints."""
    per = " per device" if r.tensor_parallel_size > 1 else ""
    lines = [
        f"model           {r.model}",
        f"shape           {r.num_layers} layers x {r.num_kv_heads} KV heads{per} x head_dim {r.head_dim}, {r.dtype}"
        + (f", tensor parallel {r.tensor_parallel_size}" if r.tensor_parallel_size > 1 else ""),
        f"kv_cache_dtype  {r.kv_cache_dtype}" + ("" if r.kv_cache_dtype != "auto" else f" ({r.dtype})"),
        f"per token       {r.bytes_per_token:,} bytes{per} ({_per_token_rule(r.kv_cache_dtype)})",
        f"per block       {r.bytes_per_block:,} bytes ({r.block_size} tokens)",
        f"one sequence    {_gib(r.bytes_per_sequence)} at {r.context} tokens "
        f"({100 * r.bytes_per_sequence / max(r.weight_bytes, 1):.1f}% of the weights)"
        + (f"; every layer slides (window {r.sliding_window}): a decoding sequence holds "
           f"{r.bytes_per_sequence // r.bytes_per_block} blocks" if r.sliding_window else ""),
        f"weights         {_gib(r.weight_bytes)}{per} ({r.num_params:,} parameters, from the {r.params_source})",
    ]
    if r.budget_bytes is None:
        lines.append("budget          none given: pass --kv-cache-memory BYTES or --gpu-memory BYTES")
        return "\n".join(lines)
    lines += [
        f"KV budget       {_gib(r.budget_bytes)}{per} ({r.budget_source})",
        f"blocks          {r.num_blocks:,} of {r.block_size} tokens = {r.num_tokens:,} tokens",
        f"concurrency     {r.max_concurrent_seqs:,} sequences of {r.context} tokens at once",
    ]
    return "\n".join(lines)
