"""Finding a checkpoint, building the model and copying its weights in.

A model is named by a folder with `config.json` and safetensors files
(sharded through `model.safetensors.index.json` or not), by a `.gguf` file
(dequantized through transformers + gguf), or by None: the built-in default
model (pagedkv.model.default_model). The tokenizer comes from the same
place unless another is named. `LoadedModel.load` does all of it for an
`EngineArgs`, and finds the EOS tokens and sampling defaults the checkpoint
sets.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.config import EngineArgs, ModelConfig, resolve_device, resolve_dtype
from pagedkv.model.parallel_state import get_tp_size
from pagedkv.model.protocol import CausalLM
from pagedkv.model.registry import model_class
from pagedkv.model.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

# Keys of generation_config.json that set sampling defaults, with HF's own defaults (a value equal to HF's
# default is not a choice of the checkpoint's authors: vLLM skips those too).
_GENERATION_KEYS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                    "max_new_tokens": None}


@dataclass(slots=True)
class ModelSource:
    """Where a checkpoint lives: a folder, and the GGUF file inside it if it is one."""

    path: Path
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        return self.gguf_file or self.path.name


def resolve_model(model: str | Path | None) -> ModelSource:
    """A model argument (None, a folder, or a .gguf file) -> its ModelSource; raises ValueError if unusable."""
    if model is None:
        from pagedkv.model.default_model import ensure_default_model
        return ModelSource(ensure_default_model())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0])
        raise ValueError(f"model folder {path} has no config.json (and {len(ggufs)} .gguf files, need exactly 1)")
    raise ValueError(f"model {str(model)!r} is not a checkpoint folder or a .gguf file (pagedkv loads local "
                     "checkpoints only; model=None is the built-in default model)")


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint folder {path} has no .safetensors files")
    return files


class CheckpointSlice:
    """A checkpoint tensor not read yet: `narrow` and `[a:b]` read only the part asked for.

    Under tensor parallelism each rank's weight loaders narrow the tensor to
    their shard, so a rank reads (and holds) its shard, never the whole
    tensor. Valid while its file is open (the next iteration step may close it).
    """

    def __init__(self, tensor_slice) -> None:
        self._slice = tensor_slice
        self.shape = torch.Size(tensor_slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]

    def read(self) -> torch.Tensor:
        return self._slice[:]


def iter_safetensors(path: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """(name, tensor) for every tensor of a (possibly sharded) safetensors checkpoint, one shard open at a time.

    lazy: yield CheckpointSlice objects instead (read on demand, a shard's worth at a time).
    """
    from safetensors import safe_open

    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, CheckpointSlice(f.get_slice(name)) if lazy else f.get_tensor(name)


def load_gguf(source: ModelSource) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """(HF config dict, weights) of a GGUF checkpoint, dequantized to float32 by transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(source.path), gguf_file=source.gguf_file, dtype=torch.float32)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    return cfg, iter(hf.state_dict().items())


def read_hf_config(source: ModelSource, hf_overrides: dict | None = None) -> dict:
    """The checkpoint's config.json as a dict, `hf_overrides`' keys set over it (EngineArgs.hf_overrides)."""
    hf_config = json.loads((source.path / "config.json").read_text())
    return hf_config | (hf_overrides or {})


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None = None, hf_overrides: dict | None = None) -> CausalLM:
    """Builds the model for `source` in `dtype` on `device` and loads every weight.

    max_model_len: the engine's longest sequence, if it is set, else the model's position limit (the rotary tables
    hold that many positions; LongRoPE checkpoints choose their factors by it). hf_overrides: keys set over the
    checkpoint's config (EngineArgs.hf_overrides).
    """
    if source.gguf_file:
        hf_config, weights = load_gguf(source)
        hf_config |= hf_overrides or {}
    else:
        # Sharded: read each tensor's slice only (at size 1 a whole read is the same and simpler).
        hf_config = read_hf_config(source, hf_overrides)
        weights = iter_safetensors(source.path, lazy=get_tp_size() > 1)
    cfg = ModelConfig.from_hf(hf_config)
    cfg.max_model_len = max_model_len or cfg.position_limit  # the engine's default (EngineArgs), rotary tables too
    cls = model_class(cfg.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    loaded = model.load_weights(weights)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if not cfg.has_lm_head:  # a base model's checkpoint: no LM head (it only pools), kept at zero
        for name in [n for n in missing if n.startswith("lm_head.")]:
            missing.discard(name)
            with torch.no_grad():
                model.get_parameter(name).zero_()
    if missing:
        raise ValueError(f"checkpoint {source.path} lacks weights for {sorted(missing)[:5]} "
                         f"({len(missing)} parameters)")
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            # The rotary table stays float32 whatever the model dtype (positions up to 128K need it).
            module.cos_sin = module.cos_sin.float()
        elif device.type == "cpu" and hasattr(module, "pack_for_cpu"):
            module.pack_for_cpu()
    return model.eval()


def load_tokenizer(source: ModelSource, tokenizer: str | Path | None = None):
    """The HF tokenizer (with its chat template) of the checkpoint, or of the folder `tokenizer`."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    if source.gguf_file:
        return AutoTokenizer.from_pretrained(str(source.path), gguf_file=source.gguf_file)
    return AutoTokenizer.from_pretrained(str(source.path))


def eos_token_ids(source_path: Path, cfg: ModelConfig, tokenizer) -> set[int]:
    """Every id that ends a sequence: config.json's, generation_config.json's and the tokenizer's."""
    ids = set(cfg.eos_token_id)
    gen = source_path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def generation_defaults(folder: Path | None) -> dict[str, Any]:
    """SamplingParams defaults set by `folder`/generation_config.json (vLLM's `--generation-config`).

    Only the sampling keys the checkpoint sets to something other than HF's
    own default count; `max_new_tokens` becomes `max_tokens`. A missing or
    unreadable file sets nothing.
    """
    path = folder / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", path, e)
        return {}
    out = {}
    for key, hf_default in _GENERATION_KEYS.items():
        value = config.get(key)
        if value is not None and value != hf_default:
            out["max_tokens" if key == "max_new_tokens" else key] = value
    return out


@dataclass(slots=True)
class LoadedModel:
    """A model and its tokenizer, loaded once; several engines (e.g. tests of different cache settings) can share it."""

    model: Any
    tokenizer: Any
    name: str
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: set[int]
    source_path: Path | None = None  # the checkpoint folder (its generation_config.json gives sampling defaults)

    @classmethod
    def load(cls, args: EngineArgs, device: torch.device | None = None, with_tokenizer: bool = True) -> LoadedModel:
        """device: this rank's device under tensor parallelism (default: args.device resolved)."""
        device = device or resolve_device(args.device)
        source = resolve_model(args.model)
        start = time.perf_counter()
        checkpoint_dtype = (None if source.gguf_file
                            else ModelConfig.from_hf(read_hf_config(source, args.hf_overrides)).torch_dtype)
        dtype = resolve_dtype(args.dtype, checkpoint_dtype, device)
        torch.manual_seed(args.seed)
        model = load_model(source, dtype, device, args.max_model_len, args.hf_overrides)
        tokenizer = None if args.skip_tokenizer_init or not with_tokenizer else load_tokenizer(source, args.tokenizer)
        name = str(args.model) if args.model else source.name
        logger.info("loaded %s (%s, %s) in %.1f s", name, dtype, device, time.perf_counter() - start)
        return cls(model, tokenizer, name, dtype, device, eos_token_ids(source.path, model.config, tokenizer),
                   Path(source.path))
