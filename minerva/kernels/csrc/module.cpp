// The Python module: every kernel, a whole decoder layer as one call, and a mixture of
// experts' expert loop as one call.
//
// DecoderLayer runs the same kernels, in the same order, as minerva/models/layers.py's
// DecoderLayer.forward on its native path, so both give the same bits; it only saves the
// Python between them (a decode step of a small model is mostly that).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include <pybind11/stl.h>

#include "exchange.h"
#include "kernels.h"
#include "parallel.h"

namespace {

struct Packed {
  torch::Tensor bytes;
  int64_t qtype, rows, cols;
  bool int8 = false;  // 8-bit activations (qmatmul_q8)
  torch::Tensor operator()(const torch::Tensor& x) const {
    return int8 ? qmatmul_q8(x, bytes, qtype, rows, cols) : qmatmul(x, bytes, qtype, rows, cols);
  }
};

// One projection or several on the same input (Q/K/V of different GGML types), outputs side by
// side; with 8-bit activations several run as one parallel loop (qmatmul_q8_parts).
struct Projections {
  std::vector<Packed> parts;
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (parts.size() == 1) return parts[0](x);
    if (std::all_of(parts.begin(), parts.end(), [](const Packed& p) { return p.int8; })) {
      std::vector<torch::Tensor> bytes;
      std::vector<int64_t> qtypes, rows;
      for (const auto& p : parts) bytes.push_back(p.bytes), qtypes.push_back(p.qtype), rows.push_back(p.rows);
      return qmatmul_q8_parts(x, bytes, qtypes, rows, parts[0].cols);
    }
    std::vector<torch::Tensor> outs;
    for (const auto& p : parts) outs.push_back(p(x));
    return torch::cat(outs, 1);
  }
};

// The outputs a layer's steps pass on inside the layer (the input norm's, attention's, the
// pre-feed-forward norm's, the activation's), kept from one call to the next for up to
// KEPT_ROWS tokens (decode) instead of allocated each time. A fresh tensor goes through
// torch's allocator and dispatcher, whose code and data a matmul's weights have just pushed
// out of the caches. Intel Xeon, greedy decode of the 1.1B Q4_K_M shape, timers around each
// step of the layer: the steps between the matmuls took ~2.6 ms of a ~26 ms token (the helper
// threads idle meanwhile; the matmuls streamed at ~96% of one large matrix's rate), the input
// norm ~12 us a call of which ~8 went with a kept output (part of that cost then moves to
// the next call that enters torch's code); with these four outputs kept and Q/K/V's rotary
// and KV writes without views (rope_cols_, kv_write_cols), the two builds alternating:
// forward 1.3% faster (6 of 8 pairs), SmolLM2 135M 3-10%.
struct Kept {
  static constexpr int64_t KEPT_ROWS = 16;
  enum Slot { NORM, ATTENTION, MLP_NORM, ACT, SLOTS };
  torch::Tensor t[SLOTS];
  torch::Tensor get(Slot s, at::IntArrayRef sizes, at::ScalarType dtype) {
    if (sizes[0] > KEPT_ROWS) return torch::empty(sizes, torch::dtype(dtype));
    torch::Tensor& k = t[s];
    if (!k.defined() || k.sizes() != sizes || k.scalar_type() != dtype) k = torch::empty(sizes, torch::dtype(dtype));
    return k;
  }
};

// A decode step's one token through a layer on raw memory: the layer's matrices as
// qmatmul_q8_row takes them, and its outputs kept as rows of the residual stream's dtype (q
// and attn [1, heads, head_dim] tensors for the attention kernel: q a view of qkv_out's first
// columns, or with Q/K norms their output, as k [1, kv_heads, head_dim] is; scratch: the
// float32 matmul outputs of a bfloat16 stream).
struct RowPath {
  RowMatrices qkv, o, gate_up, down;
  at::ScalarType dtype = at::ScalarType::Undefined;  // of the buffers below, made on first use
  torch::Tensor norm, qkv_out, q, k, attn, out, gu, act, scratch;
};

struct DecoderLayer {
  Projections qkv;
  Packed o;
  Projections gate_up;
  Packed down;
  torch::Tensor input_norm, pre_mlp_norm;
  std::optional<torch::Tensor> post_attn_norm, post_mlp_norm, q_norm, k_norm;
  double eps;
  int64_t heads, kv_heads, head_dim, window, act;
  double scale;
  mutable Kept kept;  // (one caller at a time: the engine's loop, or one tensor-parallel rank's)
  mutable std::optional<RowPath> row;  // (its buffers likewise)
  // LoRA adapters on q/k/v, o, gate/up and down (adapt()), applied to a step's adapted rows
  std::shared_ptr<const LoraRows> lora_rows;
  LoraWeights lora[4];
  enum { QKV, O, GATE_UP, DOWN };

  bool adapted() const { return lora_rows != nullptr && lora_rows->active; }

  // The row path when this layer can take it: float32 norms, every matrix with 8-bit
  // activations (Packed::int8; others run the float kernels).
  void plan_rows() {
    if (q_norm.has_value() != k_norm.has_value()) return;
    const int64_t D = input_norm.numel();
    auto fits = [](const torch::Tensor& n, int64_t size) {
      return n.scalar_type() == torch::kFloat32 && n.is_contiguous() && n.numel() == size;
    };
    if (!fits(input_norm, D) || !fits(pre_mlp_norm, D) || (post_attn_norm && !fits(*post_attn_norm, D)) ||
        (post_mlp_norm && !fits(*post_mlp_norm, D)) || (q_norm && (!fits(*q_norm, head_dim) || !fits(*k_norm, head_dim))))
      return;
    auto mats = [](const std::vector<Packed>& ps) -> std::optional<RowMatrices> {
      std::vector<torch::Tensor> bytes;
      std::vector<int64_t> qtypes, rows;
      for (const auto& p : ps) {
        if (!p.int8 || p.cols != ps[0].cols) return std::nullopt;
        bytes.push_back(p.bytes), qtypes.push_back(p.qtype), rows.push_back(p.rows);
      }
      return row_matrices(bytes, qtypes, rows, ps[0].cols);
    };
    auto qkv_m = mats(qkv.parts), o_m = mats({o}), gu_m = mats(gate_up.parts), down_m = mats({down});
    if (!qkv_m || !o_m || !gu_m || !down_m) return;
    const int64_t qd = heads * head_dim, kd = kv_heads * head_dim, I = gu_m->outputs() / 2;
    if (qkv_m->cols != D || qkv_m->outputs() != qd + 2 * kd || o_m->cols != qd || o_m->outputs() != D ||
        gu_m->cols != D || gu_m->outputs() != 2 * I || down_m->cols != I || down_m->outputs() != D ||
        D % 16 || I % 16 || head_dim % 32)
      return;
    row = RowPath{*qkv_m, *o_m, *gu_m, *down_m};
  }

  // the row path's buffers in dtype
  RowPath& row_buffers(at::ScalarType dtype) const {
    RowPath& r = *row;
    if (r.dtype == dtype) return r;
    const int64_t D = input_norm.numel(), qd = heads * head_dim, kd = kv_heads * head_dim, I = r.down.cols;
    const auto t = torch::dtype(dtype);
    r.norm = torch::empty({1, D}, t), r.qkv_out = torch::empty({1, qd + 2 * kd}, t);
    if (q_norm) {
      r.q = torch::empty({1, heads, head_dim}, t), r.k = torch::empty({1, kv_heads, head_dim}, t);
    } else {
      r.q = r.qkv_out.narrow(1, 0, qd).view({1, heads, head_dim});
    }
    r.attn = torch::empty({1, heads, head_dim}, t), r.out = torch::empty({1, D}, t);
    r.gu = torch::empty({1, 2 * I}, t), r.act = torch::empty({1, I}, t);
    r.scratch = torch::empty({std::max({qd + 2 * kd, D, 2 * I})}, torch::dtype(torch::kFloat32));
    r.dtype = dtype;
    return r;
  }

  // h [T, hidden] is the residual stream, updated in place and returned.
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& k_scale,
                        const torch::Tensor& v_scale, const torch::Tensor& slots, const torch::Tensor& tables,
                        const torch::Tensor& seq_lens, const torch::Tensor& qsl, const torch::Tensor& positions) const {
    if (row && !adapted() && h.size(0) == 1 && h.is_contiguous() && h.numel() == input_norm.numel()) {
      if (h.scalar_type() == torch::kFloat32)
        return forward_row<float>(h, cos, sin, k_pool, v_pool, k_scale, v_scale, slots, tables, seq_lens, qsl, positions);
      if (h.scalar_type() == torch::kBFloat16)
        return forward_row<at::BFloat16>(h, cos, sin, k_pool, v_pool, k_scale, v_scale, slots, tables, seq_lens, qsl,
                                         positions);
    }
    auto a = attention(h, cos, sin, k_pool, v_pool, k_scale, v_scale, slots, tables, seq_lens, qsl, positions);
    return residual(h, feed_forward(h, a));
  }

  // forward for one token (T: float or at::BFloat16, h's dtype): the same kernels in the same
  // order as attention(), feed_forward() and residual(), on the row path's buffers, with no
  // tensor made and only the KV writes and attention taking tensors. After a matmul's weights
  // have streamed through the caches, each torch allocation, view and dispatch costs
  // microseconds (Intel Xeon, 1.1B Q4_K_M shape: ~2.3 ms of a ~26 ms token went to the steps
  // between the matmuls before this path). The builds before and after alternating, greedy
  // decode in bfloat16, medians of the forward's time a token: 1.1B Q4_K_M 2-6% faster (3 of
  // 3 pairs), SmolLM2 135M 9-12% (3 of 3), Gemma 3 270M 4% (5 of 6 pairs). Timers around
  // each step then (a temporary build, the same 1.1B decode) gave medians of 1.8 us for the
  // input norm, 2.6 and 1.2 for the K and V writes and 13.4 for the attention a layer (the
  // rotary 1.3 on average).
  template <typename T>
  torch::Tensor forward_row(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                            const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& k_scale,
                            const torch::Tensor& v_scale, const torch::Tensor& slots, const torch::Tensor& tables,
                            const torch::Tensor& seq_lens, const torch::Tensor& qsl, const torch::Tensor& positions) const {
    const RowPath& r = row_buffers(h.scalar_type());
    const int64_t D = input_norm.numel(), qd = heads * head_dim, kd = kv_heads * head_dim, I = r.down.cols;
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.numel() == head_dim / 2 && sin.numel() == head_dim / 2,
                "DecoderLayer: cos and sin must be float32 [1, head_dim / 2]");
    T *hp = h.data_ptr<T>(), *x = r.norm.data_ptr<T>(), *qkv_p = r.qkv_out.data_ptr<T>();
    T *out = r.out.data_ptr<T>(), *gu = r.gu.data_ptr<T>(), *act_p = r.act.data_ptr<T>();
    float* scratch = r.scratch.data_ptr<float>();
    auto matmul = [&](const T* in, const RowMatrices& m, T* y) {
      if constexpr (std::is_same_v<T, float>) qmatmul_q8_row(in, m, y);
      else qmatmul_q8_row(in, m, scratch, y);
    };
    const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
    const float e = static_cast<float>(eps);
    rms_norm_row<T>(hp, input_norm.data_ptr<float>(), x, D, D, e);
    matmul(x, r.qkv, qkv_p);
    if (q_norm) {  // each head normed (rows of head_dim) into q and k
      T *q = r.q.data_ptr<T>(), *k = r.k.data_ptr<T>();
      rms_norm_row<T>(qkv_p, q_norm->data_ptr<float>(), q, qd, head_dim, e);
      rms_norm_row<T>(qkv_p + qd, k_norm->data_ptr<float>(), k, kd, head_dim, e);
      rope_row<T>(q, heads, head_dim, c, s);
      rope_row<T>(k, kv_heads, head_dim, c, s);
      kv_write(r.k, k_pool, k_scale, slots);
    } else {
      rope_row<T>(qkv_p, heads, head_dim, c, s);
      rope_row<T>(qkv_p + qd, kv_heads, head_dim, c, s);
      kv_write_cols(r.qkv_out, qd, k_pool, k_scale, slots);
    }
    kv_write_cols(r.qkv_out, qd + kd, v_pool, v_scale, slots);
    paged_attention_into(r.q, k_pool, v_pool, k_scale, v_scale, tables, seq_lens, qsl, positions, window, scale,
                         torch::Tensor(), r.attn);
    matmul(r.attn.data_ptr<T>(), r.o, out);
    // (the post norms in place: each value comes from its own and the row's sum of squares)
    if (post_attn_norm) rms_norm_row<T>(out, post_attn_norm->data_ptr<float>(), out, D, D, e);
    add_rms_norm_row<T>(hp, out, pre_mlp_norm.data_ptr<float>(), x, D, e);
    matmul(x, r.gate_up, gu);
    act_mul_row<T>(gu, act_p, I, act);
    matmul(act_p, r.down, out);
    if (post_mlp_norm) rms_norm_row<T>(out, post_mlp_norm->data_ptr<float>(), out, D, D, e);
    residual_add_row<T>(hp, out, D);
    return h;
  }

  // The three parts of forward, for tensor parallelism: each rank's attention and
  // feed-forward outputs are partial sums, all-reduced between the parts.
  // attention: the attention sublayer's output (o projection), before its post-norm.
  torch::Tensor attention(const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& k_scale,
                          const torch::Tensor& v_scale, const torch::Tensor& slots, const torch::Tensor& tables,
                          const torch::Tensor& seq_lens, const torch::Tensor& qsl,
                          const torch::Tensor& positions) const {
    const int64_t T = h.size(0), qd = heads * head_dim, kd = kv_heads * head_dim;
    const auto x = rms_norm_into(h, input_norm, eps, kept.get(Kept::NORM, h.sizes(), h.scalar_type()));
    auto qkv_out = qkv(x);
    lora[QKV].add_(lora_rows.get(), x, qkv_out);
    torch::Tensor q;
    if (q_norm) {
      q = rms_norm(qkv_out.narrow(1, 0, qd).view({T, heads, head_dim}), *q_norm, eps);
      auto k = rms_norm(qkv_out.narrow(1, qd, kd).view({T, kv_heads, head_dim}), *k_norm, eps);
      rope_(q, cos, sin);
      rope_(k, cos, sin);
      kv_write(k, k_pool, k_scale, slots);
    } else {  // in place in qkv_out, without views of it (each a dispatch through torch)
      rope_cols_(qkv_out, 0, heads, cos, sin);
      rope_cols_(qkv_out, qd, kv_heads, cos, sin);
      kv_write_cols(qkv_out, qd, k_pool, k_scale, slots);
      q = qkv_out.narrow(1, 0, qd).view({T, heads, head_dim}).contiguous();
    }
    kv_write_cols(qkv_out, qd + kd, v_pool, v_scale, slots);
    auto attn = paged_attention_into(q, k_pool, v_pool, k_scale, v_scale, tables, seq_lens, qsl, positions, window, scale,
                                     torch::Tensor(), kept.get(Kept::ATTENTION, q.sizes(), q.scalar_type()));
    const auto flat = attn.view({T, qd});
    auto out = o(flat);
    lora[O].add_(lora_rows.get(), flat, out);
    return out;
  }

  // feed_forward: h += post_attn_norm(a), then the feed-forward's output (down), before its post-norm.
  torch::Tensor feed_forward(torch::Tensor h, torch::Tensor a) const {
    if (post_attn_norm) a = rms_norm(a, *post_attn_norm, eps);
    const auto x = add_rms_norm_into(h, a, pre_mlp_norm, eps, kept.get(Kept::MLP_NORM, h.sizes(), h.scalar_type()));
    auto gu = gate_up(x).contiguous();
    lora[GATE_UP].add_(lora_rows.get(), x, gu);
    const auto y = act_mul_into(gu, act, 0.0, 0.0, kept.get(Kept::ACT, {gu.size(0), gu.size(1) / 2}, gu.scalar_type()));
    auto out = down(y);
    lora[DOWN].add_(lora_rows.get(), y, out);
    return out;
  }

  // residual: h += post_mlp_norm(m), returned.
  torch::Tensor residual(torch::Tensor h, torch::Tensor m) const {
    if (post_mlp_norm) m = rms_norm(m, *post_mlp_norm, eps);
    return residual_add_(h, m);
  }
};

// A model's decoder layers, each over its own pools, rotary tables, slots and block table (a
// sliding-window layer's group has its own; see minerva/kernels/kv_layout.py) with the step's
// lengths and positions shared: CausalLM.forward's loop over its native layers in one call,
// without the Python and the argument conversions of a call per layer.
torch::Tensor forward_layers(const std::vector<const DecoderLayer*>& layers, torch::Tensor h,
                             const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                             const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                             const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
                             const std::vector<torch::Tensor>& slots, const std::vector<torch::Tensor>& tables,
                             const torch::Tensor& seq_lens, const torch::Tensor& qsl, const torch::Tensor& positions) {
  const size_t n = layers.size();
  TORCH_CHECK(cos.size() == n && sin.size() == n && k_pools.size() == n && v_pools.size() == n &&
                  k_scales.size() == n && v_scales.size() == n && slots.size() == n && tables.size() == n,
              "forward_layers: one rotary table pair, pool pair, scale pair, slot mapping and block table per layer");
  for (size_t i = 0; i < n; ++i)
    h = layers[i]->forward(h, cos[i], sin[i], k_pools[i], v_pools[i], k_scales[i], v_scales[i], slots[i], tables[i],
                           seq_lens, qsl, positions);
  return h;
}

// forward_layers, then the final RMSNorm and the LM head (`head`), as float32 logits: a step
// whose every row needs logits (decode) in one call, where CausalLM.forward and .logits made
// three more from Python (the norm, the head, the conversion), each slow to start after the
// layers' weights have streamed through the caches. The same kernels in the same order, so
// the same bits. Returns the normed hidden states and the logits.
std::vector<torch::Tensor> forward_logits(const std::vector<const DecoderLayer*>& layers, torch::Tensor h,
                                          const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                                          const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                                          const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
                                          const std::vector<torch::Tensor>& slots, const std::vector<torch::Tensor>& tables,
                                          const torch::Tensor& seq_lens, const torch::Tensor& qsl, const torch::Tensor& positions,
                                          const torch::Tensor& norm, double eps, const Packed& head) {
  h = rms_norm(forward_layers(layers, h, cos, sin, k_pools, v_pools, k_scales, v_scales, slots, tables, seq_lens, qsl,
                              positions),
               norm, eps);
  return {h, head(h).to(torch::kFloat32)};
}

// A whole decode step from its token ids: the embedding's rows of `ids` (packed GGML rows, a
// regrouped Q8_0 matrix's (qtype | REGROUPED), or a plain float matrix's with qtype -1, as
// `dtype`, times `embed_scale` when given), each rotary's cos and sin tables at `positions`
// (inv_freqs[r], scaled by factors[r] unless 1; `which` names each layer's), then forward_logits. The ATen ops of CausalLM._embedded and
// Rotary.cos_sin in their order, so the same bits, without their Python.
std::vector<torch::Tensor> forward_step(const std::vector<const DecoderLayer*>& layers, const torch::Tensor& ids,
                                        const torch::Tensor& embed, int64_t embed_qtype, int64_t cols,
                                        std::optional<double> embed_scale, at::ScalarType dtype,
                                        const std::vector<torch::Tensor>& inv_freqs, const std::vector<double>& factors,
                                        const std::vector<int64_t>& which,
                                        const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                                        const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
                                        const std::vector<torch::Tensor>& slots, const std::vector<torch::Tensor>& tables,
                                        const torch::Tensor& seq_lens, const torch::Tensor& qsl, const torch::Tensor& positions,
                                        const torch::Tensor& norm, double eps, const Packed& head) {
  TORCH_CHECK(inv_freqs.size() == factors.size() && which.size() == layers.size(),
              "forward_step: one factor per rotary and one rotary index per layer");
  const auto picked = embed_qtype >= 0 && (embed_qtype & REGROUPED) ? regrouped_rows(embed, embed_qtype, ids, cols)
                                                                     : embed.index_select(0, ids);
  auto h = (embed_qtype < 0 ? picked : dequantize_rows(picked, embed_qtype & ~REGROUPED, cols)).to(dtype);
  if (embed_scale) h = h * torch::scalar_tensor(*embed_scale, torch::dtype(h.scalar_type()));
  std::vector<torch::Tensor> rc, rs;
  const auto p = positions.to(torch::kFloat32).unsqueeze(1);
  for (size_t r = 0; r < inv_freqs.size(); ++r) {
    const auto freqs = p * inv_freqs[r].unsqueeze(0);
    auto c = freqs.cos(), s = freqs.sin();
    if (factors[r] != 1.0) c = c * factors[r], s = s * factors[r];
    rc.push_back(c), rs.push_back(s);
  }
  std::vector<torch::Tensor> cos, sin;
  for (int64_t r : which) {
    TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(rc.size()), "forward_step: no rotary ", r);
    cos.push_back(rc[r]), sin.push_back(rs[r]);
  }
  return forward_logits(layers, h, cos, sin, k_pools, v_pools, k_scales, v_scales, slots, tables, seq_lens, qsl,
                        positions, norm, eps, head);
}

// A burst of greedy decode steps (minerva/engine/runner.py, ModelRunner._burst): `steps` times,
// each row's token of the step before (`tokens`, then each step's argmax) fed in one position
// on, forward_step, each row's argmax (greedy_rows: -1 for NaN/inf logits). Before each step
// `ids`, `positions` and `seq_lens` (views of the runner's step buffer) move on by that token,
// and each layer's `slots` (the same memory for the layers of one group) to the slot of the new
// position in the layer's block table, which must cover it. Ends early after a step where a row
// samples one of `stop_ids` or -1, or `interrupt()` (None: never) is true. Without Python between
// the steps: from Python each cost 0.2-0.3 ms of cold-cache glue (1.1B shape, 2 threads).
// Returns (each step's tokens, the last step's hidden states, its logits).
py::tuple forward_steps(int64_t steps, std::vector<int64_t> tokens, const std::vector<int64_t>& stop_ids,
                        int64_t block_size, const py::object& interrupt,
                        const std::vector<const DecoderLayer*>& layers, const torch::Tensor& ids,
                        const torch::Tensor& embed, int64_t embed_qtype, int64_t cols,
                        std::optional<double> embed_scale, at::ScalarType dtype,
                        const std::vector<torch::Tensor>& inv_freqs, const std::vector<double>& factors,
                        const std::vector<int64_t>& which,
                        const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                        const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
                        const std::vector<torch::Tensor>& slots, const std::vector<torch::Tensor>& tables,
                        const torch::Tensor& seq_lens, const torch::Tensor& qsl, const torch::Tensor& positions,
                        const torch::Tensor& norm, double eps, const Packed& head) {
  const int64_t B = ids.numel();
  auto ok = [B](const torch::Tensor& t) {
    return t.scalar_type() == torch::kLong && t.is_contiguous() && t.dim() == 1 && t.size(0) == B;
  };
  TORCH_CHECK(steps >= 1 && block_size >= 1 && static_cast<int64_t>(tokens.size()) == B && ok(ids) &&
                  ok(positions) && ok(seq_lens) && slots.size() == layers.size() && tables.size() == layers.size(),
              "forward_steps: steps and block_size >= 1, one token per row; ids, positions, seq_lens and each "
              "layer's slots contiguous int64 of one entry per row, one block table per layer");
  for (size_t i = 0; i < layers.size(); ++i)
    TORCH_CHECK(ok(slots[i]) && tables[i].scalar_type() == torch::kLong && tables[i].dim() == 2 &&
                    tables[i].size(0) == B && tables[i].stride(1) == 1,
                "forward_steps: layer ", i, "'s slots or block table");
  int64_t *id = ids.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>(), *len = seq_lens.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> out;
  std::vector<torch::Tensor> last;
  py::gil_scoped_release nogil;  // as the other entry points (NOGIL below); taken back for interrupt()
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = pos[b] + 1, block = p / block_size;
      for (size_t i = 0; i < layers.size(); ++i) {
        TORCH_CHECK(block < tables[i].size(1), "forward_steps: layer ", i, "'s block table ends before position ", p);
        slots[i].data_ptr<int64_t>()[b] = tables[i].data_ptr<int64_t>()[b * tables[i].stride(0) + block] * block_size +
                                          p % block_size;
      }
      id[b] = tokens[b], pos[b] = p, len[b] = p + 1;
    }
    last = forward_step(layers, ids, embed, embed_qtype, cols, embed_scale, dtype, inv_freqs, factors, which, k_pools,
                        v_pools, k_scales, v_scales, slots, tables, seq_lens, qsl, positions, norm, eps, head);
    tokens = greedy_rows(last[1]);
    out.push_back(tokens);
    const bool stop = std::any_of(tokens.begin(), tokens.end(), [&](int64_t t) {
      return t < 0 || std::find(stop_ids.begin(), stop_ids.end(), t) != stop_ids.end();
    });
    if (stop) break;
    if (s + 1 < steps) {
      py::gil_scoped_acquire gil;
      if (!interrupt.is_none() && interrupt().cast<bool>()) break;
    }
  }
  py::gil_scoped_acquire gil;
  return py::make_tuple(out, last[0], last[1]);
}

// A linear layer with an optional bias added in place (minerva/models/layers.py Linear)
struct Linear {
  Packed w;
  std::optional<torch::Tensor> bias;
  torch::Tensor operator()(const torch::Tensor& x) const {
    auto y = w(x);
    return bias ? y.add_(*bias) : y;
  }
};

// One expert: gate and up (one fused matmul, or one each, outputs side by side), the
// activation, down.
struct Expert {
  std::vector<Linear> gate_up;
  Linear down;
};

// The experts of a mixture-of-experts feed-forward after routing: minerva/models/layers.py's
// MoE.forward and GatedMLP.forward with the same kernels and ATen ops in the same order, so
// the same bits; it saves the Python of the loop over the chosen experts (tens of ops each).
//
// With 8-bit activations and every expert's gate/up (one matrix) and down regrouped in one
// type, a batch's experts run grouped: x's rows gathered by expert, every chosen expert's
// gate/up in one parallel loop (grouped_qmatmul_q8), the activation over all rows at once,
// then every down in one more: the same kernels and element-wise ops per row, so the same
// bits, with two joins of the threads per layer instead of two per expert.
struct Experts {
  std::vector<Expert> experts;
  int64_t act;           // an ops.ACT_IDS id, or -1: GPT-OSS's clamped SwiGLU with (limit, alpha)
  double limit, alpha;
  bool grouped = false;  // see above; set by the constructor
  std::vector<torch::Tensor> gate_up_w, down_w, gate_up_b, down_b;
  torch::Tensor gate_up_bs, down_bs;  // the biases stacked [experts, rows], when there are any

  Experts(std::vector<Expert> experts_, int64_t act_, double limit_, double alpha_)
      : experts(std::move(experts_)), act(act_), limit(limit_), alpha(alpha_) {
    const auto regrouped = [](const Packed& p) { return p.int8 && (p.qtype & REGROUPED); };
    grouped = !experts.empty();
    for (const auto& e : experts) {
      grouped = grouped && e.gate_up.size() == 1 && regrouped(e.gate_up[0].w) && regrouped(e.down.w) &&
                same(e.gate_up[0].w, experts[0].gate_up[0].w) && same(e.down.w, experts[0].down.w);
      if (!grouped) break;
      gate_up_w.push_back(e.gate_up[0].w.bytes);
      down_w.push_back(e.down.w.bytes);
      gate_up_b.push_back(e.gate_up[0].bias ? e.gate_up[0].bias->contiguous() : torch::Tensor());
      down_b.push_back(e.down.bias ? e.down.bias->contiguous() : torch::Tensor());
    }
    // the biases: none, or every expert's, in one dtype
    const auto one_kind = [](const std::vector<torch::Tensor>& b) {
      return std::all_of(b.begin(), b.end(), [&](const torch::Tensor& t) {
        return t.defined() ? b[0].defined() && t.dtype() == b[0].dtype() : !b[0].defined();
      });
    };
    grouped = grouped && one_kind(gate_up_b) && one_kind(down_b);
    if (grouped && gate_up_b[0].defined()) gate_up_bs = torch::stack(gate_up_b);
    if (grouped && down_b[0].defined()) down_bs = torch::stack(down_b);
  }

  static bool same(const Packed& a, const Packed& b) {
    return a.qtype == b.qtype && a.rows == b.rows && a.cols == b.cols;
  }
  static bool dtype_or_none(const torch::Tensor& b, torch::ScalarType t) { return !b.defined() || b.scalar_type() == t; }

  // whether x's dtype takes the grouped path: float32 with float32 biases (added in the
  // kernel), or bfloat16 (outputs rounded to bf16, then the biases added in place, as Linear does)
  bool groups(const torch::Tensor& x) const {
    if (!grouped) return false;
    if (x.scalar_type() == torch::kBFloat16) return true;
    return x.scalar_type() == torch::kFloat32 && dtype_or_none(gate_up_bs, torch::kFloat32) &&
           dtype_or_none(down_bs, torch::kFloat32);
  }

  // y [R, n] float32, one kernel output row per (token, rank) pair sorted by expert: for bf16
  // x each row rounded to bf16 and its expert's bias (row `expert[r]` of bs, when there are
  // biases) added and rounded again, as Linear's y.to(bf16).add_(bias) does; float32 x got its
  // biases in the kernel
  static torch::Tensor as_linear(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& bs,
                                 const std::vector<int64_t>& expert) {
    if (x.scalar_type() == torch::kFloat32) return y;
    const int64_t R = y.size(0), n = y.size(1);
    auto out = torch::empty({R, n}, x.options());
    const float* yp = y.data_ptr<float>();
    auto* op = out.data_ptr<at::BFloat16>();
    const auto add = [&](const auto* b) {
      minerva::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* yr = yp + r * n;
          at::BFloat16* o = op + r * n;
          if (!b) {
            for (int64_t i = 0; i < n; ++i) o[i] = at::BFloat16(yr[i]);
          } else {
            const auto* br = b + expert[r] * n;
            for (int64_t i = 0; i < n; ++i)
              o[i] = at::BFloat16(static_cast<float>(at::BFloat16(yr[i])) + static_cast<float>(br[i]));
          }
        }
      });
    };
    if (!bs.defined()) add(static_cast<const float*>(nullptr));
    else if (bs.scalar_type() == torch::kFloat32) add(bs.data_ptr<float>());
    else if (bs.scalar_type() == torch::kBFloat16) add(bs.data_ptr<at::BFloat16>());
    else TORCH_CHECK(false, "expert biases must be float32 or bfloat16");
    return out;
  }

  torch::Tensor activation(const torch::Tensor& gu) const {
    return act >= 0 ? act_mul(gu, act) : act_mul(gu, ACT_SWIGLU_LIMIT, limit, alpha);
  }

  // The grouped path: the (token, rank) pairs sorted by expert (stably, as argsort), x's rows
  // gathered in that order, every chosen expert's gate/up in one kernel call, the activation
  // over all rows, every down in one more, then each token's k outputs weighted and summed in
  // rank order with ATen's rounding: out = y0·w0, then out += yj·wj, each product and sum
  // rounded to x's dtype. The element-wise steps are loops here, not ATen ops.
  torch::Tensor forward_grouped(const torch::Tensor& x_, const torch::Tensor& ids_, const torch::Tensor& w_) const {
    const auto x = x_.contiguous(), ids = ids_.contiguous(), w = w_.contiguous();
    const int64_t T = x.size(0), k = ids.size(1), E = static_cast<int64_t>(experts.size()), H = x.size(1), R = T * k;
    TORCH_CHECK(ids.scalar_type() == torch::kLong && w.scalar_type() == x.scalar_type() && w.size(0) == T &&
                    w.size(1) == k, "Experts: ids must be int64 [T, k] and weights [T, k] in x's dtype");
    const int64_t* id = ids.data_ptr<int64_t>();
    std::vector<int64_t> starts(E + 1, 0), order(R), sorted_at(R), expert(R);
    for (int64_t i = 0; i < R; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < E, "expert id out of range");
      ++starts[id[i] + 1];
    }
    for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
    {
      std::vector<int64_t> next(starts.begin(), starts.end() - 1);
      for (int64_t i = 0; i < R; ++i) {
        const int64_t r = next[id[i]]++;
        order[r] = i, sorted_at[i] = r, expert[r] = id[i];
      }
    }
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    auto xs = torch::empty({R, H}, torch::dtype(torch::kFloat32));
    float* xsp = xs.data_ptr<float>();
    minerva::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = order[r] / k;
        if (bf16) {
          const auto* src = x.data_ptr<at::BFloat16>() + t * H;
          for (int64_t i = 0; i < H; ++i) xsp[r * H + i] = static_cast<float>(src[i]);
        } else {
          std::copy_n(x.data_ptr<float>() + t * H, H, xsp + r * H);
        }
      }
    });
    const std::vector<torch::Tensor> none(E);
    const auto& gp = experts[0].gate_up[0].w;
    const auto& dp = experts[0].down.w;
    auto gu = as_linear(grouped_qmatmul_q8(xs, gate_up_w, starts, bf16 ? none : gate_up_b, gp.qtype, gp.rows, gp.cols),
                        x, gate_up_bs, expert);
    auto a = activation(gu);
    if (bf16) a = a.to(torch::kFloat32);  // exact
    const auto y = as_linear(grouped_qmatmul_q8(a, down_w, starts, bf16 ? none : down_b, dp.qtype, dp.rows, dp.cols),
                             x, down_bs, expert);
    auto out = torch::empty({T, H}, x.options());
    const auto sum = [&](auto* tag) {
      using D = std::remove_pointer_t<decltype(tag)>;
      const D* yp = y.data_ptr<D>();
      const D* wp = w.data_ptr<D>();
      D* op = out.data_ptr<D>();
      minerva::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          D* o = op + t * H;
          for (int64_t j = 0; j < k; ++j) {
            const D* yr = yp + sorted_at[t * k + j] * H;
            const float wj = static_cast<float>(wp[t * k + j]);
            for (int64_t i = 0; i < H; ++i) {
              const D p = D(static_cast<float>(yr[i]) * wj);
              o[i] = j == 0 ? p : D(static_cast<float>(o[i]) + static_cast<float>(p));
            }
          }
        }
      });
    };
    if (bf16) sum(static_cast<at::BFloat16*>(nullptr));
    else sum(static_cast<float*>(nullptr));
    return out;
  }

  torch::Tensor run(const Expert& e, const torch::Tensor& x) const {
    torch::Tensor gu;
    if (e.gate_up.size() == 1) {
      gu = e.gate_up[0](x);
    } else {
      std::vector<torch::Tensor> outs;
      for (const auto& lin : e.gate_up) outs.push_back(lin(x));
      gu = torch::cat(outs, -1);
    }
    return e.down(activation(gu));
  }

  // x [T, hidden]; ids [T, k] int64 and w [T, k] (x's dtype): each token's experts and weights
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& w) const {
    const int64_t T = x.size(0), k = ids.size(1), E = static_cast<int64_t>(experts.size());
    const bool group = groups(x);
    if (T == 1 && !group) {  // the token's experts in rank order
      const auto chosen = ids.contiguous();
      const int64_t* id = chosen.data_ptr<int64_t>();
      torch::Tensor out;
      for (int64_t j = 0; j < k; ++j) {
        TORCH_CHECK(id[j] >= 0 && id[j] < E, "expert id out of range");
        auto y = run(experts[id[j]], x).mul_(w.narrow(1, j, 1));
        out = j == 0 ? y : out.add_(y);
      }
      return out;
    }
    if (group) return forward_grouped(x, ids, w);  // (for one token too: its experts in one loop)
    const auto flat = ids.reshape(-1);
    const auto order = torch::argsort(flat, /*stable=*/true);
    const auto counts = torch::bincount(flat, {}, E).contiguous();
    TORCH_CHECK(counts.size(0) == E, "expert id out of range");
    const int64_t* n = counts.data_ptr<int64_t>();
    auto ys = torch::empty({T * k, x.size(1)}, x.options());
    for (int64_t e = 0, start = 0; e < E; start += n[e], ++e) {
      if (n[e] == 0) continue;
      const auto pairs = order.narrow(0, start, n[e]);
      ys.index_put_({pairs}, run(experts[e], x.index({torch::floor_divide(pairs, k)})));
    }
    const auto y3 = ys.view({T, k, -1});
    auto out = y3.select(1, 0).mul(w.narrow(1, 0, 1));
    for (int64_t j = 1; j < k; ++j) out.add_(y3.select(1, j).mul(w.narrow(1, j, 1)));
    return out;
  }
};

}  // namespace

// The entry points that take and give only tensors and numbers run without the GIL, so that
// the server's event loop (and any other Python thread) goes on while the engine's thread is
// in a kernel: with it held, one long prefill left /health and new requests waiting for
// seconds. Concurrent callers are safe: the pool runs one parallel call at a time and a
// second caller's loop serially on its own thread (parallel.h). cpu_choices and pool_stats,
// which take or build Python objects, keep it; forward_steps takes it back for interrupt().
#define NOGIL py::call_guard<py::gil_scoped_release>()

// The classes are module_local: two builds of this module can be loaded side by side (as
// benchmarks/kernel_ab.py does, under two names) without their types clashing in pybind11.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, NOGIL, "x @ W^T with W in a packed GGML format");
  m.def("qmatmul_q8", &qmatmul_q8, NOGIL,
        "x @ W^T with x quantized to 8 bits per block (32; 256 for K-quants), integer dot products");
  m.def("grouped_qmatmul_q8", &grouped_qmatmul_q8, NOGIL,
        "regrouped matrices of one type and shape, each against its own rows of x, in one parallel loop");
  m.def("quantize_activations", &quantize_activations, NOGIL, "x -> (int8 values, scale per block, scale * sum)",
        py::arg("x"), py::arg("block") = 32);
  m.def("int8_peak_probe", &int8_peak_probe, NOGIL,
        "(chunks, steps) -> multiply-adds done by the int8 dot-product instruction mix, on every thread");
  m.def("cpu_choices", &cpu_choices, py::arg("set") = py::none(), py::arg("qtype") = -1,
        "the int8 kernels' choices for GGML type `qtype` (-1: every type; read: Q4_K's) [one row of x: groups "
        "per work item, L2 prefetch bytes; many rows: the Q4_K/Q5_K tiles copy x (0 or 1); the Q4_K/Q5_K tiles "
        "scale sub-blocks in i32 (1) or in float (0), for every type]; returns them, then sets them when given");
  m.attr("x8_pairs") = x8_pairs_choice();
  m.attr("regroups_q6_k") = q6_k_regrouped();
  m.attr("vnni") = vnni_dot_products();
  m.def("regroup_", &regroup_, NOGIL, "packed rows regrouped for the int8 kernels in place (minerva/kernels/repack.py)");
  m.def("regroup_q6_k_", &regroup_q6_k_, NOGIL, "Q6_K rows regrouped in units of 16 in place (minerva/kernels/repack.py)");
  m.def("regrouped_rows", &regrouped_rows, NOGIL, "rows of a regrouped Q8_0 matrix in the GGML layout");
  m.def("set_num_threads", [](int64_t n) { minerva::ThreadPool::get().set_threads(static_cast<int>(n)); },
        "threads for the kernels (0: torch's setting)");
  m.def("pool_stats", [] {
        const auto s = minerva::ThreadPool::get().stats();
        return py::dict(py::arg("parallel_calls") = s.parallel, py::arg("backed_off_calls") = s.serial_backed_off,
                        py::arg("stalls") = s.stalls, py::arg("backoffs") = s.backoffs,
                        py::arg("wait_seconds") = s.wait_ns * 1e-9);
      },
      "the kernels' thread pool since start: parallel calls, calls run alone while backed off, stalls, back-offs, "
      "seconds callers waited for helpers");
  m.def("dequantize_rows", &dequantize_rows, NOGIL, "packed GGML rows -> float32");
  m.def("lora_add_", &lora_add_, NOGIL, "y[rows, parts] += B (A x) of each row's LoRA adapter (minerva/models/lora.py)");
  m.def("argmax_rows", &argmax_rows, NOGIL, "each row's index of its first largest value (torch.argmax over the last dim)");
  m.def("greedy_rows", &greedy_rows, NOGIL, "argmax_rows as a list, -1 for a row whose largest value is NaN or infinite");
  m.def("sample_rows", &sample_rows, NOGIL,
        "each row's token after temperature, top-k, top-p and min-p, drawn at u (sampler.sample_batch)");
  m.def("invert_cdf_rows", &invert_cdf_rows, NOGIL, "each row's token where its float64 CDF first exceeds u times its total");
  m.def("apply_token_bitmask_", &apply_token_bitmask_, NOGIL, "logits of the tokens a bitmask forbids set to -inf, in place");
  m.def("paged_attention", &paged_attention, NOGIL, "causal attention over the paged KV pool");
  m.def("kv_write", &kv_write, NOGIL, "store K or V rows into the paged pool (quantizing for int8)");
  m.def("qmatmul_q8_parts", &qmatmul_q8_parts, NOGIL,
        "x against several packed matrices (8-bit activations), outputs side by side", py::arg("x"),
        py::arg("packed"), py::arg("qtypes"), py::arg("rows"), py::arg("cols"));
  m.def("rms_norm", &rms_norm, NOGIL, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, NOGIL, "h += a; RMSNorm(h)");
  m.def("rope_", &rope_, NOGIL, "rotary embedding in place (half-split layout)");
  m.def("act_mul", &act_mul, NOGIL, "act(gate) * up", py::arg("gu"), py::arg("act"), py::arg("limit") = 0.0,
        py::arg("alpha") = 0.0);
  py::class_<Packed>(m, "Packed", py::module_local())
      .def(py::init<torch::Tensor, int64_t, int64_t, int64_t, bool>(), py::arg("bytes"), py::arg("qtype"),
           py::arg("rows"), py::arg("cols"), py::arg("int8") = false);
  py::class_<LoraRows, std::shared_ptr<LoraRows>>(m, "LoraRows", "a step's adapted rows, shared by native layers",
                                                  py::module_local())
      .def(py::init<>())
      .def("set", [](LoraRows& r, torch::Tensor order, torch::Tensor bounds) {
        r.order = order, r.bounds = bounds, r.active = true;
      })
      .def("clear", [](LoraRows& r) { r.order = r.bounds = torch::Tensor(), r.active = false; });
  py::class_<DecoderLayer>(m, "DecoderLayer", py::module_local())
      .def(py::init([](std::vector<Packed> qkv, Packed o, std::vector<Packed> gate_up, Packed down,
                       torch::Tensor input_norm,
                       torch::Tensor pre_mlp_norm, std::optional<torch::Tensor> post_attn_norm,
                       std::optional<torch::Tensor> post_mlp_norm, std::optional<torch::Tensor> q_norm,
                       std::optional<torch::Tensor> k_norm, double eps, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t window, int64_t act, double scale) {
        DecoderLayer layer{{qkv}, o, {gate_up}, down, input_norm, pre_mlp_norm, post_attn_norm, post_mlp_norm,
                           q_norm, k_norm, eps, heads, kv_heads, head_dim, window, act, scale};
        layer.plan_rows();
        return layer;
      }))
      .def_property_readonly("row_path", [](const DecoderLayer& l) { return l.row.has_value(); },
                             "whether a decode step's one float32 token takes the row path (forward_row)")
      .def("adapt",
           [](DecoderLayer& l, std::shared_ptr<LoraRows> rows, const std::vector<std::optional<torch::Tensor>>& parts) {
             TORCH_CHECK(parts.size() == 8, "adapt: entries and weights of q/k/v, o, gate/up and down");
             l.lora_rows = rows;
             for (int i = 0; i < 4; ++i) l.lora[i] = parts[2 * i] ? LoraWeights{*parts[2 * i], *parts[2 * i + 1]}
                                                                  : LoraWeights{};
           },
           "LoRA adapters on the layer's projections (lora_add_'s entries and weights, None where none), applied "
           "to the rows `rows` names each step")
      .def("forward", &DecoderLayer::forward, NOGIL)
      .def("attention", &DecoderLayer::attention, NOGIL)
      .def("feed_forward", &DecoderLayer::feed_forward, NOGIL)
      .def("residual", &DecoderLayer::residual, NOGIL);
  m.def("forward_layers", &forward_layers, NOGIL, "decoder layers in turn, each over its own pools, rotary tables, slots and block table");
  m.def("forward_logits", &forward_logits, NOGIL, "forward_layers, the final RMSNorm and the LM head: (hidden, float32 logits)");
  m.def("forward_step", &forward_step, NOGIL, "a decode step from token ids: embedding rows, rotary tables, forward_logits");
  m.def("forward_steps", &forward_steps,
        "greedy decode steps, each one's argmax fed back in: (tokens of each step, last hidden states, last logits)");
  py::class_<minerva::Exchange>(m, "Exchange", py::module_local())
      .def(py::init<torch::Tensor, int64_t, int64_t, int64_t, std::vector<int64_t>>(), py::arg("segment"),
           py::arg("rank"), py::arg("world"), py::arg("slot_bytes"), py::arg("pids"))
      .def_static("bytes_needed", &minerva::Exchange::bytes_needed)
      .def("all_reduce_", &minerva::Exchange::all_reduce_, "sum every rank's tensor into each, in place")
      .def("broadcast", &minerva::Exchange::broadcast, "rank 0's int64 vector to every rank")
      .def("gather", &minerva::Exchange::gather, "every rank's tensor, stacked on rank 0")
      .def_property_readonly("wait_seconds", &minerva::Exchange::wait_seconds);
  py::class_<Linear>(m, "Linear", py::module_local()).def(py::init<Packed, std::optional<torch::Tensor>>());
  py::class_<Expert>(m, "Expert", py::module_local()).def(py::init<std::vector<Linear>, Linear>());
  py::class_<Experts>(m, "Experts", py::module_local())
      .def(py::init<std::vector<Expert>, int64_t, double, double>())
      .def_readonly("grouped", &Experts::grouped)
      .def("groups", &Experts::groups, "whether x (its dtype) takes the grouped path")
      .def("forward", &Experts::forward, NOGIL);
}
