// The int8 kernels' choices per CPU (q8_cpu.h): their one definition, which every kernel file
// reads, `cpu_choices` to read and set them, and the probe of the CPU's int8 compute peak.
#include <torch/extension.h>
#include <immintrin.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "q8_blocks.h"
#include "q8_cpu.h"

namespace minerva::q8 {

// (in this order: each starts from the one before)
const CpuChoices vendor_choices = [] {
  const bool intel = __builtin_cpu_is("intel");
  return CpuChoices{intel ? 2 : 1, intel ? 32768 : 0, intel ? 1 : 0, intel ? 0 : 1};
}();
int64_t int_steps = vendor_choices.int_steps;
std::array<TypeChoices, CHOICE_TYPES> type_choices = [] {
  std::array<TypeChoices, CHOICE_TYPES> out{};
  for (int qt = 0; qt < CHOICE_TYPES; ++qt)
    out[qt] = {is_k_type(qt) ? vendor_choices.groups : 4, vendor_choices.l2_ahead, vendor_choices.x_copy,
               FEW_ROWS_DEFAULT, vendor_choices.l2_ahead};
  return out;
}();

}  // namespace minerva::q8

using namespace minerva;
using namespace minerva::q8;

int64_t x8_pairs_choice() {
#if defined(MINERVA_V16)
  return X8_PAIRS;
#else
  return 0;
#endif
}

bool vnni_dot_products() { return VNNI; }

std::vector<int64_t> cpu_choices(std::optional<std::vector<int64_t>> set, int64_t qtype) {
  TORCH_CHECK(qtype == -1 || (qtype >= 0 && qtype < CHOICE_TYPES && int8_type(qtype)),
              "cpu_choices: type ", qtype, " is not one the int8 kernels multiply (-1: every type)");
  const TypeChoices& c = type_choices[qtype == -1 ? Q4_K : qtype];
  // every type (-1): the four shared choices (each 32-weight type keeps its own few rows)
  std::vector<int64_t> was{c.groups, c.l2_ahead, c.x_copy, int_steps};
  if (qtype != -1) was.insert(was.end(), {c.few_rows, c.l2_long});
  if (set) {
    const auto& v = *set;
    const int64_t most_groups = qtype == -1 || is_k_type(qtype) ? 2 : 4;
#if defined(MINERVA_V16)
    const bool pairs = qtype != -1 && !is_k_type(qtype) && v.size() >= 1 && v[0] == X8_PAIRS;
#else
    const bool pairs = false;
#endif
    TORCH_CHECK(v.size() >= 4 && v.size() <= 6 && ((v[0] >= 1 && v[0] <= most_groups) || pairs) && v[1] >= 0 &&
                    (v[2] == 0 || v[2] == 1) && (v[3] == 0 || v[3] == 1) &&
                    (v.size() == 4 || (v[4] >= 1 && v[4] <= FEW_ROWS_MOST)) && (v.size() < 6 || v[5] >= 0),
                "cpu_choices takes [groups (1 or 2 for the K-quants, 1 to 4 for the 32-weight block types, or ",
                X8_PAIRS, " for them where the build has two groups a 512-bit register), "
                "L2 prefetch distance in bytes (>= 0), x copy (0 or 1), int steps (0 or 1), and optionally "
                "few rows (1 to ", FEW_ROWS_MOST, ") and the L2 prefetch distance for rows of ", LONG_ROWS,
                " columns or more (>= 0; else the first)]");
    int_steps = v[3];
    for (int qt = 0; qt < CHOICE_TYPES; ++qt) {
      if (!int8_type(qt) || (qtype != -1 && qt != qtype)) continue;
      // every type (-1): the groups go to the K-quants; the 32-weight types' streams are set per type
      const TypeChoices& t = type_choices[qt];
      type_choices[qt] = {qtype == -1 && !is_k_type(qt) ? t.groups : v[0], v[1], v[2],
                          v.size() >= 5 ? v[4] : t.few_rows, v.size() == 6 ? v[5] : v[1]};
    }
  }
  return was;
}

// The int8 compute peak of the widest dot products the kernels use (q8_repack_k.cpp's V16): `chunks` chunks
// (spread over the threads) of `steps` steps, each 8 independent dot products on registers.
// With AVX-512 VNNI (V16) one 512-bit vpdpbusd each, 64 multiply-adds, as the K-quant tiles
// take; else one 256-bit dot4 (one VNNI instruction, or a maddubs -> madd -> add triple), 32.
// On the Intel AVX-512 machine one thread ran 585 GOPS with 512-bit vpdpbusd against 324 with
// 256-bit (the probe had been 256-bit only, so the prefill fractions it gave there were 1.8x
// too high). Returns the multiply-adds done (the sums feed the result, so nothing is optimised
// away; the value itself means nothing).
double int8_peak_probe(int64_t chunks, int64_t steps) {
#if defined(MINERVA_V16)
  using I = __m512i;
  constexpr double MACS = 512.0;
  auto dot = [](I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); };
  auto set8 = [](int v) { return _mm512_set1_epi8(static_cast<char>(v)); };
  auto set32 = [](int v) { return _mm512_set1_epi32(v); };
  auto first = [](I v) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(v)); };
#else
  using I = __m256i;
  constexpr double MACS = 256.0;
  auto dot = [](I acc, I w, I x) { return dot4(acc, w, x); };
  auto set8 = [](int v) { return _mm256_set1_epi8(static_cast<char>(v)); };
  auto set32 = [](int v) { return _mm256_set1_epi32(v); };
  auto first = [](I v) { return _mm256_extract_epi32(v, 0); };
#endif
  std::atomic<int64_t> sink{0};
  minerva::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      I acc[8], x[8], w = set8(static_cast<int>(3 + c));
      for (int i = 0; i < 8; ++i) {
        acc[i] = set32(i);
        x[i] = set8(5 + i);
      }
      for (int64_t n = 0; n < steps; ++n) {
        for (int i = 0; i < 8; ++i) acc[i] = dot(acc[i], w, x[i]);
        // a new w and x each step, as far as the compiler knows; 8 different x, so no two
        // products are the same expression (one shared maddubs would be counted 8 times)
        asm volatile("" : "+v"(w), "+v"(x[0]), "+v"(x[1]), "+v"(x[2]), "+v"(x[3]));
        asm volatile("" : "+v"(x[4]), "+v"(x[5]), "+v"(x[6]), "+v"(x[7]));
      }
      int64_t total = 0;
      for (int i = 0; i < 8; ++i) total += first(acc[i]);
      sink += total;
    }
  });
  return sink.load() == 42 ? 0.0 : MACS * static_cast<double>(chunks) * static_cast<double>(steps);
}
