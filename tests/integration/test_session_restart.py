#!/usr/bin/python3
"""Sessions through restarts, with real processes (issue 41):

1. 16 sessions decode one token per step from 2 client threads while the server is sent
   SIGTERM twice mid-step and restarted on the same port each time (--session_snapshot_dir,
   the same --replica_name). The Python client waits and retries through each restart: no
   call fails, no session is lost, and every answer holds FlashAttention's rule against a
   fresh local reference (float64 oracle, float32 numpy loop).
2. SIGKILL writes nothing: the next server has none of the sessions (SESSION_UNKNOWN).
3. A snapshot corrupted on purpose in 5 ways is refused at start-up with a log line, kept
   as .refused, and the server serves new sessions.
4. Live handoff: the same 16 sessions decode on a replica started with
   --session_handoff_peer; it is sent SIGTERM mid-step and not restarted. It hands every
   session to its peer (--accept_session_handoff), whose answers the clients follow
   (WRONG_REPLICA naming the peer's address): no call fails, nothing waits for a restart,
   every answer holds the rule, and the peer holds all 16 sessions. Restarted, the drained
   replica still sends fresh clients (blocking and asyncio) on to the peer.

usage: test_session_restart.py PATH/TO/attention-server
"""
import asyncio
import os
import random
import re
import shutil
import signal
import tempfile
import threading

import numpy as np

import harness
from attention_client import AttentionClient, SessionError

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 32
SESSIONS, THREADS, TOKENS = 16, 2, 48
REPLICA = "attention-0"


def server_flags(snapshot_dir):
    return ["--compute_threads=2", "--kv_cache_bytes=%d" % (64 << 20),
            "--replica_name=" + REPLICA, "--session_snapshot_dir=" + snapshot_dir]


def reference(q, k, v, dtype):
    """Causal attention of every token in `dtype`: q [T, H, d], k and v [T, Hkv, d]."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.astype(dtype), np.repeat(k, group, 1).astype(dtype), np.repeat(v, group, 1).astype(dtype)
    scores = np.einsum("ihd,jhd->hij", q, k) / dtype(np.sqrt(q.shape[-1]))
    scores = np.where(np.tril(np.ones(scores.shape[1:], dtype=bool)), scores, dtype(-np.inf))
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("hij,jhd->ihd", p / p.sum(axis=-1, keepdims=True), v)


def check_answers(decoder, sessions, tokens, check, t, label):
    """Every session holds TOKENS tokens on `check`'s server, and every answer the decoder
    got holds FlashAttention's rule; returns the worst error / bound."""
    worst = 0.0
    for session in sessions:
        try:
            length = check.get_session(session).length
        except SessionError as error:
            t.check(False, "%s: session %s lost: %s %s"
                    % (label, session, error.reason, error.details()))
            continue
        t.check(length == TOKENS, "%s: session %s holds %d tokens, want %d"
                % (label, session, length, TOKENS))
        q, k, v = tokens[session]
        for layer in range(LAYERS):
            if any(a is None for a in decoder.answers[session][layer]):
                continue  # counted by the caller
            ours = np.stack(decoder.answers[session][layer]).astype(np.float64)
            oracle = reference(q[layer], k[layer], v[layer], np.float64)
            plain = reference(q[layer], k[layer], v[layer], np.float32).astype(np.float64)
            bound = 2 * np.max(np.abs(plain - oracle)) + 1e-6 * np.max(np.abs(oracle))
            error = np.max(np.abs(ours - oracle))
            worst = max(worst, error / bound)
            t.check(error <= bound, "%s: session %s layer %d: max|ours - fp64| = %.3g > %.3g "
                    "(2 x max|numpy fp32 - fp64| + 1e-6 x max|fp64|)"
                    % (label, session, layer, error, bound))
    return worst


def new_sessions(client, rng):
    """SESSIONS sessions on `client`'s server, and each one's random Q, K and V."""
    sessions, tokens = [], {}
    for _ in range(SESSIONS):
        info = client.create_session(LAYERS, HEADS, KV_HEADS, HEAD_DIM, reserved_tokens=TOKENS)
        sessions.append(info.session_id)
        tokens[info.session_id] = tuple(
            [rng.normal(size=(TOKENS, heads, HEAD_DIM)).astype(np.float32) for _ in range(LAYERS)]
            for heads in (HEADS, KV_HEADS, KV_HEADS))
    return sessions, tokens


class Decoder:
    """The client threads: each steps its sessions one token at a time, round robin."""

    def __init__(self, target, sessions, tokens):
        self.clients = [AttentionClient(target, timeout=120.0) for _ in range(THREADS)]
        self.sessions, self.tokens = sessions, tokens
        self.answers = {s: [[None] * TOKENS for _ in range(LAYERS)] for s in sessions}
        self.errors = []
        self.steps = 0
        self.lock = threading.Lock()
        self.progress = threading.Condition(self.lock)

    def run(self, index):
        client, mine = self.clients[index], self.sessions[index::THREADS]
        for position in range(TOKENS):
            for session in mine:
                q, k, v = self.tokens[session]
                entries = [(session, layer, position, q[layer][position:position + 1],
                            k[layer][position:position + 1], v[layer][position:position + 1])
                           for layer in range(LAYERS)]
                try:
                    outputs = client.session_step(entries)
                except Exception as error:  # noqa: BLE001 -- every failure is the finding
                    with self.lock:
                        self.errors.append("%s at %d: %r" % (session, position, error))
                    return
                with self.progress:
                    for layer, output in enumerate(outputs):
                        self.answers[session][layer][position] = output[0]
                    self.steps += 1
                    self.progress.notify_all()

    def wait_for_steps(self, steps):
        with self.progress:
            self.progress.wait_for(lambda: self.steps >= steps or self.errors, timeout=300)


def restart(binary, server, snapshot_dir, t, label):
    """SIGTERM `server` (mid-step: the decoders keep sending), then a new one on its port."""
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=120)
    log = server.stderr_text()
    t.check(code == 0, "%s: exit code %s after SIGTERM; stderr:\n%s" % (label, code, log[-3000:]))
    t.check(re.search(r"wrote %d sessions" % SESSIONS, log),
            "%s: no 'wrote %d sessions' line; stderr:\n%s" % (label, SESSIONS, log[-3000:]))
    following = harness.ServerProcess(binary, *server_flags(snapshot_dir),
                                      listen="127.0.0.1:%d" % server.port).start()
    log = following.stderr_text()
    t.check(re.search(r"restored %d sessions .* 0 left out" % SESSIONS, log),
            "%s: no 'restored %d sessions' line; stderr:\n%s" % (label, SESSIONS, log[-3000:]))
    t.check(not os.path.exists(os.path.join(snapshot_dir, REPLICA + ".kvsnap")),
            "%s: the snapshot is still there after it was restored" % label)
    return following


def decode_through_two_restarts(binary, snapshot_dir, t, seed):
    rng = np.random.default_rng(seed)
    server = harness.ServerProcess(binary, *server_flags(snapshot_dir)).start()
    sessions, tokens = new_sessions(AttentionClient(server.target), rng)
    decoder = Decoder(server.target, sessions, tokens)
    threads = [threading.Thread(target=decoder.run, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    total = SESSIONS * TOKENS
    for label, at in (("first restart", total // 3), ("second restart", 2 * total // 3)):
        decoder.wait_for_steps(at)
        server = restart(binary, server, snapshot_dir, t, label)
    for thread in threads:
        thread.join(timeout=600)
    t.check(not decoder.errors, "calls failed through the restarts: %s" % decoder.errors[:4])
    t.check(decoder.steps == total, "%d of %d steps answered" % (decoder.steps, total))
    # No session lost, and every answer within the rule.
    worst = check_answers(decoder, sessions, tokens, AttentionClient(server.target), t,
                          "restarts")
    print("16 sessions x %d tokens through 2 restarts; worst error / bound %.3f" % (TOKENS, worst))
    return server, sessions[0]


def sigkill_loses_the_sessions(binary, server, snapshot_dir, session, t):
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=60)
    t.check(not os.path.exists(os.path.join(snapshot_dir, REPLICA + ".kvsnap")),
            "SIGKILL left a snapshot behind")
    following = harness.ServerProcess(binary, *server_flags(snapshot_dir),
                                      listen="127.0.0.1:%d" % server.port).start()
    t.check("no session snapshot" in following.stderr_text(),
            "after SIGKILL the server did not say it starts empty:\n%s"
            % following.stderr_text()[-2000:])
    try:
        AttentionClient(following.target).get_session(session)
        t.check(False, "session %s answered after SIGKILL" % session)
    except SessionError as error:
        t.check(error.reason == "SESSION_UNKNOWN",
                "after SIGKILL: %s %s, want SESSION_UNKNOWN" % (error.reason, error.details()))
    return following


def corrupt_snapshots_are_refused(binary, server, snapshot_dir, t, seed):
    """One good snapshot, then five corruptions of it, each at a fresh start-up."""
    client = AttentionClient(server.target)
    info = client.create_session(LAYERS, HEADS, KV_HEADS, HEAD_DIM, reserved_tokens=8)
    q = np.random.default_rng(seed).normal(size=(4, HEADS, HEAD_DIM)).astype(np.float32)
    kv = q[:, :KV_HEADS]
    client.session_step([(info.session_id, layer, 0, q, kv, kv) for layer in range(LAYERS)])
    t.check(server.stop() == 0, "server exit code after SIGTERM")
    path = os.path.join(snapshot_dir, REPLICA + ".kvsnap")
    with open(path, "rb") as f:
        good = f.read()
    flip = random.Random(seed).randrange(100, len(good) - 100)

    def flipped(offset):
        bad = bytearray(good)
        bad[offset] ^= 0x01
        return bytes(bad)
    corruptions = [
        ("cut short", good[:len(good) // 2], "ends inside"),
        ("one bit flipped at byte %d" % flip, flipped(flip), "does not match its SHA-256"),
        ("an older format version", good[:8] + b"\0\0\0\0" + good[12:], "format version 0"),
        ("bytes past the trailer", good + b"\0" * 64, "past its trailer"),
        ("not a snapshot", b"\0" * 4096, "not a session snapshot"),
    ]
    for name, data, says in corruptions:
        with open(path, "wb") as f:
            f.write(data)
        started = harness.ServerProcess(binary, *server_flags(snapshot_dir)).start()
        log = started.stderr_text()
        t.check(re.search(r"session snapshot .* refused \(.*%s" % re.escape(says), log),
                "%s: no refusal saying %r at start-up:\n%s" % (name, says, log[-2000:]))
        t.check(os.path.exists(path + ".refused") and not os.path.exists(path),
                "%s: the refused file was not kept aside as .refused" % name)
        fresh = AttentionClient(started.target)
        try:
            fresh.get_session(info.session_id)
            t.check(False, "%s: a session came back from a corrupt snapshot" % name)
        except SessionError as error:
            t.check(error.reason == "SESSION_UNKNOWN", "%s: %s" % (name, error.reason))
        new = fresh.create_session(LAYERS, HEADS, KV_HEADS, HEAD_DIM, reserved_tokens=8)
        out = fresh.session_step([(new.session_id, 0, 0, q, kv, kv)])
        t.check(out[0].shape == (4, HEADS, HEAD_DIM), "%s: the server does not serve" % name)
        started.process.send_signal(signal.SIGKILL)  # no snapshot of its own over the next
        started.process.wait(timeout=60)
        os.remove(path + ".refused")


async def read_through_async(target, session):
    from attention_client.aio import AsyncAttentionClient
    async with AsyncAttentionClient(target) as client:
        return await client.get_session(session)


def hand_off_to_a_peer(binary, snapshot_dir, t, seed):
    """Replica attention-0 decodes, is drained with SIGTERM mid-step and hands its sessions to
    attention-1, which the clients follow; attention-0 is never restarted."""
    rng = np.random.default_rng(seed + 1)
    common = ["--compute_threads=1", "--kv_cache_bytes=%d" % (64 << 20),
              "--replica_address=127.0.0.1"]
    peer = harness.ServerProcess(binary, *common, "--replica_name=attention-1",
                                 "--accept_session_handoff").start()
    # The linger outlasts any client's next call: each of the 2 threads steps without pause.
    draining_flags = common + ["--replica_name=" + REPLICA, "--session_snapshot_dir=" + snapshot_dir]
    draining = harness.ServerProcess(binary, *draining_flags,
                                     "--session_handoff_peer=" + peer.target,
                                     "--session_handoff_linger=10s").start()
    try:
        sessions, tokens = new_sessions(AttentionClient(draining.target), rng)
        decoder = Decoder(draining.target, sessions, tokens)
        threads = [threading.Thread(target=decoder.run, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        decoder.wait_for_steps(SESSIONS * TOKENS // 2)
        draining.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=600)
        code = draining.process.wait(timeout=120)
        log = draining.stderr_text()
        t.check(code == 0, "handoff: exit code %s after SIGTERM; stderr:\n%s" % (code, log[-3000:]))
        t.check(re.search(r"handed %d of %d sessions .* to replica \"attention-1\"" % (SESSIONS, SESSIONS), log),
                "handoff: no 'handed %d of %d sessions' line; stderr:\n%s"
                % (SESSIONS, SESSIONS, log[-3000:]))
        t.check(not decoder.errors, "handoff: calls failed: %s" % decoder.errors[:4])
        total = SESSIONS * TOKENS
        t.check(decoder.steps == total, "handoff: %d of %d steps answered" % (decoder.steps, total))
        worst = check_answers(decoder, sessions, tokens, AttentionClient(peer.target), t,
                              "handoff")
        holder = AttentionClient(peer.target)
        t.check(all(holder.get_session(s).replica == "attention-1" for s in sessions),
                "handoff: the peer does not name itself as the holder")
        print("16 sessions x %d tokens handed to a peer mid-decode; worst error / bound %.3f"
              % (TOKENS, worst))
        # The drained replica, restarted on its port, remembers where its sessions went.
        draining = harness.ServerProcess(binary, *draining_flags,
                                         listen="127.0.0.1:%d" % draining.port).start()
        t.check(AttentionClient(draining.target).get_session(sessions[0]).length == TOKENS,
                "handoff: a fresh client of the restarted replica did not reach the peer")
        t.check(asyncio.run(read_through_async(draining.target, sessions[1])).length == TOKENS,
                "handoff: a fresh asyncio client of the restarted replica did not reach the peer")
    finally:
        if draining.process.poll() is None:
            draining.process.kill()
        t.check(peer.stop() == 0, "handoff: the peer's exit code after SIGTERM")


def main():
    binary = harness.server_binary()
    seed = int(os.environ.get("ATTENTION_TEST_SEED", "4141"))
    print("seed %d (ATTENTION_TEST_SEED)" % seed)
    t = harness.Checker("test_session_restart")
    snapshot_dir = tempfile.mkdtemp(prefix="session-snapshots-")
    server = None
    try:
        server, session = decode_through_two_restarts(binary, snapshot_dir, t, seed)
        server = sigkill_loses_the_sessions(binary, server, snapshot_dir, session, t)
        corrupt_snapshots_are_refused(binary, server, snapshot_dir, t, seed)
        server = None
        hand_off_to_a_peer(binary, snapshot_dir, t, seed)
    finally:
        if server is not None and server.process.poll() is None:
            server.process.kill()
        shutil.rmtree(snapshot_dir, ignore_errors=True)
    if t.failures:
        print("seed %d" % seed)
    t.finish()


if __name__ == "__main__":
    main()
