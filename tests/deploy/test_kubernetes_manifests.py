#!/usr/bin/python3
"""Renders every kustomization in deploy/ with `kubectl kustomize` and validates it.

usage: test_kubernetes_manifests.py        (ctest: test_kubernetes_manifests)

For each of deploy/kubernetes and every deploy/overlays/*/ (found, not listed, so a new
overlay is covered without editing this file):
  - `kubernetes-validate --strict` against Kubernetes 1.27 (the first with GA gRPC probes,
    which the workload uses) and 1.37 (the newest the pinned package knows), for every
    object with a built-in schema; any unknown field, wrong type or missing required field
    fails. Each object must be reported "passed": a kind without a schema fails too.
  - Prometheus Operator objects (PodMonitor, ServiceMonitor) have no built-in schema: they
    are left out of kubernetes-validate by kind, with the reason printed, and checked here
    instead for the fields the operator requires and for a selector and port that match
    the Deployment and Service they scrape.
  - Cross-object checks no schema makes: each renders one workload, a Deployment (a
    StatefulSet in deploy/overlays/statefulset); Service, PDB, NetworkPolicy and HPA point at
    it; the HPA's custom metric is the one the prometheus-adapter rule serves,
    from a metric server/observability/metrics.cc registers; the memory bounds in the server's flags add
    up to less than the container's memory limit (the arithmetic in deployment.yaml);
    terminationGracePeriodSeconds covers preStop, the drain, the calls' grace and, with
    --session_snapshot_dir, the snapshot's write at SNAPSHOT_SECONDS_PER_GIB.
  - A StatefulSet: its serviceName is a headless Service of its pods, it updates by
    RollingUpdate, --replica_name is the pod's name and --replica_address its stable DNS name
    (Downward API), and --session_snapshot_dir is the mount of a ReadWriteOnce
    volumeClaimTemplate holding at least two snapshots of the whole KV pool.
Before that, the validator is shown to reject a Deployment with an unknown field, so this
test can fail. Runs under the venv of scripts/deploy-venv (re-executes itself there);
exits 77 (ctest: skipped) when kubectl is not installed.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
DEPLOY = os.path.join(REPO, "deploy")
KUBERNETES_VERSIONS = ("1.27.0", "1.37.0")
SKIP = 77

try:
    import yaml  # noqa: F401  (the venv's; Debian's python3 may lack it)
    import kubernetes_validate  # noqa: F401
except ImportError:
    venv = os.environ.get("ATTENTION_DEPLOY_VENV", os.path.join(REPO, "build", "deploy-venv"))
    python = subprocess.run([os.path.join(REPO, "scripts", "deploy-venv"), venv], check=True,
                            stdout=subprocess.PIPE).stdout.decode().strip()
    os.execv(python, [python] + sys.argv)

# Kinds of CRDs kubernetes-validate has no schema for, checked by check_monitor() instead.
MONITOR_KINDS = {"PodMonitor": "podMetricsEndpoints", "ServiceMonitor": "endpoints"}
MIB = 1 << 20
GIB = 1 << 30
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# Overlays whose workload is not the base's Deployment.
EXPECTED_WORKLOAD = {os.path.join("overlays", "statefulset"): "StatefulSet"}
# Disk budget for writing a session snapshot, seconds per GiB of --kv_cache_bytes, as
# deploy/overlays/statefulset's arithmetic (measured 2.8-3.4: docs/benchmarks.md).
SNAPSHOT_SECONDS_PER_GIB = 5
# server/app/main.cc's defaults, for a workload that does not set these flags.
DEFAULT_SHUTDOWN_GRACE_SECONDS = 10.0
DEFAULT_DRAIN_DELAY_SECONDS = 0.0


class Checker:
    def __init__(self, report=True):
        self.failures = 0
        self.report = report

    def check(self, ok, message):
        if not ok:
            self.failures += 1
            if self.report:
                print("FAIL: " + message, flush=True)
        return ok


def kubectl():
    return os.environ.get("KUBECTL") or shutil.which("kubectl")


def render(directory):
    result = subprocess.run([kubectl(), "kustomize", directory], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, timeout=120)
    if result.returncode != 0:
        return None, result.stderr.decode(errors="replace")
    return result.stdout.decode(), ""


def validate(t, where, objects, version):
    """kubernetes-validate --strict on `objects`; each must be reported as passed."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump_all(objects, f)
        f.flush()
        result = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "kubernetes-validate"), "--strict",
             "-k", version, f.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            timeout=300)
    output = result.stdout.decode(errors="replace").replace(f.name, where)
    passed = len(re.findall(r"^INFO .* passed for resource ", output, re.M))
    ok = t.check(result.returncode == 0 and passed == len(objects),
                 "%s: kubernetes-validate --strict -k %s: exit %d, %d of %d objects passed:\n%s"
                 % (where, version, result.returncode, passed, len(objects), output))
    return ok, output


def self_test(t):
    """The validator must reject an unknown field, or every pass below means nothing."""
    broken = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
              "spec": {"selector": {"matchLabels": {"a": "b"}},
                       "template": {"metadata": {"labels": {"a": "b"}},
                                    "spec": {"containers": [{"name": "c", "image": "i",
                                                             "memoryLimit": "1Gi"}]}}}}
    quiet = Checker(report=False)
    ok, output = validate(quiet, "self-test", [broken], KUBERNETES_VERSIONS[0])
    t.check(not ok and "memoryLimit" in output,
            "kubernetes-validate --strict accepted a container with an unknown field:\n"
            + output)
    print("self-test: kubernetes-validate --strict rejects an unknown container field")


def labels_match(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def by_kind(objects, kind):
    return [o for o in objects if o.get("kind") == kind]


def check_monitor(t, where, monitor, deployment, services):
    kind, name = monitor["kind"], monitor.get("metadata", {}).get("name")
    what = "%s: %s/%s" % (where, kind, name)
    t.check(monitor.get("apiVersion") == "monitoring.coreos.com/v1",
            "%s apiVersion %r" % (what, monitor.get("apiVersion")))
    t.check(bool(name), "%s has no metadata.name" % what)
    spec = monitor.get("spec") or {}
    endpoints = spec.get(MONITOR_KINDS[kind])
    if not t.check(isinstance(endpoints, list) and endpoints,
                   "%s has no spec.%s" % (what, MONITOR_KINDS[kind])):
        return
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    pod = deployment["spec"]["template"]
    if kind == "PodMonitor":
        t.check(labels_match(selector, pod["metadata"]["labels"]),
                "%s selector %s does not select the Deployment's pods" % (what, selector))
        ports = {p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        job_source = pod["metadata"]["labels"]
    else:
        selected = [s for s in services if labels_match(selector, s["metadata"]["labels"])]
        t.check(selected, "%s selector %s selects no Service" % (what, selector))
        ports = {p.get("name") for s in selected for p in s["spec"].get("ports", [])}
        job_source = selected[0]["metadata"]["labels"] if selected else {}
    for endpoint in endpoints:
        t.check(endpoint.get("port") in ports,
                "%s endpoint port %r is none of %s" % (what, endpoint.get("port"), sorted(ports)))
        t.check(endpoint.get("path", "/metrics") == "/metrics",
                "%s scrapes %r, the server serves /metrics" % (what, endpoint.get("path")))
    # The alert rules select job="attention-service".
    t.check(job_source.get(spec.get("jobLabel")) == "attention-service",
            "%s jobLabel %r does not give job attention-service" % (what, spec.get("jobLabel")))


def registered_metrics():
    with open(os.path.join(REPO, "server", "observability", "metrics.cc")) as f:
        return set(re.findall(r'\.Name\("(attention_[a-z_]+)"\)', f.read()))


def check_adapter_rule(t, where, hpas):
    """The HPA's Pods metrics must be served by the overlay's prometheus-adapter rule, from a
    metric the server registers."""
    wanted = {m["pods"]["metric"]["name"] for h in hpas for m in h["spec"].get("metrics", [])
              if m.get("type") == "Pods"}
    if not wanted:
        return
    path = os.path.join(DEPLOY, where, "prometheus-adapter-rules.yaml")
    if not t.check(os.path.exists(path), "%s: custom metrics %s but no %s"
                   % (where, sorted(wanted), os.path.relpath(path, REPO))):
        return
    with open(path) as f:
        rules = yaml.safe_load(f)["rules"]
    served = {r["name"]["as"]: r for r in rules}
    known = registered_metrics()
    for metric in sorted(wanted):
        if not t.check(metric in served, "%s: no adapter rule serves %r" % (where, metric)):
            continue
        series = re.match(r"\s*([a-z_:]+)", served[metric]["seriesQuery"]).group(1)
        t.check(series in known, "%s: adapter rule reads %r, which server/observability/metrics.cc does not "
                "register" % (where, series))
        print("  adapter rule: %s <- %s" % (metric, series))


def flag_values(args):
    values = {}
    for arg in args:
        name, _, value = arg.lstrip("-").partition("=")
        values[name] = value
    return values


QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi)?$")


def quantity_bytes(text):
    number, unit = QUANTITY.match(str(text)).groups()
    return int(number) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30}[unit]


def check_memory_budget(t, where, deployment):
    """deployment.yaml's arithmetic: the bounds the flags set must fit the memory limit."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    flags = flag_values(container.get("args", []))
    required = ("batch_workers", "max_request_memory_bytes", "max_queued_bytes",
                "max_message_bytes", "max_weight_bytes", "kv_cache_bytes")
    missing = [f for f in required if f not in flags]
    if not t.check(not missing, "%s: the server's args do not set %s (their defaults do not "
                   "fit the memory limit)" % (where, missing)):
        return
    process, messages_in_flight = 64 * MIB, 4
    peak = (process + int(flags["max_weight_bytes"])
            + int(flags["batch_workers"]) * int(flags["max_request_memory_bytes"])
            + int(flags["max_queued_bytes"])
            + messages_in_flight * int(flags["max_message_bytes"])
            + int(flags["kv_cache_bytes"]))
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    print("  memory: worst case %d MiB of the %d MiB limit" % (peak // MIB, limit // MIB))
    t.check(peak <= limit * 3 // 4, "%s: the server's bounds add up to %d MiB, more than 3/4 "
            "of the %d MiB memory limit" % (where, peak // MIB, limit // MIB))


def check_replica_identity(t, where, workload):
    """Session pinning: --replica_name and --replica_address name the pod through the
    Downward API (the env vars their $(VAR) references must exist, from the pod's fields).
    A Deployment's pods are reached at their IP; a StatefulSet's at their stable DNS name
    <pod>.<serviceName>.<namespace>.svc..., which a replaced pod keeps (its IP changes)."""
    container = workload["spec"]["template"]["spec"]["containers"][0]
    flags = flag_values(container.get("args", []))
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
           for e in container.get("env", [])}
    var = r"\$\((\w+)\)"
    if workload["kind"] == "StatefulSet":
        address = (r"%s\.%s\.%s\.svc(?:\.[a-z0-9.-]+)?(?::\d+)?"
                   % (var, re.escape(workload["spec"].get("serviceName", "")), var))
        fields = ("metadata.name", "metadata.namespace")
    else:
        address, fields = var, ("status.podIP",)
    for flag, pattern, wanted in (("replica_name", var, ("metadata.name",)),
                                  ("replica_address", address, fields)):
        reference = re.fullmatch(pattern, flags.get(flag, ""))
        if not t.check(reference is not None, "%s: --%s=%r is not %s from the Downward API"
                       % (where, flag, flags.get(flag), " / ".join(wanted))):
            continue
        read = list(reference.groups())
        t.check([env.get(v) for v in read] == list(wanted), "%s: --%s reads $(%s), which is "
                "not the pod's %s" % (where, flag, "), $(".join(read), " / ".join(wanted)))


DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)(h|ms|us|ns|m|s)")
DURATION_UNITS = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def duration_seconds(text):
    """An absl::Duration flag's value ("0", "5s", "1m30s") in seconds."""
    if text in ("0", ""):
        return 0.0
    parts = DURATION_PART.findall(text)
    if "".join(n + u for n, u in parts) != text:
        raise ValueError("not a duration: %r" % text)
    return sum(float(n) * DURATION_UNITS[u] for n, u in parts)


def prestop_seconds(container):
    """How long the container's preStop hook holds SIGTERM back (a `sleep N` exec or the
    sleep action)."""
    prestop = container.get("lifecycle", {}).get("preStop", {})
    command = prestop.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0] == "sleep":
        return float(command[1])
    return float(prestop.get("sleep", {}).get("seconds", 0))


def check_termination_grace(t, where, workload):
    """terminationGracePeriodSeconds counts from preStop; the kubelet's SIGKILL must come after
    the drain (--drain_delay), the calls' grace (--shutdown_grace_seconds) and, with
    --session_snapshot_dir, the write of the whole KV pool at SNAPSHOT_SECONDS_PER_GIB."""
    pod = workload["spec"]["template"]["spec"]
    container = pod["containers"][0]
    flags = flag_values(container.get("args", []))
    terms = [("preStop", prestop_seconds(container)),
             ("--drain_delay", duration_seconds(flags["drain_delay"]) if "drain_delay" in flags
              else DEFAULT_DRAIN_DELAY_SECONDS),
             ("--shutdown_grace_seconds", float(flags.get("shutdown_grace_seconds",
                                                          DEFAULT_SHUTDOWN_GRACE_SECONDS)))]
    if "session_snapshot_dir" in flags:
        kv_gib = int(flags.get("kv_cache_bytes", 256 * MIB)) / GIB
        terms.append(("snapshot %.4g GiB x %d s/GiB" % (kv_gib, SNAPSHOT_SECONDS_PER_GIB),
                      kv_gib * SNAPSHOT_SECONDS_PER_GIB))
    needed = sum(seconds for _, seconds in terms)
    grace = pod.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
    print("  termination: %s = %.1f s, terminationGracePeriodSeconds %d"
          % (" + ".join("%s %.1f s" % term for term in terms), needed, grace))
    t.check(grace >= needed, "%s: terminationGracePeriodSeconds %d is less than %s = %.1f s"
            % (where, grace, " + ".join("%s %.1f s" % term for term in terms), needed))


def check_statefulset(t, where, objects, workload):
    """Sessions that outlive a pod: a headless governing Service, rolling updates, and the
    snapshot directory on a per-pod ReadWriteOnce volume large enough for two snapshots of
    the whole pool (one is written beside the last before replacing it)."""
    spec = workload["spec"]
    pod = spec["template"]
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    governing = services.get(spec.get("serviceName"))
    if t.check(governing is not None, "%s: serviceName %r is not a Service of the overlay"
               % (where, spec.get("serviceName"))):
        t.check(governing["spec"].get("clusterIP") == "None"
                and labels_match(governing["spec"]["selector"], pod["metadata"]["labels"]),
                "%s: serviceName %s is not a headless Service of the StatefulSet's pods"
                % (where, spec["serviceName"]))
    t.check(spec.get("updateStrategy", {}).get("type", "RollingUpdate") == "RollingUpdate",
            "%s: updateStrategy %r, not RollingUpdate" % (where, spec.get("updateStrategy")))
    container = pod["spec"]["containers"][0]
    flags = flag_values(container.get("args", []))
    directory = flags.get("session_snapshot_dir")
    if not t.check(bool(directory), "%s: the StatefulSet's server has no --session_snapshot_dir"
                   % where):
        return
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container.get("volumeMounts", [])}
    claims = {c["metadata"]["name"]: c for c in spec.get("volumeClaimTemplates", [])}
    claim = claims.get(mounts.get(directory.rstrip("/")))
    if not t.check(claim is not None, "%s: --session_snapshot_dir=%s is not the mount of a "
                   "volumeClaimTemplate (mounts %s, claims %s)"
                   % (where, directory, sorted(mounts), sorted(claims))):
        return
    t.check(claim["spec"].get("accessModes") == ["ReadWriteOnce"],
            "%s: claim %s has accessModes %s, not ReadWriteOnce"
            % (where, claim["metadata"]["name"], claim["spec"].get("accessModes")))
    storage = quantity_bytes(claim["spec"]["resources"]["requests"]["storage"])
    kv = int(flags.get("kv_cache_bytes", 256 * MIB))
    print("  sessions: --session_snapshot_dir=%s on claim %s, %d MiB for a %d MiB KV pool"
          % (directory, claim["metadata"]["name"], storage // MIB, kv // MIB))
    t.check(storage >= 2 * kv, "%s: claim %s holds %d MiB, less than two snapshots of the "
            "%d MiB KV pool" % (where, claim["metadata"]["name"], storage // MIB, kv // MIB))


def check_references(t, where, objects, workload):
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    kind, name = workload["kind"], workload["metadata"]["name"]
    for service in by_kind(objects, "Service"):
        t.check(labels_match(service["spec"]["selector"], pod_labels),
                "%s: Service %s selects no pod of the %s" % (where, service["metadata"]["name"],
                                                             kind))
    for other in ("PodDisruptionBudget", "NetworkPolicy"):
        for o in by_kind(objects, other):
            selector = o["spec"].get("selector") or o["spec"].get("podSelector")
            t.check(labels_match(selector["matchLabels"], pod_labels),
                    "%s: %s selects no pod of the %s" % (where, other, kind))
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        t.check(target["kind"] == kind and target["name"] == name,
                "%s: HPA scales %s/%s, not the %s" % (where, target["kind"], target["name"],
                                                     kind))
        t.check("replicas" not in workload["spec"],
                "%s: %s sets replicas next to an HPA (apply would reset its choice)"
                % (where, kind))
    check_adapter_rule(t, where, hpas)


def main():
    if not kubectl():
        print("SKIPPED: kubectl is not installed (needed for `kubectl kustomize`)", flush=True)
        return SKIP
    t = Checker()
    self_test(t)
    overlays = ["kubernetes"] + sorted(
        os.path.join("overlays", d) for d in os.listdir(os.path.join(DEPLOY, "overlays"))
        if os.path.exists(os.path.join(DEPLOY, "overlays", d, "kustomization.yaml")))
    for where in overlays:
        print("== deploy/%s" % where, flush=True)
        text, error = render(os.path.join(DEPLOY, where))
        if not t.check(text is not None, "kubectl kustomize deploy/%s: %s" % (where, error)):
            continue
        objects = [o for o in yaml.safe_load_all(text) if o]
        workloads = [o for o in objects if o.get("kind") in WORKLOAD_KINDS]
        if not t.check(len(workloads) == 1, "%s: %d workloads (%s)" % (
                where, len(workloads), ", ".join(o["kind"] for o in workloads))):
            continue
        workload = workloads[0]
        expected = EXPECTED_WORKLOAD.get(where, "Deployment")
        if not t.check(workload["kind"] == expected, "%s: a %s, not a %s" % (
                where, workload["kind"], expected)):
            continue
        monitors = [o for o in objects if o.get("kind") in MONITOR_KINDS]
        for monitor in monitors:
            print("  %s/%s: no built-in schema (Prometheus Operator CRD), left out of "
                  "kubernetes-validate; required fields and selectors checked here"
                  % (monitor["kind"], monitor["metadata"]["name"]))
            check_monitor(t, where, monitor, workload, by_kind(objects, "Service"))
        schema_objects = [o for o in objects if o.get("kind") not in MONITOR_KINDS]
        for version in KUBERNETES_VERSIONS:
            ok, _ = validate(t, "deploy/" + where, schema_objects, version)
            if ok:
                print("  kubernetes %s: %d objects pass --strict (%s)" % (
                    version, len(schema_objects),
                    ", ".join(sorted({o["kind"] for o in schema_objects}))))
        check_references(t, where, objects, workload)
        check_memory_budget(t, where, workload)
        check_replica_identity(t, where, workload)
        check_termination_grace(t, where, workload)
        if workload["kind"] == "StatefulSet":
            check_statefulset(t, where, objects, workload)
    print("%d overlays, %d failures" % (len(overlays), t.failures))
    return 1 if t.failures else 0


if __name__ == "__main__":
    sys.exit(main())
