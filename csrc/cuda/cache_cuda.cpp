// CUDA block-copy ops: reshape_and_cache and copy_blocks launch the kernels of
// csrc/cache/cache_kernels.cu; swap_blocks moves whole blocks with
// cudaMemcpyAsync (GPU<->CPU, GPU->GPU), coalescing runs of consecutive blocks.
#include <ATen/ATen.h>
// The caching host allocator's header trips GCC's -Winterference-size (a note about its
// own alignas values, not about this file).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#endif
#include <ATen/core/CachingHostAllocator.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "cache/cache_launch.h"
#include "common/row_rotation.h"
#include "common/supported.h"
#include "common/validation.h"
#include "cuda/launch_checks.h"
#include "ops.h"

namespace pagedkv {
namespace {

void check_cuda_call(const char* op, const char* what, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, op, ": ", what, " failed: ", cudaGetErrorString(err));
}

// Whether [a, a + bytes) and [b, b + bytes) share a byte (UVA: host and device addresses never collide).
bool ranges_overlap(const char* a, const char* b, int64_t bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return x < y + bytes && y < x + bytes;
}

// One cudaMemcpyAsync per run of pairs (s, d), (s+1, d+1), ... of the mapping. A run stops
// before its source and destination ranges would overlap (src and dst may be one GPU tensor):
// an overlapping cudaMemcpy is undefined, while one copy per block, in stream order, gives the
// sequential dst[d] = src[s] of the reference.
void copy_block_runs(const char* op, const char* src, char* dst, const int64_t* pairs, int64_t num_pairs,
                     int64_t block_bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  int64_t i = 0;
  while (i < num_pairs) {
    const int64_t s0 = pairs[2 * i];
    const int64_t d0 = pairs[2 * i + 1];
    int64_t run = 1;
    while (i + run < num_pairs && pairs[2 * (i + run)] == s0 + run && pairs[2 * (i + run) + 1] == d0 + run &&
           !ranges_overlap(src + s0 * block_bytes, dst + d0 * block_bytes, (run + 1) * block_bytes)) {
      ++run;
    }
    check_cuda_call(op, "cudaMemcpyAsync",
                    cudaMemcpyAsync(dst + d0 * block_bytes, src + s0 * block_bytes, run * block_bytes, kind, stream));
    i += run;
  }
}

// A 4-D [num_blocks, ...] cache of copy_blocks: K and V alike, contiguous. What the
// elements hold (any dtype, quantized codes included) does not matter: bytes move.
void check_block_cache_shape(const char* op, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(key.defined() && value.defined() && key.dim() == 4, op,
              ": caches must be 4-D [num_blocks, block_size, num_kv_heads, X]");
  TORCH_CHECK(value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type(), op,
              ": value_cache shape/dtype ", value.sizes(), " ", value.scalar_type(), " differs from key_cache ",
              key.sizes(), " ", key.scalar_type());
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous(), op, ": caches must be contiguous");
  TORCH_CHECK(is_one_of(key.size(1), kSupportedBlockSizes), op, ": block_size ", key.size(1), " is not supported");
}

// The copy kernel reads whole blocks in units of up to 16 bytes from each base pointer.
void check_aligned(const char* op, int64_t layer, const char* what, const at::Tensor& t) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": layer ", layer, " ", what,
              " must be 16-byte aligned");
}

// One launch copying the mapped blocks of every layer's key and value tensor (caches or
// scale planes: the tensors of one list pair share shape and dtype).
void copy_layer_blocks(const char* op, at::TensorList keys, at::TensorList values, const at::Tensor& mapping_dev,
                       int64_t num_blocks) {
  const int64_t num_layers = static_cast<int64_t>(keys.size());
  // Base pointers of every layer (keys, then values), so one launch covers all layers.
  // Pinned, so the host->device copy is asynchronous; the pinned-memory allocator keeps
  // the buffer alive until the copy has run, the device allocator keeps both device
  // tables alive (stream-ordered reuse) until the kernel has read them.
  at::Tensor ptrs = at::empty({2 * num_layers}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* p = ptrs.data_ptr<int64_t>();
  for (int64_t l = 0; l < num_layers; ++l) {
    p[l] = reinterpret_cast<int64_t>(keys[l].data_ptr());
    p[num_layers + l] = reinterpret_cast<int64_t>(values[l].data_ptr());
  }
  const at::Tensor ptrs_dev = ptrs.to(mapping_dev.device(), /*non_blocking=*/true);
  const int64_t block_bytes = keys[0].stride(0) * keys[0].element_size();
  check_cuda_call(op, "kernel launch",
                  cuda::launch_copy_blocks(ptrs_dev.data_ptr<int64_t>(), static_cast<int>(num_layers),
                                           mapping_dev.data_ptr<int64_t>(), mapping_dev.size(0), block_bytes,
                                           num_blocks, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping, c10::string_view kv_cache_dtype,
                            std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale) {
  constexpr const char* op = "reshape_and_cache";
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const CacheDims& c = kv.dims;
  check_kv_tokens(op, key, value, c, key_cache);
  TORCH_CHECK(key_cache.is_cuda(), op, ": the CUDA kernel needs CUDA caches, got ", key_cache.device());
  TORCH_CHECK(slot_mapping.defined() && slot_mapping.device() == key_cache.device(), op,
              ": slot_mapping must be on the cache device ", key_cache.device(), ", got ",
              slot_mapping.defined() ? slot_mapping.device() : at::Device(at::kCPU));
  check_slot_mapping(op, slot_mapping, key.size(0), c);
  const c10::cuda::CUDAGuard guard(key_cache.device());
  // A rotated format stores rotated rows (common/row_rotation.h): the kernel quantizes those, from fp32.
  const bool rotate = rotates_rows(c.format);
  const at::Tensor k = rotate ? rotate_rows(key) : key;
  const at::Tensor v = rotate ? rotate_rows(value) : value;
  cuda::ReshapeAndCacheArgs a{};
  a.key = k.data_ptr();
  a.value = v.data_ptr();
  a.key_stride_token = k.stride(0);
  a.key_stride_head = k.stride(1);
  a.value_stride_token = v.stride(0);
  a.value_stride_head = v.stride(1);
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.num_tokens = key.size(0);
  a.num_slots = c.num_blocks * c.block_size;
  a.num_kv_heads = static_cast<int>(c.num_kv_heads);
  a.head_size = static_cast<int>(c.head_size);
  a.element_size = static_cast<int>(key_cache.element_size());
  a.dtype = cuda::to_kernel_dtype(k.scalar_type());
  a.quant = cuda::quant_args(kv);
  check_cuda_call(op, "kernel launch", cuda::launch_reshape_and_cache(a, c10::cuda::getCurrentCUDAStream()));
}

void copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping,
                      const std::optional<at::TensorList>& key_scales,
                      const std::optional<at::TensorList>& value_scales) {
  constexpr const char* op = "copy_blocks";
  TORCH_CHECK(key_caches.size() == value_caches.size(), op, ": got ", key_caches.size(), " key caches but ",
              value_caches.size(), " value caches");
  if (key_caches.empty()) return;
  check_block_cache_shape(op, key_caches[0], value_caches[0]);
  const int64_t num_blocks = key_caches[0].size(0);
  const at::Device device = key_caches[0].device();
  TORCH_CHECK(device.is_cuda(), op, ": the CUDA kernel needs CUDA caches, got ", device);
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(num_layers <= 65535, op, ": at most 65535 layers per call, got ", num_layers);
  for (int64_t l = 0; l < num_layers; ++l) {
    check_block_cache_shape(op, key_caches[l], value_caches[l]);
    TORCH_CHECK(key_caches[l].sizes() == key_caches[0].sizes() &&
                    key_caches[l].scalar_type() == key_caches[0].scalar_type(),
                op, ": layer ", l, " cache shape/dtype ", key_caches[l].sizes(), " ", key_caches[l].scalar_type(),
                " differs from layer 0 ", key_caches[0].sizes(), " ", key_caches[0].scalar_type());
    TORCH_CHECK(key_caches[l].device() == device, op, ": layer ", l, " cache is on ", key_caches[l].device(),
                ", layer 0 on ", device);
    check_aligned(op, l, "cache", key_caches[l]);
    check_aligned(op, l, "cache", value_caches[l]);
  }
  check_scale_planes(op, key_scales, value_scales, key_caches.size(), key_caches[0]);
  if (key_scales.has_value()) {
    for (int64_t l = 0; l < num_layers; ++l) {
      check_aligned(op, l, "key scale plane", (*key_scales)[l]);
      check_aligned(op, l, "value scale plane", (*value_scales)[l]);
    }
  }
  check_block_mapping(op, block_mapping, num_blocks, num_blocks, /*disjoint_pairs=*/true);
  TORCH_CHECK(block_mapping.is_cpu() || block_mapping.device() == device, op, ": block_mapping is on ",
              block_mapping.device(), " but the caches are on ", device);
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0) return;
  const c10::cuda::CUDAGuard guard(device);

  const at::Tensor mapping_dev = block_mapping.to(device, /*non_blocking=*/true).contiguous();
  copy_layer_blocks(op, key_caches, value_caches, mapping_dev, num_blocks);
  // The per-token-head planes are indexed by block id like the values: same pairs.
  if (key_scales.has_value()) copy_layer_blocks(op, *key_scales, *value_scales, mapping_dev, num_blocks);
}

void swap_blocks_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  constexpr const char* op = "swap_blocks";
  TORCH_CHECK(src.defined() && dst.defined(), op, ": src and dst are required");
  TORCH_CHECK(src.dim() >= 2 && dst.dim() == src.dim() && src.sizes().slice(1) == dst.sizes().slice(1), op,
              ": src and dst must hold blocks of one shape ([num_blocks, ...]), got ", src.sizes(), " and ",
              dst.sizes());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), op, ": src dtype ", src.scalar_type(),
              " differs from dst dtype ", dst.scalar_type());
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), op, ": src and dst must be contiguous");
  TORCH_CHECK((src.is_cuda() || src.is_cpu()) && (dst.is_cuda() || dst.is_cpu()) && (src.is_cuda() || dst.is_cuda()),
              op, ": the CUDA implementation copies between CUDA and CPU tensors, got src on ", src.device(),
              " and dst on ", dst.device());
  TORCH_CHECK(!(src.is_cuda() && dst.is_cuda()) || src.device() == dst.device(), op,
              ": GPU->GPU swaps must stay on one device, got src on ", src.device(), " and dst on ", dst.device());
  TORCH_CHECK(block_mapping.defined() && block_mapping.is_cpu(), op, ": block_mapping must be a CPU tensor, got ",
              block_mapping.defined() ? block_mapping.device() : at::Device(at::kCPU));
  check_block_mapping(op, block_mapping, src.size(0), dst.size(0));
  const at::Tensor mapping = block_mapping.contiguous();
  if (mapping.size(0) == 0) return;
  const cudaMemcpyKind kind = src.is_cuda() ? (dst.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                            : cudaMemcpyHostToDevice;
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  const int64_t block_bytes = src.stride(0) * src.element_size();
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  copy_block_runs(op, static_cast<const char*>(src.data_ptr()), static_cast<char*>(dst.data_ptr()),
                  mapping.data_ptr<int64_t>(), mapping.size(0), block_bytes, kind, stream);
  // With pinned host memory the copies are still pending when this returns. Tell the caching
  // host allocator, as a non_blocking Tensor.to() does, so that a host tensor the caller drops
  // now is not handed out again before they have run (pageable or foreign memory: a no-op).
  const at::Tensor& host = src.is_cuda() ? dst : src;
  if (host.is_cpu()) {
    const c10::DataPtr& data = host.storage().data_ptr();
    at::getHostAllocator(at::kCUDA)->record_event(data.get(), data.get_context(), stream);
  }
}

}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("reshape_and_cache", &pagedkv::reshape_and_cache_cuda);
  m.impl("copy_blocks", &pagedkv::copy_blocks_cuda);
  m.impl("swap_blocks", &pagedkv::swap_blocks_cuda);
}
