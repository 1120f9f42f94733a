#include "server/models/layer_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"

namespace attention::server {

absl::Status LayerRegistryOptions::Validate() const {
  if (max_weight_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_weight_bytes = ", max_weight_bytes, " must be >= 0 (0 = unlimited)"));
  }
  if (max_device_weight_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_device_weight_bytes = ", max_device_weight_bytes, " must be >= 0 (0 = unlimited)"));
  }
  return absl::OkStatus();
}

absl::Status LayerRegistry::Configure(const LayerRegistryOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  max_weight_bytes_ = options.max_weight_bytes;
  max_device_weight_bytes_ = options.max_device_weight_bytes;
  if (!options.model_repository.empty()) {
    ASSIGN_OR_RETURN(repository_, ModelRepository::Open(options.model_repository));
  }
  return absl::OkStatus();
}

int64_t LayerRegistry::EstimatedHostBytes(int64_t weight_bytes, const std::string& device) {
  return device == "cpu" ? 2 * weight_bytes : weight_bytes;
}

absl::Status LayerRegistry::CheckBudget(const std::string& name, int64_t host_bytes,
                                        int64_t weight_bytes, const std::string& device) const {
  // The host budget counts every layer; a device's budget counts the layers placed on it.
  // Retired layers that sessions still hold count as loaded ones do.
  int64_t in_use = 0, on_device = 0, cached = 0, retired = 0, retired_on_device = 0;
  int others = 0, others_on_device = 0, retired_layers = 0;
  {
    core::ReaderLock lock(mu_);
    cached = cached_bytes_;
    const auto count_retired = [&](int64_t host, int64_t weights, const std::string& on) {
      retired += host;
      ++retired_layers;
      if (on == device) retired_on_device += weights;
    };
    for (const auto& [loaded_name, snapshot] : layers_) {
      const core::MhaLayer& layer = *snapshot->layer;
      if (loaded_name == name) {
        // Replaced by this load, but held by sessions (the registry's is the other
        // reference): it stays in memory after the replacement.
        if (snapshot->layer.use_count() > 1) {
          count_retired(layer.HostBytes(), layer.WeightBytes(), layer.device());
        }
        continue;
      }
      in_use += layer.HostBytes();
      ++others;
      if (layer.device() == device) {
        on_device += layer.WeightBytes();
        ++others_on_device;
      }
    }
    for (const RetiredLayer& layer : retired_) {
      if (!layer.layer.expired()) count_retired(layer.host_bytes, layer.weight_bytes, layer.device);
    }
    in_use += cached + retired;
    on_device += retired_on_device;
  }
  const std::string held_by_sessions =
      absl::StrCat(retired_layers, " unloaded or replaced layer(s) that sessions still hold");
  if (max_weight_bytes_ > 0 && in_use + host_bytes > max_weight_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "layer \"", name, "\" needs ", host_bytes, " bytes of host memory for its weights",
        device == "cpu" ? " (with the CPU's packed copy)" : "", " but only ",
        std::max<int64_t>(0, max_weight_bytes_ - in_use),
        " of max_weight_bytes = ", max_weight_bytes_, " are free (", in_use, " in use by ", others,
        " other layer(s)", retired > 0 ? absl::StrCat(", ", retired, " by ", held_by_sessions) : "",
        cached > 0 ? absl::StrCat(" and ", cached, " by cached inline layers") : "",
        "); unload a layer", retired > 0 ? ", drop the sessions over retired layers" : "",
        " or raise --max_weight_bytes"));
  }
  if (device != "cpu" && max_device_weight_bytes_ > 0 &&
      on_device + weight_bytes > max_device_weight_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "layer \"", name, "\" needs ", weight_bytes, " weight bytes on ", device, " but only ",
        std::max<int64_t>(0, max_device_weight_bytes_ - on_device),
        " of max_device_weight_bytes = ", max_device_weight_bytes_, " are free there (", on_device,
        " in use by ", others_on_device, " other layer(s)",
        retired_on_device > 0 ? absl::StrCat(", ", retired_on_device, " by ", held_by_sessions)
                              : "",
        "); unload a layer", retired_on_device > 0 ? ", drop the sessions over retired layers" : "",
        " or raise --max_device_weight_bytes"));
  }
  return absl::OkStatus();
}

void LayerRegistry::RetireLocked(const std::shared_ptr<const core::MhaLayer>& layer) {
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                [](const RetiredLayer& r) { return r.layer.expired(); }),
                 retired_.end());
  retired_.push_back({layer, layer->HostBytes(), layer->WeightBytes(), layer->device()});
}

std::shared_ptr<const LayerSnapshot> LayerRegistry::PublishLocked(
    const std::string& name, std::shared_ptr<const core::MhaLayer> layer, bool persisted,
    const BatchLimitOverrides& batching) {
  auto snapshot = std::make_shared<LayerSnapshot>();
  snapshot->name = name;
  snapshot->layer = std::move(layer);
  snapshot->persisted = persisted;
  snapshot->batching = batching;
  core::WriterLock lock(mu_);
  snapshot->version = next_version_++;
  std::shared_ptr<const LayerSnapshot>& published = layers_[name];
  if (published != nullptr) RetireLocked(published->layer);
  published = snapshot;
  return snapshot;
}

absl::StatusOr<std::shared_ptr<const LayerSnapshot>> LayerRegistry::Publish(
    const std::string& name, std::shared_ptr<const core::MhaLayer> layer, bool persist,
    const BatchLimitOverrides& batching, const std::string& requested_device) {
  core::MutexLock update(update_mu_);
  if (persist && repository_ == nullptr) {
    return absl::FailedPreconditionError(
        "persist = true needs a model repository; start the server with --model_repository");
  }
  RETURN_IF_ERROR(CheckBudget(name, layer->HostBytes(), layer->WeightBytes(), layer->device()));
  bool replaces_persisted = false;
  {
    core::ReaderLock lock(mu_);
    auto found = layers_.find(name);
    replaces_persisted = found != layers_.end() && found->second->persisted;
  }
  if (persist) {
    RETURN_IF_ERROR(repository_->Persist(name, *layer, batching, requested_device));
  } else if (replaces_persisted) {
    RETURN_IF_ERROR(repository_->RemovePersisted(name));
  }
  return PublishLocked(name, std::move(layer), persist, batching);
}

absl::StatusOr<std::shared_ptr<const LayerSnapshot>> LayerRegistry::Get(
    const std::string& name) const {
  core::ReaderLock lock(mu_);
  auto found = layers_.find(name);
  if (found == layers_.end()) return NotFoundLocked(name);
  return found->second;
}

absl::Status LayerRegistry::Remove(const std::string& name) {
  core::MutexLock update(update_mu_);
  bool persisted = false;
  {
    core::ReaderLock lock(mu_);
    auto found = layers_.find(name);
    if (found == layers_.end()) return NotFoundLocked(name);
    persisted = found->second->persisted;
  }
  if (persisted && repository_ != nullptr) RETURN_IF_ERROR(repository_->RemovePersisted(name));
  core::WriterLock lock(mu_);
  const auto found = layers_.find(name);
  RetireLocked(found->second->layer);
  layers_.erase(found);
  return absl::OkStatus();
}

std::vector<std::shared_ptr<const LayerSnapshot>> LayerRegistry::List() const {
  core::ReaderLock lock(mu_);
  std::vector<std::shared_ptr<const LayerSnapshot>> snapshots;
  for (const auto& [name, snapshot] : layers_) snapshots.push_back(snapshot);
  return snapshots;
}

int64_t LayerRegistry::weight_bytes() const {
  core::ReaderLock lock(mu_);
  int64_t bytes = 0;
  for (const auto& [name, snapshot] : layers_) bytes += snapshot->layer->WeightBytes();
  for (const RetiredLayer& layer : retired_) {
    if (!layer.layer.expired()) bytes += layer.weight_bytes;
  }
  return bytes;
}

absl::Status LayerRegistry::ReserveCachedBytes(int64_t host_bytes) {
  // Not under update_mu_, which a Publish holds across its file I/O.
  int64_t in_use = 0;
  core::WriterLock lock(mu_);
  if (max_weight_bytes_ > 0) {
    for (const auto& [name, snapshot] : layers_) in_use += snapshot->layer->HostBytes();
    for (const RetiredLayer& layer : retired_) {
      if (!layer.layer.expired()) in_use += layer.host_bytes;
    }
    if (in_use + cached_bytes_ + host_bytes > max_weight_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "caching an inline layer of ", host_bytes, " host bytes would pass max_weight_bytes = ",
          max_weight_bytes_, " (", in_use, " in use by loaded layers and those sessions hold, ",
          cached_bytes_, " by cached inline layers)"));
    }
  }
  cached_bytes_ += host_bytes;
  return absl::OkStatus();
}

void LayerRegistry::ReleaseCachedBytes(int64_t host_bytes) {
  core::WriterLock lock(mu_);
  cached_bytes_ -= host_bytes;
}

std::vector<std::string> LayerRegistry::LoadPersisted(
    core::Devices& devices, const std::shared_ptr<const core::Backend>& default_backend) {
  std::vector<std::string> problems;
  if (repository_ == nullptr) return problems;
  core::MutexLock update(update_mu_);
  for (ModelRepository::PersistedLayer& persisted :
       repository_->LoadPersisted(devices, default_backend, &problems)) {
    const absl::Status budget =
        CheckBudget(persisted.name, persisted.layer->HostBytes(), persisted.layer->WeightBytes(),
                    persisted.layer->device());
    if (!budget.ok()) {
      problems.push_back(absl::StrCat(PersistedPath(persisted.name), ": ", budget.message(),
                                      "; skipped (the file is kept)"));
      continue;
    }
    PublishLocked(persisted.name, std::move(persisted.layer), /*persisted=*/true,
                  persisted.batching);
  }
  return problems;
}

absl::Status LayerRegistry::NotFoundLocked(const std::string& name) const {
  std::vector<std::string> loaded;
  for (const auto& [loaded_name, snapshot] : layers_) loaded.push_back(loaded_name);
  return absl::NotFoundError(absl::StrCat("layer ", Quoted(name),
                                          " is not loaded (loaded: ", ListForMessage(loaded), ")"));
}

}  // namespace attention::server
