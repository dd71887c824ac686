"""Dataclass configs of the engine, validated in __post_init__.

The names are vLLM's, so that a vLLM launch line reads the same here:
`gpu_memory_utilization`, `max_num_batched_tokens`, `max_num_seqs`,
`block_size`, `enable_prefix_caching`, `swap_space`, `preemption_mode`,
`max_model_len`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
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
class ModelConfig:
    """The architecture of a Llama-family checkpoint, read from its HF `config.json`.

    Llama (with Llama-3 rope scaling), Mistral, Qwen2 (QKV bias) and SmolLM2
    share this decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: torch.dtype | None = None

    SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    def __post_init__(self) -> None:
        if self.architecture not in self.SUPPORTED:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"pagedkv runs {', '.join(self.SUPPORTED)}")
        _positive("ModelConfig", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                  num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                  num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"head_dim {self.head_dim} has no paged-attention kernel; supported: "
                             f"{SUPPORTED_HEAD_SIZES}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From the dict of an HF `config.json` (or `PretrainedConfig.to_dict()`)."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type", "")
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                       "qwen2": "Qwen2ForCausalLM"}.get(model_type, model_type)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_list = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        # Transformers 5 keeps rope parameters in `rope_parameters`; older configs
        # have rope_theta / rope_scaling at the top level.
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        window = hf.get("sliding_window") if hf.get("use_sliding_window", model_type != "qwen2") else None
        dtype = hf.get("torch_dtype") or hf.get("dtype")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_list,
            torch_dtype=_DTYPES.get(str(dtype).replace("torch.", "")) if dtype else None,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @property
    def kv_sliding_window(self) -> int | None:
        """The window (tokens) the KV cache may be bounded by: set only when every layer attends within it.

        Then no layer reads a key older than the window, and the block manager
        releases the blocks before it as sequences grow. A model where only some
        layers slide (Gemma 2 style) must keep every block for its full-attention
        layers: None there. Today every supported model slides in all layers or none.
        """
        return self.sliding_window or None

    def tensor_parallel_size_fits(self, tp: int) -> bool:
        """Whether the model shards over `tp` ranks: query heads, MLP width and vocabulary split evenly, and KV
        heads split evenly or (tp a multiple of them) replicated."""
        kv = self.num_key_value_heads
        return (tp >= 1 and self.num_attention_heads % tp == 0 and self.intermediate_size % tp == 0
                and self.vocab_size % tp == 0 and (kv % tp == 0 or tp % kv == 0))

    def check_tensor_parallel_size(self, tp: int) -> None:
        """Refuses a tensor-parallel size the model does not shard over, listing those it does."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
        if not self.tensor_parallel_size_fits(tp):
            valid = [t for t in range(1, self.num_attention_heads + 1) if self.tensor_parallel_size_fits(t)]
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide this model ({self.num_attention_heads} attention heads, "
                f"{self.num_key_value_heads} KV heads, intermediate size {self.intermediate_size}, vocabulary "
                f"{self.vocab_size}); valid sizes: {valid}")

    def kv_bytes_per_token(self, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
        """KV-cache bytes one token takes on one device: 2 (K and V) x layers x kv heads x head_dim x dtype bytes.

        With tensor parallelism each device holds its share of the KV heads
        (at least one: heads are replicated when there are fewer than devices).
        """
        kv_heads = max(1, self.num_key_value_heads // tensor_parallel_size)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * kv_heads * self.head_dim * itemsize


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache: block size, how much memory it gets, prefix caching, swap space."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; overrides the sizing rule on any device
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    enable_prefix_caching: bool = False
    watermark: float = 0.01
    hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")


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

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                           kv_cache_memory=self.kv_cache_memory, swap_space=self.swap_space,
                           enable_prefix_caching=self.enable_prefix_caching, hash_algo=self.hash_algo)

    def scheduler_config(self, model_config: ModelConfig) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=_max_model_len(model_config, self.max_model_len), preemption_mode=self.preemption_mode,
            long_prefill_token_threshold=self.long_prefill_token_threshold)


def _max_model_len(cfg: ModelConfig, asked: int | None) -> int:
    limit = cfg.max_position_embeddings
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len={asked} exceeds the model's max_position_embeddings ({limit})")
    # No cap at the sliding window: the attention ops take the window, and the block manager keeps only the
    # blocks inside it (ModelConfig.kv_sliding_window).
    return asked or limit
