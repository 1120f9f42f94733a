// libFuzzer target: requests of every compute and management RPC from arbitrary bytes,
// through the service's one validation path and, when valid, a small compute. The first byte
// picks the RPC (0 MultiHeadAttention, 1 ScaledDotProductAttention, 2 LoadLayer, 3 the Open
// Inference Protocol's ModelInfer, translated and then submitted as the service does, 4
// SessionStep, whose entries without a session id go to a session the target holds); the rest
// is the serialized request. Budgets are small, so a valid request computes in milliseconds.
// Seeds: tests/fuzz/corpus/requests/ (made by tests/fuzz/make_corpus.py).
#include <cstddef>
#include <cstdint>
#include <future>

#include "absl/time/clock.h"
#include "server/kserve/kserve_convert.h"
#include "server/native/attention_service.h"
#include "server/sessions/session_table.h"

namespace attention::server {
namespace {

// The service and everything it needs, in process, without a gRPC server.
struct Service {
  Service() : devices(1), batcher(Options()), loader(1) {
    LayerRegistryOptions registry_options;
    registry_options.max_weight_bytes = 1 << 20;
    if (!registry.Configure(registry_options).ok()) __builtin_trap();
    RequestLogOptions log_options;
    log_options.errors = false;
    log = std::make_unique<RequestLog>(log_options);
    RequestBudget budget;
    budget.max_response_bytes = 1 << 20;
    budget.max_request_flops = 50'000'000;
    budget.max_request_memory_bytes = 16 << 20;
    SessionTableOptions session_options;
    session_options.kv_cache_bytes = 1 << 20;
    session_options.block_bytes = 4096;
    session_options.max_session_tokens = 256;
    session_options.poison_freed_blocks = true;  // a read outside a block table shows as NaN
    sessions = *SessionTable::Create(session_options, devices.cpu()->pool());
    service = std::make_unique<AttentionServiceImpl>(registry, batcher, metrics, *log, budget,
                                                     devices, devices.cpu(), AccessPolicy{}, loader,
                                                     kDefaultInlineLayerCacheBytes, sessions.get());
    // A session for steps to write: 2 layers, 2 query heads on 1 KV head of 4 dims.
    SessionShape shape;
    shape.num_layers = 2;
    shape.num_heads = 2;
    shape.head_dim = 4;
    session_id = sessions->CreateSession(shape, 64, absl::Hours(1), absl::Now())->id;
    // A layer for requests to name: "tiny", E = 8, 2 heads.
    v1::LoadLayerRequest load;
    load.set_name("tiny");
    load.mutable_spec()->mutable_config()->set_embed_dim(8);
    load.mutable_spec()->mutable_config()->set_num_heads(2);
    load.mutable_spec()->mutable_random_init()->set_seed(1);
    v1::LoadLayerResponse response;
    if (!service->DoLoadLayer(load, &response).ok()) __builtin_trap();
  }
  static BatcherOptions Options() {
    BatcherOptions options;
    options.num_workers = 1;
    return options;
  }

  core::Devices devices;
  Metrics metrics;
  Batcher batcher;
  LayerRegistry registry;
  LoaderPool loader;
  std::unique_ptr<RequestLog> log;
  std::unique_ptr<SessionTable> sessions;
  std::string session_id;
  std::unique_ptr<AttentionServiceImpl> service;
};

// Submits and waits for the answer, which must come exactly once.
template <typename Submit>
void RunAndWait(Submit submit) {
  std::promise<absl::Status> answered;
  const absl::Status status = submit([&answered](const absl::Status& result) {
    answered.set_value(result);
  });
  if (status.ok()) answered.get_future().wait();
}

}  // namespace
}  // namespace attention::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attention;
  static server::Service* const service = new server::Service();
  if (size == 0) return 0;
  const int rpc = data[0] % 5;
  const uint8_t* body = data + 1;
  const int body_size = static_cast<int>(size - 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto never_cancelled = [] { return false; };
  switch (rpc) {
    case 0: {
      v1::MultiHeadAttentionRequest request;
      if (!request.ParseFromArray(body, body_size)) return 0;
      v1::MultiHeadAttentionResponse response;
      server::RunAndWait([&](auto finish) {
        return service->service->SubmitMultiHeadAttention(request, deadline, never_cancelled,
                                                          &response, finish,
                                                          /*borrow_inputs=*/true);
      });
      break;
    }
    case 1: {
      v1::ScaledDotProductAttentionRequest request;
      if (!request.ParseFromArray(body, body_size)) return 0;
      v1::ScaledDotProductAttentionResponse response;
      server::RunAndWait([&](auto finish) {
        return service->service->SubmitScaledDotProductAttention(request, deadline,
                                                                 never_cancelled, &response,
                                                                 finish);
      });
      break;
    }
    case 3: {
      inference::ModelInferRequest request;
      if (!request.ParseFromArray(body, body_size)) return 0;
      v1::MultiHeadAttentionRequest native;
      server::kserve::OutputPlan plan;
      if (!server::kserve::ToNativeRequest(request, &native, &plan).ok()) return 0;
      v1::MultiHeadAttentionResponse response;
      absl::Status answer = absl::UnknownError("not answered");
      server::RunAndWait([&](auto finish) {
        return service->service->SubmitMultiHeadAttention(
            native, deadline, never_cancelled, &response,
            [&answer, finish](const absl::Status& result) {
              answer = result;
              finish(result);
            },
            /*borrow_inputs=*/true);
      });
      if (answer.ok()) {
        inference::ModelInferResponse translated;
        // No shared memory here: translating a computed answer cannot fail.
        if (!server::kserve::ToInferResponse(response, plan, request.model_name(), &translated)
                 .ok()) {
          __builtin_trap();
        }
      }
      break;
    }
    case 4: {
      v1::SessionStepRequest request;
      if (!request.ParseFromArray(body, body_size)) return 0;
      for (v1::SessionStepEntry& entry : *request.mutable_entries()) {
        if (entry.session_id().empty()) entry.set_session_id(service->session_id);
      }
      v1::SessionStepResponse response;
      server::RunAndWait([&](auto finish) {
        return service->service->SubmitSessionStep(request, server::SessionCaller{}, deadline,
                                                   never_cancelled, &response, finish);
      });
      // Back to empty, so the next input's positions start from 0 again.
      if (!service->sessions->Truncate(service->session_id, 0, absl::Now()).ok()) {
        __builtin_trap();
      }
      break;
    }
    default: {  // 2
      v1::LoadLayerRequest request;
      if (!request.ParseFromArray(body, body_size)) return 0;
      // Never replace the layer the other requests name, and never persist (no repository).
      if (request.name() == "tiny") return 0;
      v1::LoadLayerResponse response;
      if (service->service->DoLoadLayer(request, &response).ok()) {
        service->registry.Remove(request.name()).IgnoreError();
      }
    }
  }
  return 0;
}
