#include "tensor_codec.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace attention::wire {

using core::DType;

absl::StatusOr<DType> ConvertDType(v1::DataType dtype, absl::string_view field) {
  if (dtype == v1::DATA_TYPE_UNSPECIFIED) {
    return Invalid(field, " is DATA_TYPE_UNSPECIFIED; expected FLOAT32, FLOAT16 or BFLOAT16");
  }
  const core::DTypeInfo* info = core::FindDType(v1::DataType_Name(dtype), &core::DTypeInfo::name);
  if (info == nullptr) {
    return Invalid(field, " = ", static_cast<int>(dtype), " is not a known DataType");
  }
  return info->dtype;
}

v1::DataType WireDType(DType dtype) {
  v1::DataType wire = v1::DATA_TYPE_UNSPECIFIED;
  v1::DataType_Parse(core::Info(dtype).name, &wire);
  return wire;
}

absl::StatusOr<int64_t> ElementCount(absl::Span<const int64_t> shape, absl::string_view field,
                                     ShapeRule rule) {
  if (shape.empty() && rule == ShapeRule::kPositive) {
    return Invalid(field, ".shape is empty: the tensor is missing or has rank 0");
  }
  const int64_t min_dim = rule == ShapeRule::kPositive ? 1 : 0;
  int64_t count = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t dim = shape[d];
    if (dim < min_dim) {
      return Invalid(field, ".shape[", d, "] = ", dim,
                     rule == ShapeRule::kPositive ? " must be >= 1" : " is negative");
    }
    if (dim > kMaxTensorElements || (dim > 0 && count > kMaxTensorElements / dim)) {
      return Invalid(field, ".shape ", ShapeString(shape), " has more than ", kMaxTensorElements,
                     " elements");
    }
    count *= dim;
  }
  return count;
}

absl::StatusOr<int64_t> CheckShape(const v1::Tensor& tensor, absl::string_view field) {
  return ElementCount(tensor.shape(), field);
}

absl::Status CheckByteCount(size_t bytes, int64_t count, int64_t element_size,
                            absl::string_view bytes_field,
                            absl::FunctionRef<std::string(int64_t expected)> needs) {
  const int64_t expected = count * element_size;
  if (bytes == static_cast<uint64_t>(expected)) return absl::OkStatus();
  return Invalid(bytes_field, " has ", bytes, " bytes; ", needs(expected));
}

namespace {

// CheckByteCount of a wire tensor's `raw_bytes` raw bytes of `dtype`, wherever they are.
absl::Status CheckRawByteCount(const v1::Tensor& tensor, uint64_t raw_bytes, DType dtype,
                               int64_t count, absl::string_view field) {
  return CheckByteCount(raw_bytes, count, core::ElementSize(dtype),
                        absl::StrCat(field, ".raw_data"), [&](int64_t expected) {
                          return absl::StrCat("shape ", ShapeString(tensor.shape()), " of ",
                                              core::DTypeName(dtype), " needs ", expected);
                        });
}

// The dtype of a tensor's raw float bytes: FLOAT32, FLOAT16 or BFLOAT16.
absl::StatusOr<DType> RawFloatDType(const v1::Tensor& tensor, absl::string_view field) {
  ASSIGN_OR_RETURN(const DType dtype, ConvertDType(tensor.dtype(), absl::StrCat(field, ".dtype")));
  if (dtype == DType::kBool) {
    return Invalid(field, ".dtype is BOOL; expected FLOAT32, FLOAT16 or BFLOAT16");
  }
  return dtype;
}

}  // namespace

absl::Status CheckByteCount(const v1::Tensor& tensor, DType dtype, int64_t count,
                            absl::string_view field) {
  return CheckRawByteCount(tensor, tensor.raw_data().size(), dtype, count, field);
}

bool HasContent(const v1::Tensor& tensor) {
  return tensor.shape_size() > 0 || !tensor.raw_data().empty() || tensor.float_data_size() > 0;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<int64_t> CheckFloatTensor(const v1::Tensor& tensor, absl::string_view field,
                                         DType* dtype) {
  if (!HasContent(tensor)) return Invalid(field, " is missing");
  ASSIGN_OR_RETURN(const int64_t count, CheckShape(tensor, field));
  DType values_dtype = DType::kFloat32;
  if (tensor.float_data_size() > 0) {
    if (!tensor.raw_data().empty()) {
      return Invalid(field, " has both raw_data and float_data; give exactly one");
    }
    if (tensor.dtype() != v1::FLOAT32 && tensor.dtype() != v1::DATA_TYPE_UNSPECIFIED) {
      return Invalid(field, ".float_data needs dtype FLOAT32, not ",
                     v1::DataType_Name(tensor.dtype()));
    }
    if (tensor.float_data_size() != count) {
      return Invalid(field, ".float_data has ", tensor.float_data_size(), " values; shape ",
                     ShapeString(tensor.shape()), " needs ", count);
    }
  } else {
    ASSIGN_OR_RETURN(values_dtype, RawFloatDType(tensor, field));
    RETURN_IF_ERROR(CheckByteCount(tensor, values_dtype, count, field));
  }
  if (dtype != nullptr) *dtype = values_dtype;
  return count;
}

absl::StatusOr<int64_t> CheckFloatTensorBytes(const v1::Tensor& tensor, absl::string_view field,
                                              uint64_t raw_bytes, DType* dtype) {
  ASSIGN_OR_RETURN(const int64_t count, CheckShape(tensor, field));
  ASSIGN_OR_RETURN(*dtype, RawFloatDType(tensor, field));
  RETURN_IF_ERROR(CheckRawByteCount(tensor, raw_bytes, *dtype, count, field));
  return count;
}

absl::StatusOr<FloatTensor> DecodeFloatTensor(const v1::Tensor& tensor, absl::string_view field) {
  DType dtype;
  RETURN_IF_ERROR(CheckFloatTensor(tensor, field, &dtype).status());
  FloatTensor result;
  result.shape.assign(tensor.shape().begin(), tensor.shape().end());
  if (tensor.float_data_size() > 0) {
    result.values.assign(tensor.float_data().begin(), tensor.float_data().end());
  } else {
    ASSIGN_OR_RETURN(result.values, core::DecodeFloats(tensor.raw_data(), dtype, field));
  }
  return result;
}

void EncodeTensor(absl::Span<const float> values, absl::Span<const int64_t> shape,
                  core::DType dtype, v1::Tensor* tensor) {
  tensor->set_dtype(WireDType(dtype));
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  tensor->set_raw_data(core::EncodeFloats(values, dtype));
}

namespace {

// `tensor` set to `dtype` and `shape` with zeroed raw bytes, returned as elements of T.
template <typename T>
absl::Span<T> ResizeTensor(absl::Span<const int64_t> shape, v1::DataType dtype,
                           v1::Tensor* tensor) {
  // raw_data is little-endian, as this host's numbers are (core/dtype.cc asserts it), and
  // its heap bytes are aligned for floats.
  int64_t count = 1;
  for (const int64_t dim : shape) count *= dim;
  tensor->set_dtype(dtype);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* bytes = tensor->mutable_raw_data();
  bytes->resize(static_cast<size_t>(count) * sizeof(T));
  return absl::MakeSpan(reinterpret_cast<T*>(bytes->data()), static_cast<size_t>(count));
}

}  // namespace

absl::Span<float> ResizeFloat32Tensor(absl::Span<const int64_t> shape, v1::Tensor* tensor) {
  return ResizeTensor<float>(shape, v1::FLOAT32, tensor);
}

absl::Span<uint16_t> ResizeBFloat16Tensor(absl::Span<const int64_t> shape, v1::Tensor* tensor) {
  return ResizeTensor<uint16_t>(shape, v1::BFLOAT16, tensor);
}

}  // namespace attention::wire
