"""Stateful test: random operation sequences on the C++ manager, checked against its Python twin.

Hypothesis drives allocate / append / batch append / fork / free / swap out /
swap in / prefix hits (prompts drawn from a few shared prefixes) / cache
reset / step journal (begin_step, uncache_step_blocks) on both backends.
After every step it checks that both agree exactly (block tables, free-list
order, counters, step journal, results and error types) and that:
  - free + used == total, in both pools;
  - no block is both free and referenced;
  - every ref count equals the number of block tables holding the block (the
    prefix cache holds no reference: a cached block with count 0 is free and
    evictable, and reusing it takes it off the free list);
  - copy-on-write never leaves a sequence writing into a shared block;
  - blocks hold what the sequences put in them: sequences sharing a block
    agree on its tokens and their salt, and a prefix-cache hit (also on a
    cached block nobody holds any more) hands out a block holding exactly the
    new prompt's tokens under the same salt. Prompts that continue an earlier
    sequence's tokens (multi-turn), with its salt or another, make such hits
    common, also on blocks filled by appends and by forked children;
  - after all sequences are freed every block is free (cached ones evictable),
    and with caching off no block is even evictable: the pool is full again;
  - with a sliding window (the *Window machines), each sequence has dropped
    exactly the blocks wholly before the window of its latest earliest query
    (the first uncached prompt token at allocate, the old length at an
    append), its dropped entries are DROPPED_BLOCK and every walk over a table
    (fork, free, swap, metadata, caching) skips them. Sequences then grow far
    past the pool's size, and dropped cached blocks stay hittable.
"""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagedkv.core import DROPPED_BLOCK, BlockManager, BlockManagerError, block_hashes

BS = 4
NUM_GPU = 24
NUM_CPU = 16
PREFIXES = [list(range(1000, 1013)), list(range(2000, 2009)), list(range(1000, 1006)) + [7] * 6]
SALTS = [(), ("tenant-b",)]


class BlockManagerMachine(RuleBasedStateMachine):
    enable_caching = True
    sliding_window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        kw = {"watermark": 0.05, "enable_caching": self.enable_caching, "sliding_window": self.sliding_window}
        self.cpp = BlockManager(BS, NUM_GPU, NUM_CPU, backend="cpp", **kw)
        self.model = BlockManager(BS, NUM_GPU, NUM_CPU, backend="python", **kw)
        self.next_id = 0
        # What the sequences hold: tokens and salt per live sequence, the last
        # few freed ones (prompts may continue them), and per physical GPU block
        # the (salt, tokens up to the block's end) it holds while full.
        self.tokens_of: dict[int, list[int]] = {}
        self.salt_of: dict[int, tuple] = {}
        self.history: list[tuple[tuple, list[int]]] = []
        self.content: dict[int, tuple] = {}
        # Per live sequence: the position of the earliest query of its latest growth (what its window drop used).
        self.first_query: dict[int, int] = {}

    # --- helpers ---------------------------------------------------------------
    def both(self, method: str, *args, **kwargs):
        """Runs one call on both managers; they must return the same or raise the same error."""
        results = []
        for bm in (self.cpp, self.model):
            try:
                results.append(("ok", getattr(bm, method)(*args, **kwargs)))
            except BlockManagerError as e:
                results.append(("error", type(e)))
        assert results[0] == results[1], f"{method}{args}: C++ {results[0]} vs Python {results[1]}"
        return results[0]

    def running(self) -> list[int]:
        return [s for s in self.cpp.seq_ids() if not self.cpp.is_swapped(s)]

    def swapped(self) -> list[int]:
        return [s for s in self.cpp.seq_ids() if self.cpp.is_swapped(s)]

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def tokens(self, n: int, data) -> list[int]:
        return data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))

    def block_key(self, seq_id: int, i: int) -> tuple:
        """What logical block i of a sequence holds: its salt and every token up to the block's end."""
        return self.salt_of[seq_id], tuple(self.tokens_of[seq_id][:(i + 1) * BS])

    def do_allocate(self, prompt: list[int], salt: tuple) -> None:
        seq = self.new_id()
        arg = prompt if self.enable_caching else len(prompt)
        self.both("can_allocate", arg, salt)
        status, cached = self.both("allocate", seq, arg, salt)
        if status != "ok":
            return
        self.tokens_of[seq], self.salt_of[seq] = list(prompt), salt
        self.first_query[seq] = cached
        table = self.cpp.get_block_table(seq)
        assert cached % BS == 0 and cached < len(prompt)
        for i in range(cached // BS):  # each hit must hold this prompt's block, under this salt
            if table[i] == DROPPED_BLOCK:  # a hit before the window: not taken
                continue
            assert self.content.get(table[i]) == self.block_key(seq, i), (
                f"prefix hit on block {table[i]} holding {self.content.get(table[i])}, "
                f"prompt wants {self.block_key(seq, i)}")

    def check_no_shared_write(self, seq_id: int, n: int) -> None:
        table, total = self.cpp.get_block_table(seq_id), self.cpp.get_num_tokens(seq_id)
        for pos in range(total - n, total):
            assert self.cpp.core.gpu_ref_count(table[pos // BS]) == 1, "a write lands in a shared block"

    # --- rules -------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 13), extra=st.integers(1, 10),
          salt=st.sampled_from(SALTS))
    def allocate(self, data, prefix, cut, extra, salt):
        self.do_allocate(prefix[:cut] + self.tokens(extra, data), salt)

    @rule(data=st.data(), n=st.integers(1, BS - 1), salt=st.sampled_from(SALTS))
    def allocate_short(self, data, n, salt):
        """A prompt shorter than a block: its first block fills, and gets indexed, through appends."""
        self.do_allocate(self.tokens(n, data), salt)

    @precondition(lambda self: self.tokens_of or self.history)
    @rule(data=st.data(), extra=st.integers(0, 5), salt=st.sampled_from(SALTS))
    def allocate_continuing(self, data, extra, salt):
        """A prompt that starts with an earlier sequence's tokens (the next turn of a chat), any salt."""
        sources = [self.tokens_of[s] for s in sorted(self.tokens_of)] + [toks for _, toks in self.history]
        source = data.draw(st.sampled_from(sources))
        cut = len(source) if data.draw(st.booleans()) else data.draw(st.integers(1, len(source)))
        self.do_allocate(source[:cut] + self.tokens(extra, data), salt)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(self.running()))
        toks = self.tokens(n, data)
        self.both("can_append", [seq], n)
        old_len = self.cpp.get_num_tokens(seq)
        status, cow = self.both("append_slots", seq, n, toks if self.enable_caching else None)
        if status == "ok":
            self.first_query[seq] = old_len
            self.tokens_of[seq] += toks
            self.check_no_shared_write(seq, n)
            if cow is not None:  # the old last block was shared: the sequence now writes into dst
                src, dst = cow
                assert src != dst
                assert self.cpp.get_block_table(seq)[(self.cpp.get_num_tokens(seq) - n) // BS] == dst

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def append_batch(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=8, unique=True))
        toks = [self.tokens(1, data) for _ in seqs]
        old_lens = [self.cpp.get_num_tokens(s) for s in seqs]
        status, _ = self.both("append_slots_batch", seqs, 1, toks if self.enable_caching else None)
        if status == "ok":
            for seq, t, old_len in zip(seqs, toks, old_lens, strict=True):
                self.first_query[seq] = old_len
                self.tokens_of[seq] += t
                self.check_no_shared_write(seq, 1)

    @precondition(lambda self: self.sliding_window and self.running())
    @rule(data=st.data(), steps=st.integers(4, 24))
    def decode_run(self, data, steps):
        """Many one-token decodes of a few sequences: they grow past their window (and the pool's size)."""
        seqs = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=3, unique=True))
        for _ in range(steps):
            toks = [self.tokens(1, data) for _ in seqs]
            old_lens = [self.cpp.get_num_tokens(s) for s in seqs]
            status, _ = self.both("append_slots_batch", seqs, 1, toks if self.enable_caching else None)
            if status != "ok":
                return
            for seq, t, old_len in zip(seqs, toks, old_lens, strict=True):
                self.first_query[seq] = old_len
                self.tokens_of[seq] += t
            self.same_state()
            self.blocks_hold_the_same_tokens()  # records what each block holds before the window drops it

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data):
        parent, child = data.draw(st.sampled_from(self.running())), self.new_id()
        if self.both("fork", parent, child)[0] == "ok":
            self.tokens_of[child], self.salt_of[child] = list(self.tokens_of[parent]), self.salt_of[parent]
            self.first_query[child] = self.first_query[parent]

    @precondition(lambda self: self.cpp.seq_ids())
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.cpp.seq_ids()))
        if self.both("free", seq)[0] == "ok":
            del self.first_query[seq]
            self.history = [*self.history[-15:], (self.salt_of.pop(seq), self.tokens_of.pop(seq))]

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def swap_out(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=3, unique=True))
        self.both("can_swap_out", seqs)
        self.both("swap_out", seqs)

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.swapped()), min_size=1, max_size=3, unique=True))
        self.both("can_swap_in", seqs)
        self.both("swap_in", seqs)

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll):
        if roll == 0:  # rare: a reset wipes out the hits the other rules build up
            self.both("reset_prefix_cache")

    @rule()
    def begin_step(self):
        self.both("begin_step")

    @rule(roll=st.integers(0, 2))
    def uncache_step_blocks(self, roll):
        """A failed step: exactly the blocks newly cached since begin_step leave the index."""
        if roll != 0:  # a third of the time: uncaching, like a reset, takes hits away
            return
        journal = set(self.cpp.core.step_cached_blocks())
        cached = {b for b in range(NUM_GPU) if self.cpp.core.gpu_is_cached(b)}
        _, dropped = self.both("uncache_step_blocks")
        assert dropped == len(journal & cached)
        still = {b for b in range(NUM_GPU) if self.cpp.core.gpu_is_cached(b)}
        assert still == cached - journal, f"journal {journal}: cached {cached} became {still}"
        assert self.cpp.core.step_cached_blocks() == []

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def metadata(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=6))
        # Queries sit in live blocks (the slots of dropped ones are gone).
        live = [self.cpp.get_num_tokens(s) - self.cpp.num_dropped_blocks(s) * BS for s in seqs]
        query_lens = [data.draw(st.integers(0, n)) for n in live]
        width = max(len(self.cpp.get_block_table(s)) for s in seqs)
        outs = []
        for bm in (self.cpp, self.model):
            bt, sm = np.full((6, width), -7, np.int32), np.full(sum(query_lens) + 4, -1, np.int64)
            sl = np.zeros(6, np.int32)
            outs.append((bm.fill_metadata(seqs, bt, sm, sl, query_lens=query_lens), bt, sm, sl))
        assert outs[0][0] == outs[1][0]
        for a, b in zip(outs[0][1:], outs[1][1:], strict=True):
            np.testing.assert_array_equal(a, b)
        bt, sm = outs[0][1], outs[0][2]
        for i, s in enumerate(seqs):  # the rows carry the markers; no slot lands in a dropped block
            assert list(bt[i, :len(self.cpp.get_block_table(s))]) == self.cpp.get_block_table(s)
        assert (sm[:sum(query_lens)] >= 0).all()

    # --- invariants ----------------------------------------------------------------
    @invariant()
    def same_state(self):
        cpp, model = self.cpp, self.model
        assert cpp.seq_ids() == model.seq_ids()
        for s in cpp.seq_ids():
            assert cpp.get_block_table(s) == model.get_block_table(s)
            assert cpp.num_held_blocks(s) == model.num_held_blocks(s)
            assert cpp.get_num_tokens(s) == model.get_num_tokens(s)
            assert cpp.is_swapped(s) == model.is_swapped(s)
        assert cpp.core.gpu_free_list() == model.core.gpu_free_list()
        assert cpp.core.cpu_free_list() == model.core.cpu_free_list()
        assert cpp.num_evictable_gpu_blocks == model.num_evictable_gpu_blocks
        assert cpp.core.num_evictions == model.core.num_evictions
        assert cpp.core.step_cached_blocks() == model.core.step_cached_blocks()
        assert cpp.core.num_cached_blocks == model.core.num_cached_blocks
        s1, s2 = cpp.prefix_cache_stats, model.prefix_cache_stats
        assert (s1.queries, s1.hits) == (s2.queries, s2.hits)

    @invariant()
    def blocks_hold_the_same_tokens(self):
        """Sharers of a block agree on its contents; remember what each full GPU block holds."""
        assert sorted(self.tokens_of) == self.cpp.seq_ids()
        for swapped in (False, True):
            seen: dict[int, tuple] = {}
            for s in self.cpp.seq_ids():
                if self.cpp.is_swapped(s) != swapped:
                    continue
                assert len(self.tokens_of[s]) == self.cpp.get_num_tokens(s)
                for i, b in enumerate(self.cpp.get_block_table(s)):
                    if b == DROPPED_BLOCK:
                        continue
                    key = self.block_key(s, i)
                    assert seen.setdefault(b, key) == key, f"block {b} shared by sequences holding different tokens"
                    if not swapped:
                        if len(key[1]) == (i + 1) * BS:
                            self.content[b] = key
                        else:  # partly (re)written: whatever it held before is gone
                            self.content.pop(b, None)
        if not self.enable_caching:
            return
        # The hits a prompt equal to a live sequence would get, under each salt: every block the
        # index hands out must hold that prompt's tokens under that salt. Blocks are indexed only
        # while their sequence runs, so this sees a block filed under the wrong salt at once.
        for s in self.running():
            toks = self.tokens_of[s]
            for salt in SALTS:
                hashes = block_hashes(toks, BS, salt)
                hits = self.cpp.core.lookup_prefix(hashes, len(hashes))
                assert hits == self.model.core.lookup_prefix(hashes, len(hashes))
                for i, b in enumerate(hits):
                    assert self.content.get(b) == (salt, tuple(toks[:(i + 1) * BS])), (
                        f"the index hands out block {b} holding {self.content.get(b)} for {(salt, toks)}")

    @invariant()
    def pool_accounting(self):
        cpp = self.cpp
        cpp.check_invariants()  # C++: free-list links, counts, cache index, ref counts vs tables
        self.model.check_invariants()
        assert cpp.num_free_gpu_blocks + cpp.num_used_gpu_blocks == NUM_GPU
        holders = {"gpu": [0] * NUM_GPU, "cpu": [0] * NUM_CPU}
        for s in cpp.seq_ids():
            for b in cpp.get_block_table(s):
                if b != DROPPED_BLOCK:
                    holders["cpu" if cpp.is_swapped(s) else "gpu"][b] += 1
        for pool, ref_count, free_list in (("gpu", cpp.core.gpu_ref_count, cpp.core.gpu_free_list()),
                                           ("cpu", cpp.core.cpu_ref_count, cpp.core.cpu_free_list())):
            free = set(free_list)
            assert len(free) == len(free_list)
            for b, held in enumerate(holders[pool]):
                assert ref_count(b) == held, f"{pool} block {b}: ref count {ref_count(b)}, held by {held} tables"
                assert not (b in free and held), f"{pool} block {b} is free and referenced"
                assert (b in free) or held, f"{pool} block {b} is neither free nor referenced"
        assert cpp.num_free_cpu_blocks + sum(1 for h in holders["cpu"] if h) == NUM_CPU
        if not self.enable_caching:
            assert cpp.num_evictable_gpu_blocks == 0

    @invariant()
    def window_drops_exactly(self):
        """Each sequence dropped exactly the blocks wholly before the window of its latest earliest query."""
        w = self.sliding_window or 0
        for s in self.cpp.seq_ids():
            expect = max(0, self.first_query[s] - w + 1) // BS if w else 0
            table = self.cpp.get_block_table(s)
            assert self.cpp.num_dropped_blocks(s) == expect, (s, self.first_query[s], table)
            assert table[:expect] == [DROPPED_BLOCK] * expect and DROPPED_BLOCK not in table[expect:]
            assert self.cpp.num_held_blocks(s) == len(table) - expect

    def teardown(self):
        for s in self.cpp.seq_ids():
            self.both("free", s)
        for bm in (self.cpp, self.model):
            assert bm.num_free_gpu_blocks == NUM_GPU and bm.num_free_cpu_blocks == NUM_CPU
            assert bm.num_used_gpu_blocks == 0
            bm.check_invariants()
        if not self.enable_caching:
            assert self.cpp.num_evictable_gpu_blocks == 0


class BlockManagerMachineNoCaching(BlockManagerMachine):
    enable_caching = False


class BlockManagerMachineWindow(BlockManagerMachine):
    """A window that is not a multiple of the block size: the drop bound falls inside blocks."""

    sliding_window = 7


class BlockManagerMachineWindowNoCaching(BlockManagerMachine):
    enable_caching = False
    sliding_window = 4


COMMON = {"deadline": None, "database": None, "derandomize": True,
          "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}

TestBlockManagerWithCaching = BlockManagerMachine.TestCase
TestBlockManagerWithCaching.settings = settings(max_examples=120, stateful_step_count=50, **COMMON)
TestBlockManagerNoCaching = BlockManagerMachineNoCaching.TestCase
TestBlockManagerNoCaching.settings = settings(max_examples=60, stateful_step_count=50, **COMMON)
TestBlockManagerWindow = BlockManagerMachineWindow.TestCase
TestBlockManagerWindow.settings = settings(max_examples=120, stateful_step_count=50, **COMMON)
TestBlockManagerWindowNoCaching = BlockManagerMachineWindowNoCaching.TestCase
TestBlockManagerWindowNoCaching.settings = settings(max_examples=60, stateful_step_count=50, **COMMON)
