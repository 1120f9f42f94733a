"""Python client for attention-service (attention.v1 over gRPC, numpy in and out).

    from attention_client import AttentionClient
    with AttentionClient("localhost:50051") as c:
        out = c.multi_head_attention(x, layer="demo-bert-base", need_weights="averaged")
"""

from .client import AttentionClient, AttentionResult, make_layer_config, make_layer_spec
from . import convert
from .convert import from_linears, from_torch_mha, linear
from .stubs import generate as generate_stubs
from .tensors import (bfloat16_bits_to_float32, decode, encode, float32_to_bfloat16_bits,
                      round_to_dtype)

__all__ = [
    "AttentionClient", "AttentionResult", "make_layer_config", "make_layer_spec",
    "from_linears", "from_torch_mha", "linear", "generate_stubs", "encode", "decode",
    "float32_to_bfloat16_bits", "bfloat16_bits_to_float32", "round_to_dtype",
]
