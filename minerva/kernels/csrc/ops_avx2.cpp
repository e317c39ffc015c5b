// Small fused CPU ops around the matmuls for x86-64 CPUs with AVX2 and FMA (the AVX-512
// build's ops.cpp, on 8-lane vectors): RMSNorm (with the residual add), rotary embedding,
// and the gated activations. Each row is computed on its own in a fixed order (batch
// invariant); math is float32 whatever the storage (float32 / bfloat16).

#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "parallel.h"
#include "simd_avx2.h"

namespace {

using namespace minerva;

template <typename F>
void by_dtype(const torch::Tensor& x, F&& f) {
  if (x.scalar_type() == torch::kFloat32) f(static_cast<float*>(nullptr));
  else if (x.scalar_type() == torch::kBFloat16) f(static_cast<at::BFloat16*>(nullptr));
  else TORCH_CHECK(false, "expected float32 or bfloat16, got ", x.scalar_type());
}

// out = RMSNorm of each row of x; with `a`, first sum = x + a (rounded to T, as torch's add
// rounds; sum may be x itself) and the norm of the stored sums
template <typename T>
void norm_rows(const T* x, const float* w, T* out, int64_t rows, int64_t D, float eps, T* sum = nullptr,
               const T* a = nullptr) {
  minerva::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      if (a != nullptr) {
        for (int64_t d = 0; d < D; d += 8)
          store8(sum + r * D + d, _mm256_add_ps(load8(xr + d, 1.0f), load8(a + r * D + d, 1.0f)));
        xr = sum + r * D;
      }
      __m256 ss = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 v = load8(xr + d, 1.0f);
        ss = _mm256_fmadd_ps(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(reduce_add(ss) / static_cast<float>(D) + eps);
      const __m256 s = _mm256_set1_ps(inv);
      for (int64_t d = 0; d < D; d += 8)
        store8(out + r * D + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(load8(xr + d, 1.0f), s)));
    }
  });
}

// h += m over n values (a multiple of 16), rounded to T as torch's add_ rounds
template <typename T>
void add_rows(T* h, const T* m, int64_t n) {
  minerva::parallel_for(0, n / 8, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0 * 8; i < i1 * 8; i += 8)
      store8(h + i, _mm256_add_ps(load8(h + i, 1.0f), load8(m + i, 1.0f)));
  });
}

// Rotary embedding, half-split layout, in place on Hn heads of D values per token at base +
// t * ts (+ h * D), with cos/sin float32 [T, D/2]: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
template <typename T_>
void rope_rows(T_* base, int64_t ts, int64_t T, int64_t Hn, int64_t D, const float* c, const float* s) {
  const int64_t half = D / 2;
  minerva::parallel_for(0, T * Hn, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hn, h = i % Hn;
      T_* p = base + t * ts + h * D;
      for (int64_t d = 0; d < half; d += 8) {
        const __m256 x1 = load8(p + d, 1.0f), x2 = load8(p + half + d, 1.0f);
        const __m256 cv = _mm256_loadu_ps(c + t * half + d), sv = _mm256_loadu_ps(s + t * half + d);
        store8(p + d, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
        store8(p + half + d, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
      }
    }
  });
}

// gate_up [T, 2I] (gate first) -> act(gate) * up [T, I]; act 0 = silu, 1 = gelu (tanh
// approximation), 2 = GPT-OSS's clamped SwiGLU (see ops.cpp).
template <typename T_>
void act_rows(const T_* in, T_* o, int64_t T, int64_t I, int64_t act, double limit, double alpha) {
  minerva::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 k0 = _mm256_set1_ps(0.7978845608028654f), k1 = _mm256_set1_ps(0.044715f);
    const __m256 hi = _mm256_set1_ps(static_cast<float>(limit)), lo = _mm256_set1_ps(-static_cast<float>(limit));
    const __m256 minus_alpha = _mm256_set1_ps(-static_cast<float>(alpha));
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < I; i += 8) {
        __m256 g = load8(in + t * 2 * I + i, 1.0f), u = load8(in + t * 2 * I + I + i, 1.0f);
        __m256 a;
        if (act == 0) {
          a = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        } else if (act == 1) {  // 0.5 g (1 + tanh(y)) = g * sigmoid(2y), which keeps the negative tail exact
          const __m256 y = _mm256_mul_ps(k0, _mm256_fmadd_ps(_mm256_mul_ps(k1, g), _mm256_mul_ps(g, g), g));
          a = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), y))));
        } else {
          g = _mm256_min_ps(g, hi);
          u = _mm256_add_ps(_mm256_max_ps(_mm256_min_ps(u, hi), lo), one);
          a = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_mul_ps(minus_alpha, g))));
        }
        store8(o + t * I + i, _mm256_mul_ps(a, u));
      }
  });
}

}  // namespace

#include "ops_tensor.h"  // add_rms_norm, residual_add_ and the rotary entry points over the functions above
