// x quantized as the int8 kernels take it (the recipe: q8_matmul.cpp's top), as ggml-cpu's
// quantize_row_q8_0 / q8_K: Q8, the kernels' view of it; Quantized, which quantizes x into the
// calling thread's memory (its rows quantized in q8_quant.cpp); and the way back at the entry
// points: x's checks, the outputs rounded to bf16.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace minerva::q8 {

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

// x as the kernels take it: [M, cols], float32 or bfloat16, contiguous (q8_quant.cpp)
torch::Tensor checked(const torch::Tensor& x, int64_t cols);
// y [M, N] float32 as x's dtype, bf16 rounded on the kernels' threads (q8_quant.cpp)
torch::Tensor as_dtype_of(const torch::Tensor& y, const torch::Tensor& x);

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
  void init(const XT* xp, int64_t M, int64_t K, int64_t block);  // (q8_quant.cpp)

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

}  // namespace minerva::q8
