// The server's model repository (--model_repository): a directory of safetensors checkpoints
// that LoadLayer may name by relative path, and the layers persisted with persist = true.
//
//   <root>/any/path.safetensors          checkpoints the operator puts there
//   <root>/persisted/<name>.safetensors  one file per persisted layer, written by the server:
//                                        this project's tensor names (WEIGHT_NAMING_NATIVE,
//                                        float32) and the resolved LayerConfig as proto3 JSON
//                                        in __metadata__["attention_service.layer_config"],
//                                        the layer's own batching limits (a BatchingPolicy
//                                        as proto3 JSON, only the fields it sets) in
//                                        __metadata__["attention_service.batching"]
//
// Persisted layers live in their own directory so that start-up never mistakes an operator's
// checkpoint for a layer to load, and a persisted file is itself a valid checkpoint.
#ifndef ATTENTION_SERVER_MODELS_MODEL_REPOSITORY_H_
#define ATTENTION_SERVER_MODELS_MODEL_REPOSITORY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/mha_layer.h"
#include "core/devices.h"
#include "core/safetensors.h"
#include "server/models/batch_limits.h"

namespace attention::server {

inline constexpr char kPersistedDir[] = "persisted";
inline constexpr char kLayerConfigKey[] = "attention_service.layer_config";
inline constexpr char kBatchingKey[] = "attention_service.batching";
// The device LoadLayerRequest named; absent when it named none.
inline constexpr char kDeviceKey[] = "attention_service.device";
inline constexpr char kLayerNameKey[] = "attention_service.layer_name";
inline constexpr char kFormatVersionKey[] = "attention_service.format_version";

// Thread-safe: holds no mutable state. Writers of the same layer name must be serialized by
// the caller (LayerRegistry does).
class ModelRepository {
 public:
  // `root` must be an existing directory; it is canonicalized once here, so a root that is
  // itself a symlink (a Kubernetes volume mount) works.
  static absl::StatusOr<std::unique_ptr<ModelRepository>> Open(
      const std::string& root, const core::SafetensorsOptions& options = {});

  // Canonical absolute path of the root.
  const std::string& root() const { return root_; }

  // Maps a safetensors file given by a path relative to the root. `field` names the request
  // field in errors. INVALID_ARGUMENT for an empty or absolute path, a ".." component, a
  // directory or a malformed file; PERMISSION_DENIED when the path leaves the root through a
  // symlink; NOT_FOUND when nothing is there.
  absl::StatusOr<std::unique_ptr<core::SafetensorsFile>> OpenSafetensors(
      absl::string_view path, absl::string_view field) const;

  // Whether `path` (relative, confined as OpenSafetensors) is a directory. NOT_FOUND when
  // nothing is there.
  absl::StatusOr<bool> IsDirectory(absl::string_view path, absl::string_view field) const;

  // The contents of a small file (a checkpoint's config.json), confined as OpenSafetensors.
  // INVALID_ARGUMENT for a directory or a file over `max_bytes`.
  absl::StatusOr<std::string> ReadSmallFile(absl::string_view path, absl::string_view field,
                                            int64_t max_bytes) const;

  // Writes layer `name` to persisted/<name>.safetensors atomically: a temporary file in the
  // same directory, fsync, rename over the old file, fsync of the directory. A crash at any
  // point leaves either the old file or the new one, never a mix. RESOURCE_EXHAUSTED when
  // the disk is full, INTERNAL for other I/O errors; the message names the file.
  // `requested_device` is the device LoadLayerRequest named ("" for none: the layer then
  // follows the server's --device after a restart).
  absl::Status Persist(const std::string& name, const core::MhaLayer& layer,
                       const BatchLimitOverrides& batching = {},
                       const std::string& requested_device = "") const;
  // Removes persisted/<name>.safetensors; OK when there is none.
  absl::Status RemovePersisted(const std::string& name) const;

  struct PersistedLayer {
    std::string name;
    std::shared_ptr<const core::MhaLayer> layer;
    BatchLimitOverrides batching;
    // Why the layer is not on its requested device (that device cannot be used now); "".
    std::string placement_problem;
  };
  // Every persisted layer that reads back cleanly, sorted by name. Each file that does not
  // (truncated, corrupt, not a layer) is skipped and described in `problems`; leftover
  // temporary files of interrupted writes are removed and reported there too. Placement as
  // ReadPersisted's, whose placement problems are reported in `problems` too.
  std::vector<PersistedLayer> LoadPersisted(
      core::Devices& devices, const std::shared_ptr<const core::Backend>& default_backend,
      std::vector<std::string>* problems) const;

  // Reads one persisted layer back onto the device its LoadLayerRequest named, or onto
  // `default_backend` when it named none or that device cannot be used here (a GPU gone
  // since): the layer keeps serving, and `placement_problem` says why it moved; the file
  // is kept as it is, so the layer returns to its device once that device is back. A file
  // without batching metadata (written before it existed) has no overrides.
  absl::StatusOr<PersistedLayer> ReadPersisted(
      const std::string& name, core::Devices& devices,
      const std::shared_ptr<const core::Backend>& default_backend) const;

 private:
  ModelRepository(std::string root, const core::SafetensorsOptions& options)
      : root_(std::move(root)), options_(options) {}
  // Opens `path` (relative) read-only after confining it to the root; returns the fd.
  absl::StatusOr<int> OpenConfined(absl::string_view path, absl::string_view field) const;
  bool InsideRoot(absl::string_view absolute) const;

  std::string root_;
  core::SafetensorsOptions options_;
};

// "persisted/<name>.safetensors", relative to the root.
std::string PersistedPath(absl::string_view name);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_MODELS_MODEL_REPOSITORY_H_
