"""KV transfer bandwidth: the UCX connector moving one request's KV between two processes,
beside raw UCX and a plain memcpy of the same bytes, all measured in the same run.

For each prompt length, a prefill-side process (``bench.kv_transfer_peer``) holds a KV
cache of the model's shape and publishes the request's blocks at scattered, shuffled
block ids; this process, the decode side, times :meth:`UCXConnector.pull` into its own
scattered block ids. Beside it: the same bytes as one contiguous buffer over plain ucxx
send/recv between the same two processes, on the same ucxx runtime, and ``torch``
``copy_`` in-process. Connector pulls and raw transfers alternate (each repeat runs
both, in alternating order), so that both see the same load on a shared machine; every
timing is the median and best of ``--repeats`` runs after one untimed warm-up, and the
pulled bytes are checked once. A breakdown shows the connector's parts on their own
(connection, header round trip, gather, scatter, the same bytes as raw UCX in the
connector's chunks) and both paths' CPU time per transfer in each process; unless
``--skip-prefill``, the engine's prefill of the same prompt puts the transfer in
proportion::

    python -m bench.kv_transfer --prompt-tokens 512 2048 8192 --output-json kv_transfer.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from bench.kv_transfer_peer import (
    OP_CHUNKS,
    OP_CPU,
    OP_PING,
    OP_SEND,
    PeerReady,
    PeerSpec,
    process_cpu_s,
    raw_command,
    request_id,
    scattered_block_ids,
    seeded_cache,
    seeded_payload,
)
from kv_connector.base import KVSource, gather_blocks
from kv_connector.block_copy import BlockCopier
from kv_connector.ucx import RING_DEPTH, UCXConnector  # imports ucxx only when used, after the UCX environment is set
from kv_connector.ucx_messages import ChunkPlan
from kv_connector.ucx_context import ucxx_for_running_loop
from kv_connector.wire import PullReply, PullRequest, encode

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
# Fast settings for UCX between two processes on one host (ucxx moved 64 MiB at 0.7 GiB/s
# with UCX's defaults and 1.9 GiB/s with these on the 2-core development VM), and UCX's
# TCP transport kept on loopback (by default it listens on, and stripes over, every
# interface). ucxx listeners themselves bind every address: ucxx takes no bind address.
UCX_DEFAULTS = {"UCX_TLS": "tcp,sm,self", "UCX_RNDV_SCHEME": "put_zcopy", "UCX_NET_DEVICES": "lo"}
_PEER_START_TIMEOUT_S = 120.0
_PEER_STOP_TIMEOUT_S = 30.0
_GIB = 1 << 30
_MIB = 1 << 20


# ----------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class EnvSetting:
    name: str
    value: str | None  # None: unset, UCX picks its own default
    source: Literal["flag", "environment", "bench default"]

    def describe(self) -> str:
        return f"{self.name}={self.value if self.value is not None else '(unset: UCX default)'} ({self.source})"


@dataclass(slots=True)
class Samples:
    """Seconds of the timed runs of one measurement (the warm-up is not among them)."""

    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best_s(self) -> float:
        return min(self.seconds)

    def summary(self, num_bytes: int | None = None) -> dict[str, float]:
        figures = {"median_ms": self.median_s * 1e3, "best_ms": self.best_s * 1e3}
        if num_bytes:
            figures |= {"median_gib_per_s": num_bytes / _GIB / self.median_s, "best_gib_per_s": num_bytes / _GIB / self.best_s}
        return figures


@dataclass(slots=True)
class LengthResult:
    """Every measurement for one prompt length."""

    num_tokens: int
    num_blocks: int
    num_bytes: int
    connector: Samples
    raw_ucx: Samples
    memcpy: Samples
    # Parts of the connector's time, each measured on its own (see measure_breakdown).
    breakdown: dict[str, Samples] = field(default_factory=dict)
    # CPU milliseconds per transfer, by path ("connector", "raw UCX") and process ("decode", "prefill").
    cpu_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def overhead_vs_raw(self) -> float:
        """The connector's median time over raw UCX's, minus one (0.2 = 20% slower)."""
        return self.connector.median_s / self.raw_ucx.median_s - 1.0


@dataclass(slots=True)
class PrefillResult:
    num_tokens: int
    samples: Samples


# --------------------------------------------------------------- environment


def resolve_ucx_env(args: argparse.Namespace) -> list[EnvSetting]:
    """A flag wins over the environment, which wins over :data:`UCX_DEFAULTS`; an empty
    flag value unsets the variable. Applied to ``os.environ`` here, before ucxx starts,
    and inherited by the peer process."""
    settings = []
    flags = {"UCX_TLS": args.ucx_tls, "UCX_RNDV_SCHEME": args.ucx_rndv_scheme, "UCX_NET_DEVICES": args.ucx_net_devices}
    for name, flag in flags.items():
        if flag is not None:
            setting = EnvSetting(name, flag or None, "flag")
        elif name in os.environ:
            setting = EnvSetting(name, os.environ[name] or None, "environment")
        else:
            setting = EnvSetting(name, UCX_DEFAULTS[name], "bench default")
        if setting.value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = setting.value
        settings.append(setting)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables this UCX build does not know
    os.environ.setdefault("UCX_LOG_FILE", "stderr")  # not stdout, which carries the peer's ready line and the table
    return settings


def kv_layout(model: str | None) -> tuple[str, tuple[int, int, int]]:
    """(model identity, (num_layers, num_kv_heads, head_dim)) from the checkpoint's config."""
    from transformers import AutoConfig

    from engine.engine_core import resolve_model_path
    from engine.models.llama import ModelShape
    from kv_connector.fingerprint import model_identity

    path = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path)
    shape = ModelShape.from_config(config, (config.architectures or ["LlamaForCausalLM"])[0])
    return model_identity(path), (shape.num_layers, shape.num_kv_heads, shape.head_dim)


# ----------------------------------------------------------------- the peer


class Peer:
    """The running prefill-side process and its addresses."""

    def __init__(self, process: subprocess.Popen, ready: PeerReady) -> None:
        self._process = process
        self.ready = ready


@contextmanager
def peer_process(spec: PeerSpec) -> Iterator[Peer]:
    """Start the prefill-side process, yield it once it serves, and always stop it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.kv_transfer_peer", "--spec", spec.to_json(), "--host", "127.0.0.1"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    try:
        readable, _, _ = select.select([process.stdout], [], [], _PEER_START_TIMEOUT_S)
        if not readable:
            raise RuntimeError(f"the peer process was not ready within {_PEER_START_TIMEOUT_S:.0f} s; see its stderr above")
        line = process.stdout.readline()  # its one line; the peer writes nothing else to stdout
        if not line:
            raise RuntimeError(f"the peer process exited (code {process.wait(timeout=_PEER_STOP_TIMEOUT_S)}) before it was ready; see its stderr above")
        try:
            ready = PeerReady.from_json(line)
        except (ValueError, TypeError):
            raise RuntimeError(f"the peer process wrote {line!r} instead of its ready line (bug)") from None
        yield Peer(process, ready)
    finally:
        try:
            process.stdin.close()
            process.wait(timeout=_PEER_STOP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            logger.warning("peer %d did not stop within %.0f s of stdin closing; killing it", process.pid, _PEER_STOP_TIMEOUT_S)
            process.kill()
            process.wait()
        process.stdout.close()


class RawClient:
    """This side of the peer's raw mode: plain ucxx endpoint send/recv on one client-server
    endpoint kept open across transfers (protocol in :mod:`bench.kv_transfer_peer`)."""

    def __init__(self, endpoint, timeout_s: float) -> None:  # noqa: ANN001 - ucxx endpoint
        self._endpoint = endpoint
        self._timeout_s = timeout_s  # per transfer, like the connector's pulls: a dead peer must not hang the bench

    @classmethod
    async def connect(cls, peer: Peer, timeout_s: float) -> RawClient:
        # The connector's ucxx runtime (asyncio futures, no spinning waits): both paths run on it.
        ucxx = ucxx_for_running_loop()
        host, _, port = peer.ready.raw_address.rpartition(":")
        return cls(await ucxx.create_endpoint(host, int(port)), timeout_s)

    async def fetch(self, buffer: np.ndarray) -> None:
        """Receive the first ``buffer.nbytes`` bytes of the peer's payload into ``buffer``:
        one ``send_obj`` request, one payload, as a pull minus its reply header."""
        async def exchange() -> None:
            await self._endpoint.send_obj(raw_command(OP_SEND, buffer.nbytes))
            await self._endpoint.recv(buffer)

        await asyncio.wait_for(exchange(), self._timeout_s)

    async def fetch_chunks(self, buffer: np.ndarray, chunk_bytes: int) -> None:
        """Like :meth:`fetch`, the payload in messages of ``chunk_bytes`` with at most
        ``RING_DEPTH`` receives posted: the connector's wire pattern without its copies."""
        async def exchange() -> None:
            await self._endpoint.send_obj(raw_command(OP_CHUNKS, buffer.nbytes, chunk_bytes))
            starts = range(0, buffer.nbytes, chunk_bytes)
            receives = [self._receive(buffer, start, chunk_bytes, index) for index, start in enumerate(starts[:RING_DEPTH])]
            for index in range(len(starts)):
                await receives[index]
                if index + RING_DEPTH < len(starts):
                    receives.append(self._receive(buffer, starts[index + RING_DEPTH], chunk_bytes, index + RING_DEPTH))

        await asyncio.wait_for(exchange(), self._timeout_s)

    def _receive(self, buffer: np.ndarray, start: int, chunk_bytes: int, index: int) -> asyncio.Future:
        return asyncio.ensure_future(self._endpoint.recv(buffer[start:start + chunk_bytes], tag=index))

    async def ping(self, request_bytes: int, reply_bytes: int) -> None:
        """The connector's header exchange without the connector: ``send_obj`` of a
        ``request_bytes`` body, ``recv_obj`` of a ``reply_bytes`` one."""
        async def exchange() -> None:
            await self._endpoint.send_obj(raw_command(OP_PING, reply_bytes, size=request_bytes))
            await self._endpoint.recv_obj()

        await asyncio.wait_for(exchange(), self._timeout_s)

    async def peer_cpu_s(self) -> float:
        """The peer process's CPU seconds so far."""
        async def exchange() -> float:
            await self._endpoint.send_obj(raw_command(OP_CPU))
            return float(json.loads(bytes(await self._endpoint.recv_obj())))

        return await asyncio.wait_for(exchange(), self._timeout_s)

    async def close(self) -> None:
        await self._endpoint.close()


# ------------------------------------------------------------- measurements


async def timed_async(run: Callable[[], Awaitable[object]], repeats: int) -> Samples:
    """``repeats`` timed awaits of ``run()``; the caller has run its warm-up."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        await run()
        seconds.append(time.perf_counter() - start)
    return Samples(seconds)


async def timed_alternating(first: Callable[[], Awaitable[object]], second: Callable[[], Awaitable[object]], repeats: int) -> tuple[Samples, Samples]:
    """``repeats`` timed awaits of each, interleaved (first-second, then second-first, ...),
    so that both see the same moments of a shared machine's load."""
    seconds: tuple[list[float], list[float]] = ([], [])
    for repeat in range(repeats):
        for which in ((0, 1) if repeat % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            await (first, second)[which]()
            seconds[which].append(time.perf_counter() - start)
    return Samples(seconds[0]), Samples(seconds[1])


def timed(run: Callable[[], object], repeats: int) -> Samples:
    """Like :func:`timed_async` for synchronous work, with its own warm-up run."""
    run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return Samples(seconds)


def check_blocks(local_cache: torch.Tensor, local_ids: list[int], remote_cache: torch.Tensor, remote_ids: list[int]) -> None:
    """Bytewise: the cache holds random bit patterns, NaNs among them."""
    mine = gather_blocks(local_cache, local_ids).view(torch.uint8)
    theirs = gather_blocks(remote_cache, remote_ids).view(torch.uint8)
    if not torch.equal(mine, theirs):
        raise RuntimeError("the connector wrote different bytes than the peer holds (bug in the connector or the bench)")


@dataclass(slots=True)
class Bench:
    """What every prompt length's measurements share."""

    spec: PeerSpec
    peer: Peer
    raw: RawClient
    connector: UCXConnector  # the decode side's, on local_cache; its connection stays open, as a decode instance's does
    local_cache: torch.Tensor  # the decode side's KV cache, pulled into
    remote_cache: torch.Tensor  # a copy of the peer's, to check bytes against and to time the peer's gather
    payload: torch.Tensor  # a copy of the peer's raw payload
    repeats: int
    timeout_s: float


async def measure_length(bench: Bench, num_tokens: int) -> LengthResult:
    """Every measurement for one prompt length."""
    spec, repeats, connector = bench.spec, bench.repeats, bench.connector
    num_blocks = -(-num_tokens // spec.block_size)
    remote_ids = scattered_block_ids("prefill", spec.seed, spec.num_cache_blocks, num_blocks)
    local_ids = scattered_block_ids("decode", spec.seed, spec.num_cache_blocks, num_blocks)
    source = KVSource(request_id(num_blocks), bench.peer.ready.connector_address, tuple(remote_ids), num_tokens, spec.fingerprint)
    num_bytes = num_blocks * spec.bytes_per_block

    async def pull() -> None:
        await connector.pull(source, local_ids, 0, bench.timeout_s)

    receive = torch.zeros(num_bytes, dtype=torch.uint8)

    async def fetch() -> None:
        await bench.raw.fetch(receive.numpy())

    # Warm-ups, checked bytewise: a pull into zeroed blocks, a raw transfer into a zeroed buffer.
    bench.local_cache[:, :, local_ids] = 0
    stats = await connector.pull(source, local_ids, 0, bench.timeout_s)
    if stats.num_bytes != num_bytes:
        raise RuntimeError(f"the connector moved {stats.num_bytes} bytes for {num_blocks} blocks, expected {num_bytes} (bug)")
    check_blocks(bench.local_cache, local_ids, bench.remote_cache, remote_ids)
    await fetch()
    if not torch.equal(receive, bench.payload[:num_bytes]):
        raise RuntimeError("raw UCX delivered different bytes than the peer sent (bug in the bench)")

    connector_samples, raw_samples = await timed_alternating(pull, fetch, repeats)
    cpu_ms = {"connector": await cpu_per_transfer(bench, pull), "raw UCX": await cpu_per_transfer(bench, fetch)}

    destination = torch.empty_like(receive)
    memcpy_samples = timed(lambda: destination.copy_(receive), repeats)

    breakdown = await measure_breakdown(bench, source, local_ids, num_bytes)
    return LengthResult(num_tokens, num_blocks, num_bytes, connector_samples, raw_samples, memcpy_samples, breakdown, cpu_ms)


async def cpu_per_transfer(bench: Bench, transfer: Callable[[], Awaitable[object]]) -> dict[str, float]:
    """CPU milliseconds per transfer in this (decode) process and in the peer, all threads,
    over ``repeats`` back-to-back transfers."""
    decode_start, prefill_start = process_cpu_s(), await bench.raw.peer_cpu_s()
    for _ in range(bench.repeats):
        await transfer()
    decode_s, prefill_s = process_cpu_s() - decode_start, await bench.raw.peer_cpu_s() - prefill_start
    return {"decode": decode_s * 1e3 / bench.repeats, "prefill": prefill_s * 1e3 / bench.repeats}


async def measure_breakdown(bench: Bench, source: KVSource, local_ids: list[int], num_bytes: int) -> dict[str, Samples]:
    """The parts of one pull, each timed on its own:

    - ``connect``: a new connection to the peer's connector, closed after (a decode
      instance makes one per prefill instance and keeps it);
    - ``header_round_trip``: the request and reply headers over an open raw endpoint;
    - ``gather``: the peer's copies of the scattered blocks into its staging chunks, one
      chunk after another (run here, on an identical cache: the peer runs the same
      calls on the same CPU); in a pull they overlap the wire;
    - ``scatter``: the pull's copies from staging chunks into the decode cache's blocks;
    - ``raw_chunked``: raw UCX of the same bytes in the connector's chunks, with as many
      in flight as the connector has staging buffers: the connector's wire without copies.
    """
    repeats, connector = bench.repeats, bench.connector
    remote_ids = list(source.block_ids)
    plan = ChunkPlan(len(remote_ids), connector.blocks_per_chunk)
    chunk_bytes = connector.blocks_per_chunk * bench.spec.bytes_per_block
    layers, kv, _, block_size, heads, head_dim = bench.local_cache.shape
    request = encode(PullRequest(source.request_id, remote_ids, source.fingerprint))
    reply = encode(PullReply(ok=True, num_bytes=num_bytes, shape=[plan.num_chunks, layers, kv, plan.blocks_per_chunk, block_size, heads, head_dim], dtype=bench.spec.dtype))

    async def connect() -> None:
        ucxx = ucxx_for_running_loop()
        host, _, port = source.address.rpartition(":")
        endpoint = await ucxx.create_endpoint(host, int(port))
        await endpoint.close()

    await connect()
    connect_samples = await timed_async(connect, repeats)
    await bench.raw.ping(len(request), len(reply))
    header_round_trip = await timed_async(lambda: bench.raw.ping(len(request), len(reply)), repeats)
    receive = np.zeros(num_bytes, dtype=np.uint8)
    await bench.raw.fetch_chunks(receive, chunk_bytes)
    raw_chunked = await timed_async(lambda: bench.raw.fetch_chunks(receive, chunk_bytes), repeats)

    ring = [torch.zeros(chunk_bytes, dtype=torch.uint8) for _ in range(RING_DEPTH)]
    remote_copier, local_copier = BlockCopier(bench.remote_cache), BlockCopier(bench.local_cache)

    def each_chunk(copy: Callable[[list[int], torch.Tensor], None], block_ids: list[int]) -> None:
        for chunk in range(plan.num_chunks):
            start, stop = plan.bounds(chunk)
            copy(block_ids[start:stop], ring[chunk % RING_DEPTH])

    gather = timed(lambda: each_chunk(remote_copier.gather, remote_ids), repeats)
    scatter = timed(lambda: each_chunk(local_copier.scatter, local_ids), repeats)
    return {"connect": connect_samples, "header_round_trip": header_round_trip, "gather": gather, "scatter": scatter, "raw_chunked": raw_chunked}


async def measure_transfers(spec: PeerSpec, prompt_tokens: list[int], repeats: int, timeout_s: float) -> list[LengthResult]:
    logger.info("building the reference cache (%.0f MiB) and payload to check bytes against", spec.num_cache_blocks * spec.bytes_per_block / _MIB)
    remote_cache = seeded_cache(spec)
    local_cache = torch.zeros(spec.cache_shape, dtype=remote_cache.dtype)
    with peer_process(spec) as peer:
        logger.info("peer ready: connector at %s", peer.ready.connector_address)
        raw = await RawClient.connect(peer, timeout_s)
        connector = UCXConnector(local_cache, spec.fingerprint)
        try:
            bench = Bench(spec, peer, raw, connector, local_cache, remote_cache, seeded_payload(spec), repeats, timeout_s)
            results = []
            for num_tokens in prompt_tokens:
                logger.info("measuring %d tokens", num_tokens)
                results.append(await measure_length(bench, num_tokens))
        finally:
            await connector.close()
            await raw.close()
    return results


def measure_prefill(model: str | None, dtype: str, block_size: int, num_tokens: int, repeats: int, seed: int) -> PrefillResult:
    """Prefill of a random ``num_tokens``-token prompt (one output token), after a warm-up
    prompt; every prompt is distinct, so no run hits the prefix cache."""
    from bench.throughput import random_prompts
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, block_size=block_size)
    prompts = random_prompts(random.Random(seed), repeats + 1, num_tokens, llm.engine.vocab_size)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prompts[0]], params)
    seconds = []
    for prompt in prompts[1:]:
        start = time.perf_counter()
        outputs = llm.generate([prompt], params)
        seconds.append(time.perf_counter() - start)
        if len(outputs[0].outputs[0].token_ids) != 1:
            raise RuntimeError(f"prefill produced {len(outputs[0].outputs[0].token_ids)} tokens with max_tokens=1 (bug)")
    return PrefillResult(num_tokens, Samples(seconds))


# ------------------------------------------------------------------ report


def format_report(
    env: list[EnvSetting], spec: PeerSpec, repeats: int, results: list[LengthResult], prefill: PrefillResult | None
) -> str:
    lines = [
        "UCX: " + "  ".join(setting.describe() for setting in env),
        f"KV: {spec.model_id}, {spec.dtype}, {spec.num_layers} layers x {spec.num_kv_heads} KV heads x {spec.head_dim} head_dim, "
        f"{spec.block_size}-token blocks = {spec.bytes_per_block:,} bytes/block; "
        f"median and best of {repeats} runs after 1 warm-up",
        "",
        f"{'tokens':>6} {'blocks':>6} {'MiB':>8}  {'path':<10} {'median ms':>10} {'best ms':>9} {'med GiB/s':>10} {'best GiB/s':>11} {'vs raw UCX':>11}",
    ]
    for r in results:
        for name, samples in (("connector", r.connector), ("raw UCX", r.raw_ucx), ("memcpy", r.memcpy)):
            figures = samples.summary(r.num_bytes)
            versus = f"{samples.median_s / r.raw_ucx.median_s - 1:+.1%}" if name != "raw UCX" else ""
            head = f"{r.num_tokens:>6} {r.num_blocks:>6} {r.num_bytes / _MIB:>8.2f}" if name == "connector" else " " * 22
            lines.append(
                f"{head}  {name:<10} {figures['median_ms']:>10.2f} {figures['best_ms']:>9.2f} "
                f"{figures['median_gib_per_s']:>10.2f} {figures['best_gib_per_s']:>11.2f} {versus:>11}"
            )
    lines += [
        "",
        "connector breakdown, median ms, parts timed on their own: connect = a new connection (made once per prefill",
        "instance, then kept); headers = the request and reply headers over raw UCX; gather / scatter = the copies",
        "between scattered blocks and staging chunks on each side, chunk after chunk; raw chunked = raw UCX of the same",
        "bytes in the connector's chunks (the wire without copies). In a pull the copies overlap the wire.",
        "CPU ms per transfer (decode process + prefill process, all threads) for the connector and raw UCX.",
        f"{'tokens':>6} {'pull':>8} {'raw':>8} {'connect':>8} {'headers':>8} {'gather':>8} {'scatter':>8} {'raw chunked':>12} "
        f"{'overhead':>9} {'pull CPU D+P':>14} {'raw CPU D+P':>13}",
    ]
    for r in results:
        b = {name: samples.median_s * 1e3 for name, samples in r.breakdown.items()}
        pull_cpu, raw_cpu = r.cpu_ms["connector"], r.cpu_ms["raw UCX"]
        lines.append(
            f"{r.num_tokens:>6} {r.connector.median_s * 1e3:>8.2f} {r.raw_ucx.median_s * 1e3:>8.2f} {b['connect']:>8.2f} "
            f"{b['header_round_trip']:>8.2f} {b['gather']:>8.2f} {b['scatter']:>8.2f} {b['raw_chunked']:>12.2f} "
            f"{r.overhead_vs_raw:>+9.1%} {pull_cpu['decode']:>6.1f}+{pull_cpu['prefill']:<7.1f} {raw_cpu['decode']:>5.1f}+{raw_cpu['prefill']:<7.1f}"
        )
    if prefill is not None:
        transfer = next(r for r in results if r.num_tokens == prefill.num_tokens)
        ratio = transfer.connector.median_s / prefill.samples.median_s
        lines += [
            "",
            f"prefill of {prefill.num_tokens} tokens: median {prefill.samples.median_s * 1e3:.1f} ms, best {prefill.samples.best_s * 1e3:.1f} ms "
            f"({len(prefill.samples.seconds)} runs after 1 warm-up)",
            f"connector pull / prefill: {transfer.connector.median_s * 1e3:.2f} / {prefill.samples.median_s * 1e3:.1f} ms = {ratio:.1%} (target < 10%)",
        ]
    return "\n".join(lines)


def report_json(
    args: argparse.Namespace, env: list[EnvSetting], spec: PeerSpec, results: list[LengthResult], prefill: PrefillResult | None
) -> dict[str, object]:
    report: dict[str, object] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "ucx_env": [asdict(setting) for setting in env],
        "kv": {**asdict(spec), "bytes_per_block": spec.bytes_per_block},
        "lengths": [
            {
                "num_tokens": r.num_tokens,
                "num_blocks": r.num_blocks,
                "num_bytes": r.num_bytes,
                "connector": {**r.connector.summary(r.num_bytes), "seconds": r.connector.seconds},
                "raw_ucx": {**r.raw_ucx.summary(r.num_bytes), "seconds": r.raw_ucx.seconds},
                "memcpy": {**r.memcpy.summary(r.num_bytes), "seconds": r.memcpy.seconds},
                "connector_overhead_vs_raw_pct": r.overhead_vs_raw * 100,
                "breakdown": {name: {**s.summary(), "seconds": s.seconds} for name, s in r.breakdown.items()},
                "cpu_ms_per_transfer": r.cpu_ms,
            }
            for r in results
        ],
    }
    if prefill is not None:
        transfer = next(r for r in results if r.num_tokens == prefill.num_tokens)
        report["prefill"] = {
            "num_tokens": prefill.num_tokens,
            **prefill.samples.summary(),
            "seconds": prefill.samples.seconds,
            "transfer_over_prefill": transfer.connector.median_s / prefill.samples.median_s,
        }
    return report


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local Hugging Face folder for the KV shape (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="KV cache dtype")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths to transfer")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement, after one warm-up")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per pull")
    parser.add_argument("--seed", type=int, default=0, help="seeds the KV bytes, block ids and prefill prompts")
    parser.add_argument("--ucx-tls", default=None, help=f"UCX_TLS for both processes (default: the environment's, else {UCX_DEFAULTS['UCX_TLS']}; '' unsets it)")
    parser.add_argument("--ucx-rndv-scheme", default=None, help=f"UCX_RNDV_SCHEME likewise (default {UCX_DEFAULTS['UCX_RNDV_SCHEME']})")
    parser.add_argument("--ucx-net-devices", default=None, help=f"UCX_NET_DEVICES likewise (default {UCX_DEFAULTS['UCX_NET_DEVICES']}: TCP on loopback only)")
    parser.add_argument("--skip-prefill", action="store_true", help="do not time the engine's prefill")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="prompt length whose prefill is timed; must be among --prompt-tokens")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills, after one warm-up")
    parser.add_argument("--output-json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    for name in ("block_size", "repeats", "prefill_repeats", "prefill_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.prompt_tokens):
        parser.error(f"--prompt-tokens must all be >= 1, got {args.prompt_tokens}")
    if not args.skip_prefill and args.prefill_tokens not in args.prompt_tokens:
        parser.error(f"--prefill-tokens {args.prefill_tokens} is not among --prompt-tokens {args.prompt_tokens}; add it there or pass --skip-prefill")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    env = resolve_ucx_env(args)  # before anything starts ucxx
    logger.info("UCX settings: %s", "  ".join(setting.describe() for setting in env))
    model_id, (num_layers, num_kv_heads, head_dim) = kv_layout(args.model)
    request_num_blocks = tuple(sorted({-(-n // args.block_size) for n in args.prompt_tokens}))
    spec = PeerSpec(
        model_id=model_id, dtype=args.dtype, num_layers=num_layers, block_size=args.block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
        num_cache_blocks=2 * request_num_blocks[-1],  # twice the largest request, so its blocks scatter
        request_num_blocks=request_num_blocks, seed=args.seed,
    )

    # Prefill first, while no UCX progress thread and no peer process share the CPU.
    prefill = None
    if not args.skip_prefill:
        logger.info("timing the engine's prefill of %d tokens", args.prefill_tokens)
        prefill = measure_prefill(args.model, args.dtype, args.block_size, args.prefill_tokens, args.prefill_repeats, args.seed)
        gc.collect()

    results = asyncio.run(measure_transfers(spec, args.prompt_tokens, args.repeats, args.timeout_s))
    sys.stdout.write(format_report(env, spec, args.repeats, results, prefill) + "\n")
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report_json(args, env, spec, results, prefill), indent=2) + "\n")
        logger.info("wrote %s", args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
