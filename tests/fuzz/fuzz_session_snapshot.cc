// libFuzzer target: a session snapshot whose index is any bytes that parse, in a file whose
// checksums hold (what a buggy writer, or anyone who may write the snapshot volume, could
// leave), restored into a small table at start-up. It is refused with a status or restored;
// a restored table answers reads and gives every block back when its sessions are dropped.
// Never a crash, a leak, or an allocation past the pool. Blocks follow the index's count (at
// most 16), their bytes from the input. Seeds: tests/fuzz/corpus/session_snapshot/ (made by
// tests/fuzz/make_corpus.py).
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/cpu/thread_pool.h"
#include "server/sessions/session_snapshot.h"
#include "server/sessions/session_table.h"

namespace attention::server {
namespace {

constexpr int64_t kBlockBytes = 4096;
constexpr int64_t kMaxBlocks = 16;

SessionTableOptions Options() {
  SessionTableOptions options;
  options.kv_cache_bytes = 64 * kBlockBytes;
  options.block_bytes = kBlockBytes;
  options.max_session_tokens = 1024;
  options.replica = "fuzz-0";
  options.poison_freed_blocks = true;
  return options;
}

}  // namespace
}  // namespace attention::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attention::server;  // NOLINT(google-build-using-namespace): one function
  static attention::core::ThreadPool* pool = new attention::core::ThreadPool(1);
  snapshot::SnapshotIndex index;
  if (!index.ParseFromArray(data, static_cast<int>(size))) return 0;
  // The index as this replica's, so that it reaches the sessions; their contents are the
  // fuzzer's.
  index.set_replica("fuzz-0");
  index.set_block_bytes(kBlockBytes);
  index.set_num_blocks(std::clamp<int64_t>(index.num_blocks(), 0, kMaxBlocks));
  const std::string path = absl::StrCat("/tmp/fuzz_session_snapshot_", getpid(), ".kvsnap");
  {
    auto writer = SnapshotWriter::Open(path, index);
    if (!writer.ok()) return 0;
    std::vector<uint8_t> block(kBlockBytes);
    for (int64_t b = 0; b < index.num_blocks(); ++b) {
      for (int64_t i = 0; i < kBlockBytes; ++i) block[i] = data[(b * 131 + i) % size];
      if (!(*writer)->AddBlock(block.data()).ok()) __builtin_trap();
    }
    if (!(*writer)->Commit().ok()) __builtin_trap();
  }
  auto table = SessionTable::Create(Options(), *pool);
  if (!table.ok()) __builtin_trap();
  const absl::Time now = absl::Now();
  const auto restored = (*table)->RestoreSnapshot(
      path, [](const std::string& name) { return absl::NotFoundError(name); }, now);
  std::remove(path.c_str());
  const SessionCounters empty = (*table)->Counters();
  for (const SessionInfo& session : (*table)->List(now)) {
    if (!(*table)->Get(session.id, now).ok()) __builtin_trap();
    if (!(*table)->Drop(session.id, now).ok()) __builtin_trap();
  }
  // Every block back: a restored table's bookkeeping is the pool's own.
  const SessionCounters after = (*table)->Counters();
  if (after.pool.blocks_free != after.pool.blocks_total ||
      after.pool.blocks_available != after.pool.blocks_total) {
    __builtin_trap();
  }
  if (!restored.ok() && empty.sessions != 0) __builtin_trap();  // refused means none
  return 0;
}
