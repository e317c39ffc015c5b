// Paged attention over the KV pool for x86-64 CPUs with AVX2 and FMA (the AVX-512 build's
// attention.cpp, on 8-lane vectors).
//
// One call covers every request of a step: query rows (chunked prefill, decode and
// speculative verification alike) attend causally, optionally within a sliding
// window, to their own request's keys, read through its block table. Each (query row,
// KV head) is one work item computed start to finish by one thread in a fixed order
// (scores, max, exp, sum, weighted sum of V), so a row's result never depends on the
// other rows or requests in the batch. K and V may be stored as float32, bfloat16 or
// int8 with a float32 scale per token and head; the math is float32.
//
// Keys are taken in chunks that fit the L1 cache: a chunk of K (or V) rows is read from
// memory once, widened to float32 once when stored narrower, and then used from cache by
// every query head of the KV head's group, so a long context is streamed once per item.
// The next chunk is prefetched meanwhile: a request's blocks lie anywhere in the pool,
// where the hardware prefetchers cannot follow.

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_parts.h"
#include "kernels.h"
#include "kernels.h"
#include "parallel.h"
#include "simd_avx2.h"

namespace {

using namespace minerva;

struct Pool {
  const void* data;
  const float* scale;  // null for float storage
  int64_t block_stride, token_stride;  // elements
  int64_t scale_block_stride, scale_token_stride;
};

// float32 values of a chunk of K or V rows (8 KiB). One head's rows lie a power-of-two
// stride apart in the pool and share a few L1 sets: a chunk and the next one, prefetched,
// must fit there (measured on Zen 3: 2048 beat 4096 by 5-10%).
constexpr int64_t kChunkFloats = 2048;
constexpr int64_t kMaxChunk = kChunkFloats / 8;  // keys per chunk when D = 8 (the most)

// Where a chunk of rows of one head lives: a pointer per row and, for int8, its scale's.
struct RawChunk {
  int64_t n = 0;
  const char* rows[kMaxChunk];
  const float* scales[kMaxChunk];
};

// Walks a request's block table from key `lo` on, a chunk at a time, without a division
// per key.
struct RowCursor {
  const int64_t* table;
  int64_t block_size, b, off;
  RowCursor(const int64_t* table_, int64_t lo, int64_t block_size_)
      : table(table_), block_size(block_size_), b(lo / block_size_), off(lo % block_size_) {}

  // the next n rows of head hk (row bytes: D * elem)
  void next(const Pool& P, int64_t elem, int64_t n, int64_t hk, int64_t D, RawChunk& r) {
    r.n = n;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t blk = table[b];
      r.rows[j] = static_cast<const char*>(P.data) + (blk * P.block_stride + off * P.token_stride + hk * D) * elem;
      r.scales[j] = P.scale ? P.scale + blk * P.scale_block_stride + off * P.scale_token_stride + hk : nullptr;
      if (++off == block_size) off = 0, ++b;
    }
  }
};

// Asks for rows [j0, j1) of a chunk (and their int8 scales) to be brought into L1.
inline void prefetch_rows(const RawChunk& r, int64_t j0, int64_t j1, int64_t row_bytes) {
  for (int64_t j = j0; j < std::min(j1, r.n); ++j) {
    const int64_t skew = static_cast<int64_t>(reinterpret_cast<uintptr_t>(r.rows[j]) & 63);
    for (int64_t o = 0; o < skew + row_bytes; o += 64) prefetch(r.rows[j] - skew + o);
    if (r.scales[j]) prefetch(r.scales[j]);
  }
}

// A chunk's rows as float32 rows: the pool's own rows for float32 storage, else widened
// (bf16) or dequantized (int8: value * scale, as load8 computes it) into buf [n, D] once, for
// all the heads of the group to use. The last row repeats up to a multiple of 8 rows.
template <typename T>
void float_rows(const RawChunk& r, int64_t D, float* buf, const float** rows) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < r.n; ++j) rows[j] = reinterpret_cast<const float*>(r.rows[j]);
  } else {
    for (int64_t j = 0; j < r.n; ++j) {
      const T* src = reinterpret_cast<const T*>(r.rows[j]);
      const float s = r.scales[j] ? *r.scales[j] : 1.0f;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(buf + j * D + d, load8(src + d, s));
      rows[j] = buf + j * D;
    }
  }
  for (int64_t j = r.n; j % 8; ++j) rows[j] = rows[r.n - 1];
}

// The scores of 8 keys against one pre-scaled query head: acc[j] = q . k_j, 8 lanes of D at
// a time, then one horizontal sum for all 8 keys.
inline __m256 scores8(const float* q, const float* const* k, int64_t D) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), acc[j]);
  }
  return hsum8(acc);
}

// acc[g] += sum_j p[g * stride + j] * v_j[d : d + 16] over the chunk's n keys, for NG heads.
// Keys go round-robin over NC register sets (independent FMA chains), summed at the end;
// NG * NC * 2 <= 8 accumulators (AVX2 has 16 registers).
template <int NG, int NC>
inline void weighted_sum(const float* p, int64_t stride, const float* const* v, int64_t n, int64_t d, float* acc,
                         int64_t D) {
  __m256 a[NC][NG][2];
  for (int c = 0; c < NC; ++c)
    for (int g = 0; g < NG; ++g) a[c][g][0] = a[c][g][1] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + NC <= n; j += NC) {
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      const __m256 v0 = _mm256_loadu_ps(v[j + c] + d), v1 = _mm256_loadu_ps(v[j + c] + d + 8);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const __m256 pb = _mm256_broadcast_ss(p + g * stride + j + c);
        a[c][g][0] = _mm256_fmadd_ps(pb, v0, a[c][g][0]);
        a[c][g][1] = _mm256_fmadd_ps(pb, v1, a[c][g][1]);
      }
    }
  }
  for (int c = 0; j < n; ++j, ++c) {
    const __m256 v0 = _mm256_loadu_ps(v[j] + d), v1 = _mm256_loadu_ps(v[j] + d + 8);
    for (int g = 0; g < NG; ++g) {
      const __m256 pb = _mm256_broadcast_ss(p + g * stride + j);
      a[c][g][0] = _mm256_fmadd_ps(pb, v0, a[c][g][0]);
      a[c][g][1] = _mm256_fmadd_ps(pb, v1, a[c][g][1]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int h = 0; h < 2; ++h) {
      __m256 s = a[0][g][h];
      for (int c = 1; c < NC; ++c) s = _mm256_add_ps(s, a[c][g][h]);
      float* o = acc + g * D + d + 8 * h;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), s));
    }
}

struct Scratch {
  std::vector<float> scores, qf, acc, buf;
  std::vector<const float*> rows;
  RawChunk raw[2];
};

// One (query row, KV head) item: the G query heads of the group against keys lo..hi-1.
// (ml null: out = the normalized result, the group's sink logits, when given, in the
// softmax; else out holds the unnormalized sum and ml the softmax max and sum of each head,
// for attention_parts.h to merge, and the sinks join there)
template <typename QT, typename KT, typename VT, typename OT>
void attend_item(const QT* q, OT* out, const Pool& K, const Pool& V, const int64_t* table, int64_t lo, int64_t hi,
                 int64_t G, int64_t D, int64_t block_size, int64_t hk, float scale, const float* sink, Scratch& w,
                 float* ml) {
  const int64_t S = hi - lo, S8 = (S + 7) / 8 * 8;
  const int64_t C = std::max<int64_t>(8, kChunkFloats / D / 8 * 8);  // keys per chunk
  const int64_t kbytes = D * sizeof(KT), vbytes = D * sizeof(VT);
  w.scores.resize(G * S8);
  w.qf.resize(G * D);
  w.acc.assign(G * D, 0.0f);
  w.buf.resize(C * D);
  w.rows.resize(C);
  float *qf = w.qf.data(), *sc = w.scores.data(), *buf = w.buf.data(), *acc = w.acc.data();
  const float** rows = w.rows.data();
  for (int64_t g = 0; g < G; ++g)  // q pre-scaled: scores = (scale q) . k
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(qf + g * D + d, _mm256_mul_ps(load8(q + g * D + d, 1.0f), _mm256_set1_ps(scale)));
  // The K chunks, then the V chunks, each prefetched while the one before is computed.
  RowCursor kc(table, lo, block_size), vc(table, lo, block_size);
  RawChunk *cur = &w.raw[0], *nxt = &w.raw[1];
  int64_t kleft = S, vleft = S;
  auto next_chunk = [&](RawChunk& r) -> int64_t {  // bytes per row of r, 0 when none is left
    if (kleft > 0) {
      kc.next(K, sizeof(KT), std::min(C, kleft), hk, D, r);
      kleft -= r.n;
      return kbytes;
    }
    if (vleft > 0) {
      vc.next(V, sizeof(VT), std::min(C, vleft), hk, D, r);
      vleft -= r.n;
      return vbytes;
    }
    r.n = 0;
    return 0;
  };
  next_chunk(*cur);
  // scores, 8 keys per step (the last step of a short chunk repeats its last key; those
  // lanes get -inf); all heads use a step's 8 rows while they are in L1
  for (int64_t c0 = 0; c0 < S; c0 += C) {
    const int64_t n = cur->n, nbytes = next_chunk(*nxt);
    float_rows<KT>(*cur, D, buf, rows);
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      prefetch_rows(*nxt, j0 * nxt->n / n, (j0 + 8) * nxt->n / n, nbytes);
      const __m256 valid = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                         _mm256_set1_ps(static_cast<float>(n - j0)), _CMP_LT_OQ);
      for (int64_t g = 0; g < G; ++g)
        _mm256_storeu_ps(sc + g * S8 + c0 + j0,
                         _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores8(qf + g * D, rows + j0, D), valid));
    }
    std::swap(cur, nxt);
  }
  // softmax numerators in place, and 1 / sum
  float inv_sum[64];
  for (int64_t g = 0; g < G; ++g) {
    float* s = sc + g * S8;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < S8; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    // a whole row with a sink: the sink's logit joins the max (and the sum, below)
    const float mval = sink && !ml ? std::max(reduce_max(mx), sink[g]) : reduce_max(mx);
    const __m256 m = _mm256_set1_ps(mval);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < S8; j += 8) {  // padding lanes hold -inf: exp gives 0
      const __m256 x = _mm256_loadu_ps(s + j);
      const __m256 e = _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                     exp256(_mm256_sub_ps(x, m)));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (ml) {
      ml[g] = mval;
      ml[G + g] = reduce_add(sum);
      inv_sum[g] = 1.0f;
    } else {
      inv_sum[g] = 1.0f / (reduce_add(sum) + (sink ? std::exp(sink[g] - mval) : 0.0f));
    }
  }
  // acc = sum_j p_j v_j, a chunk at a time, in passes over it of 16 lanes of D and up to 4
  // heads (the heads of a slice of D in turn, while its lines of the rows are in L1)
  const int64_t passes = (G + 3) / 4 * (D / 16);
  for (int64_t c0 = 0; c0 < S; c0 += C) {
    const int64_t n = cur->n, nbytes = next_chunk(*nxt);
    float_rows<VT>(*cur, D, buf, rows);
    int64_t pass = 0;
    for (int64_t d = 0; d < D; d += 16) {
      for (int64_t g0 = 0; g0 < G; g0 += 4, ++pass) {
        prefetch_rows(*nxt, pass * nxt->n / passes, (pass + 1) * nxt->n / passes, nbytes);
        const float* p = sc + g0 * S8 + c0;
        float* a = acc + g0 * D;
        switch (std::min<int64_t>(4, G - g0)) {
          case 1: weighted_sum<1, 4>(p, S8, rows, n, d, a, D); break;
          case 2: weighted_sum<2, 2>(p, S8, rows, n, d, a, D); break;
          case 3: weighted_sum<3, 1>(p, S8, rows, n, d, a, D); break;
          default: weighted_sum<4, 1>(p, S8, rows, n, d, a, D); break;
        }
      }
    }
    std::swap(cur, nxt);
  }
  // out = acc / sum
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; d += 8)
      store8(out + g * D + d, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + d), _mm256_set1_ps(inv_sum[g])));
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
  // small steps (a decode of a short context) are cheaper on one thread than to fork
  minerva::attend_in_parts<Scratch>(
      T, H, Hkv, D, lo.data(), hi.data(), nullptr, work < (1 << 14), sm.sinks, out,
      [&](Scratch& w, int64_t t, int64_t, int64_t hk, int64_t plo, int64_t phi, QT* o, float* partial, float* ml) {
        const QT* qt = q + (t * H + hk * G) * D;
        const int64_t* table = tables + req[t] * table_stride;
        const float* sink = sm.sinks ? sm.sinks + hk * G : nullptr;
        if (o) attend_item<QT, KT, VT>(qt, o, K, V, table, plo, phi, G, D, block_size, hk, scale, sink, w, nullptr);
        else attend_item<QT, KT, VT>(qt, partial, K, V, table, plo, phi, G, D, block_size, hk, scale, sink, w, ml);
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
        __m256 amax = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) amax = _mm256_max_ps(amax, abs8(load8(src + d, 1.0f)));
        const float scale = reduce_max(amax) / 127.0f;
        const __m256 div = _mm256_set1_ps(scale > 0 ? scale : 1.0f);
        const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
        for (int64_t d = 0; d < D; d += 8) {
          __m256 q = _mm256_round_ps(_mm256_div_ps(load8(src + d, 1.0f), div),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          store8(dst + d, _mm256_min_ps(_mm256_max_ps(q, lo), hi));
        }
        scales[slots[t] * Hkv + h] = scale;
      } else {
        for (int64_t d = 0; d < D; d += 8) store8(dst + d, load8(src + d, 1.0f));
      }
    }
  }
  });
}

}  // namespace

#include "attention_tensor.h"  // paged_attention, kv_write and kv_write_cols over the functions above
