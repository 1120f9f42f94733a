#include "server/sessions/session_table.h"

#include <openssl/rand.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <new>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/attention_options.h"
#include "core/cpu/host_kv_storage.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"
#include "server/sessions/session_snapshot.h"

namespace attention::server {
namespace {

using core::kv_cache::BlockId;
using core::kv_cache::KvLayout;

KvLayout LayoutOf(const SessionShape& shape) {
  KvLayout layout;
  layout.num_kv_heads = shape.num_kv_heads;
  layout.key_dim = shape.head_dim;
  layout.value_dim = shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim;
  layout.dtype = shape.kv_dtype;
  return layout;
}

// The pool's refusal to promise blocks, with its reason.
absl::Status WithPoolReason(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kResourceExhausted) return status;
  return WithReason(status, "KV_POOL_EXHAUSTED");
}
absl::StatusOr<core::kv_cache::SequenceId> WithPoolReason(
    absl::StatusOr<core::kv_cache::SequenceId> sequence) {
  if (sequence.ok()) return sequence;
  return WithPoolReason(sequence.status());
}

// Whether `id` has the form this server's ids have: "<replica>/<32 hex digits>" or the
// digits alone, the replica a DNS label or pod name. Only such an id may name another
// replica as its holder; any other text is unknown, never echoed as a replica name.
bool IsWellFormedId(absl::string_view id) {
  const size_t slash = id.rfind('/');
  const absl::string_view replica = slash == absl::string_view::npos ? "" : id.substr(0, slash);
  const absl::string_view random = id.substr(slash == absl::string_view::npos ? 0 : slash + 1);
  const auto is_hex = [](char c) { return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f'); };
  const auto is_name = [](char c) {
    return absl::ascii_isalnum(c) || c == '-' || c == '.' || c == '_';
  };
  return random.size() == 32 && std::all_of(random.begin(), random.end(), is_hex) &&
         replica.size() <= 253 && std::all_of(replica.begin(), replica.end(), is_name);
}

float ScaleOf(const SessionShape& shape) {
  return shape.scale > 0 ? shape.scale : 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
}

// A session over BFLOAT16 layers attends as those layers do: its products may round the
// queries and probabilities to bf16 (core::PagedDecodeBatch::bf16_products).
bool Bf16Products(const SessionShape& shape) {
  return shape.layers != nullptr && !shape.layers->layers.empty() &&
         shape.layers->layers.front()->config().compute_dtype == core::DType::kBFloat16;
}

absl::Status CheckShape(const SessionShape& shape) {
  if (shape.num_layers < 1 || shape.num_layers > kMaxSessionLayers) {
    return Invalid("num_layers = ", shape.num_layers, " must be in [1, ", kMaxSessionLayers, "]");
  }
  for (auto [name, value] : {std::pair<const char*, int64_t>{"num_heads", shape.num_heads},
                             {"head_dim", shape.head_dim}}) {
    if (value < 1 || value > kMaxSessionDim) {
      return Invalid(name, " = ", value, " must be in [1, ", kMaxSessionDim, "]");
    }
  }
  RETURN_IF_ERROR(
      core::CheckHeadGroups(shape.num_heads, shape.num_kv_heads, "num_heads", "num_kv_heads"));
  if (shape.v_head_dim < 0 || shape.v_head_dim > kMaxSessionDim) {
    return Invalid("v_head_dim = ", shape.v_head_dim, " must be in [1, ", kMaxSessionDim,
                   "], or 0 for head_dim");
  }
  // Each factor is at most 2^16 now, so the products are exact.
  const int64_t widest_row =
      shape.num_heads * std::max(shape.head_dim, std::max<int64_t>(shape.v_head_dim, 1));
  if (widest_row > kMaxSessionRowWidth) {
    return Invalid("num_heads x max(head_dim, v_head_dim) = ", shape.num_heads, " x ",
                   std::max(shape.head_dim, shape.v_head_dim), " = ", widest_row,
                   " values a token exceeds ", kMaxSessionRowWidth);
  }
  if (shape.kv_dtype != core::DType::kFloat32 && shape.kv_dtype != core::DType::kBFloat16) {
    return Invalid("kv_dtype = ", core::DTypeName(shape.kv_dtype),
                   "; KV is stored in FLOAT32 or BFLOAT16");
  }
  if (!std::isfinite(shape.scale) || shape.scale < 0) {
    return Invalid("scale = ", shape.scale, " must be finite and >= 0 (0 for 1/sqrt(head_dim))");
  }
  if (shape.sliding_window < 0) {
    return Invalid("sliding_window = ", shape.sliding_window, " must be >= 0 (0 for none)");
  }
  if (!shape.layer_sliding_windows.empty()) {
    if (static_cast<int64_t>(shape.layer_sliding_windows.size()) != shape.num_layers) {
      return Invalid("layer_sliding_windows has ", shape.layer_sliding_windows.size(),
                     " windows for num_layers = ", shape.num_layers);
    }
    if (shape.sliding_window != 0) {
      return Invalid("sliding_window = ", shape.sliding_window,
                     " and layer_sliding_windows go one or the other: give one window per "
                     "layer, or one for all");
    }
    for (size_t l = 0; l < shape.layer_sliding_windows.size(); ++l) {
      if (shape.layer_sliding_windows[l] < 0) {
        return Invalid("layer_sliding_windows[", l, "] = ", shape.layer_sliding_windows[l],
                       " must be >= 0 (0 for none)");
      }
    }
  }
  if (shape.layers != nullptr &&
      static_cast<int64_t>(shape.layers->layers.size()) != shape.num_layers) {
    return Invalid("layers has ", shape.layers->layers.size(),
                   " layers for num_layers = ", shape.num_layers);
  }
  return absl::OkStatus();
}

// `count` values as the KV dtype stores them.
void Store(const float* values, int64_t count, std::byte* stored, core::DType dtype) {
  if (dtype == core::DType::kFloat32) {
    std::memcpy(stored, values, count * sizeof(float));
    return;
  }
  auto* bits = reinterpret_cast<uint16_t*>(stored);
  for (int64_t i = 0; i < count; ++i) bits[i] = core::FloatToBFloat16(values[i]);
}

// A call that reached a replica still restoring its snapshot (SessionTable::SetRestoring).
absl::Status RestoringSessions() {
  return WithReason(absl::UnavailableError("this replica is restoring its sessions after a "
                                           "restart; retry in a moment"),
                    "SESSION_RESTORING");
}

}  // namespace

absl::Status CheckPlacement(const StepEntry& entry, absl::Span<const int64_t> layer_lengths,
                            int64_t other_tokens, int64_t reserved_tokens) {
  const auto layers = static_cast<int64_t>(layer_lengths.size());
  if (entry.layer < 0 || entry.layer >= layers) {
    return Invalid("layer = ", entry.layer, " is not a layer of the session (it has ", layers, ")");
  }
  if (entry.num_tokens < 1) return Invalid("num_tokens = ", entry.num_tokens, " must be >= 1");
  if (entry.position < 0) return Invalid("position = ", entry.position, " must be >= 0");
  // No overflow: a request's tokens are bounded by its message.
  const int64_t length = layer_lengths[entry.layer] + other_tokens;
  if (entry.position > length) {
    return WithReason(absl::OutOfRangeError(
                          absl::StrCat("position = ", entry.position, " leaves a gap: layer ",
                                       entry.layer, " of the session holds ", length,
                                       " tokens, so the next step starts at or before ", length)),
                      "POSITION_GAP");
  }
  const int64_t end = entry.position + entry.num_tokens;
  if (end <= reserved_tokens) return absl::OkStatus();
  return WithReason(absl::OutOfRangeError(absl::StrCat("position + num_tokens = ", end,
                                                       " is past the session's reservation of ",
                                                       reserved_tokens, " tokens")),
                    "PAST_RESERVATION");
}

absl::Status SessionTableOptions::Validate() const {
  if (block_bytes < 64 || block_bytes % 64 != 0) {
    return Invalid("block_bytes = ", block_bytes, " must be a positive multiple of 64");
  }
  if (kv_cache_bytes < block_bytes) {
    return Invalid("kv_cache_bytes = ", kv_cache_bytes, " must hold at least one block of ",
                   block_bytes, " bytes");
  }
  if (max_sessions < 1) return Invalid("max_sessions = ", max_sessions, " must be >= 1");
  if (max_session_tokens < 1) {
    return Invalid("max_session_tokens = ", max_session_tokens, " must be >= 1");
  }
  if (default_ttl <= absl::ZeroDuration() || max_ttl < default_ttl) {
    return Invalid("default_ttl = ", absl::FormatDuration(default_ttl),
                   " must be > 0 and <= max_ttl = ", absl::FormatDuration(max_ttl));
  }
  if (tombstone_ttl < absl::ZeroDuration() || max_tombstones < 0) {
    return Invalid("tombstone_ttl and max_tombstones must be >= 0");
  }
  if (prefill_min_queries < 1) {
    return Invalid("prefill_min_queries = ", prefill_min_queries, " must be >= 1");
  }
  if (prefill_chunk_tokens < 1) {
    return Invalid("prefill_chunk_tokens = ", prefill_chunk_tokens, " must be >= 1");
  }
  if (max_sessions_per_owner < 0 || max_reserved_tokens_per_owner < 0) {
    return Invalid("max_sessions_per_owner = ", max_sessions_per_owner,
                   " and max_reserved_tokens_per_owner = ", max_reserved_tokens_per_owner,
                   " must be >= 0 (0 for no limit)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SessionTable>> SessionTable::Create(
    const SessionTableOptions& options, core::ThreadPool& pool) {
  RETURN_IF_ERROR(options.Validate());
  return Create(options, std::make_unique<core::HostKvStorage>(
                             options.kv_cache_bytes / options.block_bytes, options.block_bytes,
                             pool, options.prefill_min_queries));
}

absl::StatusOr<std::unique_ptr<SessionTable>> SessionTable::Create(
    const SessionTableOptions& options, std::unique_ptr<core::kv_cache::KvStorage> storage) {
  RETURN_IF_ERROR(options.Validate());
  if (storage == nullptr) return absl::InvalidArgumentError("no KV storage");
  ASSIGN_OR_RETURN(
      core::kv_cache::KvBlockPool block_pool,
      core::kv_cache::KvBlockPool::Create(options.kv_cache_bytes, options.block_bytes));
  const int64_t blocks = block_pool.Counters().blocks_total;
  if (storage->num_blocks() != blocks || storage->block_bytes() != options.block_bytes) {
    return absl::InternalError(absl::StrCat(
        "the KV storage has ", storage->num_blocks(), " blocks of ", storage->block_bytes(),
        " bytes; the options ask for ", blocks, " of ", options.block_bytes));
  }
  return std::unique_ptr<SessionTable>(
      new SessionTable(options, std::move(block_pool), std::move(storage)));
}

SessionTable::SessionTable(const SessionTableOptions& options,
                           core::kv_cache::KvBlockPool block_pool,
                           std::unique_ptr<core::kv_cache::KvStorage> storage)
    : options_(options),
      device_(storage->device()),
      block_pool_(std::move(block_pool)),
      storage_(std::move(storage)) {
  if (options_.poison_freed_blocks) {
    std::vector<BlockId> all(storage_->num_blocks());
    for (BlockId b = 0; b < storage_->num_blocks(); ++b) all[b] = b;
    core::MutexLock lock(mu_);
    FreeBlocksLocked(all);
  }
}

absl::StatusOr<absl::Duration> SessionTable::TtlFor(absl::Duration ttl) const {
  if (ttl == absl::ZeroDuration()) return options_.default_ttl;
  if (ttl < absl::ZeroDuration() || ttl > options_.max_ttl) {
    return Invalid("ttl = ", absl::FormatDuration(ttl),
                   " must be > 0 and <= ", absl::FormatDuration(options_.max_ttl),
                   " (the server's max_ttl), or 0 for ",
                   absl::FormatDuration(options_.default_ttl));
  }
  return ttl;
}

absl::Status SessionTable::CheckReservation(int64_t reserved_tokens) const {
  if (reserved_tokens < 1) return Invalid("reserved_tokens = ", reserved_tokens, " must be >= 1");
  if (reserved_tokens > options_.max_session_tokens) {
    // INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: no retry succeeds on this server.
    return WithReason(Invalid("reserved_tokens = ", reserved_tokens, " must be in [1, ",
                              options_.max_session_tokens, "] (the server's max_session_tokens)"),
                      "MAX_SESSION_TOKENS");
  }
  return absl::OkStatus();
}

absl::Status SessionTable::CheckOwnerLimitsLocked(const std::string& owner,
                                                  int64_t reserved_tokens) const {
  if (owner.empty()) return absl::OkStatus();
  OwnerUsage usage;
  if (const auto found = owner_usage_.find(owner); found != owner_usage_.end()) {
    usage = found->second;
  }
  if (options_.max_sessions_per_owner > 0 && usage.sessions >= options_.max_sessions_per_owner) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          Quoted(owner), " holds ", usage.sessions,
                          " sessions, the most one "
                          "identity may (--max_sessions_per_identity); drop one first")),
                      "MAX_SESSIONS_PER_IDENTITY");
  }
  if (options_.max_reserved_tokens_per_owner > 0 &&
      usage.reserved_tokens + reserved_tokens > options_.max_reserved_tokens_per_owner) {
    return WithReason(
        absl::ResourceExhaustedError(absl::StrCat(
            Quoted(owner), "'s sessions reserve ", usage.reserved_tokens, " tokens; ",
            reserved_tokens, " more would pass the ", options_.max_reserved_tokens_per_owner,
            " one identity may reserve (--max_session_tokens_per_identity)")),
        "MAX_RESERVED_TOKENS_PER_IDENTITY");
  }
  return absl::OkStatus();
}

void SessionTable::CountOwnerLocked(const std::string& owner, int64_t reserved_tokens, int sign) {
  if (owner.empty()) return;
  OwnerUsage& usage = owner_usage_[owner];
  usage.sessions += sign;
  usage.reserved_tokens += sign * reserved_tokens;
  if (usage.sessions == 0) owner_usage_.erase(owner);
}

std::string SessionTable::NewIdLocked() {
  while (true) {
    unsigned char random[16];
    if (RAND_bytes(random, sizeof(random)) != 1) {
      // The CSPRNG is seeded by the OS; failing here means the process cannot make ids.
      std::abort();
    }
    std::string id = absl::BytesToHexString(
        absl::string_view(reinterpret_cast<const char*>(random), sizeof(random)));
    if (!options_.replica.empty()) id = absl::StrCat(options_.replica, "/", id);
    if (!sessions_.contains(id) && !tombstones_.contains(id)) return id;
  }
}

absl::StatusOr<SessionInfo> SessionTable::CreateSession(const SessionShape& shape,
                                                        int64_t reserved_tokens, absl::Duration ttl,
                                                        absl::Time now, const std::string& owner) {
  RETURN_IF_ERROR(CheckShape(shape));
  RETURN_IF_ERROR(CheckReservation(reserved_tokens));
  ASSIGN_OR_RETURN(const absl::Duration session_ttl, TtlFor(ttl));
  core::MutexLock lock(mu_);
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "the server holds ", sessions_.size(),
                          " sessions, its max_sessions; drop one or wait for one to expire")),
                      "MAX_SESSIONS");
  }
  if (restoring_) return RestoringSessions();
  RETURN_IF_ERROR(CheckOwnerLimitsLocked(owner, reserved_tokens));
  ASSIGN_OR_RETURN(
      const core::kv_cache::SequenceId sequence,
      WithPoolReason(block_pool_.Reserve(LayoutOf(shape), shape.num_layers, reserved_tokens)));
  Session session;
  session.owner = owner;
  session.shape = shape;
  session.sequence = sequence;
  session.layer_lengths.assign(shape.num_layers, 0);
  session.ttl = session_ttl;
  session.last_used = now;
  const std::string id = NewIdLocked();
  const Session& stored = sessions_[id] = std::move(session);
  CountOwnerLocked(owner, reserved_tokens, +1);
  ++totals_.created;
  return InfoLocked(id, stored);
}

absl::StatusOr<SessionTable::Session*> SessionTable::FindLocked(const std::string& id,
                                                                absl::Time now, bool renew_ttl) {
  if (id.empty()) return Invalid("session_id is empty");
  ForgetTombstonesLocked(now);
  auto found = sessions_.find(id);
  if (found != sessions_.end() && now - found->second.last_used > found->second.ttl &&
      !pins_.contains(found->second.sequence)) {  // a step in flight is a use
    EndLocked(id, Tombstone{Ending::kExpired, now, "", ""});
    found = sessions_.end();
  }
  if (found != sessions_.end()) {
    if (moving_) {
      return WithReason(absl::UnavailableError(absl::StrCat(
                            "session ", Quoted(id),
                            " is being handed to another replica while this one drains; "
                            "retry, and follow the replica its answer names")),
                        "SESSION_MOVING");
    }
    if (renew_ttl) found->second.last_used = now;  // every use renews the TTL
    return &found->second;
  }
  if (restoring_) return RestoringSessions();
  const auto tombstone = tombstones_.find(id);
  if (tombstone != tombstones_.end() && tombstone->second.ending == Ending::kHandedOff) {
    // Clients parse `is held by replica "NAME" at "ADDRESS"` and send the call there.
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "session ", Quoted(id), " is held by replica ", Quoted(tombstone->second.holder),
            " at ", Quoted(tombstone->second.address), ", not this one (", Quoted(options_.replica),
            "), which handed it over while draining; send its calls there")),
        "WRONG_REPLICA");
  }
  const size_t slash = id.rfind('/');
  if (tombstone == tombstones_.end() && slash != std::string::npos &&
      absl::string_view(id).substr(0, slash) != options_.replica && IsWellFormedId(id)) {
    return WithReason(
        absl::FailedPreconditionError(
            absl::StrCat("session ", Quoted(id), " is held by replica ",
                         Quoted(id.substr(0, slash)), ", not this one (", Quoted(options_.replica),
                         "); send its calls to the replica_address its CreateSession answer gave")),
        "WRONG_REPLICA");
  }
  if (tombstone == tombstones_.end()) {
    return WithReason(
        absl::NotFoundError(absl::StrCat("session ", Quoted(id), " is unknown on this server")),
        "SESSION_UNKNOWN");
  }
  if (tombstone->second.ending == Ending::kExpired) {
    return WithReason(absl::NotFoundError(absl::StrCat(
                          "session ", Quoted(id), " expired: it was idle longer than its ttl")),
                      "SESSION_EXPIRED");
  }
  return WithReason(absl::NotFoundError(absl::StrCat("session ", Quoted(id), " was dropped")),
                    "SESSION_DROPPED");
}

SessionInfo SessionTable::InfoLocked(const std::string& id, const Session& session) const {
  SessionInfo info;
  info.id = id;
  info.owner = session.owner;
  info.shape = session.shape;
  info.length = *std::min_element(session.layer_lengths.begin(), session.layer_lengths.end());
  info.layer_lengths = session.layer_lengths;
  const core::kv_cache::KvSequence* sequence = *block_pool_.Find(session.sequence);
  info.reserved_tokens = sequence->reserved_tokens;
  for (const auto& table : sequence->block_tables) {
    info.kv_bytes += static_cast<int64_t>(table.size()) * options_.block_bytes;
  }
  info.ttl = session.ttl;
  info.last_used = session.last_used;
  return info;
}

absl::StatusOr<SessionInfo> SessionTable::Fork(const std::string& id, int64_t tokens,
                                               int64_t reserved_tokens, absl::Duration ttl,
                                               absl::Time now) {
  // Zero asks for the source's reservation and TTL, found below.
  if (reserved_tokens < 0) {
    return Invalid("reserved_tokens = ", reserved_tokens,
                   " must be >= 0 (0 for the source's reservation)");
  }
  if (reserved_tokens != 0) RETURN_IF_ERROR(CheckReservation(reserved_tokens));
  absl::Duration session_ttl = ttl;
  if (ttl != absl::ZeroDuration()) {
    ASSIGN_OR_RETURN(session_ttl, TtlFor(ttl));
  }
  core::MutexLock lock(mu_);
  ASSIGN_OR_RETURN(Session * source, FindLocked(id, now));
  if (reserved_tokens == 0) {
    reserved_tokens = (*block_pool_.Find(source->sequence))->reserved_tokens;
  }
  if (ttl == absl::ZeroDuration()) session_ttl = source->ttl;
  const int64_t written =
      *std::min_element(source->layer_lengths.begin(), source->layer_lengths.end());
  if (tokens < 0 || tokens > written) {
    return WithReason(
        absl::OutOfRangeError(absl::StrCat("tokens = ", tokens, " must be in [0, ", written,
                                           "], the tokens written in every layer")),
        "PAST_LENGTH");
  }
  if (reserved_tokens < tokens) {
    return Invalid("reserved_tokens = ", reserved_tokens, " is less than tokens = ", tokens);
  }
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return WithReason(
        absl::ResourceExhaustedError(absl::StrCat("the server holds ", sessions_.size(),
                                                  " sessions, its max_sessions; drop one first")),
        "MAX_SESSIONS");
  }
  RETURN_IF_ERROR(CheckOwnerLimitsLocked(source->owner, reserved_tokens));
  ASSIGN_OR_RETURN(const core::kv_cache::SequenceId sequence,
                   WithPoolReason(block_pool_.Fork(source->sequence, tokens, reserved_tokens)));
  Session fork;
  fork.owner = source->owner;
  fork.shape = source->shape;
  fork.sequence = sequence;
  fork.layer_lengths.assign(fork.shape.num_layers, tokens);
  fork.ttl = session_ttl;
  fork.last_used = now;
  const std::string fork_id = NewIdLocked();
  const Session& stored = sessions_[fork_id] = std::move(fork);
  CountOwnerLocked(stored.owner, reserved_tokens, +1);
  ++totals_.forked;
  return InfoLocked(fork_id, stored);
}

absl::StatusOr<SessionInfo> SessionTable::Truncate(const std::string& id, int64_t tokens,
                                                   absl::Time now) {
  core::MutexLock lock(mu_);
  ASSIGN_OR_RETURN(Session * session, FindLocked(id, now));
  const int64_t longest =
      *std::max_element(session->layer_lengths.begin(), session->layer_lengths.end());
  if (tokens < 0 || tokens > longest) {
    return WithReason(absl::OutOfRangeError(absl::StrCat("tokens = ", tokens, " must be in [0, ",
                                                         longest, "], the session's length")),
                      "PAST_LENGTH");
  }
  if (pins_.contains(session->sequence)) {
    // Its step reads blocks a truncation would free for others to write.
    return WithReason(absl::AbortedError(absl::StrCat(
                          "session ", Quoted(id),
                          " has a step in flight; truncate it once the step has answered")),
                      "SESSION_BUSY");
  }
  std::vector<BlockId> freed;
  RETURN_IF_ERROR(WithPoolReason(block_pool_.Truncate(session->sequence, tokens, &freed)));
  FreeBlocksLocked(freed);
  for (int64_t& length : session->layer_lengths) length = std::min(length, tokens);
  return InfoLocked(id, *session);
}

absl::Status SessionTable::Drop(const std::string& id, absl::Time now) {
  core::MutexLock lock(mu_);
  RETURN_IF_ERROR(FindLocked(id, now).status());
  EndLocked(id, Tombstone{Ending::kDropped, now, "", ""});
  return absl::OkStatus();
}

absl::StatusOr<SessionInfo> SessionTable::Get(const std::string& id, absl::Time now,
                                              bool renew_ttl) {
  core::MutexLock lock(mu_);
  ASSIGN_OR_RETURN(Session * session, FindLocked(id, now, renew_ttl));
  return InfoLocked(id, *session);
}

std::vector<SessionInfo> SessionTable::List(absl::Time now) {
  ExpireIdle(now);
  core::MutexLock lock(mu_);
  std::map<std::string, const Session*> sorted;
  for (const auto& [id, session] : sessions_) sorted.emplace(id, &session);
  std::vector<SessionInfo> infos;
  for (const auto& [id, session] : sorted) infos.push_back(InfoLocked(id, *session));
  return infos;
}

int64_t SessionTable::ExpireIdle(absl::Time now) {
  core::MutexLock lock(mu_);
  ForgetTombstonesLocked(now);
  std::vector<std::string> idle;
  for (const auto& [id, session] : sessions_) {
    if (now - session.last_used > session.ttl && !pins_.contains(session.sequence)) {
      idle.push_back(id);
    }
  }
  for (const std::string& id : idle) EndLocked(id, Tombstone{Ending::kExpired, now, "", ""});
  return static_cast<int64_t>(idle.size());
}

void SessionTable::EndLocked(const std::string& id, Tombstone tombstone) {
  switch (tombstone.ending) {
    case Ending::kDropped:
      ++totals_.dropped;
      break;
    case Ending::kExpired:
      ++totals_.expired;
      break;
    case Ending::kHandedOff:
      ++totals_.handed_off;
      break;
  }
  const auto found = sessions_.find(id);
  CountOwnerLocked(found->second.owner,
                   (*block_pool_.Find(found->second.sequence))->reserved_tokens, -1);
  ReleaseLocked(found->second.sequence);
  sessions_.erase(found);
  AddTombstoneLocked(id, std::move(tombstone));
}

void SessionTable::AddTombstoneLocked(const std::string& id, Tombstone tombstone) {
  if (options_.max_tombstones == 0 || tombstones_.contains(id)) return;
  while (static_cast<int64_t>(tombstones_.size()) >= options_.max_tombstones) {
    tombstones_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
  tombstones_[id] = std::move(tombstone);
  tombstone_order_.push_back(id);
}

void SessionTable::ForgetTombstonesLocked(absl::Time now) {
  while (!tombstone_order_.empty()) {
    const auto oldest = tombstones_.find(tombstone_order_.front());
    if (now - oldest->second.when <= options_.tombstone_ttl) break;
    tombstones_.erase(oldest);
    tombstone_order_.pop_front();
  }
}

absl::Status SessionTable::CopyBlocksLocked(absl::Span<const core::kv_cache::BlockCopy> copies) {
  for (const auto& copy : copies) RETURN_IF_ERROR(storage_->CopyBlock(copy.from, copy.to));
  return absl::OkStatus();
}

void SessionTable::FreeBlocksLocked(absl::Span<const BlockId> freed) {
  if (!options_.poison_freed_blocks) return;
  // A test aid: a block that could not be poisoned is merely freed.
  for (const BlockId block : freed) storage_->Poison(block).IgnoreError();
}

absl::Status SessionTable::WriteLocked(const StepEntry& entry, Session& session) {
  const SessionShape& shape = session.shape;
  const core::kv_cache::KvSequence* sequence = *block_pool_.Find(session.sequence);
  RETURN_IF_ERROR(CheckPlacement(entry, session.layer_lengths, 0, sequence->reserved_tokens));
  int64_t& length = session.layer_lengths[entry.layer];
  const int64_t end = entry.position + entry.num_tokens;
  const KvLayout layout = LayoutOf(shape);
  const int64_t heads = layout.num_kv_heads, dk = layout.key_dim, dv = layout.value_dim;
  const int64_t element = layout.ElementBytes();
  // Visits the entry's tokens [from, to) a block at a time: the run's block, first slot,
  // token count and first position, with its K and V as the storage holds them ([Hkv]
  // [count][d] in the KV dtype) in `keys` and `values`.
  std::vector<std::byte> keys, values;
  auto for_each_run = [&](int64_t from, int64_t to, auto&& visit) -> absl::Status {
    const int64_t per_block = sequence->tokens_per_block;
    for (int64_t t = from; t < to;) {
      const int64_t slot = t % per_block;
      const int64_t count = std::min(to - t, per_block - slot);
      keys.resize(heads * count * dk * element);
      values.resize(heads * count * dv * element);
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < count; ++i) {
          const int64_t row = t + i - entry.position;
          Store(entry.key + (row * heads + h) * dk, dk,
                keys.data() + (h * count + i) * dk * element, layout.dtype);
          Store(entry.value + (row * heads + h) * dv, dv,
                values.data() + (h * count + i) * dv * element, layout.dtype);
        }
      }
      RETURN_IF_ERROR(visit(sequence->block_tables[entry.layer][t / per_block], slot, count, t));
      t += count;
    }
    return absl::OkStatus();
  };
  // The lambdas below run under mu_ too, but clang's analysis does not see into lambdas.
  core::kv_cache::KvStorage& storage = *storage_;
  // Positions written already must hold the same K/V, bit for bit: then the step is a retry.
  std::vector<std::byte> stored_keys, stored_values;
  int64_t conflict = -1;
  RETURN_IF_ERROR(for_each_run(
      entry.position, std::min(end, length),
      [&](BlockId block, int64_t slot, int64_t count, int64_t first) -> absl::Status {
        if (conflict >= 0) return absl::OkStatus();  // the first one is named
        stored_keys.resize(keys.size());
        stored_values.resize(values.size());
        RETURN_IF_ERROR(storage.ReadTokens(block, layout, sequence->tokens_per_block, slot, count,
                                           stored_keys.data(), stored_values.data()));
        for (int64_t i = 0; i < count && conflict < 0; ++i) {
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t k = (h * count + i) * dk * element, v = (h * count + i) * dv * element;
            if (std::memcmp(&keys[k], &stored_keys[k], dk * element) != 0 ||
                std::memcmp(&values[v], &stored_values[v], dv * element) != 0) {
              conflict = first + i;
              break;
            }
          }
        }
        return absl::OkStatus();
      }));
  if (conflict >= 0) {
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "position ", conflict, " of layer ", entry.layer,
                          " already holds other keys or values; truncate the session to ", conflict,
                          " tokens before writing there again")),
                      "POSITION_CONFLICT");
  }
  if (end <= length) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::vector<core::kv_cache::BlockCopy> copies,
                   block_pool_.EnsureCapacity(session.sequence, end));
  RETURN_IF_ERROR(CopyBlocksLocked(copies));
  sequence = *block_pool_.Find(session.sequence);  // EnsureCapacity may have moved it
  RETURN_IF_ERROR(
      for_each_run(length, end, [&](BlockId block, int64_t slot, int64_t count, int64_t) {
        return storage.WriteTokens(block, layout, sequence->tokens_per_block, slot, count,
                                   keys.data(), values.data());
      }));
  length = end;
  return absl::OkStatus();
}

SessionTable::StorageTurns::Turn::Turn(StorageTurns& turns) : turns_(turns) {
  std::unique_lock<std::mutex> lock(turns_.mu_);
  const uint64_t ticket = turns_.next_ticket_++;
  turns_.turn_.wait(lock, [&] { return turns_.serving_ == ticket; });
}

SessionTable::StorageTurns::Turn::~Turn() {
  {
    std::lock_guard<std::mutex> lock(turns_.mu_);
    ++turns_.serving_;
  }
  turns_.turn_.notify_all();
}

int64_t SessionTable::StorageTurns::Waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(next_ticket_ - serving_) - (next_ticket_ > serving_ ? 1 : 0);
}

// One turn of a step's attention: entries that share a KV layout, heads, scale and window,
// each with a chunk of its query rows, over block tables copied under the table's lock.
struct SessionTable::AttendPass {
  core::PagedDecodeBatch batch;  // batch.sequences spans `sequences`
  std::vector<core::PagedDecodeSequence> sequences;
  std::vector<std::vector<BlockId>> block_tables;
  std::vector<size_t> members;  // the entry of each sequence
  int64_t first_query = 0;      // of each entry's chunk
};

std::vector<SessionTable::AttendPass> SessionTable::PlanStepLocked(
    absl::Span<const StepEntry> entries, absl::Time now, std::vector<absl::Status>& statuses,
    std::vector<core::kv_cache::SequenceId>& pinned) {
  // Entries of one session and layer apply in position order, whatever order they came in.
  std::vector<size_t> order(entries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(entries[a].session_id, entries[a].layer, entries[a].position) <
           std::tie(entries[b].session_id, entries[b].layer, entries[b].position);
  });
  std::vector<Session*> sessions(entries.size(), nullptr);
  for (const size_t i : order) {
    absl::StatusOr<Session*> session = FindLocked(entries[i].session_id, now);
    statuses[i] = session.status();
    if (session.ok()) statuses[i] = WriteLocked(entries[i], **session);
    if (statuses[i].ok()) sessions[i] = *session;
  }
  // One group per KV layout, heads, scale and window; the dispatcher sends decode entries
  // to the decode kernel and prefill chunks to the blocked flash-style kernel
  // (core/cpu/paged_prefill_cpu.h). Pass k of a group holds chunk k of each of its entries.
  using GroupKey = std::tuple<int64_t, int64_t, int64_t, int, int64_t, float, int64_t, bool>;
  std::map<GroupKey, std::vector<size_t>> groups;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (sessions[i] == nullptr) continue;
    const SessionShape& shape = sessions[i]->shape;
    const KvLayout layout = LayoutOf(shape);
    groups[{layout.num_kv_heads, layout.key_dim, layout.value_dim, static_cast<int>(layout.dtype),
            shape.num_heads, ScaleOf(shape), shape.WindowOf(entries[i].layer), Bf16Products(shape)}]
        .push_back(i);
  }
  // Every group's first chunks (all of a decode entry) first, then the second chunks, ...
  const int64_t chunk = options_.prefill_chunk_tokens;
  std::vector<AttendPass> passes;
  for (int64_t first = 0;; first += chunk) {
    const size_t before = passes.size();
    for (const auto& [key, members] : groups) {
      const SessionShape& shape = sessions[members.front()]->shape;
      AttendPass pass;
      pass.first_query = first;
      for (const size_t i : members) {
        const StepEntry& entry = entries[i];
        if (first >= entry.num_tokens) continue;
        const core::kv_cache::KvSequence* sequence = *block_pool_.Find(sessions[i]->sequence);
        pass.batch.tokens_per_block = sequence->tokens_per_block;
        pass.block_tables.push_back(sequence->block_tables[entry.layer]);
        const int64_t count = std::min(chunk, entry.num_tokens - first);
        core::PagedDecodeSequence rows;
        rows.length = entry.position + first + count;
        rows.num_queries = count;
        rows.query = entry.query + first * shape.num_heads * shape.head_dim;
        rows.output = entry.output + first * shape.num_heads * LayoutOf(shape).value_dim;
        rows.log_sum_exp =
            entry.log_sum_exp == nullptr ? nullptr : entry.log_sum_exp + first * shape.num_heads;
        pass.sequences.push_back(rows);
        pass.members.push_back(i);
      }
      if (pass.sequences.empty()) continue;
      for (size_t s = 0; s < pass.sequences.size(); ++s) {
        pass.sequences[s].block_table = pass.block_tables[s];
      }
      pass.batch.layout = LayoutOf(shape);
      pass.batch.num_heads = shape.num_heads;
      pass.batch.scale = ScaleOf(shape);
      pass.batch.sliding_window = std::get<6>(key);  // the group's window
      pass.batch.bf16_products = std::get<7>(key);
      passes.push_back(std::move(pass));
    }
    if (passes.size() == before) break;
  }
  absl::flat_hash_set<core::kv_cache::SequenceId> distinct;
  for (const Session* session : sessions) {
    if (session != nullptr && distinct.insert(session->sequence).second) {
      pinned.push_back(session->sequence);
      ++pins_[session->sequence];
    }
  }
  return passes;
}

void SessionTable::UnpinLocked(absl::Span<const core::kv_cache::SequenceId> pinned) {
  for (const core::kv_cache::SequenceId sequence : pinned) {
    if (--pins_[sequence] > 0) continue;
    pins_.erase(sequence);
    if (release_when_unpinned_.erase(sequence) > 0) ReleaseLocked(sequence);
  }
}

void SessionTable::ReleaseLocked(core::kv_cache::SequenceId sequence) {
  if (pins_.contains(sequence)) {
    release_when_unpinned_.insert(sequence);
    return;
  }
  std::vector<BlockId> freed;
  // Releasing a sequence the table holds cannot fail.
  block_pool_.Release(sequence, &freed).IgnoreError();
  FreeBlocksLocked(freed);
}

std::vector<absl::Status> SessionTable::Step(absl::Span<const StepEntry> entries, absl::Time now) {
  std::vector<absl::Status> statuses(entries.size());
  std::vector<core::kv_cache::SequenceId> pinned;
  std::vector<AttendPass> passes;
  absl::Duration compute;
  int64_t kv_bytes_read = 0, shared_blocks_read = 0;
  const auto attend = [&](AttendPass& pass) {
    pass.batch.sequences = pass.sequences;
    core::PagedAttendStats shared;
    pass.batch.stats = &shared;
    const absl::Time start = absl::Now();
    const absl::Status computed =
        CatchExceptions("the KV attention", [&] { return storage_->Attend(pass.batch); });
    compute += absl::Now() - start;
    if (!computed.ok()) {
      for (const size_t i : pass.members) statuses[i] = computed;
      return;
    }
    // Each K/V head is read once for its query group (or gathered once for a prefill
    // chunk), over the keys the first query sees.
    for (const core::PagedDecodeSequence& sequence : pass.sequences) {
      const int64_t first_seen = sequence.length - sequence.num_queries;
      const int64_t keys =
          pass.batch.sliding_window > 0
              ? sequence.length - std::max<int64_t>(0, first_seen - pass.batch.sliding_window + 1)
              : sequence.length;
      kv_bytes_read += keys * pass.batch.layout.TokenBytes();
    }
    // A prefix forks share is read once for all of them.
    kv_bytes_read -= shared.keys_not_reread * pass.batch.layout.TokenBytes();
    shared_blocks_read += shared.shared_blocks;
  };
  if (storage_->attends_concurrently()) {
    // Writes under the lock, then attention beside other steps': blocks being read are
    // pinned, and shared ones are copied before any write.
    {
      core::MutexLock lock(mu_);
      passes = PlanStepLocked(entries, now, statuses, pinned);
    }
    for (AttendPass& pass : passes) attend(pass);
  } else {
    // The writes and every entry's first chunk (a decode entry whole) in one turn, then one
    // turn per later chunk: a decode step waits for at most one chunk of a long prefill.
    size_t next = 0;
    {
      const StorageTurns::Turn turn(storage_turns_);
      {
        core::MutexLock lock(mu_);
        passes = PlanStepLocked(entries, now, statuses, pinned);
      }
      for (; next < passes.size() && passes[next].first_query == 0; ++next) attend(passes[next]);
    }
    for (; next < passes.size(); ++next) {
      const StorageTurns::Turn turn(storage_turns_);
      attend(passes[next]);
    }
  }
  core::MutexLock lock(mu_);
  UnpinLocked(pinned);
  totals_.step_compute += compute;
  totals_.kv_bytes_read += kv_bytes_read;
  totals_.shared_blocks_read += shared_blocks_read;
  return statuses;
}

absl::StatusOr<SnapshotReport> SessionTable::WriteSnapshot(const std::string& path,
                                                           absl::Time now) {
  const StorageTurns::Turn turn(storage_turns_);
  core::MutexLock lock(mu_);
  return WriteSnapshotLocked(path, now);
}

absl::StatusOr<SnapshotReport> SessionTable::BeginHandoff(const std::string& path, absl::Time now) {
  const StorageTurns::Turn turn(storage_turns_);
  core::MutexLock lock(mu_);
  ASSIGN_OR_RETURN(SnapshotReport written, WriteSnapshotLocked(path, now));
  // Under the same lock: no step lands between the file and the peer taking it over.
  moving_ = true;
  return written;
}

void SessionTable::SetRestoring(bool restoring) {
  core::MutexLock lock(mu_);
  restoring_ = restoring;
}

void SessionTable::EndHandoff(absl::Span<const std::string> adopted, const std::string& holder,
                              const std::string& address, absl::Time now) {
  core::MutexLock lock(mu_);
  moving_ = false;
  for (const std::string& id : adopted) {
    if (!sessions_.contains(id)) continue;  // the peer's answer names only what it was sent
    EndLocked(id, Tombstone{Ending::kHandedOff, now, holder, address});
  }
}

absl::StatusOr<SnapshotReport> SessionTable::WriteSnapshotLocked(const std::string& path,
                                                                 absl::Time now) {
  snapshot::SnapshotIndex index;
  index.set_replica(options_.replica);
  index.set_block_bytes(options_.block_bytes);
  index.set_written_unix_ms(absl::ToUnixMillis(now));
  // The pool's blocks in the order the snapshot numbers them; forks' shared blocks once.
  absl::flat_hash_map<BlockId, int32_t> numbered;
  std::vector<BlockId> order;
  LayerDigests digests;
  for (const auto& [id, session] : sessions_) {
    const SessionShape& shape = session.shape;
    snapshot::SnapshotSession& saved = *index.add_sessions();
    saved.set_id(id);
    saved.set_owner(session.owner);
    saved.set_num_layers(shape.num_layers);
    saved.set_num_heads(shape.num_heads);
    saved.set_num_kv_heads(shape.num_kv_heads);
    saved.set_head_dim(shape.head_dim);
    saved.set_v_head_dim(shape.v_head_dim);
    saved.set_kv_dtype(static_cast<int32_t>(shape.kv_dtype));
    saved.set_scale(shape.scale);
    saved.set_sliding_window(shape.sliding_window);
    saved.mutable_layer_sliding_windows()->Add(shape.layer_sliding_windows.begin(),
                                               shape.layer_sliding_windows.end());
    if (shape.layers != nullptr) {
      for (size_t l = 0; l < shape.layers->layers.size(); ++l) {
        snapshot::SnapshotLayer& saved_layer = *saved.add_layers();
        saved_layer.set_name(shape.layers->names[l]);
        saved_layer.set_sha256(digests.Of(*shape.layers->layers[l]));
      }
    }
    saved.mutable_layer_lengths()->Add(session.layer_lengths.begin(), session.layer_lengths.end());
    const core::kv_cache::KvSequence& sequence = **block_pool_.Find(session.sequence);
    saved.set_length(sequence.length);
    saved.set_reserved_tokens(sequence.reserved_tokens);
    for (const std::vector<BlockId>& table : sequence.block_tables) {
      snapshot::SnapshotBlockTable& saved_table = *saved.add_block_tables();
      for (const BlockId block : table) {
        const auto [number, added] =
            numbered.try_emplace(block, static_cast<int32_t>(order.size()));
        if (added) order.push_back(block);
        saved_table.add_blocks(number->second);
      }
    }
    saved.set_ttl_ms(absl::ToInt64Milliseconds(session.ttl));
    saved.set_idle_ms(std::max<int64_t>(0, absl::ToInt64Milliseconds(now - session.last_used)));
  }
  for (const std::string& id : tombstone_order_) {
    const Tombstone& tombstone = tombstones_.at(id);
    if (tombstone.ending != Ending::kHandedOff) continue;
    snapshot::SnapshotForward& forward = *index.add_forwarded();
    forward.set_id(id);
    forward.set_holder(tombstone.holder);
    forward.set_address(tombstone.address);
    forward.set_handed_unix_ms(absl::ToUnixMillis(tombstone.when));
  }
  index.set_num_blocks(static_cast<int64_t>(order.size()));
  ASSIGN_OR_RETURN(std::unique_ptr<SnapshotWriter> writer, SnapshotWriter::Open(path, index));
  std::vector<std::byte> bytes(options_.block_bytes);
  for (const BlockId block : order) {
    RETURN_IF_ERROR(storage_->ReadBlock(block, bytes.data()));
    RETURN_IF_ERROR(writer->AddBlock(bytes.data()));
  }
  RETURN_IF_ERROR(writer->Commit());
  SnapshotReport report;
  report.sessions = index.sessions_size();
  report.blocks = index.num_blocks();
  report.bytes = writer->bytes();
  return report;
}

absl::StatusOr<SessionTable::Session> SessionTable::RestoredSessionLocked(
    const snapshot::SnapshotSession& saved, const LayerLookup& find_layer, LayerDigests& digests,
    absl::Time now, const std::string& replica) {
  const std::string prefix = replica.empty() ? "" : replica + "/";
  if (!IsWellFormedId(saved.id()) || !absl::StartsWith(saved.id(), prefix)) {
    return Invalid("its id is not one of replica \"", replica, "\"");
  }
  if (sessions_.contains(saved.id())) return Invalid("its id is held here already");
  if (saved.kv_dtype() != static_cast<int32_t>(core::DType::kFloat32) &&
      saved.kv_dtype() != static_cast<int32_t>(core::DType::kBFloat16)) {
    return Invalid("kv_dtype ", saved.kv_dtype(), " is not FLOAT32 or BFLOAT16");
  }
  Session session;
  session.owner = saved.owner();
  SessionShape& shape = session.shape;
  shape.num_layers = saved.num_layers();
  shape.num_heads = saved.num_heads();
  shape.num_kv_heads = saved.num_kv_heads();
  shape.head_dim = saved.head_dim();
  shape.v_head_dim = saved.v_head_dim();
  shape.kv_dtype = static_cast<core::DType>(saved.kv_dtype());
  shape.scale = saved.scale();
  shape.sliding_window = saved.sliding_window();
  shape.layer_sliding_windows.assign(saved.layer_sliding_windows().begin(),
                                     saved.layer_sliding_windows().end());
  if (saved.layers_size() > 0) {
    auto served = std::make_shared<ServedLayers>();
    for (const snapshot::SnapshotLayer& saved_layer : saved.layers()) {
      absl::StatusOr<std::shared_ptr<const core::MhaLayer>> layer = find_layer(saved_layer.name());
      if (!layer.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "its layer \"", saved_layer.name(), "\" is not loaded: ", layer.status().message()));
      }
      if (digests.Of(**layer) != saved_layer.sha256()) {
        return absl::FailedPreconditionError(
            absl::StrCat("its layer \"", saved_layer.name(),
                         "\" is not the one it was created over (other weights or config)"));
      }
      served->layers.push_back(*std::move(layer));
      served->names.push_back(saved_layer.name());
    }
    shape.layers = std::move(served);
  }
  RETURN_IF_ERROR(CheckShape(shape));
  RETURN_IF_ERROR(CheckReservation(saved.reserved_tokens()));
  const absl::Duration ttl = absl::Milliseconds(saved.ttl_ms());
  if (ttl <= absl::ZeroDuration() || ttl > options_.max_ttl) {
    return Invalid("its ttl ", absl::FormatDuration(ttl), " is past this server's max_ttl ",
                   absl::FormatDuration(options_.max_ttl));
  }
  session.ttl = ttl;
  session.last_used = now - absl::Milliseconds(std::max<int64_t>(0, saved.idle_ms()));
  session.layer_lengths.assign(saved.layer_lengths().begin(), saved.layer_lengths().end());
  if (static_cast<int64_t>(session.layer_lengths.size()) != shape.num_layers ||
      saved.block_tables_size() != shape.num_layers) {
    return Invalid("it has ", session.layer_lengths.size(), " layer lengths and ",
                   saved.block_tables_size(), " block tables for ", shape.num_layers, " layers");
  }
  for (const int64_t length : session.layer_lengths) {
    if (length < 0 || length > saved.length()) {
      return Invalid("a layer length ", length, " is outside its KV length ", saved.length());
    }
  }
  return session;
}

absl::StatusOr<SnapshotReport> SessionTable::RestoreSnapshot(const std::string& path,
                                                             const LayerLookup& find_layer,
                                                             absl::Time now) {
  return TakeSnapshot(path, find_layer, now, Origin::kOwn);
}

absl::StatusOr<SnapshotReport> SessionTable::AdoptSnapshot(const std::string& path,
                                                           const LayerLookup& find_layer,
                                                           absl::Time now) {
  return TakeSnapshot(path, find_layer, now, Origin::kPeer);
}

absl::StatusOr<SnapshotReport> SessionTable::TakeSnapshot(const std::string& path,
                                                          const LayerLookup& find_layer,
                                                          absl::Time now, Origin origin) {
  ASSIGN_OR_RETURN(std::unique_ptr<SnapshotReader> reader, SnapshotReader::Open(path));
  const snapshot::SnapshotIndex& index = reader->index();
  const bool own = origin == Origin::kOwn;
  // A peer's snapshot comes from another named replica: its ids say who created them.
  const bool right_replica = own ? index.replica() == options_.replica
                                 : !index.replica().empty() && index.replica() != options_.replica;
  if (!right_replica || index.block_bytes() != options_.block_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session snapshot of replica ", Quoted(index.replica()), " with KV blocks of ",
        index.block_bytes(), " bytes; this server is replica ", Quoted(options_.replica),
        " (--replica_name) with blocks of ", options_.block_bytes,
        own ? "" : ", and adopts only other named replicas' sessions"));
  }
  // Layers are hashed before the table's lock is taken: their weights may be gigabytes.
  LayerDigests digests;
  for (const snapshot::SnapshotSession& saved : index.sessions()) {
    for (const snapshot::SnapshotLayer& saved_layer : saved.layers()) {
      absl::StatusOr<std::shared_ptr<const core::MhaLayer>> layer = find_layer(saved_layer.name());
      if (layer.ok()) digests.Of(**layer);
    }
  }
  SnapshotReport report;
  absl::flat_hash_map<int64_t, BlockId> placed;  // snapshot block -> pool block
  std::vector<std::pair<std::string, Session>> taken;
  const auto refuse = [&report](const std::string& id, absl::string_view why) {
    if (report.refused_sessions++ < kMaxRefusalsTold) {
      report.refused.push_back(absl::StrCat(id.substr(0, 300), ": ", why.substr(0, 500)));
    }
  };
  {
    core::MutexLock lock(mu_);
    if (own && !sessions_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("a snapshot restores into an empty table; this one holds ", sessions_.size(),
                       " sessions"));
    }
    absl::flat_hash_set<std::string> ids;
    for (const snapshot::SnapshotSession& saved : index.sessions()) {
      absl::StatusOr<Session> session =
          ids.insert(saved.id()).second
              ? RestoredSessionLocked(saved, find_layer, digests, now, index.replica())
              : Invalid("its id is in the snapshot twice");
      if (session.ok() &&
          static_cast<int64_t>(sessions_.size() + taken.size()) >= options_.max_sessions) {
        session = absl::ResourceExhaustedError(
            absl::StrCat("this server's max_sessions is ", options_.max_sessions));
      }
      core::kv_cache::KvSequence sequence;
      if (session.ok()) {
        sequence.layout = LayoutOf(session->shape);
        sequence.tokens_per_block =
            core::kv_cache::TokensPerBlock(sequence.layout, options_.block_bytes).value_or(0);
        sequence.num_layers = session->shape.num_layers;
        sequence.length = saved.length();
        sequence.reserved_tokens = saved.reserved_tokens();
        for (const snapshot::SnapshotBlockTable& table : saved.block_tables()) {
          sequence.block_tables.emplace_back(table.blocks().begin(), table.blocks().end());
          for (const BlockId block : table.blocks()) {
            if (block >= index.num_blocks()) {
              session = Invalid("its block table names block ", block, " of ", index.num_blocks());
            }
          }
        }
      }
      absl::StatusOr<core::kv_cache::SequenceId> adopted =
          session.ok() ? block_pool_.Adopt(sequence, placed) : session.status();
      if (!adopted.ok()) {
        refuse(saved.id(), adopted.status().message());
        continue;
      }
      session->sequence = *adopted;
      taken.emplace_back(saved.id(), *std::move(session));
    }
  }
  // Every block is checked, those of sessions left out too: a torn file takes in nothing.
  // Outside the table's lock (the pool's new blocks belong to no session yet), in one turn
  // on the storage.
  absl::Status read;
  {
    const StorageTurns::Turn turn(storage_turns_);
    std::vector<std::byte> bytes(options_.block_bytes);
    for (int64_t block = 0; read.ok() && block < index.num_blocks(); ++block) {
      read = reader->ReadBlock(bytes.data());
      const auto here = placed.find(block);
      if (read.ok() && here != placed.end()) {
        read = storage_->WriteBlock(here->second, bytes.data());
      }
    }
    if (read.ok()) read = reader->Finish();
  }
  core::MutexLock lock(mu_);
  std::vector<std::string> added;
  for (auto& [id, session] : taken) {
    // Sessions created meanwhile have this replica's ids; only another adoption could
    // have brought the same id.
    if (!read.ok() || sessions_.contains(id)) {
      std::vector<BlockId> freed;
      block_pool_.Release(session.sequence, &freed).IgnoreError();  // adopted above
      FreeBlocksLocked(freed);
      if (read.ok()) refuse(id, "its id is held here already");
      continue;
    }
    CountOwnerLocked(session.owner, (*block_pool_.Find(session.sequence))->reserved_tokens, +1);
    sessions_[id] = std::move(session);
    added.push_back(id);
  }
  if (!read.ok()) return read;
  if (own) {
    // Sessions handed to a peer before the restart are still found there.
    for (const snapshot::SnapshotForward& forward : index.forwarded()) {
      if (!IsWellFormedId(forward.id()) || sessions_.contains(forward.id())) continue;
      AddTombstoneLocked(forward.id(), Tombstone{Ending::kHandedOff,
                                                 absl::FromUnixMillis(forward.handed_unix_ms()),
                                                 forward.holder(), forward.address()});
    }
    ForgetTombstonesLocked(now);
  }
  (own ? totals_.restored : totals_.adopted) += static_cast<int64_t>(added.size());
  report.sessions = static_cast<int64_t>(added.size());
  report.blocks = static_cast<int64_t>(placed.size());
  report.bytes = reader->bytes();
  if (!own) report.adopted = std::move(added);
  return report;
}

SessionCounters SessionTable::Counters() const {
  core::MutexLock lock(mu_);
  SessionCounters counters;
  counters.sessions = static_cast<int64_t>(sessions_.size());
  counters.tombstones = static_cast<int64_t>(tombstones_.size());
  counters.pool = block_pool_.Counters();
  counters.kv_device = storage_->device();
  counters.attend_calls_by_path = storage_->AttendCallsByPath();
  for (const auto& [id, session] : sessions_) {
    counters.written_tokens +=
        *std::min_element(session.layer_lengths.begin(), session.layer_lengths.end());
    counters.reserved_tokens += (*block_pool_.Find(session.sequence))->reserved_tokens;
  }
  counters.created = totals_.created;
  counters.forked = totals_.forked;
  counters.restored = totals_.restored;
  counters.adopted = totals_.adopted;
  counters.handed_off = totals_.handed_off;
  counters.dropped = totals_.dropped;
  counters.expired = totals_.expired;
  counters.kv_bytes_read = totals_.kv_bytes_read;
  counters.shared_blocks_read = totals_.shared_blocks_read;
  counters.step_compute = totals_.step_compute;
  return counters;
}

}  // namespace attention::server
