#include "core/input_shapes.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/attention_options.h"
#include "core/status_macros.h"

namespace attention::core {
namespace {

absl::Status CheckRank(Shape shape, size_t rank, absl::string_view field,
                       absl::string_view layout) {
  if (shape.size() != rank) {
    return Invalid(field, ".shape ", ShapeString(shape), " has rank ", shape.size(), "; expected ",
                   layout);
  }
  return absl::OkStatus();
}

absl::Status CheckDim(Shape shape, size_t dim, int64_t expected, absl::string_view field,
                      absl::string_view meaning) {
  if (shape[dim] != expected) {
    return Invalid(field, ".shape[", dim, "] = ", shape[dim], " must equal ", meaning, " = ",
                   expected);
  }
  return absl::OkStatus();
}

}  // namespace

std::string ShapeString(Shape shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::Status CheckMhaQueryShape(const MhaConfig& config, Shape query) {
  RETURN_IF_ERROR(CheckRank(query, 3, "query", "[B, Nq, embed_dim]"));
  return CheckDim(query, 2, config.embed_dim, "query", "the layer's embed_dim");
}

absl::Status CheckMhaKeyValuePresence(const MhaConfig& config, bool has_key, bool has_value) {
  if (has_key != has_value) {
    return Invalid(has_key ? "key" : "value", " is set but ", has_key ? "value" : "key",
                   " is not; cross-attention needs both");
  }
  if (!has_key && (config.kdim != config.embed_dim || config.vdim != config.embed_dim)) {
    return Invalid("key and value are required: the layer has kdim = ", config.kdim,
                   " and vdim = ", config.vdim,
                   ", so it cannot self-attend with embed_dim = ", config.embed_dim);
  }
  return absl::OkStatus();
}

absl::Status CheckMhaKeyValueShapes(const MhaConfig& config, int64_t batch, Shape key,
                                    Shape value) {
  RETURN_IF_ERROR(CheckRank(key, 3, "key", "[B, Nk, kdim]"));
  RETURN_IF_ERROR(CheckRank(value, 3, "value", "[B, Nk, vdim]"));
  RETURN_IF_ERROR(CheckDim(key, 0, batch, "key", "query batch size B"));
  RETURN_IF_ERROR(CheckDim(value, 0, batch, "value", "query batch size B"));
  RETURN_IF_ERROR(CheckDim(value, 1, key[1], "value", "key length Nk"));
  RETURN_IF_ERROR(CheckDim(key, 2, config.kdim, "key", "the layer's kdim"));
  return CheckDim(value, 2, config.vdim, "value", "the layer's vdim");
}

absl::StatusOr<AttentionDims> SdpaDimsOf(Shape query, Shape key, Shape value) {
  RETURN_IF_ERROR(CheckRank(query, 4, "query", "[B, H, Nq, dk]"));
  RETURN_IF_ERROR(CheckRank(key, 4, "key", "[B, Hkv, Nk, dk]"));
  RETURN_IF_ERROR(CheckRank(value, 4, "value", "[B, Hkv, Nk, dv]"));
  RETURN_IF_ERROR(CheckDim(key, 0, query[0], "key", "query batch size B"));
  RETURN_IF_ERROR(CheckDim(value, 0, query[0], "value", "query batch size B"));
  RETURN_IF_ERROR(CheckDim(value, 1, key[1], "value", "key heads Hkv"));
  RETURN_IF_ERROR(CheckDim(value, 2, key[2], "value", "key length Nk"));
  RETURN_IF_ERROR(CheckDim(key, 3, query[3], "key", "query head size dk"));
  RETURN_IF_ERROR(CheckHeadGroups(query[1], key[1], "query.shape[1] (H)", "key.shape[1] (Hkv)"));
  return AttentionDims{query[0], query[1], key[1], query[2], key[2], query[3], value[3]};
}

}  // namespace attention::core
