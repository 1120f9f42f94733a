"""Generates the Python protobuf / gRPC stubs of the wire API into a cache directory.

The stubs are produced with `protoc` and Debian's `grpc_python_plugin` (no grpcio-tools
needed) from the .proto files of this repository, into

    $ATTENTION_CLIENT_CACHE / <sha256 of the proto files>     (when the variable is set)
    $XDG_CACHE_HOME/attention-client/<hash> or ~/.cache/attention-client/<hash> otherwise

so a fresh clone works without a build step and an edited .proto gets fresh stubs.
Generation is atomic (generated in a temporary directory, then renamed), so concurrent
processes can share the cache.
"""

import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

_PROTO_FILES = ("attention/v1/attention.proto", "grpc/health/v1/health.proto")
_DEFAULT_PROTO_DIR = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "proto"))

_loaded = None


def proto_dir():
    """Directory holding attention/v1/attention.proto ($ATTENTION_PROTO_DIR overrides)."""
    return os.environ.get("ATTENTION_PROTO_DIR", _DEFAULT_PROTO_DIR)


def cache_root():
    explicit = os.environ.get("ATTENTION_CLIENT_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attention-client")


def _digest(src):
    h = hashlib.sha256()
    for name in _PROTO_FILES:
        with open(os.path.join(src, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def generate(out_root=None, src=None):
    """Generates the stubs (if not cached yet) and returns the directory holding them."""
    src = src or proto_dir()
    for name in _PROTO_FILES:
        if not os.path.isfile(os.path.join(src, name)):
            raise FileNotFoundError(
                "attention_client: %s not found under %s (set ATTENTION_PROTO_DIR)" % (name, src))
    out_root = out_root or cache_root()
    final = os.path.join(out_root, _digest(src))
    if os.path.isfile(os.path.join(final, "attention", "v1", "attention_pb2_grpc.py")):
        return final
    os.makedirs(out_root, exist_ok=True)
    protoc = shutil.which("protoc") or "/usr/bin/protoc"
    plugin = (os.environ.get("GRPC_PYTHON_PLUGIN") or shutil.which("grpc_python_plugin")
              or "/usr/bin/grpc_python_plugin")
    tmp = tempfile.mkdtemp(prefix=".gen-", dir=out_root)
    try:
        cmd = [protoc, "--python_out=" + tmp, "--grpc_out=" + tmp,
               "--plugin=protoc-gen-grpc=" + plugin, "-I", src] + list(_PROTO_FILES)
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise RuntimeError("attention_client: %s failed:\n%s" % (" ".join(cmd), result.stderr))
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process won the race; its stubs are identical.
            if not os.path.isdir(final):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load():
    """Returns (attention_pb2, attention_pb2_grpc, health_pb2), generating them if needed."""
    global _loaded
    if _loaded is not None:
        return _loaded
    root = generate()
    if root not in sys.path:
        sys.path.insert(0, root)
    pb2 = importlib.import_module("attention.v1.attention_pb2")
    pb2_grpc = importlib.import_module("attention.v1.attention_pb2_grpc")
    # The health stubs live under a top-level "grpc" directory, which the real grpc package
    # shadows; load the message module from its file under a private name instead.
    path = os.path.join(root, "grpc", "health", "v1", "health_pb2.py")
    spec = importlib.util.spec_from_file_location("attention_client._health_pb2", path)
    health_pb2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(health_pb2)
    _loaded = (pb2, pb2_grpc, health_pb2)
    return _loaded


if __name__ == "__main__":
    print(generate(*sys.argv[1:2]))
