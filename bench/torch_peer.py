"""PyTorch 2.x as the peer of bench/compare.py: an "SDPA module" (one fused QKV nn.Linear(E, 3E),
split into heads, torch.nn.functional.scaled_dot_product_attention, merge heads, output
nn.Linear(E, E)) and nn.MultiheadAttention, timed on random inputs, in float32 and in
bfloat16 (the same modules `.to(torch.bfloat16)`: PyTorch's bf16 path, issue 26's peer). Run
with the bench venv's Python (scripts/bench-deps), which has torch 2.x; prints useful GFLOPS
of all four as JSON. Exits non-zero before timing if the two float32 modules disagree with the
same weights, or a bf16 one strays from them by more than bf16's rounding could (a twentieth
of the largest output), so a wrong peer is never reported.

    build/bench-venv/bin/python bench/torch_peer.py B N E H CAUSAL THREADS [MIN_SECONDS]
"""
import json
import sys

import torch

from measure import seconds_per_call, useful_flops


class SdpaAttention(torch.nn.Module):
    def __init__(self, embed_dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(embed_dim, 3 * embed_dim)
        self.out = torch.nn.Linear(embed_dim, embed_dim)

    def forward(self, x, causal):
        batch, tokens, embed_dim = x.shape
        # (B, N, 3E) -> three (B, H, N, E/H)
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(attended.transpose(1, 2).reshape(batch, tokens, embed_dim))


def main():
    batch, tokens, embed_dim, heads = (int(v) for v in sys.argv[1:5])
    causal = sys.argv[5] in ("1", "true", "True")
    threads = int(sys.argv[6])
    min_seconds = float(sys.argv[7]) if len(sys.argv) > 7 else 1.0
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    sdpa = SdpaAttention(embed_dim, heads).eval()
    mha = torch.nn.MultiheadAttention(embed_dim, heads, batch_first=True).eval()
    x = torch.randn(batch, tokens, embed_dim)
    # nn.MultiheadAttention insists on the mask with is_causal=True; is_causal lets it skip it.
    mask = torch.triu(torch.ones(tokens, tokens, dtype=torch.bool), 1) if causal else None
    with torch.inference_mode():
        # Same weights in both (in_proj packs q, k, v in the order the SDPA module splits them).
        mha.in_proj_weight.copy_(sdpa.qkv.weight)
        mha.in_proj_bias.copy_(sdpa.qkv.bias)
        mha.out_proj.weight.copy_(sdpa.out.weight)
        mha.out_proj.bias.copy_(sdpa.out.bias)
        sdpa_call = lambda: sdpa(x, causal)
        mha_call = lambda: mha(x, x, x, attn_mask=mask, need_weights=False, is_causal=causal)[0]
        difference = (sdpa_call() - mha_call()).abs().max().item()
        if difference >= 1e-4:
            sys.exit(f"torch_peer: SDPA module and nn.MultiheadAttention differ by {difference}")
        flops = useful_flops(batch, tokens, embed_dim, causal)
        result = {"torch": torch.__version__}
        reference = sdpa_call().float()
        result["sdpa_gflops"] = flops / seconds_per_call(sdpa_call, min_seconds) / 1e9
        result["mha_gflops"] = flops / seconds_per_call(mha_call, min_seconds) / 1e9
        sdpa.to(torch.bfloat16)
        mha.to(torch.bfloat16)
        x16 = x.to(torch.bfloat16)
        sdpa16_call = lambda: sdpa(x16, causal)
        mha16_call = lambda: mha(x16, x16, x16, attn_mask=mask, need_weights=False,
                                 is_causal=causal)[0]
        for name, call in (("sdpa_bf16", sdpa16_call), ("mha_bf16", mha16_call)):
            stray = (call().float() - reference).abs().max().item()
            if not stray <= reference.abs().max().item() / 20:
                sys.exit(f"torch_peer: {name} strays from float32 by {stray}")
            result[name + "_gflops"] = flops / seconds_per_call(call, min_seconds) / 1e9
        # The shape's QKV product as one bf16 matmul: the matrix engine's ceiling (oneDNN on
        # AMX tiles where the CPU has them), against which a layer's bf16 speed is read.
        tokens16 = torch.randn(batch * tokens, embed_dim).to(torch.bfloat16)
        qkv16 = torch.randn(embed_dim, 3 * embed_dim).to(torch.bfloat16)
        matmul_seconds = seconds_per_call(lambda: tokens16 @ qkv16, min_seconds)
        result["matmul_bf16_gflops"] = 2 * batch * tokens * embed_dim * 3 * embed_dim / \
            matmul_seconds / 1e9
    print(json.dumps(result))


if __name__ == "__main__":
    main()
