#!/usr/bin/python3
"""Runs OpenBLAS sgemm, this project's core, PyTorch nn.MultiheadAttention and ONNX Runtime
(bench/ort_peer.py, when the bench venv exists: scripts/bench-deps) on the benchmark shapes
in one go and prints GFLOPS and ratios as a markdown table.

    /usr/bin/python3 bench/compare.py [--bench build/bench/attention_bench] [--repeats 3] [--s5]
        [--ort-python build/bench-venv/bin/python] [--shapes S1,S4] [--threads 2] [--no-ragged]

Report every row twice: as the machine is set up, and with OpenBLAS's own kernel choice
(`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 bench/compare.py`).

Useful FLOPs per sequence of N tokens: 8*N*E^2 (four projections) + 4*N^2*E (attention),
half the attention term when causal. Ratios are what travels between machines; absolute
GFLOPS drift with load on these shared machines.
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch

SHAPES = {  # name: (batch, tokens, embed_dim, heads, causal)
    "S1": (32, 128, 768, 12, False),
    "S2": (8, 512, 768, 12, False),
    "S3": (1, 2048, 768, 12, True),
    "S4": (256, 16, 768, 12, False),
}


def useful_flops(batch, tokens, embed_dim, causal):
    attention = (2.0 if causal else 4.0) * tokens * tokens * embed_dim
    return batch * (8.0 * tokens * embed_dim * embed_dim + attention)


def torch_gflops(batch, tokens, embed_dim, heads, causal, threads, min_seconds=2.0):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(embed_dim, heads, batch_first=True).eval()
    x = torch.randn(batch, tokens, embed_dim)
    mask = torch.triu(torch.ones(tokens, tokens, dtype=torch.bool), 1) if causal else None
    with torch.inference_mode():
        mha(x, x, x, attn_mask=mask, need_weights=False)  # warm-up
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_seconds:
            mha(x, x, x, attn_mask=mask, need_weights=False)
            runs += 1
        seconds = (time.perf_counter() - start) / runs
    return useful_flops(batch, tokens, embed_dim, causal) / seconds / 1e9


def run_bench(bench, pattern, min_time):
    output = subprocess.run(
        [bench, f"--benchmark_filter={pattern}", "--benchmark_format=json",
         f"--benchmark_min_time={min_time}"],
        check=True, capture_output=True, text=True).stdout
    return {b["name"]: b for b in json.loads(output)["benchmarks"]}


def ort_gflops(python, batch, tokens, embed_dim, heads, causal, threads, min_seconds):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ort_peer.py")
    output = subprocess.run([python, script, str(batch), str(tokens), str(embed_dim), str(heads),
                             "1" if causal else "0", str(threads), str(min_seconds)],
                            check=True, capture_output=True, text=True).stdout
    return json.loads(output)["gflops"]


def median(values):
    return statistics.median(values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", default="build/bench/attention_bench")
    parser.add_argument("--min-time", default="1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--s5", action="store_true", help="also run S5 (N=65536, ~1 minute)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="e.g. S4 or S1,S4")
    parser.add_argument("--threads", default="1,2", help="thread counts, e.g. 2")
    parser.add_argument("--no-ragged", action="store_true", help="skip the ragged batch")
    parser.add_argument("--ort-python", default="build/bench-venv/bin/python",
                        help="Python with onnxruntime (scripts/bench-deps); skipped if absent")
    args = parser.parse_args()
    with_ort = os.path.exists(args.ort_python)

    # The host's speed drifts by tens of percent within minutes, so sgemm, the core and
    # PyTorch are measured back to back for each row, several times, and the ratios are
    # taken per repeat before the median.
    print(f"Each row: median of {args.repeats} back-to-back runs of sgemm n=1024, the core, "
          f"PyTorch {torch.__version__}" + (" and ONNX Runtime." if with_ort else "."))
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    print()
    print("| shape | threads | sgemm GFLOPS | core GFLOPS | PyTorch GFLOPS | core / sgemm "
          "| core / PyTorch |" + (" ORT GFLOPS | core / ORT |" if with_ort else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if with_ort else ""))
    shapes = args.shapes.split(",")
    for name, (batch, tokens, embed_dim, heads, causal) in SHAPES.items():
        if name not in shapes:
            continue
        for threads in (int(t) for t in args.threads.split(",")):
            key = f"BM_Mha{name}/threads:{threads}/real_time"
            sgemm_key = f"BM_Sgemm/n:1024/threads:{threads}/real_time"
            rows = []
            for _ in range(args.repeats):
                pattern = f"^BM_Sgemm/n:1024/threads:{threads}/|^BM_Mha{name}/threads:{threads}/"
                results = run_bench(args.bench, pattern, args.min_time)
                if key not in results:
                    break
                ours = results[key]["GFLOPS"]
                sgemm = results[sgemm_key]["GFLOPS"]
                theirs = torch_gflops(batch, tokens, embed_dim, heads, causal, threads,
                                      min_seconds=float(args.min_time))
                ort = (ort_gflops(args.ort_python, batch, tokens, embed_dim, heads, causal,
                                  threads, float(args.min_time)) if with_ort else float("nan"))
                rows.append((sgemm, ours, theirs, ours / sgemm, ours / theirs, ort, ours / ort))
            if not rows:
                continue
            columns = [median([row[i] for row in rows]) for i in range(7)]
            print(f"| {name} B={batch} N={tokens}{' causal' if causal else ''} | {threads} "
                  f"| {columns[0]:.1f} | {columns[1]:.1f} | {columns[2]:.1f} "
                  f"| {columns[3]:.2f} | {columns[4]:.2f} |"
                  + (f" {columns[5]:.1f} | {columns[6]:.2f} |" if with_ort else ""))
    if not args.no_ragged:
        ragged = run_bench(args.bench, "Ragged", args.min_time)
        milliseconds = {kind: ragged[f"BM_MhaRagged{kind}/real_time"]["real_time"]
                        for kind in ("Packed", "OneByOne", "Padded")}
        print()
        print("Ragged batch (24 sequences, lengths 16..512, 2 threads), milliseconds per batch:")
        print(f"packed {milliseconds['Packed']:.1f}, sum of each sequence alone "
              f"{milliseconds['OneByOne']:.1f} (packed / alone = "
              f"{milliseconds['Packed'] / milliseconds['OneByOne']:.2f}), padded to the longest "
              f"{milliseconds['Padded']:.1f} (packed / padded = "
              f"{milliseconds['Packed'] / milliseconds['Padded']:.2f})")
    if args.s5:
        result = subprocess.run(
            ["/usr/bin/time", "-f", "%M", args.bench, "--benchmark_filter=MhaS5",
             "--benchmark_format=json"], check=True, capture_output=True, text=True)
        gflops = json.loads(result.stdout)["benchmarks"][0]["GFLOPS"]
        peak_mib = int(result.stderr.strip().splitlines()[-1]) / 1024
        print(f"S5 N=65536 causal E=512: {gflops:.1f} GFLOPS, peak RSS {peak_mib:.0f} MiB")


if __name__ == "__main__":
    main()
