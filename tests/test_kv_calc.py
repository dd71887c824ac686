"""`pagedkv kv-calc`: KV sizing from a config.json alone (small config files in tmp dirs, no model loaded)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from pagedkv.cli import main
from pagedkv.config import ModelConfig
from pagedkv.engine.memory_pool import kv_cache_spec
from pagedkv.kv_calc import count_params_from_config, format_report, kv_budget, kv_calc, parse_bytes
from pagedkv.supported import MODEL_TYPES

LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "max_position_embeddings": 4096, "torch_dtype": "float16"}
LLAMA_7B_PARAMS = 6_738_415_616  # Llama-2-7b-hf's parameter count


def write_config(folder, **overrides) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA_7B, **overrides}))
    return str(folder / "config.json")


def write_safetensors_header(path, tensors: dict[str, list[int]]) -> None:
    """A safetensors file whose header lists `tensors` (name -> shape, F16); the data part is left empty."""
    header = {name: {"dtype": "F16", "shape": shape, "data_offsets": [0, 0]} for name, shape in tensors.items()}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_design_notes_7b_example(tmp_path):
    r = kv_calc(write_config(tmp_path), dtype="float16", context=1024)
    assert r.bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert r.bytes_per_sequence == 536_870_912
    assert r.bytes_per_block == 524_288 * 16


def test_same_function_as_the_engine(tmp_path):
    """The tool's per-token figure is memory_pool.kv_cache_spec's, for every dtype and block size."""
    cfg = ModelConfig.from_hf({**LLAMA_7B, "num_key_value_heads": 8})
    path = write_config(tmp_path, num_key_value_heads=8)
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        for block_size in (8, 32):
            r = kv_calc(path, dtype=dtype, block_size=block_size)
            spec = kv_cache_spec(cfg, torch_dtype, block_size)
            assert (r.bytes_per_token, r.bytes_per_block) == (spec.bytes_per_token, spec.bytes_per_block)


def test_budget_blocks_and_concurrency(tmp_path):
    r = kv_calc(write_config(tmp_path), dtype="float16", block_size=16, context=1000,
                kv_cache_memory=10 * 536_870_912 + 123)
    assert r.num_blocks == 10 * 64  # 1024 tokens = 64 blocks per 536,870,912 bytes
    assert r.num_tokens == 10 * 1024
    assert r.max_concurrent_seqs == 10  # 1000 tokens still take 63 blocks: 640 // 63


def test_gpu_memory_subtracts_the_weights(tmp_path):
    path = write_config(tmp_path)
    assert count_params_from_config(ModelConfig.from_hf(LLAMA_7B)) == LLAMA_7B_PARAMS
    r = kv_calc(path, dtype="float16", gpu_memory=80 * 2**30, gpu_memory_utilization=0.9)
    assert r.params_source == "config"
    assert r.weight_bytes == 2 * LLAMA_7B_PARAMS
    assert r.budget_bytes == int(80 * 2**30 * 0.9) - 2 * LLAMA_7B_PARAMS
    tp = kv_calc(path, dtype="float16", gpu_memory=80 * 2**30, tensor_parallel_size=2)
    assert tp.weight_bytes == LLAMA_7B_PARAMS  # half the fp16 bytes on each device
    assert tp.bytes_per_token == r.bytes_per_token // 2  # half the KV heads on each device


def test_weights_from_safetensors_headers(tmp_path):
    folder = tmp_path / "ckpt"
    write_config(folder)
    write_safetensors_header(folder / "model-00001-of-00002.safetensors", {"a": [1000, 1000]})
    write_safetensors_header(folder / "model-00002-of-00002.safetensors", {"b": [10, 20], "c": [7]})
    r = kv_calc(str(folder), dtype="float32", gpu_memory=2**34)
    assert (r.params_source, r.num_params) == ("safetensors", 1_000_000 + 200 + 7)
    assert r.weight_bytes == 4 * r.num_params  # counted at the run dtype, not the stored one


def test_no_room_for_kv_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_calc(write_config(tmp_path), dtype="float16", gpu_memory=12 * 2**30, gpu_memory_utilization=0.9)


def test_parse_bytes():
    assert parse_bytes("536870912") == 536_870_912
    assert parse_bytes(12345) == 12345
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5e9") == 1_500_000_000
    with pytest.raises(ValueError, match="not a byte count"):
        parse_bytes("lots")


def test_cli_json(tmp_path, capsys):
    assert main(["kv-calc", write_config(tmp_path), "--dtype", "float16", "--context", "1024",
                 "--kv-cache-memory", "8GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_sequence"] == 536_870_912
    assert out["num_blocks"] == 8 * 2**30 // (524_288 * 16)
    assert out["max_concurrent_seqs"] == 16


def test_cli_table_and_errors(tmp_path, capsys):
    assert main(["kv-calc", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err
    write_config(tmp_path)
    assert main(["kv-calc", str(tmp_path), "--context", "1024", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "536,870,912 bytes" in out and "concurrency" in out


def test_all_sliding_model_holds_a_window_per_sequence(tmp_path):
    """Mistral-7B-v0.1's shape with its 4096 window: a 32K-token sequence holds the window's blocks, not 32K."""
    cfg = write_config(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral", num_key_value_heads=8,
                       intermediate_size=14336, sliding_window=4096, max_position_embeddings=32768)
    r = kv_calc(cfg, dtype="float16", context=32768, kv_cache_memory=8 << 30)
    window_blocks = -(-4096 // 16) + 1
    assert r.sliding_window == 4096 and r.bytes_per_sequence == window_blocks * r.bytes_per_block
    assert r.max_concurrent_seqs == r.num_blocks // window_blocks
    full = kv_calc(write_config(tmp_path / "full", num_key_value_heads=8), dtype="float16", context=32768,
                   kv_cache_memory=8 << 30)
    assert full.sliding_window is None and full.bytes_per_sequence == full.bytes_per_token * 32768


def test_mixture_of_experts_parameters_from_the_config():
    """Mixtral-8x7B's published 46.7B parameters from its config alone (experts, routers, dense attention)."""
    cfg = ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
                               "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                               "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                               "num_experts_per_tok": 2, "max_position_embeddings": 32768})
    assert count_params_from_config(cfg) == 46_702_792_704


def test_kv_cache_dtype_counts_the_stored_format(tmp_path):
    """Llama-2-7B (head_dim 128): fp8 1 byte a value; int8 / int4 per token head 1 / 0.5 byte plus a 4-byte
    (scale, zero) pair per token and KV head; the figure is the engine's kv_cache_spec for that format."""
    path = write_config(tmp_path)
    cfg = ModelConfig.from_hf(LLAMA_7B)
    per_token = {"auto": 524_288, "fp8": 262_144, "fp8_e5m2": 262_144,
                 "int8_per_token_head": 2 * 32 * 32 * (128 + 4), "int4_per_token_head": 139_264}
    for name, expected in per_token.items():
        r = kv_calc(path, dtype="float16", kv_cache_dtype=name, kv_cache_memory=8 << 30)
        assert r.bytes_per_token == expected == kv_cache_spec(cfg, torch.float16, 16, 1, name).bytes_per_token
        assert r.num_blocks == (8 << 30) // (expected * 16)
    assert kv_calc(path, dtype="float16", kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_calc(path, kv_cache_dtype="int2")


def test_cli_names_the_kv_cache_dtype(tmp_path, capsys):
    path = write_config(tmp_path)
    assert main(["kv-calc", path, "--dtype", "float16", "--kv-cache-dtype", "int4_per_token_head",
                 "--kv-cache-memory", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "kv_cache_dtype  int4_per_token_head" in out
    assert "139,264 bytes (2 x layers x KV heads x (head_dim / 2 bytes + 4-byte scale pair))" in out
    assert main(["kv-calc", path, "--dtype", "float16", "--kv-cache-memory", "8GiB"]) == 0
    assert "kv_cache_dtype  auto (float16)" in capsys.readouterr().out
    assert main(["kv-calc", path, "--kv-cache-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache_dtype"] == "fp8_e4m3"
    with pytest.raises(SystemExit):
        main(["kv-calc", path, "--kv-cache-dtype", "fp4"])


@pytest.mark.parametrize("text,value", [("7", 7), ("7b", 7), ("7k", 7 * 10**3), ("7KB", 7 * 10**3), ("7m", 7 * 10**6),
                                        ("7MB", 7 * 10**6), ("7g", 7 * 10**9), ("7gb", 7 * 10**9),
                                        ("7T", 7 * 10**12), ("7TB", 7 * 10**12), ("7KiB", 7 << 10),
                                        ("7MiB", 7 << 20), ("7 GiB", 7 << 30), ("7TiB", 7 << 40), ("0.5GiB", 1 << 29)])
def test_parse_bytes_every_unit(text, value):
    """Decimal units (k, KB, ...) are powers of 10, binary ones (KiB, ...) powers of 2, any case."""
    assert parse_bytes(text) == value


# Per family, the settings that change its parameter count (biases, tying, q/k norms, experts).
_FAMILY_SETTINGS = {
    "llama": [{}, {"tie_word_embeddings": True}, {"attention_bias": True, "mlp_bias": True}],
    "qwen2": [{"tie_word_embeddings": True}], "mistral": [{}], "granite": [{}],
    "mixtral": [{"num_local_experts": 4, "num_experts_per_tok": 2}],
    "qwen3": [{}], "qwen3_moe": [{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                  "mlp_only_layers": [1]}],
    "gemma2": [{}], "gemma3_text": [{}], "phi3": [{"pad_token_id": 0}], "olmo2": [{"pad_token_id": 0}],
    "gemma": [{}], "smollm3": [{"pad_token_id": 0}], "olmo3": [{"pad_token_id": 0}],
    "qwen2_moe": [{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 96, "mlp_only_layers": [1]}],
    "olmoe": [{"num_experts": 4, "num_experts_per_tok": 2}],
    "granitemoe": [{"num_local_experts": 4, "num_experts_per_tok": 2}],
    "granitemoeshared": [{"num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 96}],
    "glm": [{"pad_token_id": 0}], "glm4": [{"pad_token_id": 0}], "starcoder2": [{}, {"use_bias": False}],
    "stablelm": [{"use_qkv_bias": True}, {"use_parallel_residual": True, "qk_layernorm": True}],
    "phi": [{}, {"qk_layernorm": True}],
    "gpt_neox": [{}, {"use_parallel_residual": False, "attention_bias": False}],
    "cohere": [{"pad_token_id": 0}, {"pad_token_id": 0, "attention_bias": True},
               {"pad_token_id": 0, "use_qk_norm": True}], "cohere2": [{"pad_token_id": 0}],
    "gpt2": [{}], "gpt_bigcode": [{"multi_query": True}, {"multi_query": False}],
    "ministral3": [{"pad_token_id": 0}], "ernie4_5": [{"pad_token_id": 0}, {"pad_token_id": 0, "use_bias": True}],
    "helium": [{"pad_token_id": 0}], "seed_oss": [{"pad_token_id": 0}], "arcee": [{"pad_token_id": 0}],
    "exaone4": [{"pad_token_id": 0}], "gptj": [{"rotary_dim": 32}], "opt": [{"ffn_dim": 320}, {"enable_bias": False}],
    "nemotron": [{"pad_token_id": 0}],
    "falcon": [{}, {"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True},
               {"multi_query": False, "parallel_attn": False}],
}


@pytest.mark.parametrize("model_type,settings", [(t, s) for t in MODEL_TYPES for s in _FAMILY_SETTINGS[t]])
def test_parameters_from_the_config_equal_transformers_count(model_type, settings):
    """Every supported family, from its config alone: the count transformers' own model of that config has
    (both built on the meta device), so --gpu-memory budgets subtract the real weights."""
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=1000, hidden_size=256, intermediate_size=320, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128)
    config_class = type(transformers.AutoConfig.for_model(model_type))
    # A size the config class derives itself (Falcon's head_dim) cannot be passed.
    shape = {k: v for k, v in shape.items() if not isinstance(getattr(config_class, k, None), property)}
    hf_config = transformers.AutoConfig.for_model(model_type, **shape, **settings)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in hf.parameters())
    assert count_params_from_config(ModelConfig.from_hf(hf_config.to_dict())) == expected


def test_kv_budget_limits():
    """utilization in (0, 1]; a budget of exactly nothing is no room; an explicit budget wins."""
    assert kv_budget(100, None, 1000, 1.0, 0) == (900, "1.0 x 1000 - weights 100")
    assert kv_budget(100, None, 1000, 0.5, 50) == (350, "0.5 x 1000 - weights 100 - activations 50")
    assert kv_budget(100, 7, 1000, 5.0, 0) == (7, "--kv-cache-memory")
    assert kv_budget(100, None, None, 0.9, 0) == (None, "none given")
    for utilization in (0.0, 1.01, -0.5):
        with pytest.raises(ValueError, match=rf"gpu_memory_utilization must be in \(0, 1\], got {utilization}"):
            kv_budget(100, None, 1000, utilization, 0)
    with pytest.raises(ValueError, match=r"no room for a KV cache: .* = 0 bytes"):
        kv_budget(500, None, 1000, 0.5, 0)
    assert kv_budget(499, None, 1000, 0.5, 0)[0] == 1


def test_settings_out_of_range_are_refused(tmp_path):
    path = write_config(tmp_path)
    with pytest.raises(ValueError, match="context must be >= 1 token, got -3"):
        kv_calc(path, context=-3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        kv_calc(path, tensor_parallel_size=0)
    assert kv_calc(path, context=1, dtype="float16").bytes_per_sequence == 16 * 524_288  # one whole block


def test_report_per_device_under_tensor_parallelism(tmp_path):
    """More ranks than KV heads: each rank keeps one head (replicated); the table says "per device"."""
    path = write_config(tmp_path, num_key_value_heads=2)
    r = kv_calc(path, dtype="float16", tensor_parallel_size=4, kv_cache_memory=1 << 30)
    assert r.num_kv_heads == 1 and r.bytes_per_token == 2 * 32 * 1 * 128 * 2
    table = format_report(r)
    assert "32 layers x 1 KV heads per device x head_dim 128, float16, tensor parallel 4" in table
    assert "per token       16,384 bytes per device" in table
    single = format_report(kv_calc(path, dtype="float16", kv_cache_memory=1 << 30))
    assert "32 layers x 2 KV heads x head_dim 128, float16\n" in single and "per device" not in single


def test_small_edges_of_the_report(tmp_path, capsys):
    """A config naming no dtype sizes in float16; a window of 17 at block 16 holds 3 blocks (a decoding
    token's 17 keys may straddle two, +1); two ranks say "per device"; int8's rule names whole head_dim bytes."""
    path = tmp_path / "nodtype"
    write_config(path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["torch_dtype"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert kv_calc(str(path)).dtype == "float16"
    window = kv_calc(write_config(tmp_path / "w", architectures=["MistralForCausalLM"], model_type="mistral",
                                  sliding_window=17), dtype="float16", context=4096)
    assert window.bytes_per_sequence == 3 * window.bytes_per_block
    two = format_report(kv_calc(write_config(tmp_path / "tp"), dtype="float16", tensor_parallel_size=2))
    assert "16 KV heads per device" in two and ", tensor parallel 2" in two
    assert main(["kv-calc", write_config(tmp_path / "i8"), "--kv-cache-dtype", "int8_per_token_head"]) == 0
    assert "(2 x layers x KV heads x (head_dim bytes + 4-byte scale pair))" in capsys.readouterr().out


def test_hf_overrides_turn_on_yarn_and_its_longer_context(tmp_path, capsys):
    """Qwen3-8B's shape (40960 positions) with YaRN x4 over 32768 set through --hf-overrides: the default
    context is the stretched 131072 tokens, as the engine's max_model_len would be."""
    path = write_config(tmp_path, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_key_value_heads=8,
                        max_position_embeddings=40960, torch_dtype="bfloat16")
    assert kv_calc(path).context == 40960
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    r = kv_calc(path, hf_overrides=yarn, kv_cache_memory=64 << 30)
    assert r.context == 131072 and r.bytes_per_sequence == 131072 * r.bytes_per_token
    assert main(["kv-calc", path, "--hf-overrides", json.dumps(yarn), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 131072
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        kv_calc(path, hf_overrides="[]")
