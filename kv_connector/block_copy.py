"""Copies between a request's KV blocks in the cache and contiguous staging chunks.

A chunk holds ``n`` blocks laid out as ``[num_layers, 2, n, block_size, num_kv_heads,
head_dim]`` (what :func:`kv_connector.base.gather_blocks` returns), so one chunk is
``2 * num_layers * n`` runs of ``block_size * num_kv_heads * head_dim`` elements, each
contiguous in the cache.

On CPU the copies go through numpy, with every such run viewed as one opaque
element: ``np.take`` / fancy assignment then move each run with one ``memcpy``, on the
calling thread. torch's ``index_select`` / ``index_copy_`` do the same work 1.2-2x
slower single-threaded and, above a small size, hand it to an OpenMP team whose
threads busy-wait; on a host where UCX's progress threads need the same cores that
made a pipelined transfer several times slower (measured on the 2-core development
VM). Device caches use the torch ops, which run on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class BlockCopier:
    """Gathers blocks of one KV cache into chunks and scatters chunks back into blocks."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = kv_cache
        layers, kv, num_blocks, block_size, heads, head_dim = kv_cache.shape
        self.num_blocks = num_blocks
        self.run_bytes = block_size * heads * head_dim * kv_cache.element_size()
        self.bytes_per_block = layers * kv * self.run_bytes
        self._chunk_shape = (layers, kv, block_size, heads, head_dim)  # with n inserted after kv
        self._runs: np.ndarray | None = None
        if kv_cache.device.type == "cpu" and kv_cache.is_contiguous():
            # runs: [num_layers * 2, num_blocks], one element per contiguous run
            self._runs = self._as_runs(kv_cache.view(torch.uint8).view(-1), layers * kv)

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        """Refuse ids outside the cache (a bug in the caller: ids come from the engine or were checked against a publication)."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise RuntimeError(f"block ids {min(block_ids)}..{max(block_ids)} outside a cache of {self.num_blocks} blocks (bug)")

    def chunk_view(self, buffer: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """The first ``num_blocks`` blocks' bytes of a uint8 ``buffer`` as a chunk tensor."""
        layers, kv, block_size, heads, head_dim = self._chunk_shape
        data = buffer[: num_blocks * self.bytes_per_block].view(self.kv_cache.dtype)
        return data.view(layers, kv, num_blocks, block_size, heads, head_dim)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy ``block_ids``' KV into the start of ``out`` (uint8, at least ``len(block_ids) * bytes_per_block``)."""
        if self._runs is not None:
            chunk = self._as_runs(out[: len(block_ids) * self.bytes_per_block], self._runs.shape[0])
            # mode="clip" is the unbuffered path (ids are in range: check_block_ids)
            np.take(self._runs, np.asarray(block_ids, dtype=np.intp), axis=1, out=chunk, mode="clip")
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        torch.index_select(self.kv_cache, 2, index, out=self.chunk_view(out, len(block_ids)))

    def scatter(self, block_ids: Sequence[int], chunk: torch.Tensor) -> None:
        """Write the start of ``chunk`` (uint8, as :meth:`gather` fills it) into ``block_ids``."""
        if self._runs is not None:
            self._runs[:, np.asarray(block_ids, dtype=np.intp)] = self._as_runs(chunk[: len(block_ids) * self.bytes_per_block], self._runs.shape[0])
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        self.kv_cache.index_copy_(2, index, self.chunk_view(chunk, len(block_ids)))

    def _as_runs(self, flat: torch.Tensor, num_rows: int) -> np.ndarray:
        """A 1-D uint8 CPU tensor as a numpy [num_rows, -1] array of run-sized opaque elements
        (a view: a 1-D contiguous array views, never copies, under both calls)."""
        return flat.numpy().view(np.dtype(f"V{self.run_bytes}")).reshape(num_rows, -1)
