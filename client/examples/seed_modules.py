"""The torch modules of the seed tutorials (../../../shared/seeds in the workspace), as the
tutorials write them, and their conversion to the service's native layer description.

Each `*_spec` function returns (config dict, weights dict) for
AttentionClient.load_layer / make_layer_spec. Used by the examples and by
tests/integration/test_torch_parity.py.
"""

import os
import sys
import types
from math import sqrt

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from attention_client import from_linears, linear, convert  # noqa: E402

# ---------------------------------------------------------------------------------------
# Seed 002: "implementing a very naive attention mechanism" (Raschka-style tutorial)
# ---------------------------------------------------------------------------------------
SEED_002_INPUTS = torch.tensor(
    [[0.43, 0.15, 0.89],
     [0.55, 0.87, 0.66],
     [0.57, 0.85, 0.64],
     [0.22, 0.58, 0.33],
     [0.77, 0.25, 0.10],
     [0.05, 0.80, 0.55]])

# Values the seed prints (4 decimals).
SEED_002_PRINTED = {
    "naive_weights": [
        [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
        [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
        [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
        [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
        [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
        [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896]],
    "naive_context": [
        [0.4421, 0.5931, 0.5790], [0.4419, 0.6515, 0.5683], [0.4431, 0.6496, 0.5671],
        [0.4304, 0.6298, 0.5510], [0.4671, 0.5910, 0.5266], [0.4177, 0.6503, 0.5645]],
    "attn_weights_2": [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820],
    "context_vec_2": [0.3061, 0.8210],
    # print(sa_v1(inputs)) after torch.manual_seed(123)
    "self_attention_v1": [
        [0.2996, 0.8053], [0.3061, 0.8210], [0.3058, 0.8203],
        [0.2948, 0.7939], [0.2927, 0.7891], [0.2990, 0.8040]],
    # print(sa_v2(inputs)) after torch.manual_seed(123)
    "self_attention_v2": [
        [-0.5337, -0.1051], [-0.5323, -0.1080], [-0.5323, -0.1079],
        [-0.5297, -0.1076], [-0.5311, -0.1066], [-0.5299, -0.1081]],
    # print(ca(batch)): the notebook builds `ca` without re-seeding, after cells that are
    # not shown (In [22]..In [26]) consumed an unknown amount of RNG, so these values are
    # not reproducible from the seed text; shown for reference only.
    "causal_attention_batch0": [
        [-0.2636, 0.4184], [-0.3537, 0.2172], [-0.3752, 0.1474],
        [-0.3611, 0.0971], [-0.2495, 0.0649], [-0.3074, 0.0523]],
    # print(mha(batch)) after torch.manual_seed(123), d_out=2, num_heads=2 (both batch rows)
    "multi_head_attention_batch0": [
        [0.3510, 0.4315], [0.3571, 0.3429], [0.3587, 0.3164],
        [0.3373, 0.3482], [0.3329, 0.3713], [0.3238, 0.3734]],
}


class SelfAttentionV1(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys = x @ self.W_key
        values = x @ self.W_value
        queries = x @ self.W_query
        attention_weights = torch.softmax((queries @ keys.T) / keys.shape[-1] ** 0.5, dim=-1)
        return attention_weights @ values


class SelfAttentionV2(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        values = self.W_value(x)
        queries = self.W_query(x)
        attention_weights = torch.softmax((queries @ keys.T) / keys.shape[-1] ** 0.5, dim=-1)
        return attention_weights @ values


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_K = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_Q = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_V = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = torch.nn.Dropout(dropout)
        self.register_buffer('mask', torch.triu(torch.ones(context_length, context_length),
                                                diagonal=1))

    def forward(self, x):
        keys = self.W_K(x)
        values = self.W_V(x)
        queries = self.W_Q(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores = attn_scores.masked_fill(self.mask.bool(), -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class MultiHeadAttention002(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert (d_out % num_heads == 0), "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer('mask', torch.triu(torch.ones(context_length, context_length),
                                                diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        values = self.W_value(x)
        queries = self.W_query(x)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores = attn_scores.masked_fill(self.mask.bool(), -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vector = (attn_weights @ values).transpose(1, 2)
        context_vector = context_vector.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vector)


def self_attention_v1_spec(m):
    # x @ W with W [d_in, d_out] is a Linear with weight W.T.
    d_in, d_out = m.W_query.shape
    return from_linears(d_in, 1, (m.W_query.T, None), (m.W_key.T, None), (m.W_value.T, None))


def self_attention_v2_spec(m):
    return from_linears(m.W_query.in_features, 1, linear(m.W_query), linear(m.W_key),
                        linear(m.W_value))


def causal_attention_spec(m):
    return from_linears(m.W_Q.in_features, 1, linear(m.W_Q), linear(m.W_K), linear(m.W_V),
                        always_causal=True)


def multi_head_attention_002_spec(m):
    return from_linears(m.W_query.in_features, m.num_heads, linear(m.W_query),
                        linear(m.W_key), linear(m.W_value), out=linear(m.out_proj),
                        always_causal=True)


# ---------------------------------------------------------------------------------------
# Seed 004: "GPT Series - Multi-head Self Attention"
# ---------------------------------------------------------------------------------------
class ScaledDotProduct(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask = self.register_buffer('mask', None)

    def create_causal_mask(self, inputs):
        mask = torch.ones_like(inputs, dtype=torch.bool)
        return torch.triu(mask, diagonal=1)

    def forward(self, keys, queries, values):
        x = torch.matmul(queries, keys.transpose(-1, -2))
        if self.mask is None or self.mask.shape[-1] != x.shape[-1]:
            self.mask = self.create_causal_mask(x)
        x = torch.masked_fill(x, mask=self.mask, value=-torch.inf)
        x /= keys.shape[-1] ** 0.5
        x = torch.softmax(x, -1)
        return torch.matmul(x, values)


class Attention004(nn.Module):
    def __init__(self, embedding_size, dk):
        super().__init__()
        self.__d = embedding_size
        self.__dk = dk
        self.__qkv = nn.Linear(self.__d, 2 * self.__dk + self.__d)
        self.__scaled_dot_product = ScaledDotProduct()

    def forward(self, x, *args, **kwargs):
        qkv = self.__qkv(x)
        queries, keys, values = torch.split(qkv, [self.__dk, self.__dk, self.__d], -1)
        return self.__scaled_dot_product(keys, queries, values)

    @property
    def qkv(self):
        return self.__qkv


class ScaledDotProductMHA004(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask = self.register_buffer('mask', None)

    def create_causal_mask(self, inputs):
        mask = torch.ones_like(inputs, dtype=torch.bool)
        return torch.triu(mask, diagonal=1)

    def forward(self, keys, queries, values):
        b, n, h, d2 = keys.shape
        x = torch.matmul(queries.reshape((b, h, n, d2)),
                         keys.reshape((b, h, n, d2)).transpose(-1, -2))
        if self.mask is None or self.mask.shape[-1] != x.shape[-1]:
            self.mask = self.create_causal_mask(x)
        x = torch.masked_fill(x, mask=self.mask, value=-torch.inf)
        x /= keys.shape[-1] ** 0.5
        x = torch.softmax(x, -1)
        x = torch.matmul(x, values.reshape((b, h, n, d2)))
        return x.reshape((b, n, h, d2))


class MultiHeadAttention004(nn.Module):
    """Seed 004's MHA. Note: it splits heads with reshape((b, h, n, d2)) instead of a
    transpose, which mixes tokens and heads; the service's layer does the standard split,
    so this module is reproduced through ScaledDotProductAttention on its own Q/K/V
    layout (see seed_004_mha_via_sdpa) and the standard split is checked separately."""

    def __init__(self, embedding_size, n_heads, masked=False):
        assert embedding_size % n_heads == 0
        super().__init__()
        self.__embedding_size = embedding_size
        self.__number_heads = n_heads
        self.__masked = masked
        self.__qkv = nn.Linear(self.__embedding_size, self.__embedding_size * 3)
        self.__scaled_dot_product = ScaledDotProductMHA004()
        self.__fc = nn.Linear(self.__embedding_size, self.__embedding_size)

    def forward(self, x, *args, **kwargs):
        qkv = self.__qkv(x)
        queries, keys, values = torch.split(qkv, [self.__embedding_size] * 3, -1)
        head_size = self.__embedding_size // self.__number_heads
        queries = queries.view(x.shape[0], x.shape[1], self.__number_heads, head_size)
        keys = keys.view(x.shape[0], x.shape[1], self.__number_heads, head_size)
        values = values.view(x.shape[0], x.shape[1], self.__number_heads, head_size)
        scaled = self.__scaled_dot_product(keys, queries, values)
        scaled = scaled.view(x.shape[0], x.shape[1], self.__embedding_size)
        return self.__fc(scaled)

    @property
    def qkv(self):
        return self.__qkv

    @property
    def fc(self):
        return self.__fc

    @property
    def num_heads(self):
        return self.__number_heads


def attention_004_spec(m):
    """Fused qkv Linear(d, 2*dk + d): one head, dk for Q/K, d for V, no output projection,
    causal (the seed always applies its triu mask)."""
    w, b = convert.to_numpy(m.qkv.weight), convert.to_numpy(m.qkv.bias)
    d = m.qkv.in_features
    dk = (m.qkv.out_features - d) // 2
    config = dict(embed_dim=d, num_heads=1, head_dim=dk, v_head_dim=d,
                  skip_output_projection=True, always_causal=True)
    return config, {"qkv_proj.weight": w, "qkv_proj.bias": b}


def multi_head_attention_004_standard_spec(m):
    """Seed 004's MHA weights as a standard (transpose-split) causal MHA layer."""
    e = m.qkv.in_features
    config = dict(embed_dim=e, num_heads=m.num_heads, always_causal=True)
    return config, {"qkv_proj.weight": convert.to_numpy(m.qkv.weight),
                    "qkv_proj.bias": convert.to_numpy(m.qkv.bias),
                    "out_proj.weight": convert.to_numpy(m.fc.weight),
                    "out_proj.bias": convert.to_numpy(m.fc.bias)}


def multi_head_attention_004_standard_torch(m, x):
    """What the standard split of seed 004's weights computes, in torch."""
    b, n, e = x.shape
    h = m.num_heads
    q, k, v = torch.split(m.qkv(x), [e] * 3, -1)
    q, k, v = (t.view(b, n, h, e // h).transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) / sqrt(e // h)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    ctx = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, n, e)
    return m.fc(ctx)


def seed_004_mha_qkv_layout(m, x):
    """Q, K, V exactly as seed 004's ScaledDotProductMHA multiplies them, [b, h, n, d2]."""
    b, n, e = x.shape
    h = m.num_heads
    q, k, v = torch.split(m.qkv(x), [e] * 3, -1)
    return tuple(t.reshape(b, h, n, e // h) for t in (q, k, v))


def seed_004_mha_finish(m, sdpa_out):
    """The rest of seed 004's MHA forward after attention: reshape back, then fc."""
    b, h, n, d2 = sdpa_out.shape
    return m.fc(sdpa_out.reshape(b, n, h, d2).reshape(b, n, h * d2))


# ---------------------------------------------------------------------------------------
# Seed 000: BERT-base-shaped MultiHeadAttention built from per-head AttentionHead modules
# ---------------------------------------------------------------------------------------
def scaled_dot_product_attention_000(query, key, value):
    dim_k = key.size(-1)
    dot_product = torch.bmm(query, key.transpose(1, 2))
    attention_weights = dot_product / sqrt(dim_k)
    scores = F.softmax(attention_weights, dim=-1)
    return torch.bmm(scores, value)


class AttentionHead(nn.Module):
    def __init__(self, embed_dim, head_dim):
        super().__init__()
        self.q = nn.Linear(embed_dim, head_dim)
        self.k = nn.Linear(embed_dim, head_dim)
        self.v = nn.Linear(embed_dim, head_dim)

    def forward(self, hidden_states):
        return scaled_dot_product_attention_000(
            self.q(hidden_states), self.k(hidden_states), self.v(hidden_states))


class MultiHeadAttention000(nn.Module):
    def __init__(self, config):
        super().__init__()
        embed_dim = config.hidden_size
        num_heads = config.num_attention_heads
        head_dim = embed_dim // num_heads
        self.heads = nn.ModuleList(
            [AttentionHead(embed_dim, head_dim) for _ in range(num_heads)])
        self.output_linear = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_state):
        x = torch.cat([head(hidden_state) for head in self.heads], dim=-1)
        return self.output_linear(x)


BERT_BASE_CONFIG = types.SimpleNamespace(hidden_size=768, num_attention_heads=12,
                                         vocab_size=30522)


def multi_head_attention_000_spec(m):
    """Per-head Linear(768, 64) modules stacked in head order = one [768, 768] projection."""
    def cat(attr, part):
        return torch.cat([getattr(getattr(h, attr), part) for h in m.heads], dim=0)
    e = m.output_linear.in_features
    return from_linears(e, len(m.heads), (cat("q", "weight"), cat("q", "bias")),
                        (cat("k", "weight"), cat("k", "bias")),
                        (cat("v", "weight"), cat("v", "bias")), out=linear(m.output_linear))


# ---------------------------------------------------------------------------------------
# Seed 001: single-head attention on BERT embeddings, and an MHA(d_model=512, 8 heads)
# ---------------------------------------------------------------------------------------
class SingleHead001(nn.Module):
    """query_layer / key_layer / value_layer = nn.Linear(768, 768), then softmax(QK^T /
    sqrt(768)) V, no output projection."""

    def __init__(self, d_model=768):
        super().__init__()
        self.query_layer = nn.Linear(d_model, d_model)
        self.key_layer = nn.Linear(d_model, d_model)
        self.value_layer = nn.Linear(d_model, d_model)

    def forward(self, token_embeddings):
        Q = self.query_layer(token_embeddings)
        K = self.key_layer(token_embeddings)
        V = self.value_layer(token_embeddings)
        d_k = Q.size(-1)
        scores = torch.matmul(Q, K.transpose(-1, -2)) / torch.sqrt(
            torch.tensor(d_k, dtype=torch.float32))
        return torch.matmul(torch.softmax(scores, dim=-1), V)


def single_head_001_spec(m):
    return from_linears(m.query_layer.in_features, 1, linear(m.query_layer),
                        linear(m.key_layer), linear(m.value_layer))


class MultiHeadAttention001(nn.Module):
    def __init__(self, d_model, num_heads, dropout):
        super().__init__()
        self.d_model = d_model
        self.num_heads = num_heads
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        self.d_k = d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def scaled_dot_product_attention(self, Q, K, V, mask=None):
        attn_scores = torch.matmul(Q, K.transpose(-2, -1)) / sqrt(self.d_k)
        if mask is not None:
            attn_scores = attn_scores.masked_fill(mask == 0, -1e9)
        attn_probs = torch.softmax(attn_scores, dim=-1)
        if self.dropout is not None:
            attn_probs = self.dropout(attn_probs)
        return torch.matmul(attn_probs, V)

    def forward(self, Q, K, V, mask=None):
        Q = self.W_q(Q)
        K = self.W_k(K)
        V = self.W_v(V)
        batch_size = Q.shape[0]
        Q = Q.view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        K = K.view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        V = V.view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        attn_output = self.scaled_dot_product_attention(Q, K, V, mask)
        attn_output = attn_output.transpose(1, 2).contiguous().view(
            attn_output.shape[0], -1, self.num_heads * self.d_k)
        return self.W_o(attn_output)


def multi_head_attention_001_spec(m):
    return from_linears(m.d_model, m.num_heads, linear(m.W_q), linear(m.W_k), linear(m.W_v),
                        out=linear(m.W_o))
