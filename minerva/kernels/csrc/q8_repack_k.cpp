// The K-quants regrouped (Q2_K .. Q5_K at load, minerva/kernels/repack.py; Q3_K and Q6_K also
// panel by panel at run time, Q6_K's units regrouped at load too: q8_q6k.cpp): their kernels on
// V8 / V16, the regrouped dispatch for them (q8_repack.h), matmul_panels and panel_tiles.
// q8_matmul.cpp describes the design.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "q8_repack.h"

namespace minerva::q8 {

// One row of x: sub-block s's (0..7) eighth of the prefetches for the super-block at b (and
// at b + gb, the second group, with TWO): its lines `far` bytes on into L2, and two
// super-blocks on into L1, so that the requests go out evenly through the super-block rather
// than 18-36 at its start. Intel Xeon with AMX, the 1.1B shape's matrices regrouped, 1.2 GB of
// them in turn from memory, 2 threads, the two ways alternating sweep by sweep (medians of
// 10): the L2 prefetches spread alone 1.02-1.05x (Q4_K), 1.05x (Q5_K), 1.03x (Q3_K), 1.04x
// (Q2_K); with the L1 prefetch too, Q4_K 1.08x (one 65536 x 2048 matrix 27.0 -> 29.2 GB/s),
// Q5_K 1.12x, Q3_K 1.07x, Q2_K 1.07x. (Half of the L2 prefetches, every other line, 0.92x;
// the L1 prefetch at the super-block's start beside the L2 burst had been 1.01x.)
template <bool TWO, int64_t BYTES>
inline void prefetch_eighth(const uint8_t* b, int64_t gb, int64_t far, int s) {
  const int64_t lo = (s * BYTES / 8) & ~int64_t{63}, hi = s == 7 ? BYTES : ((s + 1) * BYTES / 8) & ~int64_t{63};
  for (int64_t o = lo; o < hi; o += 64) {
    prefetch_l2(b + far + o);
    prefetch(b + 2 * BYTES + o);
    if constexpr (TWO) {
      prefetch_l2(b + gb + far + o);
      prefetch(b + gb + 2 * BYTES + o);
    }
  }
}

// Q4_K regrouped: per super-block of a group, d[8] | dmin[8] | the 12 bytes of scales and
// mins as three u32 per row, u0[8] | u1[8] | u2[8] | qs, chunk q (bytes 4q .. 4q + 3 of a row's
// 128: sub-block 2 (q / 8) in the low nibbles, 2 (q / 8) + 1 in the high ones, elements
// 4 (q % 8) .. + 3) of row j at 128 + 32q + 4j. The 8 rows' scales and mins unpack together,
// one row per 32-bit lane, with KHeader's shifts and masks.
template <class V>
struct XK {
  using I = typename V::I;
  I sc03, sc47, mn03, mn47;  // lane j: the 6-bit scales (mins) of sub-blocks 0..3, 4..7 of row j
  XK(const uint8_t* b, int64_t gb) {
    const I u0 = V::load(b + 32, gb), u1 = V::load(b + 64, gb), u2 = V::load(b + 96, gb);
    const I low6 = V::bytes(0x3f), low4 = V::bytes(0x0f), low2 = V::bytes(0x03);
    sc03 = V::and_(u0, low6);
    mn03 = V::and_(u1, low6);
    sc47 = V::or_(V::and_(u2, low4), V::shl32(V::and_(V::shr32(u0, 6), low2), 4));
    mn47 = V::or_(V::and_(V::shr32(u2, 4), low4), V::shl32(V::and_(V::shr32(u1, 6), low2), 4));
  }
  // lane j: byte s of row j's four (s = 0..3) as the i16 pair (v, v)
  static I pair(I v, int s) {
    const char z = static_cast<char>(0x80);
    auto c = [&](int d) { return static_cast<char>(4 * d + s); };
    return V::shuffle(v, _mm_setr_epi8(c(0), z, c(0), z, c(1), z, c(1), z, c(2), z, c(2), z, c(3), z, c(3), z));
  }
  I sc(int s) const { return pair(s < 4 ? sc03 : sc47, s & 3); }
  // lane j: sub-block s's scale of row j as an i32
  I sc32(int s) const { return V::and_(V::shr32(s < 4 ? sc03 : sc47, 8 * (s & 3)), V::i32(0xff)); }
  I mn(int s) const { return pair(s < 4 ? mn03 : mn47, s & 3); }
  // lane j: the mins of sub-blocks s and s + 1 (s even) of row j as an i16 pair
  I mn2(int s) const {
    const char z = static_cast<char>(0x80);
    auto c = [&](int d, int k) { return static_cast<char>(4 * d + (s & 3) + k); };
    return V::shuffle(s < 4 ? mn03 : mn47,
                      _mm_setr_epi8(c(0, 0), z, c(0, 1), z, c(1, 0), z, c(1, 1), z, c(2, 0), z, c(2, 1), z, c(3, 0), z, c(3, 1), z));
  }
};

// mr rows of x against a group of 8 regrouped Q4_K or Q5_K rows (Q5_K: qh chunk c, bytes
// 4c .. 4c + 3 of its 32, at 128 + 32c + 4j, bit s the fifth bit of sub-block s; qs from 384),
// one row per lane (V16: and the group gb bytes on). Without VNNI, per super-block and output:
// the exact i32 sums of mins * x's sums and of sc * q * x, then acc = fma(mins, -dmin * d_x,
// acc) and acc = fma(sum, d * d_x, acc); a sub-block's chunks add up in i16 first, as many as
// fit (a maddubs lane is at most 2 * 15 * 127 = 3810 for Q4_K: 8 chunks, 2 * 31 * 127 = 7874
// for Q5_K: 4 chunks), then madd by the scales. With VNNI a sub-block's chunks add up in i32
// (dot4) and the super-block in float: part = mins * -dmin, part = fma(sum_s, d * sc_s, part)
// for each sub-block s (d * sc_s is exact: an f16 times 6 bits), acc = fma(part, d_x, acc).
// (An i32 multiply by the scales, vpmulld, is two micro-ops on Intel: the float steps made the
// Q4_K matrices of the 1.1B Q4_K_M shape 1.14-1.20x faster against 512 rows of x on the
// AVX-512 machine, one row of x the same.)
// INT (choices.int_steps, CPUs other than Intel's): with VNNI too the exact i32 sums, and the
// same two FMAs as without VNNI, so the same bits: a sub-block's dot4 chains, then one vpmulld
// by its scales (one micro-op on Zen 4) and an add. On Zen 4 that is the cheaper step: a
// standalone loop of one sub-block (64 512-bit dot4 for 8 rows of x, then the step per row)
// ran 61 TSC cycles with cvt + fma, 55 with vpmulld + add and 56 with no step at all; 512 rows
// of x against 11264 x 2048 Q4_K (the 1.1B shape's gate and up projections), one thread,
// alternating builds, 142.5 -> 155.2 GMAC/s (2 threads 284.9 -> 306.7).
// With IN_PLACE the even sub-blocks' scales are taken times 16, so the sum is 16x the exact
// one, and d / 16 (exact) meets it: the same product. No step overflows: 8 sub-blocks of at
// most 32 * 240 * 127 * 63 (Q4_K, either way) or 32 * 31 * 127 * 63 (Q5_K) stay below 2^29.
// Q5_K: sub-block s's chunk c of the rows (V16: both groups'), each weight's 5 bits as a byte
// (the low nibble, or the high one, of qs chunk 8 (s / 2) + c and bit s of qh chunk c)
template <class V>
inline typename V::I q5_chunk(const uint8_t* b, int64_t gb, int s, int c) {
  const typename V::I v = V::load(b + 384 + 32 * (8 * (s >> 1) + c), gb);
  const typename V::I w = !(s & 1) ? V::and_(v, V::bytes(0x0F)) : move_bits(v, 4, 0, 4);
  return V::or_(w, move_bits(V::load(b + 128 + 32 * c, gb), s, 4, 1));
}

template <class V, int QT, int mr, bool X_COPY, bool INT, bool PRE>  // (X_COPY, INT, PRE false unless given: q8_repack.h)
void tile_xk(const Q8& a, int64_t m0, const uint8_t* grp, int64_t group_bytes, int valid, float* y, int64_t ldy,
             const uint8_t* end, const uint8_t* plain) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t BYTES = 8 * Layout<QT>::bytes;
  constexpr bool FIFTH = QT == Q5_K, TWO = !std::is_same_v<V, V8>;
  constexpr int QS_AT = FIFTH ? 384 : 128, RUN = FIFTH ? 4 : 8;  // chunks summed in i16
  constexpr bool DOT4 = VNNI || TWO;  // a sub-block's chunks in dot4 chains, else in maddubs runs
  constexpr bool FLOAT_STEPS = DOT4 && !INT;  // the sub-blocks' sums scaled in float (above)
  // Q4_K with dot4: an odd sub-block's high nibbles stay in place (16 q, one AND, no shift);
  // float steps divide its d * sc by 16, int steps multiply the even ones' scales by 16 (both
  // exact), so the products are the same
  constexpr bool IN_PLACE = DOT4 && !FIFTH;
  F acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = V::zerof();
  // V16, more than one row of x, where the CPU takes it (choices.x_copy): the tile's x bytes of
  // a super-block copied side by side, so that one base register addresses them all
  constexpr bool XCOPY = X_COPY && TWO && mr > 1;
  alignas(64) int8_t xt[XCOPY ? mr : 1][256];
  const int64_t FAR = l2_ahead_for<QT>(a.K) / BYTES * BYTES;  // a super-block's place in a group further on
  // the super-blocks whose weights FAR bytes on are still in the chunk (none without the prefetch)
  const int64_t far_g = mr > 1 ? 0 : far_blocks(grp, TWO ? group_bytes : 0, FAR, BYTES, end, a.G);
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = grp + g * BYTES;
    const int64_t gb = opaque(group_bytes);
    // One row of x: the prefetches sub-block by sub-block (prefetch_eighth, below), where
    // there is the one to L2 (choices.l2_ahead); without it none.
    if constexpr (mr > 1 && !PRE)
      for (int64_t o = 0; o < BYTES; o += 64) {
        prefetch(b + 2 * BYTES + o);
        if constexpr (TWO) prefetch(b + gb + 2 * BYTES + o);
      }
    if constexpr (XCOPY)
      for (int i = 0; i < mr; ++i)
        for (int o = 0; o < 256; o += 64) _mm512_store_si512(xt[i] + o, _mm512_loadu_si512(a.q + (m0 + i) * a.K + 256 * g + o));
    const XK<V> h(b, gb);
    const F d = V::halves(b, gb), ndmin = V::sub(V::zerof(), V::halves(b + 16, gb));
    F part[FLOAT_STEPS ? mr : 1];  // this super-block's sum, in units of d_x
    // the offsets: sum over s of mn_s * x's sums of 32, two sub-blocks a dot2 (with x's sums of
    // 16, one a dot2, 5632 x 2048 Q4_K against 512 rows of x ran at 306 GMAC/s, now 317-321)
    for (int i = 0; i < mr; ++i) {
      const int16_t* p = a.p + (m0 + i) * a.lp + a.K / 16 + 8 * g;
      I ms = V::zero();
#pragma GCC unroll 4
      for (int s = 0; s < 8; s += 2) {
        int32_t pair;
        std::memcpy(&pair, p + s, 4);
        ms = V::dot2(ms, h.mn2(s), V::i32(pair));
      }
      if constexpr (FLOAT_STEPS) part[i] = V::mul(V::cvt(ms), ndmin);
      else acc[i] = V::fmadd(V::cvt(ms), V::mul(ndmin, V::f32(a.d[(m0 + i) * a.G + g])), acc[i]);
    }
    I isum[FLOAT_STEPS ? 1 : mr];  // the exact sums (maddubs and int steps; 16x with IN_PLACE)
    if constexpr (!FLOAT_STEPS)
      for (int i = 0; i < mr; ++i) isum[i] = V::zero_idiom();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      if (g < far_g) prefetch_eighth<TWO, BYTES>(b, gb, FAR, s);
      auto chunk = [&](int c) {  // sub-block s's chunk c of the rows: their unsigned values
        if constexpr (PRE) return V::whole(plain + sizeof(I) * (64 * g + 8 * s + c));  // (V16: PLAIN_BYTES a super-block)
        if constexpr (FIFTH) return q5_chunk<V>(b, gb, s, c);
        const I v = V::load(b + QS_AT + 32 * (8 * (s >> 1) + c), gb);
        return !(s & 1) ? V::and_(v, V::bytes(0x0F)) : IN_PLACE ? V::and_(v, V::bytes(0xF0)) : move_bits(v, 4, 0, 4);
      };
      auto x4 = [&](int i, int c) {  // x's 4 bytes against chunk c, in every lane
        int32_t xv;
        std::memcpy(&xv, a.q + (m0 + i) * a.K + 256 * g + 32 * s + 4 * c, 4);
        return V::i32(xv);
      };
      if constexpr (!DOT4) {  // maddubs: a sub-block's chunks in i16 runs, then madd by the scales
        const I sc = h.sc(s);
        for (int c0 = 0; c0 < 8; c0 += RUN) {
          I t[mr];
          for (int i = 0; i < mr; ++i) t[i] = V::zero();
          for (int c = c0; c < c0 + RUN; ++c) {
            const I w = chunk(c);
            // (kept: else GCC takes all the products first, spilling them)
            for (int i = 0; i < mr; ++i) t[i] = kept(_mm256_add_epi16(t[i], _mm256_maddubs_epi16(w, x4(i, c))));
          }
          for (int i = 0; i < mr; ++i) isum[i] = kept(V::add(isum[i], _mm256_madd_epi16(t[i], sc)));
        }
      } else {  // a sub-block's exact i32 sums, times its scales: two chains per row of x up to
        // 4 rows of one group or one row of two, one for more (enough chains; two would not
        // fit the registers)
        constexpr int CH = mr >= 6 || (TWO && mr > 1) ? 1 : 2;
        I t[CH][mr];
        for (int i = 0; i < mr; ++i)
          for (int k = 0; k < CH; ++k) t[k][i] = V::zero_idiom();
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          const I w = chunk(c);
          for (int i = 0; i < mr; ++i)
            t[c % CH][i] = V::dot4x(t[c % CH][i], w, (XCOPY ? xt[i] : a.q + (m0 + i) * a.K + 256 * g) + 32 * s + 4 * c);
        }
        if constexpr (INT) {
          const I sc = IN_PLACE && !(s & 1) ? V::shl32(h.sc32(s), 4) : h.sc32(s);
          for (int i = 0; i < mr; ++i) {
            isum[i] = V::add(isum[i], V::mullo(CH == 2 ? V::add(t[0][i], t[1][i]) : t[0][i], sc));
            keep_in_register(isum[i]);
          }
          continue;
        }
        const F dsc = V::mul(IN_PLACE && (s & 1) ? V::mul(d, V::f32(1.0f / 16)) : d, V::cvt(h.sc32(s)));
        for (int i = 0; i < mr; ++i) {
          part[i] = V::fmadd(V::cvt(CH == 2 ? V::add(t[0][i], t[1][i]) : t[0][i]), dsc, part[i]);
          keep_in_register(part[i]);
        }
      }
    }
    for (int i = 0; i < mr; ++i) {
      const F dx = V::f32(a.d[(m0 + i) * a.G + g]);
      if constexpr (FLOAT_STEPS) acc[i] = V::fmadd(part[i], dx, acc[i]);
      else acc[i] = V::fmadd(V::cvt(isum[i]), V::mul(IN_PLACE ? V::mul(d, V::f32(1.0f / 16)) : d, dx), acc[i]);
    }
  }
  for (int i = 0; i < mr; ++i) V::store(y + i * ldy, acc[i], valid);
}

// Q3_K and Q6_K regrouped: Q3_K at load (minerva/kernels/repack.py) for 8-bit activations;
// Q6_K, and a Q3_K matrix left in the GGML layout (one that is also the embedding), panel by
// panel at run time with PANELS_FROM or more rows of x (regroup_panel, into a buffer of the
// work item's; Q6_K's units of 16 rows, regrouped at load, likewise: q6_unit_to_panels). Each group of 8 rows keeps its super-block's fields in the GGML order, the 8
// rows' chunk q of a field (its bytes 4q .. 4q + 3) of row j at 32q + 4j, and the kernel below
// takes one weight row per lane:
// - Q6_K: ql[1024] | qh[512] | scales[128] | d[8] (f16). Sub-block s = 4 part + t (as
//   W8<Q6_K>) takes, for its chunk c (elements 4c .. 4c + 3), the nibble t >> 1 of ql chunk
//   16 part + 8 (t & 1) + c and bits 2t, 2t + 1 of qh chunk 8 part + c.
// - Q3_K: hmask[256] | qs[512] | scales[96] (the 12 bytes of 6-bit scales as stored) | d[8].
//   Sub-block s takes bits 2 (s & 3), +1 of qs chunk 8 (s >> 2) + c and bit s of hmask chunk c.
// - Q2_K (at load, as Q3_K): scales[128] (the 16 bytes of 4-bit scales and mins as stored) |
//   qs[512] | d[8] | dmin[8]. Sub-block s takes bits 2 (s & 3), +1 of qs chunk 8 (s >> 2) + c.
// Sub-block s's chunks 0..3 take scale 2s, 4..7 scale 2s + 1.
// With one row of x this takes fewer instructions per weight than `row1` on the GGML layout
// (no horizontal sums, one broadcast of x's 4 bytes for 8 or 16 rows). Zen 4, 512 x 2048 from
// L2, one thread: Q3_K 54 GMAC/s against 35, Q6_K 44 against 35, Q2_K 60 against 37
// (benchmarks/int8_kernels.py; Q2_K from memory, 65536 rows, 2 threads: 139 against 80).
// From memory the hardware prefetchers do not follow its order of reads (Q6_K's ql and qh a
// kilobyte apart in each super-block): without the software prefetch below a 65536 x 2048
// Q6_K matrix streamed at 14 GB/s against 41-52 for the GGML layout's `row1`, and with it the
// 1.1B shape's Q6_K matrices (22 layers of Q/K/V, output, gate/up and down in turn, 2 threads)
// still took 26-29 ms against 23-26, so one row of x reads Q6_K in the GGML layout or in
// units read front to back (q8_q6k.cpp), not in these groups. Q3_K,
// whose GGML kernel is bound by its instructions, gains: greedy decode of the 1.1B Q3_K_M
// shape, the two ways alternating in one process, medians: 16.90 against 17.68 ms a token
// where a read probe taken with each pair gave under 45 GB/s (122 pairs), and (with two groups
// at a time) 14.45 against 16.56 where it gave 45 or more (22 pairs). Q2_K likewise: the 1.1B
// Q2_K shape 14.07 against 15.46 ms (47 pairs under 45 GB/s), 12.43 against 15.10 (17 over).
template <int QT>
struct Panel;
template <>
struct Panel<Q6_K> {
  static constexpr int64_t QS_AT = 0, HI_AT = 1024, SC_AT = 1536, D_AT = 1664, BYTES = 1680;
  static constexpr int BIAS = 5;  // the stored values are q + 32
};
template <>
struct Panel<Q3_K> {
  static constexpr int64_t HI_AT = 0, QS_AT = 256, SC_AT = 768, D_AT = 864, BYTES = 880;
  static constexpr int BIAS = 2;  // q + 4
};
template <>
struct Panel<Q2_K> {
  static constexpr int64_t SC_AT = 0, QS_AT = 128, D_AT = 640, DMIN_AT = 656, BYTES = 672;
  static constexpr int BIAS = 0;  // q unsigned; the mins meet x's sums apart
};
static_assert(Panel<Q6_K>::BYTES == 8 * Layout<Q6_K>::bytes && Panel<Q3_K>::BYTES == 8 * Layout<Q3_K>::bytes &&
                  Panel<Q2_K>::BYTES == 8 * Layout<Q2_K>::bytes,
              "a regrouped super-block holds the 8 GGML blocks' bytes");

// the GF(2) matrix of an affine transform that moves each byte's n bits from bit `from` to bit
// `to` and clears the others (row i, byte 7 - i of the qword, selects the source of result bit i)
constexpr int64_t bit_matrix(int from, int to, int n) {
  uint64_t m = 0;
  for (int k = 0; k < n; ++k) m |= (1ULL << (from + k)) << (8 * (7 - (to + k)));
  return static_cast<int64_t>(m);
}

// mr rows of x against the 8 rows (V16: and the group gb bytes on). Per super-block and output
// the exact i32 sum of sc_j * (the stored values' dot product with x over the 16 elements of
// scale j, minus 2^BIAS times x's sum over them), then acc = fma(sum, d * d_x, acc): the same
// integer as `row1` and `tile` give for Q3_K and Q6_K, so a row's result is the same at one row
// of x and at many, regrouped or not. Q2_K (no bias) first takes acc = fma(mins . x's sums of
// 16, -dmin * d_x, acc), as tile_xk does: within float32 rounding of its GGML layout's results
// (which keep 8 lanes an output), and the same at one row of x and at many. The 4 chunks of a scale add up in i32 (dot4), from the
// bias on, before one multiply by the scale. No step overflows: a scale's dot product is at
// most 16 * 63 * 127, times |sc| <= 128, 16 of them: < 2^28. With the bias as the chains' start,
// a 2048 x 5632 Q6_K matrix (the 1.1B shape's down projection) against 512 rows of x went from
// 272-275 to 283-288 GMAC/s (AVX-512 machine, 2 threads, alternating runs), where a dot2 of
// scale pairs against x's sums of 16 had taken it apart.
// `end` (the end of the thread's run of a matrix regrouped at load; null for a run-time
// panel, already in cache): the weights are prefetched, with more than one row of x as
// tile_xk does, with one into L2 PANEL_L2_AHEAD bytes ahead on every CPU (above; Q3_K
// 65536 x 2048, 2 threads, one group at a time: 44.9, 47.1, 46.4, 46.0 GB/s 16, 32, 64 and
// 128 KB ahead). With one row of x and GFNI each high-bit field takes one affine transform
// instead of a shift and a mask (a standalone copy of the Q6_K loop, 512 x 2048 from L2, one
// thread, Zen 4: 9.8 TSC cycles per row and super-block against 10.5).
constexpr int64_t PANEL_L2_AHEAD = 32768;
// Sub-block s's chunk c (0..7) of the rows (V16: both groups'), each weight's stored value a
// byte (Q6_K q + 32, Q3_K q + 4, Q2_K q), as tile_panel takes them; with AFFINE each high-bit
// field by one GFNI affine transform
template <class V, int QT, bool AFFINE = false>
inline typename V::I panel_chunk(const uint8_t* b, int64_t gb, int s, int c) {
  using I = typename V::I;
  using P = Panel<QT>;
  auto bits = [](I v, int from, int to, int n) {
    if constexpr (AFFINE) return V::affine(v, bit_matrix(from, to, n));
    else return move_bits(v, from, to, n);
  };
  const int part = s >> 2, t = s & 3;
  if constexpr (QT == Q6_K) {
    const I v = V::load(b + P::QS_AT + 32 * (16 * part + 8 * (t & 1) + c), gb);
    const I hb = bits(V::load(b + P::HI_AT + 32 * (8 * part + c), gb), 2 * t, 4, 2);
    return V::or_((t >> 1) ? move_bits(v, 4, 0, 4) : V::and_(v, V::bytes(0x0F)), hb);
  } else if constexpr (QT == Q3_K) {
    const I v = V::load(b + P::QS_AT + 32 * (8 * part + c), gb);
    const I hb = bits(V::load(b + P::HI_AT + 32 * c, gb), s, 2, 1);
    return V::or_(t ? move_bits(v, 2 * t, 0, 2) : V::and_(v, V::bytes(3)), hb);
  } else {
    const I v = V::load(b + P::QS_AT + 32 * (8 * part + c), gb);
    return t ? move_bits(v, 2 * t, 0, 2) : V::and_(v, V::bytes(3));
  }
}

template <class V, int QT, int mr, bool PRE>
void tile_panel(const Q8& a, int64_t m0, const uint8_t* grp, int64_t group_bytes, int valid, float* y, int64_t ldy,
                const uint8_t* end, const uint8_t* plain) {
  using I = typename V::I;
  using F = typename V::F;
  using P = Panel<QT>;
  constexpr int64_t BYTES = P::BYTES;
  constexpr bool TWO = !std::is_same_v<V, V8>, MINS = QT == Q2_K;
#if defined(__GFNI__)
  constexpr bool AFFINE = mr == 1;
#else
  constexpr bool AFFINE = false;
#endif
  // Without VNNI a scale's chunks go in maddubs runs summed in i16, RUN chunks a run (a pair of
  // products at most 2 * 63 * 127 for Q6_K's 6-bit values, 2 * 7 * 127 for Q3_K's), then one
  // madd by the scale, as tile_xk does, where dot4 is a maddubs, a madd by ones and an add a
  // chunk and the scale an i32 multiply; the bias's part is taken apart (above the loop). The
  // same exact i32 sum, so the same bits. x's sums of 16 (the bias's part, Q2_K's mins) are
  // broadcast by their loads (V::i32_at), where a copy through a register had cost a move and a
  // shuffle each: Zen 4, MINERVA_ISA=avx2, 2 threads, 5632 x 2048 at 512 rows of x
  // (benchmarks/kernel_ab.py): Q6_K 1.096x, Q3_K 1.071x, Q2_K 1.024x (one row, 2048 x 5632:
  // 1.067x); the AVX-512 build's Q2_K the same (0.993x).
  constexpr bool RUNS = !VNNI;
  constexpr int RUN = QT == Q6_K ? 2 : 4;
  static_assert(!RUNS || !TWO, "V16 needs VNNI");
  static_assert(RUN * 2 * (QT == Q6_K ? 63 : QT == Q3_K ? 7 : 3) * 127 <= 32767, "a run's i16 sums do not saturate");
  // shuffles: byte b of each lane to the high (low) byte of both its i16 halves; bytes 0, 1 and
  // 2, 3 of each lane to the high bytes of its halves
  constexpr char z = static_cast<char>(0x80);
  [[maybe_unused]] const __m128i scale_high[4] = {
      _mm_setr_epi8(z, 0, z, 0, z, 4, z, 4, z, 8, z, 8, z, 12, z, 12), _mm_setr_epi8(z, 1, z, 1, z, 5, z, 5, z, 9, z, 9, z, 13, z, 13),
      _mm_setr_epi8(z, 2, z, 2, z, 6, z, 6, z, 10, z, 10, z, 14, z, 14), _mm_setr_epi8(z, 3, z, 3, z, 7, z, 7, z, 11, z, 11, z, 15, z, 15)};
  [[maybe_unused]] const __m128i scale_low[4] = {
      _mm_setr_epi8(0, z, 0, z, 4, z, 4, z, 8, z, 8, z, 12, z, 12, z), _mm_setr_epi8(1, z, 1, z, 5, z, 5, z, 9, z, 9, z, 13, z, 13, z),
      _mm_setr_epi8(2, z, 2, z, 6, z, 6, z, 10, z, 10, z, 14, z, 14, z), _mm_setr_epi8(3, z, 3, z, 7, z, 7, z, 11, z, 11, z, 15, z, 15, z)};
  [[maybe_unused]] const __m128i pair01_high = _mm_setr_epi8(z, 0, z, 1, z, 4, z, 5, z, 8, z, 9, z, 12, z, 13);
  [[maybe_unused]] const __m128i pair23_high = _mm_setr_epi8(z, 2, z, 3, z, 6, z, 7, z, 10, z, 11, z, 14, z, 15);
  F acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = V::zerof();
  const int64_t FAR = end == nullptr ? 0 : PANEL_L2_AHEAD / BYTES * BYTES;
  const int64_t far_g = mr > 1 ? 0 : far_blocks(grp, TWO ? group_bytes : 0, FAR, BYTES, end, a.G);
  // Intel's choice (choices.l2_ahead): the prefetches sub-block by sub-block (prefetch_eighth);
  // elsewhere the L2 prefetch as measured on Zen 4 (above), all at the super-block's start
  const bool spread = l2_ahead_for<QT>(a.K) > 0;
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = grp + g * BYTES;
    const int64_t gb = opaque(group_bytes);
    if (g < far_g && !spread)
      for (int64_t o = 0; o < BYTES; o += 64) {
        prefetch_l2(b + FAR + o);
        if constexpr (TWO) prefetch_l2(b + gb + FAR + o);
      }
    if (mr > 1 && end != nullptr)
      for (int64_t o = 0; o < BYTES; o += 64) {
        prefetch(b + 2 * BYTES + o);
        if constexpr (TWO) prefetch(b + gb + 2 * BYTES + o);
      }
    // lane j of scales chunk k: row j's scales 4k .. 4k + 3, as signed bytes (loaded where
    // used: kept in registers they crowd out the sums). Q3_K's are decoded here first, for all
    // rows at once, as GGML does for one: the low 4 bits from bytes 0..7 (nibble k >> 1 of u0
    // or u1), the high 2 from bits 2k, 2k + 1 of u2, minus 32.
    [[maybe_unused]] alignas(64) uint8_t sc3[QT == Q3_K ? 4 : 1][sizeof(I)];
    if constexpr (QT == Q3_K) {
      const I u0 = V::load(b + P::SC_AT, gb), u1 = V::load(b + P::SC_AT + 32, gb), u2 = V::load(b + P::SC_AT + 64, gb);
      const I lo = V::bytes(0x0F), hi = V::bytes(0x30), bias = V::bytes(32);
      V::put(sc3[0], V::sub8(V::or_(V::and_(u0, lo), V::and_(V::shl32(u2, 4), hi)), bias));
      V::put(sc3[1], V::sub8(V::or_(V::and_(u1, lo), V::and_(V::shl32(u2, 2), hi)), bias));
      V::put(sc3[2], V::sub8(V::or_(V::and_(V::shr32(u0, 4), lo), V::and_(u2, hi)), bias));
      V::put(sc3[3], V::sub8(V::or_(V::and_(V::shr32(u1, 4), lo), V::and_(V::shr32(u2, 2), hi)), bias));
    }
    auto scales = [&](int k) {
      if constexpr (QT == Q3_K) return V::whole(sc3[k]);
      else return V::load(b + P::SC_AT + 32 * k, gb);
    };
    I isum[mr];
    for (int i = 0; i < mr; ++i) isum[i] = V::zero();
    // Without VNNI (RUNS): the bias's part of the sum, -2^BIAS * sum over j of sc_j * x's sum
    // over scale j's 16 elements, two scales a dot2, starts the sum
    if constexpr (RUNS && !MINS)
      for (int i = 0; i < mr; ++i) {
        I bs = V::zero();
        for (int k = 0; k < 4; ++k) {  // scales 4k .. 4k + 3, sign-extended to i16 pairs
          const I sc = scales(k), lo = V::sar16(V::shuffle(sc, pair01_high), 8), hi = V::sar16(V::shuffle(sc, pair23_high), 8);
          const int32_t* xs = reinterpret_cast<const int32_t*>(a.p + (m0 + i) * a.lp + 16 * g + 4 * k);
          bs = V::dot2(V::dot2(bs, lo, V::i32_at(xs)), hi, V::i32_at(xs + 1));
        }
        isum[i] = V::sub(V::zero(), V::shl32(bs, P::BIAS));
      }
    // the bias, -2^BIAS * x's sum over a scale's 16 elements, starts that scale's dot product
    // (a broadcast from memory: no arithmetic in the loop, where a multiply by the scales per
    // pair of them was)
    [[maybe_unused]] alignas(32) int32_t bias[MINS || RUNS ? 1 : mr][16];
    if constexpr (!MINS && !RUNS)
      for (int i = 0; i < mr; ++i) {
        const int16_t* p = a.p + (m0 + i) * a.lp + 16 * g;
        for (int k = 0; k < 2; ++k) {
          const __m256i v = _mm256_slli_epi32(_mm256_cvtepi16_epi32(load128(reinterpret_cast<const uint8_t*>(p + 8 * k))), P::BIAS);
          _mm256_store_si256(reinterpret_cast<__m256i*>(bias[i] + 8 * k), _mm256_sub_epi32(_mm256_setzero_si256(), v));
        }
      }
    // Q2_K's mins first: the exact i32 sum of the 16 mins (high nibbles of the scale bytes)
    // times x's sums of 16, two a dot2, then acc = fma(that, -dmin * d_x, acc)
    if constexpr (MINS) {
      const char z = static_cast<char>(0x80);
      const __m128i pair01 = _mm_setr_epi8(0, z, 1, z, 4, z, 5, z, 8, z, 9, z, 12, z, 13, z);
      const __m128i pair23 = _mm_setr_epi8(2, z, 3, z, 6, z, 7, z, 10, z, 11, z, 14, z, 15, z);
      I ms[mr];
      for (int i = 0; i < mr; ++i) ms[i] = V::zero();
      for (int k = 0; k < 4; ++k) {  // the mins of scales 4k .. 4k + 3
        const I mn = V::and_(V::shr32(scales(k), 4), V::bytes(0x0F));
        const I lo = V::shuffle(mn, pair01), hi = V::shuffle(mn, pair23);
        for (int i = 0; i < mr; ++i) {
          const int32_t* xs = reinterpret_cast<const int32_t*>(a.p + (m0 + i) * a.lp + 16 * g + 4 * k);  // x's sums, a pair each
          ms[i] = V::dot2(V::dot2(ms[i], lo, V::i32_at(xs)), hi, V::i32_at(xs + 1));
        }
      }
      const F ndmin = V::sub(V::zerof(), V::halves(b + P::DMIN_AT, gb));
      for (int i = 0; i < mr; ++i) acc[i] = V::fmadd(V::cvt(ms[i]), V::mul(ndmin, V::f32(a.d[(m0 + i) * a.G + g])), acc[i]);
    }
    // two dot product chains per row of x up to 4 rows of one group, one for more (enough chains)
    constexpr int CH = mr >= 6 || TWO ? 1 : 2;
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      if (g < far_g && spread) prefetch_eighth<TWO, BYTES>(b, gb, FAR, s);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * s + h, byte = j & 3;  // the scale: byte `byte` of each lane of chunk j >> 2, with its sign
        auto stored = [&](int c) {  // the stored values of the 8 (16) rows' chunk c of sub-block s
          if constexpr (PRE) return V::whole(plain + sizeof(I) * (64 * g + 8 * s + c));  // (V16: PLAIN_BYTES a super-block)
          else return panel_chunk<V, QT, AFFINE>(b, gb, s, c);
        };
        if constexpr (RUNS) {  // maddubs runs of RUN chunks in i16, then a madd by the scale
          // the scale as i16 in both halves of each lane: sign-extended (Q2_K: its low nibble)
          const I sc = MINS ? V::and_(V::shuffle(scales(j >> 2), scale_low[byte]), _mm256_set1_epi16(0x0F))
                            : V::sar16(V::shuffle(scales(j >> 2), scale_high[byte]), 8);
#pragma GCC unroll 4
          for (int c0 = 4 * h; c0 < 4 * h + 4; c0 += RUN) {
            I run[mr];
            for (int i = 0; i < mr; ++i) run[i] = V::zero();
            for (int c = c0; c < c0 + RUN; ++c) {
              const I w = stored(c);
              for (int i = 0; i < mr; ++i) {
                const I xb = V::i32_at(reinterpret_cast<const int32_t*>(a.q + (m0 + i) * a.K + 256 * g + 32 * s + 4 * c));
                run[i] = kept(_mm256_add_epi16(run[i], _mm256_maddubs_epi16(w, xb)));
              }
            }
            for (int i = 0; i < mr; ++i) isum[i] = kept(V::add(isum[i], _mm256_madd_epi16(run[i], sc)));
          }
          continue;
        }
        I dot[CH][mr];
        for (int i = 0; i < mr; ++i) {
          if constexpr (MINS) dot[0][i] = V::zero();
          else dot[0][i] = V::i32_at(&bias[i][j]);
          if constexpr (CH == 2) dot[1][i] = V::zero();
        }
#pragma GCC unroll 4
        for (int c = 4 * h; c < 4 * h + 4; ++c) {
          const I w = stored(c);
          for (int i = 0; i < mr; ++i)
            dot[c % CH][i] = V::dot4x(dot[c % CH][i], w, a.q + (m0 + i) * a.K + 256 * g + 32 * s + 4 * c);
        }
        const I sc = MINS ? V::shr32(V::shl32(scales(j >> 2), 28 - 8 * byte), 28)  // Q2_K: the low nibble
                          : V::sar32(V::shl32(scales(j >> 2), 24 - 8 * byte), 24);
        for (int i = 0; i < mr; ++i) {
          isum[i] = V::add(isum[i], V::mullo(CH == 2 ? V::add(dot[0][i], dot[CH - 1][i]) : dot[0][i], sc));
          keep_in_register(isum[i]);
        }
      }
    }
    const F d = V::halves(b + P::D_AT, gb);
    for (int i = 0; i < mr; ++i) acc[i] = V::fmadd(V::cvt(isum[i]), V::mul(d, V::f32(a.d[(m0 + i) * a.G + g])), acc[i]);
  }
  for (int i = 0; i < mr; ++i) V::store(y + i * ldy, acc[i], valid);
}

// 8 rows' dwords d0 .. d7 (r[j] = row j's) to r[q] = dword q of rows 0 .. 7
inline void transpose8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);      // rows 2k, 2k+1: dwords 0, 1 | 4, 5
    t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);  // 2, 3 | 6, 7
  }
  for (int k = 0; k < 2; ++k) {  // rows 4k .. 4k + 3
    u[4 * k] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);      // dword 0 | 4
    u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);  // 1 | 5
    u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);  // 2 | 6
    u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);  // 3 | 7
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
    r[q + 4] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
  }
}

// `dwords` dwords of 8 rows (from src[j]) side by side, chunk q of row j at dst + 32q + 4j
inline void interleave_dwords(const uint8_t* const src[8], int dwords, uint8_t* dst) {
  for (int q0 = 0; q0 < dwords; q0 += 8) {
    __m256i r[8];
    for (int j = 0; j < 8; ++j)
      r[j] = dwords - q0 >= 8 ? load256(src[j] + 4 * q0) : _mm256_castsi128_si256(load128(src[j] + 4 * q0));
    transpose8x8(r);
    for (int q = 0; q < std::min(8, dwords - q0); ++q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * (q0 + q)), r[q]);
  }
}

// Q3_K or Q6_K rows rows[0..7] (GGML blocks) to tile_panel's layout, G super-blocks, at `out`
template <int QT>
inline void regroup_panel(const uint8_t* const rows[8], int64_t G, uint8_t* out) {
  using P = Panel<QT>;
  constexpr int64_t bytes = Layout<QT>::bytes;
  for (int64_t g = 0; g < G; ++g) {
    uint8_t* o = out + g * P::BYTES;
    auto fields = [&](int64_t at, int dwords, uint8_t* dst) {  // `dwords` dwords from byte `at` of each block
      const uint8_t* src[8];
      for (int j = 0; j < 8; ++j) src[j] = rows[j] + g * bytes + at;
      interleave_dwords(src, dwords, dst);
    };
    if constexpr (QT == Q6_K) {
      fields(0, 32, o + P::QS_AT);    // ql
      fields(128, 16, o + P::HI_AT);  // qh
      fields(192, 4, o + P::SC_AT);   // scales
    } else {
      fields(0, 8, o + P::HI_AT);    // hmask
      fields(32, 16, o + P::QS_AT);  // qs
      for (int j = 0; j < 8; ++j)    // the scales' 12 bytes (3 dwords: interleave_dwords would read 16)
        for (int q = 0; q < 3; ++q) std::memcpy(o + P::SC_AT + 32 * q + 4 * j, rows[j] + g * bytes + 96 + 4 * q, 4);
    }
    for (int j = 0; j < 8; ++j) std::memcpy(o + P::D_AT + 2 * j, rows[j] + g * bytes + bytes - 2, 2);  // d
  }
}

// `units` groups of a panel or of a matrix regrouped at load (V16: pairs of groups, gb bytes
// apart) decoded once for the tiles' PRE (tile_xk's for Q5_K, tile_panel's for Q2_K, Q3_K,
// Q6_K), every chunk as q5_chunk or panel_chunk gives it: unit u's super-block g, sub-block s,
// chunk c at out + sizeof(I) * (64 * (u * G + g) + 8 * s + c)
template <class V, int QT>
void decode_once(const uint8_t* groups, int64_t gb, int64_t G, int64_t units, uint8_t* out) {
  constexpr int64_t R = sizeof(typename V::I), STEP = R / 32, BYTES = 8 * Layout<QT>::bytes;  // bytes a chunk, groups a unit
  for (int64_t u = 0; u < units; ++u)
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = groups + STEP * u * gb + g * BYTES;
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s)
        for (int c = 0; c < 8; ++c) {
          uint8_t* at = out + R * (64 * (u * G + g) + 8 * s + c);
          if constexpr (QT == Q5_K) V::put(at, q5_chunk<V>(b, gb, s, c));
          else V::put(at, panel_chunk<V, QT>(b, gb, s, c));
        }
    }
}

// a unit of 16 Q6_K rows regrouped at load (q8_q6k.cpp) as two groups of tile_panel's layout,
// the second gb bytes after the first: the first and the second 32 bytes of each 64-byte chunk
void q6_unit_to_panels(const uint8_t* unit, int64_t G, int64_t gb, uint8_t* out) {
  using P = Panel<Q6_K>;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* u = unit + g * 2 * P::BYTES;
    uint8_t* o = out + g * P::BYTES;
    auto chunk = [&](const uint8_t* from, int64_t to) {
      std::memcpy(o + to, from, 32);
      std::memcpy(o + gb + to, from + 32, 32);
    };
    for (int p = 0; p < 2; ++p)
      for (int c = 0; c < 8; ++c) {
        const uint8_t* at = u + 1536 * p + 192 * c;
        chunk(at, P::QS_AT + 32 * (16 * p + c));
        chunk(at + 64, P::QS_AT + 32 * (16 * p + 8 + c));
        chunk(at + 128, P::HI_AT + 32 * (8 * p + c));
      }
    for (int k = 0; k < 4; ++k) chunk(u + 3072 + 64 * k, P::SC_AT + 32 * k);
    std::memcpy(o + P::D_AT, u + 3328, 16);
    std::memcpy(o + gb + P::D_AT, u + 3344, 16);
  }
}

// `groups` groups of tile_panel's layout at `panel`, gb bytes apart, against all M rows of x
// (`left` weight rows from the first on; outputs past them dropped), group grp's outputs at
// y + 8 grp: tiles of x8_mr rows of x (with V16, pairs of groups), from Q6_PLAIN_FROM rows (V8:
// PANEL_PLAIN_FROM_V8) each group decoded once into `plain_buffer` first
template <int QT>
void panel_tiles(const Q8& a, int64_t M, const uint8_t* panel, int64_t gb, int64_t groups, int64_t left, float* y,
                 int64_t ldy, std::vector<uint8_t>& plain_buffer) {
#if defined(MINERVA_V16)
  auto valid = [&](int64_t grp, int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, left - 8 * grp)); };
  if (QT == Q6_K && M >= Q6_PLAIN_FROM) {  // the panel decoded once (q8_repack.h)
    const int64_t pairs = groups / 2;
    uint8_t* const plain = plain_space(plain_buffer, pairs * PLAIN_BYTES * a.G);
    decode_once<V16, QT>(panel, gb, a.G, pairs, plain);
    x_tiles<V16_MR>(M, [&](int64_t m, auto tile_rows) {
      constexpr int r = decltype(tile_rows)::value;
      int64_t grp = 0;
      for (int64_t p = 0; p < pairs; ++p, grp += 2)
        tile_panel<V16, QT, r, true>(a, m, panel + grp * gb, gb, valid(grp, 16), y + m * ldy + 8 * grp, ldy, nullptr,
                                     plain + p * a.G * PLAIN_BYTES);
      if (grp < groups) tile_panel<V8, QT, r>(a, m, panel + grp * gb, gb, valid(grp, 8), y + m * ldy + 8 * grp, ldy);
    });
    return;
  }
  x_tiles<V16_MR>(M, [&](int64_t m, auto tile_rows) {
    constexpr int r = decltype(tile_rows)::value;
    int64_t grp = 0;
    for (; grp + 2 <= groups; grp += 2)
      tile_panel<V16, QT, r>(a, m, panel + grp * gb, gb, valid(grp, 16), y + m * ldy + 8 * grp, ldy);
    if (grp < groups) tile_panel<V8, QT, r>(a, m, panel + grp * gb, gb, valid(grp, 8), y + m * ldy + 8 * grp, ldy);
  });
#else
  if (M >= PANEL_PLAIN_FROM_V8) {  // each group decoded once, 32 bytes a chunk (as V16 above)
    constexpr int64_t PLAIN8 = PLAIN_BYTES / 2;
    uint8_t* const plain = plain_space(plain_buffer, groups * PLAIN8 * a.G);
    decode_once<V8, QT>(panel, gb, a.G, groups, plain);
    x_tiles<x8_mr<QT>>(M, [&](int64_t m, auto tile_rows) {
      for (int64_t grp = 0; grp < groups; ++grp)
        tile_panel<V8, QT, decltype(tile_rows)::value, true>(
            a, m, panel + grp * gb, gb, static_cast<int>(std::min<int64_t>(8, left - 8 * grp)), y + m * ldy + 8 * grp, ldy,
            nullptr, plain + grp * a.G * PLAIN8);
    });
    return;
  }
  x_tiles<x8_mr<QT>>(M, [&](int64_t m, auto tile_rows) {
    for (int64_t grp = 0; grp < groups; ++grp)
      tile_panel<V8, QT, decltype(tile_rows)::value>(a, m, panel + grp * gb, gb,
                                                     static_cast<int>(std::min<int64_t>(8, left - 8 * grp)),
                                                     y + m * ldy + 8 * grp, ldy);
  });
#endif
}

// Q3_K and Q6_K in the GGML layout, M >= PANELS_FROM: panels of PANEL weight rows, each
// regrouped into the work item's buffer (a last group of fewer than 8 rows repeats its last
// row; those outputs are dropped), then panel_tiles
template <int QT>
void matmul_panels(const Q8& a, int64_t M, const uint8_t* W, int64_t N, float* y_all, at::BFloat16* yb) {
  const int64_t rb = row_bytes<QT>(a.K), gb = a.G * Panel<QT>::BYTES;  // a group's bytes in the panel
  minerva::parallel_for(0, (N + PANEL - 1) / PANEL, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> panel(PANEL / 8 * gb);
    std::vector<uint8_t> plain_buffer;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = PANEL * blk, groups = (std::min(N, n0 + PANEL) - n0 + 7) / 8;
      columns_out(M, N, n0, std::min(N, n0 + PANEL), y_all, yb, [&](float* y, int64_t ldy) {
        for (int64_t grp = 0; grp < groups; ++grp) {
          const uint8_t* rows[8];
          for (int j = 0; j < 8; ++j) rows[j] = W + std::min(n0 + 8 * grp + j, N - 1) * rb;
          regroup_panel<QT>(rows, a.G, panel.data() + grp * gb);
        }
        panel_tiles<QT>(a, M, panel.data(), gb, groups, N - n0, y, ldy, plain_buffer);
      });
    }
  });
}

MINERVA_Q8_REGROUPED(Q2_K);
MINERVA_Q8_REGROUPED(Q3_K);
MINERVA_Q8_REGROUPED(Q4_K);
MINERVA_Q8_REGROUPED(Q5_K);
template void matmul_panels<Q3_K>(const Q8&, int64_t, const uint8_t*, int64_t, float*, at::BFloat16*);
template void matmul_panels<Q6_K>(const Q8&, int64_t, const uint8_t*, int64_t, float*, at::BFloat16*);
template void panel_tiles<Q6_K>(const Q8&, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t,
                                std::vector<uint8_t>&);

}  // namespace minerva::q8
