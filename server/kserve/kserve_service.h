// inference.GRPCInferenceService (the Open Inference Protocol, KServe v2, with Triton's
// repository and statistics extensions) on the native service's port. Every call goes
// through the native service: ModelInfer through SubmitMultiHeadAttention (one validation,
// batcher and error mapping; see server/kserve/kserve_convert.h for the mapping), repository loads
// and unloads through the same admin check and loader pool as LoadLayer and UnloadLayer.
#ifndef ATTENTION_SERVER_KSERVE_KSERVE_SERVICE_H_
#define ATTENTION_SERVER_KSERVE_KSERVE_SERVICE_H_

#include <atomic>

#include "absl/functional/function_ref.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/kserve/shared_memory.h"
#include "server/native/attention_service.h"

namespace attention::server {

class InferenceServiceImpl final : public inference::GRPCInferenceService::CallbackService {
 public:
  // `ready` is what ServerReady answers: false while starting and draining.
  // `system_shared_memory` says whether callers may register system shared memory regions,
  // `cuda_shared_memory` opens the GPU buffers of CUDA shared memory regions (null: off),
  // and one call reads at most `max_call_bytes` from regions.
  InferenceServiceImpl(AttentionServiceImpl& native, LayerRegistry& registry, Metrics& metrics,
                       LoaderPool& loader, const std::atomic<bool>& ready,
                       bool system_shared_memory, kserve::DeviceMemoryOpener cuda_shared_memory,
                       uint64_t max_call_bytes)
      : native_(native),
        registry_(registry),
        metrics_(metrics),
        loader_(loader),
        ready_(ready),
        shared_memory_(system_shared_memory, max_call_bytes, std::move(cuda_shared_memory)) {}

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const inference::ModelInferRequest* request,
                                       inference::ModelInferResponse* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const inference::RepositoryIndexRequest* request,
                                            inference::RepositoryIndexResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelLoad(
      grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
      inference::RepositoryModelLoadResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(
      grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
      inference::RepositoryModelUnloadResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryStatusRequest* request,
      inference::SystemSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryRegisterRequest* request,
      inference::SystemSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryUnregisterRequest* request,
      inference::SystemSharedMemoryUnregisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(
      grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest* request,
      inference::CudaSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryRegisterRequest* request,
      inference::CudaSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryUnregisterRequest* request,
      inference::CudaSharedMemoryUnregisterResponse* response) override;

 private:
  // A call that answers INVALID_ARGUMENT for fields this server does not know, else the
  // status of `body` (which fills the response).
  grpc::ServerUnaryReactor* CheckedCall(grpc::CallbackServerContext* context,
                                        absl::string_view method,
                                        const google::protobuf::Message& request,
                                        absl::FunctionRef<absl::Status()> body);

  // The loaded layer `name` at `version` (empty: any); NOT_FOUND naming `field` (the
  // request's field that holds the name) otherwise.
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> FindModel(absl::string_view field,
                                                                 const std::string& name,
                                                                 const std::string& version) const;

  AttentionServiceImpl& native_;
  LayerRegistry& registry_;
  Metrics& metrics_;
  LoaderPool& loader_;
  const std::atomic<bool>& ready_;
  kserve::SharedMemory shared_memory_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_KSERVE_KSERVE_SERVICE_H_
