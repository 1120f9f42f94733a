"""Shared plumbing of the examples: connect to --target, or start --server on a free port."""

import argparse
import contextlib
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

from attention_client import AttentionClient  # noqa: E402
from attention_client.server_process import ServerProcess  # noqa: E402


def parse_args(description, add_arguments=None):
    """--target and --server, plus what `add_arguments(parser)` adds."""
    parser = argparse.ArgumentParser(description=description)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--target", help="host:port of a running attention-server")
    parser.add_argument("--server", default=os.path.join(REPO, "build", "server",
                                                         "attention-server"),
                        help="server binary to start on a free port when --target is not given")
    return parser.parse_args()


@contextlib.contextmanager
def connect(args):
    """Yields an AttentionClient; starts (and afterwards stops) a server if needed."""
    if args.target:
        with AttentionClient(args.target) as client:
            yield client
        return
    if not os.path.exists(args.server):
        sys.exit("no --target and no server binary at %s (build it first)" % args.server)
    with ServerProcess(args.server, "--demo_layer=false", "--compute_threads=2") as server:
        with AttentionClient(server.target) as client:
            yield client


def show(title, service, torch_values, printed=None, decimals=4):
    """Prints the service's values next to PyTorch's (and the seed's printed ones)."""
    service = np.asarray(service, dtype=np.float64)
    torch_values = np.asarray(torch_values, dtype=np.float64)
    print("== %s  (max |service - torch| = %.2e)" % (
        title, float(np.max(np.abs(service - torch_values)))))
    rows_s = service.reshape(-1, service.shape[-1])
    rows_t = torch_values.reshape(-1, torch_values.shape[-1])
    rows_p = None if printed is None else np.asarray(printed).reshape(-1, rows_s.shape[-1])
    fmt = lambda row: "[" + ", ".join("% .*f" % (decimals, v) for v in row[:6]) + (
        ", ..." if len(row) > 6 else "") + "]"
    for i in range(min(len(rows_s), 8)):
        line = "  service %s   torch %s" % (fmt(rows_s[i]), fmt(rows_t[i]))
        if rows_p is not None:
            line += "   printed %s" % fmt(rows_p[i])
        print(line)
    if len(rows_s) > 8:
        print("  ... (%d rows)" % len(rows_s))
    if printed is not None:
        print("  matches the seed's printed values to %d decimals: %s" % (
            decimals, "yes" if matches_printed(service, printed, decimals) else "NO"))


def matches_printed(values, printed, decimals=4):
    """True if `values` print as `printed` with `decimals` decimals (half-unit tolerance,
    plus 1e-6 for float32 values that sit right on a rounding boundary)."""
    values = np.asarray(values, dtype=np.float64)
    printed = np.asarray(printed, dtype=np.float64).reshape(values.shape)
    return bool(np.max(np.abs(values - printed)) <= 0.5 * 10 ** -decimals + 1e-6)
