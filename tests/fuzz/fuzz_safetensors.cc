// libFuzzer target: safetensors files from arbitrary bytes (header JSON, offsets, dtypes,
// shapes), then every tensor read as floats. Seeds: tests/fuzz/corpus/safetensors/.
#include <cstddef>
#include <cstdint>

#include "core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto file = attention::core::SafetensorsFile::FromBuffer(bytes, "fuzz.safetensors");
  if (!file.ok()) return 0;
  for (const auto& [name, tensor] : (*file)->tensors()) {
    auto values = (*file)->ReadFloats(tensor);
    (void)values;
  }
  return 0;
}
