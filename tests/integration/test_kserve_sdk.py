"""The Open Inference Protocol (KServe v2) endpoint, called with the KServe SDK's asyncio gRPC
client (kserve.InferenceGRPCClient) against a real server: every call the client has
(is_server_live, is_server_ready, is_model_ready, infer), plus the SDK's generated stub for the
endpoints the client has no method for (ServerMetadata, ModelMetadata, RepositoryModelLoad /
Unload). ModelInfer's outputs equal the native MultiHeadAttention RPC's bitwise. Runs in the
venv that scripts/kserve-sdk-venv makes.

Two limits of the SDK (0.21) shape the test: its InferParameter has no double_param, so the
`scale` parameter cannot be sent; and it cannot decode a BF16 output (InferResponse.from_grpc
raises), so BF16 goes through the SDK's request builder and stub instead of infer(). The
SDK's numpy inputs carry REST's binary_data_size parameter, which the server checks against
the raw entry's size.

usage: test_kserve_sdk.py PATH/TO/attention-server
"""

import asyncio
import logging
import os
import random

import numpy as np

from harness import Checker, ServerProcess, server_binary

import grpc
from google.protobuf import json_format
from kserve import InferenceGRPCClient, InferInput, InferRequest
from kserve.protocol.infer_type import RequestedOutput
from kserve.protocol.grpc import grpc_predict_v2_pb2 as sdk_pb
from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from attention_client import stubs

pb, pb_grpc, _ = stubs.load()
NATIVE_DTYPES = {np.float32: pb.FLOAT32, np.float16: pb.FLOAT16}
SDK_DTYPES = {np.float32: "FP32", np.float16: "FP16", np.float64: "FP64", np.int64: "INT64",
              np.bool_: "BOOL"}


def native_tensor(array):
    if array.dtype in (np.int64, np.bool_):  # masks go natively as BOOL bytes
        return pb.Tensor(dtype=pb.BOOL, shape=list(array.shape),
                         raw_data=array.astype(np.uint8).tobytes())
    return pb.Tensor(dtype=NATIVE_DTYPES[array.dtype.type], shape=list(array.shape),
                     raw_data=np.ascontiguousarray(array).tobytes())


def sdk_input(name, array):
    tensor = InferInput(name, list(array.shape), SDK_DTYPES[array.dtype.type])
    tensor.set_data_from_numpy(array)
    return tensor


def to_bfloat16_bits(array):
    """float32 -> bfloat16 bytes by truncation (any bits do: both paths get the same)."""
    return (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32) >> 16).astype(
        np.uint16).tobytes()


async def expect_error(check, label, call, code, *words):
    """`call` (a coroutine) fails with `code`, and its message holds every word."""
    try:
        await call
        check.check(False, "%s was accepted" % label)
    except grpc.aio.AioRpcError as e:
        check.check(e.code() == code and all(w in e.details() for w in words),
                    "%s: %s %s, want %s naming %s" % (label, e.code(), e.details(), code, words))


async def run(check, server, rng):
    channel = grpc.aio.insecure_channel(server.target)
    native = pb_grpc.AttentionServiceStub(channel)
    sdk_stub = GRPCInferenceServiceStub(channel)
    # Layers load through the native API: KServe's RepositoryModelLoad carries no config.
    layers = {"self": {"embedDim": 64, "numHeads": 4, "numKvHeads": 2},
              "cross": {"embedDim": 32, "numHeads": 2, "kdim": 24, "vdim": 40}}
    for seed, (name, config) in enumerate(layers.items()):
        await native.LoadLayer(json_format.ParseDict(
            {"name": name, "spec": {"config": config, "randomInit": {"seed": seed + 3}}},
            pb.LoadLayerRequest()))

    client = InferenceGRPCClient(server.target, timeout=60)
    check.check(await client.is_server_live(), "is_server_live is false")
    check.check(await client.is_server_ready(), "is_server_ready is false")
    check.check(await client.is_model_ready("self"), "is_model_ready(self) is false")
    check.check(not await client.is_model_ready("absent"), "is_model_ready(absent) is true")

    metadata = await sdk_stub.ServerMetadata(sdk_pb.ServerMetadataRequest())
    check.check(metadata.name == "attention-service" and "model_repository" in metadata.extensions,
                "ServerMetadata: %s" % metadata)
    model = await sdk_stub.ModelMetadata(sdk_pb.ModelMetadataRequest(name="self"))
    check.check([i.name for i in model.inputs][:3] == ["query", "key", "value"]
                and list(model.inputs[0].shape) == [-1, -1, 64]
                and [o.name for o in model.outputs] == ["output", "attention_weights"],
                "ModelMetadata: %s" % model)

    # KServe's repository messages put model_name in field 1, where the protocol (Triton's
    # repository extension) has repository_name: the server reads a repository name it does
    # not have and refuses by that name, never loading or unloading a layer by accident.
    unload = sdk_pb.RepositoryModelUnloadRequest(model_name="self")
    load = sdk_pb.RepositoryModelLoadRequest(model_name="self")
    for label, call in (("KServe RepositoryModelUnload", sdk_stub.RepositoryModelUnload(unload)),
                        ("KServe RepositoryModelLoad", sdk_stub.RepositoryModelLoad(load))):
        await expect_error(check, label, call, grpc.StatusCode.NOT_FOUND, "repository_name",
                           '"self"')
    check.check(await client.is_model_ready("self"), "self not ready after the refused unload")

    async def compare(label, request, native_request, outputs=("output",)):
        """infer() through the SDK, then the same request natively: bitwise equal. Returns
        the SDK's InferResponse."""
        response = await client.infer(request)
        answer = await native.MultiHeadAttention(native_request)
        expected = {"output": answer.output, "attention_weights": answer.attention_weights}
        check.check([o.name for o in response.outputs] == list(outputs),
                    "%s: outputs %s, want %s" % (label, [o.name for o in response.outputs],
                                                 list(outputs)))
        for output in response.outputs:
            want = expected.get(output.name)
            check.check(want is not None and output.shape == list(want.shape) and
                        output.as_numpy().tobytes() == want.raw_data,
                        "%s: %s differs from the native RPC's" % (label, output.name))
        check.check(response.model_version == str(answer.layer_version),
                    "%s: model_version %s, layer version %d" % (label, response.model_version,
                                                                 answer.layer_version))
        return response

    # FP32 with a tokenizer's INT64 attention_mask (1 = attend), causal, per-head weights.
    x = rng.standard_normal((3, 7, 64)).astype(np.float32)
    tokens_mask = np.ones((3, 7), dtype=np.int64)
    tokens_mask[1, 5:] = 0
    tokens_mask[2, 2:] = 0
    response = await compare(
        "fp32 masked causal per_head",
        InferRequest("self", [sdk_input("query", x), sdk_input("key_padding_mask", tokens_mask)],
                     parameters={"causal": True, "need_weights": "per_head"},
                     request_outputs=[RequestedOutput("output"),
                                      RequestedOutput("attention_weights")]),
        pb.MultiHeadAttentionRequest(
            layer="self", query=native_tensor(x),
            options=pb.AttentionOptions(causal=True, need_weights=pb.NEED_WEIGHTS_PER_HEAD,
                                        key_padding_polarity=pb.TRUE_ATTENDS,
                                        key_padding_mask=native_tensor(tokens_mask))),
        outputs=("output", "attention_weights"))
    weights = response.get_output_by_name("attention_weights")
    check.check(weights is not None and weights.shape == [3, 4, 7, 7],
                "per-head weights shape %s" % (weights and weights.shape))

    # FP16, answered in FP16.
    half = rng.standard_normal((2, 5, 64)).astype(np.float16)
    response = await compare("fp16", InferRequest("self", [sdk_input("query", half)]),
                             pb.MultiHeadAttentionRequest(layer="self", query=native_tensor(half)))
    check.check(response.outputs[0].datatype == "FP16", "fp16 answered in %s"
                % response.outputs[0].datatype)

    # Cross-attention with a BOOL mask (True = masked out, as PyTorch's MultiheadAttention)
    # and averaged weights.
    q = rng.standard_normal((2, 3, 32)).astype(np.float32)
    k = rng.standard_normal((2, 6, 24)).astype(np.float32)
    v = rng.standard_normal((2, 6, 40)).astype(np.float32)
    bool_mask = np.zeros((2, 6), dtype=bool)
    bool_mask[0, 4:] = True
    await compare(
        "cross bool mask",
        InferRequest("cross", [sdk_input("query", q), sdk_input("key", k), sdk_input("value", v),
                               sdk_input("key_padding_mask", bool_mask)],
                     parameters={"need_weights": "averaged"}),
        pb.MultiHeadAttentionRequest(
            layer="cross", query=native_tensor(q), key=native_tensor(k), value=native_tensor(v),
            options=pb.AttentionOptions(need_weights=pb.NEED_WEIGHTS_AVERAGED,
                                        key_padding_mask=native_tensor(bool_mask))),
        outputs=("output", "attention_weights"))

    # Typed contents in and out (the SDK's binary_data=False): the same values as the raw path.
    raw_answer = (await client.infer(InferRequest("self", [sdk_input("query", x)]))).outputs[0]
    typed_input = InferInput("query", list(x.shape), "FP32")
    typed_input.set_data_from_numpy(x, binary_data=False)
    typed = await client.infer(InferRequest("self", [typed_input],
                                            parameters={"binary_data_output": False}))
    check.check(typed.outputs[0].data != [] and
                np.array_equal(typed.outputs[0].as_numpy(), raw_answer.as_numpy()),
                "typed contents answer differs from the raw one")

    # BF16: the SDK builds the request (raw_inputs) but cannot decode a BF16 answer, so the
    # built request goes through its stub; raw bytes equal the native answer's.
    bf16 = to_bfloat16_bits(rng.standard_normal((2, 5, 64)))
    built = InferRequest("self", [InferInput("query", [2, 5, 64], "BF16")],
                         raw_inputs=[bf16]).to_grpc()
    got = await sdk_stub.ModelInfer(built)
    answer = await native.MultiHeadAttention(pb.MultiHeadAttentionRequest(
        layer="self", query=pb.Tensor(dtype=pb.BFLOAT16, shape=[2, 5, 64], raw_data=bf16)))
    check.check(got.outputs[0].datatype == "BF16" and
                got.raw_output_contents[0] == answer.output.raw_data,
                "bf16: output differs from the native RPC's")

    # Errors keep their status and a message naming the input or parameter.
    await expect_error(check, "FP64 query",
                       client.infer(InferRequest("self", [sdk_input("query",
                                                                    x.astype(np.float64))])),
                       grpc.StatusCode.INVALID_ARGUMENT, "FP64")
    await expect_error(check, "unknown model",
                       client.infer(InferRequest("absent", [sdk_input("query", x)])),
                       grpc.StatusCode.NOT_FOUND, "absent")
    # The SDK sends integers as int64_param; scale must be a double, which it cannot send.
    await expect_error(check, "int64 scale",
                       client.infer(InferRequest("self", [sdk_input("query", x)],
                                                 parameters={"scale": 1})),
                       grpc.StatusCode.INVALID_ARGUMENT, "scale", "double")
    await client.close()
    await channel.close()


def main():
    seed = int(os.environ.get("TEST_SEED", random.SystemRandom().randrange(1 << 31)))
    print("seed %d (set TEST_SEED to repeat)" % seed, flush=True)
    check = Checker("test_kserve_sdk (seed %d)" % seed)
    # The SDK logs every failed call with its traceback; the expected ones would bury a real
    # failure, which Checker reports with its own traceback.
    logging.getLogger("kserve.trace").setLevel(logging.CRITICAL)
    server = ServerProcess(server_binary(), "--compute_threads=2").start()
    check.run("KServe SDK client", asyncio.run, run(check, server, np.random.default_rng(seed)))
    check.finish(server)


if __name__ == "__main__":
    main()
