#!/usr/bin/python3
"""deploy/prometheus and deploy/grafana, checked with Debian's promtool.

usage: test_promtool_rules.py

  promtool check rules  deploy/prometheus/attention-service.rules.yml
  promtool test rules   deploy/prometheus/rules_test.yml
  promtool check config deploy/prometheus/prometheus.yml
  promtool check config prometheus-kubernetes.yml with its kubernetes_sd_configs block swapped
                        for a static target (Debian's Prometheus has no Kubernetes discovery)
and that every attention_* metric the rules and the Grafana dashboard use is one that
server/observability/metrics.cc registers, so renaming a metric breaks this test, not a dashboard.
"""

import os
import re
import shutil
import subprocess
import tempfile

import obs

RULES = os.path.join(obs.PROMETHEUS_DIR, "attention-service.rules.yml")
RULES_TEST = os.path.join(obs.PROMETHEUS_DIR, "rules_test.yml")
LOCAL_CONFIG = os.path.join(obs.PROMETHEUS_DIR, "prometheus.yml")
K8S_CONFIG = os.path.join(obs.PROMETHEUS_DIR, "prometheus-kubernetes.yml")
K8S_SD_BLOCK = "    kubernetes_sd_configs:\n      - role: pod\n"
METRIC_NAME = re.compile(r"(?<![\w:])attention_[a-z_]+(?![\w:])")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def promtool(t, *args, cwd=None):
    result = subprocess.run([obs.tool("promtool")] + list(args), cwd=cwd, timeout=120,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = result.stdout.decode(errors="replace")
    print("$ promtool %s\n%s" % (" ".join(args), output.rstrip()), flush=True)
    t.check(result.returncode == 0, "promtool %s exited %d" % (" ".join(args), result.returncode))
    return output


def registered_metrics():
    """Metric family names in server/observability/metrics.cc, with the _bucket/_sum/_count series of the
    histograms."""
    with open(os.path.join(obs.REPO, "server", "observability", "metrics.cc")) as f:
        source = f.read()
    names = set()
    for builder, name in re.findall(r'Build(Counter|Gauge|Histogram)\(\)\s*\.Name\("([^"]+)"\)',
                                    source):
        names.add(name)
        if builder == "Histogram":
            names.update(name + suffix for suffix in HISTOGRAM_SUFFIXES)
    return names


def check_names(t, where, text, known):
    used = set(METRIC_NAME.findall(text))
    t.check(used, "%s uses no attention_* metric" % where)
    unknown = sorted(used - known)
    t.check(not unknown, "%s uses metrics server/observability/metrics.cc does not register: %s"
            % (where, unknown))
    return used


def main():
    t = obs.Checker("test_promtool_rules")
    out = promtool(t, "check", "rules", RULES)
    t.check("SUCCESS" in out, "check rules did not report SUCCESS")
    out = promtool(t, "test", "rules", RULES_TEST, cwd=obs.PROMETHEUS_DIR)
    t.check("SUCCESS" in out and "FAILED" not in out, "test rules did not report SUCCESS")
    promtool(t, "check", "config", LOCAL_CONFIG)

    with open(K8S_CONFIG) as f:
        k8s = f.read()
    if t.check(K8S_SD_BLOCK in k8s, "prometheus-kubernetes.yml has no %r block" % K8S_SD_BLOCK):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "prometheus-kubernetes.yml"), "w") as f:
                f.write(k8s.replace(K8S_SD_BLOCK, '    static_configs:\n'
                                                  '      - targets: ["127.0.0.1:9464"]\n'))
            shutil.copy(RULES, tmp)
            promtool(t, "check", "config", os.path.join(tmp, "prometheus-kubernetes.yml"))

    known = registered_metrics()
    t.check(len(known) >= 20, "found only %d metric names in server/observability/metrics.cc" % len(known))
    with open(RULES) as f:
        check_names(t, "attention-service.rules.yml", f.read(), known | {"up"})

    dashboard = obs.load_json(obs.GRAFANA_DASHBOARD)
    t.check(dashboard.get("uid") == "attention-service", "dashboard uid %r" % dashboard.get("uid"))
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    t.check(len(exprs) >= 15, "dashboard has %d queries" % len(exprs))
    used = check_names(t, "the Grafana dashboard", "\n".join(exprs), known)
    for family in ("attention_request_duration_seconds_bucket", "attention_requests_total",
                   "attention_batch_size_requests_bucket", "attention_batch_size_tokens_bucket",
                   "attention_queue_depth_requests", "attention_in_flight_requests",
                   "attention_queue_duration_seconds_bucket",
                   "attention_compute_duration_seconds_bucket"):
        t.check(family in used, "the dashboard does not show %s" % family)
    t.check(any("histogram_quantile(0.99" in e and "attention_request_duration_seconds_bucket" in e
                for e in exprs), "the dashboard has no p99 from the request histogram")
    t.check(any("by (code)" in e for e in exprs), "the dashboard has no errors-by-code panel")
    ids = [panel["id"] for panel in dashboard["panels"]]
    t.check(len(ids) == len(set(ids)), "dashboard panel ids repeat: %s" % ids)
    t.finish()


if __name__ == "__main__":
    main()
