"""Starts an attention-server binary on a free loopback port (for tests and examples), and
makes throwaway TLS certificates for it (make_test_certificates).

    with ServerProcess("build/server/attention-server", "--compute_threads=2") as server:
        client = AttentionClient(server.target)
    # leaving the block sends SIGTERM; server.returncode holds the exit code

The port is read from the server's "attention-service listening on port N" line, polled
with select() and a deadline; nothing here sleeps. Every port the server opens is bound to
0: when the binary has a --metrics_listen flag, the metrics endpoint gets 127.0.0.1:0 too
(unless the caller passes its own --metrics_listen), and server.metrics_port is read from
the "attention-service metrics on port M" line.
"""

import os
import re
import select
import signal
import subprocess
import tempfile
import time


def make_test_certificates(directory):
    """A CA (ca.pem), a server certificate for 127.0.0.1 / localhost (server.pem, server.key)
    and a client certificate (client.pem, client.key) in `directory`, made by the openssl
    command. Returns a function file name -> path. For tests only: the keys are not secret."""
    def run(command):
        subprocess.run(command, shell=True, check=True, cwd=directory,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    run("printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > san.ext")
    run("openssl req -x509 %s -days 2 -subj /CN=ca -keyout ca.key -out ca.pem" % ec)
    for name in ("server", "client"):
        run("openssl req %s -subj /CN=%s -keyout %s.key -out %s.csr" % (ec, name, name, name))
        run("openssl x509 -req -in %s.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
            "-extfile san.ext -out %s.pem" % (name, name))
    return lambda name: os.path.join(directory, name)


_PORT_LINE = re.compile(rb"attention-service listening on port (\d+)")
_METRICS_LINE = re.compile(rb"attention-service metrics on port (\d+)")


class ServerProcess:
    def __init__(self, binary, *flags, listen="127.0.0.1:0", start_timeout=60.0):
        self.binary = binary
        self.flags = list(flags)
        self.listen = listen
        self.start_timeout = start_timeout
        self.process = None
        self.port = None
        self.metrics_port = None  # /metrics port, when --metrics_listen is set
        self.returncode = None
        self._stderr = None

    @property
    def target(self):
        return "127.0.0.1:%d" % self.port

    def _extra_flags(self):
        if any(f.startswith("--metrics_listen") for f in self.flags):
            return []
        try:
            help_text = subprocess.run([self.binary, "--helpfull"], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return ["--metrics_listen=127.0.0.1:0"] if b"metrics_listen" in help_text else []

    def start(self):
        self._stderr = tempfile.TemporaryFile()
        args = [self.binary, "--listen=" + self.listen] + self._extra_flags() + self.flags
        # The metrics line follows the port line when a /metrics address is given.
        metrics_flags = [a for a in args if a.startswith("--metrics_listen=")]
        expect_metrics = bool(metrics_flags) and metrics_flags[-1] not in (
            "--metrics_listen=", '--metrics_listen=""', "--metrics_listen=''")
        self.process = subprocess.Popen(args,
                                        stdout=subprocess.PIPE, stderr=self._stderr)
        deadline = time.monotonic() + self.start_timeout
        fd = self.process.stdout.fileno()
        seen = b""
        while True:
            match = _PORT_LINE.search(seen)
            if match and b"\n" in seen[match.end():]:
                self.port = int(match.group(1))
                metrics = _METRICS_LINE.search(seen)
                if metrics and b"\n" in seen[metrics.end():]:
                    self.metrics_port = int(metrics.group(1))
                if self.metrics_port is not None or not expect_metrics:
                    return self
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise RuntimeError("server did not print its port within %.0f s; stderr:\n%s"
                                   % (self.start_timeout, self.stderr_text()))
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = self.process.wait()
                    raise RuntimeError("server exited with %s before listening; stderr:\n%s"
                                       % (code, self.stderr_text()))
                seen += chunk

    def stderr_text(self):
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def stop(self, timeout=60.0):
        """SIGTERM, wait for exit, return the exit code."""
        if self.process is None:
            return self.returncode
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError("server did not exit within %.0f s of SIGTERM" % timeout)
        self.process.stdout.close()
        return self.returncode

    def kill(self):
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.returncode = self.process.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            # Keep the original error; still do not leave the server running.
            try:
                self.stop()
            except Exception:
                self.kill()
            return False
        self.stop()
        return False
