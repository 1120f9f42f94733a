#include "core/cpu/amx_tiles.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/gemm.h"
#include "core/dtype.h"
#include "core/half_bits.h"
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attention::core {
namespace {

constexpr int64_t kTileRows = 16;              // rows of an A or C tile, pair-rows of a B tile
constexpr int64_t kTileDepth = 32;             // bf16 depths in a row of an A tile (64 bytes)
constexpr int64_t kPairRow = 2 * kPanelWidth;  // bf16 elements in a pair-row of a panel
constexpr int64_t kPairRowBytes = kPairRow * 2;
// C is computed in blocks of 2 x 2 tiles: 32 rows by two panels.
constexpr int64_t kBlockRows = 2 * kTileRows;
constexpr int64_t kBlockColumns = 2 * kPanelWidth;

// One depth step of a block: A's two tiles (the second kTileRows rows below the first,
// rows `a_stride` elements apart) and B's two (16 pair-rows of a panel each).
struct TileStep {
  const uint16_t* a;
  int64_t a_stride;
  const uint16_t* b0;
  const uint16_t* b1;
};

// A block's sums (kBlockRows x kBlockColumns floats) into C, the arithmetic of the other
// bf16 tiles: alpha * sum + (C, bias or 0), then rounded to bf16 where C is bf16.
void WriteBlock(const Bf16PanelGemm& g, const float* sums, int64_t first_row, int64_t rows,
                int64_t first_column, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* sum = sums + r * kBlockColumns;
    const int64_t offset = (first_row + r) * g.ldc + first_column;
    for (int64_t j = 0; j < width; ++j) {
      const float addend = g.accumulate        ? g.c[offset + j]
                           : g.bias != nullptr ? g.bias[first_column + j]
                                               : 0.0f;
      const float value = g.alpha * sum[j] + addend;
      if (g.c_bf16 != nullptr) {
        g.c_bf16[offset + j] = FloatToBFloat16(value);
      } else {
        g.c[offset + j] = value;
      }
    }
  }
}

// The scalar model of the tile unit: four float32 accumulators of 16 x 16, and
// `tdpbf16ps` as the SDM writes it (per pair k: C += A[2k] B[2k], then C += A[2k+1] B[2k+1],
// each bf16 product exact in float32).
class EmulatedTileUnit {
 public:
  void Begin() {}
  void End() {}
  void Zero() { std::fill(std::begin(sums_), std::end(sums_), 0.0f); }
  void Step(const TileStep& step) {
    for (int64_t tile_row = 0; tile_row < 2; ++tile_row) {
      const uint16_t* a = step.a + tile_row * kTileRows * step.a_stride;
      for (int64_t tile_column = 0; tile_column < 2; ++tile_column) {
        DotProducts(a, step.a_stride, tile_column == 0 ? step.b0 : step.b1,
                    sums_ + tile_row * kTileRows * kBlockColumns + tile_column * kPanelWidth);
      }
    }
  }
  void Store(float* sums) const { std::copy(std::begin(sums_), std::end(sums_), sums); }
  void StoreTo(float* c, int64_t ldc) const {
    for (int64_t r = 0; r < kBlockRows; ++r) {
      std::copy_n(sums_ + r * kBlockColumns, kBlockColumns, c + r * ldc);
    }
  }
  void Write(const Bf16PanelGemm& g, const float* sums, int64_t first_row, int64_t rows,
             int64_t first_column, int64_t width) const {
    WriteBlock(g, sums, first_row, rows, first_column, width);
  }

 private:
  // tdpbf16ps on one accumulator tile (rows kBlockColumns floats apart in sums_).
  static void DotProducts(const uint16_t* a, int64_t a_stride, const uint16_t* b, float* sums) {
    for (int64_t m = 0; m < kTileRows; ++m) {
      for (int64_t k = 0; k < kTileDepth / 2; ++k) {
        const float a_even = BFloat16BitsToFloat(a[m * a_stride + 2 * k]);
        const float a_odd = BFloat16BitsToFloat(a[m * a_stride + 2 * k + 1]);
        for (int64_t n = 0; n < kPanelWidth; ++n) {
          float& sum = sums[m * kBlockColumns + n];
          sum += a_even * BFloat16BitsToFloat(b[k * kPairRow + 2 * n]);
          sum += a_odd * BFloat16BitsToFloat(b[k * kPairRow + 2 * n + 1]);
        }
      }
    }
  }

  alignas(64) float sums_[kBlockRows * kBlockColumns];
};

// The GEMM in blocks of 2 x 2 tiles over any tile unit. Depth steps of 32 read A and the
// panels in place; what a tile load would read past an operand (a short last block of rows,
// the depth past the last multiple of 32, a missing second panel) is staged zero-padded,
// so every load stays inside memory and padding adds zeros.
template <class Unit>
void GemmTiled(Unit& unit, const Bf16PanelGemm& g) {
  const int64_t pair_rows = (g.depth + 1) / 2;
  const int64_t panel_stride = pair_rows * kPairRow;
  const int64_t full_depth = g.depth / kTileDepth * kTileDepth;
  const bool has_tail = full_depth < g.depth;
  const int64_t padded_depth = full_depth + (has_tail ? kTileDepth : 0);
  thread_local std::vector<uint16_t> short_block;
  alignas(64) uint16_t a_tail[kBlockRows * kTileDepth];
  alignas(64) uint16_t b_tail[2][kTileRows * kPairRow];
  alignas(64) static constexpr uint16_t kZeroPanel[kTileRows * kPairRow] = {};
  alignas(64) float sums[kBlockRows * kBlockColumns];
  // Float32 C that takes the sums as they are: whole blocks go from the tiles straight there.
  const bool plain_sums =
      g.alpha == 1.0f && g.bias == nullptr && !g.accumulate && g.c_bf16 == nullptr;
  unit.Begin();
  // Panels a pass keeps in L2 while every block of rows goes by (384 KiB at depth 768):
  // row blocks outermost re-read all the weights from L3 for every 32 rows.
  constexpr int64_t kChunkPanels = 16;  // even, so panels pair up as over the whole range
  for (int64_t chunk = g.first_panel; chunk < g.end_panel; chunk += kChunkPanels) {
    const int64_t chunk_end = std::min(g.end_panel, chunk + kChunkPanels);
    for (int64_t first_row = 0; first_row < g.rows; first_row += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, g.rows - first_row);
      const uint16_t* a = g.a + first_row * g.lda;
      int64_t lda = g.lda;
      if (rows < kBlockRows) {
        short_block.assign(kBlockRows * padded_depth, 0);
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(short_block.data() + r * padded_depth, a + r * lda,
                      g.depth * sizeof(uint16_t));
        }
        a = short_block.data();
        lda = padded_depth;
      }
      // The last depth step's A: in place in a staged short block, else staged here.
      const uint16_t* a_last = a + full_depth;
      int64_t a_last_stride = lda;
      if (has_tail && rows == kBlockRows) {
        std::fill(std::begin(a_tail), std::end(a_tail), uint16_t{0});
        for (int64_t r = 0; r < kBlockRows; ++r) {
          std::memcpy(a_tail + r * kTileDepth, a + r * lda + full_depth,
                      (g.depth - full_depth) * sizeof(uint16_t));
        }
        a_last = a_tail;
        a_last_stride = kTileDepth;
      }
      for (int64_t p = chunk; p < chunk_end; p += 2) {
        const bool two_panels = p + 1 < chunk_end;
        const uint16_t* b0 = g.panels + p * panel_stride;
        const uint16_t* b1 = two_panels ? b0 + panel_stride : nullptr;
        unit.Zero();
        for (int64_t k = 0; k < full_depth; k += kTileDepth) {
          const int64_t pair_row = k / 2;
          unit.Step({a + k, lda, b0 + pair_row * kPairRow,
                     two_panels ? b1 + pair_row * kPairRow : kZeroPanel});
        }
        if (has_tail) {
          const int64_t tail_bytes = (pair_rows - full_depth / 2) * kPairRowBytes;
          for (int64_t q = 0; q < 2; ++q) {
            std::memset(b_tail[q], 0, sizeof(b_tail[q]));
            if (q == 1 && !two_panels) continue;
            std::memcpy(b_tail[q], (q == 0 ? b0 : b1) + full_depth / 2 * kPairRow, tail_bytes);
          }
          unit.Step({a_last, a_last_stride, b_tail[0], b_tail[1]});
        }
        const int64_t first_column = p * kPanelWidth;
        const int64_t width =
            std::min(two_panels ? kBlockColumns : kPanelWidth, g.columns - first_column);
        if (plain_sums && rows == kBlockRows && width == kBlockColumns) {
          unit.StoreTo(g.c + first_row * g.ldc + first_column, g.ldc);  // 1 * sum + 0 is sum
          continue;
        }
        unit.Store(sums);
        unit.Write(g, sums, first_row, rows, first_column, width);
      }
    }
  }
  unit.End();
}

#if defined(__x86_64__)
#define ATTENTION_AMX_TARGET \
  __attribute__((target("avx512f,avx512bf16,avx512vl,amx-tile,amx-bf16")))

// ldtilecfg's operand: palette 1, all eight tiles 16 rows of 64 bytes. In static storage:
// GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of it, not 64.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};
constexpr TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// GCC 12's tile loads and stores do not tell the compiler that they read or write memory:
// a barrier keeps the staging copies before the loads, and the stores before the reads.
inline void CompilerMemoryBarrier() { asm volatile("" ::: "memory"); }

// The hardware unit: tiles 0-3 the accumulators (row-major over the block), 4-5 A, 6-7 B.
class AmxTileUnit {
 public:
  ATTENTION_AMX_TARGET void Begin() { _tile_loadconfig(&kTileConfig); }
  ATTENTION_AMX_TARGET void End() { _tile_release(); }
  ATTENTION_AMX_TARGET void Zero() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  ATTENTION_AMX_TARGET void Step(const TileStep& step) {
    const int64_t a_stride_bytes = step.a_stride * 2;
    CompilerMemoryBarrier();
    _tile_loadd(4, step.a, a_stride_bytes);
    _tile_loadd(5, step.a + kTileRows * step.a_stride, a_stride_bytes);
    _tile_loadd(6, step.b0, kPairRowBytes);
    _tile_loadd(7, step.b1, kPairRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  ATTENTION_AMX_TARGET void Store(float* sums) const {
    constexpr int64_t kStride = kBlockColumns * sizeof(float);
    _tile_stored(0, sums, kStride);
    _tile_stored(1, sums + kPanelWidth, kStride);
    _tile_stored(2, sums + kTileRows * kBlockColumns, kStride);
    _tile_stored(3, sums + kTileRows * kBlockColumns + kPanelWidth, kStride);
    CompilerMemoryBarrier();
  }
  ATTENTION_AMX_TARGET void StoreTo(float* c, int64_t ldc) const {
    const int64_t stride = ldc * static_cast<int64_t>(sizeof(float));
    _tile_stored(0, c, stride);
    _tile_stored(1, c + kPanelWidth, stride);
    _tile_stored(2, c + kTileRows * ldc, stride);
    _tile_stored(3, c + kTileRows * ldc + kPanelWidth, stride);
    CompilerMemoryBarrier();
  }
  // WriteBlock in AVX-512, the same arithmetic (a product, then a sum; no FMA).
  ATTENTION_AMX_TARGET void Write(const Bf16PanelGemm& g, const float* sums, int64_t first_row,
                                  int64_t rows, int64_t first_column, int64_t width) const {
    const __m512 alpha = _mm512_set1_ps(g.alpha);
    for (int64_t r = 0; r < rows; ++r) {
      const float* sum = sums + r * kBlockColumns;
      const int64_t offset = (first_row + r) * g.ldc + first_column;
      for (int64_t j = 0; j < width; j += kPanelWidth) {
        const __mmask16 live =
            width - j >= kPanelWidth ? 0xFFFF : static_cast<__mmask16>((1u << (width - j)) - 1);
        const __m512 addend = g.accumulate ? _mm512_maskz_loadu_ps(live, g.c + offset + j)
                              : g.bias != nullptr
                                  ? _mm512_maskz_loadu_ps(live, g.bias + first_column + j)
                                  : _mm512_setzero_ps();
        const __m512 value = _mm512_add_ps(_mm512_mul_ps(alpha, _mm512_load_ps(sum + j)), addend);
        if (g.c_bf16 != nullptr) {
          _mm256_mask_storeu_epi16(g.c_bf16 + offset + j, live, (__m256i)_mm512_cvtneps_pbh(value));
        } else {
          _mm512_mask_storeu_ps(g.c + offset + j, live, value);
        }
      }
    }
  }
};
#undef ATTENTION_AMX_TARGET
#endif

struct AmxAccess {
  bool usable = false;
  std::string reason;
};

#if defined(__x86_64__)
AmxAccess AskForAmx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;  // CPUID.(7, 0):EDX
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0 || (edx & kAmxBf16) == 0 ||
      (edx & kAmxTile) == 0) {
    return {false, "this CPU has no AMX-BF16"};
  }
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vl")) {
    return {false, "this CPU has AMX but no AVX512-BF16 for the tiles' epilogue"};
  }
  // Linux hands out the 8 KiB of tile data per process, on request.
  constexpr long kArchRequestXcompPermission = 0x1023, kXfeatureTileData = 18;
  if (syscall(SYS_arch_prctl, kArchRequestXcompPermission, kXfeatureTileData) != 0) {
    return {
        false,
        absl::StrCat("the kernel refused the tile data (arch_prctl: ", std::strerror(errno), ")")};
  }
  return {true, ""};
}
#else
AmxAccess AskForAmx() { return {false, "not an x86-64 CPU"}; }
#endif

const AmxAccess& Access() {
  static const AmxAccess access = AskForAmx();
  return access;
}

}  // namespace

bool AmxTilesUsable() { return Access().usable; }

std::string AmxUnavailableReason() { return Access().reason; }

void GemmBf16Amx(const Bf16PanelGemm& gemm) {
#if defined(__x86_64__)
  AmxTileUnit unit;
  GemmTiled(unit, gemm);
#else
  GemmBf16AmxEmulated(gemm);
#endif
}

void GemmBf16AmxEmulated(const Bf16PanelGemm& gemm) {
  EmulatedTileUnit unit;
  GemmTiled(unit, gemm);
}

}  // namespace attention::core
