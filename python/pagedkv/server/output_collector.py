"""RequestOutputCollector: what the engine produced for one HTTP request and its client has not read yet.

The engine thread hands over DELTA outputs (only what each step added). A
client that reads slowly (or not at all) must not make the server hold one
object per step: the collector keeps at most one pending output per engine
request and merges each new delta into it (texts and token ids appended,
the latest finish state kept), as vLLM's RequestOutputCollector does. So
what a slow reader costs is the text it has not read, never a copy per step.
An error for an engine request replaces whatever was pending for it.
"""

from __future__ import annotations

import asyncio

from pagedkv.outputs import CompletionOutput, RequestOutput

Item = RequestOutput | BaseException


def _merge_completion(into: CompletionOutput, new: CompletionOutput) -> None:
    into.text += new.text
    into.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = list(new.logprobs)
        else:
            into.logprobs.extend(new.logprobs)
    into.cumulative_logprob = new.cumulative_logprob
    into.finish_reason, into.stop_reason = new.finish_reason, new.stop_reason


def merge_delta(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`pending` with the DELTA output `new` appended (in place; returns `pending`)."""
    by_index = {c.index: c for c in pending.outputs}
    for c in new.outputs:
        have = by_index.get(c.index)
        if have is None:
            by_index[c.index] = c
        else:
            _merge_completion(have, c)
    pending.outputs = sorted(by_index.values(), key=lambda c: c.index)
    pending.finished, pending.metrics = new.finished, new.metrics
    pending.num_cached_tokens, pending.error = new.num_cached_tokens, new.error
    if new.pooled is not None:
        pending.pooled = new.pooled
    return pending


class RequestOutputCollector:
    """Pending outputs of one HTTP request's engine requests: one merged slot each, and one wake-up event.

    Lives on the event loop: `put` is called there (the engine thread hands
    its outputs over with call_soon_threadsafe), `get` waits there.
    """

    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, Item]] = {}  # request_id -> (tag, merged output or error)
        self._ready = asyncio.Event()

    def put(self, tag: int, request_id: str, item: Item) -> None:
        have = self._pending.get(request_id)
        if have is not None and isinstance(item, RequestOutput) and isinstance(have[1], RequestOutput):
            item = merge_delta(have[1], item)
        elif have is not None and isinstance(have[1], BaseException):
            return  # an error is final: nothing after it matters
        self._pending[request_id] = (tag, item)
        self._ready.set()

    async def get(self) -> list[tuple[int, str, Item]]:
        """Waits for something, then takes everything pending: [(tag, request_id, output or error)]."""
        await self._ready.wait()
        self._ready.clear()
        items = [(tag, rid, item) for rid, (tag, item) in self._pending.items()]
        self._pending.clear()
        return items

    def pending_tokens(self) -> int:
        """Output tokens waiting to be read, over all its engine requests."""
        return sum(len(c.token_ids) for _, item in self._pending.values() if isinstance(item, RequestOutput)
                   for c in item.outputs)

    @property
    def num_pending(self) -> int:
        """Engine requests with something unread (at most one slot each)."""
        return len(self._pending)
