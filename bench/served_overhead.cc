// Where a large served request spends the time beyond its compute (issue 15, item 4).
//
//   build/bench/served_overhead [--batch=32] [--tokens=128] [--causal] [--rounds=15]
//                               [--warmup_rounds=2] [--bf16] [--kserve_shared_memory]
//                               [--callers=1]
//
// One process, loopback, interleaved per round:
//   echo      a gRPC echo of the request's payload size both ways (generic API, bytes only):
//             the transport ceiling;
//   served    MultiHeadAttention on the demo layer (E=768, 12 heads) through an in-process
//             server, one caller;
//   compute   the same forward pass on the layer directly (in process, no gRPC);
//   protobuf  serializing and parsing the request and the answer messages;
//   shm       with --kserve_shared_memory, the same request as KServe ModelInfer with its
//             query written into (each call) and its output read from POSIX shared
//             memory regions (Triton's system shared memory extension): no tensor bytes in
//             the messages;
//   cuda shm  with --kserve_cuda_shared_memory, the same ModelInfer with the query in, and
//             the output to, a GPU buffer another process exported (Triton's CUDA shared
//             memory): on a layer on that GPU the tensors never reach the host;
//   many      with --callers=N > 1, N callers at once, served and in process, timed until
//             the last answer: throughput under load, where one caller's transport runs
//             while another's request computes.
// Medians over the rounds after the untimed warm-up ones are printed, with served - compute
// and served / compute.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attention/v1/attention.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/app/malloc_tuning.h"
#include "server/app/server.h"
#include "tensor_codec.h"
#include "tests/server/cuda_ipc_exporter_process.h"

ABSL_FLAG(int64_t, batch, 32, "sequences per request");
ABSL_FLAG(int64_t, tokens, 128, "tokens per sequence");
ABSL_FLAG(int, rounds, 15, "interleaved rounds");
ABSL_FLAG(int, warmup_rounds, 2,
          "untimed rounds first: a fresh server's first two large calls are the slowest "
          "(S1 on Zen 4: 168-175 and 133-142 ms, then 110-135)");
ABSL_FLAG(int, compute_threads, 0, "the server's --compute_threads (0: one per hardware thread)");
ABSL_FLAG(int, batch_workers, 2, "the server's --batch_workers");
ABSL_FLAG(bool, causal, false, "causal attention (S3: --batch=1 --tokens=2048 --causal)");
ABSL_FLAG(bool, bf16, false,
          "serve a BFLOAT16 layer of the demo layer's shape (LayerConfig.compute_dtype, issue "
          "26) with bf16 requests and answers; compute is then the same bf16 input in process");
ABSL_FLAG(int, callers, 1,
          "also time this many callers at once, served and in process (throughput under load)");
ABSL_FLAG(bool, kserve_shared_memory, false,
          "also time KServe ModelInfer with the query and output in system shared memory");
ABSL_FLAG(bool, kserve_cuda_shared_memory, false,
          "also time KServe ModelInfer with the query in, and the output to, a GPU buffer that "
          "another process exported (Triton's CUDA shared memory; see --cuda_ipc_exporter)");
ABSL_FLAG(std::string, cuda_ipc_exporter, "",
          "the exporting process's binary, tests/server/cuda_ipc_exporter (default: beside "
          "this one, as scripts/gpu-bundle places it)");
ABSL_FLAG(int, echo_lookahead_bytes, 0,
          "grpc.http2.lookahead_bytes of the echo client and server (0: gRPC's default)");
ABSL_FLAG(int, echo_max_frame_bytes, 0,
          "grpc.http2.max_frame_size of the echo client and server (0: gRPC's default)");

namespace {

using attention::server::AttentionServer;
using attention::server::ServerOptions;

// Echoes one message back.
class EchoService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Reactor final : public grpc::ServerGenericBidiReactor {
     public:
      Reactor() { StartRead(&buffer_); }
      void OnReadDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::OK);
          return;
        }
        StartWriteAndFinish(&buffer_, grpc::WriteOptions(), grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      grpc::ByteBuffer buffer_;
    };
    return new Reactor;
  }
};

// A POSIX shared memory object of `bytes` for one run, mapped; unlinked at the end.
struct SharedObject {
  explicit SharedObject(const std::string& name, size_t bytes)
      : key("/served-overhead-" + std::to_string(getpid()) + "-" + name), size(bytes) {
    const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) std::abort();
    data = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    if (data == MAP_FAILED) std::abort();
  }
  ~SharedObject() {
    munmap(data, size);
    shm_unlink(key.c_str());
  }
  std::string key;
  size_t size;
  char* data;
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

double MillisecondsSince(absl::Time start) { return absl::ToDoubleMilliseconds(absl::Now() - start); }

grpc::ChannelArguments LargeMessages() {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  return arguments;
}

// The HTTP/2 settings under test (those set), for the echo's both ends.
std::vector<std::pair<const char*, int>> Http2Arguments() {
  std::vector<std::pair<const char*, int>> arguments;
  if (const int bytes = absl::GetFlag(FLAGS_echo_lookahead_bytes); bytes > 0) {
    arguments.emplace_back(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, bytes);
  }
  if (const int bytes = absl::GetFlag(FLAGS_echo_max_frame_bytes); bytes > 0) {
    arguments.emplace_back(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, bytes);
  }
  return arguments;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  attention::server::KeepLargeBuffersInHeap(size_t{256} << 20);  // as attention-server
  const int64_t batch = absl::GetFlag(FLAGS_batch), tokens = absl::GetFlag(FLAGS_tokens);
  const int64_t embed_dim = attention::server::kDemoEmbedDim;

  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.demo_layer = true;
  options.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  options.batcher.num_workers = absl::GetFlag(FLAGS_batch_workers);
  options.kserve_system_shared_memory = absl::GetFlag(FLAGS_kserve_shared_memory);
  options.kserve_cuda_shared_memory = absl::GetFlag(FLAGS_kserve_cuda_shared_memory);
  auto server = AttentionServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  EchoService echo_service;
  grpc::ServerBuilder echo_builder;
  int echo_port = 0;
  echo_builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &echo_port);
  echo_builder.RegisterCallbackGenericService(&echo_service);
  echo_builder.SetMaxReceiveMessageSize(-1);
  echo_builder.SetMaxSendMessageSize(-1);
  for (const auto& [name, value] : Http2Arguments()) echo_builder.AddChannelArgument(name, value);
  std::unique_ptr<grpc::Server> echo_server = echo_builder.BuildAndStart();

  auto mha = attention::v1::AttentionService::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials(),
      LargeMessages()));
  grpc::ChannelArguments echo_arguments = LargeMessages();
  for (const auto& [name, value] : Http2Arguments()) echo_arguments.SetInt(name, value);
  grpc::GenericStub echo(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(echo_port),
                                                   grpc::InsecureChannelCredentials(),
                                                   echo_arguments));

  const bool bf16 = absl::GetFlag(FLAGS_bf16);
  std::string layer_name = attention::server::kDemoLayerName;
  if (bf16) {
    layer_name = "demo-bf16";
    attention::v1::LoadLayerRequest load;
    load.set_name(layer_name);
    attention::v1::LayerConfig* config = load.mutable_spec()->mutable_config();
    config->set_embed_dim(embed_dim);
    config->set_num_heads(attention::server::kDemoNumHeads);
    config->set_compute_dtype(attention::v1::BFLOAT16);
    load.mutable_spec()->mutable_random_init()->set_seed(1);
    grpc::ClientContext context;
    attention::v1::LoadLayerResponse loaded;
    if (const grpc::Status status = mha->LoadLayer(&context, load, &loaded); !status.ok()) {
      std::fprintf(stderr, "LoadLayer: %s\n", status.error_message().c_str());
      return 1;
    }
  }
  const attention::core::DType wire_dtype =
      bf16 ? attention::core::DType::kBFloat16 : attention::core::DType::kFloat32;
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(batch * tokens * embed_dim));
  for (float& v : values) v = uniform(rng);
  std::vector<uint16_t> bf16_values(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bf16_values[i] = attention::core::FloatToBFloat16(values[i]);
  }
  attention::v1::MultiHeadAttentionRequest request;
  request.set_layer(layer_name);
  attention::wire::EncodeTensor(values, {batch, tokens, embed_dim}, wire_dtype,
                                request.mutable_query());
  request.mutable_options()->set_causal(absl::GetFlag(FLAGS_causal));
  const std::string payload = request.SerializeAsString();
  const grpc::Slice slice(payload);
  const grpc::ByteBuffer echo_request(&slice, 1);

  // KServe ModelInfer over shared memory: the query's bytes go into region "in" each call,
  // the answer comes back in region "out".
  const bool shm = absl::GetFlag(FLAGS_kserve_shared_memory);
  const size_t element_bytes = bf16 ? 2 : 4;
  const size_t tensor_bytes = values.size() * element_bytes;
  std::unique_ptr<SharedObject> shm_in, shm_out;
  auto kserve = inference::GRPCInferenceService::NewStub(
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                grpc::InsecureChannelCredentials(), LargeMessages()));
  // ModelInfer of the query at `in_offset` of region `in` and the output at `out_offset` of
  // region `out`.
  const auto region_request = [&](const char* in, uint64_t in_offset, const char* out,
                                  uint64_t out_offset) {
    inference::ModelInferRequest request;
    request.set_model_name(layer_name);
    auto* query = request.add_inputs();
    query->set_name("query");
    query->set_datatype(bf16 ? "BF16" : "FP32");
    for (int64_t dim : {batch, tokens, embed_dim}) query->add_shape(dim);
    auto& query_parameters = *query->mutable_parameters();
    query_parameters["shared_memory_region"].set_string_param(in);
    query_parameters["shared_memory_byte_size"].set_uint64_param(tensor_bytes);
    query_parameters["shared_memory_offset"].set_uint64_param(in_offset);
    auto* output = request.add_outputs();
    output->set_name("output");
    auto& output_parameters = *output->mutable_parameters();
    output_parameters["shared_memory_region"].set_string_param(out);
    output_parameters["shared_memory_byte_size"].set_uint64_param(tensor_bytes);
    output_parameters["shared_memory_offset"].set_uint64_param(out_offset);
    (*request.mutable_parameters())["causal"].set_bool_param(absl::GetFlag(FLAGS_causal));
    return request;
  };
  const void* query_bytes =
      bf16 ? static_cast<const void*>(bf16_values.data()) : static_cast<const void*>(values.data());
  inference::ModelInferRequest shm_request;
  if (shm) {
    shm_in = std::make_unique<SharedObject>("in", tensor_bytes);
    shm_out = std::make_unique<SharedObject>("out", tensor_bytes);
    for (const auto& [name, object] : {std::pair{"in", shm_in.get()}, {"out", shm_out.get()}}) {
      inference::SystemSharedMemoryRegisterRequest registration;
      registration.set_name(name);
      registration.set_key(object->key);
      registration.set_byte_size(object->size);
      grpc::ClientContext context;
      inference::SystemSharedMemoryRegisterResponse registered;
      if (const grpc::Status status =
              kserve->SystemSharedMemoryRegister(&context, registration, &registered);
          !status.ok()) {
        std::fprintf(stderr, "SystemSharedMemoryRegister: %s\n", status.error_message().c_str());
        return 1;
      }
    }
    shm_request = region_request("in", 0, "out", 0);
  }
  // KServe ModelInfer over CUDA shared memory: the query sits in a GPU buffer of another
  // process (left there once, as a producer on the GPU would), the answer goes right after it.
  const bool cuda_shm = absl::GetFlag(FLAGS_kserve_cuda_shared_memory);
  std::string exporter_path = absl::GetFlag(FLAGS_cuda_ipc_exporter);
  if (exporter_path.empty())
    exporter_path = attention::testing::CudaIpcExporter::BesideThisBinary();
  attention::testing::CudaIpcExporter exporter(exporter_path);
  inference::ModelInferRequest cuda_request;
  if (cuda_shm) {
    std::string contents(2 * tensor_bytes, '\0');
    std::memcpy(contents.data(), query_bytes, tensor_bytes);
    std::string handle, failure;
    if (!exporter.Start(contents, &handle, &failure)) {
      std::fprintf(stderr, "%s: %s\n", exporter_path.c_str(), failure.c_str());
      return 1;
    }
    inference::CudaSharedMemoryRegisterRequest registration;
    registration.set_name("gpu");
    registration.set_raw_handle(handle);
    registration.set_device_id(0);
    registration.set_byte_size(contents.size());
    grpc::ClientContext context;
    inference::CudaSharedMemoryRegisterResponse registered;
    if (const grpc::Status status =
            kserve->CudaSharedMemoryRegister(&context, registration, &registered);
        !status.ok()) {
      std::fprintf(stderr, "CudaSharedMemoryRegister: %s\n", status.error_message().c_str());
      return 1;
    }
    cuda_request = region_request("gpu", 0, "gpu", tensor_bytes);
  }

  auto layer = (*(*server)->registry().Get(layer_name))->layer;
  attention::core::MhaInput input;
  input.batch = batch;
  input.q_len = input.kv_len = tokens;
  if (bf16) {  // as the server hands a bf16 layer its bf16 request
    input.half_dtype = attention::core::DType::kBFloat16;
    input.query_half = bf16_values;
  } else {
    input.query = values;
  }
  input.options.causal = absl::GetFlag(FLAGS_causal);

  // `callers` runs of `call` at once, each on its own thread: milliseconds until the last
  // returns, per call, or -1 when one failed.
  const int callers = absl::GetFlag(FLAGS_callers);
  const auto time_at_once = [callers](const std::function<bool()>& call) {
    const absl::Time start = absl::Now();
    std::vector<std::thread> threads;
    std::vector<char> ok(callers, 0);
    for (int c = 0; c < callers; ++c) threads.emplace_back([&, c] { ok[c] = call(); });
    for (std::thread& thread : threads) thread.join();
    const bool all_ok = std::all_of(ok.begin(), ok.end(), [](char v) { return v != 0; });
    return all_ok ? MillisecondsSince(start) / callers : -1.0;
  };

  std::vector<double> echo_ms, served_ms, compute_ms, protobuf_ms, shm_ms, cuda_shm_ms,
      served_many_ms, compute_many_ms;
  std::string served_answer;  // the last served call's output bytes
  const int warmup_rounds = absl::GetFlag(FLAGS_warmup_rounds);
  for (int round = -warmup_rounds; round < absl::GetFlag(FLAGS_rounds); ++round) {
    if (round == 0) {  // warmed up: time from here on
      echo_ms.clear();
      served_ms.clear();
      compute_ms.clear();
      protobuf_ms.clear();
      shm_ms.clear();
      cuda_shm_ms.clear();
      served_many_ms.clear();
      compute_many_ms.clear();
    }
    absl::Time start = absl::Now();
    grpc::ByteBuffer echoed;
    grpc::ClientContext echo_context;
    absl::Notification echo_done;
    grpc::Status echo_status;
    echo.UnaryCall(&echo_context, "/bench.Echo/Echo", grpc::StubOptions(), &echo_request, &echoed,
                   [&](const grpc::Status& status) {
                     echo_status = status;
                     echo_done.Notify();
                   });
    echo_done.WaitForNotification();
    echo_ms.push_back(MillisecondsSince(start));

    start = absl::Now();
    grpc::ClientContext context;
    attention::v1::MultiHeadAttentionResponse response;
    const grpc::Status status = mha->MultiHeadAttention(&context, request, &response);
    served_ms.push_back(MillisecondsSince(start));
    served_answer = response.output().raw_data();
    if (!status.ok() || !echo_status.ok()) {
      std::fprintf(stderr, "call failed: %s %s\n", status.error_message().c_str(),
                   echo_status.error_message().c_str());
      return 1;
    }

    start = absl::Now();
    const auto computed = layer->ForwardBatch({&input});
    compute_ms.push_back(MillisecondsSince(start));
    if (!computed.ok()) return 1;

    if (shm) {
      start = absl::Now();
      std::memcpy(shm_in->data, query_bytes, tensor_bytes);
      grpc::ClientContext shm_context;
      inference::ModelInferResponse shm_response;
      const grpc::Status shm_status = kserve->ModelInfer(&shm_context, shm_request, &shm_response);
      shm_ms.push_back(MillisecondsSince(start));
      if (!shm_status.ok()) {
        std::fprintf(stderr, "ModelInfer: %s\n", shm_status.error_message().c_str());
        return 1;
      }
    }

    if (cuda_shm) {
      start = absl::Now();
      grpc::ClientContext cuda_context;
      inference::ModelInferResponse cuda_response;
      const grpc::Status cuda_status =
          kserve->ModelInfer(&cuda_context, cuda_request, &cuda_response);
      cuda_shm_ms.push_back(MillisecondsSince(start));
      if (!cuda_status.ok()) {
        std::fprintf(stderr, "ModelInfer (CUDA shared memory): %s\n",
                     cuda_status.error_message().c_str());
        return 1;
      }
    }

    if (callers > 1) {
      served_many_ms.push_back(time_at_once([&] {
        grpc::ClientContext many_context;
        attention::v1::MultiHeadAttentionResponse many_response;
        return mha->MultiHeadAttention(&many_context, request, &many_response).ok();
      }));
      compute_many_ms.push_back(time_at_once([&] { return layer->ForwardBatch({&input}).ok(); }));
      if (served_many_ms.back() < 0 || compute_many_ms.back() < 0) {
        std::fprintf(stderr, "a call of %d at once failed\n", callers);
        return 1;
      }
    }

    start = absl::Now();
    attention::v1::MultiHeadAttentionRequest parsed_request;
    attention::v1::MultiHeadAttentionResponse parsed_response;
    const bool parsed = parsed_request.ParseFromString(request.SerializeAsString()) &&
                        parsed_response.ParseFromString(response.SerializeAsString());
    protobuf_ms.push_back(MillisecondsSince(start));
    if (!parsed) return 1;
  }
  const double served = Median(served_ms), compute = Median(compute_ms);
  std::printf("request %.1f MB, answer %.1f MB (B=%lld N=%lld E=%lld), %d rounds, medians:\n",
              payload.size() / 1e6, payload.size() / 1e6, static_cast<long long>(batch),
              static_cast<long long>(tokens), static_cast<long long>(embed_dim),
              absl::GetFlag(FLAGS_rounds));
  std::printf("  echo (transport ceiling, both ways)   %8.2f ms\n", Median(echo_ms));
  std::printf("  protobuf serialize+parse, both ways   %8.2f ms\n", Median(protobuf_ms));
  std::printf("  compute in process                    %8.2f ms\n", compute);
  std::printf("  served MultiHeadAttention             %8.2f ms\n", served);
  std::printf("  served - compute                      %8.2f ms\n", served - compute);
  std::printf("  served / in-process throughput        %8.3f\n", compute / served);
  if (shm) {
    const double shared = Median(shm_ms);
    std::printf("  KServe ModelInfer, shared memory      %8.2f ms\n", shared);
    std::printf("  shared memory - compute               %8.2f ms\n", shared - compute);
    std::printf("  shared memory / in-process throughput %8.3f\n", compute / shared);
  }
  if (cuda_shm) {
    const double shared = Median(cuda_shm_ms);
    std::printf("  KServe ModelInfer, CUDA shared memory %8.2f ms (layer on %s)\n", shared,
                layer->device().c_str());
    std::printf("  CUDA shared memory - compute          %8.2f ms\n", shared - compute);
    std::printf("  CUDA shared memory / in-process throughput %6.3f\n", compute / shared);
    std::string buffer;
    if (!exporter.Dump(2 * tensor_bytes, &buffer)) {
      std::fprintf(stderr, "%s: %s\n", exporter_path.c_str(), exporter.Errors().c_str());
      return 1;
    }
    std::printf("  its answer in the GPU buffer: %s the served call's\n",
                buffer.compare(tensor_bytes, tensor_bytes, served_answer) == 0 ? "bitwise"
                                                                               : "DIFFERS from");
  }
  if (callers > 1) {
    const double served_many = Median(served_many_ms), compute_many = Median(compute_many_ms);
    std::printf("  %d callers at once, per call: served   %8.2f ms\n", callers, served_many);
    std::printf("  %d callers at once, per call: in process %6.2f ms\n", callers, compute_many);
    std::printf("  served / in-process throughput, %d callers %6.3f\n", callers,
                compute_many / served_many);
  }
  echo_server->Shutdown();
  return 0;
}
