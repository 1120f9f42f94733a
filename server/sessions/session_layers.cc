#include "server/sessions/session_layers.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"

namespace attention::server {
namespace {

// The caller's value of a field the layers decide: 0 (unset) or the same.
absl::Status CheckFromLayers(absl::string_view field, int64_t requested, int64_t from_layers) {
  if (requested == 0 || requested == from_layers) return absl::OkStatus();
  return Invalid("config.", field, " = ", requested, " but config.layers have ", from_layers,
                 "; leave it 0 for a session over served layers");
}

// The heads of one layer as a session sees them.
SessionShape HeadsOf(const core::MhaConfig& c) {
  SessionShape heads;
  heads.num_heads = c.num_heads;
  heads.num_kv_heads = c.num_kv_heads;
  heads.head_dim = c.head_dim;
  heads.v_head_dim = c.v_head_dim;
  heads.sliding_window = c.sliding_window;
  return heads;
}

// One layer's entries of a step, projected as one matrix.
struct LayerRows {
  std::vector<size_t> members;  // indices into the step's entries
  std::vector<int64_t> positions;
  std::vector<float> x, q, k, v, attended, output;
};

}  // namespace

absl::StatusOr<SessionShape> ShapeOverLayers(
    const SessionShape& requested, std::vector<std::shared_ptr<const core::MhaLayer>> layers,
    std::vector<std::string> names) {
  if (layers.empty()) return Invalid("config.layers is empty");
  const SessionShape first = HeadsOf(layers[0]->config());
  std::vector<int64_t> windows;  // each layer's
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string field = absl::StrCat("config.layers[", l, "] ('", names[l], "')");
    RETURN_IF_ERROR(Prefixed(layers[l]->DecodeSupport(), field));
    const SessionShape heads = HeadsOf(layers[l]->config());
    if (heads.num_heads != first.num_heads || heads.num_kv_heads != first.num_kv_heads ||
        heads.head_dim != first.head_dim || heads.v_head_dim != first.v_head_dim) {
      return Invalid(field, " has ", heads.num_heads, " heads, ", heads.num_kv_heads,
                     " KV heads and head sizes ", heads.head_dim, "/", heads.v_head_dim,
                     "; config.layers[0] has ", first.num_heads, ", ", first.num_kv_heads, " and ",
                     first.head_dim, "/", first.v_head_dim,
                     ": one session's layers share their heads (use a session per kind)");
    }
    windows.push_back(heads.sliding_window);
  }
  const bool one_window = std::all_of(windows.begin(), windows.end(),
                                      [&](int64_t window) { return window == windows[0]; });
  RETURN_IF_ERROR(
      CheckFromLayers("num_layers", requested.num_layers, static_cast<int64_t>(layers.size())));
  RETURN_IF_ERROR(CheckFromLayers("num_heads", requested.num_heads, first.num_heads));
  RETURN_IF_ERROR(CheckFromLayers("num_kv_heads", requested.num_kv_heads, first.num_kv_heads));
  RETURN_IF_ERROR(CheckFromLayers("head_dim", requested.head_dim, first.head_dim));
  RETURN_IF_ERROR(CheckFromLayers("v_head_dim", requested.v_head_dim, first.v_head_dim));
  if (one_window) {
    RETURN_IF_ERROR(CheckFromLayers("sliding_window", requested.sliding_window, windows[0]));
  } else if (requested.sliding_window != 0) {
    return Invalid("config.sliding_window = ", requested.sliding_window,
                   " but config.layers have different windows: leave it 0");
  }
  if (!requested.layer_sliding_windows.empty() && requested.layer_sliding_windows != windows) {
    return Invalid(
        "config.layer_sliding_windows differ from config.layers' windows: leave "
        "them empty");
  }
  if (requested.scale != 0) {
    return Invalid("config.scale = ", requested.scale,
                   " is for sessions without layers; served layers scale by 1/sqrt(head_dim)");
  }
  SessionShape shape = first;
  shape.num_layers = static_cast<int64_t>(layers.size());
  shape.sliding_window = one_window ? windows[0] : 0;
  if (!one_window) shape.layer_sliding_windows = std::move(windows);
  shape.kv_dtype = requested.kv_dtype;
  shape.layers =
      std::make_shared<const ServedLayers>(ServedLayers{std::move(layers), std::move(names)});
  return shape;
}

std::vector<absl::Status> StepOverLayers(SessionTable& table, std::vector<StepEntry> entries,
                                         absl::Span<const LayerStepInput> layered, absl::Time now) {
  std::vector<absl::Status> statuses(entries.size());
  // Ordered by layer, so that a step's work does not depend on where layers were allocated.
  std::map<const core::MhaLayer*, LayerRows> by_layer;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (layered[i].layer != nullptr) by_layer[layered[i].layer].members.push_back(i);
  }
  for (auto& [layer, rows] : by_layer) {
    const core::MhaConfig& c = layer->config();
    for (const size_t i : rows.members) {
      const StepEntry& entry = entries[i];
      rows.x.insert(rows.x.end(), layered[i].hidden_states,
                    layered[i].hidden_states + entry.num_tokens * c.embed_dim);
      for (int64_t t = 0; t < entry.num_tokens; ++t) rows.positions.push_back(entry.position + t);
    }
    const auto count = static_cast<int64_t>(rows.positions.size());
    rows.q.resize(count * c.QWidth());
    rows.k.resize(count * c.KWidth());
    rows.v.resize(count * c.VWidth());
    rows.attended.resize(count * c.AttentionWidth());
    const absl::Status projected = layer->ProjectForDecode(
        rows.x.data(), rows.positions, rows.q.data(), rows.k.data(), rows.v.data());
    int64_t row = 0;
    for (const size_t i : rows.members) {
      StepEntry& entry = entries[i];
      statuses[i] = projected;
      entry.query = rows.q.data() + row * c.QWidth();
      entry.key = rows.k.data() + row * c.KWidth();
      entry.value = rows.v.data() + row * c.VWidth();
      entry.output = rows.attended.data() + row * c.AttentionWidth();
      row += entry.num_tokens;
    }
  }
  // Every entry projected (or given Q, K and V) is stepped in one pass.
  std::vector<StepEntry> ready;
  std::vector<size_t> ready_index;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!statuses[i].ok()) continue;
    ready.push_back(entries[i]);
    ready_index.push_back(i);
  }
  const std::vector<absl::Status> stepped = table.Step(ready, now);
  for (size_t r = 0; r < ready.size(); ++r) statuses[ready_index[r]] = stepped[r];
  for (auto& [layer, rows] : by_layer) {
    const core::MhaConfig& c = layer->config();
    const auto count = static_cast<int64_t>(rows.positions.size());
    rows.output.resize(count * c.output_dim);
    const absl::Status projected =
        layer->ProjectDecodeOutput(rows.attended.data(), count, rows.output.data());
    int64_t row = 0;
    for (const size_t i : rows.members) {
      const int64_t tokens = entries[i].num_tokens;
      if (statuses[i].ok()) statuses[i] = projected;
      if (statuses[i].ok()) {
        std::copy_n(rows.output.data() + row * c.output_dim, tokens * c.output_dim,
                    layered[i].output);
      }
      row += tokens;
    }
  }
  return statuses;
}

}  // namespace attention::server
