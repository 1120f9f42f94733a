#include "core/devices.h"

#include <dlfcn.h>
#include <unistd.h>

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/cpu/host_kv_storage.h"
#include "core/cuda/cuda_backend.h"
#include "core/status_macros.h"

namespace attention::core {
namespace {

constexpr char kCudaPluginFile[] = "libattention_cuda_backend.so";

// Where the CUDA plugin may be: $ATTENTION_CUDA_PLUGIN, beside the executable, in
// ../lib/attention-service/ of it (an installed tree), and where this build wrote it.
std::vector<std::string> CudaPluginCandidates() {
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("ATTENTION_CUDA_PLUGIN"); path != nullptr && *path != 0) {
    candidates.push_back(path);
  }
  char exe[4096];
  const ssize_t length = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (length > 0) {
    std::string dir(exe, length);
    dir.resize(dir.rfind('/') + 1);
    candidates.push_back(dir + kCudaPluginFile);
    candidates.push_back(dir + "../lib/attention-service/" + kCudaPluginFile);
  }
#ifdef ATTENTION_CUDA_PLUGIN_BUILD_PATH
  candidates.push_back(ATTENTION_CUDA_PLUGIN_BUILD_PATH);
#endif
  return candidates;
}

// Loaded once per process, on first use; never unloaded (backends live in it).
const absl::StatusOr<const CudaPlugin*>& CudaPluginOnce() {
  static const absl::StatusOr<const CudaPlugin*> plugin = []() -> absl::StatusOr<const CudaPlugin*> {
    if (!CudaBuilt()) {
      return absl::FailedPreconditionError("this build has no CUDA backend (ATTENTION_CUDA=OFF)");
    }
    std::vector<std::string> errors;
    for (const std::string& path : CudaPluginCandidates()) {
      if (::access(path.c_str(), F_OK) != 0) continue;
      void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        errors.push_back(::dlerror());
        continue;
      }
      auto entry = reinterpret_cast<CudaPluginEntry>(::dlsym(handle, kCudaPluginEntry));
      if (entry == nullptr) {
        errors.push_back(absl::StrCat(path, " has no ", kCudaPluginEntry));
        continue;
      }
      return entry();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA backend plugin ", kCudaPluginFile, " could not be loaded (",
        errors.empty() ? "not found beside the executable; set ATTENTION_CUDA_PLUGIN"
                       : absl::StrJoin(errors, "; "),
        ")"));
  }();
  return plugin;
}

}  // namespace

bool CudaBuilt() { return ATTENTION_HAVE_CUDA != 0; }

int Devices::GpuCount(std::string* why_none) const {
  const absl::StatusOr<const CudaPlugin*>& plugin = CudaPluginOnce();
  absl::StatusOr<int> count =
      plugin.ok() ? (*plugin)->device_count() : absl::StatusOr<int>(plugin.status());
  if (!count.ok()) {
    if (why_none != nullptr) *why_none = std::string(count.status().message());
    return 0;
  }
  if (*count == 0 && why_none != nullptr) *why_none = "the CUDA driver sees no device";
  return *count;
}

absl::StatusOr<std::shared_ptr<const Backend>> Devices::Get(absl::string_view device) {
  if (device == "cpu") return std::shared_ptr<const Backend>(cpu_);
  int index = 0;
  absl::string_view number = device;
  if (device != "auto" && device != "cuda" &&
      !(absl::ConsumePrefix(&number, "cuda:") && absl::SimpleAtoi(number, &index) && index >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device \"", device.substr(0, 64), "\" is not one of auto, cpu, cuda, cuda:N"));
  }
  std::string why_none;
  const int gpus = GpuCount(&why_none);
  if (device == "auto" && gpus == 0) return std::shared_ptr<const Backend>(cpu_);
  if (index >= gpus) {
    return absl::FailedPreconditionError(
        gpus == 0 ? absl::StrCat("device cuda:", index, " is not available: ", why_none)
                  : absl::StrCat("device cuda:", index, " is not available: ", gpus,
                                 " GPU(s) visible (cuda:0 to cuda:", gpus - 1, ")"));
  }
  MutexLock lock(mu_);
  std::shared_ptr<const Backend>& backend = gpus_[index];
  if (backend == nullptr) {
    absl::StatusOr<std::shared_ptr<const Backend>> opened = (*CudaPluginOnce())->open_backend(index);
    if (!opened.ok()) {
      gpus_.erase(index);
      return opened.status();
    }
    backend = *std::move(opened);
  }
  return backend;
}

absl::StatusOr<std::unique_ptr<kv_cache::KvStorage>> Devices::CreateKvStorage(
    absl::string_view device, int64_t num_blocks, int64_t block_bytes) {
  ASSIGN_OR_RETURN(const std::shared_ptr<const Backend> backend, Get(device));
  if (backend == cpu_) {
    return std::unique_ptr<kv_cache::KvStorage>(std::make_unique<HostKvStorage>(
        num_blocks, block_bytes, cpu_->pool(), kPagedPrefillMinQueries, cpu_->SessionBf16Products(),
        cpu_->SessionSharedPrefixes()));
  }
  int index = 0;
  absl::string_view number = backend->name();
  if (!absl::ConsumePrefix(&number, "cuda:") || !absl::SimpleAtoi(number, &index)) {
    return absl::InternalError(absl::StrCat("unexpected backend name ", backend->name()));
  }
  return (*CudaPluginOnce())->create_kv_storage(index, num_blocks, block_bytes);
}

absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> Devices::OpenIpcMemory(int64_t device,
                                                                           absl::string_view handle,
                                                                           uint64_t byte_size) {
  std::string why_none;
  const int gpus = GpuCount(&why_none);
  if (device < 0 || device >= gpus) {
    return absl::FailedPreconditionError(
        gpus == 0 ? absl::StrCat("device_id = ", device, " is not available: ", why_none)
                  : absl::StrCat("device_id = ", device, " is not available: ", gpus,
                                 " GPU(s) visible (0 to ", gpus - 1, ")"));
  }
  return (*CudaPluginOnce())->open_ipc_memory(static_cast<int>(device), handle, byte_size);
}

}  // namespace attention::core
