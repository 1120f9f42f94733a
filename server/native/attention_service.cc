#include "server/native/attention_service.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/input_shapes.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"
#include "server/models/layer_builder.h"
#include "server/validation/input_decoding.h"
#include "server/validation/wire_convert.h"

namespace attention::server {
namespace {

// The converted options, with an additive mask refused when it holds NaN or +inf (and the
// budget asks for checking; -inf masks).
absl::StatusOr<core::AttentionOptions> ConvertCheckedOptions(const v1::AttentionOptions& options,
                                                             const core::AttentionDims& dims,
                                                             const RequestBudget& budget) {
  ASSIGN_OR_RETURN(core::AttentionOptions converted, ConvertOptions(options, dims));
  if (budget.reject_non_finite && !converted.attn_mask_bias.empty()) {
    RETURN_IF_ERROR(CheckFinite(converted.attn_mask_bias, converted.attn_mask_dims,
                                "options.attn_mask", /*allow_negative_infinity=*/true));
  }
  return converted;
}

// The answer's tensors in float_data (float_data_output).
template <typename Response>
void UseFloatData(Response* response) {
  RawToFloatData(response->mutable_output());
  if (response->has_attention_weights()) RawToFloatData(response->mutable_attention_weights());
}

// Writes attention weights in the layout the request asked for; without them the field
// stays absent (HasField false), as the proto promises.
template <typename Response>
void EncodeWeights(const core::AttentionResult& result, const core::AttentionDims& dims,
                   core::NeedWeights need, core::DType dtype, Response* response) {
  if (need == core::NeedWeights::kNone) return;
  const std::vector<int64_t> shape =
      need == core::NeedWeights::kAveraged
          ? std::vector<int64_t>{dims.batch, dims.q_len, dims.kv_len}
          : std::vector<int64_t>{dims.batch, dims.num_heads, dims.q_len, dims.kv_len};
  EncodeTensor(result.weights, shape, dtype, response->mutable_attention_weights());
}

// The fields every queued task sets alike: its size, its bytes (its buffers and answer, and
// the request message held until the call ends), priority and deadline.
template <typename Request>
absl::Status SetQueueFields(const Request& request, int64_t tokens, const RequestCost& cost,
                            absl::Time deadline, std::function<bool()> is_cancelled,
                            WorkItem* item) {
  item->tokens = tokens;
  item->bytes = CheckedSum({cost.memory_bytes, static_cast<int64_t>(request.ByteSizeLong())});
  item->priority = request.options().priority();
  ASSIGN_OR_RETURN(item->deadline, QueueDeadline(request.options(), deadline, absl::Now()));
  item->is_cancelled = std::move(is_cancelled);
  return absl::OkStatus();
}

}  // namespace

absl::Time Deadline(const grpc::CallbackServerContext* context) {
  return absl::FromChrono(context->deadline());
}

UnaryCall AttentionServiceImpl::StartCall(grpc::CallbackServerContext* context,
                                          absl::string_view method) {
  return UnaryCall(context, CallRecord(metrics_, log_, method));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::MultiHeadAttention(
    grpc::CallbackServerContext* context, const v1::MultiHeadAttentionRequest* request,
    v1::MultiHeadAttentionResponse* response) {
  const UnaryCall call = StartCall(context, "MultiHeadAttention");
  auto answer = [call, request](const absl::Status& status) {
    call.Answer(status, request->request_id());
  };
  SubmitWithInlineLayer(
      *request, call.deadline(), call.cancelled(),
      [this, call, response, answer](const v1::MultiHeadAttentionRequest& request,
                                     std::shared_ptr<const LayerSnapshot> inline_layer) {
        return CatchExceptions("MultiHeadAttention", [&] {
          return SubmitMultiHeadAttention(request, call.deadline(), call.cancelled(), response,
                                          answer,
                                          /*borrow_inputs=*/true,  // gRPC holds the request
                                          std::move(inline_layer));
        });
      },
      answer, /*copy_to_build=*/false);
  return call.reactor();
}

void AttentionServiceImpl::SubmitWithInlineLayer(
    const v1::MultiHeadAttentionRequest& request, absl::Time deadline,
    std::function<bool()> is_cancelled, const SubmitWithLayer& submit,
    const std::function<void(const absl::Status&)>& refused, bool copy_to_build) {
  if (!request.has_inline_layer()) {
    const absl::Status submitted = submit(request, nullptr);
    if (!submitted.ok()) refused(submitted);
    return;
  }
  absl::StatusOr<InlineLayerLookup> lookup = LookUpInlineLayer(request);
  if (!lookup.ok()) {
    refused(lookup.status());
    return;
  }
  if (lookup->cached != nullptr) {  // a cached layer needs no build
    const absl::Status submitted = submit(request, std::move(lookup->cached));
    if (!submitted.ok()) refused(submitted);
    return;
  }
  // An inline layer is built on the loader pool, never on a gRPC thread.
  std::shared_ptr<const v1::MultiHeadAttentionRequest> held;
  if (copy_to_build) {
    held = std::make_shared<v1::MultiHeadAttentionRequest>(request);
  } else {
    held = std::shared_ptr<const v1::MultiHeadAttentionRequest>(
        std::shared_ptr<void>(), &request);  // not owned: the caller keeps it alive
  }
  LoaderJob job = CallJob(*held, deadline, &held->options(), std::move(is_cancelled));
  job.work = [this, held, submit, key = std::move(lookup->key)] {
    ASSIGN_OR_RETURN(std::shared_ptr<const LayerSnapshot> layer,
                     BuildInlineLayer(held->inline_layer(), key));
    return submit(*held, std::move(layer));
  };
  // OK: the request was queued, and its batch worker answers it.
  job.done = [refused](const absl::Status& status) {
    if (!status.ok()) refused(status);
  };
  const absl::Status submitted = loader_.Submit(std::move(job));
  if (!submitted.ok()) refused(submitted);
}

absl::Status AttentionServiceImpl::CheckMultiHeadAttentionRequest(
    const v1::MultiHeadAttentionRequest& request) const {
  RETURN_IF_ERROR(CheckKnownFields(request));
  RETURN_IF_ERROR(CheckRequestId(request.request_id()));
  if (!request.layer().empty() && request.has_inline_layer()) {
    return Invalid("layer = ", Quoted(request.layer()), " and inline_layer are both set; give one");
  }
  if (request.has_inline_layer() && !access_.allow_inline_layers) {
    return absl::PermissionDeniedError(
        "inline_layer is disabled on this server (--allow_inline_layers=false): name a "
        "loaded layer (see ListLayers)");
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionServiceImpl::InlineLayerLookup> AttentionServiceImpl::LookUpInlineLayer(
    const v1::MultiHeadAttentionRequest& request) {
  RETURN_IF_ERROR(CheckMultiHeadAttentionRequest(request));
  InlineLayerLookup lookup;
  lookup.key = InlineLayerCache::KeyOf(request.inline_layer());
  if (lookup.key.has_value()) lookup.cached = inline_cache_.Find(*lookup.key);
  return lookup;
}

absl::StatusOr<std::shared_ptr<const LayerSnapshot>> AttentionServiceImpl::BuildInlineLayer(
    const v1::LayerSpec& spec, const std::optional<std::string>& key) {
  auto build = [this, &spec]() -> absl::StatusOr<std::shared_ptr<const LayerSnapshot>> {
    auto inline_snapshot = std::make_shared<LayerSnapshot>();
    inline_snapshot->name = "(inline)";
    // An inline layer's weights are this request's memory.
    auto admit = [this](int64_t bytes) { return CheckInlineLayerBytes(bytes, budget_); };
    auto built = BuildLayer(spec, "inline_layer", default_backend_, registry_.repository(), admit);
    // A shape the default device cannot compute falls back to the CPU.
    if (built.status().code() == absl::StatusCode::kUnimplemented &&
        default_backend_ != devices_.cpu()) {
      built = BuildLayer(spec, "inline_layer", devices_.cpu(), registry_.repository(), admit);
    }
    ASSIGN_OR_RETURN(inline_snapshot->layer, std::move(built));
    return inline_snapshot;
  };
  if (!key.has_value()) return build();
  return inline_cache_.GetOrBuild(*key, build);
}

namespace {

// INTERNAL unless tensors in GPU memory are in the memory of the GPU `layer` runs on (the
// front-end that found them asked the same layer).
absl::Status CheckGpuTensors(const GpuTensors& on_gpu, const core::MhaLayer& layer) {
  if (!on_gpu.inputs() && !on_gpu.pinned_inputs() && !on_gpu.output.has_value()) {
    return absl::OkStatus();
  }
  if (layer.backend().InPlaceGpu() == on_gpu.gpu) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("tensors in the memory of cuda:", on_gpu.gpu,
                                          " were sent to a layer on ", layer.device()));
}

// One of query, key and value: from `request`, or its bytes on the GPU or in page-locked
// host memory when GpuTensors has them.
absl::StatusOr<DecodedTensor> DecodeInput(const v1::Tensor& tensor, absl::string_view field,
                                          const std::optional<GpuBytes>& on_gpu,
                                          const std::optional<PinnedBytes>& pinned,
                                          const TensorDecoding& how) {
  if (on_gpu.has_value()) return DecodeGpuTensor(tensor, field, *on_gpu, how);
  if (pinned.has_value()) return DecodePinnedTensor(tensor, field, *pinned, how);
  return DecodeTensor(tensor, field, how);
}

// Whether `decoded` is read in place (from its buffer), not copied.
bool Borrowed(const DecodedTensor& decoded) {
  return decoded.borrowed.data() != nullptr || decoded.borrowed_half.data() != nullptr;
}

// Decodes a MultiHeadAttention request's inputs into `item`'s input for `layer`: query, key
// and value under the shape rules of core/input_shapes.h, then the options' masks. 16-bit
// inputs stay as sent when the layer takes them so (MhaLayer::TakesHalfInputs) and all three
// share one 16-bit dtype; with `borrow`, FLOAT32 and 16-bit raw_data are read in place, and
// inputs in `on_gpu` always are (on the GPU).
absl::Status DecodeMhaInputs(const v1::MultiHeadAttentionRequest& request,
                             const core::MhaLayer& layer, const RequestBudget& budget, bool borrow,
                             const GpuTensors& on_gpu, LayerWorkItem* item) {
  const core::MhaConfig& config = layer.config();
  const bool has_key = request.has_key(), has_value = request.has_value();
  const core::DType half_dtype = HalfDType(request.query());
  TensorDecoding how;
  how.keep_half = layer.TakesHalfInputs() && half_dtype != core::DType::kFloat32 &&
                  (!has_key || (HalfDType(request.key()) == half_dtype &&
                                HalfDType(request.value()) == half_dtype));
  how.borrow = borrow;
  how.reject_non_finite = budget.reject_non_finite;
  ASSIGN_OR_RETURN(DecodedTensor query,
                   DecodeInput(request.query(), "query", on_gpu.query, on_gpu.pinned_query, how));
  // Inputs read in place from page-locked memory are one DMA each; one widened on the host,
  // or read elsewhere, is not.
  bool all_pinned = on_gpu.pinned_query.has_value() && Borrowed(query);
  RETURN_IF_ERROR(core::CheckMhaQueryShape(config, query.shape));
  core::MhaInput& input = item->input;
  input.batch = query.shape[0];
  input.q_len = input.kv_len = query.shape[1];
  RETURN_IF_ERROR(core::CheckMhaKeyValuePresence(config, has_key, has_value));
  // Spans of the key and value values; they survive item->storage growing, as a moved
  // vector keeps its buffer.
  absl::Span<const float> key_values, value_values;
  absl::Span<const uint16_t> key_half, value_half;
  if (has_key) {
    ASSIGN_OR_RETURN(DecodedTensor key,
                     DecodeInput(request.key(), "key", on_gpu.key, on_gpu.pinned_key, how));
    ASSIGN_OR_RETURN(DecodedTensor value,
                     DecodeInput(request.value(), "value", on_gpu.value, on_gpu.pinned_value, how));
    all_pinned = all_pinned && on_gpu.pinned_key.has_value() && on_gpu.pinned_value.has_value() &&
                 Borrowed(key) && Borrowed(value);
    RETURN_IF_ERROR(core::CheckMhaKeyValueShapes(config, input.batch, key.shape, value.shape));
    input.kv_len = key.shape[1];
    item->storage.push_back(std::move(key.values));
    item->storage.push_back(std::move(value.values));
    key_values = key.Floats(item->storage[0]);
    value_values = value.Floats(item->storage[1]);
    item->half_storage.push_back(std::move(key.half));
    item->half_storage.push_back(std::move(value.half));
    key_half = key.HalfBits(item->half_storage[0]);
    value_half = value.HalfBits(item->half_storage[1]);
  }
  item->storage.push_back(std::move(query.values));
  item->half_storage.push_back(std::move(query.half));
  if (how.keep_half) {
    input.half_dtype = half_dtype;
    input.query_half = query.HalfBits(item->half_storage.back());
    input.key_half = key_half;
    input.value_half = value_half;
  } else {
    input.query = query.Floats(item->storage.back());
    input.key = key_values;
    input.value = value_values;
  }
  if (on_gpu.inputs()) {
    input.inputs_memory = core::InputMemory::kGpu;
  } else if (all_pinned) {
    input.inputs_memory = core::InputMemory::kPinnedHost;
  }
  ASSIGN_OR_RETURN(input.options,
                   ConvertCheckedOptions(request.options(), layer.Dims(input), budget));
  return absl::OkStatus();
}

// A ScaledDotProductAttention request's inputs: query, key and value copied (the task may
// outlive the request's bytes; the input's spans are set once they can no longer move),
// the attention's dims from their shapes, and the options' masks.
struct SdpaInputs {
  core::SdpaInput input;
  std::vector<float> query, key, value;
};

absl::StatusOr<SdpaInputs> DecodeSdpaInputs(const v1::ScaledDotProductAttentionRequest& request,
                                            const RequestBudget& budget) {
  TensorDecoding how;
  how.reject_non_finite = budget.reject_non_finite;
  ASSIGN_OR_RETURN(DecodedTensor query, DecodeTensor(request.query(), "query", how));
  ASSIGN_OR_RETURN(DecodedTensor key, DecodeTensor(request.key(), "key", how));
  ASSIGN_OR_RETURN(DecodedTensor value, DecodeTensor(request.value(), "value", how));
  SdpaInputs decoded;
  ASSIGN_OR_RETURN(decoded.input.dims, core::SdpaDimsOf(query.shape, key.shape, value.shape));
  ASSIGN_OR_RETURN(decoded.input.options,
                   ConvertCheckedOptions(request.options(), decoded.input.dims, budget));
  decoded.query = std::move(query.values);
  decoded.key = std::move(key.values);
  decoded.value = std::move(value.values);
  return decoded;
}

// Points `input`'s output at `destination` in GPU memory, and gives `response`'s output
// the answer's shape and dtype: FLOAT32 or BFLOAT16, which the layer writes there.
absl::Status PlaceOutputOnGpu(const GpuBytes& destination, absl::Span<const int64_t> shape,
                              core::DType dtype, v1::MultiHeadAttentionResponse* response,
                              core::MhaInput* input) {
  if (dtype != core::DType::kFloat32 && dtype != core::DType::kBFloat16) {
    return absl::InternalError(
        absl::StrCat(destination.field, " is ", core::DTypeName(dtype),
                     "; only FLOAT32 and BFLOAT16 answers go to GPU memory"));
  }
  const int64_t elements = shape[0] * shape[1] * shape[2];
  const uint64_t bytes = static_cast<uint64_t>(elements * core::ElementSize(dtype));
  if (bytes > destination.size) {
    return Invalid(destination.field,
                   ".parameters[\"shared_memory_byte_size\"] = ", destination.size,
                   " cannot hold the answer's ", bytes, " bytes");
  }
  v1::Tensor* output = response->mutable_output();
  output->set_dtype(wire::WireDType(dtype));
  for (int64_t dim : shape) output->add_shape(dim);
  if (dtype == core::DType::kFloat32) {
    input->output_destination =
        absl::MakeSpan(reinterpret_cast<float*>(destination.data()), elements);
  } else {
    input->output_destination_bf16 =
        absl::MakeSpan(reinterpret_cast<uint16_t*>(destination.data()), elements);
  }
  input->output_on_gpu = true;
  return absl::OkStatus();
}

// What a MultiHeadAttention answer holds, fixed when its task is built.
struct MhaAnswerShape {
  core::AttentionDims dims;
  int64_t output_dim = 0;
  core::NeedWeights need = core::NeedWeights::kNone;
  core::DType output_dtype = core::DType::kFloat32;
  // The output was computed into the response (a FLOAT32 or BFLOAT16 raw_data answer), or
  // into GPU memory (the response then holds its shape and dtype only).
  bool output_in_response = false;
  bool output_on_gpu = false;
  uint64_t layer_version = 0;
};

// Makes `item` a task of `snapshot`'s layer over its decoded input: the answer's dtype, the
// request's cost against `budget`, the layer's own checks, queue fields, and the output
// computed straight into `response` where its dtype allows, or into `output_on_gpu`.
absl::StatusOr<MhaAnswerShape> BuildMhaTask(const v1::MultiHeadAttentionRequest& request,
                                            const LayerSnapshot& snapshot,
                                            const RequestBudget& budget, absl::Time deadline,
                                            std::function<bool()> is_cancelled,
                                            const std::optional<GpuBytes>& output_on_gpu,
                                            v1::MultiHeadAttentionResponse* response,
                                            LayerWorkItem* item) {
  const core::MhaLayer& layer = *snapshot.layer;
  core::MhaInput& input = item->input;
  MhaAnswerShape answer;
  answer.dims = layer.Dims(input);
  answer.output_dim = layer.config().output_dim;
  answer.need = input.options.need_weights;
  answer.layer_version = snapshot.version;
  ASSIGN_OR_RETURN(answer.output_dtype, OutputDType(request.output_dtype(), request.query().dtype(),
                                                    request.float_data_output()));
  const RequestCost cost =
      MultiHeadAttentionCost(layer.config(), answer.dims, answer.need, answer.output_dtype);
  RETURN_IF_ERROR(CheckRequestBudget(cost, budget));
  RETURN_IF_ERROR(layer.ValidateInput(input));
  RETURN_IF_ERROR(SetQueueFields(request, input.batch * input.q_len, cost, deadline,
                                 std::move(is_cancelled), item));
  const int64_t shape[] = {answer.dims.batch, answer.dims.q_len, answer.output_dim};
  if (output_on_gpu.has_value()) {
    RETURN_IF_ERROR(PlaceOutputOnGpu(*output_on_gpu, shape, answer.output_dtype, response, &input));
    answer.output_on_gpu = true;
    return answer;
  }
  answer.output_in_response = (answer.output_dtype == core::DType::kFloat32 ||
                               answer.output_dtype == core::DType::kBFloat16) &&
                              !request.float_data_output();
  if (answer.output_in_response) {
    if (answer.output_dtype == core::DType::kFloat32) {
      input.output_destination = wire::ResizeFloat32Tensor(shape, response->mutable_output());
    } else {
      input.output_destination_bf16 = wire::ResizeBFloat16Tensor(shape, response->mutable_output());
    }
  }
  return answer;
}

// What a batch worker does with a MultiHeadAttention result: encodes it into `response`
// (unless the output was computed into it already), then calls `finish`.
std::function<void(absl::StatusOr<core::AttentionResult>)> MhaAnswer(
    const v1::MultiHeadAttentionRequest& request, v1::MultiHeadAttentionResponse* response,
    std::function<void(const absl::Status&)> finish, const MhaAnswerShape& shape) {
  return [finish = std::move(finish), response, shape, float_data = request.float_data_output(),
          request_id = request.request_id()](absl::StatusOr<core::AttentionResult> result) {
    if (!result.ok()) {
      response->clear_output();
      finish(result.status());
      return;
    }
    if (!shape.output_in_response && !shape.output_on_gpu) {
      EncodeTensor(result->output, {shape.dims.batch, shape.dims.q_len, shape.output_dim},
                   shape.output_dtype, response->mutable_output());
    }
    EncodeWeights(*result, shape.dims, shape.need, shape.output_dtype, response);
    if (float_data) UseFloatData(response);
    response->set_request_id(request_id);
    response->set_layer_version(shape.layer_version);
    finish(absl::OkStatus());
  };
}

}  // namespace

absl::StatusOr<std::shared_ptr<const LayerSnapshot>> AttentionServiceImpl::ResolveLayer(
    const v1::MultiHeadAttentionRequest& request, std::shared_ptr<const LayerSnapshot> resolved) {
  if (resolved != nullptr) return resolved;
  if (request.has_inline_layer()) {
    ASSIGN_OR_RETURN(InlineLayerLookup lookup, LookUpInlineLayer(request));
    if (lookup.cached != nullptr) return lookup.cached;
    return BuildInlineLayer(request.inline_layer(), lookup.key);
  }
  if (request.layer().empty()) {
    return Invalid("layer is empty: name a loaded layer (see ListLayers) or give inline_layer");
  }
  return registry_.Get(request.layer());
}

absl::Status AttentionServiceImpl::SubmitMultiHeadAttention(
    const v1::MultiHeadAttentionRequest& request, absl::Time deadline,
    std::function<bool()> is_cancelled, v1::MultiHeadAttentionResponse* response,
    std::function<void(const absl::Status&)> finish, bool borrow_inputs,
    std::shared_ptr<const LayerSnapshot> resolved, const GpuTensors* on_gpu) {
  RETURN_IF_ERROR(CheckMultiHeadAttentionRequest(request));
  ASSIGN_OR_RETURN(std::shared_ptr<const LayerSnapshot> snapshot,
                   ResolveLayer(request, std::move(resolved)));
  static const GpuTensors kNone;
  const GpuTensors& gpu_tensors = on_gpu != nullptr ? *on_gpu : kNone;
  RETURN_IF_ERROR(CheckGpuTensors(gpu_tensors, *snapshot->layer));
  auto item = std::make_unique<LayerWorkItem>();
  RETURN_IF_ERROR(
      DecodeMhaInputs(request, *snapshot->layer, budget_, borrow_inputs, gpu_tensors, item.get()));
  ASSIGN_OR_RETURN(const MhaAnswerShape answer,
                   BuildMhaTask(request, *snapshot, budget_, deadline, std::move(is_cancelled),
                                gpu_tensors.output, response, item.get()));
  item->done = MhaAnswer(request, response, std::move(finish), answer);
  item->snapshot = std::move(snapshot);
  absl::Status submitted = batcher_.Submit(std::move(item));
  if (!submitted.ok()) response->clear_output();
  return submitted;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ScaledDotProductAttention(
    grpc::CallbackServerContext* context, const v1::ScaledDotProductAttentionRequest* request,
    v1::ScaledDotProductAttentionResponse* response) {
  const UnaryCall call = StartCall(context, "ScaledDotProductAttention");
  auto answer = [call, request](const absl::Status& status) {
    call.Answer(status, request->request_id());
  };
  const absl::Status status = CatchExceptions("ScaledDotProductAttention", [&] {
    return SubmitScaledDotProductAttention(*request, call.deadline(), call.cancelled(), response,
                                           answer);
  });
  if (!status.ok()) answer(status);
  return call.reactor();
}

absl::Status AttentionServiceImpl::SubmitScaledDotProductAttention(
    const v1::ScaledDotProductAttentionRequest& request, absl::Time deadline,
    std::function<bool()> is_cancelled, v1::ScaledDotProductAttentionResponse* response,
    std::function<void(const absl::Status&)> finish) {
  RETURN_IF_ERROR(CheckKnownFields(request));
  RETURN_IF_ERROR(CheckRequestId(request.request_id()));
  ASSIGN_OR_RETURN(SdpaInputs decoded, DecodeSdpaInputs(request, budget_));
  auto item = std::make_unique<SoloWorkItem>();
  core::SdpaInput& input = decoded.input;
  ASSIGN_OR_RETURN(
      const core::DType output_dtype,
      OutputDType(request.output_dtype(), request.query().dtype(), request.float_data_output()));
  if (request.compute_dtype() != v1::DATA_TYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(input.compute_dtype,
                     wire::ConvertDType(request.compute_dtype(), "compute_dtype"));
  }
  RETURN_IF_ERROR(core::ValidateSdpaInput(input));
  const core::AttentionDims& d = input.dims;
  const RequestCost cost =
      ScaledDotProductAttentionCost(d, input.options.need_weights, output_dtype);
  RETURN_IF_ERROR(CheckRequestBudget(cost, budget_));
  RETURN_IF_ERROR(SetQueueFields(request, d.batch * d.q_len, cost, deadline,
                                 std::move(is_cancelled), item.get()));
  const core::AttentionDims dims = input.dims;
  const core::NeedWeights need = input.options.need_weights;
  // On the default device, or the CPU when that device cannot compute this shape.
  std::shared_ptr<const core::Backend> backend = default_backend_;
  if (!backend->Supports(core::SdpaConfig(input.dims), input.options).ok()) {
    backend = devices_.cpu();
  }
  item->device_name = backend->name();
  // The closure owns the decoded tensors; spans are set where they can no longer move.
  item->run = [backend = std::move(backend), decoded = std::move(decoded)]() mutable {
    decoded.input.query = decoded.query;
    decoded.input.key = decoded.key;
    decoded.input.value = decoded.value;
    return backend->ScaledDotProductAttention(decoded.input);
  };
  item->done = [finish = std::move(finish), response, dims, need, output_dtype,
                float_data = request.float_data_output(),
                request_id = request.request_id()](absl::StatusOr<core::AttentionResult> result) {
    if (!result.ok()) {
      finish(result.status());
      return;
    }
    EncodeTensor(result->output, {dims.batch, dims.num_heads, dims.q_len, dims.v_head_dim},
                 output_dtype, response->mutable_output());
    EncodeWeights(*result, dims, need, output_dtype, response);
    if (float_data) UseFloatData(response);
    response->set_request_id(request_id);
    finish(absl::OkStatus());
  };
  return batcher_.Submit(std::move(item));
}

}  // namespace attention::server
