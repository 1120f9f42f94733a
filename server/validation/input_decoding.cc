#include "server/validation/input_decoding.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/half_bits.h"
#include "core/status_macros.h"
#include "server/validation/request_validation.h"
#include "tensor_codec.h"

namespace attention::server {
namespace {

// Whether `bytes` may be read in place as elements of T.
template <typename T>
bool AlignedFor(absl::string_view bytes) {
  return reinterpret_cast<uintptr_t>(bytes.data()) % alignof(T) == 0;
}

// DecodeTensor of a checked `tensor` of `count` values of `dtype`, its raw bytes `raw`.
absl::StatusOr<DecodedTensor> DecodeChecked(const v1::Tensor& tensor, absl::string_view field,
                                            absl::string_view raw, core::DType dtype, int64_t count,
                                            const TensorDecoding& how) {
  DecodedTensor decoded;
  decoded.shape.assign(tensor.shape().begin(), tensor.shape().end());
  const size_t elements = static_cast<size_t>(count);
  if (how.keep_half && dtype != core::DType::kFloat32) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(raw.data());
    if (how.borrow && AlignedFor<uint16_t>(raw)) {
      decoded.borrowed_half = absl::MakeConstSpan(bits, elements);
    } else {
      decoded.half.resize(elements);
      std::memcpy(decoded.half.data(), raw.data(), elements * sizeof(uint16_t));
      bits = decoded.half.data();
    }
    if (how.reject_non_finite &&
        core::AnyHalfBitsNonFinite(bits, elements, dtype == core::DType::kBFloat16)) {
      // Widened, the float32 check names the index and the value.
      TensorDecoding widened = how;
      widened.keep_half = false;
      return DecodeChecked(tensor, field, raw, dtype, count, widened).status();
    }
    return decoded;
  }
  absl::Span<const float> values;
  if (how.borrow && dtype == core::DType::kFloat32 && tensor.float_data_size() == 0 &&
      AlignedFor<float>(raw)) {
    decoded.borrowed = absl::MakeConstSpan(reinterpret_cast<const float*>(raw.data()), elements);
    values = decoded.borrowed;
  } else {
    if (tensor.float_data_size() > 0) {
      decoded.values.assign(tensor.float_data().begin(), tensor.float_data().end());
    } else {
      ASSIGN_OR_RETURN(decoded.values, core::DecodeFloats(raw, dtype, field));
    }
    values = decoded.values;
  }
  if (how.reject_non_finite) RETURN_IF_ERROR(CheckFinite(values, decoded.shape, field));
  return decoded;
}

}  // namespace

core::DType HalfDType(const v1::Tensor& tensor) {
  if (tensor.float_data_size() > 0) return core::DType::kFloat32;
  if (tensor.dtype() == v1::FLOAT16) return core::DType::kFloat16;
  if (tensor.dtype() == v1::BFLOAT16) return core::DType::kBFloat16;
  return core::DType::kFloat32;
}

absl::StatusOr<DecodedTensor> DecodeTensor(const v1::Tensor& tensor, absl::string_view field,
                                           const TensorDecoding& how) {
  // Presence, shape, one of float_data and raw_data, a float dtype, the byte count.
  core::DType dtype;
  ASSIGN_OR_RETURN(const int64_t count, wire::CheckFloatTensor(tensor, field, &dtype));
  return DecodeChecked(tensor, field, tensor.raw_data(), dtype, count, how);
}

absl::StatusOr<DecodedTensor> DecodePinnedTensor(const v1::Tensor& tensor, absl::string_view field,
                                                 const PinnedBytes& bytes,
                                                 const TensorDecoding& how) {
  core::DType dtype;
  ASSIGN_OR_RETURN(const int64_t count,
                   wire::CheckFloatTensorBytes(tensor, field, bytes.size, &dtype));
  TensorDecoding in_place = how;
  in_place.borrow = true;
  return DecodeChecked(tensor, field, absl::string_view(bytes.buffer.get(), bytes.size), dtype,
                       count, in_place);
}

char* GpuBytes::data() const { return memory->data() + offset; }

absl::StatusOr<DecodedTensor> DecodeGpuTensor(const v1::Tensor& tensor, absl::string_view field,
                                              const GpuBytes& bytes, const TensorDecoding& how) {
  core::DType dtype;
  ASSIGN_OR_RETURN(const int64_t count,
                   wire::CheckFloatTensorBytes(tensor, field, bytes.size, &dtype));
  if (dtype != core::DType::kFloat32 && !how.keep_half) {
    return absl::InternalError(absl::StrCat(field, " is ", core::DTypeName(dtype),
                                            " in GPU memory, which only the GPU can widen"));
  }
  DecodedTensor decoded;
  decoded.shape.assign(tensor.shape().begin(), tensor.shape().end());
  if (how.reject_non_finite) {
    ASSIGN_OR_RETURN(const int64_t first, bytes.memory->FindNonFinite(bytes.offset, count, dtype));
    if (first >= 0) {
      const int64_t element_bytes = core::ElementSize(dtype);
      std::string value(element_bytes, '\0');
      RETURN_IF_ERROR(bytes.memory->CopyToHost(bytes.offset + first * element_bytes, element_bytes,
                                               value.data()));
      ASSIGN_OR_RETURN(const std::vector<float> widened, core::DecodeFloats(value, dtype, field));
      return NonFiniteAt(field, decoded.shape, first, widened[0]);
    }
  }
  if (dtype == core::DType::kFloat32) {
    decoded.borrowed = absl::MakeConstSpan(reinterpret_cast<const float*>(bytes.data()), count);
  } else {
    decoded.borrowed_half =
        absl::MakeConstSpan(reinterpret_cast<const uint16_t*>(bytes.data()), count);
  }
  return decoded;
}

}  // namespace attention::server
