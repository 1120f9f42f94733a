#!/usr/bin/python3
"""Health and in-flight calls while a real attention-server drains on SIGTERM.

usage: test_drain_on_sigterm.py PATH/TO/attention-server

Starts several slow-ish MultiHeadAttention calls (a [2, 2048, 768] batch each on the demo
layer, one request per forward pass so they queue behind each other), waits until every one
of them has reached the server (attention_in_flight_requests plus the calls already answered
equals the number sent) with at least one still in flight, then sends SIGTERM, and a second
SIGTERM while the calls are still draining.

What the test asserts:
  * every call started before the signal completes OK, with the same output as before the
    drain, and at least one of them completes after the signal (the drain was exercised);
  * a grpc.health.v1 Watch stream opened before the signal receives NOT_SERVING;
  * no health Check returns SERVING once the Watch said NOT_SERVING;
  * once a Check is refused, a new attention call is refused too (UNAVAILABLE);
  * the second SIGTERM neither kills the process nor cuts the drain short (it used to: see
    ForwardToMainThread in server/app/main.cc);
  * the process exits 0 and logs the drain.

What gRPC C++ 1.51 lets a client observe (documented, not wished for): Shutdown() refuses
new calls at once (Check answers CANCELLED or UNAVAILABLE, never NOT_SERVING) while the
calls already in flight run to completion; the NOT_SERVING status, set just before
Shutdown() in AttentionServer::Shutdown, reaches clients holding a Health/Watch stream.
Kubernetes' gRPC readiness probe issues Check, so it sees the refusal as a failed probe.
"""

import signal
import threading
import time

import grpc
import numpy as np

import obs
from attention_client import AttentionClient, stubs

DEMO = "demo-bert-base"
CALLS = 5
# Long sequences: a call's compute (attention grows with N^2) must outlast the client's own
# sending and receiving of it by far, or all five may finish between two polls of the
# metrics below; [8, 384, 768] did on a fast core under load.
SHAPE = (2, 2048, 768)
DEADLINE_S = 120.0


class Events:
    """Thread-safe list of (monotonic time, kind, value)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.items = []

    def add(self, kind, value):
        with self._lock:
            self.items.append((time.monotonic(), kind, value))

    def of(self, kind):
        with self._lock:
            return [(at, value) for at, k, value in self.items if k == kind]


def watch_health(target, events, done):
    """Health/Watch("") until NOT_SERVING (then cancels the stream, so the server's
    Shutdown does not wait for it) or the stream ends."""
    health_pb2 = stubs.load()[2]
    channel = grpc.insecure_channel(target)
    watch = channel.unary_stream(
        "/grpc.health.v1.Health/Watch",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)
    call = watch(health_pb2.HealthCheckRequest(service=""), timeout=DEADLINE_S)
    try:
        for response in call:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            events.add("watch", status)
            if status == "SERVING":
                done.set()
            if status == "NOT_SERVING":
                call.cancel()
                break
    except grpc.RpcError as error:
        events.add("watch_end", error.code().name)
    finally:
        done.set()
        channel.close()


def check_health(target, events, stop):
    """Health Check in a loop until `stop`; records (start, result) pairs."""
    with AttentionClient(target, timeout=5) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                result = client.health()
            except grpc.RpcError as error:
                result = error.code().name
            events.add("check", (started, result))
            stop.wait(0.005)


def main():
    t = obs.Checker("test_drain_on_sigterm")
    # The calls are long on purpose (about 100 MB of buffers each): the queue's memory bound
    # is raised so that all of them are admitted before SIGTERM.
    server = obs.ServerProcess(obs.server_binary(), "--demo_layer", "--max_batch_requests=1",
                               "--max_queued_bytes=%d" % (2 << 30),
                               "--shutdown_grace_seconds=%d" % DEADLINE_S).start()
    events = Events()
    stop_checks = threading.Event()
    try:
        client = AttentionClient(server.target, timeout=DEADLINE_S)
        client.wait_ready()
        x = np.random.default_rng(5).normal(size=SHAPE).astype(np.float32)
        reference = client.multi_head_attention(x, layer=DEMO).output

        watching = threading.Event()
        watcher = threading.Thread(target=watch_health, args=(server.target, events, watching))
        watcher.start()
        checker = threading.Thread(target=check_health, args=(server.target, events, stop_checks))
        checker.start()
        t.check(watching.wait(DEADLINE_S), "the Watch stream never answered")
        t.check(obs.poll(lambda: any(r == "SERVING" for _, (_, r) in events.of("check")),
                         DEADLINE_S, "a SERVING Check"), "Check never answered SERVING")

        results = [None] * CALLS
        finished_at = [None] * CALLS

        def call(i):
            try:
                results[i] = client.multi_head_attention(x, layer=DEMO).output
            except grpc.RpcError as error:
                results[i] = "%s: %s" % (error.code().name, error.details())
            finished_at[i] = time.monotonic()

        callers = [threading.Thread(target=call, args=(i,)) for i in range(CALLS)]
        for caller in callers:
            caller.start()
        def all_arrived():
            # Answered calls are counted before the gauge is read, so a call finishing in
            # between is missed (never counted twice): the sum can only be too low.
            answered = sum(1 for at in finished_at if at is not None)
            gauge = obs.sample_value(obs.metrics_text(server), "attention_in_flight_requests")
            return gauge is not None and gauge >= 1 and answered + gauge >= CALLS

        t.check(obs.poll(all_arrived, DEADLINE_S, "all %d calls at the server" % CALLS),
                "the %d calls never were all at the server with one still in flight" % CALLS)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        # A second SIGTERM once the drain has begun (the Watch says NOT_SERVING).
        obs.poll(lambda: any(s == "NOT_SERVING" for _, s in events.of("watch")), DEADLINE_S,
                 "NOT_SERVING on the Watch")
        signalled_again = time.monotonic()
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)

        for caller in callers:
            caller.join(DEADLINE_S)
        watcher.join(DEADLINE_S)
        # Once Check is refused the listener is shut: a new call must be refused as well.
        refused = obs.poll(lambda: [r for at, (s, r) in events.of("check")
                                    if s > signalled and r != "SERVING" and r != "NOT_SERVING"],
                           DEADLINE_S, "a refused Check")
        if t.check(refused, "no Check was refused after SIGTERM"):
            try:
                client.multi_head_attention(x, layer=DEMO, timeout=10)
                t.check(False, "a new call after the drain began succeeded")
            except grpc.RpcError as error:
                t.check(error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED),
                        "a new call after the drain began: %s, want UNAVAILABLE" % error.code())
        try:
            server.process.wait(timeout=DEADLINE_S)
        except Exception:
            t.check(False, "the server did not exit within %.0f s of SIGTERM" % DEADLINE_S)
        code = server.stop(timeout=DEADLINE_S)
        stop_checks.set()
        checker.join(DEADLINE_S)
        client.close()

        for i, result in enumerate(results):
            ok = isinstance(result, np.ndarray)
            t.check(ok, "call %d started before SIGTERM: %s" % (i, result))
            if ok:
                t.check(np.array_equal(result, reference),
                        "call %d: output differs from the one before the drain" % i)
        after = sum(1 for at in finished_at if at is not None and at > signalled)
        print("%d of %d calls finished after SIGTERM" % (after, CALLS), flush=True)
        t.check(after >= 1, "no call finished after SIGTERM: the drain was not exercised "
                "(the calls are too fast for this machine)")
        after_again = sum(1 for at in finished_at if at is not None and at > signalled_again)
        print("%d of %d calls finished after the second SIGTERM" % (after_again, CALLS), flush=True)
        t.check(after_again >= 1, "no call finished after the second SIGTERM: not exercised")

        watch = events.of("watch")
        print("watch: %s" % [(round(at - signalled, 3), s) for at, s in watch], flush=True)
        t.check(watch and watch[0][1] == "SERVING", "Watch did not start SERVING: %s" % watch)
        not_serving = [at for at, s in watch if s == "NOT_SERVING"]
        t.check(not_serving and not_serving[0] > signalled,
                "Watch never turned NOT_SERVING after SIGTERM: %s %s"
                % (watch, events.of("watch_end")))
        checks = events.of("check")
        after_signal = sorted({r for _, (s, r) in checks if s > signalled})
        print("Check results after SIGTERM: %s" % after_signal, flush=True)
        if not_serving:
            late_serving = [(s - signalled, r) for _, (s, r) in checks
                            if s > not_serving[0] and r == "SERVING"]
            t.check(not late_serving, "Check said SERVING after the Watch said NOT_SERVING: %s"
                    % late_serving)
        t.check(set(after_signal) <= {"SERVING", "NOT_SERVING", "UNAVAILABLE", "CANCELLED"},
                "unexpected Check results while draining: %s" % after_signal)
        t.check(code == 0, "exit code %s after SIGTERM, want 0; stderr:\n%s"
                % (code, server.stderr_text()[-4000:]))
        t.check("draining" in server.stderr_text(), "no drain line on stderr:\n%s"
                % server.stderr_text()[-4000:])
    except Exception:
        stop_checks.set()
        server.kill()
        raise
    t.finish()


if __name__ == "__main__":
    main()
