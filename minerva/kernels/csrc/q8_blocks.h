// The int8 kernels' building blocks, header-only (q8_matmul.cpp describes the design and lists
// the files): SIMD helpers, the exact integer dot products (dot4, dot2) and each GGML type's
// block decoded for them (W8<QT>), as ggml-cpu's quants.h and arch/x86/quants.c hold its own.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qformat.h"
#include "simd_avx2.h"

namespace minerva::q8 {

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }

// Each byte's n bits from bit `from` moved to bit `to`, its other bits cleared: a 16-bit
// shift (which serves both bytes of a lane: bit to + 8 of the lane comes from bit from + 8)
// and a mask. (GFNI's one affine transform per byte instead measured no faster on the
// AVX-512 machine: the prefill kernels are bound by loads and dot products, not these steps.)
inline __m256i move_bits(__m256i v, int from, int to, int n) {
  const __m256i shifted = from <= to ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
  return _mm256_and_si256(shifted, _mm256_set1_epi8(static_cast<char>(((1 << n) - 1) << to)));
}
inline __m256i high4(__m256i v) { return move_bits(v, 4, 0, 4); }

// 16 bytes of nibbles as 32 bytes: the low nibbles (elements 0..15), then the high ones (16..31)
// (the bytes loaded into both halves, the upper half shifted right by 4)
inline __m256i nibbles32(const uint8_t* p) {
  const __m256i q = _mm256_broadcastsi128_si256(load128(p));
  return low4(_mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)));
}

// bit l of `bits` as byte l (l = 0..31): 16 where set, else 0
inline __m256i bits32(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(16));
}

inline __m256i ones16() { return _mm256_set1_epi16(1); }

// dot4: acc plus, per i32 lane, the sum of its 4 products of unsigned bytes u and signed bytes
// s; dot2: acc plus, per i32 lane, the sum of its 2 products of i16. One AVX-512 VNNI (or AVX
// VNNI) instruction where the CPU has it (the build is -march=native), else maddubs, madd
// and add, with the same exact sums: no pair of products reaches i16's limit here (see the
// top), and i32 adds associate.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool VNNI = true;
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#elif defined(__AVXVNNI__)
constexpr bool VNNI = true;
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#elif defined(MINERVA_EVEX_VNNI)
// The AVX-VNNI build (AVX2 CPUs with VNNI: Intel's since Alder Lake, AMD's since Zen 5) as a
// CPU with AVX-512 VNNI but not AVX-VNNI runs it, for its tests (native.py's avx2-vnni): the
// same two instructions in their EVEX form, in the 16 registers AVX2 has
constexpr bool VNNI = true;
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  asm("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
  return acc;
}
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) {
  asm("%{evex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  return acc;
}
#else
constexpr bool VNNI = false;
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones16()));
}
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif

// the 4 bytes at p in every 32-bit lane
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// *p in every lane, broadcast by the load (of a value that is then shifted, GCC would load it
// into a general register, shift it there and move it over: three more instructions)
inline __m256i bcast_i32(const int32_t* p) {
  __m256i v;
  asm("vpbroadcastd %1, %0" : "=v"(v) : "m"(*p));
  return v;
}

// dot4 against the 4 signed bytes at p in every lane. With AVX-512 VNNI one instruction with
// an embedded broadcast: GCC otherwise issues a vpbroadcastd for each, and x's broadcasts
// were half the instructions of the prefill kernels (AVX-512 machine, 5632 x 2048 Q4_K, 512
// rows of x, 2 threads: 311-313 GMAC/s against 289-290).
inline __m256i dot4x(__m256i acc, __m256i u, const int8_t* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
#else
  return dot4(acc, u, bcast4(p));
#endif
}

// V16 (q8_repack_k.cpp): two groups of 8 weight rows side by side in a 512-bit register, where
// the CPU has AVX-512 VNNI
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MINERVA_V16 1
#endif

// One 32-weight block of a packed row: w() gives its 32 values as bytes (signed for Q8_0,
// else unsigned), with the f16 scale d at b[0] and, when OFFSET, the f16 offset m at b[2]:
// weight = d * (w - 2^BIAS) + m.
template <int QT> struct W8;

template <> struct W8<Q4_0> {
  static constexpr bool OFFSET = false;
  static constexpr int BIAS = 3;
  const uint8_t* b;
  W8(const uint8_t* row, int64_t g) : b(row + g * 18) {}
  __m256i w() const { return nibbles32(b + 2); }
};

template <> struct W8<Q4_1> {
  static constexpr bool OFFSET = true;
  static constexpr int BIAS = 0;
  const uint8_t* b;
  W8(const uint8_t* row, int64_t g) : b(row + g * 20) {}
  __m256i w() const { return nibbles32(b + 4); }
};

template <> struct W8<Q5_0> {
  static constexpr bool OFFSET = false;
  static constexpr int BIAS = 4;
  const uint8_t* b;
  W8(const uint8_t* row, int64_t g) : b(row + g * 22) {}
  __m256i w() const {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return _mm256_or_si256(nibbles32(b + 6), bits32(qh));
  }
};

template <> struct W8<Q5_1> {
  static constexpr bool OFFSET = true;
  static constexpr int BIAS = 0;
  const uint8_t* b;
  W8(const uint8_t* row, int64_t g) : b(row + g * 24) {}
  __m256i w() const {
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    return _mm256_or_si256(nibbles32(b + 8), bits32(qh));
  }
};

// MXFP4: weight = d * value[q] (d the halved E8M0 scale, values the doubled E2M1 table,
// -12..12), entering as value + 16 (4..28) from a lookup of each nibble
template <> struct W8<MXFP4> {
  static constexpr bool OFFSET = false;
  static constexpr int BIAS = 4;
  const uint8_t* b;
  W8(const uint8_t* row, int64_t g) : b(row + g * 17) {}
  __m256i w() const {
    const __m256i biased = _mm256_broadcastsi128_si256(_mm_add_epi8(mxfp4_values(), _mm_set1_epi8(16)));
    return _mm256_shuffle_epi8(biased, nibbles32(b + 1));
  }
};

template <> struct W8<Q8_0> {
  static constexpr bool OFFSET = false;
  static constexpr int BIAS = 0;
  const uint8_t* b;
  W8(const uint8_t* row, int64_t g) : b(row + g * 34) {}
  __m256i w() const { return load256(b + 2); }
};

// The K-quants meet x quantized in blocks of 256 (one scale per super-block, as llama.cpp's
// Q8_K), so a super-block's 8 sub-block dot products add up in i32 before one float
// multiply-add. w(s) gives sub-block s's unsigned values (elements 32s .. 32s+31 of the
// super-block), sc(s) the i16 multipliers of its pair sums, d the float scale. Q4_K/Q5_K also
// give `mins` (mn_s at i16 lanes 2s and 2s+1, against x's sums of 16) and dmin; Q6_K gives its
// 16 scales as i16 for the bias: the stored values are w + 32.

// a shuffle control that spreads i16 lane s of a 128-bit half over all its 8 lanes
inline __m256i spread16(int s) { return _mm256_set1_epi16(static_cast<int16_t>(0x0100 * (2 * s + 1) + 2 * s)); }

// Q4_K / Q5_K super-block header: d, dmin and the 6-bit scales and mins of the 8 sub-blocks,
// unpacked from their 12 bytes all at once
struct KHeader {
  float d, dmin;
  __m256i sc16, mins;
  explicit KHeader(const uint8_t* b) : d(f16(b)), dmin(f16(b + 2)) {
    uint32_t u0, u1, u2;  // three scalars, not an array: loaded straight into registers
    std::memcpy(&u0, b + 4, 4);
    std::memcpy(&u1, b + 8, 4);
    std::memcpy(&u2, b + 12, 4);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    // the 8 scales and the 8 mins as bytes in a register (no round trip through memory)
    const uint64_t s47 = (u2 & low4) | (((u0 >> 6) & low2) << 4);
    const uint64_t m47 = ((u2 >> 4) & low4) | (((u1 >> 6) & low2) << 4);
    const uint64_t sc = (s47 << 32) | (u0 & low6), mn = (m47 << 32) | (u1 & low6);
    sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    const __m128i m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(mn)));
    mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
  }
  __m256i sc(int s) const { return _mm256_shuffle_epi8(sc16, spread16(s)); }
};

// Q4_K: weight = d * sc_s * q - dmin * mn_s; sub-blocks 2j and 2j+1 are the low and high
// nibbles of bytes 32j .. 32j+31
template <> struct W8<Q4_K> {
  static constexpr bool MINS = true;
  static constexpr int BIAS = 0;
  const uint8_t* qs;
  KHeader h;
  W8(const uint8_t* row, int64_t g) : qs(row + g * 144 + 16), h(row + g * 144) {}
  __m256i mins() const { return h.mins; }
  float dmin() const { return h.dmin; }
  __m256i w(int s) const {
    const __m256i v = load256(qs + 32 * (s >> 1));
    return (s & 1) ? high4(v) : low4(v);
  }
  __m256i sc(int s) const { return h.sc(s); }
  float d() const { return h.d; }
};

// Q5_K: as Q4_K, with a fifth bit per weight (bit s of qh[l] for element l of sub-block s)
template <> struct W8<Q5_K> {
  static constexpr bool MINS = true;
  static constexpr int BIAS = 0;
  const uint8_t* b;
  KHeader h;
  __m256i qh;
  W8(const uint8_t* row, int64_t g) : b(row + g * 176), h(b), qh(load256(b + 16)) {}
  __m256i mins() const { return h.mins; }
  float dmin() const { return h.dmin; }
  __m256i w(int s) const {
    const __m256i v = load256(b + 48 + 32 * (s >> 1));
    const __m256i hb = move_bits(qh, s, 4, 1);
    return _mm256_or_si256((s & 1) ? high4(v) : low4(v), hb);
  }
  __m256i sc(int s) const { return h.sc(s); }
  float d() const { return h.d; }
};

// The types with a scale per 16 weights (Q2_K, Q3_K, Q6_K) hold their 16 scales as i16 lanes
// (sc16); sub-block s takes scales 2s and 2s+1 spread over the low and the high 8 i16 lanes,
// against the pair sums of its elements 0..15 and 16..31: the half of sc16 that holds them
// copied to both 128-bit lanes (the same for s = 0..3 and for s = 4..7, so the compiler can
// keep it), then one in-lane shuffle.
inline __m256i scale_pairs(__m256i sc16, int s) {
  const __m256i half = s < 4 ? _mm256_permute4x64_epi64(sc16, 0x44) : _mm256_permute4x64_epi64(sc16, 0xEE);
  const char t = static_cast<char>(4 * (s & 3)), u = static_cast<char>(t + 1), v = static_cast<char>(t + 2),
             w = static_cast<char>(t + 3);
  return _mm256_shuffle_epi8(half, _mm256_setr_epi8(t, u, t, u, t, u, t, u, t, u, t, u, t, u, t, u,
                                                    v, w, v, w, v, w, v, w, v, w, v, w, v, w, v, w));
}

// Q2_K and Q3_K sub-block s: the 2-bit fields at bits 2 (s & 3) of qs bytes 32 (s >> 2) .. +31
inline __m256i k2_low32(const uint8_t* qs, int s) {
  const __m256i v = load256(qs + 32 * (s >> 2));
  return (s & 3) ? move_bits(v, 2 * (s & 3), 0, 2) : _mm256_and_si256(v, _mm256_set1_epi8(3));
}

// Q2_K: weight = d * sc * q - dmin * mn, q 2-bit; byte i of the first 16 holds the scale (low
// nibble) and min (high nibble) of elements 16i .. 16i + 15, so `mins` meets x's 16 sums of 16
// lane by lane.
template <> struct W8<Q2_K> {
  static constexpr bool MINS = true;
  static constexpr int BIAS = 0;
  const uint8_t* b;
  __m256i sc16, mn16;
  W8(const uint8_t* row, int64_t g) : b(row + g * 84) {
    const __m256i s = _mm256_cvtepu8_epi16(load128(b));
    sc16 = _mm256_and_si256(s, _mm256_set1_epi16(15));
    mn16 = _mm256_srli_epi16(s, 4);
  }
  __m256i mins() const { return mn16; }
  float dmin() const { return f16(b + 82); }
  __m256i w(int s) const { return k2_low32(b + 16, s); }
  __m256i sc(int s) const { return scale_pairs(sc16, s); }
  float d() const { return f16(b + 80); }
};

// Q3_K: weight = d * sc * q, q 3-bit signed, entering as q + 4 (the third bit, bit s of hmask
// byte l, set when q >= 0); a 6-bit signed scale per 16 weights.
template <> struct W8<Q3_K> {
  static constexpr bool MINS = false;
  static constexpr int BIAS = 2;
  const uint8_t* b;
  __m256i sc16, hm;
  W8(const uint8_t* row, int64_t g) : b(row + g * 110), sc16(_mm256_cvtepi8_epi16(q3k_scales(b))), hm(load256(b)) {}
  W8(const uint8_t* row, int64_t g, __m128i scales) : b(row + g * 110), sc16(_mm256_cvtepi8_epi16(scales)), hm(load256(b)) {}
  __m256i w(int s) const { return _mm256_or_si256(k2_low32(b + 32, s), hm_bit(s)); }
  // bit s of each hmask byte moved to bit 2, the others cleared: with GFNI one affine transform
  // (on Zen 4 it runs beside the shifts, on the pipes of the dot products, which the one-row
  // kernel leaves half idle), else a shift and a mask
  __m256i hm_bit(int s) const {
#if defined(__GFNI__)
    // row i of the bit matrix (byte 7 - i of the qword) selects the source bit of result bit i
    return _mm256_gf2p8affine_epi64_epi8(hm, _mm256_set1_epi64x(static_cast<int64_t>((1ULL << s) << 40)), 0);
#else
    return move_bits(hm, s, 2, 1);
#endif
  }
  __m256i sc(int s) const { return scale_pairs(sc16, s); }
  float d() const { return f16(b + 108); }
};

// q3k_scales of two Q3_K blocks at once, the first's in the low 128 bits: the 16 bytes at
// b + 94 of each (within the block) hold its scale bytes at 2 .. 13. With the GFNI hmask bit
// above, `row1`'s two rows went from 33.0 to 36.8 GMAC/s (Zen 4, 512 x 2048 from L2, one thread,
// a harness around the kernel, alternating runs) and greedy decode of the 1.1B Q3_K_M shape ran
// 1.105x faster (one process, old and new alternating, 10 pairs, 1.005-1.18).
inline __m256i q3k_scales2(const uint8_t* b0, const uint8_t* b1) {
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(load128(b0 + 94)), load128(b1 + 94), 1);
  const __m128i lo = _mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9);
  const __m128i hi = _mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13);
  const __m256i low = _mm256_and_si256(_mm256_srlv_epi64(_mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(lo)), _mm256_setr_epi64x(0, 4, 0, 4)),
                                       _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(hi)), _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
}

// Q6_K: 4 low bits from ql, 2 high bits from qh, minus 32; an int8 scale per 16 weights. Sub-block
// s = 4 * part + t reads ql bytes 64 part + 32 (t & 1) (nibble t >> 1) and qh bytes 128 + 32 part
// (bits 2t, 2t+1); its halves take scales 8 part + 2t and 8 part + 2t + 1.
template <> struct W8<Q6_K> {
  static constexpr bool MINS = false;
  static constexpr int BIAS = 5;
  const uint8_t* b;
  __m256i sc16;  // the 16 int8 scales as i16
  W8(const uint8_t* row, int64_t g) : b(row + g * 210), sc16(_mm256_cvtepi8_epi16(load128(b + 192))) {}
  __m256i w(int s) const {
    const int part = s >> 2, t = s & 3;
    const __m256i v = load256(b + 64 * part + 32 * (t & 1));
#if defined(__GFNI__)  // bits 2t, 2t + 1 to 4, 5 in one affine transform, as W8<Q3_K>::hm_bit (one row,
    // 512 x 2048 from L2, one thread, Zen 4: 36.5 -> 38 GMAC/s)
    const __m256i hb = _mm256_gf2p8affine_epi64_epi8(
        load256(b + 128 + 32 * part), _mm256_set1_epi64x(static_cast<int64_t>(((1ULL << (2 * t)) << 24) | ((2ULL << (2 * t)) << 16))), 0);
#else
    const __m256i hb = move_bits(load256(b + 128 + 32 * part), 2 * t, 4, 2);
#endif
    return _mm256_or_si256((t >> 1) ? high4(v) : low4(v), hb);
  }
  __m256i sc(int s) const { return scale_pairs(sc16, s); }
  float d() const { return f16(b + 208); }
};

template <int QT>
constexpr bool is_k = QT == Q2_K || QT == Q3_K || QT == Q4_K || QT == Q5_K || QT == Q6_K;

template <int QT>
constexpr bool has_w8 = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q8_0 || QT == MXFP4 || is_k<QT>;

// the sum of the 8 i32 lanes
inline int32_t sum_lanes(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// An accumulator kept as one register add after another. Integer adds associate, and with
// the sub-block loop unrolled GCC otherwise computes all of a tile's products first, spills
// them to the stack and adds them up afterwards.
template <class T>
inline void keep_in_register(T& v) { asm volatile("" : "+v"(v)); }
// ... as a value: `acc[i] = kept(add(acc[i], x))` leaves the array itself out of the asm (whose
// operand, an element of it, made GCC keep the whole array in memory: tile_panel's runs)
template <class T>
inline T kept(T v) {
  asm volatile("" : "+v"(v));
  return v;
}

// v, which the compiler may no longer treat as loop invariant: the second group's loads then
// address b + v + offset from one register (GCC had hoisted each v + offset out of the
// super-block loop, to the stack, and reloaded them one load at a time)
inline int64_t opaque(int64_t v) {
  asm("" : "+r"(v));
  return v;
}

}  // namespace minerva::q8
