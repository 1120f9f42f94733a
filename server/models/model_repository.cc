#include "server/models/model_repository.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/dtype.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"
#include "server/models/layer_config.h"
#include "server/models/weight_naming.h"

namespace attention::server {
namespace {

constexpr char kSuffix[] = ".safetensors";
constexpr char kTempMarker[] = ".tmp.";

// I/O failures while writing: a full disk is a configured limit (RESOURCE_EXHAUSTED, so it is
// not paged as an outage); anything else is INTERNAL.
absl::Status WriteError(int error, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  if (error == ENOSPC || error == EDQUOT) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status WriteAll(int fd, absl::string_view bytes, absl::string_view what) {
  while (!bytes.empty()) {
    const ssize_t written = ::write(fd, bytes.data(), bytes.size());
    if (written < 0) {
      if (errno == EINTR) continue;
      return WriteError(errno, what);
    }
    bytes.remove_prefix(static_cast<size_t>(written));
  }
  return absl::OkStatus();
}

absl::Status FsyncDirectory(const std::string& dir, absl::string_view what) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return WriteError(errno, what);
  const int result = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  return result == 0 ? absl::OkStatus() : WriteError(error, what);
}

// Closes a descriptor when it goes out of scope.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  int fd_;
};

}  // namespace

std::string PersistedPath(absl::string_view name) {
  return absl::StrCat(kPersistedDir, "/", name, kSuffix);
}

absl::StatusOr<std::unique_ptr<ModelRepository>> ModelRepository::Open(
    const std::string& root, const core::SafetensorsOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  char resolved[PATH_MAX];
  if (root.empty() || ::realpath(root.c_str(), resolved) == nullptr) {
    return Invalid("model_repository = \"", root, "\" does not exist",
                   root.empty() ? "" : absl::StrCat(": ", std::strerror(errno)));
  }
  struct stat info;
  if (::stat(resolved, &info) != 0 || !S_ISDIR(info.st_mode)) {
    return Invalid("model_repository = \"", root, "\" is not a directory");
  }
  return std::unique_ptr<ModelRepository>(new ModelRepository(resolved, options));
}

bool ModelRepository::InsideRoot(absl::string_view absolute) const {
  if (root_ == "/") return true;
  return absolute == root_ ||
         (absl::StartsWith(absolute, root_) && absolute.size() > root_.size() &&
          absolute[root_.size()] == '/');
}

absl::StatusOr<int> ModelRepository::OpenConfined(absl::string_view path,
                                                  absl::string_view field) const {
  if (path.empty()) return Invalid(field, " is empty; give a path relative to the model repository");
  if (path.find('\0') != absl::string_view::npos) return Invalid(field, " contains a NUL byte");
  if (path.front() == '/') {
    return Invalid(field, " = \"", path,
                   "\" is absolute; give a path relative to the model repository");
  }
  for (absl::string_view component : absl::StrSplit(path, '/')) {
    if (component == "..") {
      return Invalid(field, " = \"", path,
                     "\" contains \"..\"; paths must stay inside the model repository");
    }
  }
  const std::string joined = absl::StrCat(root_, "/", path);
  char resolved[PATH_MAX];
  if (::realpath(joined.c_str(), resolved) == nullptr) {
    const int error = errno;
    if (error == ENOENT || error == ENOTDIR) {
      return absl::NotFoundError(
          absl::StrCat(field, " = \"", path, "\" does not exist in the model repository"));
    }
    if (error == EACCES) {
      return absl::PermissionDeniedError(
          absl::StrCat(field, " = \"", path, "\" cannot be read: ", std::strerror(error)));
    }
    return Invalid(field, " = \"", path, "\" cannot be resolved: ", std::strerror(error));
  }
  const auto escaped = [&] {
    return absl::PermissionDeniedError(absl::StrCat(
        field, " = \"", path, "\" resolves outside the model repository (through a symlink)"));
  };
  if (!InsideRoot(resolved)) return escaped();
  const int fd = ::open(resolved, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    const int error = errno;
    if (error == ELOOP) return escaped();  // swapped for a symlink since realpath
    if (error == EACCES) {
      return absl::PermissionDeniedError(
          absl::StrCat(field, " = \"", path, "\" cannot be read: ", std::strerror(error)));
    }
    return absl::NotFoundError(absl::StrCat(field, " = \"", path, "\" cannot be opened: ",
                                            std::strerror(error)));
  }
  // A directory on the path could have been swapped for a symlink between realpath and open;
  // the kernel's view of what was actually opened settles it.
  char opened[PATH_MAX];
  const std::string proc = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t length = ::readlink(proc.c_str(), opened, sizeof(opened) - 1);
  if (length > 0 && !InsideRoot(absl::string_view(opened, static_cast<size_t>(length)))) {
    ::close(fd);
    return escaped();
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<core::SafetensorsFile>> ModelRepository::OpenSafetensors(
    absl::string_view path, absl::string_view field) const {
  ASSIGN_OR_RETURN(const int fd, OpenConfined(path, field));
  FdCloser closer(fd);
  auto file = core::SafetensorsFile::FromDescriptor(fd, path, options_);
  if (!file.ok() && file.status().code() == absl::StatusCode::kInvalidArgument) {
    return Invalid(field, ": ", file.status().message());
  }
  return file;
}

absl::StatusOr<bool> ModelRepository::IsDirectory(absl::string_view path,
                                                  absl::string_view field) const {
  ASSIGN_OR_RETURN(const int fd, OpenConfined(path, field));
  FdCloser closer(fd);
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    return Invalid(field, " = ", Quoted(path), " cannot be examined: ", std::strerror(errno));
  }
  return S_ISDIR(info.st_mode);
}

absl::StatusOr<std::string> ModelRepository::ReadSmallFile(absl::string_view path,
                                                          absl::string_view field,
                                                          int64_t max_bytes) const {
  ASSIGN_OR_RETURN(const int fd, OpenConfined(path, field));
  FdCloser closer(fd);
  struct stat info;
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    return Invalid(field, " = ", Quoted(path), " is not a regular file");
  }
  if (info.st_size > max_bytes) {
    return Invalid(field, " = ", Quoted(path), " has ", static_cast<int64_t>(info.st_size),
                   " bytes; at most ", max_bytes, " are read");
  }
  std::string contents(static_cast<size_t>(info.st_size), '\0');
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t got = ::read(fd, &contents[done], contents.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return Invalid(field, " = ", Quoted(path), " cannot be read: ",
                     got < 0 ? std::strerror(errno) : "it shrank while being read");
    }
    done += static_cast<size_t>(got);
  }
  return contents;
}

absl::Status ModelRepository::Persist(const std::string& name, const core::MhaLayer& layer,
                                      const BatchLimitOverrides& batching,
                                      const std::string& requested_device) const {
  RETURN_IF_ERROR(ValidateLayerName(name, "name"));
  const std::string relative = PersistedPath(name);
  const std::string dir = absl::StrCat(root_, "/", kPersistedDir);
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return WriteError(errno, absl::StrCat("cannot create ", kPersistedDir, "/ in the model repository"));
  }

  std::string config_json, batching_json;
  google::protobuf::util::JsonPrintOptions print_options;
  print_options.always_print_primitive_fields = true;  // unset optional fields stay absent
  print_options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(ConfigToProto(layer.config()), &config_json,
                                                   print_options)
           .ok() ||
      !google::protobuf::util::MessageToJsonString(BatchingPolicyToProto(batching),
                                                   &batching_json, print_options)
           .ok()) {
    return absl::InternalError(absl::StrCat("cannot encode the config of layer \"", name, "\""));
  }
  const core::MhaWeights& weights = layer.weights();
  // A BFLOAT16 layer's tensors are written as the bf16 it holds (exact, half the file).
  const bool bf16 = layer.config().compute_dtype == core::DType::kBFloat16;
  std::deque<std::string> bf16_bytes;  // a deque: the entries view into it as it grows
  std::vector<core::SafetensorsEntry> entries;
  for (const core::MhaWeights::Slot& slot : core::MhaWeights::Slots(layer.config())) {
    const std::vector<float>& values = weights.*slot.member;
    if (bf16) {
      bf16_bytes.push_back(core::EncodeFloats(values, core::DType::kBFloat16));
      entries.push_back({slot.name, core::DType::kBFloat16, slot.shape, bf16_bytes.back()});
      continue;
    }
    entries.push_back({slot.name, core::DType::kFloat32, slot.shape,
                       absl::string_view(reinterpret_cast<const char*>(values.data()),
                                         values.size() * sizeof(float))});
  }
  std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                 {kLayerConfigKey, config_json},
                                                 {kBatchingKey, batching_json},
                                                 {kLayerNameKey, name},
                                                 {kFormatVersionKey, "1"}};
  if (!requested_device.empty()) metadata.emplace(kDeviceKey, requested_device);
  ASSIGN_OR_RETURN(const std::string header, core::SafetensorsHeader(entries, metadata));

  // Unique per process and call, so concurrent writers never share a temporary file.
  static std::atomic<uint64_t> counter{0};
  const std::string temp = absl::StrCat(dir, "/.", name, kSuffix, kTempMarker, ::getpid(), ".",
                                        counter.fetch_add(1));
  const std::string what = absl::StrCat("cannot write ", relative);
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return WriteError(errno, what);
  absl::Status status = WriteAll(fd, header, what);
  for (const core::SafetensorsEntry& entry : entries) {
    if (status.ok()) status = WriteAll(fd, entry.data, what);
  }
  if (status.ok() && ::fsync(fd) != 0) status = WriteError(errno, what);
  if (::close(fd) != 0 && status.ok()) status = WriteError(errno, what);
  const std::string final_path = absl::StrCat(root_, "/", relative);
  if (status.ok() && ::rename(temp.c_str(), final_path.c_str()) != 0) {
    status = WriteError(errno, what);
  }
  if (!status.ok()) {
    ::unlink(temp.c_str());
    return status;
  }
  // The rename is durable only once the directory entry is.
  return FsyncDirectory(dir, what);
}

absl::Status ModelRepository::RemovePersisted(const std::string& name) const {
  RETURN_IF_ERROR(ValidateLayerName(name, "name"));
  const std::string path = absl::StrCat(root_, "/", PersistedPath(name));
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return WriteError(errno, absl::StrCat("cannot remove ", PersistedPath(name)));
  }
  return FsyncDirectory(absl::StrCat(root_, "/", kPersistedDir),
                        absl::StrCat("cannot remove ", PersistedPath(name)));
}

absl::StatusOr<ModelRepository::PersistedLayer> ModelRepository::ReadPersisted(
    const std::string& name, core::Devices& devices,
    const std::shared_ptr<const core::Backend>& default_backend) const {
  const std::string relative = PersistedPath(name);
  ASSIGN_OR_RETURN(std::unique_ptr<core::SafetensorsFile> file,
                   OpenSafetensors(relative, "persisted layer"));
  const auto& metadata = file->metadata();
  auto config_json = metadata.find(kLayerConfigKey);
  if (config_json == metadata.end()) {
    return Invalid(relative, " has no __metadata__[\"", kLayerConfigKey,
                   "\"]; it is not a layer persisted by this server");
  }
  google::protobuf::util::JsonParseOptions parse_options;
  parse_options.ignore_unknown_fields = true;  // files from newer versions still load
  v1::LayerConfig config_proto;
  if (const auto parsed = google::protobuf::util::JsonStringToMessage(
          config_json->second, &config_proto, parse_options);
      !parsed.ok()) {
    return Invalid(relative, ": __metadata__[\"", kLayerConfigKey,
                   "\"] is not a LayerConfig: ", parsed.ToString());
  }
  v1::BatchingPolicy batching_proto;
  if (auto batching_json = metadata.find(kBatchingKey); batching_json != metadata.end()) {
    if (const auto parsed = google::protobuf::util::JsonStringToMessage(
            batching_json->second, &batching_proto, parse_options);
        !parsed.ok()) {
      return Invalid(relative, ": __metadata__[\"", kBatchingKey,
                     "\"] is not a BatchingPolicy: ", parsed.ToString());
    }
  }
  auto batching = ConvertBatchingPolicy(batching_proto, "batching");
  if (!batching.ok()) return Invalid(relative, ": ", batching.status().message());
  auto converted = ConvertConfig(config_proto);
  auto config = converted.ok() ? core::MhaConfig::Resolve(*converted) : converted;
  if (!config.ok()) return Invalid(relative, ": ", config.status().message());
  PersistedLayer persisted;
  persisted.name = name;
  persisted.batching = *std::move(batching);
  std::shared_ptr<const core::Backend> backend = default_backend;
  if (auto device = metadata.find(kDeviceKey); device != metadata.end()) {
    auto requested = devices.Get(device->second);
    if (requested.ok()) {
      backend = *std::move(requested);
    } else {
      persisted.placement_problem = absl::StrCat(
          relative, ": loaded with device ", Quoted(device->second), ", which cannot be used: ",
          requested.status().message(), "; placed on ", default_backend->name(),
          " (the server's --device) instead; the file is kept");
    }
  }
  SafetensorsTensorSource source(*file, "persisted layer");
  ASSIGN_OR_RETURN(core::MhaWeights weights,
                   ConvertWeights(v1::WEIGHT_NAMING_NATIVE, source, "", *config, "naming"));
  ASSIGN_OR_RETURN(persisted.layer, core::MhaLayer::Create(*config, std::move(weights), backend));
  return persisted;
}

std::vector<ModelRepository::PersistedLayer> ModelRepository::LoadPersisted(
    core::Devices& devices, const std::shared_ptr<const core::Backend>& default_backend,
    std::vector<std::string>* problems) const {
  std::vector<PersistedLayer> layers;
  const std::string dir = absl::StrCat(root_, "/", kPersistedDir);
  DIR* stream = ::opendir(dir.c_str());
  if (stream == nullptr) {
    if (errno != ENOENT) {
      problems->push_back(absl::StrCat("cannot list ", kPersistedDir, "/: ", std::strerror(errno)));
    }
    return layers;
  }
  std::vector<std::string> entries;
  while (const dirent* entry = ::readdir(stream)) {
    const std::string file_name = entry->d_name;
    if (file_name != "." && file_name != "..") entries.push_back(file_name);
  }
  ::closedir(stream);
  std::sort(entries.begin(), entries.end());
  for (const std::string& file_name : entries) {
    const std::string relative = absl::StrCat(kPersistedDir, "/", file_name);
    if (!absl::EndsWith(file_name, kSuffix)) {
      // Temporary names never end in the suffix, so a layer named like one is safe.
      if (file_name.front() == '.' &&
          absl::StrContains(file_name, absl::StrCat(kSuffix, kTempMarker))) {
        // A write interrupted by a crash; its rename never happened, so nothing refers to it.
        ::unlink(absl::StrCat(dir, "/", file_name).c_str());
        problems->push_back(
            absl::StrCat(relative, ": temporary file of an interrupted write; removed"));
      } else {
        problems->push_back(absl::StrCat(relative, ": not a ", kSuffix, " file; ignored"));
      }
      continue;
    }
    const std::string name = file_name.substr(0, file_name.size() - std::strlen(kSuffix));
    if (absl::Status valid = ValidateLayerName(name, "layer name"); !valid.ok()) {
      problems->push_back(absl::StrCat(relative, ": ", valid.message(), "; skipped"));
      continue;
    }
    auto layer = ReadPersisted(name, devices, default_backend);
    if (!layer.ok()) {
      // The message already names the file.
      problems->push_back(absl::StrCat(layer.status().message(), "; skipped"));
      continue;
    }
    if (!layer->placement_problem.empty()) problems->push_back(layer->placement_problem);
    layers.push_back(*std::move(layer));
  }
  return layers;
}

}  // namespace attention::server
