#!/usr/bin/python3
"""Before/after of attention_bench binaries on a noisy shared host: runs them alternately
(A B B A A B B A ...: each binary as often first as second, so a drift in the host's speed
favours neither), then prints each benchmark's median GFLOPS per binary and the ratio to the
first binary.

    /usr/bin/python3 bench/alternate.py BEFORE AFTER [MORE ...] [--filter REGEX] [--rounds 4]
        [--min-time 0.5]

E.g. build the commit before into /tmp/before (`git worktree add`, cmake, copy
build/bench/attention_bench), then
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 bench/alternate.py
/tmp/before build/bench/attention_bench --filter 'BM_MhaS[124]Cpu|BM_AttentionCpu'`.
Prefer the ...Cpu benchmarks (GFLOPS per process CPU second): another tenant taking a core
shows up in wall-clock time far more than in CPU time.
"""
import argparse
import statistics

from measure import run_bench


def gflops(binary, pattern, min_time):
    """{benchmark name: GFLOPS} of one run of `binary`."""
    return {name: b["GFLOPS"] for name, b in run_bench(binary, pattern, min_time).items()
            if "GFLOPS" in b}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binaries", nargs="+", help="attention_bench binaries; the first is the base")
    parser.add_argument("--filter", default="BM_MhaS[124]Cpu|BM_AttentionCpu")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each binary")
    parser.add_argument("--min-time", default="0.5")
    args = parser.parse_args()
    if len(args.binaries) < 2:
        parser.error("give at least two binaries")
    runs = {binary: [] for binary in args.binaries}
    for round_index in range(args.rounds):
        order = args.binaries if round_index % 2 == 0 else list(reversed(args.binaries))
        for binary in order:
            runs[binary].append(gflops(binary, args.filter, args.min_time))
    base = args.binaries[0]
    print("| benchmark | " + " | ".join(args.binaries) + " | "
          + " | ".join(f"{b} / {base}" for b in args.binaries[1:]) + " |")
    print("|---|" + "---|" * (2 * len(args.binaries) - 1))
    for name in runs[base][0]:
        medians = [statistics.median(run[name] for run in runs[b]) for b in args.binaries]
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in medians) + " | "
              + " | ".join(f"{m / medians[0]:.3f}" for m in medians[1:]) + " |")


if __name__ == "__main__":
    main()
