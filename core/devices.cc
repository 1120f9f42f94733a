#include "core/devices.h"

#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#if ATTENTION_HAVE_CUDA
#include "core/cuda/cuda_backend.h"
#endif

namespace attention::core {

bool CudaBuilt() { return ATTENTION_HAVE_CUDA != 0; }

int Devices::GpuCount(std::string* why_none) const {
#if ATTENTION_HAVE_CUDA
  const absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) {
    if (why_none != nullptr) *why_none = std::string(count.status().message());
    return 0;
  }
  if (*count == 0 && why_none != nullptr) *why_none = "the CUDA driver sees no device";
  return *count;
#else
  if (why_none != nullptr) *why_none = "this build has no CUDA backend (ATTENTION_CUDA=OFF)";
  return 0;
#endif
}

absl::StatusOr<std::shared_ptr<const Backend>> Devices::Get(absl::string_view device) {
  if (device == "cpu") return std::shared_ptr<const Backend>(cpu_);
  std::string why_none;
  const int gpus = GpuCount(&why_none);
  if (device == "auto") {
    if (gpus == 0) return std::shared_ptr<const Backend>(cpu_);
    device = "cuda:0";
  }
  int index = 0;
  absl::string_view number = device;
  if (device != "cuda" && !(absl::ConsumePrefix(&number, "cuda:") &&
                            absl::SimpleAtoi(number, &index) && index >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device \"", device.substr(0, 64), "\" is not one of auto, cpu, cuda, cuda:N"));
  }
  if (index >= gpus) {
    return absl::FailedPreconditionError(
        gpus == 0 ? absl::StrCat("device cuda:", index, " is not available: ", why_none)
                  : absl::StrCat("device cuda:", index, " is not available: ", gpus,
                                 " GPU(s) visible (cuda:0 to cuda:", gpus - 1, ")"));
  }
#if ATTENTION_HAVE_CUDA
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<const Backend>& backend = gpus_[index];
  if (backend == nullptr) {
    absl::StatusOr<std::shared_ptr<const Backend>> opened = OpenCudaBackend(index);
    if (!opened.ok()) {
      gpus_.erase(index);
      return opened.status();
    }
    backend = *std::move(opened);
  }
  return backend;
#else
  return absl::FailedPreconditionError("unreachable: no GPU without CUDA");
#endif
}

}  // namespace attention::core
