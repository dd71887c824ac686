// Input checks shared by the CPU and CUDA implementations of every op.
// Each failure is a TORCH_CHECK naming the op, what was expected and what was
// given, so bad input surfaces as a Python exception, never as a crash or as
// silently wrong output.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include <c10/util/string_view.h>

#include "common/kv_cache_dtype.h"
#include "common/window.h"

namespace pagedkv {

struct CacheDims {
  int64_t num_blocks;
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t head_size;  // logical: twice the last dim for int4
  KVCacheDType format = KVCacheDType::kAuto;
};

// The validated cache format of one op call: the dims (format included) and the scale
// tensors, undefined when the format has none (auto; fp8 without k_scale/v_scale = 1.0).
struct KVCacheArgs {
  CacheDims dims;
  at::Tensor k_scale, v_scale;
};

struct AttentionDims {
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t num_blocks;
  int64_t max_blocks_per_seq;
};

struct PrefillDims {
  AttentionDims attn;  // num_seqs from seq_lens
  int64_t num_tokens;  // query.size(0)
};

// key_cache/value_cache: 4-D [num_blocks, block_size, num_kv_heads, X], identical shape,
// dtype and device, contiguous, supported sizes; the dtype the format stores (auto: a
// supported compute dtype; fp8: float8_e4m3fn / float8_e5m2; per-token-head: uint8), X =
// head_size (int4: head_size / 2).
CacheDims check_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache, const char* op,
                         KVCacheDType format = KVCacheDType::kAuto);

// kv_cache_dtype one of kSupportedKVCacheDtypes ("fp8" is e4m3).
KVCacheDType parse_kv_cache_dtype(const char* op, c10::string_view kv_cache_dtype);

// Parses kv_cache_dtype, checks the caches for that format and the scales: fp8 takes
// optional float32 [1] k_scale / v_scale on the cache's device (absent: 1.0), the
// per-token-head formats require float16 planes [num_blocks, block_size, num_kv_heads, 2],
// contiguous, on the cache's device; auto takes none.
KVCacheArgs check_kv_cache_args(const char* op, c10::string_view kv_cache_dtype,
                                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                const at::Tensor& key_cache, const at::Tensor& value_cache);

// The scale planes of copy_blocks: absent, or one per layer, each the per-token plane of
// that layer's cache shape (planes of every layer alike).
void check_scale_planes(const char* op, const std::optional<at::TensorList>& key_scales,
                        const std::optional<at::TensorList>& value_scales, size_t num_layers,
                        const at::Tensor& key_cache0);

// sliding_window >= 0 (0: no window) and logits_soft_cap finite and >= 0 (0: off).
void check_window_and_soft_cap(const char* op, int64_t sliding_window, double logits_soft_cap);

// Decode inputs (v1/v2/paged_attention). `out` may be undefined (allocating op).
AttentionDims check_decode_inputs(const char* op, const at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                                  int64_t sliding_window = 0, double logits_soft_cap = 0.0,
                                  KVCacheDType format = KVCacheDType::kAuto);

// v2 scratch: exp_sums/max_logits fp32 [num_seqs, num_heads, P], tmp_out
// [num_seqs, num_heads, P, head_size] in the query dtype, P >= ceil(max_seq_len / partition_size).
void check_v2_scratch(const char* op, const AttentionDims& dims, const at::Tensor& query,
                      const at::Tensor& exp_sums, const at::Tensor& max_logits, const at::Tensor& tmp_out,
                      int64_t max_seq_len, int64_t partition_size);

PrefillDims check_prefill_inputs(const char* op, const at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                 const at::Tensor& seq_lens, int64_t max_query_len, int64_t max_seq_len,
                                 int64_t sliding_window = 0, double logits_soft_cap = 0.0,
                                 KVCacheDType format = KVCacheDType::kAuto);

// Value checks: every seq_len in [0, max_seq_len] and within the block table,
// every block id a sequence uses in [0, num_blocks). Reads the tensors: free on
// the CPU, one device->host sync on CUDA (skippable, see index_checks_enabled).
// With a sliding window, the logical blocks that lie wholly before the window of the
// sequence's first query are not used (no kernel reads them; the block manager may have
// freed them): their entries are not checked. query_start_loc (prefill; undefined for
// decode, one query per sequence) gives each sequence's number of queries.
void check_block_table_values(const char* op, const AttentionDims& dims, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, int64_t max_seq_len, int64_t sliding_window = 0,
                              const at::Tensor& query_start_loc = at::Tensor());

// query_start_loc: starts at 0, non-decreasing, ends at num_tokens; each
// q_len <= max_query_len and <= its seq_len.
void check_query_start_loc_values(const char* op, const PrefillDims& dims, const at::Tensor& query_start_loc,
                                  const at::Tensor& seq_lens, int64_t max_query_len);

// key/value of new tokens: each [num_tokens, num_kv_heads, head_size], the cache's dtype
// (quantized formats: a supported compute dtype, key's for value) and device, last dim
// dense (dims 0/1 may be strided, e.g. a fused QKV slice); the same number of tokens.
void check_kv_tokens(const char* op, const at::Tensor& key, const at::Tensor& value, const CacheDims& cache,
                     const at::Tensor& key_cache);

// slot_mapping: every slot < num_blocks * block_size (negative = skip).
void check_slot_mapping(const char* op, const at::Tensor& slot_mapping, int64_t num_tokens,
                        const CacheDims& cache);

// block_mapping int64 [n, 2] of (src, dst) block ids, src < num_src_blocks, dst < num_dst_blocks.
// disjoint_pairs: the pairs run concurrently within one cache (copy_blocks), so every
// destination must be unique and no destination may also be a source.
void check_block_mapping(const char* op, const at::Tensor& block_mapping, int64_t num_src_blocks,
                         int64_t num_dst_blocks, bool disjoint_pairs = false);

// rms_norm / fused_add_rms_norm: input 2-D [num_tokens, hidden_size] in a supported
// dtype with dense rows (stride(1) == 1; any row stride); `other` (out, or the residual;
// may be undefined) the same shape, dtype and device with dense rows; weight
// [hidden_size], contiguous, same dtype and device; epsilon finite and >= 0.
void check_rms_norm_inputs(const char* op, const char* other_name, const at::Tensor& other, const at::Tensor& input,
                           const at::Tensor& weight, double epsilon);

// a and b (either may be a view) do not share a byte: refused when their byte ranges
// overlap, for ops that read one while writing the other in chunks.
void check_disjoint(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                    const char* b_name);

// silu_and_mul / gelu_and_mul / gelu_tanh_and_mul: input 2-D [num_tokens, 2 d] = [gate | up] in a
// supported dtype with dense rows (any row stride), d > 0; out [num_tokens, d], the same dtype and
// device, dense rows, not overlapping input.
void check_act_and_mul_inputs(const char* op, const at::Tensor& out, const at::Tensor& input);

// rotary_embedding_and_cache: query [num_tokens, num_heads, head_size] and key/value
// [num_tokens, num_kv_heads, head_size] (last dim dense, the cache's dtype and device);
// positions int64 [num_tokens]; cos_sin_cache float32 [max_position, rot_dim],
// contiguous, rot_dim even and <= head_size; slot_mapping as for reshape_and_cache.
// Value checks (behind index_checks_enabled): every position in [0, max_position).
CacheDims check_rotary_cache_inputs(const char* op, const at::Tensor& positions, const at::Tensor& query,
                                    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                    const at::Tensor& cos_sin_cache, KVCacheDType format = KVCacheDType::kAuto);

// The value checks (block table ids, seq_lens, slot_mapping, query_start_loc; CPU
// and CUDA tensors alike) are on by default. They cost a device->host copy and a
// sync on CUDA, which also makes an op impossible to capture in a CUDA graph.
// PAGEDKV_SKIP_INDEX_CHECKS=1 sets the initial value; set_index_checks() changes it
// at run time and returns the previous value (pagedkv.ops.set_index_checks).
// With the checks off, the CUDA kernels still never read outside the cache (they
// mask out-of-range ids); the CPU kernels trust the indices, so validate the
// metadata first (pagedkv.ops.validate_decode_metadata / validate_prefill_metadata).
// Shape, dtype and device checks are never skipped.
bool index_checks_enabled();
bool set_index_checks(bool enabled);

}  // namespace pagedkv
