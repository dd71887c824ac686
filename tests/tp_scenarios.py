"""Tensor-parallel failure scenarios, each run in its own process by tests/test_tensor_parallel.py.

A scenario that hung would hang the test session, so the tests run these
under a subprocess timeout and read what they print:

    python tests/tp_scenarios.py engine-kill CHECKPOINT
    python tests/tp_scenarios.py server-kill CHECKPOINT
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

PROMPTS = [[(7 * i + j) % 400 + 5 for j in range(30 + 11 * i)] for i in range(4)]


def engine_kill(checkpoint: str) -> None:
    from pagedkv import LLM, SamplingParams
    from pagedkv.distributed import WorkerDiedError

    llm = LLM(checkpoint, device="cpu", tensor_parallel_size=2, skip_tokenizer_init=True, kv_cache_memory=1 << 24)
    engine = llm.llm_engine
    for p in PROMPTS:
        engine.add_request(None, p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    victim = engine.tp.workers[0]
    os.kill(victim.pid, signal.SIGKILL)
    start = time.monotonic()
    try:
        while engine.has_unfinished_requests():
            engine.step()
        print("NO ERROR", flush=True)
    except WorkerDiedError as e:
        print(f"ERROR after {time.monotonic() - start:.1f} s: {e}", flush=True)
    try:
        engine.step()
        print("STEPPED AGAIN", flush=True)
    except WorkerDiedError as e:
        print(f"AGAIN: {e}", flush=True)
    engine.abort_request([str(i) for i in range(len(PROMPTS))])
    print(f"FREE BLOCKS: {engine.block_manager.num_free_gpu_blocks} of {engine.block_manager.num_total_gpu_blocks}")
    llm.shutdown()
    print("SHUTDOWN OK", flush=True)


def server_kill(checkpoint: str) -> None:
    import httpx
    import uvicorn
    from pagedkv.config import EngineArgs
    from pagedkv.server.api_server import build_app

    args = EngineArgs(model=checkpoint, device="cpu", tensor_parallel_size=2, kv_cache_memory=1 << 24)
    app = build_app(args, served_model_names=["tiny"], log_interval_s=3600)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started:
        time.sleep(0.05)
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=url, timeout=120) as client:
        print(f"BEFORE: {client.post('/v1/completions', json=body).status_code}", flush=True)
        # The ranks run under the engine core's process: kill rank 1, a child of the core.
        os.kill(_children(app.state.engine.core_pid)[0], signal.SIGKILL)
        reply = client.post("/v1/completions", json=body | {"max_tokens": 64})
        print(f"AFTER: {reply.status_code} {reply.json()['error']['message']}", flush=True)
        reply = client.post("/v1/completions", json=body)
        print(f"LATER: {reply.status_code} {reply.json()['error']['type']}", flush=True)
        print(f"HEALTH: {client.get('/health').status_code}", flush=True)
    server.should_exit = True
    thread.join(30)
    print("SHUTDOWN OK", flush=True)


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid` that run Python (the tensor-parallel ranks the core spawned)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "spawn_main" in open(f"/proc/{entry}/cmdline").read():
            found.append(int(entry))
    assert found, f"no worker under the engine core {pid}"
    return found


if __name__ == "__main__":
    scenario, path = sys.argv[1], sys.argv[2]
    {"engine-kill": engine_kill, "server-kill": server_kill}[scenario](path)
