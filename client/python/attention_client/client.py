"""The blocking client for attention.v1.AttentionService (numpy or torch in and out).

Errors are raised as grpc.RpcError; `err.code()` is the gRPC status code
(e.g. grpc.StatusCode.INVALID_ARGUMENT) and `err.details()` the server's message. The session
methods raise SessionError, a grpc.RpcError that adds the server's machine-readable `reason`
(e.g. "SESSION_EXPIRED") and, for "WRONG_REPLICA", the `holder` replica.
The asyncio twin is attention_client.aio.AsyncAttentionClient; both build their requests
with attention_client.messages.
"""

import itertools
import threading

import grpc

from . import errors
from . import messages
from . import stubs
from . import tensors
from .errors import SessionError, follows_handoffs, raises_session_errors  # noqa: F401
from .messages import AttentionResult, make_layer_config, make_layer_spec  # noqa: F401


class ClientBase:
    """The channel, stub and options of both clients; `_grpc` makes the channel (grpc here,
    grpc.aio in AsyncAttentionClient)."""

    _grpc = grpc

    def __init__(self, target, timeout=60.0, max_message_bytes=64 << 20, admin_token=None,
                 tls_ca_file=None, tls_cert_file=None, tls_key_file=None,
                 tls_server_name=None, lb_policy=None, session_token=None):
        """admin_token: sent as "authorization: Bearer <token>" with load_layer and
        unload_layer, for a server started with --admin_token_file.
        session_token: sent the same way with every session call (the admin token is, where
        there is none), for a server started with --session_tokens_file: the sessions this
        client creates are its identity's alone.
        tls_ca_file: PEM CA bundle of the server's certificate; connects with TLS (plaintext
        without it). tls_cert_file / tls_key_file: this client's certificate, for mutual TLS.
        tls_server_name: the name checked against the server's certificate, when not the
        target's host. lb_policy: gRPC's load-balancing policy, e.g. "round_robin" to spread
        calls over every address the target resolves to (pick_first when None)."""
        self._pb2, pb2_grpc, _ = stubs.load()
        self.timeout = timeout
        self._admin_metadata = messages.bearer_metadata(admin_token)
        # Session calls carry the session token, else the admin token (which reaches every
        # session).
        self._session_metadata = messages.bearer_metadata(session_token or admin_token)
        credentials, options = messages.channel_arguments(
            max_message_bytes, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name)
        self._credentials, self._channel_options = credentials, options
        self._channel = self._open_channel(
            target, options + ([("grpc.lb_policy_name", lb_policy)] if lb_policy else []))
        self._stub_class = pb2_grpc.AttentionServiceStub
        self._stub = pb2_grpc.AttentionServiceStub(self._channel)
        self._health_check = messages.health_method(self._channel)
        # Sessions live in one replica's memory: each session's calls go to the address its
        # create / fork answer gave, over a channel to that replica alone.
        self._replicas_lock = threading.Lock()
        self._pinned = {}  # session id -> replica address
        self._replica_channels = {}  # replica address -> (channel, stub)

    def _open_channel(self, target, options):
        if self._credentials is None:
            return self._grpc.insecure_channel(target, options=options)
        return self._grpc.secure_channel(target, self._credentials, options=options)

    @property
    def pb2(self):
        """The generated attention.v1 message module, for hand-built requests."""
        return self._pb2

    def _timeout(self, timeout):
        return self.timeout if timeout is None else timeout

    # Session requests and answers, alike for both clients.

    def _create_session_request(self, num_layers, num_heads, num_kv_heads, head_dim,
                                reserved_tokens, *, v_head_dim=0, kv_dtype="float32", scale=None,
                                sliding_window=0, layer_sliding_windows=(), ttl_ms=0):
        config = self._pb2.SessionConfig(num_layers=num_layers, num_heads=num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim,
                                         v_head_dim=v_head_dim,
                                         kv_dtype=tensors.dtype_enum(kv_dtype),
                                         sliding_window=sliding_window,
                                         layer_sliding_windows=list(layer_sliding_windows))
        if scale is not None:
            config.scale = scale
        return self._pb2.CreateSessionRequest(config=config, reserved_tokens=reserved_tokens,
                                              ttl_ms=ttl_ms)

    def _layer_session_request(self, layers, reserved_tokens, *, kv_dtype="float32", ttl_ms=0):
        config = self._pb2.SessionConfig(layers=list(layers),
                                         kv_dtype=tensors.dtype_enum(kv_dtype))
        return self._pb2.CreateSessionRequest(config=config, reserved_tokens=reserved_tokens,
                                              ttl_ms=ttl_ms)

    def _step_request(self, return_log_sum_exp, output_dtype, request_id=""):
        """A SessionStepRequest without entries."""
        request = self._pb2.SessionStepRequest(return_log_sum_exp=return_log_sum_exp,
                                               request_id=request_id)
        if output_dtype is not None:
            request.output_dtype = tensors.dtype_enum(output_dtype)
        return request

    def _fork_request(self, session_id, tokens, reserved_tokens=0, *, ttl_ms=0):
        return self._pb2.ForkSessionRequest(session_id=session_id, tokens=tokens,
                                            reserved_tokens=reserved_tokens, ttl_ms=ttl_ms)

    @staticmethod
    def _add_entry(request, entry):
        """Adds one entries tuple of session_step to `request`."""
        session_id, layer, position, *inputs = entry
        added = request.entries.add(session_id=session_id, layer=layer, position=position)
        if len(inputs) == 1:
            tensors.encode(inputs[0], out=added.hidden_states)
            return
        query, key, value = inputs
        tensors.encode(query, out=added.query)
        tensors.encode(key, out=added.key)
        tensors.encode(value, out=added.value)

    def _step_requests(self, entries, request):
        """{stub: (request with the entries of that stub's replica, their indices)}."""
        parts = {}
        for index, entry in enumerate(entries):
            stub = self._session_stub(entry[0])
            if stub not in parts:
                part = self._pb2.SessionStepRequest()
                part.CopyFrom(request)
                parts[stub] = (part, [])
            part, indices = parts[stub]
            self._add_entry(part, entry)
            indices.append(index)
        if not parts:
            parts[self._stub] = (request, [])
        return parts

    @staticmethod
    def _step_outputs(results, return_log_sum_exp):
        decode = tensors.decode
        if return_log_sum_exp:
            return [(decode(r.output), decode(r.log_sum_exp)) for r in results]
        return [decode(r.output) for r in results]

    def pin_session(self, session_id, replica_address):
        """Sends `session_id`'s calls to `replica_address` (a session another client created:
        its SessionInfo.replica_address); "" sends them to the target again."""
        with self._replicas_lock:
            if replica_address:
                self._pinned[session_id] = replica_address
            else:
                self._pinned.pop(session_id, None)

    def _pin(self, session):
        self.pin_session(session.session_id, session.replica_address)
        return session

    def _session_stub(self, session_id):
        with self._replicas_lock:
            address = self._pinned.get(session_id)
            if not address:
                return self._stub
            if address not in self._replica_channels:
                channel = self._open_channel(address, self._channel_options)
                self._replica_channels[address] = (channel, self._stub_class(channel))
            return self._replica_channels[address][1]


class AttentionClient(ClientBase):
    """Thread-safe (gRPC channels are); one channel per instance. Constructor arguments as
    ClientBase: target, timeout, max_message_bytes, admin_token, tls_ca_file,
    tls_cert_file, tls_key_file, tls_server_name, lb_policy, session_token."""

    def close(self):
        self._channel.close()
        with self._replicas_lock:
            for channel, _ in self._replica_channels.values():
                channel.close()
            self._replica_channels.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout=30.0):
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def health(self, service=""):
        """grpc.health.v1 Check -> 'SERVING', 'NOT_SERVING', ..."""
        return messages.health_status(self._health_check(
            messages.health_request(service), timeout=self.timeout))

    def multi_head_attention(self, query, key=None, value=None, *, timeout=None, **kwargs):
        """query [B, Nq, E] (+ key [B, Nk, kdim], value [B, Nk, vdim]), numpy arrays or torch
        tensors, through the layer named `layer=` or the one-off `layer_spec=` (see
        make_layer_spec). `dtype` is the wire dtype of the inputs ("float32", "float16",
        "bfloat16"; default: float16 / bfloat16 inputs as such, others float32),
        `output_dtype` that of the answer (default: the inputs'), `request_id` is echoed.
        The other keywords are the AttentionOptions fields: causal, key_lengths,
        key_padding_mask (bool or 0/1 [B, Nk]), key_padding_polarity, attn_mask (bool or
        float, broadcast to [B, H, Nq, Nk]), attn_mask_polarity ('true_masks_out' |
        'true_attends'), attn_mask_dtype, scale, dropout_p, dropout_seed, need_weights
        (None | 'averaged' | 'per_head'), priority, queue_timeout_us.
        Returns AttentionResult(output, weights or None, ...), numpy for numpy queries and
        torch (in the wire dtype, on the query's device) for torch queries."""
        request = messages.mha_request(query, key, value, **kwargs)
        return messages.attention_result(
            self._stub.MultiHeadAttention(request, timeout=self._timeout(timeout)), query)

    def scaled_dot_product_attention(self, query, key, value, *, timeout=None, **kwargs):
        """Q [B, H, Nq, dk], K [B, Hkv, Nk, dk], V [B, Hkv, Nk, dv] -> [B, H, Nq, dv].
        Keywords as for multi_head_attention (no layer), and compute_dtype ('bfloat16':
        bf16 products as PyTorch's SDPA on bf16 tensors; 'float16': fp16 products on a GPU's
        cuDNN, float32 elsewhere; default float32)."""
        request = messages.sdpa_request(query, key, value, **kwargs)
        return messages.attention_result(
            self._stub.ScaledDotProductAttention(request, timeout=self._timeout(timeout)), query)

    def load_layer(self, name, config=None, weights=None, random_seed=None, *, timeout=None,
                   **kwargs):
        """Loads (or replaces) a layer; returns the server's LayerInfo. The weights come
        from exactly one of: `weights`, a dict native tensor name -> array; `random_seed`;
        or `source=`, from attention_client.sources: inline(state_dict, naming=, prefix=),
        safetensors(path, naming=, prefix=), hf_checkpoint(directory, layer_index),
        random_init(seed). `config` is a dict of LayerConfig fields (optional for
        hf_checkpoint, which reads config.json). Other keywords: weight_dtype ("float32" | "float16" |
        "bfloat16", for `weights`), persist, batching (this layer's BatchingPolicy fields,
        e.g. {"max_batch_requests": 8, "max_queue_delay_us": 2000}; the rest follow the
        server's flags), device ("cpu", "cuda:N", "auto"; default the server's)."""
        request = messages.load_layer_request(name, config, weights, random_seed, **kwargs)
        return self._stub.LoadLayer(request, timeout=self._timeout(timeout),
                                    metadata=self._admin_metadata).layer

    def inspect_checkpoint(self, path, offset=0, max_tensors=0, timeout=None):
        """The tensors (name, shape, dtype) of a safetensors file or Hugging Face checkpoint
        directory in the server's --model_repository, and the layer prefixes each naming
        finds there; an InspectCheckpointResponse (page with offset / max_tensors while
        `truncated`). Needs the admin token where LoadLayer does."""
        request = self._pb2.InspectCheckpointRequest(path=path, offset=offset,
                                                     max_tensors=max_tensors)
        return self._stub.InspectCheckpoint(request, timeout=self._timeout(timeout),
                                            metadata=self._admin_metadata)

    def get_layer(self, name, timeout=None):
        return self._stub.GetLayer(self._pb2.GetLayerRequest(name=name),
                                   timeout=self._timeout(timeout)).layer

    def list_layers(self, timeout=None):
        return list(self._stub.ListLayers(self._pb2.ListLayersRequest(),
                                          timeout=self._timeout(timeout)).layers)

    def unload_layer(self, name, timeout=None):
        self._stub.UnloadLayer(self._pb2.UnloadLayerRequest(name=name),
                               timeout=self._timeout(timeout), metadata=self._admin_metadata)

    # KV-cache sessions (decode): the server holds each sequence's keys and values, so a step
    # sends only its new tokens. Q, K and V are projected and rotated (RoPE) by the caller.

    @raises_session_errors
    def create_session(self, *args, timeout=None, **kwargs):
        """create_session(num_layers, num_heads, num_kv_heads, head_dim, reserved_tokens, *,
        v_head_dim=0, kv_dtype="float32", scale=None, sliding_window=0,
        layer_sliding_windows=(), ttl_ms=0): the new session's attention.v1.SessionInfo
        (session_id, length, ...). kv_dtype: "float32" or "bfloat16" (how K and V are
        stored). sliding_window: keys each token attends to, its own included (0: all);
        layer_sliding_windows: one such window per layer instead, where layers differ."""
        request = self._create_session_request(*args, **kwargs)
        return self._pin(self._stub.CreateSession(request, timeout=self._timeout(timeout),
                                                  metadata=self._session_metadata).session)

    @raises_session_errors
    def create_layer_session(self, *args, timeout=None, **kwargs):
        """create_layer_session(layers, reserved_tokens, *, kv_dtype="float32", ttl_ms=0): a
        session over layers loaded on the server (names, one per session layer): its steps
        send hidden states, and the server projects, rotates, attends and projects out. The
        heads come from the layers. Returns the attention.v1.SessionInfo."""
        request = self._layer_session_request(*args, **kwargs)
        return self._pin(self._stub.CreateSession(request, timeout=self._timeout(timeout),
                                                  metadata=self._session_metadata).session)

    @follows_handoffs
    @raises_session_errors
    def session_step(self, entries, *, return_log_sum_exp=False, output_dtype=None,
                     timeout=None):
        """entries: (session_id, layer, position, query [n, H, dk], key [n, Hkv, dk],
        value [n, Hkv, dv]) tuples, numpy or torch, or for a session over served layers
        (create_layer_session) (session_id, layer, position, hidden_states [n, E]). Writes
        each entry's K/V at [position, position + n) and attends; returns one output per
        entry, [n, H, dv] (the layer's [n, output_dim] for hidden states); with log_sum_exp,
        (output, log_sum_exp [n, H]) pairs. Retrying a step is safe."""
        parts = self._step_requests(entries, self._step_request(return_log_sum_exp, output_dtype))
        results = [None] * len(entries)
        for stub, (part, indices) in parts.items():
            response = stub.SessionStep(part, timeout=self._timeout(timeout),
                                        metadata=self._session_metadata)
            for index, result in zip(indices, response.results):
                results[index] = result
        return self._step_outputs(results, return_log_sum_exp)

    @raises_session_errors
    def session_step_stream(self, steps, *, return_log_sum_exp=False, output_dtype=None,
                            timeout=None):
        """SessionStep on one bidirectional stream, several steps in flight. `steps` yields
        (request_id, entries), entries as in session_step; this yields (request_id, outputs)
        in completion order, where a failed step's outputs are a SessionError (yielded, not
        raised: it unpacks as the (grpc.StatusCode, message) pair it was before) and the
        stream goes on. Keep one step of a session in flight at a time. The stream goes to
        the replica of the first step's first session."""
        steps = iter(steps)
        first = next(steps, None)
        if first is None:
            return
        stub = self._session_stub(first[1][0][0]) if first[1] else self._stub

        def requests():
            for request_id, entries in itertools.chain([first], steps):
                request = self._step_request(return_log_sum_exp, output_dtype, request_id)
                for entry in entries:
                    self._add_entry(request, entry)
                yield request

        for answer in stub.SessionStepStream(requests(), timeout=self._timeout(timeout),
                                             metadata=self._session_metadata):
            if answer.error_code:
                yield answer.request_id, errors.from_stream_answer(answer)
            else:
                yield answer.request_id, self._step_outputs(answer.response.results,
                                                            return_log_sum_exp)

    @follows_handoffs
    @raises_session_errors
    def fork_session(self, session_id, tokens, reserved_tokens=0, *, ttl_ms=0, timeout=None):
        """A new session sharing the first `tokens` tokens (copy-on-write); its SessionInfo.
        reserved_tokens and ttl_ms 0 take the source's."""
        request = self._fork_request(session_id, tokens, reserved_tokens, ttl_ms=ttl_ms)
        stub = self._session_stub(session_id)
        return self._pin(stub.ForkSession(request, timeout=self._timeout(timeout),
                                          metadata=self._session_metadata).session)

    @follows_handoffs
    @raises_session_errors
    def truncate_session(self, session_id, tokens, timeout=None):
        request = self._pb2.TruncateSessionRequest(session_id=session_id, tokens=tokens)
        stub = self._session_stub(session_id)
        return stub.TruncateSession(request, timeout=self._timeout(timeout),
                                    metadata=self._session_metadata).session

    @follows_handoffs
    @raises_session_errors
    def drop_session(self, session_id, timeout=None):
        self._session_stub(session_id).DropSession(
            self._pb2.DropSessionRequest(session_id=session_id), timeout=self._timeout(timeout),
            metadata=self._session_metadata)
        self.pin_session(session_id, "")

    @follows_handoffs
    @raises_session_errors
    def get_session(self, session_id, *, keep_idle=False, timeout=None):
        """The session's SessionInfo; keep_idle reads it without renewing its TTL."""
        stub = self._session_stub(session_id)
        return stub.GetSession(
            self._pb2.GetSessionRequest(session_id=session_id, keep_idle=keep_idle),
            timeout=self._timeout(timeout), metadata=self._session_metadata).session

    @raises_session_errors
    def list_sessions(self, timeout=None):
        """Every live session with the admin token; an identity's own with a session token."""
        return list(self._stub.ListSessions(
            self._pb2.ListSessionsRequest(), timeout=self._timeout(timeout),
            metadata=self._admin_metadata or self._session_metadata).sessions)
