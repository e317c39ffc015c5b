// Packed GGML matmul on 8-bit activations (`--activations int8`), in both builds.
//
// y[M, N] = x̃[M, K] @ W^T where x̃ is x quantized per row in blocks, as llama.cpp quantizes
// activations: d = max|x| / 127, q = round(x / d) (to nearest even), x̃ = d * q. Blocks of 32
// (its Q8_0) meet the 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); blocks of 256 (its
// Q8_K) meet the K-quants' super-blocks (Q2_K .. Q6_K), so a super-block's 8 sub-block dot
// products add up in i32 and need one float multiply-add. The weights stay in their GGUF
// blocks and meet the activations in integer dot products, 32 weights at a time: `maddubs`
// (u8 x i8 pairs to i16), `madd` (to i32, times the weight's integer sub-block scales where
// it has them). A weight's offset (Q4_1/Q5_1 min, Q2_K/Q4_K/Q5_K dmin * min) meets x's block
// sums.
//
// Weights stored with a bias (Q4_0: q - 8, Q5_0: q - 16, Q3_K: q - 4, Q6_K: q - 32) enter
// unsigned, as does MXFP4 (its table values, -12..12, plus 16), and the bias times x's sums
// leaves the i32 dot product (Q4_0/Q5_0/MXFP4: bias * sum(q)
// of the block; Q3_K/Q6_K: bias * sum(scale * x's sum of 16)). Q8_0's signed values use |w| as the unsigned
// operand and q with w's sign as the signed one. No step saturates: a pair sums to at most
// 2 * 127 * max(63, 128) = 32512, and a super-block's i32 sum to 256 * 128 * 63 * 127 < 2^31.
//
// Exactness: each output element is one fixed sequence of operations over K, and a row is
// quantized on its own. Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 take 8 weight rows at a time, one per
// float lane: per block the exact integer dot product, then acc = fma(dot, d_w * d_x, acc)
// and, for Q4_1/Q5_1, acc = fma(m, d_x * sum(q), acc). The others keep 8 lanes per output,
// reduced in a fixed order at the end: Q8_0 per block acc = fma(d_w * d_x, dot, acc) (its
// weights need no decoding, and gathering rows costs more than it saves); per K-quant
// super-block, for Q2_K/Q4_K/Q5_K acc = fma(mins . x's sums, -dmin * d_x, acc), then an exact
// i32 sum and acc = fma(sum, d_w * d_x, acc); Q3_K and Q6_K add a super-block's lanes up
// into one exact i32 and take one scalar acc = fma(sum, d_w * d_x, acc). A row's result
// therefore never depends on the batch, the tiling or the threads.
// The plain-torch counterpart is minerva/kernels/act_quant.py.
//
// Written with AVX2 intrinsics, which both builds' CPUs have, and AVX-512 VNNI's dot products
// (dot4, dot2) where the CPU has them: the same exact integer sums either way.
//
// The code is split as ggml-cpu splits its own (quants.h + arch/x86/quants.c, repack.cpp, the
// type traits), into files of at most 800 lines (tests/test_layout.py):
// - q8_blocks.h: the SIMD helpers, dot4 / dot2, and each type's GGML block decoded (W8<QT>);
// - q8_quant.h, q8_quant.cpp: x quantized (Q8, Quantized), x's checks, the outputs to bf16;
// - q8_cpu.h, q8_cpu.cpp: the choices per CPU (one object that every kernel file reads, set by
//   `cpu_choices`: the planner, minerva/kernels/tune.py) and the int8 compute peak probe;
// - q8_kernels.h: what the kernel files share (the block step, tiles of x, panels) and the
//   regrouped kernels' entry points;
// - this file: the kernels on the GGML layout (tile, row1, tile8, matmul) and the entry points;
// - q8_repack.h, q8_repack_x8.cpp, q8_repack_k.cpp: the kernels on the regrouped layouts
//   (minerva/kernels/repack.py) of the 32-weight block types and of the K-quants, and the
//   K-quant panels regrouped at run time;
// - q8_q6k.cpp: Q6_K's units of 16 rows (where the build has AVX-512 VNNI), its one-row kernel
//   and their dispatch.

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "q8_kernels.h"
#include "qformat.h"
#include "simd_avx2.h"

namespace minerva::q8 {

// one = fma(float(sum of v[k]'s lanes), scale[k], one) for k = 0 .. n - 1 in turn (n <= 8),
// the 8 lane sums taken at once by a tree of horizontal adds (exact in i32)
inline float pending_sums(__m256i* v, const float* scale, int n, float one) {
  for (int k = n; k < 8; ++k) v[k] = _mm256_setzero_si256();
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // h0's 128-bit halves: lanes 0..3 and 4..7 of v[0..3], partly summed; h1 likewise for v[4..7]
  const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
  alignas(32) float f[8];
  _mm256_store_ps(f, _mm256_cvtepi32_ps(sums));
  for (int k = 0; k < n; ++k) one = std::fma(f[k], scale[k], one);
  return one;
}

template <int QT, size_t... J>
std::array<W8<QT>, sizeof...(J)> make_blocks(const uint8_t* row, int64_t rb, int64_t g, std::index_sequence<J...>) {
  return {W8<QT>(row + J * rb, g)...};
}

constexpr int PF_BLOCKS = 2;  // how many row blocks ahead the weights are prefetched

// The K-quants and Q8_0: mr rows of x (from row m0 of a) against nb weight rows, 8 float
// lanes per output reduced in a fixed order at the end; y[i * ldy + j]. Q3_K and Q6_K instead
// sum a super-block's lanes in i32 and take one scalar FMA per super-block, as `row1` and
// tile_panel do.
template <int QT, int mr, int nb>
void tile(const Q8& a, int64_t m0, const uint8_t* row, int64_t rb, float* y, int64_t ldy) {
  using B = W8<QT>;
  constexpr bool ONE_SUM = QT == Q3_K || QT == Q6_K;
  __m256 acc[mr][nb];
  float one[mr][nb];  // ONE_SUM
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nb; ++j) {
      acc[i][j] = _mm256_setzero_ps();
      one[i][j] = 0.0f;
    }
  const int64_t ahead = PF_BLOCKS * nb * rb, step = (nb * rb + a.G - 1) / a.G;
  for (int64_t g = 0; g < a.G; ++g) {
    for (int64_t o = g * step; o < (g + 1) * step; o += 64) prefetch(row + ahead + o);
    const auto blocks = make_blocks<QT>(row, rb, g, std::make_index_sequence<nb>{});
    if constexpr (QT == Q8_0) {  // acc += (d_w * d_x) * dot, lane by lane (its weights need no decoding)
      __m256i w[nb], wa[nb];
      __m256 dw[nb];
      for (int j = 0; j < nb; ++j) {
        w[j] = blocks[j].w();
        wa[j] = _mm256_abs_epi8(w[j]);
        dw[j] = _mm256_set1_ps(f16(blocks[j].b));
      }
      for (int i = 0; i < mr; ++i) {
        const int64_t r = m0 + i;
        const __m256i xv = load256(a.q + r * a.K + 32 * g);
        const __m256 dx = _mm256_set1_ps(a.d[r * a.G + g]);
        for (int j = 0; j < nb; ++j) {
          const __m256i p = dot4(_mm256_setzero_si256(), wa[j], _mm256_sign_epi8(xv, w[j]));
          acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(dw[j], dx), _mm256_cvtepi32_ps(p), acc[i][j]);
        }
      }
    } else {  // an exact i32 sum per super-block, then one float FMA
      __m256 dx[mr];  // x's scales, and below the weights': products of broadcasts, lane by lane
      for (int i = 0; i < mr; ++i) dx[i] = _mm256_set1_ps(a.d[(m0 + i) * a.G + g]);
      if constexpr (B::MINS) {  // the offsets first, so the mins need no register during the sums
        __m256 dmin[nb];
        for (int j = 0; j < nb; ++j) dmin[j] = _mm256_set1_ps(-blocks[j].dmin());
        for (int i = 0; i < mr; ++i) {
          const __m256i sums = load256(a.p + (m0 + i) * a.lp + 16 * g);  // x's 16 sums of 16
          for (int j = 0; j < nb; ++j)
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2(_mm256_setzero_si256(), blocks[j].mins(), sums)),
                                        _mm256_mul_ps(dmin[j], dx[i]), acc[i][j]);
        }
      }
      __m256i isum[mr][nb];
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nb; ++j) isum[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        __m256i w[nb], sc[nb];
        for (int j = 0; j < nb; ++j) {
          w[j] = blocks[j].w(s);
          sc[j] = blocks[j].sc(s);
        }
        for (int i = 0; i < mr; ++i) {
          const __m256i xv = load256(a.q + (m0 + i) * a.K + 256 * g + 32 * s);
          for (int j = 0; j < nb; ++j) {
            isum[i][j] = dot2(isum[i][j], _mm256_maddubs_epi16(w[j], xv), sc[j]);
            keep_in_register(isum[i][j]);
          }
        }
      }
      __m256 dw[nb];
      for (int j = 0; j < nb; ++j) dw[j] = _mm256_set1_ps(blocks[j].d());
      for (int i = 0; i < mr; ++i) {
        const int64_t r = m0 + i;
        for (int j = 0; j < nb; ++j) {
          if constexpr (B::BIAS > 0) {  // the stored values are w + 2^BIAS; x's 16 sums of 16
            const __m256i sums = load256(a.p + r * a.lp + 16 * g);
            isum[i][j] =
                _mm256_sub_epi32(isum[i][j], _mm256_slli_epi32(_mm256_madd_epi16(blocks[j].sc16, sums), B::BIAS));
          }
          if constexpr (ONE_SUM)
            one[i][j] = std::fma(static_cast<float>(sum_lanes(isum[i][j])), blocks[j].d() * a.d[r * a.G + g], one[i][j]);
          else
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][j]), _mm256_mul_ps(dw[j], dx[i]), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nb; ++j) y[i * ldy + j] = ONE_SUM ? one[i][j] : reduce_add(acc[i][j]);  // a fixed lane order
}

// The K-quants with one row of x (decode): nb weight rows, a super-block's rows one at a
// time so that only one block's state is live (with all nb at once the registers spill).
// Per output the same operations as `tile`, in the same order. The weights are prefetched
// one tile (nb rows) ahead: on the AVX-512 machine, all Q6_K matrices of the 1.1B Q4_K_M
// shape one after another, one row of x each, took 5.26-5.30 ms with 2 rows a tile (or 1)
// and one tile ahead, against 5.83 with 4 rows a tile and 5.9-6.0 with 4 rows two tiles ahead
// (the layout before; 6.9 with 8 rows), medians of 30 sweeps in one process, interleaved.
//
// Q3_K and Q6_K instead sum a super-block's 8 lanes in i32 (exact) and take one scalar
// acc = fma(sum, d * d_x, acc) per super-block: the operations of tile_panel, which serves
// more rows of x.
constexpr int64_t ROW1_NB = 2;
// A tile further ahead than this is prefetched to L2, not L1: with long rows (Mistral-7B's
// down projection, 14336 columns: 23 KB a tile of Q6_K) the prefetched tile and x's 14 KB
// overflow the 32 KB L1. 4096 x 14336 Q6_K from memory, 12 copies in turn, 2 threads,
// alternating runs: 28.2-30.6 GB/s against 19.9-24.4 with every prefetch to L1; 2048 x 5632
// (9 KB a tile, to L1 as before) the same; to L2 there as well, 2048-column rows ran slower.
constexpr int64_t ROW1_L1_AHEAD = 12288;

// Q3_K and Q6_K (one exact i32 per super-block, so only the sum of the lanes counts) with VNNI
// and AVX-512BW: two sub-blocks' dot products as exact sums of 4 (dpbusd; at most 4 * 63 * 127
// in magnitude, so they fit i16), packed side by side into i16 and multiplied by their four
// scales in one dpwssd, the scales picked by one vpermw. Per 32 weights that is one multiply
// and half a pack, half a dpwssd and half a permute, where maddubs, a scale shuffle and dpwssd
// took three; the integer is the same. (Q3_K, one row, 256 x 2048 from L2, one thread, a
// standalone copy of the loop: 1.16x.)
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
constexpr bool SUB_BLOCK_PAIRS = true;
template <class B>
inline __m256i sub_block_pairs(const B& blk, const int8_t* xg) {
  __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    const int s = 2 * p;
    const __m256i ta = dot4(_mm256_setzero_si256(), blk.w(s), load256(xg + 32 * s));
    const __m256i tb = dot4(_mm256_setzero_si256(), blk.w(s + 1), load256(xg + 32 * s + 32));
    // i16 lanes after the pack: ta 0..3, tb 0..3 | ta 4..7, tb 4..7; a sub-block's lanes 0..3
    // hold its first 16 weights (scale 2s), 4..7 its last 16 (scale 2s + 1)
    const short a = static_cast<short>(2 * s), a1 = static_cast<short>(a + 1), b = static_cast<short>(a + 2),
                b1 = static_cast<short>(a + 3);
    const __m256i scales = _mm256_permutexvar_epi16(_mm256_setr_epi16(a, a, a, a, b, b, b, b, a1, a1, a1, a1, b1, b1, b1, b1),
                                                    blk.sc16);
    isum = dot2(isum, _mm256_packs_epi32(ta, tb), scales);
  }
  return isum;
}
#else
constexpr bool SUB_BLOCK_PAIRS = false;
template <class B>
inline __m256i sub_block_pairs(const B&, const int8_t*) { return _mm256_setzero_si256(); }
#endif

template <int QT, int nb>
void row1(const Q8& a, const uint8_t* row, int64_t rb, float* y, const uint8_t* end) {
  using B = W8<QT>;
  constexpr bool ONE_SUM = QT == Q3_K || QT == Q6_K;
  __m256 acc[nb];
  float one[nb];  // ONE_SUM
  for (int j = 0; j < nb; ++j) {
    acc[j] = _mm256_setzero_ps();
    one[j] = 0.0f;
  }
  // ONE_SUM: up to 8 super-blocks' i32 lanes and scales kept, then their lane sums taken
  // together and added to `one` in order (pending_sums): the same sums and FMAs as one
  // super-block at a time, without a horizontal sum and an FMA chain closing every super-block
  // (samples piled up there). Zen 4, 2 threads, benchmarks/matmul_sweep.py: the 1.1B Q3_K_M
  // file's Q3_K gate/up 25.9-26.4 -> 29.1-29.2 GB/s (its sweep 0.80 -> 0.86 of the large
  // matrix's bandwidth), the Q6_K file's sweep 0.90 -> 0.92; from L3, one thread, Q3_K 36.5 ->
  // 38.4 GMAC/s, Q6_K 38.1 -> 38.7.
  [[maybe_unused]] __m256i pend[ONE_SUM ? nb : 1][8];
  [[maybe_unused]] float pscale[ONE_SUM ? nb : 1][8];
  const int64_t ahead = nb * rb, step = (nb * rb + a.G - 1) / a.G;
  // the tile l2_ahead or more bytes ahead (at least 2 tiles), while still in the chunk
  const int64_t l2_ahead = l2_ahead_for<QT>(a.K);
  const int64_t far = std::max<int64_t>(2, (l2_ahead + ahead - 1) / ahead) * ahead;
  const bool to_l2 = l2_ahead > 0 && row + far + ahead <= end;
  for (int64_t g = 0; g < a.G; ++g) {
    if (to_l2)
      for (int64_t o = g * step; o < (g + 1) * step; o += 64) prefetch_l2(row + far + o);
    if (ahead > ROW1_L1_AHEAD)
      for (int64_t o = g * step; o < (g + 1) * step; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + ahead + o), _MM_HINT_T1);
    else
      for (int64_t o = g * step; o < (g + 1) * step; o += 64) prefetch(row + ahead + o);
    const int8_t* xg = a.q + 256 * g;
    const float dx = a.d[g];
    const __m256i sums = load256(a.p + 16 * g);  // x's 16 sums of 16 (mins, bias)
    [[maybe_unused]] __m256i sc2;  // Q3_K, two rows: both rows' scales decoded together
    if constexpr (QT == Q3_K && nb == 2) sc2 = q3k_scales2(row + g * 110, row + rb + g * 110);
    for (int j = 0; j < nb; ++j) {
      const B blk = [&] {
        if constexpr (QT == Q3_K && nb == 2) return B(row + j * rb, g, j ? _mm256_extracti128_si256(sc2, 1) : _mm256_castsi256_si128(sc2));
        else return B(row + j * rb, g);
      }();
      if constexpr (B::MINS)
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(blk.mins(), sums)),
                                 _mm256_set1_ps(-blk.dmin() * dx), acc[j]);
      __m256i isum = _mm256_setzero_si256();
      if constexpr (ONE_SUM && SUB_BLOCK_PAIRS) {
        isum = sub_block_pairs(blk, xg);
      } else {
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s)
          isum = dot2(isum, _mm256_maddubs_epi16(blk.w(s), load256(xg + 32 * s)), blk.sc(s));
      }
      if constexpr (B::BIAS > 0) isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(blk.sc16, sums), B::BIAS));
      if constexpr (ONE_SUM) {
        pend[j][g & 7] = isum;
        pscale[j][g & 7] = blk.d() * dx;
      } else {
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(blk.d() * dx), acc[j]);
      }
    }
    if constexpr (ONE_SUM)
      if ((g & 7) == 7 || g + 1 == a.G)
        for (int j = 0; j < nb; ++j) one[j] = pending_sums(pend[j], pscale[j], (g & 7) + 1, one[j]);
  }
  for (int j = 0; j < nb; ++j) y[j] = ONE_SUM ? one[j] : reduce_add(acc[j]);  // a fixed lane order, as `tile`
}

// the f16 at byte `off` of 8 blocks, as 8 floats
template <int QT>
inline __m256 f16x8(const std::array<W8<QT>, 8>& blocks, int off) {
  uint16_t h[8];
  for (int j = 0; j < 8; ++j) std::memcpy(h + j, blocks[j].b + off, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

// the scales of 8 blocks, as 8 floats: the f16 at byte 0, or MXFP4's E8M0 byte
template <int QT>
inline __m256 scales8(const std::array<W8<QT>, 8>& blocks) {
  if constexpr (QT == MXFP4) {
    float d[8];
    for (int j = 0; j < 8; ++j) d[j] = e8m0_half(blocks[j].b[0]);
    return _mm256_loadu_ps(d);
  } else {
    return f16x8<QT>(blocks, 0);
  }
}

// lane j: the sum of the 32 products of row j's pair sums p[j] (16 i16 from maddubs, each at
// most 2 * 31 * 127 = 7874; exact integers, so the order is free): two rows' pairs are added
// once more in i16, then widened
inline __m256i sum_rows(const __m256i* p) {
  __m256i q[4];  // lanes of madd(hadd(p2k, p2k+1)): rows 2k, 2k, 2k+1, 2k+1 in each half
  for (int k = 0; k < 4; ++k) q[k] = _mm256_madd_epi16(_mm256_hadd_epi16(p[2 * k], p[2 * k + 1]), ones16());
  // each half of hadd(q0, q1): rows 0, 1, 2, 3 (that half's part)
  const __m256i a = _mm256_hadd_epi32(q[0], q[1]), b = _mm256_hadd_epi32(q[2], q[3]);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Q4_0, Q4_1, Q5_0, Q5_1, MXFP4: mr rows of x against 8 weight rows (the first `valid` of them
// real; the others repeat the last and are dropped), one weight row per float lane. Per
// block the 8 rows' exact integer dot products gather into one vector, and row j's output
// is acc_j = fma(dot_jg, d_wjg * d_xg, acc_j) (then acc_j = fma(m_jg, d_xg * sum(q_g), acc_j)
// for Q4_1/Q5_1) over the blocks g: the same operations whatever the tile.
template <int QT, int mr>
void tile8(const Q8& a, int64_t m0, const uint8_t* row, int64_t rb, int valid, float* y, int64_t ldy) {
  using B = W8<QT>;
  std::array<const uint8_t*, 8> rows;
  for (int j = 0; j < 8; ++j) rows[j] = row + std::min(j, valid - 1) * rb;
  __m256 acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t ahead = PF_BLOCKS * 8 * rb, step = (8 * rb + a.G - 1) / a.G;
  for (int64_t g = 0; g < a.G; ++g) {
    if (valid == 8)
      for (int64_t o = g * step; o < (g + 1) * step; o += 64) prefetch(row + ahead + o);
    const std::array<B, 8> blocks = {B(rows[0], g), B(rows[1], g), B(rows[2], g), B(rows[3], g),
                                     B(rows[4], g), B(rows[5], g), B(rows[6], g), B(rows[7], g)};
    __m256i w[8];
    for (int j = 0; j < 8; ++j) w[j] = blocks[j].w();
    const __m256 dw = scales8<QT>(blocks);
    __m256 m = _mm256_setzero_ps();  // the offsets, for Q4_1/Q5_1
    if constexpr (B::OFFSET) m = f16x8<QT>(blocks, 2);
    for (int i = 0; i < mr; ++i) {
      const int64_t r = m0 + i;
      const __m256i xv = load256(a.q + r * a.K + 32 * g);
      __m256i p[8];
      for (int j = 0; j < 8; ++j) p[j] = _mm256_maddubs_epi16(w[j], xv);
      acc[i] = block_step<B>(a, r, g, sum_rows(p), dw, m, acc[i]);
    }
  }
  store_rows<mr>(acc, valid, y, ldy);
}

// M > 1, K-quants and Q8_0: tiles of 4 rows of x against 2 weight rows (measured on AVX2,
// one thread, M = 128: 1.1-1.8x the speed of 2x2, 2x1 or 1x1 tiles)
constexpr int K_MR = 4, K_NB = 2;

// Q3_K and Q6_K take regrouped panels from this many rows of x, `tile` below it. AVX-512 machine, Q6_K,
// 5632 x 2048, 2 threads, two runs: 2 rows 0.22-0.45 ms with `tile` against 0.39 with panels,
// 4 rows 0.36 against 0.48, 8 rows 0.73 against 0.67-0.69, 16 rows 1.42 against 1.09-1.43,
// 32 rows 2.8 against 1.9.
constexpr int64_t PANELS_FROM = 8;

template <int QT>
void matmul(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y) {
  const int64_t rb = row_bytes<QT>(a.K);
  if constexpr (QT == Q3_K || QT == Q6_K)
    if (M >= PANELS_FROM) return matmul_panels<QT>(a, M, W, N, y);
  if constexpr (!is_k<QT> && QT != Q8_0) {  // 8 weight rows against tiles of 4 rows of x
    const int64_t per = M == 1 ? 8 : PANEL;
    minerva::parallel_for(0, (N + per - 1) / per, M == 1 ? 2 : 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = per * blk, n1 = std::min(N, n0 + per);
        x_tiles<4>(M, [&](int64_t m, auto rows) {
          for (int64_t n = n0; n < n1; n += 8) {
            const int valid = static_cast<int>(std::min<int64_t>(8, N - n));
            tile8<QT, decltype(rows)::value>(a, m, W + n * rb, rb, valid, y + m * N + n, N);
          }
        });
      }
    });
  } else if (M == 1) {  // Q8_0: four independent weight rows keep the pipes busy
    constexpr int64_t nb = QT == Q8_0 ? 4 : ROW1_NB;
    minerva::parallel_for(0, (N + nb - 1) / nb, 16 / nb, [&](int64_t b0, int64_t b1) {
      const uint8_t* end = W + std::min(N, nb * minerva::ThreadPool::run_end(b1)) * rb;  // this thread's run's weights
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n = nb * blk;
        if constexpr (QT == Q8_0) {
          if (n + 4 <= N) tile<QT, 1, 4>(a, 0, W + n * rb, rb, y + n, N);
          else
            for (int64_t j = n; j < N; ++j) tile<QT, 1, 1>(a, 0, W + j * rb, rb, y + j, N);
        } else {
          if (n + nb <= N) row1<QT, nb>(a, W + n * rb, rb, y + n, end);
          else
            for (int64_t j = n; j < N; ++j) row1<QT, 1>(a, W + j * rb, rb, y + j, end);
        }
      }
    });
  } else {  // more rows: tiles of K_MR rows of x against K_NB weight rows, panel by panel
    minerva::parallel_for(0, (N + PANEL - 1) / PANEL, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = PANEL * blk, n1 = std::min(N, n0 + PANEL);
        x_tiles<K_MR>(M, [&](int64_t m, auto rows) {
          int64_t n = n0;
          for (; n + K_NB <= n1; n += K_NB) tile<QT, decltype(rows)::value, K_NB>(a, m, W + n * rb, rb, y + m * N + n, N);
          for (; n < n1; ++n) tile<QT, decltype(rows)::value, 1>(a, m, W + n * rb, rb, y + m * N + n, N);
        });
      }
    });
  }
}

}  // namespace minerva::q8

using namespace minerva;
using namespace minerva::q8;

torch::Tensor grouped_qmatmul_q8(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                                 const std::vector<int64_t>& starts, const std::vector<torch::Tensor>& bias,
                                 int64_t qtype, int64_t rows, int64_t cols) {
  const int64_t E = static_cast<int64_t>(w.size());
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == cols, "x must be float32 [R, ", cols, "]");
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == E + 1 && static_cast<int64_t>(bias.size()) == E &&
                  starts[0] == 0 && starts[E] == x.size(0),
              "grouped_qmatmul_q8: starts must run from 0 to x's rows, one bias per matrix");
  TORCH_CHECK(qtype & REGROUPED, "grouped_qmatmul_q8 takes regrouped matrices");
  return with_format(qtype & ~REGROUPED, [&]<int QT>() -> torch::Tensor {
    if constexpr (has_x8<QT>) {
      const Quantized a(x.contiguous(), is_k<QT> ? 256 : 32);
      const Q8 all = a.view();
      auto y = torch::empty({x.size(0), rows}, torch::dtype(torch::kFloat32));
      float* yp = y.data_ptr<float>();
      const int64_t groups = (rows + 7) / 8;
      // (matrix, block of groups), matrix by matrix: the threads take neighbouring blocks of one
      // matrix, so memory is read as a few long streams. (On the AVX2 machine, round robin over
      // the matrices measured better, 720 ms against 782 for 16 tokens' experts in 24 layers of
      // the GPT-OSS-20B shape; on the AVX-512 machine, with the prefetch distance raised,
      // matrix by matrix gave 31.9 against 29.7 tokens/s at 16 sequences and 11.0 against 9.9
      // at one, `minerva bench sweep` once each.)
      std::vector<std::pair<int64_t, int64_t>> items;
      int64_t most = 0;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t M = starts[e + 1] - starts[e], per = x8_per<QT>(M, cols);
        TORCH_CHECK(M >= 0, "grouped_qmatmul_q8: starts must not decrease");
        if (M > 0) {
          check_args<QT>(w[e], padded_rows<QT>(rows), cols);
          TORCH_CHECK(!bias[e].defined() || bias[e].numel() == 0 ||
                          (bias[e].dtype() == torch::kFloat32 && bias[e].is_contiguous() && bias[e].numel() == rows),
                      "grouped_qmatmul_q8: a bias must be float32 [", rows, "]");
          most = std::max(most, (groups + per - 1) / per);
        }
      }
      for (int64_t e = 0; e < E; ++e)
        for (int64_t blk = 0; blk < most; ++blk) {
          const int64_t M = starts[e + 1] - starts[e];
          if (M > 0 && blk * x8_per<QT>(M, cols) < groups) items.emplace_back(e, blk);
        }
      std::vector<const uint8_t*> wp(E, nullptr);
      std::vector<const float*> bp(E, nullptr);
      for (int64_t e = 0; e < E; ++e) {
        if (starts[e + 1] == starts[e]) continue;
        wp[e] = w[e].data_ptr<uint8_t>();
        if (bias[e].defined() && bias[e].numel() > 0) bp[e] = bias[e].data_ptr<float>();
      }
      minerva::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
        int64_t last = -1;  // the last item of the current expert's run in this chunk
        for (int64_t i = i0; i < i1; ++i) {
          const auto [e, blk] = items[i];
          const int64_t r0 = starts[e], M = starts[e + 1] - r0, per = x8_per<QT>(M, cols);
          const int64_t g0 = per * blk, g1 = std::min(groups, g0 + per);
          const Q8 part{all.q + r0 * all.K, all.p + r0 * all.lp, all.d + r0 * all.G, all.s + r0 * all.G,
                        all.n + r0 * all.G, all.K, all.G, all.lp};
          float* out = yp + r0 * rows;
          if (i > last)
            for (last = i; last + 1 < i1 && items[last + 1].first == e;) ++last;
          const uint8_t* end = wp[e] + std::min(groups, per * (items[last].second + 1)) * 8 * row_bytes<QT>(cols);
          x8_groups<QT>(part, M, wp[e], rows, out + 8 * g0, rows, g0, g1, end);
          if (bp[e] != nullptr)  // as Linear's y.add_(bias): one float add per output
            for (int64_t r = 0; r < M; ++r)
              for (int64_t c = 8 * g0; c < std::min(rows, 8 * g1); ++c) out[r * rows + c] += bp[e][c];
        }
      });
      return y;
    } else {
      TORCH_CHECK(false, "no regrouped layout for GGML type ", qtype & ~REGROUPED);
      return torch::Tensor();
    }
  });
}

namespace {

// One row of x against several matrices (a layer's Q/K/V or gate/up of different types),
// their outputs side by side: one parallel loop over every matrix's work items instead of
// one loop, one join of the threads and one concatenation per matrix. Each work item takes
// the same kernel as qmatmul_q8 on its matrix alone (a regrouped matrix's block of groups, a
// K-quant in the GGUF layout ROW1_NB rows at a time), so each output has the same bits. A
// K-quant's work items in the GGUF layout are `unit` rows, as many as a regrouped Q4_K's,
// so that chunks of items weigh about the same. (1.1B Q4_K_M shape, Q4_K Q/K and Q6_K V:
// greedy decode 1.017x and 1.021x in one process, this loop and one loop a matrix alternating;
// Gemma 3 270M, Q5_0 Q/K and Q8_0 V: 1.025x.)
template <int QT>
void part_items(const Q8& a, const RowMatrix& p, int64_t unit, int64_t i0, int64_t i1, int64_t run, float* y) {
  if constexpr (has_x8<QT>) {
    if (p.qtype & REGROUPED) {
      const int64_t groups = (p.rows + 7) / 8, per = x8_per<QT>(1, a.K), gb = 8 * row_bytes<QT>(a.K);
      const uint8_t* end = p.w + std::min(groups, per * run) * gb;  // this thread's run's weights
      for (int64_t blk = i0; blk < i1; ++blk) {
        const int64_t g0 = per * blk, g1 = std::min(groups, g0 + per);
        x8_groups<QT>(a, 1, p.w, p.rows, y + p.first + 8 * g0, p.rows, g0, g1, end);
      }
      return;
    }
  }
  if constexpr (is_k<QT>) {
    const int64_t rb = row_bytes<QT>(a.K), n0 = i0 * unit, n1 = std::min(p.rows, i1 * unit);
    const uint8_t* end = p.w + std::min(p.rows, run * unit) * rb;
    int64_t n = n0;
    for (; n + ROW1_NB <= n1; n += ROW1_NB) row1<QT, ROW1_NB>(a, p.w + n * rb, rb, y + p.first + n, end);
    for (; n < n1; ++n) row1<QT, 1>(a, p.w + n * rb, rb, y + p.first + n, end);
  }
}

// the activation block qmatmul_q8_parts quantizes x in for a matrix it takes in its one loop
// (regrouped with a group kernel, or a K-quant in the GGUF layout), else 0
int64_t one_loop_block(int64_t qtype) {
  return with_format(qtype & ~REGROUPED, [&]<int QT>() -> int64_t {
    if (qtype & REGROUPED) return has_x8<QT> ? (is_k<QT> ? 256 : 32) : 0;
    return is_k<QT> ? 256 : 0;
  });
}

constexpr size_t PARTS_MOST = 8;  // matrices in one loop (a layer's Q/K/V or gate/up: no heap for their starts)

// qmatmul_q8_parts's one loop over every matrix's work items, for x's one row quantized in `a`.
// A regrouped matrix's work item is its group block (x8_per groups, a per-CPU choice that
// tests change, so counted here); the others' the same rows.
void parts_loop(const Q8& a, const RowMatrices& m, float* y) {
  const auto& parts = m.mats;
  const size_t n = parts.size();
  TORCH_CHECK(n <= PARTS_MOST, "qmatmul_q8_parts: at most ", PARTS_MOST, " matrices in one loop");
  const int64_t unit = 8 * x8_per<Q4_K>(1, a.K);
  std::array<int64_t, PARTS_MOST + 1> starts{};  // each matrix's first work item
  for (size_t i = 0; i < n; ++i)
    starts[i + 1] = starts[i] + with_format(parts[i].qtype & ~REGROUPED, [&]<int QT>() -> int64_t {
                      if constexpr (has_x8<QT>)
                        if (parts[i].qtype & REGROUPED) return ((parts[i].rows + 7) / 8 + x8_per<QT>(1, a.K) - 1) / x8_per<QT>(1, a.K);
                      return (parts[i].rows + unit - 1) / unit;
                    });
  minerva::parallel_for(0, starts[n], 2, [&](int64_t i0, int64_t i1) {
    const int64_t run = minerva::ThreadPool::run_end(i1);
    for (size_t p = 0; p < n; ++p) {
      const int64_t lo = std::max(i0, starts[p]), hi = std::min(i1, starts[p + 1]);
      if (lo >= hi) continue;
      with_format(parts[p].qtype & ~REGROUPED, [&]<int QT>() {
        part_items<QT>(a, parts[p], unit, lo - starts[p], hi - starts[p], std::min(run, starts[p + 1]) - starts[p], y);
        return 0;
      });
    }
  });
}

// qmatmul_q8 of one matrix on x [M, K] quantized in `a`, float32 outputs into y (ldy = its rows)
template <int QT>
void one_matrix(const Q8& a, int64_t M, const RowMatrix& m, float* y) {
  if constexpr (has_w8<QT>) {
    if (m.qtype & REGROUPED) {
      if constexpr (has_x8<QT>) matmul_x8<QT>(a, M, m.w, m.rows, y);
    } else {
      matmul<QT>(a, M, m.w, m.rows, y);
    }
  }
}

}  // namespace

std::optional<RowMatrices> row_matrices(const std::vector<torch::Tensor>& packed, const std::vector<int64_t>& qtypes,
                                        const std::vector<int64_t>& rows, int64_t cols) {
  const size_t n = packed.size();
  TORCH_CHECK(n > 0 && qtypes.size() == n && rows.size() == n, "row_matrices: one type and row count per matrix");
  RowMatrices m;
  m.cols = cols;
  m.block = one_loop_block(qtypes[0]);
  bool together = n > 1 && n <= PARTS_MOST && m.block > 0;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool regrouped = qtypes[i] & REGROUPED;
    const bool ok = with_format(qtypes[i] & ~REGROUPED, [&]<int QT>() -> bool {
      if constexpr (has_w8<QT>) {
        if (regrouped && !has_x8<QT>) return false;
        check_args<QT>(packed[i], regrouped ? padded_rows<QT>(rows[i]) : rows[i], cols);
        return true;
      }
      return false;
    });
    if (!ok) return std::nullopt;
    together = together && one_loop_block(qtypes[i]) == m.block;
    m.mats.push_back({packed[i].data_ptr<uint8_t>(), qtypes[i], rows[i], total});
    total += rows[i];
  }
  m.together = together;
  return m;
}

namespace {

template <typename XT>
void row_into(const XT* x, const RowMatrices& m, float* y) {
  if (m.together) {
    const Quantized a(x, 1, m.cols, m.block);
    parts_loop(a.view(), m, y);
    return;
  }
  for (const auto& p : m.mats)
    with_format(p.qtype & ~REGROUPED, [&]<int QT>() {
      if constexpr (has_w8<QT>) {
        const Quantized a(x, 1, m.cols, is_k<QT> ? 256 : 32);
        one_matrix<QT>(a.view(), 1, p, y + p.first);
      }
      return 0;
    });
}

}  // namespace

void qmatmul_q8_row(const float* x, const RowMatrices& m, float* y) { row_into(x, m, y); }

// (the bf16 outputs: the float ones rounded, as qmatmul_q8's as_dtype_of and columns_out round them)
void qmatmul_q8_row(const at::BFloat16* x, const RowMatrices& m, float* scratch, at::BFloat16* y) {
  row_into(x, m, scratch);
  round_bf16(scratch, y, m.outputs());
}

torch::Tensor qmatmul_q8_parts(torch::Tensor x, const std::vector<torch::Tensor>& packed,
                               const std::vector<int64_t>& qtypes, const std::vector<int64_t>& rows, int64_t cols) {
  const size_t n = packed.size();
  TORCH_CHECK(n > 0 && qtypes.size() == n && rows.size() == n, "qmatmul_q8_parts: one type and row count per matrix");
  const int64_t block = one_loop_block(qtypes[0]);
  bool together = x.dim() == 2 && x.size(0) == 1 && block > 0 && n <= PARTS_MOST;
  for (size_t i = 1; i < n && together; ++i) together = one_loop_block(qtypes[i]) == block;
  if (!together) {
    std::vector<torch::Tensor> outs;
    for (size_t i = 0; i < n; ++i) outs.push_back(qmatmul_q8(x, packed[i], qtypes[i], rows[i], cols));
    return torch::cat(outs, 1);
  }
  const Quantized a(checked(x, cols), block);
  const auto m = row_matrices(packed, qtypes, rows, cols);  // (one_loop_block took only 8-bit types)
  auto y = torch::empty({1, m->outputs()}, torch::dtype(torch::kFloat32));
  parts_loop(a.view(), *m, y.data_ptr<float>());
  return as_dtype_of(y, x);
}

torch::Tensor qmatmul_q8(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t rows, int64_t cols) {
  if (qtype & REGROUPED) {
    return with_format(qtype & ~REGROUPED, [&]<int QT>() -> torch::Tensor {
      if constexpr (has_x8<QT>) {
        check_args<QT>(packed, padded_rows<QT>(rows), cols);
        const Quantized a(checked(x, cols), is_k<QT> ? 256 : 32);
        const int64_t M = a.rows();
        if (x.dtype() == torch::kBFloat16) {  // rounded as each work item finishes
          auto y = torch::empty({M, rows}, torch::dtype(torch::kBFloat16));
          matmul_x8<QT>(a.view(), M, packed.data_ptr<uint8_t>(), rows, nullptr, y.data_ptr<at::BFloat16>());
          return y;
        }
        auto y = torch::empty({M, rows}, torch::dtype(torch::kFloat32));
        matmul_x8<QT>(a.view(), M, packed.data_ptr<uint8_t>(), rows, y.data_ptr<float>());
        return y;
      } else {
        TORCH_CHECK(false, "no regrouped layout for GGML type ", qtype & ~REGROUPED);
        return x;
      }
    });
  }
  return with_format(qtype, [&]<int QT>() -> torch::Tensor {
    if constexpr (!has_w8<QT>) {
      return qmatmul(x, packed, qtype, rows, cols);  // float matrices keep float activations
    } else {
      check_args<QT>(packed, rows, cols);
      const Quantized a(checked(x, cols), is_k<QT> ? 256 : 32);
      if constexpr (QT == Q3_K || QT == Q6_K)
        if (x.dtype() == torch::kBFloat16 && a.rows() >= PANELS_FROM) {  // as above
          auto y = torch::empty({a.rows(), rows}, torch::dtype(torch::kBFloat16));
          matmul_panels<QT>(a.view(), a.rows(), packed.data_ptr<uint8_t>(), rows, nullptr, y.data_ptr<at::BFloat16>());
          return y;
        }
      auto y = torch::empty({a.rows(), rows}, torch::dtype(torch::kFloat32));
      matmul<QT>(a.view(), a.rows(), packed.data_ptr<uint8_t>(), rows, y.data_ptr<float>());
      return as_dtype_of(y, x);
    }
  });
}
