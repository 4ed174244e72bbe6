"""The small JSON headers exchanged before a KV payload, validated field by field.

Nothing from the wire is unpickled: headers are JSON objects whose every field
is type-checked before use, and the payload is raw tensor bytes whose size and
shape the receiver computes itself and compares.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from kv_connector.fingerprint import Fingerprint

# 4: a pull may name a span of P's KV heads (tensor parallelism of different sizes); 3: pulls
# present P's pull token; 2: zero-copy messages of whole blocks; 1 sent gathered chunks.
PROTOCOL_VERSION = 4
MAX_HEADER_BYTES = 1 << 20
_MAX_PULL_TOKEN_CHARS = 128
# A pull request's fields but its two lists: version, fingerprint (a model identity of a few
# dozen characters), request id, pull token, JSON punctuation; with a generous margin.
_PULL_REQUEST_FIXED_BYTES = 4096


class WireError(ValueError):
    """A peer sent a header this side cannot accept."""


@dataclass(frozen=True, slots=True)
class PullRequest:
    """D -> P: send these blocks of this request."""

    request_id: str
    block_ids: list[int]  # P's block ids, a subset of what P published for the request
    fingerprint: Fingerprint
    # How D cuts the pull into messages: block counts, in order, summing to len(block_ids);
    # each message's blocks are consecutive on both sides (D knows both, so D decides).
    message_blocks: list[int]
    # The pull token from the KV handle, hex: P serves only pulls presenting the one it made.
    pull_token: str = field(default="", repr=False)
    # [first, count] of P's own KV heads to send (the KV head plan's span), or None: all of them.
    heads: list[int] | None = None


@dataclass(frozen=True, slots=True)
class PullReply:
    """P -> D: whether the payload follows, and what it is."""

    ok: bool
    error: str = ""
    num_bytes: int = 0
    shape: list[int] | None = None  # of one block: [num_layers, 2, block_size, num_kv_heads, head_dim]
    dtype: str = ""


def max_pull_request_bytes(num_blocks: int) -> int:
    """The longest pull request a peer has reason to send to a cache of ``num_blocks`` blocks
    (at most :data:`MAX_HEADER_BYTES`): every block id once, in ``block_ids`` and at most
    once more as a count in ``message_blocks``, each with its comma. P receives headers into a
    buffer of this size, so a longer one is refused before anything is parsed."""
    per_block = 2 * (len(str(num_blocks)) + 1)
    return min(MAX_HEADER_BYTES, _PULL_REQUEST_FIXED_BYTES + num_blocks * per_block)


def encode(message: PullRequest | PullReply) -> bytes:
    # Field by field: ``asdict`` deep-copies every block id (a millisecond for a long prompt).
    body: dict[str, object] = {item.name: getattr(message, item.name) for item in fields(message)}
    if isinstance(message, PullRequest):
        body["fingerprint"] = asdict(message.fingerprint)
    body["version"] = PROTOCOL_VERSION
    return json.dumps(body, separators=(",", ":")).encode()


def decode_pull_request(data: bytes) -> PullRequest:
    body = _object(data)
    fingerprint = body.get("fingerprint")
    if not isinstance(fingerprint, dict):
        raise WireError("pull request has no fingerprint object")
    try:
        parsed_fingerprint = Fingerprint(**fingerprint)
    except TypeError as error:
        raise WireError(f"bad fingerprint: {error}") from None
    for name, kind in (("model", str), ("dtype", str)):
        _require(getattr(parsed_fingerprint, name), kind, f"fingerprint.{name}")
    for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel_size"):
        _require(getattr(parsed_fingerprint, name), int, f"fingerprint.{name}")
    request_id = _require(body.get("request_id"), str, "request_id")
    block_ids = _require(body.get("block_ids"), list, "block_ids")
    if not all(_is_int(b) and b >= 0 for b in block_ids):
        raise WireError("block_ids must be non-negative integers")
    message_blocks = _require(body.get("message_blocks"), list, "message_blocks")
    if not all(_is_int(n) and n > 0 for n in message_blocks):
        raise WireError("message_blocks must be positive integers")
    pull_token = _require(body.get("pull_token"), str, "pull_token")
    if len(pull_token) > _MAX_PULL_TOKEN_CHARS:
        raise WireError(f"pull_token of {len(pull_token)} characters (at most {_MAX_PULL_TOKEN_CHARS})")
    heads = body.get("heads")
    if heads is not None and not (
        isinstance(heads, list) and len(heads) == 2 and all(_is_int(n) for n in heads) and heads[0] >= 0 < heads[1]
    ):
        raise WireError("heads must be [first, count] with first >= 0 and count > 0")
    return PullRequest(
        request_id=request_id,
        block_ids=block_ids,
        fingerprint=parsed_fingerprint,
        message_blocks=message_blocks,
        pull_token=pull_token,
        heads=heads,
    )


def decode_pull_reply(data: bytes) -> PullReply:
    body = _object(data)
    ok = _require(body.get("ok"), bool, "ok")
    error = _require(body.get("error", ""), str, "error")
    num_bytes = _require(body.get("num_bytes", 0), int, "num_bytes")
    shape = body.get("shape")
    if shape is not None and not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise WireError("shape must be a list of non-negative integers")
    dtype = _require(body.get("dtype", ""), str, "dtype")
    return PullReply(ok=ok, error=error, num_bytes=num_bytes, shape=shape, dtype=dtype)


def _object(data: bytes) -> dict[str, object]:
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"header is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise WireError("header must be a JSON object")
    if body.get("version") != PROTOCOL_VERSION:
        raise WireError(f"protocol version {body.get('version')!r}, this side speaks {PROTOCOL_VERSION}")
    return body


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(value: object, kind: type, name: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"{name} must be {kind.__name__}, got {type(value).__name__}")
    return value
