// LoRA adapters on a projection's output, every adapter of a step in one call
// (minerva/models/lora.py): y[row, start:start+n] += B (A x[row]) for each row whose
// adapter adapts that part. The rows come grouped by adapter, so each adapter's A and B are
// read once a step for all of its rows (S-LoRA's and Punica's gathered rows); the
// base model's rows are not touched.
//
// Per entry (one adapter's one part: q, k, v, gate, up, o or down) the weights lie in one
// buffer (float32, or bfloat16 for a bfloat16 model: half the bytes a step streams) as A^T
// [in, r] then (B * scale)^T [r, n], summed in float32; so both products are
// element-wise loops over a contiguous row (r, then n floats) that the compiler vectorizes
// without reassociating a sum: each output is summed in one fixed order, whatever the
// batch, so a request's tokens do not depend on the rows beside it.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace {

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

constexpr int64_t ROWS = 4;     // rows of one adapter whose A products run together (one load of A^T a step)
constexpr int64_t COLUMNS = 64;  // output columns summed in registers over the rank

// t[g] = A x[g] for G <= ROWS rows: A^T [in, R] read once for all of them; each row's sum
// runs over `in` in order, so its value does not depend on the rows beside it.
template <int64_t R, typename W>
void a_product(const W* at, const float* xs, int64_t in, int64_t G, float* t) {
  float acc[ROWS][R] = {};
  for (int64_t i = 0; i < in; ++i) {
    float a[R];
    for (int64_t k = 0; k < R; ++k) a[k] = as_float(at[i * R + k]);
    for (int64_t g = 0; g < ROWS; ++g) {
      const float xv = g < G ? xs[g * in + i] : 0.0f;
      for (int64_t k = 0; k < R; ++k) acc[g][k] += a[k] * xv;
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < R; ++k) t[g * R + k] = acc[g][k];
}

template <typename W>
void a_product_any(const W* at, const float* xs, int64_t in, int64_t G, int64_t r, float* t) {
  std::fill(t, t + G * r, 0.0f);
  for (int64_t i = 0; i < in; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float xv = xs[g * in + i];
      for (int64_t k = 0; k < r; ++k) t[g * r + k] += as_float(at[i * r + k]) * xv;
    }
}

// y[g][c] += sum over k of (B^T)[k, c] t[g][k] for G <= ROWS rows, COLUMNS columns at a time in
// registers, each row of B^T read once for all G rows.
template <typename W, typename Y>
void b_product(const W* bt, const float* t, int64_t r, int64_t n, Y* const* out, int64_t G) {
  int64_t c0 = 0;
  for (; c0 + COLUMNS <= n; c0 += COLUMNS) {
    float acc[ROWS][COLUMNS] = {};
    for (int64_t k = 0; k < r; ++k) {
      float b[COLUMNS];
      for (int64_t j = 0; j < COLUMNS; ++j) b[j] = as_float(bt[k * n + c0 + j]);
      for (int64_t g = 0; g < ROWS; ++g) {
        const float tk = g < G ? t[g * r + k] : 0.0f;
        for (int64_t j = 0; j < COLUMNS; ++j) acc[g][j] += b[j] * tk;
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < COLUMNS; ++j) out[g][c0 + j] = static_cast<Y>(as_float(out[g][c0 + j]) + acc[g][j]);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = c0; c < n; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < r; ++k) acc += as_float(bt[k * n + c]) * t[g * r + k];
      out[g][c] = static_cast<Y>(as_float(out[g][c]) + acc);
    }
}

template <typename X, typename Y, typename W>
void lora_rows(const X* x, int64_t x_stride, Y* y, int64_t y_stride, const int64_t* order, const int64_t* bounds,
               const int64_t* entries, int64_t num_entries, const W* weights, int64_t in) {
  minerva::parallel_for(0, num_entries, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> xs(ROWS * in), t;
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t* en = entries + e * 6;
      const int64_t adapter = en[0], start = en[1], n = en[2], r = en[3];
      const W* at = weights + en[4];  // [in, r]
      const W* bt = weights + en[5];  // [r, n]
      const int64_t first = bounds[adapter], last = bounds[adapter + 1];
      t.resize(ROWS * r);
      for (int64_t g0 = first; g0 < last; g0 += ROWS) {
        const int64_t G = std::min(ROWS, last - g0);
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < in; ++i) xs[g * in + i] = as_float(x[order[g0 + g] * x_stride + i]);
        switch (r) {
          case 8: a_product<8>(at, xs.data(), in, G, t.data()); break;
          case 16: a_product<16>(at, xs.data(), in, G, t.data()); break;
          case 32: a_product<32>(at, xs.data(), in, G, t.data()); break;
          default: a_product_any(at, xs.data(), in, G, r, t.data());
        }
        Y* out[ROWS];
        for (int64_t g = 0; g < G; ++g) out[g] = y + order[g0 + g] * y_stride + start;
        b_product(bt, t.data(), r, n, out, G);
      }
    }
  });
}

template <typename X, typename W>
void lora_y(const torch::Tensor& x, torch::Tensor& y, const int64_t* order, const int64_t* bounds,
            const int64_t* entries, int64_t num_entries, const W* weights) {
  const X* xp = x.data_ptr<X>();
  if (y.scalar_type() == torch::kFloat32)
    lora_rows(xp, x.stride(0), y.data_ptr<float>(), y.stride(0), order, bounds, entries, num_entries, weights,
              x.size(1));
  else
    lora_rows(xp, x.stride(0), y.data_ptr<at::BFloat16>(), y.stride(0), order, bounds, entries, num_entries,
              weights, x.size(1));
}

template <typename W>
void lora_w(const torch::Tensor& x, torch::Tensor& y, const int64_t* order, const int64_t* bounds,
            const int64_t* entries, int64_t num_entries, const W* weights) {
  if (x.scalar_type() == torch::kFloat32)
    lora_y<float>(x, y, order, bounds, entries, num_entries, weights);
  else
    lora_y<at::BFloat16>(x, y, order, bounds, entries, num_entries, weights);
}

}  // namespace

void lora_add_(const torch::Tensor& x, torch::Tensor& y, const torch::Tensor& order, const torch::Tensor& bounds,
               const torch::Tensor& entries, const torch::Tensor& weights) {
  const auto fx = x.scalar_type(), fy = y.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (fx == torch::kFloat32 || fx == torch::kBFloat16),
              "x: float32 or bfloat16 [rows, in] with contiguous rows");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) &&
                  (fy == torch::kFloat32 || fy == torch::kBFloat16),
              "y: float32 or bfloat16 [rows, out] with contiguous rows");
  TORCH_CHECK(order.scalar_type() == torch::kInt64 && order.is_contiguous() && bounds.scalar_type() == torch::kInt64 &&
                  bounds.is_contiguous(), "order, bounds: contiguous int64");
  TORCH_CHECK(entries.scalar_type() == torch::kInt64 && entries.is_contiguous() && entries.dim() == 2 &&
                  entries.size(1) == 6, "entries: contiguous int64 [E, 6]");
  TORCH_CHECK((weights.scalar_type() == torch::kFloat32 || weights.scalar_type() == torch::kBFloat16) &&
                  weights.is_contiguous(), "weights: contiguous float32 or bfloat16");
  const int64_t* en = entries.data_ptr<int64_t>();
  const int64_t num_bounds = bounds.numel(), num_rows = order.numel(), rows = x.size(0), in = x.size(1);
  for (int64_t e = 0; e < entries.size(0); ++e) {  // every entry inside the tensors it indexes
    const int64_t* p = en + e * 6;
    TORCH_CHECK(p[0] >= 0 && p[0] + 1 < num_bounds && p[1] >= 0 && p[2] >= 0 && p[1] + p[2] <= y.size(1) &&
                    p[3] >= 0 && p[4] >= 0 && p[4] + in * p[3] <= weights.numel() && p[5] >= 0 &&
                    p[5] + p[3] * p[2] <= weights.numel(), "entry ", e, " lies outside y or the weights");
  }
  const int64_t* b = bounds.data_ptr<int64_t>();
  const int64_t* o = order.data_ptr<int64_t>();
  for (int64_t i = 0; i + 1 < num_bounds; ++i)
    TORCH_CHECK(0 <= b[i] && b[i] <= b[i + 1] && b[i + 1] <= num_rows, "bounds: not increasing within order");
  for (int64_t i = 0; i < num_rows; ++i) TORCH_CHECK(0 <= o[i] && o[i] < rows, "order: a row outside x");
  if (weights.scalar_type() == torch::kFloat32)
    lora_w(x, y, o, b, en, entries.size(0), weights.data_ptr<float>());
  else
    lora_w(x, y, o, b, en, entries.size(0), weights.data_ptr<at::BFloat16>());
}
