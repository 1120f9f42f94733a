#!/usr/bin/python3
"""The Python client package against a real attention-server on a free port.

usage: test_python_client.py PATH/TO/attention-server

Checks: health SERVING; the demo layer through MultiHeadAttention in float32, float16 and
bfloat16; ScaledDotProductAttention against a numpy reference; LoadLayer / GetLayer /
ListLayers / UnloadLayer with inline and random weights; malformed requests answered
INVALID_ARGUMENT / NOT_FOUND; session refusals raised as SessionError with the server's
reason (and the holder replica of WRONG_REPLICA), unary and streamed; the server exits 0 on
SIGTERM.
"""

import asyncio
import tempfile
import time

import grpc
import numpy as np

import harness
import attention_client as ac
from attention_client import AttentionClient, SessionError, errors, stubs, tensors
from attention_client.server_process import make_test_certificates

DEMO = "demo-bert-base"


def softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def mha_reference(x, w, heads):
    """float64 numpy MHA with native weights (self-attention, no masks)."""
    x = x.astype(np.float64)
    b, n, e = x.shape
    proj = lambda name: x @ w[name + ".weight"].T.astype(np.float64) + w[name + ".bias"]
    d = e // heads
    q, k, v = (proj(p).reshape(b, n, heads, d).transpose(0, 2, 1, 3)
               for p in ("q_proj", "k_proj", "v_proj"))
    p = softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(d))
    ctx = (p @ v).transpose(0, 2, 1, 3).reshape(b, n, e)
    return ctx @ w["out_proj.weight"].T + w["out_proj.bias"], p.mean(axis=1)


def check_codec(t):
    # bfloat16 bit patterns: exact values, round-to-nearest-even, NaN stays NaN.
    values = np.array([1.0, -2.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3.140625, np.inf, np.nan],
                      dtype=np.float32)
    bits = ac.float32_to_bfloat16_bits(values)
    t.check(list(bits[:6]) == [0x3F80, 0xC000, 0x3F80, 0x3F82, 0x4049, 0x7F80],
            "bfloat16 bits %s" % [hex(v) for v in bits])
    back = ac.bfloat16_bits_to_float32(bits)
    t.check(np.isnan(back[6]) and back[3] == np.float32(1.0 + 2 * 2 ** -7),
            "bfloat16 decode %s" % back)
    x = np.random.default_rng(1).normal(size=(2, 3, 4)).astype(np.float32)
    for dtype in ("float32", "float16", "bfloat16"):
        y = ac.decode(ac.encode(x, dtype))
        t.check(y.shape == x.shape and np.array_equal(y, ac.round_to_dtype(x, dtype)),
                "%s encode/decode round trip" % dtype)
        rel = np.max(np.abs(y - x) / np.abs(x))
        t.check(rel <= {"float32": 0, "float16": 2 ** -11, "bfloat16": 2 ** -8}[dtype],
                "%s rounding error %g" % (dtype, rel))
    mask = np.array([[True, False, True]])
    t.check(np.array_equal(ac.decode(ac.encode(mask)), mask), "bool round trip")


def check_demo_layer(t, client):
    info = client.get_layer(DEMO)
    t.check(info.config.embed_dim == 768 and info.config.num_heads == 12,
            "demo layer config %s" % info.config)
    t.check(any(layer.name == DEMO for layer in client.list_layers()), "demo layer listed")
    x = np.random.default_rng(7).normal(size=(1, 5, 768)).astype(np.float32)
    results = {}
    for dtype, enum, tol in (("float32", tensors.FLOAT32, 0.0),
                             ("float16", tensors.FLOAT16, 2e-3),
                             ("bfloat16", tensors.BFLOAT16, 2e-2)):
        r = client.multi_head_attention(x, layer=DEMO, dtype=dtype, need_weights="averaged",
                                        request_id="py-" + dtype)
        results[dtype] = r
        t.check(r.output.shape == (1, 5, 768), "%s output shape %s" % (dtype, r.output.shape))
        t.check(r.weights is not None and r.weights.shape == (1, 5, 5),
                "%s weights shape %s" % (dtype, None if r.weights is None else r.weights.shape))
        t.check(r.output_dtype == enum, "%s answered in dtype %d" % (dtype, r.output_dtype))
        t.check(r.request_id == "py-" + dtype, "request id echoed: %r" % r.request_id)
        t.check(np.all(np.isfinite(r.output)), "%s output finite" % dtype)
        if r.weights is not None:
            t.check(np.allclose(r.weights.sum(-1), 1.0, atol=1e-2 + tol),
                    "%s weight rows sum to 1: %s" % (dtype, r.weights.sum(-1)))
        if dtype != "float32":
            # Same layer on the rounded input in float32, then compare within the dtype's
            # precision (output rounded once more on the way out).
            ref = client.multi_head_attention(ac.round_to_dtype(x, dtype), layer=DEMO).output
            err = np.max(np.abs(r.output - ref) / (np.abs(ref) + 1e-2))
            t.check(err <= tol, "%s output vs float32 on rounded input: rel err %g > %g"
                    % (dtype, err, tol))
    r = client.multi_head_attention(x, layer=DEMO, output_dtype="bfloat16")
    t.check(r.output_dtype == tensors.BFLOAT16, "output_dtype=bfloat16 honoured")
    t.check(np.max(np.abs(r.output - results["float32"].output)) < 2e-2 * max(
        1.0, np.max(np.abs(r.output))), "bfloat16 output close to float32 output")
    r = client.multi_head_attention(x, layer=DEMO)
    t.check(r.weights is None, "no weights unless asked")


def check_sdpa(t, client):
    rng = np.random.default_rng(3)
    b, h, hkv, nq, nk, dk, dv = 2, 4, 2, 5, 7, 8, 6
    q = rng.normal(size=(b, h, nq, dk)).astype(np.float32)
    k = rng.normal(size=(b, hkv, nk, dk)).astype(np.float32)
    v = rng.normal(size=(b, hkv, nk, dv)).astype(np.float32)
    r = client.scaled_dot_product_attention(q, k, v, causal=True, need_weights="per_head")
    kr, vr = np.repeat(k, h // hkv, axis=1), np.repeat(v, h // hkv, axis=1)
    s = q.astype(np.float64) @ kr.transpose(0, 1, 3, 2) / np.sqrt(dk)
    allowed = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
    p = softmax(np.where(allowed, s, -np.inf))
    t.check(r.output.shape == (b, h, nq, dv), "sdpa output shape %s" % (r.output.shape,))
    t.check(np.allclose(r.output, p @ vr, atol=1e-5), "sdpa output vs numpy, max err %g"
            % np.max(np.abs(r.output - p @ vr)))
    t.check(np.allclose(r.weights, p, atol=1e-6), "sdpa weights vs numpy")


def causal_attention(q, k, v, scale, dtype):
    """One-shot causal attention in `dtype`: q [L, H, dk], k [L, Hkv, dk], v [L, Hkv, dv]."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("ihd,jhd->hij", q, k) * dtype(scale)
    n = q.shape[0]
    s = np.where(np.tril(np.ones((n, n), dtype=bool))[None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v)


def holds_fidelity_rule(ours, q, k, v, scale):
    """FlashAttention's rule against numpy: max|ours - f64| <= 2 max|np f32 - f64| + 1e-6."""
    oracle = causal_attention(q, k, v, scale, np.float64)
    reference = causal_attention(q, k, v, scale, np.float32)
    ours_error = np.max(np.abs(ours - oracle))
    reference_error = np.max(np.abs(reference - oracle))
    return ours_error <= 2 * reference_error + 1e-6, ours_error, reference_error


def check_sessions(t, client):
    rng = np.random.default_rng(9)
    h, hkv, dk, length = 4, 2, 16, 20
    session = client.create_session(2, h, hkv, dk, reserved_tokens=64)
    q = rng.normal(size=(length, h, dk)).astype(np.float32)
    k = rng.normal(size=(length, hkv, dk)).astype(np.float32)
    v = rng.normal(size=(length, hkv, dk)).astype(np.float32)
    outputs, position = [], 0
    for n in (5, 1, 1, 3, 10):  # a prefill chunk, then decode steps of 1 and more tokens
        span = slice(position, position + n)
        got = client.session_step([(session.session_id, layer, position, q[span], k[span],
                                    v[span]) for layer in (0, 1)])
        t.check(np.array_equal(got[0], got[1]), "both layers answer alike")
        outputs.append(got[0])
        position += n
    ok, ours, reference = holds_fidelity_rule(np.concatenate(outputs), q, k, v, dk ** -0.5)
    t.check(ok, "session decode vs numpy: max err %g, numpy float32's %g" % (ours, reference))
    t.check(client.get_session(session.session_id).length == length, "session length")
    retried = client.session_step([(session.session_id, 0, 10, q[10:], k[10:], v[10:])])
    t.check(np.array_equal(retried[0], outputs[-1]), "a retried step answers the same bits")
    # The same steps again on a stream: rewrites of written positions, which answer the same
    # bits in any order; and one step of a session held elsewhere, which fails alone.
    steps, position = [], 0
    for n in (5, 1, 1, 3, 10):
        span = slice(position, position + n)
        steps.append(("step%d" % position, [(session.session_id, 0, position, q[span], k[span],
                                             v[span])]))
        position += n
    steps.insert(2, ("lost", [("nobody/" + "0" * 32, 0, 0, q[:1], k[:1], v[:1])]))
    answers = dict(client.session_step_stream(iter(steps)))
    t.check(sorted(answers) == sorted(r for r, _ in steps), "one answer per streamed step")
    streamed = np.concatenate([answers[r][0] for r, _ in steps if r != "lost"])
    t.check(np.array_equal(streamed, np.concatenate(outputs)),
            "streamed steps answer the unary steps' bits")
    t.check(answers["lost"][0] == grpc.StatusCode.FAILED_PRECONDITION
            and "nobody" in answers["lost"][1], "a failed streamed step: %s" % (answers["lost"],))
    t.check(isinstance(answers["lost"], SessionError) and answers["lost"].reason ==
            "WRONG_REPLICA" and answers["lost"].holder == "nobody",
            "a failed streamed step's reason and holder: %r" % (answers["lost"],))
    fork = client.fork_session(session.session_id, 8, reserved_tokens=32)
    t.check(fork.length == 8, "fork length %d" % fork.length)
    t.check(client.truncate_session(session.session_id, 4).length == 4, "truncate")
    t.check(len(client.list_sessions()) == 2, "two sessions listed")
    for id_ in (session.session_id, fork.session_id):
        client.drop_session(id_)
    expect_error(t, "dropped session", grpc.StatusCode.NOT_FOUND,
                 lambda: client.get_session(session.session_id))


def check_async_client(t, client, target):
    """AsyncAttentionClient against the blocking client on the same server: the same bits
    for attention and for every session call, and the same SessionError."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, 5, 768)).astype(np.float32)
    h, hkv, dk, length = 2, 1, 8, 6
    q = rng.normal(size=(length, h, dk)).astype(np.float32)
    k = rng.normal(size=(length, hkv, dk)).astype(np.float32)
    v = rng.normal(size=(length, hkv, dk)).astype(np.float32)
    blocking = client.create_session(1, h, hkv, dk, 16)
    want = [client.session_step([(blocking.session_id, 0, p, q[p:p + 1], k[p:p + 1],
                                  v[p:p + 1])])[0] for p in range(length)]
    client.drop_session(blocking.session_id)

    async def run():
        async with ac.AsyncAttentionClient(target) as aio:
            mha = await aio.multi_head_attention(x, layer="demo-bert-base")
            t.check(np.array_equal(mha.output,
                                   client.multi_head_attention(x, layer="demo-bert-base").output),
                    "async multi_head_attention answers the blocking client's bits")
            a, b = await asyncio.gather(aio.create_session(1, h, hkv, dk, 16),
                                        aio.create_session(1, h, hkv, dk, 16))
            got = await aio.session_step([(a.session_id, 0, 0, q[:1], k[:1], v[:1]),
                                          (b.session_id, 0, 0, q[:1], k[:1], v[:1])])
            t.check(np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[0]),
                    "async session_step answers the blocking client's bits")
            for p in range(1, length):
                got = await aio.session_step([(a.session_id, 0, p, q[p:p + 1], k[p:p + 1],
                                               v[p:p + 1])])
                t.check(np.array_equal(got[0], want[p]), "async step at %d's bits" % p)
            # The same steps again on a stream, all in flight at once: rewrites of written
            # positions answer the same bits in any order.
            steps = [("s%d" % p, [(a.session_id, 0, p, q[p:p + 1], k[p:p + 1], v[p:p + 1])])
                     for p in range(length)]
            streamed = {request_id: outputs async for request_id, outputs in
                        aio.session_step_stream(steps)}
            t.check(all(np.array_equal(streamed["s%d" % p][0], want[p])
                        for p in range(length)), "async session_step_stream's bits")
            fork = await aio.fork_session(a.session_id, 3)
            t.check((fork.length, fork.reserved_tokens) == (3, 16), "async fork %s" % fork)
            info = await aio.get_session(a.session_id, keep_idle=True)
            t.check(info.length == length, "async get_session length %d" % info.length)
            t.check((await aio.truncate_session(a.session_id, 2)).length == 2, "async truncate")
            t.check(len(await aio.list_sessions()) == 3, "async list_sessions")
            for session in (a, b, fork):
                await aio.drop_session(session.session_id)
            try:
                await aio.get_session(a.session_id)
                t.check(False, "async get_session of a dropped session succeeded")
            except SessionError as err:
                t.check(err.reason == "SESSION_DROPPED", "async SessionError %r" % err)

    asyncio.run(run())


def decoder_layer(x, w, heads, kv_heads, theta, dtype):
    """A Llama-style layer in `dtype` over x [L, E]: projections with biases, RoPE
    (rotate-half) at positions 0..L-1, causal GQA attention, output projection."""
    x = x.astype(dtype)
    proj = lambda name: x @ w[name + ".weight"].T.astype(dtype) + w[name + ".bias"].astype(dtype)
    length, dk = x.shape[0], w["q_proj.weight"].shape[0] // heads
    q = proj("q_proj").reshape(length, heads, dk)
    k = proj("k_proj").reshape(length, kv_heads, dk)
    v = proj("v_proj").reshape(length, kv_heads, dk)
    half = dk // 2
    angle = np.arange(length)[:, None] * theta ** (-2.0 * np.arange(half) / dk)[None, :]
    cos, sin = np.cos(angle).astype(dtype)[:, None, :], np.sin(angle).astype(dtype)[:, None, :]
    rotate = lambda t: np.concatenate([t[..., :half] * cos - t[..., half:] * sin,
                                       t[..., half:] * cos + t[..., :half] * sin], axis=-1)
    attended = causal_attention(rotate(q), rotate(k), v, dk ** -0.5, dtype)
    out = w["out_proj.weight"].astype(dtype)
    return attended.reshape(length, heads * dk) @ out.T + w["out_proj.bias"].astype(dtype)


def check_layer_sessions(t, client):
    """A session over a served layer: hidden states in, the layer's output out, equal to the
    one-shot causal layer by FlashAttention's rule."""
    rng = np.random.default_rng(11)
    e, heads, kv_heads, dk, theta, length = 32, 4, 2, 8, 10000.0, 12
    shapes = {"q_proj": heads * dk, "k_proj": kv_heads * dk, "v_proj": kv_heads * dk,
              "out_proj": e}
    weights = {}
    for name, rows in shapes.items():
        columns = heads * dk if name == "out_proj" else e
        weights[name + ".weight"] = rng.uniform(-0.3, 0.3, size=(rows, columns)).astype(np.float32)
        weights[name + ".bias"] = rng.uniform(-0.3, 0.3, size=(rows,)).astype(np.float32)
    config = {"embed_dim": e, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": dk,
              "rope_theta": theta, "always_causal": True}
    client.load_layer("py-decoder", config, weights)
    session = client.create_layer_session(["py-decoder"], reserved_tokens=32)
    t.check(list(session.config.layers) == ["py-decoder"] and session.config.num_heads == heads
            and session.config.num_kv_heads == kv_heads, "heads from the layer: %s"
            % session.config)
    x = rng.normal(size=(length, e)).astype(np.float32)
    outputs, position = [], 0
    for n in (5, 1, 1, 5):
        (got,) = client.session_step([(session.session_id, 0, position, x[position:position + n])])
        t.check(got.shape == (n, e), "output shape %s" % (got.shape,))
        outputs.append(got)
        position += n
    oracle = decoder_layer(x, weights, heads, kv_heads, theta, np.float64)
    reference = decoder_layer(x, weights, heads, kv_heads, theta, np.float32)
    ours_error = np.max(np.abs(np.concatenate(outputs) - oracle))
    reference_error = np.max(np.abs(reference - oracle))
    t.check(ours_error <= 2 * reference_error + 1e-6,
            "layer session vs numpy: max err %g, numpy float32's %g"
            % (ours_error, reference_error))
    client.drop_session(session.session_id)
    client.unload_layer("py-decoder")


def check_replicas(t, binary):
    """Two server processes behind one round-robin target (as a Kubernetes Service spreads
    calls): every session answer names its replica's address, the client pins the session's
    calls there, and the other replica refuses a session it does not hold, naming the holder."""
    replicas = [harness.ServerProcess(binary, "--compute_threads=1", "--replica_name=" + name,
                                      "--replica_address=127.0.0.1").start()
                for name in ("py-a", "py-b")]
    try:
        target = "ipv4:" + ",".join(r.target for r in replicas)
        rng = np.random.default_rng(4)
        with AttentionClient(target, lb_policy="round_robin") as client:
            sessions = []
            # Round robin alternates once both replicas are connected, which under load can
            # take longer than a few creates: wait for two sessions on each (up to 20 s),
            # dropping the extra ones of the replica that answered first.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(sessions) < 4:
                created = client.create_session(1, 4, 2, 16, reserved_tokens=16)
                if sum(s.replica == created.replica for s in sessions) < 2:
                    sessions.append(created)
                else:
                    client.drop_session(created.session_id)
            address = {"py-a": replicas[0].target, "py-b": replicas[1].target}
            t.check({s.replica for s in sessions} == {"py-a", "py-b"},
                    "sessions on both replicas: %s" % sorted({s.replica for s in sessions}))
            t.check(all(s.replica_address == address[s.replica] for s in sessions),
                    "each answer names its replica's address")
            for position in range(6):
                entries = [(s.session_id, 0, position, rng.normal(size=(1, 4, 16)),
                            rng.normal(size=(1, 2, 16)), rng.normal(size=(1, 2, 16)))
                           for s in sessions]
                outputs = client.session_step(entries)
                t.check(len(outputs) == len(sessions) and outputs[0].shape == (1, 4, 16),
                        "a step over sessions of both replicas")
            t.check(all(client.get_session(s.session_id).length == 6 for s in sessions),
                    "every session holds its 6 tokens")
            held_by_a = next(s for s in sessions if s.replica == "py-a")
            with AttentionClient(replicas[1].target) as replica_b:
                expect_refusal(t, "a session of the other replica",
                               grpc.StatusCode.FAILED_PRECONDITION, "WRONG_REPLICA",
                               lambda: replica_b.get_session(held_by_a.session_id), "py-a")
                replica_b.pin_session(held_by_a.session_id, held_by_a.replica_address)
                t.check(replica_b.get_session(held_by_a.session_id).length == 6,
                        "pinned by hand, another client reaches it")
            for s in sessions:
                client.drop_session(s.session_id)
    except BaseException:
        for r in replicas:
            r.kill()
        raise
    for r in replicas:
        t.check(r.stop() == 0, "replica exits 0 on SIGTERM")


def check_layers(t, client):
    rng = np.random.default_rng(5)
    e, heads = 16, 4
    weights = {}
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        weights[name + ".weight"] = rng.uniform(-0.25, 0.25, size=(e, e)).astype(np.float32)
        weights[name + ".bias"] = rng.uniform(-0.25, 0.25, size=(e,)).astype(np.float32)
    info = client.load_layer("py-test", {"embed_dim": e, "num_heads": heads}, weights)
    t.check(info.name == "py-test" and info.version >= 1, "LoadLayer info %s" % info)
    t.check(info.parameter_count == 4 * (e * e + e), "parameter_count %d" % info.parameter_count)
    got = client.get_layer("py-test")
    t.check(got.config.head_dim == e // heads and got.config.output_dim == e,
            "GetLayer resolves defaults: %s" % got.config)
    names = [layer.name for layer in client.list_layers()]
    t.check(names == sorted(names) and "py-test" in names, "ListLayers sorted: %s" % names)
    x = rng.normal(size=(3, 6, e)).astype(np.float32)
    r = client.multi_head_attention(x, layer="py-test", need_weights="averaged")
    ref_out, ref_w = mha_reference(x, weights, heads)
    t.check(np.allclose(r.output, ref_out, atol=1e-5), "loaded layer output, max err %g"
            % np.max(np.abs(r.output - ref_out)))
    t.check(np.allclose(r.weights, ref_w, atol=1e-6), "loaded layer weights")
    t.check(r.layer_version == got.version, "layer_version %d" % r.layer_version)
    # Same through an inline layer.
    r2 = client.multi_head_attention(
        x, layer_spec=ac.make_layer_spec({"embed_dim": e, "num_heads": heads}, weights))
    t.check(np.allclose(r2.output, r.output, atol=1e-6), "inline layer = loaded layer")
    # Reload publishes a new version; seeded random init is deterministic.
    info2 = client.load_layer("py-test", {"embed_dim": e, "num_heads": heads}, random_seed=9)
    t.check(info2.version > info.version, "reload bumps version %d -> %d"
            % (info.version, info2.version))
    tuned = client.load_layer("py-test-2", {"embed_dim": e, "num_heads": heads}, random_seed=9,
                              batching={"max_batch_requests": 2, "max_queue_delay_us": 0})
    t.check(tuned.batching.max_batch_requests == 2 and tuned.batching.max_queue_delay_us == 0
            and tuned.batching.max_batch_tokens == info2.batching.max_batch_tokens,
            "the layer's own batching policy, the rest the server's: %s" % tuned.batching)
    a = client.multi_head_attention(x, layer="py-test").output
    b = client.multi_head_attention(x, layer="py-test-2").output
    t.check(np.array_equal(a, b), "same random_init seed gives the same layer")
    for name in ("py-test", "py-test-2"):
        client.unload_layer(name)
    try:
        client.get_layer("py-test")
        t.check(False, "GetLayer after UnloadLayer should be NOT_FOUND")
    except grpc.RpcError as err:
        t.check(err.code() == grpc.StatusCode.NOT_FOUND,
                "GetLayer after UnloadLayer: %s %s" % (err.code(), err.details()))


def expect_error(t, label, code, fn, message_part=""):
    try:
        fn()
        t.check(False, "%s: succeeded, want %s" % (label, code))
    except grpc.RpcError as err:
        t.check(err.code() == code, "%s: got %s (%s), want %s"
                % (label, err.code(), err.details(), code))
        t.check(bool(err.details()), "%s: error message is empty" % label)
        t.check(message_part in err.details(),
                "%s: %r does not say %r" % (label, err.details(), message_part))


def expect_refusal(t, label, code, reason, fn, holder=None):
    """`fn` raises a SessionError with `code`, `reason` and `holder`."""
    try:
        fn()
        t.check(False, "%s: succeeded, want %s" % (label, reason))
    except SessionError as err:
        t.check((err.code(), err.reason, err.holder) == (code, reason, holder),
                "%s: got %s %s holder %s (%s), want %s %s holder %s"
                % (label, err.code(), err.reason, err.holder, err.details(), code, reason,
                   holder))
        t.check(isinstance(err, grpc.RpcError), "%s: a SessionError is a grpc.RpcError" % label)


def wire_field(number, payload):
    """A length-delimited protobuf field (payloads under 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def check_status_details_decoding(t):
    """The google.rpc.Status decoder on hand-built bytes: the reason of this domain's
    ErrorInfo, and None for another domain, another detail type or malformed bytes."""
    def status(reason=b"POSITION_GAP", domain=b"attention-service",
               type_url=b"type.googleapis.com/google.rpc.ErrorInfo"):
        info = wire_field(1, reason) + wire_field(2, domain) + wire_field(
            3, wire_field(1, b"key") + wire_field(2, b"value"))  # metadata, skipped
        detail = wire_field(1, type_url) + wire_field(2, info)
        return bytes([0x08, 11]) + wire_field(2, b"a message") + wire_field(3, detail)

    t.check(errors.reason_in_status(status()) == "POSITION_GAP", "decoded reason")
    for label, data in (("another domain", status(domain=b"example.com")),
                        ("another detail type", status(type_url=b"type.googleapis.com/x.Y")),
                        ("cut short", status()[:-5]), ("no details", b""),
                        ("a group field", b"\x0b"), ("an endless varint", b"\x08\xff")):
        t.check(errors.reason_in_status(data) is None, "%s decodes to no reason" % label)
    cut = SessionError(grpc.StatusCode.FAILED_PRECONDITION,
                       'session "%s/0" is held by replica "%s... (200 bytes)", not this one'
                       % ("r" * 200, "r" * 128), "WRONG_REPLICA")
    t.check(cut.holder is None, "a holder name cut short is no holder: %r" % cut.holder)
    answer = stubs.load()[0].SessionStepStreamResponse(
        error_code=9, error_reason="WRONG_REPLICA",
        error_message='entries[0]: session "b/0" is held by replica "b", not this one ("a")')
    streamed = errors.from_stream_answer(answer)
    t.check((streamed.code(), streamed.reason, streamed.holder)
            == (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_REPLICA", "b"),
            "a stream answer's failure: %r" % (streamed,))


def check_session_errors(t, client):
    """Every session method raises SessionError with the server's reason; a streamed step's
    failure is one too, yielded; other calls keep raising plain grpc.RpcError."""
    rng = np.random.default_rng(38)
    token = lambda heads: rng.normal(size=(1, heads, 16)).astype(np.float32)
    session = client.create_session(1, 4, 2, 16, reserved_tokens=16).session_id
    unknown = "0" * 32  # well-formed, never made
    expect_refusal(t, "a step leaving a gap", grpc.StatusCode.OUT_OF_RANGE, "POSITION_GAP",
                   lambda: client.session_step([(session, 0, 3, token(4), token(2),
                                                 token(2))]))
    expect_refusal(t, "get an unknown session", grpc.StatusCode.NOT_FOUND, "SESSION_UNKNOWN",
                   lambda: client.get_session(unknown))
    expect_refusal(t, "fork an unknown session", grpc.StatusCode.NOT_FOUND, "SESSION_UNKNOWN",
                   lambda: client.fork_session(unknown, 0, reserved_tokens=16))
    expect_refusal(t, "truncate an unknown session", grpc.StatusCode.NOT_FOUND,
                   "SESSION_UNKNOWN", lambda: client.truncate_session(unknown, 0))
    expect_refusal(t, "a session of another replica", grpc.StatusCode.FAILED_PRECONDITION,
                   "WRONG_REPLICA", lambda: client.get_session("py-z/" + unknown), "py-z")
    expect_refusal(t, "a session with no heads", grpc.StatusCode.INVALID_ARGUMENT, None,
                   lambda: client.create_session(1, 0, 0, 16, reserved_tokens=16))

    steps = [("ok", [(session, 0, 0, token(4), token(2), token(2))]),
             ("gap", [(session, 0, 5, token(4), token(2), token(2))]),
             ("elsewhere", [("py-z/" + unknown, 0, 0, token(4), token(2), token(2))])]
    answers = dict(client.session_step_stream(iter(steps)))
    t.check(not isinstance(answers.get("ok"), SessionError), "the good streamed step answers")
    gap, elsewhere = answers.get("gap"), answers.get("elsewhere")
    t.check(isinstance(gap, SessionError) and (gap.code(), gap.reason, gap.holder)
            == (grpc.StatusCode.OUT_OF_RANGE, "POSITION_GAP", None),
            "a streamed gap: %r" % (gap,))
    t.check(isinstance(elsewhere, SessionError) and (elsewhere.reason, elsewhere.holder)
            == ("WRONG_REPLICA", "py-z"), "a streamed step elsewhere: %r" % (elsewhere,))
    if isinstance(gap, SessionError):
        code, message = gap  # the (code, message) pair it was before SessionError
        t.check(code == gap.code() and message == gap.details(), "a failure unpacks as before")

    client.drop_session(session)
    expect_refusal(t, "get a dropped session", grpc.StatusCode.NOT_FOUND, "SESSION_DROPPED",
                   lambda: client.get_session(session))
    expect_refusal(t, "drop a dropped session", grpc.StatusCode.NOT_FOUND, "SESSION_DROPPED",
                   lambda: client.drop_session(session))
    try:
        client.get_layer("no-such-layer")
        t.check(False, "GetLayer of an unknown layer succeeded")
    except grpc.RpcError as err:
        t.check(not isinstance(err, SessionError) and err.code() == grpc.StatusCode.NOT_FOUND,
                "a layer call raises a plain grpc.RpcError: %r" % (err,))


def check_errors(t, client):
    x = np.zeros((1, 5, 100), dtype=np.float32)
    expect_error(t, "query embed_dim 100 on a 768 layer", grpc.StatusCode.INVALID_ARGUMENT,
                 lambda: client.multi_head_attention(x, layer=DEMO))
    expect_error(t, "unknown layer", grpc.StatusCode.NOT_FOUND,
                 lambda: client.multi_head_attention(np.zeros((1, 2, 8), np.float32),
                                                     layer="no-such-layer"))
    # raw_data whose size does not match the shape.
    request = client.pb2.MultiHeadAttentionRequest(layer=DEMO)
    request.query.dtype = tensors.FLOAT32
    request.query.shape.extend([1, 2, 768])
    request.query.raw_data = b"\0" * 12
    expect_error(t, "raw_data size != shape", grpc.StatusCode.INVALID_ARGUMENT,
                 lambda: client._stub.MultiHeadAttention(request, timeout=30))
    expect_error(t, "sdpa key heads do not divide query heads",
                 grpc.StatusCode.INVALID_ARGUMENT,
                 lambda: client.scaled_dot_product_attention(
                     np.zeros((1, 3, 2, 4), np.float32), np.zeros((1, 2, 2, 4), np.float32),
                     np.zeros((1, 2, 2, 4), np.float32)))
    # The server is still healthy and answering after the bad requests.
    t.check(client.health() == "SERVING", "still SERVING after malformed requests")


def check_session_tokens(t, target, session_tokens, admin_token, tls):
    """Sessions of a server with --session_tokens_file: each identity's own."""
    with AttentionClient(target, session_token=session_tokens["alice"], **tls) as alice, \
            AttentionClient(target, session_token=session_tokens["bob"], **tls) as bob, \
            AttentionClient(target, **tls) as anonymous, \
            AttentionClient(target, admin_token=admin_token, **tls) as admin:
        session = alice.create_session(1, 2, 1, 8, 16)
        q, k, v = (np.full(shape, 0.5, np.float32) for shape in ((1, 2, 8), (1, 1, 8), (1, 1, 8)))
        alice.session_step([(session.session_id, 0, 0, q, k, v)])
        expect_refusal(t, "a session call without a token", grpc.StatusCode.UNAUTHENTICATED,
                       "CREDENTIAL_MISSING", lambda: anonymous.create_session(1, 2, 1, 8, 16))
        expect_refusal(t, "another identity's session", grpc.StatusCode.PERMISSION_DENIED,
                       "SESSION_OF_ANOTHER_IDENTITY", lambda: bob.get_session(session.session_id))
        # A fork without reserved_tokens takes the source's 16; keep_idle reads without a use.
        fork = alice.fork_session(session.session_id, 1)
        t.check(fork.reserved_tokens == 16, "fork reservation %d" % fork.reserved_tokens)
        t.check(alice.get_session(fork.session_id, keep_idle=True).length == 1, "fork length")
        t.check(sorted(s.session_id for s in alice.list_sessions())
                == sorted([session.session_id, fork.session_id]), "alice lists her own")
        t.check(bob.list_sessions() == [], "bob lists none")
        t.check(len(admin.list_sessions()) == 2, "the admin lists every session")
        admin.drop_session(fork.session_id)
        alice.drop_session(session.session_id)


def check_tls_and_admin_token(t, binary):
    """Mutual TLS and a restricted LoadLayer through the Python client's options."""
    with tempfile.TemporaryDirectory() as directory:
        path = make_test_certificates(directory)
        token = "python-client-admin-token-0123"
        with open(path("token"), "w") as f:
            f.write(token + "\n")
        session_tokens = {"alice": "alice-session-token-0123", "bob": "bob-session-token-01234"}
        with open(path("session_tokens"), "w") as f:
            f.writelines("%s %s\n" % pair for pair in session_tokens.items())
        server = harness.ServerProcess(
            binary, "--compute_threads=1", "--tls_cert_file=" + path("server.pem"),
            "--tls_key_file=" + path("server.key"), "--tls_client_ca_file=" + path("ca.pem"),
            "--admin_token_file=" + path("token"),
            "--session_tokens_file=" + path("session_tokens")).start()
        try:
            tls = dict(tls_ca_file=path("ca.pem"), tls_cert_file=path("client.pem"),
                       tls_key_file=path("client.key"))
            with AttentionClient(server.target, **tls) as client:
                t.check(client.health() == "SERVING", "health over mutual TLS")
                expect_error(t, "load without the admin token",
                             grpc.StatusCode.UNAUTHENTICATED,
                             lambda: client.load_layer("x", {"embed_dim": 8, "num_heads": 2},
                                                       random_seed=1))
            with AttentionClient(server.target, admin_token=token, **tls) as admin:
                info = admin.load_layer("x", {"embed_dim": 8, "num_heads": 2}, random_seed=1)
                t.check(info.name == "x", "load with the admin token: %s" % info)
                admin.unload_layer("x")
            check_session_tokens(t, server.target, session_tokens, token, tls)
            with AttentionClient(server.target, tls_ca_file=path("ca.pem")) as no_cert:
                expect_error(t, "mutual TLS without a client certificate",
                             grpc.StatusCode.UNAVAILABLE, lambda: no_cert.list_layers())
        except BaseException:
            server.kill()
            raise
        t.check(server.stop() == 0, "TLS server exits 0 on SIGTERM")


def main():
    t = harness.Checker("test_python_client")
    check_codec(t)
    check_status_details_decoding(t)
    t.run("tls and admin token", check_tls_and_admin_token, t, harness.server_binary())
    t.run("replicas", check_replicas, t, harness.server_binary())
    server = harness.ServerProcess(harness.server_binary(), "--compute_threads=2",
                                   "--demo_layer", "--allow_list_sessions").start()
    try:
        with AttentionClient(server.target) as client:
            t.check(client.health() == "SERVING", "health is %s" % client.health())
            t.check(client.health("attention.v1.AttentionService") == "SERVING",
                    "service health")
            t.run("demo layer", check_demo_layer, t, client)
            t.run("sdpa", check_sdpa, t, client)
            t.run("layers", check_layers, t, client)
            t.run("errors", check_errors, t, client)
            t.run("sessions", check_sessions, t, client)
            t.run("async client", check_async_client, t, client, server.target)
            t.run("session errors", check_session_errors, t, client)
            t.run("layer sessions", check_layer_sessions, t, client)
    except BaseException:
        server.kill()
        raise
    t.finish(server)


if __name__ == "__main__":
    main()
