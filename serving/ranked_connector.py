"""KV hand-offs between tensor- or pipeline-parallel instances: every rank moves its own KV (its
heads of its stage's layers), rank to rank, and nothing is gathered on one rank.

Each rank's process runs a connector over its own cache: rank 0's (the last stage's first) is
the instance's (in its event loop), every other rank runs one in a :func:`serve_rank_connector`
agent, the engine's worker extension (engine/tensor_parallel/rank_context.py), driven over the
worker extension's channel. :class:`RankedConnector` is rank 0's face of them all: the servicers
use it as any connector. In call order:

1. ``start`` (instance start-up): rank 0's connector listens, each agent starts its rank's
   connector (listening too) and answers its address and place; ``rank_addresses`` lists them
   in the instance's stage-major order (kv_connector/layer_plan.py), and P's KV handles carry them.
2. ``publish`` / ``unpublish`` (P): every rank publishes (or unpublishes) the request's blocks,
   its own heads of its stage's layers of them, under the same pull token. A store connector's
   digests of what each rank stored are joined in stage-major rank order, which is the store's
   stage then head order (kv_connector/lmcache_connector.py).
3. ``pull`` (D's KV loader): every rank pulls its share at once, straight into its own cache:
   a UCX connector follows the layer plan (kv_connector/layer_plan.py: which P rank holds which
   of its (layer range, head span)s), an LMCache connector fetches its heads of the prefill
   stages that make up its own from the store; the
   pull ends when every rank's has, and fails if any failed.

Messages on a channel are JSON objects, each with an ``id`` its answer repeats; nothing is
unpickled. The channel is a pipe between processes of one instance on one host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import threading
from multiprocessing.connection import Connection
from typing import Any

from engine.openmp_threads import serial_openmp
from engine.tensor_parallel.rank_context import RankContext
from kv_connector.base import KVConnector, KVSource, KVTransferError, PublishedKV, TransferStats, combined_stats
from kv_connector.fingerprint import Fingerprint
from kv_connector.registry import make_connector

logger = logging.getLogger(__name__)


class RankedConnector(KVConnector):
    """Rank 0's connector and the other ranks' agents, as one connector; ``local`` holds the
    last stage's layers (its tensor-parallel rank 0), as rank 0's cache does."""

    def __init__(
        self, local: KVConnector, channels: list[tuple[str, Connection]], backend: str, options: dict[str, Any]
    ) -> None:
        """``channels``: each other rank's channel, with how errors name that rank
        (``TensorParallelExecutor.named_extension_channels``)."""
        super().__init__(local.kv_cache, local.fingerprint)
        self.name = local.name
        self.local = local
        self.backend, self.options = backend, options
        self.rank_addresses: list[str] = []
        self._ranks = [_RankChannel(name, channel) for name, channel in channels]
        # Each rank's place in the stage-major order (local's first), known once started.
        self._places: list[int] = []

    async def start(self, host: str, port: int) -> str:
        address = await self.local.start(host, port)
        loop = asyncio.get_running_loop()
        for rank in self._ranks:
            rank.start(loop)
        fingerprint = dataclasses.asdict(self.fingerprint)
        answers = await asyncio.gather(
            *(
                rank.call(
                    "start",
                    backend=self.backend,
                    options=_options_to_json(self.options),
                    fingerprint=fingerprint,
                    host=host,
                )
                for rank in self._ranks
            )
        )
        # Stage-major, as the layer plan numbers ranks: rank 0 is the last stage's first.
        size = self.fingerprint.tensor_parallel_size
        self._places = [
            (len(self.fingerprint.stage_first_layers) - 1) * size,
            *(answer["stage"] * size + answer["rank"] for answer in answers),
        ]
        if sorted(self._places) != list(range(len(self._ranks) + 1)):
            raise RuntimeError(f"bug: the ranks' connectors answered places {sorted(self._places)}")
        addresses = [address, *(answer["address"] for answer in answers)]
        self.rank_addresses = [rank_address for _, rank_address in sorted(zip(self._places, addresses, strict=True))]
        logger.info("KV connector of each rank: %s", ", ".join(self.rank_addresses))
        return address

    async def publish(
        self,
        request_id: str,
        block_ids: list[int],
        token_ids: list[int],
        pull_token: bytes | None = None,
        cache_salt: str = "",
    ) -> PublishedKV:
        local, *others = await asyncio.gather(
            self.local.publish(request_id, block_ids, token_ids, pull_token, cache_salt),
            *(
                rank.call(
                    "publish",
                    request_id=request_id,
                    block_ids=block_ids,
                    token_ids=token_ids,
                    pull_token=pull_token.hex() if pull_token is not None else None,
                    cache_salt=cache_salt,
                )
                for rank in self._ranks
            ),
        )
        # Joined in the ranks' stage-major order, which is the store's stage then head order
        # (kv_connector/lmcache_connector.py); rank 0's own holds the last stage.
        parts = [list(local.chunk_digests)]
        parts += [[bytes.fromhex(digest) for digest in answer["chunk_digests"]] for answer in others]
        ordered = sorted(zip(self._places, parts, strict=True), key=lambda placed: placed[0])
        return PublishedKV(chunk_digests=tuple(digest for _, part in ordered for digest in part))

    def check_pairing(self, prefill: Fingerprint) -> None:
        """Every rank's connector is of one backend over one layout: rank 0's answers for all."""
        self.local.check_pairing(prefill)

    async def unpublish(self, request_id: str, grace_s: float = 0.0) -> None:
        await asyncio.gather(
            self.local.unpublish(request_id, grace_s),
            *(rank.call("unpublish", request_id=request_id, grace_s=grace_s) for rank in self._ranks),
            return_exceptions=True,  # a rank that is gone reads nothing any more
        )

    async def pull(
        self, source: KVSource, block_ids: list[int], num_local_hit_blocks: int, timeout_s: float
    ) -> TransferStats:
        """Every rank pulls its own heads at once (each rank's connector follows the head plan)."""
        pulled = await asyncio.gather(
            self.local.pull(source, block_ids, num_local_hit_blocks, timeout_s),
            *(
                rank.call(
                    "pull",
                    source=_source_to_json(source),
                    block_ids=block_ids,
                    num_local_hit_blocks=num_local_hit_blocks,
                    timeout_s=timeout_s,
                )
                for rank in self._ranks
            ),
            return_exceptions=True,
        )
        errors = [result for result in pulled if isinstance(result, BaseException)]
        if errors:
            raise KVTransferError(f"a rank's pull failed: {errors[0]}")
        return combined_stats(
            [result if isinstance(result, TransferStats) else _stats_from_json(result) for result in pulled]
        )

    async def close(self) -> None:
        await asyncio.gather(*(rank.call("close") for rank in self._ranks if rank.alive), return_exceptions=True)
        for rank in self._ranks:
            rank.stop()
        await self.local.close()


class _RankChannel:
    """Rank 0's end of one agent's channel: calls, and a thread reading the answers."""

    def __init__(self, name: str, channel: Connection) -> None:
        # The worker's own name (engine/tensor_parallel/worker.py rank_name): with pipeline stages,
        # a channel's number is no rank's number.
        self.name = name
        self._channel = channel
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self.alive = True

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader = threading.Thread(
            target=self._read, name=f"{self.name.replace(' ', '-')}-kv-channel", daemon=True
        )
        self._reader.start()

    async def call(self, op: str, **fields: object) -> dict[str, Any]:
        if not self.alive:
            raise KVTransferError(f"{self.name} is gone")
        call_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        try:
            with self._send_lock:
                self._channel.send_bytes(json.dumps({"id": call_id, "op": op, **fields}).encode())
        except OSError:
            self._waiting.pop(call_id, None)
            raise KVTransferError(f"{self.name} is gone") from None
        answer = await future
        if not answer.get("ok"):
            raise KVTransferError(f"{self.name}: {answer.get('error', 'failed')}")
        return answer

    def stop(self) -> None:
        self.alive = False

    def _read(self) -> None:
        """Answers to the event loop, until the agent's end closes."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("bug: a rank channel read before it started")
        try:
            while True:
                answer = json.loads(self._channel.recv_bytes())
                loop.call_soon_threadsafe(self._settle, answer)
        except (EOFError, OSError):
            pass
        finally:
            self.alive = False
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._fail_all)

    def _settle(self, answer: dict[str, Any]) -> None:
        future = self._waiting.pop(answer.get("id", -1), None)
        if future is not None and not future.done():
            future.set_result(answer)

    def _fail_all(self) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(KVTransferError(f"{self.name} is gone"))
        self._waiting.clear()


# ------------------------------------------------------------------ the agent, in each worker


def serve_rank_connector(context: RankContext) -> None:
    """The worker extension: a thread serving rank 0's calls with a connector over this
    rank's cache. Returns at once."""
    agent = _RankAgent(context)
    threading.Thread(target=agent.run, name=f"rank{context.rank}-kv-agent", daemon=True).start()


class _RankAgent:
    def __init__(self, context: RankContext) -> None:
        self.context = context
        self.connector: KVConnector | None = None
        self._send_lock = threading.Lock()

    def run(self) -> None:
        """Reads calls on this thread, serves them on an event loop of the agent's own."""
        loop = asyncio.new_event_loop()
        loop.call_soon(serial_openmp)  # first, on the loop's thread: its head copies start no OpenMP team
        threading.Thread(target=loop.run_forever, name=f"rank{self.context.rank}-kv-loop", daemon=True).start()
        channel = self.context.channel
        try:
            while True:
                call = json.loads(channel.recv_bytes())
                asyncio.run_coroutine_threadsafe(self._serve(call), loop)
                if call.get("op") == "close":
                    return
        except (EOFError, OSError):
            return  # rank 0 is gone: the worker exits with it

    async def _serve(self, call: dict[str, Any]) -> None:
        try:
            answer = await self._handle(call)
            answer = {"ok": True, **answer}
        except Exception as error:  # answered, never raised: rank 0 waits for every call
            logger.warning("rank %d: KV %s failed: %s", self.context.rank, call.get("op"), error)
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        answer["id"] = call.get("id")
        with self._send_lock:
            self.context.channel.send_bytes(json.dumps(answer).encode())

    async def _handle(self, call: dict[str, Any]) -> dict[str, Any]:
        op = call["op"]
        if op == "start":
            fingerprint = Fingerprint(**call["fingerprint"])
            options = {**_options_from_json(call["options"]), "tensor_parallel_rank": self.context.rank}
            if len(fingerprint.stage_first_layers) > 1:
                options["pipeline_stage"] = self.context.pipeline_stage
            self.connector = make_connector(call["backend"], self.context.kv_cache, fingerprint, options)
            # Any free port: --kv-port is rank 0's (a firewall between P and D must let the rest through).
            address = await self.connector.start(call["host"], 0)
            return {"address": address, "rank": self.context.rank, "stage": self.context.pipeline_stage}
        connector = self.connector
        if connector is None:
            raise RuntimeError(f"bug: {op} before start")
        if op == "publish":
            token = call["pull_token"]
            published = await connector.publish(
                call["request_id"],
                call["block_ids"],
                call["token_ids"],
                bytes.fromhex(token) if token is not None else None,
                call["cache_salt"],
            )
            return {"chunk_digests": [digest.hex() for digest in published.chunk_digests]}
        if op == "unpublish":
            await connector.unpublish(call["request_id"], call["grace_s"])
            return {}
        if op == "pull":
            stats = await connector.pull(
                _source_from_json(call["source"]), call["block_ids"], call["num_local_hit_blocks"], call["timeout_s"]
            )
            return dataclasses.asdict(stats)
        if op == "close":
            await connector.close()
            return {}
        raise RuntimeError(f"bug: unknown rank call {op!r}")


def _options_to_json(options: dict[str, Any]) -> dict[str, Any]:
    """A backend's options for a channel: bytes (the KV store key) travel as hex under ``hex:``."""
    return {
        (f"hex:{k}" if isinstance(v, bytes) else k): (v.hex() if isinstance(v, bytes) else v)
        for k, v in options.items()
    }


def _options_from_json(body: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("hex:"): bytes.fromhex(v) if k.startswith("hex:") else v for k, v in body.items()}


def _source_to_json(source: KVSource) -> dict[str, Any]:
    return {
        "request_id": source.request_id,
        "address": source.address,
        "block_ids": list(source.block_ids),
        "num_tokens": source.num_tokens,
        "fingerprint": dataclasses.asdict(source.fingerprint),
        "pull_token": source.pull_token.hex(),
        "cache_salt": source.cache_salt,
        "rank_addresses": list(source.rank_addresses),
        "token_ids": list(source.token_ids),
        "chunk_digests": [digest.hex() for digest in source.chunk_digests],
    }


def _source_from_json(body: dict[str, Any]) -> KVSource:
    return KVSource(
        request_id=body["request_id"],
        address=body["address"],
        block_ids=tuple(body["block_ids"]),
        num_tokens=body["num_tokens"],
        fingerprint=Fingerprint(**body["fingerprint"]),
        pull_token=bytes.fromhex(body["pull_token"]),
        cache_salt=body["cache_salt"],
        rank_addresses=tuple(body["rank_addresses"]),
        token_ids=tuple(body["token_ids"]),
        chunk_digests=tuple(bytes.fromhex(digest) for digest in body["chunk_digests"]),
    )


def _stats_from_json(body: dict[str, Any]) -> TransferStats:
    return TransferStats(body["num_blocks"], body["num_bytes"], body["seconds"], body["num_messages"])
