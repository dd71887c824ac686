// CPU entry points of the attention ops: validate (common/validation.h), fill
// the raw-pointer parameter blocks, run the kernel variant for this CPU.
#include <ATen/ATen.h>

#include "common/row_rotation.h"
#include "common/validation.h"
#include "cpu/attention_kernels.h"
#include "cpu/cpu_capability.h"
#include "ops.h"

namespace pagedkv {
namespace {

// The AVX512_BF16 variant holds bf16 kernels only (its dot products are vdpbf16ps);
// other dtypes run the AVX-512 ones there.
#define PAGEDKV_RUN_VARIANT(kernel, params)                                                              \
  cpu::run_variant(params, (params).dtype == at::kBFloat16 ? cpu::AVX512_BF16::kernel : cpu::AVX512::kernel, \
                   cpu::AVX512::kernel, cpu::AVX2::kernel, cpu::DEFAULT::kernel)

void run_decode(const cpu::DecodeParams& p) { PAGEDKV_RUN_VARIANT(decode_attention, p); }

void run_reduce(const cpu::DecodeParams& p) { PAGEDKV_RUN_VARIANT(reduce_partitions, p); }

void run_prefill(const cpu::PrefillParams& p) { PAGEDKV_RUN_VARIANT(prefill_attention, p); }

#undef PAGEDKV_RUN_VARIANT

// The fields every kernel shares, from validated tensors.
void fill_common(cpu::PagedAttentionParams& p, at::Tensor& out, const at::Tensor& query,
                 const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, double scale, int64_t sliding_window, double logits_soft_cap,
                 const AttentionDims& d) {
  p.dtype = query.scalar_type();
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.query = query.const_data_ptr();
  p.query_stride = query.stride(0);
  p.key_cache = key_cache.const_data_ptr();
  p.value_cache = value_cache.const_data_ptr();
  p.block_tables = block_tables.const_data_ptr<int32_t>();
  p.max_blocks_per_seq = d.max_blocks_per_seq;
  p.seq_lens = seq_lens.const_data_ptr<int32_t>();
  p.scale = static_cast<float>(scale);
  p.num_seqs = d.num_seqs;
  p.num_heads = d.num_heads;
  p.num_kv_heads = d.num_kv_heads;
  p.head_size = d.head_size;
  p.block_size = d.block_size;
  p.sliding_window = sliding_window;
  p.logits_soft_cap = static_cast<float>(logits_soft_cap);
}

// The cache format's fields: codes are read through key_cache/value_cache; fp8 scales are read
// here once (CPU tensors), per-token planes are passed as pointers.
void fill_kv_format(cpu::PagedAttentionParams& p, const KVCacheArgs& kv) {
  p.kv_format = kv.dims.format;
  if (is_fp8(p.kv_format)) {
    p.k_scale = kv.k_scale.defined() ? kv.k_scale.item<float>() : 1.f;
    p.v_scale = kv.v_scale.defined() ? kv.v_scale.item<float>() : 1.f;
  } else if (is_per_token_head(p.kv_format)) {
    p.k_plane = static_cast<const c10::Half*>(kv.k_scale.const_data_ptr());
    p.v_plane = static_cast<const c10::Half*>(kv.v_scale.const_data_ptr());
  }
}

cpu::DecodeParams decode_params(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale,
                                const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                                double logits_soft_cap, const AttentionDims& d, const KVCacheArgs& kv) {
  cpu::DecodeParams p{};
  fill_common(p, out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, logits_soft_cap,
              d);
  fill_kv_format(p, kv);
  p.alibi_slopes =
      alibi_slopes.has_value() && alibi_slopes->defined() ? alibi_slopes->const_data_ptr<float>() : nullptr;
  p.bf16_dot = cpu::cpu_bf16_dot_enabled();
  return p;
}

}  // namespace

void paged_attention_v1_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                            const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                            double logits_soft_cap, c10::string_view kv_cache_dtype,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_attention_v1";
  TORCH_CHECK(out.defined(), op, ": out is required");
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const AttentionDims d = check_decode_inputs(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                                              max_seq_len, alibi_slopes, sliding_window, logits_soft_cap,
                                              kv.dims.format);
  if (d.num_seqs == 0) return;
  RotatedAttention rot(kv.dims.format, query, out);
  run_decode(decode_params(rot.out(), rot.query(), key_cache, value_cache, block_tables, seq_lens, scale,
                           alibi_slopes, sliding_window, logits_soft_cap, d, kv));
  rot.finish(out);
}

void paged_attention_v2_cpu(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits, at::Tensor& tmp_out,
                            const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                            int64_t partition_size, int64_t sliding_window, double logits_soft_cap,
                            c10::string_view kv_cache_dtype, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_attention_v2";
  TORCH_CHECK(out.defined(), op, ": out is required");
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const AttentionDims d = check_decode_inputs(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                                              max_seq_len, alibi_slopes, sliding_window, logits_soft_cap,
                                              kv.dims.format);
  check_v2_scratch(op, d, query, exp_sums, max_logits, tmp_out, max_seq_len, partition_size);
  if (d.num_seqs == 0) return;
  RotatedAttention rot(kv.dims.format, query, out);
  cpu::DecodeParams p = decode_params(rot.out(), rot.query(), key_cache, value_cache, block_tables, seq_lens, scale,
                                      alibi_slopes, sliding_window, logits_soft_cap, d, kv);
  p.partition_size = partition_size;
  // Partitions past a sequence's end or before its window (and extra scratch columns) are marked empty.
  p.max_partitions = exp_sums.size(2);
  p.exp_sums = exp_sums.data_ptr<float>();
  p.max_logits = max_logits.data_ptr<float>();
  p.tmp_out = tmp_out.data_ptr();
  run_decode(p);
  run_reduce(p);
  rot.finish(out);
}

void paged_prefill_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                                 int64_t max_query_len, int64_t max_seq_len, int64_t sliding_window,
                                 double logits_soft_cap, c10::string_view kv_cache_dtype,
                                 const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_prefill_attention";
  TORCH_CHECK(out.defined(), op, ": out is required");
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const PrefillDims pd = check_prefill_inputs(op, out, query, key_cache, value_cache, block_tables,
                                              query_start_loc, seq_lens, max_query_len, max_seq_len, sliding_window,
                                              logits_soft_cap, kv.dims.format);
  const AttentionDims& d = pd.attn;
  if (pd.num_tokens == 0 || d.num_seqs == 0) return;
  RotatedAttention rot(kv.dims.format, query, out);
  cpu::PrefillParams p{};
  fill_common(p, rot.out(), rot.query(), key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
              logits_soft_cap, d);
  fill_kv_format(p, kv);
  p.query_start_loc = query_start_loc.const_data_ptr<int32_t>();
  p.use_amx = p.dtype == at::kBFloat16 && cpu::cpu_amx_enabled();
  run_prefill(p);
  rot.finish(out);
}

}  // namespace pagedkv
