// C entry points over the kernel launchers, for ctypes (see check_kernels.py).
#include "emu.h"
#include "attention/attention_launch.h"
#include "cache/cache_launch.h"
#include "fused/fused_launch.h"
using namespace pagedkv::cuda;

// The cache format of the following launches (emu_set_kv_format; auto until set), so the
// launch entry points keep one signature for every format.
static KVQuantArgs g_format;

extern "C" void emu_set_kv_format(int format, const float* k_scale, const float* v_scale, void* k_plane,
                                  void* v_plane) {
  g_format.format = static_cast<pagedkv::KVCacheDType>(format);
  g_format.k_scale = k_scale;
  g_format.v_scale = v_scale;
  g_format.k_plane = static_cast<__half*>(k_plane);
  g_format.v_plane = static_cast<__half*>(v_plane);
}

static PagedKV kv_of(const void* kc, const void* vc, const int* bt, const int* lens, int nb, int bs, int nkv, int hs,
                     int mbps) {
  PagedKV kv{};
  kv.key_cache = kc; kv.value_cache = vc; kv.block_tables = bt; kv.seq_lens = lens;
  kv.num_blocks = nb; kv.block_size = bs; kv.num_kv_heads = nkv; kv.head_size = hs; kv.max_blocks_per_seq = mbps;
  kv.format = g_format.format; kv.k_scale = g_format.k_scale; kv.v_scale = g_format.v_scale;
  kv.k_plane = g_format.k_plane; kv.v_plane = g_format.v_plane;
  return kv;
}

extern "C" int emu_decode(int version, int dtype, void* out, const void* query, long long out_stride,
                          long long q_stride, const void* kc, const void* vc, const int* bt, const int* lens,
                          int nb, int bs, int nkv, int hs, int mbps, const float* alibi, float scale, int num_seqs,
                          int num_heads, float* es, float* ml, void* tmp, int max_parts, int part_size,
                          int max_seq_len, int sliding_window, float soft_cap) {
  DecodeArgs a{};
  a.kv = kv_of(kc, vc, bt, lens, nb, bs, nkv, hs, mbps);
  a.out = out; a.query = query; a.out_stride = out_stride; a.query_stride = q_stride;
  a.alibi_slopes = alibi; a.scale = scale; a.num_seqs = num_seqs; a.num_heads = num_heads;
  a.dtype = static_cast<DType>(dtype);
  a.sliding_window = sliding_window; a.logits_soft_cap = soft_cap;
  if (version == 1) return launch_paged_attention_v1(a, nullptr);
  DecodeScratch s{es, ml, tmp, max_parts, part_size};
  return launch_paged_attention_v2(a, s, max_seq_len, nullptr);
}

extern "C" int emu_prefill(int dtype, void* out, const void* query, long long out_stride, long long q_stride,
                           const void* kc, const void* vc, const int* bt, const int* lens, int nb, int bs, int nkv,
                           int hs, int mbps, const int* qsl, float scale, int num_seqs, int num_heads,
                           int num_tokens, int max_query_len, int sliding_window, float soft_cap) {
  PrefillArgs a{};
  a.kv = kv_of(kc, vc, bt, lens, nb, bs, nkv, hs, mbps);
  a.out = out; a.query = query; a.out_stride = out_stride; a.query_stride = q_stride;
  a.query_start_loc = qsl; a.scale = scale; a.num_seqs = num_seqs; a.num_heads = num_heads;
  a.num_tokens = num_tokens; a.max_query_len = max_query_len; a.dtype = static_cast<DType>(dtype);
  a.sliding_window = sliding_window; a.logits_soft_cap = soft_cap;
  return launch_paged_prefill_attention(a, nullptr);
}

extern "C" int emu_reshape(const void* key, const void* value, long long kst, long long ksh, long long vst,
                           long long vsh, void* kc, void* vc, const long long* slots, long long num_tokens,
                           long long num_slots, int nkv, int hs, int esize, int dtype) {
  ReshapeAndCacheArgs a{key, value, kst, ksh, vst, vsh, kc, vc, reinterpret_cast<const int64_t*>(slots),
                        num_tokens, num_slots, nkv, hs, esize};
  a.dtype = static_cast<DType>(dtype);
  a.quant = g_format;
  return launch_reshape_and_cache(a, nullptr);
}

extern "C" int emu_copy_blocks(const long long* ptrs, int num_layers, const long long* mapping, long long num_pairs,
                               long long block_bytes, long long num_blocks) {
  return launch_copy_blocks(reinterpret_cast<const int64_t*>(ptrs), num_layers,
                            reinterpret_cast<const int64_t*>(mapping), num_pairs, block_bytes, num_blocks, nullptr);
}

extern "C" int emu_rms_norm(int dtype, void* out, long long out_stride, const void* input, long long input_stride,
                            void* residual, long long residual_stride, const void* weight, long long num_tokens,
                            int hidden_size, float epsilon) {
  RmsNormArgs a{static_cast<DType>(dtype), out, out_stride, input, input_stride, residual, residual_stride, weight,
                num_tokens, hidden_size, epsilon};
  return launch_rms_norm(a, nullptr);
}

extern "C" int emu_rotary_cache(int dtype, const long long* positions, void* q, long long qst, long long qsh, void* k,
                                long long kst, long long ksh, const void* v, long long vst, long long vsh, void* kc,
                                void* vc, const long long* slots, const float* cos_sin, long long max_position,
                                int rot_dim, long long num_tokens, int num_heads, int num_kv_heads, int head_size,
                                long long num_slots, int is_neox) {
  RotaryCacheArgs a{};
  a.dtype = static_cast<DType>(dtype);
  a.positions = reinterpret_cast<const int64_t*>(positions);
  a.query = q; a.query_stride_token = qst; a.query_stride_head = qsh;
  a.key = k; a.key_stride_token = kst; a.key_stride_head = ksh;
  a.value = v; a.value_stride_token = vst; a.value_stride_head = vsh;
  a.key_cache = kc; a.value_cache = vc; a.slot_mapping = reinterpret_cast<const int64_t*>(slots);
  a.cos_sin_cache = cos_sin; a.max_position = max_position; a.rot_dim = rot_dim; a.num_tokens = num_tokens;
  a.num_heads = num_heads; a.num_kv_heads = num_kv_heads; a.head_size = head_size; a.num_slots = num_slots;
  a.is_neox = is_neox != 0;
  a.quant = g_format;
  return launch_rotary_embedding_and_cache(a, nullptr);
}
