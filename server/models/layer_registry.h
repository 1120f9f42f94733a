// Named, versioned, immutable layer snapshots, with an optional weight-memory budget and an
// optional model repository that persisted layers are written to and read back from.
#ifndef ATTENTION_SERVER_MODELS_LAYER_REGISTRY_H_
#define ATTENTION_SERVER_MODELS_LAYER_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "core/mha_layer.h"
#include "core/mutex.h"
#include "server/models/batch_limits.h"
#include "server/models/model_repository.h"

namespace attention::server {

// One published version of a layer. Immutable: a batch holds a shared_ptr to the snapshot
// it started with, so reloads and unloads never race running work.
struct LayerSnapshot {
  std::string name;
  uint64_t version = 0;
  std::shared_ptr<const core::MhaLayer> layer;
  // Written to the model repository; comes back after a restart.
  bool persisted = false;
  // The layer's own batching limits; the rest follow the server's.
  BatchLimitOverrides batching;
};

struct LayerRegistryOptions {
  // Budget for the weights of all published layers together, bytes (float32 storage, see
  // LayerInfo.weight_bytes). A load that would exceed it is RESOURCE_EXHAUSTED. 0 (default)
  // means unlimited; >= 0. A layer being replaced does not count against its successor,
  // unless sessions hold it: a layer unloaded or replaced while sessions pinned it stays in
  // memory, and counts against this budget (and max_device_weight_bytes), until the last of
  // them ends.
  int64_t max_weight_bytes = 0;
  // Budget for the weights held on each GPU, bytes, counted per device (every layer also
  // keeps its host copy, which counts against max_weight_bytes). 0 (default): only the
  // device's memory limits it, and a load it cannot hold is RESOURCE_EXHAUSTED. >= 0.
  int64_t max_device_weight_bytes = 0;
  // Directory of the model repository; empty (default) means none: safetensors sources and
  // persist = true are then FAILED_PRECONDITION.
  std::string model_repository;

  absl::Status Validate() const;
};

// Thread-safe. Reads (Get, List) take a short shared lock; updates are serialized among
// themselves by a separate mutex held across their file I/O, so a slow disk never blocks a
// request looking up its layer.
class LayerRegistry {
 public:
  LayerRegistry() = default;

  // Applies `options` and opens the repository. Call once, before the registry is shared.
  absl::Status Configure(const LayerRegistryOptions& options);
  // nullptr when there is no repository.
  const ModelRepository* repository() const { return repository_.get(); }

  // Publishes `layer` under `name`, replacing any earlier version atomically. RESOURCE_EXHAUSTED
  // past max_weight_bytes. With `persist`, the layer is first written to the repository (and
  // nothing is published if that fails); without it, the file of a persisted version being
  // replaced is removed, so that a restart never brings back an older version than the one
  // served. The batching overrides and `requested_device` (the device LoadLayerRequest
  // named, "" for none) are persisted with the layer.
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> Publish(
      const std::string& name, std::shared_ptr<const core::MhaLayer> layer, bool persist = false,
      const BatchLimitOverrides& batching = {}, const std::string& requested_device = "");
  // NOT_FOUND naming the layer and listing what is loaded.
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> Get(const std::string& name) const;
  // Unpublishes `name` and removes its persisted file, if any (the file first: when that
  // fails the layer stays loaded and the error is returned).
  absl::Status Remove(const std::string& name);
  // Sorted by name.
  std::vector<std::shared_ptr<const LayerSnapshot>> List() const;
  // RESOURCE_EXHAUSTED when a layer under `name` (replacing its current version, which still
  // counts while sessions hold it, as retired layers do) placed on
  // `device` would pass max_weight_bytes with its `host_bytes` (MhaLayer::HostBytes), or
  // max_device_weight_bytes of that device (not "cpu") with its `weight_bytes`. LoadLayer
  // asks before building the weights (with EstimatedHostBytes); Publish asks again with the
  // built layer's, serialized with other updates.
  absl::Status CheckBudget(const std::string& name, int64_t host_bytes, int64_t weight_bytes,
                           const std::string& device = "cpu") const;
  // Host bytes of a layer of `weight_bytes` on `device` before it is built: the CPU
  // backend keeps a packed copy of about the weights' size.
  static int64_t EstimatedHostBytes(int64_t weight_bytes, const std::string& device);
  // Bytes of weights of all published layers, and of the unloaded or replaced ones that
  // sessions still hold.
  int64_t weight_bytes() const;
  // Host bytes of cached inline layers (InlineLayerCache), which count against
  // max_weight_bytes as published layers do. Reserve is RESOURCE_EXHAUSTED past it.
  absl::Status ReserveCachedBytes(int64_t host_bytes);
  void ReleaseCachedBytes(int64_t host_bytes);

  // Publishes every persisted layer of the repository (marked persisted, files untouched).
  // Returns a description of each file skipped (corrupt, truncated, over budget); never
  // fails as a whole, so one bad file cannot keep the server from starting. Each layer goes
  // back on the device it was loaded with, or on `default_backend` (the server's --device)
  // when it named none; one whose device cannot be used here is placed on `default_backend`
  // and described too (ModelRepository::ReadPersisted).
  std::vector<std::string> LoadPersisted(
      core::Devices& devices, const std::shared_ptr<const core::Backend>& default_backend);

 private:
  // A layer unloaded or replaced: sessions pin the layers they were created over, so its
  // memory stays in use until the last holder lets go, and it counts against the budgets
  // until then.
  struct RetiredLayer {
    std::weak_ptr<const core::MhaLayer> layer;
    int64_t host_bytes = 0, weight_bytes = 0;
    std::string device;
  };

  absl::Status NotFoundLocked(const std::string& name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Remembers `layer` as retired, and forgets the retired layers nothing holds any more.
  void RetireLocked(const std::shared_ptr<const core::MhaLayer>& layer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<const LayerSnapshot> PublishLocked(const std::string& name,
                                                     std::shared_ptr<const core::MhaLayer> layer,
                                                     bool persisted,
                                                     const BatchLimitOverrides& batching)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(update_mu_);

  // Serializes Publish / Remove / LoadPersisted, including their file I/O. Taken before mu_.
  core::Mutex update_mu_;  // see core/mutex.h
  mutable core::SharedMutex mu_;
  std::map<std::string, std::shared_ptr<const LayerSnapshot>> layers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // ReserveCachedBytes
  std::vector<RetiredLayer> retired_ ABSL_GUARDED_BY(mu_);
  // Set by Configure before the registry is shared; read-only afterwards.
  int64_t max_weight_bytes_ = 0;
  int64_t max_device_weight_bytes_ = 0;
  std::unique_ptr<ModelRepository> repository_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_MODELS_LAYER_REGISTRY_H_
