"""KV handle signatures: every field is covered, and so is the prompt the handle travels
with; a handle signed under another key, unsigned, altered in any field, or presented with
another prompt is refused."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

from cluster.auth import ClusterSecret
from cluster.handle_signing import PULL_TOKEN_BYTES, HandleRejected, new_pull_token, sign_handle, verify_handle
from splitserve.v1 import disaggregation_pb2

PROMPT = list(range(40))
KEY = ClusterSecret.from_text("a-cluster-secret-for-tests").handle_key
OTHER_KEY = ClusterSecret.from_text("another-cluster-secret-for-tests").handle_key


def make_handle() -> disaggregation_pb2.KVHandle:
    return disaggregation_pb2.KVHandle(
        request_id="req-1",
        connector="ucx",
        connector_address="10.0.0.1:50062",
        block_ids=[7, 3, 9],
        num_tokens=40,
        fingerprint=disaggregation_pb2.Fingerprint(
            model="m-0123",
            dtype="bfloat16",
            block_size=16,
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            tensor_parallel_size=1,
            stage_first_layers=[0],
            draft="medusa:heads-0123",
        ),
        prefill_address="10.0.0.1:50061",
        lease_s=30.0,
        pull_token=bytes(range(16)),
        chunk_digests=[bytes(range(32)), bytes(32)],
        rank_connector_addresses=["10.0.0.1:50062", "10.0.0.1:50063"],
        draft_token_ids=[17, 4, 99],
        draft_kv_digest=bytes(range(1, 33)),
    )


def signed() -> disaggregation_pb2.KVHandle:
    handle = make_handle()
    sign_handle(handle, PROMPT, KEY)
    return handle


def test_a_signed_handle_verifies() -> None:
    handle = signed()
    assert len(handle.signature) == 32
    verify_handle(handle, PROMPT, KEY)
    verify_handle(
        disaggregation_pb2.KVHandle.FromString(handle.SerializeToString()), tuple(PROMPT), KEY
    )  # as it crosses the wire


def test_unsigned_and_foreign_handles_are_refused() -> None:
    with pytest.raises(HandleRejected, match="not signed"):
        verify_handle(make_handle(), PROMPT, KEY)
    handle = make_handle()
    sign_handle(handle, PROMPT, OTHER_KEY)
    with pytest.raises(HandleRejected, match="another --cluster-secret"):
        verify_handle(handle, PROMPT, KEY)


def altered(name: str, handle: disaggregation_pb2.KVHandle) -> None:
    """Change field ``name`` of ``handle`` to another valid value."""
    field = handle.DESCRIPTOR.fields_by_name[name]
    if field.message_type is not None:
        handle.fingerprint.head_dim += 1
    elif field.is_repeated:
        values = list(getattr(handle, name))
        first = values[0]
        values[0] = first + 1 if isinstance(first, int) else first + "x" if isinstance(first, str) else bytes([9]) * 16
        del getattr(handle, name)[:]
        getattr(handle, name).extend(values)
    elif field.type == FieldDescriptor.TYPE_STRING:
        setattr(handle, name, getattr(handle, name) + "x")
    elif field.type == FieldDescriptor.TYPE_BYTES:
        setattr(handle, name, bytes(16))
    else:
        setattr(handle, name, getattr(handle, name) + 1)


@pytest.mark.parametrize(
    "name", [f.name for f in disaggregation_pb2.KVHandle.DESCRIPTOR.fields if f.name != "signature"]
)
def test_every_field_is_covered_by_the_signature(name: str) -> None:
    """A field added to KVHandle later fails here until handle_signing covers it."""
    handle = signed()
    altered(name, handle)
    assert handle != signed()
    with pytest.raises(HandleRejected, match="does not match"):
        verify_handle(handle, PROMPT, KEY)


@pytest.mark.parametrize("name", [f.name for f in disaggregation_pb2.Fingerprint.DESCRIPTOR.fields])
def test_every_fingerprint_field_is_covered_by_the_signature(name: str) -> None:
    """D checks the handle's fingerprint against its own (the drafter included): a fingerprint
    field added later fails here until handle_signing covers it."""
    handle = signed()
    field = handle.fingerprint.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        getattr(handle.fingerprint, name).append(1)
    elif field.type == FieldDescriptor.TYPE_STRING:
        setattr(handle.fingerprint, name, getattr(handle.fingerprint, name) + "x")
    else:
        setattr(handle.fingerprint, name, getattr(handle.fingerprint, name) + 1)
    assert handle != signed()
    with pytest.raises(HandleRejected, match="does not match"):
        verify_handle(handle, PROMPT, KEY)


@pytest.mark.parametrize("prompt", [PROMPT[:-1] + [PROMPT[-1] + 1], list(reversed(PROMPT)), PROMPT + [0], []])
def test_a_handle_verifies_only_with_its_own_prompt(prompt: list[int]) -> None:
    """The prompt travels beside the handle (DecodeRequest.prompt_token_ids): a genuine handle
    presented with another prompt would cache one prompt's KV under the other's hashes."""
    with pytest.raises(HandleRejected, match="another prompt than the call's prompt_token_ids"):
        verify_handle(signed(), prompt, KEY)


def test_fields_cannot_trade_bytes_with_their_neighbours() -> None:
    """Fields are length-prefixed: moving a character from the request id (signed first) to
    P's address (signed next) is another handle, with another signature."""
    first, second = make_handle(), make_handle()
    first.request_id, first.prefill_address = "req-1", "10.0.0.1:50061"
    second.request_id, second.prefill_address = "req-", "110.0.0.1:50061"
    sign_handle(first, PROMPT, KEY)
    sign_handle(second, PROMPT, KEY)
    assert first.signature != second.signature


def test_pull_tokens_are_random() -> None:
    tokens = {new_pull_token() for _ in range(100)}
    assert len(tokens) == 100 and all(len(t) == PULL_TOKEN_BYTES for t in tokens)
