"""Every family in the model registry against HF transformers on tiny random checkpoints.

Each checkpoint is made here from transformers' config classes (seeded, float32,
`save_pretrained`) with the family's distinctive features switched on and set
away from their neutral values, so that a missing feature shows in the logits:

* qwen3: per-head q/k RMSNorm, tied embeddings;
* gemma2: (1 + w) norms, four norms per layer, scaled embeddings, GeGLU,
  alternating sliding/full layers with a window shorter than the prompts,
  attention and final logit soft-capping (caps small enough to bite),
  query_pre_attn_scalar != head_dim;
* gemma3: per-head q/k norms, a sliding/full pattern, per-layer rope bases,
  linear rope scaling on the full layers; gemma3_mm: the text model of a
  multimodal (Gemma3ForConditionalGeneration) checkpoint, vision tower skipped;
* phi3: fused qkv and gate_up in the checkpoint, a partial rotary factor,
  every layer sliding; LongRoPE (short and long factors, the cos/sin factor);
* olmo2: post-norms and a q/k norm over all heads;
* granite: embedding, residual, attention and logit multipliers;
* mistral_window: Mistral with every layer sliding (window < prompt);
* mixtral, qwen3_moe: top-k mixtures of experts (fused expert path);
* gemma: Gemma 1, the Llama layer with (1 + w) norms, scaled embeddings, GeGLU;
* smollm3: NoPE on every second layer (`no_rope_layers`);
* olmo3: OLMo 2's layer with alternating sliding/full layers and their own rope bases;
* qwen2_moe: routed experts without renormalization plus a sigmoid-gated
  shared expert, q/k/v bias, one dense layer;
* olmoe: experts with a q/k norm over all heads and `clip_qkv` small enough to bite;
* granitemoe, granitemoeshared: stacked expert tensors, Granite's multipliers,
  and an ungated shared expert;
* glm, glm4: interleaved (GPT-J order) partial rotary, q/k/v bias, fused
  gate_up; GLM-4-0414's post-sublayer norms;
* starcoder2: LayerNorms with bias, an ungated MLP, biases everywhere, a window;
* stablelm: LayerNorms, q/k/v bias only, a quarter of each head rotating; and
  the parallel-residual variant with one shared norm; stablelm_qk: StableLM-2-12B's
  per-head q/k LayerNorms (each head its own weight, one module per head);
* phi: parallel attention and MLP on one norm, `dense`, an LM head with bias;
  phi_qk: one LayerNorm (with bias) over each q and k head;
* gpt_neox: per-head fused query_key_value, parallel residual with two norms,
  and the sequential variant;
* cohere, cohere2: bias-free LayerNorm, parallel residual, interleaved rotary
  over the whole head, logit_scale; Cohere 2's sliding layers and NoPE full layers;
  cohere_qk: Command R+'s per-head q/k LayerNorms under the interleaved rotary;
* gpt2, gpt_bigcode: learned absolute positions and no rotary; GPT-2's Conv1D
  weights; GPTBigCode's multi-query attention (one KV head);
* ministral3, mistral3_mm: YaRN and queries scaled by position past the
  pretraining length; the text model of a Mistral 3 multimodal checkpoint;
* ernie4_5, helium: interleaved rotary over the whole head (ERNIE with biases
  everywhere); seed_oss: q/k/v bias without an output bias; arcee: a squared-ReLU
  ungated MLP; exaone4: OLMo 2's post-norms with per-head q/k norms, three sliding
  layers and a NoPE full layer;
* qwen2_5_vl, qwen3_vl: the text model of a vision-language checkpoint (M-RoPE on
  text positions is the plain rotation), vision tower skipped;
* gptj: Phi's parallel layer with interleaved partial rotary, no attention
  biases, an LM head with bias; opt: learned positions offset by 2, ReLU MLP,
  biases everywhere, a final LayerNorm; nemotron: LayerNorm1P (1 + w, with bias),
  a squared-ReLU ungated MLP, a quarter of each head rotating;
* falcon, falcon_new, falcon_seq: Falcon-7B's multi-query fused q/k/v with one
  shared norm, the new decoder architecture's KV-grouped fused q/k/v with two
  norms and biases, and the per-head fused q/k/v with a sequential layer.

For each: prompt logits and mixed flat batches (decodes and prefill chunks,
chunks after a cached prefix) equal HF's to fp32 tolerance, and `LLM.generate`
greedy ids equal HF `generate` on several prompts batched together.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_util import (
    CPU,
    VOCAB,
    PagedRunner,
    assert_close_fp32,
    assert_greedy_matches_hf,
    assert_same_greedy,
    copy_checkpoint,
    edit_config,
    hf_logits,
    mixed_batch,
    mixed_reference,
    random_tokens,
    randomize,
    torch_threads,
)
from pagedkv.model.loader import ModelSource, load_model

transformers = pytest.importorskip("transformers")

WINDOW = 24  # shorter than the longest prompts (45, 51 tokens), not a multiple of the block size
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
               initializer_range=0.1, rms_norm_eps=1e-6)
_ALTERNATING = ["sliding_attention", "full_attention"]
# For the families whose head size is hidden_size / num_attention_heads (they read no head_dim).
_WIDE = _COMMON | {"hidden_size": 256}


def _config(family: str):
    T = transformers
    if family == "qwen3":
        return T.Qwen3ForCausalLM, T.Qwen3Config(**_COMMON, tie_word_embeddings=True)
    if family == "gemma2":
        return T.Gemma2ForCausalLM, T.Gemma2Config(
            **_COMMON, sliding_window=WINDOW, layer_types=_ALTERNATING, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh")
    if family == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        return T.Gemma3ForCausalLM, T.Gemma3TextConfig(
            **_COMMON, sliding_window=WINDOW, layer_types=_ALTERNATING, rope_parameters=rope,
            query_pre_attn_scalar=64)
    if family == "gemma3_mm":  # a multimodal checkpoint: pagedkv runs its text model
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        text = T.Gemma3TextConfig(**_COMMON, sliding_window=WINDOW, layer_types=_ALTERNATING,
                                  rope_parameters=rope, query_pre_attn_scalar=64)
        vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=28, patch_size=14)
        return T.Gemma3ForConditionalGeneration, T.Gemma3Config(text_config=text.to_dict(),
                                                                vision_config=vision.to_dict(), mm_tokens_per_image=4)
    if family == "phi3":
        common = _COMMON | {"num_hidden_layers": 2}
        return T.Phi3ForCausalLM, T.Phi3Config(
            **common, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    if family == "olmo2":
        return T.Olmo2ForCausalLM, T.Olmo2Config(**_COMMON, pad_token_id=0, eos_token_id=2)
    if family == "granite":
        return T.GraniteForCausalLM, T.GraniteConfig(
            **_COMMON, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.05,
            logits_scaling=2.0)
    if family == "mistral_window":
        return T.MistralForCausalLM, T.MistralConfig(**_COMMON, sliding_window=WINDOW)
    if family == "mixtral":
        return T.MixtralForCausalLM, T.MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(
            **_COMMON, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[1])
    return _config_2(family)


def _config_2(family: str):
    T = transformers
    granite = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.05, logits_scaling=2.0,
                   num_local_experts=8, num_experts_per_tok=2)
    if family == "gemma":
        return T.GemmaForCausalLM, T.GemmaConfig(**_COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "smollm3":
        return T.SmolLM3ForCausalLM, T.SmolLM3Config(**_COMMON, no_rope_layer_interval=2, pad_token_id=0,
                                                     bos_token_id=1, eos_token_id=2)
    if family == "olmo3":
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        return T.Olmo3ForCausalLM, T.Olmo3Config(**_COMMON, sliding_window=WINDOW, layer_types=_ALTERNATING,
                                                 rope_parameters=rope, pad_token_id=0, eos_token_id=2)
    if family == "qwen2_moe":
        return T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig(
            **_COMMON | {"num_hidden_layers": 3}, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=96,
            shared_expert_intermediate_size=160, mlp_only_layers=[1])
    if family == "olmoe":
        return T.OlmoeForCausalLM, T.OlmoeConfig(**_WIDE, num_experts=8,
                                                 num_experts_per_tok=4, clip_qkv=1.5, pad_token_id=0, eos_token_id=2)
    if family == "granitemoe":
        return T.GraniteMoeForCausalLM, T.GraniteMoeConfig(**_COMMON, **granite)
    if family == "granitemoeshared":
        return T.GraniteMoeSharedForCausalLM, T.GraniteMoeSharedConfig(**_COMMON, **granite,
                                                                       shared_intermediate_size=80)
    if family == "starcoder2":
        return T.Starcoder2ForCausalLM, T.Starcoder2Config(**_COMMON, sliding_window=WINDOW, norm_epsilon=1e-5,
                                                           hidden_act="gelu_pytorch_tanh")
    if family == "stablelm":
        return T.StableLmForCausalLM, T.StableLmConfig(**_WIDE, use_qkv_bias=True, partial_rotary_factor=0.25,
                                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family in ("stablelm_parallel", "stablelm_qk"):  # stablelm_qk: StableLM-2-12B's layout
        return T.StableLmForCausalLM, T.StableLmConfig(**_WIDE, use_parallel_residual=True,
                                                       partial_rotary_factor=0.5, pad_token_id=0,
                                                       qk_layernorm=family == "stablelm_qk")
    if family in ("phi", "phi_qk"):
        return T.PhiForCausalLM, T.PhiConfig(**_WIDE | {"num_key_value_heads": 4}, partial_rotary_factor=0.5,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                             qk_layernorm=family == "phi_qk")
    if family in ("gpt_neox", "gpt_neox_sequential"):
        shape = {k: v for k, v in _COMMON.items() if k not in ("num_key_value_heads", "head_dim", "rms_norm_eps")}
        return T.GPTNeoXForCausalLM, T.GPTNeoXConfig(**shape | {"hidden_size": 256}, rotary_pct=0.25,
                                                     use_parallel_residual=family == "gpt_neox", bos_token_id=1,
                                                     eos_token_id=2)
    if family in ("cohere", "cohere2", "cohere_qk"):  # cohere_qk: Command R+'s per-head q/k norms
        extra = dict(sliding_window=WINDOW, layer_types=_ALTERNATING) if family == "cohere2" else {}
        if family == "cohere_qk":
            extra = dict(use_qk_norm=True)
        cls, config = (T.Cohere2ForCausalLM, T.Cohere2Config) if family == "cohere2" else (T.CohereForCausalLM,
                                                                                          T.CohereConfig)
        return cls, config(**_COMMON, logit_scale=0.25, layer_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, **extra)
    if family in ("gpt2", "gpt_bigcode"):
        gpt = dict(vocab_size=VOCAB, n_embd=256, n_head=4, n_layer=2, n_positions=512, n_inner=320,
                   initializer_range=0.1, bos_token_id=1, eos_token_id=2)
        if family == "gpt2":
            return T.GPT2LMHeadModel, T.GPT2Config(**gpt)
        return T.GPTBigCodeForCausalLM, T.GPTBigCodeConfig(**gpt, multi_query=True)
    if family in ("ministral3", "mistral3_mm"):
        # YaRN over a pretraining length of 32 and queries scaled by 1 + 0.5 * log(1 + floor(position / 32)):
        # the 45-token prompts reach the second span.
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5}
        text = T.Ministral3Config(**_COMMON | {"max_position_embeddings": 512}, rope_parameters=rope,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if family == "ministral3":
            return T.Ministral3ForCausalLM, text
        vision = T.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=28, patch_size=14)
        return T.Mistral3ForConditionalGeneration, T.Mistral3Config(text_config=text.to_dict(),
                                                                    vision_config=vision.to_dict())
    if family == "ernie4_5":
        return T.Ernie4_5ForCausalLM, T.Ernie4_5Config(**_COMMON, use_bias=True, pad_token_id=0, bos_token_id=1,
                                                       eos_token_id=2)
    if family == "helium":
        return T.HeliumForCausalLM, T.HeliumConfig(**_WIDE, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "seed_oss":
        return T.SeedOssForCausalLM, T.SeedOssConfig(**_COMMON, attention_bias=True, attention_out_bias=False,
                                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "arcee":
        return T.ArceeForCausalLM, T.ArceeConfig(**_COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "exaone4":  # layers 0-2 slide, layer 3 attends to everything without rotary positions
        return T.Exaone4ForCausalLM, T.Exaone4Config(**_COMMON | {"num_hidden_layers": 4}, sliding_window=WINDOW,
                                                     sliding_window_pattern=4, pad_token_id=0, bos_token_id=1,
                                                     eos_token_id=2)
    if family in ("qwen2_5_vl", "qwen3_vl"):  # text prompts on a vision-language checkpoint
        # The M-RoPE sections split the 32 rotary frequencies of a 64-wide head.
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}
        if family == "qwen3_vl":
            rope["mrope_interleaved"] = True
        text = (_WIDE if family == "qwen2_5_vl" else _COMMON) | {"pad_token_id": 0, "tie_word_embeddings": False,
                                                                 "rope_parameters": rope}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=14)
        if family == "qwen2_5_vl":
            return T.Qwen2_5_VLForConditionalGeneration, T.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
        return T.Qwen3VLForConditionalGeneration, T.Qwen3VLConfig(text_config=text, vision_config=vision)
    if family in ("glm", "glm4"):
        cls, config = (T.GlmForCausalLM, T.GlmConfig) if family == "glm" else (T.Glm4ForCausalLM, T.Glm4Config)
        return cls, config(**_COMMON, pad_token_id=0, eos_token_id=2)
    if family == "gptj":  # half of each 64-wide head rotates, interleaved
        return T.GPTJForCausalLM, T.GPTJConfig(vocab_size=VOCAB, n_embd=256, n_head=4, n_layer=2, n_positions=512,
                                               n_inner=320, rotary_dim=32, initializer_range=0.1, bos_token_id=1,
                                               eos_token_id=2)
    if family == "opt":
        return T.OPTForCausalLM, T.OPTConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, ffn_dim=320,
                                             num_attention_heads=4, max_position_embeddings=512,
                                             word_embed_proj_dim=256, init_std=0.1, pad_token_id=0, bos_token_id=1,
                                             eos_token_id=2)
    if family in ("falcon", "falcon_new", "falcon_seq"):
        layouts = {"falcon": dict(multi_query=True),  # Falcon-7B: one shared K/V head, one shared norm
                   "falcon_new": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True,
                                      ffn_hidden_size=320),  # 40B / 180B: grouped KV heads, two norms
                   "falcon_seq": dict(multi_query=False, parallel_attn=False)}  # per-head q/k/v, sequential
        return T.FalconForCausalLM, T.FalconConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2,
                                                   num_attention_heads=4, max_position_embeddings=512,
                                                   initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                                                   **layouts[family])
    if family == "nemotron":  # a quarter of each head rotates
        return T.NemotronForCausalLM, T.NemotronConfig(**_COMMON, partial_rotary_factor=0.25, norm_eps=1e-5,
                                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise AssertionError(family)


FAMILIES = ("qwen3", "gemma2", "gemma3", "gemma3_mm", "phi3", "olmo2", "granite", "mistral_window", "mixtral",
            "qwen3_moe", "gemma", "smollm3", "olmo3", "qwen2_moe", "olmoe", "granitemoe", "granitemoeshared", "glm",
            "glm4", "starcoder2", "stablelm", "stablelm_parallel", "phi", "gpt_neox", "gpt_neox_sequential", "cohere",
            "cohere2", "gpt2", "gpt_bigcode", "ministral3", "mistral3_mm", "ernie4_5", "helium", "seed_oss", "arcee",
            "exaone4", "qwen2_5_vl", "qwen3_vl", "gptj", "opt", "nemotron", "stablelm_qk", "cohere_qk", "phi_qk",
            "falcon", "falcon_new", "falcon_seq")


def make_checkpoint(family: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Saves a tiny random `family` checkpoint to `path`; returns the HF model (float32, eval, eager attention)."""
    cls, cfg = _config(family)
    cfg._attn_implementation = "eager"  # the eager path applies soft-capping and windows exactly
    torch.manual_seed(4321 + seed)
    model = cls(cfg).float().eval()
    randomize(model, 77 + seed)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    out = {}
    for i, family in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, make_checkpoint(family, path, i))
    return out


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _ours(checkpoints, family: str):
    return load_model(ModelSource(checkpoints[family][0]), torch.float32, CPU)


def test_checkpoints_carry_their_features(checkpoints):
    """The saved configs really have what the tests are meant to cover (guards against config drift)."""
    cfg = {f: json.loads((p / "config.json").read_text()) for f, (p, _) in checkpoints.items()}
    assert cfg["gemma2"]["attn_logit_softcapping"] == 2.0 and cfg["gemma2"]["sliding_window"] == WINDOW
    assert set(cfg["gemma3"]["layer_types"]) == {"sliding_attention", "full_attention"}
    phi_names = set(checkpoints["phi3"][1].state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in phi_names and "model.layers.0.mlp.gate_up_proj.weight" in \
        phi_names
    ours = {f: _ours(checkpoints, f).config for f in ("gemma2", "gemma3", "phi3", "mistral_window", "qwen3_moe")}
    assert ours["gemma2"].kv_sliding_window is None and ours["gemma2"].layer_window(0) == WINDOW
    assert ours["gemma3"].rope_local_theta == 1e4 and ours["gemma3"].rope_scaling["rope_type"] == "linear"
    assert ours["phi3"].rotary_dim == 32 and ours["phi3"].kv_sliding_window == WINDOW
    assert ours["mistral_window"].kv_sliding_window == WINDOW
    assert [ours["qwen3_moe"].is_moe_layer(i) for i in range(2)] == [True, False]
    more = {f: _ours(checkpoints, f) for f in ("smollm3", "olmo3", "qwen2_moe", "olmoe", "granitemoeshared", "glm")}
    assert more["smollm3"].config.no_rope_layers == (1,) and more["smollm3"].config.tie_word_embeddings
    assert more["olmo3"].config.layer_window(0) == WINDOW and more["olmo3"].config.rope_local_theta == 1e4
    assert more["qwen2_moe"].config.shared_expert_intermediate_size == 160
    assert [more["qwen2_moe"].config.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert more["qwen2_moe"].layers[0].self_attn.qkv_proj.bias is not None
    assert more["qwen2_moe"].layers[0].self_attn.o_proj.bias is None
    assert more["olmoe"].config.clip_qkv == 1.5 and not more["olmoe"].config.norm_topk_prob
    assert more["granitemoeshared"].layers[0].mlp.shared_expert_gate is None
    assert more["granitemoeshared"].config.norm_topk_prob
    assert more["glm"].config.rotary_dim == 32 and more["glm"].layers[0].self_attn.o_proj.bias is None
    neox, phi = _ours(checkpoints, "gpt_neox"), _ours(checkpoints, "phi")
    assert neox.config.parallel_residual and neox.layers[0].post_attention_layernorm is not None
    assert not _ours(checkpoints, "gpt_neox_sequential").config.parallel_residual
    assert phi.lm_head.bias is not None and phi.layers[0].post_attention_layernorm is None
    assert _ours(checkpoints, "starcoder2").config.kv_sliding_window == WINDOW


def test_rotary_tables_hold_max_model_len_positions(checkpoints):
    """With the engine's max_model_len known at load, each rotary table holds that many positions, not all of
    max_position_embeddings (Gemma 3: 131072 x 256 float32 per table); the logits do not change."""
    path, hf = checkpoints["gemma3"]
    model = load_model(ModelSource(path), torch.float32, CPU, max_model_len=100)
    assert model.rotary_emb.cos_sin.shape[0] == 100 and model.rotary_emb_local.cos_sin.shape[0] == 100
    tokens = random_tokens(9, 60)
    assert_close_fp32(PagedRunner(model, torch.float32).step([], [(0, tokens)]), hf_logits(hf, tokens), "gemma3")


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_hf(family, checkpoints):
    """One 45-token prompt (longer than the window) as one prefill: every position's logits equal HF's."""
    _, hf = checkpoints[family]
    tokens = random_tokens(7, 45)
    ours = PagedRunner(_ours(checkpoints, family), torch.float32).step([], [(0, tokens)])
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 0.5  # logits of a useful magnitude
    assert_close_fp32(ours, ref, f"{family} prompt")


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_logits_match_hf(family, checkpoints):
    """Three steps of mixed flat batches (decodes first, prefill chunks after a cached prefix): every row equals
    HF's logits at that position."""
    runner = PagedRunner(_ours(checkpoints, family), torch.float32)
    seqs, rows, ours = mixed_batch(runner)
    assert_close_fp32(ours, mixed_reference(checkpoints[family][1], seqs, rows), f"{family} mixed batch")


@pytest.mark.parametrize("family", FAMILIES)
def test_llm_greedy_matches_hf_generate(family, checkpoints):
    """LLM.generate, prompts of several lengths (past the window where there is one) batched, greedy == HF."""
    path, hf = checkpoints[family]
    prompts = [random_tokens(300 + i, n) for i, n in enumerate((5, 30, 47, 13))]
    compared = assert_greedy_matches_hf(path, hf, prompts, max_tokens=10)
    assert compared >= 3 * 10


def test_glm_interleaved_rotary_equals_halves_rotary_on_permuted_heads():
    """GPT-J-order rotary on a head equals NeoX-order rotary on the head's rows permuted by
    interleaved_to_halves, so q . k is unchanged when both are permuted (what the GLM loader relies on)."""
    from pagedkv.model.rotary import interleaved_to_halves, permute_heads

    head_dim, rotary_dim, heads, n = 64, 32, 3, 7
    order = interleaved_to_halves(head_dim, rotary_dim)
    assert order[:4].tolist() == [0, 2, 4, 6] and order[16:18].tolist() == [1, 3] and order[32:].tolist() == list(
        range(32, 64))
    angles = torch.rand(n, rotary_dim // 2, dtype=torch.float64) * 6.0
    cos, sin = angles.cos(), angles.sin()

    def interleaved(x):  # GLM's: pairs (2i, 2i + 1) turn by angle i
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        a, b = rot[..., 0::2], rot[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2), rest], -1)

    def halves(x):  # pagedkv's kernels': pairs (i, i + rotary_dim / 2)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        a, b = rot[..., :rotary_dim // 2], rot[..., rotary_dim // 2:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([a * c - b * s, b * c + a * s, rest], -1)

    q, k = torch.randn(n, heads, head_dim, dtype=torch.float64), torch.randn(n, heads, head_dim, dtype=torch.float64)
    torch.testing.assert_close(halves(q[..., order]), interleaved(q)[..., order])
    scores = (interleaved(q) * interleaved(k)).sum(-1)
    torch.testing.assert_close((halves(q[..., order]) * halves(k[..., order])).sum(-1), scores)
    weight = torch.randn(heads * head_dim, 5)
    torch.testing.assert_close(permute_heads(weight, heads, order).view(heads, head_dim, 5),
                               weight.view(heads, head_dim, 5)[:, order])
    with pytest.raises(ValueError, match="does not hold 2 heads of 64"):
        permute_heads(weight, 2, order)


LONGROPE_ORIGINAL = 64


@pytest.fixture(scope="module")
def longrope_checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny Phi-3 with LongRoPE (as Phi-3.5 / Phi-4-mini): pretraining length 64, 512 positions, partial rotary."""
    g = torch.Generator().manual_seed(5)
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
            "short_factor": (1 + torch.rand(16, generator=g)).tolist(),
            "long_factor": (2 + 6 * torch.rand(16, generator=g)).tolist(),
            "original_max_position_embeddings": LONGROPE_ORIGINAL}
    # hidden_size = heads x head_dim: HF checks the factor count against hidden_size / heads.
    cfg = transformers.Phi3Config(**(_COMMON | {"hidden_size": 256}), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  rope_parameters=rope,
                                  original_max_position_embeddings=LONGROPE_ORIGINAL)
    cfg._attn_implementation = "eager"
    torch.manual_seed(11)
    model = transformers.Phi3ForCausalLM(cfg).float().eval()
    randomize(model, 12)
    path = tmp_path_factory.mktemp("phi3_longrope")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.mark.parametrize("max_model_len, length", [(LONGROPE_ORIGINAL, 45), (None, 90)])
def test_longrope_logits_match_hf(longrope_checkpoint, max_model_len, length):
    """Short factors when the engine stays within the pretraining length (HF: sequences up to it), long factors
    (and the cos/sin multiplier) beyond it (HF: sequences longer than it)."""
    path, hf = longrope_checkpoint
    model = load_model(ModelSource(path), torch.float32, CPU, max_model_len=max_model_len)
    tokens = random_tokens(21, length)
    ours = PagedRunner(model, torch.float32).step([], [(0, tokens)])
    assert_close_fp32(ours, hf_logits(hf, tokens), f"longrope, max_model_len {max_model_len}, {length} tokens")


def test_longrope_greedy_matches_hf_generate(longrope_checkpoint):
    """Prompts past the pretraining length, max_model_len 256 (long factors): greedy == HF generate."""
    path, hf = longrope_checkpoint
    prompts = [random_tokens(500 + i, n) for i, n in enumerate((70, 97, 66))]
    assert assert_greedy_matches_hf(path, hf, prompts, max_tokens=8) >= 2 * 8


# YaRN variants as configs carry them: Qwen2.5 / Qwen3 long context (factor 4 over 32768, here over 64), a
# DeepSeek-style mscale / mscale_all_dim pair, an explicit attention_factor, untruncated bounds, no factor (the
# stretch is then max_position_embeddings / original), and beta bounds that meet (a step, no ramp).
YARN = [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 1.0,
     "beta_fast": 24, "beta_slow": 2},
    {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 1.3, "truncate": False},
    {"factor": None, "original_max_position_embeddings": 128},
    {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 2, "beta_slow": 2},
]


@pytest.mark.parametrize("yarn", YARN)
def test_yarn_frequencies_equal_transformers(yarn):
    """pagedkv's YaRN inverse frequencies and cos/sin multiplier are transformers' for the same config."""
    from pagedkv.model.rotary import rope_frequencies
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 1e4, **yarn}
    cfg = transformers.Qwen3Config(**_COMMON, rope_parameters=rope)
    theirs, their_mult = ROPE_INIT_FUNCTIONS["yarn"](cfg, torch.device("cpu"))
    ours, our_mult = rope_frequencies(64, 1e4, rope, cfg.max_position_embeddings, None)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_mult == pytest.approx(their_mult, rel=1e-12)
    assert not torch.equal(ours, rope_frequencies(64, 1e4, None, 512, None)[0])  # the rule did something


def test_yarn_checkpoint_logits_and_greedy_match_hf(tmp_path):
    """A tiny Qwen3 with YaRN (factor 4 over a pretraining length of 64) and max_position_embeddings 128: the
    model runs to 64 x 4 = 256 positions (vLLM's rule; Qwen3's 32768 x 4 over its 40960), and past both
    lengths its logits and greedy ids equal HF's; a longer max_model_len is refused, naming the stretch."""
    from pagedkv import LLM

    rope = {"rope_type": "yarn", "rope_theta": 1e4, **YARN[0]}
    cfg = transformers.Qwen3Config(**(_COMMON | {"max_position_embeddings": 128}), rope_parameters=rope,
                                   tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(13)
    hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    randomize(hf, 14)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(ModelSource(tmp_path), torch.float32, CPU)
    assert model.config.position_limit == 256 and model.rotary_emb.cos_sin.shape[0] == 256
    tokens = random_tokens(23, 200)
    assert_close_fp32(PagedRunner(model, torch.float32).step([], [(0, tokens)]), hf_logits(hf, tokens), "yarn")
    prompts = [random_tokens(600 + i, n) for i, n in enumerate((170, 33))]
    assert assert_greedy_matches_hf(tmp_path, hf, prompts, max_tokens=6, max_model_len=None) >= 2 * 6
    with pytest.raises(ValueError, match=r"max_model_len=257 exceeds the model's YaRN-stretched length "
                                         r"\(original_max_position_embeddings x factor\) \(256\)"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, device="cpu", max_model_len=257)


def test_hf_overrides_turn_yarn_on_without_editing_the_checkpoint(tmp_path):
    """hf_overrides (vLLM's; --hf-overrides on the CLI, a JSON object) sets rope_scaling over a plain Qwen3
    checkpoint's config.json: greedy ids equal HF's model of the same weights with YaRN in its config, past
    max_position_embeddings; what is not a JSON object is refused."""
    from pagedkv.config import EngineArgs

    rope = {"rope_type": "yarn", "rope_theta": 1e4, **YARN[0]}
    shape = _COMMON | {"max_position_embeddings": 128}
    torch.manual_seed(15)
    plain = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, tie_word_embeddings=True)).float()
    randomize(plain, 16)
    plain.save_pretrained(tmp_path, safe_serialization=True)
    cfg = transformers.Qwen3Config(**shape, rope_parameters=rope, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    hf.load_state_dict(plain.state_dict())
    prompts = [random_tokens(700 + i, n) for i, n in enumerate((150, 40))]
    overrides = json.dumps({"rope_scaling": rope})
    assert assert_greedy_matches_hf(tmp_path, hf, prompts, max_tokens=6, max_model_len=None,
                                    hf_overrides=overrides, engine_core="process") >= 2 * 6
    for bad in ("[1, 2]", "{rope", 7):
        with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
            EngineArgs(hf_overrides=bad)


@pytest.mark.parametrize("family", ("gemma2", "olmo2", "mixtral", "qwen2_moe", "glm", "phi", "opt", "gptj",
                                    "stablelm_qk", "cohere_qk", "falcon", "falcon_new"))
def test_tensor_parallel_size_2_matches_size_1(family, checkpoints):
    """Sliding windows with soft-capping (Gemma 2), q/k norms gathered across ranks (OLMo 2), sharded
    experts (Mixtral), a sharded shared expert beside them (Qwen2-MoE), q/k heads permuted for GLM's
    interleaved rotary, split by head, Phi's parallel residual with an LM-head bias split by vocabulary
    rows (and GPT-J's, with partial interleaved rotary), OPT's learned positions split by rows, per-head q/k
    norms split with their heads (StableLM-2-12B, Command R+), Falcon's fused q/k/v split by head (one KV
    head replicated; KV-grouped), at tensor_parallel_size=2: the greedy ids of size 1, ties aside."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.model.default_model import ensure_default_model

    path = checkpoints[family][0]
    prompts = [random_tokens(400 + i, n) for i, n in enumerate((9, 40, 31))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outputs = {}
    for tp in (1, 2):
        with LLM(model=str(path), tokenizer=str(ensure_default_model()), device="cpu", dtype="float32",
                 tensor_parallel_size=tp, kv_cache_memory=16 << 20, max_model_len=256, block_size=16) as llm:
            outputs[tp] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_same_greedy(outputs[1], outputs[2], f"{family} at tensor_parallel_size=2")


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ({"hidden_activation": "relu2"}, "relu2"),
    ({"sliding_window": -5}, "positive sliding_window"),
])
def test_config_the_kernels_cannot_run_is_refused(change, message, checkpoints, tmp_path):
    """A layer kind, activation or window pagedkv does not run is refused at load, naming it."""
    path = copy_checkpoint(checkpoints["gemma2"][0], tmp_path)
    edit_config(path, **change)
    with pytest.raises(ValueError, match=message):
        load_model(ModelSource(path), torch.float32, CPU)


@pytest.mark.parametrize("family", ("gemma2", "gemma3", "gemma3_mm"))
def test_gemma_config_without_tie_word_embeddings_is_tied(family, checkpoints, tmp_path):
    """Gemma's published config.json files leave tie_word_embeddings out (transformers' Gemma configs default
    it to True) and their checkpoints hold no lm_head.weight: the LM head is the embedding, as in HF."""
    path = copy_checkpoint(checkpoints[family][0], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    for part in (cfg, cfg.get("text_config", {})):
        part.pop("tie_word_embeddings", None)
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(ModelSource(path), torch.float32, CPU)
    assert model.config.tie_word_embeddings
    tokens = random_tokens(11, 20)
    assert_close_fp32(PagedRunner(model, torch.float32).step([], [(0, tokens)]),
                      hf_logits(checkpoints[family][1], tokens), f"{family} without tie_word_embeddings")


def test_checkpoint_missing_an_expert_is_refused(checkpoints, tmp_path):
    """A Mixtral checkpoint without one expert's w2: a clear error naming the parameter, not a random expert."""
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(checkpoints["mixtral"][0], tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expert 5's down weights of layers.1"):
        load_model(ModelSource(path), torch.float32, CPU)
