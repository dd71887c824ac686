"""The engine on a tiny random all-sliding Mistral checkpoint: KV memory stays bounded by the window.

The checkpoint (transformers' MistralConfig(sliding_window=W), seeded random
weights, saved with save_pretrained) makes ModelConfig.kv_sliding_window = W,
and the engine hands it to the block manager. Sequences generated to 8x the
window must then hold about ceil(W / block_size) + 1 blocks each, with
prefix caching, n > 1 samples (fork, copy-on-write) and swap preemption too,
and the engine must neither crash nor leak. The greedy outputs of the same
family against HF's are in tests/test_model_families.py (mistral_window).
"""

from __future__ import annotations

import math

import pytest
import torch
from model_util import torch_threads
from pagedkv import LLM, SamplingParams
from pagedkv.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig, _max_model_len
from pagedkv.engine.memory_pool import KVCacheSpec, plan_kv_cache, tokens_held_at_most

transformers = pytest.importorskip("transformers")

WINDOW = 32
BS = 16
BOUND = math.ceil(WINDOW / BS) + 1  # blocks one decoding sequence holds at most


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = transformers.MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     max_position_embeddings=1024, initializer_range=0.1,
                                     sliding_window=WINDOW, tie_word_embeddings=False)
    torch.manual_seed(4321)
    model = transformers.MistralForCausalLM(cfg).float().eval()
    path = tmp_path_factory.mktemp("mistral_sliding")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def make_llm(checkpoint, **kw) -> LLM:
    args = dict(model=str(checkpoint), device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=BS,
                kv_cache_memory=4 << 20, max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=8)
    return LLM(**(args | kw))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, int]:
    """Steps the engine to the end, checking after every step that each sequence holds a window of blocks.

    Returns (request id -> final output, peak of used blocks).
    """
    engine = llm.llm_engine
    bm = engine.block_manager
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs, peak, dropped = {}, 0, 0
    chunk_blocks = -(-engine.scheduler_config.max_num_batched_tokens // BS)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        state = engine.inspect()
        assert state["invariants_error"] is None
        held = [bm.num_held_blocks(s) for s in bm.seq_ids() if not bm.is_swapped(s)]
        # Past its first decode a sequence holds a window of blocks (the last prefill chunk's window
        # goes at the next append, whose earliest query it is).
        decoding = [s for s in engine.scheduler.running if not s.is_finished
                    and s.num_computed_tokens > s.num_prompt_tokens]
        for s in decoding:
            assert bm.num_held_blocks(s.seq_id) <= BOUND, (s.seq_id, bm.get_block_table(s.seq_id))
        assert all(h <= BOUND + chunk_blocks for h in held)
        assert state["used_blocks"] <= sum(held)  # shared blocks count once
        peak = max(peak, state["used_blocks"])
        dropped = max(dropped, state["dropped_blocks"])
    assert dropped > 0  # every test runs past the window
    bm.check_invariants()
    assert bm.num_used_gpu_blocks == 0 and not bm.seq_ids()
    return outputs, peak


def prompts_of(lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def test_model_config_wires_the_window(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint)
    assert cfg.sliding_window == WINDOW and cfg.kv_sliding_window == WINDOW
    assert _max_model_len(cfg, None) == 1024  # no longer capped at the window
    full = transformers.MistralConfig(sliding_window=None, head_dim=64).to_dict()
    assert ModelConfig.from_hf(full | {"architectures": ["MistralForCausalLM"]}).kv_sliding_window is None
    llm = make_llm(checkpoint)
    assert llm.llm_engine.block_manager.sliding_window == WINDOW
    assert EngineArgs().max_model_len is None


def test_generation_to_8x_the_window_holds_a_window_of_blocks(checkpoint):
    llm = make_llm(checkpoint)
    lengths = [20, 45, 70, 3]
    params = SamplingParams(temperature=0.0, max_tokens=8 * WINDOW, ignore_eos=True)
    outputs, peak = run(llm, prompts_of(lengths), params)
    assert len(outputs) == len(lengths)
    for out in outputs.values():
        assert out.error is None and len(out.outputs[0].token_ids) == 8 * WINDOW
    # Without the window the four would hold sum(ceil((n + 256) / 16)) = 77 blocks at the end.
    assert peak <= len(lengths) * (BOUND + 128 // BS)
    assert llm.llm_engine.get_stats().num_preemptions == 0


def test_long_prompt_prefix_caching_and_forks(checkpoint):
    """A prompt of 16x the window in chunks, a second request sharing it (prefix hits), n = 3 samples."""
    llm = make_llm(checkpoint, enable_prefix_caching=True, long_prefill_token_threshold=64)
    long = prompts_of([16 * WINDOW])[0]
    params = SamplingParams(temperature=0.8, max_tokens=4 * WINDOW, ignore_eos=True, n=3, seed=1)
    outputs, _ = run(llm, [long], params)
    assert all(len(c.token_ids) == 4 * WINDOW for c in outputs["0"].outputs)
    bm = llm.llm_engine.block_manager
    assert bm.num_evictable_gpu_blocks > 0  # the dropped hashed blocks stayed cached
    again, _ = run(llm, [long[:-1] + [9]], SamplingParams(temperature=0.0, max_tokens=WINDOW, ignore_eos=True))
    assert again["0"].num_cached_tokens >= 16 * WINDOW - 2 * BS


def test_swap_preemption_with_dropped_blocks(checkpoint):
    """9 blocks; 4 sequences of 2 blocks reach their third block together: some swap out (live blocks only) and
    come back, and all finish."""
    llm = make_llm(checkpoint, preemption_mode="swap", swap_space=0.01, kv_cache_memory=9 * BS * 2048,
                   max_num_batched_tokens=64)
    assert llm.llm_engine.block_manager.num_total_gpu_blocks == 9
    params = SamplingParams(temperature=0.0, max_tokens=4 * WINDOW, ignore_eos=True)
    outputs, peak = run(llm, prompts_of([17, 18, 19, 20]), params)
    assert all(len(o.outputs[0].token_ids) == 4 * WINDOW for o in outputs.values())
    assert peak <= 9 and llm.llm_engine.scheduler.num_swapped_out > 0


def test_pool_only_needs_a_window_and_a_chunk():
    assert tokens_held_at_most(1024, 16, None, 128) == 1024
    assert tokens_held_at_most(1024, 16, 32, 128) == (math.ceil((31 + 128) / 16) + 1) * 16
    assert tokens_held_at_most(40, 16, 32, 128) == 48  # never more than max_model_len's blocks


def test_pool_check_takes_the_per_sequence_chunk_cap():
    """With long_prefill_token_threshold a sequence's chunk is at most the threshold, so a sliding-window pool
    need only hold the window and that chunk; without it, the whole step's budget."""
    spec = KVCacheSpec(bytes_per_token=1024, block_size=16)
    blocks = tokens_held_at_most(4096, 16, 32, 128) // 16  # 11: the window and a 128-token chunk
    cache = CacheConfig(watermark=0.0)
    capped = SchedulerConfig(max_num_batched_tokens=2048, max_model_len=4096, long_prefill_token_threshold=128)
    plan = plan_kv_cache(spec, blocks, cache, capped, torch.device("cpu"), sliding_window=32)
    assert plan.num_blocks == blocks
    with pytest.raises(ValueError, match="sliding-window model"):
        plan_kv_cache(spec, blocks, cache, SchedulerConfig(max_num_batched_tokens=2048, max_model_len=4096),
                      torch.device("cpu"), sliding_window=32)
