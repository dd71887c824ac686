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
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from pagedkv.core.block_manager import BlockManager
from pagedkv.engine.model_runner import allocate_kv_cache
from pagedkv.model.attention import AttentionMetadata
from pagedkv.model.loader import ModelSource, load_model
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
VOCAB = 512
FP32_ATOL = 1e-4
FP32_RTOL = 1e-5
CPU = torch.device("cpu")

# Common shape of every tiny model: 2 layers, 4 query heads and 2 KV heads of 64 (GQA), hidden 128.
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
               initializer_range=0.1, rms_norm_eps=1e-6)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF zero-initialises biases and sets norm weights to 1: make them random so that they are tested too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)


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
        _randomize(model, 99 + i)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path, safe_serialization=True)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="module")
def ours_fp32(checkpoints):
    return {kind: load_model(ModelSource(path), torch.float32, CPU) for kind, (path, _) in checkpoints.items()}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The models are tiny: one intra-op thread avoids OpenMP barrier stalls on a shared, loaded CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


# --- running pagedkv on a hand-built flat batch -----------------------------------------------------

class PagedRunner:
    """A model, its paged KV cache and a block manager; runs steps built from (seq_id, tokens, start) lists."""

    def __init__(self, model, dtype: torch.dtype, num_blocks: int = 64) -> None:
        self.model = model
        self.bm = BlockManager(BLOCK_SIZE, num_blocks)
        self.kv = allocate_kv_cache(model.config, model.num_kv_heads, num_blocks, BLOCK_SIZE, dtype, CPU)
        self.computed: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, decodes: list[tuple[int, int]], prefills: list[tuple[int, list[int]]]) -> torch.Tensor:
        """decodes: (seq_id, token); prefills: (seq_id, chunk tokens). Returns float32 logits of every row."""
        ids: list[int] = []
        pos: list[int] = []
        for sid, tok in decodes:
            self.bm.append_slots(sid, 1)
            ids.append(tok)
            pos.append(self.computed[sid])
        lens = []
        for sid, chunk in prefills:
            start = self.computed.get(sid, 0)
            if start == 0:
                self.bm.allocate(sid, len(chunk))
            else:
                self.bm.append_slots(sid, len(chunk))
            ids.extend(chunk)
            pos.extend(range(start, start + len(chunk)))
            lens.append(len(chunk))
        nd, npf = len(decodes), len(prefills)
        seq_ids = [s for s, _ in decodes] + [s for s, _ in prefills]
        seq_lens_py = [self.computed[s] + 1 for s, _ in decodes] + [
            self.computed.get(s, 0) + n for (s, _), n in zip(prefills, lens, strict=True)]
        width = -(-max(seq_lens_py) // BLOCK_SIZE)
        block_tables = np.zeros((nd + npf, width), dtype=np.int32)
        slot_mapping = np.zeros(len(ids), dtype=np.int64)
        seq_lens = np.zeros(nd + npf, dtype=np.int32)
        query_lens = np.asarray([1] * nd + lens, dtype=np.int64)
        n = self.bm.fill_metadata(np.asarray(seq_ids, np.int64), block_tables, slot_mapping, seq_lens, query_lens)
        assert n == len(ids)
        assert seq_lens.tolist() == seq_lens_py
        qsl = np.zeros(npf + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        bt, sl = torch.from_numpy(block_tables), torch.from_numpy(seq_lens)
        meta = AttentionMetadata(
            num_decode_tokens=nd, slot_mapping=torch.from_numpy(slot_mapping),
            decode_block_tables=bt[:nd], decode_seq_lens=sl[:nd], decode_max_seq_len=max(seq_lens_py[:nd], default=0),
            num_prefills=npf, prefill_block_tables=bt[nd:], prefill_seq_lens=sl[nd:],
            prefill_query_start_loc=torch.from_numpy(qsl), prefill_max_query_len=max(lens, default=0),
            prefill_max_seq_len=max(seq_lens_py[nd:], default=0))
        hidden = self.model(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), self.kv,
                            meta)
        for (sid, _), length in zip(decodes + prefills, [1] * nd + lens, strict=True):
            self.computed[sid] = self.computed.get(sid, 0) + length
        return self.model.compute_logits(hidden)


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_close_fp32(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    assert ours.shape == ref.shape, what
    assert torch.isfinite(ours).all(), what
    err = (ours - ref).abs().max().item()
    bound = FP32_ATOL + FP32_RTOL * ref.abs().max().item()
    assert err <= bound, f"{what}: max |ours - HF| = {err:.3g} > {bound:.3g}"
    return err


def _mixed_batch(runner: PagedRunner) -> tuple[dict[int, list[int]], list[list[tuple[int, int]]], torch.Tensor]:
    """Runs three steps of a mixed flat batch.

    Returns (tokens of each sequence, per logits row its (seq_id, position), all logits rows stacked).
    Step 1: prefills only: C's first chunk (20 of 50 tokens), whole prompts of D (33), E (17), F (16: one full
    block). Step 2: decodes of D, E, F (F's needs a new block) first, then C's second chunk (30 tokens, starting
    mid-block after the cached prefix), and new prompts A (1 token) and B (7). Step 3: decode only, every
    sequence.
    """
    seqs = {sid: _tokens(100 + sid, n) for sid, n in
            ((0, 1 + 1), (1, 7 + 1), (2, 50 + 1), (3, 33 + 2), (4, 17 + 2), (5, 16 + 2))}
    a, b, c, d, e, f = range(6)
    rows: list[tuple[int, int]] = []
    logits = []

    def run(decodes, prefills):
        for sid, _ in decodes:
            rows.append((sid, runner.computed[sid]))
        for sid, chunk in prefills:
            start = runner.computed.get(sid, 0)
            rows.extend((sid, start + i) for i in range(len(chunk)))
        logits.append(runner.step(decodes, prefills))

    run([], [(c, seqs[c][:20]), (d, seqs[d][:33]), (e, seqs[e][:17]), (f, seqs[f][:16])])
    run([(d, seqs[d][33]), (e, seqs[e][17]), (f, seqs[f][16])],
        [(c, seqs[c][20:50]), (a, seqs[a][:1]), (b, seqs[b][:7])])
    run([(s, seqs[s][runner.computed[s]]) for s in (d, e, f, c, a, b)], [])
    for s, toks in seqs.items():
        assert runner.computed[s] == len(toks), s
    runner.bm.check_invariants()
    return seqs, rows, torch.cat(logits)


def _mixed_reference(hf_model, seqs, rows) -> torch.Tensor:
    full = {s: _hf_logits(hf_model, toks) for s, toks in seqs.items()}
    return torch.stack([full[s][p] for s, p in rows])


# --- float32 parity -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logits_match_hf(kind, checkpoints, ours_fp32):
    """One 45-token prompt as one prefill: the logits of every position equal HF's."""
    _, hf = checkpoints[kind]
    tokens = _tokens(7, 45)
    ours = PagedRunner(ours_fp32[kind], torch.float32).step([], [(0, tokens)])
    ref = _hf_logits(hf, tokens)
    assert ref.abs().max() > 1.0  # logits of a useful magnitude
    _assert_close_fp32(ours, ref, f"{kind} prompt")
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_logits_match_hf(kind, checkpoints, ours_fp32):
    """Decodes + prefill chunks (some after a cached prefix) + new prompts in one flat batch, then a decode step."""
    _, hf = checkpoints[kind]
    seqs, rows, ours = _mixed_batch(PagedRunner(ours_fp32[kind], torch.float32))
    ref = _mixed_reference(hf, seqs, rows)
    _assert_close_fp32(ours, ref, f"{kind} mixed batch")


# --- bfloat16 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_bf16_close_to_hf(kind, checkpoints):
    """bfloat16 runs and stays as close to HF float32 as HF's own bfloat16 does (within a factor)."""
    path, hf = checkpoints[kind]
    ours_model = load_model(ModelSource(path), torch.bfloat16, CPU)
    seqs, rows, ours = _mixed_batch(PagedRunner(ours_model, torch.bfloat16))
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    ref32 = _mixed_reference(hf, seqs, rows)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref16 = _mixed_reference(hf16, seqs, rows)
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
    tokens = _tokens(11, 21)
    a = PagedRunner(sharded, torch.float32).step([], [(0, tokens)])
    b = PagedRunner(ours_fp32["qwen2"], torch.float32).step([], [(0, tokens)])
    assert torch.equal(a, b)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_raises(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["llama_tied"][0], tmp_path / "ckpt")
    _edit_config(path, architectures=["GemmaForCausalLM"], model_type="gemma")
    with pytest.raises(ValueError, match="unsupported architecture 'GemmaForCausalLM'"):
        load_model(ModelSource(path), torch.float32, CPU)


def test_unsupported_head_dim_raises(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["llama_tied"][0], tmp_path / "ckpt")
    _edit_config(path, head_dim=32)
    with pytest.raises(ValueError, match="head_dim 32"):
        load_model(ModelSource(path), torch.float32, CPU)


def test_missing_weight_raises(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["qwen2"][0], tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for \['layers.1.mlp.down_proj.weight'\]"):
        load_model(ModelSource(path), torch.float32, CPU)


def test_missing_bias_raises(checkpoints, tmp_path):
    """Qwen2's q/k/v bias is a weight like the others: a checkpoint without it is refused, not zero-filled."""
    path = _copy_checkpoint(checkpoints["qwen2"][0], tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    for part in "qkv":
        del tensors[f"model.layers.0.self_attn.{part}_proj.bias"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights"):
        load_model(ModelSource(path), torch.float32, CPU)


def test_unknown_weight_raises(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["mistral"][0], tmp_path / "ckpt")
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
    path = _copy_checkpoint(checkpoints["mistral"][0], tmp_path / "ckpt")
    _edit_config(path, **change)
    with pytest.raises(ValueError, match="shape|does not fit"):
        load_model(ModelSource(path), torch.float32, CPU)


# --- end to end ----------------------------------------------------------------------------------------

def test_llm_greedy_matches_hf_generate(checkpoints):
    """LLM on the tiny Qwen2, prompts of different lengths batched together, greedy == HF generate(do_sample=False).

    The tiny checkpoint has no tokenizer: the default model's is used, prompts are token ids in the tiny vocab.
    If a step of HF's run is a near-tie (top-2 logits within 1e-3), the tokens after it are not compared.
    """
    from pagedkv import LLM, SamplingParams
    from pagedkv.model.default_model import ensure_default_model

    path, hf = checkpoints["qwen2"]
    prompts = [_tokens(200 + i, n) for i, n in enumerate((3, 17, 40, 9))]
    max_tokens = 12
    llm = LLM(model=str(path), tokenizer=str(ensure_default_model()), device="cpu", dtype="float32",
              kv_cache_memory=64 << 20, max_model_len=256, block_size=BLOCK_SIZE)
    assert llm.llm_engine.dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == max_tokens and out.outputs[0].finish_reason == "length"
        with torch.inference_mode():
            gen = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                              pad_token_id=0)
        theirs = gen.sequences[0, len(prompt):].tolist()
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a != b:
                top2 = gen.logits[i][0].float().topk(2).values
                assert (top2[0] - top2[1]).item() < 1e-3, f"prompt {prompt}: token {i}: ours {a}, HF {b}"
                break
            compared += 1
    assert compared >= 3 * max_tokens  # nearly everything was compared
