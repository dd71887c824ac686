// The allocating paged_attention op: sizes the output and v2 scratch and picks
// v1 (one pass per sequence) or v2 (split-K over partitions + reduce).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>

#include "common/supported.h"
#include "ops.h"

namespace pagedkv {

// The rule, measured by bench/bench_kernels.py --v1-vs-v2 (bench/results/): v2
// pays when there is too little (sequence, kv head) work to fill the machine
// and each sequence is long enough to split.
//  - CUDA: v1 launches a CTA per (sequence, kv head); below ~4 CTAs per SM
//    (num_sms: the current device's multiprocessor count, 132 on an H200) v2's
//    extra parallelism wins once a sequence spans more than one partition (the
//    same shape of rule vLLM uses).
//  - CPU: never. The CPU v1 kernel splits long sequences across threads
//    itself (pieces of the total KV length, merged in fp32 by the last piece,
//    in one parallel region), which v2's partitions + separate reduce pass
//    (with tmp_out rounded to the query dtype) only repeat at more cost.
// The SM count of the query's CUDA device (0 for a CPU tensor), cached per device.
static int64_t multiprocessor_count(const at::Tensor& query) {
#ifdef PAGEDKV_WITH_CUDA
  if (query.is_cuda()) return cuda_multiprocessor_count(query.get_device());
#endif
  return 0;
}

bool should_use_v2(bool is_cuda, int64_t num_sms, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t max_seq_len, int64_t partition_size) {
  const int64_t num_partitions = (max_seq_len + partition_size - 1) / partition_size;
  if (num_partitions <= 1 || !is_cuda) return false;
  const int64_t work_items = num_seqs * num_kv_heads;
  return max_seq_len > 8192 || work_items < 4 * num_sms;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           std::optional<int64_t> max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                           int64_t sliding_window, double logits_soft_cap, c10::string_view kv_cache_dtype,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(query.defined() && query.dim() == 3, "paged_attention: query must be 3-D [num_seqs, num_heads, head_size]");
  TORCH_CHECK(key_cache.defined() && key_cache.dim() == 4,
              "paged_attention: key_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(seq_lens.defined() && seq_lens.dim() == 1, "paged_attention: seq_lens must be 1-D [num_seqs]");
  // Without max_seq_len this reads seq_lens: a device->host copy and a sync on CUDA (documented;
  // pass max_seq_len to keep the call sync-free and capturable in a CUDA graph).
  const int64_t max_len = max_seq_len.has_value() ? *max_seq_len
                          : seq_lens.numel() == 0 ? 0
                                                  : seq_lens.max().item<int64_t>();
  at::Tensor out = at::empty_like(query, query.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t partition_size = kDefaultPartitionSize;
  // A window bounds the context every query attends to, so it is the length that decides
  // (the scratch below still spans max_len: partitions are fixed positions of the sequence).
  const int64_t attended_len = sliding_window > 0 ? std::min(max_len, sliding_window) : max_len;
  if (!should_use_v2(query.is_cuda(), multiprocessor_count(query), num_seqs, num_heads, key_cache.size(2),
                     attended_len, partition_size)) {
    static auto v1 = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("pagedkv::paged_attention_v1", "")
                         .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, double, int64_t,
                                     const std::optional<at::Tensor>&, int64_t, double, c10::string_view,
                                     const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
    v1.call(out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_len, alibi_slopes, sliding_window,
            logits_soft_cap, kv_cache_dtype, k_scale, v_scale);
    return out;
  }
  const int64_t num_partitions = (max_len + partition_size - 1) / partition_size;
  auto f32 = query.options().dtype(at::kFloat);
  at::Tensor exp_sums = at::empty({num_seqs, num_heads, num_partitions}, f32);
  at::Tensor max_logits = at::empty({num_seqs, num_heads, num_partitions}, f32);
  at::Tensor tmp_out = at::empty({num_seqs, num_heads, num_partitions, head_size}, query.options());
  static auto v2 = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pagedkv::paged_attention_v2", "")
                       .typed<void(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   double, int64_t, const std::optional<at::Tensor>&, int64_t, int64_t, double,
                                   c10::string_view, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&)>();
  v2.call(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_len,
          alibi_slopes, partition_size, sliding_window, logits_soft_cap, kv_cache_dtype, k_scale, v_scale);
  return out;
}

}  // namespace pagedkv
