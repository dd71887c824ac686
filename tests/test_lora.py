"""LoRA adapters end to end: PEFT adapters of the default model, served by the engine beside the base model,
against PEFT on HF transformers; the scheduler's max_loras, the prefix cache's separation, and refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lora_util import _save_adapter
from pagedkv import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory):
    """Two adapters: every projection at rank 8; q/v only at rank 4 with rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    full = _save_adapter(default_model_dir, root / "full", 1, r=8, lora_alpha=16,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    qv = _save_adapter(default_model_dir, root / "qv", 2, r=4, lora_alpha=8, use_rslora=True,
                       target_modules=["q_proj", "v_proj"])
    return {"full": LoRARequest("full", 1, full), "qv": LoRARequest("qv", 2, qv)}


@pytest.fixture(scope="module")
def peft_model(default_model_dir, adapters):
    """PEFT's model with both adapters (a copy of the weights: the session's hf_model stays plain)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(model, adapters["full"].lora_path, adapter_name="full")
    wrapped.load_adapter(adapters["qv"].lora_path, adapter_name="qv")
    return wrapped.eval()


def _peft_logprobs(peft_model, adapter: str | None, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """log-softmax rows of PEFT's model for each output token (adapter None: the base model)."""
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                logits = peft_model(ids).logits[0]
        else:
            peft_model.set_adapter(adapter)
            logits = peft_model(ids).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1].float(), dim=-1)


def _llm(loaded_model, **kwargs) -> LLM:
    kwargs = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "kv_cache_memory": 64 << 20,
              "max_model_len": 512} | kwargs
    return LLM(loaded_model=loaded_model, device="cpu", dtype="float32", **kwargs)


def _check_against_peft(peft_model, outputs, names) -> None:
    for out, name in zip(outputs, names, strict=True):
        assert out.error is None, out.error
        c = out.outputs[0]
        ref = _peft_logprobs(peft_model, name, list(out.prompt_token_ids), list(c.token_ids))
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            top = ref[i].max().item()
            assert ref[i, token].item() >= top - 1e-4, f"{name}: token {i} is not PEFT's greedy choice"
            assert math.isclose(entry[token].logprob, ref[i, token].item(), abs_tol=2e-4), (name, i)


def test_mixed_batch_matches_peft(loaded_model, adapters, peft_model):
    """Base, adapter "full" and adapter "qv" prompts in one batch (prefill and decode steps): each token and its
    logprob are PEFT's for that prompt's adapter."""
    llm = _llm(loaded_model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    names = [None, "full", "qv", "full", None, "qv"]
    prompts = PROMPTS * 2
    loras = [None if n is None else adapters[n] for n in names]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    _check_against_peft(peft_model, outputs, names)
    # The check discriminates: each adapter moves the logprobs well beyond its tolerance from the base model's.
    for i in (1, 2):
        c = outputs[i].outputs[0]
        base = _peft_logprobs(peft_model, None, list(outputs[i].prompt_token_ids), list(c.token_ids))
        pairs = enumerate(zip(c.token_ids, c.logprobs, strict=True))
        moved = max(abs(e[t].logprob - base[j, t].item()) for j, (t, e) in pairs)
        assert moved > 1e-2, (names[i], moved)


def test_one_slot_serves_two_adapters_in_turn(loaded_model, adapters, peft_model):
    """max_loras=1: requests of two adapters never share a step, all finish, and each still matches PEFT (the
    slot is reloaded between them)."""
    llm = _llm(loaded_model, max_loras=1, max_cpu_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    names = ["full", "qv", None, "qv", "full"]
    outputs = llm.generate([PROMPTS[i % 3] for i in range(5)], params, use_tqdm=False,
                           lora_request=[None if n is None else adapters[n] for n in names])
    _check_against_peft(peft_model, outputs, names)
    # One slot; both host copies kept past max_cpu_loras=1 while their requests ran (no folder re-read in a step).
    manager = llm.llm_engine.runner.lora
    assert len(manager.slots) == 1 and set(manager.host) == {1, 2}


def test_prefix_cache_is_per_adapter(loaded_model, adapters):
    """A prompt computed under one adapter is not reused under another (or the base model), and is reused under
    the same one."""
    llm = _llm(loaded_model, enable_prefix_caching=True)
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(lora):
        return llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(None) == 0
    assert cached(adapters["full"]) == 0
    assert cached(adapters["qv"]) == 0
    assert cached(adapters["full"]) > 0
    assert cached(None) > 0


def test_engine_core_process_matches_in_process(loaded_model, adapters, default_model_dir):
    """Through the engine-core process (the core reads the adapter) the outputs equal the in-process engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [adapters["full"], None, adapters["qv"]]
    inproc = _llm(loaded_model).generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    with LLM(str(default_model_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
             kv_cache_memory=64 << 20, max_model_len=512, engine_core="process") as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in inproc]


def test_refusals_name_the_problem_and_the_rest_runs(loaded_model, adapters, tmp_path):
    """Adapters pagedkv cannot run are refused per request, with the reason; the other prompts run."""
    llm = _llm(loaded_model, max_lora_rank=4)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((Path(adapters["qv"].lora_path) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    misfit = tmp_path / "misfit"  # q_proj's lora_A made for another model's hidden size
    misfit.mkdir()
    (misfit / "adapter_config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(Path(adapters["qv"].lora_path) / "adapter_model.safetensors"))
    name = next(n for n in tensors if "layers.3.self_attn.q_proj.lora_A" in n)
    tensors[name] = torch.randn(tensors[name].shape[0], 100)
    save_file(tensors, str(misfit / "adapter_model.safetensors"))
    bad = {
        "layers.3.self_attn.qkv_proj part does not fit": LoRARequest("misfit", 10, str(misfit)),
        "rank 8 exceeds max_lora_rank=4": adapters["full"],
        "no such folder": LoRARequest("missing", 7, str(tmp_path / "nothing")),
        "DoRA": LoRARequest("dora", 8, str(dora)),
        "no adapter_config.json": LoRARequest("empty", 9, str(tmp_path)),
    }
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outputs = llm.generate(["Hello"] * (len(bad) + 1), params, use_tqdm=False,
                           lora_request=list(bad.values()) + [adapters["qv"]])
    for out, needle in zip(outputs, bad, strict=False):
        assert out.error is not None and needle in out.error, out.error
        assert out.outputs[0].finish_reason == "abort"
    assert outputs[-1].error is None and len(outputs[-1].outputs[0].token_ids) == 4


def test_lora_needs_enable_lora(loaded_model, adapters):
    llm = LLM(loaded_model=loaded_model, device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=512)
    out = llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False, lora_request=adapters["qv"])[0]
    assert "enable_lora" in out.error
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(loaded_model=loaded_model, enable_lora=True, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")


def test_two_engines_on_one_model_keep_their_own_adapters(loaded_model, adapters, peft_model):
    """Two LoRA engines sharing one loaded model, used in turn: each applies its own slots (the one built last
    does not take the other's projections)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
    first, second = _llm(loaded_model), _llm(loaded_model)
    for llm, name in ((first, "full"), (second, "qv"), (first, "qv"), (second, "full")):
        out = llm.generate(PROMPTS[1], params, use_tqdm=False, lora_request=adapters[name])
        _check_against_peft(peft_model, out, [name])


def test_same_id_other_adapter_is_refused(loaded_model, adapters):
    llm = _llm(loaded_model)
    llm.llm_engine.add_lora(adapters["qv"])
    with pytest.raises(ValueError, match="lora_int_id 2 is held"):
        llm.llm_engine.add_lora(LoRARequest("other", 2, adapters["full"].lora_path))
    assert llm.llm_engine.list_loras() == {2}
    assert llm.llm_engine.remove_lora(2) and not llm.llm_engine.list_loras()


def test_tensor_parallel_matches_one_device(loaded_model, adapters, default_model_dir):
    """The default model at tensor_parallel_size=3 (each rank its shard of A or B): the same greedy tokens as one
    device, with one slot reloaded between the two adapters on every rank."""
    from model_util import assert_same_greedy

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    loras = [adapters["full"], None, adapters["qv"], adapters["full"]]
    prompts = PROMPTS + PROMPTS[:1]
    common = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8, "kv_cache_memory": 32 << 20,
              "max_model_len": 256, "device": "cpu", "dtype": "float32"}
    ref = LLM(loaded_model=loaded_model, **common).generate(prompts, params, use_tqdm=False, lora_request=loras)
    with LLM(str(default_model_dir), tensor_parallel_size=3, **common) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert all(o.error is None for o in outputs)
    assert_same_greedy(ref, outputs, "LoRA at tensor_parallel_size=3")
    for r, o in zip(ref, outputs, strict=True):  # the adapters' effect on the logprobs too, not only the argmax
        a, b = r.outputs[0], o.outputs[0]
        if a.token_ids == b.token_ids:
            assert [e[t].logprob for t, e in zip(b.token_ids, b.logprobs, strict=True)] == pytest.approx(
                [e[t].logprob for t, e in zip(a.token_ids, a.logprobs, strict=True)], abs=1e-3)


def test_kv_events_name_the_adapter(loaded_model, adapters, tmp_path):
    """BlockStored events of blocks computed under an adapter carry its lora_id and lora_name (vLLM's fields,
    which KV-aware routers match on); the base model's carry None."""
    from pagedkv.engine.kv_events import BlockStored

    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv-events"}
    llm = _llm(loaded_model, enable_prefix_caching=True, kv_events_config=events)
    emitter, seen = llm.llm_engine.kv_events, []
    publish = emitter.flush

    def capture():
        seen.extend(e for e in emitter.pending if isinstance(e, BlockStored))
        publish()

    emitter.flush = capture
    prompt = " ".join(["A paged KV cache keeps each sequence's keys and values in fixed-size blocks."] * 3)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([prompt, prompt], params, use_tqdm=False, lora_request=[adapters["qv"], None])
    by_adapter = {(e.lora_id, e.lora_name) for e in seen}
    assert by_adapter == {(2, "qv"), (None, None)}
    llm.llm_engine.shutdown()


def test_prompt_logprobs_and_beam_search_under_an_adapter(loaded_model, adapters, peft_model):
    """What evaluation harnesses send: a prompt scored under an adapter (prompt_logprobs over two chunks) equals
    PEFT's log-softmax; a beam search runs under the adapter and reports it on its hypotheses."""
    from pagedkv import BeamSearchParams

    llm = _llm(loaded_model, max_num_batched_tokens=16, max_num_seqs=4)
    prompt = "The quick brown fox jumps over the lazy dog while the cat watches from the window."
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False,
                       lora_request=adapters["full"])[0]
    ids = list(out.prompt_token_ids)
    assert len(ids) > 16  # scored over more than one chunk
    peft_model.set_adapter("full")
    with torch.no_grad():
        ref = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = [e[t].logprob for t, e in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
    want = [ref[i, t].item() for i, t in enumerate(ids[1:])]
    assert got == pytest.approx(want, abs=2e-4)
    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4), lora_request=adapters["qv"])
    assert beams[0].sequences and all(s.lora_request == adapters["qv"] for s in beams[0].sequences)
