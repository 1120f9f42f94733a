#include "server/layer_registry.h"

#include "absl/strings/str_cat.h"

namespace attention::server {

std::shared_ptr<const LayerSnapshot> LayerRegistry::Put(
    const std::string& name, std::shared_ptr<const core::MhaLayer> layer) {
  auto snapshot = std::make_shared<LayerSnapshot>();
  snapshot->name = name;
  snapshot->layer = std::move(layer);
  absl::MutexLock lock(&mu_);
  snapshot->version = next_version_++;
  layers_[name] = snapshot;
  return snapshot;
}

absl::StatusOr<std::shared_ptr<const LayerSnapshot>> LayerRegistry::Get(
    const std::string& name) const {
  absl::ReaderMutexLock lock(&mu_);
  auto found = layers_.find(name);
  if (found == layers_.end()) return NotFoundLocked(name);
  return found->second;
}

absl::Status LayerRegistry::Remove(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (layers_.erase(name) == 0) return NotFoundLocked(name);
  return absl::OkStatus();
}

std::vector<std::shared_ptr<const LayerSnapshot>> LayerRegistry::List() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<std::shared_ptr<const LayerSnapshot>> snapshots;
  for (const auto& [name, snapshot] : layers_) snapshots.push_back(snapshot);
  return snapshots;
}

absl::Status LayerRegistry::NotFoundLocked(const std::string& name) const {
  std::string loaded;
  for (const auto& [loaded_name, snapshot] : layers_) {
    absl::StrAppend(&loaded, loaded.empty() ? "" : ", ", loaded_name);
  }
  return absl::NotFoundError(absl::StrCat("layer \"", name, "\" is not loaded (loaded: ",
                                          loaded.empty() ? "none" : loaded, ")"));
}

}  // namespace attention::server
