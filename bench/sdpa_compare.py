"""Scaled dot-product attention alone, the service's CPU core (attention_bench's BM_SdpaCpu,
the path a served SDPA request takes) against PyTorch 2.x's F.scaled_dot_product_attention on
the same [B, 12, N, 64] shapes and threads, in float32 and in bf16 (compute_dtype BFLOAT16
against torch on bf16 tensors), alternated round by round because the host's speed drifts.
Prints a markdown table of medians: useful GFLOPS and the ratios per round.

    build/bench-venv/bin/python bench/sdpa_compare.py [--bench build/bench/attention_bench]
        [--rounds 3] [--threads 2]
"""
import argparse
import os
import statistics

import torch

from measure import run_bench, seconds_per_call

# name: (batch, tokens, causal), 12 heads of 64.
SHAPES = {"S1": (32, 128, False), "S2": (8, 512, False), "S3": (1, 2048, True)}
HEADS, HEAD_DIM = 12, 64


def torch_gflops(batch, tokens, causal, dtype, min_seconds):
    shape = (batch, HEADS, tokens, HEAD_DIM)
    q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
    with torch.inference_mode():
        seconds = seconds_per_call(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
            min_seconds)
    return (2.0 if causal else 4.0) * batch * tokens * tokens * HEADS * HEAD_DIM / seconds / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", default="build/bench/attention_bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {name: [] for name in SHAPES}
    kernel = "?"
    for _ in range(args.rounds):
        for name, (batch, tokens, causal) in SHAPES.items():
            prefix = f"BM_SdpaCpu/batch:{batch}/tokens:{tokens}/causal:{int(causal)}"
            ours = run_bench(args.bench, f"{prefix}/bf16:[01]/threads:{args.threads}/",
                             args.min_time)
            f32, bf16 = (ours[f"{prefix}/bf16:{b}/threads:{args.threads}/real_time"]
                         for b in (0, 1))
            kernel = bf16.get("label", "?")
            torch_f32 = torch_gflops(batch, tokens, causal, torch.float32, args.min_time)
            torch_bf16 = torch_gflops(batch, tokens, causal, torch.bfloat16, args.min_time)
            rows[name].append((f32["GFLOPS"], bf16["GFLOPS"], torch_f32, torch_bf16))
    print(f"torch {torch.__version__}, {args.threads} threads, bf16 products: {kernel}, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}, "
          f"median of {args.rounds} alternated rounds")
    print()
    print("| shape | ours f32 | ours bf16 | torch f32 | torch bf16 | ours/torch f32 | "
          "ours/torch bf16 | ours bf16/f32 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, measured in rows.items():
        med = lambda f: statistics.median(f(m) for m in measured)
        print(f"| {name} {SHAPES[name]} | {med(lambda m: m[0]):.0f} | {med(lambda m: m[1]):.0f} | "
              f"{med(lambda m: m[2]):.0f} | {med(lambda m: m[3]):.0f} | "
              f"{med(lambda m: m[0] / m[2]):.2f} | {med(lambda m: m[1] / m[3]):.2f} | "
              f"{med(lambda m: m[1] / m[0]):.2f} |")


if __name__ == "__main__":
    main()
