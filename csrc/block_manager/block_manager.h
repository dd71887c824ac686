// Per-sequence block tables over a GPU pool (and a CPU swap pool).
//
// A sequence id maps to its block table (logical block i -> physical block)
// and its token count. The manager knows token counts only, never token ids:
// prefix-cache keys are computed in Python (pagedkv.core.prefix_cache) and
// handed in as opaque digests.
//
// Every mutating call checks everything it needs first and then changes the
// state, so a call that throws (e.g. NoFreeBlocksError) leaves it untouched.
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

struct SeqState {
  std::vector<BlockId> table;
  int64_t num_tokens = 0;
  bool swapped = false;  // table holds CPU-pool blocks
  uint64_t batch_stamp = 0;  // last append_slots_batch that saw it (duplicate check in O(1))
};

class BlockManager {
 public:
  // watermark: fraction of GPU blocks that admitting new prompts must leave
  // free, so that running sequences can still append (in [0, 1)).
  BlockManager(int32_t block_size, int32_t num_gpu_blocks, int32_t num_cpu_blocks, double watermark,
               bool enable_caching);

  // --- admission --------------------------------------------------------
  // kNever: the prompt can never fit (more blocks than the pool minus the
  // watermark); kLater: not now; kOk: go. `cached_prefix` are blocks a
  // prefix-cache lookup returned; free ones among them still cost a block.
  AllocStatus allocate_status(int64_t num_tokens, const std::vector<BlockId>& cached_prefix) const;
  // Gives `seq_id` blocks for `num_tokens` tokens, sharing `cached_prefix`
  // (ref count +1 each) as its first blocks.
  void allocate(SeqId seq_id, int64_t num_tokens, const std::vector<BlockId>& cached_prefix);

  // --- growth -----------------------------------------------------------
  // New GPU blocks that appending `num_new_tokens` would take (copy-on-write included).
  int32_t blocks_to_append(SeqId seq_id, int64_t num_new_tokens) const;
  // Whether every sequence in `seq_ids` can append `num_new_tokens` at once.
  bool can_append(const std::vector<SeqId>& seq_ids, int64_t num_new_tokens) const;
  // Reserves slots for `num_new_tokens` more tokens. If the last block is
  // partly filled and shared, it is first copied: returns that (src, dst).
  std::optional<BlockPair> append_slots(SeqId seq_id, int64_t num_new_tokens);
  // append_slots for every sequence of a decode step, all or nothing: throws
  // NoFreeBlocksError before changing anything if the blocks do not suffice.
  // Returns the copy-on-write pairs.
  std::vector<BlockPair> append_slots_batch(const std::vector<SeqId>& seq_ids, int64_t num_new_tokens);
  // `child` shares every block of `parent` (parallel sampling, beam search).
  void fork(SeqId parent, SeqId child);
  void free(SeqId seq_id);

  // --- swapping (a group of sequences at once keeps their sharing) ------
  bool can_swap_out(const std::vector<SeqId>& seq_ids) const;
  bool can_swap_in(const std::vector<SeqId>& seq_ids) const;
  // (gpu, cpu) pairs for swap_blocks, each distinct block once.
  std::vector<BlockPair> swap_out(const std::vector<SeqId>& seq_ids);
  // (cpu, gpu) pairs.
  std::vector<BlockPair> swap_in(const std::vector<SeqId>& seq_ids);

  // --- prefix cache -----------------------------------------------------
  // Blocks cached under keys[0], keys[1], ... up to the first miss, at most `max_blocks`.
  std::vector<BlockId> lookup_prefix(const std::vector<std::string>& keys, int64_t max_blocks) const;
  // Caches the full blocks first_block, first_block+1, ... of a sequence
  // under `keys`. Returns how many were newly cached (a key already present
  // elsewhere keeps its block).
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

  // --- batch metadata ---------------------------------------------------
  // For the i-th sequence: block_tables[i, :] = its table padded with
  // `pad_value`, seq_lens[i] = its token count, and slot_mapping gets the
  // slots of its last query_lens[i] tokens (query_lens null: 1 each).
  // block_tables is row-major [num_seqs, max_blocks]; returns the number of
  // slots written. Checks everything before writing anything.
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
  // Pools' invariants, and every ref count equals the number of tables holding the block.
  void check_invariants() const;

 private:
  int64_t blocks_for(int64_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }
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
  std::unordered_map<SeqId, SeqState> seqs_;
  uint64_t batch_counter_ = 0;
  std::vector<BlockId> step_cached_;  // the step journal, see begin_step()
};

}  // namespace pagedkv
