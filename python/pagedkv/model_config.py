"""The architecture of a checkpoint, read from its HF `config.json`.

One dataclass serves every family in `pagedkv.supported.ARCHITECTURES`: the
fields every decoder has (sizes, heads, norms, rope) plus the ones some
families add, each with the value that means "not used" as its default:

* per-layer attention: `layer_types` ("full_attention" / "sliding_attention"
  per layer, as transformers 5 writes them) with `sliding_window`; sliding
  layers may have their own rope base (`rope_local_theta`, Gemma 3);
* Gemma: `hidden_act` gelu, `query_pre_attn_scalar`, attention and final
  logit soft-capping;
* Granite: embedding, residual, attention and logit multipliers;
* Phi: `partial_rotary_factor` (the share of each head that rotates);
* mixture of experts: `num_experts`, `num_experts_per_tok`,
  `moe_intermediate_size`, `norm_topk_prob`, which layers are dense, and the
  width of an always-on shared expert (Qwen2-MoE, Granite-MoE-shared);
* LayerNorm families (GPT-NeoX, Phi, StableLM, StarCoder2): the norms' eps
  sits in `rms_norm_eps` whatever the config calls it; `parallel_residual`
  (attention and MLP on the same input);
* SmolLM3: `no_rope_layers`, the layers that attend without rotary positions
  (NoPE); OLMo / OLMoE: `clip_qkv`, a clamp on the projected q, k and v.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.kv_cache import kv_cache_format
from pagedkv.supported import (
    ARCHITECTURES,
    HEADLESS_ARCHITECTURES,
    MODEL_TYPES,
    SUPPORTED_HEAD_SIZES,
    TEXT_OF_MULTIMODAL,
)

FULL, SLIDING = "full_attention", "sliding_attention"
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Families whose transformers config class ties the LM head to the embeddings unless config.json says otherwise;
# their published config.json files leave the key out (google/gemma-2-2b) and their checkpoints hold no
# lm_head.weight. Every other family defaults to an LM head of its own.
_TIED_BY_DEFAULT = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                    "SmolLM3ForCausalLM", "Starcoder2ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
                    "Ernie4_5ForCausalLM", "GPT2LMHeadModel", "GPTBigCodeForCausalLM", "OPTForCausalLM",
                    "FalconForCausalLM")
# Families whose q/k/v projections have a bias and whose output projection has none; the config says so with
# `attention_bias` (GLM) or `qkv_bias` (Qwen2-MoE), and each one's config class turns it on by default.
_QKV_BIAS_ONLY = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
                  "StableLmForCausalLM", "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# Families whose projections have biases unless config.json says otherwise (Phi's always do; GPT-NeoX's
# attention_bias and StarCoder2's use_bias default to true).
_BIASED_BY_DEFAULT = ("GPTNeoXForCausalLM", "PhiForCausalLM", "Starcoder2ForCausalLM", "GPT2LMHeadModel",
                      "GPTBigCodeForCausalLM", "OPTForCausalLM")
# Families whose MLP has biases and whose attention has none (GPT-J).
_MLP_BIASED_BY_DEFAULT = _BIASED_BY_DEFAULT + ("GPTJForCausalLM",)
# The config key of the norms' eps where it is not rms_norm_eps (the one the family's transformers code reads).
_EPS_KEYS = {"Starcoder2ForCausalLM": "norm_epsilon", "PhiForCausalLM": "layer_norm_eps",
             "GPTNeoXForCausalLM": "layer_norm_eps", "StableLmForCausalLM": "layer_norm_eps",
             "CohereForCausalLM": "layer_norm_eps", "Cohere2ForCausalLM": "layer_norm_eps",
             "NemotronForCausalLM": "norm_eps"}
# Families whose transformers code sizes heads as hidden_size / num_attention_heads whatever config.json says
# (GPT-NeoX also has no grouped KV heads: num_key_value_heads is ignored).
_HEAD_DIM_FROM_HIDDEN = ("GPTNeoXForCausalLM", "StableLmForCausalLM", "GPT2LMHeadModel", "GPTBigCodeForCausalLM",
                         "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "GPTJForCausalLM",
                         "OPTForCausalLM", "FalconForCausalLM")
# Families whose attention and MLP read the same input unless use_parallel_residual is false (GPT-NeoX).
_PARALLEL_BY_DEFAULT = ("GPTNeoXForCausalLM", "FalconForCausalLM")
# Families whose attention and MLP always read the same input (no config key says so).
_ALWAYS_PARALLEL = ("PhiForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "GPTJForCausalLM")
# Families that rotate in GPT-J's interleaved order (dims 2i and 2i + 1 form pair i), which the loader turns
# into the kernels' halves order (`rotary.interleaved_to_halves`).
_INTERLEAVED_ROTARY = ("GlmForCausalLM", "Glm4ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
                       "Ernie4_5ForCausalLM", "HeliumForCausalLM", "GPTJForCausalLM")
# Families whose `qk_layernorm` / `use_qk_norm` puts a LayerNorm on each q and k head before the rotation:
# StableLM-2-12B and Command R+ with each head's own weights, Phi with one shared over the heads.
_QK_LAYERNORM = ("StableLmForCausalLM", "CohereForCausalLM", "PhiForCausalLM")
# Families whose config.json honours `sliding_window` only with `use_sliding_window` set.
_WINDOW_SWITCHED = ("qwen", "smollm3")


def _positive(**values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ModelConfig: {name} must be a positive int, got {value!r}")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    model_type: str = ""
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6  # every norm's eps, RMS or LayerNorm (layer_norm_eps, norm_epsilon in config.json)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # False for a base model's checkpoint (HEADLESS_ARCHITECTURES, e.g. MistralModel): it runs pooling requests only
    # (an untied LM head is left at zero).
    has_lm_head: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0  # Granite divides the logits by it
    logit_scale: float = 1.0  # Cohere multiplies them by it
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    shared_expert_intermediate_size: int = 0
    no_rope_layers: tuple[int, ...] = ()
    clip_qkv: float | None = None
    parallel_residual: bool = False
    qk_layernorm: bool = False  # StableLM / Cohere / Phi: a LayerNorm on each q and k head (_QK_LAYERNORM)
    # Falcon: how its fused query_key_value orders q, k and v ("grouped", "multi_query", "per_head"), and how many
    # norms its parallel layer has (1: shared, 2: one for attention and one for the MLP).
    fused_qkv_layout: str | None = None
    parallel_norms: int = 1
    attention_out_bias: bool | None = None  # Seed-OSS sets the output projection's bias apart from q/k/v's
    max_model_len: int | None = None  # the engine's, set at load: LongRoPE picks its factors by it
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"pagedkv runs {', '.join(sorted(ARCHITECTURES))}")
        _positive(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                  num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                  head_dim=self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv must be a positive number or null, got {self.clip_qkv!r}")
        if self.head_dim not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"head_dim {self.head_dim} has no paged-attention kernel; supported: "
                             f"{SUPPORTED_HEAD_SIZES}")
        if not self.layer_types:
            kind = SLIDING if self.sliding_window else FULL
            self.layer_types = (kind,) * self.num_hidden_layers
        self._check_layers()

    def _check_layers(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported (pagedkv runs {FULL!r} and "
                             f"{SLIDING!r} layers)")
        if SLIDING in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(f"sliding-window layers need a positive sliding_window, got {self.sliding_window!r}")
        rotary = self.head_dim * self.partial_rotary_factor
        if not (0 < rotary <= self.head_dim and rotary == int(rotary) and int(rotary) % 2 == 0):
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives {rotary} rotary dims of "
                             f"head_dim {self.head_dim}; need an even count in (0, head_dim]")

    # --- derived ------------------------------------------------------------------------------------

    @property
    def position_limit(self) -> int:
        """The longest sequence the model runs: max_position_embeddings, or with YaRN the pretraining length
        stretched by its factor where that is longer (vLLM's rule: Qwen3's 32768 x 4 = 131072 over its 40960)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("factor"):
            original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
            stretched = int(original * scaling["factor"])
            return max(self.max_position_embeddings, stretched)
        return self.max_position_embeddings

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias: attention_bias, except in the families whose bias
        is on q/k/v only (Qwen2, Qwen2-MoE, GLM), and Seed-OSS's own `attention_out_bias`."""
        if self.attention_out_bias is not None:
            return self.attention_out_bias
        return self.attention_bias and self.architecture not in _QKV_BIAS_ONLY

    @property
    def rotary_interleaved(self) -> bool:
        """Whether the checkpoint rotates in GPT-J's interleaved order (GLM, Cohere, ERNIE 4.5, Helium): the
        loader permutes its q/k rows into the kernels' order."""
        return self.architecture in _INTERLEAVED_ROTARY

    @property
    def query_position_scale(self) -> tuple[float, int] | None:
        """(beta, length) where queries are scaled by 1 + beta * log(1 + floor(position / length)) after the
        rotation (Ministral 3's `llama_4_scaling_beta` over its pretraining length), else None."""
        scaling = self.rope_scaling or {}
        beta = scaling.get("llama_4_scaling_beta")
        if not beta:
            return None
        length = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        return float(beta), int(length)

    def layer_rotates(self, layer: int) -> bool:
        """Whether `layer` applies rotary positions (False for SmolLM3's NoPE layers)."""
        return layer not in self.no_rope_layers

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (its keys are the last `window` positions), 0 for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0

    @property
    def kv_sliding_window(self) -> int | None:
        """The window when every layer slides (blocks wholly outside it can be freed), else None.

        With one full-attention layer (Gemma 2/3) every block stays: that layer reads the whole context.
        """
        return self.sliding_window if all(t == SLIDING for t in self.layer_types) else None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """Softmax scale: Granite's attention_multiplier, Gemma's query_pre_attn_scalar^-1/2, else head_dim^-1/2."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def mlp_shard_size(self) -> int:
        """The MLP width tensor parallelism splits (the experts' width for an all-MoE model)."""
        return self.moe_intermediate_size if self.num_experts and self.moe_intermediate_size else self.intermediate_size

    # --- reading config.json ------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From the dict of an HF `config.json` (or `PretrainedConfig.to_dict()`)."""
        hf = _with_falcon_names(_with_opt_names(_with_gpt2_names(hf)))
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type", "")
        arch = archs[0] if archs else MODEL_TYPES.get(model_type, model_type)
        has_lm_head = arch not in HEADLESS_ARCHITECTURES
        arch = HEADLESS_ARCHITECTURES.get(arch, arch)
        if arch in TEXT_OF_MULTIMODAL and "text_config" in hf:
            hf = _text_config(hf)
            model_type = hf.get("model_type", "")
        qk_layernorm = bool(hf.get("qk_layernorm") or hf.get("use_qk_norm"))
        if qk_layernorm and arch not in _QK_LAYERNORM:
            key = "qk_layernorm" if hf.get("qk_layernorm") else "use_qk_norm"
            raise ValueError(f"{arch} with {key} (a LayerNorm over each q and k head) is not supported")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{arch} with use_bidirectional_attention is an encoder (embedding model); pagedkv "
                             "runs causal decoders")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        dtype = hf.get("torch_dtype") or hf.get("dtype")
        theta, scaling, local_theta, partial = _rope(hf)
        layers = hf["num_hidden_layers"]
        kinds = _layer_types(hf, model_type, layers)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size") or 0,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads if arch == "GPTNeoXForCausalLM" else hf.get("num_key_value_heads") or heads,
            head_dim=(hf["hidden_size"] // heads if arch in _HEAD_DIM_FROM_HIDDEN
                      else hf.get("head_dim") or hf["hidden_size"] // heads),
            model_type=model_type,
            hidden_act=_hidden_act(hf, model_type),
            rms_norm_eps=_first(hf, (_EPS_KEYS.get(arch, "rms_norm_eps"),), 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            partial_rotary_factor=partial,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in _TIED_BY_DEFAULT)),
            has_lm_head=has_lm_head,
            attention_bias=bool(_first(hf, ("attention_bias", "qkv_bias", "use_qkv_bias", "use_bias"),
                                       arch in _QKV_BIAS_ONLY + _BIASED_BY_DEFAULT)),
            mlp_bias=bool(_first(hf, ("mlp_bias", "use_bias"), arch in _MLP_BIASED_BY_DEFAULT)),
            sliding_window=_window(hf, model_type),
            layer_types=kinds,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            attention_multiplier=hf.get("attention_multiplier"),
            logits_scaling=float(hf.get("logits_scaling", 1.0)),
            num_experts=hf.get("num_local_experts") or hf.get("num_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            # Mixtral and Granite-MoE always renormalize (Granite: a softmax over the top-k logits, the same).
            norm_topk_prob=bool(hf.get("norm_topk_prob", model_type in ("mixtral", "granitemoe", "granitemoeshared"))),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            shared_expert_intermediate_size=(hf.get("shared_expert_intermediate_size")
                                             or hf.get("shared_intermediate_size") or 0),
            no_rope_layers=_no_rope_layers(hf, model_type, kinds),
            clip_qkv=hf.get("clip_qkv"),
            parallel_residual=arch in _ALWAYS_PARALLEL or bool(hf.get("use_parallel_residual",
                                                                      arch in _PARALLEL_BY_DEFAULT)),
            qk_layernorm=qk_layernorm,
            fused_qkv_layout=hf.get("fused_qkv_layout"),
            parallel_norms=hf.get("parallel_norms", 1),
            logit_scale=float(hf.get("logit_scale", 1.0)),
            attention_out_bias=hf.get("attention_out_bias"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=[] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos],
            torch_dtype=_DTYPE_NAMES.get(str(dtype).replace("torch.", "")) if dtype else None,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    # --- tensor parallelism and memory --------------------------------------------------------------

    def tensor_parallel_size_fits(self, tp: int) -> bool:
        """Whether the model shards over `tp` ranks: query heads, MLP width and vocabulary split evenly, and KV
        heads split evenly or (tp a multiple of them) replicated."""
        kv = self.num_key_value_heads
        return (tp >= 1 and self.num_attention_heads % tp == 0 and self.mlp_shard_size % tp == 0
                and self.intermediate_size % tp == 0 and self.shared_expert_intermediate_size % tp == 0
                and self.vocab_size % tp == 0 and (kv % tp == 0 or tp % kv == 0))

    def check_tensor_parallel_size(self, tp: int) -> None:
        """Refuses a tensor-parallel size the model does not shard over, listing those it does."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
        if not self.tensor_parallel_size_fits(tp):
            valid = [t for t in range(1, self.num_attention_heads + 1) if self.tensor_parallel_size_fits(t)]
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide this model ({self.num_attention_heads} attention heads, "
                f"{self.num_key_value_heads} KV heads, intermediate size {self.mlp_shard_size}, vocabulary "
                f"{self.vocab_size}); valid sizes: {valid}")

    def kv_bytes_per_token(self, dtype: torch.dtype, tensor_parallel_size: int = 1,
                           kv_cache_dtype: str = "auto") -> int:
        """KV-cache bytes one token takes on one device: 2 (K and V) x layers x kv heads x bytes per token and head.

        Bytes per token and head are head_dim x the element size for "auto" (the compute dtype `dtype`) and
        fp8, head_dim (int8) or head_dim / 2 (int4) bytes plus the 4-byte (scale, zero) pair for the
        per-token-head formats (`KVCacheFormat.bytes_per_token_head`). With tensor parallelism each device
        holds its share of the KV heads (at least one: heads are replicated when there are fewer than devices).
        """
        kv_heads = max(1, self.num_key_value_heads // tensor_parallel_size)
        per_head = kv_cache_format(kv_cache_dtype).bytes_per_token_head(self.head_dim, dtype)
        return 2 * self.num_hidden_layers * kv_heads * per_head


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's text model, with what the wrapper alone states (dtype, tokens), and the
    wrapper's tie_word_embeddings where it states one: the LM head belongs to the wrapper's model."""
    text = dict(hf["text_config"])
    for key in ("torch_dtype", "dtype", "bos_token_id", "eos_token_id"):
        if key in hf and text.get(key) is None:
            text[key] = hf[key]
    if hf.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(theta, scaling, local theta, partial rotary factor) from either config style.

    transformers 5 keeps rope settings in `rope_parameters`, keyed by layer type
    when sliding and full layers differ (Gemma 3); older configs have
    rope_theta / rope_scaling / rope_local_base_freq at the top level.
    """
    params = dict(hf.get("rope_parameters") or {})
    local = params.pop(SLIDING, None)
    params = params.pop(FULL, None) or params
    if local and local.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling on the sliding-window layers ({local.get('rope_type')!r}) is not supported; "
                         "pagedkv scales the full-attention layers' rotary positions only")
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "mrope":
        # Qwen2-VL's multimodal rotary: a text token's three position components (time, height, width) are all
        # its position, so every section turns by it and the rotation is the plain one.
        scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su", "yarn"):
        # Older Phi-3 configs (and some YaRN ones) keep the pretraining length at the top level.
        scaling = dict(scaling)
        scaling.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    # GPT-NeoX's and older StableLM configs name the base and the rotary share their own way.
    theta = float(hf.get("rope_theta", params.get("rope_theta", hf.get("rotary_emb_base", 10000.0))))
    local_theta = (local or {}).get("rope_theta", hf.get("rope_local_base_freq"))
    partial = float(_first(hf, ("partial_rotary_factor",), None) or params.get("partial_rotary_factor")
                    or _first(hf, ("rotary_pct", "rope_pct"), 1.0))
    return theta, dict(scaling) if scaling else None, None if local_theta is None else float(local_theta), partial


# GPT-2-style config keys (GPT-2, GPTBigCode) -> the names every other family uses.
_GPT2_NAMES = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
               "max_position_embeddings": "n_positions", "intermediate_size": "n_inner",
               "hidden_act": "activation_function", "rms_norm_eps": "layer_norm_epsilon"}


def _with_gpt2_names(hf: dict[str, Any]) -> dict[str, Any]:
    """A GPT-2-style config (GPT-2, GPTBigCode, GPT-J) with the common names filled in: sizes, 4 x hidden for a
    null n_inner, one KV head under multi_query, softmax scale 1 without scale_attn_weights, GPT-J's rotary_dim
    as a partial rotary factor; settings pagedkv does not run refused."""
    if hf.get("model_type") not in ("gpt2", "gpt_bigcode", "gptj"):
        return hf
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("add_cross_attention"):
        key = "scale_attn_by_inverse_layer_idx" if hf.get("scale_attn_by_inverse_layer_idx") else "add_cross_attention"
        raise ValueError(f"{hf['model_type']} with {key} is not supported")
    out = dict(hf)
    for name, alias in _GPT2_NAMES.items():  # the GPT-2 name is the one the family's code reads
        if out.get(alias) is not None:
            out[name] = out[alias]
    out["intermediate_size"] = hf.get("n_inner") or 4 * out["hidden_size"]
    out["num_key_value_heads"] = 1 if out.get("multi_query") else out["num_attention_heads"]
    if out.get("scale_attn_weights") is False:
        out["attention_multiplier"] = 1.0
    if hf.get("model_type") == "gptj" and hf.get("rotary_dim"):
        out["partial_rotary_factor"] = hf["rotary_dim"] / (out["hidden_size"] // out["num_attention_heads"])
    return out


def _with_opt_names(hf: dict[str, Any]) -> dict[str, Any]:
    """An OPT config with the common names: ffn_dim, activation_function, enable_bias, LayerNorm's eps 1e-5 (no
    key holds it), no grouped KV heads; its post-norm layout (opt-350m) and projected embeddings are refused."""
    if hf.get("model_type") != "opt":
        return hf
    refused = [key for key, ok in (("do_layer_norm_before", hf.get("do_layer_norm_before", True)),
                                   ("word_embed_proj_dim", hf.get("word_embed_proj_dim") in (None, hf["hidden_size"])),
                                   ("layer_norm_elementwise_affine", hf.get("layer_norm_elementwise_affine", True)),
                                   ("_remove_final_layer_norm", not hf.get("_remove_final_layer_norm")))
               if not ok]
    if refused:
        raise ValueError(f"OPT with {refused[0]}={hf.get(refused[0])!r} (opt-350m's post-norm layout or projected "
                         f"embeddings) is not supported")
    bias = hf.get("enable_bias", True)
    return dict(hf, intermediate_size=hf.get("ffn_dim"), hidden_act=hf.get("activation_function", "relu"),
                rms_norm_eps=1e-5, attention_bias=bias, mlp_bias=bias,
                num_key_value_heads=hf["num_attention_heads"])  # no grouped KV heads


def _with_falcon_names(hf: dict[str, Any]) -> dict[str, Any]:
    """A Falcon config with the common names: its own size keys (n_embed, n_head, n_head_kv, n_layer),
    num_kv_heads under the new decoder architecture (else one KV head under multi_query, or one per head),
    ffn_hidden_size (4 x hidden by default), bias, parallel_attn, and its fused q/k/v layout; ALiBi and the
    new decoder architecture without parallel attention (which transformers cannot run either) are refused."""
    if hf.get("model_type") != "falcon":
        return hf
    if hf.get("alibi"):
        raise ValueError("Falcon with alibi (Falcon-RW) is not supported: pagedkv's kernels use rotary positions")
    new_arch, parallel = hf.get("new_decoder_architecture", False), hf.get("parallel_attn", True)
    if new_arch and not parallel:
        raise ValueError("Falcon with new_decoder_architecture and parallel_attn false is not supported")
    out = dict(hf)
    for name, alias in (("hidden_size", "n_embed"), ("num_attention_heads", "n_head"),
                        ("num_hidden_layers", "n_layer"), ("num_kv_heads", "n_head_kv")):
        if out.get(alias) is not None:
            out[name] = out[alias]
    heads = out["num_attention_heads"]
    kv = out.get("num_kv_heads") or heads
    multi_query = not new_arch and hf.get("multi_query", True)
    out.update(num_key_value_heads=1 if multi_query else kv,
               intermediate_size=hf.get("ffn_hidden_size") or 4 * out["hidden_size"],
               hidden_act=hf.get("activation", "gelu"), rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
               attention_bias=bool(hf.get("bias", False)), mlp_bias=bool(hf.get("bias", False)),
               use_parallel_residual=parallel,
               fused_qkv_layout="grouped" if new_arch else "multi_query" if multi_query else "per_head",
               parallel_norms=(hf.get("num_ln_in_parallel_attn") or 2) if new_arch else 1)
    return out


def _first(hf: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """The value of the first of `keys` that config.json sets (not null), else `default`."""
    return next((hf[k] for k in keys if hf.get(k) is not None), default)


def _hidden_act(hf: dict[str, Any], model_type: str) -> str:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    # Gemma 1's published configs say "gelu" and mean the tanh approximation (transformers and vLLM read it so).
    return "gelu_pytorch_tanh" if model_type == "gemma" and act == "gelu" else act


def _no_rope_layers(hf: dict[str, Any], model_type: str, kinds: tuple[str, ...]) -> tuple[int, ...]:
    """The layers without rotary positions (NoPE), given each layer's attention kind. SmolLM3: `no_rope_layers`
    flags each layer 1 (rotates) or 0, else every `no_rope_layer_interval`-th layer skips them. Cohere 2 and
    EXAONE 4 with a window: their full-attention layers. GPT-2, OPT: every layer (their positions are learned)."""
    layers = len(kinds)
    if model_type == "cohere2" or (model_type == "exaone4" and _window(hf, model_type)):
        return tuple(i for i, kind in enumerate(kinds) if kind == FULL)
    if model_type in ("gpt2", "gpt_bigcode", "opt"):  # learned absolute positions instead
        return tuple(range(layers))
    flags = hf.get("no_rope_layers")
    if flags is None and hf.get("no_rope_layer_interval"):
        interval = hf["no_rope_layer_interval"]
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not flags:
        return ()
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


def _window(hf: dict[str, Any], model_type: str) -> int | None:
    # Qwen2/3 and SmolLM3 configs carry a sliding_window that only applies with use_sliding_window.
    if model_type.startswith(_WINDOW_SWITCHED) and not hf.get("use_sliding_window", False):
        return None
    return hf.get("sliding_window") or None


def _layer_types(hf: dict[str, Any], model_type: str, layers: int) -> tuple[str, ...]:
    """Per-layer attention kinds: config.json's `layer_types`, else each family's published rule."""
    window = _window(hf, model_type)
    if not window:
        return (FULL,) * layers
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    if model_type == "gemma2":  # even layers slide
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(layers))
    if model_type == "gemma3_text":  # five sliding layers, then one full
        pattern = hf.get("sliding_window_pattern", 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    if model_type == "exaone4":  # a period (4: three sliding, one full) or letters, L sliding and G full
        pattern = hf.get("sliding_window_pattern", 4)
        if isinstance(pattern, str):
            return tuple(SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(layers))
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    if model_type.startswith("qwen"):  # layers from max_window_layers on slide
        first = hf.get("max_window_layers", layers)
        return tuple(SLIDING if i >= first else FULL for i in range(layers))
    return (SLIDING,) * layers
