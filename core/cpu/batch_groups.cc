#include "core/cpu/batch_groups.h"

#include <algorithm>

namespace attention::core {

std::vector<std::vector<size_t>> GroupBatchParts(int64_t embed_dim,
                                                 absl::Span<const BatchPart> parts, int threads) {
  struct Group {
    std::vector<size_t> members;
    int64_t rows = 0;
    double cost = 0;
  };
  std::vector<Group> groups;
  double total_cost = 0;
  for (size_t n = 0; n < parts.size(); ++n) {
    if (groups.empty() || groups.back().rows >= kGroupRows) groups.emplace_back();
    // A query row's FLOPs: 8 E^2 in the projections, 4 E Nk in attention.
    const double cost = static_cast<double>(parts[n].q_rows) * (2.0 * embed_dim + parts[n].kv_len);
    groups.back().members.push_back(n);
    groups.back().rows += parts[n].q_rows;
    groups.back().cost += cost;
    total_cost += cost;
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Group& a, const Group& b) { return a.cost > b.cost; });
  if (groups.size() < 2 || groups.front().cost * 2 * threads > total_cost) return {};
  std::vector<std::vector<size_t>> members;
  for (Group& group : groups) members.push_back(std::move(group.members));
  return members;
}

}  // namespace attention::core
