"""Reading a PEFT LoRA adapter and mapping its tensors onto the model's projections.

A PEFT adapter folder holds `adapter_config.json` (r, lora_alpha, use_rslora,
...) and `adapter_model.safetensors` (or `adapter_model.bin`) with, per
adapted module, `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; the module's output gains
`scaling * x A^T B^T` with scaling = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora). pagedkv folds the scaling into B once, here.

Each module is mapped with the model's own checkpoint mapping
(`split_checkpoint_tensor`), so an adapter of `q_proj` lands in slice "q" of
the fused `qkv_proj`, `gate_proj` in part 0 of `gate_up_proj`, and a family
that permutes or splits checkpoint rows (GPT-J's rotary order, Phi-3's fused
qkv) does the same to B's rows. What pagedkv cannot run is refused by name
before anything is loaded: DoRA, LoRA biases, `modules_to_save`, adapters of
the embeddings, the LM head or MoE experts, and ranks above `max_lora_rank`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.lora.request import LoRARequest

_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class LoRAAdapterError(ValueError):
    """An adapter pagedkv cannot load: the message names the file, the setting or the tensor."""


@dataclass(slots=True)
class ModulePart:
    """One adapted piece of a model projection: `module` (our module path, e.g. "layers.3.self_attn.qkv_proj"),
    its `shard` (the fused part: "q"/"k"/"v", 0/1, or None), A [r, in] and B [out of the part, r] (scaled)."""

    module: str
    shard: object
    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(slots=True)
class LoRAAdapter:
    """A loaded adapter: its request, its rank and its parts (host tensors in the model's dtype)."""

    request: LoRARequest
    rank: int
    parts: list[ModulePart]

    @property
    def num_bytes(self) -> int:
        return sum(p.lora_a.nbytes + p.lora_b.nbytes for p in self.parts)


def read_adapter_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {folder}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {path}: expected a JSON object")
    return config


def check_adapter_config(config: dict, where: str) -> None:
    """Refuses the PEFT settings pagedkv does not run (each named), before any tensor is read."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type!r} is not LoRA")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoRAAdapterError(f"{where}: adapters that train biases (bias={config.get('bias')!r}, "
                               f"lora_bias={config.get('lora_bias')!r}) are not supported; use bias='none'")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(f"{where}: modules_to_save {config['modules_to_save']} (fully trained copies of "
                               "base modules) are not supported")
    if config.get("alpha_pattern"):
        raise LoRAAdapterError(f"{where}: per-module lora_alpha (alpha_pattern) is not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAAdapterError(f"{where}: {key} must be a positive number, got {value!r}")


def read_adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: the adapter is refused, the engine goes on
            raise LoRAAdapterError(f"LoRA adapter {path}: cannot read its tensors ({type(e).__name__}: {e})") from None
    raise LoRAAdapterError(f"LoRA adapter {folder}: no {' or '.join(WEIGHT_FILES)}")


def pair_tensors(tensors: dict[str, torch.Tensor], where: str) -> dict[str, dict[str, torch.Tensor]]:
    """{HF module path: {"A": [r, in], "B": [out, r]}} from PEFT tensor names; anything else is refused."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR.match(name.removeprefix(_PREFIX))
        if m is None:
            what = ("LoRA on an embedding" if "lora_embedding" in name else
                    "a DoRA magnitude" if "lora_magnitude" in name else "a tensor that is not lora_A / lora_B")
            raise LoRAAdapterError(f"{where}: {name!r} is {what}: not supported")
        if tensor.dim() != 2:
            raise LoRAAdapterError(f"{where}: {name!r} must be 2-D, got shape {tuple(tensor.shape)}")
        modules.setdefault(m["module"], {})[m["which"]] = tensor
    for module, pair in modules.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: module {module!r} has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(f"{where}: module {module!r}: lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)} disagree on the rank")
    if not modules:
        raise LoRAAdapterError(f"{where}: the adapter has no LoRA tensors")
    return modules


def load_adapter(request: LoRARequest, model, lora_modules: dict, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Reads `request`'s folder and maps it onto `model` (whose LoRA-capable projections are `lora_modules`, by
    module path); raises LoRAAdapterError naming what does not fit."""
    folder = Path(request.lora_path).expanduser()
    where = f"LoRA adapter {request.lora_name!r} ({folder})"
    if not folder.is_dir():
        raise LoRAAdapterError(f"{where}: {'not a folder' if folder.exists() else 'no such folder'}")
    config = read_adapter_config(folder)
    check_adapter_config(config, where)
    modules = pair_tensors(read_adapter_tensors(folder), where)
    rank = max(pair["A"].shape[0] for pair in modules.values())
    if rank > max_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} exceeds max_lora_rank={max_rank} (start the engine with "
                               f"max_lora_rank >= {rank})")
    alpha = float(config["lora_alpha"])
    parts: list[ModulePart] = []
    for hf_module, pair in modules.items():
        a, b = pair["A"], pair["B"]
        r = a.shape[0]
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        b = (b.float() * scaling).to(dtype)
        parts.extend(_map_module(model, lora_modules, hf_module, a.to(dtype), b, where))
    return LoRAAdapter(request, rank, parts)


def _map_module(model, lora_modules: dict, hf_module: str, a: torch.Tensor, b: torch.Tensor,
                where: str) -> list[ModulePart]:
    """The model's checkpoint mapping applied to B's rows (it may split or permute them); A goes with each part."""
    name = hf_module.removeprefix("model.") + ".weight"
    try:
        mapped = list(model.split_checkpoint_tensor(name, b))
    except Exception as e:  # the family's mapping expected a weight's shape
        raise LoRAAdapterError(f"{where}: module {hf_module!r} does not map onto {model.config.architecture} "
                               f"({type(e).__name__}: {e})") from None
    parts = []
    for target, shard, tensor in mapped:
        module = target.removesuffix(".weight")
        if module not in lora_modules:
            raise LoRAAdapterError(f"{where}: module {hf_module!r} is not a projection pagedkv adapts (LoRA runs on "
                                   "the attention and MLP projections of the decoder layers; not on embeddings, "
                                   "the LM head or MoE experts)")
        rows = tensor if isinstance(tensor, torch.Tensor) else tensor.read()
        parts.append(ModulePart(module, shard, a, rows))
    if not parts:
        raise LoRAAdapterError(f"{where}: module {hf_module!r} has no weight in {model.config.architecture}")
    return parts
