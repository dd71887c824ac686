"""Dataclass configs of the engine, validated in __post_init__.

The names are vLLM's, so that a vLLM launch line reads the same here:
`gpu_memory_utilization`, `max_num_batched_tokens`, `max_num_seqs`,
`block_size`, `enable_prefix_caching`, `swap_space`, `preemption_mode`,
`max_model_len`, `kv_cache_dtype` (CacheConfig.cache_dtype),
`calculate_kv_scales`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from typing import Any

import torch

from pagedkv.kv_cache import kv_cache_format
from pagedkv.model_config import ModelConfig
from pagedkv.supported import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

PREEMPTION_MODES = ("recompute", "swap")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
GiB = 1 << 30
logger = logging.getLogger(__name__)


def _positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def _check_calculate_kv_scales(value: Any) -> None:
    if value is not None and not isinstance(value, bool):  # identity, not ==: 1.0 is not a setting
        raise ValueError(f"calculate_kv_scales must be None, True or False, got {value!r}")


def cpu_has_bf16_dot_products() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16, which AMX CPUs also have)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype for `dtype` ("auto", a name, or a torch.dtype).

    "auto" on the CPU: bfloat16 where the CPU has bf16 dot products (AVX512-BF16:
    oneDNN's bf16 GEMMs and pagedkv's avx512_bf16 attention kernels; a 48-sequence
    decode step of SmolLM2-135M and the offline throughput bench ran 1.8x faster
    than fp32 on a Zen 4, bench/results/bf16_cpu.md), float32 elsewhere (without
    them bf16 is widened to fp32 and saves only memory traffic). bf16 outputs are
    not bit-equal to fp32 ones: pass "float32" to match a float32 reference. On
    CUDA the checkpoint's dtype, with float32 checkpoints run in bfloat16, as vLLM does.
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cpu":
            resolved = torch.bfloat16 if cpu_has_bf16_dot_products() else torch.float32
            logger.info("dtype auto on the CPU: %s (%s)", resolved,
                        "the CPU has AVX512-BF16" if resolved == torch.bfloat16 else "no AVX512-BF16 on this CPU")
            return resolved
        resolved = checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {resolved}")
    return resolved


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" is CUDA when a GPU is visible, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    return dev


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields (`--kv-events-config` JSON); the publisher is pagedkv.engine.kv_events."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {name} must be a positive int, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
        """From a JSON string (the CLI's), a dict or a config; None stays None. Unknown keys are refused."""
        return parse_config(cls, "kv_events_config", value)


def parse_json_object(name: str, value: str | dict | None) -> dict | None:
    """A dict given as itself or as a JSON object string (the CLI's); None stays None."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object, got {value!r}: {e}") from None
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(f"{name} must be a JSON object, got {value!r}")


def parse_config(cls: type, name: str, value: Any) -> Any:
    """A dataclass config `cls` from a JSON object string (the CLI's), a dict, or itself; None stays None.
    Unknown keys are refused, naming the setting `name` and the keys it knows."""
    if value is None or isinstance(value, cls):
        return value
    value = parse_json_object(name, value)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**value)


def _check_tiers(c) -> None:
    """The tier settings of a CacheConfig or EngineArgs: sizes in GiB, and prefix caching on."""
    for name in ("kv_offloading_size", "kv_cache_dir_size"):
        value = getattr(c, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name} must be a positive number of GiB (or None: off), got {value!r}")
    if c.kv_cache_dir is not None and not isinstance(c.kv_cache_dir, (str, os.PathLike)):
        raise ValueError(f"kv_cache_dir must be a directory path, got {c.kv_cache_dir!r}")
    if c.kv_cache_dir_size is not None and c.kv_cache_dir is None:
        raise ValueError("kv_cache_dir_size needs kv_cache_dir (the directory it caps)")
    if (c.kv_offloading_size or c.kv_cache_dir) and not c.enable_prefix_caching:
        raise ValueError("kv_offloading_size / kv_cache_dir keep prefix-cache blocks: they need "
                         "enable_prefix_caching=True (--enable-prefix-caching)")


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache: block size, storage format, how much memory it gets, prefix caching, swap space.

    cache_dtype: a `kv_cache_dtype` (pagedkv.kv_cache: "auto" is the compute dtype; fp8 and the per-token-head
    int8/int4 formats store less per token), kept under its canonical name ("fp8" becomes "fp8_e4m3").
    calculate_kv_scales (fp8 only): None computes the per-layer scales from the first batch when the
    checkpoint has none, True always computes them, False takes the checkpoint's or 1.0.
    num_gpu_blocks / num_cpu_blocks: set once the pool is sized (vLLM's fields; the metrics report them).
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; overrides the sizing rule on any device
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    enable_prefix_caching: bool = False
    watermark: float = 0.01
    hash_algo: str = "sha256"
    cache_dtype: str = "auto"
    calculate_kv_scales: bool | None = None
    # Tiers of the prefix cache below the pool (pagedkv.core.kv_tiers): host memory for evicted cached blocks
    # (GiB, vLLM's kv_offloading_size) and a directory of block files that outlives the process.
    kv_offloading_size: float | None = None
    kv_cache_dir: str | None = None
    kv_cache_dir_size: float | None = None  # GiB the directory may hold (None: no limit)
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None

    def __post_init__(self) -> None:
        self.cache_dtype = kv_cache_format(self.cache_dtype).name  # ValueError listing the valid values
        _check_calculate_kv_scales(self.calculate_kv_scales)
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")
        _check_tiers(self)

    def metrics_info(self) -> dict[str, str]:
        """Every field as a string: the labels of the `vllm:cache_config_info` gauge (vLLM's method)."""
        return {name: str(getattr(self, name)) for name in self.__dataclass_fields__}


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous batching limits of one engine step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: str = "recompute"
    # Most prompt tokens one sequence may take in a step (0: up to the whole budget). Lets
    # several long prompts advance side by side instead of one after the other.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold!r}")
        _positive("SchedulerConfig", max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs a token of the step's budget")


MAX_LORA_RANK_LIMIT = 512
MAX_SPECULATIVE_TOKENS = 32  # drafts per step: beyond this the rejected tail costs more than it can win


@dataclass(slots=True)
class LoRAConfig:
    """Serving LoRA adapters (vLLM's names): at most `max_loras` adapters in one step (each a device slot), of
    rank up to `max_lora_rank`, with `max_cpu_loras` adapters kept in host memory (default max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _positive("LoRAConfig", max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                  max_cpu_loras=self.max_cpu_loras)
        if self.max_lora_rank > MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK_LIMIT}, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


SPECULATIVE_METHODS = ("ngram",)


def _batch_size_schedule(value: Any) -> list[tuple[int, int, int]]:
    """num_speculative_tokens_per_batch_size checked: (start, end, k) triples of ints, start <= end, k >= 0,
    ranges sorted without overlap, the first from batch size 1."""
    name = "speculative_config: num_speculative_tokens_per_batch_size"
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name} must be a non-empty list of [start, end, k], got {value!r}")
    schedule = []
    for entry in value:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise ValueError(f"{name}: each entry must be [start, end, k] of ints, got {entry!r}")
        start, end, k = entry
        if start < 1 or end < start or k < 0:
            raise ValueError(f"{name}: need 1 <= start <= end and k >= 0, got {list(entry)}")
        schedule.append((start, end, k))
    schedule.sort()
    if schedule[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at batch size 1, got {list(schedule[0])}")
    for (_, end, _), (start, _, _) in zip(schedule, schedule[1:], strict=False):
        if start <= end:
            raise ValueError(f"{name}: ranges overlap at batch size {start}")
    return schedule


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys; pagedkv.spec_decode): per step a decoding
    sequence proposes up to `num_speculative_tokens` draft tokens and the model checks them all in one forward.

    method "ngram" (prompt lookup): the drafts are the tokens that followed the longest earlier occurrence of the
    sequence's last n tokens, n in [prompt_lookup_min, prompt_lookup_max]; one of the two alone sets both, and
    neither gives 5 and 5 (vLLM's defaults).

    num_speculative_tokens_per_batch_size (vLLM's dynamic schedule): [[start, end, k], ...], inclusive ranges of
    the running batch size, sorted, the first from 1; a size between or past the ranges takes the k before it.
    Each k is capped at num_speculative_tokens, and 0 turns speculation off at those sizes: a batch large enough
    to keep the cores busy gains little from drafts and pays for the rejected ones.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_speculative_tokens_per_batch_size: list | None = None

    def __post_init__(self) -> None:
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(SPECULATIVE_METHODS)} (draft models, "
                             f"EAGLE and MTP heads are not supported), got {self.method!r}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config: num_speculative_tokens is required (drafts per step, e.g. 4)")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        _positive("speculative_config", num_speculative_tokens=self.num_speculative_tokens,
                  prompt_lookup_max=self.prompt_lookup_max, prompt_lookup_min=self.prompt_lookup_min)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.num_speculative_tokens_per_batch_size is not None:
            schedule = _batch_size_schedule(self.num_speculative_tokens_per_batch_size)
            self.num_speculative_tokens_per_batch_size = schedule

    def tokens_for_batch(self, batch_size: int) -> int:
        """Drafts per sequence for a step of `batch_size` running sequences."""
        k = self.num_speculative_tokens
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is None:
            return k
        chosen = schedule[0][2]
        for start, _, value in schedule:  # the last range starting at or before the size (gaps carry forward)
            if start > batch_size:
                break
            chosen = value
        return min(chosen, k)

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON string (the CLI's), a dict or a config; None stays None. Unknown keys are refused."""
        return parse_config(cls, "speculative_config", value)


POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")


@dataclass(slots=True)
class PoolerConfig:
    """How a pooling request's final hidden states become its vector (vLLM's `pooler_config` keys; pagedkv.pooler).

    pooling_type: "LAST" (the last prompt token's state: what causal embedding models such as Qwen3-Embedding and
    e5-mistral are trained for), "MEAN" (the mean over the prompt's tokens) or "CLS" (the first token's). None
    reads the checkpoint's sentence-transformers files (modules.json, 1_Pooling/config.json), else "LAST".
    normalize: L2-normalize the vector (None: true when the checkpoint has no sentence-transformers files or lists
    a Normalize module). dimensions: the default output size of a Matryoshka model (None: hidden_size).
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    # vLLM's newer names for the two above (pooling_type of a whole sequence; an embedding's activation).
    seq_pooling_type: str | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        for old, new in (("seq_pooling_type", "pooling_type"), ("use_activation", "normalize")):
            value = getattr(self, old)
            if value is not None:
                if getattr(self, new) is not None and getattr(self, new) != value:
                    raise ValueError(f"pooler_config: {old} and {new} disagree (they are the same setting)")
                setattr(self, new, value)
                setattr(self, old, None)
        if isinstance(self.pooling_type, str):
            self.pooling_type = self.pooling_type.upper()
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of {list(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config: normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None:
            _positive("pooler_config", dimensions=self.dimensions)

    @classmethod
    def parse(cls, value: str | dict | PoolerConfig | None) -> PoolerConfig | None:
        """From a JSON string (the CLI's), a dict or a config; None stays None. Unknown keys are refused."""
        return parse_config(cls, "pooler_config", value)


@dataclass(slots=True)
class EngineArgs:
    """Everything `LLM(...)` and `pagedkv serve` accept (vLLM's names and defaults)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = False
    swap_space: float = 4.0
    preemption_mode: str = "recompute"
    max_model_len: int | None = None
    seed: int = 0
    hash_algo: str = "sha256"
    long_prefill_token_threshold: int = 0
    skip_tokenizer_init: bool = False  # token-id prompts only, no output text (checkpoints without a tokenizer)
    tensor_parallel_size: int = 1  # ranks the model is sharded over (one per GPU; processes on the CPU)
    enforce_eager: bool = False  # CUDA: no captured decode graphs (every step launched kernel by kernel)
    max_logprobs: int = 20  # most logprobs a request may ask for (vLLM's default)
    # Sampling defaults for what a request leaves out: "auto" reads the checkpoint's generation_config.json,
    # "vllm" uses vLLM's own defaults, anything else is a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Where the engine core runs: "process" (its own process, the front end over ZeroMQ), "inproc" (in the
    # caller's process and thread), or "auto" (the server: process; LLM offline: inproc, measured faster).
    engine_core: str = "auto"
    # The core's compute CPUs (engine/cpu_binding.py): "auto", "all", "nobind" or a list such as "0-3";
    # None reads $PAGEDKV_CPU_THREADS_BIND.
    cpu_threads_bind: str | None = None
    # The KV cache's storage format (vLLM's name; pagedkv.kv_cache.KV_CACHE_DTYPES) and, for fp8, where its
    # per-layer scales come from (CacheConfig.calculate_kv_scales).
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool | None = None
    # Prefix-cache tiers below the pool (CacheConfig): host memory in GiB, a block-file directory and its cap.
    kv_offloading_size: float | None = None
    kv_cache_dir: str | None = None
    kv_cache_dir_size: float | None = None
    # KV cache events for routers (pagedkv.engine.kv_events): vLLM's KVEventsConfig as a JSON string or dict.
    kv_events_config: str | dict | None = None
    # Keys set over the checkpoint's config.json before the model is built (vLLM's hf_overrides), as a dict or
    # a JSON object: e.g. {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
    # "original_max_position_embeddings": 32768}} for a long context without editing the checkpoint.
    hf_overrides: str | dict | None = None
    # LoRA adapters (pagedkv.lora; vLLM's names): requests name one with a LoRARequest (the server's `model`).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (pagedkv.spec_decode; vLLM's speculative_config, a dict or a JSON object string):
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}.
    speculative_config: str | dict | SpeculativeConfig | None = None
    # Pooling (embeddings; pagedkv.pooler, vLLM's names): runner "auto" serves generation and pooling requests
    # alike, "generate" or "pooling" only that kind (convert="embed" is runner="pooling"); pooler_config says how
    # hidden states are pooled ({"pooling_type": "MEAN", "normalize": false}, a dict or a JSON object).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | dict | PoolerConfig | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {list(CONVERTS)} (classification and reward heads are not "
                             f"supported), got {self.convert!r}")
        if self.convert == "embed":
            if self.runner == "generate":
                raise ValueError("convert='embed' makes a pooling model: it cannot run with runner='generate'")
            self.runner = "pooling"
        kv_cache_format(self.kv_cache_dtype)  # a bad value fails here, before any model loads or process starts
        self.hf_overrides = parse_json_object("hf_overrides", self.hf_overrides)
        events = KVEventsConfig.parse(self.kv_events_config)
        if events is not None and events.enabled and not self.enable_prefix_caching:
            raise ValueError("kv_events_config: KV cache events report the prefix cache's blocks; they need "
                             "enable_prefix_caching=True (--enable-prefix-caching)")
        _check_calculate_kv_scales(self.calculate_kv_scales)
        _check_tiers(self)
        self.lora_config()  # bad LoRA limits fail here, before any model loads
        if (self.kv_offloading_size or self.kv_cache_dir) and self.tensor_parallel_size > 1:
            raise ValueError("kv_offloading_size / kv_cache_dir: the prefix-cache tiers run on one device "
                             f"(tensor_parallel_size=1), got tensor_parallel_size={self.tensor_parallel_size}")

    def lora_config(self) -> LoRAConfig | None:
        """None without enable_lora (the settings are still checked)."""
        config = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        return config if self.enable_lora else None

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                           kv_cache_memory=self.kv_cache_memory, swap_space=self.swap_space,
                           enable_prefix_caching=self.enable_prefix_caching, hash_algo=self.hash_algo,
                           cache_dtype=self.kv_cache_dtype, calculate_kv_scales=self.calculate_kv_scales,
                           kv_offloading_size=self.kv_offloading_size, kv_cache_dir=self.kv_cache_dir,
                           kv_cache_dir_size=self.kv_cache_dir_size)

    def scheduler_config(self, model_config: ModelConfig) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=_max_model_len(model_config, self.max_model_len), preemption_mode=self.preemption_mode,
            long_prefill_token_threshold=self.long_prefill_token_threshold)


def _max_model_len(cfg: ModelConfig, asked: int | None) -> int:
    limit = cfg.position_limit
    if asked is not None and asked > limit:
        what = ("max_position_embeddings" if limit == cfg.max_position_embeddings
                else "YaRN-stretched length (original_max_position_embeddings x factor)")
        raise ValueError(f"max_model_len={asked} exceeds the model's {what} ({limit})")
    # No cap at the sliding window: the attention ops take the window, and the block manager keeps only the
    # blocks inside it (ModelConfig.kv_sliding_window).
    return asked or limit
