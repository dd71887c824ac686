"""Pooling requests (embeddings): PoolingParams, the pooler's settings, the scheduler's lifecycle, the vectors
against HF transformers' hidden states on the default model, and /v1/embeddings."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from pagedkv import LLM, PoolingParams, SamplingParams
from pagedkv.config import CacheConfig, EngineArgs, PoolerConfig, SchedulerConfig
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.sequence import Request, Sequence
from pagedkv.errors import SamplingParamsError
from pagedkv.outputs import RequestMetrics, SamplerOutput
from pagedkv.pooler import Pooler, PoolingState, resolve_pooler

TEXTS = [
    "Paged attention keeps the KV cache in fixed-size blocks, so memory is allocated as sequences grow.",
    "The quick brown fox jumps over the lazy dog.",
    "A block table maps each sequence's logical blocks to physical blocks in the pool; copy-on-write lets "
    "several samples share the blocks of one prompt until one of them writes.",
    "hi",
]


# --- settings ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "param"), [
    ({"dimensions": 0}, "dimensions"), ({"dimensions": True}, "dimensions"), ({"normalize": "yes"}, "normalize"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"task": "classify"}, "task"), ({"truncate_prompt_tokens": 1 << 64}, "truncate_prompt_tokens"),
])
def test_pooling_params_refuse_bad_values_by_name(kwargs, param):
    with pytest.raises(SamplingParamsError) as e:
        PoolingParams(**kwargs)
    assert e.value.param == param


def test_truncate_keeps_the_last_tokens():
    ids = list(range(10))
    assert PoolingParams(truncate_prompt_tokens=3).truncate(ids, 100) == [7, 8, 9]
    assert PoolingParams(truncate_prompt_tokens=-1).truncate(ids, 4) == [6, 7, 8, 9]
    assert PoolingParams(truncate_prompt_tokens=50).truncate(ids, 100) == ids
    assert PoolingParams().truncate(ids, 4) == ids  # the length check refuses it later


def test_engine_args_runner_convert_and_pooler_config():
    import argparse

    from pagedkv.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--convert", "embed", "--pooler-config", '{"pooling_type": "CLS", "normalize": false}'])
    args = EngineArgs(**engine_kwargs(ns))
    assert (args.runner, args.pooler_config) == ("pooling", PoolerConfig("CLS", False))
    assert EngineArgs(convert="embed").runner == "pooling"
    # vLLM's newer names for the same settings.
    assert EngineArgs(pooler_config={"seq_pooling_type": "MEAN", "use_activation": False}).pooler_config == \
        PoolerConfig("MEAN", False)
    assert PoolingParams(use_activation=False).normalize is False
    assert EngineArgs(pooler_config='{"pooling_type": "mean"}').pooler_config == PoolerConfig("MEAN")
    for kwargs, message in [({"runner": "embed"}, "runner must be one of"),
                            ({"convert": "classify"}, "convert must be one of"),
                            ({"convert": "embed", "runner": "generate"}, "cannot run with runner='generate'"),
                            ({"pooler_config": {"pooling_type": "MAX"}}, "pooling_type must be one of"),
                            ({"pooler_config": {"softmax": True}}, "unknown keys ['softmax']"),
                            ({"pooler_config": "[1]"}, "must be a JSON object"),
                            ({"pooler_config": {"normalize": 1}}, "normalize must be true or false")]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            EngineArgs(**kwargs)


def _st_checkpoint(tmp_path, flags: dict, normalize: bool = True):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8} | flags))
    return tmp_path


@pytest.mark.parametrize(("flag", "kind"), [("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
                                            ("pooling_mode_cls_token", "CLS")])
def test_sentence_transformers_files_set_the_pooling(tmp_path, flag, kind):
    pooler = resolve_pooler(_st_checkpoint(tmp_path, {flag: True}, normalize=False), {}, 8, None)
    assert (pooler.pooling_type, pooler.normalize, pooler.refusal) == (kind, False, None)
    assert "sentence-transformers" in pooler.source
    # pooler_config wins over the files.
    assert resolve_pooler(tmp_path, {}, 8, PoolerConfig("CLS", True)).pooling_type == "CLS"


def test_defaults_and_a_mode_pagedkv_does_not_build(tmp_path):
    default = resolve_pooler(None, {}, 8, None)
    assert (default.pooling_type, default.normalize, default.source) == ("LAST", True, "default")
    odd = resolve_pooler(_st_checkpoint(tmp_path, {"pooling_mode_max_tokens": True}), {}, 8, None)
    with pytest.raises(SamplingParamsError, match="pooling_mode_max_tokens"):
        odd.check(PoolingParams())
    assert resolve_pooler(tmp_path, {}, 8, PoolerConfig("MEAN")).refusal is None


def test_dimensions_need_a_matryoshka_model():
    plain = resolve_pooler(None, {}, 8, None)
    with pytest.raises(SamplingParamsError, match="Matryoshka") as e:
        plain.check(PoolingParams(dimensions=4))
    assert e.value.param == "dimensions"
    listed = resolve_pooler(None, {"matryoshka_dimensions": [2, 4, 8]}, 8, None)
    listed.check(PoolingParams(dimensions=4))
    for bad in (3, 16):
        with pytest.raises(SamplingParamsError, match="dimensions"):
            listed.check(PoolingParams(dimensions=bad))
    with pytest.raises(ValueError, match="needs a Matryoshka model"):
        resolve_pooler(None, {}, 8, PoolerConfig(dimensions=4))


def test_pooling_state_over_chunks_and_a_restart():
    states = torch.randn(10, 6)

    def run(kind: str, chunks: list[tuple[int, int]]) -> torch.Tensor:
        state = PoolingState(Pooler(kind, False, 6), PoolingParams(), 10)
        for start, n in chunks:
            first, count = state.rows_of_chunk(start, n)
            state.add(start, states[start + first:start + first + count])
        return state.finish()

    chunked = [(0, 3), (3, 3), (6, 4)]
    assert torch.allclose(run("MEAN", chunked), states.mean(0), atol=1e-6)
    assert torch.equal(run("LAST", chunked), states[9])
    assert torch.equal(run("CLS", chunked), states[0])
    # Recomputed after preemption: the chunk from 0 starts the sum over.
    assert torch.allclose(run("MEAN", [(0, 3), (3, 3), (0, 5), (5, 5)]), states.mean(0), atol=1e-6)
    normalized = PoolingState(Pooler("LAST", True, 6), PoolingParams(), 1)
    normalized.add(0, states[:1])
    assert torch.allclose(normalized.finish().norm(), torch.tensor(1.0))


# --- the scheduler -------------------------------------------------------------------------------------------------
def _pooling_request(kind: str, prompt: list[int], rid: str = "e0") -> Request:
    params = PoolingParams()
    req = Request(rid, None, prompt, SamplingParams(max_tokens=1, temperature=0.0), RequestMetrics(0.0),
                  pooling=PoolingState(Pooler(kind, True, 8), params, len(prompt)))
    req.seqs.append(Sequence(0, req, 0, list(prompt)))
    return req


def test_a_pooling_request_ends_when_its_prompt_is_computed_and_frees_its_blocks():
    bm = BlockManager(8, 64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64),
                      CacheConfig(block_size=8), bm)
    req = _pooling_request("LAST", list(range(1, 21)))
    sched.add(req.seqs[0])
    steps = 0
    while not req.finished:
        out = sched.schedule()
        assert out.prefill_seqs == req.seqs and not out.decode_seqs
        update = sched.update_from_output(out, [], SamplerOutput([], []))
        steps += 1
    assert steps == 3  # 20 tokens in chunks of 8
    assert update.finished == req.seqs and req.seqs[0].finish_reason == "stop"
    assert req.seqs[0].token_ids == list(range(1, 21))  # nothing sampled
    assert bm.num_used_gpu_blocks == 0


def test_mean_and_cls_read_nothing_from_the_prefix_cache():
    assert _pooling_request("LAST", [1, 2]).reads_prefix_cache
    assert not _pooling_request("MEAN", [1, 2]).reads_prefix_cache
    assert not _pooling_request("CLS", [1, 2]).reads_prefix_cache


# --- the default model against HF transformers -----------------------------------------------------------------------
def _llm(loaded_model, **kwargs) -> LLM:
    kwargs = {"kv_cache_memory": 64 << 20, "max_model_len": 512, "max_num_seqs": 8} | kwargs
    return LLM(loaded_model=loaded_model, device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def hf_states(hf_model, loaded_model):
    """Per text: the HF model's final hidden states [tokens, hidden] (after its last norm) on the same ids."""
    tok = loaded_model.tokenizer
    with torch.no_grad():
        return [hf_model.model(torch.tensor([tok.encode(t)])).last_hidden_state[0] for t in TEXTS]


def _reference(states: torch.Tensor, kind: str, normalize: bool = True) -> torch.Tensor:
    v = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[kind]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def _vectors(outputs) -> list[torch.Tensor]:
    for o in outputs:
        assert o.error is None and o.finished
    return [torch.tensor(o.outputs.embedding) for o in outputs]


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_vectors_match_hf_in_chunks_beside_generation(loaded_model, hf_states, kind):
    """Chunked prompts (16-token steps) pooled beside generation requests that run in the same steps: the vectors
    are HF's, the generated tokens those of generation alone, and the pool is empty after."""
    llm = _llm(loaded_model, max_num_batched_tokens=16, pooler_config={"pooling_type": kind})
    gen = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(TEXTS[:2], gen, use_tqdm=False)
    engine = llm.llm_engine
    for i, text in enumerate(TEXTS[:2]):
        engine.add_request(f"g{i}", text, gen)
    for i, text in enumerate(TEXTS):
        engine.add_request(f"e{i}", text, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for i, states in enumerate(hf_states):
        got = done[f"e{i}"].pooled
        assert got.dtype == torch.float32 and got.shape == (576,)
        torch.testing.assert_close(got, _reference(states, kind), atol=1e-4, rtol=1e-4)
        assert done[f"e{i}"].outputs[0].token_ids == [] and done[f"e{i}"].outputs[0].finish_reason == "stop"
    for i, ref in enumerate(alone):
        assert done[f"g{i}"].outputs[0].token_ids == ref.outputs[0].token_ids
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_gpu_blocks == 0
    assert engine.get_stats().generation_tokens == 2 * 2 * 12  # pooling requests sample nothing


def test_embed_normalize_dimensions_and_truncation(loaded_model, hf_states):
    llm = _llm(loaded_model, hf_overrides={"is_matryoshka": True})
    raw = _vectors(llm.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False))
    for got, states in zip(raw, hf_states, strict=True):
        torch.testing.assert_close(got, states[-1], atol=1e-4, rtol=1e-4)
    cut = _vectors(llm.embed(TEXTS[:1], PoolingParams(dimensions=64), use_tqdm=False))[0]
    assert cut.shape == (64,)
    torch.testing.assert_close(cut, torch.nn.functional.normalize(raw[0][:64], dim=0), atol=1e-5, rtol=1e-5)
    ids = loaded_model.tokenizer.encode(TEXTS[2])
    tail = llm.embed([ids], truncate_prompt_tokens=7, use_tqdm=False)
    assert tail[0].prompt_token_ids == ids[-7:]
    alone = llm.embed([ids[-7:]], use_tqdm=False)
    assert tail[0].outputs.embedding == alone[0].outputs.embedding
    encoded = llm.encode(TEXTS[:1], use_tqdm=False)[0]
    assert isinstance(encoded.outputs.data, torch.Tensor) and encoded.outputs.data.shape == (576,)


def test_prefix_caching_last_reuses_blocks_and_mean_recomputes(loaded_model):
    text = TEXTS[2] + " " + TEXTS[0]
    for kind, reuses in (("LAST", True), ("MEAN", False)):
        llm = _llm(loaded_model, enable_prefix_caching=True, pooler_config={"pooling_type": kind})
        first = llm.embed([text], use_tqdm=False)
        engine = llm.llm_engine
        rid = "again"
        engine.add_request(rid, text, PoolingParams())
        while engine.has_unfinished_requests():
            for out in engine.step():
                second = out
        assert (second.num_cached_tokens > 0) is reuses
        torch.testing.assert_close(second.pooled, torch.tensor(first[0].outputs.embedding), atol=1e-5, rtol=1e-5)


def test_preempted_pooling_requests_are_recomputed_right(loaded_model, hf_states):
    """A 12-block cache: two generations of 75-token prompts fill it while a MEAN pooling prompt is computed in
    chunks; it is preempted (recompute, being the latest) and its vector is still HF's."""
    llm = _llm(loaded_model, kv_cache_memory=12 * 16 * 46080, max_num_batched_tokens=16, max_model_len=128,
               pooler_config={"pooling_type": "MEAN"})
    engine = llm.llm_engine
    assert engine.block_manager.num_total_gpu_blocks == 12
    ids = (loaded_model.tokenizer.encode(" ".join(TEXTS)) * 2)[:75]
    for i in range(2):
        engine.add_request(f"g{i}", ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    done = {}
    while engine.scheduler.running == [] or engine.scheduler.running[-1].num_output_tokens < 2:
        engine.step()
    engine.add_request("e", TEXTS[2], PoolingParams())
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["e"].metrics.num_preemptions > 0
    torch.testing.assert_close(done["e"].pooled, _reference(hf_states[2], "MEAN"), atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_used_gpu_blocks == 0


def test_refusals_leave_the_rest_running(loaded_model):
    llm = _llm(loaded_model, max_model_len=64)
    long = list(range(1, 66))
    outputs = llm.embed([TEXTS[1], long, [], [10**9], long[:64]], use_tqdm=False)
    assert outputs[0].error is None and outputs[4].error is None and len(outputs[4].outputs.embedding) == 576
    assert "max_model_len is 64: it must be at most 64" in outputs[1].error
    assert "empty" in outputs[2].error and "outside the vocabulary" in outputs[3].error
    assert all(o.outputs.embedding == [] for o in outputs[1:4])
    pooling = _llm(loaded_model, runner="pooling")
    refused = pooling.generate([TEXTS[1]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert "pooling requests only" in refused[0].error
    generating = _llm(loaded_model, runner="generate")
    assert "generation requests only" in generating.embed([TEXTS[1]], use_tqdm=False)[0].error


def test_a_failed_step_fails_its_pooling_requests_alone(loaded_model):
    llm = _llm(loaded_model)
    runner = llm.llm_engine.runner

    def broken(out):
        del runner.execute_model  # only this step fails
        raise RuntimeError("injected")

    runner.execute_model = broken
    failed = llm.embed([TEXTS[0]], use_tqdm=False)
    assert "injected" in failed[0].error and failed[0].outputs.embedding == []
    assert len(llm.embed([TEXTS[0]], use_tqdm=False)[0].outputs.embedding) == 576
    assert llm.llm_engine.block_manager.num_used_gpu_blocks == 0


def test_engine_core_process_and_tensor_parallel_match_in_process(default_model_dir, loaded_model):
    ref = _vectors(_llm(loaded_model).embed(TEXTS, use_tqdm=False))
    for kwargs in ({"engine_core": "process"}, {"tensor_parallel_size": 3}):
        with LLM(str(default_model_dir), device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256,
                 max_num_batched_tokens=16, max_num_seqs=8, **kwargs) as llm:
            if "engine_core" in kwargs:  # a message the wire cannot encode is that request's refusal, not a crash
                from pagedkv.engine.core_messages import AddRequest

                with pytest.raises(ValueError, match="cannot be sent to the engine core"):
                    llm.llm_engine.client.send(AddRequest("big", b"", (), 0.0, pooling=(1 << 70,)))
            got = _vectors(llm.embed(TEXTS, use_tqdm=False))
            refused = llm.embed([[]], use_tqdm=False)[0]
        assert refused.error is not None
        for a, b in zip(ref, got, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# --- the server ------------------------------------------------------------------------------------------------------
def test_server_embeddings_float_and_base64(loaded_model):
    import httpx
    from pagedkv.server import build_app
    from server_util import running_server

    ref = _vectors(_llm(loaded_model).embed(TEXTS, use_tqdm=False))
    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=512)
    app = build_app(args, served_model_names=["smol"], loaded=loaded_model)
    with running_server(app) as srv:
        import openai

        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.embeddings.create(model="smol", input=TEXTS)  # the client asks for base64 and decodes it
        assert [d.index for d in r.data] == [0, 1, 2, 3]
        for d, v in zip(r.data, ref, strict=True):
            np.testing.assert_allclose(d.embedding, v.numpy(), atol=1e-5)
        tokens = sum(len(loaded_model.tokenizer.encode(t)) for t in TEXTS)
        assert (r.usage.prompt_tokens, r.usage.total_tokens) == (tokens, tokens)
        body = {"model": "smol", "input": TEXTS[0], "encoding_format": "float"}
        plain = httpx.post(srv.url + "/v1/embeddings", json=body, timeout=120).json()
        assert plain["object"] == "list" and plain["data"][0]["object"] == "embedding"
        np.testing.assert_allclose(plain["data"][0]["embedding"], ref[0].numpy(), atol=1e-5)
        packed = httpx.post(srv.url + "/v1/embeddings", json=body | {"encoding_format": "base64"}, timeout=120).json()
        decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, ref[0].numpy(), atol=1e-5)
        ids = httpx.post(srv.url + "/v1/embeddings", json={"input": [loaded_model.tokenizer.encode(TEXTS[1])]},
                         timeout=120).json()
        np.testing.assert_allclose(ids["data"][0]["embedding"], ref[1].numpy(), atol=1e-5)
        for bad, param in [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [10**9]}, "input"),
                           ({"input": list(range(1, 600))}, "input"), ({"input": "x", "dimensions": 8}, "dimensions"),
                           ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
                           ({"input": "x", "truncate_prompt_tokens": 10**30}, "truncate_prompt_tokens"),
                           ({"input": [[]]}, "input"), ({"input": [2**70]}, "input"),
                           ({"input": "x", "model": "other"}, "model")]:
            r = httpx.post(srv.url + "/v1/embeddings", json=bad, timeout=60)
            assert 400 <= r.status_code < 500, (bad, r.text)
            assert r.json()["error"]["param"] == param or r.status_code == 404, (bad, r.text)
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="smol"} 7.0' in metrics
    engine = app.state.engine
    assert engine.block_manager.num_used_gpu_blocks == 0


def test_pooling_runner_server_refuses_completions(loaded_model):
    import httpx
    from pagedkv.server import build_app
    from server_util import running_server

    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, runner="pooling")
    app = build_app(args, served_model_names=["smol"], loaded=loaded_model)
    with running_server(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 400 and "pooling requests only" in r.json()["error"]["message"]
        ok = httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 576


# --- a base model's checkpoint (no LM head), as embedding models ship -------------------------------------------------
@pytest.fixture(scope="module")
def headless_checkpoint(default_model_dir, tmp_path_factory):
    """The default model saved as an embedding checkpoint: architecture LlamaModel, weights without the "model."
    prefix, no LM head (untied), sentence-transformers files asking for last-token pooling and normalization."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("headless")
    weights = load_file(str(default_model_dir / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head.")},
              str(out / "model.safetensors"))
    config = json.loads((default_model_dir / "config.json").read_text())
    config |= {"architectures": ["LlamaModel"], "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, out / name)
    _st_checkpoint(out, {"pooling_mode_lasttoken": True})
    return out


def test_a_base_model_checkpoint_runs_as_an_embedding_model(headless_checkpoint, loaded_model):
    ref = _vectors(_llm(loaded_model).embed(TEXTS, use_tqdm=False))
    with LLM(str(headless_checkpoint), device="cpu", dtype="float32", kv_cache_memory=32 << 20,
             max_model_len=256) as llm:
        assert llm.llm_engine.runner_type == "pooling" and llm.llm_engine.pooler.source == "sentence-transformers files"
        got = _vectors(llm.embed(TEXTS, use_tqdm=False))
        refused = llm.generate([TEXTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert "pooling requests only" in refused.error
    with pytest.raises(ValueError, match="without an LM head"):
        LLM(str(headless_checkpoint), device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256,
            runner="generate")
