// Integer dot products for the block-quantised weights of the native forward (Q8_0, Q4_1 in the 16-row
// interleaved layout of native_linear.h) against activations quantised to 8 bits per block of 32:
//
//   a[m, k] = round(x[m, k] / e[m, b]),  e[m, b] = max_k |x[m, k]| / 127 over block b (0 for an all-zero block)
//   y[m, n] = sum_b e[m, b] * (d[n, b] * sum_k q[n, k] a[m, k] + m_w[n, b] * sum_k a[m, k])
//
// A 32-bit lane of a weight vector holds 4 consecutive codes of one of 16 rows, so one multiply-accumulate of 4
// broadcast activation codes updates 16 outputs at once: the integer sums never need a horizontal reduction and
// a weight vector loaded once serves up to 4 activation rows. Integer sums are exact; the only rounding that
// differs from the float32 model is the 8-bit activation rounding. Each (row m, group of 16 outputs) runs the
// same instructions whatever M is, so results do not depend on the other rows of a call. Paths: AVX-512 VNNI
// (vpdpbusd; Q8_0 codes offset by 128, the offset folded into an m_w term of -128 d), AVX2 (vpmaddubsw;
// Q8_0's sign moved onto the activations), portable C++; the ISA follows native_set_isa.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "native_linear.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define SA_QX86 1
#define SA_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define SA_QAVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define SA_QX86 0
#endif

namespace specadapt {
namespace cpu {
namespace native {

int active_isa_value();  // native_linear.cpp: 0 scalar, 1 AVX2, 2 AVX-512

namespace {

inline float h2f(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Activations of one call quantised per block: codes [M, K] int8, scales e [M, nb], e * sum(codes) [M, nb].
// half_sum [M, 2 nb]: the integer sums of each 16 codes (Q6_K's sub-blocks; filled only when a part needs them).
struct QuantizedActivations {
  int64_t M = 0, K = 0, nb = 0;
  std::vector<int8_t> codes;
  std::vector<float> scale, scaled_sum;
  std::vector<int32_t> half_sum;
};

void fill_half_sums(QuantizedActivations& q) {
  q.half_sum.resize(q.M * 2 * q.nb);
  for (int64_t m = 0; m < q.M; ++m) {
    const int8_t* c = q.codes.data() + m * q.K;
    for (int64_t h = 0; h < 2 * q.nb; ++h) {
      int32_t s = 0;
      for (int j = 0; j < 16; ++j) s += c[16 * h + j];
      q.half_sum[m * 2 * q.nb + h] = s;
    }
  }
}

void quantize_block(const float* x, int8_t* out, float* scale, float* scaled_sum) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float e = amax / 127.f;
  const float inv = amax > 0.f ? 1.f / e : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const float v = std::nearbyint(x[j] * inv);
    const int32_t c = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
    out[j] = static_cast<int8_t>(c);
    sum += c;
  }
  *scale = e;
  *scaled_sum = e * static_cast<float>(sum);
}

#if SA_QX86
SA_VNNI void quantize_block_avx512(const float* x, int8_t* out, float* scale, float* scaled_sum) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float e = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 1.f / e : 0.f);
  const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
  const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(x0, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(x1, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i c0 = _mm512_cvtps_epi32(_mm512_min_ps(lim, _mm512_max_ps(nlim, r0)));
  const __m512i c1 = _mm512_cvtps_epi32(_mm512_min_ps(lim, _mm512_max_ps(nlim, r1)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(c1));
  *scale = e;
  *scaled_sum = e * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1)));
}

SA_QAVX2 void quantize_block_avx2(const float* x, int8_t* out, float* scale, float* scaled_sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float top = _mm_cvtss_f32(h);
  const float e = top / 127.f;
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 1.f / e : 0.f);
  const __m256 lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
  __m256i c[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c[i] = _mm256_cvtps_epi32(_mm256_min_ps(lim, _mm256_max_ps(nlim, r)));
    sum = _mm256_add_epi32(sum, c[i]);
  }
  // int32 -> int8 in element order: packs work per 128-bit lane, so permute back afterwards
  const __m256i s16a = _mm256_packs_epi32(c[0], c[1]), s16b = _mm256_packs_epi32(c[2], c[3]);
  const __m256i s8 = _mm256_packs_epi16(s16a, s16b);
  const __m256i ordered = _mm256_permutevar8x32_epi32(s8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), ordered);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  *scale = e;
  *scaled_sum = e * static_cast<float>(_mm_cvtsi128_si32(s));
}
#endif

void quantize_activations(const float* x, int64_t M, int64_t ldx, int64_t K, int isa, QuantizedActivations& q) {
  q.M = M;
  q.K = K;
  q.nb = K / kBlock;
  q.codes.resize(M * K);
  q.scale.resize(M * q.nb);
  q.scaled_sum.resize(M * q.nb);
  const auto work = [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < q.nb; ++b) {
        const float* src = x + m * ldx + b * kBlock;
        int8_t* dst = q.codes.data() + m * K + b * kBlock;
        float* e = q.scale.data() + m * q.nb + b;
        float* s = q.scaled_sum.data() + m * q.nb + b;
#if SA_QX86
        if (isa == 2) {
          quantize_block_avx512(src, dst, e, s);
          continue;
        }
        if (isa == 1) {
          quantize_block_avx2(src, dst, e, s);
          continue;
        }
#endif
        quantize_block(src, dst, e, s);
      }
    }
  };
  if (M * K >= 32768) {
    at::parallel_for(0, M, 1, work);
  } else {
    work(0, M);
  }
}

// Code of (row r of the group, element k of block b) in the interleaved layout.
inline int32_t code_x16(const WeightView& w, int64_t group, int64_t b, int64_t r, int64_t k) {
  const int64_t nb = w.cols / kBlock;
  if (w.format == kQ8_0) {
    const int8_t* blk = static_cast<const int8_t*>(w.data) + (group * nb + b) * 512;
    return blk[(k / 4) * 64 + r * 4 + k % 4];
  }
  const uint8_t* blk = static_cast<const uint8_t*>(w.data) + (group * nb + b) * block_data_bytes(w.format);
  const int64_t c = k / 4, j = k % 4;
  const uint8_t byte = blk[(c % 4) * 64 + r * 4 + j];
  const int32_t low = c < 4 ? (byte & 15) : (byte >> 4);
  if (w.format != kQ6_K) return low;
  const uint8_t high = blk[256 + (c / 4) * 64 + r * 4 + j];
  return low | (((high >> (2 * (c % 4))) & 3) << 4);
}

// The float32 factors of block b, row r of a K-quant group: w = scale * q + offset for Q4_K (offset -dmin * m)
// and, for Q6_K, scale of the block's first / second 16 values (offset unused: the code's -32 is exact).
inline float kq_super(const WeightView& w, int64_t group, int64_t b, int64_t r, int which) {
  const int64_t nsb = w.cols / kSuperBlock;
  const int64_t per = w.format == kQ4_K ? 32 : 16;
  return h2f(w.scales[group * nsb * per + (b / 8) * per + 16 * which + r]);
}
inline float kq_sub(const WeightView& w, int64_t group, int64_t b, int64_t r, int which) {
  const int64_t nb = w.cols / kBlock;
  const uint8_t raw = w.sub[group * nb * 32 + b * 32 + 16 * which + r];
  return w.format == kQ4_K ? static_cast<float>(raw) : static_cast<float>(static_cast<int8_t>(raw));
}

void qdot_group_kquant_scalar(const WeightView& w, int64_t group, const QuantizedActivations& xa, float* y,
                              int64_t ldy, int64_t rows_here) {
  const int64_t nb = w.cols / kBlock;
  for (int64_t m = 0; m < xa.M; ++m) {
    const int8_t* a = xa.codes.data() + m * xa.K;
    for (int64_t r = 0; r < rows_here; ++r) {
      float acc = 0.f, macc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const float e = xa.scale[m * nb + b];
        if (w.format == kQ4_K) {
          int32_t isum = 0;
          for (int64_t k = 0; k < kBlock; ++k) isum += code_x16(w, group, b, r, k) * a[b * kBlock + k];
          const float d = kq_super(w, group, b, r, 0) * kq_sub(w, group, b, r, 0);
          const float mw = -(kq_super(w, group, b, r, 1) * kq_sub(w, group, b, r, 1));
          acc = std::fma(static_cast<float>(isum), d * e, acc);
          macc = std::fma(mw, xa.scaled_sum[m * nb + b], macc);
        } else {
          for (int h = 0; h < 2; ++h) {
            int32_t isum = 0;
            for (int64_t k = 16 * h; k < 16 * h + 16; ++k) isum += code_x16(w, group, b, r, k) * a[b * kBlock + k];
            isum -= 32 * xa.half_sum[m * 2 * nb + 2 * b + h];
            const float d = kq_super(w, group, b, r, 0) * kq_sub(w, group, b, r, h);
            acc = std::fma(static_cast<float>(isum), d * e, acc);
          }
        }
      }
      y[m * ldy + r] = acc + macc;
    }
  }
}

void qdot_group_scalar(const WeightView& w, int64_t group, const QuantizedActivations& xa, float* y, int64_t ldy,
                       int64_t rows_here) {
  if (is_k_format(w.format)) return qdot_group_kquant_scalar(w, group, xa, y, ldy, rows_here);
  const int64_t nb = w.cols / kBlock;
  const uint16_t* sc = w.scales + group * nb * 16;
  const uint16_t* mn = w.format == kQ4_1 ? w.mins + group * nb * 16 : nullptr;
  for (int64_t m = 0; m < xa.M; ++m) {
    const int8_t* a = xa.codes.data() + m * xa.K;
    for (int64_t r = 0; r < rows_here; ++r) {
      float acc = 0.f, macc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int64_t k = 0; k < kBlock; ++k) isum += code_x16(w, group, b, r, k) * a[b * kBlock + k];
        acc = std::fma(static_cast<float>(isum), h2f(sc[b * 16 + r]) * xa.scale[m * nb + b], acc);
        if (mn) macc = std::fma(h2f(mn[b * 16 + r]), xa.scaled_sum[m * nb + b], macc);
      }
      y[m * ldy + r] = acc + macc;
    }
  }
}

// Activation rows [0, M) in tiles of kMax rows, then one tile of the remainder: tile(std::integral_constant<int,
// R>, first row) with R fixed at compile time, so each tile size is its own register-resident instantiation.
template <int R, typename Tile>
inline void remainder_tile(int64_t rest, int64_t m, Tile& tile) {
  if constexpr (R > 0) {
    if (rest == R) {
      tile(std::integral_constant<int, R>{}, m);
    } else {
      remainder_tile<R - 1>(rest, m, tile);
    }
  }
}

template <int kMax, typename Tile>
inline void for_row_tiles(int64_t M, Tile&& tile) {
  int64_t m = 0;
  for (; m + kMax <= M; m += kMax) tile(std::integral_constant<int, kMax>{}, m);
  remainder_tile<kMax - 1>(M - m, m, tile);
}

#if SA_QX86
// Software prefetch of a block's weights kBlocksAhead blocks ahead of block b (Q4_1: 256 bytes a block, 4 KB
// ahead; Q8_0: 512 bytes, 8 KB), with their scales and minimums (a line holds two blocks' 16 scales). A thread's
// groups are consecutive in memory, so this runs ahead across group boundaries too. Without it the kernels
// waited on their weight loads (perf: most samples on the instruction after each load) and read ~8 GB/s per core
// on an AMX Xeon; prefetching 1-16 KB ahead cut the Q4_1 layers' time by about a quarter (plateau from 2 KB).
constexpr int64_t kBlocksAhead = 16;
// prefetcht0 as an asm statement: GCC 12 dropped the _mm_prefetch calls of this file (none were in the object).
inline void prefetch_line(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
template <int kBlockBytes>
inline void prefetch_block_ahead(const void* blk, const uint16_t* sc, const uint16_t* mn, int64_t b) {
  const char* ahead = static_cast<const char*>(blk) + kBlockBytes * kBlocksAhead;
#pragma GCC unroll 8
  for (int line = 0; line < kBlockBytes / 64; ++line) prefetch_line(ahead + 64 * line);
  if ((b & 1) == 0) {
    prefetch_line(sc + 16 * (b + kBlocksAhead));
    if (mn != nullptr) prefetch_line(mn + 16 * (b + kBlocksAhead));
  }
}

// ------------------------------------------------------------------------------------------- AVX-512 VNNI
// Kind: kQ8_0, kQ4_1 or kQ4_K (Q4_K: the codes of Q4_1, each block's scale d * sc and minimum -dmin * m formed
// in float32 from the super-block's d, dmin and the block's 6-bit sc, m: exact, as ggml de-quantises).
template <int R, int64_t Kind>
SA_VNNI void qdot_tile_vnni(const WeightView& w, int64_t group, const QuantizedActivations& xa, int64_t m0, float* y,
                            int64_t ldy, __mmask16 out_mask) {
  constexpr bool Q4 = Kind != kQ8_0;
  constexpr bool KQ = Kind == kQ4_K;
  const int64_t nb = w.cols / kBlock, K = xa.K;
  const uint16_t* sc = KQ ? w.scales + group * (nb / 8) * 32 : w.scales + group * nb * 16;
  const uint16_t* mn = Kind == kQ4_1 ? w.mins + group * nb * 16 : nullptr;
  const uint8_t* sub = KQ ? w.sub + group * nb * 32 : nullptr;
  // the prefetch of a block's 16 scales (32 bytes) reads the same offsets in Q4_K's 32 sub-block bytes
  const uint16_t* sc_ahead = KQ ? reinterpret_cast<const uint16_t*>(sub) : sc;
  __m512 dsup = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  const int8_t* a[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) a[r] = xa.codes.data() + (m0 + r) * K;
  __m512 acc[R], macc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wv[8];
    if (Q4) {
      const uint8_t* blk = static_cast<const uint8_t*>(w.data) + (group * nb + b) * 256;
      prefetch_block_ahead<256>(blk, sc_ahead, mn, b);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512i z = _mm512_loadu_si512(blk + 64 * i);
        wv[i] = _mm512_and_si512(z, low4);
        wv[i + 4] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
      }
    } else {
      const int8_t* blk = static_cast<const int8_t*>(w.data) + (group * nb + b) * 512;
      prefetch_block_ahead<512>(blk, sc, nullptr, b);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) wv[c] = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * c), flip);
    }
    __m512 d, mw;
    if constexpr (KQ) {
      if ((b & 7) == 0) {
        dsup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + (b >> 3) * 32)));
        dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + (b >> 3) * 32 + 16)));
      }
      const __m128i sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + b * 32));
      const __m128i mb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + b * 32 + 16));
      d = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sb)));
      mw = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mb))));
    } else {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b * 16)));
      mw = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + b * 16)))
              : _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* ab = a[r] + b * kBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 8; c += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wv[c], _mm512_set1_epi32(load_i32(ab + 4 * c)));
        s1 = _mm512_dpbusd_epi32(s1, wv[c + 1], _mm512_set1_epi32(load_i32(ab + 4 * c + 4)));
      }
      const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      const int64_t m = m0 + r;
      acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(xa.scale[m * nb + b])), acc[r]);
      macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xa.scaled_sum[m * nb + b]), macc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, out_mask, _mm512_add_ps(acc[r], macc[r]));
}

// Activation rows in tiles of up to 8 (a weight vector unpacked once serves the whole tile; 2 accumulators per
// row + 8 weight vectors fit the 32 registers).
template <int64_t Kind>
SA_VNNI void qdot_rows_vnni(const WeightView& w, int64_t group, const QuantizedActivations& xa, float* y, int64_t ldy,
                            __mmask16 mask) {
  for_row_tiles<8>(xa.M, [&](auto rows, int64_t m) {
    qdot_tile_vnni<decltype(rows)::value, Kind>(w, group, xa, m, y + m * ldy, ldy, mask);
  });
}

// Q6_K's 6-bit codes of chunk I (I = 0..3, low nibbles) / I + 4 (high nibbles) of a 64-byte vector: the 2 high bits
// come from bits 2I..2I+1 of the matching high-bit plane, moved to bits 4..5.
template <int I>
SA_VNNI inline __m512i q6_high_vnni(__m512i h) {
  const __m512i top2 = _mm512_set1_epi8(0x30);
  if constexpr (I == 0) return _mm512_and_si512(_mm512_slli_epi16(h, 4), top2);
  if constexpr (I == 1) return _mm512_and_si512(_mm512_slli_epi16(h, 2), top2);
  if constexpr (I == 2) return _mm512_and_si512(h, top2);
  return _mm512_and_si512(_mm512_srli_epi16(h, 2), top2);
}

template <int I>
SA_VNNI inline void q6_unpack_vnni(const uint8_t* blk, __m512i h0, __m512i h1, __m512i* wv) {
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i z = _mm512_loadu_si512(blk + 64 * I);
  wv[I] = _mm512_or_si512(_mm512_and_si512(z, low4), q6_high_vnni<I>(h0));
  wv[I + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(z, 4), low4), q6_high_vnni<I>(h1));
}

// Q6_K: unsigned codes q in [0, 63] against the activation codes with vpdpbusd, one integer sum per 16 values
// (each has its own scale), the codes' offset of 32 taken off exactly in int32 (32 * the 16 activations' sum).
template <int R>
SA_VNNI void q6k_tile_vnni(const WeightView& w, int64_t group, const QuantizedActivations& xa, int64_t m0, float* y,
                           int64_t ldy, __mmask16 out_mask) {
  const int64_t nb = w.cols / kBlock, K = xa.K;
  const uint16_t* sd = w.scales + group * (nb / 8) * 16;
  const int8_t* sub = reinterpret_cast<const int8_t*>(w.sub) + group * nb * 32;
  const int8_t* a[R];
  const int32_t* hs[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    a[r] = xa.codes.data() + (m0 + r) * K;
    hs[r] = xa.half_sum.data() + (m0 + r) * 2 * nb;
  }
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 dsup = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = static_cast<const uint8_t*>(w.data) + (group * nb + b) * 384;
    prefetch_block_ahead<384>(blk, reinterpret_cast<const uint16_t*>(sub), nullptr, b);
    if ((b & 7) == 0) dsup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sd + (b >> 3) * 16)));
    const __m512i h0 = _mm512_loadu_si512(blk + 256), h1 = _mm512_loadu_si512(blk + 320);
    __m512i wv[8];
    q6_unpack_vnni<0>(blk, h0, h1, wv);
    q6_unpack_vnni<1>(blk, h0, h1, wv);
    q6_unpack_vnni<2>(blk, h0, h1, wv);
    q6_unpack_vnni<3>(blk, h0, h1, wv);
    const __m512 d0 = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + b * 32)))));
    const __m512 d1 = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + b * 32 + 16)))));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* ab = a[r] + b * kBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        s0 = _mm512_dpbusd_epi32(s0, wv[c], _mm512_set1_epi32(load_i32(ab + 4 * c)));
        s1 = _mm512_dpbusd_epi32(s1, wv[c + 4], _mm512_set1_epi32(load_i32(ab + 16 + 4 * c)));
      }
      s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * hs[r][2 * b]));
      s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * hs[r][2 * b + 1]));
      const __m512 ev = _mm512_set1_ps(xa.scale[(m0 + r) * nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, ev), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, ev), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, out_mask, acc[r]);
}

SA_VNNI void qdot_group_vnni(const WeightView& w, int64_t group, const QuantizedActivations& xa, float* y,
                             int64_t ldy, int64_t rows_here) {
  const __mmask16 mask = rows_here >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows_here) - 1);
  switch (w.format) {
    case kQ4_1:
      return qdot_rows_vnni<kQ4_1>(w, group, xa, y, ldy, mask);
    case kQ4_K:
      return qdot_rows_vnni<kQ4_K>(w, group, xa, y, ldy, mask);
    case kQ6_K:
      return for_row_tiles<8>(xa.M, [&](auto rows, int64_t m) {
        q6k_tile_vnni<decltype(rows)::value>(w, group, xa, m, y + m * ldy, ldy, mask);
      });
    default:
      return qdot_rows_vnni<kQ8_0>(w, group, xa, y, ldy, mask);
  }
}

// ---------------------------------------------------------------------------------------------------- AVX2
// The 16 rows of a group as two halves of 8 (lanes of 4 codes each). A half runs over all blocks with up to 4
// activation rows at once: each weight vector is loaded, unpacked and used by every row of the tile before the
// next (so only the rows' sums, accumulators and one or two weight vectors are live, no spills). Q4_1: a
// product pair of vpmaddubsw is at most 2 * 15 * 127 = 3810, so the 8 products of a block add exactly in int16
// (<= 30480, in any order) before one vpmaddwd widens them; Q8_0 pairs reach 2 * 127 * 127 and widen after
// every product. The minimum term runs as its own loop after the codes (the same
// float operations in the same order as one loop would do). Per row, the instructions do not depend on R.
// An empty asm that makes `v` live in a register here: keeps GCC from hoisting every product of a block ahead of
// the sums (which spills them to the stack).
SA_QAVX2 inline void pin(__m256i& v) { asm volatile("" : "+x"(v)); }

// Kind: kQ8_0, kQ4_1 or kQ4_K (block scales and minimums of Q4_K formed as in the AVX-512 path).
template <int R, int64_t Kind>
SA_QAVX2 void qdot_tile_avx2(const WeightView& w, int64_t group, const QuantizedActivations& xa, int64_t m0, float* y,
                             int64_t ldy, int64_t rows_here) {
  constexpr bool Q4 = Kind != kQ8_0;
  constexpr bool KQ = Kind == kQ4_K;
  const int64_t nb = w.cols / kBlock, K = xa.K;
  const uint16_t* sc = KQ ? w.scales + group * (nb / 8) * 32 : w.scales + group * nb * 16;
  const uint16_t* mn = Kind == kQ4_1 ? w.mins + group * nb * 16 : nullptr;
  const uint8_t* sub = KQ ? w.sub + group * nb * 32 : nullptr;
  const uint16_t* sc_ahead = KQ ? reinterpret_cast<const uint16_t*>(sub) : sc;
  const int8_t* a[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) a[r] = xa.codes.data() + (m0 + r) * K;
  const float* e[R];
  const float* es[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    e[r] = xa.scale.data() + (m0 + r) * nb;
    es[r] = xa.scaled_sum.data() + (m0 + r) * nb;
  }
  float out[R][16];
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 d;
      if constexpr (KQ) {
        const __m256 dsup = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (b >> 3) * 32 + 8 * half)));
        const __m128i sb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + b * 32 + 8 * half));
        d = _mm256_mul_ps(dsup, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sb)));
      } else {
        d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * 16 + 8 * half)));
      }
      const __m256i ones = _mm256_set1_epi16(1);
      __m256i s[R];  // Q4_1: int16 sums of the block's 8 products; Q8_0: int32 sums
      if (Q4) {
        // one 32-byte load holds chunk i (low nibbles) and chunk i + 4 (high nibbles) of the half's 8 rows;
        // it is unpacked and used by every row of the tile before the next load
        const __m256i low4 = _mm256_set1_epi8(15);
        const uint8_t* blk = static_cast<const uint8_t*>(w.data) + (group * nb + b) * 256 + 32 * half;
        if (half == 0) prefetch_block_ahead<256>(blk, sc_ahead, mn, b);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * i));
          const __m256i lo = _mm256_and_si256(z, low4), hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), low4);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const int8_t* ab = a[r] + b * kBlock;
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(ab + 4 * i))),
                                                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(ab + 4 * i + 16))));
            s[r] = i == 0 ? pair : _mm256_add_epi16(s[r], pair);
          }
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) pin(s[r]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) s[r] = _mm256_madd_epi16(s[r], ones);
      } else {
        const int8_t* blk = static_cast<const int8_t*>(w.data) + (group * nb + b) * 512 + 32 * half;
        if (half == 0) prefetch_block_ahead<512>(blk, sc, nullptr, b);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          const __m256i wc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c));
          const __m256i mag = _mm256_sign_epi8(wc, wc);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256i av = _mm256_set1_epi32(load_i32(a[r] + b * kBlock + 4 * c));
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(av, wc)), ones));
          }
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) pin(s[r]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d, _mm256_set1_ps(e[r][b])), acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 macc = _mm256_setzero_ps();
      if constexpr (KQ) {
        for (int64_t b = 0; b < nb; ++b) {
          const __m256 dmin = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (b >> 3) * 32 + 16 + 8 * half)));
          const __m128i mb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + b * 32 + 16 + 8 * half));
          const __m256 mw = _mm256_sub_ps(_mm256_setzero_ps(),
                                          _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mb))));
          macc = _mm256_fmadd_ps(mw, _mm256_set1_ps(es[r][b]), macc);
        }
      } else if (Q4) {
        for (int64_t b = 0; b < nb; ++b) {
          const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b * 16 + 8 * half)));
          macc = _mm256_fmadd_ps(mw, _mm256_set1_ps(es[r][b]), macc);
        }
      }
      _mm256_storeu_ps(out[r] + 8 * half, _mm256_add_ps(acc[r], macc));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, out[r], sizeof(float) * rows_here);
}

template <int64_t Kind>
SA_QAVX2 void qdot_rows_avx2(const WeightView& w, int64_t group, const QuantizedActivations& xa, float* y, int64_t ldy,
                             int64_t rows_here) {
  for_row_tiles<4>(xa.M, [&](auto rows, int64_t m) {
    qdot_tile_avx2<decltype(rows)::value, Kind>(w, group, xa, m, y + m * ldy, ldy, rows_here);
  });
}

template <int I>
SA_QAVX2 inline __m256i q6_high_avx2(__m256i h) {
  const __m256i top2 = _mm256_set1_epi8(0x30);
  if constexpr (I == 0) return _mm256_and_si256(_mm256_slli_epi16(h, 4), top2);
  if constexpr (I == 1) return _mm256_and_si256(_mm256_slli_epi16(h, 2), top2);
  if constexpr (I == 2) return _mm256_and_si256(h, top2);
  return _mm256_and_si256(_mm256_srli_epi16(h, 2), top2);
}

// Chunk I and I + 4 of a Q6_K half-group against R activation rows: int32 sums of the block's first 16 values
// (s0) and last 16 (s1); a vpmaddubsw pair is at most 2 * 63 * 127 = 16002 and widens at once.
template <int I, int R>
SA_QAVX2 inline void q6_chunk_avx2(const uint8_t* blk, __m256i h0, __m256i h1, const int8_t* const* a, int64_t b,
                                   __m256i* s0, __m256i* s1) {
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * I));
  const __m256i lo = _mm256_or_si256(_mm256_and_si256(z, low4), q6_high_avx2<I>(h0));
  const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z, 4), low4), q6_high_avx2<I>(h1));
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const int8_t* ab = a[r] + b * kBlock;
    s0[r] = _mm256_add_epi32(s0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(ab + 4 * I))), ones));
    s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(ab + 16 + 4 * I))), ones));
  }
}

template <int R>
SA_QAVX2 void q6k_tile_avx2(const WeightView& w, int64_t group, const QuantizedActivations& xa, int64_t m0, float* y,
                            int64_t ldy, int64_t rows_here) {
  const int64_t nb = w.cols / kBlock, K = xa.K;
  const uint16_t* sd = w.scales + group * (nb / 8) * 16;
  const int8_t* sub = reinterpret_cast<const int8_t*>(w.sub) + group * nb * 32;
  const int8_t* a[R];
  const int32_t* hs[R];
  const float* e[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    a[r] = xa.codes.data() + (m0 + r) * K;
    hs[r] = xa.half_sum.data() + (m0 + r) * 2 * nb;
    e[r] = xa.scale.data() + (m0 + r) * nb;
  }
  float out[R][16];
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = static_cast<const uint8_t*>(w.data) + (group * nb + b) * 384 + 32 * half;
      if (half == 0) prefetch_block_ahead<384>(blk, reinterpret_cast<const uint16_t*>(sub), nullptr, b);
      const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256));
      const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 320));
      __m256i s0[R], s1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
      q6_chunk_avx2<0, R>(blk, h0, h1, a, b, s0, s1);
      q6_chunk_avx2<1, R>(blk, h0, h1, a, b, s0, s1);
      q6_chunk_avx2<2, R>(blk, h0, h1, a, b, s0, s1);
      q6_chunk_avx2<3, R>(blk, h0, h1, a, b, s0, s1);
      const __m256 dsup = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sd + (b >> 3) * 16 + 8 * half)));
      const __m256 d0 = _mm256_mul_ps(dsup, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + b * 32 + 8 * half)))));
      const __m256 d1 = _mm256_mul_ps(dsup, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + b * 32 + 16 + 8 * half)))));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i i0 = _mm256_sub_epi32(s0[r], _mm256_set1_epi32(32 * hs[r][2 * b]));
        const __m256i i1 = _mm256_sub_epi32(s1[r], _mm256_set1_epi32(32 * hs[r][2 * b + 1]));
        const __m256 ev = _mm256_set1_ps(e[r][b]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d0, ev), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d1, ev), acc[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, out[r], sizeof(float) * rows_here);
}

SA_QAVX2 void qdot_group_avx2(const WeightView& w, int64_t group, const QuantizedActivations& xa, float* y,
                              int64_t ldy, int64_t rows_here) {
  switch (w.format) {
    case kQ4_1:
      return qdot_rows_avx2<kQ4_1>(w, group, xa, y, ldy, rows_here);
    case kQ4_K:
      return qdot_rows_avx2<kQ4_K>(w, group, xa, y, ldy, rows_here);
    case kQ6_K:  // tiles of 2 rows: two int32 sums per row and the unpacked codes fit the 16 registers
      return for_row_tiles<2>(xa.M, [&](auto rows, int64_t m) {
        q6k_tile_avx2<decltype(rows)::value>(w, group, xa, m, y + m * ldy, ldy, rows_here);
      });
    default:
      return qdot_rows_avx2<kQ8_0>(w, group, xa, y, ldy, rows_here);
  }
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}
#endif  // SA_QX86

}  // namespace

int32_t block_code(const WeightView& w, int64_t n, int64_t k) {  // Q6_K: the unsigned code (q - 32 is the value)
  return code_x16(w, n / 16, k / kBlock, n % 16, k % kBlock);
}

void linear_q8_activations_parts(const float* x, int64_t M, int64_t ldx, const WeightView* parts, int64_t nparts,
                                 float* y, int64_t ldy) {
  TORCH_CHECK(nparts >= 1, "a linear layer needs at least one weight");
  int64_t groups = 0;
  bool half_sums = false;
  std::vector<int64_t> first_group(nparts + 1, 0), first_row(nparts, 0);
  for (int64_t p = 0; p < nparts; ++p) {
    const WeightView& w = parts[p];
    TORCH_CHECK(is_block_format(w.format), "8-bit activations need Q8_0, Q4_1, Q4_K or Q6_K weights, got format ",
                w.format);
    TORCH_CHECK(w.cols == parts[0].cols, "the parts of a linear layer must share K");
    TORCH_CHECK(!is_k_format(w.format) || w.cols % kSuperBlock == 0, "K-quant weights need K divisible by 256");
    half_sums = half_sums || w.format == kQ6_K;
    first_row[p] = p == 0 ? 0 : first_row[p - 1] + parts[p - 1].rows;
    groups += (w.rows + 15) / 16;
    first_group[p + 1] = groups;
  }
  if (M == 0 || groups == 0) return;
  int isa = active_isa_value();
#if SA_QX86
  static const bool vnni = cpu_has_vnni();
  if (isa == 2 && !vnni) isa = 1;
#else
  isa = 0;
#endif
  QuantizedActivations xa;
  quantize_activations(x, M, ldx, parts[0].cols, isa, xa);
  if (half_sums) fill_half_sums(xa);
  auto group_fn = qdot_group_scalar;
#if SA_QX86
  if (isa == 2) group_fn = qdot_group_vnni;
  if (isa == 1) group_fn = qdot_group_avx2;
#endif
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(16, groups / (4 * at::get_num_threads() + 1)));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    int64_t p = 0;
    for (int64_t g = begin; g < end; ++g) {
      while (g >= first_group[p + 1]) ++p;
      const WeightView& w = parts[p];
      const int64_t local = g - first_group[p];
      group_fn(w, local, xa, y + first_row[p] + local * 16, ldy, std::min<int64_t>(16, w.rows - local * 16));
    }
  });
}

void linear_q8_activations(const float* x, int64_t M, int64_t ldx, const WeightView& w, float* y, int64_t ldy) {
  linear_q8_activations_parts(x, M, ldx, &w, 1, y, ldy);
}

}  // namespace native
}  // namespace cpu
}  // namespace specadapt
