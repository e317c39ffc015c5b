// SIMD helpers shared by Minerva's CPU kernels on CPUs with AVX2, FMA and F16C: the AVX2
// counterparts of simd.h, on vectors of 8 float32 lanes (__m256).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace minerva {

inline __m256 exp256(__m256 x) {  // ~1e-7 relative error; the same steps as exp512 in simd.h
  // e^x = 2^n * e^r, r = x - n ln2 in [-ln2/2, ln2/2]; degree-6 Taylor is accurate to ~1e-7
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // times 2^n, n in [-126, 127] after the clamp: a normal power of two built from its
  // exponent bits, so the product is rounded once, as _mm512_scalef_ps rounds it
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 values of a stored row as float32 (int8 times its scale, bfloat16 widened exactly)
inline __m256 load8(const float* p, float) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p, float) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p, float scale) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(scale));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// float32 -> bfloat16 rounded to nearest even, as c10::BFloat16 rounds (NaN stores 0x7FC0,
// subnormals are rounded, not flushed)
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

// 8 float32 values that are already integers in [-127, 127] (rounded and clamped) as int8
inline void store8(int8_t* p, __m256 v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}

// Lane sums of 8 vectors as one vector: out[i] = sum of the lanes of v[i], each as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), the tree of reduce_add below.
inline __m256 hsum8(const __m256 v[8]) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  // per 128-bit half: lane k holds the half-sum of v[k] (low half) or v[4 + k] (high half)
  const __m256 a = _mm256_hadd_ps(s01, s23), b = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float reduce_add(__m256 v) {
  __m256 h = _mm256_hadd_ps(v, v);
  h = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

// Asks for p's cache line in L1. GCC deletes a loop whose body is only _mm_prefetch (it
// counts as no effect), so this is a volatile asm statement, which it keeps.
inline void prefetch(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

}  // namespace minerva
