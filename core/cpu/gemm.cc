#include "core/cpu/gemm.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <cblas.h>

#include "core/cpu/transpose_avx512.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attention::core {
namespace {

// Depth steps summed into fresh accumulators before they are added to the running sums:
// one FMA chain over a whole row of depth 768 erred up to 4x PyTorch's float32 error on
// the projections (issue 23); blocks of 64 err less than OpenBLAS's serial chains.
constexpr int64_t kSumBlock = 64;

// Where a tile's sums go: C[r][j] = alpha * sum + (accumulate ? C[r][j] : bias[j]) for the
// `width` valid columns (<= 16) of the panel; `bias` (may be null) is the panel's first.
// (A wide tile's two panels are always whole.)
struct TileOutput {
  float alpha;
  const float* bias;
  bool accumulate;
  float* c;
  int64_t ldc;
  int64_t width;
};

// The scalar epilogue, from sums stored as R x 16 floats: the portable kernel's, and the
// AVX2 kernel's for a panel narrower than 16 columns.
void Epilogue(const float* acc, int rows, const TileOutput& out) {
  for (int r = 0; r < rows; ++r) {
    const float* in = acc + r * kPanelWidth;
    float* row = out.c + r * out.ldc;
    for (int64_t j = 0; j < out.width; ++j) {
      const float addend = out.accumulate ? row[j] : out.bias != nullptr ? out.bias[j] : 0.0f;
      row[j] = out.alpha * in[j] + addend;
    }
  }
}

// A tile: sum[r][0..16) = sum over depth of a[r][k] * panel[k][0..16), for R rows of A
// `lda` apart, written to C as `out` says. The SIMD kernels apply the epilogue to their
// registers, so a tile's sums never make a round trip through memory (with short depths,
// attention's heads, that round trip cost as much as a quarter of the tile).
using TileFn = void (*)(const float* a, int64_t lda, const float* panel, int64_t depth,
                        const TileOutput& out);

template <int R>
void TilePortable(const float* a, int64_t lda, const float* panel, int64_t depth,
                  const TileOutput& out) {
  float sum[R][kPanelWidth] = {};
  for (int64_t k0 = 0; k0 < depth; k0 += kSumBlock) {
    float block[R][kPanelWidth] = {};
    for (int64_t k = k0; k < std::min(depth, k0 + kSumBlock); ++k) {
      const float* b = panel + k * kPanelWidth;
      for (int r = 0; r < R; ++r) {
        const float x = a[r * lda + k];
        for (int j = 0; j < kPanelWidth; ++j) block[r][j] += x * b[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kPanelWidth; ++j) sum[r][j] += block[r][j];
    }
  }
  Epilogue(&sum[0][0], R, out);
}

#if defined(__x86_64__)
// The accumulators are named variables, one tile row per macro line: GCC keeps an array of
// vectors on the stack and stores it back every step, which halved the kernel's speed.
// Past kSumBlock of depth, each block is summed into fresh accumulators (`block` in the
// macros) and then added to the running ones (`sum`); depths up to kSumBlock (attention's
// heads) run the plain loop alone.
// 2 x R accumulators (R <= 6 leaves registers for B and the broadcast).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are pasted into names.
#define AVX2_ROW(acc, r)                                         \
  if constexpr (R > r) {                                         \
    const __m256 x = _mm256_broadcast_ss(a + r * lda + k);       \
    acc##_low##r = _mm256_fmadd_ps(x, b0, acc##_low##r);         \
    acc##_high##r = _mm256_fmadd_ps(x, b1, acc##_high##r);       \
  }
#define AVX2_ROWS(acc)                                                                \
  const __m256 b0 = _mm256_loadu_ps(panel + k * kPanelWidth);                         \
  const __m256 b1 = _mm256_loadu_ps(panel + k * kPanelWidth + 8);                     \
  AVX2_ROW(acc, 0) AVX2_ROW(acc, 1) AVX2_ROW(acc, 2) AVX2_ROW(acc, 3) AVX2_ROW(acc, 4) \
  AVX2_ROW(acc, 5)
#define AVX2_ADD_BLOCK(r)                                        \
  if constexpr (R > r) {                                         \
    sum_low##r = _mm256_add_ps(sum_low##r, block_low##r);        \
    sum_high##r = _mm256_add_ps(sum_high##r, block_high##r);     \
  }
#define AVX2_STORE(r)                                                                        \
  if constexpr (R > r) {                                                                   \
    float* row = out.c + r * out.ldc;                                                      \
    if (out.accumulate) {                                                                  \
      bias_low = _mm256_loadu_ps(row);                                                     \
      bias_high = _mm256_loadu_ps(row + 8);                                                \
    }                                                                                      \
    _mm256_storeu_ps(row, _mm256_fmadd_ps(sum_low##r, alpha, bias_low));                   \
    _mm256_storeu_ps(row + 8, _mm256_fmadd_ps(sum_high##r, alpha, bias_high));             \
  }
#define AVX2_SPILL(r)                                            \
  if constexpr (R > r) {                                         \
    _mm256_storeu_ps(acc + r * kPanelWidth, sum_low##r);         \
    _mm256_storeu_ps(acc + r * kPanelWidth + 8, sum_high##r);    \
  }
template <int R>
__attribute__((target("avx2,fma"))) void TileAvx2(const float* a, int64_t lda,
                                                  const float* panel, int64_t depth,
                                                  const TileOutput& out) {
  __m256 sum_low0 = _mm256_setzero_ps(), sum_low1 = sum_low0, sum_low2 = sum_low0,
         sum_low3 = sum_low0, sum_low4 = sum_low0, sum_low5 = sum_low0;
  __m256 sum_high0 = sum_low0, sum_high1 = sum_low0, sum_high2 = sum_low0,
         sum_high3 = sum_low0, sum_high4 = sum_low0, sum_high5 = sum_low0;
  int64_t k = 0;
  while (depth > kSumBlock && k < depth) {
    __m256 block_low0 = _mm256_setzero_ps(), block_low1 = block_low0, block_low2 = block_low0,
           block_low3 = block_low0, block_low4 = block_low0, block_low5 = block_low0;
    __m256 block_high0 = block_low0, block_high1 = block_low0, block_high2 = block_low0,
           block_high3 = block_low0, block_high4 = block_low0, block_high5 = block_low0;
    for (const int64_t end = std::min(depth, k + kSumBlock); k < end; ++k) {
      AVX2_ROWS(block)
    }
    AVX2_ADD_BLOCK(0) AVX2_ADD_BLOCK(1) AVX2_ADD_BLOCK(2) AVX2_ADD_BLOCK(3) AVX2_ADD_BLOCK(4)
    AVX2_ADD_BLOCK(5)
  }
  for (; k < depth; ++k) {
    AVX2_ROWS(sum)
  }
  if (out.width < kPanelWidth) {  // the last panel of a width not a multiple of 16
    alignas(32) float acc[R * kPanelWidth];
    AVX2_SPILL(0) AVX2_SPILL(1) AVX2_SPILL(2) AVX2_SPILL(3) AVX2_SPILL(4) AVX2_SPILL(5)
    Epilogue(acc, R, out);
    return;
  }
  const __m256 alpha = _mm256_set1_ps(out.alpha);
  __m256 bias_low = _mm256_setzero_ps(), bias_high = bias_low;
  if (out.bias != nullptr) {
    bias_low = _mm256_loadu_ps(out.bias);
    bias_high = _mm256_loadu_ps(out.bias + 8);
  }
  AVX2_STORE(0) AVX2_STORE(1) AVX2_STORE(2) AVX2_STORE(3) AVX2_STORE(4) AVX2_STORE(5)
}
#undef AVX2_ROW
#undef AVX2_ROWS
#undef AVX2_ADD_BLOCK
#undef AVX2_STORE
#undef AVX2_SPILL

// One accumulator per row (R <= 12 of the 32 registers; 24 with the block's). Masked loads
// and stores cover a panel narrower than 16 columns.
#define AVX512_ROW(acc, r) \
  if constexpr (R > r) acc##r = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), b, acc##r);
#define AVX512_ROWS(acc)                                                                  \
  const __m512 b = _mm512_loadu_ps(panel + k * kPanelWidth);                              \
  AVX512_ROW(acc, 0) AVX512_ROW(acc, 1) AVX512_ROW(acc, 2) AVX512_ROW(acc, 3)              \
  AVX512_ROW(acc, 4) AVX512_ROW(acc, 5) AVX512_ROW(acc, 6) AVX512_ROW(acc, 7)              \
  AVX512_ROW(acc, 8) AVX512_ROW(acc, 9) AVX512_ROW(acc, 10) AVX512_ROW(acc, 11)
#define AVX512_ADD_BLOCK(r) \
  if constexpr (R > r) sum##r = _mm512_add_ps(sum##r, block##r);
#define AVX512_STORE(r)                                                                     \
  if constexpr (R > r) {                                                                  \
    float* row = out.c + r * out.ldc;                                                     \
    if (full_width) {                                                                     \
      const __m512 addend = out.accumulate ? _mm512_loadu_ps(row) : bias;                 \
      _mm512_storeu_ps(row, _mm512_fmadd_ps(sum##r, alpha, addend));                      \
    } else {                                                                              \
      const __m512 addend = out.accumulate ? _mm512_maskz_loadu_ps(mask, row) : bias;     \
      _mm512_mask_storeu_ps(row, mask, _mm512_fmadd_ps(sum##r, alpha, addend));           \
    }                                                                                     \
  }
template <int R>
__attribute__((target("avx512f,prfchw"))) void TileAvx512(const float* a, int64_t lda,
                                                          const float* panel, int64_t depth,
                                                          const TileOutput& out) {
  PrefetchForWriting(out.c, out.ldc * sizeof(float), R, kPanelWidth * sizeof(float));
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0, sum2 = sum0, sum3 = sum0, sum4 = sum0,
         sum5 = sum0, sum6 = sum0, sum7 = sum0, sum8 = sum0, sum9 = sum0, sum10 = sum0,
         sum11 = sum0;
  int64_t k = 0;
  while (depth > kSumBlock && k < depth) {
    __m512 block0 = _mm512_setzero_ps(), block1 = block0, block2 = block0, block3 = block0,
           block4 = block0, block5 = block0, block6 = block0, block7 = block0, block8 = block0,
           block9 = block0, block10 = block0, block11 = block0;
    for (const int64_t end = std::min(depth, k + kSumBlock); k < end; ++k) {
      AVX512_ROWS(block)
    }
    AVX512_ADD_BLOCK(0) AVX512_ADD_BLOCK(1) AVX512_ADD_BLOCK(2) AVX512_ADD_BLOCK(3)
    AVX512_ADD_BLOCK(4) AVX512_ADD_BLOCK(5) AVX512_ADD_BLOCK(6) AVX512_ADD_BLOCK(7)
    AVX512_ADD_BLOCK(8) AVX512_ADD_BLOCK(9) AVX512_ADD_BLOCK(10) AVX512_ADD_BLOCK(11)
  }
  for (; k < depth; ++k) {
    AVX512_ROWS(sum)
  }
  // Masked stores are slow on some CPUs (Zen 4): full panels take plain ones.
  const bool full_width = out.width == kPanelWidth;
  const __mmask16 mask = static_cast<__mmask16>((1u << out.width) - 1);
  const __m512 alpha = _mm512_set1_ps(out.alpha);
  const __m512 bias =
      out.bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, out.bias);
  AVX512_STORE(0) AVX512_STORE(1) AVX512_STORE(2) AVX512_STORE(3) AVX512_STORE(4)
  AVX512_STORE(5) AVX512_STORE(6) AVX512_STORE(7) AVX512_STORE(8) AVX512_STORE(9)
  AVX512_STORE(10) AVX512_STORE(11)
}
#undef AVX512_ROW
#undef AVX512_ROWS
#undef AVX512_ADD_BLOCK
#undef AVX512_STORE

// Two adjacent full panels (32 columns) per tile, 2 x R accumulators (R <= 12): each
// broadcast of A feeds two FMAs. TileAvx512 needs a load per FMA, which holds back CPUs
// with two 512-bit FMA ports (Intel); `panel_stride` floats separate the two panels. With
// a block's accumulators too, the running sums live on the stack, touched once a block.
#define AVX512_WIDE_ROW(acc, r)                             \
  if constexpr (R > r) {                                    \
    const __m512 x = _mm512_set1_ps(a[r * lda + k]);        \
    acc##_left##r = _mm512_fmadd_ps(x, b0, acc##_left##r);  \
    acc##_right##r = _mm512_fmadd_ps(x, b1, acc##_right##r); \
  }
#define AVX512_WIDE_ROWS(acc)                                                     \
  const __m512 b0 = _mm512_loadu_ps(panel + k * kPanelWidth);                     \
  const __m512 b1 = _mm512_loadu_ps(second + k * kPanelWidth);                    \
  AVX512_WIDE_ROW(acc, 0) AVX512_WIDE_ROW(acc, 1) AVX512_WIDE_ROW(acc, 2)          \
  AVX512_WIDE_ROW(acc, 3) AVX512_WIDE_ROW(acc, 4) AVX512_WIDE_ROW(acc, 5)          \
  AVX512_WIDE_ROW(acc, 6) AVX512_WIDE_ROW(acc, 7) AVX512_WIDE_ROW(acc, 8)          \
  AVX512_WIDE_ROW(acc, 9) AVX512_WIDE_ROW(acc, 10) AVX512_WIDE_ROW(acc, 11)
#define AVX512_WIDE_ADD_BLOCK(r)                                 \
  if constexpr (R > r) {                                         \
    sum_left##r = _mm512_add_ps(sum_left##r, block_left##r);     \
    sum_right##r = _mm512_add_ps(sum_right##r, block_right##r);  \
  }
#define AVX512_WIDE_STORE(r)                                                               \
  if constexpr (R > r) {                                                                 \
    float* row = out.c + r * out.ldc;                                                    \
    const __m512 left_addend = out.accumulate ? _mm512_loadu_ps(row) : bias_left;        \
    const __m512 right_addend = out.accumulate ? _mm512_loadu_ps(row + 16) : bias_right; \
    _mm512_storeu_ps(row, _mm512_fmadd_ps(sum_left##r, alpha, left_addend));             \
    _mm512_storeu_ps(row + 16, _mm512_fmadd_ps(sum_right##r, alpha, right_addend));      \
  }
template <int R>
__attribute__((target("avx512f,prfchw"))) void TileAvx512Wide(const float* a, int64_t lda,
                                                              const float* panel,
                                                              int64_t panel_stride, int64_t depth,
                                                              const TileOutput& out) {
  PrefetchForWriting(out.c, out.ldc * sizeof(float), R, 2 * kPanelWidth * sizeof(float));
  __m512 sum_left0 = _mm512_setzero_ps(), sum_left1 = sum_left0, sum_left2 = sum_left0,
         sum_left3 = sum_left0, sum_left4 = sum_left0, sum_left5 = sum_left0,
         sum_left6 = sum_left0, sum_left7 = sum_left0, sum_left8 = sum_left0,
         sum_left9 = sum_left0, sum_left10 = sum_left0, sum_left11 = sum_left0;
  __m512 sum_right0 = sum_left0, sum_right1 = sum_left0, sum_right2 = sum_left0,
         sum_right3 = sum_left0, sum_right4 = sum_left0, sum_right5 = sum_left0,
         sum_right6 = sum_left0, sum_right7 = sum_left0, sum_right8 = sum_left0,
         sum_right9 = sum_left0, sum_right10 = sum_left0, sum_right11 = sum_left0;
  const float* second = panel + panel_stride;
  int64_t k = 0;
  while (depth > kSumBlock && k < depth) {
    __m512 block_left0 = _mm512_setzero_ps(), block_left1 = block_left0,
           block_left2 = block_left0, block_left3 = block_left0, block_left4 = block_left0,
           block_left5 = block_left0, block_left6 = block_left0, block_left7 = block_left0,
           block_left8 = block_left0, block_left9 = block_left0, block_left10 = block_left0,
           block_left11 = block_left0;
    __m512 block_right0 = block_left0, block_right1 = block_left0, block_right2 = block_left0,
           block_right3 = block_left0, block_right4 = block_left0, block_right5 = block_left0,
           block_right6 = block_left0, block_right7 = block_left0, block_right8 = block_left0,
           block_right9 = block_left0, block_right10 = block_left0, block_right11 = block_left0;
    for (const int64_t end = std::min(depth, k + kSumBlock); k < end; ++k) {
      AVX512_WIDE_ROWS(block)
    }
    AVX512_WIDE_ADD_BLOCK(0) AVX512_WIDE_ADD_BLOCK(1) AVX512_WIDE_ADD_BLOCK(2)
    AVX512_WIDE_ADD_BLOCK(3) AVX512_WIDE_ADD_BLOCK(4) AVX512_WIDE_ADD_BLOCK(5)
    AVX512_WIDE_ADD_BLOCK(6) AVX512_WIDE_ADD_BLOCK(7) AVX512_WIDE_ADD_BLOCK(8)
    AVX512_WIDE_ADD_BLOCK(9) AVX512_WIDE_ADD_BLOCK(10) AVX512_WIDE_ADD_BLOCK(11)
  }
  for (; k < depth; ++k) {
    AVX512_WIDE_ROWS(sum)
  }
  const __m512 alpha = _mm512_set1_ps(out.alpha);
  const __m512 bias_left = out.bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(out.bias);
  const __m512 bias_right =
      out.bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(out.bias + 16);
  AVX512_WIDE_STORE(0) AVX512_WIDE_STORE(1) AVX512_WIDE_STORE(2) AVX512_WIDE_STORE(3)
  AVX512_WIDE_STORE(4) AVX512_WIDE_STORE(5) AVX512_WIDE_STORE(6) AVX512_WIDE_STORE(7)
  AVX512_WIDE_STORE(8) AVX512_WIDE_STORE(9) AVX512_WIDE_STORE(10) AVX512_WIDE_STORE(11)
}
#undef AVX512_WIDE_ROW
#undef AVX512_WIDE_ROWS
#undef AVX512_WIDE_ADD_BLOCK
#undef AVX512_WIDE_STORE
// NOLINTEND(bugprone-macro-parentheses)
#endif

// Rows per tile at most: as many as keep the accumulators in registers.
int MaxTileRows(SimdLevel level) {
#if defined(__x86_64__)
  if (level == SimdLevel::kAvx512) return 12;
  if (level == SimdLevel::kAvx2) return 6;
#endif
  return 4;  // the portable kernel, which is all that other CPUs compile
}

#if defined(__x86_64__)
constexpr TileFn kAvx512Tiles[] = {nullptr,         &TileAvx512<1>,  &TileAvx512<2>,
                                   &TileAvx512<3>,  &TileAvx512<4>,  &TileAvx512<5>,
                                   &TileAvx512<6>,  &TileAvx512<7>,  &TileAvx512<8>,
                                   &TileAvx512<9>,  &TileAvx512<10>, &TileAvx512<11>,
                                   &TileAvx512<12>};
using WideTileFn = void (*)(const float* a, int64_t lda, const float* panel,
                            int64_t panel_stride, int64_t depth, const TileOutput& out);
constexpr WideTileFn kAvx512WideTiles[] = {
    nullptr,             &TileAvx512Wide<1>, &TileAvx512Wide<2>,  &TileAvx512Wide<3>,
    &TileAvx512Wide<4>,  &TileAvx512Wide<5>, &TileAvx512Wide<6>,  &TileAvx512Wide<7>,
    &TileAvx512Wide<8>,  &TileAvx512Wide<9>, &TileAvx512Wide<10>, &TileAvx512Wide<11>,
    &TileAvx512Wide<12>};
constexpr TileFn kAvx2Tiles[] = {nullptr,      &TileAvx2<1>, &TileAvx2<2>, &TileAvx2<3>,
                                 &TileAvx2<4>, &TileAvx2<5>, &TileAvx2<6>};
#endif
constexpr TileFn kPortableTiles[] = {nullptr, &TilePortable<1>, &TilePortable<2>,
                                     &TilePortable<3>, &TilePortable<4>};

// The kernel for `rows` (1..MaxTileRows(level)) rows.
TileFn Tile(SimdLevel level, int rows) {
#if defined(__x86_64__)
  if (level == SimdLevel::kAvx512) return kAvx512Tiles[rows];
  if (level == SimdLevel::kAvx2) return kAvx2Tiles[rows];
#endif
  return kPortableTiles[rows];
}

// Depth per pass: a whole row up to E = 1024, so each tile's epilogue runs once (blocks of
// 256 that kept the panel slice in L1 measured 4-10% slower: the row tiles re-read it
// from L2 fast enough).
constexpr int64_t kDepthBlock = 1024;
// Rows per chunk: at depth 768 (E of BERT-base) they take 384 KiB and stay in L2.
constexpr int64_t kRowChunk = 128;

#if defined(__x86_64__)
#pragma GCC diagnostic push
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// PackPanels of a transposed B (depth_stride 1, e.g. attention's keys): blocks of 16 columns
// x 16 depths transposed in registers; columns past the last load as zeros, and a last block
// shorter than 16 depths loads masked and stores only its rows.
__attribute__((target("avx512f"))) void PackTransposedAvx512(const float* b, int64_t depth,
                                                             int64_t columns,
                                                             int64_t column_stride,
                                                             float* panels) {
  for (int64_t p = 0; p < PanelCount(columns); ++p) {
    float* panel = panels + p * depth * kPanelWidth;
    const float* first_column = b + p * kPanelWidth * column_stride;
    const int64_t width = std::min(kPanelWidth, columns - p * kPanelWidth);
    for (int64_t k0 = 0; k0 < depth; k0 += kPanelWidth) {
      const int64_t depths = std::min(kPanelWidth, depth - k0);
      const __mmask16 mask = static_cast<__mmask16>((1u << depths) - 1);
      __m512 block[16];
      for (int64_t j = 0; j < kPanelWidth; ++j) {
        block[j] = j < width ? _mm512_maskz_loadu_ps(mask, first_column + j * column_stride + k0)
                             : _mm512_setzero_ps();
      }
      Transpose16x16(block);
      for (int64_t k = 0; k < depths; ++k) {
        _mm512_storeu_ps(panel + (k0 + k) * kPanelWidth, block[k]);
      }
    }
  }
}
#pragma GCC diagnostic pop
#endif

}  // namespace

const char* SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512: return "avx512";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kPortable: break;
  }
  return "portable";
}

bool CpuSupports(SimdLevel level) {
#if defined(__x86_64__)
  switch (level) {
    case SimdLevel::kAvx512: return __builtin_cpu_supports("avx512f");
    case SimdLevel::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case SimdLevel::kPortable: return true;
  }
#endif
  return level == SimdLevel::kPortable;
}

SimdLevel BestSimdLevel() {
  static const SimdLevel best = CpuSupports(SimdLevel::kAvx512) ? SimdLevel::kAvx512
                                : CpuSupports(SimdLevel::kAvx2) ? SimdLevel::kAvx2
                                                                : SimdLevel::kPortable;
  return best;
}

void PackPanels(const float* b, int64_t depth, int64_t columns, int64_t depth_stride,
                int64_t column_stride, float* panels, SimdLevel level) {
#if defined(__x86_64__)
  // Attention packs every head's keys this way; the scalar loop below took a third of
  // attention's time on 16-token sequences.
  if (level == SimdLevel::kAvx512 && depth_stride == 1) {
    PackTransposedAvx512(b, depth, columns, column_stride, panels);
    return;
  }
#endif
  for (int64_t p = 0; p < PanelCount(columns); ++p) {
    float* panel = panels + p * depth * kPanelWidth;
    const float* first_column = b + p * kPanelWidth * column_stride;
    const int64_t width = std::min(kPanelWidth, columns - p * kPanelWidth);
    for (int64_t k = 0; k < depth; ++k) {
      float* row = panel + k * kPanelWidth;
      const float* source = first_column + k * depth_stride;
      if (column_stride == 1 && width == kPanelWidth) {
        std::memcpy(row, source, sizeof(float) * kPanelWidth);  // a whole row of B: one fixed copy
      } else {
        for (int64_t j = 0; j < width; ++j) row[j] = source[j * column_stride];
        std::fill(row + width, row + kPanelWidth, 0.0f);
      }
    }
  }
}

void GemmPanels(SimdLevel level, const float* a, int64_t lda, int64_t rows, const float* panels,
                int64_t depth, int64_t columns, int64_t first_panel, int64_t end_panel,
                float alpha, const float* bias, float* c, int64_t ldc, bool accumulate) {
  const int max_tile_rows = MaxTileRows(level);
  for (int64_t chunk = 0; chunk < rows; chunk += kRowChunk) {
    const int64_t chunk_rows = std::min(kRowChunk, rows - chunk);
    // Tiles of equal height (16 rows: 6 + 5 + 5 on AVX2), not full ones and a short rest.
    const int64_t tiles = (chunk_rows + max_tile_rows - 1) / max_tile_rows;
    // Panels outermost: the weights stream through once, in memory order, which the
    // hardware prefetcher follows; the chunk's rows of A stay in L2.
    for (int64_t p = first_panel; p < end_panel;) {
      const int64_t column = p * kPanelWidth;
      const int64_t width = std::min(kPanelWidth, columns - column);
      // Two full panels at once where the AVX-512 kernel can take them.
      const bool wide = level == SimdLevel::kAvx512 && p + 1 < end_panel &&
                        column + 2 * kPanelWidth <= columns;
      for (int64_t k0 = 0; k0 < depth; k0 += kDepthBlock) {
        const int64_t slice = std::min(kDepthBlock, depth - k0);
        const float* panel = panels + (p * depth + k0) * kPanelWidth;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t first = chunk + chunk_rows * t / tiles;
          const int tile_rows = static_cast<int>(chunk + chunk_rows * (t + 1) / tiles - first);
          const TileOutput out{alpha, bias == nullptr ? nullptr : bias + column,
                               accumulate || k0 > 0,
                               c + first * ldc + column, ldc, width};
#if defined(__x86_64__)
          if (wide) {
            kAvx512WideTiles[tile_rows](a + first * lda + k0, lda, panel, depth * kPanelWidth,
                                        slice, out);
            continue;
          }
#endif
          Tile(level, tile_rows)(a + first * lda + k0, lda, panel, slice, out);
        }
      }
      p += wide ? 2 : 1;
    }
  }
}

PackedWeight::PackedWeight(absl::Span<const float> weight, int64_t out_features,
                           int64_t in_features)
    : out_features_(out_features), in_features_(in_features) {
  const size_t bytes = PanelFloats(in_features, out_features) * sizeof(float);
  panels_.reset(static_cast<float*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  PackTransposed(weight.data(), out_features, in_features, in_features, panels_.get());
}

int64_t PackedLinearMaxRows(SimdLevel level) {
  return level == SimdLevel::kAvx512 ? std::numeric_limits<int64_t>::max() : 256;
}

// Every part packs all of the operand that is not split (OpenBLAS) or streams it (the
// microkernel), so split the larger one: by output columns when the weights outweigh the
// rows (few tokens), else by rows.
bool SplitsLinearByRows(int64_t rows, int64_t out_features, int64_t threads) {
  constexpr int64_t kMinPart = 16;
  return rows >= out_features ? rows >= threads * kMinPart : out_features < threads * kMinPart;
}

void ForEachPackedLinearPart(ThreadPool& pool, int64_t rows, int64_t out_features,
                             absl::FunctionRef<void(int64_t first_row, int64_t row_count,
                                                    int64_t first_panel, int64_t end_panel)>
                                 part) {
  const int64_t threads = pool.size();
  const bool split_rows = SplitsLinearByRows(rows, out_features, threads);
  const int64_t total = split_rows ? rows : PanelCount(out_features);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, total));
  pool.ParallelFor(parts, [&](int64_t index) {
    const int64_t begin = total * index / parts, end = total * (index + 1) / parts;
    if (begin == end) return;
    if (split_rows) {
      part(begin, end - begin, 0, PanelCount(out_features));
    } else {
      part(0, rows, begin, end);
    }
  });
}

void LinearForward(ThreadPool& pool, const float* x, int64_t rows, int64_t in_features,
                   absl::Span<const float> weight, absl::Span<const float> bias,
                   int64_t out_features, float* y, const float* panels, SimdLevel level,
                   std::optional<int64_t> max_packed_rows) {
  const int64_t threads = pool.size();
  const bool split_rows = SplitsLinearByRows(rows, out_features, threads);
  if (panels != nullptr && rows <= max_packed_rows.value_or(PackedLinearMaxRows(level))) {
    const float* b = bias.empty() ? nullptr : bias.data();
    ForEachPackedLinearPart(
        pool, rows, out_features,
        [&](int64_t first_row, int64_t row_count, int64_t first_panel, int64_t end_panel) {
          GemmPanels(level, x + first_row * in_features, in_features, row_count, panels,
                     in_features, out_features, first_panel, end_panel, 1.0f, b,
                     y + first_row * out_features, out_features);
        });
    return;
  }
  const int64_t total = split_rows ? rows : out_features;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, total));
  pool.ParallelFor(parts, [&](int64_t part) {
    const int64_t begin = total * part / parts;
    const int64_t end = total * (part + 1) / parts;
    if (begin == end) return;
    const int64_t m = split_rows ? end - begin : rows;
    const int64_t n = split_rows ? out_features : end - begin;
    const float* a = split_rows ? x + begin * in_features : x;
    const float* w = split_rows ? weight.data() : weight.data() + begin * in_features;
    float* c = split_rows ? y + begin * out_features : y + begin;
    // The bias goes in as the GEMM's C with beta = 1: no separate pass over Y.
    float beta = 0.0f;
    if (!bias.empty()) {
      const float* b = split_rows ? bias.data() : bias.data() + begin;
      for (int64_t r = 0; r < m; ++r) std::copy(b, b + n, c + r * out_features);
      beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, in_features, 1.0f, a,
                in_features, w, in_features, beta, c, out_features);
  });
}

}  // namespace attention::core
