"""The asyncio client (grpc.aio): AttentionClient's methods as coroutines.

    async with AsyncAttentionClient("localhost:50051") as client:
        results = await asyncio.gather(*(client.multi_head_attention(x, layer="enc0")
                                         for x in batches))

Requests are built and answers read by attention_client.messages, as in the blocking
client; arguments, results and errors (grpc.aio.AioRpcError, a grpc.RpcError) are the same.
Create it inside the event loop that uses it.
"""

import asyncio

import grpc.aio

from . import messages
from .client import AttentionClient, ClientBase


class AsyncAttentionClient(ClientBase):
    """One grpc.aio channel; usable from the event loop it was created in."""

    _grpc = grpc.aio

    async def close(self):
        await self._channel.close()

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


# The docstrings are the blocking client's.
for _name, _method in vars(AsyncAttentionClient).items():
    if callable(_method) and not _method.__doc__ and hasattr(AttentionClient, _name):
        _method.__doc__ = getattr(AttentionClient, _name).__doc__
