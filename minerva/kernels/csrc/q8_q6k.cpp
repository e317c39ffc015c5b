// Q6_K regrouped at load for 8-bit activations where the build has V16 (AVX-512 VNNI;
// minerva/kernels/repack.py): units of 16 weight rows, each super-block's bytes in the order
// one row of x reads them, its kernel for one row of x, and the regrouped dispatch for it
// (x8_groups<Q6_K>: many rows of x take tile_panel's panels, q8_repack_k.cpp).
// q8_matmul.cpp describes the design.
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

#if defined(MINERVA_V16)

// A unit of 16 rows keeps super-block g of its rows together (Q6_UNIT bytes, the 16 GGML blocks'
// bytes), a field's chunk q (bytes 4q .. 4q + 3 of a row's field) as 64 bytes, row j's at 4j:
// for part p = 0, 1 and c = 0..7, 192 bytes at 1536 p + 192 c: ql chunks 16p + c and 16p + 8 + c
// (the low nibbles are sub-blocks 4p and 4p + 1, the high ones 4p + 2 and 4p + 3, elements 4c ..
// 4c + 3 of each) and qh chunk 8p + c (bits 2t, 2t + 1 for sub-block 4p + t); then the scales
// chunks k = 0..3 (scales 4k .. 4k + 3) at 3072 + 64k, and d[16] (f16) at 3328. One 512-bit load
// gives a chunk of the 16 rows, one row per 32-bit lane, and one row of x reads the unit front
// to back: part p's chunks c against x's elements 32 (4p + t) + 4c.
//
// Against `row1` on the GGML layout (two rows at a time, horizontal sums), a standalone copy of
// both loops, 2 threads, Zen 4 (AVX-512 run as two 256-bit halves), huge pages, medians of
// 60 alternating runs: 1024 x 4096 from L3, 111 against 56 GB/s; 32768 x 4096 from memory
// where a plain read ran at 47.5 GB/s, 44.1 against 32.8 GB/s (the prefetches below, 16 KB into
// L2), and in a second run 42.8 (the L1 prefetch two super-blocks ahead) against 37.8. Without
// the prefetches 26-28 GB/s; the L2 one alone 16 KB ahead 39-40 (28.9 against row1's 27.4 where
// a plain read ran at 32), 32 KB the same, 64 KB 37-39, spread over the super-block 20-26. In
// the kernels themselves (benchmarks/int8_kernels.py, 2 threads): 2048 x 5632 from L3 70.6
// against 47.6 GMAC/s; 32768 x 4096 from memory where it streamed at 34 GB/s, 1.00-1.11x (5
// runs), and the 1.1B Q6_K shape's matrices in turn (benchmarks/matmul_sweep.py) 0.87-0.89 of a
// large regrouped Q4_K matrix's bandwidth against 0.80-0.89: on this machine decode is bound
// by the memory either way; the units take two thirds of the cycles.
constexpr int64_t Q6_UNIT = 16 * Layout<Q6_K>::bytes, Q6_SCALES_AT = 3072, Q6_D_AT = 3328;
static_assert(Q6_D_AT + 32 == Q6_UNIT, "a unit's super-block holds the 16 GGML blocks' bytes");
// one row of x: each super-block's lines this far on into L2, and the next super-block's into L1
// (32 KB, as tile_panel's PANEL_L2_AHEAD: as fast as 16 KB here, and on the Intel machine 16 KB
// was too short for regrouped Q4_K's 5632-column rows, q8_cpu.h)
constexpr int64_t Q6_L2_AHEAD = 32768;

namespace {

// bits `from`, from + 1 of each byte moved to 4, 5, the others cleared: with GFNI one affine
// transform (row i of its bit matrix, byte 7 - i of the qword, selects the source of result bit
// i), else a shift and a mask (AVX-512 VNNI without GFNI: Intel's Cascade Lake)
inline __m512i high_bits(__m512i qh, int from) {
#if defined(__GFNI__)
  return _mm512_gf2p8affine_epi64_epi8(qh, _mm512_set1_epi64(static_cast<int64_t>(((1ULL << from) << 24) | ((2ULL << from) << 16))), 0);
#else
  return move_bits(qh, from, 4, 2);
#endif
}

inline __m512i dot4x16(__m512i acc, __m512i u, const int8_t* p) {  // as V16::dot4x
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// one row of x against a unit's 16 rows: per super-block and row the exact i32 sum of sc_j *
// (the stored values' dot product with x over scale j's 16 elements - 32 * x's sum over them),
// then acc = fma(sum, d * d_x, acc): the integer and the float steps of `row1` and tile_panel,
// so the same bits
void unit_row(const Q8& a, const uint8_t* unit, int valid, float* y, const uint8_t* end) {
  __m512 acc = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = unit + g * Q6_UNIT;
    if (b + Q6_L2_AHEAD + Q6_UNIT <= end)
      for (int64_t o = 0; o < Q6_UNIT; o += 64) prefetch_l2(b + Q6_L2_AHEAD + o);
    if (b + 2 * Q6_UNIT <= end)
      for (int64_t o = 0; o < Q6_UNIT; o += 64) prefetch(b + Q6_UNIT + o);
    alignas(64) int32_t bias[16];  // -32 * x's sums of 16, each scale's dot products' start
    for (int j = 0; j < 16; ++j) bias[j] = -(static_cast<int32_t>(a.p[16 * g + j]) << 5);
    const int8_t* xg = a.q + 256 * g;
    __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // chunks 4h .. 4h + 3: scales 2 (4p + t) + h
        __m512i dot[4];
        for (int t = 0; t < 4; ++t) dot[t] = _mm512_set1_epi32(bias[2 * (4 * p + t) + h]);
#pragma GCC unroll 4
        for (int c = 4 * h; c < 4 * h + 4; ++c) {
          const uint8_t* at = b + 1536 * p + 192 * c;
          const __m512i q0 = _mm512_loadu_si512(at), q1 = _mm512_loadu_si512(at + 64), qh = _mm512_loadu_si512(at + 128);
          const __m512i w[4] = {_mm512_or_si512(_mm512_and_si512(q0, low), high_bits(qh, 0)),
                                _mm512_or_si512(_mm512_and_si512(q1, low), high_bits(qh, 2)),
                                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q0, 4), low), high_bits(qh, 4)),
                                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q1, 4), low), high_bits(qh, 6))};
          for (int t = 0; t < 4; ++t) dot[t] = dot4x16(dot[t], w[t], xg + 32 * (4 * p + t) + 4 * c);
        }
        for (int t = 0; t < 4; ++t) {  // scale j: byte j & 3 of each lane of scales chunk j >> 2, with its sign
          const int j = 2 * (4 * p + t) + h;
          const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(_mm512_loadu_si512(b + Q6_SCALES_AT + 64 * (j >> 2)), 24 - 8 * (j & 3)), 24);
          isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(dot[t], sc));
          keep_in_register(isum);
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(load256(b + Q6_D_AT));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(a.d[g])), acc);
  }
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << valid) - 1), acc);
}

}  // namespace

// one work item: groups g0 .. g1 (g0 even: x8_per gives Q6_K work items of whole units) against
// all M rows of x, output column 8 g0 + c of row m at y[m * ldy + c]. One row of x: unit_row per
// unit; more: the units as tile_panel's groups in a buffer of the thread's, then its tiles.
template <>
void x8_groups<Q6_K>(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y, int64_t ldy, int64_t g0, int64_t g1,
                     const uint8_t* end) {
  const int64_t gb = a.G * Q6_UNIT / 2;  // a group of 8 rows' bytes
  if (M == 1) {
    for (int64_t grp = g0; grp < g1; grp += 2)
      unit_row(a, W + grp * gb, static_cast<int>(std::min<int64_t>(16, N - 8 * grp)), y + 8 * (grp - g0), end);
    return;
  }
  thread_local std::vector<uint8_t> panel, plain_buffer;
  if (static_cast<int64_t>(panel.size()) < (g1 - g0 + 1) * gb) panel.resize((g1 - g0 + 1) * gb);
  for (int64_t grp = g0; grp < g1; grp += 2) q6_unit_to_panels(W + grp * gb, a.G, gb, panel.data() + (grp - g0) * gb);
  panel_tiles<Q6_K>(a, M, panel.data(), gb, g1 - g0, N - 8 * g0, y, ldy, plain_buffer);
}

template void matmul_x8<Q6_K>(const Q8&, int64_t, const uint8_t*, int64_t, float*, at::BFloat16*);

#endif

}  // namespace minerva::q8

bool q6_k_regrouped() { return minerva::q8::Q6_REGROUPED; }

// Q6_K rows [a multiple of 16, row bytes] in the GGML layout to the units above, in place
void regroup_q6_k_(torch::Tensor packed) {
  using namespace minerva::q8;
  constexpr int64_t B = minerva::Layout<minerva::Q6_K>::bytes;
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.device().is_cpu() && packed.dim() == 2 &&
                  packed.size(0) % 16 == 0 && packed.size(1) % B == 0,
              "regroup_q6_k_ takes a contiguous CPU uint8 [rows (a multiple of 16), row bytes] tensor");
  const int64_t rb = packed.size(1), G = rb / B;
  regroup_in_place(packed, 16, 4, [&](const uint8_t* rows, uint8_t* dst) {
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* o = dst + g * 16 * B;
      for (int j = 0; j < 16; ++j) {
        const uint8_t* b = rows + j * rb + g * B;
        for (int p = 0; p < 2; ++p)
          for (int c = 0; c < 8; ++c) {
            uint8_t* at = o + 1536 * p + 192 * c + 4 * j;
            std::memcpy(at, b + 4 * (16 * p + c), 4);            // ql chunk 16p + c
            std::memcpy(at + 64, b + 4 * (16 * p + 8 + c), 4);   // ql chunk 16p + 8 + c
            std::memcpy(at + 128, b + 128 + 4 * (8 * p + c), 4);  // qh chunk 8p + c
          }
        for (int k = 0; k < 4; ++k) std::memcpy(o + 3072 + 64 * k + 4 * j, b + 192 + 4 * k, 4);  // scales
        std::memcpy(o + 3328 + 2 * j, b + 208, 2);  // d
      }
    }
  });
}
