// Sessions over served layers (issue 25 §1): the caller sends each step's hidden states, and
// the server projects Q, K and V with a loaded layer's weights, rotates them (RoPE) at the
// tokens' absolute positions, writes K and V to the session, attends over its cache and
// projects the output. The projections are the prepared layer's decode entry
// (core/backend.h); the attention between them is the session table's.
#ifndef ATTENTION_SERVER_SESSIONS_SESSION_LAYERS_H_
#define ATTENTION_SERVER_SESSIONS_SESSION_LAYERS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/mha_layer.h"
#include "server/sessions/session_table.h"

namespace attention::server {

// The shape of a session over `layers` (loaded as `names`): heads and head sizes come from
// the layers, which must agree on them and support decode (MhaLayer::DecodeSupport), and
// each layer keeps its own sliding window (layer_sliding_windows where they differ).
// `requested` is the caller's config: its num_layers, heads, head sizes and windows must
// each be 0 (empty) or the layers' value, its scale unset; its KV dtype is kept. Errors name
// config.layers[i] or the config field.
absl::StatusOr<SessionShape> ShapeOverLayers(
    const SessionShape& requested, std::vector<std::shared_ptr<const core::MhaLayer>> layers,
    std::vector<std::string> names);

// What a step entry of a session over served layers adds to its StepEntry (whose query, key,
// value and output StepOverLayers points into buffers of its own).
struct LayerStepInput {
  const core::MhaLayer* layer = nullptr;  // null for an entry with Q, K and V given
  const float* hidden_states = nullptr;   // [n, E]
  float* output = nullptr;                // [n, output_dim]
};

// SessionTable::Step with the layers' halves around it: the hidden states of all entries of
// one layer are projected as one matrix, the table writes and attends every entry in one
// pass, then each layer's attended rows are projected out as one matrix. `layered[i]`
// belongs to entries[i]. One status per entry, as SessionTable::Step.
std::vector<absl::Status> StepOverLayers(SessionTable& table, std::vector<StepEntry> entries,
                                         absl::Span<const LayerStepInput> layered, absl::Time now);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SESSIONS_SESSION_LAYERS_H_
