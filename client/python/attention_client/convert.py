"""Converts PyTorch weights to the service's native tensor names (WEIGHT_NAMING_NATIVE).

The server reads a PyTorch MHA, HF BERT or HF Llama state_dict itself (sources.inline or
sources.safetensors with a naming); these helpers are for modules no naming fits. Inputs may
be numpy arrays or torch tensors (torch is not imported here).
"""

import numpy as np

from . import tensors


def to_numpy(value):
    return np.ascontiguousarray(tensors.to_numpy(value), dtype=np.float32)


def from_torch_mha(state_dict, num_heads):
    """nn.MultiheadAttention state_dict -> (config dict, native weights dict).

    Handles in_proj_weight (rows Q, K, V) and the separate q/k/v_proj_weight used when
    kdim/vdim != embed_dim, bias on/off. add_bias_kv (bias_k / bias_v) is not expressible.
    """
    sd = {k: to_numpy(v) for k, v in state_dict.items()}
    if "bias_k" in sd or "bias_v" in sd:
        raise ValueError("add_bias_kv=True has no native equivalent")
    weights = {}
    if "in_proj_weight" in sd:
        embed_dim = sd["in_proj_weight"].shape[1]
        q, k, v = np.split(sd["in_proj_weight"], 3, axis=0)
        kdim = vdim = embed_dim
    else:
        q, k, v = sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"]
        embed_dim, kdim, vdim = q.shape[1], k.shape[1], v.shape[1]
    weights["q_proj.weight"], weights["k_proj.weight"], weights["v_proj.weight"] = q, k, v
    has_bias = "in_proj_bias" in sd
    if has_bias:
        qb, kb, vb = np.split(sd["in_proj_bias"], 3)
        weights["q_proj.bias"], weights["k_proj.bias"], weights["v_proj.bias"] = qb, kb, vb
    weights["out_proj.weight"] = sd["out_proj.weight"]
    has_out_bias = "out_proj.bias" in sd
    if has_out_bias:
        weights["out_proj.bias"] = sd["out_proj.bias"]
    config = dict(embed_dim=embed_dim, num_heads=num_heads, kdim=kdim, vdim=vdim,
                  no_qkv_bias=not has_bias, no_output_bias=not has_out_bias)
    return config, weights


def from_linears(embed_dim, num_heads, q, k, v, out=None, **config):
    """Separate nn.Linear-like (weight, bias-or-None) pairs -> (config dict, weights dict).

    q, k, v, out are (weight [out, in], bias [out] or None); out=None means no output
    projection. Extra keyword arguments go into the config (head_dim, v_head_dim, ...).
    head_dim / v_head_dim default to the projection sizes divided by num_heads.
    """
    weights = {}
    qw, kw, vw = to_numpy(q[0]), to_numpy(k[0]), to_numpy(v[0])
    weights.update({"q_proj.weight": qw, "k_proj.weight": kw, "v_proj.weight": vw})
    biases = [b for _, b in (q, k, v)]
    if all(b is not None for b in biases):
        weights.update({"q_proj.bias": to_numpy(q[1]), "k_proj.bias": to_numpy(k[1]),
                        "v_proj.bias": to_numpy(v[1])})
    elif any(b is not None for b in biases):
        raise ValueError("q, k, v must all have a bias or none")
    cfg = dict(embed_dim=embed_dim, num_heads=num_heads,
               head_dim=qw.shape[0] // num_heads, v_head_dim=vw.shape[0] // num_heads,
               kdim=kw.shape[1], vdim=vw.shape[1], no_qkv_bias=biases[0] is None)
    if out is None:
        cfg["skip_output_projection"] = True
        cfg["no_output_bias"] = True
    else:
        weights["out_proj.weight"] = to_numpy(out[0])
        cfg["output_dim"] = weights["out_proj.weight"].shape[0]
        if out[1] is not None:
            weights["out_proj.bias"] = to_numpy(out[1])
        else:
            cfg["no_output_bias"] = True
    cfg.update(config)
    return cfg, weights


def linear(module):
    """nn.Linear -> (weight, bias-or-None), for from_linears."""
    return module.weight, module.bias
