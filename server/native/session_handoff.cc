#include "server/native/session_handoff.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"
#include "server/sessions/session_snapshot.h"

namespace attention::server {
namespace {

// Bytes of the snapshot in each streamed message.
constexpr int64_t kChunkBytes = int64_t{1} << 20;
// Room for a snapshot's header, index and trailer beyond its blocks and their digests.
constexpr int64_t kSnapshotIndexRoom = int64_t{64} << 20;
// The largest answer of a peer a sender reads.
constexpr int kMaxAdoptAnswerBytes = 256 << 20;
// A block's SHA-256 in the file.
constexpr int64_t kBlockDigestBytes = 32;

// Removes a spooled file however the call ends.
class SpoolFile {
 public:
  explicit SpoolFile(std::string path) : path_(std::move(path)) {}
  ~SpoolFile() { std::remove(path_.c_str()); }
  SpoolFile(const SpoolFile&) = delete;
  SpoolFile& operator=(const SpoolFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace

SessionHandoffService::SessionHandoffService(SessionTable& sessions, const LayerRegistry& registry,
                                             const AccessPolicy& access, std::string spool_dir)
    : sessions_(sessions),
      registry_(registry),
      access_(access),
      spool_dir_(std::move(spool_dir)),
      max_snapshot_bytes_(sessions.kv_cache_bytes() +
                          sessions.kv_cache_bytes() / sessions.block_bytes() * kBlockDigestBytes +
                          kSnapshotIndexRoom) {}

void SessionHandoffService::SetReplicaAddress(std::string address) {
  core::MutexLock lock(adopting_);
  replica_address_ = std::move(address);
}

grpc::Status SessionHandoffService::AdoptSessions(
    grpc::ServerContext* context, grpc::ServerReader<v1::SessionSnapshotChunk>* reader,
    v1::AdoptSessionsResponse* response) {
  return ToGrpcStatus(Adopt(*context, *reader, *response));
}

absl::Status SessionHandoffService::Adopt(grpc::ServerContext& context,
                                          grpc::ServerReader<v1::SessionSnapshotChunk>& reader,
                                          v1::AdoptSessionsResponse& response) {
  RETURN_IF_ERROR(CheckAdminToken(context, access_, "AdoptSessions",
                                  "adopting sessions to holders of its admin token"));
  core::MutexLock one_at_a_time(adopting_);
  std::string pattern = absl::StrCat(spool_dir_, "/adopt-XXXXXX");
  const int descriptor = mkstemp(pattern.data());
  if (descriptor < 0) {
    return absl::InternalError(
        absl::StrCat("cannot spool a session snapshot in ", Quoted(spool_dir_)));
  }
  const SpoolFile spool(pattern);
  std::FILE* file = fdopen(descriptor, "wb");
  int64_t bytes = 0;
  v1::SessionSnapshotChunk chunk;
  absl::Status spooled;
  while (spooled.ok() && reader.Read(&chunk)) {
    bytes += static_cast<int64_t>(chunk.data().size());
    if (bytes > max_snapshot_bytes_) {
      spooled = absl::ResourceExhaustedError(
          absl::StrCat("the session snapshot is past ", max_snapshot_bytes_,
                       " bytes, the most this server's KV pool (--kv_cache_bytes) can adopt"));
    } else if (std::fwrite(chunk.data().data(), 1, chunk.data().size(), file) !=
               chunk.data().size()) {
      spooled = absl::InternalError(absl::StrCat("cannot spool the session snapshot to ",
                                                 Quoted(spool.path()), " (disk full?)"));
    }
  }
  if (std::fclose(file) != 0 && spooled.ok()) {
    spooled = absl::InternalError(
        absl::StrCat("cannot spool the session snapshot to ", Quoted(spool.path())));
  }
  RETURN_IF_ERROR(spooled);
  ASSIGN_OR_RETURN(
      SnapshotReport adopted,
      sessions_.AdoptSnapshot(
          spool.path(),
          [this](const std::string& name) -> absl::StatusOr<std::shared_ptr<const core::MhaLayer>> {
            ASSIGN_OR_RETURN(std::shared_ptr<const LayerSnapshot> loaded, registry_.Get(name));
            return loaded->layer;
          },
          absl::Now()));
  if (context.IsCancelled()) {
    // The sender gave up (its deadline) and keeps the sessions: copies here would be orphans.
    for (const std::string& id : adopted.adopted) sessions_.Drop(id, absl::Now()).IgnoreError();
    return absl::CancelledError("the sender cancelled the handoff; nothing adopted");
  }
  response.set_replica(sessions_.replica());
  response.set_replica_address(replica_address_);
  for (const std::string& id : adopted.adopted) response.add_adopted(id);
  response.set_refused_sessions(adopted.refused_sessions);
  for (const std::string& refusal : adopted.refused) response.add_refused(refusal);
  std::cerr << "attention-service: adopted " << adopted.sessions << " sessions (" << adopted.blocks
            << " KV blocks, " << adopted.bytes << " bytes) from a draining "
            << "peer; " << adopted.refused_sessions << " left with it" << std::endl;
  return absl::OkStatus();
}

absl::StatusOr<HandoffReport> HandOffSessions(SessionTable& sessions,
                                              const std::string& peer_address,
                                              const std::string& spool_path,
                                              const std::string& admin_token, absl::Time deadline) {
  HandoffReport report;
  ASSIGN_OR_RETURN(const SnapshotReport written, sessions.BeginHandoff(spool_path, absl::Now()));
  const SpoolFile spool(spool_path);
  report.sessions = written.sessions;
  report.bytes = written.bytes;
  v1::AdoptSessionsResponse answer;
  const absl::Status sent = [&]() -> absl::Status {
    grpc::ChannelArguments arguments;
    // The adopted ids: a million sessions' fit.
    arguments.SetMaxReceiveMessageSize(kMaxAdoptAnswerBytes);
    auto channel =
        grpc::CreateCustomChannel(peer_address, grpc::InsecureChannelCredentials(), arguments);
    auto stub = v1::SessionHandoff::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    context.set_wait_for_ready(true);
    if (!admin_token.empty()) context.AddMetadata("authorization", "Bearer " + admin_token);
    auto writer = stub->AdoptSessions(&context, &answer);
    std::ifstream file(spool_path, std::ios::binary);
    std::string buffer(kChunkBytes, '\0');
    v1::SessionSnapshotChunk chunk;
    bool open = true;
    while (open && file) {
      file.read(buffer.data(), kChunkBytes);
      if (file.gcount() == 0) break;
      chunk.set_data(buffer.data(), static_cast<size_t>(file.gcount()));
      open = writer->Write(chunk);
    }
    if (open && file.bad()) {
      context.TryCancel();
      writer->Finish().ok();  // cancelled: the peer adopts nothing
      return absl::InternalError(absl::StrCat("cannot read ", Quoted(spool_path)));
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat("peer ", Quoted(peer_address),
                                       " adopted nothing: ", status.error_message()));
    }
    return absl::OkStatus();
  }();
  if (!sent.ok()) {
    sessions.EndHandoff({}, "", "", absl::Now());
    return sent;
  }
  report.holder = answer.replica();
  report.address = answer.replica_address().empty() ? peer_address : answer.replica_address();
  const std::vector<std::string> adopted(answer.adopted().begin(), answer.adopted().end());
  sessions.EndHandoff(adopted, report.holder, report.address, absl::Now());
  report.adopted = static_cast<int64_t>(adopted.size());
  report.refused_sessions = answer.refused_sessions();
  report.refused.assign(answer.refused().begin(), answer.refused().end());
  return report;
}

}  // namespace attention::server
