"""Registry records signed with the cluster secret (``cluster/registry_record.py``): a
gateway believes a record only when it is signed under its own secret for the key it was
found under, dated within the clock window, and every number in it makes sense; every other
record is refused with its reason, before anything unsigned is parsed."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from cluster.auth import MAX_CLOCK_SKEW_S, ClusterSecret
from cluster.registry_record import MAX_RECORD_AGE_S, RecordRefused, decode_record, encode_record
from splitserve.v1 import disaggregation_pb2

KEY = ClusterSecret.from_text("the-cluster-secret-of-these-tests").registry_key
OTHER_KEY = ClusterSecret.from_text("another-cluster-secret-entirely").registry_key
REDIS_KEY = "splitserve:instance:decode-0"
NOW = 1_700_000_000.0


def registration(**changes: object) -> disaggregation_pb2.Registration:
    record = disaggregation_pb2.Registration(
        grpc_address="10.0.0.7:50071",
        report=disaggregation_pb2.LoadReport(
            instance_id="decode-0",
            role="decode",
            num_free_blocks=8,
            num_total_blocks=8,
            max_model_len=2048,
            prefill_tokens_per_s=1500.0,
            fingerprint=disaggregation_pb2.Fingerprint(model="m", block_size=16),
        ),
        unix_s=NOW,
        serving=True,
    )
    for path, value in changes.items():
        target, *names = path.split("__")
        message = record if target == "record" else record.report
        for name in names[:-1]:
            message = getattr(message, name)
        setattr(message, names[-1], value)
    return record


def test_a_signed_record_is_believed_as_written() -> None:
    record = registration()
    value = encode_record(record, REDIS_KEY, KEY)
    assert decode_record(value, REDIS_KEY, KEY, NOW) == record
    # A gateway without a secret reads it too (the signature is a field it ignores).
    assert decode_record(value, REDIS_KEY, None, NOW).grpc_address == record.grpc_address
    assert decode_record(encode_record(record, REDIS_KEY, None), REDIS_KEY, None, NOW) == record


def _flip_last_body_byte(value: bytes) -> bytes:
    return value[:-35] + bytes([value[-35] ^ 1]) + value[-34:]


@pytest.mark.parametrize(
    ("reason", "value", "redis_key"),
    [
        ("unsigned", lambda: encode_record(registration(), REDIS_KEY, None), REDIS_KEY),
        ("bad_signature", lambda: encode_record(registration(), REDIS_KEY, OTHER_KEY), REDIS_KEY),
        ("bad_signature", lambda: _flip_last_body_byte(encode_record(registration(), REDIS_KEY, KEY)), REDIS_KEY),
        # A genuine record copied under another instance's key.
        ("bad_signature", lambda: encode_record(registration(), REDIS_KEY, KEY), "splitserve:instance:decode-1"),
        ("unsigned", lambda: b"\x00garbage", REDIS_KEY),
    ],
    ids=["unsigned", "another-secret", "altered", "moved", "garbage"],
)
def test_a_record_not_signed_with_this_secret_for_this_key_is_refused(
    reason: str, value: Callable[[], bytes], redis_key: str
) -> None:
    with pytest.raises(RecordRefused) as refused:
        decode_record(value(), redis_key, KEY, NOW)
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    ("reason", "changes"),
    [
        ("stale", {"record__unix_s": NOW - MAX_RECORD_AGE_S - 1}),
        ("future", {"record__unix_s": NOW + MAX_CLOCK_SKEW_S + 1}),
        ("invalid", {"record__unix_s": math.inf}),  # it would freeze the instance's reports
        ("invalid", {"record__unix_s": math.nan}),
        ("invalid", {"record__grpc_address": ""}),
        ("invalid", {"report__max_model_len": 1}),  # it would refuse every request
        ("invalid", {"report__max_model_len": -5}),
        ("invalid", {"report__num_waiting": -1}),
        ("invalid", {"report__prefill_tokens_per_s": math.inf}),
        ("invalid", {"report__prefill_tokens_per_s": math.nan}),
        ("invalid", {"report__counters__step_seconds": -math.inf}),
        ("invalid", {"report__num_free_blocks": 9}),
    ],
    ids=lambda value: str(value).replace("__", "."),
)
def test_a_signed_record_that_makes_no_sense_is_refused(reason: str, changes: dict[str, object]) -> None:
    """Signed, yet refused: the checks hold for every record, signed or not."""
    value = encode_record(registration(**changes), REDIS_KEY, KEY)
    for key in (KEY, None):
        with pytest.raises(RecordRefused) as refused:
            decode_record(value, REDIS_KEY, key, NOW)
        assert refused.value.reason == reason


def test_within_the_window_a_record_is_believed() -> None:
    for unix_s in (NOW - MAX_RECORD_AGE_S + 1, NOW + MAX_CLOCK_SKEW_S - 1):
        value = encode_record(registration(record__unix_s=unix_s), REDIS_KEY, KEY)
        assert decode_record(value, REDIS_KEY, KEY, NOW).unix_s == unix_s
