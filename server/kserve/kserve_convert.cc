// kserve_convert.h's request half: a ModelInferRequest into a native request.
#include "server/kserve/kserve_convert.h"

#include <cstring>
#include <limits>
#include <set>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/validation/request_validation.h"
#include "server/common/status_util.h"
#include "server/validation/wire_convert.h"

namespace attention::server::kserve {
namespace {

using Parameter = inference::InferParameter;
using InputTensor = inference::ModelInferRequest::InferInputTensor;

// Triton's system shared memory parameters of an input or requested output (and
// kRegionParameter, in kserve_convert.h).
constexpr char kByteSizeParameter[] = "shared_memory_byte_size";
constexpr char kOffsetParameter[] = "shared_memory_offset";
// Triton's priority levels start at 1 (first); they map below this native priority.
constexpr int64_t kTritonPriorityBase = 1'000'000;

// The native dtype of a protocol datatype among `allowed`, or INVALID_ARGUMENT listing them.
absl::StatusOr<v1::DataType> ParseDatatype(const InputTensor& input,
                                           const std::vector<std::string>& allowed) {
  for (const std::string& name : allowed) {
    if (input.datatype() != name) continue;
    const core::DTypeInfo* info = core::FindDType(name, &core::DTypeInfo::kserve_name);
    // Not a core dtype: an integer mask, converted below.
    return info != nullptr ? wire::WireDType(info->dtype) : v1::DATA_TYPE_UNSPECIFIED;
  }
  return Invalid("inputs[", Quoted(input.name()), "].datatype = ", Quoted(input.datatype()),
                 " is not accepted; expected one of ", ListForMessage(allowed));
}

// inputs["name"]: how messages name an input.
std::string InputField(const InputTensor& input) {
  return absl::StrCat("inputs[", Quoted(input.name()), "]");
}

// The element count of `input`'s shape under the protocol's shape rule (zero dimensions
// pass here; the native decode refuses them after conversion).
absl::StatusOr<int64_t> ElementCount(const InputTensor& input) {
  return wire::ElementCount(input.shape(), InputField(input), wire::ShapeRule::kNonNegative);
}

// INVALID_ARGUMENT when typed contents hold `given` values where the shape needs `count`.
absl::Status CheckTypedCount(const InputTensor& input, int64_t given, int64_t count) {
  if (given == count) return absl::OkStatus();
  return Invalid("inputs[", Quoted(input.name()), "].contents holds ", given, " ",
                 input.datatype(), " values; its shape needs ", count);
}

// The typed contents field that carries values of `datatype`; null for FP16 and BF16.
const char* TypedContentsField(const std::string& datatype) {
  if (datatype == "FP32") return "fp32_contents";
  if (datatype == "BOOL") return "bool_contents";
  if (datatype == "INT64") return "int64_contents";
  if (datatype == "INT32") return "int_contents";
  return nullptr;
}

// INVALID_ARGUMENT naming the typed contents field used when it is not the datatype's:
// values in another field would otherwise read as an empty tensor.
absl::Status CheckContentsField(const InputTensor& input) {
  const char* expected = TypedContentsField(input.datatype());
  const google::protobuf::Reflection* reflection = input.contents().GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(input.contents(), &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (expected != nullptr && field->name() == expected) continue;
    const std::string given = absl::StrCat("contents.", field->name(), " holds ",
                                           reflection->FieldSize(input.contents(), field),
                                           " values");
    if (expected == nullptr) {
      return Invalid("inputs[", Quoted(input.name()), "] is ", input.datatype(),
                     ", which has no typed contents in the protocol, but its ", given,
                     "; send it in raw_input_contents");
    }
    return Invalid("inputs[", Quoted(input.name()), "] is ", input.datatype(), ", whose values go "
                   "in contents.", expected, ", but its ", given);
  }
  return absl::OkStatus();
}

// A tokenizer's attention_mask (1 = attend, 0 = padding) as the bytes of a BOOL mask with
// TRUE_ATTENDS polarity, from `raw` little-endian bytes when given, else from `typed`.
template <typename Int>
absl::Status IntegerMaskToBool(const InputTensor& input, const std::string* raw,
                               const google::protobuf::RepeatedField<Int>& typed,
                               std::string* bytes) {
  ASSIGN_OR_RETURN(const int64_t count, ElementCount(input));
  if (raw != nullptr) {
    RETURN_IF_ERROR(wire::CheckByteCount(
        raw->size(), count, sizeof(Int),
        absl::StrCat("raw_input_contents of ", Quoted(input.name())), [&](int64_t) {
          return absl::StrCat("shape and ", input.datatype(), " need ", count, " x ", sizeof(Int));
        }));
  } else {
    RETURN_IF_ERROR(CheckTypedCount(input, typed.size(), count));
  }
  bytes->resize(static_cast<size_t>(count));
  for (int64_t n = 0; n < count; ++n) {
    Int value;
    if (raw != nullptr) {
      // Copied out, as raw bytes need not be aligned for the integer type.
      std::memcpy(&value, raw->data() + n * sizeof(Int), sizeof(Int));
    } else {
      value = typed.Get(static_cast<int>(n));
    }
    if (value != 0 && value != 1) {
      return Invalid("inputs[", Quoted(input.name()), "] element ", n, " = ",
                     static_cast<int64_t>(value),
                     "; an integer mask holds 1 (attend) or 0 (padding)");
    }
    (*bytes)[n] = static_cast<char>(value);
  }
  return absl::OkStatus();
}

absl::Status ConvertIntegerMask(const InputTensor& input, const std::string* raw,
                                v1::Tensor* tensor) {
  std::string bytes;
  RETURN_IF_ERROR(input.datatype() == "INT64"
                      ? IntegerMaskToBool(input, raw, input.contents().int64_contents(), &bytes)
                      : IntegerMaskToBool(input, raw, input.contents().int_contents(), &bytes));
  tensor->set_dtype(v1::BOOL);
  *tensor->mutable_raw_data() = std::move(bytes);
  return absl::OkStatus();
}

bool IsSharedMemoryParameter(const std::string& key) {
  return key == kRegionParameter || key == kByteSizeParameter || key == kOffsetParameter;
}

// A size or offset parameter: int64 (>= 0) or uint64.
absl::StatusOr<uint64_t> SizeParameter(absl::string_view field, const char* key,
                                       const Parameter& parameter) {
  if (parameter.parameter_choice_case() == Parameter::kUint64Param) {
    return parameter.uint64_param();
  }
  if (parameter.parameter_choice_case() != Parameter::kInt64Param) {
    return Invalid(field, ".parameters[\"", key, "\"] must be an int64 or uint64 parameter");
  }
  if (parameter.int64_param() < 0) {
    return Invalid(field, ".parameters[\"", key, "\"] = ", parameter.int64_param(), " is negative");
  }
  return static_cast<uint64_t>(parameter.int64_param());
}

// The shared memory slice a tensor's parameters name (`field`: inputs["query"] or
// outputs["output"]), or none when they name no region.
absl::StatusOr<std::optional<SharedMemorySlice>> SharedMemoryParameters(
    absl::string_view field, const google::protobuf::Map<std::string, Parameter>& parameters,
    const SharedMemory& shared_memory) {
  const auto region = parameters.find(kRegionParameter);
  if (region == parameters.end()) {
    for (const char* key : {kByteSizeParameter, kOffsetParameter}) {
      if (parameters.count(key)) {
        return Invalid(field, ".parameters[\"", key, "\"] is given without parameters[\"",
                       kRegionParameter, "\"]");
      }
    }
    return std::nullopt;
  }
  if (region->second.parameter_choice_case() != Parameter::kStringParam) {
    return Invalid(field, ".parameters[\"", kRegionParameter, "\"] must be a string parameter");
  }
  const auto size = parameters.find(kByteSizeParameter);
  if (size == parameters.end()) {
    return Invalid(field, ".parameters[\"", kByteSizeParameter,
                   "\"] is missing: it gives the size of the slice of region ",
                   Quoted(region->second.string_param()));
  }
  ASSIGN_OR_RETURN(const uint64_t byte_size,
                   SizeParameter(field, kByteSizeParameter, size->second));
  uint64_t offset = 0;
  if (const auto given = parameters.find(kOffsetParameter); given != parameters.end()) {
    ASSIGN_OR_RETURN(offset, SizeParameter(field, kOffsetParameter, given->second));
  }
  return shared_memory.Find(field, region->second.string_param(), offset, byte_size);
}

// An input's parameters: binary_data_size, which the KServe SDK sends with every raw
// input, must be its raw entry's size; shared memory ones were read before; nothing else.
absl::Status CheckInputParameters(const InputTensor& input, std::optional<uint64_t> raw_size) {
  for (const auto& [key, parameter] : input.parameters()) {
    if (IsSharedMemoryParameter(key)) continue;
    if (key != "binary_data_size") {
      return absl::UnimplementedError(
          absl::StrCat("inputs[", Quoted(input.name()), "].parameters[", Quoted(key),
                       "] is not supported; an input takes binary_data_size, shared_memory_region, "
                       "shared_memory_byte_size and shared_memory_offset"));
    }
    // Compared and printed as sent: a negative int64 is no size, not a 64-bit wrap-around.
    std::string sent = "(not an integer)";
    bool matches = false;
    if (parameter.parameter_choice_case() == Parameter::kInt64Param) {
      sent = absl::StrCat(parameter.int64_param());
      matches = raw_size.has_value() && parameter.int64_param() >= 0 &&
                static_cast<uint64_t>(parameter.int64_param()) == *raw_size;
    } else if (parameter.parameter_choice_case() == Parameter::kUint64Param) {
      sent = absl::StrCat(parameter.uint64_param());
      matches = raw_size.has_value() && parameter.uint64_param() == *raw_size;
    }
    if (!matches) {
      return Invalid(
          "inputs[", Quoted(input.name()), "].parameters[\"binary_data_size\"] = ", sent,
          " does not match its raw_input_contents entry (",
          !raw_size.has_value() ? std::string("none") : absl::StrCat(*raw_size, " bytes"), ")");
    }
  }
  return absl::OkStatus();
}

// An input's bytes where it sends them raw: its raw_input_contents entry (copied: the
// request is the caller's) or what its shared memory slice held (moved).
struct RawBytes {
  const std::string* entry = nullptr;
  std::string* slice = nullptr;
  // The size of a slice whose bytes stay outside the request (GpuTensors).
  std::optional<uint64_t> elsewhere;
  const std::string* get() const { return slice != nullptr ? slice : entry; }
  std::optional<uint64_t> size() const {
    if (elsewhere.has_value()) return elsewhere;
    return get() != nullptr ? std::optional<uint64_t>(get()->size()) : std::nullopt;
  }
};

// One input into its native tensor.
absl::Status ConvertInput(const InputTensor& input, RawBytes bytes,
                          const std::vector<std::string>& datatypes, v1::Tensor* tensor) {
  const std::string* raw = bytes.get();
  RETURN_IF_ERROR(CheckInputParameters(input, bytes.size()));
  ASSIGN_OR_RETURN(const v1::DataType dtype, ParseDatatype(input, datatypes));
  if (!bytes.size().has_value()) RETURN_IF_ERROR(CheckContentsField(input));
  tensor->mutable_shape()->CopyFrom(input.shape());
  if (dtype == v1::DATA_TYPE_UNSPECIFIED) return ConvertIntegerMask(input, raw, tensor);
  tensor->set_dtype(dtype);
  if (bytes.elsewhere.has_value()) return absl::OkStatus();  // the layer reads them there
  if (raw != nullptr) {
    if (bytes.slice != nullptr) {
      tensor->mutable_raw_data()->swap(*bytes.slice);
    } else {
      tensor->set_raw_data(*bytes.entry);
    }
    return absl::OkStatus();
  }
  const inference::InferTensorContents& contents = input.contents();
  if (dtype == v1::FLOAT32) {
    ASSIGN_OR_RETURN(const int64_t count, ElementCount(input));
    RETURN_IF_ERROR(CheckTypedCount(input, contents.fp32_contents_size(), count));
    tensor->mutable_float_data()->CopyFrom(contents.fp32_contents());
    return absl::OkStatus();
  }
  if (dtype == v1::BOOL) {
    ASSIGN_OR_RETURN(const int64_t count, ElementCount(input));
    RETURN_IF_ERROR(CheckTypedCount(input, contents.bool_contents_size(), count));
    std::string* bytes = tensor->mutable_raw_data();
    bytes->resize(static_cast<size_t>(count));
    for (int64_t n = 0; n < count; ++n) (*bytes)[n] = contents.bool_contents(n) ? 1 : 0;
    return absl::OkStatus();
  }
  return Invalid("inputs[", Quoted(input.name()), "] is ", input.datatype(),
                 ", which has no typed contents in the protocol; send it in raw_input_contents");
}

absl::Status ParameterTypeError(absl::string_view name, absl::string_view expected) {
  return Invalid("parameters[", Quoted(name), "] must be a ", expected, " parameter");
}

absl::StatusOr<v1::NeedWeights> ParseNeedWeights(const Parameter& parameter) {
  if (parameter.parameter_choice_case() == Parameter::kBoolParam) {
    return parameter.bool_param() ? v1::NEED_WEIGHTS_AVERAGED : v1::NEED_WEIGHTS_NONE;
  }
  if (parameter.parameter_choice_case() != Parameter::kStringParam) {
    return ParameterTypeError("need_weights", "string or bool");
  }
  const std::string& value = parameter.string_param();
  if (value == "none") return v1::NEED_WEIGHTS_NONE;
  if (value == "averaged") return v1::NEED_WEIGHTS_AVERAGED;
  if (value == "per_head") return v1::NEED_WEIGHTS_PER_HEAD;
  return Invalid("parameters[\"need_weights\"] = ", Quoted(value),
                 "; expected \"none\", \"averaged\" or \"per_head\"");
}

// An integer parameter given as int64 or uint64 (tritonclient sends priority as uint64).
absl::StatusOr<int64_t> IntegerParameter(absl::string_view name, const Parameter& parameter) {
  if (parameter.parameter_choice_case() == Parameter::kInt64Param) return parameter.int64_param();
  if (parameter.parameter_choice_case() == Parameter::kUint64Param) {
    if (parameter.uint64_param() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid("parameters[", Quoted(name), "] = ", parameter.uint64_param(),
                     " is too large");
    }
    return static_cast<int64_t>(parameter.uint64_param());
  }
  return ParameterTypeError(name, "int64 or uint64");
}

// Request parameters into the native options; need_weights is returned apart, as the
// requested outputs also decide it.
absl::Status ConvertParameters(const inference::ModelInferRequest& request,
                               v1::AttentionOptions* options,
                               std::optional<v1::NeedWeights>* need_weights, bool* binary_data) {
  static const std::vector<std::string> kKnown = {
      "causal",   "scale",   "need_weights", "bool_mask_polarity", "binary_data_output",
      "timeout", "priority"};
  for (const auto& [name, parameter] : request.parameters()) {
    const auto choice = parameter.parameter_choice_case();
    if (name == "causal" || name == "binary_data_output") {
      if (choice != Parameter::kBoolParam) return ParameterTypeError(name, "bool");
      if (name == "causal") {
        options->set_causal(parameter.bool_param());
      } else {
        *binary_data = parameter.bool_param();
      }
    } else if (name == "scale") {
      if (choice != Parameter::kDoubleParam) return ParameterTypeError(name, "double");
      options->set_scale(static_cast<float>(parameter.double_param()));
    } else if (name == "need_weights") {
      ASSIGN_OR_RETURN(*need_weights, ParseNeedWeights(parameter));
    } else if (name == "bool_mask_polarity") {
      if (choice != Parameter::kStringParam) return ParameterTypeError(name, "string");
      v1::BoolMaskPolarity polarity;
      if (parameter.string_param() == "true_masks_out") {
        polarity = v1::TRUE_MASKS_OUT;
      } else if (parameter.string_param() == "true_attends") {
        polarity = v1::TRUE_ATTENDS;
      } else {
        return Invalid("parameters[\"bool_mask_polarity\"] = ", Quoted(parameter.string_param()),
                       "; expected \"true_masks_out\" or \"true_attends\"");
      }
      options->set_key_padding_polarity(polarity);
      options->set_attn_mask_polarity(polarity);
    } else if (name == "timeout") {
      ASSIGN_OR_RETURN(const int64_t timeout_us, IntegerParameter(name, parameter));
      RETURN_IF_ERROR(CheckQueueTimeout(timeout_us, "parameters[\"timeout\"]", " µs"));
      options->set_queue_timeout_us(timeout_us);
    } else if (name == "priority") {
      ASSIGN_OR_RETURN(const int64_t level, IntegerParameter(name, parameter));
      if (level < 0 || level >= kTritonPriorityBase) {
        return Invalid("parameters[\"priority\"] = ", level, " must be in [0, ",
                       kTritonPriorityBase, ")");
      }
      options->set_priority(level == 0 ? 0 : static_cast<int32_t>(kTritonPriorityBase - level));
    } else {
      return Invalid("parameters[", Quoted(name), "] is not a parameter of this server; known: ",
                     ListForMessage(kKnown));
    }
  }
  return absl::OkStatus();
}

absl::Status PlanOutputs(const inference::ModelInferRequest& request,
                         const SharedMemory& shared_memory,
                         std::optional<v1::NeedWeights> need_weights, OutputPlan* plan,
                         v1::AttentionOptions* options) {
  bool weights_requested = false;
  for (const auto& output : request.outputs()) {
    if (output.name() != kOutputName && output.name() != kWeightsName) {
      return Invalid("outputs[", Quoted(output.name()), "] is not an output; expected \"",
                     kOutputName, "\" or \"", kWeightsName, "\"");
    }
    for (const auto& [key, parameter] : output.parameters()) {
      if (IsSharedMemoryParameter(key)) continue;
      return absl::UnimplementedError(
          absl::StrCat("outputs[", Quoted(output.name()), "].parameters[", Quoted(key),
                       "] is not supported (no classification outputs); an output takes "
                       "shared_memory_region, shared_memory_byte_size and shared_memory_offset"));
    }
    for (const std::string& earlier : plan->names) {
      if (earlier == output.name()) {
        return Invalid("outputs[", Quoted(output.name()), "] is requested twice");
      }
    }
    ASSIGN_OR_RETURN(std::optional<SharedMemorySlice> destination,
                     SharedMemoryParameters(absl::StrCat("outputs[", Quoted(output.name()), "]"),
                                            output.parameters(), shared_memory));
    plan->names.push_back(output.name());
    plan->destinations.push_back(std::move(destination));
    weights_requested |= output.name() == kWeightsName;
  }
  if (weights_requested && need_weights == v1::NEED_WEIGHTS_NONE) {
    return Invalid("outputs asks for \"attention_weights\" but parameters[\"need_weights\"] "
                   "is \"none\"");
  }
  const v1::NeedWeights need =
      need_weights.value_or(weights_requested ? v1::NEED_WEIGHTS_AVERAGED : v1::NEED_WEIGHTS_NONE);
  options->set_need_weights(need);
  if (plan->names.empty()) {
    plan->names.push_back(kOutputName);
    if (need != v1::NEED_WEIGHTS_NONE) plan->names.push_back(kWeightsName);
    plan->destinations.resize(plan->names.size());
  }
  return absl::OkStatus();
}

bool IsQueryKeyOrValue(const InputTensor& input) {
  return input.name() == kQuery || input.name() == kKey || input.name() == kValue;
}

// Whether `slice` is in GPU `gpu`'s memory at an offset aligned to `datatype`, a float one.
bool OnGpuAligned(const SharedMemorySlice& slice, int gpu, const std::string& datatype) {
  const core::DTypeInfo* info = core::FindDType(datatype, &core::DTypeInfo::kserve_name);
  return gpu >= 0 && slice.gpu() == gpu && info != nullptr && info->dtype != core::DType::kBool &&
         slice.offset % core::ElementSize(info->dtype) == 0;
}

// Whether query, key and value stay in GPU `gpu`'s memory (ToNativeRequest's rule).
bool InputsStayOnGpu(const inference::ModelInferRequest& request,
                     const std::vector<std::optional<SharedMemorySlice>>& sources, int gpu) {
  const std::string* datatype = nullptr;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const InputTensor& input = request.inputs(i);
    if (!IsQueryKeyOrValue(input)) continue;
    if (!sources[i].has_value() || !OnGpuAligned(*sources[i], gpu, input.datatype()) ||
        (datatype != nullptr && *datatype != input.datatype())) {
      return false;
    }
    datatype = &input.datatype();
  }
  return datatype != nullptr;
}

// Whether query, key and value are read into page-locked memory: every one given is in
// system shared memory.
bool InputsGoPinned(const inference::ModelInferRequest& request,
                    const std::vector<std::optional<SharedMemorySlice>>& sources) {
  bool any = false;
  for (int i = 0; i < request.inputs_size(); ++i) {
    if (!IsQueryKeyOrValue(request.inputs(i))) continue;
    if (!sources[i].has_value() || sources[i]->gpu() >= 0) return false;
    any = true;
  }
  return any;
}

// `slice` for the layer to read or write in place; `on_gpu` keeps its region open.
GpuBytes KeepOnGpu(const SharedMemorySlice& slice, GpuTensors* on_gpu) {
  on_gpu->regions.push_back(slice.region);
  return GpuBytes{slice.region->gpu_memory(), slice.offset, slice.byte_size, slice.field};
}

// Leaves the output in GPU memory when ToNativeRequest's rule allows.
void PlaceOutputOnGpu(const inference::ModelInferRequest& request, OutputPlan* plan,
                      GpuTensors* on_gpu) {
  const InputTensor* query = nullptr;
  for (const InputTensor& input : request.inputs()) {
    if (input.name() == kQuery) query = &input;
  }
  const bool answer_on_gpu = plan->binary_data && query != nullptr &&
                             (query->datatype() == "FP32" || query->datatype() == "BF16");
  for (size_t k = 0; k < plan->names.size() && answer_on_gpu; ++k) {
    const std::optional<SharedMemorySlice>& destination = plan->destinations[k];
    if (plan->names[k] != kOutputName || !destination.has_value() ||
        !OnGpuAligned(*destination, on_gpu->gpu, query->datatype())) {
      continue;
    }
    on_gpu->output = KeepOnGpu(*destination, on_gpu);
    plan->output_on_gpu = true;
  }
}

}  // namespace

absl::Status ToNativeRequest(const inference::ModelInferRequest& request,
                             v1::MultiHeadAttentionRequest* native, OutputPlan* plan,
                             const SharedMemory* shared_memory, GpuTensors* on_gpu) {
  static const SharedMemory kOff(/*system_enabled=*/false, 0);
  const SharedMemory& regions = shared_memory != nullptr ? *shared_memory : kOff;
  RETURN_IF_ERROR(CheckKnownFields(request));
  if (request.model_name().empty()) {
    return Invalid("model_name is empty: name a loaded layer (see RepositoryIndex)");
  }
  native->set_layer(request.model_name());
  native->set_request_id(request.id());
  // Inputs in shared memory have no raw_input_contents entry (as tritonclient sends them).
  std::vector<std::optional<SharedMemorySlice>> sources(request.inputs_size());
  int outside = 0;
  uint64_t shared_bytes = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    ASSIGN_OR_RETURN(sources[i], SharedMemoryParameters(InputField(request.inputs(i)),
                                                        request.inputs(i).parameters(), regions));
    if (sources[i].has_value()) {
      shared_bytes += sources[i]->byte_size;
    } else {
      ++outside;
    }
  }
  if (shared_bytes > regions.max_call_bytes()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the inputs in shared memory hold ", shared_bytes, " bytes, past the ",
                     regions.max_call_bytes(), " a call may send (--max_message_bytes)"));
  }
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != outside) {
    return Invalid("raw_input_contents has ", request.raw_input_contents_size(), " entries for ",
                   outside, " inputs",
                   outside == request.inputs_size() ? "" : " outside shared memory",
                   "; give one per input");
  }
  const bool inputs_on_gpu = on_gpu != nullptr && InputsStayOnGpu(request, sources, on_gpu->gpu);
  const bool inputs_pinned = on_gpu != nullptr && on_gpu->pin != nullptr && !inputs_on_gpu &&
                             InputsGoPinned(request, sources);
  static const std::vector<std::string> kFloatTypes = {"FP32", "FP16", "BF16"};
  static const std::vector<std::string> kPaddingMaskTypes = {"BOOL", "INT64", "INT32"};
  static const std::vector<std::string> kAttnMaskTypes = {"BOOL", "FP32"};
  std::set<std::string> seen;
  v1::AttentionOptions* options = native->mutable_options();
  // An integer padding mask is a tokenizer's: 1 attends, whatever bool_mask_polarity says.
  bool tokenizer_mask = false;
  int raw_index = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const InputTensor& input = request.inputs(i);
    if ((raw || sources[i].has_value()) && input.has_contents()) {
      return Invalid("inputs[", Quoted(input.name()), "] has contents while ",
                     sources[i].has_value() ? "a shared memory region" : "raw_input_contents",
                     " is used; use one form");
    }
    if (!seen.insert(input.name()).second) {
      return Invalid("inputs[", Quoted(input.name()), "] is given twice");
    }
    std::string shared;
    RawBytes bytes;
    std::shared_ptr<char> pinned;
    if (sources[i].has_value() && inputs_pinned && IsQueryKeyOrValue(input)) {
      pinned = on_gpu->pin(sources[i]->byte_size);  // null: none to spare, read as usual
    }
    if (sources[i].has_value() && inputs_on_gpu && IsQueryKeyOrValue(input)) {
      const GpuBytes kept = KeepOnGpu(*sources[i], on_gpu);
      bytes.elsewhere = kept.size;
      (input.name() == kQuery ? on_gpu->query
                              : (input.name() == kKey ? on_gpu->key : on_gpu->value)) = kept;
    } else if (pinned != nullptr) {
      RETURN_IF_ERROR(ReadSliceInto(*sources[i], pinned.get()));
      bytes.elsewhere = sources[i]->byte_size;
      (input.name() == kQuery
           ? on_gpu->pinned_query
           : (input.name() == kKey ? on_gpu->pinned_key : on_gpu->pinned_value)) =
          PinnedBytes{std::move(pinned), sources[i]->byte_size};
    } else if (sources[i].has_value()) {
      RETURN_IF_ERROR(ReadSlice(*sources[i], &shared));
      bytes.slice = &shared;
    } else if (raw) {
      bytes.entry = &request.raw_input_contents(raw_index++);
    }
    if (input.name() == kQuery) {
      RETURN_IF_ERROR(ConvertInput(input, bytes, kFloatTypes, native->mutable_query()));
    } else if (input.name() == kKey) {
      RETURN_IF_ERROR(ConvertInput(input, bytes, kFloatTypes, native->mutable_key()));
    } else if (input.name() == kValue) {
      RETURN_IF_ERROR(ConvertInput(input, bytes, kFloatTypes, native->mutable_value()));
    } else if (input.name() == kKeyPaddingMask) {
      RETURN_IF_ERROR(
          ConvertInput(input, bytes, kPaddingMaskTypes, options->mutable_key_padding_mask()));
      tokenizer_mask = input.datatype() != "BOOL";
    } else if (input.name() == kAttnMask) {
      RETURN_IF_ERROR(ConvertInput(input, bytes, kAttnMaskTypes, options->mutable_attn_mask()));
    } else {
      return Invalid("inputs[", Quoted(input.name()), "] is not an input; expected query, key, "
                     "value, key_padding_mask or attn_mask");
    }
  }
  if (!seen.count(kQuery)) return Invalid("inputs has no \"query\"");
  std::optional<v1::NeedWeights> need_weights;
  RETURN_IF_ERROR(ConvertParameters(request, options, &need_weights, &plan->binary_data));
  if (tokenizer_mask) options->set_key_padding_polarity(v1::TRUE_ATTENDS);
  // JSON callers read fp32_contents; the protocol has no typed 16-bit field.
  if (!plan->binary_data) native->set_output_dtype(v1::FLOAT32);
  RETURN_IF_ERROR(PlanOutputs(request, regions, need_weights, plan, options));
  if (on_gpu != nullptr) PlaceOutputOnGpu(request, plan, on_gpu);
  return absl::OkStatus();
}

}  // namespace attention::server::kserve
