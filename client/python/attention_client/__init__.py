"""Python client for attention-service (attention.v1 over gRPC; numpy or torch in and out).

    from attention_client import AttentionClient
    with AttentionClient("localhost:50051") as c:
        out = c.multi_head_attention(x, layer="demo-bert-base", need_weights="averaged")

AsyncAttentionClient is the same over grpc.aio; attention_client.sources says where
load_layer takes weights from. Session methods raise SessionError (a grpc.RpcError with the
server's `reason` and, for WRONG_REPLICA, the `holder` replica).
"""

from .client import AttentionClient, AttentionResult, make_layer_config, make_layer_spec
from .aio import AsyncAttentionClient
from . import convert, sources
from .convert import from_linears, from_torch_mha, linear
from .errors import SessionError
from .tensors import (bfloat16_bits_to_float32, decode, encode, float32_to_bfloat16_bits,
                      round_to_dtype)

__version__ = "0.1.0"

__all__ = [
    "AttentionClient", "AsyncAttentionClient", "AttentionResult", "SessionError",
    "make_layer_config", "make_layer_spec", "sources", "from_linears", "from_torch_mha",
    "linear", "encode", "decode", "float32_to_bfloat16_bits", "bfloat16_bits_to_float32",
    "round_to_dtype",
]
