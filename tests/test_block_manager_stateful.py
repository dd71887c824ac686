"""Stateful test: random operation sequences on the C++ manager, checked against its Python twin.

Hypothesis drives allocate / append / batch append / fork / free / swap out /
swap in / prefix hits (prompts drawn from a few shared prefixes) / cache
reset on both backends. After every step it checks that both agree exactly
(block tables, free-list order, counters, results and error types) and that:
  - free + used == total, in both pools;
  - no block is both free and referenced;
  - every ref count equals the number of block tables holding the block (the
    prefix cache holds no reference: a cached block with count 0 is free and
    evictable, and reusing it takes it off the free list);
  - copy-on-write never leaves a sequence writing into a shared block;
  - after all sequences are freed every block is free (cached ones evictable),
    and with caching off no block is even evictable: the pool is full again.
"""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagedkv.core import BlockManager, BlockManagerError

BS = 4
NUM_GPU = 24
NUM_CPU = 16
PREFIXES = [list(range(1000, 1013)), list(range(2000, 2009)), list(range(1000, 1006)) + [7] * 6]


class BlockManagerMachine(RuleBasedStateMachine):
    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        kw = {"watermark": 0.05, "enable_caching": self.enable_caching}
        self.cpp = BlockManager(BS, NUM_GPU, NUM_CPU, backend="cpp", **kw)
        self.model = BlockManager(BS, NUM_GPU, NUM_CPU, backend="python", **kw)
        self.next_id = 0

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

    def check_no_shared_write(self, seq_id: int, n: int) -> None:
        table, total = self.cpp.get_block_table(seq_id), self.cpp.get_num_tokens(seq_id)
        for pos in range(total - n, total):
            assert self.cpp.core.gpu_ref_count(table[pos // BS]) == 1, "a write lands in a shared block"

    # --- rules -------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 13), extra=st.integers(1, 10),
          salt=st.sampled_from([(), ("tenant-b",)]))
    def allocate(self, data, prefix, cut, extra, salt):
        prompt = prefix[:cut] + self.tokens(extra, data)
        arg = prompt if self.enable_caching else len(prompt)
        self.both("can_allocate", arg, salt)
        self.both("allocate", self.new_id(), arg, salt)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(self.running()))
        toks = self.tokens(n, data) if self.enable_caching else None
        self.both("can_append", [seq], n)
        status, cow = self.both("append_slots", seq, n, toks)
        if status == "ok":
            self.check_no_shared_write(seq, n)
            if cow is not None:  # the old last block was shared: the sequence now writes into dst
                src, dst = cow
                assert src != dst
                assert self.cpp.get_block_table(seq)[(self.cpp.get_num_tokens(seq) - n) // BS] == dst

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def append_batch(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=8, unique=True))
        toks = [self.tokens(1, data) for _ in seqs] if self.enable_caching else None
        status, _ = self.both("append_slots_batch", seqs, 1, toks)
        if status == "ok":
            for seq in seqs:
                self.check_no_shared_write(seq, 1)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data):
        self.both("fork", data.draw(st.sampled_from(self.running())), self.new_id())

    @precondition(lambda self: self.cpp.seq_ids())
    @rule(data=st.data())
    def free(self, data):
        self.both("free", data.draw(st.sampled_from(self.cpp.seq_ids())))

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

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def metadata(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=6))
        query_lens = [data.draw(st.integers(0, self.cpp.get_num_tokens(s))) for s in seqs]
        outs = []
        for bm in (self.cpp, self.model):
            bt, sm, sl = np.full((6, 24), -1, np.int32), np.full(300, -1, np.int64), np.zeros(6, np.int32)
            outs.append((bm.fill_metadata(seqs, bt, sm, sl, query_lens=query_lens), bt, sm, sl))
        assert outs[0][0] == outs[1][0]
        for a, b in zip(outs[0][1:], outs[1][1:], strict=True):
            np.testing.assert_array_equal(a, b)

    # --- invariants ----------------------------------------------------------------
    @invariant()
    def same_state(self):
        cpp, model = self.cpp, self.model
        assert cpp.seq_ids() == model.seq_ids()
        for s in cpp.seq_ids():
            assert cpp.get_block_table(s) == model.get_block_table(s)
            assert cpp.get_num_tokens(s) == model.get_num_tokens(s)
            assert cpp.is_swapped(s) == model.is_swapped(s)
        assert cpp.core.gpu_free_list() == model.core.gpu_free_list()
        assert cpp.core.cpu_free_list() == model.core.cpu_free_list()
        assert cpp.num_evictable_gpu_blocks == model.num_evictable_gpu_blocks
        assert cpp.core.num_evictions == model.core.num_evictions
        s1, s2 = cpp.prefix_cache_stats, model.prefix_cache_stats
        assert (s1.queries, s1.hits) == (s2.queries, s2.hits)

    @invariant()
    def pool_accounting(self):
        cpp = self.cpp
        cpp.check_invariants()  # C++: free-list links, counts, cache index, ref counts vs tables
        self.model.check_invariants()
        assert cpp.num_free_gpu_blocks + cpp.num_used_gpu_blocks == NUM_GPU
        holders = {"gpu": [0] * NUM_GPU, "cpu": [0] * NUM_CPU}
        for s in cpp.seq_ids():
            for b in cpp.get_block_table(s):
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


COMMON = {"deadline": None, "database": None, "derandomize": True,
          "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}

TestBlockManagerWithCaching = BlockManagerMachine.TestCase
TestBlockManagerWithCaching.settings = settings(max_examples=120, stateful_step_count=50, **COMMON)
TestBlockManagerNoCaching = BlockManagerMachineNoCaching.TestCase
TestBlockManagerNoCaching.settings = settings(max_examples=60, stateful_step_count=50, **COMMON)
