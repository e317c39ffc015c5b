// The kernels' entry points, shared by the translation units and the Python module.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <optional>
#include <vector>

// qmatmul.cpp
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t rows, int64_t cols);
torch::Tensor dequantize_rows(torch::Tensor packed, int64_t qtype, int64_t cols);
// q8_matmul.cpp (8-bit activations; quantize_activations: q8_quant.cpp, int8_peak_probe and
// cpu_choices: q8_cpu.cpp, regroup_: q8_repack_x8.cpp)
constexpr int64_t REGROUPED = 0x100;  // added to the GGML type id of a regrouped matrix (repack.py)
torch::Tensor qmatmul_q8(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t rows, int64_t cols);
// several matrices on the same x, outputs side by side (one parallel loop for one row of x
// when they all take the same activation block: K-quants, or regrouped 32-weight-block types)
torch::Tensor qmatmul_q8_parts(torch::Tensor x, const std::vector<torch::Tensor>& packed,
                               const std::vector<int64_t>& qtypes, const std::vector<int64_t>& rows, int64_t cols);
// several regrouped matrices of one type and shape, each against its own rows of x (x's rows
// for matrix e at starts[e] .. starts[e + 1]; bias[e] may be undefined or empty), in one parallel loop
torch::Tensor grouped_qmatmul_q8(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                                 const std::vector<int64_t>& starts, const std::vector<torch::Tensor>& bias,
                                 int64_t qtype, int64_t rows, int64_t cols);
// A decode step's one row of float32 x against a layer's matrices, on raw memory: what
// qmatmul_q8 (one matrix) or qmatmul_q8_parts (several) computes for that row, with the same
// kernels in the same order, so the same bits, without a tensor (module.cpp's DecoderLayer).
struct RowMatrix {
  const uint8_t* w;
  int64_t qtype, rows, first;  // the GGML type (| REGROUPED), rows, first output column
};
struct RowMatrices {
  std::vector<RowMatrix> mats;
  int64_t cols = 0, block = 0;  // block: the activation block of the one loop that takes them all,
  bool together = false;        // when one does (qmatmul_q8_parts')
  int64_t outputs() const { return mats.empty() ? 0 : mats.back().first + mats.back().rows; }
};
// the matrices as qmatmul_q8_row takes them, after qmatmul_q8's checks; nullopt when one of
// them does not run with 8-bit activations (a float matrix)
std::optional<RowMatrices> row_matrices(const std::vector<torch::Tensor>& packed, const std::vector<int64_t>& qtypes,
                                        const std::vector<int64_t>& rows, int64_t cols);
// x [cols] against the matrices, outputs side by side in y [outputs()]; for bfloat16 x, the
// float32 outputs in scratch [outputs()], then rounded into y
void qmatmul_q8_row(const float* x, const RowMatrices& m, float* y);
void qmatmul_q8_row(const at::BFloat16* x, const RowMatrices& m, float* scratch, at::BFloat16* y);
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t block);
double int8_peak_probe(int64_t chunks, int64_t steps);
// the int8 kernels' per-CPU choices [one row of x: regrouped Q4_K/Q5_K groups per work item, L2
// prefetch bytes; many rows: the Q4_K/Q5_K tiles copy x (0 or 1)]; returns them as they were,
// then sets them when given (tests run every choice)
std::vector<int64_t> cpu_choices(std::optional<std::vector<int64_t>> set, int64_t qtype);
// the `groups` choice that takes one row of x two groups a 512-bit register (q8_cpu.h's
// X8_PAIRS), 0 where the build has none
int64_t x8_pairs_choice();
// whether the int8 kernels take VNNI's dot products (AVX-512 VNNI or AVX-VNNI; q8_blocks.h)
bool vnni_dot_products();
void regroup_(torch::Tensor packed, int64_t block_bytes, std::vector<int64_t> fields, std::vector<int64_t> moves);
void regroup_q6_k_(torch::Tensor packed);  // (q8_q6k.cpp)
bool q6_k_regrouped();  // whether this build multiplies Q6_K in that layout (q8_q6k.cpp)
// rows `ids` of a regrouped Q8_0 matrix in the GGML layout (q8_repack_x8.cpp)
torch::Tensor regrouped_rows(const torch::Tensor& packed, int64_t qtype, const torch::Tensor& ids, int64_t cols);
// attention.cpp
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_scale,
                              torch::Tensor v_scale, torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, torch::Tensor positions, int64_t window,
                              double scale, torch::Tensor sinks);
// paged_attention into `out` (contiguous, q's shape and dtype), which it returns
torch::Tensor paged_attention_into(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_scale,
                                   torch::Tensor v_scale, torch::Tensor block_tables, torch::Tensor seq_lens,
                                   torch::Tensor query_start_loc, torch::Tensor positions, int64_t window,
                                   double scale, torch::Tensor sinks, torch::Tensor out);
void kv_write(torch::Tensor x, torch::Tensor pool, torch::Tensor scales, torch::Tensor slots);
// kv_write and rope_ on heads from column col of each row of x [T, width]
void kv_write_cols(torch::Tensor x, int64_t col, torch::Tensor pool, torch::Tensor scales, torch::Tensor slots);
// ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor h, torch::Tensor a, torch::Tensor w, double eps);
// rms_norm, add_rms_norm and act_mul into `out` (contiguous, the shape and dtype they would
// allocate), which they return
torch::Tensor rms_norm_into(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor out);
torch::Tensor add_rms_norm_into(torch::Tensor h, torch::Tensor a, torch::Tensor w, double eps, torch::Tensor out);
torch::Tensor residual_add_(torch::Tensor h, const torch::Tensor& m);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void rope_cols_(torch::Tensor x, int64_t col, int64_t heads, torch::Tensor cos, torch::Tensor sin);
// act_mul's activations: 0 silu, 1 gelu (tanh), ACT_SWIGLU_LIMIT GPT-OSS's clamped SwiGLU (ops.py's ids)
constexpr int64_t ACT_SWIGLU_LIMIT = 2;
torch::Tensor act_mul(torch::Tensor gu, int64_t act, double limit = 0.0, double alpha = 0.0);
torch::Tensor act_mul_into(torch::Tensor gu, int64_t act, double limit, double alpha, torch::Tensor out);
// one float32 or bfloat16 row in memory (ops_tensor.h; D, I multiples of 16, D the head size
// for rope_row, cos/sin its D / 2 values at the row's position; rms_norm_row: the n values as
// rows of D, as rms_norm takes a row's heads)
template <typename T>
void rms_norm_row(const T* x, const float* w, T* out, int64_t n, int64_t D, float eps);
template <typename T>
void add_rms_norm_row(T* h, const T* a, const float* w, T* out, int64_t D, float eps);
template <typename T>
void residual_add_row(T* h, const T* m, int64_t D);
template <typename T>
void rope_row(T* x, int64_t heads, int64_t D, const float* cos, const float* sin);
template <typename T>
void act_mul_row(const T* gu, T* out, int64_t I, int64_t act);
// sampling.cpp
void apply_token_bitmask_(torch::Tensor logits, const torch::Tensor& mask);
torch::Tensor argmax_rows(const torch::Tensor& x);
// lora.cpp: y += each row's adapter's B A x (minerva/models/lora.py LoraLinear.add_)
void lora_add_(const torch::Tensor& x, torch::Tensor& y, const torch::Tensor& order, const torch::Tensor& bounds,
               const torch::Tensor& entries, const torch::Tensor& weights);
// A step's adapted rows (LoraLinear.add_'s order and bounds), shared by a model's native
// layers and set before each step; inactive when no row of the step has an adapter.
struct LoraRows {
  torch::Tensor order, bounds;
  bool active = false;
};
// One projection's adapters in a native layer (lora_add_'s entries and weights; undefined: none).
struct LoraWeights {
  torch::Tensor entries, weights;
  void add_(const LoraRows* rows, const torch::Tensor& x, torch::Tensor& y) const {
    if (rows != nullptr && rows->active && entries.defined()) lora_add_(x, y, rows->order, rows->bounds, entries, weights);
  }
};
std::vector<int64_t> greedy_rows(const torch::Tensor& x);
torch::Tensor invert_cdf_rows(const torch::Tensor& probs, const torch::Tensor& u);
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                          const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& u);
