#include "core/cpu/gemm_bf16.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/cpu/amx_tiles.h"
#include "core/cpu/transpose_avx512.h"
#include "core/dtype.h"
#include "core/half_bits.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attention::core {
namespace {

// Elements of one pair-row of a bf16 panel: 16 columns x 2 depths.
constexpr int64_t kPairRow = 2 * kPanelWidth;
// Rows per chunk of A, as GemmPanels: the chunk stays in L2 while the panels stream by.
constexpr int64_t kRowChunk = 128;

// Where a tile's sums go, as GemmPanels' TileOutput.
struct Bf16TileOutput {
  float alpha;
  const float* bias;
  bool accumulate;
  float* c;
  int64_t ldc;
  int64_t width;  // valid columns of the tile's last panel (<= 16)
  // Null, or where the sums go rounded to bf16 instead of c (ldc elements apart; no
  // accumulate): a BFLOAT16 layer's Q, K and V for attention's bf16 products.
  uint16_t* c_bf16 = nullptr;
};

// The portable tile: `panels` (1 or 2, `panel_stride` apart) x `rows` rows, products of
// the bf16 values in float32.
void TileBf16Portable(const uint16_t* a, int64_t lda, int rows, const uint16_t* panel,
                      int64_t panel_stride, int panels, int64_t depth, const Bf16TileOutput& out) {
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < panels; ++p) {
      const uint16_t* b = panel + p * panel_stride;
      const int64_t width = p + 1 == panels ? out.width : kPanelWidth;
      // (No row of C when the sums go to bf16: null plus an offset is undefined.)
      float* row = out.c == nullptr ? nullptr : out.c + r * out.ldc + p * kPanelWidth;
      for (int64_t j = 0; j < width; ++j) {
        float sum = 0.0f;
        for (int64_t k = 0; k < depth; ++k) {
          sum += BFloat16BitsToFloat(a[r * lda + k]) *
                 BFloat16BitsToFloat(b[(k / 2) * kPairRow + 2 * j + k % 2]);
        }
        const float* bias = out.bias == nullptr ? nullptr : out.bias + p * kPanelWidth;
        if (out.c_bf16 != nullptr) {
          const float result = out.alpha * sum + (bias != nullptr ? bias[j] : 0.0f);
          out.c_bf16[r * out.ldc + p * kPanelWidth + j] = FloatToBFloat16(result);
          continue;
        }
        const float addend = out.accumulate ? row[j] : bias != nullptr ? bias[j] : 0.0f;
        row[j] = out.alpha * sum + addend;
      }
    }
  }
}

#if defined(__x86_64__)
// Two bf16 of A (depths k and k + 1) in every lane.
__attribute__((target("avx512f"))) inline __m512i PairAt(const uint16_t* a) {
  int32_t pair;
  std::memcpy(&pair, a, sizeof(pair));
  return _mm512_set1_epi32(pair);
}
// Past the last pair-row it fetches what follows (or nothing): prefetches never fault.
inline void PrefetchPairRow(const uint16_t* row) {
  _mm_prefetch(reinterpret_cast<const char*>(row), _MM_HINT_T0);
}
// A last odd depth, paired with zero.
__attribute__((target("avx512f"))) inline __m512i SingleAt(const uint16_t* a) {
  return _mm512_set1_epi32(*a);
}

// R rows x 2 full panels, 2 x R accumulators (R <= 12), one pair of depths a step. The
// accumulators are named variables (see gemm.cc: GCC spills an array of vectors).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are pasted into names.
#define BF16_ROW(r, load)                                              \
  if constexpr (R > r) {                                               \
    const __m512bh x = (__m512bh)load(a + r * lda + k);                \
    left##r = _mm512_dpbf16_ps(left##r, x, b0);                        \
    if constexpr (kWide) right##r = _mm512_dpbf16_ps(right##r, x, b1); \
  }
#define BF16_STORE(r)                                                                        \
  if constexpr (R > r) {                                                                     \
    if (out.c_bf16 != nullptr) {                                                             \
      uint16_t* row = out.c_bf16 + r * out.ldc;                                              \
      const __m256i left =                                                                   \
          (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(left##r, alpha, bias_left));           \
      if constexpr (kWide) {                                                                 \
        const __m256i right =                                                                \
            (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(right##r, alpha, bias_right));       \
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), left);                          \
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16), right);                    \
      } else {                                                                               \
        _mm256_mask_storeu_epi16(row, mask, left);                                           \
      }                                                                                      \
    } else {                                                                                 \
      float* row = out.c + r * out.ldc;                                                      \
      if constexpr (kWide) {                                                                 \
        const __m512 left_addend = out.accumulate ? _mm512_loadu_ps(row) : bias_left;        \
        const __m512 right_addend = out.accumulate ? _mm512_loadu_ps(row + 16) : bias_right; \
        _mm512_storeu_ps(row, _mm512_fmadd_ps(left##r, alpha, left_addend));                 \
        _mm512_storeu_ps(row + 16, _mm512_fmadd_ps(right##r, alpha, right_addend));          \
      } else {                                                                               \
        const __m512 addend = out.accumulate ? _mm512_maskz_loadu_ps(mask, row) : bias_left; \
        _mm512_mask_storeu_ps(row, mask, _mm512_fmadd_ps(left##r, alpha, addend));           \
      }                                                                                      \
    }                                                                                        \
  }
template <int R, bool kWide>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,prfchw"))) void TileBf16Avx512(
    const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t panel_stride, int64_t depth,
    const Bf16TileOutput& out) {
  __m512 left0 = _mm512_setzero_ps(), left1 = left0, left2 = left0, left3 = left0, left4 = left0,
         left5 = left0, left6 = left0, left7 = left0, left8 = left0, left9 = left0, left10 = left0,
         left11 = left0;
  __m512 right0 = left0, right1 = left0, right2 = left0, right3 = left0, right4 = left0,
         right5 = left0, right6 = left0, right7 = left0, right8 = left0, right9 = left0,
         right10 = left0, right11 = left0;
  const uint16_t* second = panel + panel_stride;
  // Pair-rows ahead that the panels are fetched into L1 (their two panels do not fit in
  // Zen 4's 32 KiB L1 and come from L2): Zen 4, one thread, QKV GEMM 0.90 -> 0.94 of peak.
  constexpr int64_t kAhead = 8;
  constexpr int64_t kTileColumns = (kWide ? 2 : 1) * kPanelWidth;
  if (out.c_bf16 != nullptr) {
    PrefetchForWriting(out.c_bf16, out.ldc * sizeof(uint16_t), R, kTileColumns * sizeof(uint16_t));
  } else {
    PrefetchForWriting(out.c, out.ldc * sizeof(float), R, kTileColumns * sizeof(float));
  }
  // clang-format off
#define BF16_STEP(load)                                                                       \
  PrefetchPairRow(panel + (k / 2 + kAhead) * kPairRow);                                       \
  if constexpr (kWide) PrefetchPairRow(second + (k / 2 + kAhead) * kPairRow);                 \
  const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + (k / 2) * kPairRow);               \
  const __m512bh b1 = kWide ? (__m512bh)_mm512_loadu_si512(second + (k / 2) * kPairRow) : b0; \
  BF16_ROW(0, load) BF16_ROW(1, load) BF16_ROW(2, load) BF16_ROW(3, load)                     \
  BF16_ROW(4, load) BF16_ROW(5, load) BF16_ROW(6, load) BF16_ROW(7, load)                     \
  BF16_ROW(8, load) BF16_ROW(9, load) BF16_ROW(10, load) BF16_ROW(11, load)
  // clang-format on
  int64_t k = 0;
  for (; k + 1 < depth; k += 2) {
    BF16_STEP(PairAt)
  }
  if (k < depth) {
    BF16_STEP(SingleAt)
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << out.width) - 1);
  const __m512 alpha = _mm512_set1_ps(out.alpha);
  const __m512 bias_left =
      out.bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, out.bias);
  const __m512 bias_right =
      out.bias == nullptr || !kWide ? _mm512_setzero_ps() : _mm512_loadu_ps(out.bias + 16);
  // clang-format off
  BF16_STORE(0) BF16_STORE(1) BF16_STORE(2) BF16_STORE(3) BF16_STORE(4) BF16_STORE(5)
  BF16_STORE(6) BF16_STORE(7) BF16_STORE(8) BF16_STORE(9) BF16_STORE(10) BF16_STORE(11)
  // clang-format on
}
#undef BF16_ROW
#undef BF16_STEP
// NOLINTEND(bugprone-macro-parentheses)
#undef BF16_STORE

using Bf16TileFn = void (*)(const uint16_t* a, int64_t lda, const uint16_t* panel,
                            int64_t panel_stride, int64_t depth, const Bf16TileOutput& out);
template <bool kWide>
constexpr Bf16TileFn kTiles[] = {nullptr,
                                 &TileBf16Avx512<1, kWide>,
                                 &TileBf16Avx512<2, kWide>,
                                 &TileBf16Avx512<3, kWide>,
                                 &TileBf16Avx512<4, kWide>,
                                 &TileBf16Avx512<5, kWide>,
                                 &TileBf16Avx512<6, kWide>,
                                 &TileBf16Avx512<7, kWide>,
                                 &TileBf16Avx512<8, kWide>,
                                 &TileBf16Avx512<9, kWide>,
                                 &TileBf16Avx512<10, kWide>,
                                 &TileBf16Avx512<11, kWide>,
                                 &TileBf16Avx512<12, kWide>};

// PackBf16Panels with depth_stride 1 (keys): each column's depths are contiguous, so a
// column's 16 pairs of depths are one vector of 16 dwords (rounded from float32, or loaded
// as they are from bf16), and a panel's pair-rows are the 16 x 16 transpose of its 16
// columns' vectors.
template <typename Source>
__attribute__((target("avx512f,avx512bf16,avx512bw"))) void PackBf16TransposedAvx512(
    const Source* b, int64_t depth, int64_t columns, int64_t column_stride, uint16_t* panels) {
  const int64_t pair_rows = (depth + 1) / 2;
  for (int64_t p = 0; p < PanelCount(columns); ++p) {
    uint16_t* panel = panels + p * pair_rows * kPairRow;
    const Source* first_column = b + p * kPanelWidth * column_stride;
    const int64_t width = std::min(kPanelWidth, columns - p * kPanelWidth);
    // The next panel's columns are rows far apart (a head's keys in a projected row of
    // Q, K and V): fetch them while this one transposes.
    const int64_t next_width = std::min(kPanelWidth, columns - (p + 1) * kPanelWidth);
    for (int64_t j = 0; j < next_width; ++j) {
      const Source* column = first_column + (kPanelWidth + j) * column_stride;
      for (int64_t k = 0; k < depth; k += 64 / sizeof(Source)) {
        _mm_prefetch(reinterpret_cast<const char*>(column + k), _MM_HINT_T0);
      }
    }
    for (int64_t k0 = 0; k0 < depth; k0 += 2 * kPanelWidth) {
      const int64_t depths = std::min(2 * kPanelWidth, depth - k0);
      const __mmask16 low = static_cast<__mmask16>((1u << std::min<int64_t>(depths, 16)) - 1);
      const __mmask16 high = static_cast<__mmask16>((1u << std::max<int64_t>(depths - 16, 0)) - 1);
      const __mmask32 all = static_cast<__mmask32>((uint64_t{1} << depths) - 1);
      __m512 block[16];
      for (int64_t j = 0; j < kPanelWidth; ++j) {
        if (j >= width) {
          block[j] = _mm512_setzero_ps();
          continue;
        }
        const Source* column = first_column + j * column_stride + k0;
        if constexpr (std::is_same_v<Source, float>) {
          block[j] = (__m512)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, column + 16),
                                                 _mm512_maskz_loadu_ps(low, column));
        } else {
          block[j] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(all, column));
        }
      }
      Transpose16x16(block);
      for (int64_t m = 0; m < (depths + 1) / 2; ++m) {
        _mm512_storeu_ps(reinterpret_cast<float*>(panel + (k0 / 2 + m) * kPairRow), block[m]);
      }
    }
  }
}

// (GCC 12 takes _mm512_inserti64x4's undefined pass-through operand for an uninitialised
// read.)
#pragma GCC diagnostic push
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// PackBf16Panels with column_stride 1 (values): two rows of B (rounded from float32, or
// bf16 already) as one vector, their elements interleaved into a pair-row.
template <typename Source>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void PackBf16RowsAvx512(
    const Source* b, int64_t depth, int64_t columns, int64_t ldb, uint16_t* panels) {
  const int64_t pair_rows = (depth + 1) / 2;
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t p = 0; p < PanelCount(columns); ++p) {
    uint16_t* panel = panels + p * pair_rows * kPairRow;
    const Source* first = b + p * kPanelWidth;
    const int64_t width = std::min(kPanelWidth, columns - p * kPanelWidth);
    const __mmask16 live = static_cast<__mmask16>((1u << width) - 1);
    for (int64_t kk = 0; kk < pair_rows; ++kk) {
      const bool has_odd = 2 * kk + 1 < depth;
      __m512i pair;  // the even row's 16 elements, then the odd row's
      if constexpr (std::is_same_v<Source, float>) {
        const __m512 even = _mm512_maskz_loadu_ps(live, first + 2 * kk * ldb);
        const __m512 odd =
            has_odd ? _mm512_maskz_loadu_ps(live, first + (2 * kk + 1) * ldb) : _mm512_setzero_ps();
        pair = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
      } else {
        const __m256i even = _mm256_maskz_loadu_epi16(live, first + 2 * kk * ldb);
        const __m256i odd = has_odd ? _mm256_maskz_loadu_epi16(live, first + (2 * kk + 1) * ldb)
                                    : _mm256_setzero_si256();
        pair = _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
      }
      _mm512_storeu_si512(panel + kk * kPairRow, _mm512_permutexvar_epi16(interleave, pair));
    }
  }
}
#pragma GCC diagnostic pop
#endif

constexpr int kMaxTileRows = 12;
// Up to this many rows, kAmx multiplies attention's products on AVX512-BF16 instead
// (GemmBf16PanelsInto; a head's rows are its request's own). Projections always use AMX.
constexpr int64_t kAmxMinRows = 16;

}  // namespace

const char* Bf16KernelName(Bf16Kernel kernel) {
  switch (kernel) {
    case Bf16Kernel::kAvx512Bf16:
      return "avx512_bf16";
    case Bf16Kernel::kAmx:
      return "amx";
    case Bf16Kernel::kPortable:
      break;
  }
  return "portable";
}

bool CpuSupports(Bf16Kernel kernel) {
#if defined(__x86_64__)
  if (kernel == Bf16Kernel::kAmx) return AmxTilesUsable();
  if (kernel == Bf16Kernel::kAvx512Bf16) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }
#endif
  return kernel == Bf16Kernel::kPortable;
}

Bf16Kernel BestBf16Kernel() {
  static const Bf16Kernel best =
      CpuSupports(Bf16Kernel::kAvx512Bf16) ? Bf16Kernel::kAvx512Bf16 : Bf16Kernel::kPortable;
  return best;
}

void RoundToBf16(const float* x, int64_t count, uint16_t* out, Bf16Kernel kernel) {
  if (kernel != Bf16Kernel::kPortable) {
    FloatsToBFloat16(x, count, out);  // the same instructions, where the CPU has them
    return;
  }
  // Inline, so that it vectorizes: hosts without bf16 instructions round every
  // call's tokens and attended rows here.
  for (int64_t i = 0; i < count; ++i) out[i] = FloatToBFloat16Bits(x[i]);
}

namespace {

// An element of B as a panel holds it: float32 rounded, bf16 as it is.
uint16_t PanelBits(float value) { return FloatToBFloat16(value); }
uint16_t PanelBits(uint16_t bf16) { return bf16; }

template <typename Source>
void PackBf16PanelsOf(const Source* b, int64_t depth, int64_t columns, int64_t depth_stride,
                      int64_t column_stride, uint16_t* panels, Bf16Kernel kernel) {
#if defined(__x86_64__)
  // Attention packs every head's keys and values so: a scalar loop would cost as much as
  // the products.
  if (kernel != Bf16Kernel::kPortable && depth_stride == 1) {
    PackBf16TransposedAvx512(b, depth, columns, column_stride, panels);
    return;
  }
  if (kernel != Bf16Kernel::kPortable && column_stride == 1) {
    PackBf16RowsAvx512(b, depth, columns, depth_stride, panels);
    return;
  }
#endif
  const int64_t pair_rows = (depth + 1) / 2;
  for (int64_t p = 0; p < PanelCount(columns); ++p) {
    uint16_t* panel = panels + p * pair_rows * kPairRow;
    std::fill(panel, panel + pair_rows * kPairRow, uint16_t{0});
    const int64_t width = std::min(kPanelWidth, columns - p * kPanelWidth);
    for (int64_t j = 0; j < width; ++j) {
      const Source* column = b + (p * kPanelWidth + j) * column_stride;
      for (int64_t k = 0; k < depth; ++k) {
        panel[(k / 2) * kPairRow + 2 * j + k % 2] = PanelBits(column[k * depth_stride]);
      }
    }
  }
}

}  // namespace

void PackBf16Transposed(const uint16_t* w, int64_t columns, int64_t depth, int64_t ldw,
                        uint16_t* panels) {
  PackBf16PanelsOf(w, depth, columns, 1, ldw, panels, BestBf16Kernel());
}

void PackBf16Panels(const float* b, int64_t depth, int64_t columns, int64_t depth_stride,
                    int64_t column_stride, uint16_t* panels, Bf16Kernel kernel) {
  PackBf16PanelsOf(b, depth, columns, depth_stride, column_stride, panels, kernel);
}

void PackBf16Panels(const uint16_t* b, int64_t depth, int64_t columns, int64_t depth_stride,
                    int64_t column_stride, uint16_t* panels, Bf16Kernel kernel) {
  PackBf16PanelsOf(b, depth, columns, depth_stride, column_stride, panels, kernel);
}

namespace {

// GemmBf16Panels into float32 `c` or, with `c_bf16`, into bf16 (then `c` is unused).
// With `amx_min_rows`, up to that many rows of kAmx multiply on AVX512-BF16 instead.
void GemmBf16PanelsInto(Bf16Kernel kernel, const uint16_t* a, int64_t lda, int64_t rows,
                        const uint16_t* panels, int64_t depth, int64_t columns, int64_t first_panel,
                        int64_t end_panel, float alpha, const float* bias, float* c,
                        uint16_t* c_bf16, int64_t ldc, bool accumulate,
                        int64_t amx_min_rows = kAmxMinRows) {
  // A block of tiles is 32 rows: 16 or fewer would leave half of it multiplying zeros and pay
  // for staging their edges, and every AMX host has AVX512-BF16 (AmxTilesUsable checks).
  if (kernel == Bf16Kernel::kAmx && rows > amx_min_rows) {
    GemmBf16Amx({a, lda, rows, panels, depth, columns, first_panel, end_panel, alpha, bias, c,
                 c_bf16, ldc, accumulate});
    return;
  }
  if (kernel == Bf16Kernel::kAmx) kernel = Bf16Kernel::kAvx512Bf16;
  const int64_t panel_stride = (depth + 1) / 2 * kPairRow;
  for (int64_t chunk = 0; chunk < rows; chunk += kRowChunk) {
    const int64_t chunk_rows = std::min(kRowChunk, rows - chunk);
    const int64_t tiles = (chunk_rows + kMaxTileRows - 1) / kMaxTileRows;
    for (int64_t p = first_panel; p < end_panel;) {
      const int64_t column = p * kPanelWidth;
      const bool wide = p + 1 < end_panel && column + 2 * kPanelWidth <= columns;
      const int64_t width = wide ? kPanelWidth : std::min(kPanelWidth, columns - column);
      const uint16_t* panel = panels + p * panel_stride;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = chunk + chunk_rows * t / tiles;
        const int tile_rows = static_cast<int>(chunk + chunk_rows * (t + 1) / tiles - first);
        const int64_t offset = first * ldc + column;
        const Bf16TileOutput out{alpha,
                                 bias == nullptr ? nullptr : bias + column,
                                 accumulate,
                                 c == nullptr ? nullptr : c + offset,
                                 ldc,
                                 width,
                                 c_bf16 == nullptr ? nullptr : c_bf16 + offset};
#if defined(__x86_64__)
        if (kernel == Bf16Kernel::kAvx512Bf16) {
          (wide ? kTiles<true> : kTiles<false>)[tile_rows](a + first * lda, lda, panel,
                                                           panel_stride, depth, out);
          continue;
        }
#endif
        TileBf16Portable(a + first * lda, lda, tile_rows, panel, panel_stride, wide ? 2 : 1, depth,
                         out);
      }
      p += wide ? 2 : 1;
    }
  }
}

}  // namespace

void GemmBf16Panels(Bf16Kernel kernel, const uint16_t* a, int64_t lda, int64_t rows,
                    const uint16_t* panels, int64_t depth, int64_t columns, int64_t first_panel,
                    int64_t end_panel, float alpha, const float* bias, float* c, int64_t ldc,
                    bool accumulate) {
  GemmBf16PanelsInto(kernel, a, lda, rows, panels, depth, columns, first_panel, end_panel, alpha,
                     bias, c, nullptr, ldc, accumulate);
}

void GemmBf16PanelsToBf16(Bf16Kernel kernel, const uint16_t* a, int64_t lda, int64_t rows,
                          const uint16_t* panels, int64_t depth, int64_t columns,
                          int64_t first_panel, int64_t end_panel, float alpha, const float* bias,
                          uint16_t* c, int64_t ldc) {
  GemmBf16PanelsInto(kernel, a, lda, rows, panels, depth, columns, first_panel, end_panel, alpha,
                     bias, nullptr, c, ldc, /*accumulate=*/false);
}

PackedBf16Weight::PackedBf16Weight(absl::Span<const uint16_t> weight, int64_t out_features,
                                   int64_t in_features)
    : out_features_(out_features), in_features_(in_features) {
  const size_t bytes = Bf16PanelElements(in_features, out_features) * sizeof(uint16_t);
  panels_.reset(static_cast<uint16_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  PackBf16Transposed(weight.data(), out_features, in_features, in_features, panels_.get());
}

namespace {

// LinearForwardBf16 into float32 `y` or, with `y_bf16`, into bf16 (then `y` is unused).
void LinearForwardBf16Into(ThreadPool& pool, const uint16_t* x, int64_t rows, int64_t in_features,
                           const PackedBf16Weight& weight, absl::Span<const float> bias,
                           int64_t out_features, float* y, uint16_t* y_bf16, Bf16Kernel kernel) {
  const float* b = bias.empty() ? nullptr : bias.data();
  ForEachPackedLinearPart(
      pool, rows, out_features,
      [&](int64_t first_row, int64_t row_count, int64_t first_panel, int64_t end_panel) {
        const int64_t offset = first_row * out_features;
        // AMX at every row count, a decode step's single row too: a row's bits must not
        // depend on how many rows share its projection (issue 55).
        GemmBf16PanelsInto(kernel, x + first_row * in_features, in_features, row_count,
                           weight.panels(), in_features, out_features, first_panel, end_panel, 1.0f,
                           b, y == nullptr ? nullptr : y + offset,
                           y_bf16 == nullptr ? nullptr : y_bf16 + offset, out_features,
                           /*accumulate=*/false, /*amx_min_rows=*/0);
      });
}

}  // namespace

void LinearForwardBf16(ThreadPool& pool, const uint16_t* x, int64_t rows, int64_t in_features,
                       const PackedBf16Weight& weight, absl::Span<const float> bias,
                       int64_t out_features, float* y, Bf16Kernel kernel) {
  LinearForwardBf16Into(pool, x, rows, in_features, weight, bias, out_features, y, nullptr, kernel);
}

void LinearForwardBf16(ThreadPool& pool, const uint16_t* x, int64_t rows, int64_t in_features,
                       const PackedBf16Weight& weight, absl::Span<const float> bias,
                       int64_t out_features, uint16_t* y, Bf16Kernel kernel) {
  LinearForwardBf16Into(pool, x, rows, in_features, weight, bias, out_features, nullptr, y, kernel);
}

}  // namespace attention::core
