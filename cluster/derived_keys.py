"""Keys derived from the cluster secret for the KV path, beside those ``cluster/auth.py``
makes for calls, handles and registrations. Each is HMAC-SHA256 of a label of its own under
the handle key (itself derived from the secret), so none reveals the secret or another key,
and every process holding the secret derives the same ones. None leaves the process.

- **The prefix-cache hash key**: with ``--prefix-cache-hash sha256``, instances hash their
  prefix-cache blocks with HMAC-SHA256 under it (``engine/kv_cache_utils.py``), and the
  gateway hashes prompts the same way for kv routing (``gateway/prefix_index.py``). Without
  the secret nobody can compute a block's hash, let alone a colliding prompt.
- **The KV store key**: the lmcache connector names a request's chunks in the shared store
  under a tag derived from it, the request's cache salt and the handle's pull token
  (``kv_connector/lmcache_connector.py``), so a store reader without the secret cannot tell
  which keys hold which prompt, and no two requests (nor tenants) share a key.
"""

from __future__ import annotations

import hashlib
import hmac

from cluster.auth import ClusterSecret

_PREFIX_CACHE_HASH_LABEL = b"splitserve prefix-cache block hash key v1"
_KV_STORE_LABEL = b"splitserve KV store namespace key v1"


def prefix_cache_key(secret: ClusterSecret | None) -> bytes | None:
    """The HMAC key of the sha256 prefix-cache hash; None without a secret (plain SHA-256)."""
    return None if secret is None else _derive(secret, _PREFIX_CACHE_HASH_LABEL)


def kv_store_key(secret: ClusterSecret | None) -> bytes | None:
    """The key the lmcache connector derives store-key tags with; None without a secret."""
    return None if secret is None else _derive(secret, _KV_STORE_LABEL)


def _derive(secret: ClusterSecret, label: bytes) -> bytes:
    return hmac.new(secret.handle_key, label, hashlib.sha256).digest()
