// Attention of packed tokens over the slot KV cache (native_attention.h for the layout and contract).
//
// Work is split into units (slot, kv head, key split): a unit takes every query of the call that reads that
// slot's kv head (the slot's tokens x the kv head's query heads) over the keys [256 s, 256 (s + 1)), so each key
// tile and value row is fetched from memory once per forward, not once per query. Per unit and query:
//   1. scores of 16 keys at a time (keys are stored transposed), masked to the query's visible keys;
//   2. max, vectorised exp (Cody-Waite range reduction and Cephes' degree-6 polynomial, relative error ~1e-7), sum;
//   3. the probability-weighted sum of value rows, in key order.
// The splits of a query are then merged (m, l, o) in split order. Split boundaries are absolute key indices and
// every step is per query, so a query's result does not depend on the other tokens of the call. AVX-512 or AVX2
// intrinsics (by the active instruction set), or portable C++ otherwise.
#include "native_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define SA_ATT_X86 1
#define SA_ATT512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define SA_ATT2 __attribute__((target("avx2,fma,f16c")))
#if !defined(__clang__)
#define SA_ATT_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SA_ATT_CLONES
#endif
#else
#define SA_ATT_X86 0
#define SA_ATT_CLONES
#endif

namespace specadapt {
namespace cpu {
namespace native {

int active_isa_value();  // native_linear.cpp: 0 scalar, 1 AVX2, 2 AVX-512

namespace {

constexpr int64_t kSplit = 256;  // keys per unit (absolute boundaries)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// One query of a unit: token t, query head h; it sees keys < visible and tree_base + bit.
struct Query {
  int64_t t, h, visible, tree_base;
  uint64_t tree_bits;
  bool sees(int64_t j) const {
    if (j < visible) return true;
    const int64_t off = j - tree_base;
    return off >= 0 && off < 64 && ((tree_bits >> off) & 1u);
  }
  int64_t end() const {  // one past the last key it sees
    const int64_t tree_end = tree_bits ? tree_base + 64 - __builtin_clzll(tree_bits) : 0;
    return std::max(visible, tree_end);
  }
};

struct Unit {
  int64_t slot, kvh, k0, k1;
  std::vector<Query> queries;
};

template <typename T>
inline const T* key_tile(const T* k_layer, int64_t slot, int64_t head, int64_t Hkv, int64_t C, int64_t D,
                         int64_t tile) {
  return k_layer + ((slot * Hkv + head) * (C / kKeyTile) + tile) * D * kKeyTile;
}

inline float widen(float v) { return v; }
inline float widen(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

float exp_scalar(float x) { return std::exp(x); }

// ---------------------------------------------------------------------------------------------- portable C++
// Fills, per query: partial[q] = [m, l, o_0 .. o_{D-1}] over the unit's keys (o unnormalised).
template <typename T>
SA_ATT_CLONES void unit_generic(const Unit& u, const float* q, int64_t ldq, const T* k_layer, const T* v_layer,
                                int64_t Hkv, int64_t C, int64_t D, float scale, float* partial,
                                std::vector<float>& scores) {
  const int64_t width = u.k1 - u.k0;
  scores.resize(width);
  const T* V = v_layer + (u.slot * Hkv + u.kvh) * C * D;
  for (size_t qi = 0; qi < u.queries.size(); ++qi) {
    const Query& qr = u.queries[qi];
    const float* qv = q + qr.t * ldq + qr.h * D;
    float best = kNegInf;
    for (int64_t j = u.k0; j < u.k1; ++j) {
      if (!qr.sees(j)) {
        scores[j - u.k0] = kNegInf;
        continue;
      }
      const T* tile = key_tile(k_layer, u.slot, u.kvh, Hkv, C, D, j / kKeyTile) + j % kKeyTile;
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += qv[d] * widen(tile[d * kKeyTile]);
      scores[j - u.k0] = acc * scale;
      best = std::max(best, scores[j - u.k0]);
    }
    float* out = partial + qi * (D + 2);
    float total = 0.f;
    std::fill(out + 2, out + 2 + D, 0.f);
    if (best != kNegInf) {
      for (int64_t j = 0; j < width; ++j) {
        const float p = scores[j] == kNegInf ? 0.f : exp_scalar(scores[j] - best);
        total += p;
        if (p != 0.f) {
          const T* row = V + (u.k0 + j) * D;
          for (int64_t d = 0; d < D; ++d) out[2 + d] += p * widen(row[d]);
        }
      }
    }
    out[0] = best;
    out[1] = total;
  }
}

// Bit i set: key j0 + i is visible to the query (16 keys; the masks of both vector paths).
inline uint32_t visible_bits(const Query& qr, int64_t j0) {
  uint32_t dense = 0;
  const int64_t left = qr.visible - j0;
  if (left >= 16) {
    dense = 0xFFFFu;
  } else if (left > 0) {
    dense = (1u << left) - 1;
  }
  uint32_t tree = 0;
  if (qr.tree_bits) {
    const int64_t off = j0 - qr.tree_base;
    if (off >= 0 && off < 64) {
      tree = static_cast<uint32_t>((qr.tree_bits >> off) & 0xFFFFu);
    } else if (off < 0 && off > -16) {
      tree = static_cast<uint32_t>((qr.tree_bits << (-off)) & 0xFFFFu);
    }
  }
  return dense | tree;
}

#if SA_ATT_X86
SA_ATT512 inline __m512 exp512(__m512 x) {
  // below -87.34 the result underflows: 0 (so exp(-inf) = 0); above 88.38 it is clamped
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365478515625f), _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365478515625f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// 16-bit visibility mask of keys [j0, j0 + 16) for one query.
SA_ATT512 inline __mmask16 visible_mask(const Query& qr, int64_t j0) {
  return static_cast<__mmask16>(visible_bits(qr, j0));
}

SA_ATT512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SA_ATT512 inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Prefetch `bytes` bytes from p into the cache, a line at a time (keys / values of the unit's next tiles, so the
// memory latency of the cache overlaps the arithmetic of the current one).
constexpr int64_t kTilesAhead = 2;  // key tiles prefetched ahead of the one being scored
constexpr int64_t kRowsAhead = 8;   // value rows prefetched ahead (on the first pass over the rows only)
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// ---------------------------------------------------------------------- unit steps both vector paths share
// Isa (Avx512, Avx2) supplies score<G, T>, the scores of one 16-key tile for G <= 3 queries, and rows<G, P, T>,
// the probability-weighted sum of value rows over P vectors of kLanes dimensions for G <= 3 queries.

// Step 1: scores [Q, width] of the unit's queries over its key tiles [t0, t1), 3 queries at a time per tile,
// the tiles kTilesAhead ahead prefetched.
template <class Isa, typename T>
void score_unit(const Unit& u, const float* q, int64_t ldq, const T* k_layer, int64_t Hkv, int64_t C, int64_t D,
                int64_t t0, int64_t t1, float* scores) {
  const int64_t Q = static_cast<int64_t>(u.queries.size()), width = (t1 - t0) * kKeyTile;
  const int64_t tile_bytes = D * kKeyTile * static_cast<int64_t>(sizeof(T));
  for (int64_t t = t0; t < std::min(t1, t0 + kTilesAhead); ++t)
    prefetch_bytes(key_tile(k_layer, u.slot, u.kvh, Hkv, C, D, t), tile_bytes);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kTilesAhead < t1) prefetch_bytes(key_tile(k_layer, u.slot, u.kvh, Hkv, C, D, t + kTilesAhead), tile_bytes);
    const T* tile = key_tile(k_layer, u.slot, u.kvh, Hkv, C, D, t);
    for (int64_t q0 = 0; q0 < Q; q0 += 3) {
      const int count = static_cast<int>(std::min<int64_t>(3, Q - q0));
      const float* qs[3];
      float* outs[3];
      for (int g = 0; g < count; ++g) {
        qs[g] = q + u.queries[q0 + g].t * ldq + u.queries[q0 + g].h * D;
        outs[g] = scores + (q0 + g) * width + (t - t0) * kKeyTile;
      }
      switch (count) {
        case 1: Isa::template score<1, T>(tile, qs, D, outs); break;
        case 2: Isa::template score<2, T>(tile, qs, D, outs); break;
        default: Isa::template score<3, T>(tile, qs, D, outs);
      }
    }
  }
}

// o[g][0 .. D) = sum over `count` rows of p[g][i] * row i, G <= 3 queries, in passes of up to 4 vectors.
template <class Isa, int G, typename T>
void accumulate_all(const T* rows, int64_t count, int64_t D, const float* const* p, float* const* o) {
  constexpr int64_t kPass = 4 * Isa::kLanes;
  for (int64_t d0 = 0; d0 < D; d0 += kPass) {
    switch (std::min<int64_t>(kPass, D - d0) / Isa::kLanes) {
      case 1: Isa::template rows<G, 1, T>(rows, count, D, d0, p, o); break;
      case 2: Isa::template rows<G, 2, T>(rows, count, D, d0, p, o); break;
      case 3: Isa::template rows<G, 3, T>(rows, count, D, d0, p, o); break;
      default: Isa::template rows<G, 4, T>(rows, count, D, d0, p, o);
    }
  }
}

// Step 3: partial[qi] = [m, l, o] gets o = the unit's value rows weighted by its exp'd scores (step 2 wrote
// m, l and the weights), 3 queries at a time; a query that sees nothing here (m = -inf) gets o = 0.
template <class Isa, typename T>
void values_unit(const Unit& u, const T* V, int64_t D, int64_t t0, int64_t width, const float* scores,
                 float* partial) {
  const int64_t Q = static_cast<int64_t>(u.queries.size());
  const float* ps[3];
  float* os[3];
  int live = 0;
  auto flush = [&]() {
    switch (live) {
      case 0: break;
      case 1: accumulate_all<Isa, 1, T>(V + u.k0 * D, u.k1 - u.k0, D, ps, os); break;
      case 2: accumulate_all<Isa, 2, T>(V + u.k0 * D, u.k1 - u.k0, D, ps, os); break;
      default: accumulate_all<Isa, 3, T>(V + u.k0 * D, u.k1 - u.k0, D, ps, os);
    }
    live = 0;
  };
  for (int64_t qi = 0; qi < Q; ++qi) {
    float* out = partial + qi * (D + 2);
    if (out[0] == kNegInf) {
      std::fill(out + 2, out + 2 + D, 0.f);
      continue;
    }
    ps[live] = scores + qi * width + (u.k0 - t0 * kKeyTile);
    os[live] = out + 2;
    if (++live == 3) flush();
  }
  flush();
}

// scores of one 16-key tile (D rows of 16 keys, float32 or float16 read directly) for G <= 3 queries. Each query
// has 4 accumulation chains (d mod 4), added in a fixed order, so its scores do not depend on G.
template <int G, typename T>
SA_ATT512 void score_tile_avx512(const T* tile, const float* const* qv, int64_t D, float* const* out) {
  __m512 acc[G][4];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 4) {  // D is a multiple of 16 on this path
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512 k = load16(tile + (d + c) * kKeyTile);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(qv[g][d + c]), k, acc[g][c]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
    _mm512_storeu_ps(out[g], _mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][2]), _mm512_add_ps(acc[g][1], acc[g][3])));
}

// o[g][d0 .. d0 + 16P) = sum over `count` rows (in order) of p[g][i] * row i, G <= 3 queries; one chain per
// (query, 16 dims), so a query's sums do not depend on G. The first pass (d0 = 0) prefetches the rows ahead.
template <int G, int P, typename T>
SA_ATT512 void accumulate_rows_avx512(const T* rows, int64_t count, int64_t D, int64_t d0, const float* const* p,
                                      float* const* o) {
  __m512 acc[G][P];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int part = 0; part < P; ++part) acc[g][part] = _mm512_setzero_ps();
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < count; ++i) {
    const T* row = rows + i * D + d0;
    if (d0 == 0 && i + kRowsAhead < count) prefetch_bytes(rows + (i + kRowsAhead) * D, row_bytes);
    __m512 pv[G];
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) pv[g] = _mm512_set1_ps(p[g][i]);
#pragma GCC unroll 4
    for (int part = 0; part < P; ++part) {
      const __m512 v = load16(row + 16 * part);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) acc[g][part] = _mm512_fmadd_ps(pv[g], v, acc[g][part]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int part = 0; part < P; ++part) _mm512_storeu_ps(o[g] + d0 + 16 * part, acc[g][part]);
}

// The AVX-512 kernels for the shared unit drivers (score_unit, values_unit).
struct Avx512 {
  static constexpr int64_t kLanes = 16;
  template <int G, typename T>
  static void score(const T* tile, const float* const* qv, int64_t D, float* const* out) {
    score_tile_avx512<G, T>(tile, qv, D, out);
  }
  template <int G, int P, typename T>
  static void rows(const T* r, int64_t count, int64_t D, int64_t d0, const float* const* p, float* const* o) {
    accumulate_rows_avx512<G, P, T>(r, count, D, d0, p, o);
  }
};

// Needs D % 16 == 0. Keys and values are read where they lie (float16 converted on load), queries in groups of
// at most 3 (the query heads of one kv head at decode), the next tiles prefetched; values summed over the unit's
// rows in registers (64 dims per pass).
template <typename T>
SA_ATT512 void unit_avx512(const Unit& u, const float* q, int64_t ldq, const T* k_layer, const T* v_layer,
                           int64_t Hkv, int64_t C, int64_t D, float scale, float* partial, std::vector<float>& scores) {
  const int64_t Q = static_cast<int64_t>(u.queries.size());
  const int64_t t0 = u.k0 / kKeyTile, t1 = (u.k1 + kKeyTile - 1) / kKeyTile;
  const int64_t width = (t1 - t0) * kKeyTile;
  scores.resize(Q * width);
  score_unit<Avx512, T>(u, q, ldq, k_layer, Hkv, C, D, t0, t1, scores.data());  // 1. scores
  // 2. mask, max, exp, sum per query
  const __m512 vscale = _mm512_set1_ps(scale), neg = _mm512_set1_ps(kNegInf);
  for (int64_t qi = 0; qi < Q; ++qi) {
    const Query& qr = u.queries[qi];
    float* s = scores.data() + qi * width;
    __m512 best = neg;
    for (int64_t t = t0; t < t1; ++t) {
      __mmask16 m = visible_mask(qr, t * kKeyTile);
      const int64_t lo = u.k0 - t * kKeyTile, hi = u.k1 - t * kKeyTile;  // keys of this unit within the tile
      if (lo > 0) m &= static_cast<__mmask16>(0xFFFFu << lo);
      if (hi < 16) m &= static_cast<__mmask16>((1u << hi) - 1);
      const __m512 v = _mm512_mask_mul_ps(neg, m, _mm512_loadu_ps(s + (t - t0) * kKeyTile), vscale);
      _mm512_storeu_ps(s + (t - t0) * kKeyTile, v);
      best = _mm512_max_ps(best, v);
    }
    const float top = _mm512_reduce_max_ps(best);
    float* out = partial + qi * (D + 2);
    out[0] = top;
    if (top == kNegInf) {
      out[1] = 0.f;
      continue;
    }
    const __m512 vtop = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < width; i += 16) {
      const __m512 x = _mm512_loadu_ps(s + i);
      const __mmask16 live = _mm512_cmp_ps_mask(x, neg, _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, vtop)));
      _mm512_storeu_ps(s + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    out[1] = _mm512_reduce_add_ps(sum);
  }
  values_unit<Avx512, T>(u, v_layer + (u.slot * Hkv + u.kvh) * C * D, D, t0, width, scores.data(), partial);  // 3.
}


SA_ATT512 void exp_inplace_avx512(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp512(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, exp512(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

SA_ATT2 inline __m256 exp256(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365478515625f), _CMP_GE_OQ);  // else underflow: 0
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

SA_ATT2 void exp_inplace_avx2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp256(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}
// ------------------------------------------------------------------------------------------------------ AVX2
// The same three steps as unit_avx512 with 8-lane vectors: a key tile (16 keys) is two halves, the visibility
// mask two 8-lane blend masks. Per query the arithmetic is fixed (accumulators per query, keys and dims in a
// fixed order), so a query's result still does not depend on the other queries of its unit.
SA_ATT2 inline __m256 lane_mask8(uint32_t bits) {  // lane i all-ones where bit i of `bits` is set
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel), sel));
}

SA_ATT2 inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

SA_ATT2 inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

SA_ATT2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
SA_ATT2 inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}


// scores of one 16-key tile (D rows of 16 keys, float32 or float16 read directly) for G <= 3 queries. Each query
// has 4 accumulation chains (key half x parity of d), added in a fixed order, so its scores do not depend on G.
template <int G, typename T>
SA_ATT2 void score_tile_avx2(const T* tile, const float* const* qv, int64_t D, float* const* out) {
  __m256 acc[G][2][2];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g) acc[g][0][0] = acc[g][0][1] = acc[g][1][0] = acc[g][1][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {  // D is even (a multiple of 8 on this path)
#pragma GCC unroll 2
    for (int par = 0; par < 2; ++par) {
      const __m256 lo = load8(tile + (d + par) * kKeyTile), hi = load8(tile + (d + par) * kKeyTile + 8);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) {
        const __m256 qd = _mm256_set1_ps(qv[g][d + par]);
        acc[g][par][0] = _mm256_fmadd_ps(qd, lo, acc[g][par][0]);
        acc[g][par][1] = _mm256_fmadd_ps(qd, hi, acc[g][par][1]);
      }
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_ps(out[g], _mm256_add_ps(acc[g][0][0], acc[g][1][0]));
    _mm256_storeu_ps(out[g] + 8, _mm256_add_ps(acc[g][0][1], acc[g][1][1]));
  }
}

// o[g][d0 .. d0 + 8P) = sum over `count` rows (in order) of p[g][i] * row i, G <= 3 queries; one chain per
// (query, 8 dims), so a query's sums do not depend on G. The first pass (d0 = 0) prefetches the rows ahead.
template <int G, int P, typename T>
SA_ATT2 void accumulate_rows_avx2(const T* rows, int64_t count, int64_t D, int64_t d0, const float* const* p,
                                  float* const* o) {
  __m256 acc[G][P];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int part = 0; part < P; ++part) acc[g][part] = _mm256_setzero_ps();
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < count; ++i) {
    const T* row = rows + i * D + d0;
    if (d0 == 0 && i + kRowsAhead < count) prefetch_bytes(rows + (i + kRowsAhead) * D, row_bytes);
    __m256 pv[G];
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) pv[g] = _mm256_set1_ps(p[g][i]);
#pragma GCC unroll 4
    for (int part = 0; part < P; ++part) {
      const __m256 v = load8(row + 8 * part);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) acc[g][part] = _mm256_fmadd_ps(pv[g], v, acc[g][part]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int part = 0; part < P; ++part) _mm256_storeu_ps(o[g] + d0 + 8 * part, acc[g][part]);
}

// The AVX2 kernels for the shared unit drivers.
struct Avx2 {
  static constexpr int64_t kLanes = 8;
  template <int G, typename T>
  static void score(const T* tile, const float* const* qv, int64_t D, float* const* out) {
    score_tile_avx2<G, T>(tile, qv, D, out);
  }
  template <int G, int P, typename T>
  static void rows(const T* r, int64_t count, int64_t D, int64_t d0, const float* const* p, float* const* o) {
    accumulate_rows_avx2<G, P, T>(r, count, D, d0, p, o);
  }
};

// Needs D % 8 == 0. Keys and values are read where they lie (float16 converted on load), queries in groups of
// at most 3 (the query heads of one kv head at decode), the next tiles prefetched.
template <typename T>
SA_ATT2 void unit_avx2(const Unit& u, const float* q, int64_t ldq, const T* k_layer, const T* v_layer, int64_t Hkv,
                       int64_t C, int64_t D, float scale, float* partial, std::vector<float>& scores) {
  const int64_t Q = static_cast<int64_t>(u.queries.size());
  const int64_t t0 = u.k0 / kKeyTile, t1 = (u.k1 + kKeyTile - 1) / kKeyTile;
  const int64_t width = (t1 - t0) * kKeyTile;
  scores.resize(Q * width);
  score_unit<Avx2, T>(u, q, ldq, k_layer, Hkv, C, D, t0, t1, scores.data());  // 1. scores
  // 2. mask, max, exp, sum per query
  const __m256 vscale = _mm256_set1_ps(scale), neg = _mm256_set1_ps(kNegInf);
  for (int64_t qi = 0; qi < Q; ++qi) {
    const Query& qr = u.queries[qi];
    float* s = scores.data() + qi * width;
    __m256 best = neg;
    for (int64_t t = t0; t < t1; ++t) {
      uint32_t m = visible_bits(qr, t * kKeyTile);
      const int64_t lo = u.k0 - t * kKeyTile, hi = u.k1 - t * kKeyTile;  // keys of this unit within the tile
      if (lo > 0) m &= 0xFFFFu << lo;
      if (hi < 16) m &= (1u << hi) - 1;
      float* st = s + (t - t0) * kKeyTile;
      const __m256 a = _mm256_blendv_ps(neg, _mm256_mul_ps(_mm256_loadu_ps(st), vscale), lane_mask8(m & 0xFFu));
      const __m256 b = _mm256_blendv_ps(neg, _mm256_mul_ps(_mm256_loadu_ps(st + 8), vscale), lane_mask8(m >> 8));
      _mm256_storeu_ps(st, a);
      _mm256_storeu_ps(st + 8, b);
      best = _mm256_max_ps(best, _mm256_max_ps(a, b));
    }
    const float top = hmax8(best);
    float* out = partial + qi * (D + 2);
    out[0] = top;
    if (top == kNegInf) {
      out[1] = 0.f;
      continue;
    }
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < width; i += 8) {
      const __m256 x = _mm256_loadu_ps(s + i);
      const __m256 live = _mm256_cmp_ps(x, neg, _CMP_NEQ_OQ);
      const __m256 e = _mm256_and_ps(live, exp256(_mm256_sub_ps(x, vtop)));
      _mm256_storeu_ps(s + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    out[1] = hsum8(sum);
  }
  values_unit<Avx2, T>(u, v_layer + (u.slot * Hkv + u.kvh) * C * D, D, t0, width, scores.data(), partial);  // 3.
}

#endif  // SA_ATT_X86

}  // namespace

void exp_inplace(float* x, int64_t n) {
#if SA_ATT_X86
  const int isa = active_isa_value();
  if (isa == 2) return exp_inplace_avx512(x, n);
  if (isa == 1) return exp_inplace_avx2(x, n);
#endif
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

#if SA_ATT_X86
namespace {
__attribute__((target("avx2,f16c"))) void to_half8(const float* x, uint16_t* out) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm256_cvtps_ph(_mm256_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
}  // namespace
#endif

void write_kv(const float* key, const float* value, const AttentionMeta& meta, int64_t t, int64_t Hkv, int64_t C,
              int64_t D, void* k_layer, void* v_layer, bool half_cache) {
  const int64_t slot = meta.slot[t], idx = meta.index[t];
#if SA_ATT_X86
  const bool f16c = active_isa_value() >= 1;
#endif
  for (int64_t g = 0; g < Hkv; ++g) {
    const int64_t tile = ((slot * Hkv + g) * (C / kKeyTile) + idx / kKeyTile) * D * kKeyTile + idx % kKeyTile;
    const int64_t row = ((slot * Hkv + g) * C + idx) * D;
    if (half_cache) {
      uint16_t* kt = static_cast<uint16_t*>(k_layer) + tile;
      uint16_t* vr = static_cast<uint16_t*>(v_layer) + row;
      int64_t d = 0;
#if SA_ATT_X86
      if (f16c) {  // the same round-to-nearest-even as c10::Half, 8 at a time
        uint16_t kh[8];
        for (; d + 8 <= D; d += 8) {
          to_half8(key + g * D + d, kh);
          to_half8(value + g * D + d, vr + d);
          for (int j = 0; j < 8; ++j) kt[(d + j) * kKeyTile] = kh[j];
        }
      }
#endif
      for (; d < D; ++d) {
        kt[d * kKeyTile] = c10::Half(key[g * D + d]).x;
        vr[d] = c10::Half(value[g * D + d]).x;
      }
    } else {
      float* kt = static_cast<float*>(k_layer) + tile;
      for (int64_t d = 0; d < D; ++d) kt[d * kKeyTile] = key[g * D + d];
      std::memcpy(static_cast<float*>(v_layer) + row, value + g * D, sizeof(float) * D);
    }
  }
}

namespace {
// Longest-processing-time-first assignment of units to `threads` buckets (cost: queries x keys + a fixed 64).
std::vector<std::vector<int64_t>> balance_units(const std::vector<Unit>& units, int threads) {
  const int64_t n = static_cast<int64_t>(units.size());
  const int64_t count = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  std::vector<std::vector<int64_t>> buckets(count);
  if (count == 1) {
    for (int64_t i = 0; i < n; ++i) buckets[0].push_back(i);
    return buckets;
  }
  std::vector<int64_t> order(n), cost(n);
  for (int64_t i = 0; i < n; ++i) {
    order[i] = i;
    cost[i] = static_cast<int64_t>(units[i].queries.size()) * (units[i].k1 - units[i].k0) + 64;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::vector<int64_t> load(count, 0);
  for (int64_t i : order) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    buckets[b].push_back(i);
    load[b] += cost[i];
  }
  return buckets;
}
}  // namespace

void attention(const float* q, int64_t ldq, const void* k_layer, const void* v_layer, const AttentionMeta& meta,
               int64_t N, int64_t H, int64_t Hkv, int64_t C, int64_t D, float scale, float* out, bool half_cache) {
  const int64_t group = H / Hkv;
  const int isa = active_isa_value();
  const bool wide = SA_ATT_X86 && isa == 2 && D % 16 == 0;
  const bool wide2 = SA_ATT_X86 && isa == 1 && D % 8 == 0;
  // units: (slot, kv head, split) with the queries of the slot's tokens that see keys in the split
  std::vector<int64_t> slots;
  for (int64_t t = 0; t < N; ++t)
    if (std::find(slots.begin(), slots.end(), meta.slot[t]) == slots.end()) slots.push_back(meta.slot[t]);
  std::vector<Unit> units;
  for (int64_t slot : slots) {
    std::vector<Query> base;
    int64_t end = 0;
    for (int64_t t = 0; t < N; ++t) {
      if (meta.slot[t] != slot) continue;
      Query qr{t, 0, meta.visible[t], meta.tree_base[t], static_cast<uint64_t>(meta.tree_mask[t])};
      end = std::max(end, qr.end());
      base.push_back(qr);
    }
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      for (int64_t k0 = 0; k0 < end; k0 += kSplit) {
        Unit u{slot, kvh, k0, std::min(end, k0 + kSplit), {}};
        for (const Query& b : base) {
          if (b.end() <= k0 || (b.visible <= k0 && b.tree_bits == 0)) continue;
          for (int64_t g = 0; g < group; ++g) {
            Query qr = b;
            qr.h = kvh * group + g;
            u.queries.push_back(qr);
          }
        }
        if (!u.queries.empty()) units.push_back(std::move(u));
      }
    }
  }
  std::vector<int64_t> offset(units.size() + 1, 0);  // partial results [m, l, o...] per (unit, query)
  for (size_t i = 0; i < units.size(); ++i) offset[i + 1] = offset[i] + static_cast<int64_t>(units[i].queries.size());
  std::vector<float> partial(offset.back() * (D + 2));
  // Units differ in size (a request's last split holds its few newest keys), so contiguous chunks of the unit list
  // can leave one thread twice the work of another (at 512 cached positions and 6 new tokens: 9 units, 4 whole
  // splits on one thread and 2 on the other). Each thread gets a bucket filled by longest-processing-time-first
  // (units by cost, queries x keys, each to the least-loaded bucket). Which thread computes a unit never
  // changes its result.
  const std::vector<std::vector<int64_t>> buckets = balance_units(units, at::get_num_threads());
  // one unit's partial results [m, l, o] (each unit writes only its own slice of `partial`), by the kernel of
  // the active ISA over the cache's stored type (float16 bits or float32)
  auto run_unit = [&](int64_t i, std::vector<float>& scores) {
    float* part = partial.data() + offset[i] * (D + 2);
    const Unit& u = units[i];
    auto run = [&](const auto* k, const auto* v) {
#if SA_ATT_X86
      if (wide) return unit_avx512(u, q, ldq, k, v, Hkv, C, D, scale, part, scores);
      if (wide2) return unit_avx2(u, q, ldq, k, v, Hkv, C, D, scale, part, scores);
#endif
      unit_generic(u, q, ldq, k, v, Hkv, C, D, scale, part, scores);
    };
    if (half_cache) {
      run(static_cast<const uint16_t*>(k_layer), static_cast<const uint16_t*>(v_layer));
    } else {
      run(static_cast<const float*>(k_layer), static_cast<const float*>(v_layer));
    }
  };
  at::parallel_for(0, static_cast<int64_t>(buckets.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i : buckets[b]) run_unit(i, scores);
    }
  });
  // merge each query's splits, in split order
  std::vector<float> m(N * H, kNegInf), l(N * H, 0.f);
  std::fill(out, out + N * H * D, 0.f);
  for (size_t i = 0; i < units.size(); ++i) {
    for (size_t qi = 0; qi < units[i].queries.size(); ++qi) {
      const Query& qr = units[i].queries[qi];
      const float* part = partial.data() + (offset[i] + static_cast<int64_t>(qi)) * (D + 2);
      if (part[0] == kNegInf) continue;
      const int64_t key = qr.t * H + qr.h;
      float* o = out + key * D;
      if (m[key] == kNegInf) {
        m[key] = part[0];
        l[key] = part[1];
        std::memcpy(o, part + 2, sizeof(float) * D);
        continue;
      }
      const float top = std::max(m[key], part[0]);
      const float a = std::exp(m[key] - top), b = std::exp(part[0] - top);
      for (int64_t d = 0; d < D; ++d) o[d] = a * o[d] + b * part[2 + d];
      l[key] = a * l[key] + b * part[1];
      m[key] = top;
    }
  }
  for (int64_t key = 0; key < N * H; ++key) {
    const float inv = l[key] > 0.f ? 1.f / l[key] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[key * D + d] *= inv;
  }
  (void)wide;
  (void)wide2;
}

}  // namespace native
}  // namespace cpu
}  // namespace specadapt
