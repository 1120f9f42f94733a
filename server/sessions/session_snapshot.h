// The file a draining server writes its sessions to and the next server with its replica
// name restores (issue 41): SessionTable::WriteSnapshot and RestoreSnapshot say what goes
// in; this is how it is laid out and checked.
//
//   header   "ATTNKVSS", format version (u32), 0 (u32)
//   index    length (u64), SnapshotIndex (session_snapshot.proto), SHA-256 of all before it
//   block i  block_bytes of KV, SHA-256 of (the index's digest, i, the bytes)
//   trailer  "ATTNEND!", the block count (u64); then the file ends
//
// Integers are little-endian. Every part is covered by a digest chained to the index's, so
// a short write, a flipped bit, blocks of another snapshot or a file cut or grown anywhere
// is refused before any session is restored. A file is written to a temporary name,
// flushed to disk and renamed, so a crash while writing leaves the last snapshot or none.
#ifndef ATTENTION_SERVER_SESSIONS_SESSION_SNAPSHOT_H_
#define ATTENTION_SERVER_SESSIONS_SESSION_SNAPSHOT_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/mha_layer.h"
#include "session_snapshot.pb.h"

namespace attention::server {

inline constexpr uint32_t kSnapshotFormatVersion = 1;
// The index of a snapshot is at most this long (a million sessions' tables fit).
inline constexpr uint64_t kMaxSnapshotIndexBytes = uint64_t{1} << 30;

// SHA-256 of a layer's config and weights: a restored session's layers must be the same.
std::string LayerDigest(const core::MhaLayer& layer);

// LayerDigest of each layer once: sessions of one model share its layers, and hashing their
// weights is most of the work of a snapshot's index.
class LayerDigests {
 public:
  const std::string& Of(const core::MhaLayer& layer) {
    auto [digest, added] = digests_.try_emplace(&layer);
    if (added) digest->second = LayerDigest(layer);
    return digest->second;
  }

 private:
  absl::flat_hash_map<const core::MhaLayer*, std::string> digests_;
};

// Writes one snapshot: the index, then index.num_blocks() blocks, then Commit.
class SnapshotWriter {
 public:
  // Written bytes are handed to the disk in runs of this many.
  static constexpr int64_t kWritebackBytes = int64_t{32} << 20;

  static absl::StatusOr<std::unique_ptr<SnapshotWriter>> Open(const std::string& path,
                                                              const snapshot::SnapshotIndex& index);
  ~SnapshotWriter();  // an uncommitted snapshot's temporary file is removed

  // The next block: index.block_bytes() bytes.
  absl::Status AddBlock(const void* bytes);
  // The trailer, fsync, then the rename that makes the snapshot the one at `path`.
  absl::Status Commit();
  // Bytes written so far.
  int64_t bytes() const { return bytes_; }

 private:
  SnapshotWriter(std::string path, std::FILE* file, const snapshot::SnapshotIndex& index);
  absl::Status Write(const void* data, size_t size);

  const std::string path_, temporary_path_;
  std::FILE* file_;
  const int64_t block_bytes_, num_blocks_;
  std::string index_digest_;
  int64_t blocks_written_ = 0;
  int64_t bytes_ = 0;
  int64_t bytes_flushed_ = 0;  // handed to the disk's writeback
  bool committed_ = false;
};

// Reads one snapshot, checking every part before it is handed out: Open checks the header
// and the index, ReadBlock each block, Finish the trailer and the end of the file. Errors
// are DATA_LOSS (a torn or corrupt file) or FAILED_PRECONDITION (another format version),
// naming the part and the offset.
class SnapshotReader {
 public:
  static absl::StatusOr<std::unique_ptr<SnapshotReader>> Open(const std::string& path);
  ~SnapshotReader();

  const snapshot::SnapshotIndex& index() const { return index_; }
  // The next block, into index().block_bytes() bytes at `bytes`.
  absl::Status ReadBlock(void* bytes);
  absl::Status Finish();
  // Bytes read so far.
  int64_t bytes() const { return offset_; }

 private:
  explicit SnapshotReader(std::FILE* file) : file_(file) {}
  absl::Status Read(void* data, size_t size, const char* part);

  std::FILE* file_;
  snapshot::SnapshotIndex index_;
  std::string index_digest_;
  int64_t blocks_read_ = 0;
  int64_t offset_ = 0;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SESSIONS_SESSION_SNAPSHOT_H_
