"""Registry records as instances write them and gateways believe them.

A gateway sends prompts to whatever address a registry record names, relays the tokens
that come back, and routes by the load the record reports. So a record is believed only
when the instance that wrote it held the cluster secret: each carries an HMAC-SHA256 under
the registry key (derived from the secret, ``cluster/auth.py``) over the exact bytes the
gateway then parses, and the Redis key it was found under. Someone who can write to Redis
but lacks the secret can delete records, never add or alter one.

The signature is field 5 of ``Registration`` (``proto/splitserve/v1/disaggregation.proto``),
written last: the value is the record without it, then that one field (34 bytes: its tag,
its length, the 32-byte MAC). The gateway splits the value there, checks the MAC over the
bytes before it and only then parses them. Nothing is re-serialized, so no two protobuf
versions can disagree about what was signed, and an unauthenticated value is never parsed.

A record then has to make sense, signed or not (:func:`record_problem`): a timestamp that
is finite and within :data:`MAX_RECORD_AGE_S` behind and :data:`~cluster.auth.MAX_CLOCK_SKEW_S`
ahead of the gateway's clock (a replay of an old genuine record is stale), and a load report
whose every number is finite and not negative, with no more free blocks than blocks and a
context of at least one block (:func:`load_report_problem`). A record that fails any of this
is ignored, never half-used, and the gateway counts it by :data:`RefusalReason`.

Without a cluster secret nothing is signed, and a gateway without one believes any
well-formed record: loopback development only (both sides say so once in their log).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Literal

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from cluster.auth import MAX_CLOCK_SKEW_S
from splitserve.v1 import disaggregation_pb2

# Far more than a heartbeat's age in a live key (Redis expires it after three missed ones,
# a few seconds), plus the clock skew allowed between hosts.
MAX_RECORD_AGE_S = 30.0 + MAX_CLOCK_SKEW_S
SIGNATURE_BYTES = 32
_SIGNATURE_FIELD = disaggregation_pb2.Registration.DESCRIPTOR.fields_by_name["signature"].number
# The signature field as written last: its tag (field number, wire type 2: length-delimited) and length.
_SIGNATURE_HEADER = bytes([_SIGNATURE_FIELD << 3 | 2, SIGNATURE_BYTES])
_SIGNED_SUFFIX_BYTES = len(_SIGNATURE_HEADER) + SIGNATURE_BYTES
_VERSION = b"splitserve registry record v1"

RefusalReason = Literal["unsigned", "bad_signature", "malformed", "stale", "future", "invalid"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("unsigned", "bad_signature", "malformed", "stale", "future", "invalid")


class RecordRefused(ValueError):
    """A registry record a gateway must ignore, and why."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason: RefusalReason = reason


def encode_record(registration: disaggregation_pb2.Registration, registry_key: str, key: bytes | None) -> bytes:
    """The value an instance writes under ``registry_key``: signed with ``key`` (the cluster
    secret's registry key) when it has one."""
    if registration.signature:
        raise RuntimeError("bug: a registration to sign already carries a signature")
    body = registration.SerializeToString()
    if key is None:
        return body
    return body + _SIGNATURE_HEADER + _mac(key, registry_key, body)


def decode_record(
    value: bytes, registry_key: str, key: bytes | None, now_unix_s: float
) -> disaggregation_pb2.Registration:
    """The record a gateway may believe, found under ``registry_key``; ``key``: the gateway's
    registry key (None: no cluster secret, nothing is verified). Raises :class:`RecordRefused`."""
    body = value
    if key is not None:
        if len(value) < _SIGNED_SUFFIX_BYTES or value[-_SIGNED_SUFFIX_BYTES:-SIGNATURE_BYTES] != _SIGNATURE_HEADER:
            raise RecordRefused(
                "unsigned",
                "it is not signed: an instance without the cluster secret, or someone else, wrote it",
            )
        body, signature = value[:-_SIGNED_SUFFIX_BYTES], value[-SIGNATURE_BYTES:]
        if not hmac.compare_digest(signature, _mac(key, registry_key, body)):
            raise RecordRefused(
                "bad_signature",
                "its signature does not match: it was altered, moved from another key, or signed under another "
                "cluster secret",
            )
    registration = disaggregation_pb2.Registration()
    try:
        registration.ParseFromString(body)
    except DecodeError as error:
        raise RecordRefused("malformed", f"it is not a Registration: {error}") from None
    problem = record_problem(registration, now_unix_s)
    if problem is not None:
        raise RecordRefused(*problem)
    return registration


def record_problem(
    registration: disaggregation_pb2.Registration, now_unix_s: float
) -> tuple[RefusalReason, str] | None:
    """Why a (verified) record makes no sense at ``now_unix_s``, by the gateway's clock; None when it does."""
    unix_s = registration.unix_s
    if not math.isfinite(unix_s):
        return "invalid", f"its timestamp is {unix_s}"
    if now_unix_s - unix_s > MAX_RECORD_AGE_S:
        return "stale", f"it was written {now_unix_s - unix_s:.0f} s ago (at most {MAX_RECORD_AGE_S:g} s): a replay?"
    if unix_s - now_unix_s > MAX_CLOCK_SKEW_S:
        return (
            "future",
            f"it is dated {unix_s - now_unix_s:.0f} s ahead of this gateway's clock (at most {MAX_CLOCK_SKEW_S:g} s): "
            "keep hosts' clocks in sync (NTP)",
        )
    if not registration.grpc_address:
        return "invalid", "it names no address"
    problem = load_report_problem(registration.report)
    if problem is not None:
        return "invalid", problem
    return None


def load_report_problem(report: disaggregation_pb2.LoadReport) -> str | None:
    """Why a load report cannot be routed by; None when it can. Every number it carries must be
    finite and not negative (an infinite rate or a negative queue would skew every ranking), no
    more blocks free than it has, and its context, when given, at least one KV block."""
    problem = _numbers_problem(report, "")
    if problem is not None:
        return problem
    if report.num_free_blocks > report.num_total_blocks:
        return f"it reports {report.num_free_blocks} free KV blocks of {report.num_total_blocks}"
    block_size = max(report.fingerprint.block_size, 1)
    if report.max_model_len and report.max_model_len < block_size:
        return f"its max_model_len {report.max_model_len} is shorter than one KV block ({block_size} tokens)"
    return None


def _numbers_problem(message: Message, prefix: str) -> str | None:
    for descriptor, value in message.ListFields():
        name = prefix + descriptor.name
        if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
            if descriptor.is_repeated:
                continue  # a load report has no repeated messages
            problem = _numbers_problem(value, name + ".")
            if problem is not None:
                return problem
        elif isinstance(value, bool) or not isinstance(value, int | float):
            continue
        elif not math.isfinite(value) or value < 0:
            return f"its {name} is {value}"
    return None


def _mac(key: bytes, registry_key: str, body: bytes) -> bytes:
    """Over the version, the Redis key and the record's bytes, each length-prefixed."""
    parts = (_VERSION, registry_key.encode(), body)
    return hmac.new(key, b"".join(len(p).to_bytes(8, "little") + p for p in parts), hashlib.sha256).digest()
