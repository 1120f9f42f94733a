#include "server/kserve/system_shared_memory.h"

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

absl::Status Off() {
  return absl::FailedPreconditionError(
      "system shared memory is off on this server; start it with "
      "--kserve_system_shared_memory to let callers on its host register regions");
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

}  // namespace

SharedMemoryRegion::~SharedMemoryRegion() { close(fd); }

absl::Status SystemSharedMemory::Register(
    const inference::SystemSharedMemoryRegisterRequest& request) {
  if (!enabled_) return Off();
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
  auto region = std::make_shared<const SharedMemoryRegion>(
      request.name(), request.key(), request.offset(), request.byte_size(), fd);
  struct stat status {};
  if (fstat(fd, &status) != 0 || !S_ISREG(status.st_mode) ||
      static_cast<uint64_t>(status.st_size) < end) {
    return Invalid("region ", Quoted(request.name()), " = bytes [", request.offset(), ", ", end,
                   ") of key ", Quoted(request.key()), ", which holds ",
                   static_cast<int64_t>(status.st_size), " bytes");
  }
  core::MutexLock lock(mu_);
  if (const auto found = regions_.find(request.name()); found != regions_.end()) {
    return absl::AlreadyExistsError(
        absl::StrCat("region ", Quoted(request.name()), " is already registered (key ",
                     Quoted(found->second->key), "); unregister it first"));
  }
  if (regions_.size() >= kMaxRegions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        kMaxRegions, " regions are registered, the most this server holds; unregister one"));
  }
  regions_.emplace(request.name(), std::move(region));
  return absl::OkStatus();
}

absl::Status SystemSharedMemory::Unregister(const std::string& name) {
  if (!enabled_) return Off();
  core::MutexLock lock(mu_);
  if (name.empty()) {
    regions_.clear();
  } else {
    regions_.erase(name);
  }
  return absl::OkStatus();
}

absl::Status SystemSharedMemory::Describe(
    const std::string& name, inference::SystemSharedMemoryStatusResponse* response) const {
  if (!enabled_) return Off();
  core::MutexLock lock(mu_);
  for (const auto& [region_name, region] : regions_) {
    if (!name.empty() && region_name != name) continue;
    auto& status = (*response->mutable_regions())[region_name];
    status.set_name(region->name);
    status.set_key(region->key);
    status.set_offset(region->offset);
    status.set_byte_size(region->byte_size);
  }
  if (!name.empty() && response->regions().empty()) {
    return absl::NotFoundError(
        absl::StrCat("name = ", Quoted(name), " is not a registered region"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SharedMemorySlice> SystemSharedMemory::Find(absl::string_view field,
                                                           const std::string& region_name,
                                                           uint64_t offset,
                                                           uint64_t byte_size) const {
  if (!enabled_) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ".parameters[\"shared_memory_region\"]: ", Off().message()));
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

absl::Status ReadSlice(const SharedMemorySlice& slice, std::string* bytes) {
  bytes->resize(slice.byte_size);
  uint64_t done = 0;
  while (done < slice.byte_size) {
    const ssize_t got = pread(slice.region->fd, bytes->data() + done, slice.byte_size - done,
                              static_cast<off_t>(slice.region->offset + slice.offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(slice.field, ": region ", Quoted(slice.region->name), " (key ",
                       Quoted(slice.region->key), ") gave ", done, " of its ", slice.byte_size,
                       " bytes; the object shrank or cannot be read"));
    }
    done += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::Status WriteSlice(const SharedMemorySlice& slice, absl::string_view bytes) {
  if (bytes.size() > slice.byte_size) {
    return Invalid(slice.field, ".parameters[\"shared_memory_byte_size\"] = ", slice.byte_size,
                   " cannot hold the answer's ", bytes.size(), " bytes");
  }
  uint64_t done = 0;
  while (done < bytes.size()) {
    const ssize_t put = pwrite(slice.region->fd, bytes.data() + done, bytes.size() - done,
                               static_cast<off_t>(slice.region->offset + slice.offset + done));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          slice.field, ": region ", Quoted(slice.region->name), " (key ", Quoted(slice.region->key),
          ") took ", done, " of ", bytes.size(), " bytes: ", std::strerror(errno)));
    }
    done += static_cast<uint64_t>(put);
  }
  return absl::OkStatus();
}

}  // namespace attention::server::kserve
