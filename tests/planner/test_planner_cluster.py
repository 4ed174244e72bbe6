"""The planner against a real simulated cluster: a real gateway finding instances in a real
Redis, instances that the planner starts as processes of their own. Under a step of load it
grows the decode pool, counting the new instance from the moment every gateway routes to it;
when the load ends it drains decode instances that still hold streams, which hand them over
to the gateway to resume on the instances that stay (``--decode-drain hand-over``, the
default), and stops each once it holds nothing; every stream runs to its end (none cut) and
afterwards no KV block is left in use. (The other drain, waiting for the streams to end on
the drained instance: tests/planner/test_real_drain.py.)

The planner runs in this process, its ticks called by the test one interval apart as its loop
calls them, so that it acts on the traffic the test has set up (streams on every decode
instance before it may shrink the pool)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from launcher.processes import splitserve_command
from planner.actuator import LocalActuator, ManagedInstance
from planner.capacity import Slo, scaled_profile
from planner.decision import PlannerBounds, Role, RoleBounds
from planner.loop import Planner, PlannerConfig
from planner.metrics import PlannerMetrics
from planner.observations import GatewayScraper
from simulator.timing_model import load_profile
from tests.gateway.processes import HTTPProcess, gateway_migrations
from tests.services.processes import SERVICE_ENV
from tests.simulator.cluster import (
    SECRET,
    instance_metrics,
    prompt,
    registry_gateway,
    stream_completion,
    wait_for,
    write_profile,
)
from tests.stores import start_redis, stop

TIME_SCALE = 4.0  # steps of about 35 ms: streams slow enough for two cores, fast enough for a test
# At this scale a decode step of n rows at the test's context takes about 32 + 0.7 n ms: the ITL
# SLO holds 11 streams an instance, 3.2 requests a second of 64 tokens (planner/capacity.py). It
# sits on a bound of the gateway's ITL buckets (0.02, 0.04): the planner reads a p90 within it.
SLO = Slo(ttft_s=1.0, itl_s=0.04)
NUM_LOAD_STREAMS = 10  # closed loop: about 4 requests a second, two decode instances' worth
LOAD_TOKENS = 64
STREAMS_PER_INSTANCE = 2  # while the pool shrinks: steps of 33 ms, within the SLO
LONG_TOKENS = 600  # streams of some 20 s: they outlast the down cooldown and the drain's decision


@dataclass
class PlannedCluster:
    gateway: HTTPProcess
    planner: Planner
    actuator: LocalActuator

    def ready(self, role: Role) -> list[str]:
        return [i.instance_id for i in self.actuator.live(role) if i.state == "ready"]

    def tick_until(self, condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
        """Run the planner's ticks, one an interval as its loop does, until ``condition`` holds:
        the test decides when the planner runs, so that it acts on the traffic the test set up."""
        last_tick = [0.0]

        def tick_then_check() -> bool:
            if time.monotonic() - last_tick[0] >= self.planner.config.interval_s:
                last_tick[0] = time.monotonic()
                tick = self.planner.tick()
                if tick is not None:
                    self.planner.history.append(tick)
            return condition()

        wait_for(tick_then_check, what, timeout_s)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlannedCluster]:
    folder = tmp_path_factory.mktemp("planner")
    profile_path = write_profile(folder)
    redis_process, registry_url = start_redis()
    gateway: HTTPProcess | None = None
    actuator: LocalActuator | None = None
    try:
        gateway = registry_gateway("gateway-planner", registry_url)

        def command(role: Role, instance_id: str) -> list[str]:
            return splitserve_command(
                "simulate",
                role,
                "--profile",
                str(profile_path),
                "--time-scale",
                str(TIME_SCALE),
                "--num-instances",
                "1",
                "--instance-id",
                instance_id,
                "--port",
                "0",
                "--registry-url",
                registry_url,
                "--heartbeat-seconds",
                "0.5",
            )

        actuator = LocalActuator(
            command, folder / "logs", env={**os.environ, **SERVICE_ENV, "SPLITSERVE_CLUSTER_SECRET": SECRET}
        )
        config = PlannerConfig(
            profile=scaled_profile(load_profile(profile_path), TIME_SCALE),
            slo=SLO,
            bounds=PlannerBounds(
                RoleBounds(1, 1), RoleBounds(1, 3), max_total=4, up_cooldown_s=0.0, down_cooldown_s=3.0
            ),
            interval_s=1.0,
            predictor="moving-average",
            prompt_tokens=200,
            output_tokens=LOAD_TOKENS,
        )
        planner = Planner(config, GatewayScraper([gateway.url]), actuator, PlannerMetrics())
        planner.start_initial()
        yield PlannedCluster(gateway, planner, actuator)
    finally:
        if actuator is not None:
            actuator.stop_all()
        if gateway is not None:
            gateway.stop()
        stop(redis_process)


class LoadLoop:
    """``num_streams`` clients each streaming one completion after another until stopped."""

    def __init__(self, url: str, num_streams: int) -> None:
        self.url = url
        self.num_streams = num_streams
        self.results: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), name="load")
        self._thread.start()

    async def _run(self) -> None:
        async with AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:

            async def client_loop(index: int) -> None:
                turn = 0
                while not self._stop.is_set():
                    try:
                        result = await stream_completion(client, prompt(index * 1000 + turn, 50), LOAD_TOKENS)
                    except openai.APIError as error:  # counted, and the load goes on
                        result = (0, f"error: {error}")
                    self.results.append(result)
                    turn += 1

            await asyncio.gather(*(client_loop(i) for i in range(self.num_streams)))

    def stop(self) -> list[tuple[int, str | None]]:
        self._stop.set()
        self._thread.join(timeout=120)
        return self.results


def failed_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("splitserve_requests_total{") and ('status="error' in line or 'status="abort' in line)
    )


def test_the_planner_scales_decode_up_from_readiness_and_down_without_cutting_a_stream(
    cluster: PlannedCluster,
) -> None:
    cluster.tick_until(
        lambda: len(cluster.ready("prefill")) == 1 and len(cluster.ready("decode")) == 1, "one of each ready"
    )
    history = cluster.planner.history

    # A step of load: the planner wants more decode instances, and counts one only once ready.
    load = LoadLoop(cluster.gateway.url, NUM_LOAD_STREAMS)
    try:
        cluster.tick_until(lambda: any(t.decision.decode.desired >= 2 for t in history), "the planner to grow decode")
        first_up = next(t for t in history if t.decision.decode.desired >= 2)
        assert first_up.ready["decode"] == 1
        assert first_up.decision.decode.reason in ("load_up", "slo_miss", "max"), first_up.decision
        # Every decode instance it started ready while the load runs (it may have started a third on
        # an SLO miss): one still starting when the load ends would come up idle, and be the one
        # the planner drains first, before any holding streams.
        cluster.tick_until(
            lambda: (
                len(cluster.ready("decode")) >= 2
                and not any(i.state == "starting" for i in cluster.actuator.live("decode"))
            ),
            "every decode instance started ready, at least two",
        )
    finally:
        results = load.stop()
    assert results and all(result == (LOAD_TOKENS, "length") for result in results), results
    new = [i for i in cluster.actuator.instances if i.role == "decode" and i.ready_at is not None][1]
    assert new.ready_at is not None and new.ready_at > new.started_at
    # While it started, the ticks saw it starting and did not count it ready.
    starting_ticks = [t for t in history if first_up.at <= t.at < new.ready_at]
    assert starting_ticks and all(t.ready["decode"] == 1 for t in starting_ticks)
    assert instance_metrics(cluster.gateway.url, "healthy")[new.instance_id] == 1.0

    # Streams on every decode instance, then no new traffic: the pool shrinks while they run.
    decode_ids = cluster.ready("decode")
    # This phase is about shrinking, so the pool may not grow past what is ready now: on a busy
    # host an ITL miss (steps of 33 ms against the SLO's 40) would start an idle instance, which
    # the planner then rightly drains first, before any holding streams.
    config = cluster.planner.config
    decode_bounds = replace(config.bounds.decode, max_instances=len(decode_ids))
    cluster.planner.config = replace(config, bounds=replace(config.bounds, decode=decode_bounds))

    async def long_streams() -> list[tuple[int, str | None]]:
        async with AsyncOpenAI(
            base_url=f"{cluster.gateway.url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(
                *(
                    stream_completion(client, prompt(90_000 + i, 50), LONG_TOKENS)
                    for i in range(STREAMS_PER_INSTANCE * len(decode_ids))
                )
            )

    finished: list[list[tuple[int, str | None]]] = []
    streams = threading.Thread(target=lambda: finished.append(asyncio.run(long_streams())))
    ticks_before = len(history)
    streams.start()
    try:
        # The planner ticks again only once every decode instance holds streams.
        wait_for(
            lambda: all(instance_metrics(cluster.gateway.url, "num_running").get(i, 0) >= 1 for i in decode_ids),
            "streams running on every decode instance",
        )
        cluster.tick_until(
            lambda: any(i.state == "draining" for i in cluster.actuator.instances),
            "the planner to drain a decode instance",
            timeout_s=60,
        )
        drained = [i for i in cluster.actuator.instances if i.drain_started_at is not None]
        assert all(i.process.poll() is None for i in drained if i.state == "draining")
    finally:
        streams.join(timeout=120)

    def running_when_drained(instance: ManagedInstance) -> int:
        """Requests the instance held at the tick that drained it (the last one before the drain)."""
        assert instance.drain_started_at is not None
        tick = max((t for t in history[ticks_before:] if t.at <= instance.drain_started_at), key=lambda t: t.at)
        return tick.observation.instances[instance.instance_id].num_running

    # It drained instances holding streams, which were still running when it did.
    assert any(running_when_drained(i) >= 1 for i in drained), [running_when_drained(i) for i in drained]
    assert finished and finished[0] == [(LONG_TOKENS, "length")] * (STREAMS_PER_INSTANCE * len(decode_ids)), finished
    # Each drained instance stops once idle, and exits cleanly.
    cluster.tick_until(
        lambda: all(i.state == "stopped" for i in drained), "the drained instances to stop", timeout_s=60
    )
    assert [i.process.returncode for i in drained] == [0] * len(drained)
    assert failed_requests(cluster.gateway.url) == 0
    # The drained instances handed their streams over; nothing failed over.
    migrations = gateway_migrations(cluster.gateway.url)
    assert migrations.get("handed_over", 0) >= 1 and set(migrations) == {"handed_over"}, migrations
    # No KV block left in use on the instances that remain.
    remaining = {i.instance_id for i in cluster.actuator.live()}

    def all_free() -> bool:
        free = instance_metrics(cluster.gateway.url, "free_kv_blocks")
        total = instance_metrics(cluster.gateway.url, "total_kv_blocks")
        return all(free.get(name) == total.get(name) is not None for name in remaining)

    wait_for(all_free, "every block free on the remaining instances")
    assert len([name for name in remaining if "decode" in name]) >= 1  # the planner keeps its minimum
