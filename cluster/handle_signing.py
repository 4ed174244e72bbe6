"""KV handles signed by the prefill instance that issued them.

A KV handle tells a decode instance where to pull a prompt's KV from; D puts what it
pulls in its prefix cache, where every later request with that prompt reuses it. So D
must never pull from a handle someone else made: P signs each handle with HMAC-SHA256
under the handle key (derived from the cluster secret, ``cluster/auth.py``), and D
verifies the signature before it allocates anything.

The signature covers every field of the handle but itself (a test alters each one),
encoded canonically here rather than as protobuf bytes, whose encoding is not
guaranteed stable: the request id, P's addresses, the connector, the block ids, the
token count, the fingerprint, the lease, the pull token, the digests of the chunks a
store holds and of the EAGLE draft's KV stored beside them (lmcache: D checks what the store
returns against them), P's drafts, and a digest of the prompt's token ids. The prompt is not
a field of the handle: it travels beside it, in the Decode call
(``DecodeRequest.prompt_token_ids``), and D verifies the signature against the call's prompt,
so a handle is good only for the prompt P computed its KV from. The pull
token, random per handle, is what P's connector asks of each pull
(``kv_connector/ucx.py``): a pull needs the handle, not only the request id.

Freshness is P's business, not D's: a handle is good for as long as P keeps its KV
pinned (the lease), and a replayed handle can only make D pull the KV P really
computed for that prompt. The handle carries the lease's length, not an expiry time,
so clock skew between hosts never refuses a handle.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Iterable, Sequence

from splitserve.v1 import disaggregation_pb2

PULL_TOKEN_BYTES = 16
# v8: the draft KV's digest; v7: the fingerprint's drafter; v6: the fingerprint's pipeline stages; v5: Medusa's drafts;
# v4: the ranks' connector addresses; v3: chunk digests
_VERSION = b"splitserve KV handle v8"


class HandleRejected(ValueError):
    """A KV handle D must not pull from: unsigned, altered, or signed under another secret."""


def new_pull_token() -> bytes:
    return secrets.token_bytes(PULL_TOKEN_BYTES)


def sign_handle(handle: disaggregation_pb2.KVHandle, prompt_token_ids: Sequence[int], key: bytes) -> None:
    """P, once the handle is complete: set its signature, over the handle and the prompt
    whose KV it holds."""
    handle.signature = _mac(handle, prompt_token_ids, key)


def verify_handle(handle: disaggregation_pb2.KVHandle, prompt_token_ids: Sequence[int], key: bytes) -> None:
    """D, before allocating anything for the handle: ``prompt_token_ids`` is the Decode
    call's prompt. Raises :class:`HandleRejected`."""
    if not handle.signature:
        raise HandleRejected(
            "the KV handle is not signed: the prefill instance that issued it has no cluster secret; "
            "give gateway, prefill and decode instances the same --cluster-secret"
        )
    if not hmac.compare_digest(handle.signature, _mac(handle, prompt_token_ids, key)):
        raise HandleRejected(
            "the KV handle's signature does not match: it was altered after the prefill instance issued it, "
            "it holds the KV of another prompt than the call's prompt_token_ids, "
            "or that instance has another --cluster-secret"
        )


def _mac(handle: disaggregation_pb2.KVHandle, prompt_token_ids: Sequence[int], key: bytes) -> bytes:
    return hmac.new(key, _signed_bytes(handle, prompt_token_ids), hashlib.sha256).digest()


def _signed_bytes(handle: disaggregation_pb2.KVHandle, prompt_token_ids: Sequence[int]) -> bytes:
    """Every field but the signature, then the prompt's digest, each length-prefixed, so no
    two handles (or prompts) share an encoding."""
    fingerprint = handle.fingerprint
    parts = [
        _VERSION,
        handle.request_id.encode(),
        handle.prefill_address.encode(),
        handle.connector.encode(),
        handle.connector_address.encode(),
        _ints(handle.block_ids),
        _ints([handle.num_tokens]),
        _framed(
            [
                fingerprint.model.encode(),
                fingerprint.dtype.encode(),
                _ints(
                    [
                        fingerprint.block_size,
                        fingerprint.num_layers,
                        fingerprint.num_kv_heads,
                        fingerprint.head_dim,
                        fingerprint.tensor_parallel_size,
                    ]
                ),
                _ints(fingerprint.stage_first_layers),
                fingerprint.draft.encode(),
            ]
        ),
        struct.pack("<d", handle.lease_s),
        handle.pull_token,
        _framed(handle.chunk_digests),
        _framed(address.encode() for address in handle.rank_connector_addresses),
        _ints(handle.draft_token_ids),
        handle.draft_kv_digest,
        hashlib.sha256(_ints(prompt_token_ids)).digest(),
    ]
    return _framed(parts)


def _ints(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _framed(parts: Iterable[bytes]) -> bytes:
    return b"".join(len(part).to_bytes(8, "little") + part for part in parts)
