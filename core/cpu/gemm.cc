#include "core/cpu/gemm.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <cblas.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attention::core {
namespace {

// A tile: acc[r][0..16) = sum over depth of a[r][k] * panel[k][0..16), for R rows of A
// `lda` apart. Stored to `acc` (R x 16); the epilogue applies alpha, bias and the tail.
using TileFn = void (*)(const float* a, int64_t lda, const float* panel, int64_t depth,
                        float* acc);

template <int R>
void TilePortable(const float* a, int64_t lda, const float* panel, int64_t depth, float* acc) {
  float sum[R][kPanelWidth] = {};
  for (int64_t k = 0; k < depth; ++k) {
    const float* b = panel + k * kPanelWidth;
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + k];
      for (int j = 0; j < kPanelWidth; ++j) sum[r][j] += x * b[j];
    }
  }
  std::memcpy(acc, sum, sizeof(sum));
}

#if defined(__x86_64__)
// The accumulators are named variables, one tile row per macro line: GCC keeps an array of
// vectors on the stack and stores it back every step, which halved the kernel's speed.
// 2 x R accumulators (R <= 6 leaves registers for B and the broadcast).
#define AVX2_ROW(r)                                              \
  if constexpr (R > r) {                                         \
    const __m256 x = _mm256_broadcast_ss(a + r * lda + k);       \
    low##r = _mm256_fmadd_ps(x, b0, low##r);                     \
    high##r = _mm256_fmadd_ps(x, b1, high##r);                   \
  }
#define AVX2_STORE(r)                                            \
  if constexpr (R > r) {                                         \
    _mm256_storeu_ps(acc + r * kPanelWidth, low##r);             \
    _mm256_storeu_ps(acc + r * kPanelWidth + 8, high##r);        \
  }
template <int R>
__attribute__((target("avx2,fma"))) void TileAvx2(const float* a, int64_t lda,
                                                  const float* panel, int64_t depth,
                                                  float* acc) {
  __m256 low0 = _mm256_setzero_ps(), low1 = low0, low2 = low0, low3 = low0, low4 = low0,
         low5 = low0;
  __m256 high0 = low0, high1 = low0, high2 = low0, high3 = low0, high4 = low0, high5 = low0;
  for (int64_t k = 0; k < depth; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanelWidth);
    const __m256 b1 = _mm256_loadu_ps(panel + k * kPanelWidth + 8);
    AVX2_ROW(0) AVX2_ROW(1) AVX2_ROW(2) AVX2_ROW(3) AVX2_ROW(4) AVX2_ROW(5)
  }
  AVX2_STORE(0) AVX2_STORE(1) AVX2_STORE(2) AVX2_STORE(3) AVX2_STORE(4) AVX2_STORE(5)
}
#undef AVX2_ROW
#undef AVX2_STORE

// One accumulator per row (R <= 12 of the 32 registers).
#define AVX512_ROW(r)                                                             \
  if constexpr (R > r) sum##r = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), b, sum##r);
#define AVX512_STORE(r) \
  if constexpr (R > r) _mm512_storeu_ps(acc + r * kPanelWidth, sum##r);
template <int R>
__attribute__((target("avx512f"))) void TileAvx512(const float* a, int64_t lda,
                                                   const float* panel, int64_t depth,
                                                   float* acc) {
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0, sum2 = sum0, sum3 = sum0, sum4 = sum0,
         sum5 = sum0, sum6 = sum0, sum7 = sum0, sum8 = sum0, sum9 = sum0, sum10 = sum0,
         sum11 = sum0;
  for (int64_t k = 0; k < depth; ++k) {
    const __m512 b = _mm512_loadu_ps(panel + k * kPanelWidth);
    AVX512_ROW(0) AVX512_ROW(1) AVX512_ROW(2) AVX512_ROW(3) AVX512_ROW(4) AVX512_ROW(5)
    AVX512_ROW(6) AVX512_ROW(7) AVX512_ROW(8) AVX512_ROW(9) AVX512_ROW(10) AVX512_ROW(11)
  }
  AVX512_STORE(0) AVX512_STORE(1) AVX512_STORE(2) AVX512_STORE(3) AVX512_STORE(4)
  AVX512_STORE(5) AVX512_STORE(6) AVX512_STORE(7) AVX512_STORE(8) AVX512_STORE(9)
  AVX512_STORE(10) AVX512_STORE(11)
}
#undef AVX512_ROW
#undef AVX512_STORE
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

// C tile = alpha * acc + (accumulate ? C : bias), `columns` of the 16 valid.
void Epilogue(const float* acc, int rows, int64_t columns, float alpha, const float* bias,
              bool accumulate, float* c, int64_t ldc) {
  for (int r = 0; r < rows; ++r) {
    const float* in = acc + r * kPanelWidth;
    float* out = c + r * ldc;
    if (accumulate) {
      for (int64_t j = 0; j < columns; ++j) out[j] += alpha * in[j];
    } else if (bias != nullptr) {
      for (int64_t j = 0; j < columns; ++j) out[j] = alpha * in[j] + bias[j];
    } else {
      for (int64_t j = 0; j < columns; ++j) out[j] = alpha * in[j];
    }
  }
}

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
                int64_t column_stride, float* panels) {
  for (int64_t p = 0; p < PanelCount(columns); ++p) {
    float* panel = panels + p * depth * kPanelWidth;
    const float* first_column = b + p * kPanelWidth * column_stride;
    const int64_t width = std::min(kPanelWidth, columns - p * kPanelWidth);
    for (int64_t k = 0; k < depth; ++k) {
      float* row = panel + k * kPanelWidth;
      const float* source = first_column + k * depth_stride;
      for (int64_t j = 0; j < width; ++j) row[j] = source[j * column_stride];
      std::fill(row + width, row + kPanelWidth, 0.0f);
    }
  }
}

void GemmPanels(SimdLevel level, const float* a, int64_t lda, int64_t rows, const float* panels,
                int64_t depth, int64_t columns, int64_t first_panel, int64_t end_panel,
                float alpha, const float* bias, float* c, int64_t ldc) {
  const int max_tile_rows = MaxTileRows(level);
  alignas(64) float acc[12 * kPanelWidth];
  for (int64_t chunk = 0; chunk < rows; chunk += kRowChunk) {
    const int64_t chunk_rows = std::min(kRowChunk, rows - chunk);
    // Tiles of equal height (16 rows: 6 + 5 + 5 on AVX2), not full ones and a short rest.
    const int64_t tiles = (chunk_rows + max_tile_rows - 1) / max_tile_rows;
    // Panels outermost: the weights stream through once, in memory order, which the
    // hardware prefetcher follows; the chunk's rows of A stay in L2.
    for (int64_t p = first_panel; p < end_panel; ++p) {
      const int64_t column = p * kPanelWidth;
      const int64_t width = std::min(kPanelWidth, columns - column);
      for (int64_t k0 = 0; k0 < depth; k0 += kDepthBlock) {
        const int64_t slice = std::min(kDepthBlock, depth - k0);
        const float* panel = panels + (p * depth + k0) * kPanelWidth;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t first = chunk + chunk_rows * t / tiles;
          const int tile_rows = static_cast<int>(chunk + chunk_rows * (t + 1) / tiles - first);
          Tile(level, tile_rows)(a + first * lda + k0, lda, panel, slice, acc);
          Epilogue(acc, tile_rows, width, alpha, bias == nullptr ? nullptr : bias + column,
                   k0 > 0, c + first * ldc + column, ldc);
        }
      }
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
void LinearForward(ThreadPool& pool, const float* x, int64_t rows, int64_t in_features,
                   absl::Span<const float> weight, absl::Span<const float> bias,
                   int64_t out_features, float* y, const float* panels,
                   SimdLevel level, std::optional<int64_t> max_packed_rows) {
  constexpr int64_t kMinPart = 16;
  const int64_t threads = pool.size();
  const bool split_rows = rows >= out_features ? rows >= threads * kMinPart
                                               : out_features < threads * kMinPart;
  if (panels != nullptr && rows <= max_packed_rows.value_or(PackedLinearMaxRows(level))) {
    const int64_t total = split_rows ? rows : PanelCount(out_features);
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, total));
    const float* b = bias.empty() ? nullptr : bias.data();
    pool.ParallelFor(parts, [&](int64_t part) {
      const int64_t begin = total * part / parts, end = total * (part + 1) / parts;
      if (begin == end) return;
      if (split_rows) {
        GemmPanels(level, x + begin * in_features, in_features, end - begin, panels,
                   in_features, out_features, 0, PanelCount(out_features), 1.0f, b,
                   y + begin * out_features, out_features);
      } else {
        GemmPanels(level, x, in_features, rows, panels, in_features, out_features, begin, end,
                   1.0f, b, y, out_features);
      }
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
