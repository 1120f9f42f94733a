#!/usr/bin/python3
"""The documents cite only what exists (issue 56): every repository path, flag and metric name
that README.md, docs/, client/python/README.md and deploy/ cite must be in the tree or the code.

usage: test_documents_cite_what_exists.py SERVER CLI LOADGEN

- Paths: a word starting with one of the top-level folders (core/, server/, client/, proto/,
  tests/, bench/, scripts/, docs/, deploy/) must name a file or folder of the repository (one
  with * or {} must match one by glob). Build outputs are cited as build/..., not checked.
- Flags: a flag cited on its own in backticks (`--name` or `--name=value`) must be one that
  SERVER, CLI or LOADGEN define (their --helpfull), one of absl's own, or one that a script or
  benchmark of the repository defines (a "--name" string literal in bench/, scripts/, tests/
  or client/, or an ABSL_FLAG there).
  Flags inside longer commands belong to their tools (kubectl, protoc, pip) and are not read.
- Metrics: a name attention_... must be a metric the server defines (a string literal in
  server/ or core/), one of its histogram series (_bucket, _sum, _count), a prefix of those
  when it ends in _ (attention_inline_layer_cache_*), or a name deploy/ defines from them (a
  recording rule, a prometheus-adapter `as:`); NOT_METRICS lists the words of that shape
  that are no metric.

Fails naming each citation and where it is. Builds nothing.
"""

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = re.compile(r"(?<![\w./@-])((?:core|server|client|proto|tests|bench|scripts|docs|deploy)/"
                  r"[A-Za-z0-9_./*{}-]*[A-Za-z0-9_*}/])")
ALONE_FLAG = re.compile(r"`--([a-z][a-z0-9_]*)(?:=[^`\s]*)?`")
METRIC = re.compile(r"\b(attention_[a-z0-9_]+)\b")
HELP_FLAG = re.compile(r"^ {4}--([A-Za-z0-9_]+) \(", re.MULTILINE)
SCRIPT_FLAG = re.compile(r"""["'](?:--)([a-z][a-z0-9_-]*)["'=]""")
ABSL_FLAGS = {"help", "helpfull", "helpshort", "helppackage", "helpon", "helpmatch", "version",
              "only_check_args", "flagfile", "fromenv", "tryfromenv", "undefok"}
# Words of the same shape that are no metrics: the Python client's package, the benchmark
# binary, and Hugging Face's argument.
NOT_METRICS = {"attention_client", "attention_bench", "attention_mask"}


def documents():
    names = ["README.md", "client/python/README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))
    for pattern in ("deploy/**/*.md", "deploy/**/*.yaml", "deploy/**/*.yml", "deploy/**/*.json"):
        names += sorted(glob.glob(pattern, root_dir=ROOT, recursive=True))
    return names


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8", errors="replace") as f:
        return f.read()


def sources(patterns):
    text = []
    for pattern in patterns:
        for name in glob.glob(pattern, root_dir=ROOT, recursive=True):
            if os.path.isfile(os.path.join(ROOT, name)):
                text.append(read(name))
    return "\n".join(text)


def path_exists(cited):
    cited = cited.rstrip("/.")
    if any(c in cited for c in "*{"):
        pattern = re.sub(r"\{[^}]*\}", "*", cited)
        return bool(glob.glob(pattern, root_dir=ROOT))
    return os.path.exists(os.path.join(ROOT, cited))


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    known_flags = set(ABSL_FLAGS)
    for binary in sys.argv[1:]:
        helpfull = subprocess.run([binary, "--helpfull"], capture_output=True, text=True).stdout
        found = set(HELP_FLAG.findall(helpfull))
        if not found:
            print(f"{binary} --helpfull lists no flag", file=sys.stderr)
            return 1
        known_flags |= found
    known_flags |= set(SCRIPT_FLAG.findall(sources(
        ["bench/**/*.py", "bench/**/*.sh", "scripts/*", "tests/**/*.py", "client/**/*.py"])))
    known_flags |= set(re.findall(r"ABSL_FLAG\([^,]+,\s*([a-z0-9_]+)",
                                  sources(["bench/**/*.cc", "tests/**/*.cc", "client/**/*.cc"])))
    code = sources(["server/**/*.cc", "server/**/*.h", "core/**/*.cc", "core/**/*.h"])
    deploy = sources(["deploy/**/*.yml", "deploy/**/*.yaml"])
    recorded = set(re.findall(r"record:\s*\S*?(attention_[a-z0-9_]+)", deploy))
    recorded |= set(re.findall(r"""\bas:\s*["']?(attention_[a-z0-9_]+)""", deploy))
    defined = set(re.findall(r'"(attention_[a-z0-9_]+)"', code))

    def metric_exists(name):
        if name in NOT_METRICS or name in recorded:
            return True
        if name.endswith("_"):
            return any(metric.startswith(name) for metric in defined)
        return name in defined or re.sub(r"_(bucket|sum|count)$", "", name) in defined

    problems = []
    for name in documents():
        for number, line in enumerate(read(name).splitlines(), start=1):
            for cited in PATH.findall(line):
                if not path_exists(cited):
                    problems.append(f"{name}:{number}: path {cited} is not in the repository")
            for flag in ALONE_FLAG.findall(line):
                if flag not in known_flags:
                    problems.append(f"{name}:{number}: flag --{flag} is defined nowhere")
            for metric in METRIC.findall(line):
                if not metric_exists(metric):
                    problems.append(f"{name}:{number}: metric {metric} is not the server's")
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(documents())} documents read, {len(problems)} citations of what does not exist")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
