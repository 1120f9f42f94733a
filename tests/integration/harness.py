"""Shared plumbing of the integration tests: argument parsing, the server process, the
Python client path, and a failure collector (a test prints every failure and exits 1)."""

import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "client", "examples"))

from attention_client.server_process import ServerProcess  # noqa: E402,F401


def server_binary():
    if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
        sys.exit("usage: %s PATH/TO/attention-server [...]" % sys.argv[0])
    return sys.argv[1]


def start_server_on_device(binary, device, *flags):
    """The server with --device=`device` and `flags`, started; a GPU that is not there
    reports SKIPPED and exits 77 (ctest's SKIP_RETURN_CODE)."""
    try:
        return ServerProcess(binary, *flags, "--device=" + device).start()
    except RuntimeError as error:
        if device != "cpu" and "is not available" in str(error):
            print("SKIPPED: device %s is not available here:\n%s" % (device, error))
            sys.exit(77)
        raise


class Checker:
    """Collects failures instead of stopping at the first one."""

    def __init__(self, name):
        self.name = name
        self.failures = []
        self.checks = 0

    def check(self, condition, message):
        self.checks += 1
        if not condition:
            self.failures.append(message)
            print("FAIL: " + message, flush=True)
        return bool(condition)

    def run(self, label, fn, *args, **kwargs):
        """Runs fn; an exception counts as a failure of `label` (with its traceback)."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.check(False, "%s raised:\n%s" % (label, traceback.format_exc()))
            return None

    def finish(self, server=None):
        if server is not None:
            code = server.stop()
            self.check(code == 0, "server exit code after SIGTERM is %s, want 0; stderr:\n%s"
                       % (code, server.stderr_text()[-4000:]))
        if self.failures:
            print("%s: %d of %d checks FAILED" % (self.name, len(self.failures), self.checks))
            sys.exit(1)
        print("%s: all %d checks passed" % (self.name, self.checks))
        sys.exit(0)
