#!/usr/bin/python3
"""Issue 15's served targets in one run: for each shape, one caller's served MultiHeadAttention
(bench/served_overhead: a real server on loopback, one request per round) and, back to back,
ONNX Runtime in process (bench/ort_peer.py from the bench venv, scripts/bench-deps), several
times; prints the medians of the per-repeat ratios as a markdown table.

    /usr/bin/python3 bench/served_vs_ort.py [--build build] [--repeats 3] [--rounds 7]
        [--shapes S1,S2,S3,S4] [--peer-python build/bench-venv/bin/python]

Report it twice, as compare.py: as the machine is set up, and with OpenBLAS's own kernel
choice (`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE ...`).
"""
import argparse
import re
import statistics
import subprocess

from compare import SHAPES, run_peer
from measure import useful_flops


def served_milliseconds(build, batch, tokens, causal, rounds):
    """(served, compute in process) medians in ms from bench/served_overhead."""
    command = [f"{build}/bench/served_overhead", f"--batch={batch}", f"--tokens={tokens}",
               f"--rounds={rounds}"] + (["--causal"] if causal else [])
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout

    def value(label):
        return float(re.search(rf"{label}\s+([0-9.]+) ms", output).group(1))

    return value("served MultiHeadAttention"), value("compute in process")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7, help="served_overhead rounds per repeat")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--peer-python", default="build/bench-venv/bin/python")
    parser.add_argument("--min-time", default="2", help="seconds ONNX Runtime is timed")
    args = parser.parse_args()
    print("| shape | served GFLOPS | in-process GFLOPS | ORT GFLOPS | served / in-process "
          "| served / ORT | in-process / ORT |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        batch, tokens, embed_dim, heads, causal = SHAPES[name]
        flops = useful_flops(batch, tokens, embed_dim, causal)
        rows = []
        for _ in range(args.repeats):
            served_ms, compute_ms = served_milliseconds(args.build, batch, tokens, causal,
                                                        args.rounds)
            ort = run_peer(args.peer_python, "ort_peer.py", batch, tokens, embed_dim, heads,
                           causal, 2, args.min_time)["gflops"]
            served, in_process = flops / served_ms / 1e6, flops / compute_ms / 1e6
            rows.append([served, in_process, ort, served / in_process, served / ort,
                         in_process / ort])
        medians = [statistics.median(column) for column in zip(*rows)]
        print(f"| {name} B={batch} N={tokens}{' causal' if causal else ''} | "
              + " | ".join(f"{v:.1f}" for v in medians[:3]) + " | "
              + " | ".join(f"{v:.2f}" for v in medians[3:]) + " |", flush=True)


if __name__ == "__main__":
    main()
