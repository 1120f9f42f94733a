#!/usr/bin/env python3
"""What the Open Inference Protocol (KServe v2) costs against the native RPC on the same load:

    scripts/kserve-venv
    build/kserve-venv/bin/python bench/kserve_load.py [--server build/server/attention-server] \\
        [--loadgen build/client/attention-loadgen] [--rounds 3] [--duration 5] \\
        [--runs 1x16:1,8,64 32x128:1,8]

One server (--demo_layer: BERT-base, E=768, 12 heads) on a free loopback port serves every
run. For each request shape and number of closed-loop callers C, each round runs back to
back: the native attention.v1 MultiHeadAttention through grpc.aio stubs, tritonclient's
asyncio gRPC ModelInfer, both from the same Python asyncio loop (one channel, C coroutines,
the request built once), so only the protocol differs; then attention-loadgen (C++) on the
same shape and C, which shows where a Python client itself stands. Throughput counts the
requests sent inside the measured window (after --warmup), latency runs from send to answer
(nearest-rank p50 / p99), as attention-loadgen does. The host drifts, so kserve / native is
taken within each round and its median printed. CPU per request (Python runs only): the
server's (its /proc/PID/stat) and this client process's, over the whole run with warm-up.
"""
import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "client", "python"))
from attention_client import stubs  # noqa: E402
from attention_client.server_process import ServerProcess  # noqa: E402

pb, pb_grpc, _ = stubs.load()
LAYER = "demo-bert-base"
EMBED_DIM = 768
UNLIMITED_MESSAGES = [("grpc.max_send_message_length", -1),
                      ("grpc.max_receive_message_length", -1)]


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def nearest_rank(sorted_values, p):
    return sorted_values[max(0, math.ceil(p * len(sorted_values)) - 1)]


async def closed_loop(call, concurrency, warmup, duration, server_pid):
    """C callers, each sending its next request when the previous one is answered."""
    latencies = []
    answered = 0
    start = time.perf_counter()
    window_start, end = start + warmup, start + warmup + duration
    server_cpu, client_cpu = cpu_seconds(server_pid), time.process_time()

    async def caller():
        nonlocal answered
        while (sent := time.perf_counter()) < end:
            await call()
            answered += 1
            if sent >= window_start:
                latencies.append(time.perf_counter() - sent)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    latencies.sort()
    return {"req/s": len(latencies) / duration,
            "p50 ms": 1e3 * nearest_rank(latencies, 0.50),
            "p99 ms": 1e3 * nearest_rank(latencies, 0.99),
            "server CPU ms/req": 1e3 * (cpu_seconds(server_pid) - server_cpu) / answered,
            "client CPU ms/req": 1e3 * (time.process_time() - client_cpu) / answered}


def run_loadgen(args, target, batch, tokens, concurrency):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "load.json")
        process = subprocess.run(
            [args.loadgen, "--target=" + target, "--layer=" + LAYER, "--embed_dim=%d" % EMBED_DIM,
             "--batch=%d" % batch, "--tokens=%d" % tokens, "--concurrency=%d" % concurrency,
             "--duration=%g" % args.duration, "--warmup=%g" % args.warmup, "--json=" + report],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if process.returncode != 0:
            raise RuntimeError("attention-loadgen failed:\n" + process.stdout)
        with open(report) as f:
            result = json.load(f)
    if result["errors"]:
        raise RuntimeError("attention-loadgen saw errors: %s" % result["errors"])
    return {"req/s": result["requests_per_second"], "p50 ms": result["latency_ms"]["p50"],
            "p99 ms": result["latency_ms"]["p99"]}


async def measure_shape(args, server, batch, tokens, concurrency_list, rng):
    """Rounds of native, kserve, loadgen for each C; returns rows of per-round results."""
    query = rng.standard_normal((batch, tokens, EMBED_DIM)).astype(np.float32)
    native_request = pb.MultiHeadAttentionRequest(
        layer=LAYER, query=pb.Tensor(dtype=pb.FLOAT32, shape=list(query.shape),
                                     raw_data=query.tobytes()))
    kserve_input = triton.InferInput("query", list(query.shape), "FP32")
    kserve_input.set_data_from_numpy(query)
    channel = grpc.aio.insecure_channel(server.target, options=UNLIMITED_MESSAGES)
    native = pb_grpc.AttentionServiceStub(channel)
    kserve = triton_aio.InferenceServerClient(server.target)

    async def native_call():
        return await native.MultiHeadAttention(native_request)

    async def kserve_call():
        return await kserve.infer(LAYER, [kserve_input])

    # Same work on both paths: the answers are bitwise equal.
    native_answer, kserve_answer = await native_call(), await kserve_call()
    if native_answer.output.raw_data != kserve_answer.get_response().raw_output_contents[0]:
        raise RuntimeError("native and KServe answers differ for B=%d N=%d" % (batch, tokens))

    rows = []
    for concurrency in concurrency_list:
        for round_index in range(args.rounds):
            row = {"shape": "B=%d N=%d" % (batch, tokens), "C": concurrency,
                   "round": round_index + 1}
            for name, call in (("native", native_call), ("kserve", kserve_call)):
                row[name] = await closed_loop(call, concurrency, args.warmup, args.duration,
                                              server.process.pid)
            row["loadgen"] = run_loadgen(args, server.target, batch, tokens, concurrency)
            print(json.dumps(row), flush=True)
            rows.append(row)
    await channel.close()
    await kserve.close()
    return rows


def print_table(rows):
    def median(select, group):
        return statistics.median(select(r) for r in group)

    print("\n| shape | C | native req/s | KServe req/s | KServe/native req/s | native p50 / p99 ms"
          " | KServe p50 / p99 ms | KServe/native p50 | KServe/native p99 | server CPU ms/req"
          " native / KServe | KServe/native server CPU | client CPU ms/req native / KServe"
          " | loadgen req/s | loadgen p50 / p99 ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    groups = {}
    for row in rows:
        groups.setdefault((row["shape"], row["C"]), []).append(row)
    for (shape, concurrency), group in groups.items():
        def m(client, key):
            return median(lambda r: r[client][key], group)

        def ratio(key):
            return median(lambda r: r["kserve"][key] / r["native"][key], group)
        print("| %s | %d | %.1f | %.1f | %.3f | %.2f / %.2f | %.2f / %.2f | %.3f | %.3f "
              "| %.3f / %.3f | %.3f | %.3f / %.3f | %.1f | %.2f / %.2f |" % (
                  shape, concurrency, m("native", "req/s"), m("kserve", "req/s"),
                  ratio("req/s"), m("native", "p50 ms"), m("native", "p99 ms"),
                  m("kserve", "p50 ms"), m("kserve", "p99 ms"), ratio("p50 ms"),
                  ratio("p99 ms"), m("native", "server CPU ms/req"),
                  m("kserve", "server CPU ms/req"), ratio("server CPU ms/req"),
                  m("native", "client CPU ms/req"),
                  m("kserve", "client CPU ms/req"), m("loadgen", "req/s"),
                  m("loadgen", "p50 ms"), m("loadgen", "p99 ms")))
    print("\nKServe/native per round (req/s, p50, p99):")
    for (shape, concurrency), group in groups.items():
        print("  %s C=%d: %s" % (shape, concurrency, "; ".join(
            "%.3f %.3f %.3f" % tuple(r["kserve"][k] / r["native"][k]
                                     for k in ("req/s", "p50 ms", "p99 ms")) for r in group)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=os.path.join(REPO, "build/server/attention-server"))
    parser.add_argument("--loadgen", default=os.path.join(REPO, "build/client/attention-loadgen"))
    parser.add_argument("--runs", nargs="+", default=["1x16:1,8,64", "32x128:1,8"],
                        help="BxN:C,C,...: query shape [B, N, 768] and its caller counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1)
    parser.add_argument("--seed", type=int, default=1)
    # One B=32 N=128 request is accounted at 138 MB in the queue: let 8 of them wait.
    parser.add_argument("--server_flags", default="--max_queued_bytes=2147483648",
                        help="the server's flags besides --demo_layer")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = []
    with ServerProcess(args.server, "--demo_layer", *args.server_flags.split()) as server:
        for run in args.runs:
            shape, callers = run.split(":")
            batch, tokens = (int(v) for v in shape.split("x"))
            concurrency = [int(c) for c in callers.split(",")]
            rows += asyncio.run(measure_shape(args, server, batch, tokens, concurrency, rng))
    print_table(rows)


if __name__ == "__main__":
    main()
