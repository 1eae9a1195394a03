// The engine's CPU kernels, for float32 and bfloat16 (computing in float).
//
// Decode attention read straight from the paged KV pool.
// The torch path gathers each sequence's blocks into a dense tensor, then runs SDPA
// over it: the context is read twice and written once per layer. Here each (sequence,
// KV head) pair walks its block table and reads every K and V row once:
//
//   for t in 0..len:  slot = table[t / block_size] * block_size + t % block_size
//                     s[g][t] = <q[g], K[slot]> * scale     (g: query heads of this KV head)
//   p = softmax(s) per g;   out[g] = sum_t p[g][t] * V[slot]
//
// q [B, H, D]; k_pool, v_pool [num_blocks, block_size, KVH, D]; block_tables [B, n] int64;
// context_lens [B] int64 (tokens to attend to, including the query's own); window: a
// sliding window's length (the last `window` of them only; 0: all). -> [B, H, D]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <vector>

// Vectors of 8 floats (GCC vector extensions: one ymm with AVX2, the lower half of a zmm
// with AVX-512), loaded from float or bfloat16 (a bfloat16 is a float's high 16 bits).
typedef float vf8_t __attribute__((vector_size(32)));
typedef float vf4_t __attribute__((vector_size(16)));

static inline vf8_t load8(const float* p) {
  vf8_t v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

static inline vf8_t load8(const c10::BFloat16* p) {
#if defined(__AVX2__)  // one vpmovzxwd (GCC builds the generic form below from two halves)
  const __m256i w = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  typedef uint16_t vu16x8 __attribute__((vector_size(16)));
  typedef uint32_t vu32x8 __attribute__((vector_size(32)));
  vu16x8 h;
  __builtin_memcpy(&h, p, sizeof(h));
  const vu32x8 w = __builtin_convertvector(h, vu32x8) << 16;
#endif
  vf8_t v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

static inline void store8(float* p, vf8_t v) { __builtin_memcpy(p, &v, sizeof(v)); }

static inline void store8(c10::BFloat16* p, vf8_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::BFloat16>(v[i]);
}

#if defined(__AVX512F__)
typedef float vf16_t __attribute__((vector_size(64)));  // one zmm (AVX-512 builds only)
#endif

// Sizes the scratch for G heads of D over `len` rows and returns the queries in float,
// pre-scaled; acc's first G * D floats are the zeroed output accumulator.
template <typename Q>
static float* scaled_queries(const Q* q, int64_t G, int64_t D, int64_t len, float scale,
                             std::vector<float>& scores, std::vector<float>& acc) {
  scores.resize(G * len);
  acc.assign(2 * G * D, 0.f);
  float* qf = acc.data() + G * D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  return qf;
}

// `softcap` > 0: each finite score s becomes softcap * tanh(s / softcap) first (Gemma 2's
// capped scores; a masked -inf stays).
static void softmax_rows(float* scores, int64_t G, int64_t len, float softcap = 0.f) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    if (softcap > 0.f)
      for (int64_t t = 0; t < len; ++t)
        if (sg[t] != -INFINITY) sg[t] = softcap * std::tanh(sg[t] / softcap);
    const float top = *std::max_element(sg, sg + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - top);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

// The four horizontal sums of a0..a3, as one vector (a transpose of adds, no scalars).
static inline vf4_t sum4(vf8_t a0, vf8_t a1, vf8_t a2, vf8_t a3) {
  const vf4_t b0 = __builtin_shufflevector(a0, a0, 0, 1, 2, 3) + __builtin_shufflevector(a0, a0, 4, 5, 6, 7);
  const vf4_t b1 = __builtin_shufflevector(a1, a1, 0, 1, 2, 3) + __builtin_shufflevector(a1, a1, 4, 5, 6, 7);
  const vf4_t b2 = __builtin_shufflevector(a2, a2, 0, 1, 2, 3) + __builtin_shufflevector(a2, a2, 4, 5, 6, 7);
  const vf4_t b3 = __builtin_shufflevector(a3, a3, 0, 1, 2, 3) + __builtin_shufflevector(a3, a3, 4, 5, 6, 7);
  const vf4_t u0 = __builtin_shufflevector(b0, b1, 0, 4, 1, 5) + __builtin_shufflevector(b0, b1, 2, 6, 3, 7);
  const vf4_t u1 = __builtin_shufflevector(b2, b3, 0, 4, 1, 5) + __builtin_shufflevector(b2, b3, 2, 6, 3, 7);
  return __builtin_shufflevector(u0, u1, 0, 1, 4, 5) + __builtin_shufflevector(u0, u1, 2, 3, 6, 7);
}

// Where a unit's `len` context rows of KV head h, from position `first` on, start in the
// pool (in elements): position t lies in block row_table[t / bs] at row t % bs, rows of
// one block `kv_heads * D` apart; the walk goes block by block (no division per row).
// `first` > 0: a sliding window's rows, the older ones skipped.
static void row_offsets(const int64_t* row_table, int64_t first, int64_t len, int64_t bs,
                        int64_t kv_heads, int64_t h, int64_t D, std::vector<int64_t>& rows) {
  rows.resize(len);
  const int64_t stride = kv_heads * D;
  for (int64_t i = 0, blk = first / bs, r = first % bs; i < len; ++blk, r = 0) {
    int64_t off = ((row_table[blk] * bs + r) * kv_heads + h) * D;
    const int64_t n = std::min(bs - r, len - i);
    for (int64_t j = 0; j < n; ++j, off += stride) rows[i + j] = off;
    i += n;
  }
}

// Asks for the cache lines of one context row (D values, or a whole row's KV heads)
// into L2 (prefetcht1: in the step above ~3% faster than into L1, whose few fill buffers
// the prefetches of a whole row filled) ahead of their use. A
// unit reads D of every kv_heads * D values of a block, and the blocks of a long-running
// server lie anywhere in the pool: the hardware prefetchers miss that walk. Rows 8 ahead
// took a layer of 32 sequences x 250 rows from 1.58 to 1.30 ms with the blocks shuffled
// through the pool, 0.83 to 0.78 ms with them in order (2-core AMD EPYC, AVX2).
constexpr int64_t kRowsAhead = 8;
// From this many rows a thread on, attend_rows gives a unit all of a row's KV heads.
constexpr int64_t kRowsPerThreadForWholeRows = 4;

template <typename T>
static inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, 2);
}

// prefetch_row for the context rows [first, end) of a unit (offsets in `rows`).
template <typename T>
static inline void prefetch_rows(const T* pool, const int64_t* rows, int64_t first, int64_t end,
                                 int64_t D) {
  for (int64_t i = first; i < end; ++i) prefetch_row(pool + rows[i], D);
}

// A unit's start: its queries in float (scaled), its context rows' offsets (in this
// thread's buffer, valid until its next unit), and the first K rows asked for.
struct UnitStart {
  const float* qf;
  const int64_t* rows;
};

template <typename T, typename Q>
static UnitStart start_unit(const Q* q, const T* k_pool, const int64_t* row_table, int64_t first,
                            int64_t len, int64_t bs, int64_t kv_heads, int64_t h, int64_t G,
                            int64_t D, float scale, std::vector<float>& scores,
                            std::vector<float>& acc, int64_t pf) {
  thread_local std::vector<int64_t> rows;
  row_offsets(row_table, first, len, bs, kv_heads, h, D, rows);
  const float* qf = scaled_queries(q, G, D, len, scale, scores, acc);
  prefetch_rows(k_pool, rows.data(), 0, std::min(kRowsAhead, len), pf);
  return {qf, rows.data()};
}

// One (sequence, KV head): G query heads against `len` context rows from position
// `first` on (0 but in a sliding window), accumulated in
// float whatever the storage type T (float or bfloat16); queries and output in Q (T, or
// float for the decode graph). NV = D / 16 (64: 4, 128: 8), fixed at compile time.
// Vectors are 8 floats (one ymm), so AVX2 and AVX-512 builds run the same code:
// - scores: 4 K rows at a time (read once, for all G heads), their 4 sums per head
//   reduced together by `sum4`;
// - values: per head, the output's 64-float chunks live in 8 registers while the V rows
//   stream past (one FMA per vector, no accumulator in memory);
// - K and V rows are prefetched kRowsAhead rows ahead (V in the first head's pass; the
//   other heads find the rows in L2).
template <int NV, typename T, typename Q = T>
static void attend_one(const Q* q, const T* k_pool, const T* v_pool, const int64_t* row_table,
                       int64_t first, int64_t len, int64_t bs, int64_t kv_heads, int64_t h,
                       int64_t G,
                       float scale, float softcap, Q* out, std::vector<float>& scores,
                       std::vector<float>& acc, int64_t pf) {
  constexpr int NV8 = 2 * NV;
  constexpr int64_t D = NV8 * 8;
  constexpr int CH = NV8 < 8 ? NV8 : 8;  // vectors of the output held in registers
  static_assert(NV8 % CH == 0, "head size");
  const auto [qf, rows] = start_unit(q, k_pool, row_table, first, len, bs, kv_heads, h, G, D,
                                    scale, scores, acc, pf);
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {
    prefetch_rows(k_pool, rows, t + kRowsAhead, std::min(t + kRowsAhead + 4, len), pf);
    auto score4 = [&](const auto* k0, const auto* k1, const auto* k2, const auto* k3) {
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        vf8_t a0 = {}, a1 = {}, a2 = {}, a3 = {};
#pragma GCC unroll 16
        for (int j = 0; j < NV8; ++j) {
          const vf8_t qj = load8(qg + 8 * j);
          a0 += qj * load8(k0 + 8 * j);
          a1 += qj * load8(k1 + 8 * j);
          a2 += qj * load8(k2 + 8 * j);
          a3 += qj * load8(k3 + 8 * j);
        }
        const vf4_t s = sum4(a0, a1, a2, a3);
        __builtin_memcpy(&scores[g * len + t], &s, sizeof(s));
      }
    };
    if constexpr (std::is_same_v<T, float>) {
      score4(k_pool + rows[t], k_pool + rows[t + 1], k_pool + rows[t + 2], k_pool + rows[t + 3]);
    } else {  // bfloat16: the 4 rows widened once, not once per query head
      alignas(64) float kf[4 * D];
      for (int r = 0; r < 4; ++r)
#pragma GCC unroll 16
        for (int j = 0; j < NV8; ++j) store8(kf + r * D + 8 * j, load8(k_pool + rows[t + r] + 8 * j));
      score4(kf, kf + D, kf + 2 * D, kf + 3 * D);
    }
  }
  for (; t < len; ++t) {
    const T* k = k_pool + rows[t];
    for (int64_t g = 0; g < G; ++g) {
      vf8_t a = {};
      for (int j = 0; j < NV8; ++j) a += load8(qf + g * D + 8 * j) * load8(k + 8 * j);
      scores[g * len + t] = (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7]);
    }
  }
  prefetch_rows(v_pool, rows, 0, std::min(kRowsAhead, len), pf);
  softmax_rows(scores.data(), G, len, softcap);
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = scores.data() + g * len;
    for (int c = 0; c < NV8; c += CH) {
      vf8_t o[CH] = {};
      const bool first = g == 0 && c == 0;
      for (int64_t r = 0; r < len; ++r) {
        if (first && r + kRowsAhead < len) prefetch_row(v_pool + rows[r + kRowsAhead], pf);
        const T* v = v_pool + rows[r] + 8 * c;
        const float p = pg[r];
#pragma GCC unroll 8
        for (int j = 0; j < CH; ++j) o[j] += p * load8(v + 8 * j);
      }
#pragma GCC unroll 8
      for (int j = 0; j < CH; ++j) store8(out + g * D + 8 * (c + j), o[j]);
    }
  }
}

#if defined(__AVX512F__)
static inline vf16_t load16f(const float* p) {
  vf16_t v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

static inline vf16_t load16f(const c10::BFloat16* p) {
  const __m512i w = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  vf16_t v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

static inline vf8_t fold16(vf16_t a) {  // the two halves added: 8 lanes, the same sum
  return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}

// attend_one on AVX-512, for GT query heads a KV head (GT x NV16 <= 16): 16-float
// vectors, each K row widened once (bfloat16), and the values in one pass: each V row is
// read and widened once for all GT heads, whose outputs stay in GT x NV16 registers
// (attend_one reads every V row once per head).
template <int NV16, int GT, typename T, typename Q>
static void attend_one16(const Q* q, const T* k_pool, const T* v_pool, const int64_t* row_table,
                         int64_t first, int64_t len, int64_t bs, int64_t kv_heads, int64_t h,
                         float scale, float softcap,
                         Q* out, std::vector<float>& scores, std::vector<float>& acc,
                         int64_t pf) {
  constexpr int64_t D = NV16 * 16;
  static_assert(GT * NV16 <= 16, "registers");
  const auto [qf, rows] = start_unit(q, k_pool, row_table, first, len, bs, kv_heads, h, GT, D,
                                    scale, scores, acc, pf);
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {
    prefetch_rows(k_pool, rows, t + kRowsAhead, std::min(t + kRowsAhead + 4, len), pf);
    vf16_t k[4][NV16];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NV16; ++j) k[r][j] = load16f(k_pool + rows[t + r] + 16 * j);
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) {
      vf16_t a0 = {}, a1 = {}, a2 = {}, a3 = {};
#pragma GCC unroll 8
      for (int j = 0; j < NV16; ++j) {
        const vf16_t qj = load16f(qf + g * D + 16 * j);
        a0 += qj * k[0][j];
        a1 += qj * k[1][j];
        a2 += qj * k[2][j];
        a3 += qj * k[3][j];
      }
      const vf4_t s4 = sum4(fold16(a0), fold16(a1), fold16(a2), fold16(a3));
      __builtin_memcpy(&scores[g * len + t], &s4, sizeof(s4));
    }
  }
  for (; t < len; ++t) {
    for (int g = 0; g < GT; ++g) {
      vf16_t a = {};
      for (int j = 0; j < NV16; ++j)
        a += load16f(qf + g * D + 16 * j) * load16f(k_pool + rows[t] + 16 * j);
      const vf8_t f = fold16(a);
      scores[g * len + t] = (f[0] + f[4]) + (f[1] + f[5]) + (f[2] + f[6]) + (f[3] + f[7]);
    }
  }
  prefetch_rows(v_pool, rows, 0, std::min(kRowsAhead, len), pf);
  softmax_rows(scores.data(), GT, len, softcap);
  vf16_t o[GT][NV16];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < NV16; ++j) o[g][j] = vf16_t{};
  for (int64_t r = 0; r < len; ++r) {
    if (r + kRowsAhead < len) prefetch_row(v_pool + rows[r + kRowsAhead], pf);
    vf16_t v[NV16];
#pragma GCC unroll 8
    for (int j = 0; j < NV16; ++j) v[j] = load16f(v_pool + rows[r] + 16 * j);
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) {
      const float p = scores[g * len + r];
#pragma GCC unroll 8
      for (int j = 0; j < NV16; ++j) o[g][j] += p * v[j];
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < NV16; ++j) {
      const vf16_t x = o[g][j];
      store8(out + g * D + 16 * j, __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
      store8(out + g * D + 16 * j + 8, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
    }
}

// attend_one16 where it takes this head shape; false where it does not.
template <typename T, typename Q>
static bool attend_one16_for(int64_t D, int64_t G, const Q* q, const T* k_pool,
                             const T* v_pool, const int64_t* row_table, int64_t first,
                             int64_t len, int64_t bs, int64_t kv_heads, int64_t h, float scale,
                             float softcap, Q* out,
                             std::vector<float>& scores, std::vector<float>& acc, int64_t pf) {
#define SLUICE_ATTEND16(NV, GG)                                                              \
  if (D == 16 * NV && G == GG) {                                                             \
    attend_one16<NV, GG, T, Q>(q, k_pool, v_pool, row_table, first, len, bs, kv_heads, h,    \
                               scale, softcap, out, scores, acc, pf);                        \
    return true;                                                                             \
  }
  SLUICE_ATTEND16(4, 1) SLUICE_ATTEND16(4, 2) SLUICE_ATTEND16(4, 3) SLUICE_ATTEND16(4, 4)
  SLUICE_ATTEND16(8, 1) SLUICE_ATTEND16(8, 2)
#undef SLUICE_ATTEND16
  return false;
}
#endif

// Any head size: the same walk with scalar loops.
template <typename T, typename Q = T>
static void attend_one_any(const Q* q, const T* k_pool, const T* v_pool,
                           const int64_t* row_table, int64_t first, int64_t len, int64_t bs,
                           int64_t kv_heads, int64_t h, int64_t G, int64_t D, float scale,
                           float softcap, Q* out,
                           std::vector<float>& scores, std::vector<float>& acc) {
  thread_local std::vector<int64_t> rows;
  row_offsets(row_table, first, len, bs, kv_heads, h, D, rows);
  const float* qf = scaled_queries(q, G, D, len, scale, scores, acc);
  for (int64_t t = 0; t < len; ++t) {
    const T* k = k_pool + rows[t];
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * static_cast<float>(k[d]);
      scores[g * len + t] = s;
    }
  }
  softmax_rows(scores.data(), G, len, softcap);
  float* o = acc.data();
  for (int64_t t = 0; t < len; ++t) {
    const T* v = v_pool + rows[t];
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * len + t];
      for (int64_t d = 0; d < D; ++d) o[g * D + d] += p * static_cast<float>(v[d]);
    }
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<Q>(o[i]);
}

// B rows of H query heads against their contexts: row b's queries at q + b * q_stride,
// its output at out + b * out_stride (H * D values each; the decode graph's queries sit
// inside its fused QKV rows). Units are handed out as threads free up (see panel_matmul):
// a (row, KV head) each for a few rows, else a row with all its KV heads, whose first
// head's pass prefetches the whole of each context row (every head's K or V: one
// contiguous stream a block, each line fetched once; the other heads then read L2). Per
// (row, head), a unit reads D of every KVH * D values of a block, a walk the hardware
// prefetchers follow badly: a bfloat16 decode step of 64 rows at 300 context rows took
// 74 -> 66 ms with whole rows, 32 rows 45 -> 40 ms (the decode graph, 2-core Sapphire
// Rapids; float32, 64 rows: 131 -> 128 ms). `window` > 0: each row attends to its last
// `window` context rows only (a sliding-window layer); `softcap` > 0: scores capped
// (softmax_rows).
template <typename T, typename Q>
static void attend_rows(const Q* q, int64_t q_stride, Q* out, int64_t out_stride,
                        const T* kp, const T* vp, const int64_t* table, int64_t n_blocks,
                        const int64_t* lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                        int64_t bs, float scale, int64_t window = 0, float softcap = 0.f) {
  const int64_t G = H / KVH;
  const int threads = at::get_num_threads();
  const int64_t heads = B >= kRowsPerThreadForWholeRows * threads ? KVH : 1;  // KV heads a unit
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores, acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < B * KVH / heads; ++unit) {
      const int64_t b = unit * heads / KVH;
      for (int64_t h = unit * heads % KVH, h_end = h + heads; h < h_end; ++h) {
        const Q* qb = q + b * q_stride + h * G * D;
        Q* ob = out + b * out_stride + h * G * D;
        const int64_t* row_table = table + b * n_blocks;
        const int64_t pf = (h == 0 && heads > 1 ? KVH : 1) * D;  // values prefetched a row
        const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
        const int64_t len = lens[b] - first;
#if defined(__AVX512F__)
        if (attend_one16_for<T, Q>(D, G, qb, kp, vp, row_table, first, len, bs, KVH, h, scale,
                                   softcap, ob, scores, acc, pf))
          continue;
#endif
        if (D == 64) {
          attend_one<4, T, Q>(qb, kp, vp, row_table, first, len, bs, KVH, h, G, scale, softcap,
                              ob, scores, acc, pf);
        } else if (D == 128) {
          attend_one<8, T, Q>(qb, kp, vp, row_table, first, len, bs, KVH, h, G, scale, softcap,
                              ob, scores, acc, pf);
        } else {
          attend_one_any<T, Q>(qb, kp, vp, row_table, first, len, bs, KVH, h, G, D, scale,
                               softcap, ob, scores, acc);
        }
      }
    }
  }
}

template <typename T>
static void decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool,
                             const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                             const torch::Tensor& context_lens, float scale, int64_t window,
                             float softcap, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  attend_rows<T, T>(q.data_ptr<T>(), H * D, out.data_ptr<T>(), H * D, k_pool.data_ptr<T>(),
                    v_pool.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
                    block_tables.size(1), context_lens.data_ptr<int64_t>(), B, H,
                    k_pool.size(2), D, k_pool.size(1), scale, window, softcap);
}

static bool supported(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool,
                                     torch::Tensor v_pool, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window,
                                     double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "paged_decode_attention: q [B, H, D], pools [blocks, block_size, KVH, D]");
  TORCH_CHECK(supported(q) && k_pool.scalar_type() == q.scalar_type() &&
                  v_pool.scalar_type() == q.scalar_type(),
              "paged_decode_attention: float32 or bfloat16, one dtype");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: contiguous inputs only");
  TORCH_CHECK(k_pool.size(3) == q.size(2) && q.size(1) % k_pool.size(2) == 0,
              "paged_decode_attention: head shapes");
  auto out = torch::empty_like(q);
  const float fscale = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    decode_attention<float>(q, k_pool, v_pool, block_tables, context_lens, fscale, window,
                            static_cast<float>(softcap), out);
  } else {
    decode_attention<c10::BFloat16>(q, k_pool, v_pool, block_tables, context_lens, fscale,
                                    window, static_cast<float>(softcap), out);
  }
  return out;
}

// Prefill attention from the paged pool: a step's prefill chunks, each chunk's query rows
// attending causally to their sequence's context (its earlier tokens in the pool and the
// chunk's own, already written there). torch's SDPA took the chunks padded to one length
// with an additive mask and computed every row against every column: ~95 GFLOP/s on a
// 2-core Zen 4 for 14 chunks of 139 tokens, 15% of the prefill step. Here a unit is
// (chunk, KV head), or (up to kPrefillTile of a chunk's rows, KV head) where there are
// few chunks: the keys its last row sees are converted to float once (K transposed: a
// vector holds kLanes keys), then the scores of the unit's
// rows x G query heads, each block of rows only as far as its last row sees, a softmax
// per row over its own keys, and the values.
//
// q [T, H, D] (the chunks' rows back to back); pools [blocks, block_size, KVH, D];
// block_tables [B, n] int64; q_starts [B + 1] int64 (chunk b is rows q_starts[b] ..
// q_starts[b + 1]); context_lens [B] int64 (the tokens chunk b's last row sees, its own
// included); window: a sliding window's length (each row sees its last `window` keys
// only, the older ones' scores set to -inf before the softmax; 0: all). -> [T, H, D]
//
// Vectors of 16 floats on AVX-512, 8 on AVX2 (GCC's generic 64-byte vectors on AVX2 went
// through memory: 30x slower). Scores: 4 rows x 2 vectors of keys in 8 accumulators;
// values: 4 rows x 4 vectors (AVX-512, 16 of 32 registers) or 2 x 4 (AVX2, 8 of 16).
#if defined(__AVX512F__)
typedef vf16_t pvec_t;
constexpr int kValueRows = 4;
#else
typedef vf8_t pvec_t;
constexpr int kValueRows = 2;
#endif
constexpr int kLanes = sizeof(pvec_t) / sizeof(float);
constexpr int kScoreRows = 4, kScoreVecs = 2, kValueVecs = 4;
// query rows a unit (x G heads): whole chunks up to kPrefillWholeRows where there are
// enough (chunk, KV head) pairs to share out, so each converts its context once; else
// tiles of kPrefillTile rows, so that one long chunk still spreads over the threads
constexpr int64_t kPrefillTile = 64;
constexpr int64_t kPrefillWholeRows = 256;

// D values (a multiple of 8) of a row as float
static inline void row_to_float(const float* src, float* dst, int64_t D) {
  std::memcpy(dst, src, D * sizeof(float));
}

static inline void row_to_float(const c10::BFloat16* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) store8(dst + d, load8(src + d));
}

static inline pvec_t ldp(const float* p) {
  pvec_t v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

static inline void stp(float* p, pvec_t v) { __builtin_memcpy(p, &v, sizeof(v)); }

// out[r][0 .. kLanes V) = sum over i < n of a[r][i] * b[i][0 .. kLanes V), R rows: both
// products' micro-kernel (rows a_stride, b_stride and out_stride floats apart). Scores:
// a the queries, b the transposed keys (D rows of Lp keys); values: a the weights, b V.
template <int R, int V>
static inline void rows_times_panel(const float* a, int64_t a_stride, const float* b,
                                    int64_t b_stride, int64_t n, float* out,
                                    int64_t out_stride) {
  pvec_t acc[R][V] = {};
  for (int64_t i = 0; i < n; ++i) {
    pvec_t bv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) bv[v] = ldp(b + i * b_stride + kLanes * v);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float x = a[r * a_stride + i];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] += x * bv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) stp(out + r * out_stride + kLanes * v, acc[r][v]);
}

// One unit: `rows` query rows from q row `first_row` (position `first_pos`), KV head h.
template <typename T>
static void prefill_unit(const T* q, T* out, const T* kp, const T* vp, const int64_t* row_table,
                         int64_t bs, int64_t KVH, int64_t H, int64_t D, int64_t h,
                         int64_t first_row, int64_t rows, int64_t first_pos, float scale,
                         int64_t window, float softcap, std::vector<float>& buf,
                         std::vector<int64_t>& offs) {
  const int64_t G = H / KVH;
  const int64_t len = first_pos + rows;  // keys the unit's last row sees
  constexpr int64_t step = kLanes * kScoreVecs;
  const int64_t Lp = (len + step - 1) / step * step;
  const int64_t M = rows * G;  // score rows: row j's head g is m = j * G + g
  const int64_t Mp = (M + kScoreRows - 1) / kScoreRows * kScoreRows;
  buf.resize(D * Lp + len * D + 2 * Mp * D + Mp * Lp + D);
  float* kt = buf.data();
  float* vf = kt + D * Lp;
  float* qf = vf + len * D;
  float* o = qf + Mp * D;
  float* s = o + Mp * D;
  float* row = s + Mp * Lp;
  row_offsets(row_table, 0, len, bs, KVH, h, D, offs);
  for (int64_t t = 0; t < len; ++t) {
    row_to_float(kp + offs[t], row, D);
    for (int64_t d = 0; d < D; ++d) kt[d * Lp + t] = row[d];
    row_to_float(vp + offs[t], vf + t * D, D);
  }
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * Lp + len, kt + (d + 1) * Lp, 0.f);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t g = 0; g < G; ++g) {
      float* qm = qf + (j * G + g) * D;
      row_to_float(q + (first_row + j) * H * D + (h * G + g) * D, qm, D);
      for (int64_t d = 0; d < D; ++d) qm[d] *= scale;
    }
  // padding rows (up to Mp): zero queries, so their scores (as far as the real rows of
  // their block see, all the value pass reads) are zero weights; their outputs go unused
  std::fill(qf + M * D, qf + Mp * D, 0.f);
  for (int64_t m = 0; m < Mp; m += kScoreRows) {
    const int64_t seen = first_pos + (std::min(m + kScoreRows, M) - 1) / G + 1;
    for (int64_t k0 = 0; k0 < seen; k0 += step)
      rows_times_panel<kScoreRows, kScoreVecs>(qf + m * D, D, kt + k0, Lp, D,
                                                s + m * Lp + k0, Lp);
  }
  for (int64_t m = 0; m < M; ++m) {  // softmax over the row's own keys; zeros past them
    const int64_t n = first_pos + m / G + 1;
    if (window > 0 && n > window)  // keys before the row's window: no weight
      std::fill(s + m * Lp, s + m * Lp + (n - window), -INFINITY);
    softmax_rows(s + m * Lp, 1, n, softcap);
    std::fill(s + m * Lp + n, s + (m + 1) * Lp, 0.f);
  }
  for (int64_t m = 0; m < M; m += kValueRows) {
    const int64_t seen = first_pos + (std::min(m + kValueRows, M) - 1) / G + 1;
    int64_t c0 = 0;
    for (; c0 + kLanes * kValueVecs <= D; c0 += kLanes * kValueVecs)
      rows_times_panel<kValueRows, kValueVecs>(s + m * Lp, Lp, vf + c0, D, seen,
                                               o + m * D + c0, D);
    for (; c0 < D; c0 += kLanes)
      rows_times_panel<kValueRows, 1>(s + m * Lp, Lp, vf + c0, D, seen, o + m * D + c0, D);
  }
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t g = 0; g < G; ++g) {
      T* orow = out + (first_row + j) * H * D + (h * G + g) * D;
      const float* om = o + (j * G + g) * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(om[d]);
    }
}

template <typename T>
static void prefill_attention(const torch::Tensor& q, const torch::Tensor& k_pool,
                              const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                              const torch::Tensor& q_starts, const torch::Tensor& context_lens,
                              float scale, int64_t window, float softcap, torch::Tensor& out) {
  const int64_t B = block_tables.size(0), n_blocks = block_tables.size(1);
  const int64_t H = q.size(1), D = q.size(2), KVH = k_pool.size(2), bs = k_pool.size(1);
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  struct Unit {
    int64_t b, j0, h, cost;
  };
  const int threads = at::get_num_threads();
  const int64_t tile = B * KVH >= 4 * threads ? kPrefillWholeRows : kPrefillTile;
  std::vector<Unit> units;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qs[b + 1] - qs[b];
    for (int64_t j0 = 0; j0 < n; j0 += tile)
      for (int64_t h = 0; h < KVH; ++h)
        units.push_back({b, j0, h, lens[b] - n + std::min(j0 + tile, n)});
  }
  // the costliest first (those that see the most keys), handed out as threads free up
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t count = static_cast<int64_t>(units.size());
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf;
    std::vector<int64_t> offs;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      const Unit& u = units[i];
      const int64_t n = qs[u.b + 1] - qs[u.b];
      const int64_t rows = std::min(tile, n - u.j0);
      prefill_unit<T>(qp, op, kp, vp, table + u.b * n_blocks, bs, KVH, H, D, u.h,
                      qs[u.b] + u.j0, rows, lens[u.b] - n + u.j0, scale, window, softcap, buf,
                      offs);
    }
  }
}

torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_pool,
                                      torch::Tensor v_pool, torch::Tensor block_tables,
                                      torch::Tensor q_starts, torch::Tensor context_lens,
                                      double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "paged_prefill_attention: q [T, H, D], pools [blocks, block_size, KVH, D]");
  TORCH_CHECK(supported(q) && k_pool.scalar_type() == q.scalar_type() &&
                  v_pool.scalar_type() == q.scalar_type(),
              "paged_prefill_attention: float32 or bfloat16, one dtype");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  block_tables.is_contiguous() && q_starts.is_contiguous() &&
                  context_lens.is_contiguous(),
              "paged_prefill_attention: contiguous inputs only");
  TORCH_CHECK(k_pool.size(3) == q.size(2) && q.size(1) % k_pool.size(2) == 0 &&
                  q.size(2) % 16 == 0,
              "paged_prefill_attention: head shapes (head size a multiple of 16)");
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && q_starts.scalar_type() == torch::kLong &&
                  context_lens.scalar_type() == torch::kLong && q_starts.numel() == B + 1 &&
                  context_lens.numel() == B,
              "paged_prefill_attention: int64 block_tables [B, n], q_starts [B + 1], "
              "context_lens [B]");
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == q.size(0), "paged_prefill_attention: q_starts span q");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(qs[b + 1] > qs[b] && lens[b] >= qs[b + 1] - qs[b] &&
                    lens[b] <= block_tables.size(1) * k_pool.size(1),
                "paged_prefill_attention: chunk ", b, " rows / context / blocks");
  auto out = torch::empty_like(q);
  const float fscale = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    prefill_attention<float>(q, k_pool, v_pool, block_tables, q_starts, context_lens, fscale,
                             window, static_cast<float>(softcap), out);
  } else {
    prefill_attention<c10::BFloat16>(q, k_pool, v_pool, block_tables, q_starts, context_lens,
                                     fscale, window, static_cast<float>(softcap), out);
  }
  return out;
}

// residual += x; x = rms_norm(residual) * weight, row by row, in place (vLLM's
// fused_add_rms_norm). One pass instead of torch's add and its several-op RMSNorm, which
// cost 19 us a call for one row and 76 us for 32 on the dev machine. In bfloat16 the sum
// is rounded before it is normed, as torch's two ops do.
template <typename T>
static void add_rms_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                         float eps) {
  const int64_t T_ = x.size(0), H = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xr = xp + t * H;
      T* rr = rp + t * H;
      float squares = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        rr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        const float r = static_cast<float>(rr[i]);
        squares += r * r;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + eps);
      for (int64_t i = 0; i < H; ++i) {
        xr[i] = static_cast<T>(static_cast<float>(rr[i]) * inv * static_cast<float>(wp[i]));
      }
    }
  });
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1),
              "fused_add_rms_norm: x, residual [T, hidden], weight [hidden]");
  TORCH_CHECK(supported(x) && residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: float32 or bfloat16, one dtype");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "fused_add_rms_norm: contiguous inputs only");
  if (x.scalar_type() == torch::kFloat) {
    add_rms_norm<float>(x, residual, weight, static_cast<float>(eps));
  } else {
    add_rms_norm<c10::BFloat16>(x, residual, weight, static_cast<float>(eps));
  }
}

// RoPE in place on a step's Q and K heads (vLLM's rotary_embedding, on sluice's tables):
// x [T, heads, D] (rows x.stride(0) apart: a view into the QKV projection's output, heads
// D apart), cos and signed sin [T, 1, R] in x's dtype (llama.py's rope_tables gathered at
// the rows' positions), R <= D: the first R of each head rotate (all D but for a partial
// rotation, Phi-4-mini's 3/4), the rest pass. apply_rope's half-split rotation in float,
// with torch's rounding (below): one pass where torch's flip, multiply and addcmul made
// three and two temporaries (37 ms of a 1,946-token bfloat16 prefill step on a 2-core
// Sapphire Rapids).
template <typename T>
static void rope_rows(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& ssin) {
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2);
  const int64_t R = cos.size(2), half = R / 2;
  const int64_t stride = x.stride(0);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = ssin.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(R), s(R);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < R; ++i) {
        c[i] = static_cast<float>(cp[t * R + i]);
        s[i] = static_cast<float>(sp[t * R + i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* r = xp + t * stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(r[i]), b = static_cast<float>(r[i + half]);
          // x * cos in T first, as torch's multiply then addcmul (the bfloat16 default
          // model's answers are those of that rounding; one rounding changed the README
          // question's)
          const float ac = static_cast<float>(static_cast<T>(a * c[i]));
          const float bc = static_cast<float>(static_cast<T>(b * c[i + half]));
          r[i] = static_cast<T>(ac + b * s[i]);
          r[i + half] = static_cast<T>(bc + a * s[i + half]);
        }
      }
    }
  });
}

void rotary_embedding(torch::Tensor x, torch::Tensor cos, torch::Tensor ssin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && supported(x),
              "rotary_embedding: x [T, heads, D] float32 or bfloat16, heads D apart");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == x.size(0) && cos.size(1) == 1 &&
                  cos.size(2) % 2 == 0 && cos.size(2) > 0 && cos.size(2) <= x.size(2) &&
                  ssin.sizes() == cos.sizes() && cos.is_contiguous() && ssin.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && ssin.scalar_type() == x.scalar_type(),
              "rotary_embedding: cos and sin [T, 1, R], R even and at most D, contiguous, "
              "x's dtype");
  if (x.scalar_type() == torch::kFloat) {
    rope_rows<float>(x, cos, ssin);
  } else {
    rope_rows<c10::BFloat16>(x, cos, ssin);
  }
}

// silu(g) = g / (1 + exp(-g)), its exponent capped: under -ffast-math the compiler's
// vector expf (AVX-512) returns garbage for arguments past ~88 instead of inf, which made
// silu(-100) NaN; exp(80) is finite and g / (1 + exp(80)) is 0 to float precision.
static inline float silu(float g) { return g / (1.f + std::exp(std::min(-g, 80.f))); }

// SwiGLU's activation: x [T, 2I] = gate | up -> silu(gate) * up [T, I] (vLLM's
// silu_and_mul): one pass instead of torch's silu, then the multiply, each over the
// whole [T, I] (9% of a 2,048-token prefill step on the dev machine).
template <typename T>
static void silu_mul(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), I = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xp + t * 2 * I;
      const T* up = gate + I;
      T* o = op + t * I;
      for (int64_t i = 0; i < I; ++i) {
        o[i] = static_cast<T>(silu(static_cast<float>(gate[i])) * static_cast<float>(up[i]));
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && supported(x) && x.is_contiguous(),
              "silu_and_mul: contiguous float32 or bfloat16 [T, 2I]");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == torch::kFloat) {
    silu_mul<float>(x, out);
  } else {
    silu_mul<c10::BFloat16>(x, out);
  }
  return out;
}

// A linear over a few rows (one stream's decode, or a few): y [M, N] = x [M, K] @ w[N, K]^T
// (+ bias). One row's matmul is a GEMV, bound by reading the weights once; oneDNN and MKL
// reach ~14 GB/s on it on the AVX2 dev machine, well under what the memory gives. Here each
// thread streams its share of weight rows, R rows at a time, with M*R vector accumulators
// (GCC vector extensions: ymm on AVX2, zmm-width loads are not needed to saturate memory).
// Every output is the same dot product whatever M is, so a row's result does not depend on
// what else is in the batch.
typedef vf8_t vfloat8;  // load8 (above) reads one

static inline float hsum8(vfloat8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

template <int M, int R>
static void small_rows_block(const float* x, const float* w, const float* bias, float* y,
                             int64_t K, int64_t N, int64_t j) {
  vfloat8 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = vfloat8{0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t K8 = K / 8 * 8;
  for (int64_t d = 0; d < K8; d += 8) {
    vfloat8 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + (j + r) * K + d);
    for (int i = 0; i < M; ++i) {
      const vfloat8 xv = load8(x + i * K + d);
      for (int r = 0; r < R; ++r) acc[i][r] += xv * wv[r];
    }
  }
  for (int i = 0; i < M; ++i) {
    for (int r = 0; r < R; ++r) {
      float s = hsum8(acc[i][r]);
      for (int64_t d = K8; d < K; ++d) s += x[i * K + d] * w[(j + r) * K + d];
      y[i * N + j + r] = bias != nullptr ? s + bias[j + r] : s;
    }
  }
}

template <int M>
static void small_rows_gemv(const float* x, const float* w, const float* bias, float* y,
                              int64_t K, int64_t N) {
  constexpr int R = M <= 2 ? 4 : 2;  // M*R accumulators + R weight vectors fit 16 registers
  at::parallel_for(0, (N + R - 1) / R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t j = blk * R;
      if (j + R <= N) {
        small_rows_block<M, R>(x, w, bias, y, K, N, j);
      } else {
        for (int64_t jj = j; jj < N; ++jj) small_rows_block<M, 1>(x, w, bias, y, K, N, jj);
      }
    }
  });
}

// A float32 linear's optional bias [N], made contiguous in `holder`; nullptr for none.
static const float* float_bias(const c10::optional<torch::Tensor>& bias, int64_t N,
                               const char* op, torch::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->contiguous();
  TORCH_CHECK(holder.scalar_type() == torch::kFloat && holder.numel() == N, op, ": bias [N]");
  return holder.data_ptr<float>();
}

constexpr int64_t kSmallRowsMax = 4;

static void small_rows_matmul(const float* x, const float* w, const float* bias, float* y,
                              int64_t M, int64_t K, int64_t N) {
  switch (M) {
    case 1: small_rows_gemv<1>(x, w, bias, y, K, N); break;
    case 2: small_rows_gemv<2>(x, w, bias, y, K, N); break;
    case 3: small_rows_gemv<3>(x, w, bias, y, K, N); break;
    default: small_rows_gemv<4>(x, w, bias, y, K, N); break;
  }
}

torch::Tensor small_rows_linear(torch::Tensor x, torch::Tensor weight,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_rows_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kSmallRowsMax,
              "small_rows_linear: 1 to 4 rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat &&
                  weight.is_contiguous(),
              "small_rows_linear: float32, contiguous weight");
  const auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  torch::Tensor b;
  const float* bp = float_bias(bias, N, "small_rows_linear", b);
  auto out = torch::empty({M, N}, x.options());
  small_rows_matmul(xc.data_ptr<float>(), weight.data_ptr<float>(), bp, out.data_ptr<float>(),
                    M, K, N);
  return out;
}

// A float32 linear over a decode batch (5 to ~64 rows): y [M, N] = x [M, K] @ w[N, K]^T
// (+ bias), on the weight packed once into panels of 16 output columns, k-major:
// panel p holds w[16p + c, k] at [p][k][c] (zeros past N). Each thread takes whole panels;
// a panel (16 x K floats, 36 KB at K = 576) is read from memory once and then from L2 for
// every 6 rows of x: per k, two vector loads of the panel and one broadcast per row feed
// 2 x 6 FMAs into 12 registers. On the AVX2 dev machine oneDNN's packed matmul reaches
// ~47% of the FMA units' rate at 32 rows (the weights cold, as in a step), this ~2/3.
constexpr int64_t kPanel = 16;

torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat,
              "pack_panels: float32 weight [N, K]");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  auto packed = torch::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + c] = src[(p * kPanel + c) * K + k];
  });
  return packed;
}

// MR rows of x against two vectors of weights a k: per k, b0 = v0[k * kPanel..] and
// b1 = v1[k * kPanel..], one broadcast of x a row, 2 x MR FMAs into registers; the row's
// outputs are b0's lanes then b1's (`cols` of them written, plus the bias). The AVX2
// loop takes one panel's two halves in 8-float vectors (V = vf8_t, v1 = v0 + 8); AVX-512
// two adjacent panels in 16-float vectors (below).
template <typename V, int MR>
static inline void panel_rows(const float* x, int64_t K, const float* v0, const float* v1,
                              const float* bias, float* y, int64_t N, int64_t cols,
                              const float* pf, int64_t pf_step) {
  constexpr int W = sizeof(V) / sizeof(float);
  V acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = V{};
  for (int64_t k = 0; k < K; ++k) {
    if (pf) __builtin_prefetch(pf + k * pf_step, 0, 3);  // the next unit's panels
    V b0, b1;
    __builtin_memcpy(&b0, v0 + k * kPanel, sizeof(V));
    __builtin_memcpy(&b1, v1 + k * kPanel, sizeof(V));
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const float a = x[i * K + k];
      acc[i][0] += a * b0;
      acc[i][1] += a * b1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    float out[2 * W];
    __builtin_memcpy(out, &acc[i][0], sizeof(V));
    __builtin_memcpy(out + W, &acc[i][1], sizeof(V));
    for (int64_t c = 0; c < cols; ++c) y[i * N + c] = out[c] + (bias ? bias[c] : 0.f);
  }
}

// panel_rows for `rows` (1..R) rows: the row count as a template argument.
template <typename V, int R>
static inline void panel_rows_n(int64_t rows, const float* x, int64_t K, const float* v0,
                                const float* v1, const float* bias, float* y, int64_t N,
                                int64_t cols, const float* pf, int64_t pf_step) {
  if constexpr (R > 1) {
    if (rows < R)
      return panel_rows_n<V, R - 1>(rows, x, K, v0, v1, bias, y, N, cols, pf, pf_step);
  }
  panel_rows<V, R>(x, K, v0, v1, bias, y, N, cols, pf, pf_step);
}

// y = x @ w.T (+ bias) over units [u0, u1) of `per_unit` (1 or 2) panels each, rows in
// blocks of at most R, as even as they go (32 rows, R = 6: 6, 6, 5, 5, 5, 5; a block of
// fewer rows has fewer independent FMA chains). Chunks of units are handed out as
// threads free up: a thread that loses its core for a while (the front end, the client)
// does less of the step instead of holding it up. A unit's first block reads its panels
// from memory, the later ones from L2; from 3 blocks on, the thread prefetches the next
// unit's panels during blocks 1 and 2 (half each), so the memory works while the FMA
// units do instead of before them (bf16_matmul does the same). With 2 blocks it cost 8
// rows 9% (AVX2), so they do not prefetch.
template <typename V, int R>
static void panel_units(const float* xp, const float* wp, const float* bp, float* op,
                        int64_t M, int64_t K, int64_t N, int64_t u0, int64_t u1,
                        int64_t per_unit) {
  const int64_t blocks = (M + R - 1) / R;
  const bool prefetch = blocks >= 3;  // blocks 1 and 2 prefetch the next unit, half each
  const int64_t chunk = std::max<int64_t>(prefetch ? 3 : 1,
                                          (u1 - u0) / (8 * at::get_num_threads()));
  const int64_t pf_step = per_unit * kPanel / 2;  // half a k's floats of the next unit
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t first = u0; first < u1; first += chunk) {
    const int64_t last = std::min(u1, first + chunk);
    for (int64_t u = first; u < last; ++u) {
      const float* v0 = wp + u * per_unit * K * kPanel;
      const float* v1 = per_unit == 2 ? v0 + K * kPanel : v0 + 8;  // the next panel, or half
      const int64_t n0 = u * per_unit * kPanel, cols = std::min(per_unit * kPanel, N - n0);
      const float* bias_u = bp ? bp + n0 : nullptr;
      int64_t m = 0;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t rows = M / blocks + (blk < M % blocks ? 1 : 0);
        const float* pf = prefetch && (blk == 1 || blk == 2) && u + 1 < last
                              ? v0 + per_unit * K * kPanel + (blk - 1) * K * pf_step
                              : nullptr;
        panel_rows_n<V, R>(rows, xp + m * K, K, v0, v1, bias_u, op + m * N + n0, N, cols, pf,
                           pf_step);
        m += rows;
      }
    }
  }
}

static void panel_matmul(const float* xp, const float* wp, const float* bp, float* op, int64_t M,
                         int64_t K, int64_t N) {
  const int64_t P = (N + kPanel - 1) / kPanel;
#if defined(__AVX512F__)
  // two adjacent panels at once, one zmm each, for up to 12 rows: per k two vector loads
  // and a broadcast per row feed 2 x 12 FMAs into 24 of the 32 registers (the AVX2 loop's
  // 6 rows x 2 ymm would leave half of each FMA and register unused)
  if (P >= 2) panel_units<vf16_t, 12>(xp, wp, bp, op, M, K, N, 0, P / 2, 2);
  if (P % 2) panel_units<vf8_t, 6>(xp, wp, bp, op, M, K, N, P - 1, P, 1);  // the last one
#else
  panel_units<vf8_t, 6>(xp, wp, bp, op, M, K, N, 0, P, 1);
#endif
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel &&
                  x.size(1) == packed.size(1) && packed.size(0) == (N + kPanel - 1) / kPanel,
              "panel_linear: x [M, K], packed [ceil(N / 16), K, 16]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && packed.scalar_type() == torch::kFloat &&
                  packed.is_contiguous(),
              "panel_linear: float32, a pack_panels weight");
  const auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor b;
  const float* bp = float_bias(bias, N, "panel_linear", b);
  auto out = torch::empty({M, N}, x.options());
  panel_matmul(xc.data_ptr<float>(), packed.data_ptr<float>(), bp, out.data_ptr<float>(), M, K,
               N);
  return out;
}

// Structured output: logits[r, t] = fill wherever bit t of bitmask[r] is 0, for each row r
// in `rows` (xgrammar's layout: int32 words, token t at bit t % 32 of word t / 32). Most
// words of a grammar's mask are all-zero or all-one, so whole words are filled or
// skipped; xgrammar's own CPU kernel tests every bit (about 20x slower here). `fill` is
// passed in (minus infinity) because -ffast-math may not keep an infinity literal.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows,
                         double fill) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "apply_token_bitmask: logits [B, V] float32, contiguous");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask [B, W] int32, contiguous");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1, "apply_token_bitmask: rows [R] int64");
  const int64_t V = logits.size(1), W = bitmask.size(1), B = logits.size(0);
  TORCH_CHECK(bitmask.size(0) >= B && W * 32 >= V, "apply_token_bitmask: bitmask too small");
  const float value = static_cast<float>(fill);
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    const int64_t r = rp[i];
    TORCH_CHECK(r >= 0 && r < B, "apply_token_bitmask: row out of range");
    float* row = lp + r * V;
    const uint32_t* words = mp + r * W;
    for (int64_t w = 0; w * 32 < V; ++w) {
      const uint32_t bits = words[w];
      if (bits == 0xffffffffu) continue;
      const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
      if (bits == 0) {
        for (int64_t j = 0; j < n; ++j) row[base + j] = value;
        continue;
      }
      for (int64_t j = 0; j < n; ++j)
        if (!((bits >> j) & 1u)) row[base + j] = value;
    }
  }
}

// Multi-LoRA for decode rows (Punica's BGMV): row t adds its own slot's low-rank product,
//   h = A[part, slot] @ x[t]   (rank values per part),   y[t, part] += h @ B[part][slot]
// with A stacked [parts * slots * rank, K] (part-major) and B[part] [slots * rank, out].
// The torch path multiplies every row by every slot's A and B and masks (max_loras times
// the FLOPs); here each row touches only its own slot. Slot -1: a base row, untouched.
// x and y in T, A and B in W (the decode graph's float32 rows against a bfloat16
// model's adapters).
template <typename T, typename W = T>
static void lora_rows(const torch::Tensor& x, torch::Tensor& y, const torch::Tensor& a,
                      const std::vector<torch::Tensor>& bs, const torch::Tensor& slots,
                      int64_t rank, int64_t num_slots, const std::vector<int64_t>& offsets) {
  const int64_t D = x.size(0), K = x.size(1), P = static_cast<int64_t>(bs.size());
  const int64_t ldy = y.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const W* ap = a.data_ptr<W>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<const W*> bp(P);
  std::vector<int64_t> outs(P);
  int64_t max_out = 0;
  for (int64_t i = 0; i < P; ++i) {
    bp[i] = bs[i].data_ptr<W>();
    outs[i] = bs[i].size(1);
    max_out = std::max(max_out, outs[i]);
  }
  at::parallel_for(0, D, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(P * rank), acc(max_out), xf(K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = sp[t];
      if (s < 0) continue;
      const T* xr = xp + t * K;
      for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(xr[k]);
      for (int64_t i = 0; i < P; ++i) {
        for (int64_t j = 0; j < rank; ++j) {
          const W* ar = ap + ((i * num_slots + s) * rank + j) * K;
          vf8_t acc8 = {};  // 8 lanes of partial sums (a scalar sum does not vectorize)
          int64_t k = 0;
          for (; k + 8 <= K; k += 8) acc8 += load8(xf.data() + k) * load8(ar + k);
          float sum = (acc8[0] + acc8[4]) + (acc8[1] + acc8[5]) + (acc8[2] + acc8[6]) +
                      (acc8[3] + acc8[7]);
          for (; k < K; ++k) sum += xf[k] * static_cast<float>(ar[k]);
          h[i * rank + j] = sum;
        }
      }
      for (int64_t i = 0; i < P; ++i) {
        const int64_t n = outs[i];
        std::fill(acc.begin(), acc.begin() + n, 0.f);
        const W* b = bp[i] + s * rank * n;
        for (int64_t j = 0; j < rank; ++j) {
          const float hj = h[i * rank + j];
          if (hj == 0.f) continue;  // a zero-padded rank (or a part the adapter skips)
          const W* br = b + j * n;
          for (int64_t o = 0; o < n; ++o) acc[o] += hj * static_cast<float>(br[o]);
        }
        T* yr = yp + t * ldy + offsets[i];
        for (int64_t o = 0; o < n; ++o) yr[o] = static_cast<T>(static_cast<float>(yr[o]) + acc[o]);
      }
    }
  });
}

void lora_bgmv(torch::Tensor x, torch::Tensor y, torch::Tensor a, std::vector<torch::Tensor> bs,
               torch::Tensor slots, int64_t rank, int64_t num_slots, std::vector<int64_t> offsets) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 2 && slots.dim() == 1,
              "lora_bgmv: x [D, K], y [D, out], a [parts * slots * rank, K], slots [D]");
  TORCH_CHECK(supported(x) && y.scalar_type() == x.scalar_type() &&
                  a.scalar_type() == x.scalar_type(),
              "lora_bgmv: float32 or bfloat16, one dtype");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && y.stride(1) == 1,
              "lora_bgmv: contiguous x and a, rows of y contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.size(0) == x.size(0) &&
                  y.size(0) >= x.size(0) && bs.size() == offsets.size() &&
                  a.size(0) == static_cast<int64_t>(bs.size()) * num_slots * rank &&
                  a.size(1) == x.size(1),
              "lora_bgmv: shapes do not match");
  for (size_t i = 0; i < bs.size(); ++i) {
    TORCH_CHECK(bs[i].scalar_type() == x.scalar_type() && bs[i].is_contiguous() &&
                    bs[i].dim() == 2 && bs[i].size(0) == num_slots * rank &&
                    offsets[i] >= 0 && offsets[i] + bs[i].size(1) <= y.size(1),
                "lora_bgmv: b[part] [slots * rank, out] within y");
  }
  if (x.scalar_type() == torch::kFloat) {
    lora_rows<float>(x, y, a, bs, slots, rank, num_slots, offsets);
  } else {
    lora_rows<c10::BFloat16>(x, y, a, bs, slots, rank, num_slots, offsets);
  }
}

// GGUF block-quantized linear: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), with W kept
// in llama.cpp's block format (32 weights a block, rows of whole blocks):
//   Q4_0 (type 2):  f16 d, u8 qs[16]          w[j] = (lo(qs[j]) - 8) d,  w[j+16] = (hi(qs[j]) - 8) d
//   Q4_1 (type 3):  f16 d, f16 m, u8 qs[16]   w[j] = lo(qs[j]) d + m,    w[j+16] = hi(qs[j]) d + m
//   Q8_0 (type 8):  f16 d, i8 qs[32]          w[j] = qs[j] d
// Activations stay float: per block, dot(q, x) in float, times d, plus m * sum(x) (the
// block sums of x are computed once per call). The weights are dequantized in registers
// (AVX-512: 16 lanes, AVX2: 8) or, in the portable path, one block at a time into a tile.
// Parallel over output rows n (at::parallel_for); rows of x in groups of up to 8, so a
// weight block read from memory serves up to 8 activation rows.
static inline float gguf_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

struct GGUFType {
  int64_t block_bytes;
  int64_t header;  // bytes of d (and m) before qs
};

static GGUFType gguf_type(int64_t type) {
  switch (type) {
    case 2: return {18, 2};
    case 3: return {20, 4};
    case 8: return {34, 2};
  }
  TORCH_CHECK(false, "gguf_linear: unsupported ggml type ", type, " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  return {0, 0};
}

// The block's 32 quant values as floats (before d and m): the portable path's tile.
template <int TYPE>
static inline void gguf_block_values(const uint8_t* qs, float* out) {
  if (TYPE == 8) {
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(qs[j]));
  } else {
    const float off = TYPE == 2 ? -8.f : 0.f;
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(qs[j] & 0xF) + off;
      out[j + 16] = static_cast<float>(qs[j] >> 4) + off;
    }
  }
}

// dot(q values of one block, x[0..32)) for R rows of x (stride K) into dots[R]: the
// portable path (the vector paths in gguf_rows keep whole rows in registers).
template <int TYPE, int R>
static inline void gguf_block_dots(const uint8_t* qs, const float* x, int64_t K, float* dots) {
  float tile[32];
  gguf_block_values<TYPE>(qs, tile);
  for (int r = 0; r < R; ++r) {
    float s = 0.f;
    for (int j = 0; j < 32; ++j) s += tile[j] * x[r * K + j];
    dots[r] = s;
  }
}

// Output rows [n0, n1) for activation rows [m0, m0 + R).
template <int TYPE, int R>
static void gguf_rows(const uint8_t* w, const float* x, const float* xsum, const float* bias,
                      float* y, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const GGUFType t = gguf_type(TYPE);
  const int64_t nb = K / 32, row_bytes = nb * t.block_bytes;
  const float* xm = x + m0 * K;
#if defined(__AVX512F__)
  // AVX-512: the scaled block dots stay in one vector per row, reduced once per output
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 vacc[R];
    float macc[R] = {};
    for (int r = 0; r < R; ++r) vacc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * t.block_bytes;
      const uint8_t* qs = blk + t.header;
      __m512 lo, hi;
      if (TYPE == 8) {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
      } else {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
        __m512i l = _mm512_and_si512(q, _mm512_set1_epi32(0xF)), h = _mm512_srli_epi32(q, 4);
        if (TYPE == 2) {
          l = _mm512_sub_epi32(l, _mm512_set1_epi32(8));
          h = _mm512_sub_epi32(h, _mm512_set1_epi32(8));
        }
        lo = _mm512_cvtepi32_ps(l);
        hi = _mm512_cvtepi32_ps(h);
      }
      const __m512 d = _mm512_set1_ps(gguf_half(blk));
      lo = _mm512_mul_ps(lo, d);
      hi = _mm512_mul_ps(hi, d);
      for (int r = 0; r < R; ++r) {
        const float* xr = xm + r * K + b * 32;
        vacc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), vacc[r]);
        vacc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), vacc[r]);
      }
      if (TYPE == 3) {
        const float m = gguf_half(blk + 2);
        for (int r = 0; r < R; ++r) macc[r] += m * xsum[(m0 + r) * nb + b];
      }
    }
    const float bn = bias ? bias[n] : 0.f;
    for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = _mm512_reduce_add_ps(vacc[r]) + macc[r] + bn;
  }
  return;
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2: as above with 8 lanes; a block's values scaled by d once, one accumulator per
  // row, reduced once per output (not once per block)
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 vacc[R];
    float macc[R] = {};
    for (int r = 0; r < R; ++r) vacc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * t.block_bytes;
      const uint8_t* qs = blk + t.header;
      if (b + 4 < nb) __builtin_prefetch(blk + 4 * t.block_bytes);
      __m256 v[4];
      if (TYPE == 8) {
        for (int i = 0; i < 4; ++i)
          v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i))));
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
        const __m128i mask = _mm_set1_epi8(0xF);
        const __m128i l = _mm_and_si128(raw, mask), h = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        __m256i parts[4] = {_mm256_cvtepu8_epi32(l), _mm256_cvtepu8_epi32(_mm_srli_si128(l, 8)),
                            _mm256_cvtepu8_epi32(h), _mm256_cvtepu8_epi32(_mm_srli_si128(h, 8))};
        for (int i = 0; i < 4; ++i) {
          if (TYPE == 2) parts[i] = _mm256_sub_epi32(parts[i], _mm256_set1_epi32(8));
          v[i] = _mm256_cvtepi32_ps(parts[i]);
        }
      }
      const __m256 d = _mm256_set1_ps(gguf_half(blk));
      if (R <= 2) {  // the block's dot as a tree, then one FMA by d: one FMA's latency a block
        for (int r = 0; r < R; ++r) {
          const float* xr = xm + r * K + b * 32;
          const __m256 p01 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xr + 8), _mm256_mul_ps(v[0], _mm256_loadu_ps(xr)));
          const __m256 p23 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xr + 24), _mm256_mul_ps(v[2], _mm256_loadu_ps(xr + 16)));
          vacc[r] = _mm256_fmadd_ps(_mm256_add_ps(p01, p23), d, vacc[r]);
        }
      } else {  // rows enough to overlap the chains: scale the block once for all of them
        for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(v[i], d);
        for (int r = 0; r < R; ++r) {
          const float* xr = xm + r * K + b * 32;
          for (int i = 0; i < 4; ++i) vacc[r] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xr + 8 * i), vacc[r]);
        }
      }
      if (TYPE == 3) {
        const float m = gguf_half(blk + 2);
        for (int r = 0; r < R; ++r) macc[r] += m * xsum[(m0 + r) * nb + b];
      }
    }
    const float bn = bias ? bias[n] : 0.f;
    for (int r = 0; r < R; ++r) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vacc[r]), _mm256_extractf128_ps(vacc[r], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      y[(m0 + r) * N + n] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) + macc[r] + bn;
    }
  }
  return;
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[R] = {}, dots[R];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * t.block_bytes;
      if (b + 4 < nb) __builtin_prefetch(blk + 4 * t.block_bytes);
      gguf_block_dots<TYPE, R>(blk + t.header, xm + b * 32, K, dots);
      const float d = gguf_half(blk);
      if (TYPE == 3) {
        const float m = gguf_half(blk + 2);
        for (int r = 0; r < R; ++r) acc[r] += d * dots[r] + m * xsum[(m0 + r) * nb + b];
      } else {
        for (int r = 0; r < R; ++r) acc[r] += d * dots[r];
      }
    }
    const float bn = bias ? bias[n] : 0.f;
    for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = acc[r] + bn;
  }
}

template <int TYPE>
static void gguf_linear_typed(const uint8_t* w, const float* x, const float* xsum,
                              const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: gguf_rows<TYPE, 1>(w, x, xsum, bias, y, K, N, m0, n0, n1); break;
        case 2: gguf_rows<TYPE, 2>(w, x, xsum, bias, y, K, N, m0, n0, n1); break;
        case 3: gguf_rows<TYPE, 3>(w, x, xsum, bias, y, K, N, m0, n0, n1); break;
        case 4: gguf_rows<TYPE, 4>(w, x, xsum, bias, y, K, N, m0, n0, n1); break;
        case 5: gguf_rows<TYPE, 5>(w, x, xsum, bias, y, K, N, m0, n0, n1); break;
        case 6: gguf_rows<TYPE, 6>(w, x, xsum, bias, y, K, N, m0, n0, n1); break;
        case 7: gguf_rows<TYPE, 7>(w, x, xsum, bias, y, K, N, m0, n0, n1); break;
        default: gguf_rows<TYPE, 8>(w, x, xsum, bias, y, K, N, m0, n0, n1); break;
      }
    }
  });
}

// y [M, N] = x [M, K] @ W^T (+ bias) on GGUF blocks of `type`, float x: the block sums
// of x (into `xsum`, the caller's scratch), then the typed kernel.
static void gguf_matmul(const uint8_t* w, int64_t type, const float* x, const float* bias,
                        float* y, int64_t M, int64_t K, int64_t N, std::vector<float>& xsum) {
  const int64_t blocks = M * (K / 32);
  xsum.resize(blocks);
  for (int64_t i = 0; i < blocks; ++i) {
    float s = 0.f;
    for (int j = 0; j < 32; ++j) s += x[i * 32 + j];
    xsum[i] = s;
  }
  switch (type) {
    case 2: gguf_linear_typed<2>(w, x, xsum.data(), bias, y, M, K, N); break;
    case 3: gguf_linear_typed<3>(w, x, xsum.data(), bias, y, M, K, N); break;
    default: gguf_linear_typed<8>(w, x, xsum.data(), bias, y, M, K, N); break;
  }
}

// x [M, K] float32 or bfloat16; qweight [N, K / 32 * block_bytes] uint8; bias [N] float32
// or None -> [M, N] in x's dtype.
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor qweight, int64_t type,
                          c10::optional<torch::Tensor> bias) {
  const GGUFType t = gguf_type(type);
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && qweight.scalar_type() == torch::kByte &&
                  qweight.is_contiguous(), "gguf_linear: x [M, K], qweight [N, bytes] uint8");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "gguf_linear: x float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && qweight.size(1) == nb * t.block_bytes,
              "gguf_linear: K a multiple of 32 and qweight rows of K / 32 blocks");
  const auto xf = x.to(torch::kFloat).contiguous();
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "gguf_linear: bias [N]");
    bp = b.data_ptr<float>();
  }
  auto out = torch::empty({M, N}, xf.options());
  std::vector<float> xsum;
  gguf_matmul(qweight.data_ptr<uint8_t>(), type, xf.data_ptr<float>(), bp, out.data_ptr<float>(),
              M, K, N, xsum);
  return x.scalar_type() == torch::kFloat ? out : out.to(x.scalar_type());
}

// Weight-only int8 linear (`--quantization int8`, sluice.engine.quant):
//   y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]  (+ bias[n])
// q [N, K] int8, one float32 scale per output row (absmax / 127, symmetric). Activations
// stay float: the int8 weights are widened to float in registers (AVX-512: 16 lanes,
// AVX2: 8) and multiplied with the float rows of x; the row's scale is applied once to
// the finished dot product. Blocks of MB activation rows times R weight rows share one
// pass over K (MB * R vector accumulators), so a weight vector read and widened once
// serves MB rows. The portable path (no AVX2, or asked for) dequantizes one weight row
// at a time into a float tile and takes plain dot products with it.
#if defined(__AVX512F__)
typedef float vf_int8 __attribute__((vector_size(64)));
constexpr int kInt8Lanes = 16;
static inline vf_int8 int8_widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__)
typedef float vf_int8 __attribute__((vector_size(32)));
constexpr int kInt8Lanes = 8;
static inline vf_int8 int8_widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
template <int MB, int R>
static void int8_block(const float* x, const int8_t* w, const float* scales, const float* bias,
                       float* y, int64_t K, int64_t N, int64_t j) {
  vf_int8 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = vf_int8{};
  const int64_t KV = K / kInt8Lanes * kInt8Lanes;
  for (int64_t d = 0; d < KV; d += kInt8Lanes) {
    vf_int8 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = int8_widen(w + (j + r) * K + d);
    for (int i = 0; i < MB; ++i) {
      vf_int8 xv;
      __builtin_memcpy(&xv, x + i * K + d, sizeof(xv));
      for (int r = 0; r < R; ++r) acc[i][r] += xv * wv[r];
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int l = 0; l < kInt8Lanes; ++l) s += acc[i][r][l];
      for (int64_t d = KV; d < K; ++d) s += x[i * K + d] * static_cast<float>(w[(j + r) * K + d]);
      s *= scales[j + r];
      y[i * N + j + r] = bias != nullptr ? s + bias[j + r] : s;
    }
  }
}

// Output rows [j, j + R) for activation rows [0, M), MB rows at a time.
template <int MB, int R>
static void int8_column(const float* x, const int8_t* w, const float* scales, const float* bias,
                        float* y, int64_t M, int64_t K, int64_t N, int64_t j) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB) int8_block<MB, R>(x + m * K, w, scales, bias, y + m * N, K, N, j);
  const int64_t left = M - m;
  if constexpr (MB > 3) {
    if (left == 3) int8_block<3, R>(x + m * K, w, scales, bias, y + m * N, K, N, j);
  }
  if constexpr (MB > 2) {
    if (left == 2) int8_block<2, R>(x + m * K, w, scales, bias, y + m * N, K, N, j);
  }
  if (left == 1) int8_block<1, R>(x + m * K, w, scales, bias, y + m * N, K, N, j);
}

// Parallel over blocks of R output rows; activation rows in tiles of 64 (a tile of x
// stays in cache while every weight row passes over it).
template <int MB, int R>
static void int8_tiles(const float* x, const int8_t* w, const float* scales, const float* bias,
                       float* y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kTile = 64;
  for (int64_t m0 = 0; m0 < M; m0 += kTile) {
    const int64_t rows = std::min(kTile, M - m0);
    const float* xt = x + m0 * K;
    float* yt = y + m0 * N;
    at::parallel_for(0, (N + R - 1) / R, 8, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t j = blk * R;
        if (j + R <= N) {
          int8_column<MB, R>(xt, w, scales, bias, yt, rows, K, N, j);
        } else {
          for (int64_t jj = j; jj < N; ++jj) int8_column<MB, 1>(xt, w, scales, bias, yt, rows, K, N, jj);
        }
      }
    });
  }
}

// MB * R accumulators + R weight vectors fit 16 registers (x is a memory operand).
static void int8_vector(const float* x, const int8_t* w, const float* scales, const float* bias,
                        float* y, int64_t M, int64_t K, int64_t N) {
  if (M == 1) int8_tiles<1, 4>(x, w, scales, bias, y, M, K, N);
  else if (M == 2) int8_tiles<2, 4>(x, w, scales, bias, y, M, K, N);
  else if (M == 3) int8_tiles<3, 3>(x, w, scales, bias, y, M, K, N);
  else int8_tiles<4, 3>(x, w, scales, bias, y, M, K, N);
}
#endif

static void int8_portable(const float* x, const int8_t* w, const float* scales, const float* bias,
                          float* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> tile(K);
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* row = w + n * K;
      for (int64_t k = 0; k < K; ++k) tile[k] = static_cast<float>(row[k]) * scales[n];
      const float bn = bias != nullptr ? bias[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += tile[k] * xm[k];
        y[m * N + n] = s + bn;
      }
    }
  });
}

// x [M, K] float32 or bfloat16; qweight [N, K] int8; scales [N] float32; bias [N] or None
// -> [M, N] in x's dtype. `portable`: the tile path even where a vector path exists (tests).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && qweight.scalar_type() == torch::kChar &&
                  qweight.is_contiguous() && x.size(1) == qweight.size(1),
              "int8_linear: x [M, K], qweight [N, K] int8, contiguous");
  TORCH_CHECK(supported(x), "int8_linear: x float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  scales.numel() == N, "int8_linear: scales [N] float32");
  const auto xf = x.to(torch::kFloat).contiguous();
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "int8_linear: bias [N]");
    bp = b.data_ptr<float>();
  }
  auto out = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(__AVX2__) || defined(__AVX512F__)
  if (!portable) {
    int8_vector(xp, wp, sp, bp, op, M, K, N);
  } else {
    int8_portable(xp, wp, sp, bp, op, M, K, N);
  }
#else
  int8_portable(xp, wp, sp, bp, op, M, K, N);
#endif
  return x.scalar_type() == torch::kFloat ? out : out.to(x.scalar_type());
}

// Q4 linears with integer activations, for the decode graph. Each 32-value block of an
// activation row is written as two int8 vectors with one scale (dx = absmax / 127):
//
//   x_j  ~  dx * (q1_j + q2_j / 256),   q1 = round(x / dx),  q2 = round(256 (x / dx - q1))
//
// (llama.cpp quantizes activations to the int8 q1 alone; that cost this model 1.4% of
// perplexity, against its < 0.01% here: tests/engine/test_decode_graph.py). A Q4 block's
// dot product with it is then integer work, sum(q * q1) and sum(q * q2) over unsigned
// nibbles q and signed bytes: AVX512-VNNI's vpdpbusd does 64 of those multiply-adds in
// one instruction (AVX-512BW and AVX2: maddubs + madd), and
//
//   dot(w, x) = sum_b d_b * dx_b / 256 * (256 sum_j q_bj q1_bj + sum_j q_bj q2_bj)
//               + m_b * sum_j x_bj
//
// with m = the block's min (Q4_1) or -8 d (Q4_0), and sum_j x_bj the float sum of the
// block (the second sum in a short pass of its own per weight row). Against float
// activations (gguf_rows) this drops the per-value conversions to float, the work that
// made a one-row Q4 linear compute-bound (12 GB/s of blocks on the dev machine, whose
// memory gives 2 threads ~40 GB/s).
//
// The weights are repacked once (the file's bits, reordered, as llama.cpp repacks Q4_0
// for its SIMD paths): a row holds its nb blocks' 16-byte nibble arrays contiguously,
// then nb f16 d, then nb f16 m (Q4_1 only), so four blocks' nibbles (a group) are one
// 64-byte load. An activation row is laid out to match, a group at a time: q1 of the four
// blocks' low halves (values 0-15, the low nibbles' partners), q1 of their high halves,
// then the same for q2 (256 bytes a group); a last group of fewer blocks is zero-padded.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLUICE_Q4_INT8 1
// AVX-512BW / VL / VNNI for this section only (SLUICE_AVX512BW, SLUICE_AVX512VNNI: the
// build's -D flags, from the CPU's): the rest of the file keeps its flags, since letting
// the compiler use them everywhere changed how it vectorized other kernels' expf, and
// with it the default bfloat16 model's greedy answer to the README's question.
#pragma GCC push_options
#if defined(SLUICE_AVX512VNNI)
#pragma GCC target("avx512bw,avx512vl,avx512vnni")
#elif defined(SLUICE_AVX512BW)
#pragma GCC target("avx512bw,avx512vl")
#endif

// Q8_0 blocks (the offset bytes up to 255) need vpdpbusd's int32 sums: maddubs would
// saturate its int16 pairs. The same builds lay Q4 out in column tiles (below).
#if defined(SLUICE_AVX512VNNI) && defined(SLUICE_AVX512BW)
#define SLUICE_Q8_INT8 1
#endif

struct Q4Packed {
  std::vector<uint8_t> data;
  int64_t type, N, K, nb, row_bytes;
  // In column tiles (AVX512-VNNI builds): 16 output rows a tile, a tile's blocks in
  // order, each tile_block bytes, lane j of each 64-byte vector output row j. Q4: 4
  // vectors of nibbles (row j's qs bytes 4v..4v+3 in vector v: values 4v..4v+3 in the
  // low nibbles, 16+4v..16+4v+3 in the high ones), then the 16 rows' f16 d, then (Q4_1)
  // their m. Q8_0: 8 vectors (values 4v..4v+3 in vector v), each byte offset by 128 as
  // an unsigned one (vpdpbusd's unsigned operand), then the 16 d. The offset comes back
  // out exactly: sum((w + 128) q) = sum(w q) + 128 sum(q), with sum(q) the activation
  // block's integer sum (Q8Row::qsum).
  int64_t tile_block = 0;
};

constexpr int64_t Q4_TILE_ROWS = 16;

// Q4_0, Q4_1 or Q8_0 blocks [N, nb * block] in the column tiles above (rows past N: zeros).
static void q4_pack_tiles(Q4Packed& p, const uint8_t* src, const GGUFType& t) {
  const int64_t tiles = (p.N + Q4_TILE_ROWS - 1) / Q4_TILE_ROWS;
  const int64_t weights = p.type == 8 ? 512 : 256;
  p.tile_block = weights + 32 + (p.type == 3 ? 32 : 0);
  p.data.assign(tiles * p.nb * p.tile_block + 64, 0);
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t tile = n / Q4_TILE_ROWS, j = n % Q4_TILE_ROWS;
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* blk = src + (n * p.nb + b) * t.block_bytes;
      uint8_t* out = p.data.data() + (tile * p.nb + b) * p.tile_block;
      if (p.type == 8) {
        for (int i = 0; i < 32; ++i)
          out[64 * (i / 4) + 4 * j + i % 4] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + i]) + 128);
      } else {
        for (int v = 0; v < 4; ++v) std::memcpy(out + 64 * v + 4 * j, blk + t.header + 4 * v, 4);
      }
      std::memcpy(out + weights + 2 * j, blk, 2);  // d
      if (p.type == 3) std::memcpy(out + weights + 32 + 2 * j, blk + 2, 2);  // m
    }
  }
}

static Q4Packed q4_pack(const torch::Tensor& blocks, int64_t type) {
  const GGUFType t = gguf_type(type);
  Q4Packed p;
  p.type = type;
  p.N = blocks.size(0);
  p.nb = blocks.size(1) / t.block_bytes;
  p.K = p.nb * 32;
#if defined(SLUICE_Q8_INT8)
  q4_pack_tiles(p, blocks.data_ptr<uint8_t>(), t);
#else
  p.row_bytes = p.nb * (16 + 2 + (type == 3 ? 2 : 0));
  p.data.resize(p.N * p.row_bytes + 16);  // + a whole 8-f16 load past the last row's scales
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  for (int64_t n = 0; n < p.N; ++n) {
    uint8_t* row = p.data.data() + n * p.row_bytes;
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* blk = src + (n * p.nb + b) * t.block_bytes;
      std::memcpy(row + b * 16, blk + t.header, 16);
      std::memcpy(row + p.nb * 16 + b * 2, blk, 2);  // d
      if (type == 3) std::memcpy(row + p.nb * 18 + b * 2, blk + 2, 2);  // m
    }
  }
#endif
  return p;
}

// One activation row, quantized per block: q (the group layout, 256 bytes a group), dxe
// (per group 16 floats: each block's dx / 256, 4 times, the lanes vpdpbusd fills for the
// block), xs (each block's float sum, padded with zeros to a multiple of 16 blocks) and
// qsum (each block's quantized sum, dx / 256 (256 sum(q1) + sum(q2)), padded the same
// way: Q8_0's offset). A zero-padded last group is zero.
struct Q8Row {
  std::vector<int8_t> q;
  std::vector<float> dxe, xs, qsum;
};

// One block's 32 values into its q1 / q2 bytes (low half at q1[0..16), high half at
// q1[64..80); q2 128 bytes after q1), its dx / 256 (4 lanes) and its float sum. The
// same bytes with 8-lane vectors (AVX2 builds) or 16-lane vectors (AVX-512 builds), both
// rounding half to even, as nearbyint, as the tests' float64 model does. The graph
// quantizes every linear's input rows on the calling thread, ~100k values a row a step.
#if !defined(SLUICE_AVX512BW)
// 16 whole floats (a, b) as 16 int8 in order
static inline __m128i q8_pack16(__m256 a, __m256 b) {
  const __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));  // a0-3 b0-3 | a4-7 b4-7
  const __m256i o = _mm256_permute4x64_epi64(p, 0xD8);                                  // a0-7 | b0-7
  return _mm_packs_epi16(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1));
}

static inline void q8_block(const float* xb, int8_t* q1, float* dxe, float* xs, float* qsum) {
  const __m256 x[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                       _mm256_loadu_ps(xb + 24)};
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int j = 0; j < 4; ++j) dxe[j] = amax / 127.f / 256.f;
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(x[0], x[1]), _mm256_add_ps(x[2], x[3]));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  *xs = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
  const __m256 vinv = _mm256_set1_ps(inv), k256 = _mm256_set1_ps(256.f);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256 sum = _mm256_setzero_ps();  // 256 q1 + q2, summed exactly (|sum| < 2^24)
  for (int h = 0; h < 2; ++h) {
    __m256 r[2], c2[2];
    for (int k = 0; k < 2; ++k) {
      const __m256 v = _mm256_mul_ps(x[2 * h + k], vinv);
      r[k] = _mm256_round_ps(v, nearest);
      c2[k] = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, r[k]), k256), nearest), lo), hi);
      sum = _mm256_add_ps(sum, _mm256_fmadd_ps(r[k], k256, c2[k]));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + 64 * h), q8_pack16(r[0], r[1]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + 128 + 64 * h), q8_pack16(c2[0], c2[1]));
  }
  __m128 q4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  q4 = _mm_add_ps(q4, _mm_movehl_ps(q4, q4));
  *qsum = _mm_cvtss_f32(_mm_add_ss(q4, _mm_movehdup_ps(q4))) * dxe[0];
}
#else
static inline void q8_block(const float* xb, int8_t* q1, float* dxe, float* xs, float* qsum) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int j = 0; j < 4; ++j) dxe[j] = amax / 127.f / 256.f;
  *xs = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  const __m512 vinv = _mm512_set1_ps(inv), k256 = _mm512_set1_ps(256.f);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512 halves[2] = {x0, x1};
  __m512 sum = _mm512_setzero_ps();  // 256 q1 + q2, summed exactly (|sum| < 2^24)
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_mul_ps(halves[h], vinv);
    const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r2 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, r), k256),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c2 = _mm512_min_ps(_mm512_max_ps(r2, lo), hi);
    sum = _mm512_add_ps(sum, _mm512_fmadd_ps(r, k256, c2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + 64 * h), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + 128 + 64 * h), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c2)));
  }
  *qsum = _mm512_reduce_add_ps(sum) * dxe[0];
}
#endif

static void q8_quantize(const float* x, int64_t nb, Q8Row& out) {
  const int64_t groups = (nb + 3) / 4;
  out.q.assign(groups * 256, 0);
  out.dxe.assign(groups * 16, 0.f);
  out.xs.assign((nb + 15) / 16 * 16, 0.f);
  out.qsum.assign((nb + 15) / 16 * 16, 0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / 4, k = b % 4;
    q8_block(x + b * 32, out.q.data() + g * 256 + k * 16, out.dxe.data() + g * 16 + k * 4,
             out.xs.data() + b, out.qsum.data() + b);
  }
}

// The rows' bytes are streamed from memory once a step; at ~25 vector instructions a
// 64-byte group the core has too few loads in flight to keep the memory busy (the weight
// loads were a third of the kernel's cycles), so each tile asks for the lines of rows
// ~12 KB ahead into L2, a few with each group. Asked all at once into L1, 3 KB ahead (as
// before), the prefetches waited on L1's fill buffers: 38% of the tile's samples sat on
// the prefetch loop; spread, into L2 and 4x as far, a one-row step took 13% less on a
// Xeon with AVX-512 and 8% less on its AVX2 path (docs/engine.md).
constexpr int64_t Q4_PREFETCH_BYTES = 12288;

// The 4 f16 of a group (d) as floats; a last group's missing blocks are zero (their
// halves read past the row's d, into its m, the next row or the packing's padding, and
// masked: a copy to the stack stalled on the store-to-load forward).
static inline __m128 q4_group_halves(const uint16_t* h, int64_t count) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h));
  if (count < 4)
    v = _mm_and_si128(v, _mm_cmpgt_epi16(_mm_set1_epi16(static_cast<int16_t>(count)),
                                         _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7)));
  return _mm_cvtph_ps(v);
}

// The weight rows a pass computes together (their activation loads shared): AVX-512 has
// the 32 registers for 2 weight rows x 4 activation rows; AVX2's 16 hold one.
#if defined(SLUICE_AVX512BW)
constexpr int Q4_NW = 2;
#else
constexpr int Q4_NW = 1;
#endif
constexpr int Q4_MAX_ROWS = 4;  // activation rows a pass computes together
constexpr int64_t Q4_TILE = 16;  // weight rows a pass over the activation row groups revisits (in L1)

// One group of NW weight rows against R activation rows: each weight row's nibbles split
// once, its d widened to the group's lanes once; then per activation row (its 256 bytes
// loaded once for the NW weight rows) and weight row, the 16 lanes (4 a block) of
// s = 256 sum(q q1) + sum(q q2), and acc += s * d * dx / 256.
#if defined(SLUICE_AVX512BW)
// (The row layout runs where there is no VNNI: those builds take the column tiles.)
static inline __m512i q4_dot64(__m512i acc, __m512i u, __m512i s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}

typedef __m512 Q4Acc;
static inline Q4Acc q4_zero() { return _mm512_setzero_ps(); }
static inline float q4_total(Q4Acc acc) { return _mm512_reduce_add_ps(acc); }
static inline Q4Acc q4_add(Q4Acc a, Q4Acc b) { return _mm512_add_ps(a, b); }

template <int R, int NW>
static inline void q4_group(const uint8_t* const (&qs)[NW], const uint16_t* const (&d)[NW],
                            int64_t g, int64_t count, const Q8Row* xs, Q4Acc (&acc)[NW][R],
                            Q4Acc (&)[NW][R]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512i lo[NW], hi[NW];
  __m512 de[NW];
  for (int w = 0; w < NW; ++w) {
    const __m512i v = count == 4 ? _mm512_loadu_si512(qs[w] + g * 64)
                                 : _mm512_maskz_loadu_epi8((1ULL << (16 * count)) - 1, qs[w] + g * 64);
    lo[w] = _mm512_and_si512(v, low4);
    hi[w] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    de[w] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(q4_group_halves(d[w] + 4 * g, count)));
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* q = xs[r].q.data() + g * 256;
    const __m512i q1l = _mm512_loadu_si512(q), q1h = _mm512_loadu_si512(q + 64);
    const __m512i q2l = _mm512_loadu_si512(q + 128), q2h = _mm512_loadu_si512(q + 192);
    const __m512 dx = _mm512_loadu_ps(xs[r].dxe.data() + g * 16);
    for (int w = 0; w < NW; ++w) {
      const __m512i s1 = q4_dot64(q4_dot64(_mm512_setzero_si512(), lo[w], q1l), hi[w], q1h);
      const __m512i s2 = q4_dot64(q4_dot64(_mm512_setzero_si512(), lo[w], q2l), hi[w], q2h);
      const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(s1, 8), s2);
      acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(de[w], dx), acc[w][r]);
    }
  }
}

// acc[r] += sum_b c_b * xs[r].xs_b over a weight row's nb blocks (c: f16, times
// `scale`), in 16 lanes; c widened once for the R activation rows
template <int R>
static inline void q4_block_terms(const uint16_t* c, float scale, int64_t nb, const Q8Row* xs,
                                  Q4Acc (&acc)[R]) {
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 mask = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
    const __m512 cv = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, c + b)),
                                    _mm512_set1_ps(scale));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(cv, _mm512_loadu_ps(xs[r].xs.data() + b), acc[r]);
  }
}
#else
typedef __m256 Q4Acc;
static inline Q4Acc q4_zero() { return _mm256_setzero_ps(); }
static inline Q4Acc q4_add(Q4Acc a, Q4Acc b) { return _mm256_add_ps(a, b); }
static inline float q4_total(Q4Acc t) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// 8 int32 lanes (blocks 2h, 2h + 1 of the group) of 256 sum(q q1) + sum(q q2). The
// nibble x int8 pair sums of the low and high nibbles are added as int16 before the one
// widening per vector (|4 x 15 x 127| < 2^15), and the widening multiplies by 256 or 1:
// 4 maddubs, 2 int16 adds, 2 madds and one int32 add a half.
static inline __m256i q4_half_dot(__m256i lo, __m256i hi, const int8_t* q, int h) {
  const __m256i* v = reinterpret_cast<const __m256i*>(q);
  const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(v + h)),
                                      _mm256_maddubs_epi16(hi, _mm256_loadu_si256(v + 2 + h)));
  const __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(v + 4 + h)),
                                      _mm256_maddubs_epi16(hi, _mm256_loadu_si256(v + 6 + h)));
  return _mm256_add_epi32(_mm256_madd_epi16(p1, _mm256_set1_epi16(256)),
                          _mm256_madd_epi16(p2, _mm256_set1_epi16(1)));
}

// AVX2: a group in two halves of two blocks each (8 lanes, 4 a block). Up to 2 rows the
// second half sums into acc2, so a group's two FMAs do not wait on each other (one row
// was bound by that chain: two FMA latencies a group).
template <int R, int NW>
static inline void q4_group(const uint8_t* const (&qs)[NW], const uint16_t* const (&d)[NW],
                            int64_t g, int64_t count, const Q8Row* xs, Q4Acc (&acc)[NW][R],
                            Q4Acc (&acc2)[NW][R]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i spread_lo = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
  const __m256i spread_hi = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
  for (int w = 0; w < NW; ++w) {
    const uint8_t* src = qs[w] + g * 64;
    __m256i v0, v1;
    if (count == 4) {
      v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    } else {  // 4-byte lanes of the count * 16 bytes there are
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i words = _mm256_set1_epi32(static_cast<int>(count * 4));
      v0 = _mm256_maskload_epi32(reinterpret_cast<const int*>(src), _mm256_cmpgt_epi32(words, lane));
      v1 = _mm256_maskload_epi32(reinterpret_cast<const int*>(src + 32),
                                 _mm256_cmpgt_epi32(words, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
    }
    const __m256i lo0 = _mm256_and_si256(v0, low4), lo1 = _mm256_and_si256(v1, low4);
    const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
    const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
    const __m256 d4 = _mm256_castps128_ps256(q4_group_halves(d[w] + 4 * g, count));
    const __m256 de0 = _mm256_permutevar8x32_ps(d4, spread_lo);
    const __m256 de1 = _mm256_permutevar8x32_ps(d4, spread_hi);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = xs[r].q.data() + g * 256;
      const float* dx = xs[r].dxe.data() + g * 16;
      acc[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_half_dot(lo0, hi0, q, 0)),
                                  _mm256_mul_ps(de0, _mm256_loadu_ps(dx)), acc[w][r]);
      Q4Acc& second = R <= 2 ? acc2[w][r] : acc[w][r];
      second = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_half_dot(lo1, hi1, q, 1)),
                               _mm256_mul_ps(de1, _mm256_loadu_ps(dx + 8)), second);
    }
  }
}

// the same in 8 lanes. A last load of fewer than 8 blocks reads past c into the next
// row or the packing's padding (Q4Packed) and zeroes those lanes: copying the part to the
// stack first stalled every load on a failed store-to-load forward (a quarter of the
// kernel's samples).
template <int R>
static inline void q4_block_terms(const uint16_t* c, float scale, int64_t nb, const Q8Row* xs,
                                  Q4Acc (&acc)[R]) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b = 0; b < nb; b += 8) {
    __m256 cv = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b))),
                              _mm256_set1_ps(scale));
    if (nb - b < 8)
      cv = _mm256_and_ps(cv, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nb - b)), lane)));
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(xs[r].xs.data() + b), acc[r]);
  }
}
#endif

// Output rows [n, n + NW) for R activation rows: the groups' integer dots, then the
// blocks' constant terms sum_b m_b * sum_j x_bj (m: the min (Q4_1) or -8 d (Q4_0)) in
// one short pass over the row's f16 m (or d). `ahead`: a row this far ahead is
// prefetched (the NW rows' lines, contiguous, a share with each group) where it is below
// `limit`.
template <int R, int NW>
static inline void q4_int8_tile(const Q4Packed& w, const Q8Row* xs, const float* bias, float* y,
                                int64_t n, int64_t ahead, int64_t limit) {
  const int64_t nb = w.nb, whole = nb / 4, groups = whole + (whole * 4 < nb);
  const uint8_t* qs[NW];
  const uint16_t* d[NW];
  for (int k = 0; k < NW; ++k) {
    qs[k] = w.data.data() + (n + k) * w.row_bytes;
    d[k] = reinterpret_cast<const uint16_t*>(qs[k] + nb * 16);
  }
  const bool prefetch = n + NW + ahead <= limit;
  const uintptr_t from = reinterpret_cast<uintptr_t>(qs[0]) + ahead * w.row_bytes;
  const uintptr_t first = from & ~uintptr_t{63};
  const int64_t lines = prefetch ? (from + NW * w.row_bytes - first + 63) / 64 : 0;
  const auto prefetch_share = [&](int64_t g) {
    for (int64_t i = g * lines / groups; i < (g + 1) * lines / groups; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(first + i * 64), _MM_HINT_T1);
  };
  Q4Acc acc[NW][R], acc2[NW][R];
  for (int k = 0; k < NW; ++k)
    for (int r = 0; r < R; ++r) acc[k][r] = acc2[k][r] = q4_zero();
  for (int64_t g = 0; g < whole; ++g) {
    prefetch_share(g);
    q4_group<R, NW>(qs, d, g, 4, xs, acc, acc2);
  }
  if (whole < groups) {
    prefetch_share(whole);
    q4_group<R, NW>(qs, d, whole, nb - whole * 4, xs, acc, acc2);
  }
  for (int k = 0; k < NW; ++k) {
    for (int r = 0; r < R; ++r) acc[k][r] = q4_add(acc[k][r], acc2[k][r]);
    const uint16_t* c = w.type == 3 ? d[k] + nb : d[k];  // Q4_1: m; Q4_0: d, times -8
    const float scale = w.type == 3 ? 1.f : -8.f;
    const float bn = bias ? bias[n + k] : 0.f;
    q4_block_terms<R>(c, scale, nb, xs, acc[k]);
    for (int r = 0; r < R; ++r) y[r * w.N + n + k] = q4_total(acc[k][r]) + bn;
  }
}

// Output rows [n0, n1) for R activation rows, NW rows at a time.
template <int R>
static void q4_int8_rows(const Q4Packed& w, const Q8Row* xs, const float* bias, float* y,
                         int64_t n0, int64_t n1, int64_t limit) {
  const int64_t ahead = std::max<int64_t>(Q4_NW, Q4_PREFETCH_BYTES / w.row_bytes);
  int64_t n = n0;
  for (; n + Q4_NW <= n1; n += Q4_NW) q4_int8_tile<R, Q4_NW>(w, xs, bias, y, n, ahead, limit);
  for (; n < n1; ++n) q4_int8_tile<R, 1>(w, xs, bias, y, n, ahead, limit);
}

#if defined(SLUICE_Q8_INT8)
// One column tile (16 output rows, one per lane) against R activation rows: per block
// its weights as 8 vectors of 4 values a lane (Q4: nibbles split once; Q8_0: loaded);
// per activation row 4 bytes of q1 and of q2 broadcast to every lane, 16 vpdpbusd in 4
// independent chains, then acc += (256 s1 + s2) * d * dx / 256 and the block's constant
// term (Q4_1 m, Q4_0 -8 d times the block's float sum; Q8_0 -128 d times its quantized
// sum), 16 rows at once: no horizontal sums, no per-lane scale shuffles. The lines
// Q4_PREFETCH_BYTES on (short of `end`) are prefetched into L2, a block's with each block.
template <int R, bool Q8>
static inline void q4_tile_rows(const Q4Packed& w, const Q8Row* xs, const float* bias, float* y,
                                int64_t tile, const uint8_t* end) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* base = w.data.data() + tile * w.nb * w.tile_block;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = base + b * w.tile_block;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(blk) + Q4_PREFETCH_BYTES;
    for (int64_t o = 0; o < w.tile_block; o += 64)
      if (ahead + o < reinterpret_cast<uintptr_t>(end))
        _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    __m512i q[8];  // values 4v..4v+3 of the 16 rows' block
    for (int v = 0; v < 4; ++v) {
      const __m512i bytes = _mm512_loadu_si512(blk + 64 * v);
      if constexpr (Q8) {
        q[v] = bytes;
        q[4 + v] = _mm512_loadu_si512(blk + 256 + 64 * v);
      } else {
        q[v] = _mm512_and_si512(bytes, low4);
        q[4 + v] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      }
    }
    const int64_t weights = Q8 ? 512 : 256;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + weights)));
    // the block's constant term's factor: Q4_1 m; Q4_0 -8 d; Q8_0 -128 d (the offset)
    const __m512 c = w.type == 3
        ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + weights + 32)))
        : _mm512_mul_ps(d, _mm512_set1_ps(Q8 ? -128.f : -8.f));
    const int64_t g = b / 4, k = b % 4;
    for (int r = 0; r < R; ++r) {
      const int8_t* a = xs[r].q.data() + g * 256 + k * 16;  // q1 0-15, +64: 16-31, +128: q2
      __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
      for (int v = 0; v < 4; ++v) {
        int32_t a4[4];
        std::memcpy(&a4[0], a + 4 * v, 4);
        std::memcpy(&a4[1], a + 64 + 4 * v, 4);
        std::memcpy(&a4[2], a + 128 + 4 * v, 4);
        std::memcpy(&a4[3], a + 192 + 4 * v, 4);
        s[0] = _mm512_dpbusd_epi32(s[0], q[v], _mm512_set1_epi32(a4[0]));
        s[1] = _mm512_dpbusd_epi32(s[1], q[4 + v], _mm512_set1_epi32(a4[1]));
        s[2] = _mm512_dpbusd_epi32(s[2], q[v], _mm512_set1_epi32(a4[2]));
        s[3] = _mm512_dpbusd_epi32(s[3], q[4 + v], _mm512_set1_epi32(a4[3]));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(s[0], s[1]), 8),
                                           _mm512_add_epi32(s[2], s[3]));
      const __m512 dx = _mm512_set1_ps(xs[r].dxe[g * 16 + k * 4]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), acc[r]);
      acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(Q8 ? xs[r].qsum[b] : xs[r].xs[b]), acc[r]);
    }
  }
  const int64_t n0 = tile * Q4_TILE_ROWS, valid = std::min<int64_t>(Q4_TILE_ROWS, w.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * w.N + n0, mask, _mm512_add_ps(acc[r], bv));
}

template <bool Q8>
static void q4_tile_pass(const Q4Packed& w, const Q8Row* xs, int64_t rows, const float* bias,
                         float* y, int64_t tile, const uint8_t* end) {
  switch (rows) {
    case 1: q4_tile_rows<1, Q8>(w, xs, bias, y, tile, end); break;
    case 2: q4_tile_rows<2, Q8>(w, xs, bias, y, tile, end); break;
    case 3: q4_tile_rows<3, Q8>(w, xs, bias, y, tile, end); break;
    default: q4_tile_rows<4, Q8>(w, xs, bias, y, tile, end); break;
  }
}

// q4_int8_linear on column tiles: each thread's tiles, each against the activation rows
// in passes of up to Q4_MAX_ROWS (a tile, 5-15 KB, is read from memory once).
static void q4_tiles_linear(const Q4Packed& w, const std::vector<Q8Row>& rows, int64_t M,
                            const float* bias, float* y) {
  const int64_t tiles = (w.N + Q4_TILE_ROWS - 1) / Q4_TILE_ROWS;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const uint8_t* end = w.data.data() + t1 * w.nb * w.tile_block;
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += Q4_MAX_ROWS) {
        const Q8Row* xs = rows.data() + m0;
        float* ym = y + m0 * w.N;
        const int64_t r = std::min<int64_t>(Q4_MAX_ROWS, M - m0);
        if (w.type == 8) {
          q4_tile_pass<true>(w, xs, r, bias, ym, t, end);
        } else {
          q4_tile_pass<false>(w, xs, r, bias, ym, t, end);
        }
      }
    }
  });
}
#endif

// y [M, N] = x [M, K] @ W^T (+ bias) on repacked blocks: the column tiles with
// AVX512-VNNI; elsewhere the row layout, per thread's output rows a tile of Q4_TILE
// weight rows at a time against every activation row in passes of up to Q4_MAX_ROWS
// (the tile is read from memory once and from L1 by the later passes).
static void q4_int8_linear(const Q4Packed& w, const float* x, int64_t M, const float* bias,
                           float* y, std::vector<Q8Row>& rows) {
  rows.resize(std::max<size_t>(rows.size(), M));
  // a few thousand values a row: on the calling thread up to 8 rows, split past that
  const auto quantize = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) q8_quantize(x + m * w.K, w.nb, rows[m]);
  };
  if (M > 8) {
    at::parallel_for(0, M, 4, quantize);
  } else {
    quantize(0, M);
  }
#if defined(SLUICE_Q8_INT8)
  q4_tiles_linear(w, rows, M, bias, y);
#else
  at::parallel_for(0, w.N, Q4_TILE, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += Q4_TILE) {
      const int64_t t1 = std::min(n1, t0 + Q4_TILE);
      for (int64_t m0 = 0; m0 < M; m0 += Q4_MAX_ROWS) {
        const Q8Row* xs = rows.data() + m0;
        float* ym = y + m0 * w.N;
        switch (std::min<int64_t>(Q4_MAX_ROWS, M - m0)) {
          case 1: q4_int8_rows<1>(w, xs, bias, ym, t0, t1, n1); break;
          case 2: q4_int8_rows<2>(w, xs, bias, ym, t0, t1, n1); break;
          case 3: q4_int8_rows<3>(w, xs, bias, ym, t0, t1, n1); break;
          default: q4_int8_rows<4>(w, xs, bias, ym, t0, t1, n1); break;
        }
      }
    }
  });
#endif
}
#pragma GCC pop_options
#endif  // AVX2

// The ggml types q4_int8_linear takes here: Q4_0 and Q4_1 wherever it is built, Q8_0
// with AVX512-VNNI too.
std::vector<int64_t> int8_activation_types() {
#if defined(SLUICE_Q8_INT8)
  return {2, 3, 8};
#elif defined(SLUICE_Q4_INT8)
  return {2, 3};
#else
  return {};
#endif
}

static bool takes_int8_activations(int64_t type) {
  const auto types = int8_activation_types();
  return std::find(types.begin(), types.end(), type) != types.end();
}

// x [M, K] float32 @ Q4 blocks [N, bytes]^T (+ bias) on int8 activations,
// repacking the blocks on each call: q4_int8_linear alone, for tests.
torch::Tensor gguf_linear_int8(torch::Tensor x, torch::Tensor qweight, int64_t type,
                               c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(takes_int8_activations(type),
              "gguf_linear_int8: a ggml type of int8_activation_types() (Q4_0 2, Q4_1 3; Q8_0 8 "
              "with AVX512-VNNI)");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 &&
                  x.scalar_type() == torch::kFloat && qweight.scalar_type() == torch::kByte &&
                  qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(1) == x.size(1) / 32 * gguf_type(type).block_bytes &&
                  x.size(1) % 32 == 0,
              "gguf_linear_int8: x [M, K] float32, qweight [N, K / 32 blocks] uint8");
#ifdef SLUICE_Q4_INT8
  const Q4Packed packed = q4_pack(qweight, type);
  const auto xc = x.contiguous();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat).contiguous();
  auto out = torch::empty({x.size(0), packed.N}, xc.options());
  std::vector<Q8Row> rows;
  q4_int8_linear(packed, xc.data_ptr<float>(), x.size(0), b.defined() ? b.data_ptr<float>() : nullptr,
                 out.data_ptr<float>(), rows);
  return out;
#else
  TORCH_CHECK(false, "gguf_linear_int8: not built on this machine (no AVX2)");
  return x;
#endif
}

// The vector path q4_int8_linear was built with on this machine, or "" (none: the decode
// graph keeps float activations).
std::string q4_int8_path() {
#if defined(SLUICE_Q4_INT8) && defined(SLUICE_AVX512VNNI) && defined(SLUICE_AVX512BW)
  return "avx512_vnni";
#elif defined(SLUICE_Q4_INT8) && defined(SLUICE_AVX512BW)
  return "avx512bw";
#elif defined(SLUICE_Q4_INT8)
  return "avx2";
#else
  return "";
#endif
}

// A float rounded to bfloat16's bits, to nearest even (no NaNs here): the bfloat16
// linears' inputs, as torch rounds.
static inline uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// x [M, K] rounded to bfloat16 into xw [Mp, K] (rows M..Mp zeros: a row block's padding),
// the rows shared by the threads of the enclosing parallel region.
static void round_rows_bf16(const float* x, uint16_t* xw, int64_t M, int64_t Mp, int64_t K) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < Mp; ++r) {
    uint16_t* xr = xw + r * K;
    if (r < M) {
      const float* src = x + r * K;
      for (int64_t i = 0; i < K; ++i) xr[i] = bf16_round(src[i]);
    } else {
      std::fill(xr, xr + K, uint16_t{0});
    }
  }
}

// bfloat16 linears on AMX (Sapphire Rapids and later; built where /proc/cpuinfo has
// amx_bf16 and amx_tile, used where the kernel grants this process the tile state). The
// weight [N, K] is packed once into tiles of 16 outputs x 32 inputs, each stored as
// tdpbf16ps's B operand: 16 rows of input pairs, each row the 16 outputs' two values
// (packed[p][kb][kp][n][2] = w[16p + n][32kb + 2kp + {0, 1}]), 1 KB a tile, a panel's
// tiles contiguous. x (float32) is rounded to bfloat16 once per linear into row blocks
// of 16 (zero rows past M); a pass takes 2 panels and 2 row blocks in 4 float32
// accumulator tiles (amx_matmul). Sums are float32.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SLUICE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

static bool amx_granted() {
  // Linux hands out the tile data state on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {  // 0-3: accumulators, 4-5: weights, 6-7: activations
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// One accumulator tile's 16 x 16 sums (rows m0.. of M, panel p) into y (+ bias), a row
// a vector (it was 16 scalar adds and stores a row: 15% of the kernel's samples in a
// 64-row decode step; the step 0-5% shorter at 8-64 rows, the same logits).
static inline void amx_store(const float* o, float* y, const float* bias, int64_t m0,
                             int64_t M, int64_t N, int64_t p) {
  vf16_t b = {};
  if (bias) __builtin_memcpy(&b, bias + p * 16, sizeof(b));
  for (int64_t r = 0; r < std::min<int64_t>(16, M - m0); ++r) {
    vf16_t v;
    __builtin_memcpy(&v, o + r * 16, sizeof(v));
    v += b;
    __builtin_memcpy(y + (m0 + r) * N + p * 16, &v, sizeof(v));
  }
}

// y [M, N] = x [M, K] @ w.T (+ bias); packed as above, K % 32 == 0, N % 16 == 0. Tiles:
// 0-3 the sums of 2 row blocks x 2 panels, 4-5 the two panels' weight tiles, 6-7 the row
// blocks' activations; each tile is loaded once a 32-input step (no tile register is
// reloaded while a product still reads it, which would wait for it). x is rounded by all
// threads. Before, one panel a pass with one activation tile reloaded for each of 4 row
// blocks, and x rounded on one thread: a bfloat16 decode-graph step of 64 rows at 300
// context rows took 66 ms, now 58; 32 rows 40 -> 34, 8 rows 21 -> 17.5 (2-core Sapphire
// Rapids, after the attention's whole rows). Tile loads that miss the caches stall the
// products behind them (a one-core loop over cold weights: ~7 GB/s at 16 rows where a
// plain read takes ~11), so a pair prefetches its chunk's next pair into L2, spread over
// its 32-input steps (2-core Emerald Rapids, the model's linears alone: 1 row 15.4-16.8
// -> 12.7-14.2 ms, 64 rows 36.6-41.9 -> 26.6-33.5; whole decode-graph steps, alternated
// in one process, 0-9% shorter at 1-64 rows, 32 rows -2.5%..+4%).
static void amx_matmul(const float* x, const uint16_t* packed, const float* bias, float* y,
                       int64_t M, int64_t K, int64_t N, std::vector<uint16_t>& xb) {
  const int64_t Mp = (M + 15) / 16 * 16, KB = K / 32, P = N / 16, pairs = (P + 1) / 2;
  xb.resize(Mp * K);
  uint16_t* xw = xb.data();
  const int threads = at::get_num_threads();
  // pairs a chunk: up to 3, so that a pair has a next one to prefetch, while every thread
  // still gets two chunks
  const int64_t chunk = std::max<int64_t>(
      {1, std::min<int64_t>(3, pairs / (2 * threads)), pairs / (8 * threads)});
  // a pair's 64-byte lines, prefetched `per` a 32-input step over the row-block passes
  const int64_t passes = (Mp + 31) / 32, lines = 32 * KB;
  const int64_t per = (lines + passes * KB - 1) / (passes * KB);
#pragma omp parallel num_threads(threads)
  {
    round_rows_bf16(x, xw, M, Mp, K);  // once; the last row block's padding zeros
    amx_configure();
    alignas(64) float out[4][16 * 16];
#pragma omp for schedule(dynamic, 1)
    for (int64_t first = 0; first < pairs; first += chunk) {
      const int64_t last = std::min(pairs, first + chunk);
      for (int64_t pp = first; pp < last; ++pp) {
        const int64_t p = 2 * pp;
        const bool two = p + 1 < P;  // a second panel (N / 16 odd: the last pair has one)
        const uint16_t* w0 = packed + p * KB * 512;
        const uint16_t* w1 = w0 + KB * 512;
        // the chunk's next pair (one or two panels), into L2 while this one computes
        const char* next = pp + 1 < last ? reinterpret_cast<const char*>(w0 + 2 * KB * 512)
                                         : nullptr;
        const int64_t next_lines = 2 * (pp + 1) + 1 < P ? lines : lines / 2;
        for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
          const bool second = m0 + 16 < Mp;  // a second row block
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          const uint16_t* a = xw + m0 * K;
          for (int64_t kb = 0; kb < KB; ++kb) {
            if (next) {
              const int64_t l0 = ((m0 / 32) * KB + kb) * per;
              for (int64_t l = l0; l < std::min(next_lines, l0 + per); ++l)
                _mm_prefetch(next + 64 * l, _MM_HINT_T1);
            }
            _tile_loadd(4, w0 + kb * 512, 64);
            if (two) _tile_loadd(5, w1 + kb * 512, 64);
            _tile_loadd(6, a + kb * 32, K * 2);
            if (second) _tile_loadd(7, a + 16 * K + kb * 32, K * 2);
            _tile_dpbf16ps(0, 6, 4);
            if (two) _tile_dpbf16ps(1, 6, 5);
            if (second) {
              _tile_dpbf16ps(2, 7, 4);
              if (two) _tile_dpbf16ps(3, 7, 5);
            }
          }
          _tile_stored(0, out[0], 64); _tile_stored(1, out[1], 64);
          _tile_stored(2, out[2], 64); _tile_stored(3, out[3], 64);
          amx_store(out[0], y, bias, m0, M, N, p);
          if (two) amx_store(out[1], y, bias, m0, M, N, p + 1);
          if (second) {
            amx_store(out[2], y, bias, m0 + 16, M, N, p);
            if (two) amx_store(out[3], y, bias, m0 + 16, M, N, p + 1);
          }
        }
      }
    }
    _tile_release();
  }
}
#endif

// bfloat16 linears with AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake; built where
// /proc/cpuinfo has avx512_bf16: SLUICE_AVX512BF16), where AMX is not there or not
// granted. The weight is packed as for AMX: within a panel of 16 outputs, one 64-byte row
// per input pair (lane n holds w[16p + n][2j] and w[16p + n][2j + 1]), which is
// vdpbf16ps's operand for 16 outputs against one row's input pair broadcast. A pass
// takes 2 panels x up to 12 rows in 24 accumulators, as the float32 panels do (per input
// pair: two 64-byte loads, one broadcast a row, 2 x 12 vdpbf16ps); a panel is read from
// memory once a step and from L2 for each further 12 rows, and while a thread computes a
// unit's later row blocks from L2 it prefetches its next unit's panels (`pf`, `pf2`: one
// or two lines an input pair; off, both the line being loaded anyway), so the next
// unit's first block does not wait for memory: a 32-row decode-graph step 45.0 -> 42.0 ms, 64
// rows 76.8 -> 73.7 (Zen 4, both in one process, alternated step by step, medians of 24).
// With one row block of 8-12 rows it prefetches each panel 2 KB ahead of its loads (12
// rows 18.5 -> 16.7 ms, 8 rows 14.9 -> 14.5; fewer rows lost by it: 1 row 10.4 -> 10.9).
// A row's sums run in the same order whatever else shares its step.
#if defined(SLUICE_AVX512BF16)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
template <int MR, bool TWO>
static inline void bf16_rows(const uint16_t* x, int64_t K, const uint16_t* w0, const uint16_t* w1,
                             const float* bias, float* y, int64_t N, int64_t cols,
                             const uint16_t* pf, const uint16_t* pf2, int64_t pf_step) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K / 2; ++j) {
    // __builtin_prefetch, not _mm_prefetch: with the latter GCC kept acc in memory
    __builtin_prefetch(pf + j * pf_step, 0, 3);
    __builtin_prefetch(pf2 + j * pf_step, 0, 3);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + j * 32);
    const __m512bh b1 = TWO ? (__m512bh)_mm512_loadu_si512(w1 + j * 32) : b0;
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * K + 2 * j, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], b0, a);
      if (TWO) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], b1, a);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float out[32];
    _mm512_store_ps(out, acc[i][0]);
    _mm512_store_ps(out + 16, acc[i][1]);
    for (int64_t c = 0; c < cols; ++c) y[i * N + c] = out[c] + (bias ? bias[c] : 0.f);
  }
}

// bf16_rows for `rows` (1..R) rows and one or two panels.
template <int R>
static inline void bf16_rows_n(int64_t rows, bool two, const uint16_t* x, int64_t K,
                               const uint16_t* w0, const uint16_t* w1, const float* bias,
                               float* y, int64_t N, const uint16_t* pf, const uint16_t* pf2,
                               int64_t pf_step) {
  if constexpr (R > 1) {
    if (rows < R) return bf16_rows_n<R - 1>(rows, two, x, K, w0, w1, bias, y, N, pf, pf2, pf_step);
  }
  if (two) {
    bf16_rows<R, true>(x, K, w0, w1, bias, y, N, 32, pf, pf2, pf_step);
  } else {
    bf16_rows<R, false>(x, K, w0, w1, bias, y, N, 16, pf, pf2, pf_step);
  }
}

// y [M, N] = x [M, K] @ w.T (+ bias) on the packed weight: x rounded to bfloat16 by all
// threads, then units of 2 panels handed out in chunks as threads free up (as
// panel_units; at least 3 units a chunk past 12 rows, so a unit has a next one to
// prefetch), rows in even blocks of at most 12.
static void avx512_bf16_matmul(const float* x, const uint16_t* packed, const float* bias,
                               float* y, int64_t M, int64_t K, int64_t N,
                               std::vector<uint16_t>& xb) {
  const int64_t P = N / 16, units = (P + 1) / 2, blocks = (M + 11) / 12;
  xb.resize(M * K);
  uint16_t* xw = xb.data();
  const int threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(blocks > 1 ? 3 : 1, units / (8 * threads));
  // the next unit's K lines (2 panels of K / 2) over the row blocks after the first: two
  // lines an input pair in block 1 when there are 2 blocks, else one in blocks 1 and 2;
  // one block of 8 or more rows: each panel's line 32 pairs ahead
  const int64_t per = blocks == 2 ? 2 : 1;
  const bool stream_ahead = blocks == 1 && M >= 8;
#pragma omp parallel num_threads(threads)
  {
    round_rows_bf16(x, xw, M, M, K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t first = 0; first < units; first += chunk) {
      const int64_t last = std::min(units, first + chunk);
      for (int64_t u = first; u < last; ++u) {
        const int64_t p = 2 * u;
        const bool two = p + 1 < P;
        const uint16_t* w0 = packed + p * K * 16;
        const uint16_t* w1 = w0 + K * 16;
        const float* bias_u = bias ? bias + p * 16 : nullptr;
        int64_t m = 0;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t rows = M / blocks + (blk < M % blocks ? 1 : 0);
          const uint16_t *pf = w0, *pf2 = w0;  // off: the line being loaded anyway
          int64_t pf_step = 32;
          if (stream_ahead) {
            pf = w0 + 32 * 32;
            pf2 = w1 + 32 * 32;
          } else if (blk >= 1 && blk <= 2 / per && u + 1 < last) {  // the next unit
            pf = w0 + K * 32 + (blk - 1) * (K / 2) * per * 32;
            pf2 = per == 2 ? pf + 32 : pf;
            pf_step = per * 32;
          }
          bf16_rows_n<12>(rows, two, xw + m * K, K, w0, w1, bias_u, y + m * N + p * 16, N, pf,
                          pf2, pf_step);
          m += rows;
        }
      }
    }
  }
}
#pragma GCC pop_options
#endif

// Where bfloat16 linears (the decode graph's, bf16_linear) run in this process: "amx"
// (built for it and the tile state granted), "avx512_bf16", or "" (neither).
std::string bf16_linear_path() {
#ifdef SLUICE_AMX
  if (amx_granted()) return "amx";
#endif
#ifdef SLUICE_AVX512BF16
  return "avx512_bf16";
#else
  return "";
#endif
}

// y [M, N] = x [M, K] @ w.T (+ bias) on a pack_bf16 weight, on the path above (one of
// them is there: callers check bf16_linear_path()).
static void bf16_matmul(const float* x, const uint16_t* packed, const float* bias, float* y,
                        int64_t M, int64_t K, int64_t N, std::vector<uint16_t>& xb) {
#ifdef SLUICE_AMX
  if (amx_granted()) return amx_matmul(x, packed, bias, y, M, K, N, xb);
#endif
#ifdef SLUICE_AVX512BF16
  avx512_bf16_matmul(x, packed, bias, y, M, K, N, xb);
#endif
}

// weight [N, K] bfloat16 -> the layout above (int16 [N / 16, K / 32, 16, 32]: AMX's tiles,
// AVX512-BF16's pair rows).
torch::Tensor pack_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 &&
                  weight.size(0) % 16 == 0 && weight.size(1) % 32 == 0,
              "pack_bf16: bfloat16 weight [N, K], N % 16 == 0, K % 32 == 0");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = N / 16, KB = K / 32;
  auto packed = torch::empty({P, KB, 16, 32}, w.options().dtype(torch::kShort));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<int16_t>());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int64_t kp = 0; kp < 16; ++kp)
          for (int64_t n = 0; n < 16; ++n)
            for (int64_t e = 0; e < 2; ++e)
              dst[(((p * KB + kb) * 16 + kp) * 16 + n) * 2 + e] =
                  src[(p * 16 + n) * K + kb * 32 + 2 * kp + e];
  });
  return packed;
}

// x [M, K] float32 (rounded to bfloat16) @ the packed weight's [N, K].T (+ bias) -> [M, N]
// float32: the graph's bfloat16 linear alone.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(!bf16_linear_path().empty(), "bf16_linear: no AMX or AVX512-BF16 here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && packed.dim() == 4 &&
                  packed.scalar_type() == torch::kShort && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 32 &&
                  x.size(1) == packed.size(1) * 32,
              "bf16_linear: x [M, K] float32, a pack_bf16 weight");
  const auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  torch::Tensor b;
  const float* bp = float_bias(bias, N, "bf16_linear", b);
  auto out = torch::empty({M, N}, x.options());
  std::vector<uint16_t> xb;
  bf16_matmul(xc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>()),
              bp, out.data_ptr<float>(), M, K, N, xb);
  return out;
}

// The decode graph (sluice.engine.decode_graph): a whole decode step of a Llama-family
// model whose linears are all GGUF blocks, all float32 weights on panels, or all
// bfloat16 weights on AMX tiles or AVX512-BF16 pairs, in one call. Per layer:
//
//   residual += h;  xn = rms_norm(residual) * attention_norm    (layer 0: residual = x)
//   qkv = xn @ Wqkv;  (Qwen3: each Q and K head rms-normed);  RoPE on the Q and K heads
//   (not on SmolLM3's NoPE layers);  K, V written at the rows' slots
//   attn = paged decode attention (each row: its block table, its context length)
//   h = attn @ Wo;  residual += h;  xn = rms_norm(residual) * ffn_norm
//   h = silu(xn @ Wgate) * (xn @ Wup) @ Wdown
//
// then the final norm and the output head: logits [B, V] float32. The torch model runs
// the same step as ~10 calls a layer from Python (each a dispatch, an allocation, and
// for the parallel ones an OpenMP fork/join); here the activations stay float32 in a few
// reused buffers; the linears (q4_int8_linear or gguf_linear_typed, parallel over output
// rows; panel_matmul or the GEMV for float32; bf16_matmul for bfloat16) and the attention
// (over rows x KV heads)
// are parallel, and norms, RoPE, the K/V writes and SwiGLU's activation are parallel
// over rows from kGraphRowGrain rows (below that, a few thousand floats a row, on the
// calling thread).
// Rows are decodes or a speculative verify's tokens (each a one-query decode whose
// context ends at its own token): every row's K/V is written before any attends.
constexpr int64_t kGraphFloat = 0;  // ggml's type of float32 weights
constexpr int64_t kGraphBF16 = 30;  // ggml's type of bfloat16 weights (AMX or AVX512-BF16)
constexpr int64_t kGraphRowGrain = 8;

struct GraphLinear {
  torch::Tensor blocks;  // uint8 [N, K / 32 * block_bytes], float32 [N, K] (kGraphFloat),
                         // or bfloat16 [N, K] (kGraphBF16)
  int64_t type, N, K;
  torch::Tensor bias;  // float32 [N], or empty
  torch::Tensor panels;  // kGraphFloat: pack_panels(blocks), for more than kSmallRowsMax rows;
                         // kGraphBF16: pack_bf16(blocks)
#ifdef SLUICE_Q4_INT8
  std::shared_ptr<Q4Packed> packed;  // Q4 blocks repacked for int8 activations, or null
#endif
  // its multi-LoRA side (lora_bgmv's A, B per part and offsets), or an empty lora_a
  torch::Tensor lora_a;
  std::vector<torch::Tensor> lora_b;
  std::vector<int64_t> lora_offsets;
};

// The graph's scratch for its linears' inputs.
struct GraphScratch {
  std::vector<float> xsum;
  std::vector<uint16_t> xb;  // kGraphBF16: x in bfloat16
#ifdef SLUICE_Q4_INT8
  std::vector<Q8Row> q8;
#endif
};

static void graph_linear(const GraphLinear& l, const float* x, int64_t M, float* y,
                         GraphScratch& scratch) {
  const float* bp = l.bias.numel() ? l.bias.data_ptr<float>() : nullptr;
  if (l.type == kGraphFloat) {
    if (M <= kSmallRowsMax) {
      small_rows_matmul(x, l.blocks.data_ptr<float>(), bp, y, M, l.K, l.N);
    } else {
      panel_matmul(x, l.panels.data_ptr<float>(), bp, y, M, l.K, l.N);
    }
    return;
  }
  if (l.type == kGraphBF16) {
    bf16_matmul(x, reinterpret_cast<const uint16_t*>(l.panels.data_ptr<int16_t>()), bp, y, M,
                l.K, l.N, scratch.xb);
    return;
  }
#ifdef SLUICE_Q4_INT8
  if (l.packed) {
    q4_int8_linear(*l.packed, x, M, bp, y, scratch.q8);
    return;
  }
#endif
  gguf_matmul(l.blocks.data_ptr<uint8_t>(), l.type, x, bp, y, M, l.K, l.N, scratch.xsum);
}

// residual[i] += h[i] (unless h is null); out = rms_norm(residual) * w, one row (out =
// residual where w is null: a block without input norms, OLMo 2's).
static void graph_add_norm(float* residual, const float* h, const float* w, float* out,
                           int64_t H, float eps) {
  if (!w) {
    for (int64_t i = 0; i < H; ++i) out[i] = residual[i] += h ? h[i] : 0.f;
    return;
  }
  float squares = 0.f;
  for (int64_t i = 0; i < H; ++i) {
    if (h) residual[i] += h[i];
    squares += residual[i] * residual[i];
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = residual[i] * inv * w[i];
}

// Hugging Face's rotation of one head in place: x * cos + rotate_half(x) * sin, with
// the tables as the model keeps them (cos = [c, c], signed sin = [-s, s]).
static void graph_rope(float* x, const float* cos, const float* ssin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + b * ssin[i];
    x[i + half] = b * cos[i + half] + a * ssin[i + half];
  }
}

// Gemma's MLP activation, torch's gelu(approximate="tanh").
static inline float gelu_tanh(float x) {
  return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// The MLP's activation (LlamaConfig.mlp_activation, in its MLP_ACTIVATIONS order).
enum GraphActivation : int64_t { kSiluGated = 0, kGeluTanhGated = 1, kRelu2 = 2 };

class DecodeGraph {
 public:
  // linears: 4 per layer (qkv, o, gate_up or up alone, down) then the output head, as
  // GGUF blocks of `types`, or float32 weights [N, K] (type 0) with their pack_panels in
  // `panels`, or bfloat16 weights (type 30) with their pack_bf16 there (empty tensors for
  // GGUF blocks), with `biases` (empty tensors for none); norms: 4 per layer (the
  // attention's input and output norms, the MLP's input and output norms; an empty
  // tensor where the block has none: Llama's have the inputs', OLMo 2's the outputs',
  // Gemma's and GLM-4's all four) then the final norm, float32; k_pools, v_pools: the
  // layers' KV pools (float32 or bfloat16); int8_activations, one per linear: a Q4
  // linear on int8 activations (q4_int8_linear; needs q4_int8_path()), else on float
  // activations (gguf_rows); qk_norms: none, or 2 per layer (the Q norm, then K's),
  // float32, [head_dim] each (a norm of each head: Qwen3's) or [q_size] and [kv_size]
  // (one over all heads: OLMo 2's); rope_layers: none (every layer rotates with the
  // forward's cos/sin), or one per layer (0: none, SmolLM3's NoPE; 1: cos/sin; 2: the
  // forward's local_cos/local_sin, Gemma 3's sliding layers); windows: none, or one
  // per layer (0: full attention, else a sliding window's length); activation: a
  // GraphActivation (kRelu2: the MLP has no gate); softcap: Gemma 2's cap on the
  // attention scores (0: none).
  DecodeGraph(std::vector<torch::Tensor> linears, std::vector<int64_t> types,
              std::vector<torch::Tensor> biases, std::vector<torch::Tensor> norms,
              std::vector<torch::Tensor> k_pools, std::vector<torch::Tensor> v_pools,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
              std::vector<bool> int8_activations, std::vector<torch::Tensor> panels,
              std::vector<torch::Tensor> qk_norms, std::vector<int64_t> rope_layers,
              std::vector<int64_t> windows, int64_t activation, double softcap)
      : norms_(std::move(norms)), qk_norms_(std::move(qk_norms)),
        rope_layers_(std::move(rope_layers)), windows_(std::move(windows)),
        k_pools_(std::move(k_pools)), v_pools_(std::move(v_pools)), H_(num_heads),
        KVH_(num_kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
        activation_(activation), softcap_(static_cast<float>(softcap)) {
    const int64_t L = static_cast<int64_t>(k_pools_.size());
    TORCH_CHECK(L > 0 && static_cast<int64_t>(linears.size()) == 4 * L + 1 &&
                    types.size() == linears.size() && biases.size() == linears.size() &&
                    static_cast<int64_t>(norms_.size()) == 4 * L + 1 &&
                    int8_activations.size() == linears.size() &&
                    panels.size() == linears.size() && v_pools_.size() == k_pools_.size(),
                "DecodeGraph: 4 linears and 4 norms (or empty tensors) a layer, then the head "
                "and final norm");
    TORCH_CHECK(activation_ >= kSiluGated && activation_ <= kRelu2, "DecodeGraph: activation");
    TORCH_CHECK(H_ % KVH_ == 0 && D_ % 2 == 0, "DecodeGraph: head shapes");
    for (size_t i = 0; i < linears.size(); ++i) {
      const torch::Tensor& w = linears[i];
      const torch::Tensor& b = biases[i];
      TORCH_CHECK(b.numel() == 0 || (b.scalar_type() == torch::kFloat && b.numel() == w.size(0) &&
                                     b.is_contiguous()),
                  "DecodeGraph: biases float32 [N] or empty");
      if (types[i] == kGraphFloat) {
        const torch::Tensor& p = panels[i];
        TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous() &&
                        p.dim() == 3 && p.scalar_type() == torch::kFloat && p.is_contiguous() &&
                        p.size(0) == (w.size(0) + kPanel - 1) / kPanel && p.size(1) == w.size(1) &&
                        p.size(2) == kPanel && !int8_activations[i],
                    "DecodeGraph: a float32 linear is a contiguous weight [N, K] and its "
                    "pack_panels");
        linears_.push_back({w, kGraphFloat, w.size(0), w.size(1), b, p});
        continue;
      }
      if (types[i] == kGraphBF16) {
        const torch::Tensor& p = panels[i];
        TORCH_CHECK(!bf16_linear_path().empty() && w.dim() == 2 && w.scalar_type() == torch::kBFloat16 &&
                        p.dim() == 4 && p.scalar_type() == torch::kShort && p.is_contiguous() &&
                        p.size(0) * 16 == w.size(0) && p.size(1) * 32 == w.size(1) &&
                        !int8_activations[i],
                    "DecodeGraph: a bfloat16 linear is a weight [N, K] and its pack_bf16 "
                    "(needs AMX or AVX512-BF16)");
        linears_.push_back({w, kGraphBF16, w.size(0), w.size(1), b, p});
        continue;
      }
      const GGUFType t = gguf_type(types[i]);
      TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.is_contiguous() &&
                      w.size(1) % t.block_bytes == 0,
                  "DecodeGraph: linears are contiguous uint8 [N, blocks * block_bytes]");
      linears_.push_back({w, types[i], w.size(0), w.size(1) / t.block_bytes * 32, b, {}});
      TORCH_CHECK(!int8_activations[i] || takes_int8_activations(types[i]),
                  "DecodeGraph: int8 activations need a type of int8_activation_types()");
#ifdef SLUICE_Q4_INT8
      if (int8_activations[i])
        linears_.back().packed = std::make_shared<Q4Packed>(q4_pack(w, types[i]));
#endif
    }
    hidden_ = linears_[0].K;
    for (const auto& n : norms_)
      TORCH_CHECK(n.numel() == 0 || (n.scalar_type() == torch::kFloat && n.is_contiguous() &&
                                     n.numel() == hidden_),
                  "DecodeGraph: norms float32 [hidden] or empty");
    TORCH_CHECK(norms_.back().numel() == hidden_, "DecodeGraph: a final norm");
    TORCH_CHECK(qk_norms_.empty() || static_cast<int64_t>(qk_norms_.size()) == 2 * L,
                "DecodeGraph: no qk_norms, or a Q and a K norm a layer");
    for (size_t i = 0; i < qk_norms_.size(); ++i) {
      const torch::Tensor& n = qk_norms_[i];
      const int64_t whole = (i % 2 ? KVH_ : H_) * D_;
      TORCH_CHECK(n.scalar_type() == torch::kFloat && n.is_contiguous() &&
                      (n.numel() == D_ || n.numel() == whole),
                  "DecodeGraph: qk_norms float32, [head_dim] or [q_size] and [kv_size]");
    }
    TORCH_CHECK(rope_layers_.empty() || static_cast<int64_t>(rope_layers_.size()) == L,
                "DecodeGraph: no rope_layers, or one a layer");
    for (int64_t r : rope_layers_)
      TORCH_CHECK(r >= 0 && r <= 2, "DecodeGraph: rope_layers 0, 1 or 2");
    TORCH_CHECK(windows_.empty() || static_cast<int64_t>(windows_.size()) == L,
                "DecodeGraph: no windows, or one a layer");
    for (int64_t l = 0; l < L; ++l) {
      const GraphLinear *qkv = &linears_[4 * l], *o = &linears_[4 * l + 1],
                        *gu = &linears_[4 * l + 2], *down = &linears_[4 * l + 3];
      const int64_t up_rows = activation_ == kRelu2 ? 1 : 2;  // gate and up, or up alone
      TORCH_CHECK(qkv->N == (H_ + 2 * KVH_) * D_ && o->K == H_ * D_ && o->N == hidden_ &&
                      gu->K == hidden_ && gu->N == up_rows * down->K &&
                      down->K == linears_[3].K && down->N == hidden_,
                  "DecodeGraph: layer ", l, "'s linear shapes");
      TORCH_CHECK(norms_[4 * l].numel() == norms_[4 * l + 2].numel() &&
                      norms_[4 * l + 1].numel() == norms_[4 * l + 3].numel(),
                  "DecodeGraph: layer ", l, ": both branches' input norms or neither, and "
                  "their output norms likewise");
      const torch::Tensor& k = k_pools_[l];
      TORCH_CHECK(k.dim() == 4 && k.size(2) == KVH_ && k.size(3) == D_ && k.is_contiguous() &&
                      v_pools_[l].sizes() == k.sizes() && v_pools_[l].is_contiguous() &&
                      v_pools_[l].scalar_type() == k.scalar_type() && supported(k) &&
                      k.scalar_type() == k_pools_[0].scalar_type(),
                  "DecodeGraph: pools [blocks, block_size, kv_heads, head_dim], one dtype");
    }
    TORCH_CHECK(linears_.back().K == hidden_, "DecodeGraph: the head's input is hidden");
  }

  // Multi-LoRA sides for the linears (one entry each, an empty `a` for none): lora_bgmv's
  // stacked A [parts * num_slots * rank, K], B per part [num_slots * rank, out] and the
  // parts' output offsets; float32 or bfloat16. Rows then add their slot's products
  // (forward's lora_slots).
  void set_lora(std::vector<torch::Tensor> a, std::vector<std::vector<torch::Tensor>> b,
                std::vector<std::vector<int64_t>> offsets, int64_t rank, int64_t num_slots) {
    TORCH_CHECK(a.size() == linears_.size() && b.size() == a.size() && offsets.size() == a.size(),
                "DecodeGraph.set_lora: one entry a linear");
    for (size_t i = 0; i < a.size(); ++i) {
      GraphLinear& l = linears_[i];
      if (a[i].numel() == 0) continue;
      TORCH_CHECK(supported(a[i]) && a[i].is_contiguous() && a[i].dim() == 2 &&
                      a[i].size(1) == l.K && b[i].size() == offsets[i].size() &&
                      a[i].size(0) == static_cast<int64_t>(b[i].size()) * num_slots * rank,
                  "DecodeGraph.set_lora: linear ", i, "'s A");
      for (size_t p = 0; p < b[i].size(); ++p)
        TORCH_CHECK(b[i][p].scalar_type() == a[i].scalar_type() && b[i][p].is_contiguous() &&
                        b[i][p].dim() == 2 && b[i][p].size(0) == num_slots * rank &&
                        offsets[i][p] >= 0 && offsets[i][p] + b[i][p].size(1) <= l.N,
                    "DecodeGraph.set_lora: linear ", i, "'s B within its outputs");
      l.lora_a = a[i];
      l.lora_b = b[i];
      l.lora_offsets = offsets[i];
    }
    lora_rank_ = rank;
    lora_slots_count_ = num_slots;
  }

  // x [B, hidden] float32 (the tokens' embeddings); cos, sin [B, R] float32 (the rows'
  // RoPE table rows: the first R <= head_dim of each head rotate, R even); slots [B],
  // block_tables [B, n], context_lens [B] int64; local_cos, local_sin: the sliding
  // layers' own tables' rows (as cos, sin), or empty (no layer rotates with them).
  // Writes the rows' K/V into the pools; returns float32 logits [B, vocab].
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor slots, torch::Tensor block_tables,
                        torch::Tensor context_lens, torch::Tensor local_cos,
                        torch::Tensor local_sin, torch::Tensor lora_slots) {
    const int64_t B = x.size(0);
    TORCH_CHECK(lora_slots.numel() == 0 ||
                    (lora_slots.scalar_type() == torch::kLong && lora_slots.numel() == B &&
                     lora_slots.is_contiguous() && lora_rank_ > 0 &&
                     lora_slots.max().item<int64_t>() < lora_slots_count_),
                "DecodeGraph.forward: lora_slots, one int64 a row (-1: the base), needs "
                "set_lora");
    lora_slots_ = lora_slots;
    const bool local = std::find(rope_layers_.begin(), rope_layers_.end(), 2) != rope_layers_.end();
    TORCH_CHECK(!local || (local_cos.sizes() == cos.sizes() && local_sin.sizes() == cos.sizes() &&
                           local_cos.scalar_type() == torch::kFloat &&
                           local_sin.scalar_type() == torch::kFloat),
                "DecodeGraph.forward: the local layers' cos/sin, shaped as cos/sin");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == torch::kFloat &&
                    cos.sizes() == sin.sizes() && cos.size(0) == B && cos.size(1) <= D_ &&
                    cos.size(1) % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                    cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
                    slots.numel() == B && context_lens.numel() == B &&
                    block_tables.dim() == 2 && block_tables.size(0) == B &&
                    slots.scalar_type() == torch::kLong &&
                    block_tables.scalar_type() == torch::kLong &&
                    context_lens.scalar_type() == torch::kLong,
                "DecodeGraph.forward: x [B, hidden], cos/sin [B, head_dim] float32; slots, "
                "block_tables, context_lens int64");
    auto xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
    auto lc = local ? local_cos.contiguous() : cc, ls = local ? local_sin.contiguous() : sc;
    auto st = slots.contiguous(), bt = block_tables.contiguous(), cl = context_lens.contiguous();
    auto logits = torch::empty({B, linears_.back().N}, x.options());
    if (k_pools_[0].scalar_type() == torch::kFloat) {
      run<float>(xc, cc, sc, lc, ls, st, bt, cl, logits);
    } else {
      run<c10::BFloat16>(xc, cc, sc, lc, ls, st, bt, cl, logits);
    }
    return logits;
  }

 private:
  template <typename T>
  void run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
           const torch::Tensor& local_cos, const torch::Tensor& local_sin,
           const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lens,
           torch::Tensor& logits) {
    const int64_t B = x.size(0), Hd = hidden_, L = static_cast<int64_t>(k_pools_.size());
    const int64_t q_size = H_ * D_, kv_size = KVH_ * D_, qkv_n = q_size + 2 * kv_size;
    const int64_t I = linears_[3].K, up_n = linears_[2].N;
    residual_.assign(x.data_ptr<float>(), x.data_ptr<float>() + B * Hd);
    xn_.resize(B * Hd);
    h_.resize(B * std::max(Hd, I));
    qkv_.resize(B * qkv_n);
    attn_.resize(B * q_size);
    gate_up_.resize(B * up_n);
    act_.resize(B * I);
    const float* tables_cos[3] = {nullptr, cos.data_ptr<float>(), local_cos.data_ptr<float>()};
    const float* tables_sin[3] = {nullptr, sin.data_ptr<float>(), local_sin.data_ptr<float>()};
    const int64_t R = cos.size(1);
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* table = tables.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    const int64_t n_blocks = tables.size(1);
    const float scale = 1.f / std::sqrt(static_cast<float>(D_));
    for (int64_t l = 0; l < L; ++l) {
      add_norm_rows(B, l ? h_.data() : nullptr, norm(4 * l));
      linear(4 * l, xn_.data(), B, qkv_.data());
      T* kp = k_pools_[l].data_ptr<T>();
      T* vp = v_pools_[l].data_ptr<T>();
      const int64_t bs = k_pools_[l].size(1);
      const float* qn = qk_norms_.empty() ? nullptr : qk_norms_[2 * l].data_ptr<float>();
      const float* kn = qk_norms_.empty() ? nullptr : qk_norms_[2 * l + 1].data_ptr<float>();
      const bool whole = qn && qk_norms_[2 * l].numel() != D_;  // one norm over all heads
      const int64_t rope = rope_layers_.empty() ? 1 : rope_layers_[l];
      const float *cp = tables_cos[rope], *sp = tables_sin[rope];
      at::parallel_for(0, B, kGraphRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          float* row = &qkv_[b * qkv_n];
          if (whole) {  // in place
            graph_add_norm(row, nullptr, qn, row, q_size, eps_);
            graph_add_norm(row + q_size, nullptr, kn, row + q_size, kv_size, eps_);
          }
          for (int64_t h = 0; h < H_ + KVH_; ++h) {
            float* head = row + h * D_;
            if (qn && !whole) graph_add_norm(head, nullptr, h < H_ ? qn : kn, head, D_, eps_);
            if (rope) graph_rope(head, cp + b * R, sp + b * R, R);
          }
          for (int64_t i = 0; i < kv_size; ++i) {
            kp[slot[b] * kv_size + i] = static_cast<T>(row[q_size + i]);
            vp[slot[b] * kv_size + i] = static_cast<T>(row[q_size + kv_size + i]);
          }
        }
      });
      attend_rows<T, float>(qkv_.data(), qkv_n, attn_.data(), q_size, kp, vp, table, n_blocks,
                            len, B, H_, KVH_, D_, bs, scale, windows_.empty() ? 0 : windows_[l],
                            softcap_);
      linear(4 * l + 1, attn_.data(), B, h_.data());
      norm_rows(B, h_.data(), norm(4 * l + 1));
      add_norm_rows(B, h_.data(), norm(4 * l + 2));
      linear(4 * l + 2, xn_.data(), B, gate_up_.data());
      at::parallel_for(0, B, kGraphRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const float* gate = &gate_up_[b * up_n];
          float* act = &act_[b * I];
          if (activation_ == kSiluGated) {
            for (int64_t i = 0; i < I; ++i) act[i] = silu(gate[i]) * gate[I + i];
          } else if (activation_ == kGeluTanhGated) {
            for (int64_t i = 0; i < I; ++i) act[i] = gelu_tanh(gate[i]) * gate[I + i];
          } else {  // relu(up)², no gate
            for (int64_t i = 0; i < I; ++i) act[i] = gate[i] > 0.f ? gate[i] * gate[i] : 0.f;
          }
        }
      });
      linear(4 * l + 3, act_.data(), B, h_.data());
      norm_rows(B, h_.data(), norm(4 * l + 3));
    }
    add_norm_rows(B, h_.data(), norm(norms_.size() - 1));
    graph_linear(linears_.back(), xn_.data(), B, logits.data_ptr<float>(), scratch_);
  }

  // y = linears_[i](x) for M rows, plus each row's LoRA product where the step has some.
  void linear(size_t i, const float* x, int64_t M, float* y) {
    const GraphLinear& l = linears_[i];
    graph_linear(l, x, M, y, scratch_);
    if (l.lora_a.numel() == 0 || lora_slots_.numel() == 0) return;
    const auto opts = torch::TensorOptions().dtype(torch::kFloat);
    auto xt = torch::from_blob(const_cast<float*>(x), {M, l.K}, opts);
    auto yt = torch::from_blob(y, {M, l.N}, opts);
    if (l.lora_a.scalar_type() == torch::kFloat) {
      lora_rows<float>(xt, yt, l.lora_a, l.lora_b, lora_slots_, lora_rank_, lora_slots_count_,
                       l.lora_offsets);
    } else {
      lora_rows<float, c10::BFloat16>(xt, yt, l.lora_a, l.lora_b, lora_slots_, lora_rank_,
                                      lora_slots_count_, l.lora_offsets);
    }
  }

  // norms_[i]'s weight, or null where the block has none.
  const float* norm(size_t i) const {
    return norms_[i].numel() ? norms_[i].data_ptr<float>() : nullptr;
  }

  // Each row: residual += h (unless h is null), xn = rms_norm(residual) * w (xn = residual
  // where w is null).
  void add_norm_rows(int64_t B, const float* h, const float* w) {
    const int64_t Hd = hidden_;
    at::parallel_for(0, B, kGraphRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        graph_add_norm(&residual_[b * Hd], h ? h + b * Hd : nullptr, w, &xn_[b * Hd], Hd, eps_);
    });
  }

  // Each row of h: h = rms_norm(h) * w in place (a branch's output norm); nothing where w
  // is null.
  void norm_rows(int64_t B, float* h, const float* w) {
    if (!w) return;
    const int64_t Hd = hidden_;
    at::parallel_for(0, B, kGraphRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        graph_add_norm(h + b * Hd, nullptr, w, h + b * Hd, Hd, eps_);
    });
  }

  std::vector<GraphLinear> linears_;
  std::vector<torch::Tensor> norms_, qk_norms_;
  std::vector<int64_t> rope_layers_, windows_;
  std::vector<torch::Tensor> k_pools_, v_pools_;
  int64_t H_, KVH_, D_, hidden_ = 0;
  float eps_;
  int64_t activation_;
  float softcap_;
  int64_t lora_rank_ = 0, lora_slots_count_ = 0;
  torch::Tensor lora_slots_;  // this step's slot per row, or empty
  std::vector<float> residual_, xn_, h_, qkv_, attn_, gate_up_, act_;
  GraphScratch scratch_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module_local: two builds of these kernels (e.g. an A/B of two sources) may be loaded
  // in one process, each registering its own DecodeGraph type
  py::class_<DecodeGraph>(m, "DecodeGraph", py::module_local())
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double,
                    std::vector<bool>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, int64_t, double>(),
           py::arg("linears"), py::arg("types"), py::arg("biases"), py::arg("norms"),
           py::arg("k_pools"), py::arg("v_pools"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("int8_activations"), py::arg("panels"),
           py::arg("qk_norms") = std::vector<torch::Tensor>(),
           py::arg("rope_layers") = std::vector<int64_t>(),
           py::arg("windows") = std::vector<int64_t>(), py::arg("activation") = 0,
           py::arg("softcap") = 0.0)
      .def("forward", &DecodeGraph::forward,
           "a decode step of every layer and the head: logits [B, vocab] (CPU)")
      .def("set_lora", &DecodeGraph::set_lora,
           "the linears' multi-LoRA sides (lora_bgmv's A, B per part, offsets), rank, slots");
  m.def("int8_activation_types", &int8_activation_types,
        "ggml types the int8-activation linears take here (Q4_0 2, Q4_1 3; Q8_0 8 with VNNI)");
  m.def("gguf_linear_int8", &gguf_linear_int8,
        "x @ dequant(qweight).T + bias on Q4 blocks with int8 activations (tests; CPU)",
        py::arg("x"), py::arg("qweight"), py::arg("type"), py::arg("bias") = py::none());
  m.def("bf16_linear_path", &bf16_linear_path,
        "where bfloat16 linears run here: \"amx\" (built for it, tile state granted), "
        "\"avx512_bf16\", or \"\"");
  m.def("pack_bf16", &pack_bf16, "bfloat16 weight [N, K] -> its AMX tiles / AVX512-BF16 pairs");
  m.def("bf16_linear", &bf16_linear, py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none(), "x [M, K] float32 @ a pack_bf16 weight's .T (AMX or AVX512-BF16)");
  m.def("q4_int8_path", &q4_int8_path,
        "the vector path of the Q4 x int8 dot products built here, or '' (none)");
  m.def("int8_linear", &int8_linear,
        "x @ (qweight * scales[:, None]).T + bias on int8 weights, per-row scales (CPU)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias") = py::none(),
        py::arg("portable") = false);
  m.def("gguf_linear", &gguf_linear,
        "x @ dequant(qweight).T + bias on GGUF Q4_0 / Q4_1 / Q8_0 blocks (CPU)",
        py::arg("x"), py::arg("qweight"), py::arg("type"), py::arg("bias") = py::none());
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits[r, t] = fill where bit t of bitmask[r] is 0, rows given (float32, CPU)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV pool, in a sliding window if > 0, scores capped "
        "at softcap * tanh(s / softcap) if > 0 (float32 or bfloat16, CPU)",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal prefill attention of chunks over the paged KV pool, in a sliding window if > 0, "
        "scores capped as paged_decode_attention's (float32 or bfloat16, CPU)",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("block_tables"),
        py::arg("q_starts"), py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight, in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up] (CPU)");
  m.def("rotary_embedding", &rotary_embedding,
        "RoPE in place on x [T, heads, D] with cos and signed sin [T, 1, D] (CPU)");
  m.def("pack_panels", &pack_panels, "a float32 weight [N, K] as panels [ceil(N/16), K, 16]");
  m.def("panel_linear", &panel_linear, "x @ weight.T + bias on a pack_panels weight (float32, CPU)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("small_rows_linear", &small_rows_linear, "x @ weight.T + bias for 1-4 rows (float32, CPU)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("lora_bgmv", &lora_bgmv,
        "y[t] += B[slot[t]] @ (A[slot[t]] @ x[t]) per part, in place (multi-LoRA decode, CPU)");
}
