// Packed GGML-quantized matmul for x86-64 CPUs with AVX2, FMA and F16C.
//
// y[M, N] = x[M, K] @ W^T, the entry points of qmatmul.cpp (the AVX-512 build) for CPUs
// without AVX-512: W [N, K] stays in its GGUF block layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4) or is a plain F32, F16 or BF16 matrix read as blocks of 32.
//
// Exactness: weights are decoded to fp32 bit-identically to minerva/formats/quant.py (the
// same float operations in the same order; build with -ffp-contract=off). Each output
// element is one fixed chain of 8-lane FMAs over K (acc = fma(w[k:k+8], x[k:k+8], acc) for
// k = 0, 8, 16, ...) followed by a fixed lane reduction, whatever M is and however rows and
// panels fall to threads: a row's result never depends on what else is in the batch.
// bfloat16 activations are widened to fp32 (exact) and the result rounded back to bf16.

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "parallel.h"
#include "qformat.h"
#include "simd_avx2.h"

namespace {

using namespace minerva;

inline __m256 cvt_u8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline __m256 cvt_i8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
inline __m128i hi8(__m128i b) { return _mm_unpackhi_epi64(b, b); }  // bytes 8..15 moved to 0..7
inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i low_nibbles(__m128i b) { return _mm_and_si128(b, _mm_set1_epi8(0x0F)); }
inline __m128i high_nibbles(__m128i b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)); }

// Bit l of `bits` (l = 0..15) as byte l: 16 if set, else 0.
inline __m128i high_bits16(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i select = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(16));
}

// One group of 32 weights (elements 32g .. 32g+31) of a packed row: the constructor reads the
// group's scales, half(h, a, b) decodes elements 32g + 16h .. +15 to fp32 (a: the first 8).
template <int QT> struct Group;

template <> struct Group<Q4_0> {
  const uint8_t* b;
  __m256 d;
  Group(const uint8_t* row, int64_t g) : b(row + g * 18), d(_mm256_set1_ps(f16(b))) {}
  void half(int h, __m256& w0, __m256& w1) const {
    __m128i q = load128(b + 2);
    q = _mm_sub_epi8(h ? high_nibbles(q) : low_nibbles(q), _mm_set1_epi8(8));  // d * (q - 8)
    w0 = _mm256_mul_ps(d, cvt_i8(q));
    w1 = _mm256_mul_ps(d, cvt_i8(hi8(q)));
  }
};

template <> struct Group<Q4_1> {
  const uint8_t* b;
  __m256 d, m;
  Group(const uint8_t* row, int64_t g) : b(row + g * 20), d(_mm256_set1_ps(f16(b))), m(_mm256_set1_ps(f16(b + 2))) {}
  void half(int h, __m256& w0, __m256& w1) const {
    __m128i q = load128(b + 4);
    q = h ? high_nibbles(q) : low_nibbles(q);  // d * q + m
    w0 = _mm256_add_ps(_mm256_mul_ps(d, cvt_u8(q)), m);
    w1 = _mm256_add_ps(_mm256_mul_ps(d, cvt_u8(hi8(q))), m);
  }
};

template <> struct Group<Q5_0> {
  const uint8_t* b;
  __m256 d;
  uint32_t qh;
  Group(const uint8_t* row, int64_t g) : b(row + g * 22), d(_mm256_set1_ps(f16(b))) { std::memcpy(&qh, b + 2, 4); }
  void half(int h, __m256& w0, __m256& w1) const {
    __m128i q = load128(b + 6);
    q = _mm_or_si128(h ? high_nibbles(q) : low_nibbles(q), high_bits16(h ? qh >> 16 : qh));
    q = _mm_sub_epi8(q, _mm_set1_epi8(16));  // d * (q - 16)
    w0 = _mm256_mul_ps(d, cvt_i8(q));
    w1 = _mm256_mul_ps(d, cvt_i8(hi8(q)));
  }
};

template <> struct Group<Q5_1> {
  const uint8_t* b;
  __m256 d, m;
  uint32_t qh;
  Group(const uint8_t* row, int64_t g) : b(row + g * 24), d(_mm256_set1_ps(f16(b))), m(_mm256_set1_ps(f16(b + 2))) {
    std::memcpy(&qh, b + 4, 4);
  }
  void half(int h, __m256& w0, __m256& w1) const {
    __m128i q = load128(b + 8);
    q = _mm_or_si128(h ? high_nibbles(q) : low_nibbles(q), high_bits16(h ? qh >> 16 : qh));  // d * q + m
    w0 = _mm256_add_ps(_mm256_mul_ps(d, cvt_u8(q)), m);
    w1 = _mm256_add_ps(_mm256_mul_ps(d, cvt_u8(hi8(q))), m);
  }
};

template <> struct Group<Q8_0> {
  const uint8_t* b;
  __m256 d;
  Group(const uint8_t* row, int64_t g) : b(row + g * 34), d(_mm256_set1_ps(f16(b))) {}
  void half(int h, __m256& w0, __m256& w1) const {  // q * d
    const __m128i q = load128(b + 2 + 16 * h);
    w0 = _mm256_mul_ps(cvt_i8(q), d);
    w1 = _mm256_mul_ps(cvt_i8(hi8(q)), d);
  }
};

// MXFP4: d * value[q], d = 2^(e - 128) from the E8M0 byte, values looked up by nibble
template <> struct Group<MXFP4> {
  const uint8_t* b;
  __m256 d;
  Group(const uint8_t* row, int64_t g) : b(row + g * 17), d(_mm256_set1_ps(e8m0_half(b[0]))) {}
  void half(int h, __m256& w0, __m256& w1) const {
    const __m128i q = load128(b + 1);
    const __m128i v = _mm_shuffle_epi8(mxfp4_values(), h ? high_nibbles(q) : low_nibbles(q));
    w0 = _mm256_mul_ps(d, cvt_i8(v));
    w1 = _mm256_mul_ps(d, cvt_i8(hi8(v)));
  }
};

// Float matrices: 32 consecutive values; widening to fp32 is exact.
template <> struct Group<F32> {
  const float* p;
  Group(const uint8_t* row, int64_t g) : p(reinterpret_cast<const float*>(row) + 32 * g) {}
  void half(int h, __m256& w0, __m256& w1) const {
    w0 = _mm256_loadu_ps(p + 16 * h);
    w1 = _mm256_loadu_ps(p + 16 * h + 8);
  }
};

template <> struct Group<F16> {
  const uint8_t* p;
  Group(const uint8_t* row, int64_t g) : p(row + 64 * g) {}
  void half(int h, __m256& w0, __m256& w1) const {
    w0 = _mm256_cvtph_ps(load128(p + 32 * h));
    w1 = _mm256_cvtph_ps(load128(p + 32 * h + 16));
  }
};

template <> struct Group<BF16> {
  const uint8_t* p;
  Group(const uint8_t* row, int64_t g) : p(row + 64 * g) {}
  static __m256 widen(__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); }
  void half(int h, __m256& w0, __m256& w1) const {
    w0 = widen(load128(p + 32 * h));
    w1 = widen(load128(p + 32 * h + 16));
  }
};

// K-quant pieces: 16 weights from their bytes q, d * q (q signed) or d * q - m (q unsigned);
// and dl[i] = d * scale i for 16 int8 scales
inline void scaled16(float d, __m128i q, __m256& w0, __m256& w1) {
  const __m256 dv = _mm256_set1_ps(d);
  w0 = _mm256_mul_ps(dv, cvt_i8(q));
  w1 = _mm256_mul_ps(dv, cvt_i8(hi8(q)));
}

inline void offset16(float d, float m, __m128i q, __m256& w0, __m256& w1) {
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  w0 = _mm256_sub_ps(_mm256_mul_ps(dv, cvt_u8(q)), mv);
  w1 = _mm256_sub_ps(_mm256_mul_ps(dv, cvt_u8(hi8(q))), mv);
}

inline void scales16(float d, __m128i scales, float* dl) {
  const __m256 dv = _mm256_set1_ps(d);
  _mm256_storeu_ps(dl, _mm256_mul_ps(dv, cvt_i8(scales)));
  _mm256_storeu_ps(dl + 8, _mm256_mul_ps(dv, cvt_i8(hi8(scales))));
}

// K-quants: a 256-weight super-block of 8 sub-blocks; the constructor takes the super-block
// (the group index g of its first sub-block), half(s, h, ...) decodes half h of sub-block s.
// The other types have one group per block and take s = 0.
template <int QT> struct Block {
  Group<QT> grp;
  Block(const uint8_t* row, int64_t g) : grp(row, g) {}
  void half(int, int h, __m256& w0, __m256& w1) const { grp.half(h, w0, w1); }
};

// Q2_K: weight = (d * sc) * q - (dmin * mn), q 2-bit, a 4-bit scale and min per 16 weights
// (byte i of the 16 at b: scale in the low nibble, min in the high one)
template <> struct Block<Q2_K> {
  const uint8_t* qs;
  float dl[16], ml[16];
  Block(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + (g >> 3) * 84;
    const __m128i s = load128(b);
    scales16(f16(b + 80), low_nibbles(s), dl);  // nibbles: the same as signed bytes
    scales16(f16(b + 82), high_nibbles(s), ml);
    qs = b + 16;
  }
  void half(int s, int h, __m256& w0, __m256& w1) const {
    offset16(dl[2 * s + h], ml[2 * s + h], k2_low_bits(qs, s, h), w0, w1);
  }
};

// Q3_K: weight = (d * sc) * q, q 3-bit signed (-4..3), a 6-bit signed scale per 16 weights
template <> struct Block<Q3_K> {
  const uint8_t* b;
  float dl[16];
  Block(const uint8_t* row, int64_t g) : b(row + (g >> 3) * 110) { scales16(f16(b + 108), q3k_scales(b), dl); }
  void half(int s, int h, __m256& w0, __m256& w1) const {
    scaled16(dl[2 * s + h], _mm_sub_epi8(q3k_biased(b, s, h), _mm_set1_epi8(4)), w0, w1);
  }
};

// Q4_K / Q5_K: dl[j] = d * sc_j and ml[j] = dmin * mn_j for the 8 sub-blocks of the super-block
// at b, the 6-bit scales and mins unpacked from their 12 bytes all at once.
inline void k_scales(const uint8_t* b, float* dl, float* ml) {
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);  // mins 4..7
  const uint32_t mins = u[1] & low6;                           // mins 0..3
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);          // scales 4..7
  u[2] = mins;
  u[0] &= low6;                                                // scales 0..3
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  _mm256_storeu_ps(dl, _mm256_mul_ps(_mm256_set1_ps(f16(b)), cvt_u8(v)));
  _mm256_storeu_ps(ml, _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), cvt_u8(hi8(v))));
}

// Q4_K: weight = (d * sc) * q - (dmin * mn), sc and mn 6-bit per sub-block
template <> struct Block<Q4_K> {
  const uint8_t* qs;
  float dl[8], ml[8];
  Block(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + (g >> 3) * 144;
    k_scales(b, dl, ml);
    qs = b + 16;
  }
  void half(int s, int h, __m256& w0, __m256& w1) const {
    __m128i q = load128(qs + 32 * (s >> 1) + 16 * h);
    offset16(dl[s], ml[s], (s & 1) ? high_nibbles(q) : low_nibbles(q), w0, w1);
  }
};

// Q5_K: as Q4_K, with a fifth bit per weight (bit s of qh[l] for element l of sub-block s)
template <> struct Block<Q5_K> {
  const uint8_t *qs, *qh;
  float dl[8], ml[8];
  Block(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + (g >> 3) * 176;
    k_scales(b, dl, ml);
    qh = b + 16;
    qs = b + 48;
  }
  void half(int s, int h, __m256& w0, __m256& w1) const {
    __m128i q = load128(qs + 32 * (s >> 1) + 16 * h);
    q = (s & 1) ? high_nibbles(q) : low_nibbles(q);
    const __m128i bit = _mm_set1_epi8(static_cast<char>(1 << s));
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(load128(qh + 16 * h), bit), bit);
    offset16(dl[s], ml[s], _mm_or_si128(q, _mm_and_si128(set, _mm_set1_epi8(16))), w0, w1);
  }
};

// Q6_K: 4 low bits from ql, 2 high bits from qh, minus 32; one int8 scale per 16 weights
template <> struct Block<Q6_K> {
  const uint8_t* b;
  float dl[16];
  Block(const uint8_t* row, int64_t g) : b(row + (g >> 3) * 210) { scales16(f16(b + 208), load128(b + 192), dl); }
  void half(int s, int h, __m256& w0, __m256& w1) const {
    const int part = s >> 2, t = s & 3;
    __m128i q = load128(b + 64 * part + 32 * (t & 1) + 16 * h);
    q = (t >> 1) ? high_nibbles(q) : low_nibbles(q);
    const __m128i hb = _mm_and_si128(_mm_srli_epi16(load128(b + 128 + 32 * part + 16 * h), 2 * t), _mm_set1_epi8(3));
    scaled16(dl[2 * s + h], _mm_sub_epi8(_mm_or_si128(q, _mm_slli_epi16(hb, 4)), _mm_set1_epi8(32)), w0, w1);
  }
};

template <int mr, int nr>
inline void store_sums(const __m256 (&acc)[mr][nr], float* y, int64_t ldy) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) y[i * ldy + j] = reduce_add(acc[i][j]);  // a fixed lane order
}

// The blocks at group g of rows row, row + rb, ...
template <int QT, size_t... J>
std::array<Block<QT>, sizeof...(J)> make_blocks(const uint8_t* row, int64_t rb, int64_t g, std::index_sequence<J...>) {
  return {Block<QT>(row + J * rb, g)...};
}

constexpr int PF_BLOCKS = 2;  // how many row blocks ahead the small-batch path prefetches

// mr rows of x against nb weight rows, decoded in registers; nb independent FMA chains per
// row of x keep the FP pipes busy when M is 1.
template <int QT, int mr, int nb>
void direct(const float* x, int64_t K, const uint8_t* row, int64_t rb, float* y, int64_t ldy) {
  __m256 acc[mr][nb];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nb; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t groups = K / 32, ahead = PF_BLOCKS * nb * rb, step = (nb * rb + groups - 1) / groups;
  constexpr int subs = Layout<QT>::block / 32;  // groups of 32 per block
  for (int64_t g0 = 0; g0 < groups; g0 += subs) {
    // the rows PF_BLOCKS steps ahead, spread over this step's groups: DRAM streams at full rate
    for (int64_t off = g0 * step; off < (g0 + subs) * step; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead + off), _MM_HINT_T0);
    const auto blocks = make_blocks<QT>(row, rb, g0, std::make_index_sequence<nb>{});
#pragma GCC unroll 8
    for (int s = 0; s < subs; ++s)
    for (int h = 0; h < 2; ++h) {
      __m256 w0[nb], w1[nb];
      for (int j = 0; j < nb; ++j) blocks[j].half(s, h, w0[j], w1[j]);
      for (int i = 0; i < mr; ++i) {
        const float* xk = x + i * K + 32 * (g0 + s) + 16 * h;
        const __m256 x0 = _mm256_loadu_ps(xk), x1 = _mm256_loadu_ps(xk + 8);
        for (int j = 0; j < nb; ++j) {
          acc[i][j] = _mm256_fmadd_ps(w0[j], x0, acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(w1[j], x1, acc[i][j]);
        }
      }
    }
  }
  store_sums<mr, nb>(acc, y, ldy);
}

// x rows against decoded fp32 weight rows (a panel): the same FMA chain per output.
template <int mr, int nr>
void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m256 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < mr; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  store_sums<mr, nr>(acc, y, ldy);
}

template <int QT>
void decode_row(const uint8_t* row, int64_t K, float* out) {
  constexpr int subs = Layout<QT>::block / 32;
  for (int64_t g0 = 0; g0 < K / 32; g0 += subs) {
    const Block<QT> blk(row, g0);
#pragma GCC unroll 8
    for (int s = 0; s < subs; ++s)
      for (int h = 0; h < 2; ++h) {
        __m256 w0, w1;
        blk.half(s, h, w0, w1);
        _mm256_storeu_ps(out + 32 * (g0 + s) + 16 * h, w0);
        _mm256_storeu_ps(out + 32 * (g0 + s) + 16 * h + 8, w1);
      }
  }
}

// Small batches: up to SMALL_M rows of x, weights decoded in registers. With one row of x,
// four weight rows at once; with more, two (the accumulators must fit 16 registers).
constexpr int SMALL_M = 4;

template <int QT>
void matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t N, float* y) {
  const int64_t rb = row_bytes<QT>(K);
  const int nb = M == 1 ? 4 : 2;
  minerva::parallel_for(0, (N + nb - 1) / nb, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * nb, left = std::min<int64_t>(nb, N - n);
      const uint8_t* row = W + n * rb;
      float* yn = y + n;
      if (M == 1 && left == 4) direct<QT, 1, 4>(x, K, row, rb, yn, N);
      else if (left == 2 && M == 2) direct<QT, 2, 2>(x, K, row, rb, yn, N);
      else if (left == 2 && M == 3) direct<QT, 3, 2>(x, K, row, rb, yn, N);
      else if (left == 2 && M == 4) direct<QT, 4, 2>(x, K, row, rb, yn, N);
      else
        for (int64_t j = 0; j < left; ++j)
          for (int64_t m = 0; m < M; ++m) direct<QT, 1, 1>(x + m * K, K, row + j * rb, rb, yn + m * N + j, N);
    }
  });
}

// Larger batches: a panel of weight rows is decoded once into scratch and every row of x
// swept over it in MR x NR tiles.
constexpr int MR = 4, NR = 2, PANEL = 16;

template <int mr>
void tiles_nr(int nr, const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  if (nr == NR) tile<mr, NR>(x, ldx, w, K, y, ldy);
  else tile<mr, 1>(x, ldx, w, K, y, ldy);
}

template <int QT>
void matmul_panels(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t N, float* y) {
  const int64_t rb = row_bytes<QT>(K);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  minerva::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(PANEL * K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL, np = std::min<int64_t>(PANEL, N - n0);
      for (int64_t j = 0; j < np; ++j) decode_row<QT>(W + (n0 + j) * rb, K, panel.data() + j * K);
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, M - m0));
        for (int64_t j0 = 0; j0 < np; j0 += NR) {
          const int nr = static_cast<int>(std::min<int64_t>(NR, np - j0));
          const float *xt = x + m0 * K, *wt = panel.data() + j0 * K;
          float* yt = y + m0 * N + n0 + j0;
          switch (mr) {
            case 1: tiles_nr<1>(nr, xt, K, wt, K, yt, N); break;
            case 2: tiles_nr<2>(nr, xt, K, wt, K, yt, N); break;
            case 3: tiles_nr<3>(nr, xt, K, wt, K, yt, N); break;
            default: tiles_nr<4>(nr, xt, K, wt, K, yt, N); break;
          }
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
  const bool bf16 = x.dtype() == torch::kBFloat16;
  const torch::Tensor x32 = bf16 ? x.to(torch::kFloat32).contiguous() : x.contiguous();  // widening is exact
  const int64_t M = x32.size(0), N = rows, K = cols;
  auto y32 = torch::empty({M, N}, x32.options());
  with_format(qtype, [&]<int QT>() {
    check_args<QT>(packed, rows, cols);
    const uint8_t* W = packed.data_ptr<uint8_t>();
    if (M <= SMALL_M) matmul_small<QT>(x32.data_ptr<float>(), M, K, W, N, y32.data_ptr<float>());
    else matmul_panels<QT>(x32.data_ptr<float>(), M, K, W, N, y32.data_ptr<float>());
    return 0;
  });
  return bf16 ? y32.to(torch::kBFloat16) : y32;  // rounded to nearest even, as torch rounds
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
