// Block-copy ops on the CPU: write new K/V into the paged cache, copy blocks
// for copy-on-write, swap whole blocks between two CPU caches.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "common/validation.h"
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

}  // namespace

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const CacheDims c = check_kv_cache(key_cache, value_cache, "reshape_and_cache");
  check_kv_tokens("reshape_and_cache", "key", key, c, key_cache);
  check_kv_tokens("reshape_and_cache", "value", value, c, key_cache);
  TORCH_CHECK(value.size(0) == key.size(0), "reshape_and_cache: key has ", key.size(0), " tokens, value has ",
              value.size(0));
  const int64_t num_tokens = key.size(0);
  check_slot_mapping("reshape_and_cache", slot_mapping, num_tokens, c);
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

void copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "copy_blocks: got ", key_caches.size(),
              " key caches but ", value_caches.size(), " value caches");
  if (key_caches.empty()) return;
  const CacheDims c0 = check_kv_cache(key_caches[0], value_caches[0], "copy_blocks");
  for (size_t l = 0; l < key_caches.size(); ++l) {
    const CacheDims c = check_kv_cache(key_caches[l], value_caches[l], "copy_blocks");
    TORCH_CHECK(c.num_blocks == c0.num_blocks && key_caches[l].sizes() == key_caches[0].sizes() &&
                    key_caches[l].scalar_type() == key_caches[0].scalar_type(),
                "copy_blocks: layer ", l, " cache shape/dtype ", key_caches[l].sizes(), " ",
                key_caches[l].scalar_type(), " differs from layer 0 ", key_caches[0].sizes(), " ",
                key_caches[0].scalar_type());
  }
  TORCH_CHECK(block_mapping.defined() && block_mapping.is_cpu(), "copy_blocks: CPU caches need a CPU block_mapping");
  check_block_mapping("copy_blocks", block_mapping, c0.num_blocks, c0.num_blocks, /*disjoint_pairs=*/true);
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  const int64_t block_bytes = key_caches[0].stride(0) * key_caches[0].element_size();
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  // One task per (layer, K or V, pair): every task copies a whole block.
  at::parallel_for(0, num_layers * 2 * num_pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task % num_pairs;
      const int64_t layer = task / (2 * num_pairs);
      const bool is_value = (task / num_pairs) % 2;
      char* base = static_cast<char*>((is_value ? value_caches : key_caches)[layer].data_ptr());
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
