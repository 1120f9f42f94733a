#!/usr/bin/python3
"""Decode with a server-held KV cache: create a session, prefill a prompt's keys and values
in one step, then decode token by token, each step sending only the new token's q, k, v.
Every answer is checked against numpy's one-shot causal attention over the whole sequence.

    python3 client/examples/kv_session_decode.py              # starts build/server/attention-server
    python3 client/examples/kv_session_decode.py --target localhost:50051
"""
import numpy as np

from _common import connect, parse_args

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 8, 2, 64  # a small GQA model
PROMPT, NEW_TOKENS = 24, 8


def one_shot(q, k, v):
    """Causal attention of all tokens at once, float64: q [L, H, d], k and v [L, Hkv, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1)
    s = np.einsum("ihd,jhd->hij", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[1:], dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hij,jhd->ihd", p / p.sum(axis=-1, keepdims=True), v)


def main():
    args = parse_args(__doc__.splitlines()[0])
    rng = np.random.default_rng(0)
    total = PROMPT + NEW_TOKENS
    # What a model's projections and RoPE would produce for each token of each layer.
    qkv = [(rng.normal(size=(total, HEADS, HEAD_DIM)).astype(np.float32),
            rng.normal(size=(total, KV_HEADS, HEAD_DIM)).astype(np.float32),
            rng.normal(size=(total, KV_HEADS, HEAD_DIM)).astype(np.float32))
           for _ in range(LAYERS)]
    with connect(args) as client:
        session = client.create_session(LAYERS, HEADS, KV_HEADS, HEAD_DIM,
                                        reserved_tokens=total)
        print("session %s: %d layers, %d of %d query heads' KV, reserved %d tokens"
              % (session.session_id, LAYERS, KV_HEADS, HEADS, total))
        position, worst = 0, 0.0
        for n in [PROMPT] + [1] * NEW_TOKENS:  # the prompt in one step, then one token a step
            span = slice(position, position + n)
            outputs = client.session_step([(session.session_id, layer, position, q[span],
                                            k[span], v[span])
                                           for layer, (q, k, v) in enumerate(qkv)])
            for (q, k, v), output in zip(qkv, outputs):
                expected = one_shot(q[:position + n], k[:position + n], v[:position + n])[span]
                worst = max(worst, float(np.max(np.abs(output - expected))))
            position += n
        info = client.get_session(session.session_id)
        print("%d tokens in the session, %d KiB of KV blocks held; largest difference from "
              "numpy's float64 one-shot attention: %.2g" % (info.length, info.kv_bytes >> 10,
                                                            worst))
        client.drop_session(session.session_id)


if __name__ == "__main__":
    main()
