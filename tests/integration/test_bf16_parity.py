#!/usr/bin/python3
"""bfloat16 layers (LayerConfig.compute_dtype = BFLOAT16) and SDPA in bfloat16 and float16
(ScaledDotProductAttentionRequest.compute_dtype) over the wire against PyTorch 2.x computing
the same in that dtype, by issue 26's rule (FlashAttention's, with the
same-dtype reference):

    max|service - float64| <= 2 * max|torch bf16 - float64| + 4e-3 * max|float64|

(for float16: torch fp16 and 5e-4, about one fp16 unit).

torch bf16 is nn.Linear projections, Llama rotate-half RoPE and F.scaled_dot_product_attention
(enable_gqa) in bfloat16, or nn.MultiheadAttention in bfloat16; float64 is the same layer on
the original float32 weights and inputs. Requests are sent in float32 (answered in float32)
and in bfloat16 (answered in bfloat16: the rounding of the answer is within the floor).

usage: test_bf16_parity.py PATH/TO/attention-server [--configs=N] [--seed=S] [--device=cuda]
Runs in build/hf-venv (scripts/hf-test-deps --run): Debian's torch 1.13 has no enable_gqa.
"""

import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import harness
from attention_client import AttentionClient, make_layer_spec
from test_torch_parity import cast, causal_allowed, in_dtype, rotary, uniform_init

FLOOR_FRACTION = 4e-3
FP16_FLOOR_FRACTION = 5e-4
torch.set_grad_enabled(False)


class Bf16Rule:
    def __init__(self, checker):
        self.t = checker
        self.ratios = []

    def compare(self, label, actual, reference, oracle, config, floor=FLOOR_FRACTION):
        actual = np.asarray(actual, dtype=np.float64)
        reference = np.asarray(reference, dtype=np.float64)
        oracle = np.asarray(oracle, dtype=np.float64)
        if actual.shape != oracle.shape:
            return self.t.check(False, "%s: shape %s, want %s" % (label, actual.shape,
                                                                  oracle.shape))
        error = np.max(np.abs(actual - oracle))
        reference_error = np.max(np.abs(reference - oracle))
        allowed = 2 * reference_error + floor * np.max(np.abs(oracle))
        if reference_error > 0:
            self.ratios.append(error / reference_error)
        return self.t.check(
            bool(np.all(np.isfinite(actual))) and error <= allowed,
            "%s: max|service - float64| = %.3g, allowed 2 * %.3g (torch, same dtype) + %g * %.3g; "
            "configuration %s" % (label, error, reference_error, floor,
                                  np.max(np.abs(oracle)), config))


def native_layer(rule, client, seed):
    """A random native layer (GQA, dk != dv, cross-attention, fused QKV, RoPE, causal,
    no output projection), loaded as BFLOAT16 and as FLOAT32."""
    rng = np.random.default_rng(seed)
    h = int(rng.choice([2, 4, 8]))
    hkv = int(rng.choice([d for d in range(1, h + 1) if h % d == 0]))
    e = int(rng.choice([16, 48, 64, 100, 256]))
    dk = int(rng.choice([8, 16, 32, 64]))
    dv = int(rng.choice([dk, 5, 24]))
    cross = bool(rng.random() < 0.3)
    kdim, vdim = (int(rng.integers(3, 70)), int(rng.integers(3, 70))) if cross else (e, e)
    skip_out = bool(rng.random() < 0.2)
    bias = bool(rng.random() < 0.6)
    rope = 0.0 if cross or rng.random() < 0.5 else 10000.0
    causal = bool(rng.random() < 0.5)
    b = int(rng.integers(1, 4))
    nq = int(rng.choice([1, 7, 40, 130, 300]))
    nk = max(nq, int(rng.integers(1, 200))) if cross else nq  # no fully masked causal rows
    out_dim = h * dv if skip_out else e
    cfg = dict(seed=seed, h=h, hkv=hkv, e=e, dk=dk, dv=dv, cross=cross, kdim=kdim, vdim=vdim,
               skip_out=skip_out, bias=bias, rope=rope, causal=causal, b=b, nq=nq, nk=nk)
    torch.manual_seed(seed)
    lin = lambda o, i, with_bias: nn.Linear(i, o, bias=with_bias).double()
    qp, kp, vp = lin(h * dk, e, bias), lin(hkv * dk, kdim, bias), lin(hkv * dv, vdim, bias)
    op = None if skip_out else lin(out_dim, h * dv, bias)
    for mod in (qp, kp, vp, op):
        if mod is not None:
            uniform_init(mod, seed)
    x = rng.normal(size=(b, nq, e)).astype(np.float32)
    kin = rng.normal(size=(b, nk, kdim)).astype(np.float32) if cross else x
    vin = rng.normal(size=(b, nk, vdim)).astype(np.float32) if cross else x
    allowed = torch.from_numpy(causal_allowed(nq, nk) if causal else np.ones((nq, nk), bool))

    def forward(dt):
        q = in_dtype(qp, dt)(cast(x, dt)).view(b, nq, h, dk).transpose(1, 2)
        k = in_dtype(kp, dt)(cast(kin, dt)).view(b, nk, hkv, dk).transpose(1, 2)
        v = in_dtype(vp, dt)(cast(vin, dt)).view(b, nk, hkv, dv).transpose(1, 2)
        if rope:
            q, k = rotary(q, rope), rotary(k, rope)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        ctx = ctx.transpose(1, 2).reshape(b, nq, h * dv)
        return (ctx if op is None else in_dtype(op, dt)(ctx)).float().numpy()

    np32 = lambda t: t.detach().float().numpy()
    weights = {}
    for name, mod in (("q_proj", qp), ("k_proj", kp), ("v_proj", vp), ("out_proj", op)):
        if mod is not None:
            weights[name + ".weight"] = np32(mod.weight)
            if bias:
                weights[name + ".bias"] = np32(mod.bias)
    config = dict(embed_dim=e, num_heads=h, num_kv_heads=hkv, head_dim=dk, v_head_dim=dv,
                  kdim=kdim, vdim=vdim, output_dim=out_dim, no_qkv_bias=not bias,
                  no_output_bias=not bias, skip_output_projection=skip_out, rope_theta=rope,
                  compute_dtype="bfloat16")
    name = "bf16-layer-%d" % seed
    info = client.load_layer(name, config, weights)
    float_name = name + "-f32"
    float_info = client.load_layer(float_name, dict(config, compute_dtype="float32"), weights)
    ok = rule.t.check(info.dtype == 3 and info.config.compute_dtype == 3,  # BFLOAT16
                      "%s: LayerInfo says dtype %d, config.compute_dtype %d"
                      % (name, info.dtype, info.config.compute_dtype))
    ok &= rule.t.check(info.weight_bytes <= 0.55 * float_info.weight_bytes,
                       "%s: holds %d bytes, float32 %d" % (name, info.weight_bytes,
                                                           float_info.weight_bytes))
    try:
        reference, oracle = forward(torch.bfloat16), forward(torch.float64)
        for dtype in ("float32", "bfloat16"):
            r = client.multi_head_attention(x, kin if cross else None, vin if cross else None,
                                            layer=name, causal=causal, dtype=dtype)
            ok &= rule.compare("layer[seed=%d] %s" % (seed, dtype), r.output, reference, oracle,
                               cfg)
        # The same layer sent inline with the request: the same answer.
        inline = client.multi_head_attention(
            x, kin if cross else None, vin if cross else None, causal=causal,
            layer_spec=make_layer_spec(config, weights))
        ok &= rule.compare("inline[seed=%d]" % seed, inline.output, reference, oracle, cfg)
    finally:
        client.unload_layer(name)
        client.unload_layer(float_name)
    return ok


def torch_mha(rule, client, seed):
    """nn.MultiheadAttention in bfloat16 (batch_first, key_padding_mask), and the service's
    zeros where PyTorch's bf16 module answers NaN: a fully padded batch item."""
    rng = np.random.default_rng(seed)
    e, h = int(rng.choice([64, 96, 256])), int(rng.choice([4, 8]))
    b, n = 3, int(rng.choice([9, 64, 200]))
    torch.manual_seed(seed)
    module = nn.MultiheadAttention(e, h, batch_first=True).double().eval()
    uniform_init(module, seed)
    x = rng.normal(size=(b, n, e)).astype(np.float32)
    padding = np.zeros((b, n), bool)
    padding[1, n // 2:] = True  # half padded
    padding[2, :] = True        # fully padded
    kept = [0, 1]

    def forward(dt):
        m = in_dtype(module, dt)
        xs = cast(x, dt)
        out = m(xs[kept], xs[kept], xs[kept], key_padding_mask=torch.from_numpy(padding[kept]),
                need_weights=False)[0]
        return out.float().numpy()

    np32 = lambda t: t.detach().float().numpy()
    weights = {"qkv_proj.weight": np32(module.in_proj_weight),
               "qkv_proj.bias": np32(module.in_proj_bias),
               "out_proj.weight": np32(module.out_proj.weight),
               "out_proj.bias": np32(module.out_proj.bias)}
    name = "bf16-mha-%d" % seed
    client.load_layer(name, dict(embed_dim=e, num_heads=h, compute_dtype="bfloat16"), weights)
    try:
        r = client.multi_head_attention(x, layer=name, key_padding_mask=padding)
    finally:
        client.unload_layer(name)
    cfg = dict(seed=seed, e=e, h=h, n=n)
    ok = rule.compare("mha[seed=%d]" % seed, r.output[kept], forward(torch.bfloat16),
                      forward(torch.float64), cfg)
    # No key to attend: a zero context, so the output is the output projection's bias.
    bias = module.out_proj.bias.to(torch.bfloat16).float().numpy()
    ok &= rule.t.check(np.array_equal(r.output[2], np.broadcast_to(bias, (n, e))),
                       "mha[seed=%d]: a fully padded item answers its output bias, not %s"
                       % (seed, r.output[2][0, :4]))
    return ok


def sdpa_half(rule, client, seed, dtype=torch.bfloat16):
    """ScaledDotProductAttention with compute_dtype BFLOAT16 (or FLOAT16) on tensors of that
    dtype, answered in it, against F.scaled_dot_product_attention on the same tensors (GQA,
    causal bottom-right, head sizes of the usual models, one key block and several)."""
    rng = np.random.default_rng(seed)
    b, kv_heads, group = int(rng.integers(1, 3)), int(rng.choice([1, 2])), int(rng.choice([1, 4]))
    heads = kv_heads * group
    nk = int(rng.choice([1, 16, 100, 300, 1100]))
    nq = int(rng.choice([1, 7, 64, 130]))
    dk = int(rng.choice([16, 64, 80, 128]))
    causal = bool(rng.random() < 0.4)
    if causal:
        nq = min(nq, nk)  # PyTorch answers NaN for rows with no key
    half = lambda *shape: torch.from_numpy(rng.normal(size=shape).astype(np.float32)).to(dtype)
    q, k, v = half(b, heads, nq, dk), half(b, kv_heads, nk, dk), half(b, kv_heads, nk, dk)
    allowed = torch.from_numpy(causal_allowed(nq, nk) if causal else np.ones((nq, nk), bool))

    def forward(dt):
        return F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), attn_mask=allowed,
                                              enable_gqa=True).double().numpy()

    name = str(dtype).rsplit(".", 1)[-1]
    r = client.scaled_dot_product_attention(q, k, v, causal=causal, compute_dtype=name)
    ok = rule.t.check(r.output.dtype == dtype,
                      "sdpa[seed=%d]: answered in %s, not %s" % (seed, r.output.dtype, name))
    cfg = dict(seed=seed, b=b, heads=heads, kv_heads=kv_heads, nq=nq, nk=nk, dk=dk,
               causal=causal, dtype=name)
    floor = FLOOR_FRACTION if dtype == torch.bfloat16 else FP16_FLOOR_FRACTION
    return ok & rule.compare("sdpa[seed=%d]" % seed, r.output.double().numpy(),
                             forward(dtype), forward(torch.float64), cfg, floor)


def refusals(rule, client):
    """compute_dtype BOOL for SDPA, and FLOAT16 for layers, is INVALID_ARGUMENT naming the
    field."""
    x = np.ones((1, 1, 2, 4), np.float32)
    try:
        client.scaled_dot_product_attention(x, x, x, compute_dtype="bool")
        ok = rule.t.check(False, "SDPA compute_dtype BOOL was accepted")
    except Exception as error:  # grpc.RpcError
        ok = rule.t.check(error.code().name == "INVALID_ARGUMENT"
                          and "compute_dtype = BOOL" in error.details(),
                          "SDPA BOOL compute: %s %s" % (error.code(), error.details()))
    return ok & layer_refusal(rule, client)


def layer_refusal(rule, client):
    try:
        client.load_layer("bf16-refused", dict(embed_dim=8, num_heads=2,
                                               compute_dtype="float16"), random_seed=1)
    except Exception as error:  # grpc.RpcError
        return rule.t.check(error.code().name == "INVALID_ARGUMENT"
                            and "compute_dtype = FLOAT16" in error.details(),
                            "FLOAT16 compute: %s %s" % (error.code(), error.details()))
    return rule.t.check(False, "compute_dtype FLOAT16 was accepted")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("--configs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--device", default="cpu",
                        help="the server's --device; a GPU that is not there skips the test")
    args = parser.parse_args()
    t = harness.Checker("test_bf16_parity[%s]" % args.device)
    rule = Bf16Rule(t)
    server = harness.start_server_on_device(args.server, args.device, "--demo_layer=false",
                                            "--compute_threads=2")
    try:
        with AttentionClient(server.target) as client:
            for i in range(args.configs):
                t.run("layer[seed=%d]" % (args.seed + i), native_layer, rule, client,
                      args.seed + i)
            for i in range(6):
                t.run("mha[seed=%d]" % (args.seed + 1000 + i), torch_mha, rule, client,
                      args.seed + 1000 + i)
            for i in range(args.configs):
                t.run("sdpa[seed=%d]" % (args.seed + 2000 + i), sdpa_half, rule, client,
                      args.seed + 2000 + i)
            for i in range(args.configs // 2):
                t.run("sdpa fp16[seed=%d]" % (args.seed + 3000 + i), sdpa_half, rule, client,
                      args.seed + 3000 + i, torch.float16)
            t.run("refusals", refusals, rule, client)
    except BaseException:
        server.kill()
        raise
    r = np.array(rule.ratios)
    print("%d tensors by issue 26's rule against torch %s in the same dtype; error ratio "
          "service / torch: median %.2f, p99 %.2f, max %.2f"
          % (len(r), torch.__version__, np.median(r), np.percentile(r, 99), np.max(r)))
    t.finish(server)


if __name__ == "__main__":
    main()
