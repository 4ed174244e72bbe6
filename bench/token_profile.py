"""Where one output token's time goes, online: sample a serving instance with py-spy
while one client stream runs, and break the samples down by part.

``splitserve up`` (``--colocated`` by default, or ``--pd``: prefill on one core, decode
on the other) serves one request after another (128 prompt tokens -> 128 output tokens,
ignore_eos) while py-spy samples every process of the cluster (the gateway, and the
colocated or decode instance) for ``--duration`` seconds. Each sampled stack is put in
the first bucket whose rule its innermost matching frame meets, per process and thread;
the table shows each bucket's share of the samples and its milliseconds per output
token (samples / rate / tokens streamed meanwhile)::

    python -m bench.token_profile --duration 30
    python -m bench.token_profile --duration 30 --source-dir /tmp/splitserve-before   # another checkout
    python -m bench.token_profile --duration 30 --native   # inside the native kernels too

py-spy (``pip install py-spy``; it needs ptrace, root on most hosts) samples without
stopping the process; only threads holding the GIL or running native code are counted
(idle threads are not), so the shares are of busy time.

Each process's CPU time per output token comes too (its threads' user + system time over
the sampled seconds, from /proc), the client's included: what a token costs each process
whoever gets the cores. ``--cpu-only`` measures that alone, without py-spy beside the cluster::

    python -m bench.token_profile --duration 30 --cpu-only --model FILE.gguf --up-flags "--colocated-cpus 1"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from bench.splitserve_up import start_up, wait_ready
from engine_args.flags import add_dtype_argument
from launcher.processes import free_port

# (bucket, pattern on "function (file:line)" frames), tried from the innermost frame out.
# Native frames (``--native``) name the C kernels, ``name (library.so)`` or ``name._omp_fn.0 (...)``
# for a thread's share of a parallel loop; a libgomp frame innermost is a thread waiting in
# the OpenMP runtime (a barrier, or a team waking up) rather than computing.
_RULES: list[tuple[str, re.Pattern[str]]] = [
    ("waiting for events (idle)", re.compile(r"\(\S*selectors\.py:\d+\)")),
    ("OpenMP runtime (barriers, team wake-ups)", re.compile(r"\(\S*libgomp\S*\)")),
    (
        "linear layers",
        re.compile(r"CPUKernels\.linear |engine/models/cpu_linear\.py|torch/nn/modules/linear\.py|^linear_panels[ .]"),
    ),
    (
        "attention",
        re.compile(
            r"CPUKernels\.(paged_decode_attention|store_kv) |engine/attention/|^(paged_decode_attention|store_kv)[ .]"
        ),
    ),
    (
        "norm / rotary / SiLU kernels",
        re.compile(
            r"engine/models/ops\.py|engine/models/rotary\.py|engine/cpu_kernels\.py"
            r"|^(add_rms_norm|rotary_embedding|silu_and_mul)[ .]"
        ),
    ),
    ("embedding, logits", re.compile(r"engine/models/llama\.py|^decode_forward ")),
    # Without --native, the whole native decode step is this one frame.
    ("decode step in one native call", re.compile(r"engine/models/native_decode\.py")),
    ("sampling", re.compile(r"engine/sampler\.py")),
    ("input preparation", re.compile(r"engine/model_runner\.py")),
    ("scheduler, KV blocks", re.compile(r"engine/(scheduler|kv_cache_manager|block_pool|kv_cache_utils)\.py")),
    ("engine core, outputs", re.compile(r"engine/(engine_core|request|outputs)\.py")),
    ("async engine hand-off", re.compile(r"engine/async_engine\.py")),
    ("detokenizer", re.compile(r"engine/detokenizer\.py|gateway/generation\.py|tokenizers")),
    ("gateway HTTP / SSE / JSON", re.compile(r"gateway/|fastapi|starlette|uvicorn|pydantic|json")),
    ("gRPC and servicers", re.compile(r"grpc|serving/|cluster/|(prefill|decode|colocated)_svc/|splitserve/v1")),
    ("KV transfer", re.compile(r"kv_connector/|ucxx")),
    ("asyncio event loop", re.compile(r"asyncio/")),
]
_OTHER = "other"
_STACK = re.compile(r"^thread \((?P<tid>\w+)\): (?P<thread>[^;]*);(?P<frames>.*) (?P<count>\d+)$")


def classify(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for bucket, pattern in _RULES:
            if pattern.search(frame):
                return bucket
    return _OTHER


def thread_kind(name: str) -> str:
    """Group a process's threads: the engine's step thread, the event loop, everything else."""
    if name == "engine-step-loop":
        return "engine step thread"
    if name in ("MainThread", "main"):
        return "event loop (main thread)"
    return "other threads"


def breakdown(raw: str) -> Counter[tuple[str, str]]:
    """Samples by (thread kind, bucket) from py-spy's ``--format raw --threads`` output."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in raw.splitlines():
        match = _STACK.match(line.strip())
        if match is None:
            continue
        counts[thread_kind(match["thread"].strip()), classify(match["frames"].split(";"))] += int(match["count"])
    return counts


def child_pids(pid: int) -> list[int]:
    """Every process under ``pid`` (the launcher's children: gateway and instances)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.append(child)
            pending.append(child)
    return found


def process_label(pid: int) -> str:
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [word.decode() for word in command if word]
    for role in ("gateway", "colocated", "prefill", "decode"):
        if role in words:
            return role
    return " ".join(words[:3])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime and stime, fields 14 and 15 of proc(5), the 12th and 13th after the command name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_requests(url: str, stop: threading.Event, counts: list[int]) -> None:
    """One completion after another, streamed; counts the tokens that arrive."""
    body = json.dumps(
        {"prompt": "word " * 127, "max_tokens": 128, "ignore_eos": True, "stream": True, "temperature": 0}
    ).encode()
    while not stop.is_set():
        request = urllib.request.Request(
            f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    counts[0] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.token_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds sampled, after a 10 s warm-up stream")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument(
        "--pd", action="store_true", help="serve disaggregated (P on core 0, D on core 1), not colocated"
    )
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--source-dir", type=Path, default=None, help="serve from this checkout")
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--model", default=None, help="served model (default: the embedded one)")
    parser.add_argument(
        "--up-flags", default="", help='more splitserve up flags, one string (e.g. "--colocated-cpus 1")'
    )
    parser.add_argument(
        "--cpu-only", action="store_true", help="CPU time per process only, no py-spy beside the cluster"
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="sample native frames too (what a C kernel or the OpenMP runtime does); py-spy then pauses "
        "the processes for each sample, which slows them: read the shares, not the ms per token",
    )
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy")
    if py_spy is None and not args.cpu_only:
        parser.error("py-spy is not installed: pip install py-spy (or --cpu-only)")

    port = free_port()
    flags = ["--prefill-cpus", "0", "--decode-cpus", "1"] if args.pd else ["--colocated"]
    flags += ["--model", args.model] if args.model else []
    flags += shlex.split(args.up_flags)
    workdir = Path(tempfile.mkdtemp(prefix="token-profile-"))
    log = (workdir / "server.log").open("w")
    server = start_up(
        port, args.dtype, flags, log, log_level="INFO", source_dir=args.source_dir or Path.cwd(), new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, "/ready")
        stop, counts = threading.Event(), [0]
        client = threading.Thread(target=stream_requests, args=(url, stop, counts), daemon=True)
        client.start()
        time.sleep(10.0)  # past the first requests' one-time costs
        pids = {pid: process_label(pid) for pid in child_pids(server.pid)}
        measured = {**pids, os.getpid(): "client (this process)"}
        cpu_before = {pid: cpu_seconds(pid) for pid in measured}
        tokens_before = counts[0]
        spies = (
            {}
            if args.cpu_only
            else {
                pid: subprocess.Popen(
                    [
                        py_spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--duration",
                        str(int(args.duration)),
                        "--rate",
                        str(args.rate),
                        "--format",
                        "raw",
                        "--threads",
                        "--full-filenames",
                        # Native stacks need the process paused while py-spy walks them.
                        *(["--native"] if args.native else ["--nonblocking"]),
                        "--output",
                        str(workdir / f"{pid}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for pid in pids
            }
        )
        if args.cpu_only:
            time.sleep(args.duration)
        for spy in spies.values():
            spy.wait(timeout=args.duration + 60)
        num_tokens = counts[0] - tokens_before
        cpu_ms = {
            label: (cpu_seconds(pid) - cpu_before[pid]) * 1e3 / max(num_tokens, 1) for pid, label in measured.items()
        }
        stop.set()
        client.join(timeout=120)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()

    report: dict[str, object] = {
        "output_tokens": num_tokens,
        "duration_s": args.duration,
        "rate": args.rate,
        "cpu_ms_per_token": cpu_ms,
        "processes": {},
    }
    sys.stdout.write(
        f"{num_tokens} tokens streamed in {args.duration:.0f} s: {args.duration * 1e3 / max(num_tokens, 1):.1f} "
        "ms/token\n\n| process | CPU ms per token |\n|---|---|\n"
    )
    for label, ms in sorted(cpu_ms.items(), key=lambda item: -item[1]):
        sys.stdout.write(f"| {label} | {ms:.2f} |\n")
    for pid, label in sorted(pids.items(), key=lambda item: item[1]):
        path = workdir / f"{pid}.txt"
        counts_by_part = breakdown(path.read_text() if path.exists() else "")
        total = sum(counts_by_part.values())
        if not total:
            continue
        rows = []
        sys.stdout.write(
            f"\n{label} (pid {pid}): {total} samples\n\n| thread | part | share | ms per token |\n|---|---|---|---|\n"
        )
        for (thread, part), count in counts_by_part.most_common():
            ms_per_token = count / args.rate * 1e3 / max(num_tokens, 1)
            rows.append({"thread": thread, "part": part, "samples": count, "ms_per_token": ms_per_token})
            sys.stdout.write(f"| {thread} | {part} | {count / total:.1%} | {ms_per_token:.2f} |\n")
        report["processes"][label] = rows  # type: ignore[index]
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
