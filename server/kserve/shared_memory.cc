#include "server/kserve/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"

namespace attention::server::kserve {
namespace {

// shm_open's limit on a name (NAME_MAX), its leading '/' included.
constexpr size_t kMaxKeyBytes = 255;

absl::Status SystemOff() {
  return absl::FailedPreconditionError(
      "system shared memory is off on this server; start it with "
      "--kserve_system_shared_memory to let callers on its host register regions");
}

absl::Status CudaOff() {
  return absl::FailedPreconditionError(
      "CUDA shared memory is off on this server; start it with --kserve_cuda_shared_memory "
      "to let callers on its host register GPU buffers");
}

absl::Status CheckKey(const std::string& key) {
  const size_t slash = key.find('/', 1);
  if (key.empty() || key.size() > kMaxKeyBytes || slash != std::string::npos ||
      key.find('\0') != std::string::npos || key == "/") {
    return Invalid("key = ", Quoted(key), " is not a shared memory object name (1 to ",
                   kMaxKeyBytes, " bytes, a '/' only at the start, as shm_open takes)");
  }
  return absl::OkStatus();
}

// The end of [offset, offset + byte_size), or INVALID_ARGUMENT naming `what` on overflow.
absl::StatusOr<uint64_t> End(absl::string_view what, uint64_t offset, uint64_t byte_size) {
  if (byte_size > UINT64_MAX - offset) {
    return Invalid(what, " offset ", offset, " + byte_size ", byte_size,
                   " is past the largest object");
  }
  return offset + byte_size;
}

// Bytes [offset, offset + byte_size) of a POSIX shared memory object.
class SystemRegion final : public SharedMemoryRegion {
 public:
  SystemRegion(std::string name, std::string key, uint64_t offset, uint64_t byte_size, int fd)
      : SharedMemoryRegion(std::move(name), byte_size),
        key(std::move(key)),
        offset(offset),
        fd(fd) {}
  ~SystemRegion() override { close(fd); }

  bool on_device() const override { return false; }
  std::string Source() const override { return absl::StrCat("key ", Quoted(key)); }

  absl::Status Read(uint64_t at, uint64_t size, char* out) const override {
    uint64_t done = 0;
    while (done < size) {
      const ssize_t got =
          pread(fd, out + done, size - done, static_cast<off_t>(offset + at + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "gave ", done, " of its ", size, " bytes; the object shrank or cannot be read"));
      }
      done += static_cast<uint64_t>(got);
    }
    return absl::OkStatus();
  }
  absl::Status Write(uint64_t at, absl::string_view bytes) const override {
    uint64_t done = 0;
    while (done < bytes.size()) {
      const ssize_t put = pwrite(fd, bytes.data() + done, bytes.size() - done,
                                 static_cast<off_t>(offset + at + done));
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("took ", done, " of ", bytes.size(), " bytes: ", std::strerror(errno)));
      }
      done += static_cast<uint64_t>(put);
    }
    return absl::OkStatus();
  }

  const std::string key;
  const uint64_t offset;  // within the object
  const int fd;
};

// The first byte_size bytes of another process's GPU buffer.
class CudaRegion final : public SharedMemoryRegion {
 public:
  CudaRegion(std::string name, int64_t device, uint64_t byte_size,
             std::unique_ptr<core::SharedDeviceMemory> memory)
      : SharedMemoryRegion(std::move(name), byte_size),
        device(device),
        memory_(std::move(memory)) {}

  bool on_device() const override { return true; }
  std::string Source() const override { return absl::StrCat("cuda:", device); }

  absl::Status Read(uint64_t at, uint64_t size, char* out) const override {
    return memory_->CopyToHost(at, size, out);
  }
  absl::Status Write(uint64_t at, absl::string_view bytes) const override {
    return memory_->CopyFromHost(at, bytes.data(), bytes.size());
  }
  const core::SharedDeviceMemory* gpu_memory() const override { return memory_.get(); }

  const int64_t device;

 private:
  const std::unique_ptr<core::SharedDeviceMemory> memory_;
};

// Whether `region` is of that kind and named `name` (any name when empty).
bool Matches(const SharedMemoryRegion& region, bool on_device, const std::string& name) {
  return region.on_device() == on_device && (name.empty() || region.name == name);
}

absl::Status NotRegistered(const std::string& name) {
  return absl::NotFoundError(absl::StrCat("name = ", Quoted(name), " is not a registered region"));
}

// A region's read or write failure, led by the tensor and the region it concerns.
absl::Status AboutSlice(const SharedMemorySlice& slice, absl::Status status) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(slice.field, ": region ", Quoted(slice.region->name), " (",
                                   slice.region->Source(), ") ", status.message()));
}

}  // namespace

absl::Status SharedMemory::RegisterSystem(
    const inference::SystemSharedMemoryRegisterRequest& request) {
  if (!system_enabled_) return SystemOff();
  if (request.name().empty()) return Invalid("name is empty: give the region a name");
  RETURN_IF_ERROR(CheckKey(request.key()));
  if (request.byte_size() == 0) {
    return Invalid("byte_size is 0 for region ", Quoted(request.name()));
  }
  ASSIGN_OR_RETURN(const uint64_t end, End(absl::StrCat("region ", Quoted(request.name()), ":"),
                                           request.offset(), request.byte_size()));
  const int fd = shm_open(request.key().c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int error = errno;
    const std::string what =
        absl::StrCat("key = ", Quoted(request.key()), ": ", std::strerror(error));
    if (error == ENOENT) return absl::NotFoundError(absl::StrCat(what, " (no such object)"));
    if (error == EACCES) return absl::PermissionDeniedError(what);
    return Invalid(what);
  }
  // Owns the descriptor from here: an early return closes it.
  auto region = std::make_shared<const SystemRegion>(request.name(), request.key(),
                                                     request.offset(), request.byte_size(), fd);
  struct stat status {};
  if (fstat(fd, &status) != 0 || !S_ISREG(status.st_mode) ||
      static_cast<uint64_t>(status.st_size) < end) {
    return Invalid("region ", Quoted(request.name()), " = bytes [", request.offset(), ", ", end,
                   ") of key ", Quoted(request.key()), ", which holds ",
                   static_cast<int64_t>(status.st_size), " bytes");
  }
  return Add(std::move(region));
}

absl::Status SharedMemory::RegisterCuda(const inference::CudaSharedMemoryRegisterRequest& request) {
  if (!cuda_enabled()) return CudaOff();
  if (request.name().empty()) return Invalid("name is empty: give the region a name");
  if (request.raw_handle().size() != core::kCudaIpcHandleBytes) {
    return Invalid("raw_handle has ", request.raw_handle().size(),
                   " bytes; a cudaIpcMemHandle_t has ", core::kCudaIpcHandleBytes);
  }
  if (request.device_id() < 0) return Invalid("device_id = ", request.device_id(), " is negative");
  if (request.byte_size() == 0) {
    return Invalid("byte_size is 0 for region ", Quoted(request.name()));
  }
  {  // Refused before the handle is opened; Add checks again.
    core::MutexLock lock(mu_);
    RETURN_IF_ERROR(RoomFor(request.name()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<core::SharedDeviceMemory> memory,
                   cuda_(request.device_id(), request.raw_handle(), request.byte_size()));
  return Add(std::make_shared<const CudaRegion>(request.name(), request.device_id(),
                                                request.byte_size(), std::move(memory)));
}

absl::Status SharedMemory::RoomFor(const std::string& name) const {
  if (const auto found = regions_.find(name); found != regions_.end()) {
    return absl::AlreadyExistsError(
        absl::StrCat("region ", Quoted(name), " is already registered (", found->second->Source(),
                     "); unregister it first"));
  }
  if (regions_.size() >= kMaxRegions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        kMaxRegions, " regions are registered, the most this server holds; unregister one"));
  }
  return absl::OkStatus();
}

absl::Status SharedMemory::Add(std::shared_ptr<const SharedMemoryRegion> region) {
  core::MutexLock lock(mu_);
  RETURN_IF_ERROR(RoomFor(region->name));
  regions_.emplace(region->name, std::move(region));
  return absl::OkStatus();
}

absl::Status SharedMemory::UnregisterSystem(const std::string& name) {
  if (!system_enabled_) return SystemOff();
  return Remove(/*on_device=*/false, name);
}

absl::Status SharedMemory::UnregisterCuda(const std::string& name) {
  if (!cuda_enabled()) return CudaOff();
  return Remove(/*on_device=*/true, name);
}

absl::Status SharedMemory::Remove(bool on_device, const std::string& name) {
  core::MutexLock lock(mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    it = Matches(*it->second, on_device, name) ? regions_.erase(it) : std::next(it);
  }
  return absl::OkStatus();
}

std::vector<std::shared_ptr<const SharedMemoryRegion>> SharedMemory::Matching(
    bool on_device, const std::string& name) const {
  std::vector<std::shared_ptr<const SharedMemoryRegion>> found;
  core::MutexLock lock(mu_);
  for (const auto& [region_name, region] : regions_) {
    if (Matches(*region, on_device, name)) found.push_back(region);
  }
  return found;
}

absl::Status SharedMemory::DescribeSystem(
    const std::string& name, inference::SystemSharedMemoryStatusResponse* response) const {
  if (!system_enabled_) return SystemOff();
  const auto regions = Matching(/*on_device=*/false, name);
  if (!name.empty() && regions.empty()) return NotRegistered(name);
  for (const auto& region : regions) {
    const auto& system = static_cast<const SystemRegion&>(*region);
    auto& status = (*response->mutable_regions())[region->name];
    status.set_name(region->name);
    status.set_key(system.key);
    status.set_offset(system.offset);
    status.set_byte_size(region->byte_size);
  }
  return absl::OkStatus();
}

absl::Status SharedMemory::DescribeCuda(const std::string& name,
                                        inference::CudaSharedMemoryStatusResponse* response) const {
  if (!cuda_enabled()) return CudaOff();
  const auto regions = Matching(/*on_device=*/true, name);
  if (!name.empty() && regions.empty()) return NotRegistered(name);
  for (const auto& region : regions) {
    auto& status = (*response->mutable_regions())[region->name];
    status.set_name(region->name);
    status.set_device_id(static_cast<uint64_t>(static_cast<const CudaRegion&>(*region).device));
    status.set_byte_size(region->byte_size);
  }
  return absl::OkStatus();
}

absl::StatusOr<SharedMemorySlice> SharedMemory::Find(absl::string_view field,
                                                     const std::string& region_name,
                                                     uint64_t offset, uint64_t byte_size) const {
  if (!system_enabled_ && !cuda_enabled()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ".parameters[\"shared_memory_region\"]: ", SystemOff().message()));
  }
  std::shared_ptr<const SharedMemoryRegion> region;
  {
    core::MutexLock lock(mu_);
    const auto found = regions_.find(region_name);
    if (found == regions_.end()) {
      return absl::NotFoundError(absl::StrCat(field, ".parameters[\"shared_memory_region\"] = ",
                                              Quoted(region_name), " is not a registered region"));
    }
    region = found->second;
  }
  ASSIGN_OR_RETURN(const uint64_t end, End(field, offset, byte_size));
  if (end > region->byte_size) {
    return Invalid(field, " asks for bytes [", offset, ", ", end, ") of region ",
                   Quoted(region_name), ", which has ", region->byte_size);
  }
  return SharedMemorySlice{std::move(region), offset, byte_size, std::string(field)};
}

int SharedMemorySlice::gpu() const {
  const core::SharedDeviceMemory* memory = region->gpu_memory();
  return memory != nullptr ? memory->device() : -1;
}

absl::Status ReadSlice(const SharedMemorySlice& slice, std::string* bytes) {
  bytes->resize(slice.byte_size);
  return ReadSliceInto(slice, bytes->data());
}

absl::Status ReadSliceInto(const SharedMemorySlice& slice, char* out) {
  return AboutSlice(slice, slice.region->Read(slice.offset, slice.byte_size, out));
}

absl::Status WriteSlice(const SharedMemorySlice& slice, absl::string_view bytes) {
  if (bytes.size() > slice.byte_size) {
    return Invalid(slice.field, ".parameters[\"shared_memory_byte_size\"] = ", slice.byte_size,
                   " cannot hold the answer's ", bytes.size(), " bytes");
  }
  return AboutSlice(slice, slice.region->Write(slice.offset, bytes));
}

}  // namespace attention::server::kserve
