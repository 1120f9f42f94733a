#include "server/kserve/kserve_service.h"

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "server/kserve/kserve_convert.h"
#include "server/common/status_util.h"

namespace attention::server {
namespace {

// The server's one repository: requests may leave repository_name empty or name this.
constexpr char kRepositoryName[] = "attention";

absl::Status CheckRepositoryName(const std::string& name) {
  if (name.empty() || name == kRepositoryName) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("repository_name = ", Quoted(name),
                                          " is not a repository of this server; leave it empty "
                                          "or give \"", kRepositoryName, "\""));
}

uint64_t Nanoseconds(absl::Duration duration) {
  return static_cast<uint64_t>(absl::ToInt64Nanoseconds(duration));
}

// The load request a RepositoryModelLoad describes: its "config" parameter, an
// attention.v1.LoadLayerRequest in protobuf JSON, named model_name.
absl::StatusOr<v1::LoadLayerRequest> LoadRequestFor(
    const inference::RepositoryModelLoadRequest& request) {
  RETURN_IF_ERROR(CheckKnownFields(request));
  RETURN_IF_ERROR(CheckRepositoryName(request.repository_name()));
  const inference::ModelRepositoryParameter* config = nullptr;
  for (const auto& [key, parameter] : request.parameters()) {
    if (key != "config") {
      return absl::UnimplementedError(absl::StrCat(
          "parameters[", Quoted(key), "] is not supported: give the layer in parameters"
          "[\"config\"] as an attention.v1.LoadLayerRequest in JSON (model files are read from "
          "the server's model repository, not uploaded)"));
    }
    config = &parameter;
  }
  if (config == nullptr) {
    return Invalid("parameters[\"config\"] is missing: RepositoryModelLoad needs the layer as "
                   "an attention.v1.LoadLayerRequest in JSON, e.g. {\"spec\": {\"config\": "
                   "{\"embedDim\": 768, \"numHeads\": 12}, \"randomInit\": {\"seed\": 1}}}");
  }
  if (config->parameter_choice_case() != inference::ModelRepositoryParameter::kStringParam) {
    return Invalid("parameters[\"config\"] must be a string parameter (JSON)");
  }
  v1::LoadLayerRequest load;
  const auto parsed = google::protobuf::util::JsonStringToMessage(config->string_param(), &load);
  if (!parsed.ok()) {
    return Invalid("parameters[\"config\"] is not an attention.v1.LoadLayerRequest in JSON: ",
                   BoundedMessage(parsed.message().as_string()));
  }
  if (!load.name().empty() && load.name() != request.model_name()) {
    return Invalid("parameters[\"config\"] names the layer ", Quoted(load.name()),
                   " but model_name is ", Quoted(request.model_name()));
  }
  load.set_name(request.model_name());
  return load;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const LayerSnapshot>> InferenceServiceImpl::FindModel(
    absl::string_view field, const std::string& name, const std::string& version) const {
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> found = registry_.Get(name);
  if (found.status().code() == absl::StatusCode::kNotFound) {
    // The registry's message names the native field (layer).
    std::vector<std::string> loaded;
    for (const auto& snapshot : registry_.List()) loaded.push_back(snapshot->name);
    return absl::NotFoundError(absl::StrCat(field, " = ", Quoted(name),
                                            " is not a loaded model (loaded: ",
                                            ListForMessage(loaded), ")"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const LayerSnapshot> snapshot, std::move(found));
  if (!version.empty() && version != absl::StrCat(snapshot->version)) {
    return absl::NotFoundError(absl::StrCat("model ", Quoted(name), " has version ",
                                            snapshot->version, ", not ", Quoted(version)));
  }
  return snapshot;
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerLive(
    grpc::CallbackServerContext* context, const inference::ServerLiveRequest* request,
    inference::ServerLiveResponse* response) {
  const UnaryCall call = native_.StartCall(context, "ServerLive");
  response->set_live(true);
  call.Answer(CheckKnownFields(*request));
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerReady(
    grpc::CallbackServerContext* context, const inference::ServerReadyRequest* request,
    inference::ServerReadyResponse* response) {
  const UnaryCall call = native_.StartCall(context, "ServerReady");
  response->set_ready(ready_.load());
  call.Answer(CheckKnownFields(*request));
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelReady(
    grpc::CallbackServerContext* context, const inference::ModelReadyRequest* request,
    inference::ModelReadyResponse* response) {
  const UnaryCall call = native_.StartCall(context, "ModelReady");
  absl::Status status = CheckKnownFields(*request);
  if (status.ok()) {
    const auto found = FindModel("name", request->name(), request->version());
    // Not ready is an answer, as in Triton; only a malformed request is an error.
    if (!found.ok() && found.status().code() != absl::StatusCode::kNotFound) {
      status = found.status();
    }
    response->set_ready(found.ok() && ready_.load());
  }
  call.Answer(status);
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest* request,
    inference::ServerMetadataResponse* response) {
  const UnaryCall call = native_.StartCall(context, "ServerMetadata");
  response->set_name("attention-service");
  response->set_version(ATTENTION_VERSION);
  response->add_extensions("model_repository");
  response->add_extensions("statistics");
  if (shared_memory_.system_enabled()) response->add_extensions("system_shared_memory");
  if (shared_memory_.cuda_enabled()) response->add_extensions("cuda_shared_memory");
  call.Answer(CheckKnownFields(*request));
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  const UnaryCall call = native_.StartCall(context, "ModelMetadata");
  absl::Status status = CheckKnownFields(*request);
  if (status.ok()) {
    const auto snapshot = FindModel("name", request->name(), request->version());
    status = snapshot.status();
    if (status.ok()) {
      response->set_name((*snapshot)->name);
      response->add_versions(absl::StrCat((*snapshot)->version));
      kserve::DescribeModel((*snapshot)->layer->config(), response);
    }
  }
  call.Answer(status);
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelInfer(
    grpc::CallbackServerContext* context, const inference::ModelInferRequest* request,
    inference::ModelInferResponse* response) {
  const UnaryCall call = native_.StartCall(context, "ModelInfer");
  // The native request and answer live until the batch worker finishes the call.
  struct Call {
    v1::MultiHeadAttentionRequest request;
    v1::MultiHeadAttentionResponse response;
    kserve::OutputPlan plan;
    GpuTensors on_gpu;
  };
  auto native = std::make_shared<Call>();
  // Found first: CUDA shared memory on the layer's GPU stays there for the layer.
  const absl::StatusOr<std::shared_ptr<const LayerSnapshot>> model =
      FindModel("model_name", request->model_name(), request->model_version());
  if (model.ok()) {
    const core::Backend& backend = (*model)->layer->backend();
    native->on_gpu.gpu = backend.InPlaceGpu().value_or(-1);
    // Inputs from system shared memory are read into the GPU's page-locked memory; the
    // snapshot keeps the backend.
    if (native->on_gpu.gpu >= 0) {
      native->on_gpu.pin = [snapshot = *model](size_t bytes) {
        return snapshot->layer->backend().PinnedHostBuffer(bytes);
      };
    }
  }
  absl::Status status = CatchExceptions("ModelInfer", [&] {
    return kserve::ToNativeRequest(*request, &native->request, &native->plan, &shared_memory_,
                                   &native->on_gpu);
  });
  if (status.ok()) status = model.status();
  if (status.ok()) {
    status = CatchExceptions("ModelInfer", [&] {
      return native_.SubmitMultiHeadAttention(
          native->request, call.deadline(), call.cancelled(), &native->response,
          [call, native, request, response](const absl::Status& result) {
            absl::Status answered = result;
            if (answered.ok()) {
              answered = kserve::ToInferResponse(native->response, native->plan,
                                                 request->model_name(), response);
            }
            call.Answer(kserve::ToKserveStatus(answered, *request), request->id());
          },
          /*borrow_inputs=*/true, *model, &native->on_gpu);
    });  // `native` holds the request and the regions on the GPU until then
    status = kserve::ToKserveStatus(status, *request);
  }
  if (!status.ok()) call.Answer(status, request->id());
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  const UnaryCall call = native_.StartCall(context, "ModelStatistics");
  absl::Status status = CheckKnownFields(*request);
  std::vector<std::shared_ptr<const LayerSnapshot>> layers;
  if (status.ok() && request->name().empty()) {
    layers = registry_.List();
  } else if (status.ok()) {
    auto snapshot = FindModel("name", request->name(), request->version());
    status = snapshot.status();
    if (status.ok()) layers.push_back(*std::move(snapshot));
  }
  const auto statistics = metrics_.LayerStatisticsByName();
  for (const auto& snapshot : layers) {
    inference::ModelStatistics* model = response->add_model_stats();
    model->set_name(snapshot->name);
    model->set_version(absl::StrCat(snapshot->version));
    const auto found = statistics.find(snapshot->name);
    if (found == statistics.end()) continue;
    const Metrics::LayerStatistics& layer = found->second;
    if (layer.last_batch != absl::InfinitePast()) {
      model->set_last_inference(static_cast<uint64_t>(absl::ToUnixMillis(layer.last_batch)));
    }
    model->set_inference_count(static_cast<uint64_t>(layer.requests));
    model->set_execution_count(static_cast<uint64_t>(layer.batches));
    inference::InferStatistics* stats = model->mutable_inference_stats();
    const int64_t succeeded = layer.requests - layer.failed_requests;
    stats->mutable_success()->set_count(static_cast<uint64_t>(succeeded));
    stats->mutable_fail()->set_count(static_cast<uint64_t>(layer.failed_requests));
    // Queue and compute time of every computed request; success time is their sum for the
    // requests that succeeded, apportioned by count.
    stats->mutable_queue()->set_count(static_cast<uint64_t>(layer.requests));
    stats->mutable_queue()->set_ns(Nanoseconds(layer.queued));
    stats->mutable_compute_infer()->set_count(static_cast<uint64_t>(layer.requests));
    stats->mutable_compute_infer()->set_ns(Nanoseconds(layer.computed));
    if (layer.requests > 0) {
      stats->mutable_success()->set_ns(
          Nanoseconds((layer.queued + layer.computed) * succeeded / layer.requests));
      stats->mutable_fail()->set_ns(Nanoseconds((layer.queued + layer.computed) *
                                                layer.failed_requests / layer.requests));
    }
  }
  call.Answer(status);
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::RepositoryIndex(
    grpc::CallbackServerContext* context, const inference::RepositoryIndexRequest* request,
    inference::RepositoryIndexResponse* response) {
  const UnaryCall call = native_.StartCall(context, "RepositoryIndex");
  absl::Status status = CheckKnownFields(*request);
  if (status.ok()) status = CheckRepositoryName(request->repository_name());
  if (status.ok()) {
    // Every layer the repository index knows is loaded, so `ready` changes nothing.
    for (const auto& snapshot : registry_.List()) {
      auto* model = response->add_models();
      model->set_name(snapshot->name);
      model->set_version(absl::StrCat(snapshot->version));
      model->set_state("READY");
    }
  }
  call.Answer(status);
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
    inference::RepositoryModelLoadResponse* /*response*/) {
  const UnaryCall call = native_.StartCall(context, "RepositoryModelLoad");
  absl::Status status = native_.CheckAdmin(*context, "RepositoryModelLoad");
  absl::StatusOr<v1::LoadLayerRequest> load =
      status.ok() ? LoadRequestFor(*request) : absl::StatusOr<v1::LoadLayerRequest>(status);
  if (!load.ok()) {
    call.Answer(load.status());
  } else {
    // Reading files and building weights queue on the loader pool, as LoadLayer's.
    AnswerFromLoader(loader_, call, *request, [this, load = *std::move(load)] {
      v1::LoadLayerResponse loaded;
      return native_.DoLoadLayer(load, &loaded);
    });
  }
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
    inference::RepositoryModelUnloadResponse* /*response*/) {
  const UnaryCall call = native_.StartCall(context, "RepositoryModelUnload");
  absl::Status status = native_.CheckAdmin(*context, "RepositoryModelUnload");
  if (status.ok()) status = CheckKnownFields(*request);
  if (status.ok()) status = CheckRepositoryName(request->repository_name());
  for (const auto& [key, parameter] : request->parameters()) {
    // A layer has no dependents, so unloading them is a no-op; nothing else is known.
    if (status.ok() && key != "unload_dependents") {
      status = absl::UnimplementedError(absl::StrCat(
          "parameters[", Quoted(key), "] is not supported; only \"unload_dependents\""));
    }
  }
  if (status.ok()) status = native_.DoUnloadLayer(request->model_name());
  call.Answer(status);
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::CheckedCall(
    grpc::CallbackServerContext* context, absl::string_view method,
    const google::protobuf::Message& request, absl::FunctionRef<absl::Status()> body) {
  const UnaryCall call = native_.StartCall(context, method);
  absl::Status status = CheckKnownFields(request);
  if (status.ok()) status = body();
  call.Answer(status);
  return call.reactor();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::SystemSharedMemoryStatusRequest* request,
    inference::SystemSharedMemoryStatusResponse* response) {
  return CheckedCall(context, "SystemSharedMemoryStatus", *request,
                     [&] { return shared_memory_.DescribeSystem(request->name(), response); });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryRegisterRequest* request,
    inference::SystemSharedMemoryRegisterResponse* response) {
  return CheckedCall(context, "SystemSharedMemoryRegister", *request,
                     [&] { return shared_memory_.RegisterSystem(*request); });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryUnregisterRequest* request,
    inference::SystemSharedMemoryUnregisterResponse* response) {
  return CheckedCall(context, "SystemSharedMemoryUnregister", *request,
                     [&] { return shared_memory_.UnregisterSystem(request->name()); });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest* request,
    inference::CudaSharedMemoryStatusResponse* response) {
  return CheckedCall(context, "CudaSharedMemoryStatus", *request,
                     [&] { return shared_memory_.DescribeCuda(request->name(), response); });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::CudaSharedMemoryRegister(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryRegisterRequest* request,
    inference::CudaSharedMemoryRegisterResponse* response) {
  return CheckedCall(context, "CudaSharedMemoryRegister", *request,
                     [&] { return shared_memory_.RegisterCuda(*request); });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const inference::CudaSharedMemoryUnregisterRequest* request,
    inference::CudaSharedMemoryUnregisterResponse* response) {
  return CheckedCall(context, "CudaSharedMemoryUnregister", *request,
                     [&] { return shared_memory_.UnregisterCuda(request->name()); });
}

}  // namespace attention::server
