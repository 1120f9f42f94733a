// Reader and writer for the safetensors format (Hugging Face): an 8-byte little-endian header
// length N, N bytes of JSON header, then one byte buffer that the tensors tile exactly.
//
//   {"__metadata__": {"key": "value", ...},
//    "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//
// Offsets are relative to the start of the byte buffer. Files come from outside the server,
// so every field is checked before it is trusted: a malformed file is an INVALID_ARGUMENT
// naming the file and the problem, never a crash or an out-of-bounds read.
#ifndef ATTENTION_CORE_SAFETENSORS_H_
#define ATTENTION_CORE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace attention::core {

struct SafetensorsOptions {
  // Largest JSON header accepted, bytes. Guards against a corrupt or hostile length field
  // making the reader allocate or scan gigabytes. Default 100 MB, as the reference
  // implementation's limit; range [2, 2^32].
  int64_t max_header_bytes = 100'000'000;

  absl::Status Validate() const;
};

// One tensor of a file. `data` points into the file's mapping and is valid while the
// SafetensorsFile lives.
struct SafetensorsTensor {
  std::string name;
  // The dtype as written in the header ("F32", "I64", ...). Every dtype of the format is
  // accepted when the file is opened, so a checkpoint that also holds integer buffers (BERT's
  // position_ids) can still serve its attention weights; ReadFloats refuses any but
  // F32 / F16 / BF16 by name.
  std::string dtype;
  std::vector<int64_t> shape;
  absl::string_view data;
};

// A validated, memory-mapped safetensors file. Immutable; thread-safe.
//
// The mapping is read-only and private. Truncating the file on disk while it is mapped would
// make reads fault (SIGBUS), as with any mmap reader; the server only maps files inside its
// own model repository and copies the weights out before it serves them.
class SafetensorsFile {
 public:
  // Maps and validates the file at `path`. `display_name` names it in error messages
  // (defaults to `path`), so callers can avoid printing server-side absolute paths.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path, const SafetensorsOptions& options = {},
      absl::string_view display_name = {});
  // As Open, for a file descriptor the caller opened; the descriptor stays the caller's.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromDescriptor(
      int fd, absl::string_view display_name, const SafetensorsOptions& options = {});
  // Validates a file image already in memory; `bytes` must outlive the result.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBuffer(
      absl::string_view bytes, absl::string_view display_name,
      const SafetensorsOptions& options = {});

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& display_name() const { return display_name_; }
  // The "__metadata__" map (string to string); empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Sorted by name.
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const SafetensorsTensor* Find(const std::string& name) const;

  // The tensor's values widened to float32. INVALID_ARGUMENT naming the tensor and its dtype
  // for dtypes other than F32, F16 and BF16.
  absl::StatusOr<std::vector<float>> ReadFloats(const SafetensorsTensor& tensor) const;

 private:
  SafetensorsFile() = default;
  absl::Status Parse(absl::string_view bytes, const SafetensorsOptions& options);

  std::string display_name_;
  void* mapping_ = nullptr;  // owned when non-null; munmap'ed in the destructor
  size_t mapping_size_ = 0;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, SafetensorsTensor> tensors_;
};

// Bytes per element of a safetensors dtype name; 0 for names the format does not define.
int64_t SafetensorsElementSize(absl::string_view dtype);
// The safetensors name of `dtype`: "F32", "F16", "BF16" or "BOOL".
absl::string_view SafetensorsDTypeName(DType dtype);

// A tensor to write. `data` holds product(shape) little-endian elements of `dtype`.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  absl::string_view data;
};

// The bytes that precede the data buffer of a file holding `entries` in the given order:
// the 8-byte length and the JSON header, padded with spaces to a multiple of 8 so that the
// buffer starts aligned. Write this, then each entry's data in order. INVALID_ARGUMENT when
// an entry's byte count does not match its shape and dtype, or names repeat.
absl::StatusOr<std::string> SafetensorsHeader(absl::Span<const SafetensorsEntry> entries,
                                              const std::map<std::string, std::string>& metadata);
// The whole file image: header followed by every entry's data.
absl::StatusOr<std::string> SerializeSafetensors(
    absl::Span<const SafetensorsEntry> entries,
    const std::map<std::string, std::string>& metadata);

}  // namespace attention::core

#endif  // ATTENTION_CORE_SAFETENSORS_H_
