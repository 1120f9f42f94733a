// Translation between the Open Inference Protocol (KServe v2) and the native API: a
// ModelInferRequest becomes a MultiHeadAttentionRequest, so both protocols share one
// validation, batcher and error mapping, and the native answer becomes a ModelInferResponse.
//
// Mapping (each loaded layer is a model; its version is the layer version):
//   inputs   query [B, Nq, E] FP32 | FP16 | BF16; key [B, Nk, kdim] and value [B, Nk, vdim]
//            for cross-attention; key_padding_mask [B, Nk] BOOL (polarity below) or INT64 /
//            INT32 as a tokenizer's attention_mask (1 = attend, 0 = padding); attn_mask BOOL
//            or FP32 (additive), broadcastable to [B, H, Nq, Nk].
//            Contents in raw_input_contents (one entry per input outside shared memory),
//            the datatype's typed contents (fp32_contents, bool_contents, int64_contents,
//            int_contents for INT32; FP16 and BF16 have none; values in another typed field
//            are refused naming it) or a slice of a registered shared memory region.
//   outputs  output [B, Nq, output_dim]; attention_weights [B, Nq, Nk] averaged over heads
//            or [B, H, Nq, Nk] per head. Raw little-endian bytes unless binary_data_output
//            is false (then FP32 in contents.fp32_contents, for JSON callers); an output
//            with shared memory parameters is written there (raw bytes) and its
//            raw_output_contents entry left empty.
//   request parameters
//            causal (bool), scale (double), need_weights ("none" | "averaged" |
//            "per_head", or bool), bool_mask_polarity ("true_masks_out", the default as
//            PyTorch's MultiheadAttention, or "true_attends" as SDPA), binary_data_output
//            (bool, default true), timeout (int64 µs in the queue, Triton's), priority
//            (Triton's: 0 = none, 1 = first; any priority runs before requests without one).
//   input and output parameters
//            binary_data_size (inputs; the KServe SDK sends it): the raw entry's size;
//            shared_memory_region, shared_memory_byte_size, shared_memory_offset (Triton's
//            system and CUDA shared memory; see shared_memory.h).
#ifndef ATTENTION_SERVER_KSERVE_KSERVE_CONVERT_H_
#define ATTENTION_SERVER_KSERVE_KSERVE_CONVERT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attention/v1/attention.pb.h"
#include "core/mha_layer.h"
#include "inference/grpc_service.pb.h"
#include "server/kserve/shared_memory.h"
#include "server/validation/input_decoding.h"

namespace attention::server::kserve {

// The inputs' names.
inline constexpr char kQuery[] = "query";
inline constexpr char kKey[] = "key";
inline constexpr char kValue[] = "value";
inline constexpr char kKeyPaddingMask[] = "key_padding_mask";
inline constexpr char kAttnMask[] = "attn_mask";
// The input or output parameter naming a registered shared memory region (Triton's).
inline constexpr char kRegionParameter[] = "shared_memory_region";
inline constexpr char kOutputName[] = "output";
inline constexpr char kWeightsName[] = "attention_weights";

// Which outputs a ModelInfer call answers with, in order, and how.
struct OutputPlan {
  std::vector<std::string> names;
  // Per name: the shared memory it is written to instead of the response, if any.
  std::vector<std::optional<SharedMemorySlice>> destinations;
  bool binary_data = true;
  // The output's destination is GPU memory that the layer writes itself (GpuTensors).
  bool output_on_gpu = false;
};

// Fills `native` (and `plan`) from `request`, reading inputs in shared memory from
// `shared_memory` (null: off); INVALID_ARGUMENT or UNIMPLEMENTED naming the input,
// parameter or output and its values otherwise (NOT_FOUND for an unknown region).
// With `on_gpu`, whose `gpu` is the GPU the layer runs on (core::Backend::InPlaceGpu; -1:
// none), tensors in CUDA shared memory on that GPU stay there for the layer to read and
// write in place: query, key and value when every one given is in such a region, in one
// float datatype at offsets aligned to it (their native tensors then have no bytes), and
// the output when its destination is and its answer is FP32 or BF16 raw bytes. Else, when
// every query, key and value given is in system shared memory and `on_gpu->pin` gives
// page-locked memory, they are read straight into it (one DMA each to the GPU).
absl::Status ToNativeRequest(const inference::ModelInferRequest& request,
                             v1::MultiHeadAttentionRequest* native, OutputPlan* plan,
                             const SharedMemory* shared_memory = nullptr,
                             GpuTensors* on_gpu = nullptr);

// `status` of the native request ToNativeRequest made from `request`, its message in the
// protocol's names: query.raw_data -> raw_input_contents[0] (inputs["query"]),
// options.attn_mask -> inputs["attn_mask"], layer -> model_name, request_id -> id,
// FLOAT32 -> FP32. The code is kept.
absl::Status ToKserveStatus(const absl::Status& status,
                            const inference::ModelInferRequest& request);

// Moves the native answer's tensors into `response`, or writes them to shared memory, as
// `plan` says; an error when a shared memory slice cannot take its output.
absl::Status ToInferResponse(v1::MultiHeadAttentionResponse& native, const OutputPlan& plan,
                             const std::string& model_name,
                             inference::ModelInferResponse* response);

// The protocol's datatype name of a native dtype (core::DTypeInfo::kserve_name: "FP32",
// "FP16", "BF16", "BOOL"); "" for DATA_TYPE_UNSPECIFIED.
const char* DatatypeName(v1::DataType dtype);

// Inputs and outputs of a layer as ModelMetadata lists them.
void DescribeModel(const core::MhaConfig& config, inference::ModelMetadataResponse* metadata);

}  // namespace attention::server::kserve

#endif  // ATTENTION_SERVER_KSERVE_KSERVE_CONVERT_H_
