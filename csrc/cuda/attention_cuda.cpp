// CUDA attention ops: validate with the shared checks, build the launcher
// arguments from the tensors and launch on the current stream. The kernels
// themselves live in csrc/attention/*.cu (no torch headers there).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>

#include "attention/attention_launch.h"
#include "common/row_rotation.h"
#include "common/validation.h"
#include "cuda/launch_checks.h"
#include "ops.h"

namespace pagedkv {
namespace {

void check_fits_int(const char* op, const char* what, int64_t value) {
  TORCH_CHECK(value <= std::numeric_limits<int32_t>::max(), op, ": ", what, " = ", value,
              " does not fit the kernels' 32-bit index range");
}

// The attention kernels run on the query's device; validation already checked
// that every input shares it, here we check it is a CUDA device at all.
void check_cuda_inputs(const char* op, const at::Tensor& query, const at::Tensor& key_cache) {
  TORCH_CHECK(query.is_cuda() && key_cache.is_cuda(), op, ": the CUDA kernel needs CUDA tensors, got query on ",
              query.device(), " and key_cache on ", key_cache.device());
  // 16-byte loads of K/V rows (a quantized cache: 8-, 4- or 2-byte loads of codes, and
  // 4-byte (scale, zero) pairs): every row and slice offset is a multiple of the load size
  // for every supported shape, so only the base pointers can break the alignment.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(key_cache.data_ptr()) % 16 == 0, op,
              ": key_cache must be 16-byte aligned (a view starting mid-row?)");
}

cuda::PagedKV make_paged_kv(const char* op, const AttentionDims& d, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(value_cache.data_ptr()) % 16 == 0, op,
              ": value_cache must be 16-byte aligned");
  check_fits_int(op, "num_blocks", d.num_blocks);
  check_fits_int(op, "max_blocks_per_seq * block_size", d.max_blocks_per_seq * d.block_size);
  TORCH_CHECK(d.num_seqs <= cuda::kMaxGridYZ, op, ": at most ", cuda::kMaxGridYZ, " sequences per call, got ",
              d.num_seqs);
  cuda::PagedKV kv{};
  kv.key_cache = key_cache.data_ptr();
  kv.value_cache = value_cache.data_ptr();
  kv.block_tables = block_tables.data_ptr<int32_t>();
  kv.seq_lens = seq_lens.data_ptr<int32_t>();
  kv.num_blocks = static_cast<int>(d.num_blocks);
  kv.block_size = static_cast<int>(d.block_size);
  kv.num_kv_heads = static_cast<int>(d.num_kv_heads);
  kv.head_size = static_cast<int>(d.head_size);
  kv.max_blocks_per_seq = static_cast<int>(d.max_blocks_per_seq);
  return kv;
}

// A window longer than any sequence can be (the kernels' lengths are 32-bit) is no window.
int kernel_window(int64_t sliding_window) {
  return static_cast<int>(std::min<int64_t>(sliding_window, std::numeric_limits<int32_t>::max()));
}

cuda::DecodeArgs make_decode_args(const char* op, const AttentionDims& d, at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                                  double logits_soft_cap) {
  cuda::DecodeArgs a{};
  a.kv = make_paged_kv(op, d, key_cache, value_cache, block_tables, seq_lens);
  a.out = out.data_ptr();
  a.query = query.data_ptr();
  a.out_stride = out.stride(0);
  a.query_stride = query.stride(0);
  a.alibi_slopes =
      alibi_slopes.has_value() && alibi_slopes->defined() ? alibi_slopes->data_ptr<float>() : nullptr;
  a.scale = static_cast<float>(scale);
  a.num_seqs = static_cast<int>(d.num_seqs);
  a.num_heads = static_cast<int>(d.num_heads);
  a.dtype = cuda::to_kernel_dtype(query.scalar_type());
  a.sliding_window = kernel_window(sliding_window);
  a.logits_soft_cap = static_cast<float>(logits_soft_cap);
  return a;
}

}  // namespace

int64_t cuda_multiprocessor_count(int device) {
  // One slot per device, 0 = not read yet. A race only reads the attribute twice.
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  TORCH_CHECK(err == cudaSuccess && count > 0, "pagedkv: cannot read the multiprocessor count of CUDA device ", device,
              ": ", cudaGetErrorString(err));
  if (device >= 0 && device < static_cast<int>(cache.size())) cache[device].store(count, std::memory_order_relaxed);
  return count;
}

void paged_attention_v1_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                             const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                             double logits_soft_cap, c10::string_view kv_cache_dtype,
                             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  constexpr const char* op = "paged_attention_v1";
  TORCH_CHECK(out.defined(), op, ": out is required");
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const AttentionDims d = check_decode_inputs(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                                              max_seq_len, alibi_slopes, sliding_window, logits_soft_cap,
                                              kv.dims.format);
  check_cuda_inputs(op, query, key_cache);
  const c10::cuda::CUDAGuard guard(query.device());
  RotatedAttention rot(kv.dims.format, query, out);
  cuda::DecodeArgs a = make_decode_args(op, d, rot.out(), rot.query(), key_cache, value_cache, block_tables,
                                        seq_lens, scale, alibi_slopes, sliding_window, logits_soft_cap);
  cuda::set_kv_format(a.kv, kv);
  cuda::check_launch(op, cuda::launch_paged_attention_v1(a, c10::cuda::getCurrentCUDAStream()));
  rot.finish(out);
}

void paged_attention_v2_cuda(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits, at::Tensor& tmp_out,
                             const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                             int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                             int64_t partition_size, int64_t sliding_window, double logits_soft_cap, c10::string_view kv_cache_dtype,
                             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  constexpr const char* op = "paged_attention_v2";
  TORCH_CHECK(out.defined(), op, ": out is required");
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const AttentionDims d = check_decode_inputs(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                                              max_seq_len, alibi_slopes, sliding_window, logits_soft_cap,
                                              kv.dims.format);
  check_v2_scratch(op, d, query, exp_sums, max_logits, tmp_out, max_seq_len, partition_size);
  check_cuda_inputs(op, query, key_cache);
  check_fits_int(op, "max_seq_len", max_seq_len);
  const int64_t num_partitions = (max_seq_len + partition_size - 1) / partition_size;
  TORCH_CHECK(num_partitions <= cuda::kMaxGridYZ, op, ": max_seq_len ", max_seq_len, " needs ", num_partitions,
              " partitions of ", partition_size, "; at most ", cuda::kMaxGridYZ, " are supported");
  const c10::cuda::CUDAGuard guard(query.device());
  RotatedAttention rot(kv.dims.format, query, out);
  cuda::DecodeArgs a = make_decode_args(op, d, rot.out(), rot.query(), key_cache, value_cache, block_tables,
                                        seq_lens, scale, alibi_slopes, sliding_window, logits_soft_cap);
  cuda::set_kv_format(a.kv, kv);
  cuda::DecodeScratch s{};
  s.exp_sums = exp_sums.data_ptr<float>();
  s.max_logits = max_logits.data_ptr<float>();
  s.tmp_out = tmp_out.data_ptr();
  s.max_partitions = static_cast<int>(exp_sums.size(2));
  s.partition_size = static_cast<int>(partition_size);
  cuda::check_launch(op, cuda::launch_paged_attention_v2(a, s, static_cast<int>(max_seq_len),
                                                   c10::cuda::getCurrentCUDAStream()));
  rot.finish(out);
}

void paged_prefill_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                                  int64_t max_query_len, int64_t max_seq_len, int64_t sliding_window,
                                  double logits_soft_cap, c10::string_view kv_cache_dtype,
                             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  constexpr const char* op = "paged_prefill_attention";
  TORCH_CHECK(out.defined(), op, ": out is required");
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const PrefillDims pd = check_prefill_inputs(op, out, query, key_cache, value_cache, block_tables, query_start_loc,
                                              seq_lens, max_query_len, max_seq_len, sliding_window, logits_soft_cap,
                                              kv.dims.format);
  check_cuda_inputs(op, query, key_cache);
  check_fits_int(op, "num_tokens", pd.num_tokens);
  check_fits_int(op, "max_query_len", max_query_len);
  const c10::cuda::CUDAGuard guard(query.device());
  RotatedAttention rot(kv.dims.format, query, out);
  cuda::PrefillArgs a{};
  a.kv = make_paged_kv(op, pd.attn, key_cache, value_cache, block_tables, seq_lens);
  cuda::set_kv_format(a.kv, kv);
  a.out = rot.out().data_ptr();
  a.query = rot.query().data_ptr();
  a.out_stride = rot.out().stride(0);
  a.query_stride = rot.query().stride(0);
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.scale = static_cast<float>(scale);
  a.num_seqs = static_cast<int>(pd.attn.num_seqs);
  a.num_heads = static_cast<int>(pd.attn.num_heads);
  a.num_tokens = static_cast<int>(pd.num_tokens);
  a.max_query_len = static_cast<int>(max_query_len);
  a.dtype = cuda::to_kernel_dtype(query.scalar_type());
  a.sliding_window = kernel_window(sliding_window);
  a.logits_soft_cap = static_cast<float>(logits_soft_cap);
  cuda::check_launch(op, cuda::launch_paged_prefill_attention(a, c10::cuda::getCurrentCUDAStream()));
  rot.finish(out);
}

}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("paged_attention_v1", &pagedkv::paged_attention_v1_cuda);
  m.impl("paged_attention_v2", &pagedkv::paged_attention_v2_cuda);
  m.impl("paged_prefill_attention", &pagedkv::paged_prefill_attention_cuda);
}
