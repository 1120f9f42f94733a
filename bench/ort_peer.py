"""ONNX Runtime as the peer of bench/compare.py: a BERT-style attention block (the fused
com.microsoft.Attention op for the QKV projection and attention, then MatMul + Add for the
output projection), timed on random inputs. Run with the bench venv's Python
(scripts/bench-deps), which has onnxruntime and onnx; prints useful GFLOPS as JSON.

    build/bench-venv/bin/python bench/ort_peer.py B N E H CAUSAL THREADS [MIN_SECONDS]
"""
import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from measure import seconds_per_call, useful_flops


def model(embed_dim, heads, causal):
    rng = np.random.default_rng(0)
    bound = 1.0 / np.sqrt(embed_dim)

    def init(name, shape):
        values = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        return helper.make_tensor(name, TensorProto.FLOAT, shape, values.ravel())

    nodes = [
        helper.make_node("Attention", ["x", "w_qkv", "b_qkv"], ["attended"], domain="com.microsoft",
                         num_heads=heads, unidirectional=1 if causal else 0),
        helper.make_node("MatMul", ["attended", "w_out"], ["projected"]),
        helper.make_node("Add", ["projected", "b_out"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "attention_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", embed_dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", embed_dim])],
        [init("w_qkv", [embed_dim, 3 * embed_dim]), init("b_qkv", [3 * embed_dim]),
         init("w_out", [embed_dim, embed_dim]), init("b_out", [embed_dim])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def main():
    batch, tokens, embed_dim, heads = (int(v) for v in sys.argv[1:5])
    causal = sys.argv[5] in ("1", "true", "True")
    threads = int(sys.argv[6])
    min_seconds = float(sys.argv[7]) if len(sys.argv) > 7 else 1.0
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model(embed_dim, heads, causal).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((batch, tokens, embed_dim)).astype(np.float32)
    seconds = seconds_per_call(lambda: session.run(None, {"x": x}), min_seconds)
    gflops = useful_flops(batch, tokens, embed_dim, causal) / seconds / 1e9
    print(json.dumps({"gflops": gflops, "ort": ort.__version__}))


if __name__ == "__main__":
    main()
