#!/usr/bin/env python3
"""The CUDA backend against PyTorch on the same GPU, in one run (issue 12, section 6).

    python3 bench/gpu_compare.py --bin DIR [--repeats 3] [--shapes S1,S2] [--json OUT.json]
                                 [--dtype bfloat16]

DIR holds cuda_bench, attention_bench, attention-server and attention-loadgen (a build's
bench/, server/ and client/ outputs copied together, as scripts/gpu-bundle does). Needs a
python3 with torch (CUDA). Prints a markdown table of useful GFLOPS (8*N*E^2 + 4*N^2*E per
sequence, half the attention term when causal) for:
  - this project's CUDA backend, in process (host tensors in and out, as the server);
  - PyTorch fp32 nn.MultiheadAttention and an SDPA module (fused QKV Linear,
    scaled_dot_product_attention, out Linear), TF32 off on both sides;
  - cuBLAS sgemm (torch.mm, n=8192, TF32 off) as the ceiling;
and the CPU backend on S2 (attention_bench, 2 threads) and the server over gRPC
(attention-loadgen, S1-shaped requests) against the in-process figure.
With --dtype bfloat16 (issue 26; shapes S1-S4 and causal N16384): our BFLOAT16 layer (bf16 host tensors in,
float32 out), PyTorch's modules in bfloat16 (bf16 host tensors), cuBLAS bf16 GEMM the ceiling.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch

from measure import useful_flops
from torch_peer import SdpaAttention  # the SDPA module of the CPU comparison

SHAPES = {  # name: (batch, tokens, embed_dim, heads, causal, cuda_bench name)
    "S1": (32, 128, 768, 12, False, "BM_CudaMhaS1"),
    "S2": (8, 512, 768, 12, False, "BM_CudaMhaS2"),
    "S3": (1, 2048, 768, 12, True, "BM_CudaMhaS3"),
    "S4": (256, 16, 768, 12, False, "BM_CudaMhaS4"),
    "S5": (1, 65536, 512, 8, True, "BM_CudaMhaS5"),
    "B64 N1024 E1024": (64, 1024, 1024, 16, False, "BM_CudaMhaLarge"),
    "causal N16384": (1, 16384, 768, 12, True, "BM_CudaMhaCausal16k"),
}
BF16_SHAPES = ("S1", "S2", "S3", "S4", "causal N16384")  # cuda_bench's BM_CudaMhaBf16*


def timed(fn, min_seconds=1.0):
    fn()
    torch.cuda.synchronize()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        runs += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / runs


def torch_gflops(batch, tokens, embed_dim, heads, causal, host_copies, dtype=torch.float32):
    """PyTorch in dtype on the GPU; with host_copies, inputs come from and outputs go to
    pinned host memory each call, as the service's do."""
    torch.manual_seed(0)
    x_host = torch.randn(batch, tokens, embed_dim).to(dtype).pin_memory()
    x = x_host.cuda()
    mha = torch.nn.MultiheadAttention(embed_dim, heads, batch_first=True).cuda().to(dtype).eval()
    sdpa = SdpaAttention(embed_dim, heads).cuda().to(dtype).eval()
    mask = (torch.triu(torch.ones(tokens, tokens, dtype=torch.bool, device="cuda"), 1)
            if causal else None)
    results = {}
    with torch.inference_mode():
        def run_mha():
            inp = x_host.cuda(non_blocking=True) if host_copies else x
            out = mha(inp, inp, inp, attn_mask=mask, need_weights=False)[0]
            return out.cpu() if host_copies else out

        def run_sdpa():
            inp = x_host.cuda(non_blocking=True) if host_copies else x
            out = sdpa(inp, causal)
            return out.cpu() if host_copies else out

        for name, fn in (("mha", run_mha), ("sdpa", run_sdpa)):
            try:
                results[name] = useful_flops(batch, tokens, embed_dim, causal) / timed(fn) / 1e9
            except torch.cuda.OutOfMemoryError:
                results[name] = float("nan")
                torch.cuda.empty_cache()
    return results


def sgemm_gflops(n=8192, dtype=torch.float32):
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    return 2.0 * n ** 3 / timed(lambda: torch.mm(a, b)) / 1e9


def run_json(command):
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return {b["name"]: b for b in json.loads(out)["benchmarks"]}


def served_tokens_per_second(bin_dir, seconds=10):
    """attention-server --device=cuda with its demo layer (E=768, 12 heads), called by
    attention-loadgen with S1-shaped requests from 4 concurrent callers."""
    server = subprocess.Popen([os.path.join(bin_dir, "attention-server"), "--device=cuda",
                               "--listen=127.0.0.1:0", "--metrics_listen=", "--demo_layer"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        port = re.search(r"port (\d+)", line).group(1)
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "loadgen.json")
            subprocess.run([os.path.join(bin_dir, "attention-loadgen"),
                            "--target=127.0.0.1:" + port, "--batch=32", "--tokens=128",
                            "--concurrency=4", "--duration=%d" % seconds, "--json=" + report],
                           check=True, capture_output=True, text=True)
            with open(report) as f:
                return json.load(f)["tokens_per_second"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="comma-separated names from SHAPES (default: all)")
    parser.add_argument("--json")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    bf16 = args.dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    known = BF16_SHAPES if bf16 else SHAPES
    unknown = [name for name in shapes if name not in known]
    if unknown:
        parser.error("unknown shapes %s; known for %s: %s" % (unknown, args.dtype, ", ".join(known)))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, flush=True)
    rows, record = [], {"device": torch.cuda.get_device_name(0), "dtype": args.dtype, "rows": {}}
    for name in shapes:
        batch, tokens, embed_dim, heads, causal, bench = SHAPES[name]
        if bf16:
            bench = bench.replace("BM_CudaMha", "BM_CudaMhaBf16")
        samples = []
        for _ in range(args.repeats):
            ours = run_json([os.path.join(args.bin, "cuda_bench"), "--benchmark_format=json",
                             "--benchmark_filter=^%s/" % bench, "--benchmark_min_time=1"])
            entry = ours["%s/real_time" % bench]
            if entry.get("error_occurred"):
                raise SystemExit("%s: %s" % (bench, entry.get("error_message")))
            peer = torch_gflops(batch, tokens, embed_dim, heads, causal, True, dtype)
            resident = torch_gflops(batch, tokens, embed_dim, heads, causal, False, dtype)
            samples.append((entry["GFLOPS"], peer["mha"], peer["sdpa"], resident["sdpa"],
                            entry["tokens_per_second"]))
        med = [statistics.median(s[i] for s in samples) for i in range(5)]
        record["rows"][name] = dict(zip(
            ["ours", "torch_mha_host", "torch_sdpa_host", "torch_sdpa_resident",
             "ours_tokens_per_second"], med))
        rows.append((name, *med))
        # Each row as it is measured, so a run stopped by a time limit still reports some.
        print("%s: ours %.0f, torch MHA %.0f, SDPA module %.0f (resident %.0f) GFLOPS"
              % (name, *med[:4]), flush=True)
    sgemm = sgemm_gflops(dtype=dtype)
    record["cublas_gemm_gflops"] = sgemm
    print("\n| shape | ours GFLOPS | torch MHA | torch SDPA module | ours / MHA | ours / SDPA "
          "| torch SDPA, tensors on GPU | ours / sgemm |")
    print("|---|---|---|---|---|---|---|---|")
    for name, ours, mha, sdpa, resident, _ in rows:
        print("| %s | %.0f | %.0f | %.0f | %.2f | %.2f | %.0f | %.3f |" % (
            name, ours, mha, sdpa, ours / mha, ours / sdpa, resident, ours / sgemm))
    print("\ncuBLAS %s GEMM n=8192 (TF32 off): %.0f GFLOPS" % (args.dtype, sgemm))
    if "S2" in record["rows"] and not bf16:
        cpu = run_json([os.path.join(args.bin, "attention_bench"), "--benchmark_format=json",
                        "--benchmark_filter=^BM_MhaS2/threads:2/", "--benchmark_min_time=1"])
        cpu_s2 = cpu["BM_MhaS2/threads:2/real_time"]["GFLOPS"]
        record["cpu_backend_s2_gflops"] = cpu_s2
        print("S2: CUDA backend / CPU backend (2 threads) = %.1f (%.0f / %.0f GFLOPS)"
              % (record["rows"]["S2"]["ours"] / cpu_s2, record["rows"]["S2"]["ours"], cpu_s2))
    if "S1" in record["rows"] and not bf16:
        served = served_tokens_per_second(args.bin)
        in_process = record["rows"]["S1"]["ours_tokens_per_second"]
        record["served_s1_tokens_per_second"] = served
        print("S1 served over gRPC / in process = %.2f (%.0f / %.0f tokens/s)"
              % (served / in_process, served, in_process))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
