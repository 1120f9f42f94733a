// Sessions handed from a draining replica to a peer (issue 41's live handoff), so that
// they answer from the peer at once instead of waiting for the restart of their replica.
// The sender (--session_handoff_peer) writes its sessions as a snapshot
// (SessionTable::BeginHandoff), streams the file to the peer's SessionHandoff service and
// ends what the peer adopted (EndHandoff): those sessions' calls then answer WRONG_REPLICA
// naming the peer and its address, which both clients follow. The receiver
// (--accept_session_handoff) spools the stream to a file, bounded by its KV pool, and
// adopts it with every check of a restore (checksums, layer digests, its own limits).
#ifndef ATTENTION_SERVER_NATIVE_SESSION_HANDOFF_H_
#define ATTENTION_SERVER_NATIVE_SESSION_HANDOFF_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "core/mutex.h"
#include "server/models/layer_registry.h"
#include "server/native/access_policy.h"
#include "server/sessions/session_table.h"

namespace attention::server {

// The receiving side: registered only with --accept_session_handoff. Needs the admin
// token where the server has one. One adoption at a time.
class SessionHandoffService final : public v1::SessionHandoff::Service {
 public:
  // Spooled files go to `spool_dir`.
  SessionHandoffService(SessionTable& sessions, const LayerRegistry& registry,
                        const AccessPolicy& access, std::string spool_dir);
  // Told to senders (--replica_address with the listening port), once it is known.
  void SetReplicaAddress(std::string address);

  // The most bytes a snapshot of this table can take: its whole pool with each block's
  // digest, and an index.
  int64_t max_snapshot_bytes() const { return max_snapshot_bytes_; }

  grpc::Status AdoptSessions(grpc::ServerContext* context,
                             grpc::ServerReader<v1::SessionSnapshotChunk>* reader,
                             v1::AdoptSessionsResponse* response) override;

 private:
  absl::Status Adopt(grpc::ServerContext& context,
                     grpc::ServerReader<v1::SessionSnapshotChunk>& reader,
                     v1::AdoptSessionsResponse& response);

  SessionTable& sessions_;
  const LayerRegistry& registry_;
  const AccessPolicy access_;  // a copy: the options it came from may go first
  const std::string spool_dir_;
  const int64_t max_snapshot_bytes_;
  core::Mutex adopting_;
  std::string replica_address_ ABSL_GUARDED_BY(adopting_);
};

// What a handoff did.
struct HandoffReport {
  int64_t sessions = 0;  // sent
  int64_t bytes = 0;     // of the snapshot sent
  std::string holder, address;
  int64_t adopted = 0;
  int64_t refused_sessions = 0;
  std::vector<std::string> refused;  // "<id>: <why>", the first few
};

// The sending side, during a drain: hands every live session of `sessions` to the peer at
// `peer_address` (plaintext gRPC, with `admin_token` as its bearer token when non-empty),
// spooling through the file `spool_path`, within `deadline`. Sessions the peer did not
// adopt, or all of them on any error, stay here and answer again. Sessions are told to
// follow the peer's --replica_address, else `peer_address`.
absl::StatusOr<HandoffReport> HandOffSessions(SessionTable& sessions,
                                              const std::string& peer_address,
                                              const std::string& spool_path,
                                              const std::string& admin_token, absl::Time deadline);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_NATIVE_SESSION_HANDOFF_H_
