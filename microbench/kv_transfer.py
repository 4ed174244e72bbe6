"""KV transfer bandwidth of the UCX connector, beside raw UCX and memcpy of the same bytes.

The connector moves one request's KV between two processes; raw UCX and a plain memcpy
of the same bytes are measured in the same run. For each prompt length, a prefill-side
process (``microbench.kv_transfer_peer``) holds a block-major KV cache of the model's shape
(engine/kv_cache_layout.py) and publishes the request twice; this process, the decode
side, times :meth:`UCXConnector.pull` of each into its own cache:

- scattered blocks: shuffled ids on both sides, none followed by its successor, so the
  connector sends one message per block (its worst case: a cache so fragmented that no
  two of the request's blocks are neighbours on both sides);
- consecutive blocks: ids ``0 .. n-1`` on both sides, as a freshly started engine
  allocates them, so the connector sends messages of up to ``MAX_MESSAGE_BYTES``.

Beside them: the same bytes as one contiguous buffer over plain ucxx send/recv between
the same two processes, on the same ucxx runtime, and ``torch`` ``copy_`` in-process.
Connector pulls and raw transfers interleave (each repeat runs all three, in rotating
order), so that all see the same load on a shared machine; every timing is the median
and best of ``--repeats`` runs after one untimed warm-up, and the pulled bytes are
checked once. A breakdown times parts of a pull on their own (a new connection, the
header round trip, the same bytes as raw UCX cut into the connector's messages for
each layout: its wire pattern with no connector logic) and every path's CPU time per
transfer in each process; unless ``--skip-prefill``, the engine's prefill of the same
prompt puts the transfer in proportion::

    python -m microbench.kv_transfer --prompt-tokens 512 2048 8192 --output-json kv_transfer.json

This module measures; the prefill side runs :mod:`microbench.kv_transfer_peer`, this side talks
to it through :mod:`microbench.kv_transfer_client`, and :mod:`microbench.kv_transfer_report` holds
the records and prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import logging
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.kv_cache_utils import cdiv
from engine_args.flags import add_dtype_argument
from kv_connector.base import KVSource
from kv_connector.ucx import UCXConnector  # imports ucxx only when used, after the UCX environment is set
from kv_connector.ucx_context import ucxx_for_running_loop
from kv_connector.ucx_messages import plan_messages
from kv_connector.wire import PullReply, PullRequest, encode
from microbench.kv_transfer_client import Peer, RawClient, peer_process
from microbench.kv_transfer_peer import (
    BLOCK_LAYOUTS,
    BlockLayout,
    PeerSpec,
    empty_cache,
    process_cpu_s,
    request_block_ids,
    request_id,
    seeded_cache,
    seeded_payload,
)
from microbench.kv_transfer_report import (
    EnvSetting,
    LengthResult,
    PrefillResult,
    Samples,
    format_report,
    path_name,
    report_json,
)

logger = logging.getLogger(__name__)

# Fast settings for UCX between two processes on one host (against UCX's defaults:
# docs/benchmarks.md, "KV transfer"), and UCX's TCP transport kept on loopback (by default it
# listens on, and stripes over, every interface). ucxx listeners themselves bind every
# address: ucxx takes no bind address.
UCX_DEFAULTS = {"UCX_TLS": "tcp,sm,self", "UCX_RNDV_SCHEME": "put_zcopy", "UCX_NET_DEVICES": "lo"}
_MIB = 1 << 20


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

    path = resolve_model_path(model, load_format="safetensors" if model is None else "auto")  # a config.json
    config = AutoConfig.from_pretrained(path)
    shape = ModelShape.from_config(config, (config.architectures or ["LlamaForCausalLM"])[0])
    return model_identity(path), (shape.num_layers, shape.num_kv_heads, shape.head_dim)


# ------------------------------------------------------------- measurements


async def timed_async(run: Callable[[], Awaitable[object]], repeats: int) -> Samples:
    """``repeats`` timed awaits of ``run()``; the caller has run its warm-up."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        await run()
        seconds.append(time.perf_counter() - start)
    return Samples(seconds)


async def timed_interleaved(runs: list[Callable[[], Awaitable[object]]], repeats: int) -> list[Samples]:
    """``repeats`` timed awaits of each run, interleaved in an order that rotates every
    repeat (a-b-c, b-c-a, c-a-b, ...), so that all see the same moments of a shared
    machine's load and none always follows the same one."""
    seconds: list[list[float]] = [[] for _ in runs]
    for repeat in range(repeats):
        for offset in range(len(runs)):
            which = (repeat + offset) % len(runs)
            start = time.perf_counter()
            await runs[which]()
            seconds[which].append(time.perf_counter() - start)
    return [Samples(s) for s in seconds]


def timed(run: Callable[[], object], repeats: int) -> Samples:
    """Like :func:`timed_async` for synchronous work, with its own warm-up run."""
    run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return Samples(seconds)


def check_blocks(
    local_cache: torch.Tensor, local_ids: list[int], remote_cache: torch.Tensor, remote_ids: list[int]
) -> None:
    """Bytewise: the cache holds random bit patterns, NaNs among them."""
    mine = local_cache[local_ids].view(torch.uint8)  # block-major: block b is cache[b]
    theirs = remote_cache[remote_ids].view(torch.uint8)
    if not torch.equal(mine, theirs):
        raise RuntimeError(
            "the connector wrote different bytes than the peer holds (bug in the connector or the bench)"
        )


@dataclass(slots=True)
class Bench:
    """What every prompt length's measurements share."""

    spec: PeerSpec
    peer: Peer
    raw: RawClient
    connector: UCXConnector  # the decode side's, on local_cache; its connection stays open, as a decode instance's does
    local_cache: torch.Tensor  # the decode side's KV cache, pulled into
    remote_cache: torch.Tensor  # a copy of the peer's, to check pulled bytes against
    payload: torch.Tensor  # a copy of the peer's raw payload
    repeats: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class PullCase:
    """One request the peer published and the decode-side blocks it is pulled into."""

    layout: BlockLayout
    source: KVSource
    local_ids: list[int]
    message_blocks: list[int]  # blocks per message, as the connector plans this pull

    @classmethod
    def make(cls, bench: Bench, layout: BlockLayout, num_tokens: int) -> PullCase:
        spec = bench.spec
        num_blocks = cdiv(num_tokens, spec.block_size)
        remote_ids = request_block_ids("prefill", layout, spec, num_blocks)
        local_ids = request_block_ids("decode", layout, spec, num_blocks)
        source = KVSource(
            request_id(num_blocks, layout),
            bench.peer.ready.connector_address,
            tuple(remote_ids),
            num_tokens,
            spec.fingerprint,
        )
        return cls(layout, source, local_ids, plan_messages(remote_ids, local_ids, bench.connector.max_message_blocks))

    def message_bytes(self, bytes_per_block: int) -> int:
        """The size of this pull's messages for the raw mode, which cuts its payload into
        equal messages but a shorter last one: the connector's plan must be such a cut."""
        first = self.message_blocks[0]
        if any(count != first for count in self.message_blocks[:-1]) or self.message_blocks[-1] > first:
            raise RuntimeError(
                f"the connector plans messages of {self.message_blocks} blocks, not a cut raw messages can mimic (bug "
                "in the bench)"
            )
        return first * bytes_per_block


def pull_of(bench: Bench, case: PullCase) -> Callable[[], Awaitable[object]]:
    return lambda: bench.connector.pull(case.source, case.local_ids, 0, bench.timeout_s)


async def checked_pull(bench: Bench, case: PullCase, num_bytes: int) -> None:
    """One pull into zeroed blocks, its bytes compared with the peer's."""
    bench.local_cache[case.local_ids] = 0
    stats = await pull_of(bench, case)()
    if stats.num_bytes != num_bytes:
        raise RuntimeError(
            f"the connector moved {stats.num_bytes} bytes for {len(case.local_ids)} blocks, expected {num_bytes} (bug)"
        )
    check_blocks(bench.local_cache, case.local_ids, bench.remote_cache, list(case.source.block_ids))


def check_raw(bench: Bench, received: np.ndarray, what: str) -> None:
    if not np.array_equal(received, bench.payload[: received.nbytes].numpy()):
        raise RuntimeError(f"{what} delivered different bytes than the peer sent (bug in the bench)")


async def measure_length(bench: Bench, num_tokens: int) -> LengthResult:
    """Every measurement for one prompt length."""
    cases = {layout: PullCase.make(bench, layout, num_tokens) for layout in BLOCK_LAYOUTS}
    num_blocks = len(cases["scattered"].local_ids)
    num_bytes = num_blocks * bench.spec.bytes_per_block
    pulls = {layout: pull_of(bench, case) for layout, case in cases.items()}
    receive = np.zeros(num_bytes, dtype=np.uint8)

    async def fetch() -> None:
        await bench.raw.fetch(receive)

    # Warm-ups, checked bytewise: pulls into zeroed blocks, a raw transfer into a zeroed buffer.
    for case in cases.values():
        await checked_pull(bench, case, num_bytes)
    await fetch()
    check_raw(bench, receive, "raw UCX")

    *connector_samples, raw_samples = await timed_interleaved([*pulls.values(), fetch], bench.repeats)
    cpu_ms = {path_name(layout): await cpu_per_transfer(bench, pull) for layout, pull in pulls.items()}
    cpu_ms["raw UCX"] = await cpu_per_transfer(bench, fetch)

    received, destination = torch.from_numpy(receive), torch.empty(num_bytes, dtype=torch.uint8)
    memcpy_samples = timed(lambda: destination.copy_(received), bench.repeats)

    breakdown = await measure_breakdown(bench, cases, num_bytes)
    return LengthResult(
        num_tokens,
        num_blocks,
        num_bytes,
        connector=dict(zip(pulls, connector_samples, strict=True)),
        num_messages={layout: len(case.message_blocks) for layout, case in cases.items()},
        raw_ucx=raw_samples,
        memcpy=memcpy_samples,
        breakdown=breakdown,
        cpu_ms=cpu_ms,
    )


async def cpu_per_transfer(bench: Bench, transfer: Callable[[], Awaitable[object]]) -> dict[str, float]:
    """CPU milliseconds per transfer in this (decode) process and in the peer, all threads,
    over ``repeats`` back-to-back transfers."""
    decode_start, prefill_start = process_cpu_s(), await bench.raw.peer_cpu_s()
    for _ in range(bench.repeats):
        await transfer()
    decode_s, prefill_s = process_cpu_s() - decode_start, await bench.raw.peer_cpu_s() - prefill_start
    return {"decode": decode_s * 1e3 / bench.repeats, "prefill": prefill_s * 1e3 / bench.repeats}


async def measure_breakdown(bench: Bench, cases: dict[BlockLayout, PullCase], num_bytes: int) -> dict[str, Samples]:
    """Parts of a pull, each timed on its own:

    - ``connect``: a new connection to the peer's connector, closed after (a decode
      instance makes one per prefill instance and keeps it);
    - ``header_round_trip``: the scattered pull's request and reply headers (the larger
      request of the two) over an open raw endpoint;
    - ``raw_<layout>_messages``: raw UCX of the same bytes cut as the connector cuts that
      layout's pull, at most ``WINDOW`` messages in flight on each side: the connector's
      wire pattern with no connector logic.
    """
    repeats, scattered = bench.repeats, cases["scattered"]
    source = scattered.source
    request = encode(
        PullRequest(source.request_id, list(source.block_ids), source.fingerprint, scattered.message_blocks)
    )
    reply = encode(
        PullReply(ok=True, num_bytes=num_bytes, shape=list(bench.local_cache.shape[1:]), dtype=bench.spec.dtype)
    )

    async def connect() -> None:
        ucxx = ucxx_for_running_loop()
        host, _, port = source.address.rpartition(":")
        endpoint = await ucxx.create_endpoint(host, int(port))
        await endpoint.close()

    await connect()
    breakdown = {"connect": await timed_async(connect, repeats)}
    await bench.raw.ping(len(request), len(reply))
    breakdown["header_round_trip"] = await timed_async(lambda: bench.raw.ping(len(request), len(reply)), repeats)
    for layout, case in cases.items():
        receive = np.zeros(num_bytes, dtype=np.uint8)
        fetch = functools.partial(bench.raw.fetch_messages, receive, case.message_bytes(bench.spec.bytes_per_block))
        await fetch()
        check_raw(bench, receive, f"raw UCX in {layout} messages")
        breakdown[f"raw_{layout}_messages"] = await timed_async(fetch, repeats)
    return breakdown


async def measure_transfers(
    spec: PeerSpec, prompt_tokens: list[int], repeats: int, timeout_s: float
) -> list[LengthResult]:
    logger.info(
        "building the reference cache (%.0f MiB) and payload to check bytes against",
        spec.num_cache_blocks * spec.bytes_per_block / _MIB,
    )
    remote_cache = seeded_cache(spec)
    local_cache = empty_cache(spec)
    with peer_process(spec) as peer:
        logger.info("peer ready: connector at %s", peer.ready.connector_address)
        raw = await RawClient.connect(peer, timeout_s)
        connector = UCXConnector(local_cache, spec.fingerprint)
        try:
            bench = Bench(
                spec, peer, raw, connector, local_cache, remote_cache, seeded_payload(spec), repeats, timeout_s
            )
            results = []
            for num_tokens in prompt_tokens:
                logger.info("measuring %d tokens", num_tokens)
                results.append(await measure_length(bench, num_tokens))
        finally:
            await connector.close()
            await raw.close()
    return results


def measure_prefill(
    model: str | None, dtype: str, block_size: int, num_tokens: int, repeats: int, seed: int
) -> PrefillResult:
    """Prefill of a random ``num_tokens``-token prompt (one output token), after a warm-up
    prompt; every prompt is distinct, so no run hits the prefix cache."""
    from engine import LLM, SamplingParams
    from microbench.throughput import random_prompts

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
            raise RuntimeError(
                f"prefill produced {len(outputs[0].outputs[0].token_ids)} tokens with max_tokens=1 (bug)"
            )
    return PrefillResult(num_tokens, Samples(seconds))


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m microbench.kv_transfer", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="local Hugging Face folder for the KV shape (default: embedded SmolLM2-135M-Instruct)",
    )
    # The compute dtype, as everywhere; the KV moves in it (the engine's --kv-cache-dtype auto).
    add_dtype_argument(parser, default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--prompt-tokens", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths to transfer"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement, after one warm-up")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per pull")
    parser.add_argument("--seed", type=int, default=0, help="seeds the KV bytes, block ids and prefill prompts")
    parser.add_argument(
        "--ucx-tls",
        default=None,
        help=f"UCX_TLS for both processes (default: the environment's, else {UCX_DEFAULTS['UCX_TLS']}; '' unsets it)",
    )
    parser.add_argument(
        "--ucx-rndv-scheme", default=None, help=f"UCX_RNDV_SCHEME likewise (default {UCX_DEFAULTS['UCX_RNDV_SCHEME']})"
    )
    parser.add_argument(
        "--ucx-net-devices",
        default=None,
        help=f"UCX_NET_DEVICES likewise (default {UCX_DEFAULTS['UCX_NET_DEVICES']}: TCP on loopback only)",
    )
    parser.add_argument("--skip-prefill", action="store_true", help="do not time the engine's prefill")
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=2048,
        help="prompt length whose prefill is timed; must be among --prompt-tokens",
    )
    parser.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills, after one warm-up")
    parser.add_argument("--output-json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.dtype == "auto":
        parser.error("--dtype auto: name the dtype the KV moves in (bfloat16, float16 or float32)")
    for name in ("block_size", "repeats", "prefill_repeats", "prefill_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.prompt_tokens):
        parser.error(f"--prompt-tokens must all be >= 1, got {args.prompt_tokens}")
    if not args.skip_prefill and args.prefill_tokens not in args.prompt_tokens:
        parser.error(
            f"--prefill-tokens {args.prefill_tokens} is not among --prompt-tokens {args.prompt_tokens}; add it there "
            "or pass --skip-prefill"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    env = resolve_ucx_env(args)  # before anything starts ucxx
    logger.info("UCX settings: %s", "  ".join(setting.describe() for setting in env))
    model_id, (num_layers, num_kv_heads, head_dim) = kv_layout(args.model)
    request_num_blocks = tuple(sorted({cdiv(n, args.block_size) for n in args.prompt_tokens}))
    spec = PeerSpec(
        model_id=model_id,
        dtype=args.dtype,
        num_layers=num_layers,
        block_size=args.block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_cache_blocks=2 * request_num_blocks[-1],  # twice the largest request, so its blocks scatter
        request_num_blocks=request_num_blocks,
        seed=args.seed,
    )

    # Prefill first, while no UCX progress thread and no peer process share the CPU.
    prefill = None
    if not args.skip_prefill:
        logger.info("timing the engine's prefill of %d tokens", args.prefill_tokens)
        prefill = measure_prefill(
            args.model, args.dtype, args.block_size, args.prefill_tokens, args.prefill_repeats, args.seed
        )
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
