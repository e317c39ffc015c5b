// SIMD helpers shared by Minerva's CPU kernels (AVX-512 F/BW/VL/BF16).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace minerva {

inline __m512 exp512(__m512 x) {  // ~1e-7 relative error
  // e^x = 2^n * e^r, r = x - n ln2 in [-ln2/2, ln2/2]; degree-6 Taylor is accurate to ~1e-7
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 values of a stored row as float32
inline __m512 load16(const float* p, float) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p, float) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p, float scale) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(scale));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// Lane sums of 16 vectors as one vector: out[i] = sum of the lanes of v[i]. The adds form the
// same tree as _mm512_reduce_add_ps (lanes k + k+8, then k + k+4, k + k+2, k + k+1), so each
// sum is bit-identical to reducing its vector alone.
inline __m512 hsum16(__m512 v[16]) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // quarters 0-1: v[2i] partials, quarters 2-3: v[2i+1] partials
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter k: 4 partials of v[4i + k]
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
  __m512d a = _mm512_castps_pd(u[0]), b = _mm512_castps_pd(u[1]);
  __m512 w = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  // lane 4k + e now holds the sum of v[4e + k]
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, w);
}

}  // namespace minerva
