#include "block_manager/block_manager.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

#include "block_manager/errors.h"

namespace pagedkv {

namespace {
std::string seq_str(SeqId id) { return "sequence " + std::to_string(id); }

void check_positive(int64_t value, const char* op, const char* what) {
  if (value < 1) {
    throw std::invalid_argument(std::string(op) + ": " + what + " must be >= 1, got " + std::to_string(value));
  }
}
}  // namespace

BlockManager::BlockManager(int32_t block_size, int32_t num_gpu_blocks, int32_t num_cpu_blocks, double watermark,
                           bool enable_caching, int32_t sliding_window)
    : block_size_(block_size),
      gpu_(num_gpu_blocks, "gpu"),
      cpu_(num_cpu_blocks, "cpu"),
      watermark_blocks_(0),
      enable_caching_(enable_caching),
      window_(sliding_window) {
  if (sliding_window < 0) {
    throw std::invalid_argument("BlockManager: sliding_window must be >= 0 tokens (0: off), got " +
                                std::to_string(sliding_window));
  }
  if (block_size < 1) {
    throw std::invalid_argument("BlockManager: block_size must be >= 1, got " + std::to_string(block_size));
  }
  if (!(watermark >= 0.0 && watermark < 1.0)) {
    throw std::invalid_argument("BlockManager: watermark must be in [0, 1), got " + std::to_string(watermark));
  }
  watermark_blocks_ = static_cast<int32_t>(watermark * num_gpu_blocks);
}

// --- lookups ---------------------------------------------------------------

const SeqState& BlockManager::find_seq(SeqId seq_id, const char* op) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) throw UnknownSequenceError(std::string(op) + ": unknown " + seq_str(seq_id));
  return it->second;
}

const SeqState& BlockManager::running_seq(SeqId seq_id, const char* op) const {
  const SeqState& s = find_seq(seq_id, op);
  if (s.swapped) {
    throw InvalidSequenceStateError(std::string(op) + ": " + seq_str(seq_id) + " is swapped out; swap it in first");
  }
  return s;
}

SeqState& BlockManager::running_seq(SeqId seq_id, const char* op) {
  return const_cast<SeqState&>(static_cast<const BlockManager*>(this)->running_seq(seq_id, op));
}

const SeqState& BlockManager::seq(SeqId seq_id) const { return find_seq(seq_id, "seq"); }

int64_t BlockManager::num_held_blocks(SeqId seq_id) const {
  const SeqState& s = find_seq(seq_id, "num_held_blocks");
  return static_cast<int64_t>(s.table.size()) - s.num_dropped;
}

// --- sliding window ----------------------------------------------------------

int64_t BlockManager::blocks_before_window(int64_t first_query) const {
  if (window_ == 0) return 0;
  // The query at first_query reads keys from first_query - W + 1 on: block i is
  // unneeded when (i + 1) * block_size <= that first key.
  return std::max<int64_t>(0, first_query - window_ + 1) / block_size_;
}

int64_t BlockManager::freed_by_drop(const SeqState& s, int64_t first_query) const {
  int64_t freed = 0;
  for (int64_t i = s.num_dropped; i < blocks_before_window(first_query); ++i) {
    if (gpu_.ref_count(s.table[i]) == 1) ++freed;  // a shared block stays with its other holders
  }
  return freed;
}

void BlockManager::drop_before_window(SeqState& s, int64_t first_query) {
  const int64_t end = blocks_before_window(first_query);
  for (int64_t i = end - 1; i >= s.num_dropped; --i) {
    gpu_.decref(s.table[i]);
    s.table[i] = kDroppedBlock;
  }
  s.num_dropped = std::max(s.num_dropped, end);
}

std::vector<SeqId> BlockManager::seq_ids() const {
  std::vector<SeqId> ids;
  ids.reserve(seqs_.size());
  for (const auto& kv : seqs_) ids.push_back(kv.first);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// --- admission -------------------------------------------------------------

AllocStatus BlockManager::allocate_status(int64_t num_tokens, const std::vector<BlockId>& cached_prefix) const {
  check_positive(num_tokens, "allocate_status", "num_tokens");
  const int64_t prefix = static_cast<int64_t>(cached_prefix.size());
  const int64_t skip = std::min(prefix, blocks_before_window(prefix * block_size_));
  const int64_t total = blocks_for(num_tokens) - skip;
  if (total > static_cast<int64_t>(gpu_.num_blocks()) - watermark_blocks_) return AllocStatus::kNever;
  int64_t needed = total - (prefix - skip);
  for (int64_t i = skip; i < prefix; ++i) {
    if (gpu_.ref_count(cached_prefix[i]) == 0) ++needed;  // reviving an evictable block takes it off the free list
  }
  return gpu_.num_free() - needed >= watermark_blocks_ ? AllocStatus::kOk : AllocStatus::kLater;
}

void BlockManager::allocate(SeqId seq_id, int64_t num_tokens, const std::vector<BlockId>& cached_prefix) {
  check_positive(num_tokens, "allocate", "num_tokens");
  if (seqs_.count(seq_id)) throw SequenceExistsError("allocate: " + seq_str(seq_id) + " already has blocks");
  const int64_t total = blocks_for(num_tokens);
  const int64_t prefix = static_cast<int64_t>(cached_prefix.size());
  // The block holding the last prompt token is never taken from the cache:
  // that token is always recomputed, its logits are needed.
  if (prefix * block_size_ > num_tokens - 1) {
    throw std::invalid_argument("allocate: " + std::to_string(prefix) + " cached blocks cover " +
                                std::to_string(prefix * block_size_) + " tokens, but at most " +
                                std::to_string(num_tokens - 1) + " of a " + std::to_string(num_tokens) +
                                "-token prompt may come from the cache");
  }
  // Hits before the window of the first uncached token are never read: not taken.
  const int64_t skip = std::min(prefix, blocks_before_window(prefix * block_size_));
  int64_t needed = total - prefix;
  for (int64_t i = 0; i < prefix; ++i) {
    const BlockId b = cached_prefix[i];
    if (!gpu_.is_cached(b)) {
      throw BlockRefCountError("allocate: gpu block " + std::to_string(b) +
                               " is not in the prefix cache and cannot be shared");
    }
    if (i >= skip && gpu_.ref_count(b) == 0) ++needed;
  }
  if (needed > gpu_.num_free()) {
    throw NoFreeBlocksError("allocate: " + seq_str(seq_id) + " needs " + std::to_string(needed) +
                            " free gpu blocks for " + std::to_string(num_tokens) + " tokens, " +
                            std::to_string(gpu_.num_free()) + " are free");
  }
  SeqState state;
  state.num_tokens = num_tokens;
  state.num_dropped = skip;
  state.table.reserve(total);
  state.table.assign(skip, kDroppedBlock);
  // Revive the hits before allocating, so that allocation cannot evict them.
  for (int64_t i = skip; i < prefix; ++i) {
    gpu_.incref(cached_prefix[i]);
    state.table.push_back(cached_prefix[i]);
  }
  while (static_cast<int64_t>(state.table.size()) < total) state.table.push_back(gpu_.allocate());
  seqs_.emplace(seq_id, std::move(state));
}

// --- growth ----------------------------------------------------------------

int64_t BlockManager::blocks_to_append(const SeqState& s, int64_t num_new_tokens) const {
  int64_t needed = blocks_for(s.num_tokens + num_new_tokens) - static_cast<int64_t>(s.table.size());
  // The new tokens go into a partly filled last block: copy it first if shared.
  // (The last block is never dropped: it holds the latest token, inside any window.)
  if (s.num_tokens % block_size_ != 0 && gpu_.ref_count(s.table.back()) > 1) ++needed;
  // The earliest new query is at position num_tokens: what lies before its window goes first.
  return needed - freed_by_drop(s, s.num_tokens);
}

int32_t BlockManager::blocks_to_append(SeqId seq_id, int64_t num_new_tokens) const {
  check_positive(num_new_tokens, "blocks_to_append", "num_new_tokens");
  return static_cast<int32_t>(blocks_to_append(running_seq(seq_id, "blocks_to_append"), num_new_tokens));
}

bool BlockManager::can_append(const std::vector<SeqId>& seq_ids, int64_t num_new_tokens) const {
  check_positive(num_new_tokens, "can_append", "num_new_tokens");
  int64_t needed = 0;
  for (SeqId id : seq_ids) needed += blocks_to_append(running_seq(id, "can_append"), num_new_tokens);
  return needed <= gpu_.num_free();
}

std::optional<BlockPair> BlockManager::append_to(SeqState& s, int64_t num_new_tokens) {
  // Drop first: the freed blocks (uncached ones at the free list's front) serve this very append.
  drop_before_window(s, s.num_tokens);
  std::optional<BlockPair> cow;
  if (s.num_tokens % block_size_ != 0 && gpu_.ref_count(s.table.back()) > 1) {
    const BlockId src = s.table.back();
    const BlockId dst = gpu_.allocate();
    gpu_.decref(src);  // still held by the other sharers
    s.table.back() = dst;
    cow = BlockPair{src, dst};
  }
  s.num_tokens += num_new_tokens;
  while (static_cast<int64_t>(s.table.size()) < blocks_for(s.num_tokens)) s.table.push_back(gpu_.allocate());
  return cow;
}

std::optional<BlockPair> BlockManager::append_slots(SeqId seq_id, int64_t num_new_tokens) {
  check_positive(num_new_tokens, "append_slots", "num_new_tokens");
  SeqState& s = running_seq(seq_id, "append_slots");
  const int64_t needed = blocks_to_append(s, num_new_tokens);
  if (needed > gpu_.num_free()) {
    throw NoFreeBlocksError("append_slots: " + seq_str(seq_id) + " needs " + std::to_string(needed) +
                            " free gpu blocks, " + std::to_string(gpu_.num_free()) + " are free");
  }
  return append_to(s, num_new_tokens);
}

std::vector<BlockPair> BlockManager::append_slots_batch(const std::vector<SeqId>& seq_ids,
                                                        int64_t num_new_tokens) {
  check_positive(num_new_tokens, "append_slots_batch", "num_new_tokens");
  const uint64_t stamp = ++batch_counter_;
  std::vector<SeqState*> states;
  states.reserve(seq_ids.size());
  int64_t needed = 0;
  for (SeqId id : seq_ids) {
    SeqState& s = running_seq(id, "append_slots_batch");
    // A repeated id would be counted once here but appended twice below.
    if (s.batch_stamp == stamp) throw std::invalid_argument("append_slots_batch: " + seq_str(id) + " is listed twice");
    s.batch_stamp = stamp;
    // Sharers of one partial last block each count a copy: an over-estimate
    // (the last sharer writes in place), so the check errs on the safe side.
    needed += blocks_to_append(s, num_new_tokens);
    states.push_back(&s);
  }
  if (needed > gpu_.num_free()) {
    throw NoFreeBlocksError("append_slots_batch: " + std::to_string(seq_ids.size()) + " sequences need " +
                            std::to_string(needed) + " free gpu blocks, " + std::to_string(gpu_.num_free()) +
                            " are free");
  }
  // All drops first: the count above credits each sequence's freed blocks to the whole batch.
  for (SeqState* s : states) drop_before_window(*s, s->num_tokens);
  std::vector<BlockPair> cows;
  for (SeqState* s : states) {
    if (auto cow = append_to(*s, num_new_tokens)) cows.push_back(*cow);
  }
  return cows;
}

void BlockManager::fork(SeqId parent, SeqId child) {
  const SeqState& p = running_seq(parent, "fork");
  if (seqs_.count(child)) {
    throw SequenceExistsError("fork: child " + seq_str(child) + " already exists (parent " + seq_str(parent) + ")");
  }
  for (size_t i = p.num_dropped; i < p.table.size(); ++i) gpu_.incref(p.table[i]);
  SeqState copy = p;  // copy before emplace: emplace may rehash and move `p`
  seqs_.emplace(child, std::move(copy));
}

void BlockManager::free(SeqId seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) {
    throw UnknownSequenceError("free: unknown " + seq_str(seq_id) + " (never allocated, or already freed)");
  }
  BlockPool& pool = it->second.swapped ? cpu_ : gpu_;
  // Deepest block first: among blocks freed together the deepest lands
  // nearest the front of the LRU order and is evicted first; shared roots last.
  const auto& table = it->second.table;
  for (auto b = table.rbegin(); b != table.rend() && *b != kDroppedBlock; ++b) pool.decref(*b);
  seqs_.erase(it);
}

void BlockManager::truncate(SeqId seq_id, int64_t num_tokens) {
  SeqState& s = running_seq(seq_id, "truncate");
  if (num_tokens < 0 || num_tokens > s.num_tokens) {
    throw std::invalid_argument("truncate: " + seq_str(seq_id) + " has " + std::to_string(s.num_tokens) +
                                " tokens; num_tokens must be in [0, " + std::to_string(s.num_tokens) + "], got " +
                                std::to_string(num_tokens));
  }
  // The window of its next query (at num_tokens) must not reach into the released blocks.
  if (s.num_dropped > 0 && s.num_dropped * block_size_ > num_tokens - window_) {
    throw InvalidSequenceStateError("truncate: " + seq_str(seq_id) + " released its first " +
                                    std::to_string(s.num_dropped * block_size_) +
                                    " positions to the sliding window; cut to " + std::to_string(num_tokens) +
                                    " tokens its window would reach into them");
  }
  // Deepest first, as in free().
  while (static_cast<int64_t>(s.table.size()) > blocks_for(num_tokens)) {
    gpu_.decref(s.table.back());
    s.table.pop_back();
  }
  s.num_tokens = num_tokens;
}

// --- swapping --------------------------------------------------------------

int32_t BlockManager::distinct_blocks(const std::vector<SeqId>& seq_ids, bool swapped, const char* op) const {
  std::unordered_set<SeqId> seen_seqs;
  std::unordered_set<BlockId> blocks;
  for (SeqId id : seq_ids) {
    const SeqState& s = find_seq(id, op);
    if (s.swapped != swapped) {
      throw InvalidSequenceStateError(std::string(op) + ": " + seq_str(id) + (swapped ? " is not" : " is already") +
                                      " swapped out");
    }
    if (!seen_seqs.insert(id).second) {
      throw std::invalid_argument(std::string(op) + ": " + seq_str(id) + " is listed twice");
    }
    blocks.insert(s.table.begin() + s.num_dropped, s.table.end());
  }
  return static_cast<int32_t>(blocks.size());
}

bool BlockManager::can_swap_out(const std::vector<SeqId>& seq_ids) const {
  return distinct_blocks(seq_ids, false, "can_swap_out") <= cpu_.num_free();
}

bool BlockManager::can_swap_in(const std::vector<SeqId>& seq_ids) const {
  return gpu_.num_free() - distinct_blocks(seq_ids, true, "can_swap_in") >= watermark_blocks_;
}

std::vector<BlockPair> BlockManager::move_seqs(const std::vector<SeqId>& seq_ids, BlockPool& from, BlockPool& to,
                                               bool now_swapped) {
  const char* op = now_swapped ? "swap_out" : "swap_in";
  const int32_t needed = distinct_blocks(seq_ids, !now_swapped, op);
  if (needed > to.num_free()) {
    throw NoFreeBlocksError(std::string(op) + ": needs " + std::to_string(needed) + " free " + to.name() +
                            " blocks, " + std::to_string(to.num_free()) + " are free");
  }
  // A block shared inside the group is copied once and stays shared.
  std::unordered_map<BlockId, BlockId> moved;
  std::vector<BlockPair> mapping;
  mapping.reserve(needed);
  for (SeqId id : seq_ids) {
    SeqState& s = seqs_.at(id);
    const auto live = s.table.begin() + s.num_dropped;  // dropped entries stay dropped in either pool
    for (auto b = live; b != s.table.end(); ++b) {
      auto it = moved.find(*b);
      if (it == moved.end()) {
        const BlockId dst = to.allocate();
        it = moved.emplace(*b, dst).first;
        mapping.emplace_back(*b, dst);
      } else {
        to.incref(it->second);
      }
    }
    for (auto b = s.table.rbegin(); b != s.table.rend() && *b != kDroppedBlock; ++b) from.decref(*b);
    for (auto b = live; b != s.table.end(); ++b) *b = moved.at(*b);
    s.swapped = now_swapped;
  }
  return mapping;
}

std::vector<BlockPair> BlockManager::swap_out(const std::vector<SeqId>& seq_ids) {
  return move_seqs(seq_ids, gpu_, cpu_, true);
}

std::vector<BlockPair> BlockManager::swap_in(const std::vector<SeqId>& seq_ids) {
  return move_seqs(seq_ids, cpu_, gpu_, false);
}

// --- prefix cache ----------------------------------------------------------

std::vector<BlockId> BlockManager::lookup_prefix(const std::vector<std::string>& keys, int64_t max_blocks) const {
  std::vector<BlockId> hits;
  if (!enable_caching_) return hits;
  for (const auto& key : keys) {
    if (static_cast<int64_t>(hits.size()) >= max_blocks) break;
    const BlockId b = gpu_.lookup(key);
    if (b < 0) break;
    hits.push_back(b);
  }
  return hits;
}

int32_t BlockManager::cache_blocks(SeqId seq_id, int64_t first_block, const std::vector<std::string>& keys) {
  if (!enable_caching_) throw std::invalid_argument("cache_blocks: prefix caching is disabled for this manager");
  const SeqState& s = running_seq(seq_id, "cache_blocks");
  const int64_t num_full = s.num_tokens / block_size_;
  const int64_t end = first_block + static_cast<int64_t>(keys.size());
  if (first_block < 0 || end > num_full) {
    throw std::invalid_argument("cache_blocks: blocks [" + std::to_string(first_block) + ", " + std::to_string(end) +
                                ") of " + seq_str(seq_id) + " are not all full; it has " +
                                std::to_string(num_full) + " full blocks (partial blocks are never cached)");
  }
  int32_t added = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const BlockId b = s.table[first_block + i];
    if (b == kDroppedBlock) continue;  // released by the window: nothing held to offer
    if (gpu_.cache_block(b, keys[i])) {
      step_cached_.push_back(b);
      ++added;
    }
  }
  return added;
}

void BlockManager::reset_prefix_cache() {
  gpu_.clear_cache();
  step_cached_.clear();
}

std::vector<std::pair<BlockId, std::string>> BlockManager::step_cached_entries() const {
  std::vector<std::pair<BlockId, std::string>> out;
  out.reserve(step_cached_.size());
  for (BlockId b : step_cached_) {
    const std::string& key = gpu_.key(b);
    if (!key.empty()) out.emplace_back(b, key);
  }
  return out;
}

int32_t BlockManager::uncache_step_blocks() {
  int32_t dropped = 0;
  for (BlockId b : step_cached_) dropped += gpu_.uncache(b) ? 1 : 0;
  step_cached_.clear();
  return dropped;
}

// --- batch metadata --------------------------------------------------------

int64_t BlockManager::fill_metadata(const SeqId* seq_ids, int64_t num_seqs, const int64_t* query_lens,
                                    int32_t* block_tables, int64_t max_blocks, int64_t* slot_mapping,
                                    int64_t slot_capacity, int32_t* seq_lens, int32_t pad_value) const {
  // Pass 1: validate, remember the states (one hash lookup per sequence).
  std::vector<const SeqState*> states(num_seqs);
  int64_t num_slots = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const SeqState& s = running_seq(seq_ids[i], "fill_metadata");
    const int64_t q = query_lens ? query_lens[i] : 1;
    // Queries must sit in live blocks: the slots of dropped ones are gone.
    const int64_t max_q = s.num_tokens - s.num_dropped * block_size_;
    if (q < 0 || q > max_q) {
      throw std::invalid_argument("fill_metadata: query_lens[" + std::to_string(i) + "] = " + std::to_string(q) +
                                  " must be in [0, " + std::to_string(max_q) + "] for " + seq_str(seq_ids[i]) +
                                  (s.num_dropped ? " (its first " + std::to_string(s.num_dropped) +
                                                       " blocks are dropped by the sliding window)"
                                                 : std::string()));
    }
    if (static_cast<int64_t>(s.table.size()) > max_blocks) {
      throw std::invalid_argument("fill_metadata: " + seq_str(seq_ids[i]) + " has " +
                                  std::to_string(s.table.size()) + " blocks, block_tables has room for " +
                                  std::to_string(max_blocks));
    }
    if (s.num_tokens > INT32_MAX) throw std::invalid_argument("fill_metadata: seq_lens overflow int32");
    states[i] = &s;
    num_slots += q;
  }
  if (num_slots > slot_capacity) {
    throw std::invalid_argument("fill_metadata: " + std::to_string(num_slots) + " slots to write, slot_mapping holds " +
                                std::to_string(slot_capacity));
  }
  // Pass 2: write.
  int64_t* slot = slot_mapping;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const SeqState& s = *states[i];
    int32_t* row = block_tables + i * max_blocks;
    const size_t n = s.table.size();
    std::copy(s.table.begin(), s.table.end(), row);
    std::fill(row + n, row + max_blocks, pad_value);
    seq_lens[i] = static_cast<int32_t>(s.num_tokens);
    const int64_t q = query_lens ? query_lens[i] : 1;
    for (int64_t pos = s.num_tokens - q; pos < s.num_tokens; ++pos) {
      *slot++ = static_cast<int64_t>(s.table[pos / block_size_]) * block_size_ + pos % block_size_;
    }
  }
  return num_slots;
}

// --- invariants --------------------------------------------------------------

void BlockManager::check_dropped(SeqId id, const SeqState& s) const {
  if (s.num_dropped < 0 || s.num_dropped > static_cast<int64_t>(s.table.size())) {
    throw std::logic_error(seq_str(id) + " has " + std::to_string(s.num_dropped) + " dropped blocks of " +
                           std::to_string(s.table.size()));
  }
  // Dropping needs a window, and never reaches the last W tokens (the latest query's window).
  if (s.num_dropped > 0 && (window_ == 0 || s.num_dropped * block_size_ > s.num_tokens - window_)) {
    throw std::logic_error(seq_str(id) + " dropped " + std::to_string(s.num_dropped) + " blocks of a " +
                           std::to_string(s.num_tokens) + "-token sequence with sliding window " +
                           std::to_string(window_));
  }
  for (size_t i = 0; i < s.table.size(); ++i) {
    const bool dropped = static_cast<int64_t>(i) < s.num_dropped;
    if ((s.table[i] == kDroppedBlock) != dropped) {
      throw std::logic_error(seq_str(id) + " table entry " + std::to_string(i) + " is " + std::to_string(s.table[i]) +
                             (dropped ? ", expected the dropped marker" : ", a dropped marker past the live start"));
    }
  }
}

void BlockManager::check_invariants() const {
  gpu_.check_invariants();
  cpu_.check_invariants();
  std::vector<int32_t> gpu_refs(gpu_.num_blocks(), 0), cpu_refs(cpu_.num_blocks(), 0);
  for (const auto& [id, s] : seqs_) {
    if (static_cast<int64_t>(s.table.size()) != blocks_for(s.num_tokens)) {
      throw std::logic_error(seq_str(id) + " has " + std::to_string(s.table.size()) + " blocks for " +
                             std::to_string(s.num_tokens) + " tokens");
    }
    check_dropped(id, s);
    for (size_t i = s.num_dropped; i < s.table.size(); ++i) ++(s.swapped ? cpu_refs : gpu_refs)[s.table[i]];
  }
  for (BlockId b = 0; b < gpu_.num_blocks(); ++b) {
    if (gpu_refs[b] != gpu_.ref_count(b)) {
      throw std::logic_error("gpu block " + std::to_string(b) + " has ref count " + std::to_string(gpu_.ref_count(b)) +
                             " but " + std::to_string(gpu_refs[b]) + " block tables hold it");
    }
  }
  for (BlockId b = 0; b < cpu_.num_blocks(); ++b) {
    if (cpu_refs[b] != cpu_.ref_count(b)) {
      throw std::logic_error("cpu block " + std::to_string(b) + " has ref count " + std::to_string(cpu_.ref_count(b)) +
                             " but " + std::to_string(cpu_refs[b]) + " block tables hold it");
    }
  }
}

}  // namespace pagedkv
