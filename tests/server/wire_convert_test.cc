// Conversions from the wire that need no server: the queue deadline of a request.
#include "server/wire_convert.h"

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

}  // namespace
}  // namespace attention::server
