// Packed GGML matmul on 8-bit activations (`--activations int8`), in both builds.
//
// y[M, N] = x̃[M, K] @ W^T where x̃ is x quantized per row in blocks, as llama.cpp quantizes
// activations: d = max|x| / 127, q = round(x / d) (to nearest even), x̃ = d * q. Blocks of 32
// (its Q8_0) meet the 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); blocks of 256 (its
// Q8_K) meet the K-quants' super-blocks (Q2_K .. Q6_K), so a super-block's 8 sub-block dot
// products add up in i32 and need one float multiply-add. The weights stay in their GGUF
// blocks and meet the activations in integer dot products, 32 weights at a time: `maddubs`
// (u8 x i8 pairs to i16), `madd` (to i32, times the weight's integer sub-block scales where
// it has them). A weight's offset (Q4_1/Q5_1 min, Q2_K/Q4_K/Q5_K dmin * min) meets x's block
// sums.
//
// Weights stored with a bias (Q4_0: q - 8, Q5_0: q - 16, Q3_K: q - 4, Q6_K: q - 32) enter
// unsigned, as does MXFP4 (its table values, -12..12, plus 16), and the bias times x's sums
// leaves the i32 dot product (Q4_0/Q5_0/MXFP4: bias * sum(q)
// of the block; Q3_K/Q6_K: bias * sum(scale * x's sum of 16)). Q8_0's signed values use |w| as the unsigned
// operand and q with w's sign as the signed one. No step saturates: a pair sums to at most
// 2 * 127 * max(63, 128) = 32512, and a super-block's i32 sum to 256 * 128 * 63 * 127 < 2^31.
//
// Exactness: each output element is one fixed sequence of operations over K, and a row is
// quantized on its own. Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 take 8 weight rows at a time, one per
// float lane: per block the exact integer dot product, then acc = fma(dot, d_w * d_x, acc)
// and, for Q4_1/Q5_1, acc = fma(m, d_x * sum(q), acc). The others keep 8 lanes per output,
// reduced in a fixed order at the end: Q8_0 per block acc = fma(d_w * d_x, dot, acc) (its
// weights need no decoding, and gathering rows costs more than it saves); per K-quant
// super-block, for Q2_K/Q4_K/Q5_K acc = fma(mins . x's sums, -dmin * d_x, acc), then an exact
// i32 sum and acc = fma(sum, d_w * d_x, acc); Q3_K and Q6_K add a super-block's lanes up
// into one exact i32 and take one scalar acc = fma(sum, d_w * d_x, acc). A row's result
// therefore never depends on the batch, the tiling or the threads.
// The plain-torch counterpart is minerva/kernels/act_quant.py.
//
// Written with AVX2 intrinsics, which both builds' CPUs have, and AVX-512 VNNI's dot products
// (dot4, dot2) where the CPU has them: the same exact integer sums either way.

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "qformat.h"
#include "simd_avx2.h"

namespace {

using namespace minerva;

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
#else
constexpr bool VNNI = false;
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones16()));
}
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif

// dot4 against the 4 signed bytes at p in every lane. With AVX-512 VNNI one instruction with
// an embedded broadcast: GCC otherwise issues a vpbroadcastd for each, and x's broadcasts
// were half the instructions of the prefill kernels (AVX-512 machine, 5632 x 2048 Q4_K, 512
// rows of x, 2 threads: 311-313 GMAC/s against 289-290).
inline __m256i dot4x(__m256i acc, __m256i u, const int8_t* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
#else
  int32_t v;
  std::memcpy(&v, p, 4);
  return dot4(acc, u, _mm256_set1_epi32(v));
#endif
}

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

// x quantized: per row, K int8 values in blocks of B (32 or 256) with one scale d, sum(q) and
// d * sum(q) each; per 256-block also the 16 sums of 16 (the K-quants' mins and bias)
struct Q8 {
  const int8_t* q;
  const int16_t* p;  // B = 256 per row: K / 16 i16 (sums of 16), then K / 32 (sums of 32); B = 32: none
  const float *d, *s;
  const int32_t* n;  // sum(q) per block
  int64_t K, G;      // row length, blocks per row
  int64_t lp;        // i16 sums per row
};

// the sum of the 8 i32 lanes
inline int32_t sum_lanes(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// one = fma(float(sum of v[k]'s lanes), scale[k], one) for k = 0 .. n - 1 in turn (n <= 8),
// the 8 lane sums taken at once by a tree of horizontal adds (exact in i32)
inline float pending_sums(__m256i* v, const float* scale, int n, float one) {
  for (int k = n; k < 8; ++k) v[k] = _mm256_setzero_si256();
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // h0's 128-bit halves: lanes 0..3 and 4..7 of v[0..3], partly summed; h1 likewise for v[4..7]
  const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
  alignas(32) float f[8];
  _mm256_store_ps(f, _mm256_cvtepi32_ps(sums));
  for (int k = 0; k < n; ++k) one = std::fma(f[k], scale[k], one);
  return one;
}

// 8 values of x as float32 (bf16 widened exactly)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(reinterpret_cast<const uint8_t*>(p))), 16));
}

template <int B, typename XT>
inline void quantize_row(const XT* x, int64_t K, int8_t* q, int16_t* sums, float* d, float* s, int32_t* n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / B; ++g) {
    const XT* xg = x + B * g;
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < B / 8; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(xg + 8 * i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float dg = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(dg != 0.0f ? 1.0f / dg : 0.0f);
    __m256i total = _mm256_setzero_si256();
    for (int c = 0; c < B / 32; ++c) {
      __m256i i[4];
      for (int k = 0; k < 4; ++k) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(load8(xg + 32 * c + 8 * k), id),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f)));
      }
      // packs work within 128-bit lanes: 0 4 1 5 2 6 3 7 puts the 32-bit groups back in order
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
      const __m256i b = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + B * g + 32 * c), b);
      const __m256i sum32 = dot4(_mm256_setzero_si256(), _mm256_set1_epi8(1), b);
      total = _mm256_add_epi32(total, sum32);
      if constexpr (B == 256) {  // the two sums of 16: lanes 0..3 and 4..7 of sum32 (each 4 elements)
        const __m128i h16 = _mm_hadd_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
        const __m128i h8 = _mm_hadd_epi32(h16, h16);  // lanes: sum of 0..15, sum of 16..31
        sums[16 * g + 2 * c] = static_cast<int16_t>(_mm_cvtsi128_si32(h8));
        sums[16 * g + 2 * c + 1] = static_cast<int16_t>(_mm_extract_epi32(h8, 1));
        sums[K / 16 + 8 * g + c] = static_cast<int16_t>(_mm_cvtsi128_si32(_mm_hadd_epi32(h8, h8)));  // of 32
      }
    }
    d[g] = dg;
    n[g] = sum_lanes(total);
    s[g] = dg * static_cast<float>(n[g]);
  }
}

template <int QT, size_t... J>
std::array<W8<QT>, sizeof...(J)> make_blocks(const uint8_t* row, int64_t rb, int64_t g, std::index_sequence<J...>) {
  return {W8<QT>(row + J * rb, g)...};
}

constexpr int PF_BLOCKS = 2;  // how many row blocks ahead the weights are prefetched

// Choices that differ between CPUs, made once per process from the CPU's vendor; each keeps the
// results bit for bit (tests/test_repack.py runs every choice). Two are for one row of x
// (decode), one for many (prefill).
//
// l2_ahead: the one-row kernels (regrouped Q2_K and Q3_K aside: tile_panel; and tile_x8, the
// regrouped Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 where a group is short, and for a matrix's last
// groups; x8_rows, which takes the rest, asks for its next work item's instead, at whatever
// distance, where this is not 0) also ask for the weights this many bytes ahead of the ones
// they read, into L2, up to the end of the thread's run of the matrix (ThreadPool::run_end;
// 0: no such prefetch). On the Intel AVX-512 machine (2 MiB L2 a core) the hardware prefetchers alone left
// one row of x well under a plain read's bandwidth. One call per matrix, all matrices of a
// file from memory, 2 threads, interleaved sweeps with and without: 1.1B Q4_K_M 1.13x (its Q4_K
// matrices 1.09-1.19x, three runs), Q5_K_M 1.14x, 7B Q4_K_M 1.06x (Q4_K 1.06-1.26x, its Q6_K
// down projection 1.12x), 1.1B Q6_K 0.98x and 1.08x in two runs. 16 KB ahead was too short for
// the 5632-column rows (1.03x), 32 and 64 KB alike. Without the bound at the chunk's end the
// small matrices (256 rows) lost 10%. tile_x8 on an Intel Xeon with AMX (2 MiB L2 a core),
// the 1.1B shape's matrices regrouped, 1.2 GB of them in turn from memory, 2 threads, the
// choice alternating sweep by sweep (medians of 10): Q4_0 20.2 -> 25.3 GB/s (1.27x; 16 KB
// ahead 1.29x, 64 KB 1.21x), Q4_1 1.28x, Q5_0 1.25x; its prefetch 40 blocks ahead into L1 kept
// beside it, 1.06x and 1.02x (Q4_0, Q5_1). On the Zen 4 machine it made things slower: a plain
// 512 MB read with prefetcht1 8-64 KB ahead ran at 21-23 GB/s on one thread against 30 without,
// 31.5-32 against 34 on two; Q4_K matrices likewise (below).
//
// groups: regrouped Q2_K..Q5_K groups of 8 rows per work item with one row of x. Two
// (V16: both in one 512-bit register, one broadcast of x for 16 rows) on Intel, 1.07-1.12x
// faster than one there (all the Q4_K / Q5_K matrices of the 1.1B and 7B Q4_K_M / Q5_K_M shapes
// from memory, 2 threads, interleaved sweeps; one dot product chain per row or two, no
// difference; a software prefetch 2 super-blocks ahead, within the noise). On Zen 4, which runs
// a 512-bit operation as two 256-bit halves, one group (V8) at a time streams faster: 131072 x
// 2048 from memory, 2 threads, alternating in one process, medians of 12: Q4_K 32-35 GB/s with
// one group and no L2 prefetch against 19-25 with two groups and the prefetch (Q5_K 30 against
// 23); every matrix of the 1.1B Q4_K_M shape in turn, 1.13-1.38x in two runs. Zen 5 decoded
// at its README figures with neither, so CPUs other than Intel's get one group, no prefetch.
//
// x_copy: the Q4_K/Q5_K prefill tiles (tile_xk, V16, more than one row of x) copy their rows of
// x side by side per super-block so that one base register addresses them all. On the Intel
// machine that was 1.05x (a pointer per row left too few registers); on Zen 4 the tiles ran
// faster without it: 512 rows of x against 5632 x 2048 Q4_K in work items of 4 groups, one
// thread, a harness around x8_groups, alternating runs: 54% of the 512-bit peak with the copy,
// 61-62% without (the tile alone from L1: 70% and 78%). CPUs other than Intel's go without.
//
// int_steps: the Q4_K/Q5_K tiles with VNNI scale each sub-block's dot products by an i32
// multiply (tile_xk's INT) rather than in float: Intel's vpmulld is two micro-ops, Zen 4's one
// (measured in tile_xk's comment). Unlike the other choices it changes the bits (each way
// batch invariant, each within the reference's tolerance); with it the VNNI tiles give the
// bits of the AVX2 build's. CPUs other than Intel's take it.
struct CpuChoices {
  int64_t groups;    // one row of x: regrouped Q2_K..Q5_K groups per work item (2 only with MINERVA_V16)
  int64_t l2_ahead;  // one row of x: bytes; 0 = none
  int64_t x_copy;    // many rows: 1 = the V16 Q4_K/Q5_K tiles copy x per super-block (float steps)
  int64_t int_steps; // 1 = the Q4_K/Q5_K tiles scale sub-blocks in i32 (tile_xk's INT), 0 = in float
};
inline const CpuChoices vendor_choices = [] {
  const bool intel = __builtin_cpu_is("intel");
  return CpuChoices{intel ? 2 : 1, intel ? 32768 : 0, intel ? 1 : 0, intel ? 0 : 1};
}();

// The choices that keep the bits are kept per type, so that the planner
// (minerva/kernels/tune.py), which times them on the machine they run on, can give each type
// its fastest: `groups` is for the K-quants as above (1, or 2 with MINERVA_V16) and for the
// 32-weight block types the groups of 8 rows one work item streams side by side with one row
// of x (x8_rows, q8_0_rows: 2 to 4; 1: one at a time, tile_x8 and its prefetches), 4 by
// default; `l2_ahead` and `x_copy` as above, from the vendor until the planner sets them.
// int_steps, which changes the bits, stays one choice for every type.
struct TypeChoices {
  int64_t groups, l2_ahead, x_copy;
};
constexpr int CHOICE_TYPES = MXFP4 + 1;
inline int64_t int_steps = vendor_choices.int_steps;
inline bool is_k_type(int64_t qt) { return qt == Q2_K || qt == Q3_K || qt == Q4_K || qt == Q5_K || qt == Q6_K; }
inline bool int8_type(int64_t qt) {
  return is_k_type(qt) || qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q5_1 || qt == Q8_0 || qt == MXFP4;
}
inline std::array<TypeChoices, CHOICE_TYPES> type_choices = [] {
  std::array<TypeChoices, CHOICE_TYPES> out{};
  for (int qt = 0; qt < CHOICE_TYPES; ++qt)
    out[qt] = {is_k_type(qt) ? vendor_choices.groups : 4, vendor_choices.l2_ahead, vendor_choices.x_copy};
  return out;
}();
template <int QT>
inline const TypeChoices& choices_of() {
  static_assert(QT >= 0 && QT < CHOICE_TYPES);
  return type_choices[QT];
}

// An accumulator kept as one register add after another. Integer adds associate, and with
// the sub-block loop unrolled GCC otherwise computes all of a tile's products first, spills
// them to the stack and adds them up afterwards.
template <class T>
inline void keep_in_register(T& v) { asm volatile("" : "+v"(v)); }

// v, which the compiler may no longer treat as loop invariant: the second group's loads then
// address b + v + offset from one register (GCC had hoisted each v + offset out of the
// super-block loop, to the stack, and reloaded them one load at a time)
inline int64_t opaque(int64_t v) {
  asm("" : "+r"(v));
  return v;
}

// One row of x, the regrouped kernels: how many of a group's G blocks (super-blocks), `bytes`
// each, may prefetch the weights `far` bytes on without passing `end`, the end of the
// thread's run of the matrix (its last stream `last` bytes past the group's start; 0 when
// there is no such prefetch, or no end). Without the bound the small matrices (256 rows) lost
// 10% (Intel AVX-512 machine).
inline int64_t far_blocks(const uint8_t* grp, int64_t last, int64_t far, int64_t bytes, const uint8_t* end, int64_t G) {
  return far == 0 || end == nullptr ? 0 : std::clamp<int64_t>((end - grp - last - far) / bytes, 0, G);
}

// One row of x: sub-block s's (0..7) eighth of the prefetches for the super-block at b (and
// at b + gb, the second group, with TWO): its lines `far` bytes on into L2, and two
// super-blocks on into L1, so that the requests go out evenly through the super-block rather
// than 18-36 at its start. Intel Xeon with AMX, the 1.1B shape's matrices regrouped, 1.2 GB of
// them in turn from memory, 2 threads, the two ways alternating sweep by sweep (medians of
// 10): the L2 prefetches spread alone 1.02-1.05x (Q4_K), 1.05x (Q5_K), 1.03x (Q3_K), 1.04x
// (Q2_K); with the L1 prefetch too, Q4_K 1.08x (one 65536 x 2048 matrix 27.0 -> 29.2 GB/s),
// Q5_K 1.12x, Q3_K 1.07x, Q2_K 1.07x. (Half of the L2 prefetches, every other line, 0.92x;
// the L1 prefetch at the super-block's start beside the L2 burst had been 1.01x.)
template <bool TWO, int64_t BYTES>
inline void prefetch_eighth(const uint8_t* b, int64_t gb, int64_t far, int s) {
  const int64_t lo = (s * BYTES / 8) & ~int64_t{63}, hi = s == 7 ? BYTES : ((s + 1) * BYTES / 8) & ~int64_t{63};
  for (int64_t o = lo; o < hi; o += 64) {
    prefetch_l2(b + far + o);
    prefetch(b + 2 * BYTES + o);
    if constexpr (TWO) {
      prefetch_l2(b + gb + far + o);
      prefetch(b + gb + 2 * BYTES + o);
    }
  }
}

// The K-quants and Q8_0: mr rows of x (from row m0 of a) against nb weight rows, 8 float
// lanes per output reduced in a fixed order at the end; y[i * ldy + j]. Q3_K and Q6_K instead
// sum a super-block's lanes in i32 and take one scalar FMA per super-block, as `row1` and
// tile_panel do.
template <int QT, int mr, int nb>
void tile(const Q8& a, int64_t m0, const uint8_t* row, int64_t rb, float* y, int64_t ldy) {
  using B = W8<QT>;
  constexpr bool ONE_SUM = QT == Q3_K || QT == Q6_K;
  __m256 acc[mr][nb];
  float one[mr][nb];  // ONE_SUM
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nb; ++j) {
      acc[i][j] = _mm256_setzero_ps();
      one[i][j] = 0.0f;
    }
  const int64_t ahead = PF_BLOCKS * nb * rb, step = (nb * rb + a.G - 1) / a.G;
  for (int64_t g = 0; g < a.G; ++g) {
    for (int64_t o = g * step; o < (g + 1) * step; o += 64) prefetch(row + ahead + o);
    const auto blocks = make_blocks<QT>(row, rb, g, std::make_index_sequence<nb>{});
    if constexpr (QT == Q8_0) {  // acc += (d_w * d_x) * dot, lane by lane (its weights need no decoding)
      __m256i w[nb], wa[nb];
      __m256 dw[nb];
      for (int j = 0; j < nb; ++j) {
        w[j] = blocks[j].w();
        wa[j] = _mm256_abs_epi8(w[j]);
        dw[j] = _mm256_set1_ps(f16(blocks[j].b));
      }
      for (int i = 0; i < mr; ++i) {
        const int64_t r = m0 + i;
        const __m256i xv = load256(a.q + r * a.K + 32 * g);
        const __m256 dx = _mm256_set1_ps(a.d[r * a.G + g]);
        for (int j = 0; j < nb; ++j) {
          const __m256i p = dot4(_mm256_setzero_si256(), wa[j], _mm256_sign_epi8(xv, w[j]));
          acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(dw[j], dx), _mm256_cvtepi32_ps(p), acc[i][j]);
        }
      }
    } else {  // an exact i32 sum per super-block, then one float FMA
      __m256 dx[mr];  // x's scales, and below the weights': products of broadcasts, lane by lane
      for (int i = 0; i < mr; ++i) dx[i] = _mm256_set1_ps(a.d[(m0 + i) * a.G + g]);
      if constexpr (B::MINS) {  // the offsets first, so the mins need no register during the sums
        __m256 dmin[nb];
        for (int j = 0; j < nb; ++j) dmin[j] = _mm256_set1_ps(-blocks[j].dmin());
        for (int i = 0; i < mr; ++i) {
          const __m256i sums = load256(a.p + (m0 + i) * a.lp + 16 * g);  // x's 16 sums of 16
          for (int j = 0; j < nb; ++j)
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2(_mm256_setzero_si256(), blocks[j].mins(), sums)),
                                        _mm256_mul_ps(dmin[j], dx[i]), acc[i][j]);
        }
      }
      __m256i isum[mr][nb];
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nb; ++j) isum[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        __m256i w[nb], sc[nb];
        for (int j = 0; j < nb; ++j) {
          w[j] = blocks[j].w(s);
          sc[j] = blocks[j].sc(s);
        }
        for (int i = 0; i < mr; ++i) {
          const __m256i xv = load256(a.q + (m0 + i) * a.K + 256 * g + 32 * s);
          for (int j = 0; j < nb; ++j) {
            isum[i][j] = dot2(isum[i][j], _mm256_maddubs_epi16(w[j], xv), sc[j]);
            keep_in_register(isum[i][j]);
          }
        }
      }
      __m256 dw[nb];
      for (int j = 0; j < nb; ++j) dw[j] = _mm256_set1_ps(blocks[j].d());
      for (int i = 0; i < mr; ++i) {
        const int64_t r = m0 + i;
        for (int j = 0; j < nb; ++j) {
          if constexpr (B::BIAS > 0) {  // the stored values are w + 2^BIAS; x's 16 sums of 16
            const __m256i sums = load256(a.p + r * a.lp + 16 * g);
            isum[i][j] =
                _mm256_sub_epi32(isum[i][j], _mm256_slli_epi32(_mm256_madd_epi16(blocks[j].sc16, sums), B::BIAS));
          }
          if constexpr (ONE_SUM)
            one[i][j] = std::fma(static_cast<float>(sum_lanes(isum[i][j])), blocks[j].d() * a.d[r * a.G + g], one[i][j]);
          else
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][j]), _mm256_mul_ps(dw[j], dx[i]), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nb; ++j) y[i * ldy + j] = ONE_SUM ? one[i][j] : reduce_add(acc[i][j]);  // a fixed lane order
}

// The K-quants with one row of x (decode): nb weight rows, a super-block's rows one at a
// time so that only one block's state is live (with all nb at once the registers spill).
// Per output the same operations as `tile`, in the same order. The weights are prefetched
// one tile (nb rows) ahead: on the AVX-512 machine, all Q6_K matrices of the 1.1B Q4_K_M
// shape one after another, one row of x each, took 5.26-5.30 ms with 2 rows a tile (or 1)
// and one tile ahead, against 5.83 with 4 rows a tile and 5.9-6.0 with 4 rows two tiles ahead
// (the layout before; 6.9 with 8 rows), medians of 30 sweeps in one process, interleaved.
//
// Q3_K and Q6_K instead sum a super-block's 8 lanes in i32 (exact) and take one scalar
// acc = fma(sum, d * d_x, acc) per super-block: the operations of tile_panel, which serves
// more rows of x.
constexpr int64_t ROW1_NB = 2;
// A tile further ahead than this is prefetched to L2, not L1: with long rows (Mistral-7B's
// down projection, 14336 columns: 23 KB a tile of Q6_K) the prefetched tile and x's 14 KB
// overflow the 32 KB L1. 4096 x 14336 Q6_K from memory, 12 copies in turn, 2 threads,
// alternating runs: 28.2-30.6 GB/s against 19.9-24.4 with every prefetch to L1; 2048 x 5632
// (9 KB a tile, to L1 as before) the same; to L2 there as well, 2048-column rows ran slower.
constexpr int64_t ROW1_L1_AHEAD = 12288;

// Q3_K and Q6_K (one exact i32 per super-block, so only the sum of the lanes counts) with VNNI
// and AVX-512BW: two sub-blocks' dot products as exact sums of 4 (dpbusd; at most 4 * 63 * 127
// in magnitude, so they fit i16), packed side by side into i16 and multiplied by their four
// scales in one dpwssd, the scales picked by one vpermw. Per 32 weights that is one multiply
// and half a pack, half a dpwssd and half a permute, where maddubs, a scale shuffle and dpwssd
// took three; the integer is the same. (Q3_K, one row, 256 x 2048 from L2, one thread, a
// standalone copy of the loop: 1.16x.)
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
constexpr bool SUB_BLOCK_PAIRS = true;
template <class B>
inline __m256i sub_block_pairs(const B& blk, const int8_t* xg) {
  __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    const int s = 2 * p;
    const __m256i ta = dot4(_mm256_setzero_si256(), blk.w(s), load256(xg + 32 * s));
    const __m256i tb = dot4(_mm256_setzero_si256(), blk.w(s + 1), load256(xg + 32 * s + 32));
    // i16 lanes after the pack: ta 0..3, tb 0..3 | ta 4..7, tb 4..7; a sub-block's lanes 0..3
    // hold its first 16 weights (scale 2s), 4..7 its last 16 (scale 2s + 1)
    const short a = static_cast<short>(2 * s), a1 = static_cast<short>(a + 1), b = static_cast<short>(a + 2),
                b1 = static_cast<short>(a + 3);
    const __m256i scales = _mm256_permutexvar_epi16(_mm256_setr_epi16(a, a, a, a, b, b, b, b, a1, a1, a1, a1, b1, b1, b1, b1),
                                                    blk.sc16);
    isum = dot2(isum, _mm256_packs_epi32(ta, tb), scales);
  }
  return isum;
}
#else
constexpr bool SUB_BLOCK_PAIRS = false;
template <class B>
inline __m256i sub_block_pairs(const B&, const int8_t*) { return _mm256_setzero_si256(); }
#endif

template <int QT, int nb>
void row1(const Q8& a, const uint8_t* row, int64_t rb, float* y, const uint8_t* end) {
  using B = W8<QT>;
  constexpr bool ONE_SUM = QT == Q3_K || QT == Q6_K;
  __m256 acc[nb];
  float one[nb];  // ONE_SUM
  for (int j = 0; j < nb; ++j) {
    acc[j] = _mm256_setzero_ps();
    one[j] = 0.0f;
  }
  // ONE_SUM: up to 8 super-blocks' i32 lanes and scales kept, then their lane sums taken
  // together and added to `one` in order (pending_sums): the same sums and FMAs as one
  // super-block at a time, without a horizontal sum and an FMA chain closing every super-block
  // (samples piled up there). Zen 4, 2 threads, benchmarks/matmul_sweep.py: the 1.1B Q3_K_M
  // file's Q3_K gate/up 25.9-26.4 -> 29.1-29.2 GB/s (its sweep 0.80 -> 0.86 of the large
  // matrix's bandwidth), the Q6_K file's sweep 0.90 -> 0.92; from L3, one thread, Q3_K 36.5 ->
  // 38.4 GMAC/s, Q6_K 38.1 -> 38.7.
  [[maybe_unused]] __m256i pend[ONE_SUM ? nb : 1][8];
  [[maybe_unused]] float pscale[ONE_SUM ? nb : 1][8];
  const int64_t ahead = nb * rb, step = (nb * rb + a.G - 1) / a.G;
  // the tile l2_ahead or more bytes ahead (at least 2 tiles), while still in the chunk
  const int64_t far = std::max<int64_t>(2, (choices_of<QT>().l2_ahead + ahead - 1) / ahead) * ahead;
  const bool to_l2 = choices_of<QT>().l2_ahead > 0 && row + far + ahead <= end;
  for (int64_t g = 0; g < a.G; ++g) {
    if (to_l2)
      for (int64_t o = g * step; o < (g + 1) * step; o += 64) prefetch_l2(row + far + o);
    if (ahead > ROW1_L1_AHEAD)
      for (int64_t o = g * step; o < (g + 1) * step; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + ahead + o), _MM_HINT_T1);
    else
      for (int64_t o = g * step; o < (g + 1) * step; o += 64) prefetch(row + ahead + o);
    const int8_t* xg = a.q + 256 * g;
    const float dx = a.d[g];
    const __m256i sums = load256(a.p + 16 * g);  // x's 16 sums of 16 (mins, bias)
    [[maybe_unused]] __m256i sc2;  // Q3_K, two rows: both rows' scales decoded together
    if constexpr (QT == Q3_K && nb == 2) sc2 = q3k_scales2(row + g * 110, row + rb + g * 110);
    for (int j = 0; j < nb; ++j) {
      const B blk = [&] {
        if constexpr (QT == Q3_K && nb == 2) return B(row + j * rb, g, j ? _mm256_extracti128_si256(sc2, 1) : _mm256_castsi256_si128(sc2));
        else return B(row + j * rb, g);
      }();
      if constexpr (B::MINS)
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(blk.mins(), sums)),
                                 _mm256_set1_ps(-blk.dmin() * dx), acc[j]);
      __m256i isum = _mm256_setzero_si256();
      if constexpr (ONE_SUM && SUB_BLOCK_PAIRS) {
        isum = sub_block_pairs(blk, xg);
      } else {
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s)
          isum = dot2(isum, _mm256_maddubs_epi16(blk.w(s), load256(xg + 32 * s)), blk.sc(s));
      }
      if constexpr (B::BIAS > 0) isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(blk.sc16, sums), B::BIAS));
      if constexpr (ONE_SUM) {
        pend[j][g & 7] = isum;
        pscale[j][g & 7] = blk.d() * dx;
      } else {
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(blk.d() * dx), acc[j]);
      }
    }
    if constexpr (ONE_SUM)
      if ((g & 7) == 7 || g + 1 == a.G)
        for (int j = 0; j < nb; ++j) one[j] = pending_sums(pend[j], pscale[j], (g & 7) + 1, one[j]);
  }
  for (int j = 0; j < nb; ++j) y[j] = ONE_SUM ? one[j] : reduce_add(acc[j]);  // a fixed lane order, as `tile`
}

// the f16 at byte `off` of 8 blocks, as 8 floats
template <int QT>
inline __m256 f16x8(const std::array<W8<QT>, 8>& blocks, int off) {
  uint16_t h[8];
  for (int j = 0; j < 8; ++j) std::memcpy(h + j, blocks[j].b + off, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

// the scales of 8 blocks, as 8 floats: the f16 at byte 0, or MXFP4's E8M0 byte
template <int QT>
inline __m256 scales8(const std::array<W8<QT>, 8>& blocks) {
  if constexpr (QT == MXFP4) {
    float d[8];
    for (int j = 0; j < 8; ++j) d[j] = e8m0_half(blocks[j].b[0]);
    return _mm256_loadu_ps(d);
  } else {
    return f16x8<QT>(blocks, 0);
  }
}

// lane j: the sum of the 32 products of row j's pair sums p[j] (16 i16 from maddubs, each at
// most 2 * 31 * 127 = 7874; exact integers, so the order is free): two rows' pairs are added
// once more in i16, then widened
inline __m256i sum_rows(const __m256i* p) {
  __m256i q[4];  // lanes of madd(hadd(p2k, p2k+1)): rows 2k, 2k, 2k+1, 2k+1 in each half
  for (int k = 0; k < 4; ++k) q[k] = _mm256_madd_epi16(_mm256_hadd_epi16(p[2 * k], p[2 * k + 1]), ones16());
  // each half of hadd(q0, q1): rows 0, 1, 2, 3 (that half's part)
  const __m256i a = _mm256_hadd_epi32(q[0], q[1]), b = _mm256_hadd_epi32(q[2], q[3]);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// mr rows of 8 outputs, one per lane, to y[i * ldy + j] (the first `valid` lanes)
template <int mr>
inline void store_rows(const __m256* acc, int valid, float* y, int64_t ldy) {
  for (int i = 0; i < mr; ++i) {
    if (valid == 8) {
      _mm256_storeu_ps(y + i * ldy, acc[i]);
    } else {
      float out[8];
      _mm256_storeu_ps(out, acc[i]);
      std::copy(out, out + valid, y + i * ldy);
    }
  }
}

// The float steps of a 32-weight block for row r of x, 8 weight rows in the lanes: `dot` the
// exact integer dot products of the stored values, dw the weights' scales, m their offsets
// (Q4_1/Q5_1): acc = fma(dot - 2^BIAS * sum(q), d_w * d_x, acc), then acc = fma(m, d_x * sum(q), acc)
template <typename B>
inline __m256 block_step(const Q8& a, int64_t r, int64_t g, __m256i dot, __m256 dw, __m256 m, __m256 acc) {
  if constexpr (B::BIAS > 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(a.n[r * a.G + g] << B::BIAS));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[r * a.G + g])), acc);
  if constexpr (B::OFFSET) acc = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[r * a.G + g]), acc);
  return acc;
}

// Q4_0, Q4_1, Q5_0, Q5_1, MXFP4: mr rows of x against 8 weight rows (the first `valid` of them
// real; the others repeat the last and are dropped), one weight row per float lane. Per
// block the 8 rows' exact integer dot products gather into one vector, and row j's output
// is acc_j = fma(dot_jg, d_wjg * d_xg, acc_j) (then acc_j = fma(m_jg, d_xg * sum(q_g), acc_j)
// for Q4_1/Q5_1) over the blocks g: the same operations whatever the tile.
template <int QT, int mr>
void tile8(const Q8& a, int64_t m0, const uint8_t* row, int64_t rb, int valid, float* y, int64_t ldy) {
  using B = W8<QT>;
  std::array<const uint8_t*, 8> rows;
  for (int j = 0; j < 8; ++j) rows[j] = row + std::min(j, valid - 1) * rb;
  __m256 acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t ahead = PF_BLOCKS * 8 * rb, step = (8 * rb + a.G - 1) / a.G;
  for (int64_t g = 0; g < a.G; ++g) {
    if (valid == 8)
      for (int64_t o = g * step; o < (g + 1) * step; o += 64) prefetch(row + ahead + o);
    const std::array<B, 8> blocks = {B(rows[0], g), B(rows[1], g), B(rows[2], g), B(rows[3], g),
                                     B(rows[4], g), B(rows[5], g), B(rows[6], g), B(rows[7], g)};
    __m256i w[8];
    for (int j = 0; j < 8; ++j) w[j] = blocks[j].w();
    const __m256 dw = scales8<QT>(blocks);
    __m256 m = _mm256_setzero_ps();  // the offsets, for Q4_1/Q5_1
    if constexpr (B::OFFSET) m = f16x8<QT>(blocks, 2);
    for (int i = 0; i < mr; ++i) {
      const int64_t r = m0 + i;
      const __m256i xv = load256(a.q + r * a.K + 32 * g);
      __m256i p[8];
      for (int j = 0; j < 8; ++j) p[j] = _mm256_maddubs_epi16(w[j], xv);
      acc[i] = block_step<B>(a, r, g, sum_rows(p), dw, m, acc[i]);
    }
  }
  store_rows<mr>(acc, valid, y, ldy);
}

// Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 regrouped at load (minerva/kernels/repack.py): a group of 8 weight
// rows keeps their block g together, d[8] | m[8] | qh[8] | qs[128], qs chunk k of row j at
// 32k + 4j. One 32-byte load gives chunk k of all 8 rows, one row per 32-bit lane, and
// maddubs against x's 4 bytes broadcast to every lane sums each row in its own lane.
// the types with a regrouped layout (minerva/kernels/repack.py's TYPES)
template <int QT>
constexpr bool has_x8 = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == MXFP4 || QT == Q8_0 ||
                        QT == Q2_K || QT == Q3_K || QT == Q4_K || QT == Q5_K;

// MXFP4 regrouped: e[8] | qs[128], its nibbles looked up into values + 16 as W8<MXFP4> does.
// Q8_0 regrouped: d[8] | qs[256], its signed bytes whole (chunks k = 0..7).
// how many blocks of a group ahead the regrouped kernels prefetch (about 5 KB). GPT-OSS's
// gate/up for one token's 4 experts, grouped matrix by matrix, on the AVX-512 machine: 0.84 ms
// a layer with 40 blocks against 1.04 ms with 16 (round robin over the experts: 1.9 ms with
// 4, 1.4 ms with 16); ad-hoc timings, one layer repeated.
constexpr int64_t X8_AHEAD = 40;

template <int QT>
struct X8 {
  static constexpr bool OFFSET = W8<QT>::OFFSET, FIFTH = QT == Q5_0 || QT == Q5_1, LOOKUP = QT == MXFP4;
  static constexpr bool WIDE = FIFTH || LOOKUP;  // values past 4 bits: maddubs lanes up to 2 * 31 * 127
  static constexpr int BIAS = W8<QT>::BIAS;
  static constexpr int M_AT = 16, QH_AT = OFFSET ? 32 : 16, QS_AT = LOOKUP ? 8 : QH_AT + (FIFTH ? 32 : 0);
  static constexpr int64_t BYTES = 8 * Layout<QT>::bytes, QS_BYTES = QT == Q8_0 ? 256 : 128;
  static_assert(QS_AT + QS_BYTES == BYTES, "the regrouped block holds the 8 GGML blocks' bytes");
  // the 8 rows' scales: 8 f16, or 8 E8M0 bytes as e8m0_half computes them
  static __m256 scales(const uint8_t* b) {
    if constexpr (LOOKUP) {
      const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
      const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
      return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
    } else {
      return _mm256_cvtph_ps(load128(b));
    }
  }
  // a chunk's 32 low or high nibbles as the values the dot products take
  static __m256i values(__m256i nibbles) {
    if constexpr (LOOKUP)
      return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_add_epi8(mxfp4_values(), _mm_set1_epi8(16))), nibbles);
    else
      return nibbles;
  }
};

// One regrouped block of Q4_0, Q4_1, Q5_0, Q5_1 or MXFP4 (not Q8_0) at b: its 8 rows' values
// unpacked once (lo[k], hi[k]: chunk k's low and high nibbles, with the fifth bit) and offsets
// m (Q4_1/Q5_1); dot(xq) the 8 rows' exact integer dot products with x's 32 values at xq.
template <int QT>
struct X8Block {
  using X = X8<QT>;
  __m256i lo[4], hi[4];
  __m256 m = _mm256_setzero_ps();
  explicit X8Block(const uint8_t* b) {
    if constexpr (X::OFFSET) m = _mm256_cvtph_ps(load128(b + X::M_AT));
    for (int k = 0; k < 4; ++k) {
      const __m256i v = load256(b + X::QS_AT + 32 * k);
      lo[k] = X::values(low4(v));
      hi[k] = X::values(high4(v));
    }
    if constexpr (X::FIFTH) {
      const __m256i qh = load256(b + X::QH_AT), bit4 = _mm256_set1_epi8(0x10);
      for (int k = 0; k < 4; ++k) {
        lo[k] = _mm256_or_si256(lo[k], _mm256_and_si256(_mm256_srli_epi32(qh, k), bit4));
        hi[k] = _mm256_or_si256(hi[k], _mm256_and_si256(_mm256_slli_epi32(qh, 4 - k), bit4));
      }
    }
  }
  __m256i dot(const int8_t* xq) const {
    auto pairs = [&](int k) {
      int32_t x0, x1;
      std::memcpy(&x0, xq + 4 * k, 4);
      std::memcpy(&x1, xq + 16 + 4 * k, 4);
      return _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], _mm256_set1_epi32(x0)),
                              _mm256_maddubs_epi16(hi[k], _mm256_set1_epi32(x1)));
    };
    if constexpr (VNNI) {  // low and high nibbles in two chains, widened as they go
      __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
      for (int k = 0; k < 4; ++k) {
        d0 = dot4x(d0, lo[k], xq + 4 * k);
        d1 = dot4x(d1, hi[k], xq + 16 + 4 * k);
      }
      return _mm256_add_epi32(d0, d1);
    } else if constexpr (X::WIDE) {
      return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(pairs(0), pairs(1)), ones16()),
                              _mm256_madd_epi16(_mm256_add_epi16(pairs(2), pairs(3)), ones16()));
    } else {
      return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(pairs(0), pairs(1)),
                                                _mm256_add_epi16(pairs(2), pairs(3))), ones16());
    }
  }
};

// The same outputs as tile8 on the GGML layout, bit for bit: per block the same exact
// integer dot product per row (here summed in i16 before one madd: a lane of maddubs is at
// most 2 * 15 * 127 = 3810 for 4-bit values, so 8 of them fit; 5-bit values, at most 7874,
// and MXFP4's values + 16, at most 7112, go 4 at a time), then the same float operations.
//
// Q8_0 (its own float rounding, not the GGML layout's: a block's exact i32 dot product per
// row in one lane, then one FMA, where the GGML layout keeps 8 partial lanes per output):
// per chunk |w| against x's 4 bytes given w's signs, each chunk's pairs (up to 2 * 128 * 127)
// widened to i32 on their own; with VNNI (no i16 pair sums to saturate) w + 128 as the unsigned
// operand against x, and 128 sum(x) subtracted: the same exact sum in fewer steps (x enters as
// an embedded broadcast, where |w| against x given w's signs needs x in a register).
template <int QT, int mr>
void tile_x8(const Q8& a, int64_t m0, const uint8_t* grp, int valid, float* y, int64_t ldy,
             const uint8_t* end = nullptr) {
  using X = X8<QT>;
  __m256 acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t FAR = choices_of<QT>().l2_ahead / X::BYTES * X::BYTES;
  const int64_t far_g = mr > 1 ? 0 : far_blocks(grp, 0, FAR, X::BYTES, end, a.G);
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = grp + g * X::BYTES;
    if (g < far_g)
      for (int64_t o = 0; o < X::BYTES; o += 64) prefetch_l2(b + FAR + o);
    for (int64_t o = 0; o < X::BYTES; o += 64) prefetch(b + X8_AHEAD * X::BYTES + o);
    const __m256 dw = X::scales(b);
    if constexpr (QT == Q8_0) {
      __m256i dot[2][mr];  // the even and the odd chunks: two dependency chains per row
      for (int i = 0; i < mr; ++i) dot[0][i] = dot[1][i] = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        const __m256i w = load256(b + X::QS_AT + 32 * k);
        if constexpr (VNNI) {  // w + 128 unsigned against x, 128 sum(x) taken off below
          const __m256i wu = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
          for (int i = 0; i < mr; ++i) dot[k & 1][i] = dot4x(dot[k & 1][i], wu, a.q + (m0 + i) * a.K + 32 * g + 4 * k);
        } else {
          const __m256i wa = _mm256_abs_epi8(w);
          for (int i = 0; i < mr; ++i) {
            int32_t x4;
            std::memcpy(&x4, a.q + (m0 + i) * a.K + 32 * g + 4 * k, 4);
            dot[k & 1][i] = dot4(dot[k & 1][i], wa, _mm256_sign_epi8(_mm256_set1_epi32(x4), w));
          }
        }
      }
      for (int i = 0; i < mr; ++i) {
        __m256i dot_i = _mm256_add_epi32(dot[0][i], dot[1][i]);
        if constexpr (VNNI) dot_i = _mm256_sub_epi32(dot_i, _mm256_set1_epi32(a.n[(m0 + i) * a.G + g] << 7));
        acc[i] = block_step<X>(a, m0 + i, g, dot_i, dw, _mm256_setzero_ps(), acc[i]);
      }
      continue;
    }
    const X8Block<QT> blk(b);
    for (int i = 0; i < mr; ++i) {
      const int64_t r = m0 + i;
      acc[i] = block_step<X>(a, r, g, blk.dot(a.q + r * a.K + 32 * g), dw, blk.m, acc[i]);
    }
  }
  store_rows<mr>(acc, valid, y, ldy);
}

// Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 regrouped, one row of x (decode): NG groups (8 NG weight rows)
// at a time, block by block, each group read as its own stream; per output the same
// operations as tile_x8<QT, 1>. Four streams a thread, which the hardware prefetchers follow,
// read faster than one with tile_x8's prefetches: Intel Xeon with AMX, 2 threads, the two
// ways alternating in one process, every matrix of the 1.1B Q4_0 shape in turn from memory,
// 22.0 against 20.4 GB/s (medians of 10 sweeps, 1.075x); its greedy decode 31.0 against 28.9
// tokens/s (8 of 8 pairs faster).
// Where the CPU takes the L2 prefetch (choices.l2_ahead), each stream also asks for its lines
// NG groups on, the same place in the next work item (the next 8 NG rows), into L2, up to the
// end of the thread's run: the prefetchers do not start the next item's four streams before
// they are read. The same machine, with and without, alternating in one process: the 1.1B
// Q4_0 shape's greedy decode 42.45 against 36.69 tokens/s (10 of 10 pairs faster, 1.157x;
// its matrices in turn from memory 1.09-1.13x), the 7B Q4_0 shape's 6.53 against 6.07
// (1.088x), GPT-OSS-20B-shaped MXFP4 experts (4 of 32 a layer, from memory) 1.25x (5760 x
// 2880) and 1.085x (2880 x 2880); Q4_1, Q5_0 and Q5_1 matrices of the 1.1B and 7B shapes
// 1.11-1.24x; Gemma 3 270M's decode the same (1.003x). A fixed 16 KB ahead instead: 0.84x of
// this; two items ahead, the same. (Q8_0's q8_0_rows, below, with it: 0.96x.)
// Shorter groups are too short a stream each for the hardware prefetchers: Gemma 3 270M's Q5_0
// matrices (640 columns, 3.5 KB a group) in four streams decoded 0.954x as fast as one
// group at a time with tile_x8's prefetches (the two alternating in one process, medians of
// 10); the 1.1B shape's Q4_0 groups (9.2 KB and 25 KB) gained as above.
constexpr int64_t X8_STREAM_BYTES = 8192;
template <int QT, int NG>
void x8_rows(const Q8& a, const uint8_t* grp, int64_t gb, float* y, const uint8_t* end) {
  using X = X8<QT>;
  __m256 acc[NG];
  for (int n = 0; n < NG; ++n) acc[n] = _mm256_setzero_ps();
  const int64_t far = choices_of<QT>().l2_ahead > 0 ? NG * gb : 0;  // the next work item's same place
  const int64_t far_g = far_blocks(grp, (NG - 1) * gb, far, X::BYTES, end, a.G);
  for (int64_t g = 0; g < a.G; ++g) {
    // each stream's lines that block g reaches for the first time, far bytes on
    const int64_t lo = (g * X::BYTES + 63) & ~int64_t{63}, hi = ((g + 1) * X::BYTES + 63) & ~int64_t{63};
    for (int n = 0; n < NG; ++n) {
      const uint8_t* b = grp + n * gb + g * X::BYTES;
      if (g < far_g)
        for (int64_t o = lo; o < hi; o += 64) prefetch_l2(grp + n * gb + far + o);
      const X8Block<QT> blk(b);
      acc[n] = block_step<X>(a, 0, g, blk.dot(a.q + 32 * g), X::scales(b), blk.m, acc[n]);
    }
  }
  for (int n = 0; n < NG; ++n) _mm256_storeu_ps(y + 8 * n, acc[n]);
}

// Q8_0 regrouped, one row of x (decode): NG groups (8 NG weight rows) at a time, sharing x's
// loads; per output the same operations as tile_x8<Q8_0, 1>. No software prefetch: four
// groups are four streams the hardware prefetcher follows. (One thread, 65536 x 2880, from
// memory: 8.7-9.8 ms with four groups and none, 11.7-18.4 ms with two groups and 40 blocks
// ahead, as tile_x8 does, 9.8-12.8 ms (median 10.0) for the GGML layout's rows; `benchmarks/int8_kernels.py
// --type Q8_0 --rows 65536 --cols 2880 --m 1 --threads 1`.)
template <int NG>
void q8_0_rows(const Q8& a, const uint8_t* grp, int64_t gb, float* y) {
  using X = X8<Q8_0>;
  __m256 acc[NG];
  for (int n = 0; n < NG; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b[NG];
    for (int n = 0; n < NG; ++n) b[n] = grp + n * gb + g * X::BYTES;
    __m256i dot[NG][2];
    for (int n = 0; n < NG; ++n) dot[n][0] = dot[n][1] = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {  // the even and the odd chunks in two chains per group
      int32_t x4;
      std::memcpy(&x4, a.q + 32 * g + 4 * k, 4);
      const __m256i xb = _mm256_set1_epi32(x4);
      for (int n = 0; n < NG; ++n) {
        const __m256i w = load256(b[n] + X::QS_AT + 32 * k);
        if constexpr (VNNI)  // as tile_x8
          dot[n][k & 1] = dot4(dot[n][k & 1], _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))), xb);
        else
          dot[n][k & 1] = dot4(dot[n][k & 1], _mm256_abs_epi8(w), _mm256_sign_epi8(xb, w));
      }
    }
    const __m256i bias = _mm256_set1_epi32(VNNI ? a.n[g] << 7 : 0);
    for (int n = 0; n < NG; ++n)
      acc[n] = block_step<X>(a, 0, g, _mm256_sub_epi32(_mm256_add_epi32(dot[n][0], dot[n][1]), bias), X::scales(b[n]),
                             _mm256_setzero_ps(), acc[n]);
  }
  for (int n = 0; n < NG; ++n) _mm256_storeu_ps(y + 8 * n, acc[n]);
}

// Rows of x are taken MR at a time (the last tile shorter): tile_rows(m, rows) runs a tile
// of `rows` rows of x from row m.
template <int MR, typename F>
inline void x_tiles(int64_t M, const F& tile_rows) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile_rows(m, std::integral_constant<int, MR>{});
  if constexpr (MR > 4)
    if (M - m >= 4) {
      tile_rows(m, std::integral_constant<int, 4>{});
      m += 4;
    }
  if constexpr (MR > 3) if (M - m == 3) tile_rows(m, std::integral_constant<int, 3>{});
  if constexpr (MR > 2) if (M - m == 2) tile_rows(m, std::integral_constant<int, 2>{});
  if constexpr (MR > 1) if (M - m == 1) tile_rows(m, std::integral_constant<int, 1>{});
}

// M > 1, K-quants and Q8_0: tiles of 4 rows of x against 2 weight rows (measured on AVX2,
// one thread, M = 128: 1.1-1.8x the speed of 2x2, 2x1 or 1x1 tiles)
constexpr int K_MR = 4, K_NB = 2;

// For M > 1 the weight rows go in panels of 32 (a few tens of KB, kept in L1/L2) and each
// tile of x (4 rows, one K-long row each) meets the whole panel while it sits in L1: x is
// read from L2/L3 once per panel rather than once per weight row.
constexpr int64_t PANEL = 32;

template <int QT>
void matmul_panels(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, at::BFloat16* yb = nullptr);
// Q3_K and Q6_K take regrouped panels from this many rows of x, `tile` below it. AVX-512 machine, Q6_K,
// 5632 x 2048, 2 threads, two runs: 2 rows 0.22-0.45 ms with `tile` against 0.39 with panels,
// 4 rows 0.36 against 0.48, 8 rows 0.73 against 0.67-0.69, 16 rows 1.42 against 1.09-1.43,
// 32 rows 2.8 against 1.9.
constexpr int64_t PANELS_FROM = 8;

template <int QT>
void matmul(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y) {
  const int64_t rb = row_bytes<QT>(a.K);
  if constexpr (QT == Q3_K || QT == Q6_K)
    if (M >= PANELS_FROM) return matmul_panels<QT>(a, M, W, N, y);
  if constexpr (!is_k<QT> && QT != Q8_0) {  // 8 weight rows against tiles of 4 rows of x
    const int64_t per = M == 1 ? 8 : PANEL;
    minerva::parallel_for(0, (N + per - 1) / per, M == 1 ? 2 : 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = per * blk, n1 = std::min(N, n0 + per);
        x_tiles<4>(M, [&](int64_t m, auto rows) {
          for (int64_t n = n0; n < n1; n += 8) {
            const int valid = static_cast<int>(std::min<int64_t>(8, N - n));
            tile8<QT, decltype(rows)::value>(a, m, W + n * rb, rb, valid, y + m * N + n, N);
          }
        });
      }
    });
  } else if (M == 1) {  // Q8_0: four independent weight rows keep the pipes busy
    constexpr int64_t nb = QT == Q8_0 ? 4 : ROW1_NB;
    minerva::parallel_for(0, (N + nb - 1) / nb, 16 / nb, [&](int64_t b0, int64_t b1) {
      const uint8_t* end = W + std::min(N, nb * minerva::ThreadPool::run_end(b1)) * rb;  // this thread's run's weights
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n = nb * blk;
        if constexpr (QT == Q8_0) {
          if (n + 4 <= N) tile<QT, 1, 4>(a, 0, W + n * rb, rb, y + n, N);
          else
            for (int64_t j = n; j < N; ++j) tile<QT, 1, 1>(a, 0, W + j * rb, rb, y + j, N);
        } else {
          if (n + nb <= N) row1<QT, nb>(a, W + n * rb, rb, y + n, end);
          else
            for (int64_t j = n; j < N; ++j) row1<QT, 1>(a, W + j * rb, rb, y + j, end);
        }
      }
    });
  } else {  // more rows: tiles of K_MR rows of x against K_NB weight rows, panel by panel
    minerva::parallel_for(0, (N + PANEL - 1) / PANEL, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = PANEL * blk, n1 = std::min(N, n0 + PANEL);
        x_tiles<K_MR>(M, [&](int64_t m, auto rows) {
          int64_t n = n0;
          for (; n + K_NB <= n1; n += K_NB) tile<QT, decltype(rows)::value, K_NB>(a, m, W + n * rb, rb, y + m * N + n, N);
          for (; n < n1; ++n) tile<QT, decltype(rows)::value, 1>(a, m, W + n * rb, rb, y + m * N + n, N);
        });
      }
    });
  }
}

// The regrouped K-quant kernels below run on one group of 8 weight rows per 256-bit register
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
  static I i32_at(const int32_t* p) {  // *p in every lane, broadcast by the load (GCC would move it through a register)
    I v;
    asm("vpbroadcastd %1, %0" : "=v"(v) : "m"(*p));
    return v;
  }
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
  static I dot4(I acc, I u, I s) { return ::dot4(acc, u, s); }
  static I dot4x(I acc, I u, const int8_t* p) { return ::dot4x(acc, u, p); }
  static I dot2(I acc, I a, I b) { return ::dot2(acc, a, b); }
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MINERVA_V16 1
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
  static I dot4x(I acc, I u, const int8_t* p) {  // as ::dot4x
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
constexpr int V16_MR = 8;  // rows of x per tile with V16
// ... and for the Q4_K/Q5_K tiles with int steps: Zen 4, 512 rows of x against 11264 x 2048
// Q4_K, one thread, alternating builds: 161-167 GMAC/s with 6 rows against 145-162 with 8
// (7 of 7 pairs; Q5_K the same), 10 rows 151-152
constexpr int V16_INT_MR = 6;
#endif

// Q4_K regrouped: per super-block of a group, d[8] | dmin[8] | the 12 bytes of scales and
// mins as three u32 per row, u0[8] | u1[8] | u2[8] | qs, chunk q (bytes 4q .. 4q + 3 of a row's
// 128: sub-block 2 (q / 8) in the low nibbles, 2 (q / 8) + 1 in the high ones, elements
// 4 (q % 8) .. + 3) of row j at 128 + 32q + 4j. The 8 rows' scales and mins unpack together,
// one row per 32-bit lane, with KHeader's shifts and masks.
template <class V>
struct XK {
  using I = typename V::I;
  I sc03, sc47, mn03, mn47;  // lane j: the 6-bit scales (mins) of sub-blocks 0..3, 4..7 of row j
  XK(const uint8_t* b, int64_t gb) {
    const I u0 = V::load(b + 32, gb), u1 = V::load(b + 64, gb), u2 = V::load(b + 96, gb);
    const I low6 = V::bytes(0x3f), low4 = V::bytes(0x0f), low2 = V::bytes(0x03);
    sc03 = V::and_(u0, low6);
    mn03 = V::and_(u1, low6);
    sc47 = V::or_(V::and_(u2, low4), V::shl32(V::and_(V::shr32(u0, 6), low2), 4));
    mn47 = V::or_(V::and_(V::shr32(u2, 4), low4), V::shl32(V::and_(V::shr32(u1, 6), low2), 4));
  }
  // lane j: byte s of row j's four (s = 0..3) as the i16 pair (v, v)
  static I pair(I v, int s) {
    const char z = static_cast<char>(0x80);
    auto c = [&](int d) { return static_cast<char>(4 * d + s); };
    return V::shuffle(v, _mm_setr_epi8(c(0), z, c(0), z, c(1), z, c(1), z, c(2), z, c(2), z, c(3), z, c(3), z));
  }
  I sc(int s) const { return pair(s < 4 ? sc03 : sc47, s & 3); }
  // lane j: sub-block s's scale of row j as an i32
  I sc32(int s) const { return V::and_(V::shr32(s < 4 ? sc03 : sc47, 8 * (s & 3)), V::i32(0xff)); }
  I mn(int s) const { return pair(s < 4 ? mn03 : mn47, s & 3); }
  // lane j: the mins of sub-blocks s and s + 1 (s even) of row j as an i16 pair
  I mn2(int s) const {
    const char z = static_cast<char>(0x80);
    auto c = [&](int d, int k) { return static_cast<char>(4 * d + (s & 3) + k); };
    return V::shuffle(s < 4 ? mn03 : mn47,
                      _mm_setr_epi8(c(0, 0), z, c(0, 1), z, c(1, 0), z, c(1, 1), z, c(2, 0), z, c(2, 1), z, c(3, 0), z, c(3, 1), z));
  }
};

// mr rows of x against a group of 8 regrouped Q4_K or Q5_K rows (Q5_K: qh chunk c, bytes
// 4c .. 4c + 3 of its 32, at 128 + 32c + 4j, bit s the fifth bit of sub-block s; qs from 384),
// one row per lane (V16: and the group gb bytes on). Without VNNI, per super-block and output:
// the exact i32 sums of mins * x's sums and of sc * q * x, then acc = fma(mins, -dmin * d_x,
// acc) and acc = fma(sum, d * d_x, acc); a sub-block's chunks add up in i16 first, as many as
// fit (a maddubs lane is at most 2 * 15 * 127 = 3810 for Q4_K: 8 chunks, 2 * 31 * 127 = 7874
// for Q5_K: 4 chunks), then madd by the scales. With VNNI a sub-block's chunks add up in i32
// (dot4) and the super-block in float: part = mins * -dmin, part = fma(sum_s, d * sc_s, part)
// for each sub-block s (d * sc_s is exact: an f16 times 6 bits), acc = fma(part, d_x, acc).
// (An i32 multiply by the scales, vpmulld, is two micro-ops on Intel: the float steps made the
// Q4_K matrices of the 1.1B Q4_K_M shape 1.14-1.20x faster against 512 rows of x on the
// AVX-512 machine, one row of x the same.)
// INT (choices.int_steps, CPUs other than Intel's): with VNNI too the exact i32 sums, and the
// same two FMAs as without VNNI, so the same bits: a sub-block's dot4 chains, then one vpmulld
// by its scales (one micro-op on Zen 4) and an add. On Zen 4 that is the cheaper step: a
// standalone loop of one sub-block (64 512-bit dot4 for 8 rows of x, then the step per row)
// ran 61 TSC cycles with cvt + fma, 55 with vpmulld + add and 56 with no step at all; 512 rows
// of x against 11264 x 2048 Q4_K (the 1.1B shape's gate and up projections), one thread,
// alternating builds, 142.5 -> 155.2 GMAC/s (2 threads 284.9 -> 306.7).
// With IN_PLACE the even sub-blocks' scales are taken times 16, so the sum is 16x the exact
// one, and d / 16 (exact) meets it: the same product. No step overflows: 8 sub-blocks of at
// most 32 * 240 * 127 * 63 (Q4_K, either way) or 32 * 31 * 127 * 63 (Q5_K) stay below 2^29.
template <class V, int QT, int mr, bool X_COPY = false, bool INT = false>
void tile_xk(const Q8& a, int64_t m0, const uint8_t* grp, int64_t group_bytes, int valid, float* y, int64_t ldy,
             const uint8_t* end) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t BYTES = 8 * Layout<QT>::bytes;
  constexpr bool FIFTH = QT == Q5_K, TWO = !std::is_same_v<V, V8>;
  constexpr int QS_AT = FIFTH ? 384 : 128, RUN = FIFTH ? 4 : 8;  // chunks summed in i16
  constexpr bool DOT4 = VNNI || TWO;  // a sub-block's chunks in dot4 chains, else in maddubs runs
  constexpr bool FLOAT_STEPS = DOT4 && !INT;  // the sub-blocks' sums scaled in float (above)
  // Q4_K with dot4: an odd sub-block's high nibbles stay in place (16 q, one AND, no shift);
  // float steps divide its d * sc by 16, int steps multiply the even ones' scales by 16 (both
  // exact), so the products are the same
  constexpr bool IN_PLACE = DOT4 && !FIFTH;
  F acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = V::zerof();
  // V16, more than one row of x, where the CPU takes it (choices.x_copy): the tile's x bytes of
  // a super-block copied side by side, so that one base register addresses them all
  constexpr bool XCOPY = X_COPY && TWO && mr > 1;
  alignas(64) int8_t xt[XCOPY ? mr : 1][256];
  const int64_t FAR = choices_of<QT>().l2_ahead / BYTES * BYTES;  // a super-block's place in a group further on
  // the super-blocks whose weights FAR bytes on are still in the chunk (none without the prefetch)
  const int64_t far_g = mr > 1 ? 0 : far_blocks(grp, TWO ? group_bytes : 0, FAR, BYTES, end, a.G);
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = grp + g * BYTES;
    const int64_t gb = opaque(group_bytes);
    // One row of x: the prefetches sub-block by sub-block (prefetch_eighth, below), where
    // there is the one to L2 (choices.l2_ahead); without it none.
    if constexpr (mr > 1)
      for (int64_t o = 0; o < BYTES; o += 64) {
        prefetch(b + 2 * BYTES + o);
        if constexpr (TWO) prefetch(b + gb + 2 * BYTES + o);
      }
    if constexpr (XCOPY)
      for (int i = 0; i < mr; ++i)
        for (int o = 0; o < 256; o += 64) _mm512_store_si512(xt[i] + o, _mm512_loadu_si512(a.q + (m0 + i) * a.K + 256 * g + o));
    const XK<V> h(b, gb);
    const F d = V::halves(b, gb), ndmin = V::sub(V::zerof(), V::halves(b + 16, gb));
    F part[FLOAT_STEPS ? mr : 1];  // this super-block's sum, in units of d_x
    // the offsets: sum over s of mn_s * x's sums of 32, two sub-blocks a dot2 (with x's sums of
    // 16, one a dot2, 5632 x 2048 Q4_K against 512 rows of x ran at 306 GMAC/s, now 317-321)
    for (int i = 0; i < mr; ++i) {
      const int16_t* p = a.p + (m0 + i) * a.lp + a.K / 16 + 8 * g;
      I ms = V::zero();
#pragma GCC unroll 4
      for (int s = 0; s < 8; s += 2) {
        int32_t pair;
        std::memcpy(&pair, p + s, 4);
        ms = V::dot2(ms, h.mn2(s), V::i32(pair));
      }
      if constexpr (FLOAT_STEPS) part[i] = V::mul(V::cvt(ms), ndmin);
      else acc[i] = V::fmadd(V::cvt(ms), V::mul(ndmin, V::f32(a.d[(m0 + i) * a.G + g])), acc[i]);
    }
    I isum[FLOAT_STEPS ? 1 : mr];  // the exact sums (maddubs and int steps; 16x with IN_PLACE)
    if constexpr (!FLOAT_STEPS)
      for (int i = 0; i < mr; ++i) isum[i] = V::zero_idiom();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      if (g < far_g) prefetch_eighth<TWO, BYTES>(b, gb, FAR, s);
      auto chunk = [&](int c) {  // sub-block s's chunk c of the rows: their unsigned values
        const I v = V::load(b + QS_AT + 32 * (8 * (s >> 1) + c), gb);
        const I w = !(s & 1) ? V::and_(v, V::bytes(0x0F)) : IN_PLACE ? V::and_(v, V::bytes(0xF0)) : move_bits(v, 4, 0, 4);
        if constexpr (FIFTH) return V::or_(w, move_bits(V::load(b + 128 + 32 * c, gb), s, 4, 1));
        return w;
      };
      auto x4 = [&](int i, int c) {  // x's 4 bytes against chunk c, in every lane
        int32_t xv;
        std::memcpy(&xv, a.q + (m0 + i) * a.K + 256 * g + 32 * s + 4 * c, 4);
        return V::i32(xv);
      };
      if constexpr (!DOT4) {  // maddubs: a sub-block's chunks in i16 runs, then madd by the scales
        const I sc = h.sc(s);
        for (int c0 = 0; c0 < 8; c0 += RUN) {
          I t[mr];
          for (int i = 0; i < mr; ++i) t[i] = V::zero();
          for (int c = c0; c < c0 + RUN; ++c) {
            const I w = chunk(c);
            for (int i = 0; i < mr; ++i) t[i] = _mm256_add_epi16(t[i], _mm256_maddubs_epi16(w, x4(i, c)));
          }
          for (int i = 0; i < mr; ++i) {
            isum[i] = V::add(isum[i], _mm256_madd_epi16(t[i], sc));
            keep_in_register(isum[i]);
          }
        }
      } else {  // a sub-block's exact i32 sums, times its scales: two chains per row of x up to
        // 4 rows of one group or one row of two, one for more (enough chains; two would not
        // fit the registers)
        constexpr int CH = mr >= 6 || (TWO && mr > 1) ? 1 : 2;
        I t[CH][mr];
        for (int i = 0; i < mr; ++i)
          for (int k = 0; k < CH; ++k) t[k][i] = V::zero_idiom();
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          const I w = chunk(c);
          for (int i = 0; i < mr; ++i)
            t[c % CH][i] = V::dot4x(t[c % CH][i], w, (XCOPY ? xt[i] : a.q + (m0 + i) * a.K + 256 * g) + 32 * s + 4 * c);
        }
        if constexpr (INT) {
          const I sc = IN_PLACE && !(s & 1) ? V::shl32(h.sc32(s), 4) : h.sc32(s);
          for (int i = 0; i < mr; ++i) {
            isum[i] = V::add(isum[i], V::mullo(CH == 2 ? V::add(t[0][i], t[1][i]) : t[0][i], sc));
            keep_in_register(isum[i]);
          }
          continue;
        }
        const F dsc = V::mul(IN_PLACE && (s & 1) ? V::mul(d, V::f32(1.0f / 16)) : d, V::cvt(h.sc32(s)));
        for (int i = 0; i < mr; ++i) {
          part[i] = V::fmadd(V::cvt(CH == 2 ? V::add(t[0][i], t[1][i]) : t[0][i]), dsc, part[i]);
          keep_in_register(part[i]);
        }
      }
    }
    for (int i = 0; i < mr; ++i) {
      const F dx = V::f32(a.d[(m0 + i) * a.G + g]);
      if constexpr (FLOAT_STEPS) acc[i] = V::fmadd(part[i], dx, acc[i]);
      else acc[i] = V::fmadd(V::cvt(isum[i]), V::mul(IN_PLACE ? V::mul(d, V::f32(1.0f / 16)) : d, dx), acc[i]);
    }
  }
  for (int i = 0; i < mr; ++i) V::store(y + i * ldy, acc[i], valid);
}

// Q3_K and Q6_K regrouped: Q3_K at load (minerva/kernels/repack.py) for 8-bit activations;
// Q6_K, and a Q3_K matrix left in the GGML layout (one that is also the embedding), panel by
// panel at run time with PANELS_FROM or more rows of x (regroup_panel, into a buffer of the
// work item's). Each group of 8 rows keeps its super-block's fields in the GGML order, the 8
// rows' chunk q of a field (its bytes 4q .. 4q + 3) of row j at 32q + 4j, and the kernel below
// takes one weight row per lane:
// - Q6_K: ql[1024] | qh[512] | scales[128] | d[8] (f16). Sub-block s = 4 part + t (as
//   W8<Q6_K>) takes, for its chunk c (elements 4c .. 4c + 3), the nibble t >> 1 of ql chunk
//   16 part + 8 (t & 1) + c and bits 2t, 2t + 1 of qh chunk 8 part + c.
// - Q3_K: hmask[256] | qs[512] | scales[96] (the 12 bytes of 6-bit scales as stored) | d[8].
//   Sub-block s takes bits 2 (s & 3), +1 of qs chunk 8 (s >> 2) + c and bit s of hmask chunk c.
// - Q2_K (at load, as Q3_K): scales[128] (the 16 bytes of 4-bit scales and mins as stored) |
//   qs[512] | d[8] | dmin[8]. Sub-block s takes bits 2 (s & 3), +1 of qs chunk 8 (s >> 2) + c.
// Sub-block s's chunks 0..3 take scale 2s, 4..7 scale 2s + 1.
// With one row of x this takes fewer instructions per weight than `row1` on the GGML layout
// (no horizontal sums, one broadcast of x's 4 bytes for 8 or 16 rows). Zen 4, 512 x 2048 from
// L2, one thread: Q3_K 54 GMAC/s against 35, Q6_K 44 against 35, Q2_K 60 against 37
// (benchmarks/int8_kernels.py; Q2_K from memory, 65536 rows, 2 threads: 139 against 80).
// From memory the hardware prefetchers do not follow its order of reads (Q6_K's ql and qh a
// kilobyte apart in each super-block): without the software prefetch below a 65536 x 2048
// Q6_K matrix streamed at 14 GB/s against 41-52 for the GGML layout's `row1`, and with it the
// 1.1B shape's Q6_K matrices (22 layers of Q/K/V, output, gate/up and down in turn, 2 threads)
// still took 26-29 ms against 23-26, so Q6_K stays in the GGML layout for one row of x. Q3_K,
// whose GGML kernel is bound by its instructions, gains: greedy decode of the 1.1B Q3_K_M
// shape, the two ways alternating in one process, medians: 16.90 against 17.68 ms a token
// where a read probe taken with each pair gave under 45 GB/s (122 pairs), and (with two groups
// at a time) 14.45 against 16.56 where it gave 45 or more (22 pairs). Q2_K likewise: the 1.1B
// Q2_K shape 14.07 against 15.46 ms (47 pairs under 45 GB/s), 12.43 against 15.10 (17 over).
template <int QT>
struct Panel;
template <>
struct Panel<Q6_K> {
  static constexpr int64_t QS_AT = 0, HI_AT = 1024, SC_AT = 1536, D_AT = 1664, BYTES = 1680;
  static constexpr int BIAS = 5;  // the stored values are q + 32
};
template <>
struct Panel<Q3_K> {
  static constexpr int64_t HI_AT = 0, QS_AT = 256, SC_AT = 768, D_AT = 864, BYTES = 880;
  static constexpr int BIAS = 2;  // q + 4
};
template <>
struct Panel<Q2_K> {
  static constexpr int64_t SC_AT = 0, QS_AT = 128, D_AT = 640, DMIN_AT = 656, BYTES = 672;
  static constexpr int BIAS = 0;  // q unsigned; the mins meet x's sums apart
};
static_assert(Panel<Q6_K>::BYTES == 8 * Layout<Q6_K>::bytes && Panel<Q3_K>::BYTES == 8 * Layout<Q3_K>::bytes &&
                  Panel<Q2_K>::BYTES == 8 * Layout<Q2_K>::bytes,
              "a regrouped super-block holds the 8 GGML blocks' bytes");

// the GF(2) matrix of an affine transform that moves each byte's n bits from bit `from` to bit
// `to` and clears the others (row i, byte 7 - i of the qword, selects the source of result bit i)
constexpr int64_t bit_matrix(int from, int to, int n) {
  uint64_t m = 0;
  for (int k = 0; k < n; ++k) m |= (1ULL << (from + k)) << (8 * (7 - (to + k)));
  return static_cast<int64_t>(m);
}

// mr rows of x against the 8 rows (V16: and the group gb bytes on). Per super-block and output
// the exact i32 sum of sc_j * (the stored values' dot product with x over the 16 elements of
// scale j, minus 2^BIAS times x's sum over them), then acc = fma(sum, d * d_x, acc): the same
// integer as `row1` and `tile` give for Q3_K and Q6_K, so a row's result is the same at one row
// of x and at many, regrouped or not. Q2_K (no bias) first takes acc = fma(mins . x's sums of
// 16, -dmin * d_x, acc), as tile_xk does: within float32 rounding of its GGML layout's results
// (which keep 8 lanes an output), and the same at one row of x and at many. The 4 chunks of a scale add up in i32 (dot4), from the
// bias on, before one multiply by the scale. No step overflows: a scale's dot product is at
// most 16 * 63 * 127, times |sc| <= 128, 16 of them: < 2^28. With the bias as the chains' start,
// a 2048 x 5632 Q6_K matrix (the 1.1B shape's down projection) against 512 rows of x went from
// 272-275 to 283-288 GMAC/s (AVX-512 machine, 2 threads, alternating runs), where a dot2 of
// scale pairs against x's sums of 16 had taken it apart.
// `end` (the end of the thread's run of a matrix regrouped at load; null for a run-time
// panel, already in cache): the weights are prefetched, with more than one row of x as
// tile_xk does, with one into L2 PANEL_L2_AHEAD bytes ahead on every CPU (above; Q3_K
// 65536 x 2048, 2 threads, one group at a time: 44.9, 47.1, 46.4, 46.0 GB/s 16, 32, 64 and
// 128 KB ahead). With one row of x and GFNI each high-bit field takes one affine transform
// instead of a shift and a mask (a standalone copy of the Q6_K loop, 512 x 2048 from L2, one
// thread, Zen 4: 9.8 TSC cycles per row and super-block against 10.5).
constexpr int64_t PANEL_L2_AHEAD = 32768;
template <class V, int QT, int mr>
void tile_panel(const Q8& a, int64_t m0, const uint8_t* grp, int64_t group_bytes, int valid, float* y, int64_t ldy,
                const uint8_t* end = nullptr) {
  using I = typename V::I;
  using F = typename V::F;
  using P = Panel<QT>;
  constexpr int64_t BYTES = P::BYTES;
  constexpr bool TWO = !std::is_same_v<V, V8>, MINS = QT == Q2_K;
#if defined(__GFNI__)
  constexpr bool AFFINE = mr == 1;
#else
  constexpr bool AFFINE = false;
#endif
  auto bits = [](I v, int from, int to, int n) {  // move_bits, by GFNI where it pays
    if constexpr (AFFINE) return V::affine(v, bit_matrix(from, to, n));
    else return move_bits(v, from, to, n);
  };
  F acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = V::zerof();
  const int64_t FAR = end == nullptr ? 0 : PANEL_L2_AHEAD / BYTES * BYTES;
  const int64_t far_g = mr > 1 ? 0 : far_blocks(grp, TWO ? group_bytes : 0, FAR, BYTES, end, a.G);
  // Intel's choice (choices.l2_ahead): the prefetches sub-block by sub-block (prefetch_eighth);
  // elsewhere the L2 prefetch as measured on Zen 4 (above), all at the super-block's start
  const bool spread = choices_of<QT>().l2_ahead > 0;
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = grp + g * BYTES;
    const int64_t gb = opaque(group_bytes);
    if (g < far_g && !spread)
      for (int64_t o = 0; o < BYTES; o += 64) {
        prefetch_l2(b + FAR + o);
        if constexpr (TWO) prefetch_l2(b + gb + FAR + o);
      }
    if (mr > 1 && end != nullptr)
      for (int64_t o = 0; o < BYTES; o += 64) {
        prefetch(b + 2 * BYTES + o);
        if constexpr (TWO) prefetch(b + gb + 2 * BYTES + o);
      }
    // lane j of scales chunk k: row j's scales 4k .. 4k + 3, as signed bytes (loaded where
    // used: kept in registers they crowd out the sums). Q3_K's are decoded here first, for all
    // rows at once, as GGML does for one: the low 4 bits from bytes 0..7 (nibble k >> 1 of u0
    // or u1), the high 2 from bits 2k, 2k + 1 of u2, minus 32.
    [[maybe_unused]] alignas(64) uint8_t sc3[QT == Q3_K ? 4 : 1][sizeof(I)];
    if constexpr (QT == Q3_K) {
      const I u0 = V::load(b + P::SC_AT, gb), u1 = V::load(b + P::SC_AT + 32, gb), u2 = V::load(b + P::SC_AT + 64, gb);
      const I lo = V::bytes(0x0F), hi = V::bytes(0x30), bias = V::bytes(32);
      V::put(sc3[0], V::sub8(V::or_(V::and_(u0, lo), V::and_(V::shl32(u2, 4), hi)), bias));
      V::put(sc3[1], V::sub8(V::or_(V::and_(u1, lo), V::and_(V::shl32(u2, 2), hi)), bias));
      V::put(sc3[2], V::sub8(V::or_(V::and_(V::shr32(u0, 4), lo), V::and_(u2, hi)), bias));
      V::put(sc3[3], V::sub8(V::or_(V::and_(V::shr32(u1, 4), lo), V::and_(V::shr32(u2, 2), hi)), bias));
    }
    auto scales = [&](int k) {
      if constexpr (QT == Q3_K) return V::whole(sc3[k]);
      else return V::load(b + P::SC_AT + 32 * k, gb);
    };
    I isum[mr];
    for (int i = 0; i < mr; ++i) isum[i] = V::zero();
    // the bias, -2^BIAS * x's sum over a scale's 16 elements, starts that scale's dot product
    // (a broadcast from memory: no arithmetic in the loop, where a multiply by the scales per
    // pair of them was)
    [[maybe_unused]] alignas(32) int32_t bias[MINS ? 1 : mr][16];
    if constexpr (!MINS)
      for (int i = 0; i < mr; ++i) {
        const int16_t* p = a.p + (m0 + i) * a.lp + 16 * g;
        for (int k = 0; k < 2; ++k) {
          const __m256i v = _mm256_slli_epi32(_mm256_cvtepi16_epi32(load128(reinterpret_cast<const uint8_t*>(p + 8 * k))), P::BIAS);
          _mm256_store_si256(reinterpret_cast<__m256i*>(bias[i] + 8 * k), _mm256_sub_epi32(_mm256_setzero_si256(), v));
        }
      }
    // Q2_K's mins first: the exact i32 sum of the 16 mins (high nibbles of the scale bytes)
    // times x's sums of 16, two a dot2, then acc = fma(that, -dmin * d_x, acc)
    if constexpr (MINS) {
      const char z = static_cast<char>(0x80);
      const __m128i pair01 = _mm_setr_epi8(0, z, 1, z, 4, z, 5, z, 8, z, 9, z, 12, z, 13, z);
      const __m128i pair23 = _mm_setr_epi8(2, z, 3, z, 6, z, 7, z, 10, z, 11, z, 14, z, 15, z);
      I ms[mr];
      for (int i = 0; i < mr; ++i) ms[i] = V::zero();
      for (int k = 0; k < 4; ++k) {  // the mins of scales 4k .. 4k + 3
        const I mn = V::and_(V::shr32(scales(k), 4), V::bytes(0x0F));
        const I lo = V::shuffle(mn, pair01), hi = V::shuffle(mn, pair23);
        for (int i = 0; i < mr; ++i) {
          int32_t xs[2];
          std::memcpy(xs, a.p + (m0 + i) * a.lp + 16 * g + 4 * k, 8);
          ms[i] = V::dot2(V::dot2(ms[i], lo, V::i32(xs[0])), hi, V::i32(xs[1]));
        }
      }
      const F ndmin = V::sub(V::zerof(), V::halves(b + P::DMIN_AT, gb));
      for (int i = 0; i < mr; ++i) acc[i] = V::fmadd(V::cvt(ms[i]), V::mul(ndmin, V::f32(a.d[(m0 + i) * a.G + g])), acc[i]);
    }
    // two dot product chains per row of x up to 4 rows of one group, one for more (enough chains)
    constexpr int CH = mr >= 6 || TWO ? 1 : 2;
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      if (g < far_g && spread) prefetch_eighth<TWO, BYTES>(b, gb, FAR, s);
      const int part = s >> 2, t = s & 3;
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * s + h, byte = j & 3;  // the scale: byte `byte` of each lane of chunk j >> 2, with its sign
        I dot[CH][mr];
        for (int i = 0; i < mr; ++i) {
          if constexpr (MINS) dot[0][i] = V::zero();
          else dot[0][i] = V::i32_at(&bias[i][j]);
          if constexpr (CH == 2) dot[1][i] = V::zero();
        }
#pragma GCC unroll 4
        for (int c = 4 * h; c < 4 * h + 4; ++c) {
          I w;  // the stored values of the 8 (16) rows' chunk c of sub-block s
          if constexpr (QT == Q6_K) {
            const I v = V::load(b + P::QS_AT + 32 * (16 * part + 8 * (t & 1) + c), gb);
            const I hb = bits(V::load(b + P::HI_AT + 32 * (8 * part + c), gb), 2 * t, 4, 2);
            w = V::or_((t >> 1) ? move_bits(v, 4, 0, 4) : V::and_(v, V::bytes(0x0F)), hb);
          } else if constexpr (QT == Q3_K) {
            const I v = V::load(b + P::QS_AT + 32 * (8 * part + c), gb);
            const I hb = bits(V::load(b + P::HI_AT + 32 * c, gb), s, 2, 1);
            w = V::or_(t ? move_bits(v, 2 * t, 0, 2) : V::and_(v, V::bytes(3)), hb);
          } else {
            const I v = V::load(b + P::QS_AT + 32 * (8 * part + c), gb);
            w = t ? move_bits(v, 2 * t, 0, 2) : V::and_(v, V::bytes(3));
          }
          for (int i = 0; i < mr; ++i)
            dot[c % CH][i] = V::dot4x(dot[c % CH][i], w, a.q + (m0 + i) * a.K + 256 * g + 32 * s + 4 * c);
        }
        const I sc = MINS ? V::shr32(V::shl32(scales(j >> 2), 28 - 8 * byte), 28)  // Q2_K: the low nibble
                          : V::sar32(V::shl32(scales(j >> 2), 24 - 8 * byte), 24);
        for (int i = 0; i < mr; ++i) {
          isum[i] = V::add(isum[i], V::mullo(CH == 2 ? V::add(dot[0][i], dot[CH - 1][i]) : dot[0][i], sc));
          keep_in_register(isum[i]);
        }
      }
    }
    const F d = V::halves(b + P::D_AT, gb);
    for (int i = 0; i < mr; ++i) acc[i] = V::fmadd(V::cvt(isum[i]), V::mul(d, V::f32(a.d[(m0 + i) * a.G + g])), acc[i]);
  }
  for (int i = 0; i < mr; ++i) V::store(y + i * ldy, acc[i], valid);
}

// The regrouped types: groups of 8 weight rows (the padded rows' outputs dropped); for M > 1
// PANEL rows (4 groups) at a time against tiles of x8_mr rows of x, as `matmul`.
// Groups of 8 weight rows per work item, rows K long; with one row of x four for Q8_0
// (q8_0_rows) and for the other 32-weight block types where a group is X8_STREAM_BYTES or
// longer (x8_rows), else one, or two where V16 takes the K-quants two groups at a time
// (choices.groups, above).
template <int QT>
int64_t x8_per(int64_t M, int64_t K) {
  if (M > 1) return PANEL / 8;
  if constexpr (QT == Q8_0) return choices_of<QT>().groups;
  if constexpr (!is_k<QT>) return 8 * row_bytes<QT>(K) >= X8_STREAM_BYTES ? choices_of<QT>().groups : 1;
#if defined(MINERVA_V16)
  if constexpr (is_k<QT>) return choices_of<QT>().groups >= 2 ? 2 : 1;
#endif
  return 1;
}

// rows of x per tile: 4, or with AVX-512's 32 vector registers 8 for Q4_K and Q6_K (and Q3_K,
// whose panel kernel is Q6_K's; not timed apart) and 6 for Q5_K (one dot product chain per row
// of x); with VNNI too, V16 tiles of V16_MR rows take over for Q4_K and Q5_K (and for their
// panels, more than one row of x). AVX-512 machine, 5632 x 2048, 512 rows of x, 2
// threads, alternating runs: Q4_K 248-258 GMAC/s with 8 against 232-235 with 4 (242-245 with
// 6); Q5_K 194-205 with 6 against 173-174 with 4 and 178-182 with 8; Q6_K 200-207 with 8
// against 179-183 with 4 (the GGML layout's `tile`: 136-143).
#if defined(__AVX512F__)
template <int QT>
constexpr int x8_mr = QT == Q4_K || QT == Q6_K || QT == Q3_K || QT == Q2_K ? 8 : QT == Q5_K ? 6 : 4;
#else
template <int QT>
constexpr int x8_mr = 4;
#endif

// 8 rows' dwords d0 .. d7 (r[j] = row j's) to r[q] = dword q of rows 0 .. 7
inline void transpose8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);      // rows 2k, 2k+1: dwords 0, 1 | 4, 5
    t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);  // 2, 3 | 6, 7
  }
  for (int k = 0; k < 2; ++k) {  // rows 4k .. 4k + 3
    u[4 * k] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);      // dword 0 | 4
    u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);  // 1 | 5
    u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);  // 2 | 6
    u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);  // 3 | 7
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
    r[q + 4] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
  }
}

// `dwords` dwords of 8 rows (from src[j]) side by side, chunk q of row j at dst + 32q + 4j
inline void interleave_dwords(const uint8_t* const src[8], int dwords, uint8_t* dst) {
  for (int q0 = 0; q0 < dwords; q0 += 8) {
    __m256i r[8];
    for (int j = 0; j < 8; ++j)
      r[j] = dwords - q0 >= 8 ? load256(src[j] + 4 * q0) : _mm256_castsi128_si256(load128(src[j] + 4 * q0));
    transpose8x8(r);
    for (int q = 0; q < std::min(8, dwords - q0); ++q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * (q0 + q)), r[q]);
  }
}

// Q3_K or Q6_K rows rows[0..7] (GGML blocks) to tile_panel's layout, G super-blocks, at `out`
template <int QT>
inline void regroup_panel(const uint8_t* const rows[8], int64_t G, uint8_t* out) {
  using P = Panel<QT>;
  constexpr int64_t bytes = Layout<QT>::bytes;
  for (int64_t g = 0; g < G; ++g) {
    uint8_t* o = out + g * P::BYTES;
    auto fields = [&](int64_t at, int dwords, uint8_t* dst) {  // `dwords` dwords from byte `at` of each block
      const uint8_t* src[8];
      for (int j = 0; j < 8; ++j) src[j] = rows[j] + g * bytes + at;
      interleave_dwords(src, dwords, dst);
    };
    if constexpr (QT == Q6_K) {
      fields(0, 32, o + P::QS_AT);    // ql
      fields(128, 16, o + P::HI_AT);  // qh
      fields(192, 4, o + P::SC_AT);   // scales
    } else {
      fields(0, 8, o + P::HI_AT);    // hmask
      fields(32, 16, o + P::QS_AT);  // qs
      for (int j = 0; j < 8; ++j)    // the scales' 12 bytes (3 dwords: interleave_dwords would read 16)
        for (int q = 0; q < 3; ++q) std::memcpy(o + P::SC_AT + 32 * q + 4 * j, rows[j] + g * bytes + 96 + 4 * q, 4);
    }
    for (int j = 0; j < 8; ++j) std::memcpy(o + P::D_AT + 2 * j, rows[j] + g * bytes + bytes - 2, 2);  // d
  }
}

// 8 floats rounded to bf16 (to nearest even; NaN to c10's quiet NaN where done by hand)
inline __m128i bf16x8(__m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  return (__m128i)_mm256_cvtneps_pbh(v);
#else
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
#endif
}

// n floats rounded to bf16, as Tensor.to rounds
inline void round_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bf16x8(_mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

// Output columns c0 .. c1 of all M rows, computed by `compute(out, ldy)` (column c0 + c of
// row m at out[m * ldy + c]): into y (ldy N), or with yb into a float buffer of the thread's,
// rounded to bf16 into yb at once. Against a float32 y rounded afterwards (as_dtype_of) the
// same values, and the float results never leave the cache.
template <class F>
void columns_out(int64_t M, int64_t N, int64_t c0, int64_t c1, float* y, at::BFloat16* yb, const F& compute) {
  if (yb == nullptr) return compute(y + c0, N);
  const int64_t w = c1 - c0;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < M * w) buffer.resize(M * w);
  compute(buffer.data(), w);
  for (int64_t m = 0; m < M; ++m) round_bf16(buffer.data() + m * w, yb + m * N + c0, w);
}

// Q3_K and Q6_K, M >= PANELS_FROM: panels of PANEL weight rows, each regrouped into the work
// item's buffer (a last group of fewer than 8 rows repeats its last row; those outputs are
// dropped), then tiles of x8_mr rows of x against its groups (with V16, pairs of them)
template <int QT>
void matmul_panels(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y_all, at::BFloat16* yb) {
  const int64_t rb = row_bytes<QT>(a.K), gb = a.G * Panel<QT>::BYTES;  // a group's bytes in the panel
  minerva::parallel_for(0, (N + PANEL - 1) / PANEL, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> panel(PANEL / 8 * gb);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = PANEL * blk, groups = (std::min(N, n0 + PANEL) - n0 + 7) / 8;
      columns_out(M, N, n0, std::min(N, n0 + PANEL), y_all, yb, [&](float* y, int64_t ldy) {
      for (int64_t grp = 0; grp < groups; ++grp) {
        const uint8_t* rows[8];
        for (int j = 0; j < 8; ++j) rows[j] = W + std::min(n0 + 8 * grp + j, N - 1) * rb;
        regroup_panel<QT>(rows, a.G, panel.data() + grp * gb);
      }
#if defined(MINERVA_V16)
      x_tiles<V16_MR>(M, [&](int64_t m, auto tile_rows) {
        constexpr int r = decltype(tile_rows)::value;
        int64_t grp = 0;
        auto valid = [&](int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, N - n0 - 8 * grp)); };
        for (; grp + 2 <= groups; grp += 2)
          tile_panel<V16, QT, r>(a, m, panel.data() + grp * gb, gb, valid(16), y + m * ldy + 8 * grp, ldy);
        if (grp < groups) tile_panel<V8, QT, r>(a, m, panel.data() + grp * gb, gb, valid(8), y + m * ldy + 8 * grp, ldy);
      });
#else
      x_tiles<x8_mr<QT>>(M, [&](int64_t m, auto tile_rows) {
        for (int64_t grp = 0; grp < groups; ++grp) {
          const int64_t n = n0 + 8 * grp;
          tile_panel<V8, QT, decltype(tile_rows)::value>(a, m, panel.data() + grp * gb, gb,
                                                         static_cast<int>(std::min<int64_t>(8, N - n)), y + m * ldy + 8 * grp, ldy);
        }
      });
#endif
      });
    }
  });
}

// one work item: groups g0 .. g1 against all M rows of x; output column 8 g0 + c of row m at
// y[m * ldy + c]
template <int QT>
void x8_groups(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, int64_t ldy, int64_t g0, int64_t g1,
               const uint8_t* end) {
  const int64_t gb = 8 * row_bytes<QT>(a.K);
  if constexpr (!is_k<QT>) {
    if (M == 1 && N >= 8 * g1) {  // (a last group with fewer than 8 rows takes tile_x8)
      const auto rows = [&]<int NG>() {
        if constexpr (QT == Q8_0) q8_0_rows<NG>(a, W + g0 * gb, gb, y);
        else x8_rows<QT, NG>(a, W + g0 * gb, gb, y, end);
      };
      if (g1 - g0 == 4) return rows.template operator()<4>();
      if (g1 - g0 == 3) return rows.template operator()<3>();
      if (g1 - g0 == 2) return rows.template operator()<2>();
    }
  }
#if defined(MINERVA_V16)
  if constexpr (QT == Q4_K || QT == Q5_K) {
    const bool x_copy = choices_of<QT>().x_copy;
    const auto groups = [&]<bool INT>(int64_t m, auto rows) {
      constexpr int r = decltype(rows)::value;
      int64_t grp = g0;
      auto valid = [&](int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, N - 8 * grp)); };
      for (; grp + 2 <= g1; grp += 2) {
        float* out = y + m * ldy + 8 * (grp - g0);
        if constexpr (INT) tile_xk<V16, QT, r, false, true>(a, m, W + grp * gb, gb, valid(16), out, ldy, end);
        else if (x_copy) tile_xk<V16, QT, r, true>(a, m, W + grp * gb, gb, valid(16), out, ldy, end);
        else tile_xk<V16, QT, r>(a, m, W + grp * gb, gb, valid(16), out, ldy, end);
      }
      if (grp < g1) tile_xk<V8, QT, r, false, INT>(a, m, W + grp * gb, gb, valid(8), y + m * ldy + 8 * (grp - g0), ldy, end);
    };
    if (int_steps)
      x_tiles<V16_INT_MR>(M, [&](int64_t m, auto rows) { groups.template operator()<true>(m, rows); });
    else
      x_tiles<V16_MR>(M, [&](int64_t m, auto rows) { groups.template operator()<false>(m, rows); });
    return;
  }
  if constexpr (QT == Q2_K || QT == Q3_K) {  // as matmul_panels, from the matrix itself
    x_tiles<V16_MR>(M, [&](int64_t m, auto rows) {
      constexpr int r = decltype(rows)::value;
      int64_t grp = g0;
      auto valid = [&](int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, N - 8 * grp)); };
      for (; grp + 2 <= g1; grp += 2)
        tile_panel<V16, QT, r>(a, m, W + grp * gb, gb, valid(16), y + m * ldy + 8 * (grp - g0), ldy, end);
      if (grp < g1) tile_panel<V8, QT, r>(a, m, W + grp * gb, gb, valid(8), y + m * ldy + 8 * (grp - g0), ldy, end);
    });
    return;
  }
#endif
  x_tiles<x8_mr<QT>>(M, [&](int64_t m, auto rows) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int valid = static_cast<int>(std::min<int64_t>(8, N - 8 * grp));
      if constexpr (QT == Q4_K || QT == Q5_K) {
        float* out = y + m * ldy + 8 * (grp - g0);
        if (VNNI && int_steps) tile_xk<V8, QT, decltype(rows)::value, false, true>(a, m, W + grp * gb, gb, valid, out, ldy, end);
        else tile_xk<V8, QT, decltype(rows)::value>(a, m, W + grp * gb, gb, valid, out, ldy, end);
      }
      else if constexpr (QT == Q2_K || QT == Q3_K)
        tile_panel<V8, QT, decltype(rows)::value>(a, m, W + grp * gb, gb, valid, y + m * ldy + 8 * (grp - g0), ldy, end);
      else tile_x8<QT, decltype(rows)::value>(a, m, W + grp * gb, valid, y + m * ldy + 8 * (grp - g0), ldy, end);
    }
  });
}

template <int QT>
void matmul_x8(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, at::BFloat16* yb = nullptr) {
  const int64_t groups = (N + 7) / 8, per = x8_per<QT>(M, a.K);
  minerva::parallel_for(0, (groups + per - 1) / per, M == 1 ? 2 : 1, [&](int64_t b0, int64_t b1) {
    const uint8_t* end = W + std::min(groups, per * minerva::ThreadPool::run_end(b1)) * 8 * row_bytes<QT>(a.K);  // this thread's run's weights
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t g0 = per * blk, g1 = std::min(groups, per * (blk + 1));
      columns_out(M, N, 8 * g0, std::min(N, 8 * g1), y, yb,
                  [&](float* out, int64_t ldy) { x8_groups<QT>(a, M, W, N, out, ldy, g0, g1, end); });
    }
  });
}

// x as the kernels take it: [M, cols], float32 or bfloat16, contiguous
torch::Tensor checked(const torch::Tensor& x, int64_t cols) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols, "x must be [M, ", cols, "]");
  TORCH_CHECK(x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(cols % 32 == 0, "row length ", cols, " is not a multiple of 32");
  return x.contiguous();
}

// y [M, N] float32 as x's dtype: bf16 rounded (to nearest even, as Tensor.to) on the kernels'
// threads (the engine runs torch's own ops on one thread, where this conversion took 1.7% of a
// 512-token prefill of the 1.1B Q4_K_M shape). The regrouped kernels and Q3_K/Q6_K's panels
// round as each work item finishes instead (columns_out): layer 0 of that file's matmuls
// against 512 rows of bf16 x, 71.5-72.9 ms against 76.7-82.9 with this pass after them
// (alternating runs).
torch::Tensor as_dtype_of(const torch::Tensor& y, const torch::Tensor& x) {
  if (x.dtype() != torch::kBFloat16) return y;
  auto out = torch::empty(y.sizes(), torch::dtype(torch::kBFloat16));
  const float* src = y.data_ptr<float>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  const int64_t n = y.numel();
  minerva::parallel_for(0, (n + 4095) / 4096, 16, [&](int64_t c0, int64_t c1) {
    round_bf16(src + c0 * 4096, dst + c0 * 4096, std::min(n, c1 * 4096) - c0 * 4096);
  });
  return out;
}

// x [M, K] (float32 or bfloat16) quantized row by row in blocks of `block` (32 or 256): values,
// for 256 the i16 sums of 16 (Q8::p), scales, scale * sum, sum. Into memory of the calling
// thread's, not tensors: a decode step quantizes x four times a layer, and five tensors each
// time (allocated, then freed) took longer than quantizing the one row. Each Quantized alive
// on a thread holds its own buffer (a stack of them, reused; one over SCRATCH_KEPT bytes is
// freed with it).
class Quantized {
 public:
  Quantized(const torch::Tensor& x, int64_t block) {
    TORCH_CHECK(x.is_contiguous() && (x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16),
                "x must be contiguous float32 or bfloat16");
    if (x.dtype() == torch::kBFloat16) init(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), block);
    else init(x.data_ptr<float>(), x.size(0), x.size(1), block);
  }
  // x [M, K] float32 or bfloat16 in memory
  template <typename XT>
  Quantized(const XT* x, int64_t M, int64_t K, int64_t block) { init(x, M, K, block); }
  ~Quantized() {
    if (own_.empty()) --stack().depth;
  }
  Quantized(const Quantized&) = delete;
  Quantized& operator=(const Quantized&) = delete;

  Q8 view() const { return Q8{q_, p_, d_, s_, n_, K_, G_, lp_}; }
  int64_t rows() const { return M_; }
  // the values and scales as tensors (copies)
  std::vector<torch::Tensor> tensors() const {
    auto q = torch::empty({M_, K_}, torch::dtype(torch::kInt8));
    auto d = torch::empty({M_, G_}, torch::dtype(torch::kFloat32)), s = torch::empty({M_, G_}, torch::dtype(torch::kFloat32));
    std::memcpy(q.data_ptr<int8_t>(), q_, M_ * K_);
    std::memcpy(d.data_ptr<float>(), d_, M_ * G_ * 4);
    std::memcpy(s.data_ptr<float>(), s_, M_ * G_ * 4);
    return {q, d, s};
  }

 private:
  template <typename XT>
  void init(const XT* xp, int64_t M, int64_t K, int64_t block) {
    TORCH_CHECK(block == 32 || block == 256, "the activation block is 32 or 256, got ", block);
    M_ = M, K_ = K, G_ = K_ / block, lp_ = block == 32 ? 0 : K_ / 16 + K_ / 32;
    TORCH_CHECK(K_ % block == 0, "row length ", K_, " is not a multiple of ", block);
    auto up = [](int64_t n) { return (n + 63) / 64 * 64; };
    const int64_t qb = up(M_ * K_), pb = up(M_ * lp_ * 2), fb = up(M_ * G_ * 4);
    uint8_t* base = take(qb + pb + 3 * fb + 128);  // room to align, and for loads a little past the end
    base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
    q_ = reinterpret_cast<int8_t*>(base);
    p_ = reinterpret_cast<int16_t*>(base + qb);
    d_ = reinterpret_cast<float*>(base + qb + pb);
    s_ = reinterpret_cast<float*>(base + qb + pb + fb);
    n_ = reinterpret_cast<int32_t*>(base + qb + pb + 2 * fb);
    const int64_t G = G_, lp = lp_;
    int8_t* qp = q_;
    int16_t* pp = p_;
    float *dp = d_, *sp = s_;
    int32_t* np = n_;
    minerva::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        if (block == 32) quantize_row<32>(xp + r * K, K, qp + r * K, pp, dp + r * G, sp + r * G, np + r * G);
        else quantize_row<256>(xp + r * K, K, qp + r * K, pp + r * lp, dp + r * G, sp + r * G, np + r * G);
    });
  }

  static constexpr int64_t SCRATCH_KEPT = 1 << 20;
  struct Stack {
    std::vector<std::vector<uint8_t>> buffers;
    size_t depth = 0;
  };
  static Stack& stack() {
    thread_local Stack s;
    return s;
  }
  uint8_t* take(int64_t bytes) {
    if (bytes > SCRATCH_KEPT) {
      own_.resize(bytes);
      return own_.data();
    }
    Stack& st = stack();
    if (st.depth == st.buffers.size()) st.buffers.emplace_back();
    auto& b = st.buffers[st.depth++];
    if (static_cast<int64_t>(b.size()) < bytes) b.resize(bytes);
    return b.data();
  }

  int64_t M_ = 0, K_ = 0, G_ = 0, lp_ = 0;
  int8_t* q_ = nullptr;
  int16_t* p_ = nullptr;
  float *d_ = nullptr, *s_ = nullptr;
  int32_t* n_ = nullptr;
  std::vector<uint8_t> own_;  // a large x's buffer, freed with this
};

}  // namespace

std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t block) {
  const Quantized a(checked(x, x.dim() == 2 ? x.size(1) : -1), block);
  return a.tensors();
}

// repack.py's regrouping of packed rows, in place, group by group: a group's regrouped bytes
// fill exactly its 8 rows' bytes. `fields` lists a block's fields in order as (bytes, kind):
// 0 the 8 rows' field side by side, 1 the same after moving Q5's fifth bits (repack.py's
// _bit_moves, given as `moves`: 32 (from, to) bit pairs), 2 interleaved 4 bytes at a time.
void regroup_(torch::Tensor packed, int64_t block_bytes, std::vector<int64_t> fields, std::vector<int64_t> moves) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.device().is_cpu() &&
                  packed.dim() == 2 && packed.size(0) % 8 == 0 && packed.size(1) % block_bytes == 0,
              "regroup_ takes a contiguous CPU uint8 [rows (a multiple of 8), row bytes] tensor");
  TORCH_CHECK(fields.size() % 2 == 0 && moves.size() == 64, "regroup_: bad field or bit tables");
  const int64_t rb = packed.size(1), blocks = rb / block_bytes, groups = packed.size(0) / 8;
  uint8_t* base = packed.data_ptr<uint8_t>();
  minerva::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows(8 * rb);
    for (int64_t grp = g0; grp < g1; ++grp) {
      uint8_t* dst = base + grp * 8 * rb;
      std::memcpy(rows.data(), dst, 8 * rb);
      for (int64_t b = 0; b < blocks; ++b) {
        int64_t at = 0;
        for (size_t f = 0; f < fields.size(); f += 2) {
          const int64_t width = fields[f], kind = fields[f + 1];
          for (int r = 0; r < 8; ++r) {
            const uint8_t* src = rows.data() + r * rb + b * block_bytes + at;
            if (kind == 2) {
              for (int64_t k = 0; k < width / 4; ++k) std::memcpy(dst + 32 * k + 4 * r, src + 4 * k, 4);
            } else if (kind == 1) {
              uint32_t word, out = 0;
              std::memcpy(&word, src, 4);
              for (int i = 0; i < 32; ++i) out |= ((word >> moves[2 * i]) & 1u) << moves[2 * i + 1];
              std::memcpy(dst + 4 * r, &out, 4);
            } else {
              std::memcpy(dst + width * r, src, width);
            }
          }
          dst += 8 * width;
          at += width;
        }
      }
    }
  });
}

std::vector<int64_t> cpu_choices(std::optional<std::vector<int64_t>> set, int64_t qtype) {
  TORCH_CHECK(qtype == -1 || (qtype >= 0 && qtype < CHOICE_TYPES && int8_type(qtype)),
              "cpu_choices: type ", qtype, " is not one the int8 kernels multiply (-1: every type)");
  const TypeChoices& c = type_choices[qtype == -1 ? Q4_K : qtype];
  std::vector<int64_t> was{c.groups, c.l2_ahead, c.x_copy, int_steps};
  if (set) {
    const auto& v = *set;
    const int64_t most_groups = qtype == -1 || is_k_type(qtype) ? 2 : 4;
    TORCH_CHECK(v.size() == 4 && v[0] >= 1 && v[0] <= most_groups && v[1] >= 0 && (v[2] == 0 || v[2] == 1) &&
                    (v[3] == 0 || v[3] == 1),
                "cpu_choices takes [groups (1 or 2 for the K-quants, 1 to 4 for the 32-weight block types), "
                "L2 prefetch distance in bytes (>= 0), x copy (0 or 1), int steps (0 or 1)]");
    int_steps = v[3];
    for (int qt = 0; qt < CHOICE_TYPES; ++qt) {
      if (!int8_type(qt) || (qtype != -1 && qt != qtype)) continue;
      // every type (-1): the groups go to the K-quants; the 32-weight types' streams are set per type
      type_choices[qt] = {qtype == -1 && !is_k_type(qt) ? type_choices[qt].groups : v[0], v[1], v[2]};
    }
  }
  return was;
}

// The int8 compute peak of the widest dot products the kernels above use: `chunks` chunks
// (spread over the threads) of `steps` steps, each 8 independent dot products on registers.
// With AVX-512 VNNI (V16) one 512-bit vpdpbusd each, 64 multiply-adds, as the K-quant tiles
// take; else one 256-bit dot4 (one VNNI instruction, or a maddubs -> madd -> add triple), 32.
// On the Intel AVX-512 machine one thread ran 585 GOPS with 512-bit vpdpbusd against 324 with
// 256-bit (the probe had been 256-bit only, so the prefill fractions it gave there were 1.8x
// too high). Returns the multiply-adds done (the sums feed the result, so nothing is optimised
// away; the value itself means nothing).
double int8_peak_probe(int64_t chunks, int64_t steps) {
#if defined(MINERVA_V16)
  using I = __m512i;
  constexpr double MACS = 512.0;
  auto dot = [](I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); };
  auto set8 = [](int v) { return _mm512_set1_epi8(static_cast<char>(v)); };
  auto set32 = [](int v) { return _mm512_set1_epi32(v); };
  auto first = [](I v) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(v)); };
#else
  using I = __m256i;
  constexpr double MACS = 256.0;
  auto dot = [](I acc, I w, I x) { return dot4(acc, w, x); };
  auto set8 = [](int v) { return _mm256_set1_epi8(static_cast<char>(v)); };
  auto set32 = [](int v) { return _mm256_set1_epi32(v); };
  auto first = [](I v) { return _mm256_extract_epi32(v, 0); };
#endif
  std::atomic<int64_t> sink{0};
  minerva::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      I acc[8], x[8], w = set8(static_cast<int>(3 + c));
      for (int i = 0; i < 8; ++i) {
        acc[i] = set32(i);
        x[i] = set8(5 + i);
      }
      for (int64_t n = 0; n < steps; ++n) {
        for (int i = 0; i < 8; ++i) acc[i] = dot(acc[i], w, x[i]);
        // a new w and x each step, as far as the compiler knows; 8 different x, so no two
        // products are the same expression (one shared maddubs would be counted 8 times)
        asm volatile("" : "+v"(w), "+v"(x[0]), "+v"(x[1]), "+v"(x[2]), "+v"(x[3]));
        asm volatile("" : "+v"(x[4]), "+v"(x[5]), "+v"(x[6]), "+v"(x[7]));
      }
      int64_t total = 0;
      for (int i = 0; i < 8; ++i) total += first(acc[i]);
      sink += total;
    }
  });
  return sink.load() == 42 ? 0.0 : MACS * static_cast<double>(chunks) * static_cast<double>(steps);
}

torch::Tensor grouped_qmatmul_q8(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                                 const std::vector<int64_t>& starts, const std::vector<torch::Tensor>& bias,
                                 int64_t qtype, int64_t rows, int64_t cols) {
  const int64_t E = static_cast<int64_t>(w.size());
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == cols, "x must be float32 [R, ", cols, "]");
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == E + 1 && static_cast<int64_t>(bias.size()) == E &&
                  starts[0] == 0 && starts[E] == x.size(0),
              "grouped_qmatmul_q8: starts must run from 0 to x's rows, one bias per matrix");
  TORCH_CHECK(qtype & REGROUPED, "grouped_qmatmul_q8 takes regrouped matrices");
  return with_format(qtype & ~REGROUPED, [&]<int QT>() -> torch::Tensor {
    if constexpr (has_x8<QT>) {
      const Quantized a(x.contiguous(), is_k<QT> ? 256 : 32);
      const Q8 all = a.view();
      auto y = torch::empty({x.size(0), rows}, torch::dtype(torch::kFloat32));
      float* yp = y.data_ptr<float>();
      const int64_t groups = (rows + 7) / 8;
      // (matrix, block of groups), matrix by matrix: the threads take neighbouring blocks of one
      // matrix, so memory is read as a few long streams. (On the AVX2 machine, round robin over
      // the matrices measured better, 720 ms against 782 for 16 tokens' experts in 24 layers of
      // the GPT-OSS-20B shape; on the AVX-512 machine, with the prefetch distance raised,
      // matrix by matrix gave 31.9 against 29.7 tokens/s at 16 sequences and 11.0 against 9.9
      // at one, `minerva bench sweep` once each.)
      std::vector<std::pair<int64_t, int64_t>> items;
      int64_t most = 0;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t M = starts[e + 1] - starts[e], per = x8_per<QT>(M, cols);
        TORCH_CHECK(M >= 0, "grouped_qmatmul_q8: starts must not decrease");
        if (M > 0) {
          check_args<QT>(w[e], 8 * groups, cols);
          TORCH_CHECK(!bias[e].defined() || bias[e].numel() == 0 ||
                          (bias[e].dtype() == torch::kFloat32 && bias[e].is_contiguous() && bias[e].numel() == rows),
                      "grouped_qmatmul_q8: a bias must be float32 [", rows, "]");
          most = std::max(most, (groups + per - 1) / per);
        }
      }
      for (int64_t e = 0; e < E; ++e)
        for (int64_t blk = 0; blk < most; ++blk) {
          const int64_t M = starts[e + 1] - starts[e];
          if (M > 0 && blk * x8_per<QT>(M, cols) < groups) items.emplace_back(e, blk);
        }
      std::vector<const uint8_t*> wp(E, nullptr);
      std::vector<const float*> bp(E, nullptr);
      for (int64_t e = 0; e < E; ++e) {
        if (starts[e + 1] == starts[e]) continue;
        wp[e] = w[e].data_ptr<uint8_t>();
        if (bias[e].defined() && bias[e].numel() > 0) bp[e] = bias[e].data_ptr<float>();
      }
      minerva::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
        int64_t last = -1;  // the last item of the current expert's run in this chunk
        for (int64_t i = i0; i < i1; ++i) {
          const auto [e, blk] = items[i];
          const int64_t r0 = starts[e], M = starts[e + 1] - r0, per = x8_per<QT>(M, cols);
          const int64_t g0 = per * blk, g1 = std::min(groups, g0 + per);
          const Q8 part{all.q + r0 * all.K, all.p + r0 * all.lp, all.d + r0 * all.G, all.s + r0 * all.G,
                        all.n + r0 * all.G, all.K, all.G, all.lp};
          float* out = yp + r0 * rows;
          if (i > last)
            for (last = i; last + 1 < i1 && items[last + 1].first == e;) ++last;
          const uint8_t* end = wp[e] + std::min(groups, per * (items[last].second + 1)) * 8 * row_bytes<QT>(cols);
          x8_groups<QT>(part, M, wp[e], rows, out + 8 * g0, rows, g0, g1, end);
          if (bp[e] != nullptr)  // as Linear's y.add_(bias): one float add per output
            for (int64_t r = 0; r < M; ++r)
              for (int64_t c = 8 * g0; c < std::min(rows, 8 * g1); ++c) out[r * rows + c] += bp[e][c];
        }
      });
      return y;
    } else {
      TORCH_CHECK(false, "no regrouped layout for GGML type ", qtype & ~REGROUPED);
      return torch::Tensor();
    }
  });
}

namespace {

// One row of x against several matrices (a layer's Q/K/V or gate/up of different types),
// their outputs side by side: one parallel loop over every matrix's work items instead of
// one loop, one join of the threads and one concatenation per matrix. Each work item takes
// the same kernel as qmatmul_q8 on its matrix alone (a regrouped matrix's block of groups, a
// K-quant in the GGUF layout ROW1_NB rows at a time), so each output has the same bits. A
// K-quant's work items in the GGUF layout are `unit` rows, as many as a regrouped Q4_K's,
// so that chunks of items weigh about the same. (1.1B Q4_K_M shape, Q4_K Q/K and Q6_K V:
// greedy decode 1.017x and 1.021x in one process, this loop and one loop a matrix alternating;
// Gemma 3 270M, Q5_0 Q/K and Q8_0 V: 1.025x.)
template <int QT>
void part_items(const Q8& a, const RowMatrix& p, int64_t unit, int64_t i0, int64_t i1, int64_t run, float* y) {
  if constexpr (has_x8<QT>) {
    if (p.qtype & REGROUPED) {
      const int64_t groups = (p.rows + 7) / 8, per = x8_per<QT>(1, a.K), gb = 8 * row_bytes<QT>(a.K);
      const uint8_t* end = p.w + std::min(groups, per * run) * gb;  // this thread's run's weights
      for (int64_t blk = i0; blk < i1; ++blk) {
        const int64_t g0 = per * blk, g1 = std::min(groups, g0 + per);
        x8_groups<QT>(a, 1, p.w, p.rows, y + p.first + 8 * g0, p.rows, g0, g1, end);
      }
      return;
    }
  }
  if constexpr (is_k<QT>) {
    const int64_t rb = row_bytes<QT>(a.K), n0 = i0 * unit, n1 = std::min(p.rows, i1 * unit);
    const uint8_t* end = p.w + std::min(p.rows, run * unit) * rb;
    int64_t n = n0;
    for (; n + ROW1_NB <= n1; n += ROW1_NB) row1<QT, ROW1_NB>(a, p.w + n * rb, rb, y + p.first + n, end);
    for (; n < n1; ++n) row1<QT, 1>(a, p.w + n * rb, rb, y + p.first + n, end);
  }
}

// the activation block qmatmul_q8_parts quantizes x in for a matrix it takes in its one loop
// (regrouped with a group kernel, or a K-quant in the GGUF layout), else 0
int64_t one_loop_block(int64_t qtype) {
  return with_format(qtype & ~REGROUPED, [&]<int QT>() -> int64_t {
    if (qtype & REGROUPED) return has_x8<QT> ? (is_k<QT> ? 256 : 32) : 0;
    return is_k<QT> ? 256 : 0;
  });
}

constexpr size_t PARTS_MOST = 8;  // matrices in one loop (a layer's Q/K/V or gate/up: no heap for their starts)

// qmatmul_q8_parts's one loop over every matrix's work items, for x's one row quantized in `a`.
// A regrouped matrix's work item is its group block (x8_per groups, a per-CPU choice that
// tests change, so counted here); the others' the same rows.
void parts_loop(const Q8& a, const RowMatrices& m, float* y) {
  const auto& parts = m.mats;
  const size_t n = parts.size();
  TORCH_CHECK(n <= PARTS_MOST, "qmatmul_q8_parts: at most ", PARTS_MOST, " matrices in one loop");
  const int64_t unit = 8 * x8_per<Q4_K>(1, a.K);
  std::array<int64_t, PARTS_MOST + 1> starts{};  // each matrix's first work item
  for (size_t i = 0; i < n; ++i)
    starts[i + 1] = starts[i] + with_format(parts[i].qtype & ~REGROUPED, [&]<int QT>() -> int64_t {
                      if constexpr (has_x8<QT>)
                        if (parts[i].qtype & REGROUPED) return ((parts[i].rows + 7) / 8 + x8_per<QT>(1, a.K) - 1) / x8_per<QT>(1, a.K);
                      return (parts[i].rows + unit - 1) / unit;
                    });
  minerva::parallel_for(0, starts[n], 2, [&](int64_t i0, int64_t i1) {
    const int64_t run = minerva::ThreadPool::run_end(i1);
    for (size_t p = 0; p < n; ++p) {
      const int64_t lo = std::max(i0, starts[p]), hi = std::min(i1, starts[p + 1]);
      if (lo >= hi) continue;
      with_format(parts[p].qtype & ~REGROUPED, [&]<int QT>() {
        part_items<QT>(a, parts[p], unit, lo - starts[p], hi - starts[p], std::min(run, starts[p + 1]) - starts[p], y);
        return 0;
      });
    }
  });
}

// qmatmul_q8 of one matrix on x [M, K] quantized in `a`, float32 outputs into y (ldy = its rows)
template <int QT>
void one_matrix(const Q8& a, int64_t M, const RowMatrix& m, float* y) {
  if constexpr (has_w8<QT>) {
    if (m.qtype & REGROUPED) {
      if constexpr (has_x8<QT>) matmul_x8<QT>(a, M, m.w, m.rows, y);
    } else {
      matmul<QT>(a, M, m.w, m.rows, y);
    }
  }
}

}  // namespace

std::optional<RowMatrices> row_matrices(const std::vector<torch::Tensor>& packed, const std::vector<int64_t>& qtypes,
                                        const std::vector<int64_t>& rows, int64_t cols) {
  const size_t n = packed.size();
  TORCH_CHECK(n > 0 && qtypes.size() == n && rows.size() == n, "row_matrices: one type and row count per matrix");
  RowMatrices m;
  m.cols = cols;
  m.block = one_loop_block(qtypes[0]);
  bool together = n > 1 && n <= PARTS_MOST && m.block > 0;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool regrouped = qtypes[i] & REGROUPED;
    const bool ok = with_format(qtypes[i] & ~REGROUPED, [&]<int QT>() -> bool {
      if constexpr (has_w8<QT>) {
        if (regrouped && !has_x8<QT>) return false;
        check_args<QT>(packed[i], regrouped ? (rows[i] + 7) / 8 * 8 : rows[i], cols);
        return true;
      }
      return false;
    });
    if (!ok) return std::nullopt;
    together = together && one_loop_block(qtypes[i]) == m.block;
    m.mats.push_back({packed[i].data_ptr<uint8_t>(), qtypes[i], rows[i], total});
    total += rows[i];
  }
  m.together = together;
  return m;
}

namespace {

template <typename XT>
void row_into(const XT* x, const RowMatrices& m, float* y) {
  if (m.together) {
    const Quantized a(x, 1, m.cols, m.block);
    parts_loop(a.view(), m, y);
    return;
  }
  for (const auto& p : m.mats)
    with_format(p.qtype & ~REGROUPED, [&]<int QT>() {
      if constexpr (has_w8<QT>) {
        const Quantized a(x, 1, m.cols, is_k<QT> ? 256 : 32);
        one_matrix<QT>(a.view(), 1, p, y + p.first);
      }
      return 0;
    });
}

}  // namespace

void qmatmul_q8_row(const float* x, const RowMatrices& m, float* y) { row_into(x, m, y); }

// (the bf16 outputs: the float ones rounded, as qmatmul_q8's as_dtype_of and columns_out round them)
void qmatmul_q8_row(const at::BFloat16* x, const RowMatrices& m, float* scratch, at::BFloat16* y) {
  row_into(x, m, scratch);
  round_bf16(scratch, y, m.outputs());
}

torch::Tensor qmatmul_q8_parts(torch::Tensor x, const std::vector<torch::Tensor>& packed,
                               const std::vector<int64_t>& qtypes, const std::vector<int64_t>& rows, int64_t cols) {
  const size_t n = packed.size();
  TORCH_CHECK(n > 0 && qtypes.size() == n && rows.size() == n, "qmatmul_q8_parts: one type and row count per matrix");
  const int64_t block = one_loop_block(qtypes[0]);
  bool together = x.dim() == 2 && x.size(0) == 1 && block > 0 && n <= PARTS_MOST;
  for (size_t i = 1; i < n && together; ++i) together = one_loop_block(qtypes[i]) == block;
  if (!together) {
    std::vector<torch::Tensor> outs;
    for (size_t i = 0; i < n; ++i) outs.push_back(qmatmul_q8(x, packed[i], qtypes[i], rows[i], cols));
    return torch::cat(outs, 1);
  }
  const Quantized a(checked(x, cols), block);
  const auto m = row_matrices(packed, qtypes, rows, cols);  // (one_loop_block took only 8-bit types)
  auto y = torch::empty({1, m->outputs()}, torch::dtype(torch::kFloat32));
  parts_loop(a.view(), *m, y.data_ptr<float>());
  return as_dtype_of(y, x);
}

torch::Tensor qmatmul_q8(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t rows, int64_t cols) {
  if (qtype & REGROUPED) {
    return with_format(qtype & ~REGROUPED, [&]<int QT>() -> torch::Tensor {
      if constexpr (has_x8<QT>) {
        check_args<QT>(packed, (rows + 7) / 8 * 8, cols);
        const Quantized a(checked(x, cols), is_k<QT> ? 256 : 32);
        const int64_t M = a.rows();
        if (x.dtype() == torch::kBFloat16) {  // rounded as each work item finishes
          auto y = torch::empty({M, rows}, torch::dtype(torch::kBFloat16));
          matmul_x8<QT>(a.view(), M, packed.data_ptr<uint8_t>(), rows, nullptr, y.data_ptr<at::BFloat16>());
          return y;
        }
        auto y = torch::empty({M, rows}, torch::dtype(torch::kFloat32));
        matmul_x8<QT>(a.view(), M, packed.data_ptr<uint8_t>(), rows, y.data_ptr<float>());
        return y;
      } else {
        TORCH_CHECK(false, "no regrouped layout for GGML type ", qtype & ~REGROUPED);
        return x;
      }
    });
  }
  return with_format(qtype, [&]<int QT>() -> torch::Tensor {
    if constexpr (!has_w8<QT>) {
      return qmatmul(x, packed, qtype, rows, cols);  // float matrices keep float activations
    } else {
      check_args<QT>(packed, rows, cols);
      const Quantized a(checked(x, cols), is_k<QT> ? 256 : 32);
      if constexpr (QT == Q3_K || QT == Q6_K)
        if (x.dtype() == torch::kBFloat16 && a.rows() >= PANELS_FROM) {  // as above
          auto y = torch::empty({a.rows(), rows}, torch::dtype(torch::kBFloat16));
          matmul_panels<QT>(a.view(), a.rows(), packed.data_ptr<uint8_t>(), rows, nullptr, y.data_ptr<at::BFloat16>());
          return y;
        }
      auto y = torch::empty({a.rows(), rows}, torch::dtype(torch::kFloat32));
      matmul<QT>(a.view(), a.rows(), packed.data_ptr<uint8_t>(), rows, y.data_ptr<float>());
      return as_dtype_of(y, x);
    }
  });
}
