// The regrouped kernels' dispatch (x8_groups, matmul_x8), shared by q8_repack_x8.cpp (Q4_0, Q4_1,
// Q5_0, Q5_1, MXFP4, Q8_0) and q8_repack_k.cpp (Q2_K .. Q5_K), as ggml-cpu's repack.cpp: each
// defines its types' kernels and instantiates the dispatch for them (MINERVA_Q8_REGROUPED), so
// the other file's kernels are only declared here (x8_groups takes a type's own kernels alone).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "q8_kernels.h"
#include "q8_lanes.h"

// a lambda GCC always inlines (after its parameter list)
#define MINERVA_INLINE __attribute__((always_inline))

namespace minerva::q8 {

#if defined(MINERVA_V16)
constexpr int V16_MR = 8;  // rows of x per tile with V16
// ... and for the Q4_K/Q5_K tiles with int steps: Zen 4, 512 rows of x against 11264 x 2048
// Q4_K, one thread, alternating builds: 161-167 GMAC/s with 6 rows against 145-162 with 8
// (7 of 7 pairs; Q5_K the same), 10 rows 151-152
constexpr int V16_INT_MR = 6;
#endif

// rows of x per tile: 4, or with AVX-512's 32 vector registers 8 for Q4_K and Q6_K (and Q3_K,
// whose panel kernel is Q6_K's; not timed apart) and 6 for Q5_K (one dot product chain per row
// of x); with VNNI too, V16 tiles of V16_MR rows take over for Q4_K and Q5_K (and for their
// panels, more than one row of x), and for the 32-weight block types (tile_x8_pair, in
// q8_repack_x8.cpp with its measurements). AVX-512 machine, 5632 x 2048, 512 rows of x, 2
// threads, alternating runs: Q4_K 248-258 GMAC/s with 8 against 232-235 with 4 (242-245 with
// 6); Q5_K 194-205 with 6 against 173-174 with 4 and 178-182 with 8; Q6_K 200-207 with 8
// against 179-183 with 4 (the GGML layout's `tile`: 136-143).
#if defined(__AVX512F__)
template <int QT>
constexpr int x8_mr = QT == Q4_K || QT == Q6_K || QT == Q3_K || QT == Q2_K ? 8 : QT == Q5_K ? 6 : 4;
#else
template <int QT>
constexpr int x8_mr = 4;
#endif

// Output columns c0 .. c1 of all M rows, computed by `compute(out, ldy)` (column c0 + c of
// row m at out[m * ldy + c]): into y (ldy N), or with yb into a float buffer of the thread's,
// rounded to bf16 into yb at once. Against a float32 y rounded afterwards (as_dtype_of) the
// same values, and the float results never leave the cache.
template <class F>
void columns_out(int64_t M, int64_t N, int64_t c0, int64_t c1, float* y, at::BFloat16* yb, const F& compute) {
  if (yb == nullptr) return compute(y + c0, N);
  const int64_t w = c1 - c0;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < M * w) buffer.resize(M * w);
  compute(buffer.data(), w);
  for (int64_t m = 0; m < M; ++m) round_bf16(buffer.data() + m * w, yb + m * N + c0, w);
}

// The rows of `packed` [a multiple of n, row bytes] rearranged n at a time in place, `grain`
// groups a work item: each group's bytes copied aside, then write(rows, dst) writes its new bytes
// over them (regroup_, regroup_q6_k_)
template <class F>
void regroup_in_place(const torch::Tensor& packed, int64_t n, int64_t grain, const F& write) {
  const int64_t rb = packed.size(1), groups = packed.size(0) / n;
  uint8_t* base = packed.data_ptr<uint8_t>();
  minerva::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows(n * rb);
    for (int64_t grp = g0; grp < g1; ++grp) {
      uint8_t* dst = base + grp * n * rb;
      std::memcpy(rows.data(), dst, n * rb);
      write(rows.data(), dst);
    }
  });
}

// The kernels: q8_repack_x8.cpp's for the 32-weight block types, q8_repack_k.cpp's for the
// K-quants on one group of 8 rows per 256-bit register (V8) or, with AVX-512 VNNI, two per
// 512-bit one (V16; q8_lanes.h)
template <int QT, int mr>
void tile_x8(const Q8& a, int64_t m0, const uint8_t* grp, int valid, float* y, int64_t ldy,
             const uint8_t* end = nullptr);
template <int QT, int NG, int MR>
void x8_rows(const Q8& a, int64_t m0, const uint8_t* grp, int64_t gb, float* y, int64_t ldy, const uint8_t* end);
#if defined(MINERVA_V16)
template <int QT, int mr, int NP = 1>
void tile_x8_pair(const Q8& a, int64_t m0, const uint8_t* grp, int64_t gb, int valid, float* y, int64_t ldy,
                  int64_t far, const uint8_t* end);
#endif
template <int NG, int MR>
void q8_0_rows(const Q8& a, int64_t m0, const uint8_t* grp, int64_t gb, float* y, int64_t ldy);
template <class V, int QT, int mr, bool X_COPY = false, bool INT = false, bool PRE = false>
void tile_xk(const Q8& a, int64_t m0, const uint8_t* grp, int64_t group_bytes, int valid, float* y, int64_t ldy,
             const uint8_t* end, const uint8_t* plain = nullptr);
// Q5_K against many rows of x with int steps: the work item's pairs of groups decoded once into
// a buffer of the thread's, each weight's 5 bits a byte (a super-block's 16 rows x 256 weights,
// PLAIN_BYTES bytes), which every tile of x then reads as it is (tile_xk's PRE) instead of
// decoding them again; the same values, so the same bits. Zen 4, 2 threads, this and the
// decoding tiles loaded side by side in one process, calls alternating
// (benchmarks/kernel_ab.py): 5632 x 2048 at 512 rows of x 1.080x (quartiles 1.045-1.097),
// 2048 x 5632 1.089x, 32 rows 1.048x, 64 rows 1.027x, 16 rows 0.951x (the decoding not paid
// back by 3 tiles). (The float steps, Intel's, keep decoding: not measured there.) Without VNNI
// (AVX2: tiles of 4 rows of x against one group) each group is decoded likewise, 32 bytes a
// chunk, from the same 32 rows: MINERVA_ISA=avx2, the same machine and way, 5632 x 2048 at 16
// rows 0.946x, 32 rows 1.013x, 64 rows 1.064x, 100 rows 1.154x, 512 rows 1.234x.
constexpr int64_t PLAIN_BYTES = 4096, Q5_PLAIN_FROM = 32;
// a 64-byte aligned run of `bytes` in `buffer`, grown as needed (the decoded weights' home)
inline uint8_t* plain_space(std::vector<uint8_t>& buffer, int64_t bytes) {
  if (static_cast<int64_t>(buffer.size()) < bytes + 64) buffer.resize(bytes + 64);
  return buffer.data() + (-reinterpret_cast<intptr_t>(buffer.data()) & 63);
}
// ... and Q6_K's panels (matmul_panels) likewise, each panel's pairs of groups decoded once
// after it is regrouped (tile_panel's PRE): the same machine and way, 5632 x 2048 at 512 rows
// 1.088x (quartiles 1.079-1.109), 2048 x 5632 1.079x, 128 rows 1.043x, 64 rows 1.005x, 32
// rows 0.950x (hence from 128: its tiles of 8 rows take the decoding's cost back more slowly)
constexpr int64_t Q6_PLAIN_FROM = 128;
// Without VNNI (one group a tile, 4 rows of x) each group is decoded once likewise, 32 bytes a
// chunk, from 16 rows (4 tiles; a lone long prompt's chunks on a slow CPU are ~100 rows): Q6_K's
// panels and Q3_K's groups, regrouped at load (x8_groups) or in panels. Zen 4 with
// MINERVA_ISA=avx2, 2 threads, against decoding in the tiles (benchmarks/kernel_ab.py): Q6_K
// 5632 x 2048 at 512 rows 1.770x (quartiles 1.754-1.853), 2048 x 5632 at 128 rows 1.637x; Q3_K
// 5632 x 2048 at 16 rows 1.104x, 100 rows 1.215x. (Q2_K's decoding, a shift and a mask, does
// not pay: 0.968x at 16 rows, 1.009x at 100.)
constexpr int64_t PANEL_PLAIN_FROM_V8 = 16;
template <class V, int QT>
void decode_once(const uint8_t* groups, int64_t gb, int64_t G, int64_t units, uint8_t* out);
// q8_repack_k.cpp: groups of tile_panel's layout against all rows of x (as matmul_panels takes
// them), and a unit of Q6_K regrouped at load (q8_q6k.cpp) as two such groups
template <int QT>
void panel_tiles(const Q8& a, int64_t M, const uint8_t* panel, int64_t gb, int64_t groups, int64_t left, float* y,
                 int64_t ldy, std::vector<uint8_t>& plain_buffer);
void q6_unit_to_panels(const uint8_t* unit, int64_t G, int64_t gb, uint8_t* out);
template <class V, int QT, int mr, bool PRE = false>
void tile_panel(const Q8& a, int64_t m0, const uint8_t* grp, int64_t group_bytes, int valid, float* y, int64_t ldy,
                const uint8_t* end = nullptr, const uint8_t* plain = nullptr);

// one work item: groups g0 .. g1 against all M rows of x; output column 8 g0 + c of row m at
// y[m * ldy + c]
template <int QT>
void x8_groups(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, int64_t ldy, int64_t g0, int64_t g1,
               const uint8_t* end) {
  const int64_t gb = 8 * row_bytes<QT>(a.K);
  if constexpr (!is_k<QT>) {
    if (M == 1 && N >= 8 * g1 && !x8_pairs<QT>()) {  // (a last group with fewer than 8 rows takes tile_x8)
      const auto rows = [&]<int NG>() {
        if constexpr (QT == Q8_0) q8_0_rows<NG, 1>(a, 0, W + g0 * gb, gb, y, ldy);
        else x8_rows<QT, NG, 1>(a, 0, W + g0 * gb, gb, y, ldy, end);
      };
      if (g1 - g0 == 4) return rows.template operator()<4>();
      if (g1 - g0 == 3) return rows.template operator()<3>();
      if (g1 - g0 == 2) return rows.template operator()<2>();
    }
    if (few_rows<QT>(M, a.K) && N >= 8 * g1 && g1 - g0 >= 2) {  // the streams of one row, FEW_MR rows at a time
      const auto rows = [&]<int NG>() {
        x_tiles<FEW_MR>(M, [&](int64_t m, auto r) {
          if constexpr (QT == Q8_0) q8_0_rows<NG, decltype(r)::value>(a, m, W + g0 * gb, gb, y + m * ldy, ldy);
          else x8_rows<QT, NG, decltype(r)::value>(a, m, W + g0 * gb, gb, y + m * ldy, ldy, end);
        });
      };
      if (g1 - g0 == 4) return rows.template operator()<4>();
      if (g1 - g0 == 3) return rows.template operator()<3>();
      return rows.template operator()<2>();
    }
  }
#if defined(MINERVA_V16)
  // groups g0 .. g1 for the tile of x's rows from m: two at a time by pair(grp, valid, out), a
  // last odd one by one(...); valid: the weight rows left (up to 16 or 8), out: group grp's
  // outputs. (The lambdas MINERVA_INLINE: as calls of their own, Zen 4, the Q2_K tiles of 12 rows
  // of x ran 0.95x of the loops written out; benchmarks/kernel_ab.py.)
  const auto by_pairs = [&](int64_t m, const auto& pair, const auto& one) MINERVA_INLINE {
    int64_t grp = g0;
    const auto valid = [&](int64_t rows) MINERVA_INLINE {
      return static_cast<int>(std::min<int64_t>(rows, N - 8 * grp));
    };
    const auto out = [&]() MINERVA_INLINE { return y + m * ldy + 8 * (grp - g0); };
    for (; grp + 2 <= g1; grp += 2) pair(grp, valid(16), out());
    if (grp < g1) one(grp, valid(8), out());
  };
  if constexpr (QT == Q4_K || QT == Q5_K) {
    const bool x_copy = choices_of<QT>().x_copy;
    const auto groups = [&]<bool INT>(int64_t m, auto rows) {
      constexpr int r = decltype(rows)::value;
      by_pairs(m, [&](int64_t grp, int valid, float* out) MINERVA_INLINE {
        if constexpr (INT) tile_xk<V16, QT, r, false, true>(a, m, W + grp * gb, gb, valid, out, ldy, end);
        else if (x_copy) tile_xk<V16, QT, r, true>(a, m, W + grp * gb, gb, valid, out, ldy, end);
        else tile_xk<V16, QT, r>(a, m, W + grp * gb, gb, valid, out, ldy, end);
      }, [&](int64_t grp, int valid, float* out) MINERVA_INLINE {
        tile_xk<V8, QT, r, false, INT>(a, m, W + grp * gb, gb, valid, out, ldy, end);
      });
    };
    if (QT == Q5_K && int_steps && M >= Q5_PLAIN_FROM) {
      thread_local std::vector<uint8_t> buffer;
      const int64_t pairs = (g1 - g0) / 2, per_pair = PLAIN_BYTES * a.G;
      uint8_t* const plain = plain_space(buffer, pairs * per_pair);
      decode_once<V16, Q5_K>(W + g0 * gb, gb, a.G, pairs, plain);  // (a branch Q4_K compiles too)
      x_tiles<V16_INT_MR>(M, [&](int64_t m, auto rows) {
        constexpr int r = decltype(rows)::value;
        by_pairs(m, [&](int64_t grp, int valid, float* out) MINERVA_INLINE {
          const uint8_t* pre = plain + (grp - g0) / 2 * per_pair;  // the pair's decoded weights
          tile_xk<V16, QT, r, false, true, true>(a, m, W + grp * gb, gb, valid, out, ldy, end, pre);
        }, [&](int64_t grp, int valid, float* out) MINERVA_INLINE {
          tile_xk<V8, QT, r, false, true>(a, m, W + grp * gb, gb, valid, out, ldy, end);
        });
      });
      return;
    }
    if (int_steps)
      x_tiles<V16_INT_MR>(M, [&](int64_t m, auto rows) { groups.template operator()<true>(m, rows); });
    else
      x_tiles<V16_MR>(M, [&](int64_t m, auto rows) { groups.template operator()<false>(m, rows); });
    return;
  }
  if constexpr (QT == Q2_K || QT == Q3_K) {  // as matmul_panels, from the matrix itself
    x_tiles<V16_MR>(M, [&](int64_t m, auto rows) {
      constexpr int r = decltype(rows)::value;
      by_pairs(m, [&](int64_t grp, int valid, float* out) MINERVA_INLINE {
        tile_panel<V16, QT, r>(a, m, W + grp * gb, gb, valid, out, ldy, end);
      }, [&](int64_t grp, int valid, float* out) MINERVA_INLINE {
        tile_panel<V8, QT, r>(a, m, W + grp * gb, gb, valid, out, ldy, end);
      });
    });
    return;
  }
  if constexpr (!is_k<QT>) {  // two groups a register (tile_x8_pair), a last odd group alone
    if (M == 1 && x8_pairs<QT>() && g1 - g0 == 4 && N >= 8 * g1) {  // a whole work item: its two pairs side by side
      const int64_t far = l2_ahead_for<QT>(a.K) > 0 ? 4 * gb : 0;
      return tile_x8_pair<QT, 1, 2>(a, 0, W + g0 * gb, gb, 16, y, ldy, far, end);
    }
    x_tiles<V16_MR>(M, [&](int64_t m, auto rows) {
      constexpr int r = decltype(rows)::value;
      // the first tile: the next work item's same place into L2 (one row of x: where the CPU takes the L2 prefetch)
      const int64_t far = m == 0 && (M > 1 || l2_ahead_for<QT>(a.K) > 0) ? (g1 - g0) * gb : 0;
      by_pairs(m, [&](int64_t grp, int valid, float* out) MINERVA_INLINE {
        tile_x8_pair<QT, r>(a, m, W + grp * gb, gb, valid, out, ldy, far, end);
      }, [&](int64_t grp, int valid, float* out) MINERVA_INLINE {
        tile_x8<QT, r>(a, m, W + grp * gb, valid, out, ldy, end);
      });
    });
    return;
  }
#endif
  if constexpr (!VNNI && (QT == Q3_K || QT == Q5_K))
    if (M >= (QT == Q5_K ? Q5_PLAIN_FROM : PANEL_PLAIN_FROM_V8)) {  // each group decoded once, then read by every tile (above)
      constexpr int64_t PLAIN8 = PLAIN_BYTES / 2;
      thread_local std::vector<uint8_t> buffer;
      uint8_t* const plain = plain_space(buffer, (g1 - g0) * PLAIN8 * a.G);
      decode_once<V8, QT>(W + g0 * gb, gb, a.G, g1 - g0, plain);
      x_tiles<x8_mr<QT>>(M, [&](int64_t m, auto rows) {
        constexpr int r = decltype(rows)::value;
        for (int64_t grp = g0; grp < g1; ++grp) {
          const int valid = static_cast<int>(std::min<int64_t>(8, N - 8 * grp));
          float* out = y + m * ldy + 8 * (grp - g0);
          const uint8_t* pre = plain + (grp - g0) * a.G * PLAIN8;  // the group's decoded weights
          if constexpr (QT == Q5_K) tile_xk<V8, QT, r, false, false, true>(a, m, W + grp * gb, gb, valid, out, ldy, end, pre);
          else tile_panel<V8, QT, r, true>(a, m, W + grp * gb, gb, valid, out, ldy, nullptr, pre);
        }
      });
      return;
    }
  x_tiles<x8_mr<QT>>(M, [&](int64_t m, auto rows) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int valid = static_cast<int>(std::min<int64_t>(8, N - 8 * grp));
      if constexpr (QT == Q4_K || QT == Q5_K) {
        float* out = y + m * ldy + 8 * (grp - g0);
        if (VNNI && int_steps) tile_xk<V8, QT, decltype(rows)::value, false, true>(a, m, W + grp * gb, gb, valid, out, ldy, end);
        else tile_xk<V8, QT, decltype(rows)::value>(a, m, W + grp * gb, gb, valid, out, ldy, end);
      }
      else if constexpr (QT == Q2_K || QT == Q3_K)
        tile_panel<V8, QT, decltype(rows)::value>(a, m, W + grp * gb, gb, valid, y + m * ldy + 8 * (grp - g0), ldy, end);
      else tile_x8<QT, decltype(rows)::value>(a, m, W + grp * gb, valid, y + m * ldy + 8 * (grp - g0), ldy, end);
    }
  });
}

template <int QT>
void matmul_x8(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, at::BFloat16* yb) {
  const int64_t groups = (N + 7) / 8, per = x8_per<QT>(M, a.K);
  minerva::parallel_for(0, (groups + per - 1) / per, M == 1 ? 2 : 1, [&](int64_t b0, int64_t b1) {
    const uint8_t* end = W + std::min(groups, per * minerva::ThreadPool::run_end(b1)) * 8 * row_bytes<QT>(a.K);  // this thread's run's weights
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t g0 = per * blk, g1 = std::min(groups, per * (blk + 1));
      columns_out(M, N, 8 * g0, std::min(N, 8 * g1), y, yb,
                  [&](float* out, int64_t ldy) { x8_groups<QT>(a, M, W, N, out, ldy, g0, g1, end); });
    }
  });
}

// x8_groups and matmul_x8 for type QT (q8_kernels.h declares them), in the file of its kernels
#define MINERVA_Q8_REGROUPED(QT)                                                                           \
  template void x8_groups<QT>(const Q8&, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t, \
                              const uint8_t*);                                                             \
  template void matmul_x8<QT>(const Q8&, int64_t, const uint8_t*, int64_t, float*, at::BFloat16*)

}  // namespace minerva::q8
