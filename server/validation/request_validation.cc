#include "server/validation/request_validation.h"

#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attention/v1/attention.pb.h"
#include "core/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/unknown_field_set.h"
#include "inference/grpc_service.pb.h"
#include "server/common/status_util.h"

namespace attention::server {
namespace {

int64_t WeightElements(const core::AttentionDims& d, core::NeedWeights need) {
  switch (need) {
    case core::NeedWeights::kNone:
      return 0;
    case core::NeedWeights::kAveraged:
      return CheckedProduct({d.batch, d.q_len, d.kv_len});
    case core::NeedWeights::kPerHead:
      return CheckedProduct({d.batch, d.num_heads, d.q_len, d.kv_len});
  }
  return kSaturated;
}

// Per-head weights are computed before they are averaged, so both exist at once.
int64_t WeightWorkingElements(const core::AttentionDims& d, core::NeedWeights need) {
  if (need == core::NeedWeights::kNone) return 0;
  return CheckedSum({CheckedProduct({d.batch, d.num_heads, d.q_len, d.kv_len}),
                     WeightElements(d, need)});
}

// Masking, exp and sums per score, counted as this many FLOPs so that heads of width 1
// with very long keys are not nearly free.
constexpr int64_t kSoftmaxFlopsPerScore = 8;

// Scores and weights times values (2 FLOPs per multiply-add, over dk and dv), plus softmax.
int64_t AttentionFlops(const core::AttentionDims& d) {
  return CheckedProduct(
      {d.batch, d.num_heads, d.q_len, d.kv_len,
       CheckedSum({CheckedProduct({2, CheckedSum({d.head_dim, d.v_head_dim})}),
                   kSoftmaxFlopsPerScore})});
}

std::string Amount(int64_t value) {
  return value == kSaturated ? std::string("more than 2^63") : absl::StrCat(value);
}

void CollectUnknownFields(const google::protobuf::Message& message, const std::string& path,
                          std::vector<std::string>* problems);

// The values of `map`, keyed by strings, at `path` ("parameters" -> parameters["timeout"]).
template <typename Map>
void CollectUnknownFieldsInValues(const Map& map, const std::string& path,
                                  std::vector<std::string>* problems) {
  for (const auto& [key, value] : map) {
    CollectUnknownFields(value, absl::StrCat(path, "[", Quoted(key), "]"), problems);
  }
}

// The values of `map` (a field of `message`, at `path`): they hold unknown fields as any
// message does. Walked through the generated accessors: protobuf 3.21's reflection reads a
// map by rebuilding it as a repeated field, which copies every entry (megabytes of weights)
// and crashed under ThreadSanitizer. Every map a request can carry is here; the test
// UnknownFieldsInsideEveryMapAreRefused fails when a proto gains one that is not.
void CollectUnknownFieldsInMap(const google::protobuf::Message& message,
                               const google::protobuf::FieldDescriptor* map,
                               const std::string& path, std::vector<std::string>* problems) {
  if (const auto* weights = dynamic_cast<const v1::LayerWeights*>(&message)) {
    CollectUnknownFieldsInValues(weights->tensors(), path, problems);
  } else if (const auto* infer = dynamic_cast<const inference::ModelInferRequest*>(&message)) {
    CollectUnknownFieldsInValues(infer->parameters(), path, problems);
  } else if (const auto* input =
                 dynamic_cast<const inference::ModelInferRequest_InferInputTensor*>(&message)) {
    CollectUnknownFieldsInValues(input->parameters(), path, problems);
  } else if (const auto* output = dynamic_cast<
                 const inference::ModelInferRequest_InferRequestedOutputTensor*>(&message)) {
    CollectUnknownFieldsInValues(output->parameters(), path, problems);
  } else if (const auto* load =
                 dynamic_cast<const inference::RepositoryModelLoadRequest*>(&message)) {
    CollectUnknownFieldsInValues(load->parameters(), path, problems);
  } else if (const auto* unload =
                 dynamic_cast<const inference::RepositoryModelUnloadRequest*>(&message)) {
    CollectUnknownFieldsInValues(unload->parameters(), path, problems);
  } else {
    problems->push_back(absl::StrCat(path, " (", map->full_name(),
                                     "): a map this server cannot check for unknown fields"));
  }
}

// Appends one line per message under `message` (at `path`) that holds unknown fields.
void CollectUnknownFields(const google::protobuf::Message& message, const std::string& path,
                          std::vector<std::string>* problems) {
  const google::protobuf::Reflection* reflection = message.GetReflection();
  const google::protobuf::UnknownFieldSet& unknown = reflection->GetUnknownFields(message);
  if (!unknown.empty()) {
    std::set<int> numbers;
    for (int i = 0; i < unknown.field_count(); ++i) numbers.insert(unknown.field(i).number());
    problems->push_back(absl::StrCat(path.empty() ? "the request" : path, " (",
                                     message.GetDescriptor()->full_name(), ") field",
                                     numbers.size() > 1 ? "s " : " ", absl::StrJoin(numbers, ", ")));
  }
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) continue;
    const std::string name = path.empty() ? field->name() : absl::StrCat(path, ".", field->name());
    if (field->is_map()) {
      CollectUnknownFieldsInMap(message, field, name, problems);
      continue;
    }
    if (!field->is_repeated()) {
      CollectUnknownFields(reflection->GetMessage(message, field), name, problems);
      continue;
    }
    for (int i = 0; i < reflection->FieldSize(message, field); ++i) {
      CollectUnknownFields(reflection->GetRepeatedMessage(message, field, i),
                           absl::StrCat(name, "[", i, "]"), problems);
    }
  }
}

}  // namespace

absl::Status CheckFinite(absl::Span<const float> values, absl::Span<const int64_t> shape,
                         absl::string_view field, bool allow_negative_infinity) {
  // A float is NaN or infinite when its exponent bits are all ones; an integer OR over the
  // whole tensor vectorizes, and only a tensor that fails is searched for the index.
  constexpr uint32_t kExponent = 0x7f800000u;
  uint32_t any = 0;
  for (float value : values) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    any |= static_cast<uint32_t>((bits & kExponent) == kExponent);
  }
  if (any == 0) return absl::OkStatus();
  for (size_t flat = 0; flat < values.size(); ++flat) {
    const float value = values[flat];
    if (std::isfinite(value) || (allow_negative_infinity && value == -INFINITY)) continue;
    return NonFiniteAt(field, shape, static_cast<int64_t>(flat), value);
  }
  return absl::OkStatus();
}

absl::Status NonFiniteAt(absl::string_view field, absl::Span<const int64_t> shape, int64_t flat,
                         float value) {
  std::vector<int64_t> index(shape.size());
  int64_t rest = flat;
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = rest % shape[d];
    rest /= shape[d];
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, " holds ", std::isnan(value) ? "NaN" : (value > 0 ? "+inf" : "-inf"), " at [",
      absl::StrJoin(index, ", "), "]; non-finite inputs are refused (--reject_non_finite)"));
}

absl::Status CheckKnownFields(const google::protobuf::Message& request) {
  std::vector<std::string> problems;
  CollectUnknownFields(request, "", &problems);
  if (problems.empty()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "this server does not know ", ListForMessage(problems),
      "; a newer client sent them, and they are refused rather than ignored (upgrade the "
      "server or leave them unset)"));
}

bool ConstantTimeEquals(absl::string_view given, absl::string_view expected) {
  unsigned char difference = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    difference |= static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
  }
  return difference == 0;
}

int64_t CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t factor : factors) {
    if (factor < 0 || __builtin_mul_overflow(product, factor, &product)) return kSaturated;
  }
  return product;
}

int64_t CheckedSum(std::initializer_list<int64_t> terms) {
  int64_t sum = 0;
  for (int64_t term : terms) {
    if (term < 0 || __builtin_add_overflow(sum, term, &sum)) return kSaturated;
  }
  return sum;
}

absl::Status RequestBudget::Validate() const {
  for (auto [name, value] : {std::pair<const char*, int64_t>{"max_response_bytes",
                                                             max_response_bytes},
                             {"max_request_flops", max_request_flops},
                             {"max_request_memory_bytes", max_request_memory_bytes}}) {
    if (value < 1) return absl::InvalidArgumentError(absl::StrCat(name, " = ", value, " must be >= 1"));
  }
  return absl::OkStatus();
}

RequestCost MultiHeadAttentionCost(const core::MhaConfig& c, const core::AttentionDims& d,
                                   core::NeedWeights need, core::DType output_dtype) {
  RequestCost cost;
  const int64_t q_tokens = CheckedProduct({d.batch, d.q_len});
  const int64_t kv_tokens = CheckedProduct({d.batch, d.kv_len});
  cost.output_elements = CheckedProduct({q_tokens, c.output_dim});
  cost.weight_elements = WeightElements(d, need);
  cost.response_bytes =
      CheckedProduct({CheckedSum({cost.output_elements, cost.weight_elements}),
                      static_cast<int64_t>(core::ElementSize(output_dtype))});
  const int64_t output_projection_flops =
      c.output_projection ? CheckedProduct({2, q_tokens, c.AttentionWidth(), c.output_dim}) : 0;
  cost.flops = CheckedSum({CheckedProduct({2, q_tokens, c.embed_dim, c.QWidth()}),
                           CheckedProduct({2, kv_tokens, c.kdim, c.KWidth()}),
                           CheckedProduct({2, kv_tokens, c.vdim, c.VWidth()}),
                           AttentionFlops(d), output_projection_flops});
  // The forward pass's float buffers: packed inputs, Q/K/V, attention output, projected
  // output and its copy per request, attention weights.
  const int64_t floats = CheckedSum(
      {CheckedProduct({q_tokens, CheckedSum({c.embed_dim, c.QWidth(), c.AttentionWidth(),
                                             CheckedProduct({2, c.output_dim})})}),
       CheckedProduct({kv_tokens, CheckedSum({c.kdim, c.vdim, c.KWidth(), c.VWidth()})}),
       WeightWorkingElements(d, need)});
  cost.memory_bytes = CheckedSum({CheckedProduct({floats, 4}), cost.response_bytes});
  return cost;
}

RequestCost ScaledDotProductAttentionCost(const core::AttentionDims& d, core::NeedWeights need,
                                          core::DType output_dtype) {
  RequestCost cost;
  cost.output_elements = CheckedProduct({d.batch, d.num_heads, d.q_len, d.v_head_dim});
  cost.weight_elements = WeightElements(d, need);
  cost.response_bytes =
      CheckedProduct({CheckedSum({cost.output_elements, cost.weight_elements}),
                      static_cast<int64_t>(core::ElementSize(output_dtype))});
  cost.flops = AttentionFlops(d);
  const int64_t floats = CheckedSum({cost.output_elements, WeightWorkingElements(d, need)});
  cost.memory_bytes = CheckedSum({CheckedProduct({floats, 4}), cost.response_bytes});
  return cost;
}

RequestCost SessionStepEntryCost(const core::AttentionDims& d, const core::MhaConfig* layer,
                                 bool log_sum_exp, core::DType output_dtype) {
  RequestCost cost;
  const int64_t n = d.q_len;
  cost.output_elements = layer != nullptr ? CheckedProduct({n, layer->output_dim})
                                          : CheckedProduct({n, d.num_heads, d.v_head_dim});
  const int64_t log_sum_exp_elements = log_sum_exp ? CheckedProduct({n, d.num_heads}) : 0;
  cost.response_bytes =
      CheckedSum({CheckedProduct({cost.output_elements,
                                  static_cast<int64_t>(core::ElementSize(output_dtype))}),
                  CheckedProduct({log_sum_exp_elements, 4})});
  cost.flops = AttentionFlops(d);
  // The step's float buffers: inputs, projections and attention rows, the answers.
  int64_t floats = CheckedSum({cost.output_elements, log_sum_exp_elements});
  if (layer == nullptr) {
    floats = CheckedSum(
        {floats,
         CheckedProduct({n, CheckedSum({CheckedProduct({d.num_heads, d.head_dim}),
                                        CheckedProduct({d.num_kv_heads, d.head_dim}),
                                        CheckedProduct({d.num_kv_heads, d.v_head_dim})})})});
  } else {
    const core::MhaConfig& c = *layer;
    cost.flops = CheckedSum(
        {cost.flops, CheckedProduct({2, n, c.embed_dim, c.QWidth()}),
         CheckedProduct({2, n, c.kdim, c.KWidth()}), CheckedProduct({2, n, c.vdim, c.VWidth()}),
         c.output_projection ? CheckedProduct({2, n, c.AttentionWidth(), c.output_dim}) : 0});
    floats = CheckedSum(
        {floats, CheckedProduct({n, CheckedSum({c.embed_dim, c.QWidth(), c.KWidth(), c.VWidth(),
                                                CheckedProduct({2, c.AttentionWidth()})})})});
  }
  cost.memory_bytes = CheckedSum({CheckedProduct({floats, 4}), cost.response_bytes});
  return cost;
}

RequestCost operator+(const RequestCost& a, const RequestCost& b) {
  RequestCost sum;
  sum.output_elements = CheckedSum({a.output_elements, b.output_elements});
  sum.weight_elements = CheckedSum({a.weight_elements, b.weight_elements});
  sum.response_bytes = CheckedSum({a.response_bytes, b.response_bytes});
  sum.flops = CheckedSum({a.flops, b.flops});
  sum.memory_bytes = CheckedSum({a.memory_bytes, b.memory_bytes});
  return sum;
}

absl::Status CheckRequestBudget(const RequestCost& cost, const RequestBudget& budget) {
  if (cost.response_bytes > budget.max_response_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the answer would be ", Amount(cost.response_bytes), " bytes (output ",
        Amount(cost.output_elements), " values, attention weights ",
        Amount(cost.weight_elements), " values), over the server's ", budget.max_response_bytes,
        "-byte message limit; send fewer sequences per request or drop options.need_weights"));
  }
  if (cost.flops > budget.max_request_flops) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", Amount(cost.flops), " FLOPs, over the server's per-request limit "
        "of ", budget.max_request_flops, " (--max_request_flops); split it into smaller requests"));
  }
  if (cost.memory_bytes > budget.max_request_memory_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", Amount(cost.memory_bytes), " bytes of working memory, over the "
        "server's per-request limit of ", budget.max_request_memory_bytes,
        " (--max_request_memory_bytes); split it into smaller requests"));
  }
  return absl::OkStatus();
}

absl::Status CheckInlineLayerBytes(int64_t weight_bytes, const RequestBudget& budget) {
  if (weight_bytes > budget.max_request_memory_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "inline_layer needs ", weight_bytes, " bytes of weights, over the server's per-request "
        "limit of ", budget.max_request_memory_bytes,
        " (--max_request_memory_bytes); load it once with LoadLayer instead"));
  }
  return absl::OkStatus();
}

absl::Status CheckRequestId(const std::string& request_id) {
  constexpr size_t kMaxRequestIdBytes = 256;
  if (request_id.size() > kMaxRequestIdBytes) {
    return Invalid("request_id has ", request_id.size(), " bytes; at most ", kMaxRequestIdBytes);
  }
  return absl::OkStatus();
}

}  // namespace attention::server
