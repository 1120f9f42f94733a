// The /metrics endpoint over real HTTP: counters by method and code, histograms, gauges.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

// GET http://127.0.0.1:port/metrics with a plain socket; returns the body.
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return "connect failed";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return "write failed";
  }
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? response : response.substr(body + 4);
}

// The value of the first sample line that starts with `series`, or -1.
double Sample(const std::string& text, const std::string& series) {
  size_t at = 0;
  while ((at = text.find(series, at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == '\n') {
      const size_t value = at + series.size() + 1;
      return std::stod(text.substr(value, text.find('\n', value) - value));
    }
    at += series.size();
  }
  return -1;
}

class MetricsTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.metrics_address = "127.0.0.1:0";
    return options;
  }
};

TEST_F(MetricsTest, CountRequestsByMethodAndCode) {
  ASSERT_GT(server_->metrics_port(), 0);
  std::mt19937_64 rng(21);
  v1::MultiHeadAttentionRequest good = DemoRequest(rng, 1, 4);
  v1::MultiHeadAttentionRequest bad = good;
  bad.set_layer("unknown-layer");
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client_->MultiHeadAttention(good).ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(client_->MultiHeadAttention(bad).status().code(), absl::StatusCode::kNotFound);
  }
  const std::string text = Scrape(server_->metrics_port());
  EXPECT_EQ(Sample(text, R"(attention_requests_total{code="OK",method="MultiHeadAttention"})"), 3)
      << text;
  EXPECT_EQ(Sample(text, R"(attention_requests_total{code="NOT_FOUND",method="MultiHeadAttention"})"), 2);
  EXPECT_EQ(Sample(text, R"(attention_request_duration_seconds_count{method="MultiHeadAttention"})"), 5);
  EXPECT_EQ(Sample(text, "attention_tokens_processed_total{layer=\"demo-bert-base\"}"), 12);
  EXPECT_EQ(Sample(text, "attention_queue_duration_seconds_count"), 3);
  EXPECT_GE(Sample(text, "attention_batch_size_requests_count{layer=\"demo-bert-base\"}"), 1);
  EXPECT_EQ(Sample(text, "attention_batch_size_tokens_sum{layer=\"demo-bert-base\"}"), 12);
  EXPECT_EQ(Sample(text, "attention_queue_capacity_requests{layer=\"demo-bert-base\"}"),
            BatchLimits{}.max_queue_requests);
  EXPECT_EQ(Sample(text, "attention_in_flight_requests"), 0);
  EXPECT_EQ(Sample(text, "attention_layers_loaded"), 1);
  EXPECT_EQ(Sample(text, "attention_layer_weight_bytes"), 4.0 * (4 * 768 * 768 + 4 * 768));
  // The default device on a machine without a GPU, and OpenBLAS's kernel set (issue 15).
  const std::string build_info = "attention_build_info{backend=\"" +
                                 server_->default_backend().name() + "\",blas_core=\"" +
                                 core::CpuBackend::BlasCore() + "\",version=\"";
  EXPECT_NE(text.find(build_info), std::string::npos) << build_info;
  EXPECT_FALSE(core::CpuBackend::BlasCore().empty());
  // An unknown layer name never becomes a label value.
  EXPECT_EQ(text.find("unknown-layer"), std::string::npos);
}

// A GPU's attention calls by path follow the backend's totals: a counter that never goes
// back, a series per (device, path). The CPU backend reports none, so no series here.
TEST_F(MetricsTest, AttentionCallsByPathFollowTheBackendsTotals) {
  Metrics& metrics = server_->metrics();
  metrics.SetAttentionCalls("cuda:0", "cudnn", 5);
  metrics.SetAttentionCalls("cuda:0", "kernels", 2);
  metrics.SetAttentionCalls("cuda:0", "cudnn", 3);  // an older total raises nothing
  const std::string series = R"(attention_device_attention_calls_total{device="cuda:0",path=")";
  std::string text = Scrape(server_->metrics_port());
  EXPECT_EQ(Sample(text, series + R"(cudnn"})"), 5) << text;
  EXPECT_EQ(Sample(text, series + R"(kernels"})"), 2);
  metrics.SetAttentionCalls("cuda:0", "cudnn", 9);
  text = Scrape(server_->metrics_port());
  EXPECT_EQ(Sample(text, series + R"(cudnn"})"), 9);
  EXPECT_TRUE(server_->default_backend().AttentionCallsByPath().empty());
  EXPECT_EQ(text.find(R"(device="cpu",path=)"), std::string::npos);
}

}  // namespace
}  // namespace attention::server::testing
