#include "server/observability/request_log.h"

#include <sstream>

#include "gtest/gtest.h"

namespace attention::server {
namespace {

int Lines(const std::string& text) { return static_cast<int>(std::count(text.begin(), text.end(), '\n')); }

TEST(RequestLogTest, ErrorsAlwaysSuccessesNeverByDefault) {
  std::ostringstream out;
  RequestLog log(RequestLogOptions{}, out);
  log.Record("MultiHeadAttention", absl::OkStatus(), absl::Milliseconds(2), "a");
  log.Record("MultiHeadAttention", absl::NotFoundError("layer \"x\" is not loaded"),
             absl::Microseconds(150), "b");
  EXPECT_EQ(Lines(out.str()), 1) << out.str();
  EXPECT_NE(out.str().find("method=MultiHeadAttention code=NOT_FOUND seconds=0.000150 "
                           "request_id=\"b\" message=\"layer \\\"x\\\" is not loaded\""),
            std::string::npos)
      << out.str();
}

TEST(RequestLogTest, AccessSampleLogsExactlyThatFraction) {
  std::ostringstream out;
  RequestLogOptions options;
  options.access_sample = 0.25;
  options.errors = false;
  RequestLog log(options, out);
  for (int i = 0; i < 100; ++i) {
    log.Record("GetLayer", absl::OkStatus(), absl::ZeroDuration(), "");
    log.Record("GetLayer", absl::InternalError("x"), absl::ZeroDuration(), "");
  }
  EXPECT_EQ(Lines(out.str()), 25);
  EXPECT_EQ(out.str().find("INTERNAL"), std::string::npos);
}

TEST(RequestLogTest, JsonLinesEscapeTheMessage) {
  std::ostringstream out;
  RequestLogOptions options;
  options.json = true;
  RequestLog log(options, out);
  log.Record("LoadLayer", absl::InvalidArgumentError("bad \"name\"\n\\ok"), absl::Seconds(1),
             "id-1");
  const std::string line = out.str();
  EXPECT_EQ(line.front(), '{');
  EXPECT_NE(line.find(R"("method":"LoadLayer","code":"INVALID_ARGUMENT","seconds":1.000000,)"
                      R"("request_id":"id-1","message":"bad \"name\"\n\\ok"})"),
            std::string::npos)
      << line;
}

TEST(RequestLogTest, RejectsSampleOutsideUnitInterval) {
  RequestLogOptions options;
  options.access_sample = 1.5;
  EXPECT_EQ(options.Validate().message(), "access_log_sample = 1.5 is outside [0, 1]");
}

}  // namespace
}  // namespace attention::server
