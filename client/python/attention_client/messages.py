"""Request building and response reading shared by AttentionClient (blocking) and
AsyncAttentionClient (grpc.aio): everything but the call itself lives here."""

import collections
import json

import grpc

from . import sources
from . import stubs
from . import tensors

AttentionResult = collections.namedtuple(
    "AttentionResult", ["output", "weights", "layer_version", "request_id", "output_dtype"])
AttentionResult.__doc__ = """output / weights: float32 numpy arrays (weights None unless asked
for), or torch tensors in the wire dtype on the query's device when the query was a torch
tensor; output_dtype: the wire dtype the server answered in (1 FLOAT32, 2 FLOAT16,
3 BFLOAT16)."""

_NEED_WEIGHTS = {None: 0, False: 0, "none": 0, True: 1, "averaged": 1, "per_head": 2}
_POLARITY = {"true_masks_out": 0, "true_attends": 1}


def _enum(table, value, what):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return table[value.lower() if isinstance(value, str) else value]
    except KeyError:
        raise ValueError("unknown %s %r; use one of %s" % (what, value, list(table)))


def make_layer_config(config):
    """dict of LayerConfig fields (or a LayerConfig) -> attention.v1.LayerConfig."""
    pb2 = stubs.load()[0]
    if isinstance(config, pb2.LayerConfig):
        return config
    if isinstance(config.get("compute_dtype"), str):  # "bfloat16" as tensors name dtypes
        config = dict(config, compute_dtype=tensors.dtype_enum(config["compute_dtype"]))
    return pb2.LayerConfig(**config)


def make_layer_spec(config, weights=None, random_seed=None, weight_dtype="float32",
                    source=None):
    """LayerSpec from a config (None where the source carries it) and exactly one of:
    `weights`, a dict name -> array (native names, PyTorch Linear layout [out, in]);
    `random_seed`, for the server's random initialisation; or `source`, a LayerSpec from
    attention_client.sources (inline with a naming, safetensors, random_init, ...)."""
    given = [x is not None for x in (weights, random_seed, source)]
    if sum(given) != 1:
        raise ValueError("give exactly one of weights, random_seed or source")
    if weights is not None:
        source = sources.inline(weights, dtype=weight_dtype)
    elif random_seed is not None:
        source = sources.random_init(random_seed)
    spec = stubs.load()[0].LayerSpec()
    spec.CopyFrom(source)
    if config is not None:
        spec.config.CopyFrom(make_layer_config(config))
    return spec


def fill_options(options, causal=False, key_lengths=None, key_padding_mask=None,
                 key_padding_polarity="true_masks_out", attn_mask=None,
                 attn_mask_polarity="true_masks_out", attn_mask_dtype=None, scale=None,
                 dropout_p=0.0, dropout_seed=0, need_weights=None, priority=0,
                 queue_timeout_us=0):
    """Fills an attention.v1.AttentionOptions from the keyword options."""
    options.causal = bool(causal)
    if key_lengths is not None:
        options.key_lengths.extend(int(n) for n in tensors.to_numpy(key_lengths).reshape(-1))
    if key_padding_mask is not None:
        tensors.encode(tensors.to_numpy(key_padding_mask) != 0, tensors.BOOL,
                       out=options.key_padding_mask)
    options.key_padding_polarity = _enum(_POLARITY, key_padding_polarity, "polarity")
    if attn_mask is not None:
        tensors.encode(attn_mask, attn_mask_dtype, out=options.attn_mask)
    options.attn_mask_polarity = _enum(_POLARITY, attn_mask_polarity, "polarity")
    if scale is not None:
        options.scale = float(scale)
    options.dropout_p = float(dropout_p)
    options.dropout_seed = int(dropout_seed)
    options.need_weights = _enum(_NEED_WEIGHTS, need_weights, "need_weights")
    options.priority = int(priority)
    options.queue_timeout_us = int(queue_timeout_us)


def mha_request(query, key=None, value=None, layer=None, layer_spec=None, dtype=None,
                output_dtype=None, request_id="", **options):
    pb2 = stubs.load()[0]
    request = pb2.MultiHeadAttentionRequest(request_id=request_id)
    if layer is not None:
        request.layer = layer
    if layer_spec is not None:
        request.inline_layer.CopyFrom(layer_spec)
    dtype = tensors.natural_dtype(query) if dtype is None else dtype
    tensors.encode(query, dtype, out=request.query)
    if key is not None:
        tensors.encode(key, dtype, out=request.key)
    if value is not None:
        tensors.encode(value, dtype, out=request.value)
    if output_dtype is not None:
        request.output_dtype = tensors.dtype_enum(output_dtype)
    fill_options(request.options, **options)
    return request


def sdpa_request(query, key, value, dtype=None, output_dtype=None, compute_dtype=None,
                 request_id="", **options):
    pb2 = stubs.load()[0]
    request = pb2.ScaledDotProductAttentionRequest(request_id=request_id)
    dtype = tensors.natural_dtype(query) if dtype is None else dtype
    tensors.encode(query, dtype, out=request.query)
    tensors.encode(key, dtype, out=request.key)
    tensors.encode(value, dtype, out=request.value)
    if output_dtype is not None:
        request.output_dtype = tensors.dtype_enum(output_dtype)
    if compute_dtype is not None:
        request.compute_dtype = tensors.dtype_enum(compute_dtype)
    fill_options(request.options, **options)
    return request


def attention_result(response, query):
    """MultiHeadAttention / ScaledDotProductAttention response -> AttentionResult, its
    tensors of the query's kind (numpy, or torch on the query's device)."""
    # An absent (or empty) attention_weights tensor means none were asked for.
    w = response.attention_weights
    weights = None
    if len(w.shape) or w.raw_data or len(w.float_data):
        weights = tensors.like(tensors.decode(w), w.dtype, query)
    output = tensors.like(tensors.decode(response.output), response.output.dtype, query)
    return AttentionResult(output, weights, getattr(response, "layer_version", 0),
                           response.request_id, response.output.dtype)


def load_layer_request(name, config=None, weights=None, random_seed=None,
                       weight_dtype="float32", persist=False, batching=None, device="",
                       source=None):
    pb2 = stubs.load()[0]
    return pb2.LoadLayerRequest(
        name=name, spec=make_layer_spec(config, weights, random_seed, weight_dtype, source),
        persist=persist, batching=pb2.BatchingPolicy(**(batching or {})), device=device)


def health_request(service=""):
    return stubs.load()[2].HealthCheckRequest(service=service)


def health_status(response):
    return stubs.load()[2].HealthCheckResponse.ServingStatus.Name(response.status)


# Session calls that are safe to repeat (a step names its positions; a read or truncation
# changes nothing twice) wait for the server through a restart or a rolling update, which
# keeps sessions with --session_snapshot_dir: a caller sees latency, not UNAVAILABLE.
# Create and fork are not repeated: a second attempt would make a second session. A server
# shutting down answers calls that reach it after its drain began CANCELLED; gRPC never
# repeats a call the caller cancelled itself.
SESSION_RETRY_SERVICE_CONFIG = {
    "methodConfig": [{
        "name": [{"service": "attention.v1.AttentionService", "method": method}
                 for method in ("SessionStep", "GetSession", "TruncateSession",
                                "ListSessions")],
        "waitForReady": True,
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.2s",
            "maxBackoff": "5s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
        },
    }]
}


def channel_arguments(max_message_bytes=64 << 20, tls_ca_file=None, tls_cert_file=None,
                      tls_key_file=None, tls_server_name=None):
    """-> (channel credentials, or None for plaintext; channel options)."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.enable_retries", 1),
               ("grpc.service_config", json.dumps(SESSION_RETRY_SERVICE_CONFIG)),
               # A restarted server is found within 5 s of listening again, not gRPC's 120 s.
               ("grpc.max_reconnect_backoff_ms", 5000)]
    if not tls_ca_file:
        if tls_cert_file or tls_key_file or tls_server_name:
            raise ValueError("tls_cert_file, tls_key_file and tls_server_name need tls_ca_file")
        return None, options
    if bool(tls_cert_file) != bool(tls_key_file):
        raise ValueError("mutual TLS needs both tls_cert_file and tls_key_file")

    def read(path):
        with open(path, "rb") as f:
            return f.read()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(tls_ca_file),
        private_key=read(tls_key_file) if tls_key_file else None,
        certificate_chain=read(tls_cert_file) if tls_cert_file else None)
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return credentials, options


def bearer_metadata(token):
    """"authorization: Bearer <token>" metadata (the admin token of layer management, or a
    session token), or None without a token."""
    return (("authorization", "Bearer " + token),) if token else None


def health_method(channel):
    """grpc.health.v1.Health/Check on `channel` (a grpc or grpc.aio channel)."""
    health_pb2 = stubs.load()[2]
    return channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)
