#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace attention::core {
namespace {

// Weights are copied byte for byte into float32 vectors; that is only right on a
// little-endian host, which is every target this project builds for.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors reader assumes little-endian");

using Json = nlohmann::json;

// The deepest a valid header nests: root object -> tensor object -> shape array.
constexpr int kMaxHeaderDepth = 3;

absl::Status ErrnoError(int error, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InternalError(message);
  }
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Refuses headers nested deeper than any valid one before they reach the JSON parser, so a
// header of a million '[' costs one linear scan and no deep structure.
absl::Status CheckNesting(absl::string_view header, absl::string_view file) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char ch : header) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    if (ch == '"') {
      in_string = true;
    } else if (ch == '{' || ch == '[') {
      if (++depth > kMaxHeaderDepth) {
        return Invalid(file, ": header JSON nests deeper than ", kMaxHeaderDepth,
                       " levels; a safetensors header is {name: {dtype, shape: [...], "
                       "data_offsets: [...]}}");
      }
    } else if (ch == '}' || ch == ']') {
      --depth;
    }
  }
  return absl::OkStatus();
}

// A non-negative JSON integer that fits int64, or an error naming `what`.
absl::StatusOr<int64_t> NonNegativeInteger(const Json& value, absl::string_view what) {
  if (!value.is_number_unsigned() ||
      value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Invalid(what, " = ", value.dump(-1, ' ', false, Json::error_handler_t::replace),
                   " is not a non-negative integer");
  }
  return static_cast<int64_t>(value.get<uint64_t>());
}

}  // namespace

absl::Status SafetensorsOptions::Validate() const {
  if (max_header_bytes < 2 || max_header_bytes > (int64_t{1} << 32)) {
    return Invalid("max_header_bytes = ", max_header_bytes, " must be in [2, 2^32]");
  }
  return absl::OkStatus();
}

int64_t SafetensorsElementSize(absl::string_view dtype) {
  static const auto* const kSizes = new std::map<std::string, int64_t, std::less<>>{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  auto found = kSizes->find(dtype);
  return found == kSizes->end() ? 0 : found->second;
}

absl::string_view SafetensorsDTypeName(DType dtype) { return Info(dtype).safetensors_name; }

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path, const SafetensorsOptions& options, absl::string_view display_name) {
  const std::string name = display_name.empty() ? path : std::string(display_name);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, absl::StrCat("cannot open ", name));
  auto file = FromDescriptor(fd, name, options);
  ::close(fd);
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromDescriptor(
    int fd, absl::string_view display_name, const SafetensorsOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  struct stat info;
  if (::fstat(fd, &info) != 0) return ErrnoError(errno, absl::StrCat("cannot stat ", display_name));
  if (!S_ISREG(info.st_mode)) return Invalid(display_name, " is not a regular file");
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->display_name_ = std::string(display_name);
  const size_t size = static_cast<size_t>(info.st_size);
  absl::string_view bytes;
  if (size > 0) {  // mmap refuses length 0; Parse reports the empty file
    void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) return ErrnoError(errno, absl::StrCat("cannot map ", display_name));
    file->mapping_ = mapping;
    file->mapping_size_ = size;
    bytes = absl::string_view(static_cast<const char*>(mapping), size);
  }
  RETURN_IF_ERROR(file->Parse(bytes, options));
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBuffer(
    absl::string_view bytes, absl::string_view display_name, const SafetensorsOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->display_name_ = std::string(display_name);
  RETURN_IF_ERROR(file->Parse(bytes, options));
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

const SafetensorsTensor* SafetensorsFile::Find(const std::string& name) const {
  auto found = tensors_.find(name);
  return found == tensors_.end() ? nullptr : &found->second;
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloats(
    const SafetensorsTensor& tensor) const {
  const std::string field = absl::StrCat(display_name_, ": tensor \"", tensor.name, "\"");
  const DTypeInfo* info = FindDType(tensor.dtype, &DTypeInfo::safetensors_name);
  if (info != nullptr && info->dtype != DType::kBool) {
    return DecodeFloats(tensor.data, info->dtype, field);
  }
  return Invalid(field, " has dtype ", tensor.dtype,
                 "; only F32, F16 and BF16 weights are supported");
}

absl::Status SafetensorsFile::Parse(absl::string_view bytes, const SafetensorsOptions& options) {
  const std::string& file = display_name_;
  if (bytes.size() < 8) {
    return Invalid(file, " has ", bytes.size(),
                   " bytes; a safetensors file starts with an 8-byte header length");
  }
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) {
    header_length = (header_length << 8) | static_cast<unsigned char>(bytes[i]);
  }
  if (header_length > static_cast<uint64_t>(options.max_header_bytes)) {
    return Invalid(file, ": header length ", header_length, " exceeds the limit of ",
                   options.max_header_bytes, " bytes");
  }
  if (header_length > bytes.size() - 8) {
    return Invalid(file, ": header length ", header_length, " runs past the end of the file (",
                   bytes.size(), " bytes); the file is truncated or not safetensors");
  }
  const absl::string_view header = bytes.substr(8, header_length);
  if (header.empty() || header.front() != '{') {
    return Invalid(file, ": header does not start with '{'; not a safetensors file");
  }
  RETURN_IF_ERROR(CheckNesting(header, file));
  const absl::string_view buffer = bytes.substr(8 + header_length);

  Json json;
  try {
    json = Json::parse(header.begin(), header.end());
  } catch (const Json::exception& e) {
    return Invalid(file, ": header is not valid JSON: ", e.what());
  }
  if (!json.is_object()) return Invalid(file, ": header is not a JSON object");

  // (begin, end, name) of every tensor, to check that they tile the buffer.
  std::vector<std::tuple<int64_t, int64_t, std::string>> extents;
  try {
    for (const auto& [key, value] : json.items()) {
      if (key == "__metadata__") {
        if (!value.is_object()) return Invalid(file, ": __metadata__ is not a JSON object");
        for (const auto& [meta_key, meta_value] : value.items()) {
          if (!meta_value.is_string()) {
            return Invalid(file, ": __metadata__[\"", meta_key, "\"] is not a string");
          }
          metadata_[meta_key] = meta_value.get<std::string>();
        }
        continue;
      }
      const std::string what = absl::StrCat(file, ": tensor \"", key, "\"");
      if (!value.is_object()) return Invalid(what, " is not a JSON object");
      SafetensorsTensor tensor;
      tensor.name = key;

      auto dtype = value.find("dtype");
      if (dtype == value.end() || !dtype->is_string()) {
        return Invalid(what, " has no \"dtype\" string");
      }
      tensor.dtype = dtype->get<std::string>();
      const int64_t element_size = SafetensorsElementSize(tensor.dtype);
      if (element_size == 0) {
        return Invalid(what, " has unknown dtype \"", tensor.dtype,
                       "\"; safetensors defines F64, F32, F16, BF16, F8_E5M2, F8_E4M3, I64, "
                       "I32, I16, I8, U64, U32, U16, U8 and BOOL");
      }

      auto shape = value.find("shape");
      if (shape == value.end() || !shape->is_array()) {
        return Invalid(what, " has no \"shape\" array");
      }
      // Element count, kept below the buffer size so the byte count cannot overflow.
      uint64_t count = 1;
      bool too_large = false;
      for (size_t d = 0; d < shape->size(); ++d) {
        ASSIGN_OR_RETURN(const int64_t dim,
                         NonNegativeInteger((*shape)[d], absl::StrCat(what, " shape[", d, "]")));
        tensor.shape.push_back(dim);
        if (dim == 0) {
          count = 0;
        } else if (!too_large && count > buffer.size() / static_cast<uint64_t>(dim)) {
          too_large = true;
        } else if (!too_large) {
          count *= static_cast<uint64_t>(dim);
        }
      }
      if (count == 0) too_large = false;

      auto offsets = value.find("data_offsets");
      if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2) {
        return Invalid(what, " has no \"data_offsets\" array of two integers");
      }
      ASSIGN_OR_RETURN(const int64_t begin,
                       NonNegativeInteger((*offsets)[0], absl::StrCat(what, " data_offsets[0]")));
      ASSIGN_OR_RETURN(const int64_t end,
                       NonNegativeInteger((*offsets)[1], absl::StrCat(what, " data_offsets[1]")));
      if (begin > end) {
        return Invalid(what, " has data_offsets [", begin, ", ", end, "] with begin > end");
      }
      if (static_cast<uint64_t>(end) > buffer.size()) {
        return Invalid(what, " has data_offsets [", begin, ", ", end,
                       "] past the end of the data buffer (", buffer.size(),
                       " bytes); the file is truncated");
      }
      const uint64_t byte_count = static_cast<uint64_t>(end - begin);
      if (too_large || count * static_cast<uint64_t>(element_size) != byte_count) {
        return Invalid(what, " has data_offsets [", begin, ", ", end, "] (", byte_count,
                       " bytes) but shape ", ShapeString(tensor.shape), " of ", tensor.dtype,
                       too_large ? " needs more bytes than the file holds"
                                 : absl::StrCat(" needs ", count * element_size, " bytes"));
      }
      tensor.data = buffer.substr(begin, end - begin);
      extents.emplace_back(begin, end, key);
      tensors_.emplace(key, std::move(tensor));
    }
  } catch (const Json::exception& e) {
    // Every access above is type-checked first; this is a last line of defence.
    return Invalid(file, ": malformed header: ", e.what());
  }

  // The tensors must tile the buffer exactly: sorted by offset, each starts where the
  // previous one ended, and the last ends at the end of the file.
  std::sort(extents.begin(), extents.end());
  int64_t cursor = 0;
  const std::string* previous = nullptr;
  for (const auto& [begin, end, name] : extents) {
    if (begin < cursor) {
      return Invalid(file, ": tensor \"", name, "\" data_offsets [", begin, ", ", end,
                     "] overlap tensor \"", *previous, "\", which ends at ", cursor);
    }
    if (begin > cursor) {
      return Invalid(file, ": bytes [", cursor, ", ", begin,
                     ") of the data buffer belong to no tensor (a hole before tensor \"", name,
                     "\")");
    }
    cursor = end;
    previous = &name;
  }
  if (static_cast<uint64_t>(cursor) != buffer.size()) {
    return Invalid(file, ": bytes [", cursor, ", ", buffer.size(),
                   ") at the end of the data buffer belong to no tensor");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SafetensorsHeader(absl::Span<const SafetensorsEntry> entries,
                                              const std::map<std::string, std::string>& metadata) {
  Json json = Json::object();
  if (!metadata.empty()) json["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsEntry& entry : entries) {
    if (entry.name == "__metadata__" || json.contains(entry.name)) {
      return Invalid("safetensors entry name \"", entry.name, "\" is reserved or repeated");
    }
    int64_t count = 1;
    for (int64_t dim : entry.shape) count *= dim;
    const uint64_t bytes = static_cast<uint64_t>(count * ElementSize(entry.dtype));
    if (entry.data.size() != bytes) {
      return Invalid("safetensors entry \"", entry.name, "\" has ", entry.data.size(),
                     " bytes; shape ", ShapeString(entry.shape), " of ",
                     SafetensorsDTypeName(entry.dtype), " needs ", bytes);
    }
    json[entry.name] = {{"dtype", SafetensorsDTypeName(entry.dtype)},
                        {"shape", entry.shape},
                        {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header = json.dump(-1, ' ', false, Json::error_handler_t::replace);
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  out += header;
  return out;
}

absl::StatusOr<std::string> SerializeSafetensors(
    absl::Span<const SafetensorsEntry> entries,
    const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(std::string out, SafetensorsHeader(entries, metadata));
  for (const SafetensorsEntry& entry : entries) out.append(entry.data.data(), entry.data.size());
  return out;
}

}  // namespace attention::core
