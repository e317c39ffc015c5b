// The GGML block layouts the packed matmul kernels read, shared by every build
// (qmatmul.cpp for AVX-512, qmatmul_avx2.cpp for AVX2): type ids, block sizes, the
// dispatch from a runtime type id to a template, and the argument checks.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace minerva {

// GGML type ids (gguf.GGMLQuantizationType)
enum : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
             Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39 };

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// MXFP4: the E8M0 block scale as GGML keeps it, halved (2^(e - 128)), since its table of
// E2M1 values is doubled to integers: ±{0, 1, 2, 3, 4, 6, 8, 12}. Exact for every e.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// MXFP4 element values by nibble (bit 3: the sign), doubled as GGML stores them
inline __m128i mxfp4_values() { return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// Q2_K / Q3_K: the 2 low bits of elements 32s + 16h .. 32s + 16h + 15 of a super-block, one per
// byte (qs: its 64 bytes; elements 128n + 32j + l sit at bits 2j of byte 32n + l)
inline __m128i k2_low_bits(const uint8_t* qs, int s, int h) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * (s >> 2) + 16 * h));
  return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(2 * (s & 3))), _mm_set1_epi8(3));
}

// Q3_K (110-byte block b): the same 16 elements as unsigned bytes value + 4 (0..7): the low
// bits from qs (b + 32), the third from bit s of hmask (b) byte l, set when the value is >= 0
inline __m128i q3k_biased(const uint8_t* b, int s, int h) {
  const __m128i bit = _mm_set1_epi8(static_cast<char>(1 << s));
  const __m128i hm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * h));
  const __m128i high = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hm, bit), bit), _mm_set1_epi8(4));
  return _mm_or_si128(k2_low_bits(b + 32, s, h), high);
}

// Q3_K: its 16 6-bit scales (12 bytes at b + 96) as int8 values - 32, scale i in byte i: the
// low 4 bits of scale i are nibble i / 8 of byte i % 8, the high 2 bits are bits 2 (i / 4) of
// byte 8 + i % 4 (in registers: a store and reload of the unpacked bytes would stall on
// store forwarding)
inline __m128i q3k_scales(const uint8_t* b) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 96));
  const __m128i low = _mm_and_si128(_mm_unpacklo_epi64(v, _mm_srli_epi16(v, 4)), _mm_set1_epi8(0x0F));
  int32_t h;
  std::memcpy(&h, b + 104, 4);
  const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(h), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
}

template <int QT> struct Layout;
template <> struct Layout<F32> { static constexpr int block = 32, bytes = 128; };
template <> struct Layout<F16> { static constexpr int block = 32, bytes = 64; };
template <> struct Layout<BF16> { static constexpr int block = 32, bytes = 64; };
template <> struct Layout<Q4_0> { static constexpr int block = 32, bytes = 18; };
template <> struct Layout<Q4_1> { static constexpr int block = 32, bytes = 20; };
template <> struct Layout<Q5_0> { static constexpr int block = 32, bytes = 22; };
template <> struct Layout<Q5_1> { static constexpr int block = 32, bytes = 24; };
template <> struct Layout<Q8_0> { static constexpr int block = 32, bytes = 34; };
template <> struct Layout<Q2_K> { static constexpr int block = 256, bytes = 84; };
template <> struct Layout<Q3_K> { static constexpr int block = 256, bytes = 110; };
template <> struct Layout<Q4_K> { static constexpr int block = 256, bytes = 144; };
template <> struct Layout<Q5_K> { static constexpr int block = 256, bytes = 176; };
template <> struct Layout<Q6_K> { static constexpr int block = 256, bytes = 210; };
template <> struct Layout<MXFP4> { static constexpr int block = 32, bytes = 17; };

// Calls f.template operator()<QT>() for the GGML type `qtype`.
template <typename F>
auto with_format(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0: return f.template operator()<Q4_0>();
    case Q4_1: return f.template operator()<Q4_1>();
    case Q5_0: return f.template operator()<Q5_0>();
    case Q5_1: return f.template operator()<Q5_1>();
    case Q8_0: return f.template operator()<Q8_0>();
    case Q2_K: return f.template operator()<Q2_K>();
    case Q3_K: return f.template operator()<Q3_K>();
    case Q4_K: return f.template operator()<Q4_K>();
    case Q5_K: return f.template operator()<Q5_K>();
    case Q6_K: return f.template operator()<Q6_K>();
    case MXFP4: return f.template operator()<MXFP4>();
    case F32: return f.template operator()<F32>();
    case F16: return f.template operator()<F16>();
    case BF16: return f.template operator()<BF16>();
    default: break;
  }
  TORCH_CHECK(false, "no packed kernel for GGML type ", qtype);
  return f.template operator()<Q4_0>();  // not reached
}

template <int QT>
int64_t row_bytes(int64_t K) { return K / Layout<QT>::block * Layout<QT>::bytes; }

template <int QT>
void check_args(const torch::Tensor& packed, int64_t rows, int64_t cols) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.device().is_cpu(),
              "packed weight must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(cols > 0 && cols % Layout<QT>::block == 0, "row length ", cols,
              " is not a multiple of the block size ", Layout<QT>::block);
  TORCH_CHECK(packed.numel() == rows * row_bytes<QT>(cols), "packed weight has ", packed.numel(),
              " bytes, expected ", rows * row_bytes<QT>(cols));
}

}  // namespace minerva
