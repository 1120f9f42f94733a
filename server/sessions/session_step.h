// A SessionStep call as the batcher's third kind of work, beside layers and work that runs
// alone: every queued step shares one batch key, so steps of different callers' sessions
// decode in one pass.
#ifndef ATTENTION_SERVER_SESSIONS_SESSION_STEP_H_
#define ATTENTION_SERVER_SESSIONS_SESSION_STEP_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/batching/batcher.h"
#include "server/sessions/session_layers.h"
#include "server/sessions/session_table.h"

namespace attention::server {

class SessionStepItem final : public WorkItem {
 public:
  SessionStepItem(SessionTable& table, std::string device)
      : table_(table), device_(std::move(device)) {}

  const LayerSnapshot* layer() const override { return nullptr; }
  std::string queue_name() const override { return kSessionStepQueue; }
  // A step longer than one prefill chunk runs alone: decode steps packed with it would
  // wait for all its chunks instead of taking turns between them.
  const void* batch_key() const override {
    return tokens > table_.prefill_chunk_tokens() ? nullptr : &table_;
  }
  std::string device() const override { return device_; }
  // Steps every entry of every item of `batch` in one StepOverLayers; each item's
  // status() is then its first failed entry's, naming entries[i].
  absl::StatusOr<std::vector<core::AttentionResult>> Compute(
      absl::Span<WorkItem* const> batch) override;

  // The entries; their pointers point into buffers the item owns. `layered[i]` belongs to
  // entries[i] (see StepOverLayers); `layers` keeps the layers it names alive, whatever
  // happens to their sessions meanwhile.
  std::vector<StepEntry> entries;
  std::vector<LayerStepInput> layered;
  std::vector<std::shared_ptr<const core::MhaLayer>> layers;
  std::vector<std::vector<float>> buffers;
  const absl::Status& status() const { return status_; }

 private:
  SessionTable& table_;
  const std::string device_;
  absl::Status status_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SESSIONS_SESSION_STEP_H_
