// Recently built inline layers, so that a caller sending the same inline layer again does not pay
// for its build again. Keyed by a SHA-256 of the layer's spec (its config and every weight byte),
// never by a caller-chosen name; bounded by bytes, least recently used out first, and the cached
// layers count against --max_weight_bytes like loaded ones.
#ifndef ATTENTION_SERVER_MODELS_INLINE_LAYER_CACHE_H_
#define ATTENTION_SERVER_MODELS_INLINE_LAYER_CACHE_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "core/mutex.h"
#include "server/models/layer_registry.h"
#include "server/observability/metrics.h"

namespace attention::server {

// Default of --inline_layer_cache_bytes: 256 MiB, about six BERT-base layers on the CPU.
inline constexpr int64_t kDefaultInlineLayerCacheBytes = int64_t{256} << 20;

// Thread-safe.
class InlineLayerCache {
 public:
  // Holds at most `max_bytes` of cached layers' host memory (MhaLayer::HostBytes); 0 disables the
  // cache. `registry` (its max_weight_bytes) and `metrics` (may be null) must outlive the cache.
  InlineLayerCache(int64_t max_bytes, LayerRegistry& registry, Metrics* metrics);
  ~InlineLayerCache();  // Clear()

  // The SHA-256 of `spec`'s deterministic serialization: the config and every weight byte. nullopt
  // for weights read from the model repository (a file may change under the same spec), which are
  // built every time.
  static std::optional<std::string> KeyOf(const v1::LayerSpec& spec);

  // The cached layer of `key`, or null. A hit counts in the metrics and becomes the most recently
  // used.
  std::shared_ptr<const LayerSnapshot> Find(const std::string& key);
  // The layer of `key`: cached, built by a concurrent caller of the same key (waited for, so that
  // concurrent identical requests build once), or built here by `build` and cached when it fits. A
  // failed build is returned to everyone waiting on it, not cached.
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> GetOrBuild(
      const std::string& key,
      const std::function<absl::StatusOr<std::shared_ptr<const LayerSnapshot>>()>& build);
  // Drops every entry, releasing its share of max_weight_bytes (a LoadLayer short of the budget
  // takes their room). Returns the bytes freed.
  int64_t Clear();

  int64_t max_bytes() const { return max_bytes_; }
  int64_t bytes() const;
  // Builds run, and requests answered without one (cached or a concurrent caller's build).
  int64_t builds() const;
  int64_t hits() const;

 private:
  struct Entry {
    std::shared_ptr<const LayerSnapshot> snapshot;
    int64_t bytes = 0;
    std::list<std::string>::iterator lru;  // position in lru_
  };
  // One build in progress, which callers of the same key wait for.
  struct Flight {
    bool done = false;
    absl::StatusOr<std::shared_ptr<const LayerSnapshot>> result;
  };

  void HitLocked(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Caches `snapshot` when it fits the cache and max_weight_bytes, evicting the least recently used
  // entries to make room.
  void InsertLocked(const std::string& key, std::shared_ptr<const LayerSnapshot> snapshot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_bytes_;
  LayerRegistry& registry_;
  Metrics* const metrics_;
  mutable core::Mutex mu_;             // see core/mutex.h
  std::condition_variable_any built_;  // a Flight finished
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // most recently used first
  absl::flat_hash_map<std::string, std::shared_ptr<Flight>> flights_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t builds_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_MODELS_INLINE_LAYER_CACHE_H_
