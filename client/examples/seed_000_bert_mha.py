#!/usr/bin/python3
"""Seed 000 through the service: the BERT-base-shaped MultiHeadAttention (embed 768,
12 heads of 64, built from per-head AttentionHead modules + output_linear) applied to
"time flies like an arrow". The tokenizer / embedding table of bert-base-uncased are not
needed for the attention math, so 5 tokens are embedded with a seeded nn.Embedding.

    /usr/bin/python3 client/examples/seed_000_bert_mha.py [--target=HOST:PORT]
"""

import torch
from torch import nn

import _common
import seed_modules as sm


def main():
    args = _common.parse_args(__doc__)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    text = "time flies like an arrow"
    config = sm.BERT_BASE_CONFIG
    # Stand-in token ids (the seed uses the bert-base-uncased tokenizer).
    input_ids = torch.tensor([[2051, 10029, 2066, 2019, 8612]])
    token_emb = nn.Embedding(config.vocab_size, config.hidden_size)
    input_embs = token_emb(input_ids)  # [1, 5, 768]
    multihead_attn = sm.MultiHeadAttention000(config).eval()
    expected = multihead_attn(input_embs)
    with _common.connect(args) as client:
        layer_config, weights = sm.multi_head_attention_000_spec(multihead_attn)
        info = client.load_layer("seed000-bert-mha", layer_config, weights)
        print("text %r -> input %s; layer with %d parameters" % (
            text, list(input_embs.shape), info.parameter_count))
        r = client.multi_head_attention(input_embs.numpy(), layer="seed000-bert-mha",
                                        need_weights="averaged")
        print("attn_output shape: service %s, torch %s" % (list(r.output.shape),
                                                           list(expected.shape)))
        _common.show("attention output (first 6 of 768 features per token)", r.output,
                     expected)
        heads = torch.stack([
            torch.softmax(h.q(input_embs) @ h.k(input_embs).transpose(1, 2) / 8.0, -1)
            for h in multihead_attn.heads]).mean(0)
        _common.show("attention weights averaged over the 12 heads", r.weights, heads)
        client.unload_layer("seed000-bert-mha")


if __name__ == "__main__":
    main()
