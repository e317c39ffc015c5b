// The 32-weight block types regrouped at load (Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q8_0;
// minerva/kernels/repack.py): their kernels, the regrouped dispatch for them (q8_repack.h), and
// regroup_, which regroups packed rows in place. q8_matmul.cpp describes the design.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "q8_repack.h"

namespace minerva::q8 {

// Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 regrouped at load (minerva/kernels/repack.py): a group of 8 weight
// rows keeps their block g together, d[8] | m[8] | qh[8] | qs[128], qs chunk k of row j at
// 32k + 4j. One 32-byte load gives chunk k of all 8 rows, one row per 32-bit lane, and
// maddubs against x's 4 bytes broadcast to every lane sums each row in its own lane.
// (has_x8, the types with a regrouped layout: q8_kernels.h)

// MXFP4 regrouped: e[8] | qs[128], its nibbles looked up into values + 16 as W8<MXFP4> does.
// Q8_0 regrouped: d[8] | qs[256], its signed bytes whole (chunks k = 0..7).
// how many blocks of a group ahead the regrouped kernels prefetch (about 5 KB). GPT-OSS's
// gate/up for one token's 4 experts, grouped matrix by matrix, on the AVX-512 machine: 0.84 ms
// a layer with 40 blocks against 1.04 ms with 16 (round robin over the experts: 1.9 ms with
// 4, 1.4 ms with 16); ad-hoc timings, one layer repeated.
constexpr int64_t X8_AHEAD = 40;

template <int QT>
struct X8 {
  static constexpr bool OFFSET = W8<QT>::OFFSET, FIFTH = QT == Q5_0 || QT == Q5_1, LOOKUP = QT == MXFP4;
  static constexpr bool WIDE = FIFTH || LOOKUP;  // values past 4 bits: maddubs lanes up to 2 * 31 * 127
  static constexpr int BIAS = W8<QT>::BIAS;
  static constexpr int M_AT = 16, QH_AT = OFFSET ? 32 : 16, QS_AT = LOOKUP ? 8 : QH_AT + (FIFTH ? 32 : 0);
  static constexpr int64_t BYTES = 8 * Layout<QT>::bytes, QS_BYTES = QT == Q8_0 ? 256 : 128;
  static_assert(QS_AT + QS_BYTES == BYTES, "the regrouped block holds the 8 GGML blocks' bytes");
  // the 8 rows' scales: 8 f16, or 8 E8M0 bytes as e8m0_half computes them
  static __m256 scales(const uint8_t* b) {
    if constexpr (LOOKUP) {
      const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
      const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
      return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
    } else {
      return _mm256_cvtph_ps(load128(b));
    }
  }
  // a chunk's 32 low or high nibbles as the values the dot products take
  static __m256i values(__m256i nibbles) {
    if constexpr (LOOKUP)
      return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_add_epi8(mxfp4_values(), _mm_set1_epi8(16))), nibbles);
    else
      return nibbles;
  }
};

// One regrouped block of Q4_0, Q4_1, Q5_0, Q5_1 or MXFP4 (not Q8_0) at b: its 8 rows' values
// unpacked once (lo[k], hi[k]: chunk k's low and high nibbles, with the fifth bit) and offsets
// m (Q4_1/Q5_1); dot(xq) the 8 rows' exact integer dot products with x's 32 values at xq.
template <int QT>
struct X8Block {
  using X = X8<QT>;
  __m256i lo[4], hi[4];
  __m256 m = _mm256_setzero_ps();
  explicit X8Block(const uint8_t* b) {
    if constexpr (X::OFFSET) m = _mm256_cvtph_ps(load128(b + X::M_AT));
    const __m256i qh = X::FIFTH ? load256(b + X::QH_AT) : _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) chunk(b, qh, k, lo[k], hi[k]);
  }
  // chunk k's values alone (qh: the block's fifth bits, Q5_0/Q5_1)
  static void chunk(const uint8_t* b, __m256i qh, int k, __m256i& lo, __m256i& hi) {
    const __m256i v = load256(b + X::QS_AT + 32 * k);
    lo = X::values(low4(v));
    hi = X::values(high4(v));
    if constexpr (X::FIFTH) {
      const __m256i bit4 = _mm256_set1_epi8(0x10);
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srli_epi32(qh, k), bit4));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32(qh, 4 - k), bit4));
    }
  }
  __m256i dot(const int8_t* xq) const {
    auto pairs = [&](int k) {
      int32_t x0, x1;
      std::memcpy(&x0, xq + 4 * k, 4);
      std::memcpy(&x1, xq + 16 + 4 * k, 4);
      return _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], _mm256_set1_epi32(x0)),
                              _mm256_maddubs_epi16(hi[k], _mm256_set1_epi32(x1)));
    };
    if constexpr (VNNI) {  // low and high nibbles in two chains, widened as they go
      __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
      for (int k = 0; k < 4; ++k) {
        d0 = dot4x(d0, lo[k], xq + 4 * k);
        d1 = dot4x(d1, hi[k], xq + 16 + 4 * k);
      }
      return _mm256_add_epi32(d0, d1);
    } else if constexpr (X::WIDE) {
      return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(pairs(0), pairs(1)), ones16()),
                              _mm256_madd_epi16(_mm256_add_epi16(pairs(2), pairs(3)), ones16()));
    } else {
      return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(pairs(0), pairs(1)),
                                                _mm256_add_epi16(pairs(2), pairs(3))), ones16());
    }
  }
};

// Q4_0 or Q4_1 without VNNI (not X::WIDE): block g at b against rows m0 .. m0 + mr - 1 of x,
// chunk by chunk, each chunk decoded once for the rows and each row's maddubs lanes summed in
// i16 in a register (X8Block::dot's sum), then acc[i] = block_step(...): X8Block's outputs with
// fewer registers (tile_x8, x8_rows)
template <int QT, int mr>
MINERVA_INLINE inline void x8_block_by_chunks(const Q8& a, int64_t m0, int64_t g, const uint8_t* b, __m256 dw, __m256* acc) {
  using X = X8<QT>;
  __m256i run[mr];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    __m256i lo, hi;
    X8Block<QT>::chunk(b, _mm256_setzero_si256(), k, lo, hi);
    for (int i = 0; i < mr; ++i) {
      const int8_t* xq = a.q + (m0 + i) * a.K + 32 * g;
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xq + 4 * k)),
                                         _mm256_maddubs_epi16(hi, bcast4(xq + 16 + 4 * k)));
      run[i] = k == 0 ? p : kept(_mm256_add_epi16(run[i], p));
    }
  }
  const __m256 m = X::OFFSET ? _mm256_cvtph_ps(load128(b + X::M_AT)) : _mm256_setzero_ps();
  for (int i = 0; i < mr; ++i)
    acc[i] = kept(block_step<X>(a, m0 + i, g, _mm256_madd_epi16(run[i], ones16()), dw, m, acc[i]));
}

// The same outputs as tile8 on the GGML layout, bit for bit: per block the same exact
// integer dot product per row (here summed in i16 before one madd: a lane of maddubs is at
// most 2 * 15 * 127 = 3810 for 4-bit values, so 8 of them fit; 5-bit values, at most 7874,
// and MXFP4's values + 16, at most 7112, go 4 at a time), then the same float operations.
//
// Q8_0 (its own float rounding, not the GGML layout's: a block's exact i32 dot product per
// row in one lane, then one FMA, where the GGML layout keeps 8 partial lanes per output):
// per chunk |w| against x's 4 bytes given w's signs, each chunk's pairs (up to 2 * 128 * 127)
// widened to i32 on their own; with VNNI (no i16 pair sums to saturate) w + 128 as the unsigned
// operand against x, and 128 sum(x) subtracted: the same exact sum in fewer steps (x enters as
// an embedded broadcast, where |w| against x given w's signs needs x in a register).
//
// Q4_0 and Q4_1 without VNNI go chunk by chunk, each chunk decoded once for the tile's rows and
// each row's i16 sum kept in a register, where X8Block's 8 decoded chunks with the tile's 4
// rows' float sums outgrew AVX2's 16 registers (GCC kept the sums in the stack, a store and a
// reload a block and row). The same i16 sums, so the same bits. Zen 4, MINERVA_ISA=avx2, 2
// threads, 2048 x 5632 (benchmarks/kernel_ab.py, medians of the pairs' ratios): Q4_0 1.141x
// at 512 rows of x and 1.160x at 16, Q4_1 1.186x and 1.165x. (Q5_0, Q5_1 and MXFP4, whose
// runs are half as long, did not gain so: 0.97-1.07x.)
template <int QT, int mr>
void tile_x8(const Q8& a, int64_t m0, const uint8_t* grp, int valid, float* y, int64_t ldy,
             const uint8_t* end) {
  using X = X8<QT>;
  __m256 acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t FAR = l2_ahead_for<QT>(a.K) / X::BYTES * X::BYTES;
  const int64_t far_g = mr > 1 ? 0 : far_blocks(grp, 0, FAR, X::BYTES, end, a.G);
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = grp + g * X::BYTES;
    if (g < far_g)
      for (int64_t o = 0; o < X::BYTES; o += 64) prefetch_l2(b + FAR + o);
    for (int64_t o = 0; o < X::BYTES; o += 64) prefetch(b + X8_AHEAD * X::BYTES + o);
    const __m256 dw = X::scales(b);
    if constexpr (QT == Q8_0) {
      __m256i dot[2][mr];  // the even and the odd chunks: two dependency chains per row
      for (int i = 0; i < mr; ++i) dot[0][i] = dot[1][i] = _mm256_setzero_si256();
      if constexpr (VNNI) {  // w + 128 unsigned against x, 128 sum(x) taken off below
        for (int k = 0; k < 8; ++k) {
          const __m256i wu = _mm256_xor_si256(load256(b + X::QS_AT + 32 * k), _mm256_set1_epi8(static_cast<char>(0x80)));
          for (int i = 0; i < mr; ++i) dot[k & 1][i] = dot4x(dot[k & 1][i], wu, a.q + (m0 + i) * a.K + 32 * g + 4 * k);
        }
      } else {  // |w| against x given w's signs: one chain per row of x for several (dot[1] stays 0)
        constexpr int C = mr == 1 ? 2 : 1;
#pragma GCC unroll 1  // (unrolled, GCC summed the products as a tree in the stack: AVX2 has 16 registers)
        for (int k0 = 0; k0 < 8; k0 += C)
          for (int c = 0; c < C; ++c) {  // (chain c a constant: k & 1, not one, put the chains in the stack)
            const __m256i w = load256(b + X::QS_AT + 32 * (k0 + c)), wa = _mm256_abs_epi8(w);
            for (int i = 0; i < mr; ++i)
              dot[c][i] = dot4(dot[c][i], wa, _mm256_sign_epi8(bcast4(a.q + (m0 + i) * a.K + 32 * g + 4 * (k0 + c)), w));
          }
      }
      for (int i = 0; i < mr; ++i) {
        __m256i dot_i = _mm256_add_epi32(dot[0][i], dot[1][i]);
        if constexpr (VNNI) dot_i = _mm256_sub_epi32(dot_i, _mm256_slli_epi32(bcast_i32(a.n + (m0 + i) * a.G + g), 7));
        acc[i] = block_step<X>(a, m0 + i, g, dot_i, dw, _mm256_setzero_ps(), acc[i]);
      }
      continue;
    }
    if constexpr (!VNNI && !X::WIDE) {
      x8_block_by_chunks<QT, mr>(a, m0, g, b, dw, acc);
      continue;
    }
    const X8Block<QT> blk(b);
    for (int i = 0; i < mr; ++i) {
      const int64_t r = m0 + i;
      acc[i] = block_step<X>(a, r, g, blk.dot(a.q + r * a.K + 32 * g), dw, blk.m, acc[i]);
    }
  }
  store_rows<mr>(acc, valid, y, ldy);
}

#if defined(MINERVA_V16)
// The 32-weight block types regrouped against more rows of x than the one-row streams take
// (few_rows), with AVX-512 VNNI: two groups side by side per 512-bit register (lanes 0..7 the
// rows of the group at grp, 8..15 those of the group gb bytes on; the values unpacked as
// X8Block does, both groups at once), so that each of x's 4 bytes, an embedded broadcast, feeds
// 16 weight rows where tile_x8 feeds 8. Per output the same operations as tile_x8<QT, 1> (the
// exact i32 dot product of the block, x's sum times the bias taken off, the same FMAs), so the
// same bits. Zen 4, 2 threads, against tile_x8's 8 rows a register (benchmarks/kernel_ab.py,
// medians of the pairs' ratios), 5632 x 2048 at 512 rows of x: Q4_0 1.224x (quartiles
// 1.162-1.257; 16 rows 1.319x; 2048 x 5632 1.280x), Q4_1 1.176x, Q5_0 1.281x, Q5_1 1.230x;
// MXFP4 5760 x 2880 1.282x (16 rows 1.306x). Q8_0: 4096 x 2880 at 16 rows of x 1.197x (quartiles 1.185-1.220),
// 9 rows 1.111x, 32 rows 1.209x, 512 rows 1.179x; 5632 x 2048 at 512 rows 1.177x; GPT-OSS-20B's
// head, 201088 x 2880 from memory, at 16 rows 1.155x. Tiles of 12 rows of x: the same at 16
// rows, 0.99x of this at 512.
// With `far`, the first tile of x's rows in a work item also asks for the next work item's same
// place (far bytes on) into L2, up to `end`: the same machine and way, the head at 16 rows
// 1.260x (quartiles 1.211-1.417) and at 9 rows 1.343x, 32768 x 4096 at 32 rows 1.163x,
// 4096 x 2880 (from L3) at 16 rows 1.040x, at 512 rows 1.011x.
// NP pairs side by side (one row of x, X8_PAIRS: a work item's 4 groups as 4 streams, as
// x8_rows reads them), pair n's outputs 16 n on; `valid` counts the last pair's rows.
template <int QT, int mr, int NP>
void tile_x8_pair(const Q8& a, int64_t m0, const uint8_t* grp, int64_t gb, int valid, float* y, int64_t ldy,
                  int64_t far, const uint8_t* end) {
  using X = X8<QT>;
  using V = V16;  // 32 bytes of each group side by side: V::load(p, gb)
  V::F acc[NP][mr];
  for (int n = 0; n < NP; ++n)
    for (int i = 0; i < mr; ++i) acc[n][i] = V::zerof();
  const int64_t far_g = far_blocks(grp, (2 * NP - 1) * gb, far, X::BYTES, end, a.G);
  for (int64_t g = 0; g < a.G; ++g) {
    for (int n = 0; n < NP; ++n) {
      const uint8_t* b = grp + 2 * n * gb + g * X::BYTES;
      if (g < far_g)
        for (int64_t o = 0; o < X::BYTES; o += 64) {
          prefetch_l2(b + far + o);
          prefetch_l2(b + gb + far + o);
        }
      for (int64_t o = 0; o < X::BYTES; o += 64) {
        prefetch(b + X8_AHEAD * X::BYTES + o);
        prefetch(b + gb + X8_AHEAD * X::BYTES + o);
      }
      const int8_t* xq = a.q + m0 * a.K + 32 * g;  // row i's 4 bytes at `at`: xq + i * a.K + at, an embedded broadcast
      // dot product chains per row of x: two for one row (decode, X8_PAIRS: the even and the odd
      // chunks, Q8_0's, or the low and the high values), else one; exact integers either way
      constexpr int C = mr == 1 ? 2 : 1;
      V::I dot[C][mr];
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < mr; ++i) dot[c][i] = V::zero();
      if constexpr (QT == Q8_0) {  // w + 128 against x, 128 sum(x) taken off below (tile_x8)
        for (int k = 0; k < 8; ++k) {
          const V::I wu = _mm512_xor_si512(V::load(b + X::QS_AT + 32 * k, gb), V::bytes(0x80));
          for (int i = 0; i < mr; ++i) dot[k % C][i] = V::dot4x(dot[k % C][i], wu, xq + i * a.K + 4 * k);
        }
      } else {  // X8Block's values, both groups at once: chunk k's low nibbles against x 4k.., high ones 16 + 4k..
        const V::I low = V::bytes(0x0F);
        V::I lo[4], hi[4];
        for (int k = 0; k < 4; ++k) {
          const V::I v = V::load(b + X::QS_AT + 32 * k, gb);
          lo[k] = V::and_(v, low);
          hi[k] = V::and_(V::shr16(v, 4), low);
        }
        if constexpr (X::FIFTH) {
          const V::I qh = V::load(b + X::QH_AT, gb), bit4 = V::bytes(0x10);
          for (int k = 0; k < 4; ++k) {
            lo[k] = V::or_(lo[k], V::and_(V::shr32(qh, k), bit4));
            hi[k] = V::or_(hi[k], V::and_(V::shl32(qh, 4 - k), bit4));
          }
        }
        if constexpr (X::LOOKUP) {
          const V::I table = _mm512_broadcast_i32x4(_mm_add_epi8(mxfp4_values(), _mm_set1_epi8(16)));
          for (int k = 0; k < 4; ++k) {
            lo[k] = _mm512_shuffle_epi8(table, lo[k]);
            hi[k] = _mm512_shuffle_epi8(table, hi[k]);
          }
        }
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < mr; ++i) {
            dot[0][i] = V::dot4x(dot[0][i], lo[k], xq + i * a.K + 4 * k);
            dot[C - 1][i] = V::dot4x(dot[C - 1][i], hi[k], xq + i * a.K + 16 + 4 * k);
          }
      }
      const V::F dw = V::join(X::scales(b), X::scales(b + gb));
      V::F m = V::zerof();
      if constexpr (X::OFFSET) m = V::halves(b + X::M_AT, gb);
      constexpr int SHIFT = QT == Q8_0 ? 7 : X::BIAS;  // sum(x) << SHIFT off the dot product, as block_step
      for (int i = 0; i < mr; ++i) {
        const int64_t r = (m0 + i) * a.G + g;
        V::I d = C == 2 ? V::add(dot[0][i], dot[C - 1][i]) : dot[0][i];
        if constexpr (SHIFT > 0) d = V::sub(d, V::shl32(V::i32_at(a.n + r), SHIFT));
        acc[n][i] = V::fmadd(V::cvt(d), V::mul(dw, V::f32(a.d[r])), acc[n][i]);
        if constexpr (X::OFFSET) acc[n][i] = V::fmadd(m, V::f32(a.s[r]), acc[n][i]);
      }
    }
  }
  for (int n = 0; n < NP; ++n)
    for (int i = 0; i < mr; ++i) V::store(y + i * ldy + 16 * n, acc[n][i], n == NP - 1 ? valid : 16);
}
#endif

// Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 regrouped, one row of x (decode): NG groups (8 NG weight rows)
// at a time, block by block, each group read as its own stream; per output the same
// operations as tile_x8<QT, 1>. Four streams a thread, which the hardware prefetchers follow,
// read faster than one with tile_x8's prefetches: Intel Xeon with AMX, 2 threads, the two
// ways alternating in one process, every matrix of the 1.1B Q4_0 shape in turn from memory,
// 22.0 against 20.4 GB/s (medians of 10 sweeps, 1.075x); its greedy decode 31.0 against 28.9
// tokens/s (8 of 8 pairs faster).
// Where the CPU takes the L2 prefetch (choices.l2_ahead), each stream also asks for its lines
// NG groups on, the same place in the next work item (the next 8 NG rows), into L2, up to the
// end of the thread's run: the prefetchers do not start the next item's four streams before
// they are read. The same machine, with and without, alternating in one process: the 1.1B
// Q4_0 shape's greedy decode 42.45 against 36.69 tokens/s (10 of 10 pairs faster, 1.157x;
// its matrices in turn from memory 1.09-1.13x), the 7B Q4_0 shape's 6.53 against 6.07
// (1.088x), GPT-OSS-20B-shaped MXFP4 experts (4 of 32 a layer, from memory) 1.25x (5760 x
// 2880) and 1.085x (2880 x 2880); Q4_1, Q5_0 and Q5_1 matrices of the 1.1B and 7B shapes
// 1.11-1.24x; Gemma 3 270M's decode the same (1.003x). A fixed 16 KB ahead instead: 0.84x of
// this; two items ahead, the same. (Q8_0's q8_0_rows, below, with it: 0.96x.)
// (The groups shorter than X8_STREAM_BYTES take tile_x8: q8_kernels.h.)
//
// With a few rows of x (2 to 8: a speculative verification, a handful of sequences) the same
// streams meet MR rows at once: each block of the NG groups is decoded once and taken by every
// row, so the weights are read from memory once and decoded once for all of them, where
// tile_x8 reads a group at a time (no L2 prefetch) and decodes it once per tile of rows.
// Per output the same operations as tile_x8<QT, 1>: a row's bits do not depend on MR.
// Q4_0 and Q4_1 without VNNI take each group chunk by chunk, as tile_x8 does: Zen 4,
// MINERVA_ISA=avx2, 2 threads, 2048 x 5632 against 592202d's build (benchmarks/kernel_ab.py),
// Q4_0 at 2, 4 and 8 rows of x 2.03x, 1.14x and 1.23x, Q4_1 at 4 rows 1.19x (one row, which
// keeps X8Block, 0.98x).
template <int QT, int NG, int MR>
void x8_rows(const Q8& a, int64_t m0, const uint8_t* grp, int64_t gb, float* y, int64_t ldy, const uint8_t* end) {
  using X = X8<QT>;
  __m256 acc[NG][MR];
  for (int n = 0; n < NG; ++n)
    for (int i = 0; i < MR; ++i) acc[n][i] = _mm256_setzero_ps();
  const int64_t far = l2_ahead_for<QT>(a.K) > 0 ? NG * gb : 0;  // the next work item's same place
  const int64_t far_g = far_blocks(grp, (NG - 1) * gb, far, X::BYTES, end, a.G);
  for (int64_t g = 0; g < a.G; ++g) {
    // each stream's lines that block g reaches for the first time, far bytes on
    const int64_t lo = (g * X::BYTES + 63) & ~int64_t{63}, hi = ((g + 1) * X::BYTES + 63) & ~int64_t{63};
    for (int n = 0; n < NG; ++n) {
      const uint8_t* b = grp + n * gb + g * X::BYTES;
      if (g < far_g)
        for (int64_t o = lo; o < hi; o += 64) prefetch_l2(grp + n * gb + far + o);
      const __m256 dw = X::scales(b);
      if constexpr (!VNNI && !X::WIDE && MR > 1) {  // as tile_x8 without VNNI
        x8_block_by_chunks<QT, MR>(a, m0, g, b, dw, acc[n]);
        continue;
      }
      const X8Block<QT> blk(b);
      for (int i = 0; i < MR; ++i)
        acc[n][i] = block_step<X>(a, m0 + i, g, blk.dot(a.q + (m0 + i) * a.K + 32 * g), dw, blk.m, acc[n][i]);
    }
  }
  for (int n = 0; n < NG; ++n)
    for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + i * ldy + 8 * n, acc[n][i]);
}

// Q8_0 regrouped, one row of x (decode): NG groups (8 NG weight rows) at a time, sharing x's
// loads; per output the same operations as tile_x8<Q8_0, 1>. No software prefetch: four
// groups are four streams the hardware prefetcher follows. (One thread, 65536 x 2880, from
// memory: 8.7-9.8 ms with four groups and none, 11.7-18.4 ms with two groups and 40 blocks
// ahead, as tile_x8 does, 9.8-12.8 ms (median 10.0) for the GGML layout's rows; `benchmarks/int8_kernels.py
// --type Q8_0 --rows 65536 --cols 2880 --m 1 --threads 1`.)
// With a few rows of x (MR of them, rows m0 .. m0 + MR - 1; few_rows) the same streams meet
// every row: each chunk of the NG groups is loaded once for all of them. A row's integer dot
// products are exact whatever the chains, so its bits do not depend on MR.
template <int NG, int MR>
void q8_0_rows(const Q8& a, int64_t m0, const uint8_t* grp, int64_t gb, float* y, int64_t ldy) {
  using X = X8<Q8_0>;
  constexpr int C = MR == 1 ? 2 : 1;  // chains per output: the even and the odd chunks for one row
  __m256 acc[NG][MR];
  for (int n = 0; n < NG; ++n)
    for (int i = 0; i < MR; ++i) acc[n][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b[NG];
    for (int n = 0; n < NG; ++n) b[n] = grp + n * gb + g * X::BYTES;
    __m256i dot[NG][MR][C];
    for (int n = 0; n < NG; ++n)
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < C; ++c) dot[n][i][c] = _mm256_setzero_si256();
    if constexpr (VNNI) {
      for (int k = 0; k < 8; ++k) {
        __m256i xb[MR];
        for (int i = 0; i < MR; ++i) xb[i] = bcast4(a.q + (m0 + i) * a.K + 32 * g + 4 * k);
        for (int n = 0; n < NG; ++n) {  // as tile_x8
          const __m256i wu = _mm256_xor_si256(load256(b[n] + X::QS_AT + 32 * k), _mm256_set1_epi8(static_cast<char>(0x80)));
          for (int i = 0; i < MR; ++i) dot[n][i][k % C] = dot4(dot[n][i][k % C], wu, xb[i]);
        }
      }
    } else {
#pragma GCC unroll 1  // as tile_x8's loop without VNNI: not unrolled, chain c a constant
      for (int k0 = 0; k0 < 8; k0 += C)
        for (int c = 0; c < C; ++c) {
          __m256i xb[MR];
          for (int i = 0; i < MR; ++i) xb[i] = bcast4(a.q + (m0 + i) * a.K + 32 * g + 4 * (k0 + c));
          for (int n = 0; n < NG; ++n) {
            const __m256i w = load256(b[n] + X::QS_AT + 32 * (k0 + c)), wa = _mm256_abs_epi8(w);
            for (int i = 0; i < MR; ++i) dot[n][i][c] = dot4(dot[n][i][c], wa, _mm256_sign_epi8(xb[i], w));
          }
        }
    }
    for (int n = 0; n < NG; ++n) {
      const __m256 dw = X::scales(b[n]);
      for (int i = 0; i < MR; ++i) {
        __m256i d = dot[n][i][0];
        if constexpr (C == 2) d = _mm256_add_epi32(d, dot[n][i][1]);
        if constexpr (VNNI) d = _mm256_sub_epi32(d, _mm256_slli_epi32(bcast_i32(a.n + (m0 + i) * a.G + g), 7));
        acc[n][i] = block_step<X>(a, m0 + i, g, d, dw, _mm256_setzero_ps(), acc[n][i]);
      }
    }
  }
  for (int n = 0; n < NG; ++n)
    for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + i * ldy + 8 * n, acc[n][i]);
}

MINERVA_Q8_REGROUPED(Q4_0);
MINERVA_Q8_REGROUPED(Q4_1);
MINERVA_Q8_REGROUPED(Q5_0);
MINERVA_Q8_REGROUPED(Q5_1);
MINERVA_Q8_REGROUPED(MXFP4);
MINERVA_Q8_REGROUPED(Q8_0);

}  // namespace minerva::q8

// repack.py's regrouping of packed rows, in place, group by group: a group's regrouped bytes
// fill exactly its 8 rows' bytes. `fields` lists a block's fields in order as (bytes, kind):
// 0 the 8 rows' field side by side, 1 the same after moving Q5's fifth bits (repack.py's
// _bit_moves, given as `moves`: 32 (from, to) bit pairs), 2 interleaved 4 bytes at a time.
void regroup_(torch::Tensor packed, int64_t block_bytes, std::vector<int64_t> fields, std::vector<int64_t> moves) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.device().is_cpu() &&
                  packed.dim() == 2 && packed.size(0) % 8 == 0 && packed.size(1) % block_bytes == 0,
              "regroup_ takes a contiguous CPU uint8 [rows (a multiple of 8), row bytes] tensor");
  TORCH_CHECK(fields.size() % 2 == 0 && moves.size() == 64, "regroup_: bad field or bit tables");
  const int64_t rb = packed.size(1), blocks = rb / block_bytes;
  minerva::q8::regroup_in_place(packed, 8, 16, [&](const uint8_t* rows, uint8_t* dst) {
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t at = 0;
      for (size_t f = 0; f < fields.size(); f += 2) {
        const int64_t width = fields[f], kind = fields[f + 1];
        for (int r = 0; r < 8; ++r) {
          const uint8_t* src = rows + r * rb + b * block_bytes + at;
          if (kind == 2) {
            for (int64_t k = 0; k < width / 4; ++k) std::memcpy(dst + 32 * k + 4 * r, src + 4 * k, 4);
          } else if (kind == 1) {
            uint32_t word, out = 0;
            std::memcpy(&word, src, 4);
            for (int i = 0; i < 32; ++i) out |= ((word >> moves[2 * i]) & 1u) << moves[2 * i + 1];
            std::memcpy(dst + 4 * r, &out, 4);
          } else {
            std::memcpy(dst + width * r, src, width);
          }
        }
        dst += 8 * width;
        at += width;
      }
    }
  });
}

// Rows `ids` of a regrouped Q8_0 matrix [rows rounded up to 8, row bytes] in the GGML layout
// [ids, row bytes]: the embedding's lookups where its LM head, the same matrix, is regrouped
// (row r is row r % 8 of group r / 8: per block its scale at 2 (r % 8), chunk k of its values
// at 16 + 32 k + 4 (r % 8)).
torch::Tensor regrouped_rows(const torch::Tensor& packed, int64_t qtype, const torch::Tensor& ids, int64_t cols) {
  using namespace minerva;
  using namespace minerva::q8;
  TORCH_CHECK(qtype == (Q8_0 | REGROUPED), "regrouped_rows takes a regrouped Q8_0 matrix, got type ", qtype);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.device().is_cpu() && packed.dim() == 2 &&
                  packed.size(0) % 8 == 0 && cols % 32 == 0 && packed.size(1) == cols / 32 * 34,
              "regrouped_rows: packed must be contiguous CPU uint8 [rows (a multiple of 8), cols / 32 * 34]");
  const auto id = ids.to(torch::kInt64).contiguous().reshape({-1});
  const int64_t n = id.numel(), rb = packed.size(1), blocks = cols / 32, rows = packed.size(0);
  auto out = torch::empty({n, rb}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t* idp = id.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < rows, "regrouped_rows: row ", idp[i], " out of range");
  minerva::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j = idp[i] % 8;
      const uint8_t* grp = src + idp[i] / 8 * 8 * rb;
      uint8_t* row = dst + i * rb;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = grp + b * X8<Q8_0>::BYTES;
        std::memcpy(row + 34 * b, blk + 2 * j, 2);
        for (int k = 0; k < 8; ++k) std::memcpy(row + 34 * b + 2 + 4 * k, blk + X8<Q8_0>::QS_AT + 32 * k + 4 * j, 4);
      }
    }
  });
  return out;
}

