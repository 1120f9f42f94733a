// The backends the core's correctness tests run against, as ggml's test-backend-ops does:
// every backend compiled in. One that cannot run on this machine (CUDA without a GPU) is
// reported SKIPPED with the reason, never passed.
#ifndef ATTENTION_TESTS_CORE_TEST_BACKENDS_H_
#define ATTENTION_TESTS_CORE_TEST_BACKENDS_H_

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

class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto backend = TestDevices().Get(GetParam());
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
