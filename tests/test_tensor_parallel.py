"""Tensor parallelism on the CPU (gloo): sharded engines produce the single-device engine's tokens.

- A tiny random-initialised Llama (8 query heads, 2 KV heads; the default
  model's tokenizer) at sizes 2 and 4 (4 replicates the KV heads), and the
  default model (9 heads, 3 KV heads) at size 3: greedy token ids equal size
  1's, with prefix caching hits, preemption (recompute and swap) and a
  copy-on-write fork (n=2) in the same run. Sharding changes the order of
  float sums, so a difference is allowed only where size 1's top-2 logit
  gap is below 1e-4 (then the rest of that sequence is not compared; the
  test reports it).
- The torchrun path: `pagedkv generate` under torchrun with two local ranks.
- Failures: a size that does not divide the model is refused, listing the
  valid ones; a killed worker makes the engine raise WorkerDiedError, and the
  server answer 503 (tests/tp_scenarios.py, in subprocesses with a timeout, so
  that a hang fails instead of blocking the session).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_util import assert_same_greedy
from pagedkv import LLM, SamplingParams
from pagedkv.config import ModelConfig

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
NUM_BLOCKS = 12  # 192 tokens for 7 sequences of ~20 + 32: preemption is certain
MAX_MODEL_LEN = 128
SHARED = "You are a careful assistant. Answer briefly and precisely, and show the numbers you used. "
QUESTIONS = ["What is 17 times 3?", "Name three prime numbers above 50.", "Why does a KV cache help decoding?",
             "Summarise paged attention in one line.", "What is the capital of Japan?",
             "Convert 3 kilometres to metres."]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, default_model_dir) -> Path:
    """8 heads / 2 KV heads of 64, 2 layers, the default model's 49152-token vocabulary and tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    path = tmp_path_factory.mktemp("tiny_tp")
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_dir) / name, path / name)
    return path


def _kv_memory(path: Path, tp: int, num_blocks: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes that give exactly `num_blocks` blocks per rank at size `tp` (so every size preempts alike)."""
    cfg = ModelConfig.from_pretrained(path)
    return cfg.kv_bytes_per_token(torch.float32, tp, kv_cache_dtype) * BLOCK_SIZE * num_blocks


def _prompts(tokenizer, n: int = len(QUESTIONS)) -> list[list[int]]:
    return [tokenizer.encode(SHARED + q) for q in QUESTIONS[:n]]


def _params(n: int = len(QUESTIONS), max_tokens: int = 32) -> list[SamplingParams]:
    """Greedy, ignore_eos so every sequence runs its full length; one request forks (n=2, copy-on-write), one
    scores its prompt (prompt_logprobs: every rank computes those rows' logits too)."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2) for _ in range(n)]
    params[1] = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2, n=2)
    if n > 2:
        params[2] = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2,
                                   prompt_logprobs=2)
    return params


def assert_same_prompt_logprobs(ref_outputs, outputs) -> None:
    """The scored prompt's logprobs equal size 1's (float sum order aside), and it read no cached block."""
    ref, got = ref_outputs[2], outputs[2]
    assert got.num_cached_tokens == 0 and len(got.prompt_logprobs) == len(got.prompt_token_ids)
    assert [e and list(e) for e in got.prompt_logprobs] == [e and list(e) for e in ref.prompt_logprobs]
    flat = [[v.logprob for e in o.prompt_logprobs if e for v in e.values()] for o in (got, ref)]
    assert flat[0] == pytest.approx(flat[1], abs=1e-4)


def _engine_kwargs(path: Path, tp: int, num_blocks: int, preemption_mode: str, **cache) -> dict:
    """cache: kv_cache_dtype (the pool still gets exactly num_blocks blocks) and calculate_kv_scales."""
    return dict(model=str(path), device="cpu", dtype="float32", tensor_parallel_size=tp,
                kv_cache_memory=_kv_memory(path, tp, num_blocks, cache.get("kv_cache_dtype", "auto")),
                enable_prefix_caching=True, preemption_mode=preemption_mode, max_model_len=MAX_MODEL_LEN,
                block_size=BLOCK_SIZE, **cache)


def _run(kwargs: dict, prompts, params):
    with LLM(**kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return outputs, llm.get_stats()


@pytest.fixture(scope="module")
def tiny_reference(tiny_checkpoint):
    """Size 1 on the tiny model with the cache the sharded runs get: (prompts, outputs, stats)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    prompts = _prompts(tok)
    outputs, stats = _run(_engine_kwargs(tiny_checkpoint, 1, NUM_BLOCKS, "recompute"), prompts, _params())
    return prompts, outputs, stats


def test_tiny_llama_sharded_under_the_engine_core_process(tiny_checkpoint, tiny_reference):
    """The core process starts the ranks under itself: the same outputs as size 1 in-process."""
    prompts, ref_outputs, _ = tiny_reference
    kwargs = _engine_kwargs(tiny_checkpoint, 2, NUM_BLOCKS, "recompute") | {"engine_core": "process"}
    outputs, stats = _run(kwargs, prompts, _params())
    assert_same_greedy(ref_outputs, outputs, "tiny Llama at tensor_parallel_size=2 in the core process")
    assert_same_prompt_logprobs(ref_outputs, outputs)
    assert stats.prefix_cache_hits > 0 and all(o.finished for o in outputs)


@pytest.mark.parametrize("tp, preemption_mode", [(2, "swap"), (4, "recompute")])
def test_tiny_llama_sharded_matches_one_device(tiny_checkpoint, tiny_reference, tp, preemption_mode):
    prompts, ref_outputs, ref_stats = tiny_reference
    outputs, stats = _run(_engine_kwargs(tiny_checkpoint, tp, NUM_BLOCKS, preemption_mode), prompts, _params())
    assert_same_greedy(ref_outputs, outputs, f"tiny Llama at tensor_parallel_size={tp}")
    assert_same_prompt_logprobs(ref_outputs, outputs)
    # The features the issue asks to have in play did happen, on the driver's block manager.
    assert stats.num_preemptions > 0 and ref_stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert all(o.finished for o in outputs)


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "fp8"])
def test_quantized_cache_sharded_matches_one_device(tiny_checkpoint, tiny_reference, kv_cache_dtype):
    """Each rank quantizes its own KV heads; the per-token-head pairs are per head, so sharding changes nothing
    but float sum order, and fp8 at fixed scales (1.0) the same. Swapping and the fork move the scale planes."""
    prompts = tiny_reference[0]
    cache = dict(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=False)
    ref_outputs, _ = _run(_engine_kwargs(tiny_checkpoint, 1, NUM_BLOCKS, "swap", **cache), prompts, _params())
    outputs, stats = _run(_engine_kwargs(tiny_checkpoint, 2, NUM_BLOCKS, "swap", **cache), prompts, _params())
    assert_same_greedy(ref_outputs, outputs, f"tiny Llama, {kv_cache_dtype} cache, tensor_parallel_size=2",
                       tie_gap=1e-2)
    assert stats.num_preemptions > 0 and all(o.finished for o in outputs)


def test_default_model_at_size_3_matches_one_device(loaded_model, default_model_dir):
    # Smaller than the tiny model's run (3 ranks share 2 cores here): 5 sequences of ~20 + 16 tokens in 8 blocks.
    prompts, num_blocks = _prompts(loaded_model.tokenizer, 4), 8
    one = dict(device="cpu", dtype="float32", kv_cache_memory=_kv_memory(default_model_dir, 1, num_blocks),
               enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    with LLM(str(default_model_dir), loaded_model=loaded_model, **one) as llm:
        ref_outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(4, 16), use_tqdm=False)
    outputs, stats = _run(_engine_kwargs(default_model_dir, 3, num_blocks, "recompute"), prompts, _params(4, 16))
    assert_same_greedy(ref_outputs, outputs, "the default model at tensor_parallel_size=3")
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("tp", [3, 5, 0])
def test_size_that_does_not_divide_the_model_is_refused(tiny_checkpoint, tp):
    with pytest.raises(ValueError, match=r"tensor_parallel_size") as err:
        LLM(str(tiny_checkpoint), device="cpu", tensor_parallel_size=tp)
    if tp:
        assert "valid sizes: [1, 2, 4, 8]" in str(err.value)


def test_loaded_model_cannot_be_shared_with_a_sharded_engine(loaded_model, default_model_dir):
    with pytest.raises(ValueError, match="loaded_model"):
        LLM(str(default_model_dir), loaded_model=loaded_model, tensor_parallel_size=3)


def _completions(stdout: str) -> dict[str, str]:
    """`pagedkv generate` prints '>>> prompt' then the completion line '<text>  [n tokens, reason]'."""
    found = re.findall(r">>> (.*)\n(.*)  \[\d+ tokens, \w+\]", stdout)
    return dict(found)


def test_torchrun_two_local_ranks(tiny_checkpoint):
    prompts = ["The capital of France is", "Paged attention stores keys"]
    with LLM(str(tiny_checkpoint), device="cpu", dtype="float32") as llm:
        expected = [o.outputs[0].text.strip() for o in
                    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "pagedkv.cli", "generate", str(tiny_checkpoint), "--tensor-parallel-size", "2", "--device", "cpu",
           "--dtype", "float32", "--max-tokens", "8", "--kv-cache-memory", str(1 << 24)]
    for p in prompts:
        cmd += ["--prompt", p]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = _completions(run.stdout)
    assert got == dict(zip(prompts, expected, strict=True)), run.stdout[-2000:]
    assert "tensor-parallel rank 1/2 joined" in run.stderr


def _scenario(name: str, checkpoint: Path) -> str:
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_scenarios.py"), name, str(checkpoint)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout


def test_killed_worker_raises_a_clear_error(tiny_checkpoint):
    out = _scenario("engine-kill", tiny_checkpoint)
    assert re.search(r"ERROR after [\d.]+ s: tensor-parallel worker died: rank 1 \(pid \d+\): exit code -9 "
                     r"\(killed by a signal\)", out), out
    assert "AGAIN: tensor-parallel worker died" in out  # the engine stays refused, it does not hang later either
    assert re.search(r"FREE BLOCKS: (\d+) of \1", out), out  # aborting the requests returned every block
    assert "SHUTDOWN OK" in out


def test_killed_worker_makes_the_server_answer_503(tiny_checkpoint):
    out = _scenario("server-kill", tiny_checkpoint)
    assert "BEFORE: 200" in out
    # The ranks run under the engine core's process: the core reports the death, the server answers for it.
    assert re.search(r"AFTER: 503 the engine core failed: tensor-parallel worker died: rank 1", out), out
    assert "LATER: 503 server_error" in out and "HEALTH: 503" in out and "SHUTDOWN OK" in out


def test_sharded_loading_reads_slices_equal_to_the_whole_tensor(tiny_checkpoint):
    """Ranks load through CheckpointSlice (read on demand): its slices are the whole tensor's slices."""
    from pagedkv.model.loader import CheckpointSlice, iter_safetensors

    whole = dict(iter_safetensors(tiny_checkpoint))
    for name, lazy in iter_safetensors(tiny_checkpoint, lazy=True):
        assert isinstance(lazy, CheckpointSlice) and lazy.shape == whole[name].shape
        n = lazy.shape[-1]
        assert torch.equal(lazy.narrow(lazy.dim() - 1, n // 4, n // 2), whole[name].narrow(-1, n // 4, n // 2))
        assert torch.equal(lazy[1:3], whole[name][1:3]) and torch.equal(lazy.read(), whole[name])
