"""The asyncio client (grpc.aio): AttentionClient's methods as coroutines.

    async with AsyncAttentionClient("localhost:50051") as client:
        results = await asyncio.gather(*(client.multi_head_attention(x, layer="enc0")
                                         for x in batches))

Requests are built and answers read by attention_client.messages and ClientBase, as in the
blocking client; arguments, results and errors (grpc.aio.AioRpcError, a grpc.RpcError; the
session methods' SessionError) are the same.
Create it inside the event loop that uses it.
"""

import asyncio

import grpc.aio

from . import messages
from .client import AttentionClient, ClientBase
from .errors import follows_handoffs, from_stream_answer, raises_session_errors


class AsyncAttentionClient(ClientBase):
    """One grpc.aio channel; usable from the event loop it was created in."""

    _grpc = grpc.aio

    async def close(self):
        await self._channel.close()
        with self._replicas_lock:
            channels = [channel for channel, _ in self._replica_channels.values()]
            self._replica_channels.clear()
        for channel in channels:
            await channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def wait_ready(self, timeout=30.0):
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def health(self, service=""):
        return messages.health_status(await self._health_check(
            messages.health_request(service), timeout=self.timeout))

    async def multi_head_attention(self, query, key=None, value=None, *, timeout=None,
                                   **kwargs):
        request = messages.mha_request(query, key, value, **kwargs)
        return messages.attention_result(
            await self._stub.MultiHeadAttention(request, timeout=self._timeout(timeout)), query)

    async def scaled_dot_product_attention(self, query, key, value, *, timeout=None,
                                           **kwargs):
        request = messages.sdpa_request(query, key, value, **kwargs)
        return messages.attention_result(
            await self._stub.ScaledDotProductAttention(request, timeout=self._timeout(timeout)),
            query)

    async def load_layer(self, name, config=None, weights=None, random_seed=None, *,
                         timeout=None, **kwargs):
        request = messages.load_layer_request(name, config, weights, random_seed, **kwargs)
        return (await self._stub.LoadLayer(request, timeout=self._timeout(timeout),
                                           metadata=self._admin_metadata)).layer

    async def inspect_checkpoint(self, path, offset=0, max_tensors=0, timeout=None):
        request = self._pb2.InspectCheckpointRequest(path=path, offset=offset,
                                                     max_tensors=max_tensors)
        return await self._stub.InspectCheckpoint(request, timeout=self._timeout(timeout),
                                                  metadata=self._admin_metadata)

    async def get_layer(self, name, timeout=None):
        return (await self._stub.GetLayer(self._pb2.GetLayerRequest(name=name),
                                          timeout=self._timeout(timeout))).layer

    async def list_layers(self, timeout=None):
        return list((await self._stub.ListLayers(self._pb2.ListLayersRequest(),
                                                 timeout=self._timeout(timeout))).layers)

    async def unload_layer(self, name, timeout=None):
        await self._stub.UnloadLayer(self._pb2.UnloadLayerRequest(name=name),
                                     timeout=self._timeout(timeout),
                                     metadata=self._admin_metadata)

    # KV-cache sessions, as the blocking client's: each session's calls go to its replica.

    @raises_session_errors
    async def create_session(self, *args, timeout=None, **kwargs):
        request = self._create_session_request(*args, **kwargs)
        return self._pin((await self._stub.CreateSession(
            request, timeout=self._timeout(timeout), metadata=self._session_metadata)).session)

    @raises_session_errors
    async def create_layer_session(self, *args, timeout=None, **kwargs):
        request = self._layer_session_request(*args, **kwargs)
        return self._pin((await self._stub.CreateSession(
            request, timeout=self._timeout(timeout), metadata=self._session_metadata)).session)

    @follows_handoffs
    @raises_session_errors
    async def session_step(self, entries, *, return_log_sum_exp=False, output_dtype=None,
                           timeout=None):
        parts = self._step_requests(entries, self._step_request(return_log_sum_exp, output_dtype))
        # Each replica's part at once.
        responses = await asyncio.gather(*(
            stub.SessionStep(part, timeout=self._timeout(timeout),
                             metadata=self._session_metadata)
            for stub, (part, _) in parts.items()))
        results = [None] * len(entries)
        for (_, indices), response in zip(parts.values(), responses):
            for index, result in zip(indices, response.results):
                results[index] = result
        return self._step_outputs(results, return_log_sum_exp)

    @raises_session_errors
    async def session_step_stream(self, steps, *, return_log_sum_exp=False, output_dtype=None,
                                  timeout=None):
        """As the blocking client's, with `steps` an iterable or async iterable of
        (request_id, entries); an async generator of (request_id, outputs)."""
        steps = steps.__aiter__() if hasattr(steps, "__aiter__") else _async_iter(steps)
        first = await _anext_or_none(steps)
        if first is None:
            return
        stub = self._session_stub(first[1][0][0]) if first[1] else self._stub

        async def requests():
            step = first
            while step is not None:
                request_id, entries = step
                request = self._step_request(return_log_sum_exp, output_dtype, request_id)
                for entry in entries:
                    self._add_entry(request, entry)
                yield request
                step = await _anext_or_none(steps)

        call = stub.SessionStepStream(requests(), timeout=self._timeout(timeout),
                                      metadata=self._session_metadata)
        async for answer in call:
            if answer.error_code:
                yield answer.request_id, from_stream_answer(answer)
            else:
                yield answer.request_id, self._step_outputs(answer.response.results,
                                                            return_log_sum_exp)

    @follows_handoffs
    @raises_session_errors
    async def fork_session(self, session_id, tokens, reserved_tokens=0, *, ttl_ms=0,
                           timeout=None):
        request = self._fork_request(session_id, tokens, reserved_tokens, ttl_ms=ttl_ms)
        stub = self._session_stub(session_id)
        return self._pin((await stub.ForkSession(request, timeout=self._timeout(timeout),
                                                 metadata=self._session_metadata)).session)

    @follows_handoffs
    @raises_session_errors
    async def truncate_session(self, session_id, tokens, timeout=None):
        request = self._pb2.TruncateSessionRequest(session_id=session_id, tokens=tokens)
        return (await self._session_stub(session_id).TruncateSession(
            request, timeout=self._timeout(timeout), metadata=self._session_metadata)).session

    @follows_handoffs
    @raises_session_errors
    async def drop_session(self, session_id, timeout=None):
        await self._session_stub(session_id).DropSession(
            self._pb2.DropSessionRequest(session_id=session_id), timeout=self._timeout(timeout),
            metadata=self._session_metadata)
        self.pin_session(session_id, "")

    @follows_handoffs
    @raises_session_errors
    async def get_session(self, session_id, *, keep_idle=False, timeout=None):
        return (await self._session_stub(session_id).GetSession(
            self._pb2.GetSessionRequest(session_id=session_id, keep_idle=keep_idle),
            timeout=self._timeout(timeout), metadata=self._session_metadata)).session

    @raises_session_errors
    async def list_sessions(self, timeout=None):
        return list((await self._stub.ListSessions(
            self._pb2.ListSessionsRequest(), timeout=self._timeout(timeout),
            metadata=self._admin_metadata or self._session_metadata)).sessions)


async def _async_iter(iterable):
    for item in iterable:
        yield item


async def _anext_or_none(iterator):
    """The next item of an async iterator, or None at its end (anext() is Python 3.10+)."""
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None


# The docstrings are the blocking client's.
for _name, _method in vars(AsyncAttentionClient).items():
    if callable(_method) and not _method.__doc__ and hasattr(AttentionClient, _name):
        _method.__doc__ = getattr(AttentionClient, _name).__doc__
