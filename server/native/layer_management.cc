// The native API's layer management: LoadLayer, UnloadLayer, ListLayers, GetLayer and
// InspectCheckpoint, with the admin check and the layer gauges they keep current.
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/status_macros.h"
#include "proto/tensor_codec.h"
#include "server/common/status_util.h"
#include "server/models/hf_checkpoint.h"
#include "server/models/layer_builder.h"
#include "server/models/layer_config.h"
#include "server/native/attention_service.h"

namespace attention::server {

void DescribeLayer(const LayerSnapshot& snapshot, const BatchLimits& server_limits,
                   v1::LayerInfo* info) {
  const core::MhaLayer& layer = *snapshot.layer;
  info->set_name(snapshot.name);
  *info->mutable_config() = ConfigToProto(layer.config());
  info->set_parameter_count(layer.config().ParameterCount());
  info->set_weight_bytes(layer.WeightBytes());
  info->set_dtype(wire::WireDType(layer.config().compute_dtype));
  info->set_device(layer.device());
  info->set_version(snapshot.version);
  info->set_persisted(snapshot.persisted);
  *info->mutable_batching() = BatchingPolicyToProto(snapshot.batching.ApplyTo(server_limits));
}

void AttentionServiceImpl::RefreshLayerMetrics() {
  const auto layers = registry_.List();
  // Also the unloaded or replaced layers that sessions still hold, which count against
  // --max_weight_bytes.
  metrics_.SetLayers(static_cast<int64_t>(layers.size()), registry_.weight_bytes());
  // Accelerators: the default one and every one holding a layer.
  std::map<std::string, const core::Backend*> backends = {
      {default_backend_->name(), default_backend_.get()}};
  for (const auto& snapshot : layers) {
    backends.emplace(snapshot->layer->device(), &snapshot->layer->backend());
  }
  for (const auto& [device, backend] : backends) {
    if (const std::optional<core::DeviceMemory> memory = backend->Memory()) {
      metrics_.SetDeviceMemory(device, memory->used_bytes, memory->total_bytes);
    }
    for (const auto& [path, calls] : backend->AttentionCallsByPath()) {
      metrics_.SetAttentionCalls(device, path, calls);
    }
  }
}

grpc::ServerUnaryReactor* AttentionServiceImpl::LoadLayer(grpc::CallbackServerContext* context,
                                                          const v1::LoadLayerRequest* request,
                                                          v1::LoadLayerResponse* response) {
  const UnaryCall call = StartCall(context, "LoadLayer");
  const absl::Status allowed = CheckAdmin(*context, "LoadLayer");
  if (!allowed.ok()) {
    call.Answer(allowed);
  } else {
    AnswerFromLoader(loader_, call, *request,
                     [this, request, response] { return DoLoadLayer(*request, response); });
  }
  return call.reactor();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::InspectCheckpoint(
    grpc::CallbackServerContext* context, const v1::InspectCheckpointRequest* request,
    v1::InspectCheckpointResponse* response) {
  const UnaryCall call = StartCall(context, "InspectCheckpoint");
  // The same reads as LoadLayer: the same access check, and file parsing on the loader pool.
  const absl::Status allowed = CheckAdmin(*context, "InspectCheckpoint");
  if (!allowed.ok()) {
    call.Answer(allowed);
  } else {
    AnswerFromLoader(loader_, call, *request,
                     [this, request, response] { return DoInspectCheckpoint(*request, response); });
  }
  return call.reactor();
}

absl::Status AttentionServiceImpl::DoInspectCheckpoint(const v1::InspectCheckpointRequest& request,
                                                       v1::InspectCheckpointResponse* response) {
  RETURN_IF_ERROR(CheckKnownFields(request));
  if (registry_.repository() == nullptr) {
    return absl::FailedPreconditionError(
        "InspectCheckpoint reads the model repository; start the server with --model_repository");
  }
  return server::InspectCheckpoint(*registry_.repository(), request, response);
}

absl::Status AttentionServiceImpl::CheckAdmin(const grpc::CallbackServerContext& context,
                                              absl::string_view method) const {
  return CheckAdminToken(context, access_, method, "layer management");
}

absl::Status AttentionServiceImpl::DoLoadLayer(const v1::LoadLayerRequest& request,
                                               v1::LoadLayerResponse* response) {
  absl::Status loaded = PublishLayer(request, response);
  RefreshLayerMetrics();  // also after a failure, which may have freed device memory
  return loaded;
}

absl::Status AttentionServiceImpl::DoUnloadLayer(const std::string& name) {
  absl::Status removed = registry_.Remove(name);
  RefreshLayerMetrics();
  return removed;
}

absl::Status AttentionServiceImpl::PublishLayer(const v1::LoadLayerRequest& request,
                                                v1::LoadLayerResponse* response) {
  RETURN_IF_ERROR(CheckKnownFields(request));
  RETURN_IF_ERROR(ValidateLayerName(request.name(), "name"));
  ASSIGN_OR_RETURN(const BatchLimitOverrides batching,
                   ConvertBatchingPolicy(request.batching(), "batching"));
  absl::StatusOr<std::shared_ptr<const core::Backend>> backend =
      request.device().empty() ? default_backend_ : devices_.Get(request.device());
  if (!backend.ok()) {
    return absl::Status(backend.status().code(),
                        absl::StrCat("device: ", backend.status().message()));
  }
  const std::string device = (*backend)->name();
  ASSIGN_OR_RETURN(
      std::shared_ptr<const core::MhaLayer> layer,
      BuildLayer(
          request.spec(), "spec", *std::move(backend), registry_.repository(), [&](int64_t bytes) {
            auto check = [&] {
              return registry_.CheckBudget(
                  request.name(), LayerRegistry::EstimatedHostBytes(bytes, device), bytes, device);
            };
            absl::Status budget = check();
            // Cached inline layers give way to a loaded one.
            if (!budget.ok() && inline_cache_.Clear() > 0) budget = check();
            return budget;
          }));
  ASSIGN_OR_RETURN(std::shared_ptr<const LayerSnapshot> snapshot,
                   registry_.Publish(request.name(), std::move(layer), request.persist(), batching,
                                     request.device()));
  DescribeLayer(*snapshot, batcher_.server_limits(), response->mutable_layer());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnloadLayer(grpc::CallbackServerContext* context,
                                                            const v1::UnloadLayerRequest* request,
                                                            v1::UnloadLayerResponse* /*response*/) {
  const UnaryCall call = StartCall(context, "UnloadLayer");
  absl::Status status = CheckAdmin(*context, "UnloadLayer");
  if (status.ok()) status = CheckKnownFields(*request);
  if (status.ok()) status = DoUnloadLayer(request->name());
  call.Answer(status);
  return call.reactor();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListLayers(grpc::CallbackServerContext* context,
                                                           const v1::ListLayersRequest* request,
                                                           v1::ListLayersResponse* response) {
  const UnaryCall call = StartCall(context, "ListLayers");
  const absl::Status status = CheckKnownFields(*request);
  if (status.ok()) {
    for (const auto& snapshot : registry_.List()) {
      DescribeLayer(*snapshot, batcher_.server_limits(), response->add_layers());
    }
  }
  call.Answer(status);
  return call.reactor();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetLayer(grpc::CallbackServerContext* context,
                                                         const v1::GetLayerRequest* request,
                                                         v1::GetLayerResponse* response) {
  const UnaryCall call = StartCall(context, "GetLayer");
  const absl::Status known = CheckKnownFields(*request);
  auto snapshot = known.ok() ? registry_.Get(request->name())
                             : absl::StatusOr<std::shared_ptr<const LayerSnapshot>>(known);
  if (snapshot.ok()) {
    DescribeLayer(**snapshot, batcher_.server_limits(), response->mutable_layer());
  }
  call.Answer(snapshot.status());
  return call.reactor();
}

}  // namespace attention::server
