#!/usr/bin/python3
"""The live /metrics output of a real attention-server passes `promtool check metrics`.

usage: test_metrics_lint.py PATH/TO/attention-server

The server runs on port 0 with /metrics on 127.0.0.1:0. Before the scrape it answers a few
calls (OK, NOT_FOUND, INVALID_ARGUMENT) so the labelled families (requests by code, request
duration by method, tokens by layer) have series. Also checks that the families issue 7 asks
for are present, that an unknown layer name in a request did not create a series, and that
the server logs its configuration at start-up (every flag of server/app/main.cc, with its value).
"""

import os
import re
import subprocess

import grpc
import numpy as np

import obs
from attention_client import AttentionClient

DEMO = "demo-bert-base"
UNKNOWN_LAYER = "no-such-layer-lint-probe"
FAMILIES = {
    "attention_requests_total": "counter",
    "attention_request_duration_seconds": "histogram",
    "attention_queue_duration_seconds": "histogram",
    "attention_compute_duration_seconds": "histogram",
    "attention_batch_size_requests": "histogram",
    "attention_batch_size_tokens": "histogram",
    "attention_tokens_processed_total": "counter",
    "attention_queue_depth_requests": "gauge",
    "attention_in_flight_requests": "gauge",
    "attention_layers_loaded": "gauge",
    "attention_layer_weight_bytes": "gauge",
    "attention_build_info": "gauge",
}


def expect_code(t, what, code, fn):
    try:
        fn()
        t.check(False, "%s succeeded, want %s" % (what, code.name))
    except grpc.RpcError as error:
        t.check(error.code() == code, "%s: %s (%s), want %s"
                % (what, error.code(), error.details(), code.name))


def main():
    t = obs.Checker("test_metrics_lint")
    promtool = obs.tool("promtool")
    server = obs.ServerProcess(obs.server_binary(), "--compute_threads=1", "--demo_layer").start()
    try:
        t.check(server.metrics_port, "no 'metrics on port' line")
        with AttentionClient(server.target) as client:
            x = np.random.default_rng(3).normal(size=(2, 5, 768)).astype(np.float32)
            t.run("MultiHeadAttention", client.multi_head_attention, x, layer=DEMO)
            expect_code(t, "unknown layer", grpc.StatusCode.NOT_FOUND,
                        lambda: client.multi_head_attention(x, layer=UNKNOWN_LAYER))
            expect_code(t, "embed_dim 100 on a 768 layer", grpc.StatusCode.INVALID_ARGUMENT,
                        lambda: client.multi_head_attention(x[:, :, :100], layer=DEMO))
        text = obs.metrics_text(server)

        lint = subprocess.run([promtool, "check", "metrics"], input=text.encode(), timeout=60,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output = lint.stdout.decode(errors="replace").strip()
        print("$ curl /metrics | promtool check metrics  -> exit %d\n%s"
              % (lint.returncode, output), flush=True)
        t.check(lint.returncode == 0, "promtool check metrics exited %d:\n%s"
                % (lint.returncode, output))
        t.check(output == "", "promtool check metrics reported problems:\n%s" % output)

        for family, kind in FAMILIES.items():
            t.check("# TYPE %s %s\n" % (family, kind) in text,
                    "/metrics has no %s %s" % (kind, family))
        for code in ("OK", "NOT_FOUND", "INVALID_ARGUMENT"):
            value = obs.sample_value(text, "attention_requests_total",
                                     {"method": "MultiHeadAttention", "code": code})
            t.check(value == 1, "attention_requests_total{code=%s} = %s, want 1" % (code, value))
        t.check(obs.sample_value(text, "attention_tokens_processed_total", {"layer": DEMO}) == 10,
                "tokens processed for %s: %s, want 10" % (
                    DEMO, obs.sample_value(text, "attention_tokens_processed_total",
                                           {"layer": DEMO})))
        t.check(UNKNOWN_LAYER not in text,
                "an unknown layer name in a request created a series:\n%s"
                % "\n".join(l for l in text.splitlines() if UNKNOWN_LAYER in l))
        check_startup_line(t, server.stderr_text())
    except Exception:
        server.kill()
        raise
    t.finish(server)


def check_startup_line(t, stderr):
    with open(os.path.join(obs.REPO, "server", "app", "main.cc")) as f:
        flags = re.findall(r"ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,", f.read())
    t.check(len(flags) >= 10, "found only %d flags in server/app/main.cc" % len(flags))
    lines = [l for l in stderr.splitlines() if l.startswith("attention-service: starting with")]
    if not t.check(len(lines) == 1, "want one start-up configuration line on stderr:\n%s" % stderr):
        return
    print(lines[0], flush=True)
    settings = lines[0].split()[3:]
    names = [s.split("=", 1)[0][2:] for s in settings]
    t.check(sorted(names) == sorted(flags), "start-up line names %s, main.cc defines %s"
            % (sorted(names), sorted(flags)))
    for expected in ("--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                     "--compute_threads=1", "--max_queue_requests=1024"):
        t.check(expected in settings, "%s not in the start-up line" % expected)


if __name__ == "__main__":
    main()
