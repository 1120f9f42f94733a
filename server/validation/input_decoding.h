// The one stage that decodes a request's float tensors (query, key, value, hidden states)
// from the wire: presence, shape, dtype, byte count, borrow or copy, 16-bit bits kept or
// widened, and the non-finite check, in one call per tensor. Every front-end calls it with
// its field names (the KServe front-end through its native request).
#ifndef ATTENTION_SERVER_VALIDATION_INPUT_DECODING_H_
#define ATTENTION_SERVER_VALIDATION_INPUT_DECODING_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"
#include "core/cuda/cuda_backend.h"
#include "core/dtype.h"

namespace attention::server {

// How a tensor is decoded.
struct TensorDecoding {
  // FLOAT16 / BFLOAT16 raw_data kept as its bits (for a backend that widens them on its
  // device: half the bytes to copy); anything else is widened to float32.
  bool keep_half = false;
  // raw_data read in place where its alignment allows (no copy): the request must then
  // outlive every use of the decoded spans.
  bool borrow = false;
  // NaN and infinities refused, naming the index (RequestBudget::reject_non_finite).
  bool reject_non_finite = true;
};

// A decoded tensor: float32 values, or the 16-bit bits as sent (`keep_half`), each either
// owned (`values`, `half`) or read in place from the request (`borrowed`, `borrowed_half`).
struct DecodedTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
  std::vector<uint16_t> half;
  absl::Span<const float> borrowed;
  absl::Span<const uint16_t> borrowed_half;

  // The float32 values, wherever they are; `values` once moved to `stored`.
  absl::Span<const float> Floats(const std::vector<float>& stored) const {
    return borrowed.data() != nullptr ? borrowed : absl::Span<const float>(stored);
  }
  // The same for 16-bit values; `half` once moved to `stored`.
  absl::Span<const uint16_t> HalfBits(const std::vector<uint16_t>& stored) const {
    return borrowed_half.data() != nullptr ? borrowed_half : absl::Span<const uint16_t>(stored);
  }
};

// A tensor's bytes in a GPU's memory: a slice of a CUDA shared memory region, which a layer
// on that GPU reads or writes in place (core::MhaInput::inputs_on_gpu). `field` names it in
// messages (outputs["output"]).
struct GpuBytes {
  const core::SharedDeviceMemory* memory = nullptr;
  uint64_t offset = 0;
  uint64_t size = 0;
  std::string field;

  char* data() const;
};

// A tensor's bytes read into page-locked host memory of the layer's backend (core::Backend::
// PinnedHostBuffer), from which its GPU copies them in one DMA.
struct PinnedBytes {
  std::shared_ptr<char> buffer;
  uint64_t size = 0;
};

// The tensors of a MultiHeadAttention call that the GPU its layer runs on (`gpu`: core::
// Backend::InPlaceGpu) reads straight: query, key and value (all that the call gives, or
// none) in its memory or, read from system shared memory, in page-locked host memory that
// `pin` gives (the layer backend's PinnedHostBuffer; null: none); and the output's
// destination in its memory. `regions` keeps the GPU memory open for the call.
struct GpuTensors {
  int gpu = -1;
  std::function<std::shared_ptr<char>(size_t bytes)> pin;
  std::optional<GpuBytes> query, key, value, output;
  std::optional<PinnedBytes> pinned_query, pinned_key, pinned_value;
  std::vector<std::shared_ptr<const void>> regions;

  bool inputs() const { return query.has_value(); }
  bool pinned_inputs() const { return pinned_query.has_value(); }
};

// The 16-bit dtype `tensor` is sent in as raw data, or kFloat32 when it is not.
core::DType HalfDType(const v1::Tensor& tensor);

// `tensor` decoded as `how` says, or INVALID_ARGUMENT naming `field` (e.g. "query",
// "steps[2].hidden_states") and the values at fault. With `keep_half`, a FLOAT16 or
// BFLOAT16 tensor keeps its bits; the caller keeps half only when every tensor it pairs
// shares that dtype.
absl::StatusOr<DecodedTensor> DecodeTensor(const v1::Tensor& tensor, absl::string_view field,
                                           const TensorDecoding& how);

// The same for a tensor whose bytes are `bytes` on a GPU (its raw_data empty): shape, a
// float dtype, the byte count and the non-finite check (on the GPU) as DecodeTensor makes
// them, the values left where they are: `borrowed` or, 16-bit, `borrowed_half` are then GPU
// addresses. A 16-bit tensor needs `keep_half` (the host cannot widen it).
absl::StatusOr<DecodedTensor> DecodeGpuTensor(const v1::Tensor& tensor, absl::string_view field,
                                              const GpuBytes& bytes, const TensorDecoding& how);

// DecodeTensor of a tensor whose raw bytes are `bytes` (its raw_data empty), read in place
// where the alignment allows (the buffer then outlives every use of the decoded spans).
absl::StatusOr<DecodedTensor> DecodePinnedTensor(const v1::Tensor& tensor, absl::string_view field,
                                                 const PinnedBytes& bytes,
                                                 const TensorDecoding& how);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_VALIDATION_INPUT_DECODING_H_
