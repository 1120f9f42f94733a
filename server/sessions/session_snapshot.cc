#include "server/sessions/session_snapshot.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "core/status_macros.h"

namespace attention::server {
namespace {

constexpr char kHeaderMagic[8] = {'A', 'T', 'T', 'N', 'K', 'V', 'S', 'S'};
constexpr char kTrailerMagic[8] = {'A', 'T', 'T', 'N', 'E', 'N', 'D', '!'};
constexpr size_t kDigestBytes = 32;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "snapshots store integers as the host");

// SHA-256 over the parts, in order.
std::string Sha256(absl::Span<const std::string_view> parts) {
  EVP_MD_CTX* context = EVP_MD_CTX_new();
  EVP_DigestInit_ex(context, EVP_sha256(), nullptr);
  for (std::string_view part : parts) EVP_DigestUpdate(context, part.data(), part.size());
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(context, digest, &length);
  EVP_MD_CTX_free(context);
  return std::string(reinterpret_cast<const char*>(digest), length);
}

template <typename T>
std::string_view BytesOf(const T& value) {
  return std::string_view(reinterpret_cast<const char*>(&value), sizeof(value));
}

std::string Header(uint32_t version) {
  std::string header(kHeaderMagic, sizeof(kHeaderMagic));
  const uint32_t reserved = 0;
  header.append(BytesOf(version));
  header.append(BytesOf(reserved));
  return header;
}

std::string BlockDigest(const std::string& index_digest, int64_t block, const void* bytes,
                        int64_t block_bytes) {
  return Sha256({index_digest, BytesOf(block),
                 std::string_view(static_cast<const char*>(bytes), block_bytes)});
}

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// Flushes the directory entry of a rename to disk.
absl::Status SyncDirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string directory = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const int fd = open(directory.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return ErrnoError("cannot open directory", directory);
  const int synced = fsync(fd);
  close(fd);
  return synced == 0 ? absl::OkStatus() : ErrnoError("cannot fsync directory", directory);
}

}  // namespace

std::string LayerDigest(const core::MhaLayer& layer) {
  const core::MhaConfig& c = layer.config();
  const core::RopeScaling& r = c.rope_scaling;
  const std::string config = absl::StrCat(
      c.embed_dim, ",", c.num_heads, ",", c.num_kv_heads, ",", c.head_dim, ",", c.v_head_dim, ",",
      c.kdim, ",", c.vdim, ",", c.output_dim, ",", c.qkv_bias, c.output_bias, c.output_projection,
      ",", absl::StrFormat("%a", c.rope_theta), ",", r.type, ",",
      absl::StrFormat("%a,%a,%a", r.factor, r.low_freq_factor, r.high_freq_factor), ",",
      r.original_max_positions, ",", c.always_causal, ",", c.sliding_window, ",",
      core::DTypeName(c.compute_dtype));
  const core::MhaWeights weights = layer.weights();
  const std::vector<const std::vector<float>*> tensors = {
      &weights.q_weight, &weights.k_weight, &weights.v_weight, &weights.out_weight,
      &weights.q_bias,   &weights.k_bias,   &weights.v_bias,   &weights.out_bias};
  // Each tensor's length before it, so that tensors' boundaries are in the digest.
  std::vector<uint64_t> lengths;
  for (const auto* tensor : tensors) lengths.push_back(tensor->size());
  std::vector<std::string_view> parts = {config};
  for (size_t t = 0; t < tensors.size(); ++t) {
    parts.push_back(BytesOf(lengths[t]));
    parts.push_back(std::string_view(reinterpret_cast<const char*>(tensors[t]->data()),
                                     tensors[t]->size() * sizeof(float)));
  }
  return Sha256(parts);
}

absl::StatusOr<std::unique_ptr<SnapshotWriter>> SnapshotWriter::Open(
    const std::string& path, const snapshot::SnapshotIndex& index) {
  std::string serialized;
  if (!index.SerializeToString(&serialized) || serialized.size() > kMaxSnapshotIndexBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the session snapshot's index of ",
                                                     index.sessions_size(), " sessions exceeds ",
                                                     kMaxSnapshotIndexBytes, " bytes"));
  }
  const std::string temporary = path + ".tmp";
  std::FILE* file = std::fopen(temporary.c_str(), "wb");
  if (file == nullptr) return ErrnoError("cannot create", temporary);
  std::unique_ptr<SnapshotWriter> writer(new SnapshotWriter(path, file, index));
  const std::string header = Header(kSnapshotFormatVersion);
  const uint64_t length = serialized.size();
  writer->index_digest_ = Sha256({header, BytesOf(length), serialized});
  RETURN_IF_ERROR(writer->Write(header.data(), header.size()));
  RETURN_IF_ERROR(writer->Write(&length, sizeof(length)));
  RETURN_IF_ERROR(writer->Write(serialized.data(), serialized.size()));
  RETURN_IF_ERROR(writer->Write(writer->index_digest_.data(), kDigestBytes));
  return writer;
}

SnapshotWriter::SnapshotWriter(std::string path, std::FILE* file,
                               const snapshot::SnapshotIndex& index)
    : path_(std::move(path)),
      temporary_path_(path_ + ".tmp"),
      file_(file),
      block_bytes_(index.block_bytes()),
      num_blocks_(index.num_blocks()) {
  std::setvbuf(file_, nullptr, _IOFBF, 1 << 20);
}

SnapshotWriter::~SnapshotWriter() {
  if (file_ != nullptr) std::fclose(file_);
  if (!committed_) std::remove(temporary_path_.c_str());
}

absl::Status SnapshotWriter::Write(const void* data, size_t size) {
  if (std::fwrite(data, 1, size, file_) != size) return ErrnoError("cannot write", temporary_path_);
  bytes_ += static_cast<int64_t>(size);
  return absl::OkStatus();
}

absl::Status SnapshotWriter::AddBlock(const void* bytes) {
  if (blocks_written_ == num_blocks_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the session snapshot's index names ", num_blocks_, " blocks"));
  }
  const std::string digest = BlockDigest(index_digest_, blocks_written_, bytes, block_bytes_);
  RETURN_IF_ERROR(Write(bytes, block_bytes_));
  RETURN_IF_ERROR(Write(digest.data(), kDigestBytes));
  ++blocks_written_;
  // Starts the disk on what is written while the next blocks are hashed, rather than all
  // at the fsync: below the kernel's dirty-page thresholds nothing would be written sooner.
  if (bytes_ - bytes_flushed_ >= kWritebackBytes) {
    if (std::fflush(file_) != 0) return ErrnoError("cannot write", temporary_path_);
    sync_file_range(fileno(file_), bytes_flushed_, bytes_ - bytes_flushed_,
                    SYNC_FILE_RANGE_WRITE);  // advice: the fsync still makes it durable
    bytes_flushed_ = bytes_;
  }
  return absl::OkStatus();
}

absl::Status SnapshotWriter::Commit() {
  if (blocks_written_ != num_blocks_) {
    return absl::FailedPreconditionError(absl::StrCat("the session snapshot has ", blocks_written_,
                                                      " of its ", num_blocks_, " blocks"));
  }
  const uint64_t count = num_blocks_;
  RETURN_IF_ERROR(Write(kTrailerMagic, sizeof(kTrailerMagic)));
  RETURN_IF_ERROR(Write(&count, sizeof(count)));
  if (std::fflush(file_) != 0 || fsync(fileno(file_)) != 0) {
    return ErrnoError("cannot flush", temporary_path_);
  }
  const int closed = std::fclose(file_);
  file_ = nullptr;
  if (closed != 0) return ErrnoError("cannot close", temporary_path_);
  if (std::rename(temporary_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoError(absl::StrCat("cannot rename ", temporary_path_, " to"), path_);
  }
  committed_ = true;
  return SyncDirectoryOf(path_);
}

absl::StatusOr<std::unique_ptr<SnapshotReader>> SnapshotReader::Open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return ErrnoError("cannot open", path);
  std::unique_ptr<SnapshotReader> reader(new SnapshotReader(file));
  std::setvbuf(file, nullptr, _IOFBF, 1 << 20);
  posix_fadvise(fileno(file), 0, 0, POSIX_FADV_SEQUENTIAL);  // advice: a larger read-ahead
  std::string header(Header(0).size(), '\0');
  RETURN_IF_ERROR(reader->Read(header.data(), header.size(), "header"));
  if (header.compare(0, sizeof(kHeaderMagic), kHeaderMagic, sizeof(kHeaderMagic)) != 0) {
    return absl::DataLossError("not a session snapshot: its first 8 bytes are not ATTNKVSS");
  }
  uint32_t version = 0;
  std::memcpy(&version, header.data() + sizeof(kHeaderMagic), sizeof(version));
  if (header != Header(kSnapshotFormatVersion)) {
    return absl::FailedPreconditionError(absl::StrCat("session snapshot format version ", version,
                                                      "; this server reads version ",
                                                      kSnapshotFormatVersion));
  }
  uint64_t length = 0;
  RETURN_IF_ERROR(reader->Read(&length, sizeof(length), "index length"));
  if (length > kMaxSnapshotIndexBytes) {
    return absl::DataLossError(absl::StrCat("session snapshot index of ", length, " bytes exceeds ",
                                            kMaxSnapshotIndexBytes));
  }
  // Nothing is allocated for more than the file holds.
  struct stat file_status;
  if (fstat(fileno(file), &file_status) != 0) return ErrnoError("cannot stat", path);
  if (length > static_cast<uint64_t>(file_status.st_size - reader->offset_)) {
    return absl::DataLossError(absl::StrCat("session snapshot ends inside its index: ", length,
                                            " bytes from byte ", reader->offset_, " of a ",
                                            file_status.st_size, "-byte file"));
  }
  std::string serialized(length, '\0');
  RETURN_IF_ERROR(reader->Read(serialized.data(), length, "index"));
  std::string digest(kDigestBytes, '\0');
  RETURN_IF_ERROR(reader->Read(digest.data(), kDigestBytes, "index digest"));
  reader->index_digest_ = Sha256({header, BytesOf(length), serialized});
  if (digest != reader->index_digest_) {
    return absl::DataLossError("session snapshot index does not match its SHA-256");
  }
  if (!reader->index_.ParseFromString(serialized)) {
    return absl::DataLossError("session snapshot index does not parse");
  }
  const snapshot::SnapshotIndex& index = reader->index_;
  if (index.block_bytes() < 1 || index.block_bytes() > (int64_t{1} << 30) ||
      index.num_blocks() < 0) {
    return absl::DataLossError(absl::StrCat("session snapshot of ", index.num_blocks(),
                                            " blocks of ", index.block_bytes(), " bytes"));
  }
  return reader;
}

SnapshotReader::~SnapshotReader() { std::fclose(file_); }

absl::Status SnapshotReader::Read(void* data, size_t size, const char* part) {
  const size_t got = std::fread(data, 1, size, file_);
  if (got != size) {
    return absl::DataLossError(absl::StrCat("session snapshot ends inside its ", part, " at byte ",
                                            offset_ + static_cast<int64_t>(got)));
  }
  offset_ += static_cast<int64_t>(size);
  return absl::OkStatus();
}

absl::Status SnapshotReader::ReadBlock(void* bytes) {
  if (blocks_read_ == index_.num_blocks()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the session snapshot has ", index_.num_blocks(), " blocks"));
  }
  const std::string part = absl::StrCat("block ", blocks_read_);
  RETURN_IF_ERROR(Read(bytes, index_.block_bytes(), part.c_str()));
  std::string digest(kDigestBytes, '\0');
  RETURN_IF_ERROR(Read(digest.data(), kDigestBytes, part.c_str()));
  if (digest != BlockDigest(index_digest_, blocks_read_, bytes, index_.block_bytes())) {
    return absl::DataLossError(absl::StrCat("session snapshot ", part, " (ending at byte ", offset_,
                                            ") does not match its SHA-256"));
  }
  ++blocks_read_;
  return absl::OkStatus();
}

absl::Status SnapshotReader::Finish() {
  if (blocks_read_ != index_.num_blocks()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "read ", blocks_read_, " of the session snapshot's ", index_.num_blocks(), " blocks"));
  }
  char magic[sizeof(kTrailerMagic)];
  uint64_t count = 0;
  RETURN_IF_ERROR(Read(magic, sizeof(magic), "trailer"));
  RETURN_IF_ERROR(Read(&count, sizeof(count), "trailer"));
  if (std::memcmp(magic, kTrailerMagic, sizeof(magic)) != 0 ||
      count != static_cast<uint64_t>(index_.num_blocks())) {
    return absl::DataLossError(absl::StrCat("session snapshot trailer at byte ", offset_ - 16,
                                            " does not close its ", index_.num_blocks(),
                                            " blocks"));
  }
  if (std::fgetc(file_) != EOF) {
    return absl::DataLossError(
        absl::StrCat("session snapshot goes on past its trailer at byte ", offset_));
  }
  return absl::OkStatus();
}

}  // namespace attention::server
