#!/usr/bin/env python3
"""A Hugging Face model generating with every attention layer on attention-service, the KV
cache held in server sessions (attention_client.hf); compared with the same model
generating locally.

    build/hf-venv/bin/python client/examples/hf_generate.py      # a tiny random Llama
    build/hf-venv/bin/python client/examples/hf_generate.py --target localhost:50051
    build/hf-venv/bin/python client/examples/hf_generate.py --model PATH --prompt "Hello"

Needs transformers >= 4.57 and torch (build/hf-venv has them: scripts/hf-test-deps).
"""
import copy
import sys

import torch
import transformers

from _common import connect, parse_args
from attention_client import hf


def add_arguments(parser):
    parser.add_argument("--model", help="a Llama / Qwen2 / Mistral checkpoint (directory or "
                        "hub name); a tiny random Llama when not given")
    parser.add_argument("--prompt", action="append",
                        help="prompt text (repeat for a batch; with --model)")
    parser.add_argument("--new_tokens", type=int, default=32)


def tiny_llama():
    """A random 2-layer Llama with GQA, and a left-padded batch of two token prompts."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.tensor([[0, 0, 0, 5, 17, 42, 8], [3, 9, 27, 64, 11, 2, 50]])
    return model, None, {"input_ids": ids, "attention_mask": (ids != 0).long()}


def pretrained(name, prompts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(name, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    return model, tokenizer, dict(tokenizer(prompts or ["The capital of France is"],
                                            return_tensors="pt", padding=True))


def main():
    args = parse_args(__doc__.splitlines()[0], add_arguments)
    model, tokenizer, inputs = (pretrained(args.model, args.prompt) if args.model
                                else tiny_llama())
    local = model.eval()
    # A second model on the same weights whose attention runs on the service.
    served = copy.deepcopy(local)
    served.set_attn_implementation(hf.ATTENTION)
    options = dict(max_new_tokens=args.new_tokens, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=local.config.pad_token_id)
    prompt_tokens = inputs["input_ids"].shape[1]
    with connect(args) as client:
        with hf.ServiceCache(client, served.config,
                             max_tokens=prompt_tokens + args.new_tokens) as cache:
            got = served.generate(**inputs, past_key_values=cache, **options)
            print("%d sessions (one per prompt), lengths %s" % (
                len(cache.groups[0].sessions),
                [client.get_session(s).length for s in cache.groups[0].sessions]))
    want = local.generate(**inputs, **options)
    for row, tokens in enumerate(got.sequences[:, prompt_tokens:].tolist()):
        text = tokenizer.decode(tokens) if tokenizer is not None else tokens
        print("prompt %d -> %s" % (row, text))
    largest = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
    same = torch.equal(got.sequences, want.sequences)
    print("same tokens as local generate(): %s; largest logit difference %.2g"
          % ("yes" if same else "NO", largest))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
