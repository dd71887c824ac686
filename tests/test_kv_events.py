"""KV cache events (pagedkv.engine.kv_events): vLLM's schema and framing, replay, and a consumer that rebuilds the
engine's set of cached blocks from the events alone."""

from __future__ import annotations

import os
import random
import subprocess

import msgspec
import pytest
import zmq
from pagedkv import LLM, SamplingParams
from pagedkv.config import EngineArgs, KVEventsConfig
from pagedkv.engine.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    stored_events,
)

BS = 16


def replay(endpoint: str, start: int = 0) -> list[tuple[int, KVEventBatch]]:
    """Every buffered batch from `start` on, through the replay socket, decoded as a vLLM consumer would."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = []
    while True:
        frames = sock.recv_multipart()
        if frames[-2] == END_SEQ:
            break
        _empty, _topic, seq, payload = frames
        batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    sock.close()
    return batches


def rebuild(batches: list[tuple[int, KVEventBatch]], medium: str = "GPU") -> set[bytes]:
    """The hashes a consumer believes are cached on `medium` after the batches."""
    cached: set[bytes] = set()
    for _, batch in batches:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                cached.clear()
            elif ev.medium != medium:
                continue
            elif isinstance(ev, BlockRemoved):
                cached.difference_update(ev.block_hashes)
            else:
                if medium == "GPU":  # the pool's events carry the tokens; the host tier's, hashes only
                    assert len(ev.token_ids) == BS * len(ev.block_hashes) and ev.block_size == BS
                cached.update(ev.block_hashes)
    return cached


def engine_cached_prefixes(llm: LLM) -> set[int]:
    """The engine's own answer: the hash prefixes of its cached blocks (one bulk snapshot call)."""
    raw = llm.llm_engine.block_manager.core.snapshot()
    return {int(k) for k, c in zip(raw["key_prefix"], raw["cached"], strict=True) if c}


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"


def make(loaded_model, endpoints, blocks: int = 14, **kw) -> LLM:
    cfg = loaded_model.model.config
    per_block = cfg.num_hidden_layers * 2 * loaded_model.model.num_kv_heads * cfg.head_dim * 4 * BS
    events = {"enable_kv_cache_events": True, "endpoint": endpoints[0], "replay_endpoint": endpoints[1],
              "topic": "kv"}
    return LLM(loaded_model=loaded_model, kv_cache_memory=blocks * per_block, max_model_len=128,
               enable_prefix_caching=True, kv_events_config=events, **kw)


def test_replayed_events_rebuild_the_engines_cached_blocks(loaded_model, endpoints):
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 30000) for _ in range(3 * BS)] for _ in range(4)]
    llm = make(loaded_model, endpoints, blocks=8)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoints[0])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for r in range(2):  # an 8-block pool cannot keep every prefix: blocks are evicted and stored again
            for p in prefixes:
                llm.generate([{"prompt_token_ids": p + [r + 1]}], params, use_tqdm=False)
        batches = replay(endpoints[1])
        seqs = [s for s, _ in batches]
        assert seqs == list(range(len(seqs))) and len(seqs) > 3
        kinds = {type(e) for _, b in batches for e in b.events}
        assert kinds == {BlockStored, BlockRemoved}
        rebuilt = rebuild(batches)
        assert {int.from_bytes(h[:8], "little") for h in rebuilt} == engine_cached_prefixes(llm)
        # The chain is announced as a router needs it: each stored run names its parent.
        bm = llm.llm_engine.block_manager
        chain = bm.prefix_cache.prompt_hashes(prefixes[0] + [1])
        firsts = [e for _, b in batches for e in b.events
                  if isinstance(e, BlockStored) and e.block_hashes[0] == chain[0]]
        assert firsts and firsts[0].parent_block_hash is None and firsts[0].token_ids[:BS] == prefixes[0][:BS]
        # The live socket delivers later batches to a subscriber that joined earlier.
        llm.generate([{"prompt_token_ids": prefixes[0] + [99] * 20}], params, use_tqdm=False)
        live = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            live.append(int.from_bytes(seq, "big"))
        assert live and live == sorted(live) and live[-1] >= len(seqs)  # the new prompt's batches arrived
        # The wire layout itself: an array [ts, events], each event a map tagged with its class name.
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and isinstance(raw[0], float)
        assert all(isinstance(e, dict) and e["type"] in ("BlockStored", "BlockRemoved") for e in raw[1])
        assert llm.reset_prefix_cache()
        last = replay(endpoints[1], start=int.from_bytes(seq, "big") + 1)
        assert isinstance(last[-1][1].events[-1], AllBlocksCleared)
        assert rebuild(last) == set() and engine_cached_prefixes(llm) == set()
    finally:
        sub.close()
        llm.shutdown()


def test_host_tier_events_rebuild_both_media(loaded_model, endpoints):
    """With a host tier, the blocks it takes and drops come as medium "CPU" events: replaying both media gives
    the pool's cached set and the tier's."""
    rng = random.Random(1)
    prefixes = [[rng.randrange(100, 30000) for _ in range(3 * BS)] for _ in range(5)]
    cfg = loaded_model.model.config
    per_block = cfg.num_hidden_layers * 2 * loaded_model.model.num_kv_heads * cfg.head_dim * 4 * BS
    llm = make(loaded_model, endpoints, blocks=8, kv_offloading_size=6 * per_block / 2**30)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for r in range(2):
            for p in prefixes:
                llm.generate([{"prompt_token_ids": p + [r + 1]}], params, use_tqdm=False)
        batches = replay(endpoints[1])
        assert {int.from_bytes(h[:8], "little") for h in rebuild(batches)} == engine_cached_prefixes(llm)
        host = llm.llm_engine.block_manager.tiers.host
        held = {host.pool.key(s) for s in range(host.num_slots)} - {b""}
        assert rebuild(batches, "CPU") == held and len(held) == 6  # the six-slot tier is full and rotated
        assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for _, b in batches for e in b.events)
    finally:
        llm.shutdown()


def test_stored_events_group_chained_blocks():
    a, b, c, x = b"a" * 32, b"b" * 32, b"c" * 32, b"x" * 32
    events = stored_events([(a, None, [1] * BS), (b, a, [2] * BS), (x, None, [3] * BS), (c, b, [4] * BS)], BS)
    assert [e.block_hashes for e in events] == [[a, b], [x], [c]]
    assert events[0].parent_block_hash is None and events[2].parent_block_hash == b
    assert events[0].token_ids == [1] * BS + [2] * BS


@pytest.mark.parametrize("value, match", [
    ('{"enable_kv_cache_events": true, "colour": 1}', "unknown keys"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ("not json", "JSON object"),
    ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm"),
])
def test_bad_events_config_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        KVEventsConfig.parse(value)


def test_events_need_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(kv_events_config={"enable_kv_cache_events": True})
    assert EngineArgs(kv_events_config={"enable_kv_cache_events": False}).kv_events_config is not None


VLLM_PYTHON = os.environ.get("PAGEDKV_VLLM_PYTHON", "/work/vllm-venv/bin/python")


def _has_vllm_kv_events(python: str) -> bool:
    """Whether `python` can import vLLM's kv_events module and msgspec (a venv can exist half installed).
    That interpreter finds the modules without importing them, so collection does not pay for importing vLLM."""
    if not os.path.exists(python):
        return False
    probe = ("import importlib.util as u, os\n"
             "v = u.find_spec('vllm')\n"
             "ok = v is not None and u.find_spec('msgspec') is not None and os.path.exists(\n"
             "    os.path.join(os.path.dirname(v.origin), 'distributed', 'kv_events.py'))\n"
             "raise SystemExit(0 if ok else 1)\n")
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0


@pytest.mark.skipif(not _has_vllm_kv_events(VLLM_PYTHON), reason=f"no vLLM install at {VLLM_PYTHON} "
                    "(PAGEDKV_VLLM_PYTHON names one)")
def test_vllms_own_decoder_reads_the_batches_byte_for_byte(tmp_path):
    """A consumer written for vLLM decodes pagedkv's batches with vLLM's own classes and re-encodes the same
    bytes (the schema, the tags and the defaults left out all agree)."""
    batch = KVEventBatch(ts=1.5, events=[
        *stored_events([(b"a" * 32, None, [1] * BS), (b"b" * 32, b"a" * 32, [2] * BS)], BS),
        BlockRemoved(block_hashes=[b"c" * 32], medium="GPU"), AllBlocksCleared()])
    path = tmp_path / "batch.msgpack"
    path.write_bytes(msgspec.msgpack.encode(batch))
    script = ("import msgspec, sys\n"
              "from vllm.distributed.kv_events import KVEventBatch\n"
              "data = open(sys.argv[1], 'rb').read()\n"
              "b = msgspec.msgpack.Decoder(KVEventBatch).decode(data)\n"
              "print([type(e).__name__ for e in b.events], msgspec.msgpack.encode(b) == data)\n")
    out = subprocess.run([VLLM_PYTHON, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # The two chained blocks are one BlockStored.
    assert out.stdout.strip().splitlines()[-1] == "['BlockStored', 'BlockRemoved', 'AllBlocksCleared'] True"
