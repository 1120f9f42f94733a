#!/usr/bin/python3
"""Seconds per GiB of KV to write sessions to --session_snapshot_dir on SIGTERM and to restore
them at start-up (issue 41), against the disk's own sequential write with fsync and read of
the same bytes, measured in the same run. This sizes terminationGracePeriodSeconds
(deploy/overlays/statefulset).

    /usr/bin/python3 bench/session_snapshot.py build/server/attention-server \\
        [--kv_gib 2] [--dir DIR] [--handoff]

Fills the pool with sessions of 1,024 float32 tokens of 64 KV heads x 128 dims (64 MiB each;
wide heads and short contexts keep the prefill's compute small beside the bytes), sends
SIGTERM, reads the server's "wrote ... in S s" line, starts a server with the same replica
name and reads its "restored ... in T" line. DIR should be on the disk a deployment would
use; the default is a temporary directory under build/. With --handoff, the same sessions
are then filled again and handed to a peer replica on this host instead
(--session_handoff_peer): its "handed ... in T" line is the time the sessions answer
SESSION_MOVING (write, transfer over loopback, the peer's spool and adoption).
"""
import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
from attention_client import AttentionClient  # noqa: E402
from attention_client.server_process import ServerProcess  # noqa: E402

HEADS, DIM, TOKENS, CHUNK = 64, 128, 1024, 256
SESSION_BYTES = TOKENS * HEADS * 2 * DIM * 4


def seconds(text):
    """An absl duration as printed ("1.5s", "830ms", "2m3.1s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|us|ns|h|m|s)", text))


def disk_ceiling(directory, size):
    """(write GiB/s with fsync, read GiB/s) of `size` bytes in 1 MiB writes, as the snapshot
    writes them; the read drops the page cache first where this process may."""
    path = os.path.join(directory, "ceiling.bin")
    chunk = os.urandom(1 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = (size / (1 << 30)) / (time.perf_counter() - start)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        pass
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    read = (size / (1 << 30)) / (time.perf_counter() - start)
    os.remove(path)
    return write, read


def fill(client, pool, rng):
    """Sessions of SESSION_BYTES until 95% of a pool of `pool` bytes is taken."""
    for _ in range(int(pool * 0.95) // SESSION_BYTES):
        session = client.create_session(1, HEADS, HEADS, DIM, reserved_tokens=TOKENS).session_id
        for position in range(0, TOKENS, CHUNK):
            q, k, v = (rng.standard_normal((CHUNK, HEADS, DIM), dtype=np.float32)
                       for _ in range(3))
            client.session_step([(session, 0, position, q, k, v)])


def hand_off(binary, flags, pool, rng):
    """(sessions, GiB, seconds) of a full pool handed to a peer on SIGTERM."""
    peer_flags = [flag for flag in flags if not flag.startswith("--replica_name=")]
    peer = ServerProcess(binary, *peer_flags, "--replica_name=bench-1",
                         "--accept_session_handoff").start()
    sender = ServerProcess(binary, *flags, "--session_handoff_peer=" + peer.target,
                           "--session_handoff_linger=0s", "--shutdown_grace_seconds=600").start()
    fill(AttentionClient(sender.target, timeout=600), pool, rng)
    sender.process.send_signal(signal.SIGTERM)
    sender.process.wait(timeout=3600)
    handed = re.search(r"handed (\d+) of \d+ sessions \((\d+) bytes\) .* in (\S+);",
                       sender.stderr_text())
    peer.process.kill()
    peer.process.wait()
    if not handed:
        sys.exit("no 'handed' line:\n" + sender.stderr_text()[-3000:])
    return int(handed.group(1)), int(handed.group(2)) / (1 << 30), seconds(handed.group(3))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server")
    parser.add_argument("--kv_gib", type=float, default=2.0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--handoff", action="store_true",
                        help="also hand a full pool to a peer replica and time it")
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="snapshot-bench-",
                                             dir=os.path.join(HERE, "..", "build"))
    os.makedirs(directory, exist_ok=True)
    pool = int(args.kv_gib * (1 << 30))
    flags = ["--compute_threads=2", "--kv_cache_bytes=%d" % pool, "--replica_name=bench-0",
             "--session_snapshot_dir=" + directory, "--max_session_tokens=%d" % TOKENS]
    server = ServerProcess(args.server, *flags).start()
    client = AttentionClient(server.target, timeout=600)
    rng = np.random.default_rng(0)
    fill(client, pool, rng)
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout=3600)
    wrote = re.search(r"wrote (\d+) sessions \((\d+) KV blocks, (\d+) bytes\) .* in ([\d.]+) s",
                      server.stderr_text())
    if not wrote:
        sys.exit("no 'wrote' line:\n" + server.stderr_text()[-3000:])
    snapshot_gib = int(wrote.group(3)) / (1 << 30)
    write_s = float(wrote.group(4))
    restarted = ServerProcess(args.server, *flags, start_timeout=3600).start()
    restored = re.search(r"restored (\d+) sessions .* in (\S+);", restarted.stderr_text())
    if not restored:
        sys.exit("no 'restored' line:\n" + restarted.stderr_text()[-3000:])
    restore_s = seconds(restored.group(2))
    restarted.process.kill()  # no second snapshot
    restarted.process.wait()
    handoff = hand_off(args.server, flags, pool, rng) if args.handoff else None
    disk_write, disk_read = disk_ceiling(directory, int(wrote.group(3)))
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    print("%s sessions, %.2f GiB snapshot in %s" % (wrote.group(1), snapshot_gib, directory))
    print("write:   %.2f s = %.2f s/GiB (%.2f GiB/s; %.2f of the disk's %.2f GiB/s with fsync)"
          % (write_s, write_s / snapshot_gib, snapshot_gib / write_s,
             snapshot_gib / write_s / disk_write, disk_write))
    print("restore: %.2f s = %.2f s/GiB (%.2f GiB/s; %.2f of the disk's %.2f GiB/s read)"
          % (restore_s, restore_s / snapshot_gib, snapshot_gib / restore_s,
             snapshot_gib / restore_s / disk_read, disk_read))
    if handoff:
        handed, handed_gib, handoff_s = handoff
        print("handoff: %d sessions, %.2f GiB to a peer on this host in %.2f s = %.2f s/GiB "
              "(%.2f x write + restore)" % (handed, handed_gib, handoff_s, handoff_s / handed_gib,
                                            handoff_s / (write_s + restore_s)))


if __name__ == "__main__":
    main()
