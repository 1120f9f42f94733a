"""The Open Inference Protocol (KServe v2) endpoint, called with PyPI's tritonclient (sync,
callback and asyncio clients) against a real server: every endpoint answers, and ModelInfer's
outputs equal the native MultiHeadAttention RPC's bitwise, also with the query and output in
system shared memory (tritonclient.utils.shared_memory); the CUDA shared memory calls reach the
server as tritonclient sends them. Runs in the venv that
scripts/kserve-venv makes (tritonclient[grpc], grpcio-tools for the native stubs).

usage: test_kserve.py PATH/TO/attention-server
"""

import asyncio
import base64
import json
import os
import queue
import random
import subprocess
import sys
import tempfile

import numpy as np

from harness import REPO, Checker, ServerProcess, server_binary

import grpc
import ml_dtypes
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
import tritonclient.utils.shared_memory as triton_shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)


def native_stubs():
    """attention.v1 stubs generated with grpcio-tools (the venv's protobuf runtime)."""
    out = tempfile.mkdtemp(prefix="attention-stubs-")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", os.path.join(REPO, "proto"),
                    "--python_out=" + out, "--grpc_python_out=" + out,
                    "attention/v1/attention.proto"], check=True)
    sys.path.insert(0, out)
    from attention.v1 import attention_pb2, attention_pb2_grpc
    return attention_pb2, attention_pb2_grpc


pb, pb_grpc = native_stubs()
NATIVE_DTYPES = {np.float32: pb.FLOAT32, np.float16: pb.FLOAT16, ml_dtypes.bfloat16: pb.BFLOAT16}
TRITON_DTYPES = {np.float32: "FP32", np.float16: "FP16", ml_dtypes.bfloat16: "BF16"}


def native_tensor(array, dtype=None):
    return pb.Tensor(dtype=dtype or NATIVE_DTYPES[array.dtype.type], shape=list(array.shape),
                     raw_data=np.ascontiguousarray(array).tobytes())


def triton_input(name, array, datatype=None):
    tensor = triton.InferInput(name, list(array.shape),
                               datatype or TRITON_DTYPES.get(array.dtype.type, "INT64"))
    tensor.set_data_from_numpy(array)
    return tensor


def main():
    seed = int(os.environ.get("TEST_SEED", random.SystemRandom().randrange(1 << 31)))
    print("seed %d (set TEST_SEED to repeat)" % seed, flush=True)
    rng = np.random.default_rng(seed)
    check = Checker("test_kserve (seed %d)" % seed)
    server = ServerProcess(server_binary(), "--compute_threads=2",
                           "--kserve_system_shared_memory", "--kserve_cuda_shared_memory").start()
    client = triton.InferenceServerClient(server.target)
    native = pb_grpc.AttentionServiceStub(grpc.insecure_channel(server.target))

    # Reflection describes every service, the health check included (grpcurl's view).
    reflection = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(server.target))
    for service in ("inference.GRPCInferenceService", "grpc.health.v1.Health",
                    "attention.v1.AttentionService"):
        check.check(service in reflection.get_services(), "reflection lists no %s" % service)
        check.run("reflection describes " + service, reflection.FindFileContainingSymbol, service)

    check.check(client.is_server_live(), "ServerLive is false")
    check.check(client.is_server_ready(), "ServerReady is false")
    metadata = client.get_server_metadata()
    check.check(metadata.name == "attention-service" and "model_repository" in metadata.extensions
                and "system_shared_memory" in metadata.extensions
                and "cuda_shared_memory" in metadata.extensions,
                "ServerMetadata: %s" % metadata)

    # Layers through the repository extension: self-attention with GQA, and cross-attention.
    self_config = {"spec": {"config": {"embedDim": 64, "numHeads": 4, "numKvHeads": 2},
                            "randomInit": {"seed": 3}}}
    cross_config = {"spec": {"config": {"embedDim": 32, "numHeads": 2, "kdim": 24, "vdim": 40},
                             "randomInit": {"seed": 4}}}
    client.load_model("self", config=json.dumps(self_config))
    client.load_model("cross", config=json.dumps(cross_config))
    index = client.get_model_repository_index()
    check.check(sorted(m.name for m in index.models) == ["cross", "self"],
                "RepositoryIndex: %s" % index)
    check.check(client.is_model_ready("self") and not client.is_model_ready("absent"),
                "ModelReady")
    model = client.get_model_metadata("self")
    check.check([i.name for i in model.inputs][:3] == ["query", "key", "value"]
                and list(model.inputs[0].shape) == [-1, -1, 64], "ModelMetadata: %s" % model)

    def compare(label, model_name, inputs, native_request, outputs=None, parameters=None):
        """ModelInfer through tritonclient, then the same request natively: bitwise equal."""
        result = client.infer(model_name, inputs, outputs=outputs, parameters=parameters)
        answer = native.MultiHeadAttention(native_request)
        got = result.get_response()
        check.check(got.raw_output_contents[0] == answer.output.raw_data,
                    "%s: output differs from the native RPC's" % label)
        if answer.HasField("attention_weights"):
            check.check(len(got.raw_output_contents) == 2 and
                        got.raw_output_contents[1] == answer.attention_weights.raw_data,
                        "%s: attention_weights differ from the native RPC's" % label)
        check.check(got.model_version == str(answer.layer_version),
                    "%s: model_version %s, layer version %d" % (label, got.model_version,
                                                                 answer.layer_version))
        return result

    # FP32 with a tokenizer's INT64 attention_mask (1 = attend), causal, per-head weights.
    x = rng.standard_normal((3, 7, 64)).astype(np.float32)
    tokens_mask = np.ones((3, 7), dtype=np.int64)
    tokens_mask[1, 5:] = 0
    tokens_mask[2, 2:] = 0
    result = compare(
        "fp32 masked causal per_head", "self",
        [triton_input("query", x), triton_input("key_padding_mask", tokens_mask, "INT64")],
        pb.MultiHeadAttentionRequest(
            layer="self", query=native_tensor(x),
            options=pb.AttentionOptions(
                causal=True, need_weights=pb.NEED_WEIGHTS_PER_HEAD,
                key_padding_polarity=pb.TRUE_ATTENDS,
                key_padding_mask=native_tensor(tokens_mask.astype(np.uint8), pb.BOOL))),
        outputs=[triton.InferRequestedOutput("output"),
                 triton.InferRequestedOutput("attention_weights")],
        parameters={"causal": True, "need_weights": "per_head"})
    check.check(result.as_numpy("attention_weights").shape == (3, 4, 7, 7),
                "per-head weights shape %s" % (result.as_numpy("attention_weights").shape,))

    # FP16 and BF16 inputs, answered in the same dtype; a custom scale.
    for dtype in (np.float16, ml_dtypes.bfloat16):
        half = rng.standard_normal((2, 5, 64)).astype(dtype)
        result = compare(
            "%s scale" % TRITON_DTYPES[dtype], "self", [triton_input("query", half)],
            pb.MultiHeadAttentionRequest(layer="self", query=native_tensor(half),
                                         options=pb.AttentionOptions(scale=0.5)),
            parameters={"scale": 0.5})
        output = result.as_numpy("output")
        check.check(output.dtype == dtype and output.shape == (2, 5, 64),
                    "%s output %s %s" % (TRITON_DTYPES[dtype], output.dtype, output.shape))

    # Cross-attention with a BOOL mask (True = masked out, as PyTorch's MultiheadAttention)
    # and averaged weights.
    q = rng.standard_normal((2, 3, 32)).astype(np.float32)
    k = rng.standard_normal((2, 6, 24)).astype(np.float32)
    v = rng.standard_normal((2, 6, 40)).astype(np.float32)
    bool_mask = np.zeros((2, 6), dtype=bool)
    bool_mask[0, 4:] = True
    compare("cross bool mask", "cross",
            [triton_input("query", q), triton_input("key", k), triton_input("value", v),
             triton_input("key_padding_mask", bool_mask, "BOOL")],
            pb.MultiHeadAttentionRequest(
                layer="cross", query=native_tensor(q), key=native_tensor(k),
                value=native_tensor(v),
                options=pb.AttentionOptions(need_weights=pb.NEED_WEIGHTS_AVERAGED,
                                            key_padding_mask=native_tensor(
                                                bool_mask.astype(np.uint8), pb.BOOL))),
            parameters={"need_weights": "averaged"})

    # Typed contents in and out (JSON callers): the same values as the raw path.
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.target))
    typed = service_pb2.ModelInferRequest(model_name="self")
    tensor = typed.inputs.add(name="query", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    typed.parameters["binary_data_output"].bool_param = False
    typed_answer = stub.ModelInfer(typed)
    raw_answer = client.infer("self", [triton_input("query", x)]).as_numpy("output")
    check.check(np.array_equal(np.array(typed_answer.outputs[0].contents.fp32_contents,
                                        dtype=np.float32).reshape(raw_answer.shape), raw_answer)
                and not typed_answer.raw_output_contents,
                "typed contents answer differs from the raw one")

    # The callback and asyncio clients.
    answers = queue.Queue()
    client.async_infer("self", [triton_input("query", x)],
                       callback=lambda result, error: answers.put((result, error)))
    result, error = answers.get(timeout=60)
    check.check(error is None and np.array_equal(result.as_numpy("output"), raw_answer),
                "async_infer: %s" % error)

    async def infer_async():
        async with triton_aio.InferenceServerClient(server.target) as aio_client:
            return await aio_client.infer("self", [triton_input("query", x)])
    check.check(np.array_equal(asyncio.run(infer_async()).as_numpy("output"), raw_answer),
                "asyncio client answer differs")

    # Triton's system shared memory extension through tritonclient's own utilities: the
    # query read from one region, the output written into another (its response entry
    # empty), the answer bitwise the raw call's.
    keys = ["/attention-kserve-%d-%d-%s" % (os.getpid(), seed, name) for name in ("in", "out")]
    regions = [triton_shm.create_shared_memory_region(name, key, x.nbytes)
               for name, key in zip(("in", "out"), keys)]
    try:
        triton_shm.set_shared_memory_region(regions[0], [x])
        for name, key in zip(("in", "out"), keys):
            client.register_system_shared_memory(name, key, x.nbytes)
        status = client.get_system_shared_memory_status()
        check.check(sorted(status.regions) == ["in", "out"] and
                    status.regions["in"].byte_size == x.nbytes,
                    "SystemSharedMemoryStatus: %s" % status)
        query = triton.InferInput("query", list(x.shape), "FP32")
        query.set_shared_memory("in", x.nbytes)
        output = triton.InferRequestedOutput("output")
        output.set_shared_memory("out", x.nbytes)
        result = client.infer("self", [query], outputs=[output])
        answered = triton_shm.get_contents_as_numpy(regions[1], np.float32, list(x.shape))
        check.check(np.array_equal(answered, raw_answer) and
                    list(result.get_output("output").shape) == list(x.shape),
                    "the output in shared memory differs from the raw answer")
        try:
            client.register_system_shared_memory("in", keys[0], x.nbytes)
            check.check(False, "a second region \"in\" was registered")
        except InferenceServerException as e:
            check.check(e.status() == "StatusCode.ALREADY_EXISTS", "re-register: %s" % e)
        client.unregister_system_shared_memory()
        check.check(not client.get_system_shared_memory_status().regions,
                    "regions left after unregistering all")
    finally:
        for region in regions:
            triton_shm.destroy_shared_memory_region(region)

    # Triton's CUDA shared memory extension through tritonclient's own calls (its messages
    # and field numbers on the wire). No handle opens here: a zero handle is refused on a
    # GPU machine, and device 0 is missing on one without (the GPU case is the C++
    # KserveCudaSharedMemoryGpuTest with a buffer another process exported).
    for handle, expected in ((b"\0" * 64, ("device_id = 0 is not available", "raw_handle")),
                             (b"\0" * 10, ("raw_handle has 10 bytes; a cudaIpcMemHandle_t has 64",))):
        try:
            # Base64, as cuda_shared_memory.get_raw_handle gives it; the raw bytes go on the wire.
            client.register_cuda_shared_memory("gpu", base64.b64encode(handle), 0, 1024)
            check.check(False, "a CUDA region with a %d-byte zero handle was registered"
                        % len(handle))
        except InferenceServerException as e:
            check.check(any(part in e.message() for part in expected),
                        "CudaSharedMemoryRegister: %s" % e)
    check.check(not client.get_cuda_shared_memory_status().regions,
                "CudaSharedMemoryStatus lists a region")
    client.unregister_cuda_shared_memory()

    # Errors keep their status and message.
    try:
        client.infer("self", [triton_input("query", x.astype(np.float64), "FP64")])
        check.check(False, "FP64 query was accepted")
    except InferenceServerException as e:
        check.check(e.status() == "StatusCode.INVALID_ARGUMENT" and "FP64" in e.message(),
                    "FP64 query: %s %s" % (e.status(), e.message()))
    try:
        client.infer("absent", [triton_input("query", x)])
        check.check(False, "unknown model was accepted")
    except InferenceServerException as e:
        check.check(e.status() == "StatusCode.NOT_FOUND", "unknown model: %s" % e.status())

    stats = client.get_inference_statistics("self")
    check.check(stats.model_stats[0].inference_count >= 8,
                "ModelStatistics counted %d requests" % stats.model_stats[0].inference_count)
    client.unload_model("cross")
    check.check(not client.is_model_ready("cross"), "cross still ready after unload")
    client.close()
    check.finish(server)


if __name__ == "__main__":
    main()
