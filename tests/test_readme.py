"""The README's example of the ops runs as written, and computes what it claims.

The example asserts its decode output against the reference itself; here both
its outputs (the prefill `out` and the decode `out1`) are also compared with
PyTorch's own attention over the K/V it wrote, which checks the whole path:
block manager metadata, reshape_and_cache into the paged cache, the kernels.
"""

import re
from pathlib import Path

import torch
import torch.nn.functional as F

README = Path(__file__).resolve().parent.parent / "README.md"


def run_readme_example() -> dict:
    """Runs the README's example of the ops (the python block that calls the prefill op); returns its globals."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    examples = [b for b in blocks if "paged_prefill_attention(" in b]
    assert len(examples) == 1, f"README should have one python example of the ops, found {len(examples)}"
    namespace: dict = {}
    exec(compile(examples[0], str(README), "exec"), namespace)
    return namespace


def causal_attention(q, k, v, scale):
    """q [n, H, d] at the last n of the L positions of k/v [L, H_kv, d], causal, via SDPA (fp64)."""
    n, length = q.shape[0], k.shape[0]
    visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None],
        attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).float()


def test_readme_python_example_runs_and_its_outputs_are_right():
    ns = run_readme_example()
    scale = ns["head_size"] ** -0.5
    tolerance = {"atol": 2e-5, "rtol": 1e-4}  # fp32, as in test_attention.py
    prompt, q, k, v, out = ns["prompt"], ns["q"], ns["k"], ns["v"], ns["out"]
    assert out.shape == q.shape == (len(prompt), ns["num_heads"], ns["head_size"])
    torch.testing.assert_close(out, causal_attention(q, k, v, scale), **tolerance)
    # Decode: one new token after the prompt attends to all 41 positions.
    k_all, v_all = torch.cat([k, ns["k1"]]), torch.cat([v, ns["v1"]])
    torch.testing.assert_close(ns["out1"], causal_attention(ns["q1"], k_all, v_all, scale), **tolerance)


def test_readme_llm_example_runs(loaded_model, monkeypatch):
    """The README's LLM example runs as written (LLM() resolves to the default model, here the shared copy)."""
    import pagedkv
    from pagedkv.llm import LLM

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    examples = [b for b in blocks if "LLM(" in b and "generate(" in b and "tensor_parallel_size" not in b]
    assert len(examples) == 1, f"README should have one LLM example, found {len(examples)}"
    made = []

    def shared_llm(*args, **kwargs):  # the example's own arguments, plus the session's loaded model
        made.append(LLM(*args, loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=512, **kwargs))
        return made[-1]

    monkeypatch.setattr(pagedkv, "LLM", shared_llm)
    namespace: dict = {}
    exec(compile(examples[0], str(README), "exec"), namespace)
    outputs = namespace["outputs"]
    assert len(outputs) == 2 and all(o.finished and o.outputs[0].token_ids for o in outputs)
    assert "Paris" in outputs[0].outputs[0].text
    assert made and not made[0].llm_engine.has_unfinished_requests()


def test_readme_beam_search_example_runs(loaded_model, monkeypatch):
    """The README's beam search example runs as written; its best hypothesis is the prompt continued, ranked."""
    import pagedkv
    from pagedkv.llm import LLM

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    examples = [b for b in blocks if "beam_search(" in b]
    assert len(examples) == 1, f"README should have one beam search example, found {len(examples)}"
    monkeypatch.setattr(pagedkv, "LLM", lambda *a, **kw: LLM(*a, loaded_model=loaded_model,
                                                             kv_cache_memory=64 << 20, max_model_len=512, **kw))
    namespace: dict = {}
    exec(compile(examples[0], str(README), "exec"), namespace)
    seqs = namespace["out"][0].sequences
    assert len(seqs) == 4 and namespace["best"] is seqs[0]
    prompt = loaded_model.tokenizer.encode("The capital of France is")
    assert all(s.tokens[:len(prompt)] == prompt for s in seqs)
    scores = [s.cum_logprob / (len(s.tokens) - (s.finish_reason == "stop")) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    assert "Paris" in namespace["best"].text
