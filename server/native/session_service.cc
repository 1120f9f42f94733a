// The native API's KV-cache sessions: CreateSession, SessionStep, ForkSession,
// TruncateSession, DropSession, GetSession, ListSessions, over server/sessions.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"
#include "server/native/attention_service.h"
#include "server/sessions/session_step.h"
#include "server/validation/input_decoding.h"
#include "server/validation/wire_convert.h"

namespace attention::server {
namespace {

constexpr int kMaxStepEntries = 4096;

// The shape a config asks for; `registry` resolves its layers, when it names some.
absl::StatusOr<SessionShape> ShapeOf(const v1::SessionConfig& config,
                                     const LayerRegistry& registry) {
  SessionShape shape;
  shape.num_layers = config.num_layers();
  shape.num_heads = config.num_heads();
  shape.num_kv_heads = config.num_kv_heads();
  shape.head_dim = config.head_dim();
  shape.v_head_dim = config.v_head_dim();
  if (config.kv_dtype() != v1::DATA_TYPE_UNSPECIFIED) {  // the table refuses all but two
    ASSIGN_OR_RETURN(shape.kv_dtype, wire::ConvertDType(config.kv_dtype(), "config.kv_dtype"));
  }
  if (config.has_scale()) {
    if (!std::isfinite(config.scale()) || config.scale() <= 0) {
      return Invalid("config.scale = ", config.scale(), " must be finite and > 0");
    }
    shape.scale = config.scale();
  }
  if (config.sliding_window() < 0) {
    return Invalid("config.sliding_window = ", config.sliding_window(),
                   " must be >= 0 (0 for none)");
  }
  shape.sliding_window = config.sliding_window();
  // Bounded before copying: CheckShape wants one per layer.
  if (config.layer_sliding_windows_size() > kMaxSessionLayers) {
    return Invalid("config.layer_sliding_windows has ", config.layer_sliding_windows_size(),
                   " windows; at most ", kMaxSessionLayers, " (one per layer)");
  }
  shape.layer_sliding_windows.assign(config.layer_sliding_windows().begin(),
                                     config.layer_sliding_windows().end());
  if (config.layers().empty()) return shape;
  std::vector<std::shared_ptr<const core::MhaLayer>> layers;
  std::vector<std::string> names;
  for (int l = 0; l < config.layers_size(); ++l) {
    absl::StatusOr<std::shared_ptr<const LayerSnapshot>> snapshot = registry.Get(config.layers(l));
    if (!snapshot.ok()) return Prefixed(snapshot.status(), absl::StrCat("config.layers[", l, "]"));
    layers.push_back((*snapshot)->layer);
    names.push_back(config.layers(l));
  }
  const bool all_bf16 = std::all_of(layers.begin(), layers.end(), [](const auto& layer) {
    return layer->config().compute_dtype == core::DType::kBFloat16;
  });
  ASSIGN_OR_RETURN(SessionShape over_layers,
                   ShapeOverLayers(shape, std::move(layers), std::move(names)));
  // BFLOAT16 layers hold their keys and values in bf16 too, unless the config says.
  if (config.kv_dtype() == v1::DATA_TYPE_UNSPECIFIED && all_bf16) {
    over_layers.kv_dtype = core::DType::kBFloat16;
  }
  return over_layers;
}

v1::SessionConfig ConfigOf(const SessionShape& shape) {
  v1::SessionConfig config;
  config.set_num_layers(shape.num_layers);
  config.set_num_heads(shape.num_heads);
  config.set_num_kv_heads(shape.num_kv_heads);
  config.set_head_dim(shape.head_dim);
  config.set_v_head_dim(shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim);
  config.set_kv_dtype(wire::WireDType(shape.kv_dtype));
  if (shape.scale > 0) config.set_scale(shape.scale);
  config.set_sliding_window(shape.sliding_window);
  for (const int64_t window : shape.layer_sliding_windows) config.add_layer_sliding_windows(window);
  if (shape.layers != nullptr) {
    for (const std::string& name : shape.layers->names) config.add_layers(name);
  }
  return config;
}

void Describe(const SessionInfo& info, absl::Time now, const std::string& replica,
              const std::string& replica_address, v1::SessionInfo* session) {
  session->set_session_id(info.id);
  session->set_replica(replica);
  session->set_replica_address(replica_address);
  *session->mutable_config() = ConfigOf(info.shape);
  session->set_length(info.length);
  session->set_reserved_tokens(info.reserved_tokens);
  session->set_kv_bytes(info.kv_bytes);
  session->set_ttl_ms(absl::ToInt64Milliseconds(info.ttl));
  session->set_idle_ms(absl::ToInt64Milliseconds(now - info.last_used));
}

absl::StatusOr<absl::Duration> TtlOf(int64_t ttl_ms) {
  if (ttl_ms < 0) return Invalid("ttl_ms = ", ttl_ms, " must be >= 0 (0 for the server's)");
  return absl::Milliseconds(ttl_ms);
}

// One tensor of a step entry: [n, heads, dim] with the entry's n.
absl::Status CheckStepTensor(const DecodedTensor& tensor, absl::string_view field, int64_t tokens,
                             int64_t heads, int64_t dim, absl::string_view layout) {
  const std::vector<int64_t> expected = {tokens, heads, dim};
  if (tensor.shape != expected) {
    return Invalid(field, ".shape ", wire::ShapeString(tensor.shape), " must be ", layout, " = ",
                   wire::ShapeString(expected), " for the session");
  }
  return absl::OkStatus();
}

}  // namespace

void AttentionServiceImpl::RefreshSessionMetrics() {
  if (sessions_ == nullptr) return;
  const SessionCounters counters = sessions_->Counters();
  const int64_t block = sessions_->block_bytes();
  const core::kv_cache::KvPoolCounters& pool = counters.pool;
  Metrics::KvCacheSnapshot snapshot;
  snapshot.sessions = counters.sessions;
  snapshot.total_bytes = pool.blocks_total * block;
  snapshot.held_bytes = (pool.blocks_total - pool.blocks_free) * block;
  snapshot.promised_bytes = pool.blocks_reserved * block;
  snapshot.shared_bytes = pool.blocks_shared * block;
  snapshot.written_tokens = counters.written_tokens;
  snapshot.reserved_tokens = counters.reserved_tokens;
  snapshot.created = counters.created;
  snapshot.forked = counters.forked;
  snapshot.dropped = counters.dropped;
  snapshot.expired = counters.expired;
  snapshot.restored = counters.restored;
  snapshot.adopted = counters.adopted;
  snapshot.handed_off = counters.handed_off;
  snapshot.kv_bytes_read = counters.kv_bytes_read;
  snapshot.shared_blocks_read = counters.shared_blocks_read;
  snapshot.step_compute_seconds = absl::ToDoubleSeconds(counters.step_compute);
  metrics_.SetKvCache(snapshot);
  for (const auto& [path, calls] : counters.attend_calls_by_path) {
    metrics_.SetAttentionCalls(counters.kv_device, "session_" + path, calls);
  }
}

void AttentionServiceImpl::CountSessionRefusal(const absl::Status& status) {
  const std::string reason = ReasonOf(status);
  if (!reason.empty()) metrics_.CountSessionRefusal(reason);
}

void AttentionServiceImpl::SetReplicaAddress(std::string address) {
  core::MutexLock lock(replica_address_mu_);
  replica_address_ = std::move(address);
}

std::string AttentionServiceImpl::ReplicaAddress() const {
  core::MutexLock lock(replica_address_mu_);
  return replica_address_;
}

absl::Status AttentionServiceImpl::SessionsEnabled() const {
  if (sessions_ != nullptr) return absl::OkStatus();
  return WithReason(
      absl::FailedPreconditionError("KV-cache sessions are off on this server: start it with "
                                    "--kv_cache_bytes > 0"),
      "SESSIONS_OFF");
}

template <typename Request>
grpc::ServerUnaryReactor* AttentionServiceImpl::AnswerSessionCall(
    grpc::CallbackServerContext* context, absl::string_view method, const Request& request,
    const std::function<absl::Status(const SessionCaller&)>& handle) {
  const UnaryCall call = StartCall(context, method);
  absl::Status status = CheckKnownFields(request);
  if (status.ok()) status = SessionsEnabled();
  absl::StatusOr<SessionCaller> caller;
  if (status.ok()) {
    caller = IdentifySessionCaller(*context, access_, method);
    status = caller.status();
  }
  if (status.ok()) status = CatchExceptions(method, [&] { return handle(*caller); });
  RefreshSessionMetrics();
  CountSessionRefusal(status);
  call.Answer(status);
  return call.reactor();
}

absl::Status AttentionServiceImpl::CheckOwnsSession(const SessionCaller& caller,
                                                    const std::string& id, absl::Time now) const {
  if (caller.admin || !access_.SessionsNeedCredentials()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const SessionInfo info, sessions_->Get(id, now, /*renew_ttl=*/false));
  return CheckSessionOwner(caller, info);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CreateSession(
    grpc::CallbackServerContext* context, const v1::CreateSessionRequest* request,
    v1::CreateSessionResponse* response) {
  return AnswerSessionCall(
      context, "CreateSession", *request, [&](const SessionCaller& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const SessionShape shape, ShapeOf(request->config(), registry_));
        ASSIGN_OR_RETURN(const absl::Duration ttl, TtlOf(request->ttl_ms()));
        const absl::Time now = absl::Now();
        sessions_->ExpireIdle(now);  // idle sessions give their blocks back first
        ASSIGN_OR_RETURN(const SessionInfo info,
                         sessions_->CreateSession(shape, request->reserved_tokens(), ttl, now,
                                                  /*owner=*/caller.identity));
        Describe(info, now, sessions_->replica(), ReplicaAddress(), response->mutable_session());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ForkSession(grpc::CallbackServerContext* context,
                                                            const v1::ForkSessionRequest* request,
                                                            v1::ForkSessionResponse* response) {
  return AnswerSessionCall(
      context, "ForkSession", *request, [&](const SessionCaller& caller) -> absl::Status {
        ASSIGN_OR_RETURN(const absl::Duration ttl, TtlOf(request->ttl_ms()));
        const absl::Time now = absl::Now();
        sessions_->ExpireIdle(now);
        RETURN_IF_ERROR(CheckOwnsSession(caller, request->session_id(), now));
        ASSIGN_OR_RETURN(const SessionInfo info,
                         sessions_->Fork(request->session_id(), request->tokens(),
                                         request->reserved_tokens(), ttl, now));
        Describe(info, now, sessions_->replica(), ReplicaAddress(), response->mutable_session());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::TruncateSession(
    grpc::CallbackServerContext* context, const v1::TruncateSessionRequest* request,
    v1::TruncateSessionResponse* response) {
  return AnswerSessionCall(
      context, "TruncateSession", *request, [&](const SessionCaller& caller) -> absl::Status {
        const absl::Time now = absl::Now();
        RETURN_IF_ERROR(CheckOwnsSession(caller, request->session_id(), now));
        ASSIGN_OR_RETURN(const SessionInfo info,
                         sessions_->Truncate(request->session_id(), request->tokens(), now));
        Describe(info, now, sessions_->replica(), ReplicaAddress(), response->mutable_session());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::DropSession(grpc::CallbackServerContext* context,
                                                            const v1::DropSessionRequest* request,
                                                            v1::DropSessionResponse* /*response*/) {
  return AnswerSessionCall(context, "DropSession", *request,
                           [&](const SessionCaller& caller) -> absl::Status {
                             const absl::Time now = absl::Now();
                             RETURN_IF_ERROR(CheckOwnsSession(caller, request->session_id(), now));
                             return sessions_->Drop(request->session_id(), now);
                           });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetSession(grpc::CallbackServerContext* context,
                                                           const v1::GetSessionRequest* request,
                                                           v1::GetSessionResponse* response) {
  return AnswerSessionCall(
      context, "GetSession", *request, [&](const SessionCaller& caller) -> absl::Status {
        const absl::Time now = absl::Now();
        RETURN_IF_ERROR(CheckOwnsSession(caller, request->session_id(), now));
        ASSIGN_OR_RETURN(const SessionInfo info,
                         sessions_->Get(request->session_id(), now,
                                        /*renew_ttl=*/!request->keep_idle()));
        Describe(info, now, sessions_->replica(), ReplicaAddress(), response->mutable_session());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListSessions(grpc::CallbackServerContext* context,
                                                             const v1::ListSessionsRequest* request,
                                                             v1::ListSessionsResponse* response) {
  return AnswerSessionCall(
      context, "ListSessions", *request, [&](const SessionCaller& caller) -> absl::Status {
        // An identity lists its own sessions. Without identities, ids are the only key to a
        // session, so listing them all is layer management's to do.
        const bool own_only = !caller.admin && !caller.identity.empty();
        if (!own_only) {
          if (access_.admin_token.empty() && !access_.allow_list_sessions) {
            return absl::PermissionDeniedError(
                "ListSessions hands out every session id, the only key to a session: start the "
                "server with --admin_token_file (and send the token), --session_tokens_file (each "
                "identity lists its own), or --allow_list_sessions");
          }
          RETURN_IF_ERROR(CheckAdmin(*context, "ListSessions"));
        }
        const absl::Time now = absl::Now();
        for (const SessionInfo& info : sessions_->List(now)) {
          if (own_only && info.owner != caller.identity) continue;
          Describe(info, now, sessions_->replica(), ReplicaAddress(), response->add_sessions());
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::SessionStep(grpc::CallbackServerContext* context,
                                                            const v1::SessionStepRequest* request,
                                                            v1::SessionStepResponse* response) {
  const UnaryCall call = StartCall(context, "SessionStep");
  auto answer = [this, call, request](const absl::Status& status) {
    CountSessionRefusal(status);
    call.Answer(status, request->request_id());
  };
  const absl::Status status = CatchExceptions("SessionStep", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const SessionCaller caller,
                     IdentifySessionCaller(*context, access_, "SessionStep"));
    return SubmitSessionStep(*request, caller, call.deadline(), call.cancelled(), response, answer);
  });
  if (!status.ok()) answer(status);
  return call.reactor();
}

absl::Status AttentionServiceImpl::SubmitSessionStep(
    const v1::SessionStepRequest& request, const SessionCaller& caller, absl::Time deadline,
    std::function<bool()> is_cancelled, v1::SessionStepResponse* response,
    std::function<void(const absl::Status&)> finish) {
  RETURN_IF_ERROR(CheckKnownFields(request));
  RETURN_IF_ERROR(CheckRequestId(request.request_id()));
  RETURN_IF_ERROR(SessionsEnabled());
  if (request.entries().empty()) return Invalid("entries is empty: give at least one entry");
  if (request.entries_size() > kMaxStepEntries) {
    return Invalid("entries has ", request.entries_size(), " entries; at most ", kMaxStepEntries);
  }
  const v1::SessionStepEntry& first = request.entries(0);
  ASSIGN_OR_RETURN(
      const core::DType output_dtype,
      OutputDType(request.output_dtype(),
                  first.has_hidden_states() ? first.hidden_states().dtype() : first.query().dtype(),
                  /*float_data_output=*/false));
  auto item = std::make_unique<SessionStepItem>(*sessions_, sessions_->device());
  // Where each entry's answer will be: its output and log-sum-exp, in buffers of the item.
  struct Answer {
    std::vector<int64_t> output_shape;
    int64_t output_floats;
    const float* output;
    int64_t tokens, heads;
    const float* log_sum_exp;
  };
  std::vector<Answer> answers;
  int64_t response_bytes = 0;
  // Each entry's session as it was, and the tokens each session's layer gets in this request.
  std::vector<SessionInfo> infos;
  std::map<std::pair<std::string, int64_t>, int64_t> tokens_of;
  const absl::Time now = absl::Now();
  TensorDecoding decoding;  // copied: the step may outlive the request's bytes
  decoding.reject_non_finite = budget_.reject_non_finite;
  for (int i = 0; i < request.entries_size(); ++i) {
    const v1::SessionStepEntry& wire_entry = request.entries(i);
    const std::string field = absl::StrCat("entries[", i, "]");
    absl::StatusOr<SessionInfo> info = sessions_->Get(wire_entry.session_id(), now);
    if (!info.ok()) {
      return Prefixed(info.status(), field);
    }
    RETURN_IF_ERROR(Prefixed(CheckSessionOwner(caller, *info), field));
    const SessionShape& shape = info->shape;
    const int64_t dv = shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim;
    StepEntry entry;
    entry.session_id = wire_entry.session_id();
    entry.layer = wire_entry.layer();
    entry.position = wire_entry.position();
    LayerStepInput layered;
    Answer answer;
    if (shape.layers != nullptr) {
      if (wire_entry.has_query() || wire_entry.has_key() || wire_entry.has_value()) {
        return Invalid(field, " gives query, key or value, but the session runs over served ",
                       "layers (config.layers): send hidden_states only");
      }
      if (entry.layer < 0 || entry.layer >= shape.num_layers) {
        return Invalid(field, ".layer = ", entry.layer, " is outside [0, ", shape.num_layers, ")");
      }
      const std::shared_ptr<const core::MhaLayer>& layer = shape.layers->layers[entry.layer];
      const core::MhaConfig& c = layer->config();
      ASSIGN_OR_RETURN(DecodedTensor hidden, DecodeTensor(wire_entry.hidden_states(),
                                                          field + ".hidden_states", decoding));
      if (hidden.shape.size() != 2 || hidden.shape[1] != c.embed_dim) {
        return Invalid(field, ".hidden_states.shape ", wire::ShapeString(hidden.shape),
                       " must be [n, embed_dim] = [n, ", c.embed_dim, "] for layer '",
                       shape.layers->names[entry.layer], "'");
      }
      entry.num_tokens = hidden.shape[0];
      answer.output_shape = {entry.num_tokens, c.output_dim};
      answer.output_floats = CheckedProduct({entry.num_tokens, c.output_dim});
      item->buffers.push_back(std::move(hidden.values));
      layered.layer = layer.get();
      layered.hidden_states = item->buffers.back().data();
      item->layers.push_back(layer);
    } else {
      if (wire_entry.has_hidden_states()) {
        return Invalid(field, ".hidden_states is for sessions over served layers ",
                       "(config.layers); this session takes query, key and value");
      }
      ASSIGN_OR_RETURN(DecodedTensor query,
                       DecodeTensor(wire_entry.query(), field + ".query", decoding));
      ASSIGN_OR_RETURN(DecodedTensor key, DecodeTensor(wire_entry.key(), field + ".key", decoding));
      ASSIGN_OR_RETURN(DecodedTensor value,
                       DecodeTensor(wire_entry.value(), field + ".value", decoding));
      const int64_t n = query.shape.empty() ? 0 : query.shape[0];
      RETURN_IF_ERROR(CheckStepTensor(query, field + ".query", n, shape.num_heads, shape.head_dim,
                                      "[n, num_heads, head_dim]"));
      RETURN_IF_ERROR(CheckStepTensor(key, field + ".key", n, shape.num_kv_heads, shape.head_dim,
                                      "[n, num_kv_heads, head_dim]"));
      RETURN_IF_ERROR(CheckStepTensor(value, field + ".value", n, shape.num_kv_heads, dv,
                                      "[n, num_kv_heads, v_head_dim]"));
      entry.num_tokens = n;
      answer.output_shape = {n, shape.num_heads, dv};
      answer.output_floats = CheckedProduct({n, shape.num_heads, dv});
      // Moved vectors keep their buffers, so these pointers survive `buffers` growing.
      item->buffers.push_back(std::move(query.values));
      entry.query = item->buffers.back().data();
      item->buffers.push_back(std::move(key.values));
      entry.key = item->buffers.back().data();
      item->buffers.push_back(std::move(value.values));
      entry.value = item->buffers.back().data();
    }
    const int64_t n = entry.num_tokens;
    if (entry.position < 0) return Invalid(field, ".position = ", entry.position, " must be >= 0");
    tokens_of[{entry.session_id, entry.layer}] += n;
    // The answers' size grows with the session's heads, not the request's bytes: bound it
    // before allocating (checked arithmetic saturates).
    response_bytes =
        CheckedSum({response_bytes,
                    CheckedProduct({answer.output_floats,
                                    static_cast<int64_t>(core::ElementSize(output_dtype))}),
                    request.return_log_sum_exp() ? CheckedProduct({n, shape.num_heads, 4}) : 0});
    if (response_bytes > budget_.max_response_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          field, ": the answers up to here need ", response_bytes, " bytes, past the limit of ",
          budget_.max_response_bytes, " (--max_message_bytes); send fewer tokens per step"));
    }
    item->buffers.emplace_back(answer.output_floats);
    float* output = item->buffers.back().data();
    answer.output = output;
    if (shape.layers == nullptr) {
      entry.output = output;
    } else {
      layered.output = output;
    }
    if (request.return_log_sum_exp()) {
      item->buffers.emplace_back(n * shape.num_heads);
      entry.log_sum_exp = item->buffers.back().data();
    }
    answer.tokens = n;
    answer.heads = shape.num_heads;
    answer.log_sum_exp = entry.log_sum_exp;
    item->entries.push_back(entry);
    item->layered.push_back(layered);
    answers.push_back(std::move(answer));
    infos.push_back(*std::move(info));
    item->tokens += n;
  }
  // Then, before anything is queued, where each entry goes and what the step costs in all.
  RequestCost cost;
  for (size_t i = 0; i < item->entries.size(); ++i) {
    const StepEntry& entry = item->entries[i];
    const std::string field = absl::StrCat("entries[", i, "]");
    // Checked here too, before anything is queued: projecting 4,096 hidden states to find a
    // gap after took 0.44 s.
    const int64_t request_tokens = tokens_of[{entry.session_id, entry.layer}];
    RETURN_IF_ERROR(
        Prefixed(CheckPlacement(entry, infos[i].layer_lengths, request_tokens - entry.num_tokens,
                                infos[i].reserved_tokens),
                 field));
    const SessionShape& shape = infos[i].shape;
    core::AttentionDims dims;
    dims.num_heads = shape.num_heads;
    dims.num_kv_heads = shape.num_kv_heads;
    dims.q_len = entry.num_tokens;
    dims.kv_len = entry.position + entry.num_tokens;
    dims.head_dim = shape.head_dim;
    dims.v_head_dim = shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim;
    const core::MhaLayer* layer = item->layered[i].layer;
    cost = cost + SessionStepEntryCost(dims, layer == nullptr ? nullptr : &layer->config(),
                                       request.return_log_sum_exp(), output_dtype);
    RETURN_IF_ERROR(Prefixed(CheckRequestBudget(cost, budget_), field));
  }
  item->bytes = CheckedSum({cost.memory_bytes, 2 * static_cast<int64_t>(request.ByteSizeLong())});
  item->deadline = deadline;
  item->is_cancelled = std::move(is_cancelled);
  SessionStepItem* step = item.get();  // the batcher answers while it still holds the item
  item->done = [this, step, answers, response, output_dtype, finish = std::move(finish),
                request_id =
                    request.request_id()](const absl::StatusOr<core::AttentionResult>& result) {
    RefreshSessionMetrics();
    const absl::Status status = result.ok() ? step->status() : result.status();
    if (!status.ok()) {
      finish(status);
      return;
    }
    for (const Answer& a : answers) {
      v1::SessionStepResult* out = response->add_results();
      EncodeTensor(absl::MakeConstSpan(a.output, a.output_floats), a.output_shape, output_dtype,
                   out->mutable_output());
      if (a.log_sum_exp != nullptr) {
        EncodeTensor(absl::MakeConstSpan(a.log_sum_exp, a.tokens * a.heads), {a.tokens, a.heads},
                     core::DType::kFloat32, out->mutable_log_sum_exp());
      }
    }
    response->set_request_id(request_id);
    finish(absl::OkStatus());
  };
  return batcher_.Submit(std::move(item));
}

}  // namespace attention::server
