"""``python -m bench.planner``: a day of traffic replayed against simulated instances three
ways, pools sized statically for the peak, statically for the mean, and by the planner, with
the SLO attainment, the instance-seconds and the requests failed or cut of each.

The day (bench/day_trace.py): the rate rising tenfold from the night's trough to noon and back,
the mix moving from chatty to long prompts and back, compressed into ``--duration-s``. The
instances simulate ``--profile`` (a GPU profile by default) at ``--time-scale``: everything
they do is that many times slower, so the same pools carry ``1 / time-scale`` of the profile's
rates with the same streams per instance, and a two-core host keeps up. ``--peak-rate`` and the
SLOs are in the profile's time, as on the real hardware; the run scales them.

``--instances real``: the instances are real prefill and decode processes of ``--model`` at
time scale 1 (bench/planner_cluster.py), on a day sized for a CPU host (bench/planner_args.py),
priced by ``--profile``'s shape corrected by a capacity profile (``--capacity-profile``, or one
the run measures first on its own instances: :func:`measured_capacity`).

Each way, in order: a Redis registry and a gateway; the pools' first instances, one process
each (planner/actuator.py), waited for until every gateway routes to them; then the planner's
loop on its thread (for the static ways, with ``--min`` = ``--max`` so it holds the sizes) and
the trace replayed open-loop, each request a stream of token ids at its arrival time; then
everything stopped. The static sizes are what the planner's capacity model says the peak
window, or the day's mean, needs (planner/capacity.py), within ``--max-per-role``: the same
model the planner uses, corrected by the same measured profile.

Reported per way: the share of windows (``--window-s``, the compressed day's "minutes") whose
requests met both SLOs at p90 (TTFT from the client's send to its first token; ITL from the
gateway's own chunk write times, so a client short of CPU does not count), each SLO alone,
the instance-seconds from the trace's start to its last request's end (start-up and drain
included), the requests that failed (no token) or were cut (a stream that ended short), the
streams handed over by a draining decode instance (resumed on another: not cut), the
KV blocks still held once every instance was idle after the replay (a leak), and each
instance's command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
import numpy as np

from bench.day_trace import Arrival, RequestKind, day_trace, windows_of
from bench.planner_args import parse
from bench.planner_cluster import (
    InstanceSpec,
    Stack,
    blocks_held_when_idle,
    measure_capacity,
    streams_handed_over,
    wait_ready,
)
from bench.token_gaps import CHUNK_TIMES_HEADER, parse_chunk_times
from launcher.processes import embedded_model
from planner.actuator import LocalActuator
from planner.capacity import Slo, Workload, scaled_profile
from planner.capacity_profile import CapacityProfile, calibrated_capacity, check_slo, load_capacity_profile
from planner.decision import ROLES, PlannerBounds, Role, RoleBounds, instances_needed
from planner.loop import Planner, PlannerConfig
from planner.metrics import PlannerMetrics
from planner.observations import GatewayScraper
from planner.predictor_eval import rank_predictors
from planner.predictors import PREDICTORS
from simulator.timing_model import TimingProfile, load_profile

logger = logging.getLogger(__name__)

Mode = Literal["static-peak", "static-mean", "planner"]
MODES: tuple[Mode, ...] = ("static-peak", "static-mean", "planner")  # as bench/planner_args.py spells them
ATTAINMENT_TARGET = 0.95  # the targets: SLOs met in 95% of windows
INSTANCE_SECONDS_TARGET = 0.6  # with at most 60% of the peak-sized pools' instance-seconds


@dataclass(slots=True)
class RequestResult:
    offset_s: float
    long_prompt: bool
    max_tokens: int
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # the gateway's, between content chunks
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.ttft_s is None

    @property
    def cut(self) -> bool:
        """Started streaming, then ended short of its tokens."""
        return self.ttft_s is not None and (self.finish_reason != "length" or self.num_tokens < self.max_tokens)


@dataclass(slots=True)
class WindowResult:
    start_s: float
    num_requests: int
    ttft_p90_s: float | None
    itl_p90_s: float | None
    ttft_met: bool
    itl_met: bool
    ready: dict[Role, float]  # mean ready instances per role over the window's planner ticks


@dataclass(slots=True)
class ModeResult:
    mode: Mode
    sizes: dict[Role, int]  # the pools it started with
    windows: list[WindowResult]
    instance_seconds: float
    seconds: float
    num_requests: int
    num_failed: int
    num_cut: int
    num_blocks_held: int  # KV blocks still held once every instance was idle after the replay: leaked
    num_handed_over: int  # streams a draining decode instance handed over, resumed on another (none cut)
    instance_commands: dict[str, list[str]]  # each instance's command line, by instance id

    @property
    def attainment(self) -> float:
        return sum(w.ttft_met and w.itl_met for w in self.windows) / len(self.windows)


# ------------------------------------------------------------------------- sizing


def window_needs(
    windows: list[list[Arrival]],
    window_s: float,
    profile: TimingProfile,
    slo: Slo,
    measured: CapacityProfile | None = None,
) -> list[dict[Role, int]]:
    """Instances of each role each window's traffic needs, by the planner's capacity model
    (corrected by ``measured``, as the planner corrects it)."""
    return [needs_for(window, window_s, profile, slo, measured) for window in windows]


def needs_for(
    arrivals: list[Arrival], seconds: float, profile: TimingProfile, slo: Slo, measured: CapacityProfile | None = None
) -> dict[Role, int]:
    if not arrivals:
        return {"prefill": 1, "decode": 1}
    workload = Workload(
        len(arrivals) / seconds,
        sum(a.prompt_tokens for a in arrivals) / len(arrivals),
        sum(a.output_tokens for a in arrivals) / len(arrivals),
    )
    capacity = calibrated_capacity(profile, workload, slo, measured)
    return {
        "prefill": instances_needed(workload.request_rate, capacity.prefill_rate),
        "decode": instances_needed(workload.request_rate, capacity.decode_rate),
    }


# ------------------------------------------------------------------------- replay


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    index: int,
    arrival: Arrival,
    result: RequestResult,
    token_id_limit: int,
) -> None:
    # Token ids of the request's own (no prefix shared), past the special tokens a vocabulary
    # starts with and below its size: the gateway's tokenizer is no part of this.
    first_id = min(100, token_id_limit // 8)
    span = min(30_000, token_id_limit - first_id)
    prompt = [first_id + (index * 7919 + i * 31) % span for i in range(arrival.prompt_tokens)]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": arrival.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers={CHUNK_TIMES_HEADER: "1"}) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            num_events, content_events = 0, []
            async for raw in response.content:
                line = raw.rstrip(b"\r\n")
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        result.num_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or ():
                        if result.ttft_s is None:
                            result.ttft_s = time.monotonic() - sent
                        content_events.append(num_events)
                        result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    num_events += 1
                elif line.startswith(b":"):
                    offsets = parse_chunk_times(line[1:].decode())
                    if offsets is not None:
                        times = [offsets[i] / 1000.0 for i in content_events if i < len(offsets)]
                        result.gaps_s = [b - a for a, b in zip(times, times[1:])]
    except (aiohttp.ClientError, TimeoutError) as error:
        result.error = repr(error)


async def replay(
    url: str, model: str, trace: list[Arrival], started: float, token_id_limit: int
) -> list[RequestResult]:
    results = [RequestResult(a.offset_s, a.long_prompt, a.output_tokens) for a in trace]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def at_its_time(index: int) -> None:
            await asyncio.sleep(max(0.0, started + trace[index].offset_s - time.monotonic()))
            await one_request(session, url, model, index, trace[index], results[index], token_id_limit)

        await asyncio.gather(*(at_its_time(i) for i in range(len(trace))))
    return results


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return str(json.loads(response.read())["data"][0]["id"])


# ---------------------------------------------------------------------- one way


def run_mode(
    mode: Mode,
    args: argparse.Namespace,
    trace: list[Arrival],
    sizes: dict[Role, int],
    spec: InstanceSpec,
    measured: CapacityProfile | None,
    out: Path,
) -> ModeResult:
    folder = out / mode
    env = spec.environment("bench-planner-" + os.urandom(12).hex())
    profile = scaled_profile(load_profile(args.profile), args.time_scale)
    slo = Slo(args.ttft_slo * args.time_scale, args.itl_slo * args.time_scale)
    if mode == "planner":
        bounds = PlannerBounds(
            RoleBounds(1, args.max_per_role),
            RoleBounds(1, args.max_per_role),
            args.max_instances,
            up_cooldown_s=args.up_cooldown,
            down_cooldown_s=args.down_cooldown,
            down_margin=args.down_margin,
        )
    else:  # the planner's loop holding fixed sizes: the same processes, the same accounting
        bounds = PlannerBounds(
            RoleBounds(sizes["prefill"], sizes["prefill"]), RoleBounds(sizes["decode"], sizes["decode"]), 10**6
        )
    stack = Stack(folder, env, spec.gateway_flags())
    scraper = GatewayScraper([stack.url])
    actuator = LocalActuator(spec.command_for(stack.registry_url), folder / "instances", env=env)
    planner = Planner(
        PlannerConfig(
            profile,
            slo,
            bounds,
            args.plan_interval,
            args.predictor,
            dict(sizes),
            measured=measured,
            decode_drain=args.decode_drain,
        ),
        scraper,
        actuator,
        PlannerMetrics(),
    )
    stop = threading.Event()
    thread = threading.Thread(target=planner.run, args=(stop,), name=f"planner-{mode}")
    try:
        planner.start_initial()
        wait_ready(actuator, scraper, stack)
        model = served_model(stack.url)
        logger.info("%s: %s ready; replaying %d requests", mode, sizes, len(trace))
        started = time.monotonic()
        thread.start()
        results = asyncio.run(replay(stack.url, model, trace, started, spec.token_id_limit()))
        ended = time.monotonic()
        for failed in [r for r in results if r.error is not None][:3]:
            logger.warning("%s: a request at %.1f s failed: %s", mode, failed.offset_s, failed.error)
        instance_seconds = sum(
            max(0.0, min(i.stopped_at or ended, ended) - max(i.started_at, started)) for i in actuator.instances
        )
        blocks_held = blocks_held_when_idle(scraper)
        handed_over = streams_handed_over(stack.url)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        else:
            actuator.stop_all()
        scraper.close()
        stack.stop()
    windows = summarize_windows(results, planner, started, args.duration_s, args.window_s, slo)
    return ModeResult(
        mode,
        dict(sizes),
        windows,
        instance_seconds,
        ended - started,
        len(results),
        sum(r.failed for r in results),
        sum(r.cut for r in results),
        blocks_held,
        handed_over,
        {i.instance_id: [str(arg) for arg in i.process.args] for i in actuator.instances},
    )


def p90(values: list[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None


def summarize_windows(
    results: list[RequestResult], planner: Planner, started: float, duration_s: float, window_s: float, slo: Slo
) -> list[WindowResult]:
    num_windows = max(1, math.ceil(duration_s / window_s))
    windows = []
    for index in range(num_windows):
        low, high = index * window_s, (index + 1) * window_s
        inside = [r for r in results if low <= r.offset_s < high]
        ttft = p90([r.ttft_s for r in inside if r.ttft_s is not None])
        itl = p90([gap for r in inside for gap in r.gaps_s])
        ticks = [t for t in planner.history if low <= t.at - started < high]
        ready = {role: (sum(t.ready[role] for t in ticks) / len(ticks) if ticks else math.nan) for role in ROLES}
        failed = any(r.failed or r.cut for r in inside)
        windows.append(
            WindowResult(
                low,
                len(inside),
                ttft,
                itl,
                not failed and (ttft is None or ttft <= slo.ttft_s),
                not failed and (itl is None or itl <= slo.itl_s),
                ready,
            )
        )
    return windows


# ------------------------------------------------------------------------ report


def report(results: list[ModeResult], args: argparse.Namespace, measured: CapacityProfile | None) -> str:
    peak = next((r for r in results if r.mode == "static-peak"), None)
    if measured is None:
        what = f"{args.profile} at time scale {args.time_scale:g}"
    else:
        c = measured.capacity
        what = (
            f"real instances of {args.model or 'the embedded model'}, priced by {args.profile} corrected by the "
            f"profile measured at {measured.prompt_tokens}:{measured.output_tokens} tokens (prefill "
            f"{c.prefill_rate:.3f} req/s, decode {c.decode_rate:.3f} req/s in {c.decode_streams} streams)"
        )
    lines = [
        f"{what}; SLOs TTFT p90 {args.ttft_slo:g} s, ITL p90 {args.itl_slo:g} s (profile time); "
        f"{len(results[0].windows)} windows of {args.window_s:g} s",
        f"{'way':<12} {'sizes P+D':>10} {'both SLOs':>10} {'TTFT':>6} {'ITL':>6} {'inst-s':>9} {'vs peak':>8} "
        f"{'requests':>9} {'failed':>7} {'cut':>5} {'leaked':>7} {'handed over':>12}",
    ]
    for r in results:
        share = (
            f"{r.instance_seconds / peak.instance_seconds:.0%}" if peak is not None and peak.instance_seconds else "-"
        )
        lines.append(
            f"{r.mode:<12} {r.sizes['prefill']:>4}+{r.sizes['decode']:<5} {r.attainment:>10.0%} "
            f"{sum(w.ttft_met for w in r.windows) / len(r.windows):>6.0%} "
            f"{sum(w.itl_met for w in r.windows) / len(r.windows):>6.0%} {r.instance_seconds:>9.0f} {share:>8} "
            f"{r.num_requests:>9} {r.num_failed:>7} {r.num_cut:>5} {r.num_blocks_held:>7} {r.num_handed_over:>12}"
        )
    return "\n".join(lines)


def instance_spec(args: argparse.Namespace) -> InstanceSpec:
    if args.instances == "simulated":
        return InstanceSpec("simulated", args.profile, args.time_scale)
    model, name = (args.model, None) if args.model is not None else embedded_model("gguf", args.dtype)
    return InstanceSpec("real", args.profile, 1.0, model, name, args.dtype, args.kv_blocks)


def measured_capacity(
    args: argparse.Namespace, spec: InstanceSpec, trace: list[Arrival], slo: Slo, out: Path
) -> CapacityProfile | None:
    """Real instances: the capacity profile given, or one measured now at the day's mean mix."""
    if spec.kind == "simulated":
        return None  # the timing profile is what the instances run: the model prices them exactly
    if args.capacity_profile is not None:
        measured = load_capacity_profile(args.capacity_profile)
        check_slo(measured, slo)
        return measured
    sweep = {
        "seconds_per_level": args.profile_seconds_per_level,
        "min_requests_per_level": args.profile_min_requests,
        "refine_steps": args.profile_refine_steps,
        "max_levels": args.profile_max_levels,
    }
    prompt_tokens = round(sum(a.prompt_tokens for a in trace) / len(trace))
    output_tokens = round(sum(a.output_tokens for a in trace) / len(trace))
    measured = measure_capacity(spec, slo, prompt_tokens, output_tokens, sweep, out)
    measured.save(out / "capacity-profile.json")
    if measured.capacity.prefill_rate <= 0 or measured.capacity.decode_rate <= 0:
        # The correction then prices that role at nothing: every way runs its largest pool of it.
        logger.warning(
            "the profile found a role that meets the SLOs at no load (%s): a busy host, or SLOs tighter than "
            "one request alone; the ways below run that role at --max-per-role",
            measured.capacity,
        )
    return measured


def main(argv: list[str] | None = None) -> int:
    args = parse(argv, __doc__.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    modes: list[Mode] = [m for m in MODES if m in args.modes.split(",")]
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)

    def kind(spec: str) -> RequestKind:
        prompt, output = (int(x) for x in spec.split(":"))
        return RequestKind(prompt, output)

    trace = day_trace(
        args.duration_s,
        args.peak_rate / args.time_scale,
        args.trough_ratio,
        args.long_share,
        kind(args.chatty),
        kind(args.long),
        args.seed,
    )
    spec = instance_spec(args)
    profile = scaled_profile(load_profile(args.profile), args.time_scale)
    slo = Slo(args.ttft_slo * args.time_scale, args.itl_slo * args.time_scale)
    measured = measured_capacity(args, spec, trace, slo, out)
    windows = windows_of(trace, args.duration_s, args.window_s)
    needs = window_needs(windows, args.window_s, profile, slo, measured)

    def bounded(need: dict[Role, int]) -> dict[Role, int]:
        # No pool larger than the planner may run: the ways compare within the same bounds.
        return {role: min(need[role], args.max_per_role) for role in ROLES}

    peak = bounded({role: max(need[role] for need in needs) for role in ROLES})
    mean = bounded(needs_for(trace, args.duration_s, profile, slo, measured))
    sizes: dict[Mode, dict[Role, int]] = {"static-peak": peak, "static-mean": mean, "planner": bounded(needs[0])}
    logger.info("%d requests; windows need %s; peak %s, mean %s", len(trace), needs, peak, mean)
    # Which predictor forecasts this day's rate best, one planning interval ahead (no cluster needed).
    interval_rates = [len(w) / args.plan_interval for w in windows_of(trace, args.duration_s, args.plan_interval)]
    predictors = rank_predictors(PREDICTORS, {"day": interval_rates}) if len(interval_rates) > 1 else []
    results = [run_mode(mode, args, trace, sizes[mode], spec, measured, out) for mode in modes]
    text = report(results, args, measured)
    if predictors:
        text += "\npredictors, mean absolute error one interval ahead over the mean rate: " + ", ".join(
            f"{name} {score:.3f}" for name, score in predictors
        )
    print(text, flush=True)
    (out / "planner.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "capacity_profile": None if measured is None else asdict(measured),
                "window_needs": needs,
                "predictor_errors": dict(predictors),
                "results": [asdict(r) | {"attainment": r.attainment} for r in results],
                "report": text,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
