#!/usr/bin/python3
"""Issue 5's serving measurement, reproducible in one command:

    /usr/bin/python3 bench/serving.py [--build build] [--rounds 3] [--duration 8]

Each round runs, back to back on this machine: the server with batching (default flags),
the same server with --max_batch_requests=1, both under attention-loadgen (one sequence of
16 tokens per request, E=768, 12 heads, 64 closed-loop callers); the batching server again
under open-loop Poisson arrivals at half the peak it just reached, and with one caller
(idle); then the in-process core on the same work (attention_bench: B=256 N=16, one
16-token request, 32 and 64 packed).
One server runs at a time. Ratios are taken within a round, then the median is printed:
the host's speed drifts by tens of percent within minutes. Mean batch size and compute time
per batch come from the server's own /metrics.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request

TOKENS = 16
EMBED_DIM = 768


def wait_for_line(path, pattern, process, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            match = re.search(pattern, f.read())
        if match:
            return int(match.group(1))
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {open(path).read()}")
        time.sleep(0.05)
    raise RuntimeError(f"no '{pattern}' from the server within {timeout} s")


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    values = {}
    for name in ("attention_batch_size_requests_sum", "attention_batch_size_requests_count",
                 "attention_compute_duration_seconds_sum"):
        # Summed over the layer label (one layer here).
        samples = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        values[name] = sum(float(v) for v in samples)
    return values


def cpu_seconds_by_thread_name(pid):
    """CPU seconds (user + system) used so far by each thread name of process `pid`."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
        seconds[name] = seconds.get(name, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
    return seconds


def cores_used(server_pid, loadgen_pid, seconds):
    """Cores used over the next `seconds`: the server's compute threads (named after the
    binary: batch workers and pool), its gRPC threads (every other name), the load generator."""
    before = cpu_seconds_by_thread_name(server_pid), cpu_seconds_by_thread_name(loadgen_pid)
    time.sleep(seconds)
    after = cpu_seconds_by_thread_name(server_pid), cpu_seconds_by_thread_name(loadgen_pid)
    delta = [{name: (used - earlier.get(name, 0.0)) / seconds for name, used in later.items()}
             for later, earlier in zip(after, before)]
    compute = delta[0].get("attention-serve", 0.0)  # /proc truncates names to 15 characters
    return {"server compute": compute, "server gRPC": sum(delta[0].values()) - compute,
            "loadgen": sum(delta[1].values())}


def serve_and_load(args, server_flags, loadgen_flags):
    """Starts a server, drives it with the load generator, stops it; returns loadgen's JSON
    plus the server's mean batch size and compute milliseconds per batch, and the cores
    each side used during the measured seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "server.log")
        with open(log, "w") as out:
            server = subprocess.Popen(
                [f"{args.build}/server/attention-server", "--listen=127.0.0.1:0",
                 "--metrics_listen=127.0.0.1:0", "--demo_layer"] + server_flags,
                stdout=out, stderr=subprocess.STDOUT)
        try:
            port = wait_for_line(log, r"listening on port (\d+)", server)
            metrics_port = wait_for_line(log, r"metrics on port (\d+)", server)
            before = scrape(metrics_port)
            report = os.path.join(tmp, "load.json")
            loadgen_log = open(os.path.join(tmp, "loadgen.log"), "w+")
            loadgen = subprocess.Popen(
                [f"{args.build}/client/attention-loadgen", f"--target=127.0.0.1:{port}",
                 f"--tokens={TOKENS}", "--batch=1", f"--duration={args.duration}",
                 f"--warmup={args.warmup}", f"--json={report}"] + loadgen_flags,
                stdout=loadgen_log, stderr=subprocess.STDOUT)
            # Inside the measured window, with a margin at each end.
            time.sleep(args.warmup + 0.5)
            cores = cores_used(server.pid, loadgen.pid, args.duration - 1.0)
            if loadgen.wait() != 0:
                loadgen_log.seek(0)
                raise RuntimeError(f"attention-loadgen failed: {loadgen_log.read()}")
            after = scrape(metrics_port)
            with open(report) as f:
                result = json.load(f)
        finally:
            server.terminate()
            server.wait()
    batches = after["attention_batch_size_requests_count"] - before["attention_batch_size_requests_count"]
    requests = after["attention_batch_size_requests_sum"] - before["attention_batch_size_requests_sum"]
    compute = after["attention_compute_duration_seconds_sum"] - before["attention_compute_duration_seconds_sum"]
    result["cores"] = cores
    result["mean_batch_requests"] = requests / batches if batches else 0.0
    result["compute_ms_per_batch"] = 1e3 * compute / batches if batches else 0.0
    return result


def in_process(args):
    """Tokens per second of the core: B=256 N=16 packed, and 1, 32, 64 packed requests."""
    output = subprocess.run(
        [f"{args.build}/bench/attention_bench", "--benchmark_filter=MhaS4|MhaRequests16",
         "--benchmark_format=json", "--benchmark_min_time=1"],
        check=True, capture_output=True, text=True).stdout
    rates = {}
    for bench in json.loads(output)["benchmarks"]:
        seconds = bench["real_time"] / 1e9 if bench["time_unit"] == "ns" else bench["real_time"] / 1e3
        match = re.search(r"requests:(\d+)", bench["name"])
        requests = int(match.group(1)) if match else 256
        key = "S4" if "MhaS4" in bench["name"] else f"packed {requests}"
        rates[key] = requests * TOKENS / seconds
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=8, help="seconds measured per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--server_flags", default="", help="added to both servers")
    args = parser.parse_args()
    if args.duration < 2:
        parser.error("--duration must be >= 2 (CPU use is sampled inside it)")
    common = args.server_flags.split()
    closed = [f"--concurrency={args.concurrency}"]
    rows = []
    for round_index in range(args.rounds):
        batching = serve_and_load(args, common, closed)
        single = serve_and_load(args, common + ["--max_batch_requests=1"], closed)
        half_rate = 0.5 * batching["requests_per_second"]
        half_peak = serve_and_load(args, common, [f"--rate={half_rate:.0f}"])
        idle = serve_and_load(args, common, ["--concurrency=1"])
        core = in_process(args)
        row = {
            "batching": batching["tokens_per_second"],
            "single": single["tokens_per_second"],
            "batching / single": batching["tokens_per_second"] / single["tokens_per_second"],
            "served / in-process S4": batching["tokens_per_second"] / core["S4"],
            "in-process S4": core["S4"],
            "in-process 1 request": core["packed 1"],
            "in-process 64 packed / 1": core["packed 64"] / core["packed 1"],
            "mean batch": batching["mean_batch_requests"],
            "compute ms per batch": batching["compute_ms_per_batch"],
            # With two batch workers, two forward passes may overlap and each takes longer.
            "no batching: compute ms per forward": single["compute_ms_per_batch"],
            # Where the two cores go at peak; the rest is idle.
            "batching: server compute cores": batching["cores"]["server compute"],
            "batching: server gRPC cores": batching["cores"]["server gRPC"],
            "batching: loadgen cores": batching["cores"]["loadgen"],
            # Tokens/s per core the compute threads got, against the in-process core's per
            # core (S4 on 2 threads): how much of the gap to in-process is compute itself.
            "batching: per compute core / in-process per core":
                batching["tokens_per_second"] / batching["cores"]["server compute"]
                / (core["S4"] / 2),
            "batching p50 ms": batching["latency_ms"]["p50"],
            "batching p99 ms": batching["latency_ms"]["p99"],
            "half-peak rate req/s": half_rate,
            "half-peak p50 ms": half_peak["latency_ms"]["p50"],
            "half-peak p99 ms": half_peak["latency_ms"]["p99"],
            "idle p50 ms": idle["latency_ms"]["p50"],
            "idle p50 - in-process ms": idle["latency_ms"]["p50"] - 1e3 * TOKENS / core["packed 1"],
            # The serving overhead alone: round trip minus the server's own compute time.
            "idle mean - server compute ms":
                idle["latency_ms"]["mean"] - idle["compute_ms_per_batch"],
            "errors": sum(r["errors"] for r in (batching, single, half_peak, idle)),
        }
        rows.append(row)
        print(f"round {round_index + 1}: " +
              ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)
    print("\n| measure | median | min | max |\n|---|---|---|---|")
    for key in rows[0]:
        values = [r[key] for r in rows]
        print(f"| {key} | {statistics.median(values):,.2f} | {min(values):,.2f} | {max(values):,.2f} |")


if __name__ == "__main__":
    main()
