// Conversions from the wire that need no server: the queue deadline of a request, a layer's
// batching policy.
#include "server/models/layer_config.h"
#include "server/validation/wire_convert.h"

#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(QueueDeadlineTest, TheEarlierOfTheCallDeadlineAndTheQueueTimeout) {
  const absl::Time now = absl::FromUnixSeconds(1000);
  const absl::Time call_deadline = now + absl::Milliseconds(50);
  v1::AttentionOptions options;
  EXPECT_EQ(*QueueDeadline(options, call_deadline, now), call_deadline);  // 0 = no limit
  EXPECT_EQ(*QueueDeadline(options, absl::InfiniteFuture(), now), absl::InfiniteFuture());
  options.set_queue_timeout_us(2000);
  EXPECT_EQ(*QueueDeadline(options, call_deadline, now), now + absl::Milliseconds(2));
  EXPECT_EQ(*QueueDeadline(options, absl::InfiniteFuture(), now), now + absl::Milliseconds(2));
  options.set_queue_timeout_us(80000);
  EXPECT_EQ(*QueueDeadline(options, call_deadline, now), call_deadline);
}

TEST(QueueDeadlineTest, NegativeTimeoutIsInvalid) {
  v1::AttentionOptions options;
  options.set_queue_timeout_us(-5);
  const absl::StatusOr<absl::Time> deadline =
      QueueDeadline(options, absl::InfiniteFuture(), absl::Now());
  EXPECT_EQ(deadline.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(deadline.status().message(),
            "options.queue_timeout_us = -5 must be >= 0 (microseconds; 0 = no limit)");
}

// One rule for both APIs' queue timeouts: the native field and KServe's "timeout".
TEST(QueueDeadlineTest, CheckQueueTimeoutNamesTheFieldAndUnit) {
  EXPECT_TRUE(CheckQueueTimeout(0, "options.queue_timeout_us").ok());
  EXPECT_TRUE(CheckQueueTimeout(7, "parameters[\"timeout\"]", " µs").ok());
  const absl::Status status = CheckQueueTimeout(-1, "parameters[\"timeout\"]", " µs");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "parameters[\"timeout\"] = -1 µs must be >= 0 (microseconds; 0 = no limit)");
}

TEST(BatchingPolicyTest, OnlyTheFieldsSetOverrideTheServer) {
  v1::BatchingPolicy policy;
  policy.set_max_batch_requests(4);
  policy.set_max_queue_delay_us(0);  // set to zero is not unset: no delay for this layer
  policy.set_queue_timeout_us(250000);
  const absl::StatusOr<BatchLimitOverrides> overrides = ConvertBatchingPolicy(policy, "batching");
  ASSERT_TRUE(overrides.ok()) << overrides.status();
  BatchLimits server;
  server.max_batch_tokens = 100;
  server.max_queue_delay = absl::Milliseconds(3);
  const BatchLimits limits = overrides->ApplyTo(server);
  EXPECT_EQ(limits.max_batch_requests, 4);
  EXPECT_EQ(limits.max_batch_tokens, 100);
  EXPECT_EQ(limits.max_queue_delay, absl::ZeroDuration());
  EXPECT_EQ(limits.max_queue_requests, server.max_queue_requests);
  EXPECT_EQ(limits.queue_timeout, absl::Milliseconds(250));
  // Back to the wire: the overrides carry only what was set; the limits carry everything.
  const v1::BatchingPolicy round_trip = BatchingPolicyToProto(*overrides);
  EXPECT_EQ(round_trip.SerializeAsString(), policy.SerializeAsString());
  const v1::BatchingPolicy resolved = BatchingPolicyToProto(limits);
  EXPECT_TRUE(resolved.has_max_queue_tokens());
  EXPECT_EQ(resolved.max_batch_tokens(), 100);
}

TEST(BatchingPolicyTest, OutOfRangeValuesAreInvalidAndNamed) {
  const struct {
    void (v1::BatchingPolicy::*set)(int64_t);
    int64_t value;
    const char* message;
  } cases[] = {
      {&v1::BatchingPolicy::set_max_batch_requests, 0,
       "batching.max_batch_requests = 0 must be >= 1"},
      {&v1::BatchingPolicy::set_max_batch_tokens, -3, "batching.max_batch_tokens = -3 must be >= 1"},
      {&v1::BatchingPolicy::set_max_queue_delay_us, -1,
       "batching.max_queue_delay_us = -1 must be >= 0 (microseconds)"},
      {&v1::BatchingPolicy::set_max_queue_requests, 0,
       "batching.max_queue_requests = 0 must be >= 1"},
      {&v1::BatchingPolicy::set_max_queue_tokens, 0, "batching.max_queue_tokens = 0 must be >= 1"},
      {&v1::BatchingPolicy::set_queue_timeout_us, -7,
       "batching.queue_timeout_us = -7 must be >= 0 (microseconds; 0 = no limit)"},
  };
  for (const auto& c : cases) {
    v1::BatchingPolicy policy;
    (policy.*c.set)(c.value);
    const absl::StatusOr<BatchLimitOverrides> overrides =
        ConvertBatchingPolicy(policy, "batching");
    EXPECT_EQ(overrides.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(overrides.status().message(), c.message);
  }
}

}  // namespace
}  // namespace attention::server
