"""Connectors that carry the EAGLE draft's KV over a prompt beside the prompt's blocks.

What crosses and why: engine/spec_decode/prompt_draft_kv.py. A connector that can carry it
implements :class:`DraftKVCarrier` besides :class:`~kv_connector.base.KVConnector`: UCX sends it
from P's memory in the pull, LMCache stores it beside the prompt's chunks
(kv_connector/lmcache_draft_kv.py). A connector that carries none (one serving several ranks:
an EAGLE draft runs on a whole target) refuses nothing: its pulls bring the blocks alone and D's
draft attends from its first step on, as without a prefill instance's draft.

One hand-off, in call order:

1. P's prefill service, right after ``publish`` and before the handle goes out:
   :meth:`DraftKVCarrier.publish_draft_kv` makes the draft KV available to the request's pulls
   (UCX: kept with the published blocks, nothing awaited, so no pull can come before, and
   dropped with them at ``unpublish``, whichever path unpins them; LMCache: stored under the
   publish's keys until their TTL) and returns what the signed handle must carry for D to check
   it (a store's digest; nothing from UCX, whose bytes come from P itself).
2. D's loader: :meth:`DraftKVCarrier.pull_with_draft_kv` pulls the blocks D lacks and, in the
   same pull, the draft KV (whole, whatever D's prefix-cache hits: D caches no draft KV), and
   returns it with the pull's stats; None when P holds none. A failed pull returns nothing and
   keeps nothing.
"""

from __future__ import annotations

import abc

from engine.spec_decode.prompt_draft_kv import DraftKVShape, PromptDraftKV
from kv_connector.base import KVSource, TransferStats


class DraftKVCarrier(abc.ABC):
    """The draft-KV side of a connector (module docstring)."""

    @abc.abstractmethod
    async def publish_draft_kv(
        self, request_id: str, draft_kv: PromptDraftKV, pull_token: bytes | None = None, cache_salt: str = ""
    ) -> bytes:
        """P, right after ``publish(request_id, ..., pull_token, cache_salt)`` returned and before
        the handle goes out: serve ``draft_kv`` to pulls of the request that ask for it (module
        docstring). Returns the digest the handle carries (``KVHandle.draft_kv_digest``) for D to
        check a store's bytes against: empty where P sends them itself, or where the store did
        not take them (D then pulls the blocks alone). A request no longer published (unpinned
        while it published) keeps nothing."""

    @abc.abstractmethod
    async def pull_with_draft_kv(
        self,
        source: KVSource,
        block_ids: list[int],
        num_local_hit_blocks: int,
        timeout_s: float,
        draft_shape: DraftKVShape,
    ) -> tuple[TransferStats, PromptDraftKV | None]:
        """D: ``pull`` (every contract of it holds), and in the same pull the draft KV P attached
        for the prompt, received into a tensor of ``draft_shape`` (an offer of another shape or
        dtype fails the pull). None beside the stats when P has none to give."""


def draft_offer_error(
    start: int, num_entries: int, entry_shape: list[int] | None, dtype: str, num_tokens: int, mine: DraftKVShape
) -> str | None:
    """Why D refuses P's offer of a draft KV (positions ``start .. start + num_entries - 1``, of
    ``entry_shape`` and ``dtype``) for a prompt of ``num_tokens``; None to take it. The entries
    end at the prompt's end: D sizes its receive from its own prompt, never from P's count."""
    if not 0 <= start < num_tokens or start + num_entries != num_tokens:
        return f"a draft KV of positions {start}..{start + num_entries - 1} for a prompt of {num_tokens} tokens"
    if entry_shape != mine.entry_shape or dtype != mine.dtype_name:
        return f"draft KV entries of {entry_shape} {dtype}, expected {mine.entry_shape} {mine.dtype_name}"
    return None
