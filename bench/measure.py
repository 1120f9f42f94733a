"""What every benchmark script here counts and times the same way (imported from bench/)."""
import json
import subprocess
import time


def useful_flops(batch, tokens, embed_dim, causal):
    """Four projections (8*N*E^2) and attention (4*N^2*E, half when causal) per sequence."""
    attention = (2.0 if causal else 4.0) * tokens * tokens * embed_dim
    return batch * (8.0 * tokens * embed_dim * embed_dim + attention)


def seconds_per_call(call, min_seconds):
    """Mean seconds of `call` over a loop of at least `min_seconds`, after one warm-up call."""
    call()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        call()
        runs += 1
    return (time.perf_counter() - start) / runs


def run_bench(bench, pattern, min_time):
    """{benchmark name: its JSON entry} of one run of the attention_bench binary `bench`."""
    output = subprocess.run(
        [bench, f"--benchmark_filter={pattern}", "--benchmark_format=json",
         f"--benchmark_min_time={min_time}"],
        check=True, capture_output=True, text=True).stdout
    return {b["name"]: b for b in json.loads(output)["benchmarks"]}
