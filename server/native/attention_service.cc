#include "server/native/attention_service.h"

#include <deque>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "core/half_bits.h"
#include "core/status_macros.h"
#include "server/models/hf_checkpoint.h"
#include "server/models/layer_builder.h"
#include "server/common/status_util.h"
#include "server/models/layer_config.h"
#include "server/validation/wire_convert.h"

namespace attention::server {
namespace {

constexpr size_t kMaxRequestIdBytes = 256;

using wire::ShapeString;

// A query, key or value: float32 values, or, for a layer whose backend converts 16-bit
// inputs on its device, the FLOAT16 / BFLOAT16 bits as sent (half the bytes to copy), or
// FLOAT32 raw_data read in place (`borrowed`, no copy).
struct InputTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
  std::vector<uint16_t> half;
  absl::Span<const float> borrowed;

  // The float32 values, wherever they are; `values` once moved to `stored`.
  absl::Span<const float> Floats(const std::vector<float>& stored) const {
    return borrowed.data() != nullptr ? borrowed : absl::Span<const float>(stored);
  }
};

// FLOAT32 raw_data that can be read in place: 4-byte aligned, and nothing else to decode.
bool CanBorrow(const v1::Tensor& tensor) {
  const std::string& raw = tensor.raw_data();
  return tensor.dtype() == v1::FLOAT32 && tensor.float_data_size() == 0 && !raw.empty() &&
         reinterpret_cast<uintptr_t>(raw.data()) % alignof(float) == 0;
}

template <typename Tensor>
absl::Status CheckRank(const Tensor& tensor, size_t rank, absl::string_view field,
                       absl::string_view layout) {
  if (tensor.shape.size() != rank) {
    return Invalid(field, ".shape ", ShapeString(tensor.shape), " has rank ", tensor.shape.size(),
                   "; expected ", layout);
  }
  return absl::OkStatus();
}

template <typename Tensor>
absl::Status CheckDim(const Tensor& tensor, size_t dim, int64_t expected,
                      absl::string_view field, absl::string_view meaning) {
  if (tensor.shape[dim] != expected) {
    return Invalid(field, ".shape[", dim, "] = ", tensor.shape[dim], " must equal ", meaning,
                   " = ", expected);
  }
  return absl::OkStatus();
}

absl::Status CheckRequestId(const std::string& request_id) {
  if (request_id.size() > kMaxRequestIdBytes) {
    return Invalid("request_id has ", request_id.size(), " bytes; at most ", kMaxRequestIdBytes);
  }
  return absl::OkStatus();
}

// A float tensor of the request, refused when it holds NaN or infinities and the budget
// asks for checking.
absl::StatusOr<FloatTensor> DecodeInput(const v1::Tensor& tensor, absl::string_view field,
                                        const RequestBudget& budget) {
  ASSIGN_OR_RETURN(FloatTensor decoded, DecodeFloatTensor(tensor, field));
  if (budget.reject_non_finite) RETURN_IF_ERROR(CheckFinite(decoded.values, decoded.shape, field));
  return decoded;
}

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

// The 16-bit dtype `tensor` is sent in, or kFloat32 when it is not sent as 16-bit raw data.
core::DType HalfDType(const v1::Tensor& tensor) {
  if (tensor.float_data_size() > 0) return core::DType::kFloat32;
  if (tensor.dtype() == v1::FLOAT16) return core::DType::kFloat16;
  if (tensor.dtype() == v1::BFLOAT16) return core::DType::kBFloat16;
  return core::DType::kFloat32;
}

// `tensor` kept as its 16-bit bits when `keep_half` (it is then FLOAT16 or BFLOAT16 raw
// data), else decoded to float32; refused when non-finite and the budget asks for checking.
absl::StatusOr<InputTensor> DecodeMhaInput(const v1::Tensor& tensor, absl::string_view field,
                                           const RequestBudget& budget, bool keep_half,
                                           bool borrow) {
  InputTensor input;
  if (!keep_half && borrow && CanBorrow(tensor)) {
    // The checks DecodeFloatTensor makes, without its copy.
    ASSIGN_OR_RETURN(const int64_t count, wire::CheckFloatTensor(tensor, field));
    input.shape.assign(tensor.shape().begin(), tensor.shape().end());
    input.borrowed = absl::MakeConstSpan(
        reinterpret_cast<const float*>(tensor.raw_data().data()), static_cast<size_t>(count));
    if (budget.reject_non_finite) RETURN_IF_ERROR(CheckFinite(input.borrowed, input.shape, field));
    return input;
  }
  if (!keep_half) {
    ASSIGN_OR_RETURN(FloatTensor decoded, DecodeInput(tensor, field, budget));
    input.shape = std::move(decoded.shape);
    input.values = std::move(decoded.values);
    return input;
  }
  const core::DType dtype = HalfDType(tensor);
  ASSIGN_OR_RETURN(const int64_t count, wire::CheckFloatTensor(tensor, field));
  input.shape.assign(tensor.shape().begin(), tensor.shape().end());
  input.half.resize(count);
  std::memcpy(input.half.data(), tensor.raw_data().data(), count * sizeof(uint16_t));
  if (budget.reject_non_finite) {
    const bool bfloat16 = dtype == core::DType::kBFloat16;
    for (int64_t e = 0; e < count; ++e) {
      if (core::HalfBitsNonFinite(input.half[e], bfloat16)) {
        // Decoded, the same check names the index and the value.
        return DecodeInput(tensor, field, budget).status();
      }
    }
  }
  return input;
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

}  // namespace

absl::Time Deadline(const grpc::CallbackServerContext* context) {
  return absl::FromChrono(context->deadline());
}

void DescribeLayer(const LayerSnapshot& snapshot, const BatchLimits& server_limits,
                   v1::LayerInfo* info) {
  const core::MhaLayer& layer = *snapshot.layer;
  info->set_name(snapshot.name);
  *info->mutable_config() = ConfigToProto(layer.config());
  info->set_parameter_count(layer.config().ParameterCount());
  info->set_weight_bytes(layer.WeightBytes());
  info->set_dtype(v1::FLOAT32);
  info->set_device(layer.device());
  info->set_version(snapshot.version);
  info->set_persisted(snapshot.persisted);
  *info->mutable_batching() = BatchingPolicyToProto(snapshot.batching.ApplyTo(server_limits));
}

void AttentionServiceImpl::RecordCall(absl::string_view method, absl::Time start,
                                      const absl::Status& status, absl::string_view request_id) {
  const absl::Duration elapsed = absl::Now() - start;
  metrics_.CallFinished(method, status.code(), elapsed);
  log_.Record(method, status, elapsed, request_id);
}

void AttentionServiceImpl::Finish(grpc::ServerUnaryReactor* reactor, absl::string_view method,
                                  absl::Time start, const absl::Status& status,
                                  absl::string_view request_id) {
  RecordCall(method, start, status, request_id);
  reactor->Finish(ToGrpcStatus(status));
}

void AttentionServiceImpl::RefreshLayerMetrics() {
  int64_t weight_bytes = 0;
  const auto layers = registry_.List();
  for (const auto& snapshot : layers) weight_bytes += snapshot->layer->WeightBytes();
  metrics_.SetLayers(static_cast<int64_t>(layers.size()), weight_bytes);
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
  }
}

grpc::ServerUnaryReactor* AttentionServiceImpl::MultiHeadAttention(
    grpc::CallbackServerContext* context, const v1::MultiHeadAttentionRequest* request,
    v1::MultiHeadAttentionResponse* response) {
  const absl::Time start = absl::Now();
  metrics_.CallStarted();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto submit = [this, context, request, response, reactor,
                 start](std::shared_ptr<const LayerSnapshot> inline_layer) {
    return SubmitMultiHeadAttention(
        *request, Deadline(context), [context] { return context->IsCancelled(); }, response,
        [this, reactor, start, request](const absl::Status& result) {
          Finish(reactor, "MultiHeadAttention", start, result, request->request_id());
        },
        /*borrow_inputs=*/true,  // gRPC holds the request until Finish
        std::move(inline_layer));
  };
  // A refused request is answered here; a queued one by its batch worker.
  auto answer_refusal = [this, reactor, start, request](const absl::Status& status) {
    if (!status.ok()) Finish(reactor, "MultiHeadAttention", start, status, request->request_id());
  };
  if (!request->has_inline_layer()) {
    answer_refusal(submit(nullptr));
    return reactor;
  }
  absl::StatusOr<InlineLayerLookup> lookup = LookUpInlineLayer(*request);
  if (!lookup.ok()) {
    answer_refusal(lookup.status());
  } else if (lookup->cached != nullptr) {
    answer_refusal(submit(std::move(lookup->cached)));  // a cached layer needs no build
  } else {
    // An inline layer is built on the loader pool, never on a gRPC thread.
    LoaderJob job = CallJob(*request, Deadline(context), &request->options(),
                            [context] { return context->IsCancelled(); });
    job.work = [this, request, submit, key = std::move(lookup->key)] {
      ASSIGN_OR_RETURN(std::shared_ptr<const LayerSnapshot> layer,
                       BuildInlineLayer(request->inline_layer(), key));
      return submit(std::move(layer));
    };
    job.done = answer_refusal;
    answer_refusal(loader_.Submit(std::move(job)));
  }
  return reactor;
}

LoaderJob AttentionServiceImpl::CallJob(const google::protobuf::Message& request,
                                        absl::Time deadline, const v1::AttentionOptions* options,
                                        std::function<bool()> is_cancelled) {
  LoaderJob job;
  job.bytes = static_cast<int64_t>(request.ByteSizeLong());
  job.deadline = deadline;
  if (options != nullptr) {
    // A bad queue_timeout_us is refused later, by the request's own validation.
    job.deadline = QueueDeadline(*options, deadline, absl::Now()).value_or(deadline);
  }
  job.is_cancelled = std::move(is_cancelled);
  return job;
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
    auto built =
        BuildLayer(spec, "inline_layer", default_backend_, registry_.repository(), admit);
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

absl::Status AttentionServiceImpl::SubmitMultiHeadAttention(
    const v1::MultiHeadAttentionRequest& request, absl::Time deadline,
    std::function<bool()> is_cancelled, v1::MultiHeadAttentionResponse* response,
    std::function<void(const absl::Status&)> finish, bool borrow_inputs,
    std::shared_ptr<const LayerSnapshot> inline_layer) {
  RETURN_IF_ERROR(CheckMultiHeadAttentionRequest(request));
  std::shared_ptr<const LayerSnapshot> snapshot;
  if (request.has_inline_layer()) {
    if (inline_layer == nullptr) {
      ASSIGN_OR_RETURN(InlineLayerLookup lookup, LookUpInlineLayer(request));
      inline_layer = lookup.cached;
      if (inline_layer == nullptr) {
        ASSIGN_OR_RETURN(inline_layer, BuildInlineLayer(request.inline_layer(), lookup.key));
      }
    }
    snapshot = std::move(inline_layer);
  } else if (request.layer().empty()) {
    return Invalid("layer is empty: name a loaded layer (see ListLayers) or give inline_layer");
  } else {
    ASSIGN_OR_RETURN(snapshot, registry_.Get(request.layer()));
  }
  const core::MhaConfig& config = snapshot->layer->config();

  const bool has_key = request.has_key(), has_value = request.has_value();
  // 16-bit inputs go to the device as sent when its backend converts them there and every
  // input tensor has the same 16-bit dtype; otherwise they are decoded here.
  const core::DType half_dtype = HalfDType(request.query());
  const bool keep_half = snapshot->layer->backend().ConvertsHalfInputs() &&
                         half_dtype != core::DType::kFloat32 &&
                         (!has_key || (HalfDType(request.key()) == half_dtype &&
                                       HalfDType(request.value()) == half_dtype));
  ASSIGN_OR_RETURN(InputTensor query,
                   DecodeMhaInput(request.query(), "query", budget_, keep_half, borrow_inputs));
  RETURN_IF_ERROR(CheckRank(query, 3, "query", "[B, Nq, embed_dim]"));
  RETURN_IF_ERROR(CheckDim(query, 2, config.embed_dim, "query", "the layer's embed_dim"));
  auto item = std::make_unique<WorkItem>();
  core::MhaInput& input = item->input;
  input.batch = query.shape[0];
  input.q_len = input.kv_len = query.shape[1];
  if (has_key != has_value) {
    return Invalid(has_key ? "key" : "value", " is set but ", has_key ? "value" : "key",
                   " is not; cross-attention needs both");
  }
  if (!has_key && (config.kdim != config.embed_dim || config.vdim != config.embed_dim)) {
    return Invalid("key and value are required: the layer has kdim = ", config.kdim,
                   " and vdim = ", config.vdim, ", so it cannot self-attend with embed_dim = ",
                   config.embed_dim);
  }
  // Spans of the key and value values; they survive item->storage growing, as a moved
  // vector keeps its buffer.
  absl::Span<const float> key_values, value_values;
  if (has_key) {
    ASSIGN_OR_RETURN(InputTensor key,
                     DecodeMhaInput(request.key(), "key", budget_, keep_half, borrow_inputs));
    ASSIGN_OR_RETURN(InputTensor value,
                     DecodeMhaInput(request.value(), "value", budget_, keep_half, borrow_inputs));
    RETURN_IF_ERROR(CheckRank(key, 3, "key", "[B, Nk, kdim]"));
    RETURN_IF_ERROR(CheckRank(value, 3, "value", "[B, Nk, vdim]"));
    RETURN_IF_ERROR(CheckDim(key, 0, input.batch, "key", "query batch size B"));
    RETURN_IF_ERROR(CheckDim(value, 0, input.batch, "value", "query batch size B"));
    RETURN_IF_ERROR(CheckDim(value, 1, key.shape[1], "value", "key length Nk"));
    RETURN_IF_ERROR(CheckDim(key, 2, config.kdim, "key", "the layer's kdim"));
    RETURN_IF_ERROR(CheckDim(value, 2, config.vdim, "value", "the layer's vdim"));
    input.kv_len = key.shape[1];
    item->storage.push_back(std::move(key.values));
    item->storage.push_back(std::move(value.values));
    key_values = key.Floats(item->storage[0]);
    value_values = value.Floats(item->storage[1]);
    item->half_storage.push_back(std::move(key.half));
    item->half_storage.push_back(std::move(value.half));
  }
  const core::AttentionDims dims{input.batch,  config.num_heads, config.num_kv_heads,
                                 input.q_len,  input.kv_len,     config.head_dim,
                                 config.v_head_dim};
  ASSIGN_OR_RETURN(input.options, ConvertCheckedOptions(request.options(), dims, budget_));
  ASSIGN_OR_RETURN(const core::DType output_dtype,
                   OutputDType(request.output_dtype(), request.query().dtype(),
                               request.float_data_output()));
  const RequestCost cost =
      MultiHeadAttentionCost(config, dims, input.options.need_weights, output_dtype);
  RETURN_IF_ERROR(CheckRequestBudget(cost, budget_));
  item->storage.push_back(std::move(query.values));
  item->half_storage.push_back(std::move(query.half));
  if (keep_half) {
    input.half_dtype = half_dtype;
    input.query_half = item->half_storage.back();
    if (has_key) {
      input.key_half = item->half_storage[0];
      input.value_half = item->half_storage[1];
    }
  } else {
    input.query = query.Floats(item->storage.back());
    input.key = key_values;
    input.value = value_values;
  }
  RETURN_IF_ERROR(snapshot->layer->ValidateInput(input));

  item->tokens = input.batch * input.q_len;
  // Its buffers and answer, and the request message gRPC holds until the call ends.
  item->bytes = CheckedSum({cost.memory_bytes, static_cast<int64_t>(request.ByteSizeLong())});
  item->priority = request.options().priority();
  ASSIGN_OR_RETURN(item->deadline, QueueDeadline(request.options(), deadline, absl::Now()));
  item->is_cancelled = std::move(is_cancelled);
  const core::NeedWeights need = input.options.need_weights;
  // A FLOAT32 answer in raw_data is computed straight into the response.
  const bool output_in_response =
      output_dtype == core::DType::kFloat32 && !request.float_data_output();
  item->done = [finish = std::move(finish), response, dims, need, output_dtype, snapshot,
                output_in_response, float_data = request.float_data_output(),
                output_dim = config.output_dim, request_id = request.request_id()](
                   absl::StatusOr<core::AttentionResult> result) {
    if (!result.ok()) {
      response->clear_output();
      finish(result.status());
      return;
    }
    if (!output_in_response) {
      EncodeTensor(result->output, {dims.batch, dims.q_len, output_dim}, output_dtype,
                   response->mutable_output());
    }
    EncodeWeights(*result, dims, need, output_dtype, response);
    if (float_data) UseFloatData(response);
    response->set_request_id(request_id);
    response->set_layer_version(snapshot->version);
    finish(absl::OkStatus());
  };
  if (output_in_response) {
    item->input.output_destination = wire::ResizeFloat32Tensor(
        {dims.batch, dims.q_len, config.output_dim}, response->mutable_output());
  }
  item->layer = std::move(snapshot);
  const absl::Status submitted = batcher_.Submit(std::move(item));
  if (!submitted.ok()) response->clear_output();
  return submitted;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ScaledDotProductAttention(
    grpc::CallbackServerContext* context, const v1::ScaledDotProductAttentionRequest* request,
    v1::ScaledDotProductAttentionResponse* response) {
  const absl::Time start = absl::Now();
  metrics_.CallStarted();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status status = SubmitScaledDotProductAttention(
      *request, Deadline(context), [context] { return context->IsCancelled(); }, response,
      [this, reactor, start, request](const absl::Status& result) {
        Finish(reactor, "ScaledDotProductAttention", start, result, request->request_id());
      });
  if (!status.ok()) {
    Finish(reactor, "ScaledDotProductAttention", start, status, request->request_id());
  }
  return reactor;
}

absl::Status AttentionServiceImpl::SubmitScaledDotProductAttention(
    const v1::ScaledDotProductAttentionRequest& request, absl::Time deadline,
    std::function<bool()> is_cancelled, v1::ScaledDotProductAttentionResponse* response,
    std::function<void(const absl::Status&)> finish) {
  RETURN_IF_ERROR(CheckKnownFields(request));
  RETURN_IF_ERROR(CheckRequestId(request.request_id()));
  ASSIGN_OR_RETURN(FloatTensor query, DecodeInput(request.query(), "query", budget_));
  ASSIGN_OR_RETURN(FloatTensor key, DecodeInput(request.key(), "key", budget_));
  ASSIGN_OR_RETURN(FloatTensor value, DecodeInput(request.value(), "value", budget_));
  RETURN_IF_ERROR(CheckRank(query, 4, "query", "[B, H, Nq, dk]"));
  RETURN_IF_ERROR(CheckRank(key, 4, "key", "[B, Hkv, Nk, dk]"));
  RETURN_IF_ERROR(CheckRank(value, 4, "value", "[B, Hkv, Nk, dv]"));
  RETURN_IF_ERROR(CheckDim(key, 0, query.shape[0], "key", "query batch size B"));
  RETURN_IF_ERROR(CheckDim(value, 0, query.shape[0], "value", "query batch size B"));
  RETURN_IF_ERROR(CheckDim(value, 1, key.shape[1], "value", "key heads Hkv"));
  RETURN_IF_ERROR(CheckDim(value, 2, key.shape[2], "value", "key length Nk"));
  RETURN_IF_ERROR(CheckDim(key, 3, query.shape[3], "key", "query head size dk"));
  RETURN_IF_ERROR(core::CheckHeadGroups(query.shape[1], key.shape[1], "query.shape[1] (H)",
                                         "key.shape[1] (Hkv)"));
  auto item = std::make_unique<WorkItem>();
  core::SdpaInput input;
  input.dims = {query.shape[0], query.shape[1], key.shape[1], query.shape[2],
                key.shape[2],   query.shape[3], value.shape[3]};
  ASSIGN_OR_RETURN(input.options,
                   ConvertCheckedOptions(request.options(), input.dims, budget_));
  ASSIGN_OR_RETURN(const core::DType output_dtype,
                   OutputDType(request.output_dtype(), request.query().dtype(),
                               request.float_data_output()));
  RETURN_IF_ERROR(core::ValidateSdpaInput(input));
  const core::AttentionDims& d = input.dims;
  const RequestCost cost =
      ScaledDotProductAttentionCost(d, input.options.need_weights, output_dtype);
  RETURN_IF_ERROR(CheckRequestBudget(cost, budget_));
  item->tokens = input.dims.batch * input.dims.q_len;
  item->bytes = CheckedSum({cost.memory_bytes, static_cast<int64_t>(request.ByteSizeLong())});
  item->priority = request.options().priority();
  ASSIGN_OR_RETURN(item->deadline, QueueDeadline(request.options(), deadline, absl::Now()));
  item->is_cancelled = std::move(is_cancelled);
  const core::AttentionDims dims = input.dims;
  const core::NeedWeights need = input.options.need_weights;
  // On the default device, or the CPU when that device cannot compute this shape.
  std::shared_ptr<const core::Backend> backend = default_backend_;
  if (!backend->Supports(core::SdpaConfig(input.dims), input.options).ok()) {
    backend = devices_.cpu();
  }
  item->run_alone_device = backend->name();
  // The closure owns the decoded tensors; spans are set where they can no longer move.
  item->run_alone = [backend = std::move(backend), input = std::move(input),
                     q = std::move(query.values), k = std::move(key.values),
                     v = std::move(value.values)]() mutable {
    input.query = q;
    input.key = k;
    input.value = v;
    return backend->ScaledDotProductAttention(input);
  };
  item->done = [finish = std::move(finish), response, dims, need, output_dtype,
                float_data = request.float_data_output(), request_id = request.request_id()](absl::StatusOr<core::AttentionResult> result) {
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

grpc::ServerUnaryReactor* AttentionServiceImpl::LoadLayer(grpc::CallbackServerContext* context,
                                                          const v1::LoadLayerRequest* request,
                                                          v1::LoadLayerResponse* response) {
  const absl::Time start = absl::Now();
  metrics_.CallStarted();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = CheckAdmin(*context, "LoadLayer");
  // Reading files and building weights run on the loader pool, never on a gRPC thread.
  if (status.ok()) {
    LoaderJob job = CallJob(*request, Deadline(context), nullptr,
                            [context] { return context->IsCancelled(); });
    job.work = [this, request, response] {
      const absl::Status loaded = DoLoadLayer(*request, response);
      RefreshLayerMetrics();
      return loaded;
    };
    job.done = [this, reactor, start](const absl::Status& loaded) {
      Finish(reactor, "LoadLayer", start, loaded);
    };
    status = loader_.Submit(std::move(job));
  }
  if (!status.ok()) Finish(reactor, "LoadLayer", start, status);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::InspectCheckpoint(
    grpc::CallbackServerContext* context, const v1::InspectCheckpointRequest* request,
    v1::InspectCheckpointResponse* response) {
  const absl::Time start = absl::Now();
  metrics_.CallStarted();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // The same reads as LoadLayer: the same access check, and file parsing on the loader pool.
  absl::Status status = CheckAdmin(*context, "InspectCheckpoint");
  if (status.ok()) {
    LoaderJob job = CallJob(*request, Deadline(context), nullptr,
                            [context] { return context->IsCancelled(); });
    job.work = [this, request, response] { return DoInspectCheckpoint(*request, response); };
    job.done = [this, reactor, start](const absl::Status& listed) {
      Finish(reactor, "InspectCheckpoint", start, listed);
    };
    status = loader_.Submit(std::move(job));
  }
  if (!status.ok()) Finish(reactor, "InspectCheckpoint", start, status);
  return reactor;
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
  if (access_.admin_token.empty()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  const auto found = metadata.find("authorization");
  if (found == metadata.end()) {
    return absl::UnauthenticatedError(absl::StrCat(
        method, " needs \"authorization: Bearer <token>\" metadata: this server restricts "
        "layer management (--admin_token_file)"));
  }
  absl::string_view token(found->second.data(), found->second.size());
  if (!absl::ConsumePrefix(&token, "Bearer ")) {
    return absl::UnauthenticatedError(
        "the authorization metadata must be \"Bearer <token>\"");
  }
  if (!ConstantTimeEquals(token, access_.admin_token)) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, ": the bearer token is not this server's admin token"));
  }
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::DoLoadLayer(const v1::LoadLayerRequest& request,
                                               v1::LoadLayerResponse* response) {
  RETURN_IF_ERROR(CheckKnownFields(request));
  RETURN_IF_ERROR(ValidateLayerName(request.name(), "name"));
  ASSIGN_OR_RETURN(const BatchLimitOverrides batching,
                   ConvertBatchingPolicy(request.batching(), "batching"));
  absl::StatusOr<std::shared_ptr<const core::Backend>> backend =
      request.device().empty() ? default_backend_ : devices_.Get(request.device());
  if (!backend.ok()) {
    return absl::Status(backend.status().code(), absl::StrCat("device: ", backend.status().message()));
  }
  const std::string device = (*backend)->name();
  ASSIGN_OR_RETURN(std::shared_ptr<const core::MhaLayer> layer,
                   BuildLayer(request.spec(), "spec", *std::move(backend), registry_.repository(),
                              [&](int64_t bytes) {
                                auto check = [&] {
                                  return registry_.CheckBudget(
                                      request.name(),
                                      LayerRegistry::EstimatedHostBytes(bytes, device), bytes,
                                      device);
                                };
                                absl::Status budget = check();
                                // Cached inline layers give way to a loaded one.
                                if (!budget.ok() && inline_cache_.Clear() > 0) budget = check();
                                return budget;
                              }));
  ASSIGN_OR_RETURN(
      std::shared_ptr<const LayerSnapshot> snapshot,
      registry_.Publish(request.name(), std::move(layer), request.persist(), batching,
                        request.device()));
  DescribeLayer(*snapshot, batcher_.server_limits(), response->mutable_layer());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnloadLayer(
    grpc::CallbackServerContext* context, const v1::UnloadLayerRequest* request,
    v1::UnloadLayerResponse* /*response*/) {
  const absl::Time start = absl::Now();
  metrics_.CallStarted();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = CheckAdmin(*context, "UnloadLayer");
  if (status.ok()) status = CheckKnownFields(*request);
  if (status.ok()) status = registry_.Remove(request->name());
  RefreshLayerMetrics();
  Finish(reactor, "UnloadLayer", start, status);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListLayers(
    grpc::CallbackServerContext* context, const v1::ListLayersRequest* request,
    v1::ListLayersResponse* response) {
  const absl::Time start = absl::Now();
  metrics_.CallStarted();
  const absl::Status status = CheckKnownFields(*request);
  if (status.ok()) {
    for (const auto& snapshot : registry_.List()) {
      DescribeLayer(*snapshot, batcher_.server_limits(), response->add_layers());
    }
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Finish(reactor, "ListLayers", start, status);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetLayer(grpc::CallbackServerContext* context,
                                                         const v1::GetLayerRequest* request,
                                                         v1::GetLayerResponse* response) {
  const absl::Time start = absl::Now();
  metrics_.CallStarted();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status known = CheckKnownFields(*request);
  auto snapshot = known.ok() ? registry_.Get(request->name())
                             : absl::StatusOr<std::shared_ptr<const LayerSnapshot>>(known);
  if (snapshot.ok()) {
    DescribeLayer(**snapshot, batcher_.server_limits(), response->mutable_layer());
  }
  Finish(reactor, "GetLayer", start, snapshot.status());
  return reactor;
}

}  // namespace attention::server
