// The int8 kernels' choices per CPU (the kernels: q8_matmul.cpp and the q8_repack files): one
// object for every kernel file, declared here and defined once in q8_cpu.cpp, where
// `cpu_choices` (the planner, minerva/kernels/tune.py, and the tests) reads and sets them, so
// that what the planner sets reaches every kernel.
#pragma once

#include <array>
#include <cstdint>

#include "qformat.h"

namespace minerva::q8 {

// Choices that differ between CPUs, made once per process from the CPU's vendor; each keeps the
// results bit for bit (tests/kernels/test_repack.py runs every choice). Two are for one row of x
// (decode), one for many (prefill).
//
// l2_ahead: the one-row kernels (regrouped Q2_K and Q3_K aside: tile_panel; and tile_x8, the
// regrouped Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 where a group is short, and for a matrix's last
// groups; x8_rows, which takes the rest, asks for its next work item's instead, at whatever
// distance, where this is not 0) also ask for the weights this many bytes ahead of the ones
// they read, into L2, up to the end of the thread's run of the matrix (ThreadPool::run_end;
// 0: no such prefetch). On the Intel AVX-512 machine (2 MiB L2 a core) the hardware prefetchers alone left
// one row of x well under a plain read's bandwidth. One call per matrix, all matrices of a
// file from memory, 2 threads, interleaved sweeps with and without: 1.1B Q4_K_M 1.13x (its Q4_K
// matrices 1.09-1.19x, three runs), Q5_K_M 1.14x, 7B Q4_K_M 1.06x (Q4_K 1.06-1.26x, its Q6_K
// down projection 1.12x), 1.1B Q6_K 0.98x and 1.08x in two runs. 16 KB ahead was too short for
// the 5632-column rows (1.03x), 32 and 64 KB alike. Without the bound at the chunk's end the
// small matrices (256 rows) lost 10%. tile_x8 on an Intel Xeon with AMX (2 MiB L2 a core),
// the 1.1B shape's matrices regrouped, 1.2 GB of them in turn from memory, 2 threads, the
// choice alternating sweep by sweep (medians of 10): Q4_0 20.2 -> 25.3 GB/s (1.27x; 16 KB
// ahead 1.29x, 64 KB 1.21x), Q4_1 1.28x, Q5_0 1.25x; its prefetch 40 blocks ahead into L1 kept
// beside it, 1.06x and 1.02x (Q4_0, Q5_1). On the Zen 4 machine it made things slower: a plain
// 512 MB read with prefetcht1 8-64 KB ahead ran at 21-23 GB/s on one thread against 30 without,
// 31.5-32 against 34 on two; Q4_K matrices likewise (below).
//
// groups: regrouped Q2_K..Q5_K groups of 8 rows per work item with one row of x. Two
// (V16: both in one 512-bit register, one broadcast of x for 16 rows) on Intel, 1.07-1.12x
// faster than one there (all the Q4_K / Q5_K matrices of the 1.1B and 7B Q4_K_M / Q5_K_M shapes
// from memory, 2 threads, interleaved sweeps; one dot product chain per row or two, no
// difference; a software prefetch 2 super-blocks ahead, within the noise). On Zen 4, which runs
// a 512-bit operation as two 256-bit halves, one group (V8) at a time streams faster: 131072 x
// 2048 from memory, 2 threads, alternating in one process, medians of 12: Q4_K 32-35 GB/s with
// one group and no L2 prefetch against 19-25 with two groups and the prefetch (Q5_K 30 against
// 23); every matrix of the 1.1B Q4_K_M shape in turn, 1.13-1.38x in two runs. Zen 5 decoded
// as fast with neither, so CPUs other than Intel's get one group, no prefetch.
//
// x_copy: the Q4_K/Q5_K prefill tiles (tile_xk, V16, more than one row of x) copy their rows of
// x side by side per super-block so that one base register addresses them all. On the Intel
// machine that was 1.05x (a pointer per row left too few registers); on Zen 4 the tiles ran
// faster without it: 512 rows of x against 5632 x 2048 Q4_K in work items of 4 groups, one
// thread, a harness around x8_groups, alternating runs: 54% of the 512-bit peak with the copy,
// 61-62% without (the tile alone from L1: 70% and 78%). CPUs other than Intel's go without.
//
// int_steps: the Q4_K/Q5_K tiles with VNNI scale each sub-block's dot products by an i32
// multiply (tile_xk's INT) rather than in float: Intel's vpmulld is two micro-ops, Zen 4's one
// (measured in tile_xk's comment). Unlike the other choices it changes the bits (each way
// batch invariant, each within the reference's tolerance); with it the VNNI tiles give the
// bits of the AVX2 build's. CPUs other than Intel's take it.
struct CpuChoices {
  int64_t groups;    // one row of x: regrouped Q2_K..Q5_K groups per work item (2 only with MINERVA_V16)
  int64_t l2_ahead;  // one row of x: bytes; 0 = none
  int64_t x_copy;    // many rows: 1 = the V16 Q4_K/Q5_K tiles copy x per super-block (float steps)
  int64_t int_steps; // 1 = the Q4_K/Q5_K tiles scale sub-blocks in i32 (tile_xk's INT), 0 = in float
};
extern const CpuChoices vendor_choices;  // the CPU vendor's (q8_cpu.cpp)

// The choices that keep the bits are kept per type, so that the planner
// (minerva/kernels/tune.py), which times them on the machine they run on, can give each type
// its fastest: `groups` is for the K-quants as above (1, or 2 with MINERVA_V16) and for the
// 32-weight block types the groups of 8 rows one work item streams side by side with one row
// of x (x8_rows, q8_0_rows: 2 to 4; 1: one at a time, tile_x8 and its prefetches; X8_PAIRS,
// below), 4 by default; `l2_ahead` and `x_copy` as above, from the vendor until the planner sets them.
// few_rows: up to how many rows of x the 32-weight block types take the one-row
// streams, a tile of rows at a time (x8_rows, q8_0_rows; q8_kernels.h's few_rows), rather than panels of
// 4 groups against tiles of rows (tile_x8); 1 = never. 8 by default with AVX-512; 1 with AVX2
// until the planner measures it (4 groups' accumulators for FEW_MR rows and a block's values
// outgrow AVX2's 16 registers).
// int_steps, which changes the bits, stays one choice for every type.
// l2_long: `l2_ahead` for rows of LONG_ROWS columns or more, planned apart: with the
// planner's alternating sweeps on Zen 4, regrouped Q4_K at 4096 x 14336 (a 7B shape's down
// projection) streamed 25.3 GB/s without the L2 prefetch and 31.6 with it 32 KB ahead, while
// at 14336 x 4096 and at the 1.1B shapes no prefetch stayed the fastest (32.6, 34.1 GB/s).
// groups = X8_PAIRS (a 32-weight block type, builds with MINERVA_V16): one row of x takes two
// groups of 8 rows side by side in each 512-bit register (tile_x8_pair, as many rows do),
// PANEL / 8 groups a work item, where x8_rows streams 8 rows a 256-bit register: half the
// instructions a weight, for a CPU that runs 512-bit operations whole (Zen 5, Intel) and is
// bound by its instructions at one row; on Zen 4, which runs them as two halves, the streams.
// The same operations per output as tile_x8<QT, 1>, so the same bits. (A few rows of x then
// take the pairs' tiles too: few_rows is for the streams.)
constexpr int64_t X8_PAIRS = 16;
struct TypeChoices {
  int64_t groups, l2_ahead, x_copy, few_rows, l2_long;
};
constexpr int64_t LONG_ROWS = 8192;
constexpr int64_t FEW_ROWS_MOST = 8;
#if defined(__AVX512F__)
constexpr int64_t FEW_ROWS_DEFAULT = FEW_ROWS_MOST;
#else
constexpr int64_t FEW_ROWS_DEFAULT = 1;
#endif
constexpr int CHOICE_TYPES = MXFP4 + 1;
extern int64_t int_steps;  // vendor_choices.int_steps until cpu_choices sets it (q8_cpu.cpp)
inline bool is_k_type(int64_t qt) { return qt == Q2_K || qt == Q3_K || qt == Q4_K || qt == Q5_K || qt == Q6_K; }
inline bool int8_type(int64_t qt) {
  return is_k_type(qt) || qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q5_1 || qt == Q8_0 || qt == MXFP4;
}
extern std::array<TypeChoices, CHOICE_TYPES> type_choices;  // the vendor's until cpu_choices sets them (q8_cpu.cpp)
template <int QT>
inline const TypeChoices& choices_of() {
  static_assert(QT >= 0 && QT < CHOICE_TYPES);
  return type_choices[QT];
}
// the L2 prefetch distance for one row of x against rows of K columns
template <int QT>
inline int64_t l2_ahead_for(int64_t K) {
  return K >= LONG_ROWS ? choices_of<QT>().l2_long : choices_of<QT>().l2_ahead;
}
static_assert(Q4_0 < CHOICE_TYPES && Q4_1 < CHOICE_TYPES && Q5_0 < CHOICE_TYPES && Q5_1 < CHOICE_TYPES &&
                  Q8_0 < CHOICE_TYPES && MXFP4 < CHOICE_TYPES && Q2_K < CHOICE_TYPES && Q3_K < CHOICE_TYPES &&
                  Q4_K < CHOICE_TYPES && Q5_K < CHOICE_TYPES && Q6_K < CHOICE_TYPES,
              "type_choices holds every type the int8 kernels multiply");

}  // namespace minerva::q8
