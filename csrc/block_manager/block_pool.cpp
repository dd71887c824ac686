#include "block_manager/block_pool.h"

#include <stdexcept>

#include "block_manager/errors.h"

namespace pagedkv {

namespace {
std::string block_str(const std::string& pool, BlockId block) {
  return pool + " block " + std::to_string(block);
}
}  // namespace

BlockPool::BlockPool(int32_t num_blocks, std::string name)
    : name_(std::move(name)) {
  if (num_blocks < 0) {
    throw std::invalid_argument("BlockPool: num_blocks must be >= 0, got " + std::to_string(num_blocks));
  }
  ref_count_.assign(num_blocks, 0);
  in_free_list_.assign(num_blocks, 0);
  key_.assign(num_blocks, std::string());
  prev_.assign(num_blocks + 1, num_blocks);
  next_.assign(num_blocks + 1, num_blocks);
  for (BlockId b = 0; b < num_blocks; ++b) push_back(b);
}

void BlockPool::check_block(BlockId block, const char* op) const {
  if (block < 0 || block >= num_blocks()) {
    throw std::invalid_argument(std::string(op) + ": " + name_ + " block id " + std::to_string(block) +
                                " out of range [0, " + std::to_string(num_blocks()) + ")");
  }
}

void BlockPool::push_front(BlockId block) {
  const BlockId head = num_blocks();
  const BlockId first = next_[head];
  prev_[block] = head;
  next_[block] = first;
  prev_[first] = block;
  next_[head] = block;
  in_free_list_[block] = 1;
  ++num_free_;
}

void BlockPool::push_back(BlockId block) {
  const BlockId head = num_blocks();
  const BlockId last = prev_[head];
  next_[block] = head;
  prev_[block] = last;
  next_[last] = block;
  prev_[head] = block;
  in_free_list_[block] = 1;
  ++num_free_;
}

void BlockPool::unlink(BlockId block) {
  next_[prev_[block]] = next_[block];
  prev_[next_[block]] = prev_[block];
  in_free_list_[block] = 0;
  --num_free_;
}

void BlockPool::evict(BlockId block) {
  index_.erase(key_[block]);
  if (record_evictions_) {
    evicted_.emplace_back(block, std::move(key_[block]));
  }
  key_[block].clear();
  ++num_evictions_;
}

const std::string& BlockPool::key(BlockId block) const {
  check_block(block, "key");
  return key_[block];
}

void BlockPool::set_record_evictions(bool on) {
  record_evictions_ = on;
  if (!on) evicted_.clear();
}

void BlockPool::snapshot(int32_t* ref_counts, uint8_t* cached, uint64_t* key_prefix) const {
  for (BlockId b = 0; b < num_blocks(); ++b) {
    ref_counts[b] = ref_count_[b];
    const std::string& key = key_[b];
    cached[b] = key.empty() ? 0 : 1;
    uint64_t prefix = 0;
    for (size_t i = 0; i < key.size() && i < 8; ++i) {
      prefix |= static_cast<uint64_t>(static_cast<uint8_t>(key[i])) << (8 * i);
    }
    key_prefix[b] = prefix;
  }
}

std::vector<std::pair<BlockId, std::string>> BlockPool::take_evictions() {
  std::vector<std::pair<BlockId, std::string>> out;
  out.swap(evicted_);
  return out;
}

BlockId BlockPool::allocate() {
  const BlockId head = num_blocks();
  const BlockId block = next_[head];
  if (block == head) {
    throw NoFreeBlocksError("out of " + name_ + " blocks: all " + std::to_string(num_blocks()) + " are in use");
  }
  unlink(block);
  if (!key_[block].empty()) {
    --num_evictable_;
    evict(block);
  }
  ref_count_[block] = 1;
  return block;
}

void BlockPool::incref(BlockId block) {
  check_block(block, "incref");
  if (ref_count_[block] == 0) {
    if (key_[block].empty()) {
      throw BlockRefCountError("cannot share free " + block_str(name_, block) +
                               ": it is not cached, its contents are gone");
    }
    unlink(block);
    --num_evictable_;
  }
  ++ref_count_[block];
}

int32_t BlockPool::decref(BlockId block) {
  check_block(block, "decref");
  if (ref_count_[block] == 0) {
    throw BlockRefCountError("double free of " + block_str(name_, block) + ": it is already free");
  }
  if (--ref_count_[block] == 0) {
    if (key_[block].empty()) {
      push_front(block);
    } else {
      push_back(block);
      ++num_evictable_;
    }
  }
  return ref_count_[block];
}

void BlockPool::free(BlockId block) {
  check_block(block, "free");
  if (ref_count_[block] > 1) {
    throw BlockRefCountError("cannot free " + block_str(name_, block) + ": it is still referenced by " +
                             std::to_string(ref_count_[block]) + " holders (decref it instead)");
  }
  decref(block);
}

bool BlockPool::cache_block(BlockId block, const std::string& key) {
  check_block(block, "cache_block");
  if (key.empty()) throw std::invalid_argument("cache_block: the cache key must not be empty");
  if (ref_count_[block] == 0) {
    throw BlockRefCountError("cannot cache free " + block_str(name_, block) + ": allocate it first");
  }
  if (!key_[block].empty() || index_.count(key)) return false;
  index_.emplace(key, block);
  key_[block] = key;
  return true;
}

bool BlockPool::uncache(BlockId block) {
  check_block(block, "uncache");
  if (key_[block].empty()) return false;
  index_.erase(key_[block]);
  key_[block].clear();
  if (ref_count_[block] == 0) {
    // Evictable until now: it joins the uncached blocks at the front.
    unlink(block);
    push_front(block);
    --num_evictable_;
  }
  return true;
}

BlockId BlockPool::lookup(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? -1 : it->second;
}

bool BlockPool::is_cached(BlockId block) const {
  check_block(block, "is_cached");
  return !key_[block].empty();
}

void BlockPool::clear_cache() {
  // Free cached blocks keep their place in the list; they are simply no
  // longer worth keeping, which only matters for the eviction count.
  for (auto& key : key_) key.clear();
  index_.clear();
  num_evictable_ = 0;
}

int32_t BlockPool::ref_count(BlockId block) const {
  check_block(block, "ref_count");
  return ref_count_[block];
}

bool BlockPool::is_free(BlockId block) const {
  check_block(block, "is_free");
  return in_free_list_[block] != 0;
}

std::vector<BlockId> BlockPool::free_list() const {
  std::vector<BlockId> out;
  out.reserve(num_free_);
  for (BlockId b = next_[num_blocks()]; b != num_blocks(); b = next_[b]) out.push_back(b);
  return out;
}

void BlockPool::check_invariants() const {
  auto fail = [this](const std::string& what) { throw std::logic_error(name_ + " pool invariant broken: " + what); };
  const BlockId head = num_blocks();
  int32_t walked = 0, evictable = 0;
  BlockId prev = head;
  for (BlockId b = next_[head]; b != head; prev = b, b = next_[b]) {
    if (b < 0 || b > head) fail("free list link out of range");
    if (prev_[b] != prev) fail("prev link of block " + std::to_string(b));
    if (!in_free_list_[b]) fail("block " + std::to_string(b) + " in list but not flagged free");
    if (ref_count_[b] != 0) fail("free block " + std::to_string(b) + " has ref count " + std::to_string(ref_count_[b]));
    if (++walked > num_blocks()) fail("cycle in free list");
    if (!key_[b].empty()) ++evictable;
  }
  if (walked != num_free_) {
    fail("free count " + std::to_string(num_free_) + " != list length " + std::to_string(walked));
  }
  if (evictable != num_evictable_) fail("evictable count mismatch");
  int32_t flagged = 0;
  for (BlockId b = 0; b < num_blocks(); ++b) {
    if (in_free_list_[b]) ++flagged;
    else if (ref_count_[b] <= 0) fail("block " + std::to_string(b) + " is neither free nor referenced");
    if (!key_[b].empty()) {
      auto it = index_.find(key_[b]);
      if (it == index_.end() || it->second != b) fail("cache index misses block " + std::to_string(b));
    }
  }
  if (flagged != num_free_) fail("free flags disagree with free count");
  for (const auto& [key, b] : index_) {
    if (key_[b] != key) fail("cache index points at block " + std::to_string(b) + " with another key");
  }
}

}  // namespace pagedkv
