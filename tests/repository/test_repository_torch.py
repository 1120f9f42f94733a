#!/usr/bin/python3
"""Real PyTorch weights through the model repository (torch 1.13, float32, eval mode).

usage: test_repository_torch.py PATH/TO/attention-server

Exports, as safetensors files written here with struct + json (the safetensors package is
not a dependency), and loads through LoadLayer both inline and from the repository:

1. nn.MultiheadAttention self-attention inside an nn.TransformerEncoder (the checkpoint is
   the whole encoder; prefix "layers.1.self_attn." picks the layer): WEIGHT_NAMING_TORCH_MHA.
2. nn.MultiheadAttention cross-attention with kdim / vdim != embed_dim (q_proj_weight,
   k_proj_weight, v_proj_weight), stored as float16.
3. A BERT-shaped encoder layer with Hugging Face's module names
   (encoder.layer.N.attention.self.query, ...attention.output.dense, LayerNorm,
   intermediate): WEIGHT_NAMING_HF_BERT; the reference is BertSelfAttention followed by
   BertSelfOutput.dense, i.e. without the residual and LayerNorm that are not part of the
   layer.
4. A Llama-shaped GQA layer (num_kv_heads < num_heads, no biases, rotary positions with
   rope_theta), stored as bfloat16, with the reference written as Hugging Face's
   LlamaAttention computes it (rotate_half, repeat_kv, causal mask).

Each output must match PyTorch within |service - torch| <= 1e-4 + 1e-4 * |torch| (the
tolerance of tests/integration/test_torch_parity.py; weights stored in half precision are
rounded in the torch model too, so both sides use identical weights). Then persistence:
layers loaded with persist=true come back after a SIGTERM restart and after a SIGKILL, with
identical outputs.
"""

import json
import os
import shutil
import signal
import struct
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

from attention_client import AttentionClient  # noqa: E402
from attention_client.server_process import ServerProcess  # noqa: E402

torch.set_grad_enabled(False)
ATOL = 1e-4
RTOL = 1e-4
SEED = 20240611
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

failures = []
checks = 0


def check(condition, message):
    global checks
    checks += 1
    if not condition:
        failures.append(message)
        print("FAIL: " + message, flush=True)
    return bool(condition)


def compare(label, actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if not check(actual.shape == expected.shape,
                 "%s: shape %s, want %s" % (label, actual.shape, expected.shape)):
        return
    err = np.abs(actual - expected)
    bad = ~(err <= ATOL + RTOL * np.abs(expected))
    check(not bad.any(), "%s: %d of %d values differ, max error %.3g (seed %d)"
          % (label, int(bad.sum()), bad.size, float(err.max()), SEED))


def save_safetensors(path, tensors, dtype=torch.float32, metadata=None):
    """The safetensors format by hand: u64 LE header length, JSON header, data buffer."""
    header, chunks, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, tensor in tensors.items():
        t = tensor.detach().to(dtype).contiguous()
        # bfloat16 has no numpy type: reinterpret the bits as int16 to get the bytes.
        raw = (t.view(torch.int16) if dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header).encode()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def round_module(module, dtype):
    """Rounds every parameter to `dtype` and back, as storing it in that dtype would."""
    for p in module.parameters():
        p.copy_(p.to(dtype).to(torch.float32))
    return module


# ---- the four models ------------------------------------------------------------------------

def torch_encoder():
    torch.manual_seed(SEED)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2).eval()
    mha = encoder.layers[1].self_attn
    x = torch.randn(2, 5, 16)
    expected = mha(x, x, x, need_weights=False)[0]
    return {
        "label": "torch nn.MultiheadAttention self-attention (TransformerEncoder layers.1)",
        "state_dict": encoder.state_dict(), "dtype": torch.float32,
        "naming": "WEIGHT_NAMING_TORCH_MHA", "prefix": "layers.1.self_attn.",
        "config": {"embed_dim": 16, "num_heads": 4},
        "inputs": {"query": x.numpy()}, "options": {}, "expected": expected.numpy(),
    }


def torch_cross():
    torch.manual_seed(SEED + 1)
    mha = nn.MultiheadAttention(12, 3, kdim=7, vdim=5, batch_first=True).eval()
    round_module(mha, torch.float16)
    q, k, v = torch.randn(3, 4, 12), torch.randn(3, 6, 7), torch.randn(3, 6, 5)
    expected = mha(q, k, v, need_weights=False)[0]
    return {
        "label": "torch nn.MultiheadAttention cross-attention (kdim 7, vdim 5, float16 file)",
        "state_dict": mha.state_dict(), "dtype": torch.float16,
        "naming": "WEIGHT_NAMING_TORCH_MHA", "prefix": "",
        "config": {"embed_dim": 12, "num_heads": 3, "kdim": 7, "vdim": 5},
        "inputs": {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()},
        "options": {}, "expected": expected.numpy(),
    }


class BertSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.head_size = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, x):
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, self.heads, self.head_size).permute(0, 2, 1, 3)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (self.head_size ** 0.5)
        context = torch.matmul(scores.softmax(-1), v)
        return context.permute(0, 2, 1, 3).reshape(b, n, -1)


class BertSelfOutput(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)


class BertAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.self = BertSelfAttention(hidden, heads)
        self.output = BertSelfOutput(hidden)


class BertLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.attention = BertAttention(hidden, heads)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(hidden, 4 * hidden)


def bert():
    torch.manual_seed(SEED + 2)
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.layer = nn.ModuleList([BertLayer(24, 4) for _ in range(2)])
    round_module(model, torch.float16)
    x = torch.randn(2, 7, 24)
    attention = model.encoder.layer[0].attention
    expected = attention.output.dense(attention.self(x))
    return {
        "label": "Hugging Face BERT-shaped self-attention (encoder.layer.0, float16 file)",
        "state_dict": model.state_dict(), "dtype": torch.float16,
        "naming": "WEIGHT_NAMING_HF_BERT", "prefix": "encoder.layer.0.",
        "config": {"embed_dim": 24, "num_heads": 4},
        "inputs": {"query": x.numpy()}, "options": {}, "expected": expected.numpy(),
    }


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """As transformers' LlamaAttention (eager path, no cache)."""

    def __init__(self, hidden, heads, kv_heads, theta):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.theta = theta
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, n, self.heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, d).transpose(1, 2)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)  # repeat_kv
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / (d ** 0.5)
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(causal, float("-inf"))
        out = torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)


def llama():
    torch.manual_seed(SEED + 3)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    for _ in range(2):
        block = nn.Module()
        block.self_attn = LlamaAttention(32, 8, 2, 10000.0)
        block.input_layernorm = nn.LayerNorm(32, elementwise_affine=True)
        model.model.layers.append(block)
    round_module(model, torch.bfloat16)
    x = torch.randn(2, 9, 32)
    expected = model.model.layers[1].self_attn(x)
    return {
        "label": "Hugging Face Llama-shaped GQA layer (8 heads, 2 KV heads, RoPE, bfloat16 file)",
        "state_dict": model.state_dict(), "dtype": torch.bfloat16,
        "naming": "WEIGHT_NAMING_HF_LLAMA", "prefix": "model.layers.1.",
        "config": {"embed_dim": 32, "num_heads": 8, "num_kv_heads": 2, "no_qkv_bias": True,
                   "no_output_bias": True, "rope_theta": 10000.0},
        "inputs": {"query": x.numpy()}, "options": {"causal": True},
        "expected": expected.numpy(),
    }


# ---- through the service --------------------------------------------------------------------

def load_request(client, name, case, source, persist=False):
    pb2 = client.pb2
    request = pb2.LoadLayerRequest(name=name, persist=persist)
    request.spec.config.CopyFrom(pb2.LayerConfig(**case["config"]))
    naming = pb2.WeightNaming.Value(case["naming"])
    if source == "file":
        request.spec.safetensors.path = case["file"]
        request.spec.safetensors.naming = naming
        request.spec.safetensors.prefix = case["prefix"]
    else:
        weights = request.spec.inline_weights
        weights.naming = naming
        weights.prefix = case["prefix"]
        for key, tensor in case["state_dict"].items():
            if not key.startswith(case["prefix"]):
                continue
            rest = key[len(case["prefix"]):]
            if case["naming"] == "WEIGHT_NAMING_HF_BERT" and not (
                    rest.startswith("attention.self.") or rest.startswith("attention.output.dense.")):
                continue  # inline weights must all be used: send the attention tensors only
            if case["naming"] == "WEIGHT_NAMING_HF_LLAMA" and not rest.startswith("self_attn."):
                continue
            out = weights.tensors[key]
            out.dtype = pb2.FLOAT32
            out.shape.extend(tensor.shape)
            out.raw_data = tensor.detach().to(torch.float32).contiguous().numpy().tobytes()
    return client._stub.LoadLayer(request, timeout=60).layer


def run(client, name, case):
    return client.multi_head_attention(layer=name, **case["inputs"], **case["options"]).output


def main():
    if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
        sys.exit("usage: %s PATH/TO/attention-server" % sys.argv[0])
    binary = sys.argv[1]
    repository = tempfile.mkdtemp(prefix="attention-repository-")
    flags = ("--model_repository=" + repository, "--demo_layer=false", "--compute_threads=2")
    try:
        cases = [torch_encoder(), torch_cross(), bert(), llama()]
        for i, case in enumerate(cases):
            case["file"] = "checkpoints/model%d.safetensors" % i
            save_safetensors(os.path.join(repository, case["file"]), case["state_dict"],
                             case["dtype"], {"format": "pt"})

        outputs = {}
        with ServerProcess(binary, *flags) as server:
            client = AttentionClient(server.target)
            for i, case in enumerate(cases):
                for source in ("inline", "file"):
                    name = "%s-%d" % (source, i)
                    info = load_request(client, name, case, source, persist=(source == "file"))
                    check(info.persisted == (source == "file"), "%s: persisted flag" % name)
                    out = run(client, name, case)
                    compare("%s via %s" % (case["label"], source), out, case["expected"])
                    outputs[name] = out
            client.close()
            check(server.stop() == 0, "server exit code after SIGTERM")

        persisted = sorted(os.listdir(os.path.join(repository, "persisted")))
        check(persisted == ["file-%d.safetensors" % i for i in range(len(cases))],
              "persisted files: %s" % persisted)

        # Restart after SIGTERM: the persisted layers only, same outputs bit for bit.
        with ServerProcess(binary, *flags) as server:
            client = AttentionClient(server.target)
            check(client.health() == "SERVING", "health after restart")
            names = [layer.name for layer in client.list_layers()]
            check(names == ["file-%d" % i for i in range(len(cases))], "layers after restart: %s" % names)
            for i, case in enumerate(cases):
                name = "file-%d" % i
                check(np.array_equal(run(client, name, case), outputs[name]),
                      "%s: output after restart differs" % name)
            # One more persisted load, then SIGKILL: no chance to clean up.
            load_request(client, "late", cases[3], "file", persist=True)
            client.close()
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
            server.process.stdout.close()
            server.process = None

        with ServerProcess(binary, *flags) as server:
            client = AttentionClient(server.target)
            names = [layer.name for layer in client.list_layers()]
            check("late" in names and len(names) == len(cases) + 1,
                  "layers after SIGKILL: %s" % names)
            compare("late (after SIGKILL)", run(client, "late", cases[3]), cases[3]["expected"])
            client.close()
            check(server.stop() == 0, "server exit code after SIGTERM")
    finally:
        shutil.rmtree(repository, ignore_errors=True)

    if failures:
        print("test_repository_torch: %d of %d checks FAILED" % (len(failures), checks))
        sys.exit(1)
    print("test_repository_torch: all %d checks passed" % checks)


if __name__ == "__main__":
    main()
