"""The paged-cache <-> LMCache memory-object adapter behind the lmcache KV connector.

LMCache's shipped engine connectors copy between vLLM's CUDA caches and its memory
objects with CUDA kernels. This one does the same for splitserve's block-major cache
``[blocks, layers, 2, block_size, kv_heads, head_dim]`` with plain torch indexing,
so it runs wherever the cache lives (CPU here, a GPU elsewhere). A memory object holds one KV
head of one chunk, in LMCache's ``KV_2LTD`` layout: ``[2, layers, tokens, head_dim]``: the
store keeps each head apart, so a tensor-parallel rank stores and fetches exactly its own heads
(kv_connector/lmcache_connector.py, "Heads"); its layers are those of the prefill rank's cache
(its pipeline stage's), and a decode rank whose stage spans several prefill stages fetches each
into its own layers ("Stages").

Digests: given a ``chunk_digests`` dict among the keyword arguments, both directions record
the SHA-256 of each chunk's memory object (:func:`chunk_digest`) under the chunk's first
token, as stored on P and as fetched on D: the bytes the store holds, which P's signed
handle vouches for and D compares before any of them reaches its cache.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

# lmcache reports usage to its authors unless told not to; a server must not phone home.
os.environ["LMCACHE_TRACK_USAGE"] = "false"

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj

from kv_connector.base import KVTransferError


class PagedKVAdapter(GPUConnectorInterface):
    """Copies tokens between the paged KV cache and LMCache memory objects (format KV_2LTD).

    The connector passes its own keyword arguments through ``LMCacheEngine.store`` and
    ``retrieve``: ``head``, the index in this cache's heads of the one head the call moves;
    ``block_ids`` (P's blocks) for a store, and for a retrieve a ``staging`` tensor
    ``[2, layers, tokens, local kv_heads, head_dim]`` whose token 0 is prompt token
    ``staging_start``, and where the fetched object's ``num_layers`` layers go in it from
    ``layer_start`` on (by default: the whole cache's layers). D never lets LMCache write its
    cache directly: a retrieve that outlives its pull (timeout, cancel) must not land in blocks
    the engine has handed on.
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        _, self.num_layers, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape

    def get_shape(self, num_tokens: int) -> torch.Size:
        """The memory-object shape for one head of ``num_tokens`` tokens."""
        return torch.Size([2, self.num_layers, num_tokens, self.head_dim])

    def staging_shape(self, num_tokens: int) -> torch.Size:
        """A retrieve's staging tensor for ``num_tokens`` tokens of every head of this cache."""
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads, self.head_dim])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """One chunk of :meth:`batched_from_gpu` (LMCache's interface asks for both forms)."""
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """One chunk of :meth:`batched_to_gpu`."""
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs: list[MemoryObj], starts: list[int], ends: list[int], **kwargs: Any) -> None:
        """Inside ``store`` on P: copy head ``head`` of prompt tokens ``starts[i]..ends[i]-1``
        out of their blocks into ``memory_objs[i]``, one LMCache chunk each (and digest it)."""
        block_ids, head = kwargs["block_ids"], kwargs["head"]
        digests: dict[int, bytes] | None = kwargs.get("chunk_digests")
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            blocks, offsets = token_slots(block_ids, start, end, self.block_size, self.kv_cache.device)
            tokens = self.kv_cache[blocks, :, :, offsets, head]  # [n, layers, 2, head_dim]
            chunk = self._checked(memory_obj, start, end)
            chunk.copy_(tokens.permute(2, 1, 0, 3))
            if digests is not None:
                digests[start] = chunk_digest(chunk)

    def batched_to_gpu(self, memory_objs: list[MemoryObj], starts: list[int], ends: list[int], **kwargs: Any) -> None:
        """Inside ``retrieve`` on D: copy each fetched chunk into head ``head`` (and layers
        ``layer_start`` on) of the staging tensor (and digest it)."""
        staging: torch.Tensor = kwargs["staging"]
        staging_start: int = kwargs["staging_start"]
        head: int = kwargs["head"]
        layer_start: int = kwargs.get("layer_start", 0)
        num_layers: int = kwargs.get("num_layers", self.num_layers)
        layers = slice(layer_start, layer_start + num_layers)
        digests: dict[int, bytes] | None = kwargs.get("chunk_digests")
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            chunk = self._checked(memory_obj, start, end, num_layers)
            if digests is not None:
                digests[start] = chunk_digest(chunk)
            # Synchronous copy: LMCache recycles the memory object as soon as this returns.
            staging[:, layers, start - staging_start : end - staging_start, head].copy_(chunk)

    def _checked(self, memory_obj: MemoryObj, start: int, end: int, num_layers: int | None = None) -> torch.Tensor:
        """The object's tensor, if it has exactly the chunk's shape (``num_layers`` layers; by
        default the cache's) and the cache's dtype."""
        tensor = memory_obj.tensor
        expected = torch.Size([2, num_layers or self.num_layers, end - start, self.head_dim])
        if tensor is None or tensor.shape != expected or tensor.dtype != self.kv_cache.dtype:
            found = "nothing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
            raise KVTransferError(
                f"LMCache holds {found} for tokens [{start}, {end}), expected {tuple(expected)} {self.kv_cache.dtype}"
            )
        return tensor


def chunk_digest(chunk: torch.Tensor) -> bytes:
    """SHA-256 of a memory object's bytes (host memory: LMCache stages every chunk there)."""
    return hashlib.sha256(chunk.contiguous().view(-1).view(torch.uint8).cpu().numpy().data).digest()


def token_slots(
    block_ids: list[int], start: int, end: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) of prompt tokens ``start..end-1``, as index tensors on ``device``."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks.to(device), (positions % block_size).to(device)


def write_blocks(kv_cache: torch.Tensor, block_ids: list[int], start: int, end: int, tokens: torch.Tensor) -> None:
    """Write prompt tokens ``start..end-1`` (``tokens``: [2, layers, n, kv_heads, head_dim])
    into their slots of ``block_ids``; slots past ``end`` in the last block stay as they are."""
    block_size = kv_cache.shape[3]
    blocks, offsets = token_slots(block_ids, start, end, block_size, kv_cache.device)
    kv_cache[blocks, :, :, offsets] = tokens.permute(2, 1, 0, 3, 4)
