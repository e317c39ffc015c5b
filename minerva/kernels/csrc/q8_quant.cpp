// x quantized row by row in blocks of 32 or 256 (q8_quant.h; the recipe: q8_matmul.cpp's top),
// as ggml-cpu's quantize_row_q8_0 / q8_K, and the checks and conversions at the entry points.
#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "q8_blocks.h"
#include "q8_quant.h"

namespace minerva::q8 {

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

// Quantized (q8_quant.h): x's rows quantized into the thread's buffer, for float32 and bfloat16 x
template <typename XT>
void Quantized::init(const XT* xp, int64_t M, int64_t K, int64_t block) {
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
template void Quantized::init<float>(const float*, int64_t, int64_t, int64_t);
template void Quantized::init<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, int64_t);

}  // namespace minerva::q8

using namespace minerva::q8;

std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t block) {
  const Quantized a(checked(x, x.dim() == 2 ? x.size(1) : -1), block);
  return a.tensors();
}
