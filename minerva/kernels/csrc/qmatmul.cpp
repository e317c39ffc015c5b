// Packed GGML-quantized matmul for x86-64 CPUs with AVX-512 (F, BW, VL, BF16) and F16C.
//
// y[M, N] = x[M, K] @ W^T, where W [N, K] stays in its GGUF block layout (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4), or is a plain F32, F16 or BF16 matrix read as
// blocks of 32 (float checkpoints get the same batch-invariant kernels). A panel of weight rows is decoded into a small
// scratch buffer (fp32 or bf16, the dtype of x) and reused for every row of x.
//
// Exactness: the decoded fp32 weights are bit-identical to minerva/formats/quant.py
// (the same float operations in the same order; build with -ffp-contract=off). Each
// output element is one fixed sequence of FMAs over K followed by a fixed lane
// reduction, whatever M is and however rows and panels fall to threads: a row's
// result never depends on what else is in the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "qformat.h"
#include "simd.h"

namespace {

using namespace minerva;

inline __m512 cvt_u8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline __m512 cvt_i8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }

// 16 bits of `bits` starting at `shift`, each as a byte 0/1 -> shifted to bit 4
inline __m128i high_bits16(uint32_t bits) {
  __mmask16 m = static_cast<__mmask16>(bits);
  return _mm_maskz_mov_epi8(m, _mm_set1_epi8(16));
}

// Decode the 32 weights of group g (elements 32g .. 32g+31) of one packed row to fp32.
template <int QT>
inline void decode32(const uint8_t* row, int64_t g, __m512& lo, __m512& hi);

// 4-bit formats decode through a 16-entry table per group: table[q] = (d * q) + m (or d * (q - 8))
// computed with the same float operations as the reference does per element, so the values
// are bit-identical; vpermps then looks each nibble up (it reads only the low 4 bits of each
// index, so the high nibble needs just a shift).
inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

template <>
inline void decode32<Q4_0>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + g * 18;
  const __m512 table = _mm512_mul_ps(_mm512_set1_ps(f16(b)), _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)));
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
  w0 = _mm512_permutexvar_ps(idx, table);
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

template <>
inline void decode32<Q4_1>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + g * 20;
  const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f16(b)), iota16()), _mm512_set1_ps(f16(b + 2)));
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
  w0 = _mm512_permutexvar_ps(idx, table);
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

inline void q5_values(const uint8_t* qh4, const uint8_t* qs16, __m128i& lo, __m128i& hi) {
  uint32_t qh;
  std::memcpy(&qh, qh4, 4);
  __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs16));
  __m128i m4 = _mm_set1_epi8(0x0F);
  lo = _mm_or_si128(_mm_and_si128(qs, m4), high_bits16(qh));
  hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), high_bits16(qh >> 16));
}

template <>
inline void decode32<Q5_0>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + g * 22;
  __m512 d = _mm512_set1_ps(f16(b));
  __m128i lo, hi;
  q5_values(b + 2, b + 6, lo, hi);
  __m128i sixteen = _mm_set1_epi8(16);
  w0 = _mm512_mul_ps(d, cvt_i8(_mm_sub_epi8(lo, sixteen)));
  w1 = _mm512_mul_ps(d, cvt_i8(_mm_sub_epi8(hi, sixteen)));
}

template <>
inline void decode32<Q5_1>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + g * 24;
  __m512 d = _mm512_set1_ps(f16(b)), m = _mm512_set1_ps(f16(b + 2));
  __m128i lo, hi;
  q5_values(b + 4, b + 8, lo, hi);
  w0 = _mm512_add_ps(_mm512_mul_ps(d, cvt_u8(lo)), m);
  w1 = _mm512_add_ps(_mm512_mul_ps(d, cvt_u8(hi)), m);
}

template <>
inline void decode32<Q8_0>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + g * 34;
  __m512 d = _mm512_set1_ps(f16(b));
  __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
  __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
  w0 = _mm512_mul_ps(cvt_i8(q0), d);
  w1 = _mm512_mul_ps(cvt_i8(q1), d);
}

// MXFP4: weight = d * value[q], d = 2^(e - 128) from the block's E8M0 byte, value the doubled
// E2M1 table; element j is the low nibble of byte j, element j + 16 its high nibble
template <>
inline void decode32<MXFP4>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + g * 17;
  const __m512 table = _mm512_mul_ps(_mm512_set1_ps(e8m0_half(b[0])), cvt_i8(mxfp4_values()));
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1)));
  w0 = _mm512_permutexvar_ps(idx, table);
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

// Q2_K: weight = (d * sc) * q - (dmin * mn), q 2-bit; scale (low nibble) and min (high
// nibble) of each 16 weights in the block's first 16 bytes
template <>
inline void decode32<Q2_K>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + (g >> 3) * 84;
  const int j = static_cast<int>(g & 7);
  const float d = f16(b + 80), dmin = f16(b + 82);
  for (int h = 0; h < 2; ++h) {
    const int s = b[2 * j + h];
    const __m512 dl = _mm512_set1_ps(d * static_cast<float>(s & 15));
    const __m512 ml = _mm512_set1_ps(dmin * static_cast<float>(s >> 4));
    (h ? w1 : w0) = _mm512_sub_ps(_mm512_mul_ps(dl, cvt_u8(k2_low_bits(b + 16, j, h))), ml);
  }
}

// Q3_K: weight = (d * sc) * q, q 3-bit signed, a 6-bit signed scale per 16 weights
template <>
inline void decode32<Q3_K>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + (g >> 3) * 110;
  const int j = static_cast<int>(g & 7);
  alignas(16) int8_t sc[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(sc), q3k_scales(b));
  const float d = f16(b + 108);
  for (int h = 0; h < 2; ++h) {
    const __m128i q = _mm_sub_epi8(q3k_biased(b, j, h), _mm_set1_epi8(4));
    (h ? w1 : w0) = _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(sc[2 * j + h])), cvt_i8(q));
  }
}

template <>
inline void decode32<Q4_K>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + (g >> 3) * 144;
  int j = static_cast<int>(g & 7), sc, mn;
  k_scale_min(b + 4, j, sc, mn);
  const __m512 table = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(f16(b) * static_cast<float>(sc)), iota16()),
                                     _mm512_set1_ps(f16(b + 2) * static_cast<float>(mn)));
  const uint8_t* qs = b + 16 + 32 * (j >> 1);
  __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  if (j & 1) {
    i0 = _mm512_srli_epi32(i0, 4);
    i1 = _mm512_srli_epi32(i1, 4);
  }
  w0 = _mm512_permutexvar_ps(i0, table);
  w1 = _mm512_permutexvar_ps(i1, table);
}

template <>
inline void decode32<Q5_K>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + (g >> 3) * 176;
  int j = static_cast<int>(g & 7), sc, mn;
  k_scale_min(b + 4, j, sc, mn);
  __m512 dl = _mm512_set1_ps(f16(b) * static_cast<float>(sc));
  __m512 ml = _mm512_set1_ps(f16(b + 2) * static_cast<float>(mn));
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48 + 32 * (j >> 1);
  __m128i m4 = _mm_set1_epi8(0x0F), bit = _mm_set1_epi8(static_cast<char>(1 << j));
  for (int h = 0; h < 2; ++h) {
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * h));
    q = (j & 1) ? _mm_and_si128(_mm_srli_epi16(q, 4), m4) : _mm_and_si128(q, m4);
    __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16 * h));
    __mmask16 set = _mm_test_epi8_mask(hb, bit);
    q = _mm_or_si128(q, _mm_maskz_mov_epi8(set, _mm_set1_epi8(16)));
    (h ? w1 : w0) = _mm512_sub_ps(_mm512_mul_ps(dl, cvt_u8(q)), ml);
  }
}

template <>
inline void decode32<Q6_K>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const uint8_t* b = row + (g >> 3) * 210;
  int j = static_cast<int>(g & 7), half = j >> 2, t = j & 3;
  const uint8_t* ql = b + 64 * half + 32 * (t & 1);
  const uint8_t* qh = b + 128 + 32 * half;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  float d = f16(b + 208);
  __m128i m4 = _mm_set1_epi8(0x0F), m3 = _mm_set1_epi8(3), off = _mm_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 16 * h));
    q = (t >> 1) ? _mm_and_si128(_mm_srli_epi16(q, 4), m4) : _mm_and_si128(q, m4);
    __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16 * h));
    hb = _mm_and_si128(_mm_srl_epi16(hb, _mm_cvtsi32_si128(2 * t)), m3);
    q = _mm_sub_epi8(_mm_or_si128(q, _mm_slli_epi16(hb, 4)), off);
    __m512 dl = _mm512_set1_ps(d * static_cast<float>(scales[2 * j + h]));
    (h ? w1 : w0) = _mm512_mul_ps(dl, cvt_i8(q));
  }
}

// Float matrices: 32 consecutive values; widening to fp32 is exact.
template <>
inline void decode32<F32>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const float* p = reinterpret_cast<const float*>(row) + 32 * g;
  w0 = _mm512_loadu_ps(p);
  w1 = _mm512_loadu_ps(p + 16);
}

template <>
inline void decode32<F16>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const __m256i* p = reinterpret_cast<const __m256i*>(row + 64 * g);
  w0 = _mm512_cvtph_ps(_mm256_loadu_si256(p));
  w1 = _mm512_cvtph_ps(_mm256_loadu_si256(p + 1));
}

inline __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

template <>
inline void decode32<BF16>(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
  const __m256i* p = reinterpret_cast<const __m256i*>(row + 64 * g);
  w0 = bf16_to_f32(_mm256_loadu_si256(p));
  w1 = bf16_to_f32(_mm256_loadu_si256(p + 1));
}

// Every output element y[m, n] is computed the same way on every path:
//   acc = 0 (16 lanes); for k in 0, 16, 32, ...: acc = fma(w[n, k:k+16], x[m, k:k+16], acc)
//   y = reduce_add(acc)                                         (fp32 activations)
//   acc = 0; for k in 0, 32, ...: acc = dpbf16(acc, bf16(w[n, k:k+32]), x[m, k:k+32])
//   y = reduce_add(acc)                                         (bf16 activations)
// with w decoded bit-exactly. Small batches decode into registers; larger ones decode a
// panel of rows once into scratch and sweep every row of x over it. Both give the
// same bits, so where a row lands never changes its result.

constexpr int SMALL_M = 4;  // up to this many rows: decode in registers
constexpr int MR = 4;       // rows of x per micro-tile
constexpr int NR = 4;       // weight rows per micro-tile
constexpr int PANEL = 16;   // weight rows decoded at once

inline __m512bh pack_bf16(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }

// y[i, j] = lane sum of acc[i][j]; a full 4x4 tile reduces all 16 at once (bit-identical to
// reducing each alone, which the other paths do).
template <int mr, int nr>
inline void store_sums(__m512 (&acc)[mr][nr], float* y, int64_t ldy) {
  if constexpr (mr * nr == 16) {
    __m512 v[16];
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) v[i * nr + j] = acc[i][j];
    alignas(64) float s[16];
    _mm512_store_ps(s, minerva::hsum16(v));
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) y[i * ldy + j] = s[i * nr + j];
  } else {
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

constexpr int PF_BLOCKS = 2;  // how many row blocks ahead the small-batch path prefetches

// nb weight rows at once: independent FMA chains keep the FP pipes busy when M is 1.
template <int QT, int mr, int nb>
void direct_f32(const float* x, int64_t K, const uint8_t* row, int64_t rb, float* y, int64_t ldy) {
  __m512 acc[mr][nb];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nb; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t groups = K / 32, ahead = PF_BLOCKS * nb * rb, step = (nb * rb + groups - 1) / groups;
  for (int64_t g = 0; g < K / 32; ++g) {
    // the rows PF_BLOCKS steps ahead, spread over this step's groups: DRAM streams at full rate
    for (int64_t off = g * step; off < (g + 1) * step; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead + off), _MM_HINT_T0);
    __m512 w0[nb], w1[nb];
    for (int j = 0; j < nb; ++j) decode32<QT>(row + j * rb, g, w0[j], w1[j]);
    for (int i = 0; i < mr; ++i) {
      const __m512 x0 = _mm512_loadu_ps(x + i * K + 32 * g), x1 = _mm512_loadu_ps(x + i * K + 32 * g + 16);
      for (int j = 0; j < nb; ++j) {
        acc[i][j] = _mm512_fmadd_ps(w0[j], x0, acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(w1[j], x1, acc[i][j]);
      }
    }
  }
  store_sums<mr, nb>(acc, y, ldy);
}

template <int QT, int mr, int nb>
void direct_bf16(const uint16_t* x, int64_t K, const uint8_t* row, int64_t rb, float* y, int64_t ldy) {
  __m512 acc[mr][nb];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nb; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t groups = K / 32, ahead = PF_BLOCKS * nb * rb, step = (nb * rb + groups - 1) / groups;
  for (int64_t g = 0; g < K / 32; ++g) {
    // the rows PF_BLOCKS steps ahead, spread over this step's groups: DRAM streams at full rate
    for (int64_t off = g * step; off < (g + 1) * step; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead + off), _MM_HINT_T0);
    __m512bh w[nb];
    for (int j = 0; j < nb; ++j) {
      __m512 w0, w1;
      decode32<QT>(row + j * rb, g, w0, w1);
      w[j] = pack_bf16(w0, w1);
    }
    for (int i = 0; i < mr; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + 32 * g);
      for (int j = 0; j < nb; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xv);
    }
  }
  store_sums<mr, nb>(acc, y, ldy);
}

template <int QT, int nb, typename T>
void direct(int mr, const T* x, int64_t K, const uint8_t* row, int64_t rb, float* y, int64_t ldy) {
  if constexpr (std::is_same_v<T, float>) {
    switch (mr) {
      case 1: direct_f32<QT, 1, nb>(x, K, row, rb, y, ldy); break;
      case 2: direct_f32<QT, 2, nb>(x, K, row, rb, y, ldy); break;
      case 3: direct_f32<QT, 3, nb>(x, K, row, rb, y, ldy); break;
      default: direct_f32<QT, 4, nb>(x, K, row, rb, y, ldy); break;
    }
  } else {
    switch (mr) {
      case 1: direct_bf16<QT, 1, nb>(x, K, row, rb, y, ldy); break;
      case 2: direct_bf16<QT, 2, nb>(x, K, row, rb, y, ldy); break;
      case 3: direct_bf16<QT, 3, nb>(x, K, row, rb, y, ldy); break;
      default: direct_bf16<QT, 4, nb>(x, K, row, rb, y, ldy); break;
    }
  }
}

template <int mr, int nr>
void tile_f32(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m512 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
    for (int i = 0; i < mr; ++i) {
      __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  store_sums<mr, nr>(acc, y, ldy);
}

template <int mr, int nr>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* y, int64_t ldy) {
  __m512 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
    for (int i = 0; i < mr; ++i) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
  store_sums<mr, nr>(acc, y, ldy);
}

// Calls F<mr, nr>::run(args...) for runtime mr, nr in 1..4.
template <template <int, int> class F, int mr, typename... A>
void by_nr(int nr, A... a) {
  switch (nr) {
    case 1: F<mr, 1>::run(a...); break;
    case 2: F<mr, 2>::run(a...); break;
    case 3: F<mr, 3>::run(a...); break;
    default: F<mr, 4>::run(a...); break;
  }
}
template <template <int, int> class F, typename... A>
void by_mr_nr(int mr, int nr, A... a) {
  switch (mr) {
    case 1: by_nr<F, 1>(nr, a...); break;
    case 2: by_nr<F, 2>(nr, a...); break;
    case 3: by_nr<F, 3>(nr, a...); break;
    default: by_nr<F, 4>(nr, a...); break;
  }
}
template <int mr, int nr> struct TileF32 {
  static void run(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
    tile_f32<mr, nr>(x, ldx, w, K, y, ldy);
  }
};
template <int mr, int nr> struct TileBF16 {
  static void run(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* y, int64_t ldy) {
    tile_bf16<mr, nr>(x, ldx, w, K, y, ldy);
  }
};

template <int QT>
void decode_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 w0, w1;
    decode32<QT>(row, g, w0, w1);
    _mm512_storeu_ps(out + 32 * g, w0);
    _mm512_storeu_ps(out + 32 * g + 16, w1);
  }
}

template <int QT>
void decode_row_bf16(const uint8_t* row, int64_t K, uint16_t* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 w0, w1;
    decode32<QT>(row, g, w0, w1);
    _mm512_storeu_si512(out + 32 * g, (__m512i)pack_bf16(w0, w1));
  }
}

constexpr int NB = 4;  // weight rows per step of the small-batch path

template <int QT, typename T>
void matmul_small(const T* x, int64_t M, int64_t K, const uint8_t* W, int64_t N, float* y) {
  const int64_t rb = row_bytes<QT>(K);
  minerva::parallel_for(0, (N + NB - 1) / NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * NB, nb = std::min<int64_t>(NB, N - n);
      for (int64_t m0 = 0; m0 < M; m0 += SMALL_M) {
        const int mr = static_cast<int>(std::min<int64_t>(SMALL_M, M - m0));
        if (nb == NB) direct<QT, NB>(mr, x + m0 * K, K, W + n * rb, rb, y + m0 * N + n, N);
        else
          for (int64_t j = 0; j < nb; ++j) direct<QT, 1>(mr, x + m0 * K, K, W + (n + j) * rb, rb, y + m0 * N + n + j, N);
      }
    }
  });
}

template <int QT, typename T>
void matmul_panels(const T* x, int64_t M, int64_t K, const uint8_t* W, int64_t N, float* y) {
  const int64_t rb = row_bytes<QT>(K);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  minerva::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<T> panel(PANEL * K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL, np = std::min<int64_t>(PANEL, N - n0);
      for (int64_t j = 0; j < np; ++j) {
        if constexpr (std::is_same_v<T, float>) decode_row<QT>(W + (n0 + j) * rb, K, panel.data() + j * K);
        else decode_row_bf16<QT>(W + (n0 + j) * rb, K, panel.data() + j * K);
      }
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, M - m0));
        for (int64_t j0 = 0; j0 < np; j0 += NR) {
          const int nr = static_cast<int>(std::min<int64_t>(NR, np - j0));
          float* yt = y + m0 * N + n0 + j0;
          if constexpr (std::is_same_v<T, float>)
            by_mr_nr<TileF32>(mr, nr, x + m0 * K, K, static_cast<const float*>(panel.data() + j0 * K), K, yt, N);
          else
            by_mr_nr<TileBF16>(mr, nr, x + m0 * K, K, static_cast<const uint16_t*>(panel.data() + j0 * K), K, yt, N);
        }
      }
    }
  });
}

}  // namespace

// x [M, K] float32 or bfloat16 -> y [M, N] in x's dtype (accumulated in float32).
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t rows, int64_t cols) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols, "x must be [M, ", cols, "]");
  TORCH_CHECK(x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16, "x must be float32 or bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), N = rows, K = cols;
  const bool bf16 = x.dtype() == torch::kBFloat16;
  auto y32 = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  with_format(qtype, [&]<int QT>() {
    check_args<QT>(packed, rows, cols);
    const uint8_t* W = packed.data_ptr<uint8_t>();
    float* y = y32.data_ptr<float>();
    if (bf16) {
      auto xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
      if (M <= SMALL_M) matmul_small<QT>(xb, M, K, W, N, y);
      else matmul_panels<QT>(xb, M, K, W, N, y);
    } else {
      if (M <= SMALL_M) matmul_small<QT>(x.data_ptr<float>(), M, K, W, N, y);
      else matmul_panels<QT>(x.data_ptr<float>(), M, K, W, N, y);
    }
    return 0;
  });
  if (!bf16) return y32;
  auto y = torch::empty({M, N}, x.options());  // bf16, rounded as torch rounds (nearest even)
  const float* src = y32.data_ptr<float>();
  at::BFloat16* dst = y.data_ptr<at::BFloat16>();
  minerva::parallel_for(0, M * N, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dst[i] = at::BFloat16(src[i]);
  });
  return y;
}

// Decode packed rows [R, row_bytes] to float32 [R, cols] (embedding lookups, tests).
torch::Tensor dequantize_rows(torch::Tensor packed, int64_t qtype, int64_t cols) {
  TORCH_CHECK(packed.dim() == 2, "packed rows must be [R, row_bytes]");
  packed = packed.contiguous();
  const int64_t R = packed.size(0);
  auto out = torch::empty({R, cols}, torch::dtype(torch::kFloat32));
  with_format(qtype, [&]<int QT>() {
    check_args<QT>(packed, R, cols);
    const uint8_t* W = packed.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    minerva::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) decode_row<QT>(W + r * row_bytes<QT>(cols), cols, o + r * cols);
    });
    return 0;
  });
  return out;
}
