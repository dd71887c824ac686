"""Pooling: one vector per prompt from the model's final hidden states (embeddings).

A pooling request is a prompt computed once, in chunks like any prefill
(its KV is written to the paged cache, and other requests may share it
through the prefix cache), with no token sampled. The model runner hands
each of its chunks' final hidden states (after the model's last norm) to the
request's `PoolingState`, which keeps only what its pooling type needs:

    LAST  the state of the last prompt token (causal embedding models: Qwen3-Embedding, e5-mistral, gte-Qwen)
    MEAN  the sum over the prompt's tokens, divided by their number at the end
    CLS   the state of the first token

so a long prompt never holds more than one [hidden_size] vector between
steps. MEAN and CLS need every position computed, so such a request reads
nothing from the prefix cache (a cached position has no hidden state); LAST
always computes the last token and may start from cached blocks. The vector
is then cut to the request's `dimensions` (Matryoshka models) and
L2-normalized unless asked not to, in float32.

`Pooler` is the engine's resolved setting: `pooler_config` where given,
else the checkpoint's sentence-transformers files (modules.json and the
Pooling module's config.json, as sentence-transformers and vLLM read them),
else LAST with normalization (vLLM's default for a causal LM run as an
embedding model).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.config import PoolerConfig
from pagedkv.errors import SamplingParamsError
from pagedkv.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

# sentence-transformers' Pooling module flags -> pagedkv's pooling types (the others have no pagedkv pooler).
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class Pooler:
    """The engine's pooling setting, resolved at start (pickled to an engine core's front end, which checks
    requests with it too)."""

    pooling_type: str  # "LAST", "MEAN" or "CLS"
    normalize: bool
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes a Matryoshka model was trained at, if listed
    is_matryoshka: bool = False
    default_dimensions: int | None = None
    source: str = "default"  # where the setting came from, for the start-up log
    refusal: str | None = None  # why this engine runs no pooling request (its checkpoint asks for a mode not built)

    def check(self, params: PoolingParams) -> None:
        """Refuses what this model cannot give (raises SamplingParamsError naming the field)."""
        if self.refusal is not None:
            raise SamplingParamsError("input", self.refusal)
        dims = params.dimensions
        if dims is None:
            return
        if not self.is_matryoshka:
            raise SamplingParamsError("dimensions", "this model does not support Matryoshka representations: "
                                                    "cutting its embeddings would give poor ones (set "
                                                    "hf_overrides={\"is_matryoshka\": true} if it was trained so)")
        if dims > self.hidden_size:
            raise SamplingParamsError("dimensions", f"dimensions={dims} is more than the model's hidden size "
                                                    f"{self.hidden_size}")
        if self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
            raise SamplingParamsError("dimensions", f"dimensions={dims} is not one this model was trained at: "
                                                    f"{list(self.matryoshka_dimensions)}")

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a request may start from cached blocks: only LAST needs no position before its last."""
        return self.pooling_type == "LAST"

    def finalize(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """The pooled float32 [hidden_size] vector as the request gets it: cut to `dimensions` (the request's, else
        the default), then L2-normalized unless normalize is off."""
        dims = params.dimensions or self.default_dimensions
        if dims is not None:
            vector = vector[:dims]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        return vector.contiguous()

    def describe(self) -> str:
        dims = f", Matryoshka dimensions {list(self.matryoshka_dimensions) or 'any'}" if self.is_matryoshka else ""
        return (f"pooling {self.pooling_type}, normalize {self.normalize} (from {self.source}){dims}"
                if self.refusal is None else f"no pooling: {self.refusal}")


def resolve_runner(asked: str, has_lm_head: bool) -> str:
    """The engine's runner (EngineArgs.runner) for its model: a checkpoint without an LM head (a base model's,
    e.g. MistralModel) pools only, so "auto" becomes "pooling" and "generate" is refused."""
    if has_lm_head:
        return asked
    if asked == "generate":
        raise ValueError("runner='generate': this checkpoint is a base model without an LM head (an embedding "
                         "model); run it with runner='pooling' (or 'auto')")
    return "pooling"


def read_sentence_transformers(folder: Path | None) -> tuple[str | None, bool | None, str | None]:
    """(pooling type, normalize, why it cannot pool) from a checkpoint's sentence-transformers files; Nones when it
    has none. normalize is whether modules.json lists a Normalize module."""
    if folder is None or not (folder / "modules.json").is_file():
        return None, None, None
    try:
        modules = json.loads((folder / "modules.json").read_text())
        pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        if pooling is None:
            return None, normalize, None
        flags = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError, TypeError) as e:
        logger.warning("%s/modules.json could not be read (%s): pooling defaults apply", folder, e)
        return None, None, None
    modes = [t for flag, t in _ST_MODES.items() if flags.get(flag)]
    odd = [flag for flag in _ST_UNSUPPORTED if flags.get(flag)]
    if odd or len(modes) > 1:
        return None, normalize, (f"the checkpoint's sentence-transformers pooling ({', '.join(odd + modes)}) is not "
                                 f"one pagedkv implements; set pooler_config={{\"pooling_type\": ...}} "
                                 f"(LAST, MEAN or CLS) to pool anyway")
    return (modes[0] if modes else None), normalize, None


def resolve_pooler(folder: Path | None, hf_config: dict[str, Any], hidden_size: int,
                   user: PoolerConfig | None) -> Pooler:
    """The engine's pooling: `user`'s settings first, then the checkpoint's sentence-transformers files, then LAST
    with normalization. hf_config: config.json with hf_overrides (is_matryoshka, matryoshka_dimensions)."""
    user = user or PoolerConfig()
    st_type, st_normalize, refusal = read_sentence_transformers(folder)
    if user.pooling_type is not None:
        refusal = None
    pooling_type = user.pooling_type or st_type or "LAST"
    normalize = user.normalize if user.normalize is not None else (st_normalize if st_normalize is not None else True)
    source = ("pooler_config" if user.pooling_type or user.normalize is not None
              else "sentence-transformers files" if st_type or st_normalize is not None else "default")
    listed = hf_config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in listed) if isinstance(listed, (list, tuple)) and listed else None
    is_matryoshka = bool(hf_config.get("is_matryoshka")) or dims is not None
    if user.dimensions is not None:
        if not is_matryoshka or user.dimensions > hidden_size:
            raise ValueError(f"pooler_config: dimensions={user.dimensions} needs a Matryoshka model (is_matryoshka "
                             f"in config.json or hf_overrides) and at most hidden_size={hidden_size}")
    return Pooler(pooling_type, normalize, hidden_size, dims, is_matryoshka, user.dimensions, source, refusal)


def checkpoint_pooler(folder: Path | None, hf_overrides: dict | None, hidden_size: int,
                      user: PoolerConfig | None) -> Pooler:
    """`resolve_pooler` for the checkpoint folder `folder` (its config.json, hf_overrides set over it)."""
    hf_config: dict[str, Any] = {}
    if folder is not None and (folder / "config.json").is_file():
        try:
            hf_config = json.loads((folder / "config.json").read_text())
        except ValueError:
            hf_config = {}
    return resolve_pooler(folder, hf_config | (hf_overrides or {}), hidden_size, user)


@dataclass(slots=True, eq=False)
class PoolingState:
    """A pooling request's part of its prompt's hidden states between chunks (float32 [hidden_size] at most),
    and its vector once the prompt is done."""

    pooler: Pooler
    params: PoolingParams
    num_prompt_tokens: int
    partial: torch.Tensor | None = None  # LAST/CLS: the chosen row; MEAN: the sum of rows so far
    result: torch.Tensor | None = None  # the finished vector (float32, on the CPU)

    @property
    def reads_prefix_cache(self) -> bool:
        return self.pooler.reads_prefix_cache

    def rows_of_chunk(self, start: int, n: int) -> tuple[int, int]:
        """The chunk's rows [first, first + count) this pooling reads, relative to the chunk (count may be 0)."""
        kind = self.pooler.pooling_type
        if kind == "MEAN":
            return 0, n
        if kind == "CLS":
            return 0, 1 if start == 0 else 0
        return n - 1, 1 if start + n == self.num_prompt_tokens else 0

    def add(self, start: int, states: torch.Tensor) -> None:
        """The final hidden states (float32 [count, hidden_size]) of the rows `rows_of_chunk` chose from the chunk
        starting at prompt position `start`. A chunk from position 0 starts over (a prompt recomputed after
        preemption)."""
        if not len(states):
            return
        part = states.sum(0) if self.pooler.pooling_type == "MEAN" else states[0]
        self.partial = part if start == 0 or self.partial is None else self.partial + part

    def finish(self) -> torch.Tensor:
        """The vector, once the prompt's last chunk was added."""
        if self.partial is None:
            raise RuntimeError("the prompt finished without a pooled hidden state")
        vector = self.partial / self.num_prompt_tokens if self.pooler.pooling_type == "MEAN" else self.partial
        self.result = self.pooler.finalize(vector.float().cpu(), self.params)
        self.partial = None
        return self.result
