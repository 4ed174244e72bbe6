"""``splitserve profile``: measure what one prefill and one decode instance sustain within the
SLOs (``planner/profiler.py``) and write the capacity profile ``splitserve planner
--capacity-profile`` reads (``planner/capacity_profile.py``).

Either through a running gateway that routes to one instance of each role (``--gateway-url``:
real instances, or simulated ones), or on simulated instances it starts itself from a timing
profile (``--simulate-profile``): then, in call order, it starts ``splitserve up --simulate
--num-prefill 1 --num-decode 1`` on free ports, waits until its gateway routes to both, runs
the sweeps, and stops ``up`` (SIGINT, as Ctrl-C does) whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from launcher.processes import UP_STOP_TIMEOUT_S, free_port, splitserve_command
from planner.flags import SLO_FLAGS, add_flags, slo_of
from planner.profiler import Profiler, SweepConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # up --simulate: Redis, two simulated instances (each imports torch) and a gateway


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--gateway-url", help="a running gateway that routes to one prefill and one decode instance")
    target.add_argument(
        "--simulate-profile",
        metavar="NAME|FILE",
        help="start simulated instances of this timing profile (docs/simulator.md) and measure them",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="--simulate-profile: the instances' --time-scale")
    parser.add_argument("--model", default=None, help="--simulate-profile: the model folder (config and tokenizer)")
    parser.add_argument("--output", required=True, help="where the capacity profile (JSON) goes")
    add_flags(parser, SLO_FLAGS)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="every request's prompt, tokens")
    parser.add_argument("--output-tokens", type=int, default=128, help="every decode stream's output, tokens")
    parser.add_argument("--seconds-per-level", type=float, default=20.0, help="how long each load level runs")
    parser.add_argument(
        "--min-requests-per-level", type=int, default=20, help="prefill requests a load level sends at least"
    )
    parser.add_argument("--refine-steps", type=int, default=3, help="bisections of the prefill rate")
    parser.add_argument("--max-streams", type=int, default=256, help="decode streams at most")
    parser.add_argument("--max-levels", type=int, default=12, help="load levels per role at most")
    parser.add_argument("--api-key", default=None, help="the gateway's API key, if it has one")


def run(args: argparse.Namespace) -> int:
    with _target(args) as (base_url, source):
        _check_one_of_each(base_url)
        config = SweepConfig(
            base_url=base_url,
            slo=slo_of(args),
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            seconds_per_level=args.seconds_per_level,
            min_requests_per_level=args.min_requests_per_level,
            refine_steps=args.refine_steps,
            max_streams=args.max_streams,
            max_levels=args.max_levels,
            api_key=args.api_key,
        )
        profile = asyncio.run(Profiler(config, source).run())
    profile.save(args.output)
    capacity = profile.capacity
    logger.info(
        "profile: one prefill instance takes %.3f req/s, one decode instance %.3f req/s (%d streams) at TTFT p90 "
        "%.3f s, ITL p90 %.3f s; written to %s",
        capacity.prefill_rate,
        capacity.decode_rate,
        capacity.decode_streams,
        profile.slo.ttft_s,
        profile.slo.itl_s,
        args.output,
    )
    return 0


def _ready(base_url: str) -> tuple[bool, dict[str, int]]:
    """Whether the gateway's /ready says it serves (a compatible prefill and decode pair is
    healthy), and its healthy instances per role; (False, {}) while it does not answer."""
    try:
        with urllib.request.urlopen(f"{base_url}/ready", timeout=5) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:  # 503 while not ready, still with the counts
        try:
            body = json.load(error)
        except ValueError:
            return False, {}
    except (OSError, ValueError):
        return False, {}
    return bool(body.get("ready")), dict(body.get("instances", {}))


def _check_one_of_each(base_url: str) -> None:
    ready, counts = _ready(base_url)
    if not ready or counts.get("prefill") != 1 or counts.get("decode") != 1:
        raise ValueError(
            f"the gateway at {base_url} is {'ready' if ready else 'not ready'}, with {counts or 'no'} healthy "
            "instances: the profile measures one instance of each role, so point it at a ready gateway with one "
            "prefill and one decode instance"
        )


@contextmanager
def _target(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(the gateway's URL, what is measured): the given gateway, or an ``up --simulate`` run here."""
    if args.gateway_url:
        yield args.gateway_url.rstrip("/"), args.gateway_url
        return
    port = free_port()
    model = ["--model", args.model] if args.model else []
    argv = splitserve_command(
        "--log-level", args.log_level, "up", "--simulate", "--simulate-profile", args.simulate_profile,
        "--time-scale", str(args.time_scale), *model, "--num-prefill", "1", "--num-decode", "1",
        "--port", str(port), "--grpc-port", str(free_port()),
    )  # fmt: skip
    log_path = Path(tempfile.mkdtemp(prefix="splitserve-profile-")) / "up.log"
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            logger.info("profile: starting simulated instances (log: %s)", log_path)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _ready(base_url)[0]:
                if up.poll() is not None:
                    raise RuntimeError(f"splitserve up exited with {up.returncode} before it was ready; see {log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"splitserve up was not ready after {START_TIMEOUT_S:.0f} s; see {log_path}")
                time.sleep(0.2)
            yield base_url, f"{args.simulate_profile} at --time-scale {args.time_scale}"
        finally:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(UP_STOP_TIMEOUT_S)  # up's own bound on its staged stop
            except subprocess.TimeoutExpired:
                logger.error("splitserve up did not stop within %.0f s of SIGINT; killing it", UP_STOP_TIMEOUT_S)
                up.kill()
                up.wait()
