// Long rows of paged attention in parts (both builds), so that every thread works on a
// decode step even when a model has fewer KV heads than the machine has threads.
//
// A query row attends to keys [lo, hi). A row with more than kPartKeys keys is split into
// parts of kPartKeys keys from lo (the last one shorter); each (row, KV head, part) is a
// work item that leaves its unnormalized weighted sum of V with its softmax max m and sum l,
// and the parts are merged in order: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p,
// M = max_p m_p. The split depends only on the row's own key range, never on the batch or
// the threads, so a row's result stays batch invariant; a row of one part is computed and
// stored as before, with no merge.
//
// With attention sinks (GPT-OSS: one learned logit per query head that joins every softmax's
// denominator and carries no value), a one-part row takes its softmax max over the scores
// and the sink; a row of several parts adds the sink when the parts merge.
//
// Partial results are held for a wave of rows at a time (at most kWaveFloats floats), so a
// long prefill chunk does not need them all at once.

#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace minerva {

// x as contiguous int64: itself when it already is (a decode step's block tables, lengths and
// slots are; .to() and .contiguous() go through torch's dispatcher even when they change
// nothing, and after a matmul has streamed its weights through the caches that costs
// microseconds)
inline torch::Tensor as_int64(const torch::Tensor& x) {
  return x.scalar_type() == torch::kInt64 && x.is_contiguous() ? x : x.to(torch::kInt64).contiguous();
}

// What shapes every row's softmax: the sliding window (<= 0: none), the score scale, and
// the sinks [H] (null: none)
struct Softmax {
  int64_t window;
  float scale;
  const float* sinks;
};

// The sink logits of paged_attention's `sinks` argument: null when empty, else its data
inline const float* sink_logits(const torch::Tensor& sinks, int64_t H) {
  if (!sinks.defined() || sinks.numel() == 0) return nullptr;
  TORCH_CHECK(sinks.dtype() == torch::kFloat32 && sinks.is_contiguous() && sinks.numel() == H,
              "sinks must be a contiguous float32 tensor of one logit per query head");
  return sinks.data_ptr<float>();
}

constexpr int64_t kPartKeys = 1024;
constexpr int64_t kWaveFloats = int64_t(1) << 22;  // 16 MiB of partial results

inline int64_t parts_of(int64_t lo, int64_t hi) { return std::max<int64_t>(1, (hi - lo + kPartKeys - 1) / kPartKeys); }

// out[g, :] from the np partial results of one (row, KV head), `stride` floats apart, each
// acc [G, D] then m [G] then l [G]; sink: the group's G sink logits, or null
template <typename QT>
void merge_parts(const float* s, int64_t stride, int64_t np, int64_t G, int64_t D, const float* sink, QT* out) {
  std::vector<float> w(np);
  for (int64_t g = 0; g < G; ++g) {
    float M = sink ? sink[g] : -INFINITY;
    for (int64_t p = 0; p < np; ++p) M = std::max(M, s[p * stride + G * D + g]);
    float L = sink ? std::exp(sink[g] - M) : 0.0f;
    for (int64_t p = 0; p < np; ++p) {
      w[p] = std::exp(s[p * stride + G * D + g] - M);
      L += w[p] * s[p * stride + G * D + G + g];
    }
    const float inv = 1.0f / L;
    for (int64_t d = 0; d < D; ++d) {
      float o = 0.0f;
      for (int64_t p = 0; p < np; ++p) o += w[p] * s[p * stride + g * D + d];
      out[g * D + d] = static_cast<QT>(o * inv);
    }
  }
}

// Runs item(scratch, t, rows, hk, part_lo, part_hi, out, partial, ml) for every (row, KV
// head, part), in KV-head-major order (consecutive items read the same keys) and merges the
// rows of several parts. out is where a one-part row's result goes (then partial and ml are
// null), else out is null and the item leaves acc [G, D] in partial and m, l [2G] in ml.
// span (null: every row alone): an item for a one-part row t covers rows t .. t + span[t] - 1
// (`rows`; part_hi is row t's), and rows with span 0 have no item of their own.
// one_thread: the whole step is too small to be worth forking.
template <typename Scratch, typename QT, typename Item>
void attend_in_parts(int64_t T, int64_t H, int64_t Hkv, int64_t D, const int64_t* lo, const int64_t* hi,
                     const int64_t* span, bool one_thread, const float* sinks, QT* out, const Item& item) {
  const int64_t G = H / Hkv, slot = G * D + 2 * G;
  std::vector<float> partial;
  // a row's first partial slot in its wave (part p, KV head hk: + p Hkv + hk), -1 for one part
  std::vector<int64_t> first;
  std::vector<std::array<int64_t, 3>> items;
  for (int64_t t0 = 0, t1 = 0; t0 < T; t0 = t1) {
    int64_t slots = 0, max_parts = 1;
    first.clear();
    for (; t1 < T; ++t1) {
      const int64_t np = parts_of(lo[t1], hi[t1]), need = np > 1 ? np * Hkv : 0;
      if (t1 > t0 && (slots + need) * slot > kWaveFloats) break;
      first.push_back(np > 1 ? slots : -1);
      slots += need;
      max_parts = std::max(max_parts, np);
    }
    partial.resize(slots * slot);
    items.clear();
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t p = 0; p < max_parts; ++p)
        for (int64_t t = t0; t < t1; ++t)
          if (p < parts_of(lo[t], hi[t]) && (!span || span[t] > 0)) items.push_back({t, hk, p});
    const int64_t n = static_cast<int64_t>(items.size());
    parallel_for(0, n, one_thread ? n : 1, [&](int64_t i0, int64_t i1) {
      Scratch w;
      for (int64_t i = i0; i < i1; ++i) {
        const auto [t, hk, p] = items[i];
        const int64_t plo = lo[t] + p * kPartKeys, phi = std::min(hi[t], plo + kPartKeys);
        if (first[t - t0] < 0) {
          item(w, t, span ? span[t] : 1, hk, plo, phi, out + (t * H + hk * G) * D, nullptr, nullptr);
        } else {
          float* s = partial.data() + (first[t - t0] + p * Hkv + hk) * slot;
          item(w, t, int64_t(1), hk, plo, phi, nullptr, s, s + G * D);
        }
      }
    });
    if (slots == 0) continue;
    items.clear();
    for (int64_t t = t0; t < t1; ++t)
      if (first[t - t0] >= 0)
        for (int64_t hk = 0; hk < Hkv; ++hk) items.push_back({t, hk, 0});
    parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const auto [t, hk, unused] = items[i];
        merge_parts(partial.data() + (first[t - t0] + hk) * slot, Hkv * slot, parts_of(lo[t], hi[t]), G, D,
                    sinks ? sinks + hk * G : nullptr, out + (t * H + hk * G) * D);
      }
    });
  }
}

}  // namespace minerva
