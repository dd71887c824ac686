// Every op's C++ declaration, in one place. Schemas live in torch_bindings.cpp;
// Python wrappers with docstrings live in python/pagedkv/ops.py.
//
// Cache layout (per layer): key_cache and value_cache are each
//   [num_blocks, block_size, num_kv_heads, head_size], contiguous.
// block_tables int32 [num_seqs, max_blocks_per_seq]; seq_lens int32 [num_seqs];
// slot_mapping int64 [num_tokens], slot = block_id * block_size + offset,
// a negative slot means "skip this token" (padding).
//
// Quantized caches (trailing kv_cache_dtype, k_scale, v_scale; common/kv_cache_dtype.h):
// "auto" is the compute dtype; fp8 caches hold float8 codes with per-tensor float32 [1]
// scales; the per-token-head formats hold uint8 codes and a float16 (scale, zero) plane
// [num_blocks, block_size, num_kv_heads, 2] per K and V, written by the cache writers
// (mutable there) and read by the attention ops.
//
// Attention options (trailing, defaults off): sliding_window W > 0 lets a query at
// position p attend to keys p - W < k <= p only (block-table entries of blocks wholly
// before every query's window are never read); logits_soft_cap c > 0 turns each score
// s = scale * q.k into c * tanh(s / c) before ALiBi and the softmax.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <vector>

namespace pagedkv {

// ---- CPU implementations (csrc/cpu/) ---------------------------------------
void paged_attention_v1_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                            const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                            double logits_soft_cap, c10::string_view kv_cache_dtype,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);

void paged_attention_v2_cpu(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                            at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                            const std::optional<at::Tensor>& alibi_slopes, int64_t partition_size,
                            int64_t sliding_window, double logits_soft_cap, c10::string_view kv_cache_dtype,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);

void paged_prefill_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, int64_t max_query_len, int64_t max_seq_len,
                                 int64_t sliding_window, double logits_soft_cap, c10::string_view kv_cache_dtype,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping,
    c10::string_view kv_cache_dtype, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale);

void copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches,
                     const at::Tensor& block_mapping, const std::optional<at::TensorList>& key_scales,
                     const std::optional<at::TensorList>& value_scales);

void swap_blocks_cpu(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping);

// Fused per-layer ops (csrc/cpu/fused.cpp). input/out/residual [num_tokens, hidden_size];
// fused_add_rms_norm: residual <- input + residual, input <- rms_norm(residual) * weight.
void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon);
void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon);
// The MLP's gated activation, vLLM's ops: out [T, d] <- act(input[:, :d]) * input[:, d:].
void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input);
void gelu_and_mul_cpu(at::Tensor& out, const at::Tensor& input);
void gelu_tanh_and_mul_cpu(at::Tensor& out, const at::Tensor& input);
// RoPE on query/key in place (positions into cos_sin_cache [max_position, rot_dim]), then
// the rotated key and the value into their cache slots, as reshape_and_cache.
void rotary_embedding_and_cache_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                    const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                                    const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache, bool is_neox,
    c10::string_view kv_cache_dtype, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale);

// Fused mixture-of-experts with SwiGLU experts (csrc/cpu/moe.cpp). hidden [T, H];
// w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], both hidden's dtype;
// topk_weights [T, K] float32 or hidden's dtype; topk_ids int32/int64 [T, K] in [0, E).
// Returns out [T, H] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]).
// w13_packed / w2_packed: optional, one weight per expert (w13[e] / w2[e] packed), each
// either pagedkv's (pack_linear_weight) or oneDNN's (mkldnn._reorder_linear_weight); every
// expert with rows then runs on its packed weight and the plain one is not read.
at::Tensor fused_moe_cpu(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                         const std::optional<at::TensorList>& w13_packed,
                         const std::optional<at::TensorList>& w2_packed);

// The CPU linear layer (csrc/cpu/gemm.cpp): weight [N, K] float32 / bfloat16 -> its packed
// form; out [M, N] <- input [M, K] @ weight^T (+ bias [N]), all one dtype, rows dense.
at::Tensor pack_linear_weight_cpu(const at::Tensor& weight);
// One token per row of float32 logits [n, vocab] (pagedkv.model.sampler's draw without
// filters): temperature 0 takes the row's first maximum, else the first token whose running
// sum of exp((logit - max) / T) reaches uniforms[r] times the row's total. out: int64 [n].
void sample_from_logits_cpu(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperatures,
                            const at::Tensor& uniforms);
// Structured outputs: in logits row rows[i], every token whose bit in bitmask[i] is 0 gets -inf
// (bit t % 32 of int32 word t / 32, as xgrammar fills them).
void apply_token_bitmask_cpu(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);

// The shape pack_linear_weight gives a [N, K] weight of dtype t (float32 / bfloat16).
std::vector<int64_t> packed_linear_weight_shape(int64_t N, int64_t K, c10::ScalarType t);
void packed_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                       const std::optional<at::Tensor>& bias);
// Products of row groups on their own packed weights, in one parallel region: rows
// [offsets[g], offsets[g + 1]) of input times packed_weights[g] into the same rows of out,
// for each g in groups (fused_moe's experts). Each group is checked as packed_linear checks.
void packed_linear_grouped_cpu(at::Tensor& out, const at::Tensor& input, at::TensorList packed_weights,
                               const std::vector<int64_t>& groups, const std::vector<int64_t>& offsets);

// ---- Device-generic -------------------------------------------------------------
// Allocates the output (and v2 scratch) and picks v1 or v2 (paged_attention_select.cpp).
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, std::optional<int64_t> max_seq_len,
                           const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                           double logits_soft_cap, c10::string_view kv_cache_dtype,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);

// Multi-LoRA linear (csrc/lora/lora.cpp; punica's SGMV shrink then expand, ATen calls only):
// out [T, N] += per adapter slot s, on the rows token_rows[slot_starts[s] : slot_starts[s + 1]],
// (input[rows] [n, K] @ lora_a[s]^T [K, n_slices * R]) with slice j's R columns times
// lora_b[s, off_j : off_j+1, :]^T into out's columns off_j .. off_j+1 (off = slice_offsets).
// lora_a [S, n_slices * R, K], lora_b [S, N, R] (scaling folded in), out/input/lora_a/lora_b one
// float dtype and device; token_rows int64 [M], slot_starts int64 [S + 1] on that device. On CUDA
// the index values are copied to the host once per call (a sync: not capturable in a CUDA graph).
void lora_linear_add(at::Tensor& out, const at::Tensor& input, const at::Tensor& lora_a, const at::Tensor& lora_b,
                     const at::Tensor& token_rows, const at::Tensor& slot_starts, at::IntArrayRef slice_offsets);

// True when the split-K v2 kernel should be used for this shape on this device;
// num_sms: the CUDA device's multiprocessor count (unused on the CPU).
bool should_use_v2(bool is_cuda, int64_t num_sms, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t max_seq_len, int64_t partition_size);

// ---- CUDA implementations (csrc/cuda/, built when PAGEDKV_WITH_CUDA) -------
#ifdef PAGEDKV_WITH_CUDA
void paged_attention_v1_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                             const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                             double logits_soft_cap, c10::string_view kv_cache_dtype,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);

void paged_attention_v2_cuda(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                             at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                             const std::optional<at::Tensor>& alibi_slopes, int64_t partition_size,
                            int64_t sliding_window, double logits_soft_cap, c10::string_view kv_cache_dtype,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);

void paged_prefill_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                  double scale, int64_t max_query_len, int64_t max_seq_len,
                                 int64_t sliding_window, double logits_soft_cap, c10::string_view kv_cache_dtype,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping,
    c10::string_view kv_cache_dtype, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale);

void copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches,
                      const at::Tensor& block_mapping, const std::optional<at::TensorList>& key_scales,
                     const std::optional<at::TensorList>& value_scales);

// Handles GPU->GPU, GPU->CPU and CPU->GPU (the dispatcher routes here whenever
// either side is a CUDA tensor).
void swap_blocks_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping);

void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& input);
void gelu_and_mul_cuda(at::Tensor& out, const at::Tensor& input);
void gelu_tanh_and_mul_cuda(at::Tensor& out, const at::Tensor& input);
void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon);
void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon);
void rotary_embedding_and_cache_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                     const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                                     const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache, bool is_neox,
    c10::string_view kv_cache_dtype, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale);

// Multiprocessor count of a CUDA device, read once per device and cached (no sync).
int64_t cuda_multiprocessor_count(int device);
#endif

}  // namespace pagedkv
