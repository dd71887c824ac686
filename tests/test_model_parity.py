"""Architecture coverage: pagedkv's decoder against HF transformers on tiny random checkpoints.

Tiny random-initialised Llama (Llama-3 rope scaling, tied embeddings),
Mistral and Qwen2 (QKV bias) checkpoints are written with transformers'
`save_pretrained` (float32 safetensors) and loaded with pagedkv's loader.
pagedkv's logits are compared with HF's on the same token ids:

* one prompt, one prefill, logits of every position;
* mixed flat batches built by hand with the block manager (decodes first, then
  prefill chunks; some chunks continue a prefix cached by an earlier step; a
  decode-only step), every row compared with HF's logits at that position;
* float32 within a tight tolerance, bfloat16 within a loose one (scaled by HF's
  own bf16 error);
* a sharded checkpoint (model.safetensors.index.json) gives the same logits;
* clear ValueErrors for an unsupported architecture or head_dim and for a
  checkpoint that lacks a weight (or has an unknown one);
* end to end: LLM greedy generation on the tiny Qwen2 equals HF `generate`.

Tolerances. The random weights use initializer_range 0.1 so that logits are of
order 1-5 and attention is far from uniform. float32: |ours - HF| <=
FP32_ATOL + FP32_RTOL * max|HF| over all compared rows, about 1.5e-4 here (the
differences are summation order and oneDNN's packed GEMMs; measured 5e-6 to
2e-5, while a wrong rope rule, a dropped bias or a 1% attention-scale error
gives 0.07 to 6). bfloat16: max|ours_bf16 - HF_fp32| <= 4 * max|HF_bf16 -
HF_fp32| + 0.05 (measured 0.14-0.26, the same as HF's own bf16 error), and the
argmax agrees with HF fp32 on >= 90% of rows (measured 96-99%).
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
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")


# Common shape of every tiny model: 2 layers, 4 query heads and 2 KV heads of 64 (GQA), hidden 128.
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
               initializer_range=0.1, rms_norm_eps=1e-6)


def _build(kind: str):
    T = transformers
    if kind == "llama3":  # Llama-3 rope scaling; a short original context so every regime of the rule is used
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        cfg = T.LlamaConfig(**_COMMON, rope_parameters=rope, tie_word_embeddings=False)
        return T.LlamaForCausalLM, cfg
    if kind == "llama_tied":
        cfg = T.LlamaConfig(**_COMMON, tie_word_embeddings=True)
        return T.LlamaForCausalLM, cfg
    if kind == "mistral":
        cfg = T.MistralConfig(**_COMMON, sliding_window=None, tie_word_embeddings=False)
        return T.MistralForCausalLM, cfg
    if kind == "qwen2":  # Qwen2 has a bias on q/k/v (and not on o_proj); head_dim from hidden / heads
        common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
        cfg = T.Qwen2Config(**(common | {"hidden_size": 256}), tie_word_embeddings=False)
        return T.Qwen2ForCausalLM, cfg
    raise AssertionError(kind)


KINDS = ("llama3", "llama_tied", "mistral", "qwen2")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """kind -> (checkpoint folder, the HF model in float32, eval mode)."""
    out = {}
    for i, kind in enumerate(KINDS):
        cls, cfg = _build(kind)
        torch.manual_seed(1234 + i)
        model = cls(cfg).float().eval()
        randomize(model, 99 + i)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path, safe_serialization=True)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="module")
def ours_fp32(checkpoints):
    return {kind: load_model(ModelSource(path), torch.float32, CPU) for kind, (path, _) in checkpoints.items()}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def test_checkpoints_cover_the_features(checkpoints):
    """The tiny checkpoints really carry what they are meant to cover (guards against silent config drift)."""
    cfgs = {k: json.loads((p / "config.json").read_text()) for k, (p, _) in checkpoints.items()}
    rope = cfgs["llama3"].get("rope_scaling") or cfgs["llama3"].get("rope_parameters")
    assert rope["rope_type"] == "llama3"
    assert cfgs["llama_tied"]["tie_word_embeddings"] is True
    assert cfgs["mistral"]["architectures"] == ["MistralForCausalLM"]
    qwen_sd = checkpoints["qwen2"][1].state_dict()
    assert qwen_sd["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen_sd
    # The rope scaling rule changes the frequencies used by HF (else the test would not test it).
    ours = load_model(ModelSource(checkpoints["llama3"][0]), torch.float32, CPU)
    assert ours.config.rope_scaling and ours.config.rope_scaling["rope_type"] == "llama3"


# --- float32 parity -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logits_match_hf(kind, checkpoints, ours_fp32):
    """One 45-token prompt as one prefill: the logits of every position equal HF's."""
    _, hf = checkpoints[kind]
    tokens = random_tokens(7, 45)
    ours = PagedRunner(ours_fp32[kind], torch.float32).step([], [(0, tokens)])
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 1.0  # logits of a useful magnitude
    assert_close_fp32(ours, ref, f"{kind} prompt")
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_logits_match_hf(kind, checkpoints, ours_fp32):
    """Decodes + prefill chunks (some after a cached prefix) + new prompts in one flat batch, then a decode step."""
    _, hf = checkpoints[kind]
    seqs, rows, ours = mixed_batch(PagedRunner(ours_fp32[kind], torch.float32))
    ref = mixed_reference(hf, seqs, rows)
    assert_close_fp32(ours, ref, f"{kind} mixed batch")


# --- bfloat16 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_bf16_close_to_hf(kind, checkpoints):
    """bfloat16 runs and stays as close to HF float32 as HF's own bfloat16 does (within a factor)."""
    path, hf = checkpoints[kind]
    ours_model = load_model(ModelSource(path), torch.bfloat16, CPU)
    seqs, rows, ours = mixed_batch(PagedRunner(ours_model, torch.bfloat16))
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    ref32 = mixed_reference(hf, seqs, rows)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref16 = mixed_reference(hf16, seqs, rows)
    hf_err = (ref16 - ref32).abs().max().item()
    err = (ours - ref32).abs().max().item()
    assert err <= 4 * hf_err + 0.05, f"bf16: ours {err:.3g} vs HF bf16 {hf_err:.3g} (from HF fp32)"
    # The distributions agree: the argmax matches HF fp32 on nearly every row.
    agree = (ours.argmax(-1) == ref32.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


# --- loading ------------------------------------------------------------------------------------------

def test_sharded_checkpoint_same_logits(checkpoints, ours_fp32, tmp_path):
    _, hf = checkpoints["qwen2"]
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = load_model(ModelSource(tmp_path), torch.float32, CPU)
    tokens = random_tokens(11, 21)
    a = PagedRunner(sharded, torch.float32).step([], [(0, tokens)])
    b = PagedRunner(ours_fp32["qwen2"], torch.float32).step([], [(0, tokens)])
    assert torch.equal(a, b)


def test_unsupported_architecture_raises(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama_tied"][0], tmp_path / "ckpt")
    edit_config(path, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    with pytest.raises(ValueError, match="unsupported architecture 'DeepseekV3ForCausalLM'"):
        load_model(ModelSource(path), torch.float32, CPU)


def test_unsupported_head_dim_raises(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama_tied"][0], tmp_path / "ckpt")
    edit_config(path, head_dim=32)
    with pytest.raises(ValueError, match="head_dim 32"):
        load_model(ModelSource(path), torch.float32, CPU)


def test_missing_weight_raises(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["qwen2"][0], tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for \['layers.1.mlp.down_proj.weight'\]"):
        load_model(ModelSource(path), torch.float32, CPU)


def test_missing_bias_raises(checkpoints, tmp_path):
    """Qwen2's q/k/v bias is a weight like the others: a checkpoint without it is refused, not zero-filled."""
    path = copy_checkpoint(checkpoints["qwen2"][0], tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    for part in "qkv":
        del tensors[f"model.layers.0.self_attn.{part}_proj.bias"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights"):
        load_model(ModelSource(path), torch.float32, CPU)


def test_unknown_weight_raises(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["mistral"][0], tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="q_norm"):
        load_model(ModelSource(path), torch.float32, CPU)


# The weight loaders narrow each checkpoint tensor to this rank's shard: without a check of its full size,
# a config.json that disagrees with the weights would load truncated or zero-padded tensors silently.
@pytest.mark.parametrize("change", [{"intermediate_size": 128}, {"intermediate_size": 512}, {"vocab_size": 256},
                                    {"vocab_size": 1024}, {"num_key_value_heads": 1}, {"num_attention_heads": 2}],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_config_checkpoint_shape_mismatch_raises(change, checkpoints, tmp_path):
    """A config.json that disagrees with the tensors (here: the smaller / larger one) is a clear ValueError."""
    path = copy_checkpoint(checkpoints["mistral"][0], tmp_path / "ckpt")
    edit_config(path, **change)
    with pytest.raises(ValueError, match="shape|does not fit"):
        load_model(ModelSource(path), torch.float32, CPU)


# --- end to end ----------------------------------------------------------------------------------------

def test_llm_greedy_matches_hf_generate(checkpoints):
    """LLM on the tiny Qwen2, prompts of different lengths batched together, greedy == HF generate(do_sample=False).

    The tiny checkpoint has no tokenizer: the default model's is used, prompts are token ids in the tiny vocab.
    If a step of HF's run is a near-tie (top-2 logits within 1e-3), the tokens after it are not compared.
    """
    path, hf = checkpoints["qwen2"]
    prompts = [random_tokens(200 + i, n) for i, n in enumerate((3, 17, 40, 9))]
    compared = assert_greedy_matches_hf(path, hf, prompts, max_tokens=12)
    assert compared >= 3 * 12  # nearly everything was compared
