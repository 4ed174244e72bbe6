"""The processes one way of ``python -m bench.planner`` runs: a Redis registry and a gateway
(:class:`Stack`), and the instances the planner's actuator starts, one process each, either
simulated (``splitserve simulate ROLE``) or real (``splitserve prefill|decode`` on a model,
the command ``splitserve up`` runs for its instances, with a small KV budget so that the
pools fit beside each other on a small host), both spelt by planner/instance_commands.py,
as ``splitserve planner`` starts them.

Real instances have no timing profile to price them exactly: the planner prices them with a
profile of their shape (the model on this kind of CPU) corrected by a capacity profile measured
on them (planner/capacity_profile.py). :func:`measure_capacity` measures it the way
``splitserve profile --gateway-url`` does, in call order: a stack, one instance of each role
started by the same command as the run's, waited for until the gateway routes to both, the
profiler's sweeps at the run's SLOs and mean mix, everything stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from launcher.processes import free_port, splitserve_command
from planner.actuator import CommandFor, LocalActuator
from planner.capacity import Slo
from planner.capacity_profile import CapacityProfile
from planner.decision import Role
from planner.instance_commands import (
    Registration,
    real_instance_command,
    real_instance_environment,
    simulated_instance_command,
)
from planner.observations import GatewayScraper
from planner.profiler import Profiler, SweepConfig

logger = logging.getLogger(__name__)

Instances = Literal["simulated", "real"]
READY_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 60.0  # a safety net: instances free their blocks within a pull's lease of the last request
DEFAULT_TOKEN_ID_LIMIT = 30_100  # the replay's prompt ids stay below this where the vocabulary is unknown


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What the actuator starts: simulated instances of a timing profile, or real ones of a model."""

    kind: Instances
    timing_profile: str  # simulated: what they run; real: the shape the planner prices them with
    time_scale: float = 1.0  # simulated only
    model: Path | None = None  # real: the checkpoint folder or .gguf file
    served_model_name: str | None = None
    dtype: str = "float32"
    num_kv_blocks: int = 512  # real: each instance's KV budget, so that several fit in memory

    def command_for(self, registry_url: str) -> CommandFor:
        """argv of one instance of a role, registering in ``registry_url``."""
        registration = Registration(registry_url, heartbeat_seconds=0.5)

        def command(role: Role, instance_id: str) -> list[str]:
            if self.kind == "simulated":
                return simulated_instance_command(role, instance_id, registration, self.timing_profile, self.time_scale)
            if self.model is None:
                raise RuntimeError("bug: a real InstanceSpec without a model")
            return real_instance_command(
                role, instance_id, registration, self.model, ["--dtype", self.dtype], num_blocks=self.num_kv_blocks
            )

        return command

    def environment(self, secret: str) -> dict[str, str]:
        """The instances' and the gateway's environment: the cluster's secret, and for real
        instances UCX on loopback as ``splitserve up`` sets it (what the user set wins)."""
        env = {**os.environ, "SPLITSERVE_CLUSTER_SECRET": secret}
        return real_instance_environment(env) if self.kind == "real" else env

    def gateway_flags(self) -> list[str]:
        """Real instances: the gateway tokenizes for their model (simulated ones serve the embedded one's)."""
        if self.kind == "simulated" or self.model is None:
            return []
        name = ["--served-model-name", self.served_model_name] if self.served_model_name else []
        return ["--model", str(self.model), *name]

    def token_id_limit(self) -> int:
        """Prompt token ids stay below this: the size of a checkpoint folder's tokenizer, which
        the gateway checks them against, else the default (a .gguf file's vocabulary, the
        embedded model's included, is larger)."""
        if self.kind == "real" and self.model is not None and self.model.is_dir():
            from transformers import AutoTokenizer  # real runs only: a simulated one never loads it

            return len(AutoTokenizer.from_pretrained(self.model))
        return DEFAULT_TOKEN_ID_LIMIT


class Stack:
    """Redis and one gateway, on loopback, for one way of the run."""

    def __init__(self, out: Path, env: dict[str, str], gateway_flags: list[str]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.log = (out / "stack.log").open("ab")
        redis_port = free_port()
        self.redis = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.registry_url = f"redis://127.0.0.1:{redis_port}"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.gateway = subprocess.Popen(
            splitserve_command(
                "--log-level",
                "WARNING",
                "gateway",
                "--port",
                str(port),
                "--grpc-port",
                "-1",
                "--registry-url",
                self.registry_url,
                "--poll-interval",
                "0.5",
                "--max-pending-requests",
                "8192",
                *gateway_flags,
            ),  # fmt: skip
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def check_running(self) -> None:
        if any(process.poll() is not None for process in (self.gateway, self.redis)):
            raise RuntimeError("the gateway or Redis exited; see stack.log")

    def stop(self) -> None:
        for process in (self.gateway, self.redis):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.log.close()


def wait_ready(actuator: LocalActuator, scraper: GatewayScraper, stack: Stack) -> None:
    """Until the gateway routes to every instance started (their readiness, as the planner counts it)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        stack.check_running()
        try:
            scrape = scraper.scrape()
        except OSError:
            scrape = None
        if scrape is not None:
            for instance in actuator.live():
                view = scrape.instances.get(instance.instance_id)
                if view is not None and view.healthy:
                    actuator.mark_ready(instance)
            if all(i.state == "ready" for i in actuator.live()):
                return
        if actuator.reap_exited():
            raise RuntimeError("an instance exited before it was ready; see its log under instances/")
        if time.monotonic() > deadline:
            raise TimeoutError(f"instances not ready after {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


def blocks_held_when_idle(scraper: GatewayScraper) -> int:
    """KV blocks the instances still hold once none has a request left (0 unless a path leaked
    one), waited for up to :data:`IDLE_TIMEOUT_S` after the replay's last request ended."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        views = list(scraper.scrape().instances.values())
        held = sum(v.total_blocks - v.free_blocks for v in views)
        busy = any(v.num_waiting or v.num_running or v.inflight_calls for v in views)
        if (held == 0 and not busy) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def streams_handed_over(gateway_url: str) -> int:
    """Streams the gateway resumed elsewhere because their draining decode instance handed them
    over (``splitserve_migrations_total{outcome="handed_over"}``)."""
    with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "splitserve_migrations_total" and sample.labels.get("outcome") == "handed_over"
        )
    )


def measure_capacity(
    spec: InstanceSpec, slo: Slo, prompt_tokens: int, output_tokens: int, sweep: dict[str, float], out: Path
) -> CapacityProfile:
    """One prefill and one decode instance of ``spec`` profiled at ``slo`` and the given mix
    (module docstring); ``sweep``: the :class:`SweepConfig` fields that bound its time."""
    folder = out / "capacity-profile"
    env = spec.environment("bench-planner-" + os.urandom(12).hex())
    stack = Stack(folder, env, spec.gateway_flags())
    scraper = GatewayScraper([stack.url])
    actuator = LocalActuator(spec.command_for(stack.registry_url), folder / "instances", env=env)
    try:
        for role in ("prefill", "decode"):
            actuator.start(role)
        wait_ready(actuator, scraper, stack)
        logger.info("profiling one instance of each role at %s, %d:%d tokens", slo, prompt_tokens, output_tokens)
        config = SweepConfig(
            base_url=stack.url,
            slo=slo,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            seconds_per_level=sweep["seconds_per_level"],
            min_requests_per_level=int(sweep["min_requests_per_level"]),
            refine_steps=int(sweep["refine_steps"]),
            max_levels=int(sweep["max_levels"]),
        )
        source = f"bench.planner: real instances of {spec.model}, {spec.dtype}, {spec.num_kv_blocks} KV blocks"
        return asyncio.run(Profiler(config, source).run())
    finally:
        actuator.stop_all()
        scraper.close()
        stack.stop()
