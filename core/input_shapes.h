// The shape rules of attention inputs, with messages naming the field and the values. The
// layer knows its own contract, so the front-ends check requests with these and only
// name the fields; each rule lives here once.
#ifndef ATTENTION_CORE_INPUT_SHAPES_H_
#define ATTENTION_CORE_INPUT_SHAPES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/mha_types.h"

namespace attention::core {

using Shape = absl::Span<const int64_t>;

// "[2, 3, 4]".
std::string ShapeString(Shape shape);

// Multi-head attention through a layer of `config`, step by step so that a caller can
// decode each tensor just before its rule:
// query [B, Nq, embed_dim];
absl::Status CheckMhaQueryShape(const MhaConfig& config, Shape query);
// key and value both given (cross-attention) or neither, and neither only when the layer
// can self-attend (kdim = vdim = embed_dim);
absl::Status CheckMhaKeyValuePresence(const MhaConfig& config, bool has_key, bool has_value);
// key [B, Nk, kdim] and value [B, Nk, vdim] with the query's batch size B.
absl::Status CheckMhaKeyValueShapes(const MhaConfig& config, int64_t batch, Shape key, Shape value);

// Scaled dot-product attention: query [B, H, Nq, dk], key [B, Hkv, Nk, dk] and value
// [B, Hkv, Nk, dv], H a multiple of Hkv; their dims.
absl::StatusOr<AttentionDims> SdpaDimsOf(Shape query, Shape key, Shape value);

}  // namespace attention::core

#endif  // ATTENTION_CORE_INPUT_SHAPES_H_
