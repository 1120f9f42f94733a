#!/usr/bin/python3
"""The real attention-cli against a real attention-server (demo layer) on a free port.

usage: test_cli_demo.py PATH/TO/attention-server PATH/TO/attention-cli

Checks that the CLI prints "attention output shape [1, 5, 768]" for the seed sentence and
5 attention-weight rows of 5 values that each sum to ~1 (printed with 4 decimals, so the
bound is 5 * 0.5e-4 plus float slack); with --causal --dtype=bfloat16 the rows are
lower-triangular (and sum to 1 within bfloat16 precision); an unknown layer is NOT_FOUND.
`--health` (the image's HEALTHCHECK) prints SERVING and exits 0 against the server, and
exits 1 naming UNAVAILABLE against a closed port; --lb_policy other than pick_first or
round_robin exits 2 naming the flag; the server refuses to start on an unknown
--bf16_kernels, --bf16_attention_kernels or --float32_kernels name. `--version` of both binaries prints
"<program> <version> (revision <rev>)", the version and revision CMake configured
($ATTENTION_EXPECTED_VERSION, "0.1.0 (revision abc1234)").
"""

import os
import re
import socket
import subprocess
import sys

import harness

WORDS = ["time", "flies", "like", "an", "arrow"]


def weight_rows(stdout):
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("attention weights (")),
                 None)
    if start is None:
        return None
    rows = []
    for line in lines[start + 1:]:
        m = re.match(r"\s+(\S+)\s+\[(.*)\]\s*$", line)
        if not m:
            break
        rows.append((m.group(1), [float(v) for v in m.group(2).split(",")]))
    return rows


def run_cli(t, cli, target, *flags, sum_tolerance=5 * 0.5e-4 + 1e-4):
    label = "attention-cli " + " ".join(flags)
    result = subprocess.run([cli, "--target=" + target] + list(flags), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, timeout=120)
    print("$ %s\n%s" % (label, result.stdout), flush=True)
    if not t.check(result.returncode == 0, "%s exited %d: %s" % (label, result.returncode,
                                                                 result.stderr)):
        return None
    t.check(re.search(r"^layer demo-bert-base v\d+ on (cpu|cuda:\d+): ", result.stdout, re.M),
            "%s: the device that answered is not named:\n%s" % (label, result.stdout))
    t.check("attention output shape [1, 5, 768]" in result.stdout,
            "%s: no 'attention output shape [1, 5, 768]' line" % label)
    rows = weight_rows(result.stdout)
    if not t.check(rows is not None and len(rows) == 5, "%s: want 5 weight rows, got %s"
                   % (label, rows)):
        return None
    t.check([w for w, _ in rows] == WORDS, "%s: row labels %s" % (label, [w for w, _ in rows]))
    for word, values in rows:
        t.check(len(values) == 5, "%s: row %s has %d values" % (label, word, len(values)))
        t.check(abs(sum(values) - 1.0) <= sum_tolerance and min(values) >= 0,
                "%s: row %s = %s sums to %.5f, want ~1" % (label, word, values, sum(values)))
    return rows


def run(binary, *flags):
    result = subprocess.run([binary] + list(flags), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, timeout=120)
    print("$ %s %s -> exit %d\n%s%s" % (os.path.basename(binary), " ".join(flags),
                                         result.returncode, result.stdout, result.stderr),
          flush=True)
    return result


def closed_port():
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_version_health_flags(t, server_bin, cli, target):
    expected = os.environ.get("ATTENTION_EXPECTED_VERSION", "")
    t.check(re.fullmatch(r"\d+\.\d+\.\d+ \(revision ([0-9a-f]{4,40}|unknown)\)", expected),
            "ATTENTION_EXPECTED_VERSION=%r is not '<version> (revision <rev>)'" % expected)
    for binary, program in ((server_bin, "attention-server"), (cli, "attention-cli")):
        result = run(binary, "--version")
        t.check(result.returncode == 0 and result.stdout == "%s %s\n" % (program, expected),
                "%s --version: exit %d, printed %r, want %r" % (
                    program, result.returncode, result.stdout, "%s %s\n" % (program, expected)))
    result = run(cli, "--target=" + target, "--health")
    t.check(result.returncode == 0 and result.stdout == "SERVING\n",
            "--health against a serving server: exit %d, stdout %r" % (result.returncode,
                                                                       result.stdout))
    result = run(cli, "--target=127.0.0.1:%d" % closed_port(), "--health")
    t.check(result.returncode == 1 and "UNAVAILABLE" in result.stderr,
            "--health against a closed port: exit %d, stderr %r" % (result.returncode,
                                                                    result.stderr))
    result = run(cli, "--target=" + target, "--lb_policy=random")
    t.check(result.returncode == 2 and "--lb_policy=random" in result.stderr
            and "INVALID_ARGUMENT" in result.stderr,
            "--lb_policy=random: exit %d, stderr %r" % (result.returncode, result.stderr))
    # A kernel name the server does not know stops it at start-up, naming the flag and the
    # names it takes.
    for flag, names in (("--bf16_kernels", "onednn, amx, avx512_bf16, float32"),
                        ("--bf16_attention_kernels", "amx, avx512_bf16, float32"),
                        ("--float32_kernels", "own, onednn")):
        result = run(server_bin, flag + "=tpu", "--listen=127.0.0.1:0")
        t.check(result.returncode == 1 and flag + ":" in result.stderr
                and '"tpu" is not one of ' + names in result.stderr,
                "%s=tpu: exit %d, stderr %r" % (flag, result.returncode, result.stderr[-300:]))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    server_bin, cli = sys.argv[1], sys.argv[2]
    t = harness.Checker("test_cli_demo")
    server = harness.ServerProcess(server_bin, "--compute_threads=2", "--demo_layer").start()
    try:
        run_cli(t, cli, server.target)
        check_version_health_flags(t, server_bin, cli, server.target)
        # bfloat16 weights carry 8 significant bits: each value of ~0.2 is off by up to
        # 2^-11, so 5 of them may miss 1 by 5 * 2^-11 ~ 2.5e-3 (plus the print rounding).
        rows = run_cli(t, cli, server.target, "--causal", "--dtype=bfloat16",
                       sum_tolerance=5 * 2.0 ** -11 + 5 * 0.5e-4)
        if rows:
            for i, (word, values) in enumerate(rows):
                t.check(all(v == 0.0 for v in values[i + 1:]),
                        "--causal: row %s attends to later tokens: %s" % (word, values))
        # A wrong layer name is reported, not crashed on.
        bad = subprocess.run([cli, "--target=" + server.target, "--layer=no-such-layer"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             timeout=120)
        t.check(bad.returncode != 0 and "NOT_FOUND" in bad.stderr,
                "unknown layer: exit %d, stderr %r" % (bad.returncode, bad.stderr))
    except BaseException:
        server.kill()
        raise
    t.finish(server)


if __name__ == "__main__":
    main()
