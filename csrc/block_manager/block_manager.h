// Per-sequence block tables over a GPU pool (and a CPU swap pool).
//
// A sequence id maps to its block table (logical block i -> physical block)
// and its token count. The manager knows token counts only, never token ids:
// prefix-cache keys are computed in Python (pagedkv.core.prefix_cache) and
// handed in as opaque digests.
//
// Every mutating call checks everything it needs first and then changes the
// state, so a call that throws (e.g. NoFreeBlocksError) leaves it untouched.
//
// Sliding window. For a model whose every layer attends only to the last W
// positions (HF convention: a query at position p reads keys k with
// p - W < k <= p), the manager may be given W (`sliding_window`, 0 = off).
// Then, whenever a sequence gets slots for new tokens whose earliest query is
// at position p0 (allocate: the first uncached token; append: the old token
// count), every logical block whose positions all lie below p0 - W + 1 is
// released: its reference count drops exactly as in free() (a cached block
// nobody else holds becomes evictable), and its table entry becomes
// kDroppedBlock. Later queries sit further right, so a dropped block is never
// needed again. The dropped entries always form a prefix of the table, so a
// sequence holds at most ceil(W / block_size) + 1 blocks between steps (plus
// its chunk's blocks during a chunked prefill), whatever its length.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_manager/block_pool.h"

namespace pagedkv {

using SeqId = int64_t;
using BlockPair = std::pair<BlockId, BlockId>;  // (src, dst)

enum class AllocStatus { kOk, kLater, kNever };

// Table entry of a block released by the sliding window (see the top of this file).
constexpr BlockId kDroppedBlock = -1;

struct SeqState {
  std::vector<BlockId> table;  // table[:num_dropped] are kDroppedBlock, the rest live blocks
  int64_t num_tokens = 0;
  int64_t num_dropped = 0;  // leading entries released by the sliding window
  bool swapped = false;  // table holds CPU-pool blocks
  uint64_t batch_stamp = 0;  // last append_slots_batch that saw it (duplicate check in O(1))
};

class BlockManager {
 public:
  // watermark: fraction of GPU blocks that admitting new prompts must leave
  // free, so that running sequences can still append (in [0, 1)).
  // sliding_window: the model's attention window W in tokens (0: off).
  BlockManager(int32_t block_size, int32_t num_gpu_blocks, int32_t num_cpu_blocks, double watermark,
               bool enable_caching, int32_t sliding_window = 0);

  // --- admission --------------------------------------------------------
  // kNever: the prompt can never fit (more blocks than the pool minus the
  // watermark); kLater: not now; kOk: go. `cached_prefix` are blocks a
  // prefix-cache lookup returned; free ones among them still cost a block.
  // With a sliding window, hits wholly before the window of the first
  // uncached token are neither taken nor counted.
  AllocStatus allocate_status(int64_t num_tokens, const std::vector<BlockId>& cached_prefix) const;
  // Gives `seq_id` blocks for `num_tokens` tokens, sharing `cached_prefix`
  // (ref count +1 each) as its first blocks; hits before the window become
  // kDroppedBlock entries.
  void allocate(SeqId seq_id, int64_t num_tokens, const std::vector<BlockId>& cached_prefix);

  // --- growth -----------------------------------------------------------
  // Net GPU blocks that appending `num_new_tokens` would take: new blocks and
  // the copy-on-write, minus the blocks the sliding window frees (those only
  // this sequence holds). Negative when the window frees more than it takes.
  int32_t blocks_to_append(SeqId seq_id, int64_t num_new_tokens) const;
  // Whether every sequence in `seq_ids` can append `num_new_tokens` at once.
  bool can_append(const std::vector<SeqId>& seq_ids, int64_t num_new_tokens) const;
  // Reserves slots for `num_new_tokens` more tokens. If the last block is
  // partly filled and shared, it is first copied: returns that (src, dst).
  std::optional<BlockPair> append_slots(SeqId seq_id, int64_t num_new_tokens);
  // append_slots for every sequence of a decode step, all or nothing: throws
  // NoFreeBlocksError before changing anything if the blocks do not suffice.
  // Every sequence's window drop runs before any allocation, so blocks one
  // sequence frees serve another's new block. Returns the copy-on-write pairs.
  std::vector<BlockPair> append_slots_batch(const std::vector<SeqId>& seq_ids, int64_t num_new_tokens);
  // `child` shares every live block of `parent` (parallel sampling, beam
  // search); dropped entries stay dropped in the child.
  void fork(SeqId parent, SeqId child);
  void free(SeqId seq_id);
  // Shortens a running sequence to its first `num_tokens` tokens (speculative
  // decoding: slots given to draft tokens the model then rejected). Trailing
  // blocks no token is left in are released as free() releases them; the kept
  // ones, a partly filled last block included, stay as they are (the next
  // append writes over the rejected slots). num_tokens must lie in
  // [0, current count], and with a sliding window its next query's window
  // must not reach into the dropped blocks.
  void truncate(SeqId seq_id, int64_t num_tokens);

  // --- swapping (a group of sequences at once keeps their sharing) ------
  bool can_swap_out(const std::vector<SeqId>& seq_ids) const;
  bool can_swap_in(const std::vector<SeqId>& seq_ids) const;
  // (gpu, cpu) pairs for swap_blocks, each distinct live block once (dropped
  // entries stay kDroppedBlock in either pool).
  std::vector<BlockPair> swap_out(const std::vector<SeqId>& seq_ids);
  // (cpu, gpu) pairs.
  std::vector<BlockPair> swap_in(const std::vector<SeqId>& seq_ids);

  // --- prefix cache -----------------------------------------------------
  // Blocks cached under keys[0], keys[1], ... up to the first miss, at most `max_blocks`.
  std::vector<BlockId> lookup_prefix(const std::vector<std::string>& keys, int64_t max_blocks) const;
  // Caches the full blocks first_block, first_block+1, ... of a sequence
  // under `keys`. Returns how many were newly cached (a key already present
  // elsewhere keeps its block). Dropped entries are skipped: the sequence
  // holds nothing there to offer.
  int32_t cache_blocks(SeqId seq_id, int64_t first_block, const std::vector<std::string>& keys);
  // Also empties the step journal (nothing is left to uncache).
  void reset_prefix_cache();

  // --- step journal -----------------------------------------------------
  // Blocks enter the index when they get slots, before the forward pass
  // writes their KV. If that pass fails, the index would offer garbage to a
  // retry of the same prompt. So the manager journals every block that
  // cache_blocks newly caches: the engine calls begin_step() before
  // scheduling a step and, if the step fails, uncache_step_blocks().
  // Without caching the journal stays empty and both calls do nothing.
  // The journal grows by one id per newly cached block until begin_step().
  void begin_step() { step_cached_.clear(); }
  // Drops every journaled block from the index (free ones become plain free
  // blocks, see BlockPool::uncache) and empties the journal. Returns how many
  // were still cached (a journaled block evicted since is skipped).
  int32_t uncache_step_blocks();
  // GPU blocks newly cached since the last begin_step(), in caching order.
  const std::vector<BlockId>& step_cached_blocks() const { return step_cached_; }
  // (block, key) of the journaled blocks that still carry their key: the
  // blocks whose KV a successful step just wrote (a disk tier's write-through).
  std::vector<std::pair<BlockId, std::string>> step_cached_entries() const;

  // --- eviction journal (a tier below the GPU pool) -----------------------
  // While on, every cached GPU block that allocation evicts is recorded with
  // its key (BlockPool::set_record_evictions), so its bytes can be copied to
  // a host tier before the step writes over them.
  void set_record_evictions(bool on) { gpu_.set_record_evictions(on); }
  std::vector<std::pair<BlockId, std::string>> take_evicted() { return gpu_.take_evictions(); }

  // --- batch metadata ---------------------------------------------------
  // For the i-th sequence: block_tables[i, :] = its table padded with
  // `pad_value`, seq_lens[i] = its token count, and slot_mapping gets the
  // slots of its last query_lens[i] tokens (query_lens null: 1 each).
  // block_tables is row-major [num_seqs, max_blocks]; returns the number of
  // slots written. Checks everything before writing anything. Dropped
  // entries are written as kDroppedBlock; a query may not sit in a dropped block.
  int64_t fill_metadata(const SeqId* seq_ids, int64_t num_seqs, const int64_t* query_lens, int32_t* block_tables,
                        int64_t max_blocks, int64_t* slot_mapping, int64_t slot_capacity, int32_t* seq_lens,
                        int32_t pad_value) const;

  // --- introspection ----------------------------------------------------
  const SeqState& seq(SeqId seq_id) const;
  bool has_seq(SeqId seq_id) const { return seqs_.count(seq_id) != 0; }
  std::vector<SeqId> seq_ids() const;
  const BlockPool& gpu_pool() const { return gpu_; }
  const BlockPool& cpu_pool() const { return cpu_; }
  int32_t block_size() const { return block_size_; }
  int32_t watermark_blocks() const { return watermark_blocks_; }
  bool enable_caching() const { return enable_caching_; }
  int32_t sliding_window() const { return window_; }
  // Blocks a sequence holds: its table less the dropped entries.
  int64_t num_held_blocks(SeqId seq_id) const;
  // Pools' invariants, and every ref count equals the number of tables holding the block.
  void check_invariants() const;

 private:
  int64_t blocks_for(int64_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }
  // Logical blocks wholly before the window of a query at `first_query` (0 without a window).
  int64_t blocks_before_window(int64_t first_query) const;
  // Blocks the window drop for `first_query` would return to the free list (those held only by `s`).
  int64_t freed_by_drop(const SeqState& s, int64_t first_query) const;
  // Releases the blocks before the window of `first_query` (deepest first, as free() does).
  void drop_before_window(SeqState& s, int64_t first_query);
  // check_invariants for one sequence's dropped entries.
  void check_dropped(SeqId id, const SeqState& s) const;
  SeqState& running_seq(SeqId seq_id, const char* op);
  const SeqState& running_seq(SeqId seq_id, const char* op) const;
  const SeqState& find_seq(SeqId seq_id, const char* op) const;
  int64_t blocks_to_append(const SeqState& s, int64_t num_new_tokens) const;
  std::optional<BlockPair> append_to(SeqState& s, int64_t num_new_tokens);
  int32_t distinct_blocks(const std::vector<SeqId>& seq_ids, bool swapped, const char* op) const;
  std::vector<BlockPair> move_seqs(const std::vector<SeqId>& seq_ids, BlockPool& from, BlockPool& to,
                                   bool now_swapped);

  int32_t block_size_;
  BlockPool gpu_;
  BlockPool cpu_;
  int32_t watermark_blocks_;
  bool enable_caching_;
  int32_t window_;  // sliding window in tokens, 0 = off
  std::unordered_map<SeqId, SeqState> seqs_;
  uint64_t batch_counter_ = 0;
  std::vector<BlockId> step_cached_;  // the step journal, see begin_step()
};

}  // namespace pagedkv
