// Sampling over the vocabulary: a structured-output bitmask, and row by row on the kernels'
// threads greedy argmax, inverting a CDF, and the whole of temperature, top-k, top-p and
// min-p with the draw in one call, over each row's cache-resident scratch (sample_rows).
//
// Written with AVX2 intrinsics, which both builds have. Each row is computed on its own, in
// a fixed order, so a row's token never depends on the other rows of the batch.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace {

// The index of the first largest value of row[0 .. V), as torch.argmax gives it (a NaN counts
// as the largest, so the first NaN wins): one pass for the maximum, one up to its first
// occurrence. torch's own argmax over a 49152-token vocabulary took 43 us a row on this
// project's AVX-512 machine, where its max took 6.
int64_t argmax_row(const float* row, int64_t V) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 unordered = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(row + j);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  float top = *std::max_element(lanes, lanes + 8);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (int64_t k = j; k < V; ++k) {
    nan = nan || std::isnan(row[k]);
    top = std::max(top, row[k]);
  }
  if (nan) {
    for (int64_t k = 0; k < V; ++k)
      if (std::isnan(row[k])) return k;
  }
  const __m256 t = _mm256_set1_ps(top);
  for (j = 0; j + 8 <= V; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), t, _CMP_EQ_OQ));
    if (hits) return j + __builtin_ctz(hits);
  }
  for (; j < V; ++j)
    if (row[j] == top) return j;
  return 0;  // V == 0
}

// For each row of probs [N, V] (float32 or float64, not negative, not necessarily normalized)
// the token where its CDF first exceeds u[n] times the row's total, as sampler.invert_cdf
// computes it with torch: the CDF summed left to right in float64 (torch's cumsum adds in
// the same order, so the same bits), the answer the first index whose sum passes the target,
// or, where u * total rounds up to the total, the last token with mass. One pass for the
// total, one up to the answer; torch's cumsum, searchsorted and count took 0.9 ms a row over a
// 49152-token vocabulary.
template <typename T>
int64_t invert_row(const T* p, int64_t V, double u) {
  double total = 0.0;
  for (int64_t j = 0; j < V; ++j) total += static_cast<double>(p[j]);
  const double target = u * total;
  double acc = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    acc += static_cast<double>(p[j]);
    if (acc > target || acc >= total) return j;
  }
  return V - 1;  // V == 0 is refused below; a NaN total ends here
}

// exp(x) for x <= 0, as softmax takes it (y - max): 2^n e^r with n = round(x / ln 2) and
// r = x - n ln 2 (Cody and Waite's two constants), so |r| <= ln 2 / 2, and e^r by its Taylor
// polynomial to degree 7 (truncated terms below 5e-9 of it). exp(0) is exactly 1; below -87.3,
// where expf leaves the normal floats, and at -inf, 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)),
                       _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ));
}

float exp_nonpositive(float x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, exp_nonpositive(_mm256_set1_ps(x)));
  return lanes[0];
}

// A float's bits as a key that orders as the floats do (negative floats' bits flipped).
inline uint32_t key_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b & 0x80000000u ? ~b : b | 0x80000000u;
}

inline float float_of(uint32_t key) {
  const uint32_t b = key & 0x80000000u ? key & 0x7fffffffu : ~key;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

struct Scratch {
  std::vector<float> y, e, inside;  // the row after temperature, its exp, values in the chosen bucket
  std::array<double, 4096> weight;  // histograms' weights
};

struct Selected {
  bool found;    // false where the row's whole weight falls short of the target (rounding)
  float value;   // the value at which the weight from the top reaches the target
  double above;  // the weight of the values above it
};

// Going down from the row's largest value, the value at which the sum of the weights first
// reaches `target`: weights 1 (counts: the k-th largest, for top-k) or the values themselves
// (masses, for top-p; values >= 0). Radix selection on the values' keys, 8, 12 and 12 bits at
// a time, weights summed in double: the top 8 bits over the row into four histograms by turns
// (no chains of adds into one bucket), the next 12 over the members of the chosen bucket
// (found 8 at a time), the last 12 over those of the next.
template <bool Mass>
Selected select_from_top(const float* v, int64_t V, double target, Scratch& s) {
  double* w = s.weight.data();
  std::fill(w, w + 4 * 256, 0.0);
  int64_t j = 0;
  for (; j + 4 <= V; j += 4)
    for (int c = 0; c < 4; ++c) w[c * 256 + (key_of(v[j + c]) >> 24)] += Mass ? static_cast<double>(v[j + c]) : 1.0;
  for (; j < V; ++j) w[key_of(v[j]) >> 24] += Mass ? static_cast<double>(v[j]) : 1.0;
  for (int b = 0; b < 256; ++b) w[b] += w[256 + b] + w[512 + b] + w[768 + b];

  double above = 0.0;
  uint32_t prefix = 0;  // the key bits chosen so far
  auto choose = [&](int buckets) -> int {  // the bucket where the weight from the top crosses the target, or -1
    for (int b = buckets - 1; b >= 0; --b) {
      if (above + w[b] >= target) return b;
      above += w[b];
    }
    return -1;
  };
  int b = choose(256);
  if (b < 0) return {false, 0.0f, above};
  prefix = static_cast<uint32_t>(b) << 24;

  std::fill(w, w + 4096, 0.0);
  s.inside.clear();
  const __m256i top = _mm256_set1_epi32(static_cast<int>(b)), sign = _mm256_set1_epi32(INT32_MIN);
  for (j = 0; j + 8 <= V; j += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(v + j));
    const __m256i key = _mm256_xor_si256(bits, _mm256_or_si256(_mm256_srai_epi32(bits, 31), sign));
    int hits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(key, 24), top)));
    for (; hits; hits &= hits - 1) {
      const float f = v[j + __builtin_ctz(hits)];
      w[(key_of(f) >> 12) & 4095] += Mass ? static_cast<double>(f) : 1.0;
      s.inside.push_back(f);
    }
  }
  for (; j < V; ++j)
    if ((key_of(v[j]) >> 24) == static_cast<uint32_t>(b)) {
      w[(key_of(v[j]) >> 12) & 4095] += Mass ? static_cast<double>(v[j]) : 1.0;
      s.inside.push_back(v[j]);
    }
  if ((b = choose(4096)) < 0) return {false, 0.0f, above};
  prefix |= static_cast<uint32_t>(b) << 12;

  std::fill(w, w + 4096, 0.0);
  for (const float f : s.inside)
    if ((key_of(f) >> 12) == (prefix >> 12)) w[key_of(f) & 4095] += Mass ? static_cast<double>(f) : 1.0;
  if ((b = choose(4096)) < 0) return {false, 0.0f, above};
  return {true, float_of(prefix | static_cast<uint32_t>(b)), above};
}

// The sum of v[0 .. n) in double, four lanes of four accumulators (a fixed order).
double sum_double(const float* v, int64_t n) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int c = 0; c < 4; ++c) acc[c] = _mm256_add_pd(acc[c], _mm256_cvtps_pd(_mm_loadu_ps(v + j + 4 * c)));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
  double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; j < n; ++j) total += v[j];
  return total;
}

// The token where the CDF of the weights e[0 .. V) passes u times their total: blocks of 64
// skipped by their sums, then the block that passes summed token by token. Where rounding
// leaves the sums short of the target, the last token with weight.
int64_t draw(const float* e, int64_t V, double u) {
  const double target = u * sum_double(e, V);
  double acc = 0.0;
  for (int64_t j = 0; j < V; j += 64) {
    const int64_t n = std::min<int64_t>(64, V - j);
    const double block = sum_double(e + j, n);
    if (acc + block <= target) {
      acc += block;
      continue;
    }
    for (int64_t i = j; i < j + n; ++i)
      if ((acc += e[i]) > target) return i;
  }
  for (int64_t j = V - 1; j > 0; --j)
    if (e[j] > 0.0f) return j;
  return 0;
}

// One row's token: x / temperature, then top-k (the k largest values and their ties), top-p
// (going down from the most likely, each token while the probability above it is under
// top_p; of equal ones the earlier first), min-p (tokens at least min_p times as likely as the most
// likely), each on the tokens the one before kept, as sampler.process_batch does with torch
// ops; then the token where the CDF of what is left first passes u times its total (draw).
int64_t sample_row(const float* x, int64_t V, float temperature, int64_t top_k, double top_p, float min_p,
                   double u, Scratch& s) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  s.y.resize(V);
  s.e.resize(V);
  float *y = s.y.data(), *e = s.e.data();
  __m256 most = _mm256_set1_ps(-inf);
  const __m256 t = _mm256_set1_ps(temperature);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + j), t);
    _mm256_storeu_ps(y + j, q);
    most = _mm256_max_ps(most, q);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, most);
  float M = *std::max_element(lanes, lanes + 8);
  for (; j < V; ++j) M = std::max(M, y[j] = x[j] / temperature);
  if (!(M > -inf)) return V - 1;  // nothing has mass: as invert_row's answer for a row without mass
  if (M == inf) return std::find(y, y + V, inf) - y;  // a temperature so low that x / t overflowed

  if (top_k > 0 && top_k < V) {
    const Selected kth = select_from_top<false>(y, V, static_cast<double>(top_k), s);
    const __m256 kv = _mm256_set1_ps(kth.value), none = _mm256_set1_ps(-inf);
    for (j = 0; j + 8 <= V; j += 8) {
      const __m256 q = _mm256_loadu_ps(y + j);
      _mm256_storeu_ps(y + j, _mm256_blendv_ps(q, none, _mm256_cmp_ps(q, kv, _CMP_LT_OQ)));
    }
    for (; j < V; ++j)
      if (y[j] < kth.value) y[j] = -inf;
  }
  const __m256 m = _mm256_set1_ps(M);
  for (j = 0; j + 8 <= V; j += 8) _mm256_storeu_ps(e + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(y + j), m)));
  for (; j < V; ++j) e[j] = exp_nonpositive(y[j] - M);

  if (top_p < 1.0) {
    const double target = top_p * sum_double(e, V);
    const Selected last = select_from_top<true>(e, V, target, s);
    if (last.found) {
      // Ties with the last value stay in index order while the mass above is under the target
      // (transformers' order for ties is its sort's: over a whole vocabulary, the same).
      double before = last.above;
      auto one = [&](int64_t i) {
        if (e[i] > last.value) return;
        if (e[i] == last.value && before < target) {
          before += e[i];
          return;
        }
        e[i] = 0.0f;
      };
      const __m256 lv = _mm256_set1_ps(last.value);
      for (j = 0; j + 8 <= V; j += 8) {
        const __m256 q = _mm256_loadu_ps(e + j);
        if (_mm256_movemask_ps(_mm256_cmp_ps(q, lv, _CMP_EQ_OQ))) {
          for (int64_t i = j; i < j + 8; ++i) one(i);
          continue;
        }
        _mm256_storeu_ps(e + j, _mm256_and_ps(q, _mm256_cmp_ps(q, lv, _CMP_GT_OQ)));
      }
      for (; j < V; ++j) one(j);
    }
  }
  if (min_p > 0.0f) {  // the most likely token's e is exp(0) = 1, so e_j / e_max is e_j
    const __m256 floor = _mm256_set1_ps(min_p);
    for (j = 0; j + 8 <= V; j += 8) {
      const __m256 q = _mm256_loadu_ps(e + j);
      _mm256_storeu_ps(e + j, _mm256_and_ps(q, _mm256_cmp_ps(q, floor, _CMP_GE_OQ)));
    }
    for (; j < V; ++j)
      if (e[j] < min_p) e[j] = 0.0f;
  }
  return draw(e, V, u);
}

}  // namespace

// logits [N, V] float32: every token whose bit in mask [N, ceil(V / 32)] (int32, bit j of
// word w is token 32 w + j) is 0 set to -inf, in place. A word of all ones (the usual case
// inside a JSON string) costs one compare.
void apply_token_bitmask_(torch::Tensor logits, const torch::Tensor& mask) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() && logits.dim() == 2,
              "logits: contiguous float32 [N, V]");
  TORCH_CHECK(mask.scalar_type() == torch::kInt32 && mask.is_contiguous() && mask.dim() == 2 &&
                  mask.size(0) == logits.size(0) && mask.size(1) * 32 >= logits.size(1),
              "mask: contiguous int32 [N, ceil(V / 32)]");
  const int64_t N = logits.size(0), V = logits.size(1), W = mask.size(1);
  const float neg = -std::numeric_limits<float>::infinity();
  for (int64_t n = 0; n < N; ++n) {
    float* row = logits.data_ptr<float>() + n * V;
    const auto* words = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>()) + n * W;
    for (int64_t w = 0; w * 32 < V; ++w) {
      const uint32_t bits = words[w];
      if (bits == 0xffffffffu) continue;
      const int64_t end = std::min<int64_t>(32, V - w * 32);
      for (int64_t j = 0; j < end; ++j)
        if (!((bits >> j) & 1u)) row[w * 32 + j] = neg;
    }
  }
}

// argmax over the last dim of x [N, V] (contiguous float32): int64 [N], rows on the kernels' threads
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.size(1) > 0,
              "x: contiguous float32 [N, V] with V > 0");
  const int64_t N = x.size(0), V = x.size(1);
  torch::Tensor out = torch::empty({N}, torch::kInt64);
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  minerva::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) o[n] = argmax_row(p + n * V, V);
  });
  return out;
}

// argmax_rows for greedy decoding, with check_logits' test folded in: a list of each row's
// token, or -1 for a row whose largest value is NaN, +inf or -inf (the model overflowed). One call
// in place of a torch max, a float, the argmax and a tolist, each of them slow from cold
// caches after a decode step's weights streamed through.
std::vector<int64_t> greedy_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.size(1) > 0,
              "x: contiguous float32 [N, V] with V > 0");
  const int64_t N = x.size(0), V = x.size(1);
  std::vector<int64_t> out(N);
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data();
  minerva::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const int64_t k = argmax_row(p + n * V, V);
      const float top = p[n * V + k];  // the first NaN where there is one
      o[n] = std::isfinite(top) ? k : -1;  // NaN, +inf, or a row of -inf (no token possible)
    }
  });
  return out;
}

torch::Tensor invert_cdf_rows(const torch::Tensor& probs, const torch::Tensor& u) {
  TORCH_CHECK((probs.scalar_type() == torch::kFloat32 || probs.scalar_type() == torch::kFloat64) &&
                  probs.is_contiguous() && probs.dim() == 2 && probs.size(1) > 0,
              "probs: contiguous float32 or float64 [N, V] with V > 0");
  TORCH_CHECK(u.scalar_type() == torch::kFloat64 && u.is_contiguous() && u.dim() == 1 && u.size(0) == probs.size(0),
              "u: contiguous float64 [N]");
  const int64_t N = probs.size(0), V = probs.size(1);
  torch::Tensor out = torch::empty({N}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  const double* uu = u.data_ptr<double>();
  minerva::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n)
      o[n] = probs.scalar_type() == torch::kFloat32 ? invert_row(probs.data_ptr<float>() + n * V, V, uu[n])
                                                    : invert_row(probs.data_ptr<double>() + n * V, V, uu[n]);
  });
  return out;
}


torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                          const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& u) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() && logits.dim() == 2 &&
                  logits.size(1) > 0,
              "logits: contiguous float32 [N, V] with V > 0");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto check = [N](const torch::Tensor& t, torch::ScalarType type, const char* what) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == 1 && t.size(0) == N, what);
  };
  check(temperature, torch::kFloat32, "temperature: contiguous float32 [N]");
  check(top_k, torch::kInt64, "top_k: contiguous int64 [N]");
  check(top_p, torch::kFloat64, "top_p: contiguous float64 [N]");
  check(min_p, torch::kFloat32, "min_p: contiguous float32 [N]");
  check(u, torch::kFloat64, "u: contiguous float64 [N]");
  torch::Tensor out = torch::empty({N}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  const float* x = logits.data_ptr<float>();
  minerva::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    thread_local Scratch s;
    for (int64_t n = lo; n < hi; ++n)
      o[n] = sample_row(x + n * V, V, temperature.data_ptr<float>()[n], top_k.data_ptr<int64_t>()[n],
                        top_p.data_ptr<double>()[n], min_p.data_ptr<float>()[n], u.data_ptr<double>()[n], s);
  });
  return out;
}
