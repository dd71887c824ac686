"""Helpers for the model tests: tiny random HF checkpoints, pagedkv run on hand-built flat batches, HF logits.

Tolerances. The random weights use initializer_range 0.1 so that logits are of
order 1-5 and attention is far from uniform. float32: |ours - HF| <=
FP32_ATOL + FP32_RTOL * max|HF| over all compared rows (the differences are
summation order and oneDNN's packed GEMMs).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from pagedkv.core.block_manager import BlockManager
from pagedkv.engine.model_runner import allocate_kv_cache
from pagedkv.model.attention import AttentionMetadata

BLOCK_SIZE = 16
VOCAB = 512
FP32_ATOL = 1e-4
FP32_RTOL = 1e-5
CPU = torch.device("cpu")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """HF zero-initialises biases and sets norm weights to 1: make them random so that they are tested too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)


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


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def random_tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close_fp32(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    assert ours.shape == ref.shape, what
    assert torch.isfinite(ours).all(), what
    err = (ours - ref).abs().max().item()
    bound = FP32_ATOL + FP32_RTOL * ref.abs().max().item()
    assert err <= bound, f"{what}: max |ours - HF| = {err:.3g} > {bound:.3g}"
    return err


def mixed_batch(runner: PagedRunner) -> tuple[dict[int, list[int]], list[list[tuple[int, int]]], torch.Tensor]:
    """Runs three steps of a mixed flat batch.

    Returns (tokens of each sequence, per logits row its (seq_id, position), all logits rows stacked).
    Step 1: prefills only: C's first chunk (20 of 50 tokens), whole prompts of D (33), E (17), F (16: one full
    block). Step 2: decodes of D, E, F (F's needs a new block) first, then C's second chunk (30 tokens, starting
    mid-block after the cached prefix), and new prompts A (1 token) and B (7). Step 3: decode only, every
    sequence.
    """
    seqs = {sid: random_tokens(100 + sid, n) for sid, n in
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


def mixed_reference(hf_model, seqs, rows) -> torch.Tensor:
    full = {s: hf_logits(hf_model, toks) for s, toks in seqs.items()}
    return torch.stack([full[s][p] for s, p in rows])


def assert_greedy_matches_hf(path, hf_model, prompts: list[list[int]], max_tokens: int, **llm_kwargs) -> int:
    """LLM on checkpoint `path`, the prompts batched together, greedy == HF generate(do_sample=False).

    The tiny checkpoints have no tokenizer: the default model's is used, prompts are token ids in the tiny
    vocab. If a step of HF's run is a near-tie (top-2 logits within 1e-3), the tokens after it are not
    compared. Returns how many tokens were compared.
    """
    from pagedkv import LLM, SamplingParams
    from pagedkv.model.default_model import ensure_default_model

    kwargs = dict(kv_cache_memory=64 << 20, max_model_len=256, block_size=BLOCK_SIZE) | llm_kwargs
    llm = LLM(model=str(path), tokenizer=str(ensure_default_model()), device="cpu", dtype="float32", **kwargs)
    assert llm.llm_engine.dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == max_tokens and out.outputs[0].finish_reason == "length"
        with torch.inference_mode():
            gen = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
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
    return compared


def _first_divergence(ref: list[int], got: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)


def assert_same_greedy(ref_outputs, outputs, what: str, tie_gap: float = 1e-4) -> list[str]:
    """Token ids equal, or equal up to a top-2 logit tie (< tie_gap) of the reference (its outputs need logprobs >= 2);
    returns the ties seen. Sharding or batching changes the order of float sums, hence the tie rule."""
    ties = []
    for ref, got in zip(ref_outputs, outputs, strict=True):
        for rc, gc in zip(ref.outputs, got.outputs, strict=True):
            assert len(rc.token_ids) == len(gc.token_ids), f"{what}: request {ref.request_id} length differs"
            i = _first_divergence(rc.token_ids, gc.token_ids)
            if i is None:
                continue
            top = sorted((lp.logprob for lp in rc.logprobs[i].values()), reverse=True)
            gap = top[0] - top[1]
            assert gap < tie_gap, (f"{what}: request {ref.request_id} sample {rc.index} differs at output token {i} "
                                   f"({rc.token_ids[i]} vs {gc.token_ids[i]}) where the top-2 gap is {gap:.2e}")
            ties.append(f"request {ref.request_id} token {i} (gap {gap:.1e})")
    if ties:
        warnings.warn(f"{what}: diverged at float ties only: {ties}", stacklevel=2)
    return ties


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside, restored after (tiny models: one thread avoids OpenMP
    barrier stalls on a shared, loaded CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of checkpoint folder `src` at `dst` (created), to edit without touching `src`."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def edit_config(path: Path, **changes) -> None:
    """Sets keys of `path`/config.json."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
