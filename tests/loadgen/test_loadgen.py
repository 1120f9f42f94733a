#!/usr/bin/python3
"""attention-loadgen against a real attention-server (demo layer) on a free loopback port.

usage: test_loadgen.py PATH/TO/attention-server PATH/TO/attention-loadgen

Runs the load generator for about 2 s each in closed loop over unary calls, closed loop over
streams (one per caller, and callers sharing streams), open loop unary and open loop stream
(random sequence lengths, batch 2, bfloat16, causal), each with --json, and checks the JSON:
requests > 0, no errors, nothing unsent or unanswered, tokens = requests * batch * tokens
(or within [LO, HI] * requests * batch for a length range), rates = counts / window and the
latency percentiles ordered min <= p50 <= p90 <= p99 <= p99.9 <= max. A run against a
layer the server does not hold (with --embed_dim, so the tool does not look it up) must
count every request under NOT_FOUND, over unary calls and over a stream. Bad flags exit 2
and a failing layer lookup exits 1; --version names the tool and a revision. Load balancing, with a second server and one target
naming both (ipv4:127.0.0.1:P1,127.0.0.1:P2): --lb_policy=round_robin spreads calls over
both servers (each one's /metrics counts some), the default pick_first sends all to one.

The durations are the load generator's own measurement windows; the test itself never
sleeps: it waits for the processes.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))

# server_process.py needs only the standard library; load it without the package (whose
# __init__ imports grpc).
_spec = importlib.util.spec_from_file_location(
    "server_process", os.path.join(REPO, "client", "python", "attention_client",
                                   "server_process.py"))
server_process = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_process)

failures = []
checks = 0


def check(condition, message):
    global checks
    checks += 1
    if not condition:
        failures.append(message)
        print("FAIL: " + message, flush=True)
    return bool(condition)


def run_loadgen(loadgen, target, label, *flags, want_exit=0):
    """Runs the tool with --json; returns the parsed JSON (or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        json_path = os.path.join(tmp, "report.json")
        args = [loadgen, "--target=" + target, "--json=" + json_path] + list(flags)
        print("$ " + " ".join(args), flush=True)
        result = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, timeout=120)
        print(result.stdout + result.stderr, flush=True)
        if not check(result.returncode == want_exit, "%s: exit code %d, want %d; stderr: %s"
                     % (label, result.returncode, want_exit, result.stderr)):
            return None
        if want_exit != 0:
            return None
        if not check(os.path.isfile(json_path), "%s: no JSON file written" % label):
            return None
        with open(json_path) as f:
            text = f.read()
        try:
            return json.loads(text)
        except ValueError as e:
            check(False, "%s: JSON does not parse (%s):\n%s" % (label, e, text))
            return None


def check_rates(label, report):
    window = report["window_seconds"]
    check(window > 0, "%s: window_seconds %s" % (label, window))
    if window > 0:
        for count, rate in (("requests", "requests_per_second"), ("tokens", "tokens_per_second")):
            want = report[count] / window
            check(abs(report[rate] - want) <= 1e-4 * max(1.0, want),
                  "%s: %s %s != %s / window %s" % (label, rate, report[rate], count, window))


def check_good_run(label, report, batch, lo, hi):
    if report is None:
        return
    requests = report["requests"]
    check(requests > 0, "%s: requests %d, want > 0" % (label, requests))
    check(report["errors"] == 0 and report["errors_by_code"] == {},
          "%s: errors %d %s, want none" % (label, report["errors"], report["errors_by_code"]))
    check(report["not_sent"] == 0, "%s: not_sent %d" % (label, report["not_sent"]))
    check(report["unanswered"] == 0, "%s: unanswered %d" % (label, report["unanswered"]))
    check(report["sent"] == requests, "%s: sent %d != requests %d"
          % (label, report["sent"], requests))
    tokens = report["tokens"]
    if lo == hi:
        check(tokens == requests * batch * lo, "%s: tokens %d != requests %d * batch %d * %d"
              % (label, tokens, requests, batch, lo))
    else:
        check(requests * batch * lo <= tokens <= requests * batch * hi,
              "%s: tokens %d outside requests %d * batch %d * [%d, %d]"
              % (label, tokens, requests, batch, lo, hi))
    check_rates(label, report)
    lat = report["latency_ms"]
    check(lat["count"] == requests, "%s: latency count %s != requests %d"
          % (label, lat["count"], requests))
    order = [lat[k] for k in ("min", "p50", "p90", "p99", "p99.9", "max")]
    check(all(v is not None and v > 0 for v in order), "%s: latency values %s" % (label, lat))
    if all(v is not None for v in order):
        check(order == sorted(order), "%s: latency not ordered min<=p50<=p90<=p99<=p99.9<=max: %s"
              % (label, lat))
        check(lat["min"] <= lat["mean"] <= lat["max"], "%s: mean outside [min, max]: %s"
              % (label, lat))


def check_not_found_run(label, report):
    if report is None:
        return
    check(report["requests"] == 0, "%s: requests %d, want 0" % (label, report["requests"]))
    check(report["errors"] > 0, "%s: errors %d, want > 0" % (label, report["errors"]))
    check(report["errors_by_code"] == {"NOT_FOUND": report["errors"]},
          "%s: errors_by_code %s, want only NOT_FOUND = %d"
          % (label, report["errors_by_code"], report["errors"]))
    check(report["unanswered"] == 0 and report["not_sent"] == 0,
          "%s: unanswered %d, not_sent %d" % (label, report["unanswered"], report["not_sent"]))
    check(report["latency_ms"]["count"] == 0 and report["latency_ms"]["p50"] is None,
          "%s: latency of failed requests reported: %s" % (label, report["latency_ms"]))
    check_rates(label, report)


def mha_calls(server):
    """MultiHeadAttention calls the server has finished, from its /metrics."""
    url = "http://127.0.0.1:%d/metrics" % server.metrics_port
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("attention_requests_total{")
               and 'method="MultiHeadAttention"' in line)


def check_load_balancing(server_binary, loadgen, first):
    with server_process.ServerProcess(server_binary, "--demo_layer") as second:
        both = "ipv4:127.0.0.1:%d,127.0.0.1:%d" % (first.port, second.port)
        for policy in ("round_robin", "pick_first"):
            before = [mha_calls(first), mha_calls(second)]
            label = "--lb_policy=" + policy
            report = run_loadgen(loadgen, both, label, label, "--concurrency=2",
                                 "--tokens=16", "--duration=1", "--warmup=0.3", "--seed=7")
            check_good_run(label, report, 1, 16, 16)
            served = [mha_calls(first) - before[0], mha_calls(second) - before[1]]
            print("%s: MultiHeadAttention calls per server %s" % (label, served), flush=True)
            if policy == "round_robin":
                check(min(served) > 0, "%s: calls per server %s, want both > 0"
                      % (label, served))
            else:
                check(sorted(served)[0] == 0 and sum(served) > 0,
                      "%s: calls per server %s, want all on one" % (label, served))
        code = second.stop()
        check(code == 0, "second server exit code %s" % code)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    server_binary, loadgen = sys.argv[1], sys.argv[2]
    common = ["--duration=2", "--warmup=0.3", "--seed=7"]
    with server_process.ServerProcess(server_binary, "--demo_layer") as server:
        target = server.target

        report = run_loadgen(loadgen, target, "closed unary", "--mode=unary",
                             "--concurrency=4", "--tokens=16", *common)
        check_good_run("closed unary", report, 1, 16, 16)
        if report is not None:
            check(report["config"]["loop"] == "closed" and report["config"]["mode"] == "unary",
                  "closed unary: config %s" % report["config"])

        report = run_loadgen(loadgen, target, "closed stream", "--mode=stream",
                             "--concurrency=4", "--tokens=12", "--batch=3", "--dtype=float16",
                             *common)
        check_good_run("closed stream", report, 3, 12, 12)
        if report is not None:
            check(report["config"]["streams"] == 4, "closed stream: streams %s, want 4 (one per "
                  "caller)" % report["config"]["streams"])

        report = run_loadgen(loadgen, target, "closed shared stream", "--mode=stream",
                             "--concurrency=6", "--streams=2", "--connections=2", "--tokens=16",
                             "--duration=1", "--warmup=0.2")
        check_good_run("closed shared stream", report, 1, 16, 16)

        report = run_loadgen(loadgen, target, "open unary", "--mode=unary", "--rate=150",
                             "--tokens=16", *common)
        check_good_run("open unary", report, 1, 16, 16)
        if report is not None:
            check(report["config"]["loop"] == "open", "open unary: config %s" % report["config"])
            # 300 arrivals expected in the window; Poisson spread is +-17 (1 sigma).
            check(150 <= report["requests"] <= 450, "open unary: %d requests for 150/s over 2 s"
                  % report["requests"])

        report = run_loadgen(loadgen, target, "open stream range", "--mode=stream",
                             "--rate=150", "--tokens=8:24", "--batch=2", "--dtype=bfloat16",
                             "--causal", *common)
        check_good_run("open stream range", report, 2, 8, 24)

        report = run_loadgen(loadgen, target, "not found unary", "--layer=no-such-layer",
                             "--embed_dim=768", "--concurrency=2", "--duration=1",
                             "--warmup=0.1")
        check_not_found_run("not found unary", report)

        report = run_loadgen(loadgen, target, "not found stream", "--layer=no-such-layer",
                             "--embed_dim=768", "--mode=stream", "--rate=200", "--duration=1",
                             "--warmup=0.1")
        check_not_found_run("not found stream", report)

        # Without --embed_dim the tool looks the layer up and stops at once: exit 1.
        run_loadgen(loadgen, target, "lookup fails", "--layer=no-such-layer", want_exit=1)
        for bad in ("--tokens=9:3", "--tokens=abc", "--mode=bidi", "--dtype=int8",
                    "--concurrency=0", "--rate=-1", "--lb_policy=least_request"):
            run_loadgen(loadgen, target, "bad flag " + bad, bad, want_exit=2)

        check_load_balancing(server_binary, loadgen, server)
        version = subprocess.run([loadgen, "--version"], stdout=subprocess.PIPE, text=True,
                                 timeout=60)
        check(version.returncode == 0 and re.fullmatch(
            r"attention-loadgen \d+\.\d+\.\d+ \(revision ([0-9a-f]+|unknown)\)\n",
            version.stdout), "attention-loadgen --version: exit %d, %r"
              % (version.returncode, version.stdout))

        code = server.stop()
        check(code == 0, "server exit code after SIGTERM is %s, want 0; stderr:\n%s"
              % (code, server.stderr_text()[-4000:]))

    if failures:
        print("test_loadgen: %d of %d checks FAILED" % (len(failures), checks))
        sys.exit(1)
    print("test_loadgen: all %d checks passed" % checks)


if __name__ == "__main__":
    main()
