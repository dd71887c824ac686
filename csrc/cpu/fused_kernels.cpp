// CPU kernels of the fused per-layer ops: RMSNorm (with the residual add), RoPE
// with the KV-cache write, and the MLP's gated activation. Vectorized with at::vec
// (fp32 arithmetic on every dtype), parallel over tokens with at::parallel_for.
// Compiled once per CPU_CAPABILITY (see fused_kernels.h).
//
// Rounding follows the unfused PyTorch sequence each op replaces, so the model's
// outputs do not move: the residual sum is rounded to the storage dtype before its
// sum of squares is taken, and the 16-bit norms round x / rms(x) to the dtype before
// scaling by the weight (HF's LlamaRMSNorm and vLLM's kernel do the same). RoPE
// computes in fp32 from the fp32 cos/sin table and rounds once (the unfused bf16
// path rounds cos/sin and each product: last-ulp differences, see tests).
#include "cpu/fused_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace pagedkv::cpu::CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kW = Vec::size();

// Elements per step: one fp32 vector, or one Vectorized<T> (two fp32 vectors) for 16-bit T.
template <typename T>
constexpr int kStep = std::is_same_v<T, float> ? kW : 2 * kW;

// Loads count <= kStep<T> elements as fp32 (lanes past count are zero).
template <typename T>
inline void load(const T* p, int64_t count, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = Vec::loadu(p, count);
    hi = Vec(0.f);
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, count));
  }
}

// Stores the first count <= kStep<T> lanes, rounded to T.
template <typename T>
inline void store(T* p, int64_t count, const Vec& lo, const Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(p, count);
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(p, count);
  }
}

// fp32 lanes rounded to T and back (what storing then reloading would give).
template <typename T>
inline void round_to(Vec& lo, Vec& hi) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
  }
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Loads count <= 2 * kW fp32 values as two vectors.
inline void load_f32_pair(const float* p, int64_t count, Vec& lo, Vec& hi) {
  lo = Vec::loadu(p, std::min<int64_t>(count, kW));
  hi = count > kW ? Vec::loadu(p + kW, count - kW) : Vec(0.f);
}

// Tokens per parallel task: enough elements per task (~64k) that a task outweighs
// the cost of waking a thread (tens of microseconds on a loaded machine); decode
// batches of a small model (48 x 576 for the norms, 48 x 960 for RoPE) run inline.
int64_t grain_for(int64_t elements_per_token) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, elements_per_token));
}

// ---- RMSNorm ---------------------------------------------------------------------

template <typename T>
void rms_norm_row(const RmsNormParams& p, int64_t t) {
  constexpr int S = kStep<T>;
  const int64_t n = p.hidden_size;
  const T* x = static_cast<const T*>(p.input) + t * p.input_stride;
  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + t * p.out_stride;
  Vec acc_lo(0.f), acc_hi(0.f);
  const T* z = x;  // the row to normalize, as stored in T
  if (p.residual != nullptr) {
    T* r = static_cast<T*>(p.residual) + t * p.residual_stride;
    for (int64_t i = 0; i < n; i += S) {
      const int64_t c = std::min<int64_t>(S, n - i);
      Vec a0, a1, b0, b1;
      load(x + i, c, a0, a1);
      load(r + i, c, b0, b1);
      a0 = a0 + b0;
      a1 = a1 + b1;
      store(r + i, c, a0, a1);
      round_to<T>(a0, a1);  // the sum of squares is of the residual as stored
      acc_lo = at::vec::fmadd(a0, a0, acc_lo);
      acc_hi = at::vec::fmadd(a1, a1, acc_hi);
    }
    z = r;
  } else {
    for (int64_t i = 0; i < n; i += S) {
      Vec a0, a1;
      load(x + i, std::min<int64_t>(S, n - i), a0, a1);
      acc_lo = at::vec::fmadd(a0, a0, acc_lo);
      acc_hi = at::vec::fmadd(a1, a1, acc_hi);
    }
  }
  const float inv_rms = 1.f / std::sqrt(hsum(acc_lo + acc_hi) / static_cast<float>(n) + p.epsilon);
  const Vec scale(inv_rms);
  for (int64_t i = 0; i < n; i += S) {
    const int64_t c = std::min<int64_t>(S, n - i);
    Vec a0, a1, w0, w1;
    load(z + i, c, a0, a1);
    load(w + i, c, w0, w1);
    a0 = a0 * scale;
    a1 = a1 * scale;
    round_to<T>(a0, a1);  // 16-bit: x / rms(x) in T, then times the weight (HF's order)
    store(out + i, c, a0 * w0, a1 * w1);
  }
}

template <typename T>
void rms_norm_impl(const RmsNormParams& p) {
  at::parallel_for(0, p.num_tokens, grain_for(p.hidden_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row<T>(p, t);
  });
}

// ---- RoPE + cache write -------------------------------------------------------------

// Rotate-half (GPT-NeoX) pairs (i, i + half), i < half.
template <typename T>
inline void rotate_neox(T* x, const float* cos, const float* sin, int64_t half) {
  constexpr int S = kStep<T>;
  for (int64_t i = 0; i < half; i += S) {
    const int64_t c = std::min<int64_t>(S, half - i);
    Vec x1a, x1b, x2a, x2b, ca, cb, sa, sb;
    load(x + i, c, x1a, x1b);
    load(x + half + i, c, x2a, x2b);
    load_f32_pair(cos + i, c, ca, cb);
    load_f32_pair(sin + i, c, sa, sb);
    store(x + i, c, x1a * ca - x2a * sa, x1b * cb - x2b * sb);
    store(x + half + i, c, x2a * ca + x1a * sa, x2b * cb + x1b * sb);
  }
}

// GPT-J pairs (2i, 2i + 1). Scalar: no Llama-family model uses it (the loops are
// short and the compiler unrolls them); vectorize if a GPT-J model is served.
template <typename T>
inline void rotate_gptj(T* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = static_cast<float>(x[2 * i]), x1 = static_cast<float>(x[2 * i + 1]);
    x[2 * i] = static_cast<T>(x0 * cos[i] - x1 * sin[i]);
    x[2 * i + 1] = static_cast<T>(x1 * cos[i] + x0 * sin[i]);
  }
}

template <typename T>
void rotary_cache_token(const RotaryCacheParams& p, int64_t t) {
  const int64_t pos = p.positions[t];
  const int64_t half = p.rot_dim / 2;
  T* q = static_cast<T*>(p.query) + t * p.query_stride_token;
  T* k = static_cast<T*>(p.key) + t * p.key_stride_token;
  // An out-of-range position (only possible with the index checks off) leaves q/k unrotated
  // rather than reading outside the table.
  if (pos >= 0 && pos < p.max_position) {
    const float* cos = p.cos_sin_cache + pos * p.rot_dim;
    const float* sin = cos + half;
    for (int64_t h = 0; h < p.num_heads; ++h) {
      T* x = q + h * p.query_stride_head;
      p.is_neox ? rotate_neox(x, cos, sin, half) : rotate_gptj(x, cos, sin, half);
    }
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      T* x = k + h * p.key_stride_head;
      p.is_neox ? rotate_neox(x, cos, sin, half) : rotate_gptj(x, cos, sin, half);
    }
  }
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0 || slot >= p.num_slots) return;  // padding (or an id the host check refuses)
  const int64_t row = p.num_kv_heads * p.head_size;
  const int64_t head_bytes = p.head_size * static_cast<int64_t>(sizeof(T));
  T* kc = static_cast<T*>(p.key_cache) + slot * row;
  T* vc = static_cast<T*>(p.value_cache) + slot * row;
  const T* v = static_cast<const T*>(p.value) + t * p.value_stride_token;
  for (int64_t h = 0; h < p.num_kv_heads; ++h) {
    std::memcpy(kc + h * p.head_size, k + h * p.key_stride_head, head_bytes);
    std::memcpy(vc + h * p.head_size, v + h * p.value_stride_head, head_bytes);
  }
}

template <typename T>
void rotary_cache_impl(const RotaryCacheParams& p) {
  const int64_t per_token = (p.num_heads + 2 * p.num_kv_heads) * p.head_size;
  at::parallel_for(0, p.num_tokens, grain_for(per_token), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rotary_cache_token<T>(p, t);
  });
}

// ---- Gated activation (the MLP's act(gate) * up) ------------------------------------------

// act(x) in fp32 with the formulas (and the operation order) of PyTorch's own CPU kernels
// for F.silu and F.gelu, so that the fused op stores what the unfused sequence stored.
template <GatedActivation A>
inline Vec activate(const Vec& x) {
  const Vec one(1.f);
  if constexpr (A == GatedActivation::kSilu) {
    return x / (one + x.neg().exp());
  } else if constexpr (A == GatedActivation::kGelu) {
    return x * Vec(0.5f) * (one + (x * Vec(static_cast<float>(M_SQRT1_2))).erf());
  } else {
    const Vec inner = Vec(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)) * (x + Vec(0.044715f) * (x * x * x));
    return Vec(0.5f) * x * (one + inner.tanh());
  }
}

template <typename T, GatedActivation A>
void act_and_mul_row(const ActAndMulParams& p, int64_t t) {
  constexpr int S = kStep<T>;
  const T* gate = static_cast<const T*>(p.input) + t * p.input_stride;
  const T* up = gate + p.d;
  T* out = static_cast<T*>(p.out) + t * p.out_stride;
  for (int64_t i = 0; i < p.d; i += S) {
    const int64_t c = std::min<int64_t>(S, p.d - i);
    Vec g0, g1, u0, u1;
    load(gate + i, c, g0, g1);
    load(up + i, c, u0, u1);
    g0 = activate<A>(g0);
    g1 = activate<A>(g1);
    round_to<T>(g0, g1);  // act(gate) as stored in T, then the product
    store(out + i, c, g0 * u0, g1 * u1);
  }
}

template <typename T, GatedActivation A>
void act_and_mul_impl(const ActAndMulParams& p) {
  at::parallel_for(0, p.num_tokens, grain_for(2 * p.d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) act_and_mul_row<T, A>(p, t);
  });
}

template <typename T>
void act_and_mul_dispatch(const ActAndMulParams& p) {
  switch (p.activation) {
    case GatedActivation::kSilu:
      return act_and_mul_impl<T, GatedActivation::kSilu>(p);
    case GatedActivation::kGelu:
      return act_and_mul_impl<T, GatedActivation::kGelu>(p);
    case GatedActivation::kGeluTanh:
      return act_and_mul_impl<T, GatedActivation::kGeluTanh>(p);
  }
  TORCH_CHECK(false, "act_and_mul: unknown activation ", static_cast<int>(p.activation));
}

template <typename F>
void dispatch(c10::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return f(float{});
    case c10::ScalarType::BFloat16:
      return f(c10::BFloat16{});
    case c10::ScalarType::Half:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

}  // namespace

void rms_norm(const RmsNormParams& p) {
  dispatch(p.dtype, "rms_norm", [&](auto tag) { rms_norm_impl<decltype(tag)>(p); });
}

void rotary_embedding_and_cache(const RotaryCacheParams& p) {
  dispatch(p.dtype, "rotary_embedding_and_cache", [&](auto tag) { rotary_cache_impl<decltype(tag)>(p); });
}

void act_and_mul(const ActAndMulParams& p) {
  dispatch(p.dtype, "act_and_mul", [&](auto tag) { act_and_mul_dispatch<decltype(tag)>(p); });
}

}  // namespace pagedkv::cpu::CPU_CAPABILITY
