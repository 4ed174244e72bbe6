"""The small headers exchanged before a KV payload, validated field by field.

Nothing from the wire is unpickled: headers are JSON objects whose every field
is type-checked before use, and the payload is raw tensor bytes whose size and
shape the receiver computes itself and compares.

A pull request opens with a fixed frame, then its JSON: the protocol version, the lengths of
the request id and of the pull token (``<HHB``: 5 bytes), the request id (UTF-8) and the
token's raw bytes. P reads the frame alone (:func:`read_pull_credentials`), finds the
request and compares the token, and parses the JSON (:func:`decode_pull_body`: the
fingerprint, every block id) only for a pull it will serve, so a stranger's pull costs P the
same few dozen bytes whatever the size of the rest.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from kv_connector.fingerprint import Fingerprint

# 8: a pull may ask for the EAGLE draft's KV over the prompt, which P offers in its reply and
#    sends after the blocks (a peer of 7 would take the pull for one of the blocks alone);
# 7: the fingerprint names the drafter whose drafts cross the hand-off (a peer of 6 would take
#    the field for a bad fingerprint rather than another version);
# 6: a pull may name a range of P's layers (pipeline stages of different splits);
# 5: a pull request's request id and token come first, in a fixed frame read before its JSON;
# 4: a pull may name a span of P's KV heads (tensor parallelism of different sizes); 3: pulls
# present P's pull token; 2: zero-copy messages of whole blocks; 1 sent gathered chunks.
PROTOCOL_VERSION = 8
MAX_HEADER_BYTES = 1 << 20
MAX_REQUEST_ID_BYTES = 1024  # the gateway's ids are a few dozen characters
MAX_PULL_TOKEN_BYTES = 64  # P makes 16 (cluster/handle_signing.py)
_CREDENTIALS = struct.Struct("<HHB")  # protocol version, request id bytes, pull token bytes
# A pull request's fields but its two lists: the frame, fingerprint (a model identity and a
# drafter's, a few dozen characters each), request id, JSON punctuation; with a generous margin.
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
    # The pull token from the KV handle: P serves only pulls presenting the one it made.
    pull_token: bytes = field(default=b"", repr=False)
    # [first, count] of P's own KV heads to send (the KV head plan's span), or None: all of them.
    heads: list[int] | None = None
    # [first, count] of P's own layers to send (the layer plan's range), or None: all of them.
    layers: list[int] | None = None
    # D runs the same EAGLE draft: send the draft's KV over the prompt too, if P has it
    # (kv_connector/draft_kv.py); the blocks may then be none (D's prefix cache held them all).
    draft_kv: bool = False


@dataclass(frozen=True, slots=True)
class PullCredentials:
    """A pull request's fixed frame: whose blocks it asks for, and the token it presents."""

    request_id: str
    pull_token: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class PullReply:
    """P -> D: whether the payload follows, and what it is."""

    ok: bool
    error: str = ""
    num_bytes: int = 0
    shape: list[int] | None = None  # of one block: [num_layers, 2, block_size, num_kv_heads, head_dim]
    dtype: str = ""
    # The draft KV P sends after the blocks, when asked and held: [first position, entries], the
    # shape of one entry ([num_layers, 2, num_kv_heads, head_dim]) and its dtype; None: none follows.
    draft_kv: list[int] | None = None
    draft_shape: list[int] | None = None
    draft_dtype: str = ""


def max_pull_request_bytes(num_blocks: int) -> int:
    """The longest pull request a peer has reason to send to a cache of ``num_blocks`` blocks
    (at most :data:`MAX_HEADER_BYTES`): every block id once, in ``block_ids`` and at most
    once more as a count in ``message_blocks``, each with its comma. P receives headers into a
    buffer of this size, so a longer one is refused before anything is parsed."""
    per_block = 2 * (len(str(num_blocks)) + 1)
    return min(MAX_HEADER_BYTES, _PULL_REQUEST_FIXED_BYTES + num_blocks * per_block)


def encode(message: PullRequest | PullReply) -> bytes:
    """A reply as JSON; a request as its fixed frame, then JSON of the rest (module docstring)."""
    if isinstance(message, PullReply):
        reply = {item.name: getattr(message, item.name) for item in fields(message)}
        return _json(reply | {"version": PROTOCOL_VERSION})
    request_id = message.request_id.encode()
    if len(request_id) > MAX_REQUEST_ID_BYTES or len(message.pull_token) > MAX_PULL_TOKEN_BYTES:
        raise ValueError(
            f"a request id of {len(request_id)} bytes or a pull token of {len(message.pull_token)} (at most "
            f"{MAX_REQUEST_ID_BYTES} and {MAX_PULL_TOKEN_BYTES})"
        )
    frame = _CREDENTIALS.pack(PROTOCOL_VERSION, len(request_id), len(message.pull_token))
    # Field by field: ``asdict`` deep-copies every block id (a millisecond for a long prompt).
    body = {
        "block_ids": message.block_ids,
        "fingerprint": asdict(message.fingerprint),
        "message_blocks": message.message_blocks,
        "heads": message.heads,
        "layers": message.layers,
        "draft_kv": message.draft_kv,
    }
    return frame + request_id + message.pull_token + _json(body)


def read_pull_credentials(data: bytes) -> tuple[PullCredentials, memoryview]:
    """A pull request's fixed frame, and the rest of it unparsed (a view: not even copied).
    Raises :class:`WireError` for a frame that is short, of another protocol version, or
    sizes fields past their caps or past the data."""
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    if len(data) < _CREDENTIALS.size:
        raise WireError(f"a pull request of {len(data)} bytes")
    version, num_id_bytes, num_token_bytes = _CREDENTIALS.unpack_from(data)
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    if num_id_bytes > MAX_REQUEST_ID_BYTES or num_token_bytes > MAX_PULL_TOKEN_BYTES:
        raise WireError(
            f"a request id of {num_id_bytes} bytes or a pull token of {num_token_bytes} (at most "
            f"{MAX_REQUEST_ID_BYTES} and {MAX_PULL_TOKEN_BYTES})"
        )
    token_start = _CREDENTIALS.size + num_id_bytes
    body_start = token_start + num_token_bytes
    if body_start > len(data):
        raise WireError(f"a frame of {body_start} bytes in a pull request of {len(data)}")
    view = memoryview(data)
    try:
        request_id = str(view[_CREDENTIALS.size : token_start], "utf-8")
    except UnicodeDecodeError:
        raise WireError("the request id is not UTF-8") from None
    return PullCredentials(request_id, bytes(view[token_start:body_start])), view[body_start:]


def decode_pull_request(data: bytes) -> PullRequest:
    """The whole of a pull request (:func:`read_pull_credentials`, then :func:`decode_pull_body`)."""
    return decode_pull_body(*read_pull_credentials(data))


def decode_pull_body(credentials: PullCredentials, data: bytes | memoryview) -> PullRequest:
    """The JSON after a pull request's frame: its fingerprint, block ids, message plan, heads and layers."""
    body = _object(data, versioned=False)
    fingerprint = body.get("fingerprint")
    if not isinstance(fingerprint, dict):
        raise WireError("pull request has no fingerprint object")
    try:
        parsed_fingerprint = Fingerprint(**fingerprint)
    except TypeError as error:
        raise WireError(f"bad fingerprint: {error}") from None
    for name, kind in (("model", str), ("dtype", str), ("draft", str)):
        _require(getattr(parsed_fingerprint, name), kind, f"fingerprint.{name}")
    for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel_size"):
        _require(getattr(parsed_fingerprint, name), int, f"fingerprint.{name}")
    if not all(_is_int(first) for first in parsed_fingerprint.stage_first_layers):
        raise WireError("fingerprint.stage_first_layers must be integers")
    block_ids = _require(body.get("block_ids"), list, "block_ids")
    if not all(_is_int(b) and b >= 0 for b in block_ids):
        raise WireError("block_ids must be non-negative integers")
    message_blocks = _require(body.get("message_blocks"), list, "message_blocks")
    if not all(_is_int(n) and n > 0 for n in message_blocks):
        raise WireError("message_blocks must be positive integers")
    heads, layers = _span(body, "heads"), _span(body, "layers")
    draft_kv = _require(body.get("draft_kv", False), bool, "draft_kv")
    return PullRequest(
        request_id=credentials.request_id,
        block_ids=block_ids,
        fingerprint=parsed_fingerprint,
        message_blocks=message_blocks,
        pull_token=credentials.pull_token,
        heads=heads,
        layers=layers,
        draft_kv=draft_kv,
    )


def _span(body: dict[str, object], name: str) -> list[int] | None:
    """A pull request's ``[first, count]`` of P's heads or layers (None: all of them)."""
    span = body.get(name)
    if span is None:
        return None
    if not (isinstance(span, list) and len(span) == 2 and all(_is_int(n) for n in span) and span[0] >= 0 < span[1]):
        raise WireError(f"{name} must be [first, count] with first >= 0 and count > 0")
    return span


def decode_pull_reply(data: bytes) -> PullReply:
    body = _object(data)
    ok = _require(body.get("ok"), bool, "ok")
    error = _require(body.get("error", ""), str, "error")
    num_bytes = _require(body.get("num_bytes", 0), int, "num_bytes")
    shape = body.get("shape")
    if shape is not None and not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise WireError("shape must be a list of non-negative integers")
    dtype = _require(body.get("dtype", ""), str, "dtype")
    draft_kv, draft_shape = body.get("draft_kv"), body.get("draft_shape")
    if draft_kv is not None and not (
        isinstance(draft_kv, list) and len(draft_kv) == 2 and all(_is_int(n) and n >= 0 for n in draft_kv)
    ):
        raise WireError("draft_kv must be [first position, entries], non-negative integers")
    if draft_shape is not None and not (
        isinstance(draft_shape, list) and all(_is_int(n) and n >= 0 for n in draft_shape)
    ):
        raise WireError("draft_shape must be a list of non-negative integers")
    draft_dtype = _require(body.get("draft_dtype", ""), str, "draft_dtype")
    return PullReply(
        ok=ok,
        error=error,
        num_bytes=num_bytes,
        shape=shape,
        dtype=dtype,
        draft_kv=draft_kv,
        draft_shape=draft_shape,
        draft_dtype=draft_dtype,
    )


def _json(body: Mapping[str, object]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _object(data: bytes | memoryview, versioned: bool = True) -> dict[str, object]:
    """``versioned``: the object carries the protocol version (a pull request's is in its frame)."""
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        body = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:  # [[[[...: nested too deep
        raise WireError(f"header is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise WireError("header must be a JSON object")
    if versioned and body.get("version") != PROTOCOL_VERSION:
        raise WireError(f"protocol version {body.get('version')!r}, this side speaks {PROTOCOL_VERSION}")
    return body


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(value: object, kind: type, name: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"{name} must be {kind.__name__}, got {type(value).__name__}")
    return value
