"""UCX transfers between two real processes on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from kv_connector import ucx
from kv_connector.base import KVSource, KVTransferError
from kv_connector.ucx import UCXConnector
from kv_connector.ucx_context import limit_to_loopback, ucxx_for_running_loop
from kv_connector.ucx_messages import (
    consecutive_runs_error,
    header_buffer,
    message_spans,
    plan_messages,
    recv_header,
    send_header,
)
from kv_connector.wire import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    PullCredentials,
    PullReply,
    PullRequest,
    WireError,
    decode_pull_body,
    decode_pull_reply,
    decode_pull_request,
    encode,
    max_pull_request_bytes,
    read_pull_credentials,
)
from tests.kv_connector.ucx_peer import (
    DRAFT_SHAPE,
    DRAFT_START,
    DRAFTED_BLOCKS,
    DRAFTED_TOKENS,
    GUARDED_BLOCKS,
    GUARDED_TOKEN,
    PUBLISHED_BLOCKS,
    RUN_BLOCKS,
    SHAPE,
    SLOW_BLOCKS,
    PeerState,
    fingerprint,
    seeded_cache,
    seeded_draft_kv,
)

ROOT = Path(__file__).resolve().parents[2]
UCX_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}


@dataclass(slots=True)
class Peer:
    address: str
    process: subprocess.Popen

    def command(self, line: str) -> str:
        """Send one command (see ``tests.kv_connector.ucx_peer``) and return the peer's answer."""
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def state(self) -> PeerState:
        return PeerState(**json.loads(self.command("state")))

    def stop(self) -> PeerState:
        """Close stdin, wait for the peer to exit and return the state it reports."""
        self.process.stdin.close()
        line = self.process.stdout.readline()
        self.process.wait(timeout=30)
        return PeerState(**json.loads(line))


@contextmanager
def running_peer(*args: str, seed: int = 7) -> Iterator[Peer]:
    """A prefill-side connector process (``tests.kv_connector.ucx_peer``), stopped afterwards."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.kv_connector.ucx_peer", "--seed", str(seed), *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **UCX_ENV},
    )
    peer = Peer("", process)
    try:
        peer.address = process.stdout.readline().strip()
        assert peer.address.startswith("127.0.0.1:"), peer.address
        yield peer
    finally:
        if not process.stdin.closed:
            process.stdin.close()
        process.wait(timeout=30)
        process.stdout.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[str]:
    with running_peer() as running:
        yield running.address


# ------------------------------------------------------------- in-process parts


def test_messages_are_runs_consecutive_on_both_sides() -> None:
    assert plan_messages([4, 5, 6, 9], [0, 1, 2, 3], max_blocks=8) == [3, 1]
    assert plan_messages([4, 5, 6, 7], [0, 1, 5, 6], max_blocks=8) == [2, 2]  # consecutive remotely only
    assert plan_messages(list(range(10)), list(range(20, 30)), max_blocks=4) == [4, 4, 2]
    assert plan_messages([5, 2, 9, 7], [0, 3, 11, 6], max_blocks=8) == [1, 1, 1, 1]
    assert plan_messages([], [], max_blocks=1) == []
    assert list(message_spans([4, 5, 6, 9], [3, 1])) == [(4, 3), (9, 1)]


def test_a_message_plan_must_cut_the_blocks_into_consecutive_runs() -> None:
    assert consecutive_runs_error([4, 5, 6, 9], [3, 1]) is None
    assert consecutive_runs_error([4, 5, 6, 9], [2, 1]) == "messages of 3 blocks in all for 4 blocks"
    assert consecutive_runs_error([4, 5, 6, 9], [2, 2]) == "message 1 names blocks [6, 9], which are not consecutive"
    assert consecutive_runs_error([3, 3], [2]) == "message 0 names blocks [3, 3], which are not consecutive"


def prefill_side() -> UCXConnector:
    """A prefill-side connector holding ``PUBLISHED_BLOCKS`` and ``RUN_BLOCKS`` (any pull), and
    ``GUARDED_BLOCKS`` (pulls presenting ``GUARDED_TOKEN``); not listening: its answers are read
    without UCX."""
    connector = UCXConnector(seeded_cache(7), fingerprint())

    async def publish() -> None:
        await connector.publish("r", PUBLISHED_BLOCKS, token_ids=[])
        await connector.publish("run", RUN_BLOCKS, token_ids=[])
        await connector.publish("guarded", GUARDED_BLOCKS, token_ids=[], pull_token=GUARDED_TOKEN)

    asyncio.run(publish())
    return connector


def answer(request: PullRequest) -> PullReply:
    """What :func:`prefill_side` answers."""
    reply, _ = prefill_side()._answer(encode(request))
    return reply


def test_a_connector_on_a_loopback_host_keeps_ucx_data_lanes_on_lo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert not limit_to_loopback("10.1.2.3") and "UCX_NET_DEVICES" not in os.environ
    assert not limit_to_loopback("0.0.0.0") and "UCX_NET_DEVICES" not in os.environ
    for host in ("127.0.0.1", "::1", "localhost"):
        monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
        assert limit_to_loopback(host) and os.environ["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")  # the operator's choice wins
    assert not limit_to_loopback("127.0.0.1") and os.environ["UCX_NET_DEVICES"] == "eth0"


def test_prefill_side_checks_the_message_plan() -> None:
    ok = answer(PullRequest("run", RUN_BLOCKS, fingerprint(), message_blocks=[2, 2]))
    assert (
        ok.ok
        and ok.shape == list(SHAPE[1:])
        and ok.num_bytes == 4 * torch.zeros(SHAPE[1:], dtype=torch.bfloat16).nbytes
    )
    split = answer(PullRequest("r", PUBLISHED_BLOCKS, fingerprint(), message_blocks=[2, 2]))
    assert not split.ok and split.error == "bad message plan: message 0 names blocks [5, 2], which are not consecutive"
    short = answer(PullRequest("run", RUN_BLOCKS, fingerprint(), message_blocks=[3]))
    assert not short.ok and "messages of 3 blocks in all for 4 blocks" in short.error
    malformed = UCXConnector(seeded_cache(7), fingerprint())._answer(b'{"version": 2, "request_id": "run"}')[0]
    assert not malformed.ok and malformed.error.startswith("bad pull request:")


class ScriptedEndpoint:
    """Stands in for a ucxx endpoint in header framing tests: records what is sent, and
    receives the given messages in order the way UCX does (into the start of the buffer,
    the rest left as it was)."""

    def __init__(self, *messages: bytes) -> None:
        self.messages = list(messages)
        self.sent: list[bytes] = []

    async def send(self, buffer: np.ndarray) -> None:
        self.sent.append(buffer.tobytes())

    async def recv(self, buffer: np.ndarray) -> None:
        message = self.messages.pop(0)
        buffer[: len(message)] = np.frombuffer(message, dtype=np.uint8)


def test_a_header_is_one_message_and_a_truncated_one_never_reads_as_an_earlier_one() -> None:
    request = PullRequest("r", [4, 5], fingerprint(), message_blocks=[2])

    async def scenario() -> None:
        sender = ScriptedEndpoint()
        await send_header(sender, request)
        (frame,) = sender.sent
        buffer = header_buffer()
        receiver = ScriptedEndpoint(frame, frame[:-10], (1 << 40).to_bytes(8, "little"))
        assert decode_pull_request(await recv_header(receiver, buffer)) == request
        with pytest.raises(WireError, match="not JSON"):  # the tail of the first header was wiped
            decode_pull_request(await recv_header(receiver, buffer))
        with pytest.raises(WireError, match="header of 1099511627776 bytes"):
            await recv_header(receiver, buffer)
        assert not buffer.any()

    asyncio.run(scenario())


def frame_and_body(request: PullRequest) -> tuple[PullCredentials, dict[str, object]]:
    """A pull request as it travels: its fixed frame, read, and its JSON, parsed."""
    credentials, rest = read_pull_credentials(encode(request))
    return credentials, json.loads(bytes(rest))


def test_wire_refuses_message_plans_that_are_not_positive_counts() -> None:
    credentials, body = frame_and_body(PullRequest("r", [1, 2], fingerprint(), message_blocks=[2]))
    for bad in ([0, 2], [True, 1], "2", None):
        with pytest.raises(WireError, match="message_blocks"):
            decode_pull_body(credentials, json.dumps({**body, "message_blocks": bad}).encode())


def test_wire_carries_the_drafter_and_refuses_one_that_is_not_a_string() -> None:
    drafting = replace(fingerprint(), draft="medusa:heads-0123")
    request = PullRequest("r", [1, 2], drafting, message_blocks=[2])
    assert decode_pull_request(encode(request)).fingerprint == drafting
    credentials, body = frame_and_body(request)
    assert isinstance(body["fingerprint"], dict)
    for bad in (7, None, ["medusa:heads-0123"]):
        with pytest.raises(WireError, match="fingerprint.draft"):
            altered = {**body, "fingerprint": {**body["fingerprint"], "draft": bad}}
            decode_pull_body(credentials, json.dumps(altered).encode())


def test_wire_carries_the_draft_kv_ask_and_offer_and_refuses_bad_ones() -> None:
    request = PullRequest("r", [], fingerprint(), message_blocks=[], draft_kv=True)
    assert decode_pull_request(encode(request)) == request  # no block: the draft KV alone
    credentials, body = frame_and_body(request)
    with pytest.raises(WireError, match="draft_kv must be bool"):
        decode_pull_body(credentials, json.dumps({**body, "draft_kv": 1}).encode())
    offer = PullReply(ok=True, draft_kv=[8, 24], draft_shape=[1, 2, 2, 8], draft_dtype="float32")
    assert decode_pull_reply(encode(offer)) == offer
    reply = json.loads(encode(offer))
    for name, bad in (("draft_kv", [8]), ("draft_kv", [-1, 2]), ("draft_shape", [1.5]), ("draft_dtype", 7)):
        with pytest.raises(WireError, match=name):
            decode_pull_reply(json.dumps({**reply, name: bad}).encode())


# ------------------------------------------------------------- two processes


def source(
    address: str,
    request_id: str = "r",
    blocks: list[int] = PUBLISHED_BLOCKS,
    model: str = "tiny-0123",
    pull_token: bytes = b"",
) -> KVSource:
    return KVSource(
        request_id=request_id,
        address=address,
        block_ids=tuple(blocks),
        num_tokens=60,
        fingerprint=fingerprint(model),
        pull_token=pull_token,
    )


def decode_connector(
    cache: torch.Tensor, model: str = "tiny-0123", max_message_blocks: int | None = None
) -> UCXConnector:
    return UCXConnector(cache, fingerprint(model), max_message_blocks=max_message_blocks)


def run(scenario) -> object:
    os.environ.update(UCX_ENV)
    return asyncio.run(scenario())


def pull(
    cache: torch.Tensor, src: KVSource, local_blocks: list[int], num_local_hit_blocks: int = 0, model: str = "tiny-0123"
):
    async def scenario():
        connector = decode_connector(cache, model)
        try:
            return await connector.pull(src, local_blocks, num_local_hit_blocks, timeout_s=10.0)
        finally:
            await connector.close()

    return run(scenario)


def empty_cache() -> torch.Tensor:
    return torch.zeros(SHAPE, dtype=torch.bfloat16)


def test_pull_copies_exactly_the_named_blocks(peer: str) -> None:
    remote = seeded_cache(7)
    local = empty_cache()
    stats = pull(local, source(peer), [0, 3, 11, 6])
    assert stats.num_blocks == 4 and stats.num_bytes == 4 * remote[0].nbytes
    for mine, theirs in zip([0, 3, 11, 6], PUBLISHED_BLOCKS, strict=True):
        assert torch.equal(local[mine], remote[theirs])
    untouched = [b for b in range(SHAPE[0]) if b not in (0, 3, 11, 6)]
    assert not local[untouched].any()


def test_blocks_consecutive_on_both_sides_travel_as_one_message() -> None:
    remote = seeded_cache(7)
    with running_peer() as running:
        for local_blocks, max_message_blocks, expected_messages in (
            ([0, 1, 2, 3], None, 1),
            ([0, 1, 5, 6], None, 2),
            ([2, 3, 4, 5], 3, 2),
        ):
            local = empty_cache()
            sent_before = running.state().messages_sent

            async def scenario(
                local: torch.Tensor = local, blocks: list[int] = local_blocks, cap: int | None = max_message_blocks
            ):
                connector = decode_connector(local, max_message_blocks=cap)
                try:
                    return await connector.pull(source(running.address, "run", RUN_BLOCKS), blocks, 0, timeout_s=10.0)
                finally:
                    await connector.close()

            stats = run(scenario)
            assert torch.equal(local[local_blocks], remote[RUN_BLOCKS])
            assert running.state().messages_sent - sent_before == expected_messages == stats.num_messages, local_blocks


def test_local_prefix_hits_are_not_pulled(peer: str) -> None:
    remote = seeded_cache(7)
    local = empty_cache()
    stats = pull(local, source(peer), [1, 2, 3, 4], num_local_hit_blocks=2)
    assert stats.num_blocks == 2
    assert not local[[1, 2]].any()
    assert torch.equal(local[3], remote[PUBLISHED_BLOCKS[2]])
    assert torch.equal(local[4], remote[PUBLISHED_BLOCKS[3]])


def test_pulls_reuse_one_connection_and_refusals_drop_it(peer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = seeded_cache(7)
    local = empty_cache()
    # A failed pull waits this long for writes P may have started, unless P refused it (P sends
    # nothing then): a refused pull that waited would end at its own timeout, "timed out".
    monkeypatch.setattr(ucx, "SETTLE_S", 3600.0)

    async def scenario() -> None:
        connector = decode_connector(local)
        try:
            for local_blocks in ([0, 1, 2, 3], [8, 6, 4, 10]):
                await connector.pull(source(peer), local_blocks, 0, timeout_s=10.0)
                assert connector.num_connections == 1
                assert torch.equal(local[local_blocks], remote[PUBLISHED_BLOCKS])
            with pytest.raises(KVTransferError, match="no KV published"):
                await connector.pull(source(peer, request_id="other"), [0, 1, 2, 3], 0, timeout_s=10.0)
            assert connector.num_connections == 0  # it had receives posted for messages that never come
            local.zero_()
            await connector.pull(source(peer), [0, 1, 2, 3], 0, timeout_s=10.0)
            assert torch.equal(local[[0, 1, 2, 3]], remote[PUBLISHED_BLOCKS])
            assert connector.num_transfers_in_flight == 0
        finally:
            await connector.close()

    run(scenario)


def test_a_pull_must_present_the_token_the_request_was_published_with(peer: str) -> None:
    remote = seeded_cache(7)
    wrong = bytes(16)
    for token in (b"", wrong, GUARDED_TOKEN[:-1]):
        local = empty_cache()
        with pytest.raises(KVTransferError, match="the pull token for request 'guarded' does not match"):
            pull(local, source(peer, "guarded", GUARDED_BLOCKS, pull_token=token), [1, 2])
        assert not local.any(), "nothing was sent"
    local = empty_cache()
    pull(local, source(peer, "guarded", GUARDED_BLOCKS, pull_token=GUARDED_TOKEN), [1, 2])
    assert torch.equal(local[[1, 2]], remote[GUARDED_BLOCKS])


def test_wire_refuses_a_frame_that_is_short_or_sizes_its_fields_past_their_caps() -> None:
    request = PullRequest("r", [1, 2], fingerprint(), message_blocks=[2], pull_token=b"\xab" * 16)
    encoded = encode(request)
    assert decode_pull_request(encoded) == request
    assert read_pull_credentials(encoded)[0] == PullCredentials("r", b"\xab" * 16)
    with pytest.raises(ValueError, match="a pull token of 65"):
        encode(PullRequest("r", [1, 2], fingerprint(), message_blocks=[2], pull_token=bytes(65)))
    too_long_token = struct.pack("<HHB", PROTOCOL_VERSION, 1, 65) + b"r" + bytes(65) + b"{}"
    short_frame = struct.pack("<HHB", PROTOCOL_VERSION, 10, 16) + b"r"
    for bad, reason in (
        (too_long_token, "a pull token of 65"),
        (short_frame, "a frame of 31 bytes in a pull request of 6"),
        (encoded[:4], "a pull request of 4 bytes"),
        (struct.pack("<HHB", PROTOCOL_VERSION - 1, 1, 0) + b"r{}", "protocol version 7, this side speaks 8"),
        (struct.pack("<HHB", PROTOCOL_VERSION, 1, 0) + b"\xff{}", "the request id is not UTF-8"),
    ):
        with pytest.raises(WireError, match=reason):
            read_pull_credentials(bad)


def test_idle_connections_are_closed_by_the_prefill_side() -> None:
    """Nobody keeps a connection to P open for nothing: P closes one idle past its timeout,
    and D's next pull opens a new one."""
    remote = seeded_cache(7)
    local = empty_cache()
    with running_peer("--idle-timeout", "0.5") as running:

        async def scenario() -> None:
            connector = UCXConnector(local, fingerprint(), idle_timeout_s=0.5)
            try:
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
                assert running.state().serving_connections == 1
                await until_no_serving_connections(running)
                local.zero_()
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
                assert torch.equal(local[[0, 1, 2, 3]], remote[PUBLISHED_BLOCKS])
                await until_no_serving_connections(running)  # the new one is closed for idleness too
            finally:
                await connector.close()

        run(scenario)
        assert running.stop().serving_connections == 0


async def until_no_serving_connections(running: Peer) -> None:
    deadline = time.monotonic() + 120  # a safety net: P closes it after its idle timeout
    while running.state().serving_connections and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert running.state().serving_connections == 0


def test_unknown_request_is_refused(peer: str) -> None:
    with pytest.raises(KVTransferError, match="no KV published for request 'other'"):
        pull(empty_cache(), source(peer, request_id="other"), [0, 1, 2, 3])


def test_blocks_outside_the_request_are_refused(peer: str) -> None:
    with pytest.raises(KVTransferError, match=r"blocks \[0\] are not the request's"):
        pull(empty_cache(), source(peer, blocks=[5, 0]), [1, 2])


def test_fingerprint_mismatch_is_refused_on_both_sides(peer: str) -> None:
    # Caught locally against the handle's fingerprint...
    with pytest.raises(KVTransferError, match="model: decode has 'tiny-9999', prefill has 'tiny-0123'"):
        pull(empty_cache(), source(peer), [0, 1, 2, 3], model="tiny-9999")
    # ...and by the peer, when the handle claims what the peer is not.
    with pytest.raises(KVTransferError, match="refused the pull: KV caches are incompatible"):
        pull(empty_cache(), source(peer, model="tiny-9999"), [0, 1, 2, 3], model="tiny-9999")


def test_oversized_header_closes_only_that_connection(peer: str) -> None:
    async def scenario() -> None:
        ucxx = ucxx_for_running_loop()
        host, _, port = peer.rpartition(":")
        endpoint = await ucxx.create_endpoint(host, int(port))
        try:
            await endpoint.send(np.array([1 << 40], dtype=np.uint64))  # a header size the peer must not allocate
            await _closed_by_peer(endpoint)
        finally:
            await endpoint.close()

    run(scenario)
    local = empty_cache()
    pull(local, source(peer), [0, 1, 2, 3])
    assert torch.equal(local[[0, 1, 2, 3]], seeded_cache(7)[PUBLISHED_BLOCKS])


def test_pull_timed_out_mid_transfer_leaves_nothing_behind() -> None:
    """P holds back the second message of "slow" until told (a pull of "r" first opens the
    connection, so that the short timeout covers only the transfer). D's pull times out, waits
    at most SETTLE_S for writes in flight, and drops its connection: it ends while P still holds
    the message back. Nothing writes into its blocks once the pull has raised, even after P sends
    on; both sides end with no transfer in flight, and the same request then pulls intact."""
    remote = seeded_cache(7)
    local = empty_cache()
    local_blocks = [6, 0, 8, 4]
    with running_peer("--hold", "slow:1", "--drain-seconds", "5") as running:

        async def command(line: str) -> str:
            return await asyncio.get_running_loop().run_in_executor(None, running.command, line)

        async def scenario() -> None:
            connector = decode_connector(local)
            try:
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
                local.zero_()
                # The held-back message cannot come before the test releases it: only the timeout
                # ends this pull, and a pull that waited for that message would never end.
                pulling = asyncio.ensure_future(
                    connector.pull(source(running.address, "slow", SLOW_BLOCKS), local_blocks, 0, timeout_s=3.0)
                )
                assert await command("held") == "holding"  # P sent every other message
                with pytest.raises(KVTransferError, match="timed out after 3.0 s"):
                    await asyncio.wait_for(pulling, 120.0)  # a safety net: its TimeoutError fails the test
                # Mid-pull: every message but the held-back one landed.
                assert not local[local_blocks[1]].any()
                for index in (0, 2, 3):
                    assert torch.equal(local[local_blocks[index]], remote[SLOW_BLOCKS[index]])
                assert connector.num_transfers_in_flight == 0 and connector.num_connections == 0
                local.zero_()
                # P sends the held-back message only now (answered once its send is over).
                assert await command("release") in ("released sent", "released failed")
                assert not local.any()
                await connector.pull(source(running.address, "slow", SLOW_BLOCKS), local_blocks, 0, timeout_s=10.0)
                assert torch.equal(local[local_blocks], remote[SLOW_BLOCKS])
            finally:
                await connector.close()

        run(scenario)
        assert running.stop() == PeerState(transfers_in_flight=0, serving_connections=0, messages_sent=12)


def test_unpublish_cuts_off_a_pull_reading_the_blocks() -> None:
    """P releases "slow" while a pull of it waits for its held-back second message: unpublish
    returns only once nothing reads the blocks (the pull's sends are over), D's pull fails on
    the cut rather than at its timeout, and a later pull of the request is refused."""
    local = empty_cache()
    with running_peer("--hold", "slow:1", "--drain-seconds", "5") as running:

        async def scenario() -> None:
            connector = decode_connector(local)
            try:
                # P holds the message until released (never, here): the pull can end only on the
                # cut or at its timeout, which is a safety net and would say "timed out", not "failed".
                pulling = asyncio.ensure_future(
                    connector.pull(source(running.address, "slow", SLOW_BLOCKS), [0, 1, 2, 3], 0, timeout_s=120.0)
                )
                while not local[3].any():  # the last message landed: only the held-back one is outstanding
                    await asyncio.sleep(0.01)
                answer = await asyncio.get_running_loop().run_in_executor(None, running.command, "unpublish slow")
                assert answer == "unpublished"
                assert running.state().transfers_in_flight == 0
                with pytest.raises(KVTransferError, match=r"^pulling 4 blocks from \S+ failed: "):
                    await pulling
                with pytest.raises(KVTransferError, match="no KV published for request 'slow'"):
                    await connector.pull(source(running.address, "slow", SLOW_BLOCKS), [0, 1, 2, 3], 0, timeout_s=10.0)
                assert connector.num_transfers_in_flight == 0
            finally:
                await connector.close()

        run(scenario)
        assert running.stop() == PeerState(transfers_in_flight=0, serving_connections=0, messages_sent=4, refused=1)


def test_idle_connection_the_peer_dropped_is_replaced() -> None:
    remote = seeded_cache(7)
    local = empty_cache()
    with running_peer() as running:

        async def scenario() -> None:
            connector = decode_connector(local)
            try:
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
                assert connector.num_connections == 1
                assert running.command("drop") == "dropped"
                local.zero_()
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
                assert torch.equal(local[[0, 1, 2, 3]], remote[PUBLISHED_BLOCKS])
                assert connector.num_connections == 1
            finally:
                await connector.close()

        run(scenario)


def test_unreachable_peer_fails_fast_without_hanging() -> None:
    with pytest.raises(KVTransferError, match="127.0.0.1:9"):
        pull(empty_cache(), source("127.0.0.1:9"), [0, 1, 2, 3])


# ------------------------------------------------------------- the listener against strangers


def test_refused_pulls_are_logged_once_then_once_in_a_thousand(caplog: pytest.LogCaptureFixture) -> None:
    connector = prefill_side()
    wrong_token = encode(PullRequest("guarded", GUARDED_BLOCKS, fingerprint(), [1, 1], pull_token=bytes(16)))
    with caplog.at_level(logging.WARNING, logger="kv_connector.ucx"):
        for _ in range(2500):
            reply, request = connector._answer(wrong_token)
            assert request is None and "does not match" in reply.error
    refusals = [record.getMessage() for record in caplog.records]
    assert connector.num_refused == 2500 and len(refusals) == 3, refusals
    assert refusals[0].startswith("refused a KV pull: the pull token for request 'guarded' does not match")
    assert refusals[0].endswith("(1 refused since start)") and refusals[2].endswith("(2001 refused since start)")


def test_a_pull_is_refused_from_its_fixed_frame_before_its_header_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header of nearly MAX_HEADER_BYTES (160,000 block ids: a pull of a very large cache)
    under a wrong token, or naming a request P never published, is refused without the JSON
    parser running; so is one whose rest is not JSON at all, which a parse would have refused
    as such. The pull presenting the request's token is the one parsed."""
    connector = prefill_side()
    parsed: list[str] = []

    def counting_parse(credentials: PullCredentials, body: memoryview) -> PullRequest:
        parsed.append(credentials.request_id)
        return decode_pull_body(credentials, body)

    monkeypatch.setattr(ucx, "decode_pull_body", counting_parse)
    many_blocks = list(range(160_000))
    wrong_token = encode(PullRequest("guarded", many_blocks, fingerprint(), [len(many_blocks)], bytes(16)))
    assert MAX_HEADER_BYTES > len(wrong_token) > 0.9 * MAX_HEADER_BYTES
    frame_end = len(wrong_token) - len(read_pull_credentials(wrong_token)[1])
    not_json = wrong_token[:frame_end] + b"[" * (len(wrong_token) - frame_end)
    unknown = encode(PullRequest("someone-elses", many_blocks, fingerprint(), [len(many_blocks)], GUARDED_TOKEN))
    for data, refusal in (
        (wrong_token, "the pull token for request 'guarded' does not match"),
        (not_json, "the pull token for request 'guarded' does not match"),
        (unknown, "no KV published for request 'someone-elses'"),
    ):
        reply, request = connector._answer(data)
        assert request is None and reply.error.startswith(refusal), reply.error
    assert parsed == []
    right_token_not_json = not_json[: frame_end - 16] + GUARDED_TOKEN + not_json[frame_end:]
    reply, request = connector._answer(right_token_not_json)
    assert request is None and reply.error.startswith("bad pull request: header is not JSON")
    reply, request = connector._answer(
        encode(PullRequest("guarded", GUARDED_BLOCKS, fingerprint(), [1, 1], GUARDED_TOKEN))
    )
    assert reply.ok and request is not None and request.block_ids == GUARDED_BLOCKS
    assert parsed == ["guarded", "guarded"]


def test_a_pull_token_serves_one_pull() -> None:
    remote = seeded_cache(7)
    with running_peer() as running:
        guarded = source(running.address, "guarded", GUARDED_BLOCKS, pull_token=GUARDED_TOKEN)
        local = empty_cache()
        pull(local, guarded, [1, 2])
        assert torch.equal(local[[1, 2]], remote[GUARDED_BLOCKS])
        local.zero_()
        with pytest.raises(KVTransferError, match="the pull token for request 'guarded' was spent"):
            pull(local, guarded, [1, 2])
        assert not local.any()
        # A request published without a token (tools, benchmarks) may be pulled again.
        for _ in range(2):
            pull(local, source(running.address), [0, 3, 11, 6])
        assert running.stop().refused == 1


async def _connect(address: str):
    host, _, port = address.rpartition(":")
    return await ucxx_for_running_loop().create_endpoint(host, int(port))


async def _closed_by_peer(endpoint) -> None:
    """Until the peer closes the connection: a receive on it fails. The bound is a safety net
    against a hang, and its running out fails the test rather than passing for a closed connection."""
    try:
        await asyncio.wait_for(endpoint.recv(np.empty(8, dtype=np.uint8)), 120.0)
    except TimeoutError:
        pytest.fail("the peer never closed the connection")
    except Exception:  # ucxx names a closed connection variously
        return
    pytest.fail("the peer sent data rather than closing the connection")


async def _until_serving(running: Peer, num_connections: int) -> None:
    deadline = time.monotonic() + 120  # a safety net
    while running.state().serving_connections != num_connections and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert running.state().serving_connections == num_connections


def test_connections_past_the_cap_are_closed_as_they_arrive() -> None:
    remote = seeded_cache(7)
    # Only the cap can close a connection within _closed_by_peer's bound (refused counts it).
    with running_peer("--max-connections", "2", "--first-frame-timeout", "3600") as running:

        async def scenario() -> None:
            strangers = [await _connect(running.address) for _ in range(2)]
            await _until_serving(running, 2)
            third = await _connect(running.address)
            await _closed_by_peer(third)
            await third.close()
            assert running.state() == PeerState(transfers_in_flight=0, serving_connections=2, refused=1)
            for stranger in strangers:
                await stranger.close()
            await _until_serving(running, 0)
            local = empty_cache()
            connector = decode_connector(local)
            try:
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
            finally:
                await connector.close()
            assert torch.equal(local[[0, 1, 2, 3]], remote[PUBLISHED_BLOCKS])

        run(scenario)


def test_a_first_header_longer_than_a_pull_of_the_whole_cache_is_never_parsed() -> None:
    """The peer's cache holds 12 blocks: no pull request to it needs more than a few KiB. A
    100 KB header (under the 1 MiB every header may have) is refused by UCX as truncated:
    no reply, the connection closed, nothing parsed."""
    cap = max_pull_request_bytes(SHAPE[0])
    assert cap < 5000
    with running_peer() as running:

        async def scenario() -> None:
            endpoint = await _connect(running.address)
            body = b"[" + b"0," * 50_000 + b"0]"
            frame = np.frombuffer(len(body).to_bytes(8, "little") + body, dtype=np.uint8)
            await endpoint.send(frame)
            await _closed_by_peer(endpoint)
            await endpoint.close()

        run(scenario)
        assert running.stop() == PeerState(transfers_in_flight=0, serving_connections=0, refused=1)


def test_a_connection_that_sends_nothing_is_closed_after_the_first_frame_timeout() -> None:
    # Only the first-frame timeout can close it within _closed_by_peer's bound, not the idle one.
    with running_peer("--first-frame-timeout", "0.5", "--idle-timeout", "3600") as running:

        async def scenario() -> None:
            endpoint = await _connect(running.address)
            await _closed_by_peer(endpoint)
            await endpoint.close()

        run(scenario)
        assert running.stop().serving_connections == 0


def test_what_p_sends_after_the_settle_window_never_lands_in_reused_blocks() -> None:
    """P holds back the second message of a pull of "slow" until told. D's pull ends (the
    engine cancels it) once every other message has landed; it settles and drops its
    connection. D reuses the very blocks for a pull of "r" on a new connection; only then does
    P send the held-back message. It lands nowhere: the reused blocks keep "r"'s KV, through
    one more pull that makes D's UCX progress whatever has come."""
    remote = seeded_cache(7)
    local = empty_cache()
    reused = [6, 0, 8, 4]
    with running_peer("--hold", "slow:1", "--drain-seconds", "5") as running:

        async def command(line: str) -> str:
            return await asyncio.get_running_loop().run_in_executor(None, running.command, line)

        async def scenario() -> None:
            connector = decode_connector(local)
            try:
                slow = source(running.address, "slow", SLOW_BLOCKS)
                pulling = asyncio.ensure_future(connector.pull(slow, reused, 0, timeout_s=60.0))
                assert await command("held") == "holding"
                while not all(local[block].any() for block in (6, 8, 4)):  # every message but the held one
                    await asyncio.sleep(0.01)
                pulling.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pulling
                assert not local[0].any() and connector.num_connections == 0
                await connector.pull(source(running.address), reused, 0, timeout_s=10.0)
                assert torch.equal(local[reused], remote[PUBLISHED_BLOCKS])
                assert await command("release") in ("released sent", "released failed")
                await connector.pull(source(running.address, "run", RUN_BLOCKS), [1, 2, 3, 5], 0, timeout_s=10.0)
                assert torch.equal(local[reused], remote[PUBLISHED_BLOCKS])
                assert torch.equal(local[[1, 2, 3, 5]], remote[RUN_BLOCKS])
            finally:
                await connector.close()

        run(scenario)
        assert running.stop().transfers_in_flight == 0


# ------------------------------------------------------------- the EAGLE draft's KV


def pull_with_draft(
    cache: torch.Tensor, src: KVSource, local_blocks: list[int], num_local_hit_blocks: int, draft_shape=DRAFT_SHAPE
):
    async def scenario():
        connector = decode_connector(cache)
        try:
            return await connector.pull_with_draft_kv(src, local_blocks, num_local_hit_blocks, 10.0, draft_shape)
        finally:
            await connector.close()

    return run(scenario)


def drafted_source(address: str) -> KVSource:
    return replace(source(address, "drafted", DRAFTED_BLOCKS), num_tokens=DRAFTED_TOKENS)


def test_the_draft_kv_comes_in_the_pull_with_the_blocks_or_alone(peer: str) -> None:
    """The draft KV P attached arrives exactly, after the blocks, counted in the pull's bytes and
    messages; with every block a local hit, the pull brings the draft KV alone; a request P
    attached none to brings the blocks and no draft KV."""
    remote, expected = seeded_cache(7), seeded_draft_kv(7)
    draft_bytes = expected.kv.nbytes
    local = empty_cache()
    stats, draft = pull_with_draft(local, drafted_source(peer), [10, 11], 0)
    assert draft is not None and (draft.start, draft.end) == (DRAFT_START, DRAFTED_TOKENS)
    assert torch.equal(draft.kv, expected.kv) and torch.equal(local[[10, 11]], remote[DRAFTED_BLOCKS])
    assert (stats.num_blocks, stats.num_bytes, stats.num_messages) == (2, 2 * remote[0].nbytes + draft_bytes, 2)
    local = empty_cache()
    stats, draft = pull_with_draft(local, drafted_source(peer), [10, 11], 2)
    assert draft is not None and torch.equal(draft.kv, expected.kv) and not local.any()
    assert (stats.num_blocks, stats.num_bytes) == (0, draft_bytes)
    stats, draft = pull_with_draft(local, source(peer), [0, 3, 11, 6], 0)
    assert draft is None and stats.num_bytes == 4 * remote[0].nbytes


def test_p_offers_the_draft_kv_only_while_published_and_never_with_a_span() -> None:
    """Attached after the publish, offered to a pull that asks for it (to one naming no block
    too), never to a pull of a head span; unpublish drops it with the blocks, and a request
    attached after it was unpublished keeps nothing."""
    connector = prefill_side()
    draft = seeded_draft_kv(7)
    connector.attach_draft_kv("r", draft)
    offer = PullReply(ok=True, draft_kv=[DRAFT_START, DRAFTED_TOKENS - DRAFT_START])
    for blocks in ([5, 2], []):
        reply, _ = connector._answer(encode(PullRequest("r", blocks, fingerprint(), [1] * len(blocks), draft_kv=True)))
        assert (reply.draft_kv, reply.draft_shape, reply.draft_dtype) == (offer.draft_kv, [1, 2, 2, 8], "float32")
    reply, _ = connector._answer(encode(PullRequest("r", [5], fingerprint(), [1], heads=[0, 1], draft_kv=True)))
    assert reply.ok and reply.draft_kv is None
    reply, _ = connector._answer(encode(PullRequest("r", [5], fingerprint(), [1])))
    assert reply.ok and reply.draft_kv is None  # not asked
    reply, _ = connector._answer(encode(PullRequest("r", [], fingerprint(), [])))
    assert not reply.ok and "at least one block" in reply.error
    asyncio.run(connector.unpublish("r"))
    connector.attach_draft_kv("r", draft)
    assert "r" not in connector._published


def test_a_draft_kv_of_another_shape_or_span_fails_the_pull_and_nothing_is_kept(peer: str) -> None:
    """D sizes its receive from its own draft and prompt: an offer of another entry shape, or of
    entries that do not end at the prompt's end, fails the pull (no draft KV comes back)."""
    wider = replace(DRAFT_SHAPE, num_kv_heads=4)
    with pytest.raises(KVTransferError, match=r"offers draft KV entries of \[1, 2, 2, 8\] float32, expected"):
        pull_with_draft(empty_cache(), drafted_source(peer), [10, 11], 0, wider)
    longer = replace(drafted_source(peer), num_tokens=DRAFTED_TOKENS + 1)
    with pytest.raises(KVTransferError, match="a draft KV of positions 8..31 for a prompt of 33 tokens"):
        pull_with_draft(empty_cache(), longer, [10, 11], 0)
