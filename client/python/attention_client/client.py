"""A small synchronous client for attention.v1.AttentionService (numpy in, numpy out).

Errors are raised as grpc.RpcError; `err.code()` is the gRPC status code
(e.g. grpc.StatusCode.INVALID_ARGUMENT) and `err.details()` the server's message.
"""

import collections

import grpc
import numpy as np

from . import stubs
from . import tensors

AttentionResult = collections.namedtuple(
    "AttentionResult", ["output", "weights", "layer_version", "request_id", "output_dtype"])
AttentionResult.__doc__ = """output / weights: float32 numpy arrays (weights None unless asked for);
output_dtype: the wire dtype the server answered in (1 FLOAT32, 2 FLOAT16, 3 BFLOAT16)."""

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
    return pb2.LayerConfig(**config)


def make_layer_spec(config, weights=None, random_seed=None, weight_dtype="float32"):
    """LayerSpec from a config and either a dict name -> numpy array (native names, PyTorch
    Linear layout [out, in]) or a seed for the server's random initialisation."""
    pb2 = stubs.load()[0]
    spec = pb2.LayerSpec(config=make_layer_config(config))
    if (weights is None) == (random_seed is None):
        raise ValueError("give exactly one of weights or random_seed")
    if weights is not None:
        spec.inline_weights.naming = pb2.WEIGHT_NAMING_NATIVE
        for name, array in weights.items():
            tensors.encode(np.asarray(array, dtype=np.float32), weight_dtype,
                           out=spec.inline_weights.tensors[name])
    else:
        spec.random_init.seed = int(random_seed)
    return spec


class AttentionClient:
    """Thread-safe (gRPC channels are); one channel per instance."""

    def __init__(self, target, timeout=60.0, max_message_bytes=64 << 20, admin_token=None,
                 tls_ca_file=None, tls_cert_file=None, tls_key_file=None,
                 tls_server_name=None):
        """admin_token: sent as "authorization: Bearer <token>" with load_layer and
        unload_layer, for a server started with --admin_token_file.
        tls_ca_file: PEM CA bundle of the server's certificate; connects with TLS (plaintext
        without it). tls_cert_file / tls_key_file: this client's certificate, for mutual TLS.
        tls_server_name: the name checked against the server's certificate, when not the
        target's host."""
        self._pb2, pb2_grpc, self._health_pb2 = stubs.load()
        self.timeout = timeout
        self._admin_metadata = (("authorization", "Bearer " + admin_token),) if admin_token else None
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if tls_ca_file:
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            credentials = grpc.ssl_channel_credentials(
                root_certificates=read(tls_ca_file),
                private_key=read(tls_key_file) if tls_cert_file else None,
                certificate_chain=read(tls_cert_file) if tls_cert_file else None)
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb2_grpc.AttentionServiceStub(self._channel)
        self._health_check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=self._health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=self._health_pb2.HealthCheckResponse.FromString)

    @property
    def pb2(self):
        """The generated attention.v1 message module, for hand-built requests."""
        return self._pb2

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout=30.0):
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    # ---- health -------------------------------------------------------------------------
    def health(self, service=""):
        """grpc.health.v1 Check -> 'SERVING', 'NOT_SERVING', ..."""
        response = self._health_check(self._health_pb2.HealthCheckRequest(service=service),
                                      timeout=self.timeout)
        return self._health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    # ---- attention ----------------------------------------------------------------------
    def _options(self, options, causal=False, key_lengths=None, key_padding_mask=None,
                 key_padding_polarity="true_masks_out", attn_mask=None,
                 attn_mask_polarity="true_masks_out", attn_mask_dtype=None, scale=None,
                 dropout_p=0.0, dropout_seed=0, need_weights=None, priority=0,
                 queue_timeout_us=0):
        options.causal = bool(causal)
        if key_lengths is not None:
            options.key_lengths.extend(int(n) for n in key_lengths)
        if key_padding_mask is not None:
            tensors.encode(np.asarray(key_padding_mask, dtype=bool), tensors.BOOL,
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

    @staticmethod
    def _result(response):
        # An absent (or empty) attention_weights tensor means none were asked for.
        w = response.attention_weights
        weights = tensors.decode(w) if (len(w.shape) or w.raw_data or len(w.float_data)) else None
        return AttentionResult(tensors.decode(response.output), weights,
                               getattr(response, "layer_version", 0), response.request_id,
                               response.output.dtype)

    def multi_head_attention(self, query, key=None, value=None, layer=None, layer_spec=None,
                             dtype="float32", output_dtype=None, request_id="", timeout=None,
                             **options):
        """query [B, Nq, E] (+ key [B, Nk, kdim], value [B, Nk, vdim]) through the layer
        named `layer` or the one-off `layer_spec` (see make_layer_spec). `options` are the
        AttentionOptions fields: causal, key_lengths, key_padding_mask (bool [B, Nk]),
        key_padding_polarity, attn_mask (bool or float, broadcast to [B, H, Nq, Nk]),
        attn_mask_polarity ('true_masks_out' | 'true_attends'), attn_mask_dtype, scale,
        dropout_p, dropout_seed, need_weights (None | 'averaged' | 'per_head'), priority,
        queue_timeout_us.
        Returns AttentionResult(output float32 ndarray, weights ndarray or None, ...)."""
        request = self._pb2.MultiHeadAttentionRequest(request_id=request_id)
        if layer is not None:
            request.layer = layer
        if layer_spec is not None:
            request.inline_layer.CopyFrom(layer_spec)
        tensors.encode(query, dtype, out=request.query)
        if key is not None:
            tensors.encode(key, dtype, out=request.key)
        if value is not None:
            tensors.encode(value, dtype, out=request.value)
        if output_dtype is not None:
            request.output_dtype = tensors.dtype_enum(output_dtype)
        self._options(request.options, **options)
        return self._result(self._stub.MultiHeadAttention(request, timeout=timeout or self.timeout))

    def scaled_dot_product_attention(self, query, key, value, dtype="float32",
                                     output_dtype=None, request_id="", timeout=None, **options):
        """Q [B, H, Nq, dk], K [B, Hkv, Nk, dk], V [B, Hkv, Nk, dv] -> [B, H, Nq, dv].
        Options as for multi_head_attention."""
        request = self._pb2.ScaledDotProductAttentionRequest(request_id=request_id)
        tensors.encode(query, dtype, out=request.query)
        tensors.encode(key, dtype, out=request.key)
        tensors.encode(value, dtype, out=request.value)
        if output_dtype is not None:
            request.output_dtype = tensors.dtype_enum(output_dtype)
        self._options(request.options, **options)
        response = self._stub.ScaledDotProductAttention(request, timeout=timeout or self.timeout)
        return self._result(response)

    # ---- layers -------------------------------------------------------------------------
    def load_layer(self, name, config, weights=None, random_seed=None, weight_dtype="float32",
                   persist=False, batching=None):
        """Loads (or replaces) a layer; `weights` maps native tensor names to numpy arrays.
        `batching` sets this layer's own BatchingPolicy fields, e.g.
        {"max_batch_requests": 8, "max_queue_delay_us": 2000}; the rest follow the server's
        flags. Returns the server's LayerInfo."""
        request = self._pb2.LoadLayerRequest(
            name=name, spec=make_layer_spec(config, weights, random_seed, weight_dtype),
            persist=persist, batching=self._pb2.BatchingPolicy(**(batching or {})))
        return self._stub.LoadLayer(request, timeout=self.timeout,
                                    metadata=self._admin_metadata).layer

    def get_layer(self, name):
        return self._stub.GetLayer(self._pb2.GetLayerRequest(name=name), timeout=self.timeout).layer

    def list_layers(self):
        return list(self._stub.ListLayers(self._pb2.ListLayersRequest(),
                                          timeout=self.timeout).layers)

    def unload_layer(self, name):
        self._stub.UnloadLayer(self._pb2.UnloadLayerRequest(name=name), timeout=self.timeout,
                               metadata=self._admin_metadata)
