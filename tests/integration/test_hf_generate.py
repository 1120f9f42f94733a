#!/usr/bin/env python3
"""transformers' generate() with every attention layer on attention-service
(attention_client.hf), against the same model generating locally.

usage: test_hf_generate.py PATH/TO/attention-server [--seed=S]

Runs in build/hf-venv (transformers and PyPI's torch 2.x; scripts/hf-test-deps). Tiny
random-initialised float32 decoders (2 layers, hidden 64), the same weights in a local model
(attn_implementation "eager") and a served one (attention_client.hf.ATTENTION):
1. Greedy generation of 32 new tokens from a batch of left-padded prompts of different
   lengths (and one unpadded prompt): the same tokens, and every step's logits within
   rtol = atol = 1e-4 of local (the largest difference is printed per model). Models: Llama
   with GQA, MQA (1 KV head), head_dim != hidden / heads with a softmax scale that is not
   head_dim^-0.5, llama3 RoPE scaling, Qwen2 (q/k/v biases), Qwen3 (q/k norms), and when
   the server applies SessionConfig.sliding_window, Mistral and Qwen2 (sliding and full
   layers mixed: one session per prompt, each layer with its window) with a window shorter
   than the generation; a chunked prefill; beam search
   (reorder_cache), and a batch holding one prompt twice: rows that start identical continue
   on forks of one session (ServiceCache.shared_prompt_rows), with the same tokens.
2. Continuing from a cache and from its fork (ServiceCache.fork), on two different next
   tokens: each gives the tokens local generate() gives from the same prefix.
3. Rolling back with crop (TruncateSession) and generating again: the sessions hold the
   kept tokens, and the tokens match local generation from that prefix. crop takes what the
   installed transformers' caches take: a negative count, or also a length to keep (4.57,
   5.0), where newer releases refuse one.
4. Right padding (which the sessions cannot reproduce) raises ValueError; a forward
   without a ServiceCache raises; Gemma 2's logit soft-capping raises NotImplementedError;
   a sliding-window model (one window, or windows per layer) whose sessions come back
   without them (as from an older server) raises NotImplementedError; closed caches leave no session on the server. Every served generation is one SessionStep per layer per
   forward, with one entry per prompt.

On failure the seed is printed; the exit code is 1.
"""

import argparse
import copy
import sys

import torch
import transformers

import harness
from attention_client import AttentionClient
from attention_client import hf

NEW_TOKENS = 32
TOLERANCE = 1e-4  # rtol and atol of the logits
VOCAB = 96

torch.set_grad_enabled(False)


def tiny(kind, **overrides):
    """A small config of `kind` (llama, mistral, qwen2): 2 layers, hidden 64."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  # Larger weights than the default 0.02 make the logits of a random model
                  # decisive enough that greedy tokens do not hinge on float rounding.
                  initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    fields.update(overrides)
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                    "gemma2": transformers.Gemma2Config}[kind]
    return config_class(**fields)


def model_cases(sliding_window_served):
    cases = [
        ("llama GQA", tiny("llama"), {}),
        ("llama MQA", tiny("llama", num_key_value_heads=1), {}),
        ("llama head_dim 32, scale 0.3", tiny("llama", head_dim=32), {"scaling": 0.3}),
        # rope_scaling: the spelling 4.57 reads and 5.x converts to rope_parameters.
        ("llama3 rope scaling", tiny("llama", rope_scaling={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}), {}),
        ("qwen2 q/k/v bias", tiny("qwen2"), {}),
        ("qwen3 q/k norm, head_dim 32", tiny("qwen3", head_dim=32), {}),
    ]
    if sliding_window_served:
        cases += [
            ("mistral window 8", tiny("mistral", sliding_window=8), {}),
            ("qwen2 window 6 on layer 1", tiny("qwen2", use_sliding_window=True,
                                                sliding_window=6, max_window_layers=1), {}),
        ]
    return cases


def model_pair(config, seed, scaling=None):
    """The same random weights twice: attention local (eager) and on the service. Each
    model gets its own config: the attention implementation is kept there."""
    torch.manual_seed(seed)
    local = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation="eager")
    served = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                           attn_implementation=hf.ATTENTION)
    served.load_state_dict(local.state_dict())
    for model in (local, served):
        model.eval()
        if scaling is not None:  # the scale reaches the service as the `scaling` argument
            for layer in model.model.layers:
                layer.self_attn.scaling = scaling
    return local, served


def left_padded(lengths, seed):
    """Random prompts of `lengths`, left-padded with token 0: (input_ids, attention_mask)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(2, VOCAB, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


def greedy(model, ids, mask, new_tokens=NEW_TOKENS, cache=None, **options):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                          past_key_values=cache, **options)


def logits_difference(expected, got):
    """(largest |difference|, whether all steps are within TOLERANCE)."""
    largest, close = 0.0, len(expected) == len(got)
    for want, have in zip(expected, got):
        largest = max(largest, float((want - have).abs().max()))
        close = close and torch.allclose(have, want, rtol=TOLERANCE, atol=TOLERANCE)
    return largest, close


class CountingClient:
    """An AttentionClient that counts SessionStep calls and their entries."""

    def __init__(self, client):
        self.client, self.steps, self.entries = client, 0, 0

    def session_step(self, entries, **kwargs):
        self.steps += 1
        self.entries += len(entries)
        return self.client.session_step(entries, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


class Generations:
    def __init__(self, t, client, seed):
        self.t, self.client, self.seed = t, CountingClient(client), seed
        self.largest = {}  # case -> largest logit difference

    def cache(self, model, max_tokens=128):
        return hf.ServiceCache(self.client, model.config, max_tokens=max_tokens)

    def compare(self, name, local, served, ids, mask, shares_prompts=False, **options):
        """Greedy generation locally and through the service: same tokens, close logits.
        With `shares_prompts`, some rows start identical and continue on forks."""
        want = greedy(local, ids, mask, **options)
        steps, entries = self.client.steps, self.client.entries
        with self.cache(served) as cache:
            got = greedy(served, ids, mask, cache=cache, **options)
            shared = cache.shared_prompt_rows
        print("%s: %d rows continued on a fork of an identical row" % (name, shared))
        # Rows are twins only where torch computed them bitwise alike: at least one.
        self.t.check(shared >= 1 if shares_prompts else shared == 0,
                     "%s: %d rows shared an identical row's prompt" % (name, shared))
        if not options:  # one SessionStep per layer per forward, one entry per prompt
            layers, rows = served.config.num_hidden_layers, ids.shape[0]
            steps, entries = self.client.steps - steps, self.client.entries - entries
            self.t.check(steps == NEW_TOKENS * layers and entries == steps * rows,
                         "%s: %d SessionStep calls with %d entries, want %d with %d"
                         % (name, steps, entries, NEW_TOKENS * layers,
                            NEW_TOKENS * layers * rows))
        largest, close = logits_difference(want.logits, got.logits)
        self.largest[name] = max(largest, self.largest.get(name, 0.0))
        self.t.check(torch.equal(want.sequences, got.sequences),
                     "%s: tokens differ (seed %d)\n local  %s\n served %s"
                     % (name, self.seed, want.sequences.tolist(), got.sequences.tolist()))
        self.t.check(close, "%s: logits differ by up to %.3g (seed %d)"
                     % (name, largest, self.seed))

    def models(self, sliding_window_served):
        for number, (name, config, extra) in enumerate(model_cases(sliding_window_served)):
            local, served = model_pair(config, self.seed + number, **extra)
            ids, mask = left_padded([5, 11, 8], self.seed + number)
            self.t.run(name, self.compare, name, local, served, ids, mask)
        local, served = model_pair(tiny("llama"), self.seed)
        ids, mask = left_padded([9], self.seed)
        self.t.run("one prompt", self.compare, "llama GQA, one unpadded prompt", local, served,
                   ids, mask)
        ids, mask = left_padded([5, 11, 8], self.seed + 100)
        self.t.run("chunked prefill", self.compare, "llama GQA, prefill in chunks of 4", local,
                   served, ids, mask, prefill_chunk_size=4)
        self.t.run("beam search", self.compare, "llama GQA, beam search of 3", local, served,
                   ids, mask, shares_prompts=True, num_beams=3, new_tokens=16)
        twice = torch.cat([ids[1:2], ids]), torch.cat([mask[1:2], mask])
        self.t.run("a prompt twice", self.compare, "llama GQA, a prompt twice in a batch",
                   local, served, *twice, shares_prompts=True)

    def continued(self, name, local, served, cache, ids, mask, new_tokens):
        """Generation continued from `cache` (holding all but the last token of `ids`) vs
        local generation from the same prefix."""
        want = greedy(local, ids, mask, new_tokens)
        got = greedy(served, ids, mask, new_tokens, cache=cache)
        largest, _ = logits_difference(want.logits, got.logits)
        self.largest[name] = max(largest, self.largest.get(name, 0.0))
        self.t.check(torch.equal(want.sequences, got.sequences),
                     "%s: tokens differ (seed %d)\n local  %s\n served %s"
                     % (name, self.seed, want.sequences.tolist(), got.sequences.tolist()))

    def fork_and_crop(self):
        local, served = model_pair(tiny("llama"), self.seed + 200)
        ids, mask = left_padded([4, 10], self.seed + 200)
        with self.cache(served) as cache:
            first = greedy(served, ids, mask, 12, cache=cache).sequences
            prefix_mask = torch.cat([mask, torch.ones(2, 12, dtype=mask.dtype)], dim=1)
            with cache.fork() as twin:
                # The twin takes another next token; the original then continues as it
                # would have: neither may see the other's keys and values.
                other = first.clone()
                other[:, -1] = (first[:, -1] + 1) % VOCAB
                self.continued("fork", local, served, twin, other, prefix_mask, 10)
                self.continued("forked from", local, served, cache, first, prefix_mask, 10)
        with self.cache(served) as cache:
            full = greedy(served, ids, mask, NEW_TOKENS, cache=cache).sequences
            keep = ids.shape[1] + 10  # slots: the padded prompt and 10 generated tokens
            length = cache.get_seq_length()
            if hf.CROP_KEEPS_POSITIVE:  # this transformers' caches: crop(n > 0) keeps n slots
                cache.crop(length + 5)  # longer than the cache: nothing to remove
                self.t.check(cache.get_seq_length() == length,
                             "crop(%d) of %d slots changed them to %d"
                             % (length + 5, length, cache.get_seq_length()))
                cache.crop(keep)
            else:
                expect_raise(self.t, "crop of a positive count", ValueError,
                             lambda: cache.crop(keep))
                cache.crop(keep - length)
            lengths = [self.client.get_session(s).length for s in cache.groups[0].sessions]
            self.t.check(lengths == [4 + 10, 10 + 10] and cache.get_seq_length() == keep,
                         "after crop the sessions hold %s tokens and the cache %d slots, want "
                         "[14, 20] and %d" % (lengths, cache.get_seq_length(), keep))
            prefix_mask = torch.cat([mask, torch.ones(2, 11, dtype=mask.dtype)], dim=1)
            self.continued("crop", local, served, cache, full[:, :keep + 1], prefix_mask, 16)

    def refusals(self):
        local, served = model_pair(tiny("llama"), self.seed + 300)
        ids, mask = left_padded([6, 3], self.seed + 300)
        right = torch.stack([torch.roll(ids[1], -3), ids[0]]), torch.stack(
            [torch.roll(mask[1], -3), mask[0]])
        with self.cache(served) as cache:
            expect_raise(self.t, "right padding", ValueError,
                         lambda: greedy(served, *right, 4, cache=cache))
        expect_raise(self.t, "no ServiceCache", RuntimeError,
                     lambda: served(input_ids=ids, attention_mask=mask, use_cache=False))
        _, soft_capped = model_pair(tiny("gemma2", head_dim=16, attn_logit_softcapping=50.0,
                                         sliding_window=64), self.seed + 300)
        with self.cache(soft_capped) as cache:
            expect_raise(self.t, "logit soft-capping", NotImplementedError,
                         lambda: greedy(soft_capped, ids, mask, 2, cache=cache))
        left = self.client.list_sessions()
        self.t.check(left == [], "sessions left on the server: %s" % left)


def expect_raise(t, label, error, fn):
    try:
        fn()
    except error as e:
        print("%s raises %s: %s" % (label, error.__name__, str(e).splitlines()[0]))
        t.check(True, label)
        return
    except Exception as e:
        t.check(False, "%s: raised %r, want %s" % (label, e, error.__name__))
        return
    t.check(False, "%s: no %s" % (label, error.__name__))


def serves_sliding_window(client):
    """Whether the server knows SessionConfig.sliding_window (a server without it ignores
    the field and echoes a config without it)."""
    info = client.create_session(1, 1, 1, 8, 8, sliding_window=4)
    client.drop_session(info.session_id)
    return info.config.sliding_window == 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("--seed", type=int, default=2511)
    args = parser.parse_args()
    t = harness.Checker("test_hf_generate")
    print("seed %d, transformers %s, torch %s" % (args.seed, transformers.__version__,
                                                 torch.__version__))
    server = harness.ServerProcess(args.server, "--compute_threads=2", "--demo_layer=false",
                                   "--allow_list_sessions")
    server.start()
    try:
        with AttentionClient(server.target) as client:
            sliding = serves_sliding_window(client)
            if not sliding:
                print("the server has no SessionConfig.sliding_window: the sliding-window "
                      "models are left out")
            t.run("sliding window refused", check_sliding_refused, t, client)
            runs = Generations(t, client, args.seed)
            t.run("models", runs.models, sliding)
            t.run("fork and crop", runs.fork_and_crop)
            t.run("refusals", runs.refusals)
            for name, largest in runs.largest.items():
                print("largest logit difference, %-40s %.3g" % (name + ":", largest))
    except BaseException:
        server.kill()
        raise
    if t.failures:
        print("seed %d" % args.seed)
    t.finish(server)


class WindowlessServer(CountingClient):
    """A client whose sessions get no sliding window, as from a server older than
    SessionConfig.sliding_window and layer_sliding_windows (which ignores the fields)."""

    def create_session(self, *args, **kwargs):
        kwargs["sliding_window"] = 0
        kwargs["layer_sliding_windows"] = ()
        return self.client.create_session(*args, **kwargs)


def check_sliding_refused(t, client):
    """A server that does not apply the window gets a sliding-window model refused, not
    served as full attention."""
    ids, mask = left_padded([6], 0)
    for name, config in (("sliding window", tiny("mistral", sliding_window=4)),
                         ("windows per layer", tiny("qwen2", use_sliding_window=True,
                                                    sliding_window=4, max_window_layers=1))):
        _, served = model_pair(config, 0)
        with hf.ServiceCache(WindowlessServer(client), served.config, max_tokens=16) as cache:
            expect_raise(t, "%s on a server without it" % name, NotImplementedError,
                         lambda: greedy(served, ids, mask, 2, cache=cache))


if __name__ == "__main__":
    sys.exit(main())
