// What the int8 kernel files share (q8_matmul.cpp: the GGML layout and the entry points;
// q8_repack_x8.cpp and q8_repack_k.cpp: the regrouped layouts, minerva/kernels/repack.py): the
// block step, the tiles of x and the panels, and the regrouped kernels' entry points, defined
// and instantiated per type in the q8_repack files.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "parallel.h"
#include "q8_blocks.h"
#include "q8_cpu.h"
#include "q8_quant.h"
#include "qformat.h"
#include "simd_avx2.h"

namespace minerva::q8 {

// x is quantized (Quantized, q8_quant.cpp) in blocks of 32 for the 32-weight block types and of
// 256 for the K-quants (`is_k<QT> ? 256 : 32` where a kernel file asks): their weights' blocks
template <int... QT>
constexpr bool x_blocks_are_the_weights = ((Layout<QT>::block == (is_k<QT> ? 256 : 32)) && ...);
static_assert(x_blocks_are_the_weights<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>,
              "x's blocks are the weights' blocks");

// One row of x, the regrouped kernels: how many of a group's G blocks (super-blocks), `bytes`
// each, may prefetch the weights `far` bytes on without passing `end`, the end of the
// thread's run of the matrix (its last stream `last` bytes past the group's start; 0 when
// there is no such prefetch, or no end). Without the bound the small matrices (256 rows) lost
// 10% (Intel AVX-512 machine).
inline int64_t far_blocks(const uint8_t* grp, int64_t last, int64_t far, int64_t bytes, const uint8_t* end, int64_t G) {
  return far == 0 || end == nullptr ? 0 : std::clamp<int64_t>((end - grp - last - far) / bytes, 0, G);
}

// mr rows of 8 outputs, one per lane, to y[i * ldy + j] (the first `valid` lanes)
template <int mr>
inline void store_rows(const __m256* acc, int valid, float* y, int64_t ldy) {
  for (int i = 0; i < mr; ++i) {
    if (valid == 8) {
      _mm256_storeu_ps(y + i * ldy, acc[i]);
    } else {
      float out[8];
      _mm256_storeu_ps(out, acc[i]);
      std::copy(out, out + valid, y + i * ldy);
    }
  }
}

// The float steps of a 32-weight block for row r of x, 8 weight rows in the lanes: `dot` the
// exact integer dot products of the stored values, dw the weights' scales, m their offsets
// (Q4_1/Q5_1): acc = fma(dot - 2^BIAS * sum(q), d_w * d_x, acc), then acc = fma(m, d_x * sum(q), acc)
template <typename B>
inline __m256 block_step(const Q8& a, int64_t r, int64_t g, __m256i dot, __m256 dw, __m256 m, __m256 acc) {
  if constexpr (B::BIAS > 0) dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(bcast_i32(a.n + r * a.G + g), B::BIAS));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[r * a.G + g])), acc);
  if constexpr (B::OFFSET) acc = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[r * a.G + g]), acc);
  return acc;
}

// the types with a regrouped layout in this build (minerva/kernels/repack.py's TYPES; Q6_K's,
// units of 16 rows, where the build has V16: q8_q6k.cpp)
#if defined(MINERVA_V16)
constexpr bool Q6_REGROUPED = true;
#else
constexpr bool Q6_REGROUPED = false;
#endif
template <int QT>
constexpr bool has_x8 = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == MXFP4 || QT == Q8_0 ||
                        QT == Q2_K || QT == Q3_K || QT == Q4_K || QT == Q5_K || (QT == Q6_K && Q6_REGROUPED);
// the rows a regrouped matrix of `rows` rows holds: padded with zero rows to a whole group of 8,
// or for Q6_K to a unit of 16
template <int QT>
constexpr int64_t padded_rows(int64_t rows) {
  return QT == Q6_K ? (rows + 15) / 16 * 16 : (rows + 7) / 8 * 8;
}

// Rows of x are taken MR at a time (the last tile shorter): tile_rows(m, rows) runs a tile
// of `rows` rows of x from row m.
template <int MR, typename F>
inline void x_tiles(int64_t M, const F& tile_rows) {
  static_assert(MR >= 1 && MR <= 8, "the rows left after the whole tiles go as one tile of 4 and one of 3, 2 or 1");
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile_rows(m, std::integral_constant<int, MR>{});
  if constexpr (MR > 4)
    if (M - m >= 4) {
      tile_rows(m, std::integral_constant<int, 4>{});
      m += 4;
    }
  if constexpr (MR > 3) if (M - m == 3) tile_rows(m, std::integral_constant<int, 3>{});
  if constexpr (MR > 2) if (M - m == 2) tile_rows(m, std::integral_constant<int, 2>{});
  if constexpr (MR > 1) if (M - m == 1) tile_rows(m, std::integral_constant<int, 1>{});
}

// For M > 1 the weight rows go in panels of 32 (a few tens of KB, kept in L1/L2) and each
// tile of x (4 rows, one K-long row each) meets the whole panel while it sits in L1: x is
// read from L2/L3 once per panel rather than once per weight row.
constexpr int64_t PANEL = 32;
static_assert(PANEL % 16 == 0, "a panel is whole groups of 8 weight rows (x8_per, matmul_panels), and units of 16 (Q6_K)");

// (q8_repack_k.cpp, for Q3_K and Q6_K)
template <int QT>
void matmul_panels(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, at::BFloat16* yb = nullptr);

// x8_rows (q8_repack_x8.cpp) takes the 32-weight block types' groups with one row of x where
// a group is X8_STREAM_BYTES or longer.
// Shorter groups are too short a stream each for the hardware prefetchers: Gemma 3 270M's Q5_0
// matrices (640 columns, 3.5 KB a group) in four streams decoded 0.954x as fast as one
// group at a time with tile_x8's prefetches (the two alternating in one process, medians of
// 10); the 1.1B shape's Q4_0 groups (9.2 KB and 25 KB) gained as x8_rows' comment gives.
constexpr int64_t X8_STREAM_BYTES = 8192;

// The regrouped types: groups of 8 weight rows (the padded rows' outputs dropped); for M > 1
// PANEL rows (4 groups) at a time against tiles of x8_mr rows of x, as `matmul`.
// Groups of 8 weight rows per work item, rows K long; with one row of x four for Q8_0
// (q8_0_rows) and for the other 32-weight block types where a group is X8_STREAM_BYTES or
// longer (x8_rows), else one, or two where V16 takes the K-quants two groups at a time
// (choices.groups, q8_cpu.h).
// A few rows of x (2 .. choices.few_rows; a speculative verification, a handful of sequences)
// take the one-row streams of the 32-weight block types (x8_rows, q8_0_rows) FEW_MR rows at a
// time, where a group is a stream long enough (X8_STREAM_BYTES; Q8_0 whatever its length) and a
// work item is more than one group:
// the weights read and decoded once for the tile's rows. (AVX-512's 32 registers hold 4 groups'
// accumulators for 4 rows; AVX2's 16, for 2.)
#if defined(__AVX512F__)
constexpr int FEW_MR = 4;
#else
constexpr int FEW_MR = 2;
#endif
// Whether a 32-weight block type takes one row of x two groups a 512-bit register (X8_PAIRS)
template <int QT>
bool x8_pairs() {
#if defined(MINERVA_V16)
  if constexpr (!is_k<QT>) return choices_of<QT>().groups == X8_PAIRS;
#endif
  return false;
}
// Q8_0 takes its streams (q8_0_rows) whatever a group's length, with one row of x as with a few.
template <int QT>
bool few_rows(int64_t M, int64_t K) {
  if constexpr (is_k<QT>) return false;
  return M > 1 && M <= choices_of<QT>().few_rows && choices_of<QT>().groups >= 2 && !x8_pairs<QT>() &&
         (QT == Q8_0 || 8 * row_bytes<QT>(K) >= X8_STREAM_BYTES);
}

template <int QT>
int64_t x8_per(int64_t M, int64_t K) {
  if (few_rows<QT>(M, K)) return choices_of<QT>().groups;
  if (M > 1 || x8_pairs<QT>()) return PANEL / 8;
  if constexpr (QT == Q8_0) return choices_of<QT>().groups;
  if constexpr (QT == Q6_K) return 2;  // a unit of 16 rows (q8_q6k.cpp)
  if constexpr (!is_k<QT>) return 8 * row_bytes<QT>(K) >= X8_STREAM_BYTES ? choices_of<QT>().groups : 1;
#if defined(MINERVA_V16)
  if constexpr (is_k<QT>) return choices_of<QT>().groups >= 2 ? 2 : 1;
#endif
  return 1;
}

// one work item of a regrouped matrix, and a regrouped matrix (q8_repack.h; instantiated for
// each type in the q8_repack file of its kernels)
template <int QT>
void x8_groups(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, int64_t ldy, int64_t g0, int64_t g1,
               const uint8_t* end);
template <int QT>
void matmul_x8(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, at::BFloat16* yb = nullptr);
// Q6_K's units of 16 rows: groups g0 .. g1 with g0 even (q8_q6k.cpp)
template <>
void x8_groups<Q6_K>(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, int64_t ldy, int64_t g0, int64_t g1,
                     const uint8_t* end);

}  // namespace minerva::q8
