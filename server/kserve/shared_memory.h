// Triton's shared memory extensions of the Open Inference Protocol: a caller on the same host
// registers a named region, then names a slice of it (region, byte size, offset) as an
// input's contents or an output's destination, so that the tensor bytes never cross gRPC.
// - System shared memory: a POSIX shared memory object (its shm_open key). Slices are read
//   with pread and written with pwrite on the object's descriptor, never mapped: a caller
//   that shrinks its object gets an error, not a SIGBUS in the server.
// - CUDA shared memory: a GPU buffer another process exported with cudaIpcGetMemHandle,
//   opened through a DeviceMemoryOpener (core::Devices::OpenIpcMemory in the server; tests
//   give a twin over host memory), read and written with copies to and from the host.
// Both kinds share one namespace of names and one limit on regions, as in Triton.
#ifndef ATTENTION_SERVER_KSERVE_SHARED_MEMORY_H_
#define ATTENTION_SERVER_KSERVE_SHARED_MEMORY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/cuda/cuda_backend.h"
#include "core/mutex.h"
#include "inference/grpc_service.pb.h"

namespace attention::server::kserve {

// One registered region; its object or device mapping stays open while the region or a
// call using it holds this.
class SharedMemoryRegion {
 public:
  SharedMemoryRegion(std::string name, uint64_t byte_size)
      : name(std::move(name)), byte_size(byte_size) {}
  virtual ~SharedMemoryRegion() = default;
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  virtual bool on_device() const = 0;
  // Where the bytes are, for messages: key "/name", or cuda:N.
  virtual std::string Source() const = 0;
  // Bytes [offset, offset + size) of the region, within it; FAILED_PRECONDITION saying how
  // many could be moved when the memory no longer holds them.
  virtual absl::Status Read(uint64_t offset, uint64_t size, char* out) const = 0;
  virtual absl::Status Write(uint64_t offset, absl::string_view bytes) const = 0;
  // A GPU region's memory, for a layer on its GPU to read and write in place; null for
  // system shared memory.
  virtual const core::SharedDeviceMemory* gpu_memory() const { return nullptr; }

  const std::string name;
  const uint64_t byte_size;
};

// Bytes [offset, offset + byte_size) of a region, as one tensor of one call names them;
// `field` names the tensor in messages (inputs["query"], outputs["output"]).
struct SharedMemorySlice {
  std::shared_ptr<const SharedMemoryRegion> region;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  std::string field;

  // The GPU the slice is on: its region's, or -1 for system shared memory.
  int gpu() const;
};

// Opens `handle` (CudaSharedMemoryRegisterRequest.raw_handle) exported from GPU `device` as
// a region of `byte_size` bytes.
using DeviceMemoryOpener = std::function<absl::StatusOr<std::unique_ptr<core::SharedDeviceMemory>>(
    int64_t device, absl::string_view handle, uint64_t byte_size)>;

class SharedMemory {
 public:
  // Regions registered at once, of both kinds: each holds a file descriptor or a mapping.
  static constexpr size_t kMaxRegions = 256;

  // System shared memory is on with `system_enabled`, CUDA shared memory with an opener;
  // off, each kind's calls answer FAILED_PRECONDITION naming its flag. One call reads at
  // most `max_call_bytes` from regions (the server's message limit).
  SharedMemory(bool system_enabled, uint64_t max_call_bytes, DeviceMemoryOpener cuda = nullptr)
      : system_enabled_(system_enabled), max_call_bytes_(max_call_bytes), cuda_(std::move(cuda)) {}

  bool system_enabled() const { return system_enabled_; }
  bool cuda_enabled() const { return cuda_ != nullptr; }
  uint64_t max_call_bytes() const { return max_call_bytes_; }

  // Opens `key` read-write and keeps [offset, offset + byte_size) of it as `name`.
  absl::Status RegisterSystem(const inference::SystemSharedMemoryRegisterRequest& request);
  // Opens the exported GPU buffer and keeps its first byte_size bytes as `name`.
  absl::Status RegisterCuda(const inference::CudaSharedMemoryRegisterRequest& request);
  // Forgets region `name` of that kind (every region of it when empty; OK when it is not
  // registered). Calls already using it finish with it.
  absl::Status UnregisterSystem(const std::string& name);
  absl::Status UnregisterCuda(const std::string& name);
  // The region `name` of that kind, or every one when empty; NOT_FOUND for a name not
  // registered as that kind.
  absl::Status DescribeSystem(const std::string& name,
                              inference::SystemSharedMemoryStatusResponse* response) const;
  absl::Status DescribeCuda(const std::string& name,
                            inference::CudaSharedMemoryStatusResponse* response) const;

  // The slice of region `region_name` (either kind) that `field` names, checked against it.
  absl::StatusOr<SharedMemorySlice> Find(absl::string_view field, const std::string& region_name,
                                         uint64_t offset, uint64_t byte_size) const;

 private:
  // ALREADY_EXISTS or RESOURCE_EXHAUSTED when `name` cannot be added.
  absl::Status RoomFor(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Add(std::shared_ptr<const SharedMemoryRegion> region);
  absl::Status Remove(bool on_device, const std::string& name);
  // Every region of that kind named `name` (all of them when empty).
  std::vector<std::shared_ptr<const SharedMemoryRegion>> Matching(bool on_device,
                                                                  const std::string& name) const;

  const bool system_enabled_;
  const uint64_t max_call_bytes_;
  const DeviceMemoryOpener cuda_;
  mutable core::Mutex mu_;
  std::map<std::string, std::shared_ptr<const SharedMemoryRegion>> regions_ ABSL_GUARDED_BY(mu_);
};

// The slice's bytes (exactly byte_size of them), or FAILED_PRECONDITION when the region no
// longer holds them.
absl::Status ReadSlice(const SharedMemorySlice& slice, std::string* bytes);
// The same into `out`, which holds at least byte_size bytes.
absl::Status ReadSliceInto(const SharedMemorySlice& slice, char* out);
// Writes `bytes` at the start of the slice; INVALID_ARGUMENT when they do not fit in it.
absl::Status WriteSlice(const SharedMemorySlice& slice, absl::string_view bytes);

}  // namespace attention::server::kserve

#endif  // ATTENTION_SERVER_KSERVE_SHARED_MEMORY_H_
