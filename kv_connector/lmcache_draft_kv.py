"""The EAGLE draft's KV over a prompt through LMCache: one more store object beside the prompt's
chunks, checked against the signed handle as they are.

What crosses and why: engine/spec_decode/prompt_draft_kv.py; the connector's contract:
kv_connector/draft_kv.py. The UCX connector sends it from P's memory in the pull; through a store
it goes as the target's KV goes, in call order:

1. P's prefill service, right after ``publish`` and before the handle goes out:
   ``LMCacheConnector.publish_draft_kv`` puts the draft KV in the store as one object (every entry
   of every draft layer: one draft layer is small beside the target's layers, and D always takes
   it whole), waits until the store confirms it, gives it the chunks' TTL and returns its digest
   (:func:`draft_kv_digest`), which the signed handle carries (``KVHandle.draft_kv_digest``). A
   store that does not take it is logged and the handle carries no digest: D then pulls the
   blocks alone and its draft attends from its first step on, as without a draft on P.
2. D's loader, with a draft of its own: ``LMCacheConnector.pull_with_draft_kv`` fetches the object
   first (whatever D's prefix-cache hits, as the UCX path: D caches no draft KV), checks it
   (:func:`received_draft_kv`), then pulls the blocks D lacks. A handle without a digest brings
   the blocks alone. A missing object, or one whose span, shape or bytes are not what P stored,
   fails the whole pull before any block is written, as a missing or forged chunk does (the
   gateway prefills again, or D recomputes).

Keys (:func:`draft_kv_key`): the target's chunk keys' model name and the draft's dtype, and a tag,
HMAC-SHA256 under the KV store key of the request's cache salt, the handle's pull token, the
drafter's identity (the fingerprint's ``draft``) and the prompt's length. A D with another draft
computes another key and can only miss; no two publishes (and no two tenants) share a key.

The object is ``[num_layers * 2, num_entries, num_kv_heads, head_dim]`` (LMCache's stores
serialize four dimensions at most): ``PromptDraftKV.kv`` with its layers and K/V folded. D learns
``num_entries`` from the object (P's first computed position is ``num_tokens - num_entries``; D
knows nothing else of P's prefix-cache hit), refuses a span, entry shape or dtype other than its
own draft's (``draft_offer_error``), and the digest covers the span with the bytes, so a store
that alters either is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os

# lmcache reports usage to its authors unless told not to; a server must not phone home.
os.environ["LMCACHE_TRACK_USAGE"] = "false"

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.memory_management import MemoryFormat

from engine.spec_decode.prompt_draft_kv import DraftKVShape, PromptDraftKV
from kv_connector.base import KVTransferError
from kv_connector.draft_kv import draft_offer_error

REMOTE_BACKEND = "RemoteBackend"  # lmcache's name for the store behind remote_url
_TAG_LABEL = b"splitserve lmcache draft KV v1"  # apart from the chunks' tags under the same key
_DIGEST_LABEL = b"splitserve draft KV digest v1"
_TAG_BYTES = 12  # hex-encoded, as the chunks' tags


def draft_kv_key(
    model_name: str,
    tag_name: str,
    store_key: bytes,
    cache_salt: str,
    pull_token: bytes,
    draft: str,
    num_tokens: int,
    dtype: torch.dtype,
) -> CacheEngineKey:
    """The store key of one publish's draft KV (module docstring): ``model_name`` is the chunks'
    (``key_model_name``), ``tag_name`` the request config LMCache writes into keys as a tag."""
    parts = (_TAG_LABEL, cache_salt.encode(), pull_token, draft.encode(), str(num_tokens).encode())
    message = b"".join(len(part).to_bytes(8, "little") + part for part in parts)
    tag = hmac.new(store_key, message, hashlib.sha256).digest()[:_TAG_BYTES].hex()
    return CacheEngineKey(model_name, 1, 0, 0, dtype, request_configs={tag_name: tag})


def draft_kv_digest(draft_kv: PromptDraftKV) -> bytes:
    """SHA-256 of the entries' span and shape and of their bytes, as P stored them and D read them."""
    header = f"{draft_kv.start}:{list(draft_kv.kv.shape)}:{draft_kv.kv.dtype}".encode()
    digest = hashlib.sha256(_DIGEST_LABEL + len(header).to_bytes(8, "little") + header)
    digest.update(draft_kv.kv.contiguous().view(-1).view(torch.uint8).cpu().numpy().data)
    return digest.digest()


def put_draft_kv(engine: LMCacheEngine, key: CacheEngineKey, draft_kv: PromptDraftKV) -> bool:
    """Worker thread, one LMCache call at a time: hand the draft KV to LMCache's remote backend,
    which writes it in the background. False when LMCache has no room to stage it."""
    kv = draft_kv.kv  # [num_layers, 2, num_entries, num_kv_heads, head_dim]
    folded = kv.reshape(kv.shape[0] * 2, *kv.shape[2:])
    memory_obj = engine.storage_manager.allocate(folded.shape, kv.dtype, fmt=MemoryFormat.KV_2LTD, busy_loop=False)
    if memory_obj is None or memory_obj.tensor is None:
        return False
    memory_obj.tensor.copy_(folded)
    # Drops the staging object's reference once the backend took its own (as LMCache's store does).
    engine.storage_manager.batched_put([key], [memory_obj], location=REMOTE_BACKEND)
    return True


def is_stored(engine: LMCacheEngine, key: CacheEngineKey) -> bool:
    """Worker thread: whether the store holds the object now."""
    return engine.storage_manager.contains(key, search_range=[REMOTE_BACKEND]) is not None


def fetch_draft_kv(engine: LMCacheEngine, key: CacheEngineKey) -> torch.Tensor | None:
    """Worker thread, one LMCache call at a time: a copy of the object the store holds under
    ``key`` (on CPU, of whatever shape and dtype the store says), or None on a miss."""
    # The batched get: the single one also keeps what it fetched in LMCache's local CPU cache,
    # which this connector keeps off (the store is the hand-off), holding LMCache's buffer.
    (memory_obj,) = engine.storage_manager.batched_get([key], location=REMOTE_BACKEND)
    if memory_obj is None:
        return None
    try:
        return None if memory_obj.tensor is None else memory_obj.tensor.clone()
    finally:
        memory_obj.ref_count_down()  # back to LMCache's buffer


def received_draft_kv(fetched: torch.Tensor, num_tokens: int, mine: DraftKVShape, digest: bytes) -> PromptDraftKV:
    """D: the draft KV in ``fetched`` (what the store returned) for a prompt of ``num_tokens``, on
    D's device. Raises :class:`KVTransferError` (its message for the caller's) where its span,
    entry shape or dtype is not what D's draft takes, or its digest is not the handle's."""
    if fetched.dim() != 4 or fetched.shape[0] % 2:
        raise KVTransferError(f"a draft KV object of shape {list(fetched.shape)}")
    num_entries = fetched.shape[1]
    start = num_tokens - num_entries
    entry_shape = [fetched.shape[0] // 2, 2, fetched.shape[2], fetched.shape[3]]
    dtype = str(fetched.dtype).removeprefix("torch.")
    if (error := draft_offer_error(start, num_entries, entry_shape, dtype, num_tokens, mine)) is not None:
        raise KVTransferError(error)
    received = PromptDraftKV(start, fetched.view(mine.num_layers, 2, num_entries, mine.num_kv_heads, mine.head_dim))
    if not hmac.compare_digest(draft_kv_digest(received), digest):
        raise KVTransferError("other bytes for the draft KV than the prefill instance stored")
    return PromptDraftKV(start, received.kv.to(mine.device))
