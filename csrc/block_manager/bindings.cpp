// pybind11 module pagedkv._block_manager: BlockPool, BlockManager, AllocStatus
// and the exception classes. The typed Python API is pagedkv.core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>

#include "block_manager/block_manager.h"
#include "block_manager/errors.h"
#include "block_manager/ngram.h"

namespace py = pybind11;
using namespace pagedkv;

namespace {

// An output buffer must be written in place: a converted copy would silently
// drop the results, so no conversion is allowed (unlike inputs).
template <typename T>
T* out_buffer(py::array& arr, const char* name, int ndim) {
  if (!arr.dtype().equal(py::dtype::of<T>())) {
    throw std::invalid_argument(std::string("fill_metadata: ") + name + " must have dtype " +
                                std::string(py::str(py::dtype::of<T>())) + ", got " +
                                std::string(py::str(arr.dtype())));
  }
  if (arr.ndim() != ndim) {
    throw std::invalid_argument(std::string("fill_metadata: ") + name + " must be " + std::to_string(ndim) +
                                "-D, got " + std::to_string(arr.ndim()) + "-D");
  }
  if (!(arr.flags() & py::array::c_style)) {
    throw std::invalid_argument(std::string("fill_metadata: ") + name + " must be C-contiguous");
  }
  if (!arr.writeable()) throw std::invalid_argument(std::string("fill_metadata: ") + name + " is read-only");
  return static_cast<T*>(arr.mutable_data());
}

using IdArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

int64_t fill_metadata(const BlockManager& bm, const IdArray& seq_ids, const std::optional<IdArray>& query_lens,
                      py::array block_tables, py::array slot_mapping, py::array seq_lens, int32_t pad_value) {
  const int64_t n = seq_ids.size();
  if (seq_ids.ndim() != 1) throw std::invalid_argument("fill_metadata: seq_ids must be 1-D");
  if (query_lens && (query_lens->ndim() != 1 || query_lens->size() != n)) {
    throw std::invalid_argument("fill_metadata: query_lens must be 1-D with " + std::to_string(n) +
                                " entries, got " + std::to_string(query_lens->size()));
  }
  auto* bt = out_buffer<int32_t>(block_tables, "block_tables", 2);
  auto* sm = out_buffer<int64_t>(slot_mapping, "slot_mapping", 1);
  auto* sl = out_buffer<int32_t>(seq_lens, "seq_lens", 1);
  if (block_tables.shape(0) < n || seq_lens.shape(0) < n) {
    throw std::invalid_argument("fill_metadata: block_tables has " + std::to_string(block_tables.shape(0)) +
                                " rows and seq_lens " + std::to_string(seq_lens.shape(0)) + " entries, need " +
                                std::to_string(n));
  }
  // The GIL stays held: the fill takes microseconds, and releasing it would
  // let another thread mutate the manager while we read it.
  return bm.fill_metadata(seq_ids.data(), n, query_lens ? query_lens->data() : nullptr, bt, block_tables.shape(1),
                          sm, slot_mapping.shape(0), sl, pad_value);
}

std::vector<std::string> keys_of(const std::vector<py::bytes>& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.emplace_back(k);
  return out;
}

// (block, key) pairs as Python (int, bytes) tuples: keys are digests, not text.
py::list keyed_blocks(const std::vector<std::pair<BlockId, std::string>>& entries) {
  py::list out;
  for (const auto& [block, key] : entries) out.append(py::make_tuple(block, py::bytes(key)));
  return out;
}

// The pool view of BlockPool::snapshot plus every sequence's table (CSR:
// table_offsets[i]..[i+1] index table_blocks) as numpy arrays.
py::dict manager_snapshot(const BlockManager& bm) {
  const BlockPool& pool = bm.gpu_pool();
  const int64_t n = pool.num_blocks();
  py::array_t<int32_t> ref_counts(n);
  py::array_t<uint8_t> cached(n);
  py::array_t<uint64_t> key_prefix(n);
  pool.snapshot(ref_counts.mutable_data(), cached.mutable_data(), key_prefix.mutable_data());
  const std::vector<SeqId> ids = bm.seq_ids();
  int64_t total = 0;
  for (SeqId id : ids) total += static_cast<int64_t>(bm.seq(id).table.size());
  py::array_t<int64_t> seq_ids(static_cast<int64_t>(ids.size()));
  py::array_t<int64_t> num_tokens(static_cast<int64_t>(ids.size()));
  py::array_t<uint8_t> swapped(static_cast<int64_t>(ids.size()));
  py::array_t<int64_t> offsets(static_cast<int64_t>(ids.size()) + 1);
  py::array_t<int32_t> blocks(total);
  int64_t* off = offsets.mutable_data();
  int32_t* out = blocks.mutable_data();
  off[0] = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const SeqState& s = bm.seq(ids[i]);
    seq_ids.mutable_data()[i] = ids[i];
    num_tokens.mutable_data()[i] = s.num_tokens;
    swapped.mutable_data()[i] = s.swapped ? 1 : 0;
    std::copy(s.table.begin(), s.table.end(), out + off[i]);
    off[i + 1] = off[i] + static_cast<int64_t>(s.table.size());
  }
  py::dict d;
  d["ref_counts"] = ref_counts;
  d["cached"] = cached;
  d["key_prefix"] = key_prefix;
  d["seq_ids"] = seq_ids;
  d["num_tokens"] = num_tokens;
  d["swapped"] = swapped;
  d["table_offsets"] = offsets;
  d["table_blocks"] = blocks;
  return d;
}

}  // namespace

PYBIND11_MODULE(_block_manager, m) {
  m.doc() = "pagedkv C++ block manager (use pagedkv.core for the typed API)";

  // Python classes: every error is a BlockManagerError; misuse errors are
  // also KeyError / ValueError so generic handlers keep working.
  // The class objects are leaked on purpose: a static py::object would be
  // destroyed after the interpreter is gone.
  static auto* base = new py::exception<BlockManagerError>(m, "BlockManagerError", PyExc_Exception);
  static auto* no_free = new py::exception<NoFreeBlocksError>(m, "NoFreeBlocksError", *base);
  auto also = [](PyObject* builtin) { return py::make_tuple(*base, py::handle(builtin)); };
  static auto* unknown = new py::exception<UnknownSequenceError>(m, "UnknownSequenceError", also(PyExc_KeyError));
  static auto* exists = new py::exception<SequenceExistsError>(m, "SequenceExistsError", also(PyExc_ValueError));
  static auto* refcount = new py::exception<BlockRefCountError>(m, "BlockRefCountError", also(PyExc_ValueError));
  static auto* state =
      new py::exception<InvalidSequenceStateError>(m, "InvalidSequenceStateError", also(PyExc_ValueError));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const NoFreeBlocksError& e) {
      py::set_error(*no_free, e.what());
    } catch (const UnknownSequenceError& e) {
      py::set_error(*unknown, e.what());
    } catch (const SequenceExistsError& e) {
      py::set_error(*exists, e.what());
    } catch (const BlockRefCountError& e) {
      py::set_error(*refcount, e.what());
    } catch (const InvalidSequenceStateError& e) {
      py::set_error(*state, e.what());
    } catch (const BlockManagerError& e) {
      py::set_error(*base, e.what());
    }
  });

  m.attr("DROPPED_BLOCK") = kDroppedBlock;

  py::enum_<AllocStatus>(m, "AllocStatus", "Answer of allocate_status: OK now, LATER, or NEVER (too long).")
      .value("OK", AllocStatus::kOk)
      .value("LATER", AllocStatus::kLater)
      .value("NEVER", AllocStatus::kNever);

  py::class_<BlockPool>(m, "BlockPool", "Fixed pool of physical blocks with ref counts and an O(1) free list.")
      .def(py::init<int32_t, std::string>(), py::arg("num_blocks"), py::arg("name") = "gpu")
      .def("allocate", &BlockPool::allocate)
      .def("incref", &BlockPool::incref, py::arg("block"))
      .def("decref", &BlockPool::decref, py::arg("block"))
      .def("free", &BlockPool::free, py::arg("block"))
      .def("cache_block", [](BlockPool& p, int32_t b, const py::bytes& key) { return p.cache_block(b, key); },
           py::arg("block"), py::arg("key"))
      .def("lookup", [](const BlockPool& p, const py::bytes& key) { return p.lookup(key); }, py::arg("key"))
      .def("uncache", &BlockPool::uncache, py::arg("block"))
      .def("is_cached", &BlockPool::is_cached, py::arg("block"))
      .def("clear_cache", &BlockPool::clear_cache)
      .def("ref_count", &BlockPool::ref_count, py::arg("block"))
      .def("is_free", &BlockPool::is_free, py::arg("block"))
      .def("free_list", &BlockPool::free_list)
      .def("check_invariants", &BlockPool::check_invariants)
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_free", &BlockPool::num_free)
      .def_property_readonly("num_used", &BlockPool::num_used)
      .def_property_readonly("num_evictable", &BlockPool::num_evictable)
      .def_property_readonly("num_cached", &BlockPool::num_cached)
      .def("key", [](const BlockPool& p, int32_t b) { return py::bytes(p.key(b)); }, py::arg("block"))
      .def("set_record_evictions", &BlockPool::set_record_evictions, py::arg("on"))
      .def("take_evictions", [](BlockPool& p) { return keyed_blocks(p.take_evictions()); })
      .def_property_readonly("num_evictions", &BlockPool::num_evictions)
      .def_property_readonly("name", &BlockPool::name);

  py::class_<BlockManager>(m, "BlockManager", "Block tables over a GPU pool and a CPU swap pool.")
      .def(py::init<int32_t, int32_t, int32_t, double, bool, int32_t>(), py::arg("block_size"),
           py::arg("num_gpu_blocks"), py::arg("num_cpu_blocks"), py::arg("watermark"), py::arg("enable_caching"),
           py::arg("sliding_window") = 0)
      .def("allocate_status", &BlockManager::allocate_status, py::arg("num_tokens"), py::arg("cached_prefix"))
      .def("allocate", &BlockManager::allocate, py::arg("seq_id"), py::arg("num_tokens"), py::arg("cached_prefix"))
      .def("blocks_to_append", py::overload_cast<SeqId, int64_t>(&BlockManager::blocks_to_append, py::const_),
           py::arg("seq_id"), py::arg("num_new_tokens"))
      .def("can_append", &BlockManager::can_append, py::arg("seq_ids"), py::arg("num_new_tokens"))
      .def("append_slots", &BlockManager::append_slots, py::arg("seq_id"), py::arg("num_new_tokens"))
      .def("append_slots_batch", &BlockManager::append_slots_batch, py::arg("seq_ids"), py::arg("num_new_tokens"))
      .def("fork", &BlockManager::fork, py::arg("parent"), py::arg("child"))
      .def("free", &BlockManager::free, py::arg("seq_id"))
      .def("truncate", &BlockManager::truncate, py::arg("seq_id"), py::arg("num_tokens"))
      .def("can_swap_out", &BlockManager::can_swap_out, py::arg("seq_ids"))
      .def("can_swap_in", &BlockManager::can_swap_in, py::arg("seq_ids"))
      .def("swap_out", &BlockManager::swap_out, py::arg("seq_ids"))
      .def("swap_in", &BlockManager::swap_in, py::arg("seq_ids"))
      .def("lookup_prefix",
           [](const BlockManager& bm, const std::vector<py::bytes>& keys, int64_t max_blocks) {
             return bm.lookup_prefix(keys_of(keys), max_blocks);
           },
           py::arg("keys"), py::arg("max_blocks"))
      .def("cache_blocks",
           [](BlockManager& bm, int64_t seq_id, int64_t first_block, const std::vector<py::bytes>& keys) {
             return bm.cache_blocks(seq_id, first_block, keys_of(keys));
           },
           py::arg("seq_id"), py::arg("first_block"), py::arg("keys"))
      .def("reset_prefix_cache", &BlockManager::reset_prefix_cache)
      .def("begin_step", &BlockManager::begin_step)
      .def("uncache_step_blocks", &BlockManager::uncache_step_blocks)
      .def("step_cached_blocks", &BlockManager::step_cached_blocks)
      .def("step_cached_entries", [](const BlockManager& bm) { return keyed_blocks(bm.step_cached_entries()); })
      .def("set_record_evictions", &BlockManager::set_record_evictions, py::arg("on"))
      .def("take_evicted", [](BlockManager& bm) { return keyed_blocks(bm.take_evicted()); })
      .def("fill_metadata", &fill_metadata, py::arg("seq_ids"), py::arg("query_lens"), py::arg("block_tables"),
           py::arg("slot_mapping"), py::arg("seq_lens"), py::arg("pad_value") = 0)
      .def("block_table", [](const BlockManager& bm, int64_t id) { return bm.seq(id).table; }, py::arg("seq_id"))
      .def("num_tokens", [](const BlockManager& bm, int64_t id) { return bm.seq(id).num_tokens; }, py::arg("seq_id"))
      .def("is_swapped", [](const BlockManager& bm, int64_t id) { return bm.seq(id).swapped; }, py::arg("seq_id"))
      .def("num_held_blocks", &BlockManager::num_held_blocks, py::arg("seq_id"))
      .def("num_dropped_blocks", [](const BlockManager& bm, int64_t id) { return bm.seq(id).num_dropped; },
           py::arg("seq_id"))
      .def("has_seq", &BlockManager::has_seq, py::arg("seq_id"))
      .def("seq_ids", &BlockManager::seq_ids)
      .def("gpu_ref_count", [](const BlockManager& bm, int32_t b) { return bm.gpu_pool().ref_count(b); })
      .def("cpu_ref_count", [](const BlockManager& bm, int32_t b) { return bm.cpu_pool().ref_count(b); })
      .def("gpu_is_cached", [](const BlockManager& bm, int32_t b) { return bm.gpu_pool().is_cached(b); })
      .def("gpu_free_list", [](const BlockManager& bm) { return bm.gpu_pool().free_list(); })
      .def("cpu_free_list", [](const BlockManager& bm) { return bm.cpu_pool().free_list(); })
      .def("snapshot", &manager_snapshot,
           "Every GPU block's ref count, cached flag and key prefix, and every sequence's table, as numpy arrays")
      .def("check_invariants", &BlockManager::check_invariants)
      .def_property_readonly("block_size", &BlockManager::block_size)
      .def_property_readonly("watermark_blocks", &BlockManager::watermark_blocks)
      .def_property_readonly("enable_caching", &BlockManager::enable_caching)
      .def_property_readonly("sliding_window", &BlockManager::sliding_window)
      .def_property_readonly("num_gpu_blocks", [](const BlockManager& bm) { return bm.gpu_pool().num_blocks(); })
      .def_property_readonly("num_cpu_blocks", [](const BlockManager& bm) { return bm.cpu_pool().num_blocks(); })
      .def_property_readonly("num_free_gpu_blocks", [](const BlockManager& bm) { return bm.gpu_pool().num_free(); })
      .def_property_readonly("num_free_cpu_blocks", [](const BlockManager& bm) { return bm.cpu_pool().num_free(); })
      .def_property_readonly("num_evictable_gpu_blocks",
                             [](const BlockManager& bm) { return bm.gpu_pool().num_evictable(); })
      .def_property_readonly("num_cached_blocks", [](const BlockManager& bm) { return bm.gpu_pool().num_cached(); })
      .def_property_readonly("num_evictions", [](const BlockManager& bm) { return bm.gpu_pool().num_evictions(); });

  // Speculative decoding: n-gram (prompt lookup) drafts, see ngram.h.
  m.def(
      "propose_ngram",
      [](const IdArray& tokens, int64_t min_n, int64_t max_n, int64_t k, int64_t max_len) {
        if (tokens.ndim() != 1) {
          throw std::invalid_argument("propose_ngram: tokens must be 1-D, got " + std::to_string(tokens.ndim()) +
                                      "-D");
        }
        return propose_ngram(tokens.data(), tokens.size(), min_n, max_n, k, max_len);
      },
      py::arg("tokens"), py::arg("min_n"), py::arg("max_n"), py::arg("k"), py::arg("max_len"),
      "Up to k draft tokens: those after the earliest earlier occurrence of the longest suffix n-gram "
      "(min_n <= n <= max_n), stopping before max_len tokens in all");
}
