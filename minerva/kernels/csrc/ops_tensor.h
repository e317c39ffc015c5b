// The tensor-level add_rms_norm and residual_add_, shared by both builds' ops (ops.cpp,
// ops_avx2.cpp): each defines, before including this, by_dtype, norm_rows<T> (with the add) and
// add_rows<T> (h += m over n values, n a multiple of 16) for its vector width.
#pragma once

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
