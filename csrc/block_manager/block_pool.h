// A pool of fixed-size physical KV-cache blocks on one device kind.
//
// Each block has a reference count (the number of block tables holding it).
// Free blocks sit in an intrusive doubly linked list threaded through two
// index arrays (prev/next), so that every list operation is O(1):
//   - allocate pops the front;
//   - a block whose count drops to 0 is pushed back into the list;
//   - a prefix-cache hit on a free but still cached block unlinks it from the
//     middle ("revives" it) without touching its contents.
//
// Prefix caching. A block may carry a cache key (the digest of its chained
// token hash, computed in Python). The pool owns the key -> block index, so a
// free cached block stays findable ("evictable") until the pool hands it out
// again; allocate evicts it then and drops its key, with no callback needed.
// Order of the free list, front (allocated first) to back:
//   uncached free blocks | cached free blocks, least recently freed first.
// Uncached blocks go to the front (their contents are worthless), cached ones
// to the back; allocation therefore evicts the least recently used cached
// block, and only once no uncached block is left.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pagedkv {

using BlockId = int32_t;

class BlockPool {
 public:
  // `name` appears in error messages ("gpu", "cpu").
  BlockPool(int32_t num_blocks, std::string name);

  // Takes a free block (ref count 0 -> 1); evicts it from the prefix cache if
  // it was cached. Throws NoFreeBlocksError when the free list is empty.
  BlockId allocate();
  // One more holder of a block. A free block may only be shared if it is
  // cached (a prefix-cache hit): it is unlinked from the free list.
  void incref(BlockId block);
  // One holder fewer; returns the new count. At 0 the block returns to the
  // free list (cached: to the back, else to the front).
  int32_t decref(BlockId block);
  // Releases a block held exactly once. Throws if it is shared (count > 1)
  // or already free.
  void free(BlockId block);

  // Prefix-cache index. `key` is an opaque digest (e.g. 32 SHA-256 bytes).
  // Returns false (and caches nothing) if the key is already present or the
  // block already carries a key.
  bool cache_block(BlockId block, const std::string& key);
  // Drops the block's cache key, if any; returns whether it had one. A free
  // block becomes a plain free block and moves to the front of the list
  // (its contents are worthless now). Not an eviction: num_evictions stays.
  // For KV that was never written (a failed step, see BlockManager::begin_step).
  bool uncache(BlockId block);
  // The block cached under `key`, or -1.
  BlockId lookup(const std::string& key) const;
  bool is_cached(BlockId block) const;
  // Drops every cache key (free cached blocks become plain free blocks).
  void clear_cache();
  // The block's cache key ("" if it has none).
  const std::string& key(BlockId block) const;

  // Eviction journal, for a tier below this pool (pagedkv.core.kv_tiers):
  // while on, every eviction by allocate() records (block, key) before the
  // key is dropped, so the caller can copy the block's bytes elsewhere
  // before anything overwrites them. Off by default (costs nothing then).
  void set_record_evictions(bool on);
  bool record_evictions() const { return record_evictions_; }
  // The evictions recorded since the last call, in eviction order; empties the journal.
  std::vector<std::pair<BlockId, std::string>> take_evictions();

  int32_t ref_count(BlockId block) const;
  bool is_free(BlockId block) const;
  int32_t num_blocks() const { return static_cast<int32_t>(ref_count_.size()); }
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_blocks() - num_free_; }
  // Free blocks that still hold cached contents.
  int32_t num_evictable() const { return num_evictable_; }
  int32_t num_cached() const { return static_cast<int32_t>(index_.size()); }
  int64_t num_evictions() const { return num_evictions_; }
  // Free list from front (next to be allocated) to back.
  std::vector<BlockId> free_list() const;
  const std::string& name() const { return name_; }

  // The state of every block in one pass, into caller arrays of num_blocks()
  // entries: its reference count, whether it carries a cache key, and the key's
  // first 8 bytes as a little-endian integer (0 without a key), for a view of
  // the pool that costs no Python loop (pagedkv.core.kv_snapshot).
  void snapshot(int32_t* ref_counts, uint8_t* cached, uint64_t* key_prefix) const;

  // Walks every structure and throws std::logic_error on any inconsistency.
  // For tests: O(num_blocks).
  void check_invariants() const;

 private:
  void check_block(BlockId block, const char* op) const;
  void push_front(BlockId block);
  void push_back(BlockId block);
  void unlink(BlockId block);
  void evict(BlockId block);

  std::string name_;
  std::vector<int32_t> ref_count_;
  // Free-list links; index num_blocks() is the sentinel (head.next = front).
  std::vector<BlockId> prev_;
  std::vector<BlockId> next_;
  std::vector<uint8_t> in_free_list_;
  // Cache key per block ("" = not cached) and the reverse index.
  std::vector<std::string> key_;
  std::unordered_map<std::string, BlockId> index_;
  int32_t num_free_ = 0;
  int32_t num_evictable_ = 0;
  int64_t num_evictions_ = 0;
  bool record_evictions_ = false;
  std::vector<std::pair<BlockId, std::string>> evicted_;  // the eviction journal
};

}  // namespace pagedkv
