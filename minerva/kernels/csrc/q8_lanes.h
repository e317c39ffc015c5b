// The lane types the regrouped kernels are written on: V8, one group of 8 weight rows per
// 256-bit register, and with AVX-512 VNNI V16, two groups side by side per 512-bit register.
// q8_repack_k.cpp's K-quant kernels and q8_repack_x8.cpp's pair tiles take them.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "q8_kernels.h"

namespace minerva::q8 {

// The regrouped K-quant kernels run on one group of 8 weight rows per 256-bit register
// (V8), or with AVX-512 VNNI on two groups side by side per 512-bit register (V16: lanes 0..7
// the first group's rows, 8..15 those of the group gb bytes on), so that one broadcast of x's
// 4 bytes feeds 16 weight rows. With one group per register they take one load of x per dot
// product, and loads bounded them: fewer decoding steps (GFNI) made them no faster, sharing
// each broadcast over two groups did. AVX-512 machine (Zen 4, whose 512-bit operations take
// two 256-bit passes), 5632 x 2048, 2 threads, 512 rows of x, medians of 5 alternating runs:
// Q4_K 282 GMAC/s against 247 with V8, Q5_K 240 against 195, Q6_K 224 against 204 (the
// panels' regrouping included); 4, 6, 8 or 10 rows of x per tile within the noise of each
// other. The same operations per output either way, so the same results.
struct V8 {
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p, int64_t) { return load256(p); }
  static I zero() { return _mm256_setzero_si256(); }
  // zero by an idiom the core renames away, for an accumulator started afresh in a loop (GCC
  // copies a zeroed register instead, an operation on the vector pipes)
  static I zero_idiom() {
    I v;
#if defined(__AVX512VL__)
    asm volatile("vpxord %0, %0, %0" : "=v"(v));
#else
    asm volatile("vpxor %0, %0, %0" : "=v"(v));
#endif
    return v;
  }
  static I bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I i32(int32_t v) { return _mm256_set1_epi32(v); }
  static I i32_at(const int32_t* p) { return bcast_i32(p); }  // (q8_blocks.h)
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I shl16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I shr16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I sar16(I a, int n) { return _mm256_srai_epi16(a, n); }
  static I shl32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I shr32(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I sar32(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I dot4(I acc, I u, I s) { return q8::dot4(acc, u, s); }
  static I dot4x(I acc, I u, const int8_t* p) { return q8::dot4x(acc, u, p); }
  static I dot2(I acc, I a, I b) { return q8::dot2(acc, a, b); }
  static I shuffle(I v, __m128i ctl) { return _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(ctl)); }
  static I sub8(I a, I b) { return _mm256_sub_epi8(a, b); }
  static I whole(const void* p) { return load256(p); }  // a full register, as `put` left it
  static void put(void* p, I v) { _mm256_store_si256(static_cast<__m256i*>(p), v); }
#if defined(__GFNI__)
  static I affine(I v, int64_t m) { return _mm256_gf2p8affine_epi64_epi8(v, _mm256_set1_epi64x(m), 0); }
#endif
  static F halves(const uint8_t* p, int64_t) { return _mm256_cvtph_ps(load128(p)); }  // the rows' f16 at p
  static F zerof() { return _mm256_setzero_ps(); }
  static F f32(float v) { return _mm256_set1_ps(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* y, F v, int valid) { store_rows<1>(&v, valid, y, 0); }
};

#if defined(MINERVA_V16)  // (q8_blocks.h)
struct V16 {
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p, int64_t gb) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load256(p)), load256(p + gb), 1);
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I zero_idiom() {  // as V8's
    I v;
    asm volatile("vpxord %0, %0, %0" : "=v"(v));
    return v;
  }
  static I bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I i32(int32_t v) { return _mm512_set1_epi32(v); }
  static I i32_at(const int32_t* p) {  // as V8's
    I v;
    asm("vpbroadcastd %1, %0" : "=v"(v) : "m"(*p));
    return v;
  }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I shl16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I shr16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I sar16(I a, int n) { return _mm512_srai_epi16(a, n); }
  static I shl32(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I shr32(I a, int n) { return _mm512_srli_epi32(a, n); }
  static I sar32(I a, int n) { return _mm512_srai_epi32(a, n); }
  static I dot4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I dot4x(I acc, I u, const int8_t* p) {  // as q8::dot4x
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
  static I dot2(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  static I shuffle(I v, __m128i ctl) { return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(ctl)); }
  static I sub8(I a, I b) { return _mm512_sub_epi8(a, b); }
  static I whole(const void* p) { return _mm512_loadu_si512(p); }
  static void put(void* p, I v) { _mm512_store_si512(p, v); }
#if defined(__GFNI__)
  static I affine(I v, int64_t m) { return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(m), 0); }
#endif
  static F halves(const uint8_t* p, int64_t gb) { return _mm512_cvtph_ps(_mm256_set_m128i(load128(p + gb), load128(p))); }
  static F join(__m256 lo, __m256 hi) {  // lo in lanes 0..7, hi in 8..15
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
  }
  static F zerof() { return _mm512_setzero_ps(); }
  static F f32(float v) { return _mm512_set1_ps(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* y, F v, int valid) { _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << valid) - 1), v); }
};
inline __m512i move_bits(__m512i v, int from, int to, int n) {
  const __m512i shifted = from <= to ? _mm512_slli_epi16(v, to - from) : _mm512_srli_epi16(v, from - to);
  return _mm512_and_si512(shifted, _mm512_set1_epi8(static_cast<char>(((1 << n) - 1) << to)));
}
#endif

}  // namespace minerva::q8
