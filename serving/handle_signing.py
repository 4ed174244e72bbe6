"""KV handles signed by the prefill instance that issued them.

A KV handle tells a decode instance where to pull a prompt's KV from; D puts what it
pulls in its prefix cache, where every later request with that prompt reuses it. So D
must never pull from a handle someone else made: P signs each handle with HMAC-SHA256
under the handle key (derived from the cluster secret, ``cluster/auth.py``), and D
verifies the signature before it allocates anything.

The signature covers every field of the handle but itself (a test alters each one),
encoded canonically here rather than as protobuf bytes, whose encoding is not
guaranteed stable: the request id, P's instance id and addresses, the connector, the
block ids and hashes, the token count, the fingerprint, the lease, a digest of the
prompt's token ids and the pull token. The pull token, random per handle, is what
P's connector asks of each pull (``kv_connector/ucx.py``): a pull needs the handle,
not only the request id.

Freshness is P's business, not D's: a handle is good for as long as P keeps its KV
pinned (the lease), and a replayed handle can only make D pull the KV P really
computed for that prompt. D does not compare the lease's expiry with its own clock,
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
_VERSION = b"splitserve KV handle v1"


class HandleRejected(ValueError):
    """A KV handle D must not pull from: unsigned, altered, or signed under another secret."""


def new_pull_token() -> bytes:
    return secrets.token_bytes(PULL_TOKEN_BYTES)


def sign_handle(handle: disaggregation_pb2.KVHandle, key: bytes) -> None:
    """P, once the handle is complete: set its signature."""
    handle.signature = _mac(handle, key)


def verify_handle(handle: disaggregation_pb2.KVHandle, key: bytes) -> None:
    """D, before allocating anything for the handle. Raises :class:`HandleRejected`."""
    if not handle.signature:
        raise HandleRejected(
            "the KV handle is not signed: the prefill instance that issued it has no cluster secret; "
            "give gateway, prefill and decode instances the same --cluster-secret"
        )
    if not hmac.compare_digest(handle.signature, _mac(handle, key)):
        raise HandleRejected(
            "the KV handle's signature does not match: it was altered after the prefill instance issued it, "
            "or that instance has another --cluster-secret"
        )


def _mac(handle: disaggregation_pb2.KVHandle, key: bytes) -> bytes:
    return hmac.new(key, _signed_bytes(handle), hashlib.sha256).digest()


def _signed_bytes(handle: disaggregation_pb2.KVHandle) -> bytes:
    """Every field but the signature, each length-prefixed, so no two handles share an encoding."""
    fingerprint = handle.fingerprint
    parts = [
        _VERSION,
        handle.request_id.encode(),
        handle.prefill_instance_id.encode(),
        handle.prefill_address.encode(),
        handle.connector.encode(),
        handle.connector_address.encode(),
        _ints(handle.block_ids),
        _ints([handle.num_tokens]),
        _framed(handle.block_hashes),
        _framed(
            [
                fingerprint.model.encode(),
                fingerprint.dtype.encode(),
                _ints([fingerprint.block_size, fingerprint.num_layers, fingerprint.num_kv_heads,
                       fingerprint.head_dim, fingerprint.tensor_parallel_size]),
            ]
        ),
        struct.pack("<dd", handle.lease_expires_unix_s, handle.lease_s),
        hashlib.sha256(_ints(handle.prompt_token_ids)).digest(),
        handle.pull_token,
    ]
    return _framed(parts)


def _ints(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _framed(parts: Iterable[bytes]) -> bytes:
    return b"".join(len(part).to_bytes(8, "little") + part for part in parts)
