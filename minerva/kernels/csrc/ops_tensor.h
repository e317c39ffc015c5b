// The tensor-level rms_norm, add_rms_norm, residual_add_, rope_, rope_cols_ and act_mul, and
// their one-row forms on raw memory, shared by both builds' ops (ops.cpp, ops_avx2.cpp): each
// defines, before including this, by_dtype, norm_rows<T> (with the add), add_rows<T> (h += m
// over n values, n a multiple of 16), rope_rows<T> and act_rows<T> for its vector width.
#pragma once

// RMSNorm over the last dim: w * (x / sqrt(mean(x^2) + eps)); w float32 [D].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = x.contiguous();
  return rms_norm_into(x, w, eps, torch::empty_like(x));
}

// rms_norm into `out` (contiguous, x's shape and dtype), which it returns
torch::Tensor rms_norm_into(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor out) {
  x = x.contiguous();
  const int64_t D = x.size(-1);
  TORCH_CHECK(D % 16 == 0 && w.numel() == D && w.scalar_type() == torch::kFloat32, "bad rms_norm shapes");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must be contiguous, of x's shape and dtype");
  w = w.contiguous();
  by_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    norm_rows<T>(x.data_ptr<T>(), w.data_ptr<float>(), out.data_ptr<T>(), x.numel() / D, D, static_cast<float>(eps));
  });
  return out;
}

// h += a (in place, rounded to h's dtype as torch's add_ rounds), then return rms_norm(h).
torch::Tensor add_rms_norm(torch::Tensor h, torch::Tensor a, torch::Tensor w, double eps) {
  return add_rms_norm_into(h, a, w, eps, torch::empty_like(h));
}

// add_rms_norm with the norm into `out` (contiguous, h's shape and dtype), which it returns
torch::Tensor add_rms_norm_into(torch::Tensor h, torch::Tensor a, torch::Tensor w, double eps, torch::Tensor out) {
  TORCH_CHECK(h.is_contiguous() && h.sizes() == a.sizes() && h.scalar_type() == a.scalar_type(), "bad add_rms_norm args");
  const int64_t D = h.size(-1);
  TORCH_CHECK(D % 16 == 0 && w.numel() == D && w.scalar_type() == torch::kFloat32, "bad rms_norm shapes");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == h.sizes() && out.scalar_type() == h.scalar_type(),
              "add_rms_norm: out must be contiguous, of h's shape and dtype");
  const auto ac = a.contiguous();
  const auto wc = w.contiguous();
  by_dtype(h, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* hp = h.data_ptr<T>();
    norm_rows<T>(hp, wc.data_ptr<float>(), out.data_ptr<T>(), h.numel() / D, D, static_cast<float>(eps), hp,
                 ac.data_ptr<T>());
  });
  return out;
}

// h += m in place, rounded to h's dtype as torch's add_ rounds (the residual stream's add)
torch::Tensor residual_add_(torch::Tensor h, const torch::Tensor& m) {
  TORCH_CHECK(h.is_contiguous() && h.sizes() == m.sizes() && h.scalar_type() == m.scalar_type() && h.size(-1) % 16 == 0,
              "residual_add_: h and m must be the same contiguous shape and dtype, rows a multiple of 16");
  const auto mc = m.contiguous();
  by_dtype(h, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_rows<T>(h.data_ptr<T>(), mc.data_ptr<T>(), h.numel());
  });
  return h;
}

// rope_rows on x [T, heads, D]
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope_ needs x [T, heads, D] dense per token");
  const int64_t T = x.size(0), Hn = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(half % 16 == 0 && cos.size(0) == T && cos.size(1) == half, "bad rope shapes");
  cos = cos.contiguous(), sin = sin.contiguous();
  by_dtype(x, [&](auto* tag) {
    using T_ = std::remove_pointer_t<decltype(tag)>;
    rope_rows<T_>(x.data_ptr<T_>(), x.stride(0), T, Hn, D, cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

// rope_rows on `heads` heads of D = 2 cos.size(1) from column col of each row of x [T, width]
// (a layer's Q/K/V output: no views of it to make)
void rope_cols_(torch::Tensor x, int64_t col, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  const int64_t T = x.size(0), half = cos.size(1), D = 2 * half;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && col >= 0 && col + heads * D <= x.size(1), "rope_cols_ needs x [T, width] with the heads inside");
  TORCH_CHECK(half % 16 == 0 && cos.size(0) == T && sin.sizes() == cos.sizes(), "bad rope shapes");
  cos = cos.contiguous(), sin = sin.contiguous();
  by_dtype(x, [&](auto* tag) {
    using T_ = std::remove_pointer_t<decltype(tag)>;
    rope_rows<T_>(x.data_ptr<T_>() + col, x.stride(0), T, heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

// gate_up [T, 2I] (gate first) -> act(gate) * up [T, I] (act_rows; ACT_SWIGLU_LIMIT takes
// limit and alpha)
torch::Tensor act_mul(torch::Tensor gu, int64_t act, double limit, double alpha) {
  gu = gu.contiguous();
  TORCH_CHECK(gu.dim() == 2, "act_mul needs [T, 2I]");
  return act_mul_into(gu, act, limit, alpha, torch::empty({gu.size(0), gu.size(1) / 2}, gu.options()));
}

// act_mul into `out` (contiguous [T, I] of gu's dtype), which it returns
torch::Tensor act_mul_into(torch::Tensor gu, int64_t act, double limit, double alpha, torch::Tensor out) {
  gu = gu.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.dim() == 2 && I % 16 == 0, "act_mul needs [T, 2I] with I a multiple of 16");
  TORCH_CHECK(act >= 0 && act <= ACT_SWIGLU_LIMIT, "act_mul: unknown activation ", act);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == T && out.size(1) == I &&
                  out.scalar_type() == gu.scalar_type(),
              "act_mul: out must be contiguous [T, I] of gu's dtype");
  by_dtype(gu, [&](auto* tag) {
    using T_ = std::remove_pointer_t<decltype(tag)>;
    act_rows<T_>(gu.data_ptr<T_>(), out.data_ptr<T_>(), T, I, act, limit, alpha);
  });
  return out;
}

// The same row kernels on one row in memory, as the functions above run them on a one-row
// tensor (the same bits), for a decode step's decoder layer (module.cpp), where each tensor
// made or checked costs microseconds after a matmul's weights have streamed through the caches.
template <typename T>
void rms_norm_row(const T* x, const float* w, T* out, int64_t n, int64_t D, float eps) {
  norm_rows<T>(x, w, out, n / D, D, eps);
}
template <typename T>
void add_rms_norm_row(T* h, const T* a, const float* w, T* out, int64_t D, float eps) {
  norm_rows<T>(h, w, out, 1, D, eps, h, a);
}
template <typename T>
void residual_add_row(T* h, const T* m, int64_t D) {
  add_rows<T>(h, m, D);
}
template <typename T>
void rope_row(T* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  rope_rows<T>(x, heads * D, 1, heads, D, cos, sin);
}
template <typename T>
void act_mul_row(const T* gu, T* out, int64_t I, int64_t act) {
  act_rows<T>(gu, out, 1, I, act, 0.0, 0.0);
}
#define MINERVA_ROW_OPS(T)                                                                  \
  template void rms_norm_row<T>(const T*, const float*, T*, int64_t, int64_t, float);       \
  template void add_rms_norm_row<T>(T*, const T*, const float*, T*, int64_t, float);        \
  template void residual_add_row<T>(T*, const T*, int64_t);                                 \
  template void rope_row<T>(T*, int64_t, int64_t, const float*, const float*);              \
  template void act_mul_row<T>(const T*, T*, int64_t, int64_t);
MINERVA_ROW_OPS(float)
MINERVA_ROW_OPS(at::BFloat16)
#undef MINERVA_ROW_OPS
