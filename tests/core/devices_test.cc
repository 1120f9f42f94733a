// Device names and placement: which backend a name opens, and the errors for a GPU that is
// not there, on machines with and without one.
#include "core/devices.h"

#include "gtest/gtest.h"

namespace attention::core {
namespace {

TEST(DevicesTest, CpuIsAlwaysThere) {
  Devices devices(1);
  auto cpu = devices.Get("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->name(), "cpu");
  EXPECT_EQ(cpu->get(), devices.cpu().get());  // one backend per device
  EXPECT_FALSE((*cpu)->Memory().has_value());
}

TEST(DevicesTest, UnknownNamesAreInvalid) {
  Devices devices(1);
  for (const char* name : {"tpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""}) {
    const absl::Status status = devices.Get(name).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(status.message(), std::string("device \"") + name +
                                    "\" is not one of auto, cpu, cuda, cuda:N");
  }
}

TEST(DevicesTest, GpuRequestsFollowWhatTheMachineHas) {
  Devices devices(1);
  std::string why_none;
  const int gpus = devices.GpuCount(&why_none);
  auto automatic = devices.Get("auto");
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  if (gpus == 0) {
    EXPECT_FALSE(why_none.empty());
    EXPECT_EQ((*automatic)->name(), "cpu");
    const absl::Status status = devices.Get("cuda").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(status.message(), "device cuda:0 is not available: " + why_none);
    if (!CudaBuilt()) {
      EXPECT_EQ(why_none, "this build has no CUDA backend (ATTENTION_CUDA=OFF)");
    }
  } else {
    EXPECT_TRUE(CudaBuilt());
    EXPECT_EQ((*automatic)->name(), "cuda:0");
    EXPECT_TRUE((*automatic)->Memory().has_value());
    const absl::Status status = devices.Get("cuda:" + std::to_string(gpus)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(status.message().find(std::to_string(gpus) + " GPU(s) visible"), std::string::npos)
        << status;
  }
}

}  // namespace
}  // namespace attention::core
