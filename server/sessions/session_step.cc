#include "server/sessions/session_step.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/common/status_util.h"

namespace attention::server {

absl::StatusOr<std::vector<core::AttentionResult>> SessionStepItem::Compute(
    absl::Span<WorkItem* const> batch) {
  std::vector<StepEntry> all;
  std::vector<LayerStepInput> layered;
  for (WorkItem* item : batch) {
    // Items of one batch_key() are all SessionStepItems of this table.
    const auto& step = *static_cast<SessionStepItem*>(item);
    all.insert(all.end(), step.entries.begin(), step.entries.end());
    layered.insert(layered.end(), step.layered.begin(), step.layered.end());
  }
  const std::vector<absl::Status> statuses =
      StepOverLayers(table_, std::move(all), layered, absl::Now());
  size_t next = 0;
  for (WorkItem* item : batch) {
    auto& step = *static_cast<SessionStepItem*>(item);
    step.status_ = absl::OkStatus();
    for (size_t i = 0; i < step.entries.size(); ++i, ++next) {
      if (step.status_.ok() && !statuses[next].ok()) {
        step.status_ = Prefixed(statuses[next], absl::StrCat("entries[", i, "]"));
      }
    }
  }
  return std::vector<core::AttentionResult>(batch.size());
}

}  // namespace attention::server
