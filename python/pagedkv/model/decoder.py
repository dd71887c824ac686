"""What the decoder families share: the attention block, the gated MLP, and the causal-LM shell.

Each family module (llama.py, qwen3.py, gemma.py, ...) composes these with its
own layer (where its norms sit) and its checkpoint names. The shell runs one
flat batch per step: `input_ids` and `positions` [num_tokens] from many
sequences, prefill chunks and decode tokens mixed, no padding; logits are
computed separately (`compute_logits`) and only for the rows that are sampled.

The residual stream is carried as (hidden, residual) pairs whose sum is the
stream, so that each norm can be vLLM's fused_add_rms_norm (one pass adds the
residual and normalizes); a layer that keeps no separate residual returns
(stream, None).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv import ops
from pagedkv.model.attention import AttentionMetadata, PagedAttention
from pagedkv.model.kv_scales import checkpoint_scale_value, kv_scale_target
from pagedkv.model.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    PerHeadLayerNorm,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedkv.model.parallel_state import all_gather_last_dim, get_tp_rank, get_tp_size
from pagedkv.model.protocol import KVCache
from pagedkv.model.rotary import (
    NoRotation,
    RotaryEmbedding,
    StepPositions,
    interleaved_to_halves,
    qk_rows_in_halves_order,
)
from pagedkv.model_config import ModelConfig

# (our fused parameter, checkpoint part, shard) for checkpoints that store q/k/v and gate/up apart.
STACKED_PARAMS = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                  ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


# Gated activations by HF's `hidden_act` / `hidden_activation` names.
_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
                "gelu_tanh": partial(F.gelu, approximate="tanh")}
# The plain (ungated) MLPs' too: transformers' gelu_new and gelu_fast are the tanh approximation (Phi, GPT-J).
_PLAIN_ACTIVATIONS = _ACTIVATIONS | {"gelu_new": _ACTIVATIONS["gelu_tanh"], "gelu_fast": _ACTIVATIONS["gelu_tanh"],
                                     "relu": F.relu,  # OPT's
                                     "relu2": lambda x: F.relu(x).square_()}  # Arcee's (Nemotron's) squared ReLU


def split_gate_up(name: str, tensor, intermediate_size: int) -> tuple[tuple[str, int, object], ...]:
    """A checkpoint's fused gate_up_proj [2 I, hidden] (Phi-3, GLM, Granite-MoE's shared expert) -> its gate
    and up rows as the two parts of pagedkv's merged projection (loaded per part, so each tensor-parallel rank
    takes its own columns)."""
    i = intermediate_size
    return (name, 0, tensor.narrow(0, 0, i)), (name, 1, tensor.narrow(0, i, i))


def check_activation(act: str, table: dict = _ACTIVATIONS) -> None:
    if act not in table:
        raise ValueError(f"unsupported hidden activation {act!r}; pagedkv runs {', '.join(table)}")


# The fused op of each activation (pagedkv.ops): one pass instead of act(gate) into a new tensor, then
# an in-place product (0.37 s instead of 0.60 s of a ~13 s offline run of the default model in bf16 on a
# 2-core Zen 4; bench/results/offline_profile_cpu.md).
_FUSED_ACTIVATIONS = {"silu": ops.silu_and_mul, "gelu": ops.gelu_and_mul, "gelu_pytorch_tanh": ops.gelu_tanh_and_mul,
                      "gelu_tanh": ops.gelu_tanh_and_mul}


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """Gated activation: x = [gate | up] [*, 2d] -> act(gate) * up [*, d] (SwiGLU for silu, GeGLU for gelu)."""
    check_activation(act)
    d = x.shape[-1] // 2
    if x.dim() == 2 and x.stride(-1) == 1 and ops.fused_ops_supported(x):
        out = x.new_empty(x.shape[0], d)
        _FUSED_ACTIVATIONS[act](out, x)
        return out
    return _ACTIVATIONS[act](x[..., :d]).mul_(x[..., d:])


def add_and_norm(norm: RMSNorm, hidden: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm on the (hidden, residual) pair: (norm(stream), stream), stream = hidden + residual.

    The first layer has no residual yet (its input is the stream); the others fuse the add into the norm.
    """
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one column-parallel GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        check_activation(act)  # an unknown activation fails at build time, not in the first step
        self.act = act
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))): the ungated MLP of GPT-NeoX, Phi, GPT-J, StarCoder2, GPT-2, OPT and Arcee (fc1
    column-parallel, fc2 row-parallel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = True) -> None:
        super().__init__()
        check_activation(act, _PLAIN_ACTIVATIONS)
        self.act = _PLAIN_ACTIVATIONS[act]
        self.fc1 = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.fc2 = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def decoder_mlp(cfg: ModelConfig, gated: bool) -> nn.Module:
    """A layer's dense feed-forward block from the config: gated (SwiGLU / GeGLU) or plain, biased per mlp_bias."""
    cls = GatedMLP if gated else PlainMLP
    return cls(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)


class DecoderAttention(nn.Module):
    """QKV projection, optional q/k RMSNorm, rotary + cache write, paged attention, output projection.

    qk_norm: None; "head" (one RMSNorm over each head's dims: Qwen3, Gemma 3; a LayerNorm for Phi); "per_head"
    (a LayerNorm over each head with each head's own weight: StableLM-2-12B, Command R+); or "full" (over all
    heads' dims of the projection: OLMo 2, OLMoE; under tensor parallelism q and k are gathered for it).
    rope: the layer's rotary table, or a `NoRotation` for a NoPE layer.
    """

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding | NoRotation, *,
                 qk_norm: str | None = None, norm_cls: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.head_dim = d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.clip_qkv = cfg.clip_qkv  # OLMoE: q, k and v clamped to [-clip, clip] after the q/k norms
        self.query_scale = cfg.query_position_scale  # Ministral 3: (beta, length) of a per-position q scale
        self.rotary_emb = rope  # shared by the layers that use the same table (registered once per model)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = norm_cls(d, cfg.rms_norm_eps), norm_cls(d, cfg.rms_norm_eps)
        elif qk_norm == "per_head":
            proj, rank = self.qkv_proj, get_tp_rank()
            self.q_norm = PerHeadLayerNorm(proj.num_heads, d, rank * proj.num_heads, cfg.rms_norm_eps)
            self.k_norm = PerHeadLayerNorm(proj.num_kv_heads, d, rank // proj.kv_replicas * proj.num_kv_heads,
                                           cfg.rms_norm_eps)
        elif qk_norm == "full":
            if self.qkv_proj.kv_replicas > 1:
                raise ValueError("a q/k norm over all heads needs num_key_value_heads divisible by the "
                                 "tensor-parallel size")
            self.q_norm = norm_cls(cfg.num_attention_heads * d, cfg.rms_norm_eps)
            self.k_norm = norm_cls(cfg.num_key_value_heads * d, cfg.rms_norm_eps)
        elif qk_norm is not None:
            raise ValueError(f"qk_norm must be None, 'head', 'per_head' or 'full', got {qk_norm!r}")
        self.attn = PagedAttention(self.num_heads, d, self.num_kv_heads, cfg.attention_scale,
                                   sliding_window=cfg.layer_window(layer),
                                   logits_soft_cap=cfg.attn_logit_softcapping or 0.0)
        # The checkpoint's fp8 KV-cache scales of this layer, if it has them (plain floats, not parameters: a
        # checkpoint without them is complete); the runner copies them into the layer's KVCache.
        self.k_scale: float | None = None
        self.v_scale: float | None = None

    def forward(self, hidden: torch.Tensor, pos: StepPositions, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden_size] -> attention output [T, hidden_size] (this step's K/V written to the cache)."""
        t, d = hidden.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) * D]
        qs, ks = self.num_heads * d, self.num_kv_heads * d
        q, k = qkv[:, :qs], qkv[:, qs:qs + ks]
        if self.qk_norm == "head":
            q, k = self.q_norm(q.reshape(-1, d)), self.k_norm(k.reshape(-1, d))
        elif self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm == "full":
            q, k = self._full_norm(self.q_norm, q), self._full_norm(self.k_norm, k)
        v = qkv[:, qs + ks:].view(t, self.num_kv_heads, d)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = self.rotary_emb.apply(pos, q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v, kv_cache,
                                  meta.slot_mapping, calibrate=meta.calibrate_kv_scales)
        if self.query_scale is not None:
            q = q * pos.query_scale(*self.query_scale)
        return self.o_proj(self.attn(q, kv_cache, meta))

    @staticmethod
    def _full_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over every rank's heads: gathers this rank's [T, n] slice, normalizes, keeps the slice."""
        tp = get_tp_size()
        if tp == 1:
            return norm(x.contiguous())
        n = x.shape[1]
        return norm(all_gather_last_dim(x.contiguous())).narrow(1, get_tp_rank() * n, n).contiguous()


class TextOfMultimodal:
    """Mixin for a multimodal checkpoint's causal LM run on text prompts (Gemma 3, Mistral 3, Qwen2/2.5/3-VL):
    the vision tower's and projector's tensors are skipped, and the text model's are read under their own names
    whether the checkpoint keeps them at `language_model.model.` (transformers 4), `model.language_model.`
    (transformers 5) or `model.` (Qwen2.5-VL as published)."""

    VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.")

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        if name.startswith(self.VISION_PREFIXES):
            return ()
        return super().split_checkpoint_tensor(  # type: ignore[misc]
            name.removeprefix("language_model.").removeprefix("model."), tensor)


class ParallelResidualLayer(nn.Module):
    """Attention and MLP side by side on the same input: out = x + attn(norm(x)) + mlp(norm'(x)).

    GPT-NeoX normalizes the MLP's input apart (`post_attention_layernorm`); Phi, StableLM and Cohere share one
    norm (shared_norm). The MLP is gated (StableLM, Cohere) or plain (GPT-NeoX, Phi). qk_norm: the attention's
    (DecoderAttention; a "head" norm is of norm_cls). The (hidden, residual) pair it returns sums to `out`.
    """

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding | NoRotation, *,
                 norm_cls: type[nn.Module], shared_norm: bool, gated: bool, qk_norm: str | None = None) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer, rope, qk_norm=qk_norm, norm_cls=norm_cls)
        self.mlp = decoder_mlp(cfg, gated)
        self.input_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = None if shared_norm else norm_cls(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, pos: StepPositions, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else residual.add_(hidden)
        normed = self.input_layernorm(stream)
        out = self.self_attn(normed, pos, kv_cache, meta)
        mlp_in = normed if self.post_attention_layernorm is None else self.post_attention_layernorm(stream)
        return out.add_(self.mlp(mlp_in)), stream


class SandwichNormLayer(nn.Module):
    """Each sublayer's input and output normalized (Gemma 2/3, GLM-4-0414):
        h = x + post_attention_layernorm(attn(input_layernorm(x)))
        out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    NORM_CLS is the norm (Gemma's (1 + w) one in Gemma), QK_NORM the attention's q/k norm (Gemma 3's per head).
    """

    NORM_CLS: type[nn.Module] = RMSNorm
    QK_NORM: str | None = None

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding | NoRotation) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer, rope, qk_norm=self.QK_NORM, norm_cls=self.NORM_CLS)
        self.mlp = decoder_mlp(cfg, gated=True)
        norm, size, eps = self.NORM_CLS, cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = norm(size, eps), norm(size, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(size, eps), norm(size, eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, pos: StepPositions, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, pos, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class DecoderForCausalLM(nn.Module):
    """The shell every family shares: embedding, layers, final norm, LM head, weight loading.

    A family passes its layer factory `make_layer(cfg, index, rope_for_layer) -> nn.Module` whose forward is
    `(hidden, residual, pos, kv_cache, meta) -> (hidden, residual)`, and overrides the hooks it needs:
    `embed` (scaled embeddings, GPT-2's learned positions), `checkpoint_target` / `split_checkpoint_tensor`
    (checkpoint names), `norm_cls` (Gemma's 1 + w, LayerNorm).
    """

    norm_cls: type[nn.Module] = RMSNorm  # RMSNorm, Gemma's (1 + w), or LayerNorm
    LM_HEAD_BIAS = False  # Phi's LM head has a bias

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[ModelConfig, int, RotaryEmbedding], nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling, cfg.rotary_dim, cfg.max_model_len)
        # NoPE layers (SmolLM3, Cohere 2, EXAONE 4; every layer of GPT-2, whose positions are learned embeddings).
        self.no_rotation = NoRotation() if cfg.no_rope_layers else None
        # Gemma 3's sliding layers rotate with their own base.
        self.rotary_emb_local = (RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta,
                                                 None, cfg.rotary_dim, cfg.max_model_len)
                                 if cfg.rope_local_theta is not None else None)
        self.layers = nn.ModuleList(make_layer(cfg, i, self.rope_for_layer(i)) for i in range(cfg.num_hidden_layers))
        # GPT-J-order checkpoints: the q/k rows' permutation into the kernels' order, applied at load.
        self._rotary_order = interleaved_to_halves(cfg.head_dim, cfg.rotary_dim) if cfg.rotary_interleaved else None
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, bias=self.LM_HEAD_BIAS))

    def rope_for_layer(self, layer: int) -> RotaryEmbedding | NoRotation:
        if not self.config.layer_rotates(layer):
            return self.no_rotation
        if self.rotary_emb_local is not None and self.config.layer_window(layer):
            return self.rotary_emb_local
        return self.rotary_emb

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (what its cache stores)."""
        return self.layers[0].self_attn.num_kv_heads

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] -> the first layer's input [num_tokens, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite
            hidden = hidden.mul_(self.config.embedding_multiplier)
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] -> hidden states [num_tokens, hidden_size] (pre-final-norm)."""
        hidden = self.embed(input_ids, positions)
        pos = StepPositions(positions, ops.fused_ops_supported(hidden), hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, pos, kv_cache, meta)
        return hidden if residual is None else residual.add_(hidden)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of `forward`'s output [n, hidden_size] -> the model's final hidden states [n, hidden_size] (after
        its last norm): what pooling (embeddings) reads, and what the LM head would."""
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rows of `forward`'s output to sample from [n, hidden_size] -> float32 logits [n, vocab_size].

        Under tensor parallelism every rank calls it; only rank 0 gets the logits (None elsewhere).
        Gemma 2's final soft-cap and Granite's and Cohere's logit scaling apply here, on the sampled rows only.
        """
        logits = self.lm_head.logits(self.norm(hidden))
        if logits is None:
            return None
        cfg = self.config
        if cfg.logits_scaling != 1.0:
            logits.div_(cfg.logits_scaling)
        if cfg.logit_scale != 1.0:  # Cohere
            logits.mul_(cfg.logit_scale)
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    # --- weights ------------------------------------------------------------------------------------

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name (without "model.") -> (our parameter, shard id), or None to skip it."""
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        for fused, part, shard in STACKED_PARAMS:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def checkpoint_kv_scales(self) -> list[tuple[float | None, float | None]]:
        """Per layer, the checkpoint's (k_scale, v_scale) for an fp8 KV cache (None where it has none)."""
        return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in self.layers]

    def load_kv_scale(self, name: str, tensor) -> bool:
        """Keeps `name`'s value if it is a KV-cache scale (pagedkv.model.kv_scales); False for other tensors."""
        target = kv_scale_target(name)
        if target is None:
            return False
        layer, which = target
        if which and layer < len(self.layers):  # "": an attention scale the KV cache does not use
            value = checkpoint_scale_value(tensor)
            attn = self.layers[layer].self_attn
            if "k" in which:
                attn.k_scale = value
            if "v" in which:
                attn.v_scale = value
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (HF names) into the parameters; returns the names of those loaded.

        KV-cache scales are kept on their layer's attention (`checkpoint_kv_scales`), not loaded as parameters.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.load_kv_scale(name, tensor):
                continue
            for target, shard, part in self.split_checkpoint_tensor(name.removeprefix("model."), tensor):
                self._load_one(params, target, shard, part, name)
                loaded.add(target)
        return loaded

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        """(our parameter, shard id, tensor) for one checkpoint tensor: usually one, none if skipped.

        Families whose checkpoints fuse what pagedkv keeps apart (or the reverse) override it. A GPT-J-order
        checkpoint's q/k rows are permuted here (`ModelConfig.rotary_interleaved`).
        """
        if self._rotary_order is not None:
            cfg = self.config
            tensor = qk_rows_in_halves_order(name, tensor, cfg.num_attention_heads, cfg.num_key_value_heads,
                                             self._rotary_order)
        target = self.checkpoint_target(name)
        return () if target is None else ((target[0], target[1], tensor),)

    def _load_one(self, params: dict[str, nn.Parameter], target: str, shard, tensor, name: str) -> None:
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {self.config.architecture}")
        with torch.no_grad():  # the loaders copy_ into the parameter, which converts the dtype
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
