#!/usr/bin/python3
"""Seed 004 through the service: the single-head `Attention` with a fused
qkv = nn.Linear(d, 2*dk + d) (dk for queries/keys, d for values), causal, no output
projection; and the seed's MultiHeadAttention (fused qkv Linear(E, 3E) + fc, causal).

The seed's MHA splits heads with reshape((b, h, n, d2)) rather than a transpose, so it is
not a standard MHA layer; it is reproduced by sending exactly its Q/K/V layout to
ScaledDotProductAttention, and its weights are also run as a standard causal MHA layer.

    /usr/bin/python3 client/examples/seed_004_attention.py [--target=HOST:PORT]
"""

import torch

import _common
import seed_modules as sm


def main():
    args = _common.parse_args(__doc__)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    d, dk, n, b = 16, 8, 7, 2
    x = torch.randn(b, n, d)
    with _common.connect(args) as client:
        attention = sm.Attention004(d, dk).eval()
        config, weights = sm.attention_004_spec(attention)
        client.load_layer("seed004-attention", config, weights)
        info = client.get_layer("seed004-attention")
        print("layer seed004-attention: %d parameters (seed formula d*(2*dk+d) + bias = %d)"
              % (info.parameter_count, d * (2 * dk + d) + 2 * dk + d))
        r = client.multi_head_attention(x.numpy(), layer="seed004-attention")
        _common.show("Attention(d=%d, dk=%d), causal, output [b, n, d]" % (d, dk), r.output,
                     attention(x))
        client.unload_layer("seed004-attention")

        e, h = 24, 4
        mha = sm.MultiHeadAttention004(e, h).eval()
        xe = torch.randn(b, n, e)
        q, k, v = sm.seed_004_mha_qkv_layout(mha, xe)
        r = client.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), causal=True)
        out = sm.seed_004_mha_finish(mha, torch.from_numpy(r.output))
        _common.show("seed MultiHeadAttention(E=%d, heads=%d) via SDPA on its own Q/K/V"
                     % (e, h), out, mha(xe))

        config, weights = sm.multi_head_attention_004_standard_spec(mha)
        client.load_layer("seed004-mha", config, weights)
        r = client.multi_head_attention(xe.numpy(), layer="seed004-mha")
        _common.show("same weights as a standard causal MHA layer (transpose head split)",
                     r.output, sm.multi_head_attention_004_standard_torch(mha, xe))
        client.unload_layer("seed004-mha")


if __name__ == "__main__":
    main()
