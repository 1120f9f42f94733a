"""Shared helpers of the observability tests: the integration harness (server process,
Checker), Prometheus / promtool lookup, free ports, HTTP and polling with a deadline."""

import json
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
PROMETHEUS_DIR = os.path.join(REPO, "deploy", "prometheus")
GRAFANA_DASHBOARD = os.path.join(REPO, "deploy", "grafana", "attention-service.json")
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))

import harness  # noqa: E402  (puts client/python on sys.path)
from harness import Checker, ServerProcess, server_binary  # noqa: E402,F401


def tool(name):
    """Path of a Prometheus tool (promtool, prometheus): $PROMTOOL / $PROMETHEUS, else PATH.
    Exits with a failure (not a skip) when missing: scripts/install-deps installs Debian's
    `prometheus` package, which has both."""
    path = os.environ.get(name.upper()) or shutil.which(name)
    if not path:
        print("FAIL: %s not found; install Debian's prometheus package (scripts/install-deps)"
              % name, flush=True)
        sys.exit(1)
    return path


def free_port():
    """A loopback port free right now (bound to 0, then released), for programs like
    Prometheus that cannot report the port they picked."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=10.0):
    """(status, body bytes); status 0 when the connection failed."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (urllib.error.URLError, ConnectionError, socket.timeout):
        return 0, b""


def metrics_text(server):
    status, body = http_get("http://127.0.0.1:%d/metrics" % server.metrics_port)
    if status != 200:
        raise RuntimeError("GET /metrics answered %s" % status)
    return body.decode()


def sample_value(text, name, labels=None):
    """Value of the sample `name{labels}` in exposition text (labels: dict that must be a
    subset of the sample's), or None."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if labels and not all('%s="%s"' % kv in label_text for kv in labels.items()):
            continue
        return float(value)
    return None


def poll(fn, timeout, what, interval=0.05):
    """Calls fn() until it returns a truthy value or `timeout` seconds pass; returns the
    last value. Waits between tries on a deadline (not to time anything)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() >= deadline:
            if not value:
                print("poll: gave up waiting for %s after %.0f s" % (what, timeout), flush=True)
            return value
        time.sleep(interval)


def load_json(path):
    with open(path) as f:
        return json.load(f)
