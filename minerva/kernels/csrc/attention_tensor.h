// The tensor-level paged_attention, kv_write and kv_write_cols, shared by both builds'
// attention (attention.cpp, attention_avx2.cpp): each defines, before including this,
// paged_attention_into and write_rows<XT, PT> for its vector width.
#pragma once

// q [T, H, D]; k/v pools [blocks, block_size, Hkv, D] (+ float32 scales [blocks, block_size,
// Hkv] for int8, else empty tensors); block_tables [B, max_blocks] int64; seq_lens [B];
// query_start_loc [B + 1]; positions [T]; window <= 0 for none; sinks [H] float32, or empty.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_scale,
                              torch::Tensor v_scale, torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, torch::Tensor positions, int64_t window,
                              double scale, torch::Tensor sinks) {
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D]");
  q = q.contiguous();
  return paged_attention_into(q, k, v, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions, window, scale,
                              sinks, torch::empty_like(q));
}

namespace {

// K or V rows of T tokens, Hkv heads of D = pool.size(3) each, at x (of dtype xt; token t at x +
// t * x_stride elements, dense within), stored at pool slots (kv_write, kv_write_cols)
void write_kv(at::ScalarType xt, void* x, int64_t x_stride, int64_t T, const torch::Tensor& pool,
              const torch::Tensor& scales, torch::Tensor slots) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "the pool must be contiguous [blocks, block_size, Hkv, D]");
  const int64_t Hkv = pool.size(2), D = pool.size(3);
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  slots = minerva::as_int64(slots);
  TORCH_CHECK(slots.numel() == T, "one slot per token");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t num_slots = pool.size(0) * pool.size(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "slot out of range");
  float* sc = nullptr;
  if (pool.scalar_type() == torch::kInt8) {
    TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == num_slots * Hkv,
                "int8 pools need float32 scales [blocks, block_size, Hkv]");
    sc = scales.data_ptr<float>();
  }
  auto go = [&](auto* xp) {
    using XT = std::remove_pointer_t<decltype(xp)>;
    switch (pool.scalar_type()) {
      case torch::kFloat32: write_rows<XT, float>(xp, x_stride, pool.data_ptr<float>(), sc, sl, T, Hkv, D); break;
      case torch::kBFloat16: write_rows<XT, at::BFloat16>(xp, x_stride, pool.data_ptr<at::BFloat16>(), sc, sl, T, Hkv, D); break;
      case torch::kInt8: write_rows<XT, int8_t>(xp, x_stride, pool.data_ptr<int8_t>(), sc, sl, T, Hkv, D); break;
      default: TORCH_CHECK(false, "unsupported pool dtype ", pool.scalar_type());
    }
  };
  if (xt == torch::kFloat32) go(static_cast<float*>(x));
  else if (xt == torch::kBFloat16) go(static_cast<at::BFloat16*>(x));
  else TORCH_CHECK(false, "x must be float32 or bfloat16");
}

}  // namespace

// Store new K or V rows x [T, Hkv, D] (float32/bfloat16; any token stride) at pool slots
// (pool [blocks, block_size, Hkv, D] of float32, bfloat16 or int8 + float32 scales).
void kv_write(torch::Tensor x, torch::Tensor pool, torch::Tensor scales, torch::Tensor slots) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [T, Hkv, D], dense per token");
  TORCH_CHECK(pool.dim() == 4 && pool.size(2) == x.size(1) && pool.size(3) == x.size(2), "pool does not match x");
  write_kv(x.scalar_type(), x.data_ptr(), x.stride(0), x.size(0), pool, scales, slots);
}

// kv_write of the pool's Hkv heads from column col of each row of x [T, width] (a layer's
// Q/K/V output: no views of it to make)
void kv_write_cols(torch::Tensor x, int64_t col, torch::Tensor pool, torch::Tensor scales, torch::Tensor slots) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && pool.dim() == 4 && col >= 0 && col + pool.size(2) * pool.size(3) <= x.size(1),
              "kv_write_cols needs x [T, width] with the heads inside");
  write_kv(x.scalar_type(), static_cast<char*>(x.data_ptr()) + col * x.element_size(), x.stride(0), x.size(0), pool, scales, slots);
}
