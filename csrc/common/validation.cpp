#include "common/validation.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>

#include "common/supported.h"

namespace pagedkv {
namespace {

template <size_t N>
std::string join(const std::array<int64_t, N>& set) {
  std::ostringstream s;
  for (size_t i = 0; i < N; ++i) s << (i ? ", " : "") << set[i];
  return s.str();
}

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_int_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                      int64_t dim) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is required");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but key_cache is on ",
              ref.device(), "; all inputs must be on one device");
}

// The attention kernels require the last dim of query/out to be dense and the
// head dim to be the next one; any leading stride is allowed.
void check_token_head_layout(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.stride(2) == 1, op, ": ", name, " must have a contiguous last dim, got strides ", t.strides());
  TORCH_CHECK(t.stride(1) == t.size(2), op, ": ", name, " must have dense [num_heads, head_size] rows, got strides ",
              t.strides());
}

// Reads int32 values on the CPU, or copies them once from the device.
at::Tensor host_copy(const at::Tensor& t) { return t.is_cpu() ? t : t.to(at::kCPU); }

}  // namespace

namespace {
// Initial value from the environment, then whatever set_index_checks() stored. Atomic:
// ops may be called from several threads (e.g. a server thread and a warm-up thread).
std::atomic<bool>& index_checks_flag() {
  static std::atomic<bool> enabled{[] {
    const char* v = std::getenv("PAGEDKV_SKIP_INDEX_CHECKS");
    return !(v && std::string(v) == "1");
  }()};
  return enabled;
}
}  // namespace

bool index_checks_enabled() { return index_checks_flag().load(std::memory_order_relaxed); }

bool set_index_checks(bool enabled) { return index_checks_flag().exchange(enabled); }

namespace {
// The element dtype a quantized format stores.
at::ScalarType stored_dtype(KVCacheDType f) {
  switch (f) {
    case KVCacheDType::kFp8E4M3:
      return at::kFloat8_e4m3fn;
    case KVCacheDType::kFp8E5M2:
      return at::kFloat8_e5m2;
    default:
      return at::kByte;
  }
}

const char* format_name(KVCacheDType f) {
  switch (f) {
    case KVCacheDType::kAuto:
      return "auto";
    case KVCacheDType::kFp8E4M3:
      return "fp8_e4m3";
    case KVCacheDType::kFp8E5M2:
      return "fp8_e5m2";
    case KVCacheDType::kInt8PerTokenHead:
      return "int8_per_token_head";
    case KVCacheDType::kInt4PerTokenHead:
      return "int4_per_token_head";
  }
  return "?";
}

// A tensor the kernels compute in (query, out, new key/value tokens): the cache's own dtype
// when it is unquantized, else any supported compute dtype.
void check_compute_dtype(const char* op, const char* name, const at::Tensor& t, const at::Tensor& key_cache,
                         KVCacheDType format) {
  if (format == KVCacheDType::kAuto) {
    TORCH_CHECK(t.scalar_type() == key_cache.scalar_type(), op, ": ", name, " dtype ", t.scalar_type(),
                std::string(name) == "query" ? " differs from key_cache dtype " : " differs from the cache dtype ",
                key_cache.scalar_type());
    return;
  }
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), op, ": ", name, " dtype ", t.scalar_type(),
              " is not supported with kv_cache_dtype ", format_name(format), "; supported: ", kSupportedDtypes);
}
}  // namespace

KVCacheDType parse_kv_cache_dtype(const char* op, c10::string_view name) {
  if (name == "auto") return KVCacheDType::kAuto;
  if (name == "fp8" || name == "fp8_e4m3") return KVCacheDType::kFp8E4M3;
  if (name == "fp8_e5m2") return KVCacheDType::kFp8E5M2;
  if (name == "int8_per_token_head") return KVCacheDType::kInt8PerTokenHead;
  if (name == "int4_per_token_head") return KVCacheDType::kInt4PerTokenHead;
  TORCH_CHECK(false, op, ": kv_cache_dtype '", std::string(name), "' is not supported; supported: ",
              kSupportedKVCacheDtypes);
}

CacheDims check_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache, const char* op,
                         KVCacheDType format) {
  TORCH_CHECK(key_cache.defined() && value_cache.defined(), op, ": key_cache and value_cache are required");
  TORCH_CHECK(key_cache.dim() == 4, op,
              ": key_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_size], got shape ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), op, ": value_cache shape ", value_cache.sizes(),
              " differs from key_cache shape ", key_cache.sizes());
  if (format == KVCacheDType::kAuto) {
    TORCH_CHECK(is_supported_dtype(key_cache.scalar_type()), op, ": key_cache dtype ", key_cache.scalar_type(),
                " is not supported; supported: ", kSupportedDtypes,
                " (a quantized cache needs its kv_cache_dtype, one of ", kSupportedKVCacheDtypes, ")");
  } else {
    TORCH_CHECK(key_cache.scalar_type() == stored_dtype(format), op, ": kv_cache_dtype ", format_name(format),
                " stores ", stored_dtype(format), " but key_cache is ", key_cache.scalar_type());
  }
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), op, ": value_cache dtype ",
              value_cache.scalar_type(), " differs from key_cache dtype ", key_cache.scalar_type());
  check_same_device(op, "value_cache", value_cache, key_cache);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
              ": key_cache and value_cache must be contiguous");
  CacheDims d{key_cache.size(0), key_cache.size(1), key_cache.size(2), key_cache.size(3) * values_per_element(format),
              format};
  TORCH_CHECK(is_one_of(d.block_size, kSupportedBlockSizes), op, ": block_size ", d.block_size,
              " is not supported; supported block sizes: ", join(kSupportedBlockSizes));
  TORCH_CHECK(is_one_of(d.head_size, kSupportedHeadSizes), op, ": head_size ", d.head_size,
              format == KVCacheDType::kInt4PerTokenHead ? " (twice the int4 cache's last dim)" : "",
              " is not supported; supported head sizes: ", join(kSupportedHeadSizes));
  TORCH_CHECK(d.num_kv_heads > 0, op, ": num_kv_heads must be positive, got ", d.num_kv_heads);
  return d;
}

namespace {
at::Tensor check_scale(const char* op, const char* name, const std::optional<at::Tensor>& scale,
                       const at::Tensor& key_cache, const CacheDims& c) {
  const bool given = scale.has_value() && scale->defined();
  if (c.format == KVCacheDType::kAuto) {
    TORCH_CHECK(!given, op, ": ", name, " is given but kv_cache_dtype is auto (an unquantized cache has no scales)");
    return {};
  }
  if (is_fp8(c.format)) {
    if (!given) return {};
    const at::Tensor& s = *scale;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == 1, op, ": ", name,
                " of an fp8 cache must be a float32 tensor of one element (the per-tensor scale), got ",
                s.scalar_type(), " of shape ", s.sizes());
    check_same_device(op, name, s, key_cache);
    return s;
  }
  TORCH_CHECK(given, op, ": kv_cache_dtype ", format_name(c.format), " needs ", name,
              ", the float16 (scale, zero) plane [num_blocks, block_size, num_kv_heads, 2]");
  const at::Tensor& s = *scale;
  TORCH_CHECK(s.scalar_type() == at::kHalf, op, ": ", name, " must be float16, got ", s.scalar_type());
  TORCH_CHECK(s.dim() == 4 && s.size(0) == c.num_blocks && s.size(1) == c.block_size && s.size(2) == c.num_kv_heads &&
                  s.size(3) == 2,
              op, ": ", name, " must be [num_blocks=", c.num_blocks, ", block_size=", c.block_size,
              ", num_kv_heads=", c.num_kv_heads, ", 2], got shape ", s.sizes());
  TORCH_CHECK(s.is_contiguous(), op, ": ", name, " must be contiguous");
  check_same_device(op, name, s, key_cache);
  return s;
}
}  // namespace

KVCacheArgs check_kv_cache_args(const char* op, c10::string_view kv_cache_dtype,
                                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                const at::Tensor& key_cache, const at::Tensor& value_cache) {
  const KVCacheDType format = parse_kv_cache_dtype(op, kv_cache_dtype);
  KVCacheArgs a;
  a.dims = check_kv_cache(key_cache, value_cache, op, format);
  a.k_scale = check_scale(op, "k_scale", k_scale, key_cache, a.dims);
  a.v_scale = check_scale(op, "v_scale", v_scale, key_cache, a.dims);
  return a;
}

void check_scale_planes(const char* op, const std::optional<at::TensorList>& key_scales,
                        const std::optional<at::TensorList>& value_scales, size_t num_layers,
                        const at::Tensor& key_cache0) {
  const bool has_k = key_scales.has_value(), has_v = value_scales.has_value();
  TORCH_CHECK(has_k == has_v, op, ": key_scales and value_scales go together (the planes of a per-token-head cache)");
  if (!has_k) return;
  TORCH_CHECK(key_scales->size() == num_layers && value_scales->size() == num_layers, op, ": got ",
              key_scales->size(), " key and ", value_scales->size(), " value scale planes for ", num_layers,
              " layers");
  for (size_t l = 0; l < num_layers; ++l) {
    for (const at::Tensor& s : {(*key_scales)[l], (*value_scales)[l]}) {
      TORCH_CHECK(s.defined() && s.scalar_type() == at::kHalf && s.dim() == 4 && s.size(0) == key_cache0.size(0) &&
                      s.size(1) == key_cache0.size(1) && s.size(2) == key_cache0.size(2) && s.size(3) == 2 &&
                      s.is_contiguous(),
                  op, ": layer ", l, " scale plane must be contiguous float16 [", key_cache0.size(0), ", ",
                  key_cache0.size(1), ", ", key_cache0.size(2), ", 2], got ",
                  s.defined() ? s.sizes() : at::IntArrayRef{});
      check_same_device(op, "scale plane", s, key_cache0);
    }
  }
}

static AttentionDims check_attention_common(const char* op, const at::Tensor& query, const at::Tensor& key_cache,
                                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, KVCacheDType format) {
  CacheDims c = check_kv_cache(key_cache, value_cache, op, format);
  TORCH_CHECK(query.defined(), op, ": query is required");
  TORCH_CHECK(query.dim() == 3, op, ": query must be 3-D [tokens, num_heads, head_size], got shape ",
              query.sizes());
  check_compute_dtype(op, "query", query, key_cache, format);
  check_same_device(op, "query", query, key_cache);
  check_token_head_layout(op, "query", query);
  TORCH_CHECK(query.size(2) == c.head_size, op, ": query head_size ", query.size(2),
              " differs from the cache head_size ", c.head_size);
  const int64_t num_heads = query.size(1);
  TORCH_CHECK(num_heads > 0 && num_heads % c.num_kv_heads == 0, op, ": num_heads (", num_heads,
              ") must be a positive multiple of num_kv_heads (", c.num_kv_heads, ")");
  check_int_tensor(op, "block_tables", block_tables, at::kInt, 2);
  check_int_tensor(op, "seq_lens", seq_lens, at::kInt, 1);
  check_same_device(op, "block_tables", block_tables, key_cache);
  check_same_device(op, "seq_lens", seq_lens, key_cache);
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs, op, ": block_tables has ", block_tables.size(0),
              " rows but seq_lens has ", num_seqs, " entries");
  return AttentionDims{num_seqs, num_heads, c.num_kv_heads, c.head_size, c.block_size, c.num_blocks,
                       block_tables.size(1)};
}

static void check_out(const char* op, const at::Tensor& out, const at::Tensor& query) {
  if (!out.defined()) return;
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out shape ", out.sizes(), " must equal query shape ",
              query.sizes());
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), op, ": out dtype ", out.scalar_type(),
              " differs from query dtype ", query.scalar_type());
  TORCH_CHECK(out.device() == query.device(), op, ": out is on ", out.device(), ", query on ", query.device());
  check_token_head_layout(op, "out", out);
}

AttentionDims check_decode_inputs(const char* op, const at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                                  int64_t sliding_window, double logits_soft_cap, KVCacheDType format) {
  AttentionDims d = check_attention_common(op, query, key_cache, value_cache, block_tables, seq_lens, format);
  check_window_and_soft_cap(op, sliding_window, logits_soft_cap);
  TORCH_CHECK(query.size(0) == d.num_seqs, op, ": decode takes one query token per sequence: query has ",
              query.size(0), " tokens but seq_lens has ", d.num_seqs, " sequences");
  check_out(op, out, query);
  TORCH_CHECK(max_seq_len >= 0, op, ": max_seq_len must be >= 0, got ", max_seq_len);
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(a.scalar_type() == at::kFloat, op, ": alibi_slopes must be float32, got ", a.scalar_type());
    TORCH_CHECK(a.dim() == 1 && a.size(0) == d.num_heads, op, ": alibi_slopes must be [num_heads=", d.num_heads,
                "], got shape ", a.sizes());
    TORCH_CHECK(a.is_contiguous(), op, ": alibi_slopes must be contiguous");
    check_same_device(op, "alibi_slopes", a, key_cache);
  }
  check_block_table_values(op, d, block_tables, seq_lens, max_seq_len, sliding_window);
  return d;
}

void check_v2_scratch(const char* op, const AttentionDims& d, const at::Tensor& query, const at::Tensor& exp_sums,
                      const at::Tensor& max_logits, const at::Tensor& tmp_out, int64_t max_seq_len,
                      int64_t partition_size) {
  TORCH_CHECK(is_one_of(partition_size, kSupportedPartitionSizes), op, ": partition_size ", partition_size,
              " is not supported; supported: ", join(kSupportedPartitionSizes));
  const int64_t needed = (max_seq_len + partition_size - 1) / partition_size;
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"exp_sums", exp_sums},
                                std::pair<const char*, const at::Tensor&>{"max_logits", max_logits}}) {
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat, op, ": ", name, " must be float32");
    TORCH_CHECK(t.dim() == 3 && t.size(0) == d.num_seqs && t.size(1) == d.num_heads && t.size(2) >= needed, op,
                ": ", name, " must be [num_seqs=", d.num_seqs, ", num_heads=", d.num_heads,
                ", partitions>=", needed, "], got shape ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
    TORCH_CHECK(t.device() == query.device(), op, ": ", name, " is on ", t.device(), ", query on ", query.device());
  }
  TORCH_CHECK(exp_sums.sizes() == max_logits.sizes(), op, ": exp_sums shape ", exp_sums.sizes(),
              " differs from max_logits shape ", max_logits.sizes());
  TORCH_CHECK(tmp_out.defined() && tmp_out.scalar_type() == query.scalar_type(), op,
              ": tmp_out must have the query dtype ", query.scalar_type());
  TORCH_CHECK(tmp_out.dim() == 4 && tmp_out.size(0) == d.num_seqs && tmp_out.size(1) == d.num_heads &&
                  tmp_out.size(2) == exp_sums.size(2) && tmp_out.size(3) == d.head_size,
              op, ": tmp_out must be [num_seqs, num_heads, ", exp_sums.size(2), ", head_size=", d.head_size,
              "], got shape ", tmp_out.sizes());
  TORCH_CHECK(tmp_out.is_contiguous(), op, ": tmp_out must be contiguous");
  TORCH_CHECK(tmp_out.device() == query.device(), op, ": tmp_out is on ", tmp_out.device(), ", query on ",
              query.device());
}

PrefillDims check_prefill_inputs(const char* op, const at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                 const at::Tensor& seq_lens, int64_t max_query_len, int64_t max_seq_len,
                                 int64_t sliding_window, double logits_soft_cap, KVCacheDType format) {
  AttentionDims d = check_attention_common(op, query, key_cache, value_cache, block_tables, seq_lens, format);
  check_window_and_soft_cap(op, sliding_window, logits_soft_cap);
  check_out(op, out, query);
  check_int_tensor(op, "query_start_loc", query_start_loc, at::kInt, 1);
  check_same_device(op, "query_start_loc", query_start_loc, key_cache);
  TORCH_CHECK(query_start_loc.size(0) == d.num_seqs + 1, op, ": query_start_loc must have num_seqs+1=",
              d.num_seqs + 1, " entries, got ", query_start_loc.size(0));
  TORCH_CHECK(max_query_len >= 0 && max_seq_len >= 0, op, ": max_query_len and max_seq_len must be >= 0, got ",
              max_query_len, " and ", max_seq_len);
  PrefillDims p{d, query.size(0)};
  check_block_table_values(op, d, block_tables, seq_lens, max_seq_len, sliding_window, query_start_loc);
  check_query_start_loc_values(op, p, query_start_loc, seq_lens, max_query_len);
  return p;
}

void check_window_and_soft_cap(const char* op, int64_t sliding_window, double logits_soft_cap) {
  TORCH_CHECK(sliding_window >= 0, op, ": sliding_window must be >= 0 (0: no window), got ", sliding_window);
  TORCH_CHECK(std::isfinite(logits_soft_cap) && logits_soft_cap >= 0, op,
              ": logits_soft_cap must be finite and >= 0 (0: no soft-capping), got ", logits_soft_cap);
}

void check_block_table_values(const char* op, const AttentionDims& d, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, int64_t max_seq_len, int64_t sliding_window,
                              const at::Tensor& query_start_loc) {
  if (!index_checks_enabled()) return;
  const at::Tensor lens_t = host_copy(seq_lens);
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int64_t table_capacity = d.max_blocks_per_seq * d.block_size;
  for (int64_t s = 0; s < d.num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 0, op, ": seq_lens[", s, "] = ", lens[s], " is negative");
    TORCH_CHECK(lens[s] <= max_seq_len, op, ": seq_lens[", s, "] = ", lens[s], " exceeds max_seq_len = ",
                max_seq_len);
    TORCH_CHECK(lens[s] <= table_capacity, op, ": seq_lens[", s, "] = ", lens[s],
                " needs more blocks than block_tables holds (", d.max_blocks_per_seq, " blocks x block_size ",
                d.block_size, " = ", table_capacity, " tokens)");
  }
  const bool windowed = sliding_window > 0;
  const bool prefill = query_start_loc.defined();
  if (block_tables.is_cpu()) {
    const int32_t* table = block_tables.data_ptr<int32_t>();
    const at::Tensor qsl_t = windowed && prefill ? host_copy(query_start_loc) : at::Tensor();
    const int32_t* qsl = qsl_t.defined() ? qsl_t.data_ptr<int32_t>() : nullptr;
    for (int64_t s = 0; s < d.num_seqs; ++s) {
      const int64_t used = (lens[s] + d.block_size - 1) / d.block_size;
      // The sequence's first query sits at seq_len - q_len (decode: q_len 1); a malformed
      // query_start_loc (refused right after) only makes this check more blocks.
      const int64_t q_len = qsl ? std::max<int64_t>(0, int64_t(qsl[s + 1]) - qsl[s]) : 1;
      const int64_t first = window_first_key(lens[s] - q_len, sliding_window) / d.block_size;
      const int32_t* row = table + s * d.max_blocks_per_seq;
      for (int64_t b = first; b < used; ++b) {
        TORCH_CHECK(row[b] >= 0 && row[b] < d.num_blocks, op, ": block_tables[", s, "][", b, "] = ", row[b],
                    " is outside the cache (num_blocks = ", d.num_blocks, ")");
      }
    }
    return;
  }
  // Device tables: one masked reduction, one sync.
  const at::Tensor lens_l = seq_lens.to(at::kLong);
  const auto used = (lens_l + (d.block_size - 1)).div(d.block_size, "floor");
  const auto cols = at::arange(d.max_blocks_per_seq, block_tables.options().dtype(at::kLong));
  auto in_use = cols.unsqueeze(0) < used.unsqueeze(1);
  if (windowed) {
    at::Tensor q_lens = at::ones_like(lens_l);
    if (prefill) {
      const at::Tensor qsl = query_start_loc.to(at::kLong);
      q_lens = (qsl.slice(0, 1) - qsl.slice(0, 0, d.num_seqs)).clamp_min(0);
    }
    // A window longer than any row can hold is no window; the bound keeps the arithmetic in range.
    const int64_t window = std::min(sliding_window, table_capacity + 1);
    const auto first = (lens_l - q_lens - window + 1).clamp_min(0).div(d.block_size, "floor");
    in_use = in_use & (cols.unsqueeze(0) >= first.unsqueeze(1));
  }
  const auto bad = in_use & ((block_tables < 0) | (block_tables >= d.num_blocks));
  if (bad.any().item<bool>()) {
    const auto idx = bad.nonzero().select(0, 0).to(at::kCPU);
    const int64_t s = idx[0].item<int64_t>(), b = idx[1].item<int64_t>();
    TORCH_CHECK(false, op, ": block_tables[", s, "][", b, "] = ", block_tables[s][b].item<int32_t>(),
                " is outside the cache (num_blocks = ", d.num_blocks, ")");
  }
}

void check_query_start_loc_values(const char* op, const PrefillDims& p, const at::Tensor& query_start_loc,
                                  const at::Tensor& seq_lens, int64_t max_query_len) {
  if (!index_checks_enabled()) return;
  const at::Tensor qsl_t = host_copy(query_start_loc);
  const at::Tensor lens_t = host_copy(seq_lens);
  const int32_t* qsl = qsl_t.data_ptr<int32_t>();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0, op, ": query_start_loc[0] must be 0, got ", qsl[0]);
  TORCH_CHECK(qsl[p.attn.num_seqs] == p.num_tokens, op, ": query_start_loc[-1] = ", qsl[p.attn.num_seqs],
              " must equal the number of query tokens ", p.num_tokens);
  for (int64_t s = 0; s < p.attn.num_seqs; ++s) {
    const int64_t q_len = int64_t(qsl[s + 1]) - qsl[s];
    TORCH_CHECK(q_len >= 0, op, ": query_start_loc must be non-decreasing, got ", qsl[s], " then ", qsl[s + 1]);
    TORCH_CHECK(q_len <= max_query_len, op, ": sequence ", s, " has ", q_len, " query tokens, more than max_query_len = ",
                max_query_len);
    TORCH_CHECK(q_len <= lens[s], op, ": sequence ", s, " has ", q_len, " query tokens but seq_lens[", s, "] = ",
                lens[s], "; seq_lens counts the new tokens too");
  }
}

namespace {
void check_kv_token_tensor(const char* op, const char* name, const at::Tensor& t, const CacheDims& c,
                           const at::Tensor& key_cache) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is required");
  TORCH_CHECK(t.dim() == 3 && t.size(1) == c.num_kv_heads && t.size(2) == c.head_size, op, ": ", name,
              " must be [num_tokens, num_kv_heads=", c.num_kv_heads, ", head_size=", c.head_size, "], got shape ",
              t.sizes());
  check_compute_dtype(op, name, t, key_cache, c.format);
  TORCH_CHECK(t.device() == key_cache.device(), op, ": ", name, " is on ", t.device(), " but the cache is on ",
              key_cache.device());
  TORCH_CHECK(t.stride(2) == 1, op, ": ", name, " must have a contiguous last dim, got strides ", t.strides());
}
}  // namespace

void check_kv_tokens(const char* op, const at::Tensor& key, const at::Tensor& value, const CacheDims& c,
                     const at::Tensor& key_cache) {
  check_kv_token_tensor(op, "key", key, c, key_cache);
  check_kv_token_tensor(op, "value", value, c, key_cache);
  TORCH_CHECK(value.size(0) == key.size(0), op, ": key has ", key.size(0), " tokens, value has ", value.size(0));
  // The cache writers read both in key's dtype (with a quantized cache either may be any compute dtype).
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), op, ": value dtype ", value.scalar_type(),
              " differs from key dtype ", key.scalar_type());
}

void check_slot_mapping(const char* op, const at::Tensor& slot_mapping, int64_t num_tokens, const CacheDims& c) {
  check_int_tensor(op, "slot_mapping", slot_mapping, at::kLong, 1);
  TORCH_CHECK(slot_mapping.size(0) == num_tokens, op, ": slot_mapping has ", slot_mapping.size(0),
              " entries but key has ", num_tokens, " tokens");
  if (!index_checks_enabled()) return;
  const int64_t num_slots = c.num_blocks * c.block_size;
  if (slot_mapping.is_cpu()) {
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_tokens; ++i) {
      TORCH_CHECK(slots[i] < num_slots, op, ": slot_mapping[", i, "] = ", slots[i],
                  " is outside the cache (num_blocks * block_size = ", num_slots, ")");
    }
    return;
  }
  if (num_tokens == 0) return;
  const int64_t max_slot = slot_mapping.max().item<int64_t>();
  TORCH_CHECK(max_slot < num_slots, op, ": slot_mapping holds slot ", max_slot,
              ", outside the cache (num_blocks * block_size = ", num_slots, ")");
}

void check_rms_norm_inputs(const char* op, const char* other_name, const at::Tensor& other, const at::Tensor& input,
                           const at::Tensor& weight, double epsilon) {
  TORCH_CHECK(input.defined() && weight.defined(), op, ": input and weight are required");
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D [num_tokens, hidden_size], got shape ", input.sizes());
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op, ": input dtype ", input.scalar_type(),
              " is not supported; supported: ", kSupportedDtypes);
  const int64_t hidden = input.size(1);
  TORCH_CHECK(hidden > 0, op, ": hidden_size must be positive, got shape ", input.sizes());
  TORCH_CHECK(input.stride(1) == 1, op, ": input rows must be dense (stride 1 along hidden_size), got strides ",
              input.strides());
  if (other.defined()) {
    TORCH_CHECK(other.sizes() == input.sizes(), op, ": ", other_name, " shape ", other.sizes(),
                " must equal input shape ", input.sizes());
    TORCH_CHECK(other.scalar_type() == input.scalar_type(), op, ": ", other_name, " dtype ", other.scalar_type(),
                " differs from input dtype ", input.scalar_type());
    TORCH_CHECK(other.device() == input.device(), op, ": ", other_name, " is on ", other.device(),
                " but input is on ", input.device());
    TORCH_CHECK(other.stride(1) == 1, op, ": ", other_name,
                " rows must be dense (stride 1 along hidden_size), got strides ", other.strides());
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, op, ": weight must be [hidden_size=", hidden,
              "], got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), op, ": weight dtype ", weight.scalar_type(),
              " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(weight.device() == input.device(), op, ": weight is on ", weight.device(), " but input is on ",
              input.device());
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous, got strides ", weight.strides());
  TORCH_CHECK(std::isfinite(epsilon) && epsilon >= 0, op, ": epsilon must be finite and >= 0, got ", epsilon);
}

void check_disjoint(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                    const char* b_name) {
  if (a.numel() == 0 || b.numel() == 0 || !a.is_alias_of(b)) return;
  const auto range = [](const at::Tensor& t) {
    const auto* begin = static_cast<const char*>(t.const_data_ptr());
    int64_t last = 0;
    for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
    return std::make_pair(begin, begin + (last + 1) * t.element_size());
  };
  const auto [a_begin, a_end] = range(a);
  const auto [b_begin, b_end] = range(b);
  TORCH_CHECK(a_end <= b_begin || b_end <= a_begin, op, ": ", a_name, " must not share memory with ", b_name);
}

void check_act_and_mul_inputs(const char* op, const at::Tensor& out, const at::Tensor& input) {
  TORCH_CHECK(input.defined() && out.defined(), op, ": out and input are required");
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D [num_tokens, 2 * d] ([gate | up]), got shape ",
              input.sizes());
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op, ": input dtype ", input.scalar_type(),
              " is not supported; supported: ", kSupportedDtypes);
  const int64_t width = input.size(1);
  TORCH_CHECK(width > 0 && width % 2 == 0, op, ": input's last dim must be even and positive ([gate | up]), got shape ",
              input.sizes());
  TORCH_CHECK(input.stride(1) == 1, op, ": input rows must be dense (stride 1 along the last dim), got strides ",
              input.strides());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == input.size(0) && out.size(1) == width / 2, op, ": out must be [",
              input.size(0), ", ", width / 2, "] for input of shape ", input.sizes(), ", got shape ", out.sizes());
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), op, ": out dtype ", out.scalar_type(),
              " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(out.device() == input.device(), op, ": out is on ", out.device(), " but input is on ", input.device());
  TORCH_CHECK(out.stride(1) == 1, op, ": out rows must be dense (stride 1 along the last dim), got strides ",
              out.strides());
  // Rows are read and written in chunks, so an out inside input's memory could be read after it was
  // written.
  check_disjoint(op, out, "out", input, "input");
}

CacheDims check_rotary_cache_inputs(const char* op, const at::Tensor& positions, const at::Tensor& query,
                                    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                    const at::Tensor& cos_sin_cache, KVCacheDType format) {
  const CacheDims c = check_kv_cache(key_cache, value_cache, op, format);
  check_kv_tokens(op, key, value, c, key_cache);
  const int64_t num_tokens = key.size(0);
  TORCH_CHECK(query.defined(), op, ": query is required");
  TORCH_CHECK(query.dim() == 3 && query.size(0) == num_tokens && query.size(1) > 0 && query.size(2) == c.head_size,
              op, ": query must be [num_tokens=", num_tokens, ", num_heads, head_size=", c.head_size,
              "], got shape ", query.sizes());
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), op, ": query dtype ", query.scalar_type(),
              " differs from the key dtype ", key.scalar_type());
  check_same_device(op, "query", query, key_cache);
  TORCH_CHECK(query.stride(2) == 1, op, ": query must have a contiguous last dim, got strides ", query.strides());
  check_int_tensor(op, "positions", positions, at::kLong, 1);
  check_same_device(op, "positions", positions, key_cache);
  TORCH_CHECK(positions.size(0) == num_tokens, op, ": positions has ", positions.size(0), " entries but key has ",
              num_tokens, " tokens");
  TORCH_CHECK(cos_sin_cache.defined(), op, ": cos_sin_cache is required");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat, op, ": cos_sin_cache must be float32, got ",
              cos_sin_cache.scalar_type());
  TORCH_CHECK(cos_sin_cache.dim() == 2, op, ": cos_sin_cache must be 2-D [max_position, rot_dim], got shape ",
              cos_sin_cache.sizes());
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= c.head_size, op,
              ": cos_sin_cache rot_dim must be even, positive and <= head_size=", c.head_size, ", got ", rot_dim);
  TORCH_CHECK(cos_sin_cache.is_contiguous(), op, ": cos_sin_cache must be contiguous");
  check_same_device(op, "cos_sin_cache", cos_sin_cache, key_cache);
  TORCH_CHECK(slot_mapping.defined() && slot_mapping.device() == key_cache.device(), op,
              ": slot_mapping must be on the cache device ", key_cache.device(), ", got ",
              slot_mapping.defined() ? slot_mapping.device() : at::Device(at::kCPU));
  check_slot_mapping(op, slot_mapping, num_tokens, c);
  if (!index_checks_enabled() || num_tokens == 0) return c;
  const int64_t max_position = cos_sin_cache.size(0);
  if (positions.is_cpu()) {
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_tokens; ++i) {
      TORCH_CHECK(pos[i] >= 0 && pos[i] < max_position, op, ": positions[", i, "] = ", pos[i],
                  " is outside the cos/sin table (max_position = ", max_position, ")");
    }
    return c;
  }
  const auto [lo, hi] = at::aminmax(positions);
  const at::Tensor bounds = at::stack({lo, hi}).to(at::kCPU);
  const int64_t min_pos = bounds[0].item<int64_t>(), max_pos = bounds[1].item<int64_t>();
  TORCH_CHECK(min_pos >= 0 && max_pos < max_position, op, ": positions span [", min_pos, ", ", max_pos,
              "], outside the cos/sin table [0, ", max_position, ")");
  return c;
}

void check_block_mapping(const char* op, const at::Tensor& block_mapping, int64_t num_src_blocks,
                         int64_t num_dst_blocks, bool disjoint_pairs) {
  TORCH_CHECK(block_mapping.defined(), op, ": block_mapping is required");
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong, op, ": block_mapping must be int64, got ",
              block_mapping.scalar_type());
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2, op,
              ": block_mapping must be [num_pairs, 2] (src, dst), got shape ", block_mapping.sizes());
  // Block mappings are checked on the CPU whatever the toggle says: swap_blocks turns them
  // into memcpy ranges and they are never part of a captured step.
  if (!block_mapping.is_cpu() && !index_checks_enabled()) return;
  const at::Tensor m = host_copy(block_mapping).contiguous();
  const int64_t* pairs = m.data_ptr<int64_t>();
  for (int64_t i = 0; i < m.size(0); ++i) {
    TORCH_CHECK(pairs[2 * i] >= 0 && pairs[2 * i] < num_src_blocks, op, ": block_mapping[", i, "] source block ",
                pairs[2 * i], " is outside the source cache (", num_src_blocks, " blocks)");
    TORCH_CHECK(pairs[2 * i + 1] >= 0 && pairs[2 * i + 1] < num_dst_blocks, op, ": block_mapping[", i,
                "] destination block ", pairs[2 * i + 1], " is outside the destination cache (", num_dst_blocks,
                " blocks)");
  }
  if (!disjoint_pairs) return;
  std::unordered_set<int64_t> sources, destinations;
  for (int64_t i = 0; i < m.size(0); ++i) sources.insert(pairs[2 * i]);
  for (int64_t i = 0; i < m.size(0); ++i) {
    const int64_t dst = pairs[2 * i + 1];
    TORCH_CHECK(destinations.insert(dst).second, op, ": block_mapping writes block ", dst,
                " twice; each destination block may appear once");
    TORCH_CHECK(!sources.count(dst), op, ": block_mapping[", i, "] writes block ", dst,
                ", which another pair reads; the pairs are copied concurrently, so a destination must not be a source");
  }
}

}  // namespace pagedkv
