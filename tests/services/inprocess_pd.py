"""A prefill and a decode instance in the test's own event loop: real engines (a tiny model),
the real servicers behind real gRPC servers on loopback, and the real lease keeper between
them. The one thing faked is moving bytes: :class:`InProcessConnector` copies blocks between
the two engines' caches, and lets the test hold, fail or watch each pull, so that every state
a hand-off can be in is reachable on demand."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from decode_svc import server as decode_server
from decode_svc.kv_loader import RemoteKVLoader
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, EngineRole
from engine.kv_loader import KVLoader
from engine.load_report import EngineLoad
from kv_connector.base import KVConnector, KVSource, KVTransferError, PublishedKV, TransferStats
from kv_connector.fingerprint import Fingerprint
from prefill_svc import server as prefill_server
from serving.instance import Instance, fingerprint_of
from splitserve.v1 import disaggregation_pb2_grpc
from tests.serving.inprocess import serving_instance


class InProcessConnector(KVConnector):
    """Publishes blocks by id and pulls them by copying from the publishing connector's cache
    (found by address among ``peers``). A test holds pulls (``hold_pulls``), fails them
    (``fail_pulls_with``) and reads what happened (``pulls_started``, ``pulls_cancelled``)."""

    name = "inprocess"

    def __init__(self, kv_cache: torch.Tensor, fingerprint: Fingerprint, peers: dict[str, InProcessConnector]) -> None:
        super().__init__(kv_cache, fingerprint)
        self._peers = peers
        self._published: dict[str, list[int]] = {}
        self.address = ""
        self._released = asyncio.Event()
        self._released.set()
        self.fail_pulls_with: str | None = None
        self.pulls_started: list[str] = []  # P's request ids, in order
        self.pulls_cancelled: list[str] = []
        self.pull_started = asyncio.Event()  # set at each pull; the test clears it
        # Called as a pull is cancelled, before it returns (the test reads the engine's state then).
        self.on_cancel: Callable[[], None] = lambda: None

    @property
    def published(self) -> list[str]:
        return list(self._published)

    @contextmanager
    def hold_pulls(self) -> Iterator[None]:
        """Pulls wait (after ``pull_started``) until the block ends."""
        self._released.clear()
        try:
            yield
        finally:
            self._released.set()

    async def start(self, host: str, port: int) -> str:
        self.address = f"inprocess-{id(self)}"
        self._peers[self.address] = self
        return self.address

    async def publish(
        self,
        request_id: str,
        block_ids: list[int],
        token_ids: list[int],
        pull_token: bytes | None = None,
        cache_salt: str = "",
    ) -> PublishedKV:
        self._published[request_id] = list(block_ids)
        return PublishedKV()

    async def unpublish(self, request_id: str, grace_s: float = 0.0) -> None:
        self._published.pop(request_id, None)

    async def pull(
        self, source: KVSource, block_ids: list[int], num_local_hit_blocks: int, timeout_s: float
    ) -> TransferStats:
        self.check_source(source)
        self.pulls_started.append(source.request_id)
        self.pull_started.set()
        try:
            await self._released.wait()
        except asyncio.CancelledError:
            self.pulls_cancelled.append(source.request_id)
            self.on_cancel()
            raise
        if self.fail_pulls_with is not None:
            raise KVTransferError(self.fail_pulls_with)
        peer = self._peers.get(source.address)
        source_block_ids = peer._published.get(source.request_id) if peer is not None else None
        if peer is None or source_block_ids is None:
            raise KVTransferError(f"{source.request_id!r} is not published at {source.address}")
        skip = num_local_hit_blocks
        self.kv_cache[block_ids[skip:]] = peer.kv_cache[source_block_ids[skip:]]
        num_blocks = len(block_ids) - skip
        return TransferStats(num_blocks, num_blocks * self.bytes_per_block, 0.0, num_messages=1)

    async def close(self) -> None:
        self._peers.pop(self.address, None)


@dataclass
class Served:
    """One instance being served: its state, its connector and a channel to it."""

    instance: Instance
    connector: InProcessConnector
    channel: grpc.aio.Channel

    @property
    def engine(self) -> AsyncEngine:
        return self.instance.engine

    async def report_when(self, condition: Callable[[EngineLoad], bool]) -> EngineLoad:
        """The engine's published load report once ``condition`` holds for it; fails if it never does."""
        for _ in range(6000):  # a minute at the least: a guard, not a timing assertion
            if condition(report := self.engine.latest_load_report()):
                return report
            await asyncio.sleep(0.01)
        raise AssertionError(f"{self.instance.role}: the load report never met the condition; last: {report}")

    async def all_free(self) -> EngineLoad:
        """Once nothing is queued or running and every KV block is back in the pool."""
        return await self.report_when(
            lambda r: r.num_free_blocks == r.num_total_blocks and not r.num_running and not r.num_waiting
        )


@dataclass
class PrefillAndDecode:
    prefill: Served
    decode: Served
    prefill_servicer: prefill_server.PrefillServicer
    decode_servicer: decode_server.DecodeServicer

    @property
    def prefill_stub(self) -> disaggregation_pb2_grpc.PrefillStub:
        return disaggregation_pb2_grpc.PrefillStub(self.prefill.channel)

    @property
    def decode_stub(self) -> disaggregation_pb2_grpc.DecodeStub:
        return disaggregation_pb2_grpc.DecodeStub(self.decode.channel)


def _instance(model: Path, role: EngineRole, peers: dict[str, InProcessConnector], config: EngineConfig) -> Instance:
    engine = AsyncEngine(config)
    fingerprint = fingerprint_of(engine.core)
    connector = InProcessConnector(engine.core.runner.kv_cache, fingerprint, peers)
    return Instance(role, engine, connector, fingerprint, f"{role}-inprocess")


def _args(add_arguments: Callable[[argparse.ArgumentParser], None], model: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", str(model), "--port", "0", *argv])


@asynccontextmanager
async def _serving(
    instance: Instance,
    args: argparse.Namespace,
    add_servicer: Callable[[grpc.aio.Server], None],
    kv_loader: KVLoader | None = None,
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[grpc.aio.Channel]:
    """Serve the instance until the block ends (then drain and stop it); yields a channel to it."""
    async with serving_instance(instance, args, add_servicer, kv_loader, on_start, on_stop) as address:
        channel = grpc.aio.insecure_channel(address)
        try:
            yield channel
        finally:
            await channel.close()


@asynccontextmanager
async def prefill_and_decode(
    model: Path,
    lease_s: float = 30.0,
    decode_max_num_seqs: int = 256,
    kv_failure_policy: decode_server.KVFailurePolicy = "recompute",
) -> AsyncIterator[PrefillAndDecode]:
    """A prefill and a decode instance of ``model``, served in this event loop."""
    peers: dict[str, InProcessConnector] = {}
    kv_cache_memory = 1 << 22
    prefill = _instance(
        model, "prefill", peers, EngineConfig(model=str(model), role="prefill", kv_cache_memory=kv_cache_memory)
    )
    decode = _instance(
        model,
        "decode",
        peers,
        EngineConfig(
            model=str(model),
            role="decode",
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=decode_max_num_seqs,
            max_num_prefill_tokens=decode_server.DEFAULT_RECOMPUTE_CHUNK,
        ),
    )
    prefill_servicer = prefill_server.PrefillServicer(prefill, lease_s)
    decode_servicer = decode_server.DecodeServicer(
        decode, kv_failure_policy, RemoteKVLoader(decode, pull_timeout_s=30.0)
    )
    async with (
        _serving(
            prefill,
            _args(prefill_server.add_arguments, model),
            lambda server: disaggregation_pb2_grpc.add_PrefillServicer_to_server(prefill_servicer, server),
            on_stop=prefill_servicer.close,
        ) as prefill_channel,
        _serving(
            decode,
            _args(decode_server.add_arguments, model),
            lambda server: disaggregation_pb2_grpc.add_DecodeServicer_to_server(decode_servicer, server),
            kv_loader=decode_servicer.kv_loader,
            on_start=decode_servicer.start,
            on_stop=decode_servicer.close,
        ) as decode_channel,
    ):
        yield PrefillAndDecode(
            Served(prefill, prefill.connector, prefill_channel),  # type: ignore[arg-type]
            Served(decode, decode.connector, decode_channel),  # type: ignore[arg-type]
            prefill_servicer,
            decode_servicer,
        )
