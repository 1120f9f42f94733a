// Triton's system shared memory extension of the Open Inference Protocol: a caller on the
// same host registers a POSIX shared memory object (its shm_open key) as a named region,
// then names a slice of it (region, byte size, offset) as an input's contents or an output's
// destination, so that the tensor bytes never cross gRPC. Slices are read with pread and
// written with pwrite on the object's descriptor, never mapped: a caller that shrinks its
// object gets an error, not a SIGBUS in the server.
#ifndef ATTENTION_SERVER_KSERVE_SYSTEM_SHARED_MEMORY_H_
#define ATTENTION_SERVER_KSERVE_SYSTEM_SHARED_MEMORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/mutex.h"
#include "inference/grpc_service.pb.h"

namespace attention::server::kserve {

// One registered region: the object's descriptor stays open while the region or a call
// using it holds this.
struct SharedMemoryRegion {
  SharedMemoryRegion(std::string name, std::string key, uint64_t offset, uint64_t byte_size, int fd)
      : name(std::move(name)), key(std::move(key)), offset(offset), byte_size(byte_size), fd(fd) {}
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string name, key;
  const uint64_t offset, byte_size;  // within the object
  const int fd;
};

// Bytes [offset, offset + byte_size) of a region, as one tensor of one call names them;
// `field` names the tensor in messages (inputs["query"], outputs["output"]).
struct SharedMemorySlice {
  std::shared_ptr<const SharedMemoryRegion> region;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  std::string field;
};

class SystemSharedMemory {
 public:
  // Regions registered at once: each holds a file descriptor.
  static constexpr size_t kMaxRegions = 256;

  // Off (`enabled` false), every call answers FAILED_PRECONDITION naming the flag. One
  // call reads at most `max_call_bytes` from regions (the server's message limit).
  SystemSharedMemory(bool enabled, uint64_t max_call_bytes)
      : enabled_(enabled), max_call_bytes_(max_call_bytes) {}

  bool enabled() const { return enabled_; }
  uint64_t max_call_bytes() const { return max_call_bytes_; }

  // Opens `key` read-write and keeps [offset, offset + byte_size) of it as `name`.
  absl::Status Register(const inference::SystemSharedMemoryRegisterRequest& request);
  // Forgets `name` (every region when empty; OK when it is not registered).
  absl::Status Unregister(const std::string& name);
  // The region `name`, or every region when empty; NOT_FOUND for a name not registered.
  absl::Status Describe(const std::string& name,
                        inference::SystemSharedMemoryStatusResponse* response) const;

  // The slice of region `region_name` that `field` names, checked against the region.
  absl::StatusOr<SharedMemorySlice> Find(absl::string_view field, const std::string& region_name,
                                         uint64_t offset, uint64_t byte_size) const;

 private:
  const bool enabled_;
  const uint64_t max_call_bytes_;
  mutable core::Mutex mu_;
  std::map<std::string, std::shared_ptr<const SharedMemoryRegion>> regions_ ABSL_GUARDED_BY(mu_);
};

// The slice's bytes (exactly byte_size of them), or FAILED_PRECONDITION when the object no
// longer holds them.
absl::Status ReadSlice(const SharedMemorySlice& slice, std::string* bytes);
// Writes `bytes` at the start of the slice; INVALID_ARGUMENT when they do not fit in it.
absl::Status WriteSlice(const SharedMemorySlice& slice, absl::string_view bytes);

}  // namespace attention::server::kserve

#endif  // ATTENTION_SERVER_KSERVE_SYSTEM_SHARED_MEMORY_H_
