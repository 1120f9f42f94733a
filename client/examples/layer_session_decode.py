#!/usr/bin/python3
"""Decode through a layer the server holds, with the KV cache on the server: load a
Llama-style attention layer (GQA, RoPE), create a session over it, prefill a prompt's hidden
states in one step, then decode token by token, each step sending only the new token's hidden
state; the server projects, rotates at the token's position, attends over the cache and
projects out. Every answer is compared with the stateless MultiHeadAttention call over the
whole sequence (causal), which recomputes everything each time.

    python3 client/examples/layer_session_decode.py              # starts build/server/attention-server
    python3 client/examples/layer_session_decode.py --target localhost:50051
"""
import numpy as np

from _common import connect, parse_args

LAYER = "example-decoder-layer"
CONFIG = {"embed_dim": 512, "num_heads": 8, "num_kv_heads": 2, "rope_theta": 10000.0,
          "always_causal": True, "no_qkv_bias": True, "no_output_bias": True}
PROMPT, NEW_TOKENS = 24, 8


def main():
    args = parse_args(__doc__.splitlines()[0])
    rng = np.random.default_rng(0)
    total = PROMPT + NEW_TOKENS
    # What the model's previous block would hand this layer, one row per token.
    hidden = rng.normal(size=(total, CONFIG["embed_dim"])).astype(np.float32)
    with connect(args) as client:
        client.load_layer(LAYER, CONFIG, random_seed=1)
        session = client.create_layer_session([LAYER], reserved_tokens=total)
        print("session %s over %s: %d query heads, %d KV heads of %d dims"
              % (session.session_id, LAYER, session.config.num_heads,
                 session.config.num_kv_heads, session.config.head_dim))
        position, worst = 0, 0.0
        for n in [PROMPT] + [1] * NEW_TOKENS:  # the prompt in one step, then one token a step
            (output,) = client.session_step([(session.session_id, 0, position,
                                              hidden[position:position + n])])
            # The stateless call sends the whole sequence so far and keeps nothing.
            stateless = client.multi_head_attention(hidden[None, :position + n], layer=LAYER,
                                                    causal=True).output[0, position:]
            worst = max(worst, float(np.max(np.abs(output - stateless))))
            position += n
        info = client.get_session(session.session_id)
        print("%d tokens in the session, %d KiB of KV blocks held; largest difference from the "
              "stateless layer over the whole sequence: %.2g" % (info.length, info.kv_bytes >> 10,
                                                                 worst))
        client.drop_session(session.session_id)
        client.unload_layer(LAYER)


if __name__ == "__main__":
    main()
