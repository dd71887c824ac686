// Paged attention on the CPU, vectorized with at::vec and parallel with
// at::parallel_for. Compiled once per CPU_CAPABILITY (see attention_kernels.h).
//
// Shared ideas:
//  - GQA: a task owns one or more kv heads and, for each, all G =
//    num_heads / num_kv_heads query heads that read it, so each K/V row is read
//    from memory once per task, for the whole group.
//  - Online softmax (running max m, running sum l, unnormalized accumulator),
//    so K and V are streamed exactly once; all arithmetic in fp32.
//  - Tasks are handed out dynamically (an atomic counter), because sequence
//    lengths, partitions and causal tiles have very different costs.
//
// Decode works token by token: with one query row per head, dot products of a
// K row against the G query vectors are the natural unit. Prefill tiles
// query tokens x heads into up to 64 rows (vectors of rows), keeps Q and the output
// transposed ([head_size, rows]) so rows are vector lanes, and runs two small
// register-blocked matrix products per tile of 32 keys; the softmax is then
// vectorized across rows as well.
//
// Sliding window: decode starts a sequence's work at its window's first key (the
// same token ranges as a split task, so blocks before the window are never touched
// and the cost follows min(seq_len, W)); prefill starts each query tile's keys at its
// first row's window and masks the later rows per tile. Soft-capping runs on the
// logits of a block (decode) or key tile (prefill) when on: no per-score work without it.
//
// The AVX512_BF16 variant (bf16 inputs only) takes Q.K^T straight from the bf16
// rows with vdpbf16ps (32 products per instruction, summed in pairs into fp32
// lanes, no widening); the query is kept unscaled in bf16 (exactly the input) and
// the scale is applied to the fp32 logits. That is on CPUs where vdpbf16ps is fast
// (DecodeParams::bf16_dot); elsewhere (Sapphire Rapids: four FMAs' time) decode widens the
// rows to fp32 and runs Q.K^T on FMAs against the fp32 query (qk_tile_f32). P.V stays in fp32 (the probabilities
// would have to be rounded to bf16 and V's rows interleaved in pairs of tokens).
// There an fp8 cache's codes are read through byte tables (Fp8Words: vpermi2b, AVX512-VBMI)
// at head sizes that are multiples of 64: five instructions give 64 codes' bf16 values
// exactly, four more their fp32 ones. Q.K^T then runs on vdpbf16ps or on fp32 FMAs, whichever
// this CPU runs faster (DecodeParams::bf16_dot: vdpbf16ps costs about one FMA on AMD Zen 4,
// four on Intel Sapphire Rapids), and P.V on fp32 FMAs; other head sizes widen the codes to
// bf16 by moving bit fields (fp8_bf16_pairs). An int8-per-token-head cache runs on integer
// dot products (vpdpwssd, AVX512-VNNI; Q.K^T also under AVX2 with vpmaddwd): Q.K^T on the
// codes against the query quantized to int16 per head, and (head sizes from
// kMinPairedHeadSize, every one where bf16_dot is off) P.V on pairs of tokens' codes
// against the weights quantized to int16 per head and block, both summed exactly in int32;
// the fp32 widening of every code (two instructions per 16 codes, more than the FMAs of a
// group's heads) is gone, and the int16 rounding (2^-16 of a row's largest value) is far
// below the bf16 query's own.
//
// On CPUs with AMX-BF16 (PrefillParams::use_amx), bf16 prefill runs both products on AMX tiles
// instead (prefill_task_amx, csrc/cpu/attention_amx.cpp; a quantized cache's rows dequantized
// and rounded to bf16 for them), with the same task split, layout ([head_size, rows]
// transposed output) and online softmax.
//
// A quantized cache (fp8, int8 / int4 per token and head; cpu/kv_dequant.h) is read once, in 1
// (or 1/2) byte a value instead of 2 or 4. Decode widens the codes in registers as it reads them
// (above; int4 below); prefill, and decode where no direct read exists (int4 in the scalar
// variant and at head sizes 80 and 112 under AVX-512), dequantize rows into a small fp32 staging
// tile right before their arithmetic, which then runs the fp32 code: one kv head's rows of a
// block at a time (bs x D floats, L1-sized) for Q.K^T and again for P.V, or prefill's key and
// value tiles as it loads them.
//
// An int4 cache is read directly by the AVX2 and AVX-512 kernels: the two codes of a byte are
// widened together, the low nibbles (a row's even elements) into one vector and the high nibbles
// (its odd elements) into the next, and the query and the accumulators are kept in that order
// (RowFormat, int4_query_pos), so no instruction interleaves nibbles. Q.K^T runs on integer dot
// products against the int16 query where int8's does (Int4Dot), on fp32 FMAs otherwise; P.V on
// fp32 FMAs. Against the staging tile, B32 ctx 2048, LLC flushed, interleaved (AMD Zen 3, AVX2,
// 2026-12-06): bf16 9/3x64 heads 1.39x, 32/8x128 1.58x; fp32 1.32x and 1.71x.
#include "cpu/attention_kernels.h"

#include "common/window.h"
#include "cpu/kv_dequant.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX512_BF16)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

namespace pagedkv::cpu::CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kW = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Decode processes at most this many tokens per softmax update (the largest block size,
// and the span of the swept decode's units of blocks).
constexpr int kMaxBlockSize = 32;
// Prefill: keys per tile, and query rows (tokens x heads) aimed at per tile. Every
// query tile reads all of its keys once, so larger tiles read K/V fewer times.
// Measured interleaved on 32/8x128 heads (AMD Zen 3, 2026-11-30): 64 rows were
// 1.07-1.29x faster than 32 on one 2048-token prompt and on four 512-token ones;
// 96-256 rows were no faster and slower on 512-token prompts (fewer, longer tasks);
// the tile's Q and output ([D, rows] fp32 each) fit in L2. Prefetching the next key
// tile's rows while a tile computes measured 0.93-1.13x (no gain) and was dropped.
constexpr int kKeyTile = 32;
constexpr int kPrefillRows = 64;
// Query rows per tile on AMX tiles: the key tile's per-tile work (its K rows copied, its V
// rows transposed) is shared by more row tiles, and the two products cost little beside the
// softmax.
constexpr int kAmxPrefillRows = 128;

// ---- element access --------------------------------------------------------------

template <typename T>
inline Vec load_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

template <typename T>
inline float to_f32(T x) {
  return static_cast<float>(x);
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Whether Q.K^T of element type T runs on bf16 dot products (vdpbf16ps) in this variant; the
// same T whose prefill runs on AMX tiles where PrefillParams::use_amx says so.
template <typename T>
constexpr bool kDotBf16 =
#if defined(CPU_CAPABILITY_AVX512_BF16)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

#if defined(CPU_CAPABILITY_AVX512_BF16)
// Elements [c, c + 32) of a bf16 row of D elements as 16 pairs, or its last 16
// (head sizes 80 and 112) with the upper pairs zero, which add nothing to a dot product.
template <int D>
inline __m512bh load_bf16_pairs(const void* row, int c) {
  const auto* p = static_cast<const c10::BFloat16*>(row) + c;
  if (c + 32 <= D) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, p);
}
#endif

// Prefetches the K and V rows of the next block into L2, kLinesPerStep cache
// lines at a time: decode calls step() after every tile of its arithmetic on the
// current block, so memory keeps reading the next block while the core computes
// instead of idling until the next block's first misses. Blocks are scattered,
// so the hardware prefetchers only find a block's stream after those misses.
// Measured on the target rows (interleaved, LLC flushed, AMD Zen 3, 2026-11-30):
// against prefetching the whole next block at once as a block starts (the
// prefetches then stall the core behind full miss buffers before it computes),
// 0.94-1.41x, most rows 1.1-1.3x; 4 or 16 lines per step, prefetching only the first
// lines of each 4 KiB page (to start the hardware streams), or prefetching the
// current block's V during QK^T and the next block's K during PV were no faster.
class BlockPrefetcher {
 public:
  static constexpr int kLinesPerStep = 8;
  static constexpr int kStepBytes = 64 * kLinesPerStep;
  static constexpr int kMaxRanges = 8;

  // Appends the range [p, p + bytes); ranges are prefetched in the order added.
  void add(const void* p, int64_t bytes) {
    begin_[count_] = static_cast<const char*>(p);
    end_[count_] = begin_[count_] + bytes;
    if (count_++ == 0) cur_ = begin_[0];
  }

  inline void step() {
    if (range_ >= count_) return;
    // A step may run up to kStepBytes - 64 bytes past a range's end: a prefetch
    // never faults, and the extra lines are the next rows of the cache at worst.
#pragma GCC unroll 8
    for (int i = 0; i < kLinesPerStep; ++i) __builtin_prefetch(cur_ + 64 * i, 0, 2);
    cur_ += kStepBytes;
    if (cur_ >= end_[range_] && ++range_ < count_) cur_ = begin_[range_];
  }

 private:
  const char* begin_[kMaxRanges] = {};
  const char* end_[kMaxRanges] = {};
  const char* cur_ = nullptr;
  int count_ = 0;
  int range_ = 0;  // the range in progress; count_ when all are done (or none was added)
};

// Loads one vector from every 64-byte line of the n ranges [p[i], p[i] + bytes),
// line by line across the ranges (line 0 of each, then line 1, ...), and returns a
// value made from them (the caller keeps it, so the loads stay). Decode sweeps the
// K and V rows of its next blocks this way before their arithmetic: that
// arithmetic reads the rows in strided passes, one kv head at a time, a pattern the
// stream prefetchers do not follow on small rows (9/3x64 heads: 768 B), while the
// sweep reads at close to the memory's rate and leaves the blocks in L1/L2 (the
// sweep made fp32 9/3x64 decode 1.26-1.57x and bf16 1.13-1.36x faster, 2026-11-30).
// Several ranges at once keep several hardware streams busy: a pure read of
// scattered 12 KiB blocks (2 threads, AMD Zen 3, 2026-12-01) ran at 0.79x a
// sequential read taking K then V, 0.91x interleaving K and V, 0.96x with the K and
// V of two blocks (6 KiB blocks: 0.61x, 0.73x, 0.80x).
inline float touch_ranges(const char* const* p, int n, int64_t bytes) {
  Vec a(0.f);
  for (int64_t off = 0; off + static_cast<int64_t>(sizeof(float)) * kW <= bytes; off += 64) {
    for (int i = 0; i < n; ++i) a = a + Vec::loadu(reinterpret_cast<const float*>(p[i] + off));
  }
  float lanes[kW];
  a.store(lanes);
  return lanes[0];
}

// Prefetches a task's blocks in the order the streamed decode consumes them (the K
// rows of block b, then its V rows, then block b + 1), kLeadLines cache lines ahead
// of the consumer, which reports how far it has got with advance_to. Wide token
// rows (see kStreamRowBytes) are consumed in groups of whole rows, close to memory
// order, so a fixed lead keeps the misses in flight while the core computes.
// Measured on fp32 32/8x128 and 32/32x128 (interleaved, LLC flushed, AMD Zen 3,
// 2026-12-01): a lead of 512 lines was 0.97-1.15x a lead of 256 and 1.13x one of 128.
class StreamPrefetcher {
 public:
  static constexpr int64_t kLeadLines = 512;

  // Blocks [first, end) of a task whose rows are whole token rows: block b's K rows are
  // [k_cache + table[b] * block_bytes, + block_bytes), its V rows the same in v_cache.
  StreamPrefetcher(const void* k_cache, const void* v_cache, const int32_t* table, int64_t first, int64_t end,
                   int64_t block_bytes)
      : cache_{static_cast<const char*>(k_cache), static_cast<const char*>(v_cache)},
        table_(table), block_(first), end_(end), block_bytes_(block_bytes) {
    if (block_ < end_) base_ = cache_[0] + table_[block_] * block_bytes_;
  }

  // The consumer has read the first `consumed` lines of the task's stream
  // (block i of the task starts at line 2 * i * block_lines, its V rows block_lines later).
  inline void advance_to(int64_t consumed) {
    const int64_t target = consumed + kLeadLines;
    while (pos_ < target && block_ < end_) {
      __builtin_prefetch(base_ + offset_, 0, 3);
      ++pos_;
      offset_ += 64;
      if (offset_ >= block_bytes_) next_range();
    }
  }

 private:
  inline void next_range() {
    offset_ = 0;
    if (which_ == 0) {
      which_ = 1;
    } else {
      which_ = 0;
      if (++block_ == end_) return;
    }
    base_ = cache_[which_] + table_[block_] * block_bytes_;
  }

  const char* cache_[2];
  const int32_t* table_;
  int64_t block_, end_, block_bytes_;
  const char* base_ = nullptr;
  int64_t offset_ = 0, pos_ = 0;
  int which_ = 0;  // 0: K rows of block_, 1: its V rows
};

// Runs f(task, scratch) for task in [0, num_tasks) on the intra-op thread pool,
// handing tasks out one at a time; each thread builds one Scratch.
template <typename Scratch, typename MakeScratch, typename F>
void run_tasks(int64_t num_tasks, const MakeScratch& make_scratch, const F& f) {
  if (num_tasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch = make_scratch();
    for (int64_t task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) f(task, scratch);
  });
}

// =====================================================================================
// Decode
// =====================================================================================

// ---- how a K/V row is read ------------------------------------------------------------
//
// Rows are consumed in chunks of kChunk<T> elements, each widened to kParts<T> fp32
// vectors. For bf16 under AVX2 a chunk is 16 elements taken by one 256-bit load and
// widened by one shift (the even elements) and one mask (the odd ones): half the
// instructions of widening them in order. Dot products do not care about element
// order as long as the query is permuted the same way, so the query and the output
// accumulator live in this "chunk order" and the output is put back in order when
// stored. int4 codes are read the same way on AVX2 and AVX-512 (a chunk of 2 x kW codes
// is kW bytes: the low nibbles, the even elements, widen into one vector and the high
// nibbles, the odd ones, into the next; kInt4Direct). Every other case (and bf16 under
// AVX-512, whose 32-element chunks would not divide head sizes 80 and 112) reads chunks
// of one vector in order.

// An int4-per-token-head byte: two codes, element 2i of the row in the low nibble of byte i.
// Int4Code rows are widened to fp32 for both products; Int4DotCode rows take Q.K^T on integer
// dot products against the query quantized to int16 (kDotInt16), P.V on fp32 as Int4Code.
struct Int4Code {
  uint8_t bits;
};
struct Int4DotCode {
  uint8_t bits;
};
template <typename T>
constexpr bool kInt4Row = std::is_same_v<T, Int4Code> || std::is_same_v<T, Int4DotCode>;
// Values in one element of a row of T: two codes in an int4 byte, else one.
template <typename T>
constexpr int kPack = kInt4Row<T> ? 2 : 1;

template <typename T>
struct RowFormat {
  static constexpr int parts = kInt4Row<T> ? 2 : 1;
};
#if defined(CPU_CAPABILITY_AVX2)
template <>
struct RowFormat<c10::BFloat16> {
  static constexpr int parts = 2;
};
#endif
template <typename T>
constexpr int kParts = RowFormat<T>::parts;
template <typename T>
constexpr int kChunk = kParts<T> * kW;

// Where element i of a row sits in chunk order.
template <typename T>
inline int64_t chunk_pos(int64_t i) {
  constexpr int64_t C = kChunk<T>, P = kParts<T>;
  const int64_t r = i % C;
  return i - r + (r % P) * kW + r / P;
}

// An int8-per-token-head code read with integer dot products against the query quantized to
// int16 (kDotInt16); a plain uint8_t row is read through fp32.
struct Int8DotCode {
  uint8_t bits;
};
static_assert(sizeof(Int8DotCode) == 1, "a code is one byte");

// Rows of a quantized cache read directly (no staging): fp8 codes and int8 codes (one byte a
// value, kCodeRow), int4 codes (two a byte), the per-token-head ones with their planes (kPlaneRow).
template <typename T>
constexpr bool kFp8Row = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;
template <typename T>
constexpr bool kInt8Row = std::is_same_v<T, uint8_t> || std::is_same_v<T, Int8DotCode>;
template <typename T>
constexpr bool kCodeRow = kFp8Row<T> || kInt8Row<T>;
template <typename T>
constexpr bool kPlaneRow = kInt8Row<T> || kInt4Row<T>;

// The format of a row element type read directly.
template <typename T>
constexpr KVCacheDType kCodeFormat = std::is_same_v<T, c10::Float8_e4m3fn> ? KVCacheDType::kFp8E4M3
                                     : std::is_same_v<T, c10::Float8_e5m2> ? KVCacheDType::kFp8E5M2
                                                                           : KVCacheDType::kInt8PerTokenHead;

// Elements [c, c + kChunk<T>) of a row of T (`row` at its first element) as kParts<T> vectors.
template <typename T>
inline void load_chunk(const T* row, int c, Vec* out) {
  const T* p = row + c / kPack<T>;
  if constexpr (kInt4Row<T>) {
    load_int4_halves(reinterpret_cast<const uint8_t*>(p), out[0], out[1]);  // cpu/kv_dequant.h
    return;
  }
  if constexpr (kCodeRow<T>) {
    out[0] = load_codes<kCodeFormat<T>>(reinterpret_cast<const uint8_t*>(p));  // cpu/kv_dequant.h
    return;
  }
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kParts<T> == 2) {
    // A bf16 is the top half of an fp32: the low 16 bits of each 32-bit word hold
    // the even element, the high 16 bits the odd one.
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    out[0] = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)));
    out[1] = Vec(_mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))));
    return;
  }
#endif
  if constexpr (!kCodeRow<T> && !kInt4Row<T>) out[0] = load_f32(p);
}

// out[i] = the sum of the lanes of v[i], i < 8. With AVX2 it is one transposing
// add tree for all eight (about 10 instructions), not eight horizontal reductions
// (AVX-512 takes reduce_tree instead).
__attribute__((always_inline)) inline void reduce8(const Vec* v, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 h[8];
  for (int i = 0; i < 8; ++i) h[i] = v[i];
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7], so two rounds
  // leave [s0, s1, s2, s3 | s0', s1', s2', s3'] (sums of each 128-bit half) for v0..v3.
  const __m256 t0 = _mm256_hadd_ps(h[0], h[1]), t1 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 t2 = _mm256_hadd_ps(h[4], h[5]), t3 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  for (int i = 0; i < 8; ++i) out[i] = hsum(v[i]);
#endif
}

// out[i] = the sum of the lanes of v[i], i < 4.
__attribute__((always_inline)) inline void reduce4(const Vec* v, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  for (int i = 0; i < 4; ++i) out[i] = hsum(v[i]);
#endif
}

inline float hmax(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
}

// Per-thread state of one decode task; "heads" = the query heads of the task's kv heads.
struct DecodeScratch {
  std::vector<float> q;       // [heads, D], pre-scaled, chunk order
  std::vector<float> acc;     // [heads, D], unnormalized output, chunk order
  std::vector<float> logits;  // [heads, kMaxBlockSize] of the block (or unit) in progress; probabilities after the update
  std::vector<float> m, l;    // [heads] running max and sum of exp
  volatile float sink = 0.f;  // keeps the loads of touch_ranges (never read)
  std::vector<float> stage;   // quantized caches: [block_size, D] dequantized rows of one kv head
  std::vector<float> qsum;    // int8 per token and head: [heads] sum of each pre-scaled query row
  std::vector<float> qmul;    // int8 on int16 dot products (kDotInt16): [heads] the scale of each int16 query row
  std::vector<float> plane;   // int8 per token and head: one block's (scale, zero) pairs as floats (plane_floats)

  // A task's online-softmax state for `heads` query heads: empty accumulators, m = -inf, l = 0.
  void start(int64_t heads, int64_t D) {
    std::fill(acc.begin(), acc.begin() + heads * D, 0.f);
    std::fill(m.begin(), m.begin() + heads, kNegInf);
    std::fill(l.begin(), l.begin() + heads, 0.f);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// The lane sums of up to 16 vectors (N = 8 or 12; the rest taken as zero) in one vector, by
// a tree of full-width shuffles and adds: each level halves the vectors and the partial sums
// per vector. Three instructions per pair and level, all single-uop, where reduce8's
// horizontal adds take three uops each and reduce4 fell back to a reduction per vector:
// 24 instructions for 8 sums, 36 for 12 (bf16 9/3x64 decode in cache 1.05x, Intel Xeon,
// 2026-12-06). Lane 4L + e of the result holds v[4e + L]'s sum.
template <int N>
__attribute__((always_inline)) inline __m512 reduce_tree(const Vec* v) {
  static_assert(N == 8 || N == 12, "reduce_tree takes 8 or 12 vectors");
  // 256-bit halves: x[k] = [v[2k]'s 8 partial sums | v[2k + 1]'s].
  __m512 x[8];
#pragma GCC unroll 8
  for (int k = 0; k < N / 2; ++k) {
    const __m512 a = v[2 * k], b = v[2 * k + 1];
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = N / 2; k < 8; ++k) x[k] = _mm512_setzero_ps();
  // 128-bit lanes: y[m] lane L = v[4m + L]'s 4 partial sums.
  __m512 y[4];
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    y[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0xDD));
  }
  // Pairs within lanes: z[r] lane L = (v[8r + L]'s 2 partial sums, v[8r + 4 + L]'s 2).
  __m512 z[2];
#pragma GCC unroll 2
  for (int r = 0; r < 2; ++r) {
    z[r] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * r], y[2 * r + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * r], y[2 * r + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}
#endif

// logits[h * kMaxBlockSize + t] = the lane sum of acc[h * NT + t]: all reduced together.
template <int NH, int NT>
__attribute__((always_inline)) inline void store_logits(const Vec* acc, float* logits) {
  constexpr int NA = NH * NT;
  static_assert(NA == 8 || NA == 12, "reduce8 (and reduce4) take the accumulators");
#if defined(CPU_CAPABILITY_AVX512)
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce_tree<NA>(acc));
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const int i = h * NT + t;
      logits[h * kMaxBlockSize + t] = sums[4 * (i % 4) + i / 4];
    }
#else
  float dots[NA];
  reduce8(acc, dots);
  if constexpr (NA == 12) reduce4(acc + 8, dots + 8);
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) logits[h * kMaxBlockSize + t] = dots[h * NT + t];
#endif
}

// Whether Q.K^T over rows of R runs against the unscaled query (the scale on the logits) in this
// variant: bf16 rows on bf16 dot products as they are, and fp8 codes widened exactly (to bf16 by
// fp8_bf16_pairs or Fp8Words; to fp32 by Fp8Words where bf16_dot is off, the query then fp32).
template <typename R>
constexpr bool kQueryBf16 =
#if defined(CPU_CAPABILITY_AVX512_BF16)
    kDotBf16<R> || kFp8Row<R>;
#else
    false;
#endif

#if defined(CPU_CAPABILITY_AVX512_BF16)
// Codes [c, c + 32) of a row of D fp8 codes (or its last 16, upper ones zero) as bf16 pairs,
// exactly. A normal code's exponent and mantissa move into bf16's fields with the exponent
// rebiased (e4m3 by 127 - 7, e5m2 by 127 - 15). A code with exponent 0 (zero, and the
// subnormals m * 2^-9 of e4m3, m * 2^-16 of e5m2) would gain an implicit 1 that way, so
// its magnitude comes from a table indexed by its low bits (vpermw); every one of them is
// a normal bf16, so vdpbf16ps, which reads bf16 denormals as zero, loses none. The sign
// (bit 7, spread over the high byte by the sign extension) goes on last.
template <KVCacheDType F, int D>
inline __m512bh fp8_bf16_pairs(const uint8_t* row, int c) {
  constexpr bool e4m3 = F == KVCacheDType::kFp8E4M3;
  const __m256i raw = c + 32 <= D
                          ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c))
                          : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
  const __m512i x = _mm512_cvtepi8_epi16(raw);
  const __m512i fields =
      e4m3 ? _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(0x07F0)),
                              _mm512_set1_epi16(0x3C00))
           : _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, 5), _mm512_set1_epi16(0x0FE0)),
                              _mm512_set1_epi16(0x3800));
  const __mmask32 exponent_zero = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(e4m3 ? 0x0078 : 0x007C));
  // bf16 bits of m * 2^-9 (e4m3, m < 8) or m * 2^-16 (e5m2, m < 4), two words to an int32, low word first.
  const __m512i table = e4m3 ? _mm512_setr_epi32(0x3B000000, 0x3BC03B80, 0x3C203C00, 0x3C603C40, 0, 0, 0, 0, 0, 0, 0,
                                                 0, 0, 0, 0, 0)
                             : _mm512_setr_epi32(0x37800000, 0x38403800, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i magnitude = _mm512_mask_permutexvar_epi16(fields, exponent_zero, x, table);
  // magnitude | (x & 0x8000): ternary-logic table 0xF8 is a | (b & c).
  return (__m512bh)_mm512_ternarylogic_epi32(magnitude, x, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
}

#endif

#if defined(CPU_CAPABILITY_AVX512_BF16) || defined(CPU_CAPABILITY_AVX2)
// The loop of the dot-product tiles: NH heads x NT tokens of accumulators, Dot::kStep elements
// of a row per step, every K load (and widening) serving the NH heads, the sums reduced together
// at the end. Dot gives the accumulator, the loads of q and of a K row, and the instruction.
template <typename Dot, int D, int NH, int NT, typename R>
inline void qk_tile_dot(const float* q, const R* k, int64_t k_stride, float* logits) {
  typename Dot::Acc acc[NH * NT];
#pragma GCC unroll 12
  for (int i = 0; i < NH * NT; ++i) acc[i] = Dot::zero();
#pragma GCC unroll 4
  for (int c = 0; c < D; c += Dot::kStep) {
    typename Dot::Words qv[NH];
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) qv[h] = Dot::template load_query<D>(q + h * D, c);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const typename Dot::Words kv = Dot::template load_key<D>(k + t * k_stride, c);
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) acc[h * NT + t] = Dot::dot(acc[h * NT + t], qv[h], kv);
    }
  }
  Vec sums[NH * NT];
#pragma GCC unroll 12
  for (int i = 0; i < NH * NT; ++i) sums[i] = Dot::sum(acc[i]);
  store_logits<NH, NT>(sums, logits);
}
#endif

#if defined(CPU_CAPABILITY_AVX512_BF16)
// qk_tile_dot on bf16 dot products: q holds each head's unscaled bf16 row at the start of its
// fp32 row (see attend_rows); K rows are bf16 as they are, or fp8 codes widened to bf16.
struct Bf16Dot {
  static constexpr int kStep = 32;
  using Acc = __m512;
  using Words = __m512bh;
  static Acc zero() { return _mm512_setzero_ps(); }
  template <int D>
  static Words load_query(const float* q, int c) {
    return load_bf16_pairs<D>(q, c);
  }
  template <int D, typename R>
  static Words load_key(const R* row, int c) {
    if constexpr (kFp8Row<R>) {
      return fp8_bf16_pairs<kCodeFormat<R>, D>(reinterpret_cast<const uint8_t*>(row), c);
    } else {
      return load_bf16_pairs<D>(row, c);
    }
  }
  static Acc dot(Acc acc, Words a, Words b) { return _mm512_dpbf16_ps(acc, a, b); }
  static Vec sum(Acc acc) { return Vec(acc); }
};

// ---- int8 codes on integer dot products (vpdpwssd: 32 int16 products per instruction,
// summed in pairs into int32 lanes; AVX512-VNNI, which every AVX512-BF16 CPU has) ----

// Codes [c, c + 32) of a row of D uint8 codes as 16-bit words, or its last 16 (head
// sizes 80 and 112) with the upper words zero.
template <int D>
inline __m512i load_code_words(const uint8_t* row, int c) {
  if (c + 32 <= D) return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
  return _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
}

// Words [c, c + 32) of a row of D int16 (the quantized query), or its last 16, upper words zero.
template <int D>
inline __m512i load_words(const void* row, int c) {
  const auto* p = static_cast<const int16_t*>(row) + c;
  if (c + 32 <= D) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(0xFFFF, p);
}

// qk_tile_dot on int16 dot products: q holds each head's query quantized to int16 at the
// start of its fp32 row (quantize_query_i16), K rows are uint8 codes; the logits are the exact
// integer dot products q_i . c (as floats), which affine_logits turns into q . k. Sums stay
// below 2^31: |q_i| <= 32767, c <= 255 and D <= 256 give at most 2.14e9 (qk_tile asserts D).
struct Int16Dot {
  static constexpr int kStep = 32;
  using Acc = __m512i;
  using Words = __m512i;
  static Acc zero() { return _mm512_setzero_si512(); }
  template <int D>
  static Words load_query(const float* q, int c) {
    return load_words<D>(q, c);
  }
  template <int D>
  static Words load_key(const Int8DotCode* row, int c) {
    return load_code_words<D>(reinterpret_cast<const uint8_t*>(row), c);
  }
  static Acc dot(Acc acc, Words a, Words b) { return _mm512_dpwssd_epi32(acc, a, b); }
  static Vec sum(Acc acc) { return Vec(_mm512_cvtepi32_ps(acc)); }
};

// qk_tile_dot on int16 dot products over int4 codes: 64 codes (32 bytes) widened to words
// once, their low nibbles (the even elements) and high nibbles (the odd ones) two word vectors
// met by the query's two halves in int4_query_pos' order. A last step of fewer codes (head
// size 96) loads only the row's bytes (the query's words past them are zero).
struct Int4Dot {
  static constexpr int kStep = 64;
  using Acc = __m512i;
  struct Words {
    __m512i even, odd;
  };
  static Acc zero() { return _mm512_setzero_si512(); }
  template <int D>
  static Words load_query(const float* q, int c) {
    const int16_t* w = reinterpret_cast<const int16_t*>(q) + c;
    return {_mm512_loadu_si512(w), _mm512_loadu_si512(w + 32)};
  }
  template <int D>
  static Words load_key(const Int4DotCode* row, int c) {
    const auto* p = reinterpret_cast<const uint8_t*>(row) + c / 2;
    const __m256i raw = c + 64 <= D ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                    : _mm256_maskz_loadu_epi8((1u << ((D - c) / 2)) - 1, p);
    const __m512i x = _mm512_cvtepu8_epi16(raw);
    return {_mm512_and_si512(x, _mm512_set1_epi16(0x0F)), _mm512_srli_epi16(x, 4)};
  }
  static Acc dot(Acc acc, const Words& a, const Words& b) {
    return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc, a.even, b.even), a.odd, b.odd);
  }
  static Vec sum(Acc acc) { return Vec(_mm512_cvtepi32_ps(acc)); }
};

// Codes [c, c + 32) of rows r0 and r1 as (r0, r1) word pairs, one per int32 lane: lo holds
// elements c + [0, 8) and c + [16, 24), hi c + [8, 16) and c + [24, 32) (the byte unpacks work
// within 128-bit lanes); for the last 16 of a row, lo holds c + [0, 8) and hi c + [8, 16), upper
// lanes zero. fold_pairs puts the elements back in order.
template <int D>
inline void load_code_pairs(const uint8_t* r0, const uint8_t* r1, int c, __m512i& lo, __m512i& hi) {
  __m256i x0, x1;
  if (c + 32 <= D) {
    x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + c));
    x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + c));
  } else {
    x0 = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + c)));
    x1 = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + c)));
  }
  lo = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(x0, x1));
  hi = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(x0, x1));
}

// acc[c, c + 32) (or its last 16) += scale * the integer sums (lo, hi) of load_code_pairs' order.
template <int D>
inline void fold_pairs(__m512i lo, __m512i hi, float scale, int c, float* acc) {
  const __m512 l = _mm512_cvtepi32_ps(lo), h = _mm512_cvtepi32_ps(hi), s = _mm512_set1_ps(scale);
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  _mm512_storeu_ps(acc + c, _mm512_fmadd_ps(_mm512_permutex2var_ps(l, first, h), s, _mm512_loadu_ps(acc + c)));
  if (c + 32 <= D) {
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    _mm512_storeu_ps(acc + c + 16,
                     _mm512_fmadd_ps(_mm512_permutex2var_ps(l, second, h), s, _mm512_loadu_ps(acc + c + 16)));
  }
}

// acc[j] += sum_t p[j][t] * c_t for NG heads over n rows of uint8 codes (p: the weights
// p_t * s_t of affine_probs, >= 0). Each head's weights are quantized to int16 against their
// largest (relative error <= 2^-16 of it), two tokens share an int32 lane, and the integer
// sums of the block go to the fp32 accumulator once, times the weights' scale. An odd last
// token pairs with itself at weight 0 (rows past the block's n are not read).
template <int D, int NG>
inline void pv_heads_dpwssd(const float* p, const uint8_t* v, int64_t v_stride, int n, float* acc,
                            BlockPrefetcher& next) {
  alignas(64) int16_t w[NG][kMaxBlockSize + 2];
  float w_scale[NG];
  const __mmask16 first = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 second = n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
  for (int j = 0; j < NG; ++j) {
    // Tokens [0, 16) and [16, n) of the head's weights (masked: rows past n are not this head's).
    const float* row = p + j * kMaxBlockSize;
    const __m512 x0 = _mm512_maskz_loadu_ps(first, row), x1 = _mm512_maskz_loadu_ps(second, row + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
    const float inv = top > 0.f ? 32767.f / top : 0.f;
    w_scale[j] = top / 32767.f;
    // Round to nearest (cvtps2dq); 0 <= x * inv <= 32767, so the words take them as they are.
    const __m512 iv = _mm512_set1_ps(inv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w[j]), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x0, iv))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w[j] + 16),
                       _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x1, iv))));
    w[j][n] = 0;
  }
  for (int c = 0; c < D; c += 32) {
    __m512i a[NG][2];
    for (int j = 0; j < NG; ++j) a[j][0] = a[j][1] = _mm512_setzero_si512();
    for (int t = 0; t < n; t += 2) {
      const uint8_t* r0 = v + t * v_stride;
      __m512i lo, hi;
      load_code_pairs<D>(r0, t + 1 < n ? r0 + v_stride : r0, c, lo, hi);
      for (int j = 0; j < NG; ++j) {
        int32_t pair;
        std::memcpy(&pair, &w[j][t], sizeof(pair));
        const __m512i wv = _mm512_set1_epi32(pair);
        a[j][0] = _mm512_dpwssd_epi32(a[j][0], lo, wv);
        a[j][1] = _mm512_dpwssd_epi32(a[j][1], hi, wv);
      }
    }
    for (int j = 0; j < NG; ++j) fold_pairs<D>(a[j][0], a[j][1], w_scale[j], c, acc + j * D);
    next.step();
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// ---- int8 codes on integer dot products under AVX2 (vpmaddwd: 16 int16 products per
// instruction, summed in pairs into int32 lanes, then vpaddd into the accumulator) ----
//
// Q.K^T only: the same arithmetic as the AVX-512 variant's vpdpwssd, in two instructions.
// Widening 16 codes costs one vpmovzxbw, where the fp32 path took two instructions per 8 codes
// (vpmovzxbd, vcvtdq2ps) for a group's few FMAs. int8 decode with it against the fp32 Q.K^T,
// bf16 9/3x64 B32 ctx 2048, LLC flushed (AMD Zen 3, 2026-12-06, same runs): 1.25-1.34x
// (its time against the bf16 cache's 0.68-0.73x -> 0.90-0.93x). P.V on paired codes
// (vpmaddwd against the weights in int16, as pv_heads_dpwssd) measured 0.81-0.85x of the fp32
// P.V there (weights rounded by scalar code): without a fused multiply-add of integers, an add
// per product pair is as many instructions as the FMAs it replaces, and the rounding comes on top.

// qk_tile_dot on int16 dot products: q holds each head's query quantized to int16 at the start
// of its fp32 row (quantize_query_i16), K rows are uint8 codes; as the AVX-512 Int16Dot, the
// logits are the exact integer dot products (sums below 2^31 for D <= 256).
struct Int16Dot {
  static constexpr int kStep = 16;
  using Acc = __m256i;
  using Words = __m256i;
  static Acc zero() { return _mm256_setzero_si256(); }
  template <int D>
  static Words load_query(const float* q, int c) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const int16_t*>(q) + c));
  }
  template <int D>
  static Words load_key(const Int8DotCode* row, int c) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
  }
  static Acc dot(Acc acc, Words a, Words b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  static Vec sum(Acc acc) { return Vec(_mm256_cvtepi32_ps(acc)); }
};

// Int16Dot over int4 codes: 32 codes (16 bytes) widened to words once, their low nibbles (the
// even elements) and high nibbles (the odd ones) two word vectors met by the query's two halves
// in int4_query_pos' order. The last step of head sizes 80 and 112 loads only the row's 8 bytes.
struct Int4Dot {
  static constexpr int kStep = 32;
  using Acc = __m256i;
  struct Words {
    __m256i even, odd;
  };
  static Acc zero() { return _mm256_setzero_si256(); }
  template <int D>
  static Words load_query(const float* q, int c) {
    const auto* w = reinterpret_cast<const __m256i*>(reinterpret_cast<const int16_t*>(q) + c);
    return {_mm256_loadu_si256(w), _mm256_loadu_si256(w + 1)};
  }
  template <int D>
  static Words load_key(const Int4DotCode* row, int c) {
    const auto* p = reinterpret_cast<const __m128i*>(reinterpret_cast<const uint8_t*>(row) + c / 2);
    const __m256i x = _mm256_cvtepu8_epi16(c + 32 <= D ? _mm_loadu_si128(p) : _mm_loadl_epi64(p));
    return {_mm256_and_si256(x, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(x, 4)};
  }
  static Acc dot(Acc acc, const Words& a, const Words& b) {
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a.even, b.even), _mm256_madd_epi16(a.odd, b.odd)));
  }
  static Vec sum(Acc acc) { return Vec(_mm256_cvtepi32_ps(acc)); }
};

#endif

// Where element d of a row sits after in-lane unpacks spread it over vectors: per 4 x Lane
// elements (Lane of them in each of a vector's four 128-bit lanes), group g of Group elements
// of every lane goes into vector g, lane by lane. Unpacks keep each lane's elements in its lane
// and take its groups in turn, so the rows, the queries meeting them and the accumulators they
// feed are kept in this order.
template <int Lane, int Group>
constexpr int64_t unpacked_pos(int64_t d) {
  const int64_t c = d / (4 * Lane) * (4 * Lane), r = d % (4 * Lane);
  return c + 4 * Group * (r % Lane / Group) + Group * (r / Lane) + r % Group;
}
// A bf16 row widened to fp32 32 elements at a time (widen_bf16_words: two vectors of four dwords a lane).
constexpr int64_t bf16_widened_pos(int64_t d) { return unpacked_pos<8, 4>(d); }
// fp8 codes through Fp8Words, 64 at a time: as bf16 words (convert: two vectors of eight words
// a lane), the order of the bf16 query that meets them; as fp32 (convert_f32: four vectors of
// four dwords a lane), the order of the fp32 query and of pv_heads_fp8_f32's accumulators.
constexpr int64_t fp8_query_pos(int64_t d) { return unpacked_pos<16, 8>(d); }
constexpr int64_t fp8_acc_pos(int64_t d) { return unpacked_pos<16, 4>(d); }

// Whether bf16 rows at head size D can take Q.K^T on fp32 FMAs (where bf16_dot is off): whole
// 32-element chunks (Bf16Widen).
template <typename R, int D>
constexpr bool kBf16FmaRows =
#if defined(CPU_CAPABILITY_AVX512_BF16)
    std::is_same_v<R, c10::BFloat16> && D % 32 == 0;
#else
    false;
#endif

#if defined(CPU_CAPABILITY_AVX512_BF16)
// ---- fp8 codes to bf16 through byte tables (AVX512-VBMI vpermi2b) ----
//
// Decode over an fp8 cache is bound by its arithmetic, not by its reads (its time barely moves
// when the cache is in L2): widening the codes cost more than the dot products. A code's bf16
// value has two bytes, each a function of the code's low 7 bits (the magnitude), so two 128-entry
// byte lookups (vpermi2b takes 64 indexes against two 64-byte tables at once) and the sign
// (bit 7, kept as it is) give 64 codes' values exactly, subnormals included, in five
// instructions (the lookups, the sign, two byte unpacks into words), against sixteen to widen
// and fix them 32 at a time (fp8_bf16_pairs). Head sizes that are multiples of 64 take it.
// With the fp32 Q.K^T and P.V below and the unswept rows (attend_blocks_swept), fp8 decode
// against the bf16 cache, bf16 B32 ctx 2048, LLC flushed (Intel Xeon with AMX, 2026-12-06,
// bench/results/kernels_quantized_amx_cpu.md, before the bf16 cache's own FMA Q.K^T):
// 32/8x128 heads e4m3 1.27 -> 1.33-1.38x, e5m2 1.30 -> 1.34-1.41x; 9/3x64 1.12 -> 1.20-1.21x
// and 1.19 -> 1.25-1.27x. Tried there and dropped: P.V on paired tokens on vdpbf16ps (slower
// than the fp32 FMAs), and Q.K^T with tokens in lanes (16 rows transposed by dwords, then 4 x 4
// bytes in each lane, so no sums at the end): level in cache, 0.89x (9/3x64) and 0.78x
// (32/8x128) from memory.
template <int D>
constexpr bool kFp8Tables = D % 64 == 0;

// The two bytes of the bf16 value of every fp8 magnitude m (code & 0x7F), times 2^Shift: hi[m], lo[m].
struct alignas(64) Fp8ByteTables {
  uint8_t hi[128], lo[128];
};

template <KVCacheDType F, int Shift>
const Fp8ByteTables& fp8_byte_tables() {
  static const Fp8ByteTables tables = [] {
    Fp8ByteTables t;
    for (int m = 0; m < 128; ++m) {
      const auto code = static_cast<uint8_t>(m);
      const float x = F == KVCacheDType::kFp8E4M3
                          ? static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()))
                          : static_cast<float>(c10::Float8_e5m2(code, c10::Float8_e5m2::from_bits()));
      // Every fp8 value (and 2^-8 times it) is a normal bf16 exactly: the top half of its fp32 bits.
      const float scaled = std::ldexp(x, Shift);
      uint32_t bits;
      std::memcpy(&bits, &scaled, sizeof(bits));
      t.hi[m] = static_cast<uint8_t>(bits >> 24);
      t.lo[m] = static_cast<uint8_t>(bits >> 16);
    }
    return t;
  }();
  return tables;
}

// 32 bf16 words as fp32 (a bf16 is the top half of an fp32, so the words go into dwords above
// zero words): f0 holds each 128-bit lane's low four words, f1 its high four.
inline void widen_bf16_words(__m512i w, __m512& f0, __m512& f1) {
  const __m512i zero = _mm512_setzero_si512();
  f0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w));
  f1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w));
}

// The tables in registers, and the conversion.
struct Fp8Words {
  __m512i hi0, hi1, lo0, lo1;
  explicit Fp8Words(const Fp8ByteTables& t)
      : hi0(_mm512_load_si512(t.hi)), hi1(_mm512_load_si512(t.hi + 64)), lo0(_mm512_load_si512(t.lo)),
        lo1(_mm512_load_si512(t.lo + 64)) {}
  // The bf16 values of 64 codes as words: w0 holds codes [16i, 16i + 8) of each 128-bit lane i,
  // w1 codes [16i + 8, 16i + 16) (the byte unpacks work within lanes).
  inline void convert(__m512i x, __m512i& w0, __m512i& w1) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo0, x, lo1);
    // hi | (x & 0x80): ternary-logic table 0xF8 is a | (b & c).
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }
  // The fp32 values of 64 codes: f[q] lane i holds codes 16i + 4q + [0, 4) (fp8_acc_pos).
  inline void convert_f32(__m512i x, __m512 f[4]) const {
    __m512i w0, w1;
    convert(x, w0, w1);
    widen_bf16_words(w0, f[0], f[1]);
    widen_bf16_words(w1, f[2], f[3]);
  }
};

// How qk_tile_f32 reads a row chunk into fp32: kChunk elements into kVectors vectors.
// fp8 codes, 64 at a time through the byte tables (code values: the scale goes on the logits).
template <KVCacheDType F>
struct Fp8Widen {
  static constexpr int kChunk = 64, kVectors = 4;
  Fp8Words tw{fp8_byte_tables<F, 0>()};
  void load(const uint8_t* p, __m512* f) const { tw.convert_f32(_mm512_loadu_si512(p), f); }
};
// bf16 elements, 32 at a time by two unpacks.
struct Bf16Widen {
  static constexpr int kChunk = 32, kVectors = 2;
  void load(const c10::BFloat16* p, __m512* f) const { widen_bf16_words(_mm512_loadu_si512(p), f[0], f[1]); }
};

// qk_tile over fp8 rows through the byte tables: q holds each head's bf16 query in
// fp8_query_pos order at the start of its fp32 row.
template <KVCacheDType F, int D, int NH, int NT>
__attribute__((always_inline)) inline void qk_tile_fp8_tables(const float* q, const uint8_t* k, int64_t k_stride, float* logits) {
  const Fp8Words tw(fp8_byte_tables<F, 0>());
  __m512 acc[NH * NT];
#pragma GCC unroll 12
  for (int i = 0; i < NH * NT; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < D; c += 64) {
    __m512bh q0[NH], q1[NH];
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const auto* words = reinterpret_cast<const uint16_t*>(q + h * D) + c;
      q0[h] = (__m512bh)_mm512_loadu_si512(words);
      q1[h] = (__m512bh)_mm512_loadu_si512(words + 32);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      __m512i w0, w1;
      tw.convert(_mm512_loadu_si512(k + t * k_stride + c), w0, w1);
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) {
        acc[h * NT + t] = _mm512_dpbf16_ps(acc[h * NT + t], q0[h], (__m512bh)w0);
        acc[h * NT + t] = _mm512_dpbf16_ps(acc[h * NT + t], q1[h], (__m512bh)w1);
      }
    }
  }
  Vec sums[NH * NT];
#pragma GCC unroll 12
  for (int i = 0; i < NH * NT; ++i) sums[i] = Vec(acc[i]);
  store_logits<NH, NT>(sums, logits);
}

// qk_tile on fp32 FMAs over rows widened by W (Fp8Widen, Bf16Widen): q holds each head's fp32
// query (unscaled) in the order W's vectors hold the row (fp8_acc_pos, bf16_widened_pos), read
// by the FMAs from L1. Where vdpbf16ps costs more than two FMAs, twice its products on FMAs take
// less time than the dot products: bf16 decode against vdpbf16ps, B32 ctx 2048 (Intel Xeon with
// AMX, 2026-12-06), 9/3x64 and 32/8x128 heads 1.04x with the LLC flushed, 1.07-1.08x in cache.
template <int D, int NH, int NT, typename W, typename R>
__attribute__((always_inline)) inline void qk_tile_f32(const W& widen, const float* q, const R* k, int64_t k_stride,
                                                       float* logits) {
  static_assert(D % W::kChunk == 0, "whole chunks");
  Vec acc[NH * NT];
#pragma GCC unroll 12
  for (int i = 0; i < NH * NT; ++i) acc[i] = Vec(0.f);
#pragma GCC unroll 8
  for (int c = 0; c < D; c += W::kChunk) {
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      __m512 f[W::kVectors];
      widen.load(k + t * k_stride + c, f);
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) {
        __m512 a = acc[h * NT + t];
#pragma GCC unroll 4
        for (int i = 0; i < W::kVectors; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + c + 16 * i), f[i], a);
        acc[h * NT + t] = Vec(a);
      }
    }
  }
  store_logits<NH, NT>(acc, logits);
}

// acc[j] += sum_t p[j][t] * v_t for NG heads over n rows of fp8 codes, in fp32: each row's codes
// widened through the tables (nine instructions per 64 codes, against twenty through fp16),
// NG x 4 accumulators in fp8_acc_pos order.
template <KVCacheDType F, int D, int NG>
inline void pv_heads_fp8_f32(const float* p, const uint8_t* v, int64_t v_stride, int n, float* acc,
                             BlockPrefetcher& next) {
  const Fp8Words tw(fp8_byte_tables<F, F == KVCacheDType::kFp8E4M3 ? -8 : 0>());
  for (int c = 0; c < D; c += 64) {
    __m512 a[NG][4];
    for (int j = 0; j < NG; ++j)
      for (int i = 0; i < 4; ++i) a[j][i] = _mm512_loadu_ps(acc + j * D + c + 16 * i);
    for (int t = 0; t < n; ++t) {
      __m512 f[4];
      tw.convert_f32(_mm512_loadu_si512(v + t * v_stride + c), f);
      for (int j = 0; j < NG; ++j) {
        const __m512 pb = _mm512_set1_ps(p[j * kMaxBlockSize + t]);
        for (int i = 0; i < 4; ++i) a[j][i] = _mm512_fmadd_ps(pb, f[i], a[j][i]);
      }
    }
    for (int j = 0; j < NG; ++j)
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + j * D + c + 16 * i, a[j][i]);
    next.step();
  }
}

#endif

// Whether rows of R (fp8 codes) at head size D go through the byte tables in this variant.
template <typename R, int D>
constexpr bool kFp8TableRows =
#if defined(CPU_CAPABILITY_AVX512_BF16)
    kFp8Row<R> && kFp8Tables<D>;
#else
    false;
#endif

// P.V on paired codes (pv_heads_dpwssd) from this head size on; below it the fp32 P.V, where
// vdpbf16ps is fast (DecodeParams::bf16_dot). Its fixed costs per block and head (the weights
// rounded to int16, the sums folded into the fp32 accumulator) do not shrink with the head
// size. int8 decode on the paired P.V against the fp32 one, bf16 B32 ctx 2048, LLC flushed:
// AMD Zen 4 (2026-12-02) 32/8x128 heads 1.10x, 9/3x64 0.86x; Intel Xeon with AMX (2026-12-06,
// where vdpbf16ps is slow and vpdpwssd does twice an FMA's products per second) 9/3x64 1.07-1.10x,
// so there every head size takes it. (bf16_dot is the measured trait that separates the two.)
constexpr int kMinPairedHeadSize = 128;

// Whether rows of R are int8 or int4 codes on integer dot products (attend_tokens picks them by
// kInt16Query).
template <typename R>
constexpr bool kDotInt16 = std::is_same_v<R, Int8DotCode> || std::is_same_v<R, Int4DotCode>;

// Whether this variant reads an int4 cache directly at head size D (its query and accumulators in
// the order of the codes' halves): whole chunks of 2 x kW codes. Elsewhere (the scalar variant, head
// sizes 80 and 112 under AVX-512) its rows are dequantized into the staging tile.
template <int D>
constexpr bool kInt4Direct =
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    D % kChunk<Int4Code> == 0;
#else
    false;
#endif

#if defined(CPU_CAPABILITY_AVX512_BF16) || defined(CPU_CAPABILITY_AVX2)
// Where element d of the int16 query meeting int4 codes sits (Int4Dot): per step of kStep
// elements, the even ones in the first half, the odd ones in the second.
constexpr int64_t int4_query_pos(int64_t d) {
  constexpr int64_t S = Int4Dot::kStep;
  const int64_t r = d % S;
  return d - r + (r % 2) * (S / 2) + r / 2;
}
#endif

// Whether an int8-per-token-head cache is read on integer dot products for queries of type T
// in this variant. Not for fp32 queries: the int16 query's rounding (up to 2^-16 of its row's
// largest value) is far below bf16's and fp16's own, not below fp32's.
template <typename T>
constexpr bool kInt16Query =
#if defined(CPU_CAPABILITY_AVX512_BF16) || defined(CPU_CAPABILITY_AVX2)
    !std::is_same_v<T, float>;
#else
    false;
#endif

// logits[h * kMaxBlockSize + t] = q_h . k_t for NH heads x NT tokens, NH * NT = 8 or 12
// accumulators: every K chunk is loaded (and widened) once for the NH heads, and
// the dot products are reduced together at the end.
// fp8 rows through the byte tables (kFp8TableRows) take bf16 dot products where bf16_dot says
// they pay on this CPU (TaskView::bf16_dot), fp32 FMAs otherwise.
template <typename T, int D, int NH, int NT>
inline void qk_tile(const float* q, const T* k, int64_t k_stride, float* logits, bool bf16_dot) {
#if defined(CPU_CAPABILITY_AVX512_BF16)
  if constexpr (kFp8TableRows<T, D>) {
    const auto* codes = reinterpret_cast<const uint8_t*>(k);
    if (bf16_dot) return qk_tile_fp8_tables<kCodeFormat<T>, D, NH, NT>(q, codes, k_stride, logits);
    return qk_tile_f32<D, NH, NT>(Fp8Widen<kCodeFormat<T>>{}, q, codes, k_stride, logits);
  }
  if constexpr (kBf16FmaRows<T, D>) {
    if (!bf16_dot) return qk_tile_f32<D, NH, NT>(Bf16Widen{}, q, k, k_stride, logits);
  }
  if constexpr (kQueryBf16<T>) return qk_tile_dot<Bf16Dot, D, NH, NT>(q, k, k_stride, logits);
#endif
#if defined(CPU_CAPABILITY_AVX512_BF16) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (kDotInt16<T>) {  // Int16Dot of this variant: vpdpwssd, or vpmaddwd + vpaddd
    static_assert(D <= 256 && D % 16 == 0, "int32 sums of D products of 32767 x 255; whole 16-code steps");
    if constexpr (kInt4Row<T>) {
      return qk_tile_dot<Int4Dot, D, NH, NT>(q, k, k_stride, logits);
    } else {
      return qk_tile_dot<Int16Dot, D, NH, NT>(q, k, k_stride, logits);
    }
  }
#endif
  constexpr int P = kParts<T>;
  Vec acc[NH * NT];
#pragma GCC unroll 12
  for (int i = 0; i < NH * NT; ++i) acc[i] = Vec(0.f);
#pragma GCC unroll 4
  for (int c = 0; c < D; c += kChunk<T>) {
    Vec qv[NH][P];
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 2
      for (int i = 0; i < P; ++i) qv[h][i] = Vec::loadu(q + h * D + c + i * kW);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      Vec kv[P];
      load_chunk(k + t * k_stride, c, kv);
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h)
#pragma GCC unroll 2
        for (int i = 0; i < P; ++i) acc[h * NT + t] = at::vec::fmadd(qv[h][i], kv[i], acc[h * NT + t]);
    }
  }
  store_logits<NH, NT>(acc, logits);
}

// logits for G heads x n tokens of one block: an odd G >= 3 starts with three
// heads x 4 tokens (12 accumulators), then pairs of heads x 4 tokens; one head
// (MHA) takes 8 tokens at a time. Rows up to round_up(n, 8) <= block_size exist
// in the block (block sizes are multiples of 8); their extra logits are masked later.
// The three-head tile (no lone head x 8 tokens, whose K chunks serve one head)
// measured 1.19x in-cache on bf16 9/3x64 and 1.04x on fp32 (1 thread, AMD Zen 3, 2026-12-01).
template <typename T, int D>
inline void qk_block(const float* q, int64_t G, const T* k, int64_t k_stride, int n, float* logits,
                     BlockPrefetcher& next, bool bf16_dot) {
  int64_t g = 0;
  if constexpr (kCodeRow<T> || kInt4Row<T>) {
    // Codes cost a widening per chunk (more than the FMAs of two heads), so groups of four heads
    // take four heads x two tokens, and each chunk is widened once for the four.
    for (; g + 4 <= G; g += 4) {
      for (int t = 0; t < n; t += 2) {
        qk_tile<T, D, 4, 2>(q + g * D, k + t * k_stride, k_stride, logits + g * kMaxBlockSize + t, bf16_dot);
        next.step();
      }
    }
  }
  if ((G - g) % 2 == 1 && G - g >= 3) {
    for (int t = 0; t < n; t += 4) {
      qk_tile<T, D, 3, 4>(q + g * D, k + t * k_stride, k_stride, logits + g * kMaxBlockSize + t, bf16_dot);
      next.step();
    }
    g += 3;
  }
  for (; g + 2 <= G; g += 2) {
    for (int t = 0; t < n; t += 4) {
      qk_tile<T, D, 2, 4>(q + g * D, k + t * k_stride, k_stride, logits + g * kMaxBlockSize + t, bf16_dot);
      next.step();
    }
  }
  if (g < G) {
    for (int t = 0; t < n; t += 8) {
      qk_tile<T, D, 1, 8>(q + g * D, k + t * k_stride, k_stride, logits + g * kMaxBlockSize + t, bf16_dot);
      next.step();
    }
  }
}

// Chunks of a V row per PV step for NG heads: the accumulators (NG x chunks x
// parts vectors) stay in registers across the block's tokens, and each chunk
// carries one FMA dependency chain per head, so more chunks hide the FMA latency
// while the registers last. Three fp32 heads take four vectors (12 accumulators):
// 1.03-1.10x in-cache on 9/3x64 against two (1 thread, AMD Zen 3, 2026-12-01).
template <typename T, int D, int NG>
constexpr int pv_chunks() {
  if constexpr (kParts<T> == 2) return 1;
  if constexpr (NG == 3 && (D / kW) % 4 == 0) return 4;
  return (D / kW) % 2 == 0 ? 2 : 1;
}

// acc[j] += sum_t p[j][t] * v_t for NG heads; the accumulators stay in registers
// across the block's tokens, pv_chunks() chunks of head_size at a time, and each V
// chunk is widened once for the NG heads.
template <typename T, int D, int NG>
inline void pv_heads(const float* p, const T* v, int64_t v_stride, int n, float* acc, BlockPrefetcher& next,
                     bool bf16_dot) {
#if defined(CPU_CAPABILITY_AVX512_BF16)
  if constexpr (std::is_same_v<T, Int8DotCode>) {
    if (D >= kMinPairedHeadSize || !bf16_dot) {
      return pv_heads_dpwssd<D, NG>(p, reinterpret_cast<const uint8_t*>(v), v_stride, n, acc, next);
    }
  }
  if constexpr (kFp8TableRows<T, D>) {
    return pv_heads_fp8_f32<kCodeFormat<T>, D, NG>(p, reinterpret_cast<const uint8_t*>(v), v_stride, n, acc, next);
  }
#endif
  constexpr int P = kParts<T>;
  constexpr int NC = pv_chunks<T, D, NG>();  // chunks per step
  constexpr int NV = NC * P;                                     // vectors per step
  for (int c = 0; c < D; c += NC * kChunk<T>) {
    Vec a[NG][NV];
    for (int j = 0; j < NG; ++j)
      for (int i = 0; i < NV; ++i) a[j][i] = Vec::loadu(acc + j * D + c + i * kW);
    for (int t = 0; t < n; ++t) {
      Vec vv[NV];
      for (int i = 0; i < NC; ++i) load_chunk(v + t * v_stride, c + i * kChunk<T>, vv + i * P);
      for (int j = 0; j < NG; ++j) {
        const Vec pb(p[j * kMaxBlockSize + t]);
        for (int i = 0; i < NV; ++i) a[j][i] = at::vec::fmadd(pb, vv[i], a[j][i]);
      }
    }
    for (int j = 0; j < NG; ++j)
      for (int i = 0; i < NV; ++i) a[j][i].store(acc + j * D + c + i * kW);
    next.step();
  }
}

// PV for G heads in groups of up to 4 (registers: 4 heads x 2 vectors + the V row).
template <typename T, int D>
inline void pv_block(const float* p, int64_t G, const T* v, int64_t v_stride, int n, float* acc,
                     BlockPrefetcher& next, bool bf16_dot) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) pv_heads<T, D, 4>(p + g * kMaxBlockSize, v, v_stride, n, acc + g * D, next, bf16_dot);
  switch (G - g) {
    case 3:
      return pv_heads<T, D, 3>(p + g * kMaxBlockSize, v, v_stride, n, acc + g * D, next, bf16_dot);
    case 2:
      return pv_heads<T, D, 2>(p + g * kMaxBlockSize, v, v_stride, n, acc + g * D, next, bf16_dot);
    case 1:
      return pv_heads<T, D, 1>(p + g * kMaxBlockSize, v, v_stride, n, acc + g * D, next, bf16_dot);
    default:
      return;
  }
}

// Online-softmax update of one head with n new logits (row of kMaxBlockSize):
// rescales the accumulator when the max grows, turns logits into exp(logit - m).
template <int D>
inline void softmax_update(float* logits, int n, float& m, float& l, float* acc) {
  const int padded = static_cast<int>(round_up(n, kW));
  for (int t = n; t < padded; ++t) logits[t] = kNegInf;
  Vec vmax(kNegInf);
  for (int t = 0; t < padded; t += kW) vmax = at::vec::maximum(vmax, Vec::loadu(logits + t));
  const float block_max = hmax(vmax);
  if (block_max > m) {
    const float correction = std::exp(m - block_max);  // 0 on the first block (m = -inf)
    if (l != 0.f) {
      const Vec cv(correction);
      for (int c = 0; c < D; c += kW) (Vec::loadu(acc + c) * cv).store(acc + c);
    }
    l *= correction;
    m = block_max;
  }
  const Vec mv(m);
  Vec sum(0.f);
  for (int t = 0; t < padded; t += kW) {
    const Vec e = (Vec::loadu(logits + t) - mv).exp_u20();
    e.store(logits + t);
    sum = sum + e;
  }
  l += hsum(sum);
}

// Which kv heads and token range one decode task covers.
struct DecodeWork {
  int64_t seq;
  int64_t kv_head0;      // first kv head of the group
  int64_t num_kv_heads;  // kv heads in the group
  int64_t begin, end;    // token range of the sequence
};

// Token rows of at least this many bytes are streamed (attend_blocks_streamed);
// narrower ones are swept a block at a time (attend_blocks_swept). From 4 KiB on,
// a kv head's slices of a block's rows all fall in the same few L1 sets, so
// computing one head over the whole block reads its K/V from L2 again, while the
// prefetches of the next block hold the L1 miss buffers (Zen 3 prefetches fill L1).
// Measured interleaved against the sweep (B32 ctx 2048 unless said, LLC flushed,
// AMD Zen 3, 2026-12-01): fp32 32/8x128 (4 KiB rows) 1.09-1.25x, B1 ctx 4096 1.12x,
// fp32 16/16x64 1.15x, fp32 32/32x128 (16 KiB) 1.27-1.40x, bf16 32/32x128 1.26x;
// narrower rows lost or tied: fp32 9/3x64 (768 B) 0.88-0.97x, bf16 28/4x128 (1 KiB)
// 0.84-0.93x, bf16 32/8x128 and 16/16x64 (2 KiB) 0.94-1.09x.
constexpr int64_t kStreamRowBytes = 4096;
// Tokens per group in the streamed decode: a multiple of 8 (a lone head's logits,
// MHA, take 8 tokens at once) that divides every block size. 4-token groups (even
// groups only) measured 0.86-1.07x of 8.
constexpr int kStreamTokens = 8;

// The state and block-independent inputs of one task's pass over its blocks.
template <typename T>
struct TaskView {
  int64_t G, heads, bs, row_stride, seq_len;
  const T* key_cache;    // at the task's first kv head
  const T* value_cache;  // at the task's first kv head
  const int32_t* table;  // the sequence's block table
  const float* slopes;   // at the task's first head, or nullptr
  float logit_scale;     // applied to the logits when Q.K^T ran on the unscaled bf16 query (kQueryBf16)
  float soft_cap;        // logits_soft_cap, 0 when off
  // int8 per token and head read directly (rows of uint8_t codes): the planes, and sum(q) of each head.
  const c10::Half* k_plane = nullptr;  // [num_blocks, block_size, num_kv_heads, 2]
  const c10::Half* v_plane = nullptr;
  int64_t num_kv_heads = 0, kv_head0 = 0;
  const float* qsum = nullptr;  // [heads]
  const float* qmul = nullptr;  // [heads], kDotInt16 only: Q.K^T ran on the int16 query, this times its logits
  bool bf16_dot = true;  // DecodeParams::bf16_dot: Q.K^T on vdpbf16ps (else fp32 FMAs), int8 P.V pairing
};

// int8 per token and head, read directly. Q.K^T ran on the codes c of each token, so the
// logit is s_t * (q.c) + z_t * sum(q) with the token's (scale s_t, zero z_t); and P.V runs
// on the codes with p_t * s_t, while sum_t p_t z_t goes to every element of the head's
// accumulator.

// Floats between a kv head's scales and its zeros in plane_floats' output: the block size
// rounded up to whole vectors.
inline int64_t plane_stride(int64_t bs) { return round_up(bs, kW); }

// The (scale, zero) pairs of one block's rows of every kv head as floats, by kv head:
// dst[(h * 2 + j) * plane_stride(bs) + t] is pair element j (scale, zero) of token t, kv
// head h, so the G heads of a kv head take a block's logits a vector of tokens at a time.
// The n = bs * num_kv_heads * 2 halves (a multiple of 16) are converted once per block
// with vcvtph2ps into dst's tail (c10::Half's scalar conversion per token, head and use
// cost about as much as the block's arithmetic), then spread out by kv head.
// dst: [plane_floats_size(bs, num_kv_heads)].
inline int64_t plane_floats_size(int64_t bs, int64_t num_kv_heads) {
  return num_kv_heads * 2 * plane_stride(bs) + bs * num_kv_heads * 2;
}

inline void plane_floats(const c10::Half* plane, int64_t slot0, int64_t num_kv_heads, int64_t bs, float* dst) {
  const c10::Half* src = plane + slot0 * num_kv_heads * 2;
  const int64_t n = bs * num_kv_heads * 2, ps = plane_stride(bs);
  float* flat = dst + num_kv_heads * 2 * ps;  // [bs, num_kv_heads, 2]
#if defined(CPU_CAPABILITY_AVX512)
  for (int64_t i = 0; i < n; i += 16) {
    _mm512_storeu_ps(flat + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(flat + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#else
  for (int64_t i = 0; i < n; ++i) flat[i] = static_cast<float>(src[i]);
#endif
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    float* scale = dst + h * 2 * ps;
    float* zero = scale + ps;
    for (int64_t t = 0; t < bs; ++t) {
      scale[t] = flat[(t * num_kv_heads + h) * 2];
      zero[t] = flat[(t * num_kv_heads + h) * 2 + 1];
    }
  }
}

// Bytes of one block's (scale, zero) pairs of every kv head, in K's (or V's) plane.
inline int64_t block_plane_bytes(int64_t bs, int64_t num_kv_heads) {
  return bs * num_kv_heads * 2 * static_cast<int64_t>(sizeof(c10::Half));
}

// Prefetches the lines of [p, p + bytes) into L2.
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
  if (bytes > 0) __builtin_prefetch(c + bytes - 1, 0, 2);
}

// Loads block `block`'s (scale, zero) pairs of every kv head, K and V, a word from each
// line; returns a value made from them (kept by the caller, so the loads stay). Decode
// calls it before sweeping a block's rows: the planes are a separate tensor that neither
// the sweep nor the prefetchers cover, so each block's K and V planes were two misses on
// the critical path when their logits and weights were computed (perf put a quarter of
// an int8 decode's time on them). Loaded this way their misses overlap the sweep's; the
// swept decode also prefetches the next unit's planes (prefetch_planes). int8 against the
// bf16 cache, bf16 9/3x64 and 32/8x128 heads, B32 ctx 2048 (AMD Zen 4, 2026-12-02, one run
// each): the prefetch alone 0.93x and 1.17x; the loads alone 1.10x and 1.33x; both 1.08-1.24x
// and 1.29-1.33x over four runs (the loads are the gain; the prefetch beside them is within
// this box's noise).
inline uint32_t touch_planes(const c10::Half* k_plane, const c10::Half* v_plane, int64_t block, int64_t bs,
                             int64_t num_kv_heads) {
  const int64_t offset = block * bs * num_kv_heads * 2, bytes = block_plane_bytes(bs, num_kv_heads);
  const char* k = reinterpret_cast<const char*>(k_plane + offset);
  const char* v = reinterpret_cast<const char*>(v_plane + offset);
  uint32_t bits = 0;
  for (int64_t off = 0; off < bytes; off += 64) {
    uint32_t x, y;
    std::memcpy(&x, k + off, sizeof(x));
    std::memcpy(&y, v + off, sizeof(y));
    bits ^= x ^ y;
  }
  return bits;
}

template <typename T>
inline uint32_t touch_planes(const TaskView<T>& tv, int64_t b) {
  return touch_planes(tv.k_plane, tv.v_plane, tv.table[b], tv.bs, tv.num_kv_heads);
}

// Prefetches block b's (scale, zero) pairs of every kv head, K and V.
template <typename T>
inline void prefetch_planes(const TaskView<T>& tv, int64_t b) {
  const int64_t offset = static_cast<int64_t>(tv.table[b]) * tv.bs * tv.num_kv_heads * 2;
  prefetch_lines(tv.k_plane + offset, block_plane_bytes(tv.bs, tv.num_kv_heads));
  prefetch_lines(tv.v_plane + offset, block_plane_bytes(tv.bs, tv.num_kv_heads));
}

// Logits of tokens [from, n) of the G heads of task-local kv head h: the code dot products
// become s_t * q.c + z_t * sum(q) (times the int16 query's scale first, kDotInt16), a vector
// of tokens at a time. (No local arrays in these two: GCC vectorized such loops with aligned
// 32-byte loads of stack arrays it had not aligned, in the AVX-512 build.) pf: plane_floats
// of the block.
template <typename T>
inline void affine_logits(const TaskView<T>& tv, int64_t h, const float* pf, int from, int n, float* logits) {
  const float* scale = pf + (tv.kv_head0 + h) * 2 * plane_stride(tv.bs);
  const float* zero = scale + plane_stride(tv.bs);
  for (int64_t g = 0; g < tv.G; ++g) {
    float* row = logits + g * kMaxBlockSize;
    const float qm = kDotInt16<T> ? tv.qmul[h * tv.G + g] : 1.f, qs = tv.qsum[h * tv.G + g];
    const Vec qmv(qm), qsv(qs);
    int t = from;
    for (; t + kW <= n; t += kW) {
      const Vec x = Vec::loadu(row + t) * qmv;
      at::vec::fmadd(Vec::loadu(scale + t), x, Vec::loadu(zero + t) * qsv).store(row + t);
    }
    for (; t < n; ++t) row[t] = scale[t] * (row[t] * qm) + zero[t] * qs;
  }
}

// Probabilities of tokens [from, n) of the G heads of task-local kv head h: p_t becomes the
// weight p_t * s_t of the codes, and sum_t p_t z_t goes to every element of the head's accumulator.
template <typename T, int D>
inline void affine_probs(const TaskView<T>& tv, int64_t h, const float* pf, int from, int n, float* logits,
                         float* acc) {
  const float* scale = pf + (tv.kv_head0 + h) * 2 * plane_stride(tv.bs);
  const float* zero = scale + plane_stride(tv.bs);
  for (int64_t g = 0; g < tv.G; ++g) {
    float* row = logits + g * kMaxBlockSize;
    Vec shifts(0.f);
    int t = from;
    for (; t + kW <= n; t += kW) {
      const Vec p = Vec::loadu(row + t);
      shifts = at::vec::fmadd(p, Vec::loadu(zero + t), shifts);
      (p * Vec::loadu(scale + t)).store(row + t);
    }
    float shift = hsum(shifts);
    for (; t < n; ++t) {
      shift += row[t] * zero[t];
      row[t] *= scale[t];
    }
    const Vec sv(shift);
    float* a = acc + g * D;
    for (int c = 0; c < D; c += kW) (Vec::loadu(a + c) + sv).store(a + c);
  }
}

// row[t] = cap * tanh(row[t] / cap) for t < n, a vector at a time: rows hold a multiple
// of kW logits, so n rounded up to kW stays inside (the extra lanes are masked later).
inline void soft_cap_logits(float* row, int64_t n, float cap) {
  const Vec c(cap), inv(1.f / cap);
  for (int64_t t = 0; t < n; t += kW) (c * (Vec::loadu(row + t) * inv).tanh()).store(row + t);
}

// Turns the logits of one block or unit of blocks ([heads, kMaxBlockSize], tokens
// [0, n), token0 the first) into probabilities: soft-caps them (when on), masks the
// tokens before a split task's or a window's start (skip), adds ALiBi, and runs the
// online-softmax update of every head.
template <typename T, int D>
inline void block_softmax(const TaskView<T>& tv, int64_t token0, int skip, int n, float* logits, DecodeScratch& s) {
  for (int64_t head = 0; head < tv.heads; ++head) {
    float* row = logits + head * kMaxBlockSize;
    if constexpr (kQueryBf16<T>) {
      // Rows hold kMaxBlockSize logits, a multiple of kW, so n rounded up to kW stays inside.
      const Vec scale(tv.logit_scale);
      for (int t = 0; t < n; t += kW) (Vec::loadu(row + t) * scale).store(row + t);
    }
    if (tv.soft_cap > 0.f) soft_cap_logits(row, n, tv.soft_cap);
    for (int t = 0; t < skip; ++t) row[t] = kNegInf;
    if (tv.slopes) {
      const float slope = tv.slopes[head];
      for (int t = skip; t < n; ++t) row[t] += slope * static_cast<float>(token0 + t - (tv.seq_len - 1));
    }
    softmax_update<D>(row, n, s.m[head], s.l[head], s.acc.data() + head * D);
  }
}

// Blocks per softmax update in the swept decode: kMaxBlockSize tokens' worth (two
// blocks of 16 tokens), so the sweep reads the K and V of several blocks at once and
// the per-update costs (softmax, accumulator loads and stores) are shared.
inline int64_t swept_unit(int64_t block_size) { return std::max<int64_t>(1, kMaxBlockSize / block_size); }
// A unit's K and V ranges (block sizes are multiples of 8) fit the sweep's and the prefetcher's range lists.
static_assert(2 * (kMaxBlockSize / 8) <= BlockPrefetcher::kMaxRanges, "a unit has more ranges than kMaxRanges");

// Narrow rows: the blocks are taken in units of swept_unit(); each unit's K and V
// rows are swept into L1/L2 together (touch_ranges), then QK^T runs over the unit
// one block and kv head after the other, one softmax update covers the unit, then
// PV, while the next unit is prefetched. Against one block at a time (K swept,
// then V), measured interleaved with the tiles above (LLC flushed, 2 threads, AMD
// Zen 3, 2026-12-01): fp32 9/3x64 1.10-1.20x (B32 ctx 2048, block sizes 8/16/32)
// and 1.10-1.18x (B8 ctx 1024); bf16 9/3x64 1.07-1.16x and 1.04-1.06x; bf16
// 32/8x128 1.08x (B32 ctx 2048) and 1.05x (B1 ctx 4096) from the units alone.
template <typename T, int D>
void attend_blocks_swept(const TaskView<T>& tv, const DecodeWork& w, DecodeScratch& s) {
  const int64_t G = tv.G, bs = tv.bs, row_stride = tv.row_stride;
  constexpr int64_t E = D / kPack<T>;  // elements of one kv head's row
  const int64_t first_block = w.begin / bs, end_block = (w.end + bs - 1) / bs;
  const int64_t unit = swept_unit(bs);
  float* logits = s.logits.data();  // [heads, kMaxBlockSize]
  // Bytes of one block's K (or V) rows of this task: whole rows when the task has all kv heads.
  const int64_t block_bytes = ((bs - 1) * row_stride + w.num_kv_heads * E) * static_cast<int64_t>(sizeof(T));
  auto keys = [&](int64_t b) { return tv.key_cache + static_cast<int64_t>(tv.table[b]) * bs * row_stride; };
  auto values = [&](int64_t b) { return tv.value_cache + static_cast<int64_t>(tv.table[b]) * bs * row_stride; };
  for (int64_t b0 = first_block; b0 < end_block; b0 += unit) {
    const int64_t b1 = std::min(end_block, b0 + unit), b2 = std::min(end_block, b1 + unit);
    const char* rows[BlockPrefetcher::kMaxRanges];
    int num_rows = 0;
    for (int64_t b = b0; b < b1; ++b) {
      rows[num_rows++] = reinterpret_cast<const char*>(keys(b));
      rows[num_rows++] = reinterpret_cast<const char*>(values(b));
    }
    uint32_t plane_bits = 0;
    if constexpr (kPlaneRow<T>) {
      // The unit's planes are loaded before its rows, so their misses overlap the sweep's.
      for (int64_t b = b0; b < b1; ++b) plane_bits ^= touch_planes(tv, b);
    }
    // Rows of codes in the bf16 kernels (fp8 through the byte tables, int8 on integer dot
    // products) are not swept (an int8 unit's planes still are): their arithmetic gives the
    // previous unit's prefetches the time to bring them in, and the sweep's loads were then pure
    // cost. Without it, bf16 B32 ctx 2048, LLC flushed (Intel Xeon with AMX, 2026-12-06): fp8
    // 1.02-1.08x on 9/3x64 heads and 1.10x on 32/8x128, int8 1.01x and 1.06x (1.12-1.16x in
    // cache); the bf16 cache, whose arithmetic is shorter, lost 1.14x on 9/3x64 without it.
    // AVX2's int8 (vpmaddwd) ties with and without it (9/3x64, AMD Zen 3, 2026-12-06).
    float swept = 0.f;
    if constexpr (!kFp8TableRows<T, D> && !kDotInt16<T>) swept = touch_ranges(rows, num_rows, block_bytes);
    s.sink = swept + static_cast<float>(plane_bits & 1);
    // The next unit in the order its arithmetic reads it: K rows, then V rows.
    BlockPrefetcher next;
    for (int64_t b = b1; b < b2; ++b) next.add(keys(b), block_bytes);
    for (int64_t b = b1; b < b2; ++b) next.add(values(b), block_bytes);
    if constexpr (kPlaneRow<T>) {
      for (int64_t b = b1; b < b2; ++b) prefetch_planes(tv, b);
    }
    const int64_t token0 = b0 * bs;
    // A split task may start inside a block: tokens before w.begin are masked out.
    const int skip = static_cast<int>(std::max<int64_t>(0, w.begin - token0));
    const int n = static_cast<int>(std::min(unit * bs, w.end - token0));  // tokens of the unit
    // The unit's K rows first, then its V rows. Each token row is one stretch of
    // [num_kv_heads, D], so a pass over the rows for one head after the other walks
    // every row's memory in order. Alternating K and V head by head (twice the
    // streams) read ~1.4x slower from memory (AMD Zen 3, 2026-11-30).
    // In the unit's first block, Q.K^T starts at the last multiple of 8 rows at or before
    // `skip` (its tiles need rows up to round_up(nb, 8), and blocks are multiples of 8) and
    // P.V at `skip` itself, so no V row before the task's start (or window) is read.
    for (int64_t b = b0; b < b1; ++b) {
      const int t0 = static_cast<int>((b - b0) * bs), nb = std::min(static_cast<int>(bs), n - t0);
      const int k_from = b == b0 ? skip / 8 * 8 : 0;
      if constexpr (kPlaneRow<T>) plane_floats(tv.k_plane, tv.table[b] * bs, tv.num_kv_heads, bs, s.plane.data());
      for (int64_t h = 0; h < w.num_kv_heads; ++h) {
        qk_block<T, D>(s.q.data() + h * G * D, G, keys(b) + k_from * row_stride + h * E, row_stride, nb - k_from,
                       logits + h * G * kMaxBlockSize + t0 + k_from, next, tv.bf16_dot);
        if constexpr (kPlaneRow<T>) {
          affine_logits(tv, h, s.plane.data(), k_from, nb, logits + h * G * kMaxBlockSize + t0);
        }
      }
    }
    block_softmax<T, D>(tv, token0, skip, n, logits, s);
    for (int64_t b = b0; b < b1; ++b) {
      const int t0 = static_cast<int>((b - b0) * bs), nb = std::min(static_cast<int>(bs), n - t0);
      const int v_from = b == b0 ? skip : 0;
      if constexpr (kPlaneRow<T>) plane_floats(tv.v_plane, tv.table[b] * bs, tv.num_kv_heads, bs, s.plane.data());
      for (int64_t h = 0; h < w.num_kv_heads; ++h) {
        if constexpr (kPlaneRow<T>) {
          affine_probs<T, D>(tv, h, s.plane.data(), v_from, nb, logits + h * G * kMaxBlockSize + t0,
                             s.acc.data() + h * G * D);
        }
        pv_block<T, D>(logits + h * G * kMaxBlockSize + t0 + v_from, G, values(b) + v_from * row_stride + h * E,
                       row_stride, nb - v_from, s.acc.data() + h * G * D, next, tv.bf16_dot);
      }
    }
  }
}

// Wide rows (whole rows of at least kStreamRowBytes): each block is consumed in
// groups of kStreamTokens whole rows, every kv head's part of a group before the
// next group (QK^T over the K rows, then PV over the V rows), so the rows are read
// close to memory order and a group's K or V is used while it is still in L1. The
// StreamPrefetcher runs a fixed lead ahead, across block boundaries.
template <typename T, int D>
void attend_blocks_streamed(const TaskView<T>& tv, const DecodeWork& w, DecodeScratch& s) {
  const int64_t G = tv.G, bs = tv.bs, row_stride = tv.row_stride, nkv = w.num_kv_heads;
  constexpr int64_t E = D / kPack<T>;  // elements of one kv head's row
  const int64_t first_block = w.begin / bs, end_block = (w.end + bs - 1) / bs;
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(T));
  const int64_t block_bytes = bs * row_bytes;  // one block's K (or V) rows
  const int64_t block_lines = (block_bytes + 63) / 64;
  const int64_t group_bytes = kStreamTokens * row_bytes;
  float* logits = s.logits.data();  // [heads, kMaxBlockSize]
  StreamPrefetcher ahead(tv.key_cache, tv.value_cache, tv.table, first_block, end_block, block_bytes);
  BlockPrefetcher none;  // the stream prefetcher does all of it
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t block_offset = static_cast<int64_t>(tv.table[b]) * bs * row_stride;
    const T* k = tv.key_cache + block_offset;
    const T* v = tv.value_cache + block_offset;
    const int64_t token0 = b * bs;
    const int skip = static_cast<int>(std::max<int64_t>(0, w.begin - token0));
    const int n = static_cast<int>(std::min(bs, w.end - token0));
    const int64_t k_line = (b - first_block) * 2 * block_lines, v_line = k_line + block_lines;
    ahead.advance_to(k_line);
    if constexpr (kPlaneRow<T>) {
      // The block's planes are loaded now, to be ready when its logits are (see attend_blocks_swept).
      s.sink = static_cast<float>(touch_planes(tv, b) & 1);
    }
    // Rows up to round_up(n, 8) <= block_size exist; the extra logits are masked by softmax_update.
    // Groups wholly before `skip` (a window's start) are not read; P.V starts at skip itself.
    const int first_group = skip / kStreamTokens * kStreamTokens;
    for (int t = first_group; t < n; t += kStreamTokens) {
      for (int64_t h = 0; h < nkv; ++h) {
        qk_block<T, D>(s.q.data() + h * G * D, G, k + t * row_stride + h * E, row_stride, kStreamTokens,
                       logits + h * G * kMaxBlockSize + t, none, tv.bf16_dot);
        ahead.advance_to(k_line + (t * row_bytes + (h + 1) * group_bytes / nkv) / 64);
      }
    }
    if constexpr (kPlaneRow<T>) {
      plane_floats(tv.k_plane, tv.table[b] * bs, tv.num_kv_heads, bs, s.plane.data());
      for (int64_t h = 0; h < nkv; ++h) {
        affine_logits(tv, h, s.plane.data(), first_group, n, logits + h * G * kMaxBlockSize);
      }
    }
    block_softmax<T, D>(tv, token0, skip, n, logits, s);
    if constexpr (kPlaneRow<T>) {
      plane_floats(tv.v_plane, tv.table[b] * bs, tv.num_kv_heads, bs, s.plane.data());
      for (int64_t h = 0; h < nkv; ++h) {
        affine_probs<T, D>(tv, h, s.plane.data(), skip, n, logits + h * G * kMaxBlockSize,
                           s.acc.data() + h * G * D);
      }
    }
    for (int t = first_group; t < n; t += kStreamTokens) {
      const int from = std::max(t, skip);
      const int tokens = std::min(t + kStreamTokens, n) - from;
      for (int64_t h = 0; h < nkv; ++h) {
        pv_block<T, D>(logits + h * G * kMaxBlockSize + from, G, v + from * row_stride + h * E, row_stride, tokens,
                       s.acc.data() + h * G * D, none, tv.bf16_dot);
        ahead.advance_to(v_line + (t * row_bytes + (h + 1) * group_bytes / nkv) / 64);
      }
    }
  }
}

// A quantized cache's K (or V) rows for one op call (cpu/kv_dequant.h).
inline QuantRows quant_rows(const PagedAttentionParams& p, bool value) {
  const KVCacheDType f = p.kv_format;
  return {f, static_cast<const uint8_t*>(value ? p.value_cache : p.key_cache), value ? p.v_plane : p.k_plane,
          fp8_mul(f, value ? p.v_scale : p.k_scale), p.num_kv_heads};
}

// Decode over a quantized cache, block by block: the block's codes of the task's kv
// heads (K then V) are swept into L1/L2 while the next block is prefetched, then for
// each kv head its rows are dequantized into s.stage ([bs, D] fp32) and run through
// the fp32 tiles: Q.K^T for every kv head, one softmax update, P.V for every kv head.
// As in the swept path, Q.K^T starts at the last multiple of 8 rows at or before
// `skip` and P.V at `skip`, and rows up to round_up(n, 8) (inside the block) are read.
template <int D>
void attend_blocks_staged(const TaskView<float>& tv, const QuantRows& kq, const QuantRows& vq, const DecodeWork& w,
                          DecodeScratch& s) {
  const int64_t G = tv.G, bs = tv.bs, nkv = kq.num_kv_heads;
  const int64_t first_block = w.begin / bs, end_block = (w.end + bs - 1) / bs;
  const int64_t kb = row_bytes(kq.format, D);
  // The task's part of one block's rows: from its first kv head's row of token 0 to its last of token bs - 1.
  const int64_t block_bytes = ((bs - 1) * nkv + w.num_kv_heads) * kb;
  auto rows_of = [&](const QuantRows& q, int64_t b) {
    return reinterpret_cast<const char*>(q.codes) + (static_cast<int64_t>(tv.table[b]) * bs * nkv + w.kv_head0) * kb;
  };
  float* logits = s.logits.data();
  float* stage = s.stage.data();
  for (int64_t b = first_block; b < end_block; ++b) {
    const char* swept[2] = {rows_of(kq, b), rows_of(vq, b)};
    uint32_t plane_bits = 0;
    if (kq.plane) plane_bits = touch_planes(kq.plane, vq.plane, tv.table[b], bs, nkv);  // before the rows, as in the sweep
    s.sink = touch_ranges(swept, 2, block_bytes) + static_cast<float>(plane_bits & 1);
    BlockPrefetcher next;
    if (b + 1 < end_block) {
      next.add(rows_of(kq, b + 1), block_bytes);
      next.add(rows_of(vq, b + 1), block_bytes);
    }
    const int64_t token0 = b * bs, slot0 = static_cast<int64_t>(tv.table[b]) * bs;
    const int skip = static_cast<int>(std::max<int64_t>(0, w.begin - token0));
    const int n = static_cast<int>(std::min(bs, w.end - token0));
    const int k_from = skip / 8 * 8, k_rows = static_cast<int>(round_up(n, 8));
    for (int64_t h = 0; h < w.num_kv_heads; ++h) {
      for (int t = k_from; t < k_rows; ++t) kq.read<D>(slot0 + t, w.kv_head0 + h, stage + t * D);
      qk_block<float, D>(s.q.data() + h * G * D, G, stage + k_from * D, D, n - k_from,
                         logits + h * G * kMaxBlockSize + k_from, next, false);
    }
    block_softmax<float, D>(tv, token0, skip, n, logits, s);
    for (int64_t h = 0; h < w.num_kv_heads; ++h) {
      for (int t = skip; t < n; ++t) vq.read<D>(slot0 + t, w.kv_head0 + h, stage + t * D);
      pv_block<float, D>(logits + h * G * kMaxBlockSize + skip, G, stage + skip * D, D, n - skip,
                         s.acc.data() + h * G * D, next, false);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512_BF16) || defined(CPU_CAPABILITY_AVX2)
// Where element d of the int16 query sits for rows of R (kDotInt16), and how many words the
// row holds (zero past D): in order for int8 codes, in int4_query_pos' order for int4.
template <typename R>
constexpr int64_t query_word_pos(int64_t d) {
  return kInt4Row<R> ? int4_query_pos(d) : d;
}
template <typename R, int D>
constexpr int64_t kQueryWords = kInt4Row<R> ? round_up(D, Int4Dot::kStep) : round_up(D, 32);

// One query row times `scale`, quantized to int16 against its largest |x| for int8 or int4
// codes on integer dot products (kDotInt16): dst's first kQueryWords<R, D> int16 (zero where no
// element goes) hold it in query_word_pos<R>'s order, mul its scale (x ~ mul * dst), sum = mul
// * the sum of dst, so that the zero points see the same query as the codes. A non-finite
// query gives mul NaN, so the output is NaN as on the other paths.
template <typename R, typename T, int D>
inline void quantize_query_i16(const T* query, float scale, float* dst, float& mul, float& sum) {
  alignas(64) float x[D];
  float top = 0.f;
  bool finite = true;
  for (int64_t d = 0; d < D; ++d) {
    x[d] = to_f32(query[d]) * scale;
    finite = finite && std::isfinite(x[d]);
    top = std::max(top, std::fabs(x[d]));
  }
  const float inv = finite && top > 0.f ? 32767.f / top : 0.f;
  auto* words = reinterpret_cast<int16_t*>(dst);
  static_assert(kQueryWords<R, D> <= 2 * D, "the int16 row fits the head's fp32 row");
  std::fill(words, words + kQueryWords<R, D>, int16_t{0});
  int64_t total = 0;
  for (int64_t d = 0; d < D; ++d) {
    const float r = finite ? std::clamp(x[d] * inv, -32767.f, 32767.f) : 0.f;
    const int16_t word = static_cast<int16_t>(std::lrint(r));
    words[query_word_pos<R>(d)] = word;
    total += word;
  }
  mul = finite ? top / 32767.f : std::numeric_limits<float>::quiet_NaN();
  sum = mul * static_cast<float>(total);
}
#endif

// Attention of the query heads of a group of kv heads over tokens [begin, end);
// leaves m, l and the unnormalized accumulators ([group heads, D], chunk order)
// in the scratch. A group of several kv heads reads each block as one
// contiguous stretch (token rows are [num_kv_heads, head_size]), which the
// stream prefetchers, the TLB and the DRAM pages prefer.
// attend_tokens over rows of element type R: the cache's own (T, unquantized), or fp8 / int8
// codes read directly. The query goes to s.q in R's chunk order, pre-scaled (times fp8's code
// multiplier, cpu/kv_dequant.h); with bf16 dot products it stays bf16 and unscaled.
template <typename T, typename R, int D>
void attend_rows(const DecodeParams& p, const DecodeWork& w, DecodeScratch& s) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t heads = w.num_kv_heads * G;
  const int64_t row_stride = p.num_kv_heads * D / kPack<R>;  // elements between tokens
  const T* query = static_cast<const T*>(p.query) + w.seq * p.query_stride + w.kv_head0 * G * D;
  const float q_scale = kFp8Row<R> ? p.scale * fp8_mul(p.kv_format, p.k_scale) : p.scale;
  if constexpr (kPlaneRow<R>) {
    s.qsum.resize(heads);
    s.qmul.resize(heads);
    s.plane.resize(plane_floats_size(p.block_size, p.num_kv_heads));
  }
  for (int64_t h = 0; h < heads; ++h) {
    if constexpr (kDotInt16<R>) {
#if defined(CPU_CAPABILITY_AVX512_BF16) || defined(CPU_CAPABILITY_AVX2)
      quantize_query_i16<R, T, D>(query + h * D, q_scale, s.q.data() + h * D, s.qmul[h], s.qsum[h]);
#endif
    } else if constexpr (kQueryBf16<R>) {
      // The bf16 row as given, in the first half of the head's fp32 row (so the
      // callers' offsets h * D still find it); the scale (times fp8's tensor scale,
      // fp8_bf16_pairs giving the codes' own values) goes on the logits.
      T* row = reinterpret_cast<T*>(s.q.data() + h * D);
      if (kBf16FmaRows<R, D> && !p.bf16_dot) {  // fp32, in the order of Bf16Widen's vectors
        for (int64_t d = 0; d < D; ++d) s.q[h * D + bf16_widened_pos(d)] = to_f32(query[h * D + d]);
      } else if (kFp8TableRows<R, D> && !p.bf16_dot) {  // fp32, in the order of Fp8Words::convert_f32
        for (int64_t d = 0; d < D; ++d) s.q[h * D + fp8_acc_pos(d)] = to_f32(query[h * D + d]);
      } else if (kFp8TableRows<R, D>) {  // bf16, in the order of Fp8Words::convert
        for (int64_t d = 0; d < D; ++d) row[fp8_query_pos(d)] = query[h * D + d];
      } else {
        std::copy(query + h * D, query + (h + 1) * D, row);
      }
    } else {
      float sum = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float x = to_f32(query[h * D + d]) * q_scale;
        s.q[h * D + chunk_pos<R>(d)] = x;
        sum += x;
      }
      if constexpr (kPlaneRow<R>) s.qsum[h] = sum;
    }
  }
  s.start(heads, D);
  TaskView<R> tv{G,
                 heads,
                 p.block_size,
                 row_stride,
                 p.seq_lens[w.seq],
                 static_cast<const R*>(p.key_cache) + w.kv_head0 * D / kPack<R>,
                 static_cast<const R*>(p.value_cache) + w.kv_head0 * D / kPack<R>,
                 p.block_tables + w.seq * p.max_blocks_per_seq,
                 p.alibi_slopes ? p.alibi_slopes + w.kv_head0 * G : nullptr,
                 kFp8Row<R> ? p.scale * p.k_scale : p.scale,
                 p.logits_soft_cap};
  tv.bf16_dot = p.bf16_dot;
  if constexpr (kPlaneRow<R>) {
    tv.k_plane = p.k_plane;
    tv.v_plane = p.v_plane;
    tv.num_kv_heads = p.num_kv_heads;
    tv.kv_head0 = w.kv_head0;
    tv.qsum = s.qsum.data();
    tv.qmul = s.qmul.data();
  }
  const bool whole_rows = w.num_kv_heads == p.num_kv_heads;
  if (whole_rows && row_stride * static_cast<int64_t>(sizeof(R)) >= kStreamRowBytes) {
    return attend_blocks_streamed<R, D>(tv, w, s);
  }
  attend_blocks_swept<R, D>(tv, w, s);
}

// Attention of the query heads of a group of kv heads over tokens [begin, end);
// leaves m, l and the unnormalized accumulators ([group heads, D], chunk order)
// in the scratch. A group of several kv heads reads each block as one
// contiguous stretch (token rows are [num_kv_heads, head_size]), which the
// stream prefetchers, the TLB and the DRAM pages prefer. Quantized caches are read directly
// (their codes widened in registers), int4 through the staging tile where kInt4Direct is off.
template <typename T, int D>
void attend_tokens(const DecodeParams& p, const DecodeWork& w, DecodeScratch& s) {
  switch (p.kv_format) {
    case KVCacheDType::kAuto:
      return attend_rows<T, T, D>(p, w, s);
    case KVCacheDType::kFp8E4M3:
      return attend_rows<T, c10::Float8_e4m3fn, D>(p, w, s);
    case KVCacheDType::kFp8E5M2:
      return attend_rows<T, c10::Float8_e5m2, D>(p, w, s);
    case KVCacheDType::kInt8PerTokenHead:
      if constexpr (kInt16Query<T>) return attend_rows<T, Int8DotCode, D>(p, w, s);
      return attend_rows<T, uint8_t, D>(p, w, s);
    case KVCacheDType::kInt4PerTokenHead:
      if constexpr (kInt4Direct<D>) {
        if constexpr (kInt16Query<T>) return attend_rows<T, Int4DotCode, D>(p, w, s);
        return attend_rows<T, Int4Code, D>(p, w, s);
      }
      break;
  }
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t heads = w.num_kv_heads * G;
  const T* query = static_cast<const T*>(p.query) + w.seq * p.query_stride + w.kv_head0 * G * D;
  for (int64_t h = 0; h < heads; ++h) {  // the fp32 rows of the staging tile: in order, pre-scaled
    for (int64_t d = 0; d < D; ++d) s.q[h * D + d] = to_f32(query[h * D + d]) * p.scale;
  }
  s.start(heads, D);
  const TaskView<float> staged{G, heads, p.block_size, p.num_kv_heads * D, p.seq_lens[w.seq], nullptr, nullptr,
                               p.block_tables + w.seq * p.max_blocks_per_seq,
                               p.alibi_slopes ? p.alibi_slopes + w.kv_head0 * G : nullptr, p.scale,
                               p.logits_soft_cap};
  attend_blocks_staged<D>(staged, quant_rows(p, false), quant_rows(p, true), w, s);
}

// dst[d] = src[chunk position of d] * scale, in the output dtype.
template <typename T, typename OutT>
inline void store_row(OutT* dst, const float* src, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<OutT>(src[chunk_pos<T>(i)] * scale);
}

// store_row for an accumulator row of this call: in the chunk order of the cache's rows,
// or in order when they were dequantized into fp32.
template <typename T, int D>
inline void store_acc(const PagedAttentionParams& p, T* dst, const float* src, float scale) {
  if (p.kv_format == KVCacheDType::kAuto) return store_row<T>(dst, src, scale, D);
  // int4 rows read directly left P.V in the order of the codes' halves (RowFormat).
  if (kInt4Direct<D> && p.kv_format == KVCacheDType::kInt4PerTokenHead) return store_row<Int4Code>(dst, src, scale, D);
  // fp8 rows were read as code values times fp8_mul's inverse (cpu/kv_dequant.h): the V multiplier goes here.
  const float mul = is_fp8(p.kv_format) ? scale * fp8_mul(p.kv_format, p.v_scale) : scale;
#if defined(CPU_CAPABILITY_AVX512_BF16)
  if constexpr (kFp8Tables<D>) {
    if (is_fp8(p.kv_format)) {  // P.V ran on rows through the tables (pv_heads_fp8_f32)
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[fp8_acc_pos(d)] * mul);
      return;
    }
  }
#endif
  store_row<float>(dst, src, mul, D);
}

// Splits the kv heads into groups. Whole token rows read fastest (a group of one
// head out of eight reads 1/8 of each row and ran ~2.5x slower than whole rows),
// so groups stay as large as the thread count allows: the largest group size
// giving at least one task per thread, in a count that divides evenly among
// the threads or is large enough (4 per thread) for the dynamic schedule to even out.
// (v2 only: v1 always takes whole rows and splits long sequences instead.)
int64_t kv_heads_per_task(const DecodeParams& p, int64_t parts) {
  const int64_t threads = at::get_num_threads();
  for (int64_t n = p.num_kv_heads; n > 1; --n) {
    if (p.num_kv_heads % n != 0) continue;
    const int64_t tasks = p.num_seqs * parts * (p.num_kv_heads / n);
    if (tasks >= threads && (tasks % threads == 0 || tasks >= 4 * threads)) return n;
  }
  return 1;
}

// ---- v1: work split by KV length -------------------------------------------------------
//
// v1 tasks are (sequence, token range) over all kv heads. The token ranges cut
// the total KV length into about kTasksPerThread pieces per thread (never below
// kMinSplitTokens), so one long sequence keeps every thread busy and a batch of
// uneven lengths is balanced; the pieces of a split sequence leave their partial
// softmax state, merged afterwards.
// 4 pieces per thread of at least 512 tokens, the size of v2's partitions: on one
// long sequence v2 measured 3-8% faster than 8 pieces per thread of 256 tokens
// (each piece starts on a cold block and adds a partial state to merge).
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kMinSplitTokens = 512;

struct SplitTask {
  int64_t seq, begin, end;
  int64_t split;  // index of the sequence among the split ones, or -1 (unsplit: writes out directly)
  int64_t piece;  // index of this piece's partial state (when split)
};

struct DecodePlan {
  std::vector<SplitTask> tasks;                  // longest first
  std::vector<int64_t> split_first, split_count;  // per split sequence: its pieces' partial states
  int64_t num_pieces = 0;
};

// The first key the decode query of a sequence of len tokens attends to (0 without a window).
inline int64_t decode_first_key(const DecodeParams& p, int64_t len) {
  return window_first_key(len - 1, p.sliding_window);
}

DecodePlan plan_decode(const DecodeParams& p) {
  int64_t total = 0;  // tokens attended: a window bounds each sequence's work
  for (int64_t s = 0; s < p.num_seqs; ++s) total += p.seq_lens[s] - decode_first_key(p, p.seq_lens[s]);
  const int64_t threads = at::get_num_threads();
  const int64_t piece = std::max(kMinSplitTokens, (total + kTasksPerThread * threads - 1) / (kTasksPerThread * threads));
  DecodePlan plan;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t len = p.seq_lens[s];
    const int64_t first = decode_first_key(p, len);
    const int64_t pieces = std::max<int64_t>(1, (len - first + piece - 1) / piece);
    if (pieces == 1) {
      plan.tasks.push_back({s, first, len, -1, -1});
      continue;
    }
    // Equal pieces, cut at block boundaries so no block is read by two tasks; the first
    // starts at the window's first key, inside its block.
    const int64_t base = first / p.block_size * p.block_size;
    const int64_t step = round_up((len - base + pieces - 1) / pieces, p.block_size);
    const int64_t split = static_cast<int64_t>(plan.split_first.size());
    plan.split_first.push_back(plan.num_pieces);
    int64_t count = 0;
    for (int64_t begin = base; begin < len; begin += step, ++count) {
      plan.tasks.push_back({s, std::max(begin, first), std::min(len, begin + step), split, plan.num_pieces++});
    }
    plan.split_count.push_back(count);
  }
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(),
                   [](const SplitTask& a, const SplitTask& b) { return a.end - a.begin > b.end - b.begin; });
  return plan;
}

// Partial softmax states of the pieces of split sequences: [piece, num_heads] m and l,
// [piece, num_heads, D] unnormalized accumulators (chunk order). `pending` counts the
// pieces of each split sequence still running: the last one to finish merges, so
// the merge needs no second parallel region (a fork/join costs a time slice on a busy box).
struct Partials {
  std::vector<float> m, l, acc;
  std::unique_ptr<std::atomic<int64_t>[]> pending;
};

// out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j over the pieces j of one sequence.
template <typename T, int D>
void merge_pieces(const DecodeParams& p, int64_t seq, int64_t first, int64_t count, const Partials& parts,
                  float* acc) {
  const int64_t H = p.num_heads;
  for (int64_t head = 0; head < H; ++head) {
    float global_max = kNegInf;
    for (int64_t j = first; j < first + count; ++j) global_max = std::max(global_max, parts.m[j * H + head]);
    std::fill(acc, acc + D, 0.f);
    float total = 0.f;
    for (int64_t j = first; j < first + count; ++j) {
      const float w = std::exp(parts.m[j * H + head] - global_max);
      total += w * parts.l[j * H + head];
      const Vec wv(w);
      const float* a = parts.acc.data() + (j * H + head) * D;
      for (int c = 0; c < D; c += kW) at::vec::fmadd(wv, Vec::loadu(a + c), Vec::loadu(acc + c)).store(acc + c);
    }
    T* out = static_cast<T*>(p.out) + seq * p.out_stride + head * D;
    store_acc<T, D>(p, out, acc, 1.f / total);
  }
}

template <typename T, int D>
void decode_v1(const DecodeParams& p) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t H = p.num_heads;
  const DecodePlan plan = plan_decode(p);
  Partials parts;
  parts.m.resize(plan.num_pieces * H);
  parts.l.resize(plan.num_pieces * H);
  parts.acc.resize(plan.num_pieces * H * D);
  parts.pending = std::make_unique<std::atomic<int64_t>[]>(plan.split_count.size());
  for (size_t i = 0; i < plan.split_count.size(); ++i) parts.pending[i].store(plan.split_count[i]);
  auto make_scratch = [&] {
    DecodeScratch s;
    s.q.resize(H * D);
    s.acc.resize(H * D);
    s.logits.resize(H * kMaxBlockSize);
    s.m.resize(H);
    s.l.resize(H);
    if (p.kv_format != KVCacheDType::kAuto) s.stage.resize(p.block_size * D);
    return s;
  };
  run_tasks<DecodeScratch>(static_cast<int64_t>(plan.tasks.size()), make_scratch, [&](int64_t i, DecodeScratch& s) {
    const SplitTask& task = plan.tasks[i];
    T* out = static_cast<T*>(p.out) + task.seq * p.out_stride;
    if (task.begin >= task.end) {  // seq_len 0
      std::fill(out, out + H * D, static_cast<T>(0.f));
      return;
    }
    attend_tokens<T, D>(p, {task.seq, 0, p.num_kv_heads, task.begin, task.end}, s);
    if (task.split < 0) {
      for (int64_t h = 0; h < H; ++h) store_acc<T, D>(p, out + h * D, s.acc.data() + h * D, 1.f / s.l[h]);
      return;
    }
    std::copy(s.m.begin(), s.m.begin() + H, parts.m.begin() + task.piece * H);
    std::copy(s.l.begin(), s.l.begin() + H, parts.l.begin() + task.piece * H);
    std::copy(s.acc.begin(), s.acc.begin() + H * D, parts.acc.begin() + task.piece * H * D);
    // acq_rel: the last piece sees every other piece's writes above.
    if (parts.pending[task.split].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      merge_pieces<T, D>(p, task.seq, plan.split_first[task.split], plan.split_count[task.split], parts,
                         s.acc.data());
    }
  });
}

// ---- v2: one task per (sequence, kv head group, partition) ----------------------------

template <typename T, int D>
void decode_v2_task(const DecodeParams& p, int64_t group_heads, int64_t task, DecodeScratch& s) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t parts = p.max_partitions;
  const int64_t groups = p.num_kv_heads / group_heads;
  const int64_t part = task % parts;
  const int64_t group = (task / parts) % groups;
  const int64_t seq = task / (parts * groups);
  const int64_t seq_len = p.seq_lens[seq];
  const int64_t begin = std::max(part * p.partition_size, decode_first_key(p, seq_len));
  const int64_t end = std::min(seq_len, (part + 1) * p.partition_size);
  const DecodeWork w{seq, group * group_heads, group_heads, begin, end};
  const int64_t head0 = w.kv_head0 * G, heads = group_heads * G;
  const int64_t stat = (seq * p.num_heads + head0) * p.max_partitions + part;  // [seq, head0, part]
  if (begin >= end) {
    // Beyond this sequence's length or before its window: mark empty; the reduce never reads them.
    for (int64_t h = 0; h < heads; ++h) {
      p.max_logits[stat + h * p.max_partitions] = kNegInf;
      p.exp_sums[stat + h * p.max_partitions] = 0.f;
    }
    return;
  }
  attend_tokens<T, D>(p, w, s);
  T* tmp_out = static_cast<T*>(p.tmp_out);
  for (int64_t h = 0; h < heads; ++h) {
    p.max_logits[stat + h * p.max_partitions] = s.m[h];
    p.exp_sums[stat + h * p.max_partitions] = s.l[h];
    store_acc<T, D>(p, tmp_out + (stat + h * p.max_partitions) * D, s.acc.data() + h * D, 1.f / s.l[h]);
  }
}

template <typename T, int D>
void decode_v2(const DecodeParams& p) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t parts = p.max_partitions;
  const int64_t group_heads = kv_heads_per_task(p, parts);
  const int64_t num_tasks = p.num_seqs * (p.num_kv_heads / group_heads) * parts;
  auto make_scratch = [&] {
    DecodeScratch s;
    s.q.resize(group_heads * G * D);
    s.acc.resize(group_heads * G * D);
    s.logits.resize(group_heads * G * kMaxBlockSize);
    s.m.resize(group_heads * G);
    s.l.resize(group_heads * G);
    if (p.kv_format != KVCacheDType::kAuto) s.stage.resize(p.block_size * D);
    return s;
  };
  run_tasks<DecodeScratch>(num_tasks, make_scratch, [&](int64_t task, DecodeScratch& s) {
    decode_v2_task<T, D>(p, group_heads, task, s);
  });
}

template <typename T, int D>
void decode_impl(const DecodeParams& p) {
  TORCH_CHECK(p.block_size % 8 == 0 && p.block_size <= kMaxBlockSize,
              "pagedkv CPU decode: block_size must be a multiple of 8 up to ", kMaxBlockSize, ", got ", p.block_size);
  if (p.partition_size > 0) return decode_v2<T, D>(p);
  decode_v1<T, D>(p);
}

// v2 second pass: out = sum_p w_p * tmp_out_p / sum_p w_p with w_p = exp_sums_p * exp(max_p - max).
template <typename T, int D>
void reduce_impl(const DecodeParams& p) {
  const int64_t P = p.max_partitions;
  at::parallel_for(0, p.num_seqs * p.num_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(P);
    float acc[D];
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t seq = sh / p.num_heads, head = sh % p.num_heads;
      T* out = static_cast<T*>(p.out) + seq * p.out_stride + head * D;
      const int64_t seq_len = p.seq_lens[seq];
      // Partitions [first, end) hold the keys the query attends to; those before a window's
      // first key were left empty (their tmp_out unwritten) and are not read.
      const int64_t first = decode_first_key(p, seq_len) / p.partition_size;
      const int64_t parts = (seq_len + p.partition_size - 1) / p.partition_size - first;
      if (parts <= 0) {
        std::fill(out, out + D, static_cast<T>(0.f));
        continue;
      }
      const T* tmp = static_cast<const T*>(p.tmp_out) + (sh * P + first) * D;
      if (parts == 1) {
        std::copy(tmp, tmp + D, out);
        continue;
      }
      const float* max_logits = p.max_logits + sh * P + first;
      const float* exp_sums = p.exp_sums + sh * P + first;
      const float global_max = *std::max_element(max_logits, max_logits + parts);
      float total = 0.f;
      for (int64_t i = 0; i < parts; ++i) {
        weights[i] = exp_sums[i] * std::exp(max_logits[i] - global_max);
        total += weights[i];
      }
      for (int c = 0; c < D; c += kW) Vec(0.f).store(acc + c);
      for (int64_t i = 0; i < parts; ++i) {
        const Vec w(weights[i] / total);
        for (int c = 0; c < D; c += kW) at::vec::fmadd(w, load_f32(tmp + i * D + c), Vec::loadu(acc + c)).store(acc + c);
      }
      for (int c = 0; c < D; ++c) out[c] = static_cast<T>(acc[c]);
    }
  });
}

// =====================================================================================
// Prefill
// =====================================================================================

struct PrefillScratch {
  std::vector<float> qt;      // [D, RP] query, transposed and pre-scaled
  std::vector<float> ot;      // [D, RP] unnormalized output, transposed
  std::vector<float> scores;  // [kKeyTile, RP] logits, then probabilities (AMX: [kAmxKeyTile, RP])
  std::vector<float> kf, vf;  // [kKeyTile, D] K/V tile in fp32 (AMX: K [kAmxKeyTile, dp] and V^T [D, kAmxKeyTile] bf16)
  std::vector<float> m, l, qpos;  // [RP]
  std::vector<uint32_t> pairs;    // AMX: [kAmxKeyTile / 2, RP] probabilities in bf16 pairs of keys
  std::vector<c10::BFloat16> vrows;  // AMX over a quantized cache: [kAmxKeyTile, D] dequantized values
};

// scores[t][r] = sum_d kf[t][d] * qt[d][r]: NT keys x NR row vectors per step.
template <int D, int NT, int NR>
inline void qk_micro(const float* kf, const float* qt, int64_t rp, float* scores) {
  Vec acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < NR; ++i) acc[t][i] = Vec(0.f);
  for (int d = 0; d < D; ++d) {
    Vec qv[NR];
    for (int i = 0; i < NR; ++i) qv[i] = Vec::loadu(qt + d * rp + i * kW);
    for (int t = 0; t < NT; ++t) {
      const Vec kb(kf[t * D + d]);
      for (int i = 0; i < NR; ++i) acc[t][i] = at::vec::fmadd(kb, qv[i], acc[t][i]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < NR; ++i) acc[t][i].store(scores + t * rp + i * kW);
}

// ot[d][r] += sum_t vf[t][d] * probs[t][r] for ND dims x NR row vectors, t < n.
template <int D, int ND, int NR>
inline void pv_micro(const float* vf, const float* probs, int64_t rp, int n, float* ot) {
  Vec acc[ND][NR];
  for (int d = 0; d < ND; ++d)
    for (int i = 0; i < NR; ++i) acc[d][i] = Vec::loadu(ot + d * rp + i * kW);
  for (int t = 0; t < n; ++t) {
    Vec pv[NR];
    for (int i = 0; i < NR; ++i) pv[i] = Vec::loadu(probs + t * rp + i * kW);
    for (int d = 0; d < ND; ++d) {
      const Vec vb(vf[t * D + d]);
      for (int i = 0; i < NR; ++i) acc[d][i] = at::vec::fmadd(vb, pv[i], acc[d][i]);
    }
  }
  for (int d = 0; d < ND; ++d)
    for (int i = 0; i < NR; ++i) acc[d][i].store(ot + d * rp + i * kW);
}

// The row vectors of a tile go three at a time (12 accumulators: 4 keys or dims x 3
// vectors, plus 3 loaded vectors and a broadcast, all 16 AVX2 registers), then a
// last two or one. Measured interleaved against two at a time (fp32, 21 reps, AMD
// Zen 3, 2026-12-01): 1.03-1.05x on one 2048-token 32/8x128 prompt, 1.03-1.10x on
// four 512-token 32/8x128 prompts, 1.05-1.08x on four 512-token 9/3x64 prompts.
template <int D>
void qk_tile_rows(const float* kf, const float* qt, int64_t rp, int64_t nvec, int n_keys, float* scores) {
  constexpr int NT = 4;
  for (int t = 0; t < n_keys; t += NT) {
    int64_t i = 0;
    for (; i + 3 <= nvec; i += 3) qk_micro<D, NT, 3>(kf + t * D, qt + i * kW, rp, scores + t * rp + i * kW);
    if (nvec - i == 2) qk_micro<D, NT, 2>(kf + t * D, qt + i * kW, rp, scores + t * rp + i * kW);
    if (nvec - i == 1) qk_micro<D, NT, 1>(kf + t * D, qt + i * kW, rp, scores + t * rp + i * kW);
  }
}

template <int D>
void pv_tile_rows(const float* vf, const float* probs, int64_t rp, int64_t nvec, int n_keys, float* ot) {
  constexpr int ND = 4;
  for (int d = 0; d < D; d += ND) {
    int64_t i = 0;
    for (; i + 3 <= nvec; i += 3) pv_micro<D, ND, 3>(vf + d, probs + i * kW, rp, n_keys, ot + d * rp + i * kW);
    if (nvec - i == 2) pv_micro<D, ND, 2>(vf + d, probs + i * kW, rp, n_keys, ot + d * rp + i * kW);
    if (nvec - i == 1) pv_micro<D, ND, 1>(vf + d, probs + i * kW, rp, n_keys, ot + d * rp + i * kW);
  }
}

#if defined(CPU_CAPABILITY_AVX512_BF16)
// qk_micro on bf16 dot products: qt holds the unscaled query as pairs of dims,
// 32-bit word [d / 2][r] = (q_r[d], q_r[d + 1]), and kt the keys' bf16 rows (word
// [t][d / 2]), so one vdpbf16ps adds two dims of 16 rows; scores come out scaled.
template <int D, int NT, int NR>
inline void qk_micro_dpbf16(const uint32_t* kt, const uint32_t* qt, int64_t rp, float scale, float* scores) {
  Vec acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < NR; ++i) acc[t][i] = Vec(0.f);
  for (int d2 = 0; d2 < D / 2; ++d2) {
    __m512bh qv[NR];
    for (int i = 0; i < NR; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qt + d2 * rp + i * kW);
    for (int t = 0; t < NT; ++t) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(kt[t * (D / 2) + d2]));
      for (int i = 0; i < NR; ++i) acc[t][i] = Vec(_mm512_dpbf16_ps(acc[t][i], qv[i], kb));
    }
  }
  const Vec sv(scale);
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < NR; ++i) (acc[t][i] * sv).store(scores + t * rp + i * kW);
}

template <int D>
void qk_tile_rows_dpbf16(const uint32_t* kt, const uint32_t* qt, int64_t rp, int64_t nvec, int n_keys, float scale,
                         float* scores) {
  constexpr int NT = 4;
  for (int t = 0; t < n_keys; t += NT) {
    const uint32_t* k = kt + t * (D / 2);
    float* sc = scores + t * rp;
    int64_t i = 0;
    for (; i + 3 <= nvec; i += 3) qk_micro_dpbf16<D, NT, 3>(k, qt + i * kW, rp, scale, sc + i * kW);
    if (nvec - i == 2) qk_micro_dpbf16<D, NT, 2>(k, qt + i * kW, rp, scale, sc + i * kW);
    if (nvec - i == 1) qk_micro_dpbf16<D, NT, 1>(k, qt + i * kW, rp, scale, sc + i * kW);
  }
}
#endif

// The cache slot (block * block_size + offset) of token `pos` of a sequence whose block table is `table`.
inline int64_t cache_slot(const int32_t* table, int64_t bs, int64_t pos) {
  return static_cast<int64_t>(table[pos / bs]) * bs + pos % bs;
}

// The cache row of token `pos` of a sequence whose block table is `table` (row_stride: elements per token row).
template <typename T>
inline const T* token_row(const T* cache, const int32_t* table, int64_t bs, int64_t row_stride, int64_t pos) {
  return cache + cache_slot(table, bs, pos) * row_stride;
}

// Copy keys [k0, k0 + n) of one kv head into a dense bf16 tile [kKeyTile, D], as they are.
template <typename T, int D>
inline void copy_key_tile(const T* cache, const int32_t* table, int64_t bs, int64_t row_stride, int64_t k0, int n,
                          T* dst) {
  for (int t = 0; t < n; ++t) {
    const T* row = token_row(cache, table, bs, row_stride, k0 + t);
    std::copy(row, row + D, dst + t * D);
  }
}

// Copy keys [k0, k0 + n) of one kv head into a dense fp32 tile [kKeyTile, D].
template <typename T, int D>
inline void load_key_tile(const T* cache, const int32_t* table, int64_t bs, int64_t row_stride, int64_t k0, int n,
                          float* dst) {
  for (int t = 0; t < n; ++t) {
    const T* row = token_row(cache, table, bs, row_stride, k0 + t);
    for (int c = 0; c < D; c += kW) load_f32(row + c).store(dst + t * D + c);
  }
}

// Keys [k0, k0 + n) of kv head h of a quantized cache, dequantized into a dense fp32 tile [kKeyTile, D].
template <int D>
inline void load_quant_tile(const QuantRows& q, const int32_t* table, int64_t bs, int64_t h, int64_t k0, int n,
                            float* dst) {
  for (int t = 0; t < n; ++t) q.read<D>(cache_slot(table, bs, k0 + t), h, dst + t * D);
}

struct PrefillTask {
  int64_t seq;
  int64_t first_token;  // index among the sequence's new tokens
  int64_t num_tokens;
  int64_t key_begin;    // keys [key_begin, key_end) are visible to some row of the tile:
  int64_t key_end;      // key_begin is the window's first key of the tile's first row (0 without one)
};

// The row vectors [begin, end) that key tile [k0, k0 + n) reaches: rows are in position order
// (padding rows take the last one), so the vectors whose last row comes before k0 are done
// with their keys, and with a window those whose first row's window starts past the tile
// are not there yet. Without a window every vector takes the task's first key tile.
struct RowVectors {
  int64_t begin, end;
};

inline RowVectors reached_rows(const float* qpos, int64_t nvec, int64_t k0, int n, int64_t window) {
  RowVectors v{0, nvec};
  while (v.begin < nvec && static_cast<int64_t>(qpos[v.begin * kW + kW - 1]) < k0) ++v.begin;
  if (window > 0) {
    while (v.end > v.begin && window_first_key(static_cast<int64_t>(qpos[(v.end - 1) * kW]), window) > k0 + n - 1) {
      --v.end;
    }
  }
  return v;
}

// A task's rows: row r = token * G + g of the tile; padding rows (r >= rows) see every key
// at the last token's position and have zero queries.
struct PrefillRows {
  int64_t G, rows, rp, q_begin, context;

  PrefillRows(const PrefillParams& p, const PrefillTask& task)
      : G(p.num_heads / p.num_kv_heads),
        rows(task.num_tokens * G),
        rp(round_up(rows, kW)),
        q_begin(p.query_start_loc[task.seq]),
        context(p.seq_lens[task.seq] - (p.query_start_loc[task.seq + 1] - q_begin)) {}

  // Row r's element offset in query / out rows of `stride` elements, kv head h; -1 for padding.
  int64_t offset(const PrefillTask& task, int64_t r, int64_t stride, int64_t h, int64_t D) const {
    return r < rows ? (q_begin + task.first_token + r / G) * stride + (h * G + r % G) * D : -1;
  }

  // qpos, m and l of every row.
  void start(const PrefillTask& task, PrefillScratch& s) const {
    for (int64_t r = 0; r < rp; ++r) {
      const int64_t token = r < rows ? task.first_token + r / G : task.first_token + task.num_tokens - 1;
      s.qpos[r] = static_cast<float>(context + token);
      s.m[r] = kNegInf;
      s.l[r] = 0.f;
    }
  }
};

// Where a task's keys and values are: its kv head's part of the cache rows (unquantized caches;
// a quantized one is read through QuantRows), its block table, and its first and last rows'
// positions (the last also the padding rows').
template <typename T>
struct TaskKeys {
  int64_t bs, row_stride;
  const T* key_cache;
  const T* value_cache;
  const int32_t* table;
  int64_t min_pos, max_pos;
};

template <typename T, int D>
TaskKeys<T> task_keys(const PrefillParams& p, const PrefillTask& task, int64_t kv_head, const PrefillRows& pr) {
  const int64_t first = pr.context + task.first_token;
  return {p.block_size,
          p.num_kv_heads * D,
          static_cast<const T*>(p.key_cache) + kv_head * D,
          static_cast<const T*>(p.value_cache) + kv_head * D,
          p.block_tables + task.seq * p.max_blocks_per_seq,
          first,
          first + task.num_tokens - 1};
}

template <typename T, int D>
void prefill_task(const PrefillParams& p, const PrefillTask& task, int64_t kv_head, PrefillScratch& s) {
  const PrefillRows pr(p, task);
  const int64_t rows = pr.rows, rp = pr.rp;
  const T* query = static_cast<const T*>(p.query);
  const bool quantized = p.kv_format != KVCacheDType::kAuto;
  // Q.K^T on bf16 dot products needs the bf16 key rows as they are (an unquantized cache).
  const bool dot_bf16 = kDotBf16<T> && !quantized;
  pr.start(task, s);
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t at = pr.offset(task, r, p.query_stride, kv_head, D);
    const T* q = at >= 0 ? query + at : nullptr;
    for (int64_t d = 0; d < D; ++d) {
      if (dot_bf16) {
        // Pairs of dims (qk_micro_dpbf16), unscaled: the scale goes on the scores.
        reinterpret_cast<T*>(s.qt.data())[(d / 2 * rp + r) * 2 + d % 2] = q ? q[d] : T(0.f);
      } else {
        s.qt[d * rp + r] = q ? to_f32(q[d]) * p.scale : 0.f;
      }
    }
  }
  std::fill(s.ot.begin(), s.ot.begin() + D * rp, 0.f);
  const auto [bs, row_stride, key_cache, value_cache, table, min_pos, max_pos] = task_keys<T, D>(p, task, kv_head, pr);
  const int64_t window = p.sliding_window;
  const Vec window_v(static_cast<float>(window));
  const float cap = p.logits_soft_cap;
  const int64_t nvec = rp / kW;
  for (int64_t k0 = task.key_begin; k0 < task.key_end; k0 += kKeyTile) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyTile, task.key_end - k0));
    const RowVectors vr = reached_rows(s.qpos.data(), nvec, k0, n, window);
    if (vr.begin == vr.end) continue;
    const int64_t v0 = vr.begin * kW, nv = vr.end - vr.begin;
    // Keys up to round_up(n, 4) are multiplied; rows t >= n are never read afterwards.
    if (quantized) {
      load_quant_tile<D>(quant_rows(p, true), table, bs, kv_head, k0, n, s.vf.data());
      load_quant_tile<D>(quant_rows(p, false), table, bs, kv_head, k0, n, s.kf.data());
      qk_tile_rows<D>(s.kf.data(), s.qt.data() + v0, rp, nv, n, s.scores.data() + v0);
    } else {
      load_key_tile<T, D>(value_cache, table, bs, row_stride, k0, n, s.vf.data());
#if defined(CPU_CAPABILITY_AVX512_BF16)
    if constexpr (kDotBf16<T>) {
      // The key tile stays bf16, in the first half of the fp32 tile's space.
      copy_key_tile<T, D>(key_cache, table, bs, row_stride, k0, n, reinterpret_cast<T*>(s.kf.data()));
      qk_tile_rows_dpbf16<D>(reinterpret_cast<const uint32_t*>(s.kf.data()),
                             reinterpret_cast<const uint32_t*>(s.qt.data()) + v0, rp, nv, n, p.scale,
                             s.scores.data() + v0);
    } else
#endif
    {
      load_key_tile<T, D>(key_cache, table, bs, row_stride, k0, n, s.kf.data());
      qk_tile_rows<D>(s.kf.data(), s.qt.data() + v0, rp, nv, n, s.scores.data() + v0);
    }
    }
    if (cap > 0.f) {
      for (int t = 0; t < n; ++t) soft_cap_logits(s.scores.data() + t * rp + v0, nv * kW, cap);
    }
    const bool needs_mask = k0 + n - 1 > min_pos;
    // Some key of the tile lies before the window of some row (the latest row's is the latest).
    const bool needs_window_mask = window > 0 && k0 + window <= max_pos;
    for (int64_t i = vr.begin; i < vr.end; ++i) {
      float* sc = s.scores.data() + i * kW;
      if (needs_mask || needs_window_mask) {
        const Vec qpos = Vec::loadu(s.qpos.data() + i * kW);
        for (int t = 0; t < n; ++t) {
          const Vec key(static_cast<float>(k0 + t));
          Vec masked = key > qpos;
          if (needs_window_mask) masked = masked | (key + window_v <= qpos);  // key <= qpos - W
          Vec::blendv(Vec::loadu(sc + t * rp), Vec(kNegInf), masked).store(sc + t * rp);
        }
      }
      Vec tile_max(kNegInf);
      for (int t = 0; t < n; ++t) tile_max = at::vec::maximum(tile_max, Vec::loadu(sc + t * rp));
      const Vec m_old = Vec::loadu(s.m.data() + i * kW);
      // Without a window m_new is finite: key 0 is visible to every row, and every row vector
      // takes the task's first key tile. With one, a row's window may start past this tile:
      // its max stays -inf, and the exponents are taken against 0 instead (every e and the
      // correction are then 0, never NaN).
      const Vec m_new = at::vec::maximum(m_old, tile_max);
      const Vec m_exp = window > 0 ? Vec::blendv(m_new, Vec(0.f), m_new == Vec(kNegInf)) : m_new;
      const Vec correction = (m_old - m_exp).exp_u20();
      Vec sum(0.f);
      for (int t = 0; t < n; ++t) {
        const Vec e = (Vec::loadu(sc + t * rp) - m_exp).exp_u20();
        e.store(sc + t * rp);
        sum = sum + e;
      }
      at::vec::fmadd(Vec::loadu(s.l.data() + i * kW), correction, sum).store(s.l.data() + i * kW);
      m_new.store(s.m.data() + i * kW);
      if (k0 > task.key_begin) {
        for (int64_t d = 0; d < D; ++d) {
          float* o = s.ot.data() + d * rp + i * kW;
          (Vec::loadu(o) * correction).store(o);
        }
      }
    }
    pv_tile_rows<D>(s.vf.data(), s.scores.data() + v0, rp, nv, n, s.ot.data() + v0);
  }
  T* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + pr.offset(task, r, p.out_stride, kv_head, D);
    const float inv = 1.f / s.l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(s.ot[d * rp + r] * inv);
  }
}

#if defined(CPU_CAPABILITY_AVX512_BF16)
// prefill_task on AMX tiles (attention_amx.cpp): bf16 queries. Per key tile the K rows are
// copied into a dense tile (dims past D zero) and the V rows transposed, once for all the
// task's row vectors; the query goes in as pairs of dims by row, and the output comes back
// transposed, 16 x 16 at a time. A quantized cache's rows are dequantized into fp32 and
// rounded to bf16 on the way (relative error 2^-9, under the codes' own).
template <int D>
void prefill_task_amx(const PrefillParams& p, const PrefillTask& task, int64_t kv_head, PrefillScratch& s) {
  using T = c10::BFloat16;
  const PrefillRows pr(p, task);
  const int64_t rp = pr.rp, nvec = rp / kW;
  AmxPrefillState st{D, round_up(D, 32), rp, reinterpret_cast<uint32_t*>(s.qt.data()), s.ot.data(),
                     s.scores.data(), s.pairs.data(), s.m.data(), s.l.data(), s.qpos.data(), p.scale,
                     p.logits_soft_cap, p.sliding_window};
  pr.start(task, s);
  const T* query = static_cast<const T*>(p.query);
  for (int64_t v = 0; v < nvec; ++v) {
    const T* q[kW];
    for (int i = 0; i < kW; ++i) {
      const int64_t at = pr.offset(task, v * kW + i, p.query_stride, kv_head, D);
      q[i] = at >= 0 ? query + at : nullptr;
    }
    AVX512_BF16::amx_pack_query(q, D, st.dp, st.qt, rp, v);
  }
  std::fill(s.ot.begin(), s.ot.begin() + D * rp, 0.f);
  const auto [bs, row_stride, key_cache, value_cache, table, min_pos, max_pos] = task_keys<T, D>(p, task, kv_head, pr);
  const bool quantized = p.kv_format != KVCacheDType::kAuto;
  T* keys = reinterpret_cast<T*>(s.kf.data());  // [kAmxKeyTile][dp]; the dims past D stay zero
  T* vt = reinterpret_cast<T*>(s.vf.data());    // [D][kAmxKeyTile]
  AVX512_BF16::amx_tiles_begin();
  for (int64_t k0 = task.key_begin; k0 < task.key_end; k0 += kAmxKeyTile) {
    const int n = static_cast<int>(std::min<int64_t>(kAmxKeyTile, task.key_end - k0));
    const RowVectors vr = reached_rows(s.qpos.data(), nvec, k0, n, p.sliding_window);
    if (vr.begin == vr.end) continue;
    const T* values[kAmxKeyTile] = {};
    if (quantized) {
      // Each row dequantized to fp32, then rounded to bf16 for the tiles (values into s.vrows).
      const QuantRows kq = quant_rows(p, false), vq = quant_rows(p, true);
      alignas(64) float row[D];
      for (int t = 0; t < n; ++t) {
        const int64_t slot = cache_slot(table, bs, k0 + t);
        kq.read<D>(slot, kv_head, row);
        at::vec::convert(row, keys + t * st.dp, D);
        T* v = s.vrows.data() + t * D;
        vq.read<D>(slot, kv_head, row);
        at::vec::convert(row, v, D);
        values[t] = v;
      }
    } else {
      for (int t = 0; t < n; ++t) {
        std::memcpy(keys + t * st.dp, token_row(key_cache, table, bs, row_stride, k0 + t), D * sizeof(T));
        values[t] = token_row(value_cache, table, bs, row_stride, k0 + t);
      }
    }
    AVX512_BF16::amx_pack_values(values, D, vt);
    const AmxKeyTile kt{keys, vt, k0, n, k0 == task.key_begin, k0 + n - 1 > min_pos,
                        p.sliding_window > 0 && k0 + p.sliding_window <= max_pos};
    AVX512_BF16::amx_prefill_step(st, kt, vr.begin, vr.end);
  }
  AVX512_BF16::amx_tiles_end();
  T* out = static_cast<T*>(p.out);
  for (int64_t v = 0; v < nvec; ++v) {
    T* o[kW];
    alignas(64) float inv[kW];
    for (int i = 0; i < kW; ++i) {
      const int64_t at = pr.offset(task, v * kW + i, p.out_stride, kv_head, D);
      o[i] = at >= 0 ? out + at : nullptr;
      inv[i] = 1.f / s.l[v * kW + i];
    }
    AVX512_BF16::amx_store_rows(s.ot.data(), D, rp, v, inv, o);
  }
}
#endif

template <typename T, int D>
void prefill_impl(const PrefillParams& p) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const bool amx = kDotBf16<T> && p.use_amx;
  const int64_t tile_tokens = std::max<int64_t>(1, (amx ? kAmxPrefillRows : kPrefillRows) / G);
  std::vector<PrefillTask> tiles;
  for (int64_t seq = 0; seq < p.num_seqs; ++seq) {
    const int64_t q_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    const int64_t context = p.seq_lens[seq] - q_len;
    for (int64_t t = 0; t < q_len; t += tile_tokens) {
      const int64_t n = std::min(tile_tokens, q_len - t);
      tiles.push_back({seq, t, n, window_first_key(context + t, p.sliding_window), context + t + n});
    }
  }
  // Longest key ranges first, so the dynamic schedule ends with short tasks.
  std::stable_sort(tiles.begin(), tiles.end(), [](const PrefillTask& a, const PrefillTask& b) {
    return a.key_end - a.key_begin > b.key_end - b.key_begin;
  });
  const int64_t rp = round_up(std::max(tile_tokens * G, G), kW);
  auto make_scratch = [&] {
    PrefillScratch s;
    s.qt.resize(D * rp);
    s.ot.resize(D * rp);
    // AMX: scores [kAmxKeyTile, rp], K [kAmxKeyTile, dp] and V^T [D, kAmxKeyTile] in bf16.
    const int64_t keys = amx ? kAmxKeyTile : kKeyTile;
    s.scores.resize(keys * rp);
    s.kf.assign(amx ? keys * round_up(D, 32) / 2 : keys * D, 0.f);
    s.vf.assign(amx ? keys * D / 2 : keys * D, 0.f);
    s.m.resize(rp);
    s.l.resize(rp);
    s.qpos.resize(rp);
    if (amx) s.pairs.resize(kAmxKeyTile / 2 * rp);
    if (amx && p.kv_format != KVCacheDType::kAuto) s.vrows.resize(kAmxKeyTile * D);
    return s;
  };
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  run_tasks<PrefillScratch>(num_tiles * p.num_kv_heads, make_scratch, [&](int64_t task, PrefillScratch& s) {
    const PrefillTask& tile = tiles[task / p.num_kv_heads];
#if defined(CPU_CAPABILITY_AVX512_BF16)
    if constexpr (kDotBf16<T>) {
      if (amx) return prefill_task_amx<D>(p, tile, task % p.num_kv_heads, s);
    }
#endif
    prefill_task<T, D>(p, tile, task % p.num_kv_heads, s);
  });
}

// ---- dtype x head size dispatch --------------------------------------------------

template <template <typename, int> class Kernel, typename Params>
void dispatch(const Params& p) {
  auto by_head_size = [&](auto type_tag) {
    using T = decltype(type_tag);
    switch (p.head_size) {
      case 64:
        return Kernel<T, 64>::run(p);
      case 80:
        return Kernel<T, 80>::run(p);
      case 96:
        return Kernel<T, 96>::run(p);
      case 112:
        return Kernel<T, 112>::run(p);
      case 128:
        return Kernel<T, 128>::run(p);
      case 256:
        return Kernel<T, 256>::run(p);
      default:
        TORCH_CHECK(false, "pagedkv CPU attention: head_size ", p.head_size, " has no kernel");
    }
  };
  switch (p.dtype) {
#if !defined(CPU_CAPABILITY_AVX512_BF16)  // that variant is for bf16 only (csrc/cpu/attention.cpp)
    case c10::ScalarType::Float:
      return by_head_size(float{});
    case c10::ScalarType::Half:
      return by_head_size(c10::Half{});
#endif
    case c10::ScalarType::BFloat16:
      return by_head_size(c10::BFloat16{});
    default:
      TORCH_CHECK(false, "pagedkv CPU attention: dtype ", p.dtype, " has no kernel");
  }
}

template <typename T, int D>
struct DecodeKernel {
  static void run(const DecodeParams& p) { decode_impl<T, D>(p); }
};
template <typename T, int D>
struct ReduceKernel {
  static void run(const DecodeParams& p) { reduce_impl<T, D>(p); }
};
template <typename T, int D>
struct PrefillKernel {
  static void run(const PrefillParams& p) { prefill_impl<T, D>(p); }
};

}  // namespace

void decode_attention(const DecodeParams& params) { dispatch<DecodeKernel>(params); }
void reduce_partitions(const DecodeParams& params) { dispatch<ReduceKernel>(params); }
void prefill_attention(const PrefillParams& params) { dispatch<PrefillKernel>(params); }

#if defined(CPU_CAPABILITY_AVX512_BF16)
namespace {
// Seconds for `rounds` x 12 independent vdpbf16ps (dot = true) or FMAs, the best of five tries.
double time_products(bool dot, int64_t rounds) {
  double best = std::numeric_limits<double>::infinity();
  for (int attempt = 0; attempt < 5; ++attempt) {
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
    __m512 x = _mm512_set1_ps(0.5f);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < rounds; ++r) {
      if (dot) {
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, a);
        asm volatile("" : "+v"(a));  // keeps the loop from being folded
      } else {
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, x);
        asm volatile("" : "+v"(x));
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    __m512 sum = acc[0];
    for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
    volatile float sink = _mm512_reduce_add_ps(sum);
    (void)sink;
    best = std::min(best, seconds);
  }
  return best;
}
}  // namespace

double bf16_dot_cost() {
  constexpr int64_t kRounds = 1 << 14;  // ~0.2 M instructions: well under a millisecond each
  return time_products(true, kRounds) / time_products(false, kRounds);
}
#endif

}  // namespace pagedkv::cpu::CPU_CAPABILITY
