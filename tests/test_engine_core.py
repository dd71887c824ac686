"""The engine core in its own process: the same outputs as in-process, its faults seen, its life tied to ours.

One core process (the default model, float32) serves the module; the
in-process LLM on the same weights is the reference. Kill tests start
their own processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from pagedkv import LLM, SamplingParams
from pagedkv.config import EngineArgs
from pagedkv.core.sequence import OutputKind
from pagedkv.engine.cpu_binding import CpuBinding, parse_cpu_list, plan_cpu_binding
from pagedkv.engine.frontend import FrontendEngine
from pagedkv.errors import EngineDeadError

MAX_MODEL_LEN = 512
PROMPTS = ["The capital of France is", "Name three colors:", "Count: 1, 2,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def core(default_model_dir):
    engine = FrontendEngine(EngineArgs(model=str(default_model_dir), device="cpu", dtype="float32",
                                       kv_cache_memory=64 << 20, max_model_len=MAX_MODEL_LEN,
                                       enable_prefix_caching=True, cpu_threads_bind="nobind"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=MAX_MODEL_LEN,
               enable_prefix_caching=True)


def run_all(engine, requests, kind=OutputKind.FINAL_ONLY):
    """Adds (prompt, params) pairs and steps until all finish; returns every output per request, in order."""
    ids = []
    for i, (prompt, params) in enumerate(requests):
        rid = f"r{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, params, output_kind=kind)
        ids.append(rid)
    seen = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return [seen[rid] for rid in ids]


def summary(output):
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in output.outputs]


REQUESTS = [
    (PROMPTS[0], SamplingParams(temperature=0, max_tokens=12)),
    (PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, stop=["."])),  # a stop string ends it
    (PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, stop=["."], include_stop_str_in_output=True)),
    (PROMPTS[2], SamplingParams(temperature=0.8, max_tokens=10, n=3, seed=7)),  # forks, seeded
    (PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, logprobs=3)),
    (PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[13])),  # "." ends by its id
    (PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop=["Paris"])),
    (PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, logprobs=1, prompt_logprobs=2)),
]


def inspect_core(engine: FrontendEngine) -> dict:
    answer: Future = Future()
    engine.request_inspection(answer)
    while not answer.done():
        engine.step(0.1)
    return answer.result()


def test_the_tokenizers_eos_reaches_the_core(default_model_dir, tmp_path):
    """The tokenizer loads while the core starts; its EOS, which the checkpoint may not list, follows as the
    first message: the core stops sequences on it and beam search finishes on it."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"  # id 0; the checkpoint's own EOS is <|im_end|>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    engine = FrontendEngine(EngineArgs(model=str(default_model_dir), tokenizer=str(tmp_path), device="cpu",
                                       dtype="float32", kv_cache_memory=32 << 20, max_model_len=MAX_MODEL_LEN,
                                       cpu_threads_bind="nobind"))
    try:
        eos = engine.tokenizer.eos_token_id
        state = inspect_core(engine)
        assert eos not in engine.model_config.eos_token_id
        assert eos in state["eos_token_ids"] and state["beam_eos_token_id"] == eos
        assert set(state["eos_token_ids"]) == engine.eos_token_ids
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", [OutputKind.FINAL_ONLY, OutputKind.CUMULATIVE])
def test_outputs_equal_the_in_process_engine(core, llm, kind):
    ref = run_all(llm.llm_engine, REQUESTS, kind)
    got = run_all(core, REQUESTS, kind)
    for r, g, (prompt, params) in zip(ref, got, REQUESTS, strict=True):
        assert summary(g[-1]) == summary(r[-1]), (prompt, params)
        assert g[-1].finished and g[-1].prompt_token_ids == r[-1].prompt_token_ids
        if params.logprobs:
            for rc, gc in zip(r[-1].outputs, g[-1].outputs, strict=True):
                assert [sorted(e) for e in rc.logprobs] == [sorted(e) for e in gc.logprobs]
                assert gc.cumulative_logprob == pytest.approx(rc.cumulative_logprob, abs=1e-4)
                # Each candidate's own text, as vLLM fills Logprob.decoded_token (the front end's, here).
                texts = [{t: v.decoded_token for t, v in e.items()} for e in gc.logprobs]
                assert texts == [{t: v.decoded_token for t, v in e.items()} for e in rc.logprobs]
                assert all(text == core.tokenizer.decode([t]) for e in texts for t, text in e.items())
        if params.prompt_logprobs is not None:  # whole once, through the wire in the core's DELTA
            want, have = r[-1].prompt_logprobs, g[-1].prompt_logprobs
            assert have[0] is None and [sorted(e) for e in have[1:]] == [sorted(e) for e in want[1:]]
            assert [v.decoded_token for e in have[1:] for v in e.values()] == [
                v.decoded_token for e in want[1:] for v in e.values()]
            assert all(v.decoded_token == core.tokenizer.decode([t]) for e in have[1:] for t, v in e.items())


def test_streamed_deltas_add_up_to_the_final_text(core, llm):
    """DELTA outputs: text held back while it may start a stop string, then everything; a stop string that
    begins in one token and ends in the next is cut out."""
    ref = run_all(llm.llm_engine, REQUESTS, OutputKind.FINAL_ONLY)
    got = run_all(core, REQUESTS, OutputKind.DELTA)
    for r, deltas in zip(ref, got, strict=True):
        for c in r[-1].outputs:
            parts = [d for out in deltas for d in out.outputs if d.index == c.index]
            assert "".join(d.text for d in parts) == c.text
            assert [t for d in parts for t in d.token_ids] == c.token_ids
            assert parts[-1].finish_reason == c.finish_reason


def test_a_stop_string_found_by_the_front_end_frees_the_cores_blocks(core):
    """max_tokens 400, stopped by "." after a few tokens: the core hears of it and frees the sequence."""
    out = run_all(core, [(PROMPTS[1], SamplingParams(temperature=0, max_tokens=400, stop=["."]))])[0][-1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "."
    assert len(out.outputs[0].token_ids) < 40
    deadline = time.monotonic() + 30
    while core.get_stats().num_used_gpu_blocks or core.get_stats().num_running:
        assert time.monotonic() < deadline, core.get_stats()
        core.step(timeout_s=0.2)  # stats arrive with the core's next message
    assert core.get_stats().generation_tokens < 400 * 2


def test_prefix_caching_across_the_boundary(core):
    prompt = "A shared system prompt that is long enough to fill several blocks of sixteen tokens. " * 3
    params = SamplingParams(temperature=0, max_tokens=4)
    first = run_all(core, [(prompt, params)])[0][-1]
    second = run_all(core, [(prompt, params)])[0][-1]
    assert second.num_cached_tokens >= 16 * (len(first.prompt_token_ids) // 16 - 1) > 0
    assert summary(first) == summary(second)


def test_a_refused_request_raises_at_once_and_the_others_run(core):
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request("too-long", list(range(5, 5 + MAX_MODEL_LEN)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        core.add_request("bad-id", [1, 2, 10 ** 9], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="top_k"):
        core.add_request("bad-k", "hi", SamplingParams(top_k=10 ** 6))
    out = run_all(core, [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))])[0][-1]
    assert out.finished and len(out.outputs[0].token_ids) == 3


def test_abort_frees_blocks(core):
    core.add_request("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    for _ in range(3):
        core.step()
    core.abort_request("long")
    assert not core.has_unfinished_requests()
    deadline = time.monotonic() + 30
    while core.get_stats().num_used_gpu_blocks:
        assert time.monotonic() < deadline, core.get_stats()
        core.step(timeout_s=0.2)


def test_llm_drives_the_core_process_too(default_model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    with LLM(str(default_model_dir), engine_core="process", dtype="float32", kv_cache_memory=32 << 20,
             max_model_len=MAX_MODEL_LEN, cpu_threads_bind="nobind") as remote:
        got = remote.generate(PROMPTS, params, use_tqdm=False)
        assert [summary(o) for o in got] == [summary(o) for o in ref]
        refused = remote.generate([PROMPTS[0], []], params, use_tqdm=False)
        assert refused[1].error and refused[0].outputs[0].text == ref[0].outputs[0].text


def test_loaded_model_cannot_serve_a_core_process(loaded_model):
    with pytest.raises(ValueError, match="loaded_model"):
        LLM(loaded_model=loaded_model, engine_core="process")
    with pytest.raises(ValueError, match="engine_core"):
        LLM(loaded_model=loaded_model, engine_core="thread")


def test_a_core_that_cannot_start_says_why(tmp_path):
    with pytest.raises(ValueError, match="not a checkpoint"):
        FrontendEngine(EngineArgs(model=str(tmp_path / "nowhere"), device="cpu"))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(Exception, match="(?i)tokenizer|config|vocab|hidden"):
        FrontendEngine(EngineArgs(model=str(tmp_path), device="cpu"))


# --- life and death -------------------------------------------------------------------------------------------------

def _core_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[1].split()[0] != "Z"


def test_killed_core_fails_in_flight_requests_and_the_next_step(default_model_dir):
    engine = FrontendEngine(EngineArgs(model=str(default_model_dir), device="cpu", dtype="float32",
                                       kv_cache_memory=32 << 20, max_model_len=256, cpu_threads_bind="nobind"))
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        engine.step()
        os.kill(engine.core_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            for _ in range(1000):
                engine.step()
        with pytest.raises(EngineDeadError):
            engine.step()
    finally:
        engine.shutdown()


FRONT_END = textwrap.dedent("""
    import sys, time
    from pagedkv.engine.frontend import FrontendEngine
    from pagedkv.config import EngineArgs
    if __name__ == "__main__":
        engine = FrontendEngine(EngineArgs(model=sys.argv[1], device="cpu", dtype="float32",
                                           kv_cache_memory=32 << 20, max_model_len=256, cpu_threads_bind="nobind"))
        print(engine.core_pid, flush=True)
        time.sleep(600)
""")


def test_the_core_never_outlives_a_killed_front_end(default_model_dir, tmp_path):
    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END)
    proc = subprocess.Popen([sys.executable, str(script), str(default_model_dir)], stdout=subprocess.PIPE,
                            text=True)
    try:
        pid = int(proc.stdout.readline())
        assert _core_alive(pid)
        proc.kill()  # SIGKILL: no atexit, no Shutdown message
        proc.wait(10)
        deadline = time.monotonic() + 15
        while _core_alive(pid):
            assert time.monotonic() < deadline, "the core outlived its killed front end"
            time.sleep(0.1)
    finally:
        proc.kill()


# --- CPU binding -----------------------------------------------------------------------------------------------------

def test_cpu_lists_and_plans():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("2, 0,2") == [2, 0]
    for bad in ("x", "3-1", "-1", ""):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    assert plan_cpu_binding("auto", {0, 1}) == CpuBinding((0, 1), None)
    assert plan_cpu_binding("auto", set(range(8))) == CpuBinding(tuple(range(7)), (7,))
    assert plan_cpu_binding("all", set(range(8))) == CpuBinding(tuple(range(8)), None)
    assert plan_cpu_binding("nobind", {0, 1}) == CpuBinding(None, None)
    assert plan_cpu_binding("1", {0, 1}) == CpuBinding((1,), (0,))
    with pytest.raises(ValueError, match="not available"):
        plan_cpu_binding("0,5", {0, 1})


def test_bind_cpu_threads_pins_each_compute_thread():
    cpus = sorted(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        placed = torch.ops.pagedkv.bind_cpu_threads(cpus[:1])
        assert placed == cpus[:1] and torch.get_num_threads() == 1
        with pytest.raises(RuntimeError, match="listed twice"):
            torch.ops.pagedkv.bind_cpu_threads([cpus[0], cpus[0]])
        with pytest.raises(RuntimeError, match="outside"):
            torch.ops.pagedkv.bind_cpu_threads([-1])
        with pytest.raises(RuntimeError, match="empty"):
            torch.ops.pagedkv.bind_cpu_threads([])
    finally:
        # This thread (OpenMP's thread 0) was bound too: give it every CPU back.
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(before)
