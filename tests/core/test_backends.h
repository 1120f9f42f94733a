// The backends the core's correctness tests run against, as ggml's test-backend-ops does:
// every backend compiled in. One that cannot run on this machine (CUDA without a GPU) is
// reported SKIPPED with the reason, never passed.
#ifndef ATTENTION_TESTS_CORE_TEST_BACKENDS_H_
#define ATTENTION_TESTS_CORE_TEST_BACKENDS_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/devices.h"
#include "gtest/gtest.h"

namespace attention::core::testing {

// Two CPU threads, so the pool's splitting is exercised on any machine.
inline Devices& TestDevices() {
  static Devices* devices = new Devices(2);
  return *devices;
}

inline std::shared_ptr<const Backend> CpuForTests() { return TestDevices().cpu(); }

inline std::vector<std::string> CompiledDevices() {
  if (CudaBuilt()) return {"cpu", "cuda"};
  return {"cpu"};
}

// The CPU backend with float32 layers' projections forced onto each kernel set
// (core/cpu/float32_linear.h), so that tests reach both on every host: "cpu_float32_own"
// and "cpu_float32_onednn". The plain "cpu" runs the one measured fastest here.
inline const char* const kCpuFloat32Prefix = "cpu_float32_";

inline std::vector<std::string> CompiledDevicesWithEachCpuFloat32Set() {
  std::vector<std::string> devices = {std::string(kCpuFloat32Prefix) + "own",
                                      std::string(kCpuFloat32Prefix) + "onednn"};
  if (CudaBuilt()) devices.push_back("cuda");
  return devices;
}

// The backend named by CompiledDevices or CompiledDevicesWithEachCpuFloat32Set.
inline absl::StatusOr<std::shared_ptr<const Backend>> BackendForTests(const std::string& name) {
  if (name.rfind(kCpuFloat32Prefix, 0) != 0) return TestDevices().Get(name);
  static std::map<std::string, std::shared_ptr<const Backend>>* forced = [] {
    auto* made = new std::map<std::string, std::shared_ptr<const Backend>>;
    for (const Float32Projection set : {Float32Projection::kOwn, Float32Projection::kOneDnn}) {
      CpuKernelChoice kernels;
      kernels.float32_projection = set;
      (*made)[kCpuFloat32Prefix + std::string(Float32ProjectionName(set))] =
          std::make_shared<CpuBackend>(2, kernels);
    }
    return made;
  }();
  return forced->at(name);
}

class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto backend = BackendForTests(GetParam());
    if (!backend.ok()) {
      GTEST_SKIP() << "backend " << GetParam() << " cannot run here: " << backend.status().message();
    }
    backend_ = *std::move(backend);
  }

  std::shared_ptr<const Backend> backend_;
};

inline std::string DeviceTestName(const ::testing::TestParamInfo<std::string>& info) {
  return info.param;
}

}  // namespace attention::core::testing

#endif  // ATTENTION_TESTS_CORE_TEST_BACKENDS_H_
