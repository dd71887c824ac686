// Block-copy ops on the CPU: write new K/V into the paged cache (quantizing it for
// a quantized kv_cache_dtype, cpu/kv_quant.h), copy blocks for copy-on-write (with
// their scale planes), swap whole blocks between two CPU caches.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "common/supported.h"
#include "common/validation.h"
#include "cpu/kv_quant.h"
#include "ops.h"

namespace pagedkv {
namespace {

// Bytes of one cache token row (num_kv_heads * head_size elements).
int64_t token_row_bytes(const at::Tensor& cache) { return cache.stride(1) * cache.element_size(); }

// Copy one [num_kv_heads, head_size] token into a cache slot; the source may be strided
// (e.g. a slice of a fused QKV projection), the destination is contiguous.
void copy_token(const at::Tensor& src, int64_t token, char* dst_row) {
  const int64_t heads = src.size(1), head_bytes = src.size(2) * src.element_size();
  const char* base = static_cast<const char*>(src.const_data_ptr()) + token * src.stride(0) * src.element_size();
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(dst_row + h * head_bytes, base + h * src.stride(1) * src.element_size(), head_bytes);
  }
}

// One layer's key/value caches for a block copy: 4-D [num_blocks, ...], one shape, dtype
// and device across K, V and every layer (what they hold does not matter: bytes move).
void check_block_cache(const char* op, size_t layer, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& first) {
  TORCH_CHECK(key.defined() && value.defined() && key.dim() == 4, op, ": layer ", layer,
              " caches must be 4-D [num_blocks, block_size, num_kv_heads, X]");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), op, ": value_cache dtype ", value.scalar_type(),
              " differs from key_cache dtype ", key.scalar_type());
  for (const at::Tensor& t : {key, value}) {
    TORCH_CHECK(t.sizes() == first.sizes() && t.scalar_type() == first.scalar_type(), op, ": layer ", layer,
                " cache shape/dtype ", t.sizes(), " ", t.scalar_type(), " differs from layer 0 ", first.sizes(), " ",
                first.scalar_type());
  }
  TORCH_CHECK(is_one_of(first.size(1), kSupportedBlockSizes), op, ": block_size ", first.size(1),
              " is not supported");
  TORCH_CHECK(key.is_cpu() && value.is_cpu() && key.is_contiguous() && value.is_contiguous(), op,
              ": CPU caches must be contiguous CPU tensors");
}

}  // namespace

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping, c10::string_view kv_cache_dtype,
                           std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale) {
  const char* op = "reshape_and_cache";
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const CacheDims& c = kv.dims;
  check_kv_tokens(op, key, value, c, key_cache);
  const int64_t num_tokens = key.size(0);
  check_slot_mapping(op, slot_mapping, num_tokens, c);
  TORCH_CHECK(key_cache.is_cpu() && slot_mapping.is_cpu(), op, ": the CPU kernel needs CPU tensors");
  if (c.format != KVCacheDType::kAuto) return cpu::write_quantized_tokens(key, value, key_cache, value_cache,
                                                                          slot_mapping, kv);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t row = token_row_bytes(key_cache);
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding token
      copy_token(key, t, kc + slots[t] * row);
      copy_token(value, t, vc + slots[t] * row);
    }
  });
}

void copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping,
                     const std::optional<at::TensorList>& key_scales,
                     const std::optional<at::TensorList>& value_scales) {
  const char* op = "copy_blocks";
  TORCH_CHECK(key_caches.size() == value_caches.size(), op, ": got ", key_caches.size(), " key caches but ",
              value_caches.size(), " value caches");
  if (key_caches.empty()) return;
  for (size_t l = 0; l < key_caches.size(); ++l) check_block_cache(op, l, key_caches[l], value_caches[l], key_caches[0]);
  check_scale_planes(op, key_scales, value_scales, key_caches.size(), key_caches[0]);
  const int64_t num_blocks = key_caches[0].size(0);
  TORCH_CHECK(block_mapping.defined() && block_mapping.is_cpu(), op, ": CPU caches need a CPU block_mapping");
  check_block_mapping(op, block_mapping, num_blocks, num_blocks, /*disjoint_pairs=*/true);
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  // Every block-indexed tensor: each layer's K and V values, then its scale planes.
  std::vector<at::Tensor> tensors(key_caches.begin(), key_caches.end());
  tensors.insert(tensors.end(), value_caches.begin(), value_caches.end());
  if (key_scales.has_value()) {
    tensors.insert(tensors.end(), key_scales->begin(), key_scales->end());
    tensors.insert(tensors.end(), value_scales->begin(), value_scales->end());
  }
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  // One task per (tensor, pair): every task copies a whole block.
  at::parallel_for(0, num_tensors * num_pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const at::Tensor& t = tensors[task / num_pairs];
      const int64_t pair = task % num_pairs;
      const int64_t block_bytes = t.stride(0) * t.element_size();
      char* base = static_cast<char*>(t.data_ptr());
      std::memcpy(base + pairs[2 * pair + 1] * block_bytes, base + pairs[2 * pair] * block_bytes, block_bytes);
    }
  });
}

void swap_blocks_cpu(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  TORCH_CHECK(src.defined() && dst.defined(), "swap_blocks: src and dst are required");
  TORCH_CHECK(src.dim() >= 2 && dst.dim() == src.dim() && src.sizes().slice(1) == dst.sizes().slice(1),
              "swap_blocks: src and dst must hold blocks of one shape ([num_blocks, ...]), got ", src.sizes(),
              " and ", dst.sizes());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "swap_blocks: src dtype ", src.scalar_type(),
              " differs from dst dtype ", dst.scalar_type());
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "swap_blocks: src and dst must be contiguous");
  TORCH_CHECK(block_mapping.defined() && block_mapping.is_cpu(), "swap_blocks: block_mapping must be a CPU tensor");
  check_block_mapping("swap_blocks", block_mapping, src.size(0), dst.size(0));
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const int64_t block_bytes = src.stride(0) * src.element_size();
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  at::parallel_for(0, mapping.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(d + pairs[2 * i + 1] * block_bytes, s + pairs[2 * i] * block_bytes, block_bytes);
    }
  });
}

}  // namespace pagedkv
