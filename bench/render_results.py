#!/usr/bin/python3
"""Writes docs/benchmarks.md from bench/results/*.json and the page's prose,
bench/results/page.md.in, so that a rerun of a benchmark updates the page by editing data.

    /usr/bin/python3 bench/render_results.py            # (re)write docs/benchmarks.md
    /usr/bin/python3 bench/render_results.py --check    # exit 1 if the page is not what
                                                        # the data and template give
    /usr/bin/python3 bench/render_results.py --stdout   # print the page instead

Template: page.md.in is Markdown with placeholders `{{table:NAME}}`, each replaced by the
tables of bench/results/NAME.json. Every JSON file must be placed exactly once.

One JSON file per area (float32_layer.json, bf16_layer.json, ...), an object:

    {
      "section": "NAME",                  # the file's name without .json
      "families": ["Zen 3", "Zen 4"],     # host families this area reports, in FAMILIES;
                                          # one without rows is listed as "not measured yet"
      "rows": [ROW, ...]
    }

ROW, one measured case on one host:

    host_family   one of FAMILIES below
    host          the machine as measured (CPU or GPU model, SIMD level, OpenBLAS kernels)
    case          what ran (shape, context, path)
    result        the measured value: number or string, copied as the run printed it
                  ("201.7", "0.98 / 0.97", "25-27"); optional
    unit          of result ("GFLOPS", "GB/s", "ms"); optional
    ceiling       list of RATIO: ours against a ceiling measured in the same run; optional
    peers         list of RATIO: ours against other implementations in the same run; optional
    date          YYYY-MM-DD of the run
    commit        abbreviated hash of the code measured, or null for "n/a"
    commit_is_entry  true when `commit` is the commit that recorded the run, not one the
                  run named for the measured code (printed with a double dagger)
    command       the exact command that produced the numbers (from the repository root
                  after a build), or null for "n/a" where the run recorded none
    finding       optional: a line or two on what the result explains (a design choice);
                  printed under the family's table, tied to the row by a superscript number

RATIO is {"ratio": "1.03", "of": "ONNX Runtime 1.32"} (printed "1.03 × ONNX Runtime 1.32")
with "computed": true when the ratio was computed from two figures of the same run rather
than printed by the benchmark (printed with a dagger), or {"text": "..."} for a figure
that is no ratio. Values are strings where their printed form matters (trailing zeros,
ranges); numbers are printed as Python prints them.

Python 3 standard library only.
"""
import argparse
import difflib
import json
import os
import re
import sys

FAMILIES = ["Zen 3", "Zen 4", "Zen 5", "Intel with AMX", "H100", "H200"]
REQUIRED = ("host_family", "host", "case", "date", "command")
KNOWN = set(REQUIRED) | {"result", "unit", "ceiling", "peers", "commit", "commit_is_entry",
                         "finding"}
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TEMPLATE = os.path.join(RESULTS, "page.md.in")
PAGE = os.path.join(os.path.dirname(HERE), "docs", "benchmarks.md")
PLACEHOLDER = re.compile(r"\{\{table:([a-z0-9_]+)\}\}")


class DataError(Exception):
    pass


def cell(text):
    """Text safe inside a Markdown table cell (GFM: a pipe is escaped, in code spans too)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def value(v):
    return v if isinstance(v, str) else repr(v)


def ratios(items, where):
    parts = []
    for item in items or []:
        if "text" in item:
            parts.append(item["text"])
        elif "ratio" in item and "of" in item:
            parts.append(f"{value(item['ratio'])}{'†' if item.get('computed') else ''} × "
                         f"{item['of']}")
        else:
            raise DataError(f"{where}: a ratio needs 'ratio' and 'of', or 'text': {item}")
    return "; ".join(parts) if parts else "—"


def check_row(row, where):
    missing = [key for key in REQUIRED if key not in row]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(set(row) - KNOWN)
    if unknown:
        raise DataError(f"{where}: unknown fields {', '.join(unknown)}")
    if row["host_family"] not in FAMILIES:
        raise DataError(f"{where}: host_family {row['host_family']!r} is none of {FAMILIES}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]):
        raise DataError(f"{where}: date {row['date']!r} is not YYYY-MM-DD")
    commit = row.get("commit")
    if commit is not None and not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        raise DataError(f"{where}: commit {commit!r} is not a hash")


def mark_of(n):
    """The mark tying a finding to its row: a superscript number."""
    return "".join("⁰¹²³⁴⁵⁶⁷⁸⁹"[int(digit)] for digit in str(n))


def render_family(family, rows):
    hosts = []
    for row in rows:
        if row["host"] not in hosts:
            hosts.append(row["host"])
    out = [f"**{family}**" + (f": {hosts[0]}." if len(hosts) == 1 else ":")]
    if len(hosts) > 1:
        out += [f"- host {chr(ord('a') + i)}: {host}" for i, host in enumerate(hosts)]
    out += ["",
            "| case | result | against the ceiling | against the peers | date | commit | command |",
            "|---|---|---|---|---|---|---|"]
    findings = []
    for i, row in enumerate(rows):
        where = f"{family} row {i + 1}"
        case = row["case"]
        if len(hosts) > 1:
            case += f" (host {chr(ord('a') + hosts.index(row['host']))})"
        if row.get("finding"):
            mark = mark_of(len(findings) + 1)
            case += f" {mark}"
            findings.append(f"- {mark} {row['finding']}")
        result = "—"
        if "result" in row:
            result = value(row["result"]) + (f" {row['unit']}" if row.get("unit") else "")
        commit = row.get("commit")
        commit = "n/a" if commit is None else f"`{commit}`" + ("‡" if row.get("commit_is_entry")
                                                               else "")
        out.append("| " + " | ".join(cell(c) for c in (
            case, result, ratios(row.get("ceiling"), where), ratios(row.get("peers"), where),
            row["date"], commit,
            "n/a" if row["command"] is None else f"`{row['command']}`")) + " |")
    if findings:
        out += [""] + findings
    return out


def render_section(name):
    path = os.path.join(RESULTS, name + ".json")
    if not os.path.exists(path):
        raise DataError(f"{{{{table:{name}}}}}: no {os.path.relpath(path)}")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("section") != name:
        raise DataError(f"{path}: section is {data.get('section')!r}, not {name!r}")
    families = data.get("families", [])
    for family in families:
        if family not in FAMILIES:
            raise DataError(f"{path}: family {family!r} is none of {FAMILIES}")
    by_family = {family: [] for family in FAMILIES}
    for i, row in enumerate(data.get("rows", [])):
        check_row(row, f"{path} row {i + 1}")
        if row["host_family"] not in families:
            raise DataError(f"{path} row {i + 1}: {row['host_family']} is not in families")
        by_family[row["host_family"]].append(row)
    out, missing = [], []
    for family in [f for f in FAMILIES if f in families]:
        if by_family[family]:
            out += render_family(family, by_family[family]) + [""]
        else:
            missing.append(family)
    if missing:
        out.append(f"Not measured yet: {', '.join(missing)}.")
    else:
        while out and out[-1] == "":
            out.pop()
    return "\n".join(out)


def render():
    with open(TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    names = PLACEHOLDER.findall(template)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DataError(f"{TEMPLATE}: placed more than once: {', '.join(duplicates)}")
    files = sorted(f[:-5] for f in os.listdir(RESULTS) if f.endswith(".json"))
    unplaced = [f for f in files if f not in names]
    if unplaced:
        raise DataError(f"{TEMPLATE}: no {{{{table:...}}}} for {', '.join(unplaced)}")
    return PLACEHOLDER.sub(lambda m: render_section(m.group(1)), template)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if docs/benchmarks.md differs from what would be written")
    mode.add_argument("--stdout", action="store_true", help="print the page")
    parser.add_argument("--page", default=PAGE, help="the page to write or check")
    args = parser.parse_args()
    try:
        page = render()
    except (DataError, ValueError, OSError) as error:  # json.JSONDecodeError is a ValueError
        print(f"render_results.py: {error}", file=sys.stderr)
        return 2
    if args.stdout:
        sys.stdout.write(page)
        return 0
    if args.check:
        try:
            with open(args.page, encoding="utf-8") as f:
                current = f.read()
        except OSError as error:
            print(f"render_results.py: {error}", file=sys.stderr)
            return 1
        if current == page:
            return 0
        sys.stdout.writelines(difflib.unified_diff(
            current.splitlines(True), page.splitlines(True), args.page, "generated", n=1))
        print(f"\n{args.page} is not what bench/results/ gives: run "
              "/usr/bin/python3 bench/render_results.py and commit the page with the data.",
              file=sys.stderr)
        return 1
    with open(args.page, "w", encoding="utf-8") as f:
        f.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
