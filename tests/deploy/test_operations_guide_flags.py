#!/usr/bin/python3
"""Every flag docs/operations.md names exists in the server (issue 42).

usage: test_operations_guide_flags.py PATH/TO/attention-server [PATH/TO/operations.md]

Collects every `--flag_name` the guide writes (the pattern --[a-z0-9_]+, so anything the
guide writes with two dashes counts: a client's or kubectl's options do not belong in it)
and the flags `attention-server --helpfull` defines (absl lists each as a line
"    --name (help...); default: ...", continuation lines indented further). Fails naming every
flag of the guide the server does not define, with its line numbers, and fails when the guide
names no flag at all or the help lists none (a changed help format must not pass silently).
Builds nothing; needs only the server binary.
"""

import collections
import os
import re
import subprocess
import sys

GUIDE_FLAG = re.compile(r"--([a-z0-9_]+)")
# A flag's own line in absl's --helpfull output: four spaces, the flag, its help in parentheses.
HELP_FLAG = re.compile(r"^ {4}--([A-Za-z0-9_]+) \(", re.MULTILINE)


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    server = sys.argv[1]
    guide = (sys.argv[2] if len(sys.argv) == 3 else
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                          "operations.md"))

    named = collections.defaultdict(list)  # flag -> line numbers
    with open(guide, encoding="utf-8") as text:
        for number, line in enumerate(text, start=1):
            for flag in GUIDE_FLAG.findall(line):
                named[flag].append(number)

    # absl exits 1 after printing the help; the output is what counts.
    helped = subprocess.run([server, "--helpfull"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=120)
    defined = set(HELP_FLAG.findall(helped.stdout))

    failures = []
    if not named:
        failures.append("%s names no --flag at all" % guide)
    if not defined:
        failures.append("%s --helpfull listed no flags (exit %d):\n%s"
                        % (server, helped.returncode, helped.stdout[-2000:]))
    elif "listen" not in defined:
        failures.append("%s --helpfull does not list --listen: not the server's help?" % server)
    if defined:
        for flag in sorted(set(named) - defined):
            failures.append("--%s (%s line %s) is not a flag of %s"
                            % (flag, os.path.basename(guide),
                               ", ".join(str(n) for n in named[flag]), server))

    print("%s names %d distinct flags; the server defines %d"
          % (os.path.basename(guide), len(named), len(defined)))
    for failure in failures:
        print("FAIL: " + failure)
    if failures:
        return 1
    print("PASS: every flag the guide names exists in --helpfull")
    return 0


if __name__ == "__main__":
    sys.exit(main())
