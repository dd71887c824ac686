// Prefill attention on AMX tiles (bf16 queries, CPUs with AMX-BF16). Compiled only into the
// AVX512_BF16 variant with -mamx-tile -mamx-bf16 (CMakeLists.txt); prefill_task_amx
// (attention_kernels.cpp) packs each task's query and key tiles and calls these where
// PrefillParams::use_amx says the tiles are on.
//
// The layout is the one the register prefill keeps, rows (query token x head of the group) as
// the last dimension, so both products come out of the tiles with keys (or dims) as tile
// rows and query rows as tile columns, and the softmax stays vectorized across rows:
//   Q.K^T: scores^T [keys][rows] = K [keys][D] . Q^T. The key rows are the A tiles as they
//     are; Q^T is the B operand, the query's pairs of dims by row ([dp / 2][rp] dwords, packed
//     once per task by amx_pack_query).
//   P.V: out^T [D][rows] += V^T [D][keys] . P^T. V^T is the A operand: the value rows
//     transposed once per key tile of kAmxKeyTile (amx_pack_values), shared by all the row
//     tiles of the task; the probabilities, rounded to bf16, go in pairs of keys by row
//     (softmax_step).
// Every tile is 16 x 64 bytes (amx_tiles.h).
#include "cpu/attention_kernels.h"

#include "cpu/amx_tiles.h"

#include <ATen/cpu/vec/vec.h>

#include <immintrin.h>

#include <algorithm>
#include <limits>

namespace pagedkv::cpu::CPU_CAPABILITY {
namespace {

// Rows r[0..15] of 16 dwords become their columns: r[k] lane j = old r[j] lane k. Dwords
// interleave within 128-bit lanes (r[4i + c] lane L = column 4L + c of rows 4i..4i+3), then
// the 128-bit lanes of each set of four are transposed.
inline void transpose_16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);       // u[c] lanes 0,1; u[4+c] lanes 0,1
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);       // lanes 2,3 of both
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// 16 bf16 at p as the low halves of 16 dwords (zeros for a null row).
inline __m512i widen_row(const c10::BFloat16* p) {
  return p ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))) : _mm512_setzero_si512();
}


// e^x, 16 lanes: 2^k e^r with k = round(x / ln 2) and r = x - k ln 2 in [-ln 2 / 2, ln 2 / 2],
// e^r by Cephes expf's degree-7 polynomial (about 1 ulp), 2^k by vscalefps. Below -87 it is
// 0 (-inf included: masked keys); NaN stays NaN. Inlined here: ATen's exp_u20 was called out
// of line through the PLT, and the call spilled the live vectors (a tenth of the prefill's time).
inline __m512 exp_ps(__m512 x) {
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ);
  x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), _mm512_max_ps(_mm512_set1_ps(-87.f), x));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, k));
}

// Q.K^T of one row vector, stored unscaled: sum tiles tmm0-3 for keys 0-15, 16-31, 32-47 and
// 48-63 (those below n), the query pairs in tmm5, the key rows in tmm4/6/7 in turn.
inline void key_scores(const AmxPrefillState& st, const c10::BFloat16* keys, int n, int64_t v) {
  const int key_stride = static_cast<int>(st.dp * sizeof(c10::BFloat16));
  const int row_stride = static_cast<int>(st.rp * sizeof(float));
  auto k = [&](int c, int64_t s) { return keys + 16 * c * st.dp + 32 * s; };
  static_assert(kAmxKeyTile == 64, "four sum tiles of 16 keys");
  _tile_zero(0);
  if (n > 16) _tile_zero(1);
  if (n > 32) _tile_zero(2);
  if (n > 48) _tile_zero(3);
  for (int64_t s = 0; s < st.dp / 32; ++s) {
    _tile_loadd(5, st.qt + 16 * s * st.rp + 16 * v, row_stride);
    _tile_loadd(4, k(0, s), key_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (n > 16) {
      _tile_loadd(6, k(1, s), key_stride);
      _tile_dpbf16ps(1, 6, 5);
    }
    if (n > 32) {
      _tile_loadd(7, k(2, s), key_stride);
      _tile_dpbf16ps(2, 7, 5);
    }
    if (n > 48) {
      _tile_loadd(4, k(3, s), key_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  float* out = st.scores + 16 * v;
  _tile_stored(0, out, row_stride);
  if (n > 16) _tile_stored(1, out + 16 * st.rp, row_stride);
  if (n > 32) _tile_stored(2, out + 32 * st.rp, row_stride);
  if (n > 48) _tile_stored(3, out + 48 * st.rp, row_stride);
}

// The online-softmax step of one row vector over the key tile's n scores: masked (keys after a
// row's position, before its window), the running max and sum updated, and the probabilities
// rounded to bf16 in pairs of keys (pairs [kAmxKeyTile / 2][rp]); the accumulator rows
// rescaled where the max moved.
inline void softmax_step(const AmxPrefillState& st, const AmxKeyTile& kt, int64_t v) {
  const int64_t rp = st.rp;
  float* sc = st.scores + 16 * v;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // The scores stay unscaled where the scale is positive (it keeps their order) and nothing
  // caps them: the scale then goes into the exponent's FMA. Otherwise they are scaled (and
  // soft-capped) in place first.
  const bool in_place = st.soft_cap > 0.f || !(st.scale > 0.f);
  const bool masking = kt.causal_mask || kt.window_mask;
  const __m512 qpos = _mm512_loadu_ps(st.qpos + 16 * v);
  __m512 mx = neg_inf;
  for (int t = 0; t < kt.n; ++t) {
    __m512 x = _mm512_loadu_ps(sc + t * rp);
    if (in_place) {
      x = _mm512_mul_ps(x, _mm512_set1_ps(st.scale));
      if (st.soft_cap > 0.f) {
        using FVec = at::vec::Vectorized<float>;
        x = FVec(st.soft_cap) * (FVec(x) * FVec(1.f / st.soft_cap)).tanh();
      }
    }
    if (masking) {
      const __m512 key = _mm512_set1_ps(static_cast<float>(kt.k0 + t));
      __mmask16 masked = kt.causal_mask ? _mm512_cmp_ps_mask(key, qpos, _CMP_GT_OQ) : 0;
      if (kt.window_mask) {
        // key <= qpos - W
        masked |= _mm512_cmp_ps_mask(_mm512_add_ps(key, _mm512_set1_ps(static_cast<float>(st.window))), qpos,
                                     _CMP_LE_OQ);
      }
      x = _mm512_mask_mov_ps(x, masked, neg_inf);
    }
    if (in_place || masking) _mm512_storeu_ps(sc + t * rp, x);
    mx = _mm512_max_ps(mx, x);
  }
  const __m512 mul = _mm512_set1_ps(in_place ? 1.f : st.scale);
  mx = _mm512_mul_ps(mx, mul);
  // The running max moves only where the tile's max passes it by more than kMaxLag (e^8 ~
  // 3000): the probabilities may then exceed 1 by that much, harmless in fp32 sums and in bf16,
  // and the accumulators, which the tiles have just stored, are rescaled far less often (each
  // rescale reads them back from the tile stores and writes them again for the next tile load).
  constexpr float kMaxLag = 8.f;
  const __m512 m_old = _mm512_loadu_ps(st.m + 16 * v);
  const __mmask16 moved = _mm512_cmp_ps_mask(mx, _mm512_add_ps(m_old, _mm512_set1_ps(kMaxLag)), _CMP_GT_OQ);
  const __m512 m_new = _mm512_mask_max_ps(m_old, moved, m_old, mx);
  // Without a window m_new is finite: key 0 is visible to every row, and every row vector
  // takes the task's first key tile. With one, a row's window may start past this tile: its
  // max stays -inf, and the exponents are taken against 0 instead (every e and the
  // correction are then 0, never NaN).
  const __m512 m_exp =
      _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
  const __m512 correction = exp_ps(_mm512_sub_ps(m_old, m_exp));
  alignas(64) static constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  auto prob = [&](int t) {
    // Keys from n have zero probability (their V^T columns are zeros too).
    return t < kt.n ? exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(sc + t * rp), mul, m_exp)) : _mm512_setzero_ps();
  };
  __m512 sum = _mm512_setzero_ps();
  const int pairs = (kt.n + 31) / 32 * 16;  // whole B tiles of pairs: the tiles P.V reads
  for (int j = 0; j < pairs; ++j) {
    const __m512 a = prob(2 * j), b = prob(2 * j + 1);
    sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's 16 bf16 low, b's high
    _mm512_storeu_si512(st.pairs + j * rp + 16 * v, _mm512_permutexvar_epi16(order, both));
  }
  _mm512_storeu_ps(st.l + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(st.l + 16 * v), correction, sum));
  _mm512_storeu_ps(st.m + 16 * v, m_new);
  // The accumulators hold the sums of earlier tiles only where some row's max moved.
  if (!kt.first && moved) {
    for (int64_t d = 0; d < st.D; ++d) {
      float* o = st.ot + d * rp + 16 * v;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), correction));
    }
  }
}

// P.V of one row vector: ot[d][rows] += V^T [d][keys] . P^T, two column tiles of dims at a time
// (sums tmm0/1), each over keys 0-31 (V^T tmm3/4, P^T tmm2) and, where n > 32, keys 32-63 (V^T
// tmm6/7, P^T tmm5): four tile products per load and store of the sums.
inline void value_sums(const AmxPrefillState& st, const c10::BFloat16* vt, int n, int64_t v) {
  const int row_stride = static_cast<int>(st.rp * sizeof(float));
  constexpr int kVtStride = kAmxKeyTile * sizeof(c10::BFloat16);
  const bool upper = n > 32;
  _tile_loadd(2, st.pairs + 16 * v, row_stride);
  if (upper) _tile_loadd(5, st.pairs + 16 * st.rp + 16 * v, row_stride);
  auto o = [&](int64_t d0) { return st.ot + d0 * st.rp + 16 * v; };
  auto a = [&](int64_t d0, int half) { return vt + d0 * kAmxKeyTile + 32 * half; };
  int64_t d0 = 0;
  for (; d0 + 32 <= st.D; d0 += 32) {
    _tile_loadd(0, o(d0), row_stride);
    _tile_loadd(1, o(d0 + 16), row_stride);
    _tile_loadd(3, a(d0, 0), kVtStride);
    _tile_loadd(4, a(d0 + 16, 0), kVtStride);
    _tile_dpbf16ps(0, 3, 2);
    _tile_dpbf16ps(1, 4, 2);
    if (upper) {
      _tile_loadd(6, a(d0, 1), kVtStride);
      _tile_loadd(7, a(d0 + 16, 1), kVtStride);
      _tile_dpbf16ps(0, 6, 5);
      _tile_dpbf16ps(1, 7, 5);
    }
    _tile_stored(0, o(d0), row_stride);
    _tile_stored(1, o(d0 + 16), row_stride);
  }
  if (d0 < st.D) {
    _tile_loadd(0, o(d0), row_stride);
    _tile_loadd(3, a(d0, 0), kVtStride);
    _tile_dpbf16ps(0, 3, 2);
    if (upper) {
      _tile_loadd(6, a(d0, 1), kVtStride);
      _tile_dpbf16ps(0, 6, 5);
    }
    _tile_stored(0, o(d0), row_stride);
  }
}

}  // namespace

void amx_tiles_begin() { configure_amx_tiles(); }

void amx_tiles_end() { _tile_release(); }

void amx_pack_values(const c10::BFloat16* const* rows, int64_t D, c10::BFloat16* vt) {
  for (int half = 0; half < kAmxKeyTile / 32; ++half) {
    const c10::BFloat16* const* r = rows + 32 * half;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      // x[j] dword k = (row 2j [d0 + k], row 2j + 1 [d0 + k]); transposed, x[k] holds dim d0 + k
      // of the 32 keys in order.
      __m512i x[16];
      for (int j = 0; j < 16; ++j) {
        const c10::BFloat16* a = r[2 * j] ? r[2 * j] + d0 : nullptr;
        const c10::BFloat16* b = r[2 * j + 1] ? r[2 * j + 1] + d0 : nullptr;
        x[j] = _mm512_or_si512(widen_row(a), _mm512_slli_epi32(widen_row(b), 16));
      }
      transpose_16x16_epi32(x);
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512(vt + (d0 + k) * kAmxKeyTile + 32 * half, x[k]);
    }
  }
}

void amx_pack_query(const c10::BFloat16* const* rows, int64_t D, int64_t dp, uint32_t* qt, int64_t rp, int64_t v) {
  for (int64_t j0 = 0; j0 < dp / 2; j0 += 16) {
    // x[i] = pairs j0.. of row i (the dwords past D zero); transposed, x[k] holds pair j0 + k of the 16 rows.
    const int64_t valid = std::min<int64_t>(16, D / 2 - j0);
    const __mmask16 mask = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    __m512i x[16];
    for (int i = 0; i < 16; ++i) {
      x[i] = rows[i] ? _mm512_maskz_loadu_epi32(mask, rows[i] + 2 * j0) : _mm512_setzero_si512();
    }
    transpose_16x16_epi32(x);
    for (int k = 0; k < 16; ++k) _mm512_storeu_si512(qt + (j0 + k) * rp + 16 * v, x[k]);
  }
}

void amx_store_rows(const float* ot, int64_t D, int64_t rp, int64_t v, const float* inv, c10::BFloat16* const* rows) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512i x[16];
    for (int k = 0; k < 16; ++k) x[k] = _mm512_loadu_si512(ot + (d0 + k) * rp + 16 * v);
    transpose_16x16_epi32(x);  // x[i]: dims d0.. of row i
    for (int i = 0; i < 16; ++i) {
      if (!rows[i]) continue;
      const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(x[i]), _mm512_set1_ps(inv[i]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows[i] + d0), (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

void amx_prefill_step(const AmxPrefillState& st, const AmxKeyTile& kt, int64_t v_begin, int64_t v_end) {
  // A software pipeline over the row vectors: the scores of vector v, the softmax of v - 1 and
  // the sums of v - 2 in one round, so no load waits on stores just issued by the other unit
  // (vector loads of the scores a tile stored, a tile load of the probabilities the vector
  // unit stored): store-to-load forwarding does not cross between the two.
  for (int64_t v = v_begin; v < v_end + 2; ++v) {
    if (v < v_end) key_scores(st, kt.keys, kt.n, v);
    if (v - 1 >= v_begin && v - 1 < v_end) softmax_step(st, kt, v - 1);
    if (v - 2 >= v_begin) value_sums(st, kt.vt, kt.n, v - 2);
  }
}

}  // namespace pagedkv::cpu::CPU_CAPABILITY
