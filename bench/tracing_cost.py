"""What tracing costs serving: the same load on ``splitserve up`` (prefill and decode each on a
core of its own) with tracing off, on (an OTLP/gRPC receiver in this process that keeps
count of the spans it is sent), pointed at a port where nothing listens (the collector is
down), and at one that accepts connections and never answers (blackholed)::

    python -m bench.tracing_cost --output-dir results/tracing

Each mode starts its own server and runs ``splitserve bench serve`` against it (random
prompts, Poisson arrivals, the same seed every time); the table compares TTFT and ITL.
Latencies need a quiet machine; beside them the table gives each process's CPU seconds per
request over the run (gateway, prefill, decode: ``/proc/<pid>/stat``), which is what tracing
adds to serving and which load on other cores barely moves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.splitserve_up import start_up, wait_ready
from bench.token_profile import child_pids, process_label
from engine_args.flags import add_dtype_argument
from launcher.processes import free_port, splitserve_command

MODES = ("off", "on", "down", "blackholed")
ROLES = ("gateway", "prefill", "decode")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds_by_role(up_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) each process under ``splitserve up`` has used so far, by role."""
    seconds: dict[str, float] = {}
    for pid in child_pids(up_pid):
        try:
            role = process_label(pid)
            # Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        seconds[role] = seconds.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return seconds


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that only counts what it is sent."""

    def __init__(self) -> None:
        self.num_spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - gRPC signature
        count = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        with self._lock:
            self.num_spans += count
        return trace_service_pb2.ExportTraceServiceResponse()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--prefill-cpus", default="0")
    parser.add_argument("--decode-cpus", default="1")
    return parser.parse_args(argv)


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    with ExitStack() as stack:
        flags = ["--prefill-cpus", args.prefill_cpus, "--decode-cpus", args.decode_cpus, "--request-log", "off"]
        counter = None
        if mode == "on":
            counter = SpanCounter()
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counter, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            stack.callback(server.stop, None)
            flags += ["--otlp-traces-endpoint", f"http://127.0.0.1:{port}"]
        elif mode == "down":
            flags += ["--otlp-traces-endpoint", f"http://127.0.0.1:{free_port()}"]
        elif mode == "blackholed":
            blackhole = stack.enter_context(socket.socket())
            blackhole.bind(("127.0.0.1", 0))
            blackhole.listen(1024)  # accepted by the kernel, never answered
            flags += ["--otlp-traces-endpoint", f"http://127.0.0.1:{blackhole.getsockname()[1]}"]
        http_port = free_port()
        url = f"http://127.0.0.1:{http_port}"
        log = stack.enter_context(open(args.output_dir / f"{mode}-server.log", "w"))
        up = start_up(http_port, args.dtype, flags, log, log_level="INFO")
        try:
            wait_ready(url, up)
            name = f"tracing-{mode}"
            cpu_before = cpu_seconds_by_role(up.pid)
            subprocess.run(
                splitserve_command(
                    "bench",
                    "serve",
                    "--base-url",
                    url,
                    "--dataset",
                    "random",
                    "--input-len",
                    str(args.input_len),
                    "--output-len",
                    str(args.output_len),
                    "--request-rate",
                    str(args.request_rate),
                    "--num-prompts",
                    str(args.num_prompts),
                    "--seed",
                    "7",
                    "--metric-percentiles",
                    "50,90,99",
                    "--label",
                    name,
                    "--save-result",
                    "--result-dir",
                    str(args.output_dir),
                    "--result-filename",
                    f"{name}.json",
                    "--disable-tqdm",
                ),
                check=True,
            )
            cpu_after = cpu_seconds_by_role(up.pid)
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=180)
        result = json.loads((args.output_dir / f"{name}.json").read_text())
        row = {"mode": mode, "completed": result["completed"], "failed": result["failed"]}
        for metric in ("ttft", "itl"):
            for stat in ("median", "p90", "p99"):
                row[f"{metric}_{stat}_ms"] = result[f"{stat}_{metric}_ms"]
        row["spans_received"] = counter.num_spans if counter is not None else None
        for role in ROLES:
            used = cpu_after.get(role, 0.0) - cpu_before.get(role, 0.0)
            row[f"{role}_cpu_ms_per_request"] = 1000 * used / max(result["completed"], 1)
        return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = [run_mode(args, mode) for mode in args.modes.split(",")]
    (args.output_dir / "tracing-cost.json").write_text(json.dumps(rows, indent=2))
    cpu_columns = "".join(f" {role + ' CPU ms':>16}" for role in ROLES)
    header = (
        f"{'tracing':<11} {'done':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'spans':>7}"
        f"{cpu_columns}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['mode']:<11} {row['completed']:>5} {row['ttft_median_ms']:>9.1f} {row['ttft_p99_ms']:>9.1f} "
            f"{row['itl_median_ms']:>8.1f} {row['itl_p99_ms']:>8.1f} {row['spans_received'] or '':>7}"
            + "".join(f" {row[f'{role}_cpu_ms_per_request']:>16.1f}" for role in ROLES)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
