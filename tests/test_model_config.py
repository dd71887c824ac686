"""How ModelConfig reads config.json rules that differ by family (model-free: plain dicts)."""

from __future__ import annotations

import pytest
from pagedkv.model_config import ModelConfig

_SHAPE = dict(vocab_size=1000, hidden_size=256, intermediate_size=320, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64)


def _config(model_type: str, **extra) -> ModelConfig:
    return ModelConfig.from_hf({"model_type": model_type, **_SHAPE, **extra})


def test_gemma_legacy_gelu_means_the_tanh_approximation():
    """Gemma 1's published configs say hidden_act "gelu"; transformers and vLLM run gelu_pytorch_tanh."""
    assert _config("gemma", hidden_act="gelu").hidden_act == "gelu_pytorch_tanh"
    assert _config("gemma", hidden_act="gelu", hidden_activation="gelu").hidden_act == "gelu_pytorch_tanh"
    assert _config("gemma2", hidden_activation="gelu").hidden_act == "gelu"  # only Gemma 1's legacy value
    assert _config("gemma").tie_word_embeddings and not _config("olmoe").tie_word_embeddings


def test_bidirectional_gemma_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention is an encoder"):
        _config("gemma", use_bidirectional_attention=True)


def test_smollm3_no_rope_layers_from_flags_or_interval():
    assert _config("smollm3", no_rope_layers=[1, 0, 1, 0]).no_rope_layers == (1, 3)
    cfg = _config("smollm3", no_rope_layer_interval=4)
    assert cfg.no_rope_layers == (3,) and [cfg.layer_rotates(i) for i in range(4)] == [True, True, True, False]
    assert _config("llama").no_rope_layers == () and _config("llama").layer_rotates(3)
    with pytest.raises(ValueError, match="no_rope_layers has 3 entries for 4 layers"):
        _config("smollm3", no_rope_layers=[1, 1, 0])


def test_smollm3_window_applies_only_with_use_sliding_window():
    assert _config("smollm3", sliding_window=128).kv_sliding_window is None
    assert _config("smollm3", sliding_window=128, use_sliding_window=True).kv_sliding_window == 128


def test_qkv_bias_families_have_no_output_bias():
    """Qwen2 and Qwen2-MoE (qkv_bias, on by default) and GLM (attention_bias) bias q/k/v only; Llama's
    attention_bias covers the output projection too."""
    assert _config("qwen2_moe").attention_bias and not _config("qwen2_moe").o_proj_bias
    assert not _config("qwen2_moe", qkv_bias=False).attention_bias
    glm = _config("glm", attention_bias=True)
    assert glm.attention_bias and not glm.o_proj_bias
    assert _config("llama", attention_bias=True).o_proj_bias


def test_shared_expert_width_and_routing_defaults():
    assert _config("qwen2_moe", shared_expert_intermediate_size=96).shared_expert_intermediate_size == 96
    assert _config("granitemoeshared", shared_intermediate_size=64).shared_expert_intermediate_size == 64
    assert not _config("qwen2_moe").norm_topk_prob and not _config("olmoe").norm_topk_prob
    assert _config("granitemoe").norm_topk_prob and _config("mixtral").norm_topk_prob
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    assert _config("qwen2_moe", **moe, shared_expert_intermediate_size=96).tensor_parallel_size_fits(2)
    assert not _config("qwen2_moe", **moe, shared_expert_intermediate_size=97).tensor_parallel_size_fits(2)


def test_clip_qkv_must_be_positive():
    assert _config("olmoe", clip_qkv=8.0).clip_qkv == 8.0 and _config("olmoe").clip_qkv is None
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="clip_qkv must be a positive number"):
            _config("olmoe", clip_qkv=bad)


def test_rope_scaling_on_sliding_layers_is_refused():
    """OLMo 3 / Gemma 3 keep rope settings per layer kind; scaling is run on the full layers only, so a scaled
    sliding kind is refused rather than run unscaled."""
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="rope scaling on the sliding-window layers \\('linear'\\)"):
        _config("olmo3", rope_parameters=rope, sliding_window=64)


def test_layernorm_families_read_their_own_eps_rotary_and_bias_keys():
    """GPT-NeoX / Phi / StableLM read layer_norm_eps, StarCoder2 norm_epsilon (a stray rms_norm_eps is not
    theirs); GPT-NeoX's rotary_pct and rotary_emb_base; biases by each family's rule."""
    neox = _config("gpt_neox", layer_norm_eps=1e-5, rms_norm_eps=0.1, rotary_pct=0.25, rotary_emb_base=5000.0)
    assert neox.rms_norm_eps == 1e-5 and neox.rotary_dim == 16 and neox.rope_theta == 5000.0
    assert neox.parallel_residual and neox.attention_bias and neox.o_proj_bias and neox.mlp_bias
    assert not _config("gpt_neox", use_parallel_residual=False).parallel_residual
    phi = _config("phi", partial_rotary_factor=0.5)
    assert phi.parallel_residual and phi.attention_bias and phi.o_proj_bias and phi.mlp_bias and phi.rotary_dim == 32
    assert _config("phi", use_parallel_residual=False).parallel_residual  # Phi has no sequential form
    star = _config("starcoder2", norm_epsilon=3e-5, rms_norm_eps=0.1)
    assert star.rms_norm_eps == 3e-5 and star.attention_bias and star.mlp_bias and star.tie_word_embeddings
    assert not _config("starcoder2", use_bias=False).mlp_bias
    stable = _config("stablelm", use_qkv_bias=True, rope_pct=0.25)
    assert stable.attention_bias and not stable.o_proj_bias and not stable.mlp_bias and stable.rotary_dim == 16
    assert not stable.parallel_residual and _config("stablelm", use_parallel_residual=True).parallel_residual
    assert _config("llama", layer_norm_eps=0.5).rms_norm_eps == 1e-6


def test_qk_layernorm_is_read_where_a_family_has_it_and_refused_elsewhere():
    """StableLM's and Phi's qk_layernorm, Cohere's use_qk_norm; any other family setting them is refused (a norm
    it has no place for must not be dropped silently)."""
    assert _config("stablelm", qk_layernorm=True).qk_layernorm and _config("phi", qk_layernorm=True).qk_layernorm
    assert _config("cohere", use_qk_norm=True).qk_layernorm and not _config("cohere").qk_layernorm
    with pytest.raises(ValueError, match="LlamaForCausalLM with use_qk_norm"):
        _config("llama", use_qk_norm=True)
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM with qk_layernorm"):
        _config("gpt_neox", qk_layernorm=True)


def test_cohere_reads_logit_scale_ties_and_cohere2_drops_rotary_on_full_layers():
    cohere = _config("cohere", logit_scale=0.0625, layer_norm_eps=1e-5)
    assert cohere.logit_scale == 0.0625 and cohere.tie_word_embeddings and cohere.parallel_residual
    assert cohere.rms_norm_eps == 1e-5 and cohere.no_rope_layers == () and _config("llama").logit_scale == 1.0
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    cohere2 = _config("cohere2", sliding_window=64, layer_types=kinds)
    assert cohere2.no_rope_layers == (3,) and cohere2.layer_window(0) == 64 and cohere2.layer_window(3) == 0


def test_gpt2_style_names_sizes_and_refusals():
    """GPT-2's n_embd / n_head / n_layer / n_positions / n_inner / activation_function / layer_norm_epsilon are
    the sizes the family's code reads (over any common-name keys); one KV head under multi_query; every layer
    without rotary; softmax scale 1 when scale_attn_weights is off."""
    gpt2 = ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 1000, "n_embd": 256, "n_head": 4, "n_layer": 3,
                                "n_positions": 128, "n_inner": None, "activation_function": "gelu_new",
                                "layer_norm_epsilon": 1e-5, "hidden_size": 999, "head_dim": 80})
    assert (gpt2.hidden_size, gpt2.num_attention_heads, gpt2.num_hidden_layers, gpt2.max_position_embeddings) == (
        256, 4, 3, 128)
    assert gpt2.intermediate_size == 1024 and gpt2.head_dim == 64 and gpt2.num_key_value_heads == 4
    assert gpt2.hidden_act == "gelu_new" and gpt2.rms_norm_eps == 1e-5 and gpt2.tie_word_embeddings
    assert gpt2.no_rope_layers == (0, 1, 2) and gpt2.attention_bias and gpt2.mlp_bias and gpt2.attention_scale == 0.125
    bigcode = ModelConfig.from_hf({"model_type": "gpt_bigcode", "vocab_size": 1000, "n_embd": 256, "n_head": 4,
                                   "n_layer": 2, "n_inner": 512, "multi_query": True, "scale_attn_weights": False})
    assert bigcode.num_key_value_heads == 1 and bigcode.intermediate_size == 512 and bigcode.attention_scale == 1.0
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 10, "n_embd": 128, "n_head": 2, "n_layer": 1,
                                 key: True})


def test_ministral3_query_scale_and_mistral3_text_model():
    """Ministral 3's llama_4_scaling_beta over its pretraining length; a Mistral 3 wrapper's text model, with
    the wrapper's tie_word_embeddings winning over the text config's (the LM head is the wrapper's)."""
    rope = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384,
            "llama_4_scaling_beta": 0.1, "rope_theta": 1e6}
    assert _config("ministral3", rope_parameters=rope).query_position_scale == (0.1, 16384)
    assert _config("ministral3").query_position_scale is None and _config("llama").query_position_scale is None
    text = {"model_type": "mistral", **_SHAPE, "tie_word_embeddings": False}
    wrapped = ModelConfig.from_hf({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": text,
                                   "tie_word_embeddings": True, "dtype": "bfloat16"})
    assert wrapped.tie_word_embeddings and wrapped.model_type == "mistral" and wrapped.hidden_size == 256
    unstated = ModelConfig.from_hf({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": text})
    assert not unstated.tie_word_embeddings


def test_interleaved_rotary_families_and_seed_oss_output_bias():
    for model_type in ("glm", "glm4", "cohere", "cohere2", "ernie4_5", "helium"):
        assert _config(model_type).rotary_interleaved, model_type
    assert not _config("llama").rotary_interleaved and not _config("phi").rotary_interleaved
    seed = _config("seed_oss", attention_bias=True, attention_out_bias=False)
    assert seed.attention_bias and not seed.o_proj_bias
    assert _config("seed_oss", attention_bias=False, attention_out_bias=True).o_proj_bias
    ernie = _config("ernie4_5", use_bias=True)
    assert ernie.attention_bias and ernie.o_proj_bias and ernie.mlp_bias and ernie.tie_word_embeddings


def test_exaone4_pattern_and_nope_full_layers():
    """EXAONE 4: sliding_window_pattern as a period or as letters (L sliding, G full); with a window its full
    layers use no rotary positions, without one every layer rotates and attends fully."""
    period = _config("exaone4", sliding_window=64, sliding_window_pattern=4)
    assert [period.layer_window(i) for i in range(4)] == [64, 64, 64, 0] and period.no_rope_layers == (3,)
    letters = _config("exaone4", sliding_window=64, sliding_window_pattern="LLGL")
    assert [letters.layer_window(i) for i in range(4)] == [64, 64, 0, 64] and letters.no_rope_layers == (2,)
    plain = _config("exaone4")
    assert plain.no_rope_layers == () and plain.kv_sliding_window is None and plain.layer_window(0) == 0


def test_qwen_vl_text_model_from_a_published_style_config():
    """Qwen2.5-VL's config.json as published: the text model's fields at the top level beside vision_config,
    M-RoPE in rope_scaling (plain rotation for text positions), head size from hidden, q/k/v bias only."""
    published = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                 "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 320, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 80, "rope_theta": 1e6,
                 "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vision_config": {"depth": 32},
                 "sliding_window": 32768, "use_sliding_window": False}
    cfg = ModelConfig.from_hf(published)
    assert cfg.rope_scaling is None and cfg.rope_theta == 1e6 and cfg.head_dim == 64
    assert cfg.attention_bias and not cfg.o_proj_bias and cfg.kv_sliding_window is None
    nested = ModelConfig.from_hf({"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": {
        "model_type": "qwen3_vl_text", **_SHAPE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                                      "mrope_section": [24, 20, 20]}}})
    assert nested.rope_scaling is None and nested.head_dim == 64 and not nested.attention_bias


def test_gptj_names_partial_rotary_and_biases():
    """GPT-J: GPT-2's key names, rotary_dim as a share of the head, interleaved order, MLP biases only."""
    cfg = ModelConfig.from_hf({"model_type": "gptj", "vocab_size": 1000, "n_embd": 256, "n_head": 4, "n_layer": 3,
                               "n_positions": 2048, "n_inner": None, "rotary_dim": 16,
                               "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 4, 64)
    assert (cfg.num_hidden_layers, cfg.intermediate_size, cfg.max_position_embeddings) == (3, 1024, 2048)
    assert cfg.rotary_dim == 16 and cfg.rotary_interleaved and cfg.parallel_residual
    assert not cfg.attention_bias and not cfg.o_proj_bias and cfg.mlp_bias and not cfg.tie_word_embeddings
    assert (cfg.hidden_act, cfg.rms_norm_eps) == ("gelu_new", 1e-5)


def test_opt_names_learned_positions_and_refusals():
    """OPT: ffn_dim, ReLU, LayerNorm eps 1e-5, biases per enable_bias, no grouped KV heads, learned positions (no
    rotary anywhere), tied head; opt-350m's post-norm layout and projected embeddings refused by name."""
    base = {"model_type": "opt", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 3,
            "num_attention_heads": 4, "ffn_dim": 640, "max_position_embeddings": 2048, "word_embed_proj_dim": 256,
            "activation_function": "relu", "do_layer_norm_before": True, "num_key_value_heads": 2}
    cfg = ModelConfig.from_hf(base)
    assert (cfg.intermediate_size, cfg.hidden_act, cfg.rms_norm_eps, cfg.num_key_value_heads) == (640, "relu", 1e-5, 4)
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias and cfg.tie_word_embeddings
    assert cfg.no_rope_layers == (0, 1, 2)
    assert not ModelConfig.from_hf(base | {"enable_bias": False}).mlp_bias
    for key, value in (("do_layer_norm_before", False), ("word_embed_proj_dim", 512),
                       ("_remove_final_layer_norm", True)):
        with pytest.raises(ValueError, match=f"OPT with {key}="):
            ModelConfig.from_hf(base | {key: value})


def test_falcon_layouts_names_and_refusals():
    """Falcon's own keys (n_head, n_head_kv, n_layer as published), its three q/k/v layouts and norm counts, its
    defaults (4 x hidden MLP, tied head, parallel attention); ALiBi refused."""
    base = {"model_type": "falcon", "vocab_size": 1000, "hidden_size": 256, "n_head": 4, "n_layer": 3}
    seven = ModelConfig.from_hf(base)  # multi_query and parallel_attn by default (Falcon-7B)
    assert (seven.num_attention_heads, seven.num_key_value_heads, seven.head_dim) == (4, 1, 64)
    assert (seven.fused_qkv_layout, seven.parallel_norms, seven.parallel_residual) == ("multi_query", 1, True)
    assert seven.intermediate_size == 1024 and seven.tie_word_embeddings and not seven.attention_bias
    forty = ModelConfig.from_hf(base | {"new_decoder_architecture": True, "n_head_kv": 2, "bias": True})
    assert (forty.num_key_value_heads, forty.fused_qkv_layout, forty.parallel_norms) == (2, "grouped", 2)
    assert forty.attention_bias and forty.mlp_bias
    eleven = ModelConfig.from_hf(base | {"new_decoder_architecture": True, "num_kv_heads": 2,
                                         "num_ln_in_parallel_attn": 1, "ffn_hidden_size": 640})
    assert (eleven.parallel_norms, eleven.intermediate_size) == (1, 640)
    seq = ModelConfig.from_hf(base | {"multi_query": False, "parallel_attn": False})
    assert (seq.num_key_value_heads, seq.fused_qkv_layout, seq.parallel_residual) == (4, "per_head", False)
    with pytest.raises(ValueError, match="Falcon with alibi"):
        ModelConfig.from_hf(base | {"alibi": True})
    with pytest.raises(ValueError, match="new_decoder_architecture and parallel_attn false"):
        ModelConfig.from_hf(base | {"new_decoder_architecture": True, "parallel_attn": False})
