#!/usr/bin/python3
"""Writes the fuzzers' seed corpora into tests/fuzz/corpus/ (committed; rerun after an API
change): valid and near-valid requests of each RPC, safetensors files and batching
policies.

    /usr/bin/python3 tests/fuzz/make_corpus.py
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
from attention_client import stubs  # noqa: E402

pb2 = stubs.load()[0]


def inference_stubs():
    """The Open Inference Protocol's messages, generated with Debian's protoc."""
    out = tempfile.mkdtemp(prefix="inference-stubs-")
    subprocess.run(["protoc", "-I", os.path.join(HERE, "..", "..", "proto"), "--python_out=" + out,
                    "inference/grpc_service.proto"], check=True)
    sys.path.insert(0, out)
    from inference import grpc_service_pb2
    return grpc_service_pb2


kserve = inference_stubs()
rng = np.random.default_rng(7)


def tensor(shape, dtype="float32"):
    values = rng.uniform(-1, 1, size=shape).astype(dtype)
    enum = {"float32": pb2.FLOAT32, "float16": pb2.FLOAT16}[dtype]
    return pb2.Tensor(dtype=enum, shape=list(shape), raw_data=values.tobytes())


def write(kind, name, data):
    directory = os.path.join(HERE, "corpus", kind)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


def requests():
    mha = pb2.MultiHeadAttentionRequest(layer="tiny", query=tensor((1, 3, 8)))
    yield "mha_plain", 0, mha
    causal = pb2.MultiHeadAttentionRequest(layer="tiny", query=tensor((2, 3, 8)))
    causal.options.causal = True
    causal.options.key_lengths.extend([3, 1])
    causal.options.need_weights = pb2.NEED_WEIGHTS_PER_HEAD
    causal.options.dropout_p = 0.25
    causal.options.dropout_seed = 3
    yield "mha_options", 0, causal
    masked = pb2.MultiHeadAttentionRequest(layer="tiny", query=tensor((1, 2, 8)))
    masked.options.attn_mask.CopyFrom(tensor((2, 2)))
    yield "mha_float_mask", 0, masked
    cross = pb2.MultiHeadAttentionRequest(layer="tiny", query=tensor((1, 2, 8), "float16"),
                                          key=tensor((1, 4, 8), "float16"),
                                          value=tensor((1, 4, 8), "float16"))
    yield "mha_cross_float16", 0, cross
    inline = pb2.MultiHeadAttentionRequest(query=tensor((1, 2, 4)))
    inline.inline_layer.config.embed_dim = 4
    inline.inline_layer.config.num_heads = 2
    inline.inline_layer.random_init.seed = 1
    yield "mha_inline", 0, inline
    sdpa = pb2.ScaledDotProductAttentionRequest(query=tensor((1, 2, 3, 4)),
                                                key=tensor((1, 1, 5, 4)),
                                                value=tensor((1, 1, 5, 2)))
    sdpa.options.need_weights = pb2.NEED_WEIGHTS_AVERAGED
    yield "sdpa_gqa", 1, sdpa
    load = pb2.LoadLayerRequest(name="fuzz")
    load.spec.config.embed_dim = 4
    load.spec.config.num_heads = 2
    load.spec.random_init.seed = 2
    load.batching.max_batch_requests = 4
    yield "load_random", 2, load
    weights = pb2.LoadLayerRequest(name="fuzz-inline")
    weights.spec.config.embed_dim = 2
    weights.spec.config.num_heads = 1
    weights.spec.config.no_qkv_bias = True
    weights.spec.config.no_output_bias = True
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"):
        weights.spec.inline_weights.tensors[name].CopyFrom(tensor((2, 2)))
    yield "load_inline", 2, weights
    infer = kserve.ModelInferRequest(model_name="tiny", id="r1")
    infer.inputs.add(name="query", datatype="FP32", shape=[1, 3, 8])
    infer.raw_input_contents.append(tensor((1, 3, 8)).raw_data)
    infer.inputs.add(name="key_padding_mask", datatype="INT64", shape=[1, 3])
    infer.raw_input_contents.append(np.array([[1, 1, 0]], dtype=np.int64).tobytes())
    infer.parameters["causal"].bool_param = True
    infer.parameters["need_weights"].string_param = "per_head"
    infer.outputs.add(name="output")
    infer.outputs.add(name="attention_weights")
    yield "infer_raw", 3, infer
    typed = kserve.ModelInferRequest(model_name="tiny")
    query = typed.inputs.add(name="query", datatype="FP32", shape=[1, 2, 8])
    query.contents.fp32_contents.extend(rng.uniform(-1, 1, size=16).tolist())
    mask = typed.inputs.add(name="attn_mask", datatype="BOOL", shape=[2, 2])
    mask.contents.bool_contents.extend([True, False, True, True])
    typed.parameters["binary_data_output"].bool_param = False
    typed.parameters["bool_mask_polarity"].string_param = "true_attends"
    yield "infer_typed", 3, typed
    # Entries without a session id go to the target's session: 2 layers, 2 heads on 1 KV head.
    step = pb2.SessionStepRequest(return_log_sum_exp=True)
    step.entries.add(layer=0, position=0, query=tensor((3, 2, 4)), key=tensor((3, 1, 4)),
                     value=tensor((3, 1, 4)))
    step.entries.add(layer=0, position=3, query=tensor((1, 2, 4), "float16"),
                     key=tensor((1, 1, 4)), value=tensor((1, 1, 4)))
    step.entries.add(layer=1, position=0, query=tensor((2, 2, 4)), key=tensor((2, 1, 4)),
                     value=tensor((2, 1, 4)))
    yield "session_step", 4, step


def snapshot_indexes():
    """Session snapshot indexes (server/sessions/session_snapshot.proto): a session, a fork
    sharing its first block, and a session over a served layer."""
    out = tempfile.mkdtemp(prefix="snapshot-stubs-")
    sessions_dir = os.path.join(HERE, "..", "..", "server", "sessions")
    subprocess.run(["protoc", "-I", sessions_dir, "--python_out=" + out,
                    "session_snapshot.proto"], check=True)
    sys.path.insert(0, out)
    import session_snapshot_pb2 as snapshot

    def session(suffix, length, blocks, layers=()):
        return snapshot.SnapshotSession(
            id="fuzz-0/" + suffix * 32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
            layer_lengths=[length], length=length, reserved_tokens=128,
            block_tables=[snapshot.SnapshotBlockTable(blocks=blocks)], ttl_ms=60000,
            idle_ms=5, layers=[snapshot.SnapshotLayer(name=n, sha256=bytes(32)) for n in layers])
    yield "one_session", snapshot.SnapshotIndex(
        replica="fuzz-0", block_bytes=4096, num_blocks=2, sessions=[session("a", 70, [0, 1])])
    yield "fork", snapshot.SnapshotIndex(
        replica="fuzz-0", block_bytes=4096, num_blocks=3,
        sessions=[session("a", 70, [0, 1]), session("b", 100, [0, 2])])
    yield "over_a_layer", snapshot.SnapshotIndex(
        replica="fuzz-0", block_bytes=4096, num_blocks=1,
        sessions=[session("c", 10, [0], layers=["decoder"])])


def safetensors(tensors, metadata=None):
    header, data = {}, b""
    for name, array in tensors.items():
        raw = array.tobytes()
        dtype = {"float32": "F32", "float16": "F16"}[str(array.dtype)]
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def main():
    for name, rpc, message in requests():
        write("requests", name, bytes([rpc]) + message.SerializeToString())
    write("safetensors", "two_tensors", safetensors(
        {"q_proj.weight": rng.uniform(size=(4, 4)).astype("float32"),
         "q_proj.bias": rng.uniform(size=(4,)).astype("float16")},
        {"format": "pt"}))
    write("safetensors", "empty", safetensors({}))
    policy = pb2.BatchingPolicy(max_batch_requests=8, max_batch_tokens=1024,
                                max_queue_delay_us=2000, max_queue_requests=16,
                                max_queue_tokens=4096, queue_timeout_us=100000)
    write("batching", "all_fields", policy.SerializeToString())
    write("batching", "one_field", pb2.BatchingPolicy(max_queue_delay_us=5).SerializeToString())
    for name, index in snapshot_indexes():
        write("session_snapshot", name, index.SerializeToString())


if __name__ == "__main__":
    main()
