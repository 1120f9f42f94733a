#!/usr/bin/python3
"""Seed 002 through the service: the naive attention (ScaledDotProductAttention, scale=1),
the single-query trainable attention, SelfAttentionV1 / V2, CausalAttention and the
tutorial's MultiHeadAttention after torch.manual_seed(123), each printed next to PyTorch's
result and the values the seed prints.

    /usr/bin/python3 client/examples/seed_002_attention.py [--target=HOST:PORT]
"""

import numpy as np
import torch

import _common
import seed_modules as sm
from attention_client import make_layer_spec


def main():
    args = _common.parse_args(__doc__)
    torch.set_grad_enabled(False)
    printed = sm.SEED_002_PRINTED
    inputs = sm.SEED_002_INPUTS
    with _common.connect(args) as client:
        # Naive attention: softmax(X X^T) X, i.e. SDPA with Q = K = V = inputs, scale 1.
        x = inputs.numpy()[None, None]  # [B=1, H=1, N=6, d=3]
        r = client.scaled_dot_product_attention(x, x, x, scale=1.0, need_weights="per_head")
        torch_w = torch.softmax(inputs @ inputs.T, dim=-1)
        _common.show("naive attention weights", r.weights[0, 0], torch_w,
                     printed["naive_weights"])
        _common.show("naive context vectors", r.output[0, 0], torch_w @ inputs,
                     printed["naive_context"])

        # Trainable weights W_q, W_k, W_v = torch.rand(3, 2) after manual_seed(123); query x_2.
        torch.manual_seed(123)
        sa_v1 = sm.SelfAttentionV1(3, 2)
        q = (inputs[1] @ sa_v1.W_query)[None, None, None]   # [1, 1, 1, 2]
        k = (inputs @ sa_v1.W_key)[None, None]              # [1, 1, 6, 2]
        v = (inputs @ sa_v1.W_value)[None, None]
        r = client.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(),
                                                need_weights="per_head")
        torch_w2 = torch.softmax((q @ k.transpose(-1, -2)) / 2 ** 0.5, dim=-1)
        _common.show("attn_weights_2 (query x_2)", r.weights.reshape(1, 6),
                     torch_w2.reshape(1, 6), [printed["attn_weights_2"]])
        _common.show("context_vec_2", r.output.reshape(1, 2), (torch_w2 @ v).reshape(1, 2),
                     [printed["context_vec_2"]])

        # SelfAttentionV1 (same weights) as a layer: 1 head, dk = 2, no output projection.
        config, weights = sm.self_attention_v1_spec(sa_v1)
        r = client.multi_head_attention(inputs.numpy()[None],
                                        layer_spec=make_layer_spec(config, weights))
        _common.show("SelfAttentionV1 after manual_seed(123)", r.output[0], sa_v1(inputs),
                     printed["self_attention_v1"])

        torch.manual_seed(123)
        sa_v2 = sm.SelfAttentionV2(3, 2)
        config, weights = sm.self_attention_v2_spec(sa_v2)
        client.load_layer("seed002-self-attention-v2", config, weights)
        r = client.multi_head_attention(inputs.numpy()[None], layer="seed002-self-attention-v2")
        _common.show("SelfAttentionV2 after manual_seed(123)", r.output[0], sa_v2(inputs),
                     printed["self_attention_v2"])

        batch = torch.stack((inputs, inputs))
        torch.manual_seed(123)
        ca = sm.CausalAttention(3, 2, batch.shape[1], 0.0).eval()
        config, weights = sm.causal_attention_spec(ca)
        client.load_layer("seed002-causal-attention", config, weights)
        r = client.multi_head_attention(batch.numpy(), layer="seed002-causal-attention")
        _common.show("CausalAttention after manual_seed(123)", r.output, ca(batch))
        print("  (the seed prints CausalAttention from an RNG state left by notebook cells it "
              "does not show, so its printed values cannot be regenerated; first row printed: "
              "%s)" % printed["causal_attention_batch0"][0])

        torch.manual_seed(123)
        mha = sm.MultiHeadAttention002(3, 2, batch.shape[1], 0.0, num_heads=2).eval()
        config, weights = sm.multi_head_attention_002_spec(mha)
        client.load_layer("seed002-multi-head-attention", config, weights)
        r = client.multi_head_attention(batch.numpy(), layer="seed002-multi-head-attention")
        _common.show("MultiHeadAttention(d_out=2, num_heads=2) after manual_seed(123)",
                     r.output, mha(batch), printed["multi_head_attention_batch0"] * 2)
        for name in ("seed002-self-attention-v2", "seed002-causal-attention",
                     "seed002-multi-head-attention"):
            client.unload_layer(name)


if __name__ == "__main__":
    main()
