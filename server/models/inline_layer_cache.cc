#include "server/models/inline_layer_cache.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream.h>
#include <openssl/evp.h>

namespace attention::server {
namespace {

// Feeds what protobuf serializes straight into SHA-256, so that megabytes of weights are hashed
// without a copy of the message.
class Sha256Stream final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  Sha256Stream() : context_(EVP_MD_CTX_new()) {
    EVP_DigestInit_ex(context_, EVP_sha256(), nullptr);
  }
  ~Sha256Stream() override { EVP_MD_CTX_free(context_); }

  bool Next(void** data, int* size) override {
    Flush();
    *data = buffer_;
    *size = sizeof(buffer_);
    pending_ = sizeof(buffer_);
    return true;
  }
  void BackUp(int count) override { pending_ -= count; }
  int64_t ByteCount() const override { return hashed_ + pending_; }

  // The digest of everything written; the CodedOutputStream must be gone (it backs up).
  std::string Finish() {
    Flush();
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int length = 0;
    EVP_DigestFinal_ex(context_, digest, &length);
    return std::string(reinterpret_cast<const char*>(digest), length);
  }

 private:
  void Flush() {
    EVP_DigestUpdate(context_, buffer_, pending_);
    hashed_ += pending_;
    pending_ = 0;
  }

  EVP_MD_CTX* const context_;
  char buffer_[64 << 10];
  int pending_ = 0;  // bytes of buffer_ handed out and not backed up
  int64_t hashed_ = 0;
};

}  // namespace

InlineLayerCache::InlineLayerCache(int64_t max_bytes, LayerRegistry& registry, Metrics* metrics)
    : max_bytes_(max_bytes), registry_(registry), metrics_(metrics) {}

InlineLayerCache::~InlineLayerCache() { Clear(); }

std::optional<std::string> InlineLayerCache::KeyOf(const v1::LayerSpec& spec) {
  if (spec.weights_case() != v1::LayerSpec::kInlineWeights &&
      spec.weights_case() != v1::LayerSpec::kRandomInit) {
    return std::nullopt;
  }
  auto stream = std::make_unique<Sha256Stream>();  // its buffer is too big for the stack
  {
    google::protobuf::io::CodedOutputStream coded(stream.get());
    // Map entries (the weight tensors) in key order, so equal specs hash alike.
    coded.SetSerializationDeterministic(true);
    spec.SerializeToCodedStream(&coded);
  }
  return stream->Finish();
}

std::shared_ptr<const LayerSnapshot> InlineLayerCache::Find(const std::string& key) {
  core::MutexLock lock(mu_);
  auto found = entries_.find(key);
  if (found == entries_.end()) return nullptr;
  HitLocked(found->second);
  return found->second.snapshot;
}

absl::StatusOr<std::shared_ptr<const LayerSnapshot>> InlineLayerCache::GetOrBuild(
    const std::string& key,
    const std::function<absl::StatusOr<std::shared_ptr<const LayerSnapshot>>()>& build) {
  std::shared_ptr<Flight> flight;
  {
    core::MutexLock lock(mu_);
    if (max_bytes_ > 0) {
      auto found = entries_.find(key);
      if (found != entries_.end()) {
        HitLocked(found->second);
        return found->second.snapshot;
      }
      auto in_flight = flights_.find(key);
      if (in_flight != flights_.end()) {
        std::shared_ptr<Flight> other = in_flight->second;
        while (!other->done) built_.wait(lock);
        ++hits_;
        if (metrics_ != nullptr) metrics_->InlineLayerCacheLookup(/*hit=*/true);
        return other->result;
      }
      flight = std::make_shared<Flight>();
      flights_[key] = flight;
    }
    ++builds_;
  }
  if (metrics_ != nullptr) metrics_->InlineLayerCacheLookup(/*hit=*/false);
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> result = build();
  if (flight == nullptr) return result;  // the cache is disabled
  {
    core::MutexLock lock(mu_);
    flight->result = result;
    flight->done = true;
    flights_.erase(key);
    if (result.ok()) InsertLocked(key, *result);
  }
  built_.notify_all();
  return result;
}

void InlineLayerCache::HitLocked(Entry& entry) {
  ++hits_;
  lru_.splice(lru_.begin(), lru_, entry.lru);
  if (metrics_ != nullptr) metrics_->InlineLayerCacheLookup(/*hit=*/true);
}

void InlineLayerCache::InsertLocked(const std::string& key,
                                    std::shared_ptr<const LayerSnapshot> snapshot) {
  const int64_t bytes = snapshot->layer->HostBytes();
  if (bytes > max_bytes_) return;  // would evict everything and still not fit
  while (true) {
    if (bytes_ + bytes <= max_bytes_ && registry_.ReserveCachedBytes(bytes).ok()) break;
    if (lru_.empty()) return;               // the loaded layers leave no room: served uncached
    EvictLocked(std::string(lru_.back()));  // a copy: eviction frees lru_'s
  }
  lru_.push_front(key);
  entries_[key] = Entry{std::move(snapshot), bytes, lru_.begin()};
  bytes_ += bytes;
  if (metrics_ != nullptr) metrics_->SetInlineLayerCacheBytes(bytes_);
}

void InlineLayerCache::EvictLocked(const std::string& key) {
  auto found = entries_.find(key);
  registry_.ReleaseCachedBytes(found->second.bytes);
  bytes_ -= found->second.bytes;
  lru_.erase(found->second.lru);
  entries_.erase(found);
  if (metrics_ != nullptr) metrics_->SetInlineLayerCacheBytes(bytes_);
}

int64_t InlineLayerCache::Clear() {
  core::MutexLock lock(mu_);
  const int64_t freed = bytes_;
  while (!lru_.empty()) EvictLocked(std::string(lru_.back()));
  return freed;
}

int64_t InlineLayerCache::bytes() const {
  core::MutexLock lock(mu_);
  return bytes_;
}

int64_t InlineLayerCache::builds() const {
  core::MutexLock lock(mu_);
  return builds_;
}

int64_t InlineLayerCache::hits() const {
  core::MutexLock lock(mu_);
  return hits_;
}

}  // namespace attention::server
