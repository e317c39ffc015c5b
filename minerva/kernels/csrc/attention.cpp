// Paged attention over the KV pool for x86-64 CPUs with AVX-512.
//
// One call covers every request of a step: query rows (chunked prefill, decode and
// speculative verification alike) attend causally, optionally within a sliding
// window, to their own request's keys, read through its block table. Each (query row,
// KV head) is one work item computed start to finish by one thread in a fixed order
// (scores, max, exp, sum, weighted sum of V), so a row's result never depends on the
// other rows or requests in the batch. K and V may be stored as float32, bfloat16 or
// int8 with a float32 scale per token and head; the math is float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_parts.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace {

using namespace minerva;

struct Pool {
  const void* data;
  const float* scale;  // null for float storage
  int64_t block_stride, token_stride;  // elements
  int64_t scale_block_stride, scale_token_stride;
};

// Where keys lo .. lo+S-1 of head hk live: one row pointer (and int8 scale) per key, walking
// the block table without a division per key.
template <typename KT>
void token_rows(const Pool& P, const int64_t* table, int64_t lo, int64_t S, int64_t block_size, int64_t hk,
                int64_t D, std::vector<const KT*>& rows, std::vector<float>& scales) {
  rows.resize(S);
  scales.resize(S);
  int64_t b = lo / block_size, off = lo % block_size;
  for (int64_t j = 0; j < S; ++j) {
    const int64_t blk = table[b];
    rows[j] = static_cast<const KT*>(P.data) + blk * P.block_stride + off * P.token_stride + hk * D;
    scales[j] = P.scale ? P.scale[blk * P.scale_block_stride + off * P.scale_token_stride + hk] : 1.0f;
    if (++off == block_size) off = 0, ++b;
  }
}

// acc[g] = sum_j p[g * stride + j] * v_j[d : d + 16] for NG heads: even and odd keys in two
// register sets (independent FMA chains), added at the end.
template <int NG, typename VT>
inline void weighted_sum(const float* p, int64_t stride, const VT* const* vrows, const float* vscale, int64_t S,
                         int64_t d, __m512* acc) {
  __m512 a0[NG], a1[NG];
  for (int g = 0; g < NG; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 1 < S; j += 2) {
    const __m512 v0 = load16(vrows[j] + d, vscale[j]), v1 = load16(vrows[j + 1] + d, vscale[j + 1]);
    for (int g = 0; g < NG; ++g) {
      a0[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * stride + j]), v0, a0[g]);
      a1[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * stride + j + 1]), v1, a1[g]);
    }
  }
  if (j < S) {
    const __m512 v0 = load16(vrows[j] + d, vscale[j]);
    for (int g = 0; g < NG; ++g) a0[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * stride + j]), v0, a0[g]);
  }
  for (int g = 0; g < NG; ++g) acc[g] = _mm512_add_ps(a0[g], a1[g]);
}

// f.template operator()<NG>() with NG = min(n, 8): a group of up to 8 heads, their count a
// compile-time constant so that their accumulators stay in registers
template <typename F>
inline void up_to_8_heads(int64_t n, const F& f) {
  switch (std::min<int64_t>(8, n)) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

// The softmax numerators of G rows of S16 scores (`stride` apart; padding lanes hold -inf) in
// place, and each row's 1 / sum in inv_sum (ml non-null: a part of a longer row, whose max and
// sum go to ml [2G] and inv_sum is 1). A whole row with a sink: the sink's logit joins the max
// and the sum. pb non-null: the numerators also rounded to bf16 there, and the sum is theirs.
inline void softmax_rows(float* scores, int64_t G, int64_t S16, int64_t stride, const float* sink, float* ml,
                         float* inv_sum, at::BFloat16* pb) {
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * stride;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < S16; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + j));
    const float mval = sink && !ml ? std::max(_mm512_reduce_max_ps(mx), sink[g]) : _mm512_reduce_max_ps(mx);
    const __m512 m = _mm512_set1_ps(mval);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < S16; j += 16) {  // padding lanes hold -inf: exp gives 0
      __m512 x = _mm512_loadu_ps(sc + j);
      __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                     exp512(_mm512_sub_ps(x, m)));
      if (pb) {
        store16(pb + g * stride + j, e);
        e = load16(pb + g * stride + j, 1.0f);
      }
      _mm512_storeu_ps(sc + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (ml) {
      ml[g] = mval;
      ml[G + g] = _mm512_reduce_add_ps(sum);
      inv_sum[g] = 1.0f;
    } else {
      inv_sum[g] = 1.0f / (_mm512_reduce_add_ps(sum) + (sink ? std::exp(sink[g] - mval) : 0.0f));
    }
  }
}

// One (query row, KV head) item: the G query heads of the group against keys lo..hi-1.
// (ml null: out = the normalized result; else out holds the unnormalized sum and ml the
// softmax max and sum of each head, for attention_parts.h to merge)
template <typename QT, typename KT, typename VT, typename OT>
void attend_item(const QT* q, OT* out, const Pool& K, const Pool& V, const int64_t* table, int64_t lo, int64_t hi,
                 int64_t G, int64_t D, int64_t block_size, int64_t hk, float scale, const float* sink,
                 std::vector<float>& scores,
                 std::vector<float>& qf, std::vector<const KT*>& krows, std::vector<float>& kscale,
                 std::vector<const VT*>& vrows, std::vector<float>& vscale, float* ml) {
  const int64_t S = hi - lo, S16 = (S + 15) / 16 * 16;
  scores.assign(G * S16, -INFINITY);
  qf.resize(G * D);
  for (int64_t g = 0; g < G; ++g)  // q pre-scaled: scores = (scale q) . k
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(qf.data() + g * D + d, _mm512_mul_ps(load16(q + g * D + d, 1.0f), _mm512_set1_ps(scale)));
  token_rows<KT>(K, table, lo, S, block_size, hk, D, krows, kscale);
  token_rows<VT>(V, table, lo, S, block_size, hk, D, vrows, vscale);
  // scores, 16 keys at a time (a short last block repeats its last key; those lanes are dropped).
  // A request's blocks lie anywhere in the pool, where the hardware prefetchers cannot follow
  // them, and a decode step finds them out of cache (the weights streamed since evicted them):
  // the next 16 keys' rows are prefetched, and this block's value rows for the weighted sum.
  const int64_t k_bytes = D * static_cast<int64_t>(sizeof(KT)), v_bytes = D * static_cast<int64_t>(sizeof(VT));
  const auto fetch = [](const void* row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(row) + o, _MM_HINT_T0);
  };
  for (int64_t j = 0; j < std::min<int64_t>(16, S); ++j) fetch(krows[j], k_bytes);
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, S - j0);
    for (int64_t j = j0 + 16; j < std::min<int64_t>(j0 + 32, S); ++j) fetch(krows[j], k_bytes);
    for (int64_t j = j0; j < j0 + n; ++j) fetch(vrows[j], v_bytes);
    const KT* kp[16];
    float ks[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t jj = j0 + std::min<int64_t>(j, n - 1);
      kp[j] = krows[jj];
      ks[j] = kscale[jj];
    }
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(qf.data() + g * D + d);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, load16(kp[j] + d, ks[j]), acc[j]);
      }
      __m512 sums = hsum16(acc);
      __mmask16 valid = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
      _mm512_mask_storeu_ps(scores.data() + g * S16 + j0, valid, sums);
    }
  }
  // softmax numerators in place, and 1 / sum
  float inv_sum[64];
  softmax_rows(scores.data(), G, S16, S16, sink, ml, inv_sum, nullptr);
  // out = (sum_j p_j v_j) / sum, one 16-wide slice of D and up to 8 heads at a time (a
  // widened V slice serves 8 FMAs)
  for (int64_t d = 0; d < D; d += 16) {
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
      __m512 acc[8];
      const float* p = scores.data() + g0 * S16;
      up_to_8_heads(G - g0, [&]<int NG>() { weighted_sum<NG, VT>(p, S16, vrows.data(), vscale.data(), S, d, acc); });
      for (int64_t g = g0; g < std::min<int64_t>(G, g0 + 8); ++g)
        store16(out + g * D + d, _mm512_mul_ps(acc[g - g0], _mm512_set1_ps(inv_sum[g])));
    }
  }
}

// bf16 q, K and V (the default pool with bf16 compute): the scores and the weighted sum of V by
// vdpbf16ps (products of bf16 pairs added in float32), 16 keys at a time in the lanes.
//
// Scores: a block of 16 keys transposed once so that vector p holds dword p (dims 2p, 2p + 1)
// of each key; then a head's 16 scores are D / 2 instructions, each taking q's dims 2p, 2p + 1
// as an embedded broadcast, with no lane sums. (The float path widens K for every head and
// adds 16 lanes per score.) Weighted sum: the softmax numerators rounded to bf16 (their sum
// taken after the rounding, so the weights still add up to one), two keys' V rows interleaved
// dim by dim (unpacklo/hi_epi16, which leave the dims in an order the store undoes), and one
// instruction per 16 dims of two keys. A 512-token prefill of the 1.1B shape (32 heads, 4 KV
// heads, D 64), AVX-512 machine, 2 threads: 5.8 ms a layer, against 8.3 with bf16 dot products
// and lane sums for the scores and the float path's weighted sum, and 11.0 with the float path.
inline __m512 dot_bf16(__m512 acc, __m512i k, const at::BFloat16* pair) {  // acc + k . (pair in every lane)
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*reinterpret_cast<const int32_t*>(pair)));
  return acc;
}

// r[i] dword j to r[j] dword i (16 x 16)
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // b[4k + c] 128-bit lane L: rows 4k .. 4k + 3 of column 4L + c
    b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
    b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i f0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44), f1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(e0, f0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(e0, f0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(e1, f1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(e1, f1, 0xDD);
  }
}

// NG heads' scores against the transposed block kt, times scale, to out[g * stride] (valid lanes)
template <int NG>
inline void scores_bf16(const at::BFloat16* q, int64_t D, const __m512i* kt, float scale, float* out, int64_t stride,
                        __mmask16 valid) {
  __m512 acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const __m512i k = _mm512_load_si512(kt + p);
    for (int g = 0; g < NG; ++g) acc[g] = dot_bf16(acc[g], k, q + g * D + 2 * p);
  }
  for (int g = 0; g < NG; ++g) _mm512_mask_storeu_ps(out + g * stride, valid, _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
}

// NG heads' sum_j p_j v_j over dims d .. d + 31, in unpacklo/hi_epi16's order: lo lane 4L + i
// is dim d + 8L + i, hi lane 4L + i dim d + 8L + 4 + i (L = 0..3, i = 0..3). pb: the heads'
// bf16 numerators, stride apart, zero past S.
template <int NG>
inline void weighted_sum_bf16(const at::BFloat16* pb, int64_t stride, const at::BFloat16* const* vrows, int64_t S,
                              int64_t d, __m512* lo, __m512* hi) {
  __m512 a[NG], b[NG];  // in registers (through lo and hi GCC stores them at every step)
  for (int g = 0; g < NG; ++g) a[g] = b[g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; j += 2) {
    const __m512i v0 = _mm512_loadu_si512(vrows[j] + d), v1 = _mm512_loadu_si512(vrows[std::min(j + 1, S - 1)] + d);
    const __m512i l = _mm512_unpacklo_epi16(v0, v1), h = _mm512_unpackhi_epi16(v0, v1);
    for (int g = 0; g < NG; ++g) {
      a[g] = dot_bf16(a[g], l, pb + g * stride + j);
      b[g] = dot_bf16(b[g], h, pb + g * stride + j);
    }
  }
  for (int g = 0; g < NG; ++g) lo[g] = a[g], hi[g] = b[g];
}

// Rows of one request that share their first key lo (a verification step's k + 1 rows, or a
// prefill chunk's), each with its own end: row r, its G query heads at q + r q_stride, attends
// to keys lo .. his[r] - 1 and writes out + r out_stride. Each block of 16 keys is loaded and
// transposed once for all the rows and each pair of value rows loaded once, where one row at a
// time would repeat both for every row (for 3 query heads a KV head, the transpose costs more
// than the dot products). The bits are those of each row alone: a row's scores are the same
// instructions on the same lanes, its softmax runs over its own keys, and its weighted sum over
// keys past its end adds products with a zero numerator, which leave the sum as it is.
// (ml non-null: one row that is a part of a longer row; see attend_item.)
constexpr int64_t kMaxRowHeads = 64;  // rows x query heads of one item

template <typename OT>
void attend_item_bf16(const at::BFloat16* q, int64_t q_stride, OT* out, int64_t out_stride, int64_t R,
                      const int64_t* his, const Pool& K, const Pool& V, const int64_t* table, int64_t lo, int64_t G,
                      int64_t D, int64_t block_size, int64_t hk, float scale, const float* sink,
                      std::vector<float>& scores, std::vector<at::BFloat16>& pb,
                      std::vector<const at::BFloat16*>& krows, std::vector<float>& kscale,
                      std::vector<const at::BFloat16*>& vrows, std::vector<float>& vscale, float* ml) {
  using BF = at::BFloat16;
  int64_t S = 0;
  for (int64_t r = 0; r < R; ++r) S = std::max(S, his[r] - lo);
  const int64_t S16 = (S + 15) / 16 * 16, RG = R * G;
  scores.assign(RG * S16, -INFINITY);
  pb.assign(RG * S16, BF(0.0f));  // zero past each row's own keys
  token_rows<BF>(K, table, lo, S, block_size, hk, D, krows, kscale);
  token_rows<BF>(V, table, lo, S, block_size, hk, D, vrows, vscale);
  const auto fetch = [D](const void* row) {  // as attend_item
    for (int64_t o = 0; o < D * 2; o += 64) _mm_prefetch(static_cast<const char*>(row) + o, _MM_HINT_T0);
  };
  for (int64_t j = 0; j < std::min<int64_t>(16, S); ++j) fetch(krows[j]);
  alignas(64) __m512i kt[128];
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, S - j0);
    for (int64_t j = j0 + 16; j < std::min<int64_t>(j0 + 32, S); ++j) fetch(krows[j]);
    for (int64_t j = j0; j < j0 + n; ++j) fetch(vrows[j]);
    for (int64_t c = 0; c < D / 32; ++c) {  // keys j0 .. j0 + 15 (a short block repeats its last), transposed
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(krows[j0 + std::min<int64_t>(j, n - 1)] + 32 * c);
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + 16 * c + p, r[p]);
    }
    for (int64_t row = 0; row < R; ++row) {
      const int64_t nr = std::min<int64_t>(16, his[row] - lo - j0);  // this row's keys in the block
      if (nr <= 0) continue;
      const __mmask16 valid = static_cast<__mmask16>(nr == 16 ? 0xFFFF : (1u << nr) - 1);
      for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const BF* qg = q + row * q_stride + g0 * D;
        float* o = scores.data() + (row * G + g0) * S16 + j0;
        up_to_8_heads(G - g0, [&]<int NG>() { scores_bf16<NG>(qg, D, kt, scale, o, S16, valid); });
      }
    }
  }
  float inv_sum[kMaxRowHeads];
  for (int64_t row = 0; row < R; ++row) {
    const int64_t Sr16 = (his[row] - lo + 15) / 16 * 16;
    softmax_rows(scores.data() + row * G * S16, G, Sr16, S16, sink, ml, inv_sum + row * G, pb.data() + row * G * S16);
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t d = 0; d < D; d += 32) {
    for (int64_t h0 = 0; h0 < RG; h0 += 8) {  // 8 (row, head) pairs at a time, across rows
      __m512 l[8], h[8];
      const BF* p = pb.data() + h0 * S16;
      up_to_8_heads(RG - h0, [&]<int NG>() { weighted_sum_bf16<NG>(p, S16, vrows.data(), S, d, l, h); });
      for (int64_t i = h0; i < std::min<int64_t>(RG, h0 + 8); ++i) {
        const __m512 inv = _mm512_set1_ps(inv_sum[i]);
        OT* o = out + (i / G) * out_stride + (i % G) * D + d;
        store16(o, _mm512_mul_ps(_mm512_permutex2var_ps(l[i - h0], first, h[i - h0]), inv));
        store16(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(l[i - h0], second, h[i - h0]), inv));
      }
    }
  }
}

template <typename QT, typename KT, typename VT>
void attend(const QT* q, QT* out, const Pool& K, const Pool& V, const int64_t* tables, int64_t table_stride,
            const int64_t* seq_lens, const int64_t* qsl, const int64_t* positions, int64_t B, int64_t T,
            int64_t H, int64_t Hkv, int64_t D, int64_t block_size, const Softmax& sm) {
  const int64_t G = H / Hkv, window = sm.window;
  const float scale = sm.scale;
  TORCH_CHECK(G <= 64, "at most 64 query heads per KV head");
  std::vector<int64_t> req(T), lo(T), hi(T);
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = qsl[b]; t < qsl[b + 1]; ++t) {
      req[t] = b;
      hi[t] = std::min(positions[t] + 1, seq_lens[b]);
      lo[t] = window > 0 ? std::max<int64_t>(0, positions[t] - window + 1) : 0;
      work += (hi[t] - lo[t]) * H;
    }
  struct Scratch {
    std::vector<float> scores, qf, kscale, vscale;
    std::vector<const KT*> krows;
    std::vector<const VT*> vrows;
    std::vector<at::BFloat16> pb;
  };
  constexpr bool all_bf16 = std::is_same_v<QT, at::BFloat16> && std::is_same_v<KT, at::BFloat16> &&
                            std::is_same_v<VT, at::BFloat16>;
  const bool use_bf16 = all_bf16 && D % 32 == 0 && D <= 256;
  // the bf16 item takes consecutive rows of one request that start at the same key, each of
  // one part, together (span[t]: the rows the item at t covers; 0: covered by an earlier one),
  // in as many groups as keep the threads evenly busy: 4 rows of 3 KV heads on 2 threads in 2
  // groups of 2 (6 items), not 1 of 4 (3 items, one thread idle a third of the time)
  std::vector<int64_t> span;
  if (use_bf16) {
    span.assign(T, 1);
    const int64_t most = std::max<int64_t>(1, kMaxRowHeads / G), threads = ThreadPool::get().threads();
    for (int64_t t = 0; t < T;) {
      int64_t e = t + 1;
      if (parts_of(lo[t], hi[t]) == 1)
        while (e < T && req[e] == req[t] && lo[e] == lo[t] && parts_of(lo[e], hi[e]) == 1) ++e;
      const int64_t n = e - t;
      int64_t groups = (n + most - 1) / most;
      while (groups < n && (groups * Hkv) % threads != 0 && groups * Hkv < 4 * threads) ++groups;
      for (int64_t g = 0, r = t; g < groups; ++g) {  // sizes differ by at most one
        const int64_t size = n / groups + (g < n % groups);
        span[r] = size;
        for (int64_t i = 1; i < size; ++i) span[r + i] = 0;
        r += size;
      }
      t = e;
    }
  }
  // small steps are cheaper on one thread than to fork; a decode step's keys come from memory
  // (out of cache), so from 64 keys at 32 heads it forks: 0.70 against 0.46-0.52 ms a token for
  // the 22 layers of the 1.1B shape at 16-176 keys (AVX-512 machine, 2 threads)
  minerva::attend_in_parts<Scratch>(
      T, H, Hkv, D, lo.data(), hi.data(), span.empty() ? nullptr : span.data(), work < (1 << 11), sm.sinks, out,
      [&](Scratch& w, int64_t t, int64_t rows, int64_t hk, int64_t plo, int64_t phi, QT* o, float* partial,
          float* ml) {
        const QT* qt = q + (t * H + hk * G) * D;
        const int64_t* table = tables + req[t] * table_stride;
        const float* sink = sm.sinks ? sm.sinks + hk * G : nullptr;
        if constexpr (all_bf16) {
          if (use_bf16) {
            if (o)
              attend_item_bf16(qt, H * D, o, H * D, rows, hi.data() + t, K, V, table, plo, G, D, block_size, hk,
                               scale, sink, w.scores, w.pb, w.krows, w.kscale, w.vrows, w.vscale, nullptr);
            else
              attend_item_bf16(qt, H * D, partial, 0, 1, &phi, K, V, table, plo, G, D, block_size, hk, scale, sink,
                               w.scores, w.pb, w.krows, w.kscale, w.vrows, w.vscale, ml);
            return;
          }
        }
        if (o)
          attend_item<QT, KT, VT>(qt, o, K, V, table, plo, phi, G, D, block_size, hk, scale, sink, w.scores, w.qf,
                                  w.krows, w.kscale, w.vrows, w.vscale, nullptr);
        else
          attend_item<QT, KT, VT>(qt, partial, K, V, table, plo, phi, G, D, block_size, hk, scale, sink, w.scores,
                                  w.qf, w.krows, w.kscale, w.vrows, w.vscale, ml);
      });
}

Pool pool_of(const torch::Tensor& data, const torch::Tensor& scale) {
  Pool p{data.data_ptr(), nullptr, data.stride(0), data.stride(1), 0, 0};
  if (scale.defined() && scale.numel() > 0) {
    TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.dim() == 3, "KV scales must be float32 [blocks, block_size, Hkv]");
    p.scale = scale.data_ptr<float>();
    p.scale_block_stride = scale.stride(0);
    p.scale_token_stride = scale.stride(1);
  }
  return p;
}

template <typename QT, typename KT>
void dispatch_v(const torch::Tensor& v, const QT* q, QT* out, const Pool& K, const Pool& V, const int64_t* tables,
                int64_t ts, const int64_t* sl, const int64_t* qsl, const int64_t* pos, int64_t B, int64_t T,
                int64_t H, int64_t Hkv, int64_t D, int64_t bs, const Softmax& sm) {
  switch (v.scalar_type()) {
    case torch::kFloat32: attend<QT, KT, float>(q, out, K, V, tables, ts, sl, qsl, pos, B, T, H, Hkv, D, bs, sm); break;
    case torch::kBFloat16: attend<QT, KT, at::BFloat16>(q, out, K, V, tables, ts, sl, qsl, pos, B, T, H, Hkv, D, bs, sm); break;
    case torch::kInt8: attend<QT, KT, int8_t>(q, out, K, V, tables, ts, sl, qsl, pos, B, T, H, Hkv, D, bs, sm); break;
    default: TORCH_CHECK(false, "unsupported V cache dtype ", v.scalar_type());
  }
}

}  // namespace

// paged_attention into `out` (contiguous, q's shape and dtype), which it returns
torch::Tensor paged_attention_into(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_scale,
                                   torch::Tensor v_scale, torch::Tensor block_tables, torch::Tensor seq_lens,
                                   torch::Tensor query_start_loc, torch::Tensor positions, int64_t window,
                                   double scale, torch::Tensor sinks, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "q must be [T, H, D] and k/v [blocks, block_size, Hkv, D]");
  q = q.contiguous();
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_attention: out must be contiguous, of q's shape and dtype");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(2), bs = k.size(1);
  TORCH_CHECK(D % 16 == 0 && k.size(3) == D && v.size(3) == D && H % Hkv == 0, "bad head sizes");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == D && v.stride(3) == 1 && v.stride(2) == D, "KV pools must be dense in [Hkv, D]");
  auto i64 = [](const torch::Tensor& x) { return minerva::as_int64(x); };
  block_tables = i64(block_tables), seq_lens = i64(seq_lens), query_start_loc = i64(query_start_loc),
  positions = i64(positions);
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && positions.size(0) == T && block_tables.size(0) == B, "bad batch layout");
  Pool K = pool_of(k, k_scale), V = pool_of(v, v_scale);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t ts = block_tables.size(1);
  const int64_t *sl = seq_lens.data_ptr<int64_t>(), *qsl = query_start_loc.data_ptr<int64_t>(),
                *pos = positions.data_ptr<int64_t>();
  const Softmax sm{window, static_cast<float>(scale), minerva::sink_logits(sinks, H)};
  auto run = [&](auto* qp, auto* op) {
    using QT = std::remove_cv_t<std::remove_pointer_t<decltype(qp)>>;
    switch (k.scalar_type()) {
      case torch::kFloat32: dispatch_v<QT, float>(v, qp, op, K, V, tables, ts, sl, qsl, pos, B, T, H, Hkv, D, bs, sm); break;
      case torch::kBFloat16: dispatch_v<QT, at::BFloat16>(v, qp, op, K, V, tables, ts, sl, qsl, pos, B, T, H, Hkv, D, bs, sm); break;
      case torch::kInt8: dispatch_v<QT, int8_t>(v, qp, op, K, V, tables, ts, sl, qsl, pos, B, T, H, Hkv, D, bs, sm); break;
      default: TORCH_CHECK(false, "unsupported K cache dtype ", k.scalar_type());
    }
  };
  if (q.scalar_type() == torch::kFloat32) run(q.data_ptr<float>(), out.data_ptr<float>());
  else if (q.scalar_type() == torch::kBFloat16) run(q.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  else TORCH_CHECK(false, "q must be float32 or bfloat16");
  return out;
}

namespace {

template <typename XT, typename PT>
void write_rows(const XT* x, int64_t x_stride, PT* pool, float* scales, const int64_t* slots, int64_t T,
                int64_t Hkv, int64_t D) {
  minerva::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const XT* src = x + t * x_stride + h * D;
      PT* dst = pool + (slots[t] * Hkv + h) * D;
      if constexpr (std::is_same_v<PT, int8_t>) {
        // as kv_quant.quantize_kv: scale = absmax / 127; q = round_half_even(x / scale), clamped
        __m512 amax = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(src + d, 1.0f)));
        const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
        const __m512 div = _mm512_set1_ps(scale > 0 ? scale : 1.0f);
        const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        for (int64_t d = 0; d < D; d += 16) {
          __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load16(src + d, 1.0f), div),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
        }
        scales[slots[t] * Hkv + h] = scale;
      } else {
        for (int64_t d = 0; d < D; d += 16) store16(dst + d, load16(src + d, 1.0f));
      }
    }
  }
  });
}

}  // namespace

#include "attention_tensor.h"  // paged_attention, kv_write and kv_write_cols over the functions above
