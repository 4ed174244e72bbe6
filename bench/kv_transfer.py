"""KV transfer bandwidth: the UCX connector moving one request's KV between two processes,
beside raw UCX and a plain memcpy of the same bytes, all measured in the same run.

For each prompt length, a prefill-side process (``bench.kv_transfer_peer``) holds a KV
cache of the model's shape and publishes the request's blocks at scattered, shuffled
block ids; this process, the decode side, times :meth:`UCXConnector.pull` into its own
scattered block ids. Beside it: the same bytes as one contiguous buffer over plain ucxx
send/recv between the same two processes, and ``torch`` ``copy_`` in-process. Every
timing is the median and best of ``--repeats`` runs after one untimed warm-up; the
pulled bytes are checked once. A breakdown splits the connector's time into its parts
(handshake, header round trip, gather, staging buffer, wire, scatter), and, unless
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
    OP_BYE,
    OP_PING,
    OP_SEND,
    TAG_COMMAND,
    TAG_DATA,
    TAG_HELLO,
    PeerReady,
    PeerSpec,
    request_id,
    scattered_block_ids,
    seeded_cache,
    seeded_payload,
)
from kv_connector.base import KVSource, KVTransferError, gather_blocks, scatter_blocks
from kv_connector.wire import PullReply, PullRequest, decode_pull_reply, decode_pull_request, encode

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
# Fast settings for UCX between two processes on one host (docs: 0.7 GiB/s with UCX's
# defaults, 1.9 GiB/s with these, for 64 MiB on the 2-core development VM).
UCX_DEFAULTS = {"UCX_TLS": "tcp,sm,self", "UCX_RNDV_SCHEME": "put_zcopy"}
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
    for name, flag in (("UCX_TLS", args.ucx_tls), ("UCX_RNDV_SCHEME", args.ucx_rndv_scheme)):
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


@contextmanager
def peer_process(spec: PeerSpec) -> Iterator[PeerReady]:
    """Start the prefill-side process, yield its addresses, and always stop it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.kv_transfer_peer", "--spec", spec.to_json(), "--host", "127.0.0.1"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    try:
        line = process.stdout.readline()  # the peer writes nothing else to stdout
        if not line:
            raise RuntimeError(f"the peer process exited (code {process.wait(timeout=_PEER_START_TIMEOUT_S)}) before it was ready; see its stderr above")
        yield PeerReady.from_json(line)
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=_PEER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("peer %d did not stop within %.0f s of stdin closing; killing it", process.pid, _PEER_STOP_TIMEOUT_S)
            process.kill()
            process.wait()


class RawClient:
    """This side of the peer's raw mode: plain ucxx tag send/recv on one endpoint, kept
    open across transfers (protocol in :mod:`bench.kv_transfer_peer`)."""

    def __init__(self, endpoint) -> None:  # noqa: ANN001 - ucxx endpoint
        self._endpoint = endpoint
        self._command = np.zeros(3, dtype=np.uint64)

    @classmethod
    async def connect(cls, worker_address_hex: str) -> RawClient:
        import ucxx

        peer_address = ucxx.get_ucx_address_from_buffer(bytes.fromhex(worker_address_hex))
        endpoint = await ucxx.create_endpoint_from_worker_address(peer_address)
        own_address = np.frombuffer(bytearray(ucxx.get_worker_address().tobytes()), dtype=np.uint8)
        await endpoint.send(np.array([own_address.nbytes], dtype=np.uint64), tag=TAG_HELLO, force_tag=True)
        await endpoint.send(own_address, tag=TAG_HELLO, force_tag=True)
        return cls(endpoint)

    async def _send_command(self, op: int, a: int = 0, b: int = 0) -> None:
        self._command[:] = (op, a, b)
        await self._endpoint.send(self._command, tag=TAG_COMMAND, force_tag=True)

    async def fetch(self, buffer: np.ndarray) -> None:
        """Receive the first ``buffer.nbytes`` bytes of the peer's payload into ``buffer``."""
        await self._send_command(OP_SEND, buffer.nbytes)
        await self._endpoint.recv(buffer, tag=TAG_DATA, force_tag=True)

    async def ping(self, request: np.ndarray, reply_bytes: int) -> None:
        """The connector's header exchange without the connector: the same four messages
        (size and body each way) carrying bodies of the same sizes."""
        await self._send_command(OP_PING, request.nbytes, reply_bytes)
        await self._endpoint.send(request, tag=TAG_COMMAND, force_tag=True)
        size = np.empty(1, dtype=np.uint64)
        await self._endpoint.recv(size, tag=TAG_DATA, force_tag=True)
        await self._endpoint.recv(np.empty(int(size[0]), dtype=np.uint8), tag=TAG_DATA, force_tag=True)

    async def close(self) -> None:
        try:
            await self._send_command(OP_BYE)
        finally:
            await self._endpoint.close()


# ------------------------------------------------------------- measurements


async def timed_async(run: Callable[[], Awaitable[object]], repeats: int) -> Samples:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        await run()
        seconds.append(time.perf_counter() - start)
    return Samples(seconds)


def timed(run: Callable[[], object], repeats: int, warmup: bool = True) -> Samples:
    if warmup:
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


async def measure_length(
    num_tokens: int,
    spec: PeerSpec,
    ready: PeerReady,
    raw: RawClient,
    local_cache: torch.Tensor,
    remote_cache: torch.Tensor,
    payload: torch.Tensor,
    repeats: int,
    timeout_s: float,
) -> LengthResult:
    from kv_connector.ucx import UCXConnector

    num_blocks = -(-num_tokens // spec.block_size)
    remote_ids = scattered_block_ids("prefill", spec.seed, spec.num_cache_blocks, num_blocks)
    local_ids = scattered_block_ids("decode", spec.seed, spec.num_cache_blocks, num_blocks)
    connector = UCXConnector(local_cache, spec.fingerprint)
    num_bytes = num_blocks * connector.bytes_per_block
    source = KVSource(request_id(num_blocks), ready.connector_address, tuple(remote_ids), num_tokens, spec.fingerprint)

    # (1) the connector: warm-up pull into zeroed blocks, check the bytes, then time.
    local_cache[:, :, local_ids] = 0
    stats = await connector.pull(source, local_ids, 0, timeout_s)
    if stats.num_bytes != num_bytes:
        raise RuntimeError(f"the connector moved {stats.num_bytes} bytes for {num_blocks} blocks, expected {num_bytes} (bug)")
    check_blocks(local_cache, local_ids, remote_cache, remote_ids)
    connector_samples = await timed_async(lambda: connector.pull(source, local_ids, 0, timeout_s), repeats)

    # (2) raw UCX: one contiguous buffer, reused, over an endpoint kept open.
    receive = torch.zeros(num_bytes, dtype=torch.uint8)
    await raw.fetch(receive.numpy())
    if not torch.equal(receive, payload[:num_bytes]):
        raise RuntimeError("raw UCX delivered different bytes than the peer sent (bug in the bench)")
    raw_samples = await timed_async(lambda: raw.fetch(receive.numpy()), repeats)

    # (3) memcpy of the same bytes in this process.
    destination = torch.empty_like(receive)
    memcpy_samples = timed(lambda: destination.copy_(receive), repeats)

    result = LengthResult(num_tokens, num_blocks, num_bytes, connector_samples, raw_samples, memcpy_samples)
    result.breakdown = await measure_breakdown(connector, source, local_ids, raw, remote_cache, num_bytes, repeats, timeout_s)
    await connector.close()
    return result


async def measure_breakdown(
    connector,  # noqa: ANN001 - UCXConnector
    source: KVSource,
    local_ids: list[int],
    raw: RawClient,
    remote_cache: torch.Tensor,
    num_bytes: int,
    repeats: int,
    timeout_s: float,
) -> dict[str, Samples]:
    """The parts of one pull, each timed on its own, in the order the pull runs them:

    - ``handshake``: a pull the peer refuses (unknown request id, same block list): the
      endpoint's connect and close, the JSON header exchange and the peer's checks;
    - ``header_round_trip``: the same four header messages over an open raw endpoint;
    - ``json_cpu``: encoding and decoding both headers;
    - ``gather``: the peer's ``index_select`` of the scattered blocks (run here, on an
      identical cache: the peer's process runs the same call on the same CPU);
    - ``raw_fresh_buffer``: raw UCX into a newly allocated buffer, as the pull's staging
      tensor is (page faults on first touch included);
    - ``scatter``: the pull's ``index_copy_`` into the decode cache's blocks.
    """
    refused = KVSource("bench-not-published", source.address, source.block_ids, source.num_tokens, source.fingerprint)

    async def refused_pull() -> None:
        try:
            await connector.pull(refused, local_ids, 0, timeout_s)
        except KVTransferError as error:
            if "no KV published" not in str(error):
                raise
        else:
            raise RuntimeError("the peer served a request it never published (bug)")

    await refused_pull()
    handshake = await timed_async(refused_pull, repeats)

    request = encode(PullRequest(source.request_id, list(source.block_ids), connector.fingerprint))
    staging_shape = list(connector.kv_cache.shape)
    staging_shape[2] = len(source.block_ids)
    reply = encode(PullReply(ok=True, num_bytes=num_bytes, shape=staging_shape, dtype=str(connector.kv_cache.dtype).removeprefix("torch.")))
    request_array = np.frombuffer(bytearray(request), dtype=np.uint8)
    await raw.ping(request_array, len(reply))
    header_round_trip = await timed_async(lambda: raw.ping(request_array, len(reply)), repeats)

    def json_round() -> None:
        encode(PullRequest(source.request_id, list(source.block_ids), connector.fingerprint))
        decode_pull_request(request)
        encode(PullReply(ok=True, num_bytes=num_bytes, shape=staging_shape, dtype="bfloat16"))
        decode_pull_reply(reply)

    json_cpu = timed(json_round, repeats)
    gather = timed(lambda: gather_blocks(remote_cache, list(source.block_ids)), repeats)

    async def fetch_fresh() -> None:
        await raw.fetch(torch.empty(num_bytes, dtype=torch.uint8).numpy())

    await fetch_fresh()
    raw_fresh_buffer = await timed_async(fetch_fresh, repeats)

    staging = gather_blocks(remote_cache, list(source.block_ids))
    scatter = timed(lambda: scatter_blocks(connector.kv_cache, local_ids, staging), repeats)
    return {
        "handshake": handshake,
        "header_round_trip": header_round_trip,
        "json_cpu": json_cpu,
        "gather": gather,
        "raw_fresh_buffer": raw_fresh_buffer,
        "scatter": scatter,
    }


async def measure_transfers(spec: PeerSpec, prompt_tokens: list[int], repeats: int, timeout_s: float) -> list[LengthResult]:
    logger.info("building the reference cache (%.0f MiB) and payload to check the bytes against", spec.num_cache_blocks * spec.bytes_per_block / _MIB)
    remote_cache = seeded_cache(spec)
    payload = seeded_payload(spec)
    local_cache = torch.zeros(spec.cache_shape, dtype=remote_cache.dtype)
    results = []
    with peer_process(spec) as ready:
        logger.info("peer ready: connector at %s", ready.connector_address)
        raw = await RawClient.connect(ready.worker_address)
        try:
            for num_tokens in prompt_tokens:
                logger.info("measuring %d tokens", num_tokens)
                results.append(await measure_length(num_tokens, spec, ready, raw, local_cache, remote_cache, payload, repeats, timeout_s))
        finally:
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
        "connector breakdown, median ms (handshake = refused pull: connect + headers + checks + close;",
        "staging = raw into a fresh buffer minus raw into a reused one; predicted = handshake + gather + raw fresh + scatter)",
        f"{'tokens':>6} {'pull':>8} {'handshake':>10} {'headers':>8} {'json':>6} {'gather':>8} {'raw':>8} {'staging':>8} {'scatter':>8} {'predicted':>10} {'overhead':>9}",
    ]
    for r in results:
        b = {name: samples.median_s * 1e3 for name, samples in r.breakdown.items()}
        raw_ms = r.raw_ucx.median_s * 1e3
        predicted = b["handshake"] + b["gather"] + b["raw_fresh_buffer"] + b["scatter"]
        lines.append(
            f"{r.num_tokens:>6} {r.connector.median_s * 1e3:>8.2f} {b['handshake']:>10.2f} {b['header_round_trip']:>8.2f} "
            f"{b['json_cpu']:>6.2f} {b['gather']:>8.2f} {raw_ms:>8.2f} {b['raw_fresh_buffer'] - raw_ms:>8.2f} "
            f"{b['scatter']:>8.2f} {predicted:>10.2f} {r.overhead_vs_raw:>+9.1%}"
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
