// Wire tensors (attention.v1.Tensor) to and from float32 values, with validation that
// names the field and the numbers. Shared by the server and the C++ client.
#ifndef ATTENTION_PROTO_TENSOR_CODEC_H_
#define ATTENTION_PROTO_TENSOR_CODEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"
#include "core/dtype.h"

namespace attention::wire {

// Largest tensor accepted, in elements; keeps size arithmetic far from overflow.
inline constexpr int64_t kMaxTensorElements = int64_t{1} << 31;

// The gRPC message limit both sides use unless told otherwise (--max_message_bytes, the
// clients' max_message_bytes): 64 MiB.
inline constexpr int64_t kDefaultMaxMessageBytes = int64_t{64} << 20;

struct FloatTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// The wire's dtypes are core's (core::kDTypes), each DataType value named as its dtype.
absl::StatusOr<core::DType> ConvertDType(v1::DataType dtype, absl::string_view field);
v1::DataType WireDType(core::DType dtype);

// Which shapes a caller may send. kPositive, the native API's: rank >= 1 and every
// dimension >= 1. kNonNegative, a KServe input's: a scalar (rank 0) or a zero dimension
// passes the protocol conversion (the native decode then refuses it); only a negative
// dimension is refused there.
enum class ShapeRule { kPositive, kNonNegative };

// The one shape rule: the element count of `shape`, or INVALID_ARGUMENT naming `field`
// (e.g. "query", "inputs[\"query\"]") when `rule` refuses it or it holds more than
// kMaxTensorElements, so that no size derived from it can overflow.
absl::StatusOr<int64_t> ElementCount(absl::Span<const int64_t> shape, absl::string_view field,
                                     ShapeRule rule = ShapeRule::kPositive);
// ElementCount of a wire tensor's shape under kPositive.
absl::StatusOr<int64_t> CheckShape(const v1::Tensor& tensor, absl::string_view field);
// The one byte-count rule: OK when `bytes` are exactly `count` elements (an ElementCount,
// so the product cannot overflow) of `element_size` bytes; else INVALID_ARGUMENT
// "<bytes_field> has <bytes> bytes; <needs(expected bytes)>", each front-end naming its
// field and what the bytes needed are.
absl::Status CheckByteCount(size_t bytes, int64_t count, int64_t element_size,
                            absl::string_view bytes_field,
                            absl::FunctionRef<std::string(int64_t expected)> needs);
// The same for a wire tensor's raw_data of `dtype`: "<field>.raw_data has 3 bytes; shape
// [1, 2] of FLOAT32 needs 8".
absl::Status CheckByteCount(const v1::Tensor& tensor, core::DType dtype, int64_t count,
                            absl::string_view field);
// True when any part of the tensor is set.
bool HasContent(const v1::Tensor& tensor);
std::string ShapeString(absl::Span<const int64_t> shape);

// Every check DecodeFloatTensor makes, without decoding (for callers that read the values
// in place or keep 16-bit ones): present, shape, values in exactly one of float_data and
// raw_data, a float dtype, as many as the shape needs. Returns the element count and sets
// `*dtype` (when given) to the dtype the values are in (kFloat32 for float_data).
absl::StatusOr<int64_t> CheckFloatTensor(const v1::Tensor& tensor, absl::string_view field,
                                         core::DType* dtype = nullptr);
// The same for a tensor whose `raw_bytes` raw bytes lie elsewhere (its raw_data and
// float_data empty; messages still name raw_data).
absl::StatusOr<int64_t> CheckFloatTensorBytes(const v1::Tensor& tensor, absl::string_view field,
                                              uint64_t raw_bytes, core::DType* dtype);

// Checks dtype, shape and byte count of `tensor` (CheckFloatTensor) and returns its float32
// values. `field` is the request field name used in error messages, e.g. "query".
absl::StatusOr<FloatTensor> DecodeFloatTensor(const v1::Tensor& tensor, absl::string_view field);

// Writes `values` with `shape` as little-endian raw bytes of `dtype`.
void EncodeTensor(absl::Span<const float> values, absl::Span<const int64_t> shape,
                  core::DType dtype, v1::Tensor* tensor);

// Sets `tensor` to FLOAT32 of `shape` with zeroed raw bytes for the caller to fill, and
// returns them as floats: an answer computed straight into the message that carries it.
absl::Span<float> ResizeFloat32Tensor(absl::Span<const int64_t> shape, v1::Tensor* tensor);
// The same for a BFLOAT16 answer, its raw bytes as bf16 bit patterns.
absl::Span<uint16_t> ResizeBFloat16Tensor(absl::Span<const int64_t> shape, v1::Tensor* tensor);

}  // namespace attention::wire

#endif  // ATTENTION_PROTO_TENSOR_CODEC_H_
