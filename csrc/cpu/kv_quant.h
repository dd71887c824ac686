// Writing new tokens into a quantized KV cache on the CPU (the writers of
// reshape_and_cache and rotary_embedding_and_cache). The rule, bit for bit the one of
// pagedkv.reference.quantize_kv and of the CUDA writers:
//  - fp8: code = fp8(clamp(x * (1 / scale), +-max)), rounded to nearest even;
//  - per token and kv head: zero = fp16(min), scale = fp16((max - min) / code_max),
//    code = clamp(rint((x - zero) * (1 / scale)), 0, code_max) with the fp16 values
//    read back as fp32 (1 / scale taken as 0 when scale is 0); int4 packs element 2i
//    in the low nibble of byte i.
#pragma once

#include <ATen/core/Tensor.h>

#include "common/validation.h"

namespace pagedkv::cpu {

// key/value [num_tokens, num_kv_heads, head_size] (compute dtype, rows may be strided)
// into the slots of slot_mapping (negative: skip) of a cache in kv.dims.format (not auto).
void write_quantized_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping, const KVCacheArgs& kv);

}  // namespace pagedkv::cpu
