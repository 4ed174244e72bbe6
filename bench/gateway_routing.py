"""Do several gateways route as well as one? One simulated cluster (``--num-prefill`` +
``--num-decode`` instances with a GPU-like timing profile, a Redis registry, ``--num-gateways``
gateway replicas, each its own ``--gateway-index``), and the same shared-prefix workload sent
two ways, round after round, the order alternating, so that both see the same instances and
the same machine load over time:

- ``one``: every request to the first gateway (the others idle: they poll as replicas do);
- ``all``: request ``i`` to gateway ``i % --num-gateways``, so that each gateway routes a
  share and learns of the others' work only from the instances' load reports and KV events.

Each round draws prefixes of its own (token ids, never seen before), so no round serves
another's cache; round 0 warms up and is not reported. Per mode: the prefix-cache hit rate
(the gateways' cached over prompt tokens, summed over every gateway, from their counters),
the bound a round can reach (every request but the first of each prefix hits it whole), and
TTFT p50 / p99 at the client (the client is light: an open loop at ``--request-rate``)::

    python -m bench.gateway_routing --output-dir /tmp/gateway-routing

Writes ``gateway_routing.json`` and ``summary.md`` (with the CPU model and flags) in
``--output-dir``. Every process it started is stopped by its pid, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import redis

from bench.arrivals import arrival_offsets
from bench.routing import cpu_line
from bench.simulated_cluster import (
    Cluster,
    get_json,
    ready_bodies,
    redis_answers,
    split,
    start_gateways,
    start_instances,
    start_redis,
    wait_until,
)
from launcher.processes import free_port

logger = logging.getLogger(__name__)

MODES = ("one", "all")
TOKEN_ID_FLOOR = 100  # prompt ids from here up: clear of a tokenizer's special tokens
COUNTERS = ("splitserve_prompt_tokens_total", "splitserve_cached_prompt_tokens_total")


@dataclass(slots=True)
class RoundResult:
    mode: str
    round_index: int
    ttfts_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    prompt_tokens: float = 0.0  # the gateways' counters over the round, summed
    cached_tokens: float = 0.0
    reusable_tokens: int = 0  # cached tokens the round could reach at best


def round_prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """The round's prompts: ``--num-prefixes`` shared prefixes of its own, each request one of
    them (shuffled) followed by a suffix of its own."""
    rng = random.Random(seed)
    vocab = args.vocab_size - TOKEN_ID_FLOOR

    def ids(count: int) -> list[int]:
        return [TOKEN_ID_FLOOR + rng.randrange(vocab) for _ in range(count)]

    prefixes = [ids(args.prefix_len) for _ in range(args.num_prefixes)]
    groups = [i % args.num_prefixes for i in range(args.num_prompts)]
    rng.shuffle(groups)
    return [prefixes[group] + ids(args.suffix_len) for group in groups]


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float | None, str | None]:
    """(TTFT in seconds, None), or (None, the error)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    sent_at = time.perf_counter()
    ttft = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                return None, f"HTTP {response.status}: {(await response.text())[:200]}"
            async for line in response.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - sent_at
    except (aiohttp.ClientError, TimeoutError) as error:
        return None, repr(error)
    return ttft, None if ttft is not None else "no token streamed"


async def open_loop(urls: list[str], model: str, prompts: list[list[int]], args: argparse.Namespace, seed: int):
    offsets = arrival_offsets(len(prompts), args.request_rate, seed=seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(index: int) -> tuple[float | None, str | None]:
            await asyncio.sleep(max(0.0, started + offsets[index] - time.perf_counter()))
            return await one_request(session, urls[index % len(urls)], model, prompts[index], args.output_len)

        return await asyncio.gather(*(send(i) for i in range(len(prompts))))


def gateway_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for name in COUNTERS:
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        values[name] = float(found[1]) if found else 0.0
    return values


def summed_counters(cluster: Cluster) -> dict[str, float]:
    per_gateway = [gateway_counters(url) for url in cluster.gateway_urls]
    return {name: sum(values[name] for values in per_gateway) for name in COUNTERS}


def run_round(cluster: Cluster, model: str, mode: str, round_index: int, args: argparse.Namespace) -> RoundResult:
    # Prefixes of the round's and mode's own: the other mode's round never warmed them.
    seed = 2 * round_index + MODES.index(mode)
    prompts = round_prompts(args, seed)
    urls = cluster.gateway_urls if mode == "all" else cluster.gateway_urls[:1]
    before = summed_counters(cluster)
    outcomes = asyncio.run(open_loop(urls, model, prompts, args, seed))
    # The gateways count a request's tokens when it ends; every request has ended here.
    after = summed_counters(cluster)
    result = RoundResult(mode, round_index)
    for ttft, error in outcomes:
        if error is None and ttft is not None:
            result.ttfts_s.append(ttft)
        else:
            result.errors.append(error or "?")
    result.prompt_tokens = after[COUNTERS[0]] - before[COUNTERS[0]]
    result.cached_tokens = after[COUNTERS[1]] - before[COUNTERS[1]]
    num_ok = len(result.ttfts_s)
    # Each prefix's first request computes it; with errors, this bound may be loose by theirs.
    result.reusable_tokens = args.prefix_len * max(0, num_ok - args.num_prefixes)
    logger.info(
        "%s round %d: %d ok, %d failed, hit rate %.1f%%, TTFT p50 %.0f ms",
        mode, round_index, num_ok, len(result.errors),
        100 * result.cached_tokens / max(1.0, result.prompt_tokens),
        1000 * float(np.percentile(result.ttfts_s, 50)) if result.ttfts_s else float("nan"),
    )  # fmt: skip
    return result


def mode_figures(results: list[RoundResult], mode: str) -> dict:
    measured = [r for r in results if r.mode == mode and r.round_index > 0]
    ttfts_ms = [1000 * t for r in measured for t in r.ttfts_s]
    prompt = sum(r.prompt_tokens for r in measured)
    return {
        "requests": len(ttfts_ms),
        "failed": sum(len(r.errors) for r in measured),
        "hit_rate": sum(r.cached_tokens for r in measured) / prompt if prompt else 0.0,
        "hit_rate_bound": sum(r.reusable_tokens for r in measured) / prompt if prompt else 0.0,
        "ttft_p50_ms": float(np.percentile(ttfts_ms, 50)) if ttfts_ms else None,
        "ttft_p99_ms": float(np.percentile(ttfts_ms, 99)) if ttfts_ms else None,
    }


def summary(figures: dict[str, dict], num_gateways: int) -> str:
    names = {"one": "1 gateway", "all": f"{num_gateways} gateways"}
    rows = [
        "| gateways | requests | failed | prefix-cache hit rate | bound | TTFT p50 / p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, f in figures.items():
        ttft = f"{f['ttft_p50_ms']:.1f} / {f['ttft_p99_ms']:.1f}" if f["ttft_p50_ms"] is not None else "-"
        rows.append(
            f"| {names[mode]} | {f['requests']} | {f['failed']} | {f['hit_rate']:.1%} | {f['hit_rate_bound']:.1%} "
            f"| {ttft} |"
        )
    one, all_ = figures.get("one"), figures.get("all")
    if one and all_ and one["ttft_p50_ms"] and all_["ttft_p50_ms"] is not None:
        rows.append("")
        rows.append(
            f"{num_gateways} gateways against 1: hit rate {100 * (all_['hit_rate'] - one['hit_rate']):+.1f} points, "
            f"TTFT p50 {100 * (all_['ttft_p50_ms'] / one['ttft_p50_ms'] - 1):+.1f}%"
        )
    return "\n".join(rows)


def start(args: argparse.Namespace, cluster: Cluster, env: dict[str, str], log) -> str:
    """Start the gateways and instances; the served model's name once every gateway routes to all."""
    client = redis.Redis.from_url(cluster.redis_url)
    wait_until(cluster, lambda: redis_answers(client), "Redis answers")
    start_gateways(cluster, args, env, log)
    expected = {"prefill": args.num_prefill, "decode": args.num_decode}
    for role, total in expected.items():
        for index, count in enumerate(split(total, min(args.processes_per_role, total))):
            start_instances(cluster, args, env, log, role, index, count)

    def all_routed() -> bool:
        return all(
            all(body.get("instances", {}).get(role) == count for role, count in expected.items())
            for body in ready_bodies(cluster)
        )

    wait_until(cluster, all_routed, f"every gateway routes to {expected}")
    return get_json(f"{cluster.gateway_urls[0]}/v1/models")["data"][0]["id"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--num-prefill", type=int, default=16)
    parser.add_argument("--num-decode", type=int, default=16)
    parser.add_argument("--processes-per-role", type=int, default=2, help="simulate processes of each role")
    parser.add_argument("--num-gateways", type=int, default=4)
    parser.add_argument("--profile", default="llama-3.1-8b-h100", help="the instances' timing profile")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per mode (after a warm-up round)")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests per round")
    parser.add_argument("--request-rate", type=float, default=32.0, help="requests/s, Poisson arrivals")
    parser.add_argument("--num-prefixes", type=int, default=16, help="shared prefixes per round")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are drawn below this")
    parser.add_argument("--heartbeat-seconds", type=float, default=1.0, help="the instances' registry heartbeat")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="the gateways' registry scan and KV polls")
    args = parser.parse_args(argv)
    if min(args.num_prefill, args.num_decode, args.num_gateways, args.processes_per_role, args.rounds) < 1:
        parser.error("--num-prefill, --num-decode, --num-gateways, --processes-per-role and --rounds must be >= 1")
    if args.num_prompts <= args.num_prefixes:
        parser.error("--num-prompts must exceed --num-prefixes (each prefix's first request computes it)")
    args.streams = args.num_prompts  # start_gateways sizes each gateway's pending requests from it
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.output_dir / "cluster.log"
    env = {**os.environ, "SPLITSERVE_CLUSTER_SECRET": "bench-gateway-routing-" + os.urandom(8).hex()}
    cluster = Cluster(redis_port=free_port(), log_path=log_path)
    results: list[RoundResult] = []
    with log_path.open("w") as log:
        try:
            start_redis(cluster, log)
            model = start(args, cluster, env, log)
            for round_index in range(args.rounds + 1):
                for mode in MODES if round_index % 2 == 0 else reversed(MODES):
                    results.append(run_round(cluster, model, mode, round_index, args))
                    cluster.check_alive()
        finally:
            cluster.stop()
    figures = {mode: mode_figures(results, mode) for mode in MODES}
    table = summary(figures, args.num_gateways)
    cpu = cpu_line()
    settings = {k: v for k, v in vars(args).items() if k != "output_dir"}
    report = {"cpu": cpu, "settings": settings, "modes": figures, "rounds": [asdict(r) for r in results]}
    (args.output_dir / "gateway_routing.json").write_text(json.dumps(report, indent=2, default=str))
    (args.output_dir / "summary.md").write_text(f"{cpu}\n\n{table}\n")
    print(cpu)
    print(table)
    return 0


if __name__ == "__main__":
    # A SIGTERM unwinds through main's finally, so that every process it started is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
