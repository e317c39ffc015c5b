// Small fused CPU ops around the matmuls: RMSNorm (with the residual add), rotary
// embedding, and the gated activations. Each row is computed on its own in a fixed
// order (batch invariant); math is float32 whatever the storage (float32 / bfloat16).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

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
        for (int64_t d = 0; d < D; d += 16)
          store16(sum + r * D + d, _mm512_add_ps(load16(xr + d, 1.0f), load16(a + r * D + d, 1.0f)));
        xr = sum + r * D;
      }
      __m512 ss = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        __m512 v = load16(xr + d, 1.0f);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
      __m512 s = _mm512_set1_ps(inv);
      for (int64_t d = 0; d < D; d += 16)
        store16(out + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(w + d), _mm512_mul_ps(load16(xr + d, 1.0f), s)));
    }
  });
}

// h += m over n values (a multiple of 16), rounded to T as torch's add_ rounds
template <typename T>
void add_rows(T* h, const T* m, int64_t n) {
  minerva::parallel_for(0, n / 16, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0 * 16; i < i1 * 16; i += 16)
      store16(h + i, _mm512_add_ps(load16(h + i, 1.0f), load16(m + i, 1.0f)));
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
      for (int64_t d = 0; d < half; d += 16) {
        __m512 x1 = load16(p + d, 1.0f), x2 = load16(p + half + d, 1.0f);
        __m512 cv = _mm512_loadu_ps(c + t * half + d), sv = _mm512_loadu_ps(s + t * half + d);
        store16(p + d, _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)));
        store16(p + half + d, _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)));
      }
    }
  });
}

// gate_up [T, 2I] (gate first) -> act(gate) * up [T, I]; act 0 = silu, 1 = gelu (tanh
// approximation), 2 = GPT-OSS's clamped SwiGLU: g = min(gate, limit), u = clamp(up, ±limit),
// (u + 1) · g · σ(alpha · g). Computed in float32, rounded once to gu's dtype.
template <typename T_>
void act_rows(const T_* in, T_* o, int64_t T, int64_t I, int64_t act, double limit, double alpha) {
  minerva::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 k0 = _mm512_set1_ps(0.7978845608028654f), k1 = _mm512_set1_ps(0.044715f);
    const __m512 hi = _mm512_set1_ps(static_cast<float>(limit)), lo = _mm512_set1_ps(-static_cast<float>(limit));
    const __m512 minus_alpha = _mm512_set1_ps(-static_cast<float>(alpha));
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < I; i += 16) {
        __m512 g = load16(in + t * 2 * I + i, 1.0f), u = load16(in + t * 2 * I + I + i, 1.0f), a;
        if (act == 0) {
          a = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        } else if (act == 1) {  // 0.5 g (1 + tanh(y)) = g * sigmoid(2y), which keeps the negative tail exact
          __m512 y = _mm512_mul_ps(k0, _mm512_fmadd_ps(_mm512_mul_ps(k1, g), _mm512_mul_ps(g, g), g));
          a = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), y))));
        } else {
          g = _mm512_min_ps(g, hi);
          u = _mm512_add_ps(_mm512_max_ps(_mm512_min_ps(u, hi), lo), one);
          a = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_mul_ps(minus_alpha, g))));
        }
        store16(o + t * I + i, _mm512_mul_ps(a, u));
      }
  });
}

}  // namespace

#include "ops_tensor.h"  // add_rms_norm, residual_add_ and the rotary entry points over the functions above
