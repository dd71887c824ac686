"""KV cache events: which prefix blocks the engine holds, published for routers, in vLLM's wire format.

A router that places requests where their prefix is cached needs to know
which blocks each engine holds. Like vLLM and SGLang, the engine publishes,
once per step, a batch of events:

- `BlockStored`: blocks newly cached in the device pool this step (their
  chain hashes, the parent hash of the first, their token ids, block size,
  medium "GPU");
- `BlockRemoved`: cached blocks evicted from the pool this step;
- `AllBlocksCleared`: the prefix cache was reset.

With a host tier (`kv_offloading_size`), the blocks it takes on eviction and
drops (LRU) are reported too, with medium "CPU" (hashes only: an evicted
block's tokens are not kept).

Wire format (vLLM's, so a consumer written for vLLM reads pagedkv's
unchanged): a ZeroMQ PUB socket sends three frames per batch, the topic,
the batch's sequence number (8 bytes, big-endian) and the msgpack encoding
of `KVEventBatch` (an array `[ts, events]`; each event a map tagged by its
class name under "type"). With `replay_endpoint`, a ROUTER socket answers a
request `(identity, b"", start_seq)` with every buffered batch from
`start_seq` on, then an end marker whose sequence number is -1.

Configuration: `--kv-events-config` JSON with vLLM's keys
(`enable_kv_cache_events`, `publisher` "zmq" | "null", `endpoint`,
`replay_endpoint`, `buffer_steps`, `hwm`, `topic`). Publishing never blocks
a step: a consumer that falls behind the high-water mark loses batches (the
sequence numbers show the gap, and replay fills it).

Hashes are the prefix cache's chain digests (32 bytes of SHA-256 by
default), sent as bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from pagedkv.config import KVEventsConfig
from pagedkv.lora.request import lora_of_extra_keys

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # the host tier below the pool (kv_offloading_size)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the set of cached blocks (tagged by class name, as vLLM encodes it)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events: `ts` (time.time()) and the events in the order they happened."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def stored_events(entries: list[tuple[bytes, bytes | None, list[int]]], block_size: int,
                  extra_keys: dict[bytes, tuple] | None = None) -> list[BlockStored]:
    """BlockStored events for newly cached blocks given as (hash, parent hash, token ids), in caching order:
    one event per run of blocks that chain onto each other (a prompt's new blocks are one run). extra_keys:
    hash -> its request's prefix-cache extra keys; a LoRA adapter's gives the event's lora_id and lora_name."""
    events: list[BlockStored] = []
    for key, parent, tokens in entries:
        lora = lora_of_extra_keys((extra_keys or {}).get(key))
        lora_id, lora_name = lora if lora is not None else (None, None)
        last = events[-1] if events else None
        if last is not None and last.block_hashes[-1] == parent and last.lora_id == lora_id:
            last.block_hashes.append(key)
            last.token_ids.extend(tokens)
            continue
        events.append(BlockStored(block_hashes=[key], parent_block_hash=parent, token_ids=list(tokens),
                                  block_size=block_size, lora_id=lora_id, medium=MEDIUM_GPU, lora_name=lora_name))
    return events


class ZmqEventPublisher:
    """PUB socket (and optional ROUTER for replay) owned by one daemon thread, with the last `buffer_steps`
    batches kept for replay.

    The engine only encodes a batch and puts it on a bounded queue: a full queue drops the batch (counted), so
    a stuck network never slows a step. The thread sends, and answers replay requests even while the engine
    is idle.
    """

    POLL_S = 0.05

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self._zmq = zmq
        self.config = config
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.num_dropped = 0
        self.endpoint = config.endpoint
        ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ready,), name="pagedkv-kv-events", daemon=True)
        self._thread.start()
        ready.wait()
        if self._error is not None:  # a bad endpoint fails at start, naming it
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r}: {self._error}") from self._error

    def publish(self, batch: KVEventBatch) -> None:
        """Encodes a batch and queues it for the thread (never blocks)."""
        item = (self._seq, self._encoder.encode(batch))
        self._seq += 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.num_dropped += 1

    def _open(self):
        zmq = self._zmq
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if _is_bind(self.config.endpoint):
            pub.bind(self.config.endpoint)
        else:
            pub.connect(self.config.endpoint)
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.config.endpoint
        replay = None
        if self.config.replay_endpoint is not None:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.config.replay_endpoint)
        return pub, replay

    def _run(self, ready: threading.Event) -> None:
        try:
            pub, replay = self._open()
        except Exception as e:  # reported by __init__
            self._error = e
            ready.set()
            return
        ready.set()
        zmq = self._zmq
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    item = ()
                if item is None:
                    break
                if item:
                    seq, payload = item
                    self._buffer.append(item)
                    try:
                        pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                    except zmq.Again:  # past the high-water mark: this subscriber misses it, replay has it
                        self.num_dropped += 1
                if replay is not None:
                    self._serve_replay(replay)
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay) -> None:
        """Answers the waiting replay requests: every buffered batch from the asked sequence number on, then
        the end marker."""
        zmq = self._zmq
        while replay.poll(0, zmq.POLLIN):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("KV events: malformed replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued (within `timeout_s`), then closes the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("KV events: the publisher's queue stayed full; closing without its last batches")
        self._thread.join(timeout_s)


def _is_bind(endpoint: str) -> bool:
    """Wildcard tcp and ipc/inproc endpoints are bound; a host:port is connected to (vLLM's rule)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventEmitter:
    """The engine's side: gathers a step's stored / removed / cleared blocks and publishes them as one batch."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config, self.block_size = config, block_size
        self.publisher = ZmqEventPublisher(config)
        self.pending: list[KVCacheEvent] = []
        self.num_batches = 0
        logger.info("KV events: publishing on %s (topic %r)%s", self.publisher.endpoint, config.topic,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def removed(self, keys: list[bytes], medium: str = MEDIUM_GPU) -> None:
        if keys:
            self.pending.append(BlockRemoved(block_hashes=list(keys), medium=medium))

    def stored_host(self, keys: list[bytes]) -> None:
        """Blocks the host tier took: their hashes only (an evicted block's tokens are not kept), as vLLM's
        offloading reports blocks it has no metadata for."""
        if keys:
            self.pending.append(BlockStored(block_hashes=list(keys), parent_block_hash=None, token_ids=[],
                                            block_size=self.block_size, lora_id=None, medium=MEDIUM_CPU,
                                            lora_name=None))

    def stored(self, entries: list[tuple[bytes, bytes | None, list[int]]],
               extra_keys: dict[bytes, tuple] | None = None) -> None:
        self.pending.extend(stored_events(entries, self.block_size, extra_keys))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def flush(self) -> None:
        """Publishes what the step gathered (nothing when it gathered nothing)."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        self.num_batches += 1

    def close(self) -> None:
        self.flush()
        self.publisher.close()
