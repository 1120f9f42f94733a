"""A Hugging Face transformers decoder (Llama, Qwen2, Mistral) whose attention layers run on
attention-service, the KV cache held by the server; model.generate() is unchanged on top.

    from transformers import AutoModelForCausalLM
    from attention_client import AttentionClient
    from attention_client import hf

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=hf.ATTENTION)
    with AttentionClient(target) as client, \\
            hf.ServiceCache(client, model.config, max_tokens=prompt + new) as cache:
        tokens = model.generate(**inputs, cache=cache, max_new_tokens=new)

(transformers 5.24 names generate()'s cache argument cache=; before 5.24 it is
past_key_values=, which 5.24 still takes with a deprecation warning until 6.0.)

How: importing this module registers the attention implementation ATTENTION with
transformers' AttentionInterface (and a mask function with AttentionMaskInterface that always
materialises the 4D mask, so padding is never dropped). The model projects Q, K and V and
applies RoPE as usual; ServiceCache.update() keeps no tensors, it only counts each layer's
slots and hands the new K/V on to the attention function, which sends one SessionStep per
layer per forward (one entry per batch row) and gets the attention output back.

One server session per batch row, holding every layer (each with its own sliding window, as
Gemma's and Qwen2's layers differ). The server
attends causally over everything a session holds and has no mask, so a row's session gets
only the row's real tokens (a slot is real when some query may attend to it); padding slots
stay on the client as bookkeeping and their query rows get zeros. Before a forward is sent,
its 4D mask is compared with what the sessions will compute; a mask they cannot reproduce
(right padding, a custom 4D mask) raises ValueError instead of answering differently.

Supported: transformers >= 4.57, < 6 (SUPPORTED_TRANSFORMERS; tested at both ends released,
4.57.6 and 5.24.0, and at 5.0.0 and 5.23.0), PyTorch 2.x. (Older releases in the range size
masks by the forward's cache_position and take crop(n > 0) as a length to keep; both are
handled.) Not supported: attention dropout (training), output_attentions (no weights come
back), layers with different head shapes or softmax scales in one model, chunked attention,
sliding-window layers on a server without SessionConfig.sliding_window, or layers of
different windows on one without SessionConfig.layer_sliding_windows (refused),
logit soft-capping, attention sinks, position biases and non-causal layers (refused:
UNSUPPORTED_ARGUMENTS), torch.compile (the cache is not compileable).

A session call the server refuses raises attention_client.SessionError out of generate() and
the cache's methods alike: its .reason says why (e.g. SESSION_EXPIRED after an idle ttl_ms,
KV_POOL_EXHAUSTED when the server's KV cache is full).
"""

import inspect
import threading

import numpy as np
import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "attention_service"
SUPPORTED_TRANSFORMERS = (Version("4.57"), Version("6"))  # [low, high)
# Older releases' caches take crop(n > 0) as the length to keep (4.57 and 5.0 do, 5.22 raises).
CROP_KEEPS_POSITIVE = "max_length" in inspect.signature(DynamicLayer.crop).parameters

if not SUPPORTED_TRANSFORMERS[0] <= Version(transformers.__version__) < SUPPORTED_TRANSFORMERS[1]:
    raise ImportError("attention_client.hf supports transformers >= %s, < %s; this is %s"
                      % (SUPPORTED_TRANSFORMERS + (transformers.__version__,)))

# ServiceCache.update() runs right before the attention function in every layer, and the
# attention function's arguments do not include the cache: update() leaves (cache, layer, key)
# here and the attention function takes them, checking that `key` is the very tensor.
_handoff = threading.local()


def service_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, **kwargs):
    """The attention implementation registered as ATTENTION. query [B, H, q, dk]; key and
    value [B, Hkv, q, d]: the forward's new tokens only (ServiceCache.update returns them
    unchanged). Returns ([B, q, H, dv], None)."""
    pending = getattr(_handoff, "pending", None)
    _handoff.pending = None
    if pending is None or pending[1] != module.layer_idx or pending[2] is not key:
        raise RuntimeError(
            "attn_implementation=%r needs a ServiceCache: pass past_key_values="
            "attention_client.hf.ServiceCache(...) to generate() or forward(), with "
            "use_cache left on" % ATTENTION)
    if dropout:
        raise NotImplementedError("the service has no attention dropout (train locally)")
    refuse_other_attention(module, kwargs)
    cache = pending[0]
    output = cache.attend(module.layer_idx, query, key, value, attention_mask,
                          scaling if scaling is not None else module.scaling, sliding_window)
    return output, None


# Arguments some models pass to change the attention itself (Gemma 2's logit soft-capping,
# gpt-oss's sinks, T5-style position biases): the sessions compute none of them.
UNSUPPORTED_ARGUMENTS = ("softcap", "s_aux", "sinks", "position_bias")


def refuse_other_attention(module, kwargs):
    """Raises NotImplementedError where the model asks for attention the sessions do not
    compute, instead of answering as if it had not."""
    for name in UNSUPPORTED_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise NotImplementedError("%s (layer %d) passes %s=, which attention-service "
                                      "sessions do not compute" % (type(module).__name__,
                                                                   module.layer_idx, name))
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise NotImplementedError("%s (layer %d) is not causal; attention-service sessions "
                                  "are" % (type(module).__name__, module.layer_idx))


def materialised_mask(*args, **kwargs):
    """transformers' boolean 4D mask [B, 1, q, kv] (True = may attend), never skipped: with
    None for "plain causal" the padding of a batch would be lost."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register():
    """Registers ATTENTION (done on import; repeating it is harmless)."""
    AttentionInterface.register(ATTENTION, service_attention)
    AttentionMaskInterface.register(ATTENTION, materialised_mask)


register()


def layer_windows(config):
    """The sliding window of each decoder layer (None: full attention), as transformers'
    masks apply it: Mistral's sliding_window on every layer, Qwen2's on its
    "sliding_attention" layer_types."""
    count = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * count
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise NotImplementedError("layer types %s are not supported (full_attention and "
                                  "sliding_attention are)" % unknown)
    return [window if kind == "sliding_attention" else None for kind in types[:count]]


class ServiceLayer(CacheLayerMixin):
    """One decoder layer's view of a ServiceCache: no tensors, only how many slots (tokens,
    padding included) the model has passed through it, which is what transformers sizes
    masks and positions by."""

    is_sliding = False  # sliding layers keep every slot too: the server applies the window
    is_croppable = True

    def __init__(self):
        super().__init__()
        self.slots = 0

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.lazy_initialization(key_states, value_states)
        self.slots += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length):
        if torch.is_tensor(query_length):  # older releases: the forward's cache_position
            query_length = query_length.shape[0]
        return self.slots + query_length, 0

    def get_seq_length(self):
        return self.slots

    def get_max_length(self):
        return -1

    def get_max_cache_shape(self):  # get_max_length's name in older releases
        return -1

    def reset(self):  # the mixin's would zero key / value tensors this layer does not have
        self.slots = 0


class SessionGroup:
    """The model's layers, and one server session per batch row holding their keys and
    values, each layer with its own sliding window."""

    def __init__(self, windows):
        self.windows = windows  # per layer: its sliding window, None for full attention
        self.layers = list(range(len(windows)))  # a session's layer i is model layer i
        self.sessions = []  # session id per batch row


class ForwardPlan:
    """What one forward sends, from its mask: per batch row, the new slots that are real and
    the session position of the first one. Shared by all layers of the forward."""

    def __init__(self, start, length, real, new_slots, first_positions):
        self.start = start  # slots before the forward
        self.length = length  # slots it adds
        self.real = real  # bool [B, start + length]: every slot so far
        self.new_slots = new_slots  # per row: LongTensor of real slots in [0, length)
        self.first_positions = first_positions  # per row: session position of new_slots[0]
        self.checked_masks = []  # (mask, window) pairs compared with the sessions' semantics


class ServiceCache(Cache):
    """A transformers Cache whose keys and values live in attention-service sessions.

    client: an AttentionClient. config: the model's config. max_tokens: real tokens a batch
    row may reach (prompt + new tokens is enough); the server reserves them when the
    sessions are created, at the first forward. kv_dtype: "float32" or "bfloat16" storage.
    ttl_ms: session idle expiry (0: the server's --session_ttl).

    Use it for one batch; close() (or leaving a `with` block) drops the sessions. crop()
    truncates them, fork() copies them (copy-on-write on the server), and beam search's
    reorder_cache / batch_select_indices fork and drop rows.

    Rows that start identical (beam search and num_return_sequences repeat each prompt; a
    batch may hold one prompt twice) share their prompt: after the first forward, a row
    whose real tokens and keys and values in every layer are those of an earlier row
    continues on a fork of that row's session (the same bits, so the same answers), and the
    server reads the shared blocks once for the forks it steps together.
    shared_prompt_rows counts them."""

    def __init__(self, client, config, max_tokens, *, kv_dtype="float32", ttl_ms=0,
                 timeout=None):
        self.text_config = config.get_text_config(decoder=True)
        super().__init__(layers=[ServiceLayer()
                                 for _ in range(self.text_config.num_hidden_layers)])
        self.client = client
        self.max_tokens = int(max_tokens)
        self.kv_dtype = kv_dtype
        self.ttl_ms = ttl_ms
        self.timeout = timeout
        self.groups = [SessionGroup(layer_windows(self.text_config))]
        self.group_of_layer = {layer: (group, index) for group in self.groups
                               for index, layer in enumerate(group.layers)}
        self.shape = None  # (H, Hkv, dk, dv, scale) the sessions were created with
        self.real = None  # bool [B, slots]: which slots the sessions hold
        self.plan = None
        # During the forward that created the sessions: row -> the earlier row it has been
        # identical to in every layer so far (see share_identical_prompts).
        self.prompt_twins = None
        self.shared_prompt_rows = 0

    # --- transformers' Cache interface -------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.layers[layer_idx].update(key_states, value_states)
        _handoff.pending = (self, layer_idx, key_states)
        return key_states, value_states

    def crop(self, tokens_to_remove):
        """Removes the last -tokens_to_remove slots (a count <= 0) from every layer and
        truncates the sessions to the real tokens before them. Where the installed
        transformers' own caches take a positive length to keep (CROP_KEEPS_POSITIVE), so
        does this."""
        length = self.get_seq_length()
        if tokens_to_remove > 0:
            if not CROP_KEEPS_POSITIVE:
                raise ValueError("crop takes the negative number of tokens to remove, not %d"
                                 % tokens_to_remove)
            tokens_to_remove = min(tokens_to_remove, length) - length
        if tokens_to_remove == 0:
            return
        self.truncate(length + tokens_to_remove)

    def reset(self):
        self.truncate(0)

    def reorder_cache(self, beam_idx):
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices):
        self.select_rows(indices)

    def batch_repeat_interleave(self, repeats):
        rows = 0 if self.real is None else self.real.shape[0]
        self.select_rows(torch.arange(rows).repeat_interleave(repeats))

    # --- sessions -------------------------------------------------------------------------

    def truncate(self, slots):
        """Keeps the first `slots` slots of every layer."""
        if not 0 <= slots <= self.get_seq_length():
            raise ValueError("cannot keep %d of %d slots" % (slots, self.get_seq_length()))
        for layer in self.layers:
            layer.slots = slots
        self.plan = None
        if self.real is None:
            return
        self.real = self.real[:, :slots]
        for row, tokens in enumerate(self.real.sum(dim=1).tolist()):
            for group in self.groups:
                self.client.truncate_session(group.sessions[row], tokens, timeout=self.timeout)

    def fork(self):
        """A new ServiceCache with the same slots, whose sessions are forks of these (the
        server shares their KV blocks copy-on-write): continue both independently."""
        twin = ServiceCache(self.client, self.text_config, self.max_tokens,
                            kv_dtype=self.kv_dtype, ttl_ms=self.ttl_ms, timeout=self.timeout)
        for mine, theirs in zip(self.layers, twin.layers):
            theirs.slots, theirs.is_initialized = mine.slots, mine.is_initialized
        twin.shape = self.shape
        if self.real is not None:
            twin.real = self.real.clone()
            tokens = self.real.sum(dim=1).tolist()
            for mine, theirs in zip(self.groups, twin.groups):
                theirs.sessions = [self.fork_session(session, count)
                                   for session, count in zip(mine.sessions, tokens)]
        return twin

    def fork_session(self, session, tokens):
        return self.client.fork_session(session, tokens, self.max_tokens, ttl_ms=self.ttl_ms,
                                        timeout=self.timeout).session_id

    def select_rows(self, indices):
        """Row i becomes old row indices[i]: the first row taking an old session keeps it,
        others fork it, and sessions no row takes are dropped."""
        self.plan = None
        if self.real is None:
            return
        indices = [int(i) for i in torch.as_tensor(indices).tolist()]
        tokens = self.real.sum(dim=1).tolist()
        for group in self.groups:
            taken, sessions = set(), []
            for source in indices:
                if source in taken:
                    sessions.append(self.fork_session(group.sessions[source], tokens[source]))
                else:
                    taken.add(source)
                    sessions.append(group.sessions[source])
            for row, session in enumerate(group.sessions):
                if row not in taken:
                    self.client.drop_session(session, timeout=self.timeout)
            group.sessions = sessions
        self.real = self.real[indices]

    def create_sessions(self, rows, shape):
        heads, kv_heads, head_dim, v_head_dim, scale = shape
        for group in self.groups:
            windows = [window or 0 for window in group.windows]
            one_window = len(set(windows)) == 1
            for _ in range(rows):
                info = self.client.create_session(
                    len(group.layers), heads, kv_heads, head_dim, self.max_tokens,
                    v_head_dim=v_head_dim, kv_dtype=self.kv_dtype, scale=scale,
                    sliding_window=windows[0] if one_window else 0,
                    layer_sliding_windows=() if one_window else windows, ttl_ms=self.ttl_ms,
                    timeout=self.timeout)
                group.sessions.append(info.session_id)
                # A server older than SessionConfig.sliding_window (or layer_sliding_windows)
                # ignores the field: its echo of the config then says so, and its answers
                # would differ.
                applied = (list(info.config.layer_sliding_windows)
                           or [info.config.sliding_window] * len(windows))
                if applied != windows:
                    raise NotImplementedError(
                        "the server does not apply the sliding windows %s (its session has "
                        "%s); sliding-window models need a server that has "
                        "SessionConfig.sliding_window, and layer_sliding_windows where "
                        "layers differ" % (windows, applied))
        self.shape = shape
        self.prompt_twins = {}

    def close(self):
        """Drops the sessions (the cache is empty afterwards)."""
        for group in self.groups:
            for session in group.sessions:
                self.client.drop_session(session, timeout=self.timeout)
            group.sessions = []
        self.real, self.plan, self.shape, self.prompt_twins = None, None, None, None
        for layer in self.layers:
            layer.slots = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- a layer's attention ----------------------------------------------------------------

    def attend(self, layer_idx, query, key, value, attention_mask, scale, sliding_window):
        """One SessionStep: each batch row's real new tokens of layer `layer_idx`; returns
        [B, q, H, dv] with zeros for padding query rows."""
        rows, heads, length, head_dim = query.shape
        shape = (heads, key.shape[1], head_dim, value.shape[-1], float(scale))
        if self.shape is None:
            self.create_sessions(rows, shape)
        elif shape != self.shape:
            raise NotImplementedError("layer %d has heads/dims/scale %s, the sessions %s; one "
                                      "shape for all layers is supported"
                                      % (layer_idx, shape, self.shape))
        group, index = self.group_of_layer[layer_idx]
        window = group.windows[index]
        if (sliding_window or None) != window:
            raise ValueError("layer %d attends with sliding_window=%s, the config says %s"
                             % (layer_idx, sliding_window, window))
        if rows != len(group.sessions):
            raise ValueError("this ServiceCache holds %d rows; the forward has %d"
                             % (len(group.sessions), rows))
        start = self.layers[layer_idx].slots - length
        plan = self.plan_for(start, length, attention_mask, rows, query.device)
        self.check_mask(plan, attention_mask, window)

        entries, row_slots = [], []
        for row in range(rows):
            slots = plan.new_slots[row]
            if len(slots) == 0:
                continue
            entries.append((group.sessions[row], index, plan.first_positions[row],
                            tokens_of(query, row, slots), tokens_of(key, row, slots),
                            tokens_of(value, row, slots)))
            row_slots.append((row, slots))
        output = query.new_zeros(rows, length, heads, value.shape[-1])
        if entries:
            answers = self.client.session_step(entries, output_dtype="float32",
                                               timeout=self.timeout)
            for (row, slots), answer in zip(row_slots, answers):
                output[row, slots] = torch.from_numpy(np.asarray(answer)).to(output)
        if self.prompt_twins is not None:
            self.share_identical_prompts(group, index, plan, key, value)
        return output

    def share_identical_prompts(self, group, index, plan, key, value):
        """In the forward that created the sessions, layer by layer: keeps the rows whose
        real slots, keys and values are bitwise an earlier row's (its first such row); after
        the last layer, each such row's session is dropped for a fork of that row's, which
        holds the very same keys and values."""
        same = {}
        for row in range(len(plan.new_slots)):
            slots = plan.new_slots[row]
            if len(slots) == 0 or (index > 0 and row not in self.prompt_twins):
                continue
            # The first layer looks at every earlier row, the others at the one it matched.
            for earlier in range(row) if index == 0 else [self.prompt_twins[row]]:
                if (torch.equal(plan.real[row], plan.real[earlier])
                        and torch.equal(tokens_of(key, row, slots), tokens_of(key, earlier, slots))
                        and torch.equal(tokens_of(value, row, slots),
                                        tokens_of(value, earlier, slots))):
                    same[row] = earlier
                    break
        self.prompt_twins = same
        if index != len(group.layers) - 1:
            return
        tokens = plan.real.sum(dim=1).tolist()
        for row, source in same.items():
            forked = self.fork_session(group.sessions[source], tokens[source])
            self.client.drop_session(group.sessions[row], timeout=self.timeout)
            group.sessions[row] = forked
        self.shared_prompt_rows += len(same)
        self.prompt_twins = None

    def plan_for(self, start, length, attention_mask, rows, device):
        """The forward's plan: made by its first layer, reused by the others."""
        plan = self.plan
        if plan is not None and plan.start == start and plan.length == length:
            return plan
        past = self.real if self.real is not None else torch.zeros(rows, 0, dtype=torch.bool)
        if past.shape[1] < start:
            raise RuntimeError("the cache knows %d slots, the forward starts at %d"
                               % (past.shape[1], start))
        allowed = allowed_keys(attention_mask, rows, length, start + length)
        if allowed is None:  # no mask at all: every new token is real
            new_real = torch.ones(rows, length, dtype=torch.bool)
        else:
            new_real = allowed[:, :, start:].any(dim=1)
        real = torch.cat([past[:, :start].cpu(), new_real.cpu()], dim=1)
        before = real[:, :start].sum(dim=1).tolist()
        new_slots = [torch.nonzero(new_real[row]).flatten().to(device) for row in range(rows)]
        self.real = real
        self.plan = ForwardPlan(start, length, real, new_slots, before)
        return self.plan

    def check_mask(self, plan, attention_mask, window):
        """Compares the forward's mask with what the sessions compute (causal over a row's
        real tokens, within the window), once per mask and window of the forward."""
        if attention_mask is None or any(m is attention_mask and w == window
                                         for m, w in plan.checked_masks):
            return
        allowed = allowed_keys(attention_mask, plan.real.shape[0], plan.length,
                               plan.start + plan.length).cpu()
        expected = session_semantics(plan.real, plan.start, window)
        if not torch.equal(allowed, expected):
            row, query, slot = [int(i) for i in torch.nonzero(allowed != expected)[0]]
            raise ValueError(
                "the attention mask lets slot %d of row %d %s key slot %d, the service's "
                "sessions (causal over the row's real tokens%s) would %s; left padding and "
                "transformers' own causal / sliding masks are supported, right padding and "
                "custom masks are not"
                % (plan.start + query, row, "attend" if allowed[row, query, slot] else
                   "not attend", slot, "" if window is None else ", window %d" % window,
                   "not" if allowed[row, query, slot] else "attend"))
        plan.checked_masks.append((attention_mask, window))


def tokens_of(states, row, slots):
    """[B, heads, q, d] -> the row's tokens at `slots` as the server takes them, [n, heads, d]."""
    return states[row, :, slots].transpose(0, 1)


def allowed_keys(attention_mask, rows, queries, keys):
    """A 4D transformers mask ([B, 1, q, kv], bool or 0 / large negative float) as bool
    [B, q, kv]; None stays None."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or (
            tuple(attention_mask.shape[2:]) != (queries, keys)):
        raise ValueError("expected a [%d, 1, %d, %d] attention mask, got %s (is the cache "
                         "in step with the inputs?)" % (rows, queries, keys,
                                                        tuple(attention_mask.shape)))
    mask = attention_mask[:, 0].expand(rows, queries, keys)
    if mask.dtype == torch.bool:
        return mask
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not torch.all(blocked | (mask == 0)):
        raise ValueError("additive attention biases other than 0 / -inf are not supported")
    return ~blocked


def session_semantics(real, start, window):
    """bool [B, q, kv]: which slots each query slot of a forward starting at `start` attends
    on the server, where a row's real tokens are numbered 0, 1, ... (session positions) and
    token p attends positions p - window + 1 .. p; padding query slots attend nothing."""
    position = real.long().cumsum(dim=1) - 1  # [B, kv], valid where real
    query_real, query_position = real[:, start:], position[:, start:]
    attends = (real[:, None, :] & query_real[:, :, None]
               & (position[:, None, :] <= query_position[:, :, None]))
    if window is not None:
        attends &= position[:, None, :] > query_position[:, :, None] - window
    return attends
