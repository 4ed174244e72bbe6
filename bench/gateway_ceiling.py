"""How much one gateway process costs per streamed token and per request, and what it adds
to latency, against simulated instances that stream at GPU speed (``splitserve simulate``).

    python -m bench.gateway_ceiling --output-dir /tmp/ceiling --concurrency 16,256,2048

It starts a Redis registry, ``--num-instances`` simulated colocated instances (or ``--layout
pd``: as many prefill and decode ones) whose decode step takes a constant ``--step-ms`` (so
that any gap beyond it is not the instance's batch), and one gateway (``--api-server-count``
passed on when given). For each concurrency it runs a closed loop of that many streams, twice:
``--short-tokens`` and ``--long-tokens`` completion tokens a request, and reads the gateway
process's CPU time (utime + stime from /proc) before and after each. Two runs give two
equations, ``cpu = requests * per_request + tokens * per_token``, solved for both costs, and
again net of the gateway's idle CPU (read over ``--idle-seconds`` before the runs, with no
request in flight), which would otherwise fall on the longer run's tokens.

Latency the gateway adds, from the gateway's own chunk write times (gateway/chunk_times.py):
its gaps between a stream's tokens beyond the instances' step, and the client's TTFT beyond
the simulated prefill. The client shares the host: its own gaps are reported beside the
gateway's, and a run whose client lagged is flagged (bench/token_gaps.py), so that a figure
says which side it measured. The client is lean on purpose: it reads raw SSE lines and parses
only the usage event and the chunk-times comment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from bench.proc_stats import tree_cpu_s
from bench.token_gaps import CHUNK_TIMES_HEADER, parse_chunk_times
from launcher.processes import free_port, splitserve_command

logger = logging.getLogger(__name__)

RETRY_AFTER_429_S = 0.05  # a refused request (the gateway's queues are full) is sent again after this


@dataclass(slots=True)
class StreamRecord:
    ttft_s: float | None = None
    num_tokens: int = 0
    client_gaps_s: list[float] = field(default_factory=list)
    gateway_gaps_s: list[float] = field(default_factory=list)
    num_refused: int = 0
    error: str | None = None


@dataclass(slots=True)
class RunResult:
    concurrency: int
    max_tokens: int
    num_requests: int
    num_tokens: int
    num_failed: int
    num_refused: int
    seconds: float
    gateway_cpu_s: float
    tokens_per_s: float
    requests_per_s: float
    gateway_gap_ms: dict[str, float]
    client_gap_ms: dict[str, float]
    ttft_ms: dict[str, float]


def percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    array = np.array(values) * 1000.0
    return {name: float(np.percentile(array, q)) for name, q in (("p50", 50), ("p99", 99), ("p99.9", 99.9))} | {
        "max": float(array.max())
    }


async def one_stream(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int, record: StreamRecord
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    while True:
        started = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body, headers={CHUNK_TIMES_HEADER: "1"}) as response:
            if response.status == 429:
                record.num_refused += 1
                await response.read()
                await asyncio.sleep(RETRY_AFTER_429_S)
                continue
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            arrivals: list[float] = []
            async for raw in response.content:
                line = raw.rstrip(b"\r\n")
                if line.startswith(b"data: {"):
                    if b'"usage":{' in line and b'"choices":[]' in line:
                        record.num_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                    else:
                        arrivals.append(time.perf_counter())
                elif line.startswith(b":"):
                    offsets = parse_chunk_times(line[1:].decode())
                    if offsets is not None:
                        written = [offset / 1000.0 for offset in offsets[: len(arrivals)]]
                        record.gateway_gaps_s = [b - a for a, b in zip(written, written[1:])]
            if arrivals:
                record.ttft_s = arrivals[0] - started
                record.client_gaps_s = [b - a for a, b in zip(arrivals, arrivals[1:])]
            return


async def closed_loop(
    url: str, model: str, concurrency: int, num_requests: int, max_tokens: int, prompt_words: int
) -> tuple[list[StreamRecord], float]:
    records: list[StreamRecord] = []
    next_index = 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < num_requests:
            index = next_index
            next_index += 1
            record = StreamRecord()
            records.append(record)
            # Token ids, each request's own (no prefix shared): the gateway's tokenizer pool, whose
            # queue one client may fill only in part, would refuse a closed loop of text prompts
            # (429) at hundreds of streams, and the refused tries would count as requests' cost.
            prompt = [100 + (index * 7919 + i * 31) % 30000 for i in range(prompt_words)]
            try:
                await one_stream(session, url, model, prompt, max_tokens, record)
            except (aiohttp.ClientError, TimeoutError) as error:
                record.error = repr(error)

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return records, time.perf_counter() - started


def run_level(args: argparse.Namespace, url: str, gateway_pid: int, concurrency: int, max_tokens: int) -> RunResult:
    num_requests = max(args.min_requests, args.requests_per_stream * concurrency)
    cpu_before = tree_cpu_s(gateway_pid)
    records, seconds = asyncio.run(
        closed_loop(url, args.model, concurrency, num_requests, max_tokens, args.prompt_words)
    )
    cpu = tree_cpu_s(gateway_pid) - cpu_before
    done = [r for r in records if r.error is None]
    if len(done) < len(records):
        logger.warning("%d of %d requests failed, the first: %s", len(records) - len(done), len(records),
                       next(r.error for r in records if r.error is not None))  # fmt: skip
    num_tokens = sum(r.num_tokens for r in done)
    return RunResult(
        concurrency=concurrency,
        max_tokens=max_tokens,
        num_requests=len(done),
        num_tokens=num_tokens,
        num_failed=len(records) - len(done),
        num_refused=sum(r.num_refused for r in records),
        seconds=seconds,
        gateway_cpu_s=cpu,
        tokens_per_s=num_tokens / seconds,
        requests_per_s=len(done) / seconds,
        gateway_gap_ms=percentiles_ms([g for r in done for g in r.gateway_gaps_s]),
        client_gap_ms=percentiles_ms([g for r in done for g in r.client_gaps_s]),
        ttft_ms=percentiles_ms([r.ttft_s for r in done if r.ttft_s is not None]),
    )


def costs(short: RunResult, long: RunResult, idle_cpu_per_s: float = 0.0) -> tuple[float, float]:
    """(gateway CPU µs per token, ms per request) from two runs of different lengths; with
    ``idle_cpu_per_s``, net of what the gateway spends idle over each run's time (discovery,
    load reports, KV-event heartbeats), which the longer run would otherwise charge to its tokens."""
    matrix = np.array([[short.num_requests, short.num_tokens], [long.num_requests, long.num_tokens]], dtype=float)
    cpu = [run.gateway_cpu_s - idle_cpu_per_s * run.seconds for run in (short, long)]
    per_request_s, per_token_s = np.linalg.solve(matrix, cpu)
    return per_token_s * 1e6, per_request_s * 1e3


def idle_cpu_rate(gateway_pid: int, seconds: float) -> float:
    """The gateway's CPU seconds per second with no request in flight."""
    before = tree_cpu_s(gateway_pid)
    time.sleep(seconds)
    return (tree_cpu_s(gateway_pid) - before) / seconds


def write_profile(path: Path, args: argparse.Namespace) -> None:
    """A GPU-speed instance whose decode step is a constant ``--step-ms`` whatever its batch."""
    profile = {
        "name": f"constant-{args.step_ms:g}ms-step",
        "source": "bench.gateway_ceiling: a constant decode step, so that gaps beyond it are not the instance's",
        "block_size": 16,
        "num_kv_blocks": 65536,
        "kv_bytes_per_token": 131072,
        "max_num_seqs": 1024,
        "max_num_batched_tokens": 8192,
        "step_fixed_s": args.step_ms / 1000.0,
        "token_s": 0.0,
        "attention_s": 0.0,
        "context_s": 0.0,
        "link_bytes_per_s": 5e10,
        "pull_fixed_s": 0.0005,
    }
    path.write_text(json.dumps(profile))


def start_cluster(args: argparse.Namespace, out: Path) -> tuple[list[subprocess.Popen[bytes]], str, int]:
    """Redis, the simulated instances, the gateway; returns the processes, the gateway's URL and pid."""
    processes: list[subprocess.Popen[bytes]] = []
    log = (out / "cluster.log").open("w")
    redis_port = free_port()
    processes.append(
        subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    )
    registry = f"redis://127.0.0.1:{redis_port}"
    profile = out / "profile.json"
    write_profile(profile, args)
    env = {**os.environ, "SPLITSERVE_CLUSTER_SECRET": "bench-gateway-ceiling-" + os.urandom(8).hex()}
    roles = ["colocated"] if args.layout == "colocated" else ["prefill", "decode"]
    for role in roles:
        command = splitserve_command(
            "--log-level", "WARNING", "simulate", role, "--profile", str(profile), "--num-instances",
            str(args.num_instances), "--instance-id", role, "--port", "0", "--registry-url", registry,
            "--max-num-seqs", "1024", source_dir=args.source_dir,
        )  # fmt: skip
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    port = free_port()
    gateway_flags = [
        "--port", str(port), "--grpc-port", "-1", "--registry-url", registry,
        "--max-pending-requests", str(4 * max(args.concurrency)),
    ]  # fmt: skip
    if args.api_server_count:
        gateway_flags += ["--api-server-count", str(args.api_server_count)]
    if args.loop:
        gateway_flags += ["--loop", args.loop]
    if args.instance_calls:
        gateway_flags += ["--instance-calls", args.instance_calls]
    gateway = subprocess.Popen(
        splitserve_command("--log-level", "WARNING", "gateway", *gateway_flags, source_dir=args.source_dir),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    processes.append(gateway)
    url = f"http://127.0.0.1:{port}"
    wanted = {role: args.num_instances for role in roles}
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a process of the cluster exited: see {out / 'cluster.log'}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                counts = json.loads(response.read())["instances"]
                if all(counts.get(role) == n for role, n in wanted.items()):
                    with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as models:
                        args.model = json.loads(models.read())["data"][0]["id"]
                    return processes, url, gateway.pid
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the gateway never routed to {wanted}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 256, 2048])
    parser.add_argument("--layout", choices=["colocated", "pd"], default="colocated")
    parser.add_argument("--num-instances", type=int, default=16, help="simulated instances (of each role with pd)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the simulated decode step, whatever the batch")
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=64, help="prompt tokens of each request")
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests each concurrent stream sends")
    parser.add_argument("--min-requests", type=int, default=64)
    parser.add_argument("--source-dir", type=Path, default=None, help="serve from this checkout (a before/after)")
    parser.add_argument(
        "--api-server-count", type=int, default=0, help="gateway processes on one port (0: the default)"
    )
    parser.add_argument(
        "--loop", default=None, help="the gateway's --loop (auto, asyncio, uvloop; default: the gateway's own)"
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=10.0, help="how long the gateway's idle CPU is read before the runs"
    )
    parser.add_argument(
        "--instance-calls",
        default=None,
        help="the gateway's --instance-calls (multiplexed, per-call; default: the gateway's own)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    processes, url, gateway_pid = start_cluster(args, args.output_dir)
    rows = []
    try:
        idle_cpu_per_s = idle_cpu_rate(gateway_pid, args.idle_seconds)
        logger.info("gateway idle: %.4f CPU seconds a second", idle_cpu_per_s)
        for concurrency in args.concurrency:
            short = run_level(args, url, gateway_pid, concurrency, args.short_tokens)
            long = run_level(args, url, gateway_pid, concurrency, args.long_tokens)
            per_token_us, per_request_ms = costs(short, long)
            net_per_token_us, net_per_request_ms = costs(short, long, idle_cpu_per_s)
            row = {
                "concurrency": concurrency,
                "gateway_cpu_us_per_token": per_token_us,
                "gateway_cpu_ms_per_request": per_request_ms,
                "gateway_idle_cpu_per_s": idle_cpu_per_s,
                "gateway_cpu_us_per_token_net_of_idle": net_per_token_us,
                "gateway_cpu_ms_per_request_net_of_idle": net_per_request_ms,
                "short": asdict(short),
                "long": asdict(long),
            }
            rows.append(row)
            logger.info(
                "concurrency %d: %.1f µs/token, %.2f ms/request (net of idle: %.1f µs, %.2f ms); "
                "long run %.0f tok/s, %.0f req/s, gateway gap p99 %.1f ms (step %.1f), client gap p99 %.1f ms, "
                "TTFT p50 %.1f ms, %d failed, %d refused",
                concurrency, per_token_us, per_request_ms, net_per_token_us, net_per_request_ms,
                long.tokens_per_s, long.requests_per_s,
                long.gateway_gap_ms.get("p99", float("nan")), args.step_ms, long.client_gap_ms.get("p99", float("nan")),
                long.ttft_ms.get("p50", float("nan")), long.num_failed, long.num_refused,
            )  # fmt: skip
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    (args.output_dir / "gateway_ceiling.json").write_text(
        json.dumps({"args": vars(args) | {"output_dir": str(args.output_dir)}, "rows": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
