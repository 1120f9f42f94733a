// bf16 GEMMs on AMX tiles (Intel Sapphire Rapids and later): C = alpha * A * B + bias with A
// in bf16 rows and B in the bf16 panel layout of core/cpu/gemm_bf16.h, which is already the
// layout `tdpbf16ps` takes for its second operand (16 pair-rows of 16 columns x 2 depths).
//
// The blocking, the staging of edges and the epilogue are written once over a tile unit:
// the hardware unit runs AMX's instructions; the emulated unit is a scalar model of the
// same ones (each pair of bf16 products exact in float32, added to the sum one at a time),
// so the tiling is tested on every host, and the hardware against the model where AMX runs.
#ifndef ATTENTION_CORE_CPU_AMX_TILES_H_
#define ATTENTION_CORE_CPU_AMX_TILES_H_

#include <cstdint>
#include <string>

namespace attention::core {

// One bf16 GEMM over the panels [first_panel, end_panel) of B [depth, columns]: rows of C,
// `ldc` elements apart, get alpha * A B + bias (or + C with `accumulate`, then bias is
// null), as floats into `c` or, with `c_bf16`, rounded to bf16 there instead.
struct Bf16PanelGemm {
  const uint16_t* a;
  int64_t lda;
  int64_t rows;
  const uint16_t* panels;
  int64_t depth;
  int64_t columns;
  int64_t first_panel;
  int64_t end_panel;
  float alpha;
  const float* bias;
  float* c;
  uint16_t* c_bf16;
  int64_t ldc;
  bool accumulate;
};

// Whether this CPU has AMX-BF16 and the kernel lets this process use the tile data (asked
// once, with arch_prctl(ARCH_REQ_XCOMP_PERM)); `AmxUnavailableReason` says why not.
bool AmxTilesUsable();
std::string AmxUnavailableReason();

// The GEMM on AMX's tiles. Only where AmxTilesUsable().
void GemmBf16Amx(const Bf16PanelGemm& gemm);
// The same blocking over the scalar model of the tile instructions: any CPU.
void GemmBf16AmxEmulated(const Bf16PanelGemm& gemm);

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_AMX_TILES_H_
