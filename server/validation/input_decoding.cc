#include "server/validation/input_decoding.h"

#include <cstring>
#include <string>

#include "core/half_bits.h"
#include "core/status_macros.h"
#include "server/validation/request_validation.h"
#include "tensor_codec.h"

namespace attention::server {
namespace {

// Whether `bytes` may be read in place as elements of T.
template <typename T>
bool AlignedFor(const std::string& bytes) {
  return reinterpret_cast<uintptr_t>(bytes.data()) % alignof(T) == 0;
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
  DecodedTensor decoded;
  decoded.shape.assign(tensor.shape().begin(), tensor.shape().end());
  const std::string& raw = tensor.raw_data();
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
      return DecodeTensor(tensor, field, widened).status();
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

}  // namespace attention::server
