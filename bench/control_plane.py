"""How fast a prefill instance answers its control calls while its engine is busy.

A prefill instance (the embedded model by default) runs pinned to one core while a
driver keeps two long prefills in flight at all times, back to back, so the engine is
always inside a long step. Meanwhile a prober calls ``GetLoadReport`` every 50 ms, and
every finished prefill's KV is released at once with ``ReleaseKV`` (as a decode
instance does after its pull) and, before that, renewed with ``RenewKV`` (as a decode
instance does while the request is queued). It prints the latency percentiles of each
call, as JSON and as a markdown table::

    python -m bench.control_plane --duration 60 --prompt-len 2048 --cpus 0

``--source-dir`` runs the instance from another checkout (``git worktree add``) to
compare commits in one run; calls that checkout does not serve are reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_args.flags import add_dtype_argument
from launcher.processes import free_port, splitserve_command
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2

READY_TIMEOUT_S = 300.0
PROBE_INTERVAL_S = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of measurement")
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens of each long prefill")
    parser.add_argument("--cpus", default="0", help="taskset CPU list for the prefill instance")
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--model", default=None, help="local Hugging Face folder (default: the embedded model)")
    parser.add_argument("--source-dir", type=Path, default=None, help="run the instance from this checkout")
    parser.add_argument("--label", default="")
    return parser.parse_args(argv)


@dataclass
class Latencies:
    by_call: dict[str, list[float]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def timed(self, name: str, call, *args, **kwargs):
        started = time.perf_counter()
        try:
            result = call(*args, **kwargs)
        except grpc.RpcError as error:
            with self.lock:
                key = f"{name} {error.code().name}"
                self.failures[key] = self.failures.get(key, 0) + 1
            return None
        with self.lock:
            self.by_call.setdefault(name, []).append(time.perf_counter() - started)
        return result

    def summary(self) -> dict[str, dict[str, float]]:
        table = {}
        for name, values in sorted(self.by_call.items()):
            ms = np.array(values) * 1000
            table[name] = {
                "count": len(values),
                "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)),
                "max_ms": float(ms.max()),
            }
        return table


def start_instance(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    model = ["--model", args.model] if args.model else []
    instance = splitserve_command(
        "--log-level",
        "WARNING",
        "prefill",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--lease-seconds",
        "600",
        *model,
        source_dir=args.source_dir,
    )
    env = {**os.environ, "UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    return subprocess.Popen(
        ["taskset", "-c", args.cpus, *instance], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def wait_serving(channel: grpc.Channel, process: subprocess.Popen[bytes]) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the prefill instance exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if (
                health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                == health_pb2.HealthCheckResponse.SERVING
            ):
                return
        except grpc.RpcError:
            time.sleep(0.5)
    raise TimeoutError("the prefill instance did not start")


def drive(
    stub: disaggregation_pb2_grpc.PrefillStub, latencies: Latencies, prompt_len: int, stop: threading.Event, seed: int
) -> None:
    """Back-to-back long prefills (fresh prompts: no prefix-cache hits); each one's KV is
    renewed, then released, as soon as it is pinned."""
    rng = random.Random(seed)
    sampling = generation_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    number = 0
    while not stop.is_set():
        number += 1
        request_id = f"long-{seed}-{number}"
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        try:
            response = stub.Prefill(
                disaggregation_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling),
                timeout=600,
            )
        except grpc.RpcError:
            continue
        if response.HasField("kv"):
            latencies.timed(
                "RenewKV", stub.RenewKV, disaggregation_pb2.RenewKVRequest(request_ids=[request_id]), timeout=30
            )
            latencies.timed(
                "ReleaseKV", stub.ReleaseKV, disaggregation_pb2.RequestRef(request_id=request_id), timeout=30
            )


def probe(channel: grpc.Channel, latencies: Latencies, stop: threading.Event) -> None:
    load = disaggregation_pb2_grpc.LoadStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    while not stop.wait(PROBE_INTERVAL_S):
        latencies.timed("GetLoadReport", load.GetLoadReport, disaggregation_pb2.LoadReportRequest(), timeout=30)
        latencies.timed("Health", health.Check, health_pb2.HealthCheckRequest(), timeout=30)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = free_port()
    process = start_instance(args, port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    latencies = Latencies()
    stop = threading.Event()
    try:
        wait_serving(channel, process)
        stub = disaggregation_pb2_grpc.PrefillStub(channel)
        drive_once = disaggregation_pb2.PrefillRequest(
            request_id="warmup",
            prompt_token_ids=list(range(100, 164)),
            sampling=generation_pb2.SamplingParams(max_tokens=1),
        )
        stub.Prefill(drive_once, timeout=600)
        threads = [
            threading.Thread(target=drive, args=(stub, latencies, args.prompt_len, stop, seed)) for seed in (1, 2)
        ]
        threads.append(threading.Thread(target=probe, args=(channel, latencies, stop)))
        for thread in threads:
            thread.start()
        time.sleep(args.duration)
        stop.set()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        channel.close()
        process.terminate()
        process.wait(timeout=120)
    summary = latencies.summary()
    print(json.dumps({"label": args.label, "latencies": summary, "failures": latencies.failures}))
    print(f"\n| {args.label or 'call'} | count | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for name, row in summary.items():
        print(f"| {name} | {row['count']} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['max_ms']:.1f} |")
    for name, count in latencies.failures.items():
        print(f"| {name} (failed) | {count} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
