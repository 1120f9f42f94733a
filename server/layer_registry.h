// Named, versioned, immutable layer snapshots.
#ifndef ATTENTION_SERVER_LAYER_REGISTRY_H_
#define ATTENTION_SERVER_LAYER_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/mha_layer.h"

namespace attention::server {

// One published version of a layer. Immutable: a batch holds a shared_ptr to the snapshot
// it started with, so reloads and unloads never race running work.
struct LayerSnapshot {
  std::string name;
  uint64_t version = 0;
  std::shared_ptr<const core::MhaLayer> layer;
};

// Thread-safe.
class LayerRegistry {
 public:
  // Publishes `layer` under `name`, replacing any earlier version atomically.
  std::shared_ptr<const LayerSnapshot> Put(const std::string& name,
                                           std::shared_ptr<const core::MhaLayer> layer);
  // NOT_FOUND naming the layer and listing what is loaded.
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> Get(const std::string& name) const;
  absl::Status Remove(const std::string& name);
  // Sorted by name.
  std::vector<std::shared_ptr<const LayerSnapshot>> List() const;

 private:
  absl::Status NotFoundLocked(const std::string& name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const LayerSnapshot>> layers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_LAYER_REGISTRY_H_
