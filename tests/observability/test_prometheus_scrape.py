#!/usr/bin/python3
"""A real Prometheus (Debian's `prometheus` binary) scrapes a real attention-server.

usage: test_prometheus_scrape.py PATH/TO/attention-server

The server runs on port 0 with /metrics on 127.0.0.1:0; Prometheus runs on a free loopback
port with a temporary config (scrape and rule evaluation every second, the shipped
deploy/prometheus/attention-service.rules.yml) and storage directory. The test sends a known
number of calls in two rounds, some failing on purpose (unknown layer -> NOT_FOUND, bad shape
-> INVALID_ARGUMENT), and polls the HTTP query API (with a deadline) until the counts by
method and code match exactly. The second round lands after a scrape of the first, so the
counters rise between samples and histogram_quantile(0.99, rate(..._bucket[1m])) must be a
finite number. Every query of the Grafana dashboard and the recording rules' expressions
also run against this Prometheus without error.
"""

import json
import math
import os
import signal
import subprocess
import tempfile
import time
import urllib.parse

import grpc
import numpy as np

import obs
from attention_client import AttentionClient

DEMO = "demo-bert-base"
JOB = "attention-service"
DEADLINE_S = 90.0
# Calls per round: (method label, code label) -> count.
ROUNDS = [
    {("MultiHeadAttention", "OK"): 5, ("MultiHeadAttention", "NOT_FOUND"): 2,
     ("MultiHeadAttention", "INVALID_ARGUMENT"): 1, ("GetLayer", "OK"): 1},
    {("MultiHeadAttention", "OK"): 7, ("MultiHeadAttention", "NOT_FOUND"): 1,
     ("MultiHeadAttention", "INVALID_ARGUMENT"): 3, ("GetLayer", "NOT_FOUND"): 2},
]


class Prometheus:
    """Debian's prometheus on 127.0.0.1:<free port>, with its own config and storage."""

    def __init__(self, binary, metrics_port, workdir):
        self.port = obs.free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        config = {  # JSON is YAML: no YAML library needed
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [os.path.join(obs.PROMETHEUS_DIR, "attention-service.rules.yml")],
            "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics",
                                "static_configs": [{"targets": ["127.0.0.1:%d" % metrics_port]}]}],
        }
        self.config_path = os.path.join(workdir, "prometheus.yml")
        with open(self.config_path, "w") as f:
            json.dump(config, f, indent=1)
        self.log = open(os.path.join(workdir, "prometheus.log"), "w+b")
        self.process = subprocess.Popen(
            [binary, "--config.file=" + self.config_path,
             "--storage.tsdb.path=" + os.path.join(workdir, "data"),
             "--storage.tsdb.retention.time=1h",
             "--web.listen-address=127.0.0.1:%d" % self.port,
             "--web.console.templates=" + os.path.join(workdir, "consoles"),
             "--web.console.libraries=" + os.path.join(workdir, "console_libraries")],
            stdout=self.log, stderr=subprocess.STDOUT)

    def log_text(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def ready(self):
        if self.process.poll() is not None:
            raise RuntimeError("prometheus exited with %s:\n%s"
                               % (self.process.returncode, self.log_text()[-4000:]))
        return obs.http_get(self.base + "/-/ready", timeout=2)[0] == 200

    def api(self, path, **params):
        url = "%s/api/v1/%s?%s" % (self.base, path, urllib.parse.urlencode(params))
        status, body = obs.http_get(url)
        try:
            return json.loads(body)
        except ValueError:
            return {"status": "error", "error": "HTTP %s: %r" % (status, body[:200])}

    def query(self, expr):
        """Instant query -> (status, result list, error)."""
        answer = self.api("query", query=expr)
        return answer.get("status"), answer.get("data", {}).get("result", []), answer.get("error")

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def counts_by_code(prom):
    status, result, _ = prom.query('sum by (method, code) (attention_requests_total{job="%s"})'
                                   % JOB)
    if status != "success":
        return None
    return {(r["metric"]["method"], r["metric"]["code"]): int(float(r["value"][1]))
            for r in result}


def send_round(t, client, plan):
    """Sends the calls of one round; returns the (method, code) counts the server answered."""
    seen = {}
    x = np.random.default_rng(11).normal(size=(1, 4, 768)).astype(np.float32)
    calls = {
        ("MultiHeadAttention", "OK"): lambda: client.multi_head_attention(x, layer=DEMO),
        ("MultiHeadAttention", "NOT_FOUND"):
            lambda: client.multi_head_attention(x, layer="no-such-layer"),
        ("MultiHeadAttention", "INVALID_ARGUMENT"):
            lambda: client.multi_head_attention(x[:, :, :100], layer=DEMO),
        ("GetLayer", "OK"): lambda: client.get_layer(DEMO),
        ("GetLayer", "NOT_FOUND"): lambda: client.get_layer("no-such-layer"),
    }
    for key, count in plan.items():
        for _ in range(count):
            try:
                calls[key]()
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            seen[(key[0], code)] = seen.get((key[0], code), 0) + 1
    t.check(seen == plan, "the server answered %s, want %s" % (seen, plan))
    return seen


def add(a, b):
    total = dict(a)
    for key, value in b.items():
        total[key] = total.get(key, 0) + value
    return total


def dashboard_queries():
    dashboard = obs.load_json(obs.GRAFANA_DASHBOARD)
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$__rate_interval", "1m").replace("$job", JOB)
                    .replace("$instance", ".*").replace("$method", ".*"))
            yield panel["title"], expr


def main():
    t = obs.Checker("test_prometheus_scrape")
    prometheus_binary = obs.tool("prometheus")
    server = obs.ServerProcess(obs.server_binary(), "--compute_threads=1", "--demo_layer").start()
    workdir = tempfile.TemporaryDirectory(prefix="attention-prometheus-")
    prom = None
    try:
        t.check(server.metrics_port, "no 'metrics on port' line")
        prom = Prometheus(prometheus_binary, server.metrics_port, workdir.name)
        t.check(obs.poll(prom.ready, DEADLINE_S, "prometheus /-/ready"),
                "prometheus not ready within %.0f s:\n%s" % (DEADLINE_S, prom.log_text()[-4000:]))
        up = lambda: [r for r in prom.query('up{job="%s"} == 1' % JOB)[1]]
        t.check(obs.poll(up, DEADLINE_S, "up == 1"), "the target never came up:\n%s"
                % json.dumps(prom.api("targets"), indent=1)[:4000])

        expected = {}
        with AttentionClient(server.target) as client:
            for number, plan in enumerate(ROUNDS, 1):
                expected = add(expected, send_round(t, client, plan))
                got = obs.poll(lambda: counts_by_code(prom) == expected and expected,
                               DEADLINE_S, "round %d counts" % number)
                t.check(got, "round %d: Prometheus has %s, want %s"
                        % (number, counts_by_code(prom), expected))
        print("counts by (method, code) in Prometheus: %s" % sorted(counts_by_code(prom).items()),
              flush=True)

        p99_expr = ('histogram_quantile(0.99, sum by (le) (rate('
                    'attention_request_duration_seconds_bucket{job="%s",'
                    'method="MultiHeadAttention"}[1m])))' % JOB)
        status, result, error = prom.query(p99_expr)
        t.check(status == "success" and len(result) == 1,
                "%s -> %s %s %s" % (p99_expr, status, result, error))
        if result:
            p99 = float(result[0]["value"][1])
            print("p99 MultiHeadAttention latency: %.6f s" % p99, flush=True)
            t.check(math.isfinite(p99) and 0 < p99 < 30, "p99 = %r is not a finite duration" % p99)

        # The shipped rules load into a real Prometheus; their expressions run on live data.
        rules = prom.api("rules").get("data", {}).get("groups", [])
        names = {rule["name"] for group in rules for rule in group["rules"]}
        for name in ("AttentionServiceDown", "AttentionHighErrorRatio", "AttentionHighP99Latency",
                     "AttentionQueueSaturated", "job:attention_request_errors:ratio_rate5m"):
            t.check(name in names, "rule %s not loaded; loaded: %s" % (name, sorted(names)))
        for group in rules:
            for rule in group["rules"]:
                status, _, error = prom.query(rule["query"])
                t.check(status == "success", "rule %s: %s" % (rule["name"], error))
                if rule["type"] == "alerting":
                    t.check(rule.get("state") == "inactive" or rule.get("health") == "unknown",
                            "alert %s is %s against a healthy server"
                            % (rule["name"], rule.get("state")))
        # Only client errors were sent: the server-side error ratio is exactly 0.
        ratio_rule = [rule for group in rules for rule in group["rules"]
                      if rule["name"] == "job:attention_request_errors:ratio_rate5m"]
        if ratio_rule:
            _, result, _ = prom.query(ratio_rule[0]["query"])
            t.check([float(r["value"][1]) for r in result] == [0.0],
                    "server-side error ratio %s, want [0] (only client errors were sent)" % result)

        # Every dashboard query is valid PromQL; the main panels have data.
        for title, expr in dashboard_queries():
            status, result, error = prom.query(expr)
            t.check(status == "success", "dashboard panel %r: %s\n  %s" % (title, error, expr))
            if title in ("Request latency percentiles", "Throughput by method", "Errors by code",
                         "Queue depth", "In-flight requests", "Batch size (requests)"):
                finite = [r for r in result if math.isfinite(float(r["value"][1]))]
                t.check(finite, "dashboard panel %r has no finite value: %s\n  %s"
                        % (title, result, expr))
    except Exception:
        server.kill()
        raise
    finally:
        if prom is not None:
            prom.stop()
            t.check(prom.process.returncode == 0,
                    "prometheus exited %s" % prom.process.returncode)
        workdir.cleanup()
    t.finish(server)


if __name__ == "__main__":
    main()
