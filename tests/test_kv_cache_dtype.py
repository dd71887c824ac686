"""kv_cache_dtype in the engine: settings and refusals, pool capacity, fp8 scales (checkpoint and calibration),
the quantized formats end to end on the default model (greedy), swapping and copy-on-write of quantized blocks.

The per-format kernels are the ops' business (tests/test_kv_quant_ops.py); here the engine must hand them the
right tensors and keep a block's value rows and scale-plane rows together. End-to-end outputs of a quantized
cache are not the unquantized ones: they are compared with "auto" only where the choice is clear (a large
top-2 gap), and with the same format's own run where the bytes must be equal (swap, copy-on-write).
Generations stay at a few dozen tokens.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import pytest
import torch
from model_util import assert_same_greedy, copy_checkpoint
from pagedkv import LLM, SamplingParams
from pagedkv.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from pagedkv.core.step_batch import BlockOps, StepBatch
from pagedkv.engine.memory_pool import kv_cache_spec
from pagedkv.engine.model_runner import ModelRunner, allocate_kv_cache, check_kv_cache_dtype, fp8_scale_source
from pagedkv.kv_cache import KV_CACHE_DTYPES, KVCache, kv_cache_format
from pagedkv.model import kv_scales
from pagedkv.model.kv_scales import K_SCALE_CONSTANT, V_SCALE_CONSTANT, kv_scale_target
from pagedkv.model.rotary import RotaryEmbedding, StepPositions

CPU = torch.device("cpu")
QUANTIZED = ("fp8", "fp8_e5m2", "int8_per_token_head", "int4_per_token_head")
CLOSE = ("fp8", "int8_per_token_head")  # formats whose greedy choices should follow auto's where it is clear
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]
MAX_TOKENS = 12
PARAGRAPH = ("Virtual memory lets every process believe it owns a large contiguous address space, while the "
             "operating system maps its pages onto scattered physical frames and brings them in on demand. ")


def small_config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return ModelConfig(**(base | kw))


def flat(pairs) -> list[float]:
    """[(k, v), ...] -> [k, v, ...] (pytest.approx compares flat sequences)."""
    return [x for pair in pairs for x in pair]


def make_llm(loaded_model, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 64 << 20)
    kw.setdefault("max_model_len", 256)
    return LLM(loaded_model=loaded_model, **kw)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# --- settings ------------------------------------------------------------------------------------------------

def test_cache_dtype_is_validated_and_kept_canonical():
    assert CacheConfig().cache_dtype == "auto"
    assert CacheConfig(cache_dtype="fp8").cache_dtype == "fp8_e4m3"
    assert EngineArgs(kv_cache_dtype="int4_per_token_head").cache_config().cache_dtype == "int4_per_token_head"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, "
                                         "int8_per_token_head, int4_per_token_head; got 'int3'"):
        CacheConfig(cache_dtype="int3")
    for value in (None, True, False):
        assert EngineArgs(calculate_kv_scales=value).cache_config().calculate_kv_scales is value
    with pytest.raises(ValueError, match="calculate_kv_scales must be None, True or False"):
        CacheConfig(calculate_kv_scales="yes")
    # EngineArgs refuses them at once, before a model loads or an engine-core process starts.
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model="/nonexistent", kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="calculate_kv_scales must be"):
        EngineArgs(calculate_kv_scales=1.0)


def test_llm_refuses_an_unknown_kv_cache_dtype(loaded_model):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got 'fp16'"):
        make_llm(loaded_model, kv_cache_dtype="fp16")


def test_cli_flags_reach_the_cache_config():
    from pagedkv.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)

    def cache(*argv: str) -> CacheConfig:
        return EngineArgs(**engine_kwargs(parser.parse_args(list(argv)))).cache_config()

    assert (cache().cache_dtype, cache().calculate_kv_scales) == ("auto", None)
    c = cache("--kv-cache-dtype", "fp8", "--calculate-kv-scales")
    assert (c.cache_dtype, c.calculate_kv_scales) == ("fp8_e4m3", True)
    assert cache("--no-calculate-kv-scales").calculate_kv_scales is False
    for name in KV_CACHE_DTYPES:
        assert cache("--kv-cache-dtype", name).cache_dtype == kv_cache_format(name).name


def test_cli_refuses_an_unknown_kv_cache_dtype(capsys):
    from pagedkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--kv-cache-dtype", "fp4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "int4_per_token_head" in err  # argparse lists the valid ones


def test_head_and_block_sizes_a_format_cannot_store_are_refused():
    for name in QUANTIZED:
        for head_size in (64, 80, 96, 112, 128, 256):  # every supported head size is even: int4 packs them all
            check_kv_cache_dtype(name, head_size, 16)
    with pytest.raises(ValueError, match="kv_cache_dtype int4_per_token_head packs 2 values a byte, so head_size "
                                         "must be a multiple of 2; this model's is 65.*kv_cache_dtype='auto'"):
        check_kv_cache_dtype("int4_per_token_head", 65, 16)
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3: block_size 12 is not supported"):
        check_kv_cache_dtype("fp8", 64, 12)


# --- capacity ------------------------------------------------------------------------------------------------

def test_blocks_in_the_same_budget(default_model_dir):
    """Head size 64 (the default model): fp8 stores 1 byte a value, int8 1 + 4/64, int4 1/2 + 4/64."""
    cfg = ModelConfig.from_pretrained(default_model_dir)
    assert cfg.head_dim == 64
    budget = 256 << 20

    def blocks(dtype: torch.dtype, cache_dtype: str) -> int:
        return kv_cache_spec(cfg, dtype, 16, 1, cache_dtype).num_blocks(budget)

    bf16, fp32 = blocks(torch.bfloat16, "auto"), blocks(torch.float32, "auto")
    got = {name: blocks(torch.bfloat16, name) for name in QUANTIZED}
    assert got == {name: blocks(torch.float32, name) for name in QUANTIZED}  # a quantized cache ignores the dtype
    assert (bf16, fp32) == (728, 364)
    assert got == {"fp8": 1456, "fp8_e5m2": 1456, "int8_per_token_head": 1370, "int4_per_token_head": 2589}
    for name, (vs_bf16, vs_fp32) in {"fp8": (1.95, 3.9), "fp8_e5m2": (1.95, 3.9),
                                     "int8_per_token_head": (1.88, 3.76),
                                     "int4_per_token_head": (3.55, 7.1)}.items():
        assert got[name] >= vs_bf16 * bf16 and got[name] >= vs_fp32 * fp32, name
    # Per token: 2 x 30 layers x 3 KV heads x (64 values + the 4-byte scale pair of the per-token formats).
    assert kv_cache_spec(cfg, torch.float32, 16, 1, "int4_per_token_head").bytes_per_token == 2 * 30 * 3 * (32 + 4)


def test_engine_pool_and_cache_tensors_follow_the_format(loaded_model, caplog):
    """The engine's pool in one kv_cache_memory budget (float32 compute), and what each layer's cache holds."""
    caplog.set_level(logging.INFO, logger="pagedkv")
    budget = 128 << 20
    counts = {}
    for name in ("auto", *QUANTIZED):
        llm = make_llm(loaded_model, kv_cache_memory=budget, kv_cache_dtype=name)
        engine = llm.llm_engine
        counts[name] = engine.block_manager.num_total_gpu_blocks
        assert engine.cache_config.num_gpu_blocks == counts[name]
        assert engine.kv_spec.cache_dtype == kv_cache_format(name).name
        kv = engine.runner.kv_caches[0]
        assert isinstance(kv, KVCache) and kv.kv_cache_dtype == kv_cache_format(name).name
        assert f"kv_cache_dtype {kv_cache_format(name).name}, {counts[name]} blocks" in caplog.text
        fmt = kv.format
        assert kv.key.dtype == fmt.element_dtype(torch.float32)
        assert kv.key.shape == (counts[name], 16, 3, 32 if name.startswith("int4") else 64)
        if fmt.per_token_scale:
            assert kv.k_scale.shape == (counts[name], 16, 3, 2) and kv.k_scale.dtype == torch.float16
        elif fmt.per_tensor_scale:
            assert kv.k_scale.shape == (1,) and kv.k_scale.dtype == torch.float32
        else:
            assert kv.k_scale is None and kv.op_args == {}
    assert counts["auto"] == 182
    assert counts["fp8"] >= 3.9 * counts["auto"]
    assert counts["int8_per_token_head"] >= 3.76 * counts["auto"]
    assert counts["int4_per_token_head"] >= 7.1 * counts["auto"]


def test_allocate_kv_cache_per_format():
    cfg = small_config()
    for name in ("auto", *QUANTIZED):
        caches = allocate_kv_cache(cfg, 2, 10, 16, torch.bfloat16, CPU, kv_cache_dtype=name)
        assert len(caches) == 2 and all(isinstance(c, KVCache) for c in caches)
        key, value = caches[1]  # still unpacks as the pair
        fmt = kv_cache_format(name)
        assert key.shape == value.shape == (10, 16, 2, fmt.last_dim(64))
        assert len(caches[0].block_tensors()) == (4 if fmt.per_token_scale else 2)


# --- fp8 scales ----------------------------------------------------------------------------------------------

def test_checkpoint_scale_names():
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_target("model.layers.3.self_attn.v_scale") == (3, "v")
    assert kv_scale_target("model.layers.0.self_attn.k_proj.k_scale") == (0, "k")  # ModelOpt
    assert kv_scale_target("model.layers.0.self_attn.v_proj.v_scale") == (0, "v")
    assert kv_scale_target("model.layers.1.self_attn.qkv_proj.v_scale") == (1, "v")  # fused qkv checkpoints
    assert kv_scale_target("layers.2.self_attn.attn.k_scale") == (2, "k")  # vLLM's own name
    assert kv_scale_target("model.layers.12.self_attn.k_proj.output_scale") == (12, "k")
    assert kv_scale_target("model.layers.12.self_attn.v_proj.output_scale") == (12, "v")
    assert kv_scale_target("model.layers.4.self_attn.kv_scale") == (4, "kv")  # deprecated: one for both
    assert kv_scale_target("language_model.model.layers.5.self_attn.k_scale") == (5, "k")  # Gemma 3 multimodal
    assert kv_scale_target("model.layers.0.self_attn.q_scale") == (0, "")  # known, unused by a KV cache
    assert kv_scale_target("model.layers.0.self_attn.q_proj.output_scale") == (0, "")
    for other in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight_scale",
                  "model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
        assert kv_scale_target(other) is None, other


def test_scale_source_rule():
    none, some = [(None, None)] * 3, [(0.1, 0.2), (None, None), (0.3, None)]
    assert fp8_scale_source(None, none) == "calculate"
    assert fp8_scale_source(None, some) == "checkpoint"
    assert fp8_scale_source(True, some) == "calculate"
    assert fp8_scale_source(False, some) == "checkpoint"
    assert fp8_scale_source(False, none) == "one"


def test_fp8_scales_are_amax_over_vllms_constants():
    assert (K_SCALE_CONSTANT, V_SCALE_CONSTANT) == (200.0, 100.0)
    kv = KVCache(torch.zeros(2, 16, 2, 64, dtype=torch.float8_e4m3fn), torch.zeros(2, 16, 2, 64,
                 dtype=torch.float8_e4m3fn), "fp8", torch.ones(1), torch.ones(1))
    key, value = torch.zeros(5, 2, 64), torch.zeros(5, 2, 64)
    key[3, 1, 7], value[0, 0, 0] = -50.0, 3.0
    k_tensor = kv.k_scale
    kv_scales.calibrate_fp8_scales(kv, key, value)
    assert kv.k_scale is k_tensor  # in place: a captured graph reads it by address
    assert kv.k_scale.item() == pytest.approx(50.0 / 200) and kv.v_scale.item() == pytest.approx(3.0 / 100)
    kv_scales.calibrate_fp8_scales(kv, torch.zeros(5, 2, 64), value)
    assert kv.k_scale.item() == 1.0  # all zeros: any scale is exact; never 0 (its inverse would be inf)


def test_calibration_sets_scales_from_rotated_keys_before_the_write(monkeypatch):
    """rotate + cache with calibrate=True: the scales are computed from the rotated k (what the cache holds) and
    are in place before reshape_and_cache quantizes; without calibrate the fused op gets the cache's op_args."""
    from pagedkv.model import rotary

    rope = RotaryEmbedding(64, 128, 10000.0)
    kv = allocate_kv_cache(small_config(), 2, 4, 16, torch.float32, CPU, kv_cache_dtype="fp8")[0]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, n, 64, generator=gen) * 4 for n in (4, 2, 2))
    positions = torch.arange(3, 8)
    calls = []

    def fake_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **op_args):
        calls.append(("reshape", key.clone(), op_args["k_scale"].clone(), op_args["v_scale"].clone(), op_args))

    def fake_fused(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin, is_neox, **op_args):
        calls.append(("fused", op_args))

    monkeypatch.setattr(rotary.ops, "reshape_and_cache", fake_reshape_and_cache)
    monkeypatch.setattr(rotary.ops, "rotary_embedding_and_cache", fake_fused)
    pos = StepPositions(positions, True, torch.float32)
    out_q = rope.apply(pos, q.clone(), k.clone(), v, kv, torch.arange(5), calibrate=True)
    (kind, written_k, k_scale, v_scale, op_args), = calls
    cos, sin = rope.lookup(positions, torch.float32)
    torch.testing.assert_close(written_k, rope(k, cos, sin))
    torch.testing.assert_close(out_q, rope(q, cos, sin))
    assert k_scale.item() == pytest.approx(rope(k, cos, sin).abs().max().item() / K_SCALE_CONSTANT)
    assert v_scale.item() == pytest.approx(v.abs().max().item() / V_SCALE_CONSTANT)
    assert op_args["kv_cache_dtype"] == "fp8_e4m3" and op_args["k_scale"] is kv.k_scale
    calls.clear()
    rope.apply(pos, q.clone(), k.clone(), v, kv, torch.arange(5))
    assert calls == [("fused", kv.op_args)]


class RecordingModel:
    """A CausalLM stand-in: records whether each forward was asked to calibrate; no kernels run."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.config, self.num_kv_heads, self.calibrate_flags = cfg, cfg.num_key_value_heads, []

    def __call__(self, input_ids, positions, kv_caches, meta):
        self.calibrate_flags.append(meta.calibrate_kv_scales)
        return torch.zeros(len(input_ids), self.config.hidden_size)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.config.vocab_size)

    def checkpoint_kv_scales(self):
        return [(None, None)] * self.config.num_hidden_layers


def stub_runner(cache_dtype: str, num_blocks: int = 8, num_cpu_blocks: int = 0, **cache) -> ModelRunner:
    cfg = small_config()
    return ModelRunner(RecordingModel(cfg), None, CacheConfig(cache_dtype=cache_dtype, **cache),
                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                       num_blocks, num_cpu_blocks, torch.float32, CPU)


def prefill_batch() -> StepBatch:  # one 3-token prompt in block 0
    return StepBatch(np.array([1, 2, 3]), np.arange(3), np.arange(3), np.zeros((1, 1), np.int32),
                     np.array([3], np.int32), np.array([0, 3], np.int32), np.array([2]), 0, 0, 3, 3)


def decode_batch() -> StepBatch:  # its next token
    return StepBatch(np.array([4]), np.array([3]), np.array([3]), np.zeros((1, 1), np.int32),
                     np.array([4], np.int32), np.zeros(1, np.int32), np.array([0]), 1, 4, 0, 0)


def test_calibration_runs_once_on_the_first_step_with_prefill_tokens():
    runner = stub_runner("fp8")
    assert runner.kv_scales_pending
    runner.profile_run(8, 1)  # a profile (or warm-up) forward never calibrates
    runner.run_batch(BlockOps(), decode_batch())  # nor a decode-only step (the one a CUDA graph replays)
    runner.run_batch(BlockOps(), prefill_batch())
    runner.run_batch(BlockOps(), prefill_batch())
    assert runner.model.calibrate_flags == [False, False, True, False]
    assert not runner.kv_scales_pending
    for cache_dtype, calculate in (("auto", None), ("int8_per_token_head", True), ("fp8", False)):
        assert not stub_runner(cache_dtype, calculate_kv_scales=calculate).kv_scales_pending


def test_swapping_moves_every_block_tensor_of_a_quantized_cache():
    """Swap out then in: the values and the scale planes of the swapped blocks come back bit for bit."""
    runner = stub_runner("int4_per_token_head", num_blocks=8, num_cpu_blocks=4)
    gen = torch.Generator().manual_seed(1)
    for kv in runner.kv_caches:
        for t in kv.block_tensors():
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                    dtype=torch.uint8))
    before = [[t.clone() for t in kv.block_tensors()] for kv in runner.kv_caches]
    runner.apply_block_ops(BlockOps(swap_out=[(1, 0), (6, 3)]))
    runner.apply_block_ops(BlockOps(swap_in=[(0, 2), (3, 7)]))
    for kv, old in zip(runner.kv_caches, before, strict=True):
        assert len(old) == 4
        for t, o in zip(kv.block_tensors(), old, strict=True):
            assert torch.equal(t[2].view(torch.uint8), o[1].view(torch.uint8))
            assert torch.equal(t[7].view(torch.uint8), o[6].view(torch.uint8))


def test_copy_on_write_copies_the_scale_planes():
    runner = stub_runner("int8_per_token_head")
    gen = torch.Generator().manual_seed(2)
    for kv in runner.kv_caches:
        for t in kv.block_tensors():
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                    dtype=torch.uint8))
    runner.apply_block_ops(BlockOps(copy=[(1, 5), (2, 6)]))
    for kv in runner.kv_caches:
        for t in kv.block_tensors():
            assert torch.equal(t[5].view(torch.uint8), t[1].view(torch.uint8))
            assert torch.equal(t[6].view(torch.uint8), t[2].view(torch.uint8))


@pytest.fixture(scope="module")
def scaled_checkpoint(default_model_dir, tmp_path_factory):
    """The default checkpoint plus fp8 KV scales for every layer, in the naming styles of the tools that write
    them (layer i % 4: compressed-tensors, ModelOpt, ModelOpt's older output_scale, the deprecated kv_scale),
    and a q_scale (unused by the cache). Returns (folder, per-layer (k_scale, v_scale))."""
    from safetensors.torch import save_file

    path = copy_checkpoint(default_model_dir, tmp_path_factory.mktemp("scaled") / "ckpt")
    layers = ModelConfig.from_pretrained(path).num_hidden_layers
    expected, tensors = [], {}
    for i in range(layers):
        k, v = 0.02 + 0.001 * i, 0.01 + 0.0005 * i
        prefix = f"model.layers.{i}.self_attn."
        style = i % 4
        if style == 0:
            tensors |= {prefix + "k_scale": torch.tensor(k), prefix + "v_scale": torch.tensor(v)}
        elif style == 1:
            tensors |= {prefix + "k_proj.k_scale": torch.tensor([k]), prefix + "v_proj.v_scale": torch.tensor([v])}
        elif style == 2:
            tensors |= {prefix + "k_proj.output_scale": torch.tensor(k),
                        prefix + "v_proj.output_scale": torch.tensor(v)}
        else:
            tensors[prefix + "kv_scale"] = torch.tensor(k)
            v = k
        expected.append((k, v))
    tensors["model.layers.0.self_attn.q_scale"] = torch.tensor(0.5)
    save_file(tensors, str(path / "kv_scales.safetensors"))
    return path, expected


@pytest.fixture(scope="module")
def scaled_model(scaled_checkpoint):
    from pagedkv.model.loader import LoadedModel

    return LoadedModel.load(EngineArgs(model=str(scaled_checkpoint[0]), device="cpu", dtype="float32"))


def test_checkpoint_scales_are_loaded_into_every_layer(scaled_checkpoint, scaled_model, caplog):
    caplog.set_level(logging.INFO, logger="pagedkv")
    _, expected = scaled_checkpoint
    assert flat(scaled_model.model.checkpoint_kv_scales()) == pytest.approx(flat(expected))
    llm = make_llm(scaled_model, kv_cache_dtype="fp8")
    runner = llm.llm_engine.runner
    assert not runner.kv_scales_pending  # None: the checkpoint has them, so they are not computed
    assert flat(runner.kv_scales()) == pytest.approx(flat(expected), rel=1e-6)
    assert "fp8 KV-cache scales (fp8_e4m3): from the checkpoint, k_scale 0.02-0.049" in caplog.text
    forced = make_llm(scaled_model, kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True).llm_engine.runner
    assert forced.kv_scales_pending and forced.kv_scales() == [(1.0, 1.0)] * len(expected)
    kept = make_llm(scaled_model, kv_cache_dtype="fp8", calculate_kv_scales=False).llm_engine.runner
    assert not kept.kv_scales_pending and flat(kept.kv_scales()) == pytest.approx(flat(expected), rel=1e-6)


def test_checkpoint_scales_do_not_change_an_unquantized_run(scaled_model, loaded_model):
    """The scale tensors are not parameters: with kv_cache_dtype auto the checkpoint runs as the plain one."""
    ref = make_llm(loaded_model).generate(PROMPTS[:2], greedy(8), use_tqdm=False)
    got = make_llm(scaled_model).generate(PROMPTS[:2], greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_fp8_with_checkpoint_scales_generates_and_keeps_them(scaled_checkpoint, scaled_model):
    llm = make_llm(scaled_model, kv_cache_dtype="fp8")
    out = llm.generate(PROMPTS[:1], greedy(8), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.text
    assert flat(llm.llm_engine.runner.kv_scales()) == pytest.approx(flat(scaled_checkpoint[1]), rel=1e-6)


def test_calibration_on_the_first_batch_sets_each_layer_from_its_keys(loaded_model, monkeypatch, caplog):
    """calculate_kv_scales=None and a checkpoint without scales: the first step computes every layer's scales
    (amax of the keys it writes / 200, of the values / 100), once; later steps leave them."""
    from pagedkv.model import rotary

    caplog.set_level(logging.INFO, logger="pagedkv")
    seen = []
    original = kv_scales.calibrate_fp8_scales

    def recording(kv_cache, key, value):
        seen.append((key.abs().max().item() / K_SCALE_CONSTANT, value.abs().max().item() / V_SCALE_CONSTANT))
        original(kv_cache, key, value)

    monkeypatch.setattr(rotary, "calibrate_fp8_scales", recording)
    llm = make_llm(loaded_model, kv_cache_dtype="fp8")
    runner = llm.llm_engine.runner
    assert runner.kv_scales_pending and runner.kv_scales()[0] == (1.0, 1.0)
    llm.generate(PROMPTS, greedy(4), use_tqdm=False)
    llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)
    layers = loaded_model.model.config.num_hidden_layers
    assert len(seen) == layers and not runner.kv_scales_pending
    scales = runner.kv_scales()
    assert flat(scales) == pytest.approx(flat(seen), rel=1e-6)
    assert all(k != 1.0 and v != 1.0 and k > 0 and v > 0 for k, v in scales)
    assert len({k for k, _ in scales}) > 1  # per layer, not one value for all
    assert "fp8 KV-cache scales (fp8_e4m3) computed from the first batch: k_scale" in caplog.text


# --- end to end ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def auto_reference(loaded_model):
    """Greedy outputs of the unquantized cache, with the top-2 logprob gap at each token."""
    outs = make_llm(loaded_model).generate(PROMPTS, greedy(logprobs=2), use_tqdm=False)
    return [(o.outputs[0].token_ids, [_gap(lp) for lp in o.outputs[0].logprobs]) for o in outs]


def _gap(logprobs: dict) -> float:
    top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return top[0] - top[1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_generate_with_a_quantized_cache(loaded_model, auto_reference, cache_dtype):
    """Every format generates text; where auto's choice is clear (top-2 gap > 1 nat) fp8 (e4m3) and int8 take it,
    and follow auto's greedy run for at least half its tokens on average."""
    llm = make_llm(loaded_model, kv_cache_dtype=cache_dtype)
    assert llm.llm_engine.cache_config.cache_dtype == kv_cache_format(cache_dtype).name
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    agreement, clear, clear_agree = [], 0, 0
    for out, (ref, gaps) in zip(outs, auto_reference, strict=True):
        sample = out.outputs[0]
        assert out.error is None and len(sample.token_ids) == MAX_TOKENS and sample.text.strip()
        n = _common_prefix(sample.token_ids, ref)
        agreement.append(n / MAX_TOKENS)
        # Up to the first divergence both runs saw the same context: a clear choice there must match.
        for i in range(min(n + 1, MAX_TOKENS)):
            if gaps[i] > 1.0:
                clear += 1
                clear_agree += sample.token_ids[i] == ref[i]
    mean = sum(agreement) / len(agreement)
    print(f"{cache_dtype}: common prefix with auto {agreement}, clear choices kept {clear_agree}/{clear}")
    if cache_dtype in CLOSE:
        assert clear_agree == clear and mean >= 0.5, (agreement, clear_agree, clear)
    else:
        assert clear_agree >= clear / 2 and max(agreement) > 0, (agreement, clear_agree, clear)
    assert llm.llm_engine.block_manager.num_used_gpu_blocks == 0


@pytest.mark.parametrize("cache_dtype", ["fp8", "int8_per_token_head"])
def test_swap_preemption_with_a_quantized_cache(loaded_model, cache_dtype):
    """A pool too small for the batch swaps blocks out and back (values and scale planes): the greedy tokens
    equal a run of the same format that never preempts. fp8 scales fixed at 1.0, so the two runs' first batches
    (which differ) do not set different scales."""
    cfg = loaded_model.model.config
    ids = loaded_model.tokenizer.encode(PARAGRAPH * 5)
    # 12 tokens into a block: each sequence needs a new block within its 6 tokens, and 24 blocks hold 4 prompts.
    prompts = [{"prompt_token_ids": ids[:n]} for n in (60, 92, 124, 61, 93, 125)]
    kw = dict(kv_cache_dtype=cache_dtype, calculate_kv_scales=False, max_model_len=256)
    ref = make_llm(loaded_model, **kw).generate(prompts, greedy(6, logprobs=2), use_tqdm=False)
    tiny = 24 * 16 * cfg.kv_bytes_per_token(torch.float32, 1, cache_dtype)
    llm = make_llm(loaded_model, kv_cache_memory=tiny, preemption_mode="swap", swap_space=0.05, **kw)
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0 and llm.llm_engine.scheduler.num_swapped_out > 0
    assert_same_greedy(ref, outs, f"swap, {cache_dtype}", tie_gap=1e-2)
    bm = llm.llm_engine.block_manager
    assert bm.num_used_gpu_blocks == 0 and bm.num_free_cpu_blocks == bm.core.num_cpu_blocks


@pytest.mark.parametrize("cache_dtype", ["fp8", "int8_per_token_head", "int4_per_token_head"])
def test_parallel_samples_copy_on_write_a_quantized_cache(loaded_model, cache_dtype, monkeypatch):
    """n=3 greedy samples share the prompt's blocks and copy the last one on their first write: the planes go
    with it, so every sample equals the n=1 run."""
    from pagedkv import ops

    copies = []
    original = ops.copy_blocks

    def recording(key_caches, value_caches, block_mapping, **planes):
        copies.append(sorted(planes))
        original(key_caches, value_caches, block_mapping, **planes)

    monkeypatch.setattr(ops, "copy_blocks", recording)
    one = make_llm(loaded_model, kv_cache_dtype=cache_dtype).generate(PROMPTS, greedy(8, logprobs=2),
                                                                        use_tqdm=False)
    llm = make_llm(loaded_model, kv_cache_dtype=cache_dtype, enable_prefix_caching=True)
    three = llm.generate(PROMPTS, greedy(8, n=3), use_tqdm=False)
    assert copies, "no copy-on-write happened"
    planes = [] if cache_dtype == "fp8" else ["key_scales", "value_scales"]
    assert all(c == planes for c in copies)
    for ref, out in zip(one, three, strict=True):
        assert len(out.outputs) == 3
        assert_same_greedy([ref] * 3, [_single(out, i) for i in range(3)], f"n=3, {cache_dtype}", tie_gap=1e-2)
    assert llm.llm_engine.block_manager.num_used_gpu_blocks == 0


def _single(out, i: int):
    """Sample i of `out` as an output of its own (assert_same_greedy pairs the outputs' samples in order)."""
    from types import SimpleNamespace

    return SimpleNamespace(request_id=out.request_id, outputs=[out.outputs[i]])


def test_cache_config_info_metric_carries_the_cache_dtype():
    from pagedkv.server.metrics import ServerMetrics
    from prometheus_client.parser import text_string_to_metric_families

    info = CacheConfig(cache_dtype="fp8", num_gpu_blocks=1456, num_cpu_blocks=0).metrics_info()
    text = ServerMetrics("m", 256, cache_info=info).render().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"]
    (s,) = family.samples
    assert s.value == 1 and s.labels == {**info, "engine": "0"}
    assert s.labels["cache_dtype"] == "fp8_e4m3" and s.labels["num_gpu_blocks"] == "1456"
