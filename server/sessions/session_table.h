// Server-held KV-cache sessions for autoregressive decode (issue 25): each session holds the
// keys and values of one sequence, for every layer of a model, in the paged KV pool
// (core/kv_cache), so a caller sends only each step's new tokens. This is the table and
// the step; the gRPC API on top of it comes next.
//
// The rules the anchors taught (../shared/notes/kv-cache-anchors.md):
// - Admission control, never silent eviction: Create and Fork reserve every block a
//   session may grow to, or answer RESOURCE_EXHAUSTED.
// - Explicit positions make retries safe: a step writes K/V of one layer at positions
//   [position, position + n). Rewriting written positions with the same K/V changes nothing
//   and answers the same output; other K/V there is FAILED_PRECONDITION; a gap past the
//   end is OUT_OF_RANGE.
// - An idle session expires after its TTL; a tombstone then tells "expired" and "dropped"
//   apart from "unknown".
// - Time is passed in, so tests drive expiry with a fake clock.
// - Sessions live in one replica's memory: an id names its replica, and an id of another
//   replica is FAILED_PRECONDITION naming the holder, not "unknown". A draining replica may
//   hand its sessions to a peer (BeginHandoff, AdoptSnapshot, EndHandoff); the peer holds
//   them under their ids, and the sender names the peer and its address.
#ifndef ATTENTION_SERVER_SESSIONS_SESSION_TABLE_H_
#define ATTENTION_SERVER_SESSIONS_SESSION_TABLE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/cpu/paged_prefill_cpu.h"
#include "core/cpu/thread_pool.h"
#include "core/dtype.h"
#include "core/kv_cache/block_pool.h"
#include "core/kv_cache/kv_storage.h"
#include "core/mha_layer.h"
#include "core/mutex.h"
#include "server/sessions/session_snapshot.h"
#include "session_snapshot.pb.h"

namespace attention::server {

// The served layers of a session: its layer l is layers[l], loaded as names[l] and pinned at
// Create, so reloading a name does not change a live session.
struct ServedLayers {
  std::vector<std::shared_ptr<const core::MhaLayer>> layers;
  std::vector<std::string> names;
};

// The heads a session attends with. The caller projects and rotates (RoPE) its queries and
// keys, or the session's served layers do; the session stores K/V in `kv_dtype` (float32 or
// bfloat16) and computes in float32, but for a session over BFLOAT16 layers, whose steps may
// round the queries and probabilities to bf16 as those layers do (cuDNN's paged SDPA on a GPU).
// Bounds of a session's shape, checked before anything is derived from it: layers (the
// largest models have about 130), each head count and head size (a layer's own bound), and
// one token's query or output row, num_heads x head_dim or v_head_dim (4 MiB in float32).
inline constexpr int64_t kMaxSessionLayers = 1024;
inline constexpr int64_t kMaxSessionDim = 1 << 16;
inline constexpr int64_t kMaxSessionRowWidth = 1 << 20;

struct SessionShape {
  int64_t num_layers = 1;
  int64_t num_heads = 1;     // H, a multiple of num_kv_heads
  int64_t num_kv_heads = 1;  // Hkv
  int64_t head_dim = 1;      // dk
  int64_t v_head_dim = 0;    // dv; 0 means head_dim
  core::DType kv_dtype = core::DType::kFloat32;
  float scale = 0;  // softmax scale; 0 means 1/sqrt(dk)
  // Keys each query sees, its own included (Mistral's and Qwen2's sliding window); 0: all.
  int64_t sliding_window = 0;
  // One window per layer where layers differ (Gemma 2/3, Qwen2's max_window_layers); empty:
  // sliding_window for every layer. CheckShape allows one or the other.
  std::vector<int64_t> layer_sliding_windows{};
  // A session over served layers (see session_layers.h), or null for a session whose caller
  // projects Q, K and V itself. Shared and immutable, so copying a shape stays cheap.
  std::shared_ptr<const ServedLayers> layers{};

  // The window of `layer` (0: none).
  int64_t WindowOf(int64_t layer) const {
    return layer_sliding_windows.empty() ? sliding_window : layer_sliding_windows[layer];
  }
};

struct SessionTableOptions {
  // The KV pool, allocated once at start-up; nothing is allocated on the step path.
  int64_t kv_cache_bytes = int64_t{256} << 20;
  int64_t block_bytes = core::kv_cache::kDefaultBlockBytes;
  // Live sessions at once, and tokens one session may reserve.
  int64_t max_sessions = 1024;
  int64_t max_session_tokens = int64_t{128} << 10;
  // Idle time before a session expires: the default, and the most a caller may ask for.
  absl::Duration default_ttl = absl::Minutes(10);
  absl::Duration max_ttl = absl::Hours(24);
  // How long "expired" and "dropped" are remembered, and for how many sessions at most.
  absl::Duration tombstone_ttl = absl::Hours(1);
  int64_t max_tombstones = 65536;
  // On a host table: entries of at least this many tokens (prefill chunks) attend on the
  // blocked flash-style kernel, shorter ones on the decode kernel
  // (core/cpu/paged_prefill_cpu.h); >= 1, and larger than any entry keeps every entry on the
  // decode kernel (the bench's old path). A GPU's storage runs its decode kernel for all.
  int64_t prefill_min_queries = core::kPagedPrefillMinQueries;
  // A step's attention runs in turns of at most this many query tokens per entry (a
  // prefill chunk, as chunked-prefill schedulers cut them): other steps that arrive
  // meanwhile take their turns between its chunks instead of waiting for all of it. >= 1.
  int64_t prefill_chunk_tokens = 256;
  // Fill freed blocks with NaN, so that a read outside a block table shows (tests).
  bool poison_freed_blocks = false;
  // What one identity's sessions may hold at once (sessions and reserved tokens, forks
  // included); 0 for no limit. Sessions without an owner (a server without session
  // credentials) are not counted.
  int64_t max_sessions_per_owner = 0;
  int64_t max_reserved_tokens_per_owner = 0;
  // Prefix of every session id, naming the replica that holds it ("" for none).
  std::string replica;

  absl::Status Validate() const;
};

struct SessionInfo {
  std::string id;
  std::string owner;  // the identity that created it; "" for none
  SessionShape shape;
  int64_t length = 0;                  // tokens written in every layer
  std::vector<int64_t> layer_lengths;  // tokens written, per layer
  int64_t reserved_tokens = 0;         // what it may grow to
  int64_t kv_bytes = 0;                // of the blocks it holds (shared ones included)
  absl::Duration ttl;
  absl::Time last_used;
};

// One entry of a step: n new tokens of one layer of one session. The pointers are the
// caller's, row-major, and must stay valid during Step.
struct StepEntry {
  std::string session_id;
  int64_t layer = 0;
  int64_t position = 0;          // of the first new token
  int64_t num_tokens = 0;        // n >= 1
  const float* query = nullptr;  // [n][H][dk], rotated
  const float* key = nullptr;    // [n][Hkv][dk], rotated
  const float* value = nullptr;  // [n][Hkv][dv]
  float* output = nullptr;       // [n][H][dv]
  float* log_sum_exp = nullptr;  // [n][H], or null
};

// Where a step entry goes, checked when the step runs and, before its work is queued, by
// the service: a layer of the session's `layer_lengths.size()`, at least one token, a
// position >= 0 leaving no gap past what its layer holds plus `other_tokens` (what the rest
// of a request writes there; POSITION_GAP), an end within `reserved_tokens`
// (PAST_RESERVATION).
absl::Status CheckPlacement(const StepEntry& entry, absl::Span<const int64_t> layer_lengths,
                            int64_t other_tokens, int64_t reserved_tokens);

// What a snapshot carried (SessionTable::WriteSnapshot, RestoreSnapshot).
struct SnapshotReport {
  int64_t sessions = 0;  // written, or restored
  int64_t blocks = 0;    // distinct KV blocks (forks' shared blocks once)
  int64_t bytes = 0;     // of the file
  // Restoring: each session left out, "<id>: <why>" (its layer gone or changed, a limit
  // of this server), at most kMaxRefusalsTold of them; `refused_sessions` counts them all.
  std::vector<std::string> refused;
  int64_t refused_sessions = 0;
  // AdoptSnapshot: the ids of the sessions adopted.
  std::vector<std::string> adopted;
};
inline constexpr int64_t kMaxRefusalsTold = 16;

struct SessionCounters {
  int64_t sessions = 0;
  int64_t tombstones = 0;
  core::kv_cache::KvPoolCounters pool;
  // Live sessions' tokens: written (in every layer) and reserved.
  int64_t written_tokens = 0, reserved_tokens = 0;
  // Since start: sessions created (forks not included), forked, dropped and expired; bytes
  // of K and V the steps' kernels read (a prefix forks share counted once per step), and
  // their compute time (for decode steps their ratio is the achieved KV read bandwidth;
  // prefill chunks are compute-bound); blocks of shared prefixes read once for all the forks
  // a step batched (core::FindSharedPrefixes).
  int64_t created = 0, forked = 0, dropped = 0, expired = 0;
  int64_t restored = 0;    // from a snapshot at start-up
  int64_t adopted = 0;     // from a draining peer (AdoptSnapshot)
  int64_t handed_off = 0;  // to a peer while draining (EndHandoff)
  int64_t kv_bytes_read = 0;
  int64_t shared_blocks_read = 0;
  absl::Duration step_compute;
  // The KV storage's attention calls by the path that ran them, on its device
  // (core::kv_cache::KvStorage::AttendCallsByPath: a GPU's "cudnn" and "kernels").
  std::string kv_device;
  std::map<std::string, int64_t> attend_calls_by_path;
};

// Thread-safe. A mutex covers the table and the pool, held only for bookkeeping: never
// across attention, so that other sessions' calls, health and metrics never wait on a
// step's compute. The KV bytes are the storage's, reached in FIFO turns (StorageTurns): a
// step's writes take one turn and each chunk of its attention another. A session with a
// step in flight is pinned: its blocks outlive a drop or expiry until the step ends, and a
// truncation is refused (ABORTED, SESSION_BUSY), so no step ever reads a reused block.
class SessionTable {
 public:
  // A table whose KV blocks live in host memory, attended on `pool`.
  static absl::StatusOr<std::unique_ptr<SessionTable>> Create(const SessionTableOptions& options,
                                                              core::ThreadPool& pool);
  // A table over `storage` (core::Devices::CreateKvStorage: where a backend keeps memory),
  // which must have kv_cache_bytes / block_bytes blocks of block_bytes.
  static absl::StatusOr<std::unique_ptr<SessionTable>> Create(
      const SessionTableOptions& options, std::unique_ptr<core::kv_cache::KvStorage> storage);

  // A new session of `shape` that may grow to `reserved_tokens`, owned by `owner` ("" for
  // none); `ttl` zero means the default.
  absl::StatusOr<SessionInfo> CreateSession(const SessionShape& shape, int64_t reserved_tokens,
                                            absl::Duration ttl, absl::Time now,
                                            const std::string& owner = "");
  // A new session sharing the first `tokens` tokens of `id` (copy-on-write by block), owned
  // by its owner; `reserved_tokens` zero means the source's reservation, and `ttl` zero the
  // source's TTL.
  absl::StatusOr<SessionInfo> Fork(const std::string& id, int64_t tokens, int64_t reserved_tokens,
                                   absl::Duration ttl, absl::Time now);
  // Back to `tokens` tokens in every layer (rejected speculative tokens).
  absl::StatusOr<SessionInfo> Truncate(const std::string& id, int64_t tokens, absl::Time now);
  absl::Status Drop(const std::string& id, absl::Time now);
  // Without `renew_ttl` a read is not a use: the session's idle time goes on.
  absl::StatusOr<SessionInfo> Get(const std::string& id, absl::Time now, bool renew_ttl = true);
  std::vector<SessionInfo> List(absl::Time now);

  // Writes every entry's K/V, then attends every entry in one pass. Entries of one session
  // and layer apply in position order, so an entry sees the tokens of earlier entries; an
  // entry attends to keys 0 .. position + i for its token i. One status per entry; a
  // failed entry writes nothing and leaves its output untouched. An entry of n >=
  // options.prefill_min_queries tokens (a prefill chunk) runs on the blocked flash-style
  // kernel, shorter ones on the decode kernel; outputs are bitwise the same for the same
  // entry whatever else the step holds.
  std::vector<absl::Status> Step(absl::Span<const StepEntry> entries, absl::Time now);

  // Ends the sessions idle past their TTL (tombstoned "expired"); returns how many.
  int64_t ExpireIdle(absl::Time now);

  // Writes every live session (shape, owner, positions, reservation, TTL, layer names with
  // their LayerDigest, block tables, and each distinct KV block once) to `path`, a file in
  // session_snapshot.h's format, replacing it only once complete. For a drained server:
  // every other call waits until it is written.
  absl::StatusOr<SnapshotReport> WriteSnapshot(const std::string& path, absl::Time now);
  // Fills this table, which must hold no session, from a snapshot of a table with the same
  // replica name and block size. A session whose served layers `find_layer` does not give
  // with the same LayerDigest, or that this table's limits or pool refuse, is left out and
  // its reason told; its idle time goes on from where it was. A torn or corrupt file
  // restores nothing: DATA_LOSS or FAILED_PRECONDITION naming the part.
  using LayerLookup =
      std::function<absl::StatusOr<std::shared_ptr<const core::MhaLayer>>(const std::string&)>;
  absl::StatusOr<SnapshotReport> RestoreSnapshot(const std::string& path,
                                                 const LayerLookup& find_layer, absl::Time now);

  // A draining replica hands its sessions to a peer (--session_handoff_peer):
  // BeginHandoff writes every live session to `path` as WriteSnapshot does and marks them
  // moving: until EndHandoff their calls are UNAVAILABLE (SESSION_MOVING), which clients
  // retry. The peer adopts the file (AdoptSnapshot); EndHandoff then ends the sessions it
  // adopted here, and their calls answer FAILED_PRECONDITION (WRONG_REPLICA) naming `holder`
  // at `address` for as long as a tombstone lasts; every other session answers again.
  absl::StatusOr<SnapshotReport> BeginHandoff(const std::string& path, absl::Time now);
  // While the server restores a snapshot at start-up (its port is already open): a call for
  // a session the table does not hold yet, and a new session, are UNAVAILABLE
  // (SESSION_RESTORING), which clients retry, instead of NOT_FOUND or taking blocks the
  // restored sessions need.
  void SetRestoring(bool restoring);
  void EndHandoff(absl::Span<const std::string> adopted, const std::string& holder,
                  const std::string& address, absl::Time now);
  // Adds the sessions of another named replica's snapshot beside this table's own, under
  // their ids, as RestoreSnapshot restores (the same checks; a session whose id is held
  // here already is left out). `report.adopted` names them.
  absl::StatusOr<SnapshotReport> AdoptSnapshot(const std::string& path,
                                               const LayerLookup& find_layer, absl::Time now);

  SessionCounters Counters() const;
  // Steps waiting for their turn on the storage behind another step's writes or chunk.
  int64_t StepsWaitingForATurn() const { return storage_turns_.Waiting(); }
  int64_t block_bytes() const { return options_.block_bytes; }
  int64_t kv_cache_bytes() const { return options_.kv_cache_bytes; }
  int64_t prefill_chunk_tokens() const { return options_.prefill_chunk_tokens; }
  // Where the KV blocks are and attention over them runs: "cpu", "cuda:0".
  const std::string& device() const { return device_; }
  const std::string& replica() const { return options_.replica; }

 private:
  struct Session {
    std::string owner;
    SessionShape shape;
    core::kv_cache::SequenceId sequence = 0;
    std::vector<int64_t> layer_lengths;  // tokens written, per layer
    absl::Duration ttl;
    absl::Time last_used;
  };
  // First-come, first-served turns on the storage; a Turn holds one for its lifetime.
  class StorageTurns {
   public:
    class Turn {
     public:
      explicit Turn(StorageTurns& turns);
      ~Turn();
      Turn(const Turn&) = delete;
      Turn& operator=(const Turn&) = delete;

     private:
      StorageTurns& turns_;
    };
    // Turns asked for and not yet begun.
    int64_t Waiting() const;

   private:
    mutable std::mutex mu_;
    std::condition_variable turn_;
    uint64_t next_ticket_ = 0, serving_ = 0;
  };
  struct AttendPass;
  // What one owner's sessions hold.
  struct OwnerUsage {
    int64_t sessions = 0;
    int64_t reserved_tokens = 0;
  };
  enum class Ending { kDropped, kExpired, kHandedOff };
  struct Tombstone {
    Ending ending;
    absl::Time when;
    std::string holder, address;  // kHandedOff: the peer that holds it now
  };
  absl::StatusOr<SnapshotReport> WriteSnapshotLocked(const std::string& path, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A snapshot's sessions into this table: its own (restoring) or a peer's (adopting).
  enum class Origin { kOwn, kPeer };
  absl::StatusOr<SnapshotReport> TakeSnapshot(const std::string& path,
                                              const LayerLookup& find_layer, absl::Time now,
                                              Origin origin);

  SessionTable(const SessionTableOptions& options, core::kv_cache::KvBlockPool block_pool,
               std::unique_ptr<core::kv_cache::KvStorage> storage);

  absl::StatusOr<Session*> FindLocked(const std::string& id, absl::Time now, bool renew_ttl = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<absl::Duration> TtlFor(absl::Duration ttl) const;
  absl::Status CheckReservation(int64_t reserved_tokens) const;
  // RESOURCE_EXHAUSTED when one more session of `reserved_tokens` would take `owner` past
  // its limits (MAX_SESSIONS_PER_IDENTITY, MAX_RESERVED_TOKENS_PER_IDENTITY).
  absl::Status CheckOwnerLimitsLocked(const std::string& owner, int64_t reserved_tokens) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds (sign +1) or takes away (-1) one session of `reserved_tokens` to `owner`'s usage.
  void CountOwnerLocked(const std::string& owner, int64_t reserved_tokens, int sign)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewIdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionInfo InfoLocked(const std::string& id, const Session& session) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a live session; its tombstone says how.
  void EndLocked(const std::string& id, Tombstone tombstone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remembers `id`'s end, the oldest tombstone forgotten past max_tombstones.
  void AddTombstoneLocked(const std::string& id, Tombstone tombstone)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetTombstonesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies and poisons blocks as the pool says.
  absl::Status CopyBlocksLocked(absl::Span<const core::kv_cache::BlockCopy> copies)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeBlocksLocked(absl::Span<const core::kv_cache::BlockId> freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes one entry's K/V (checking positions already written), or says why not.
  absl::Status WriteLocked(const StepEntry& entry, Session& session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes every entry's K/V, pins their sessions and plans the attention's passes.
  std::vector<AttendPass> PlanStepLocked(absl::Span<const StepEntry> entries, absl::Time now,
                                         std::vector<absl::Status>& statuses,
                                         std::vector<core::kv_cache::SequenceId>& pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnpinLocked(absl::Span<const core::kv_cache::SequenceId> pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives a sequence's blocks back to the pool, or once its last step ends when one is in
  // flight.
  void ReleaseLocked(core::kv_cache::SequenceId sequence) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A snapshot's session as this table holds it, its layers found and checked, or why not.
  absl::StatusOr<Session> RestoredSessionLocked(const snapshot::SnapshotSession& saved,
                                                const LayerLookup& find_layer,
                                                LayerDigests& digests, absl::Time now,
                                                const std::string& replica)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionTableOptions options_;
  const std::string device_;  // the storage's
  StorageTurns storage_turns_;
  mutable core::Mutex mu_;  // see core/mutex.h
  core::kv_cache::KvBlockPool block_pool_ ABSL_GUARDED_BY(mu_);
  // Reached in storage_turns_ only (a step's writes under mu_ as well).
  const std::unique_ptr<core::kv_cache::KvStorage> storage_;
  absl::node_hash_map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Tombstone> tombstones_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> tombstone_order_ ABSL_GUARDED_BY(mu_);  // oldest first
  // Between BeginHandoff and EndHandoff: live sessions' calls are UNAVAILABLE.
  bool moving_ ABSL_GUARDED_BY(mu_) = false;
  // Between SetRestoring(true) and SetRestoring(false).
  bool restoring_ ABSL_GUARDED_BY(mu_) = false;
  SessionCounters totals_ ABSL_GUARDED_BY(mu_);                   // the "since start" fields
  absl::flat_hash_map<std::string, OwnerUsage> owner_usage_ ABSL_GUARDED_BY(mu_);
  // Steps in flight per sequence, and the sequences whose session ended meanwhile.
  absl::flat_hash_map<core::kv_cache::SequenceId, int> pins_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<core::kv_cache::SequenceId> release_when_unpinned_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SESSIONS_SESSION_TABLE_H_
