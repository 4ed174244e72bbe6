"""The local actuator: one instance, one process. It starts ``splitserve simulate ROLE
--num-instances 1`` (or a real role's command) per instance, and stops one without cutting a
stream, in two steps:

1. :meth:`LocalActuator.drain`: SIGUSR1. The instance turns NOT_SERVING in its health and its
   registry record (serving/instance.py, the state a dead engine puts it in, which gateways
   already skip), and keeps serving what it holds and what a gateway sent before it learnt.
   A decode instance drained with ``hand_over`` gets SIGUSR2 instead: the same, and then it
   hands each stream it may back to its gateway, which resumes it on another decode instance
   after the tokens already sent (gateway/failover.py), so it is idle within a step or two
   instead of after its longest stream.
2. :meth:`LocalActuator.stop`, called by the planner once every gateway shows the instance
   idle (``InstanceView.idle``: routed to by none, no call outstanding, no request, no pinned
   block): SIGTERM, which deregisters it and stops its server with nothing left in flight.

One process per instance, not ``--num-instances N`` in one: stopping an instance is then
stopping its process, its exit is the proof that it stopped, and its lifetime is the
instance-seconds it cost. A simulated process imports torch once for one instance (a few
seconds and a few hundred MB on a CPU host), which is the price of that.

The planner's loop thread alone calls this class (one writer); readers take
:meth:`instance_seconds` after the loop stopped, or accept a figure one tick old.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from planner.decision import Role

logger = logging.getLogger(__name__)

State = Literal["starting", "ready", "draining", "stopped"]
DecodeDrain = Literal["hand-over", "wait"]  # how a decode instance drains (--decode-drain)
DECODE_DRAINS: tuple[DecodeDrain, ...] = ("hand-over", "wait")
STOP_TIMEOUT_S = 40.0  # an instance's own drain on SIGTERM is 30 s at most (serving/instance.py)
CommandFor = Callable[[Role, str], list[str]]  # (role, instance id) -> argv


@dataclass(slots=True, eq=False)
class ManagedInstance:
    instance_id: str
    role: Role
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    started_at: float  # monotonic
    state: State = "starting"
    ready_at: float | None = None
    drain_started_at: float | None = None
    stopped_at: float | None = None

    @property
    def exited(self) -> bool:
        return self.process.poll() is not None

    def seconds(self, now: float) -> float:
        """Seconds this instance's process has cost so far: start to exit, start-up and drain included."""
        return (self.stopped_at if self.stopped_at is not None else now) - self.started_at


@dataclass(slots=True)
class LocalActuator:
    command_for: CommandFor
    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    instances: list[ManagedInstance] = field(default_factory=list)  # every one ever started
    _next_index: dict[Role, int] = field(default_factory=dict)

    def live(self, role: Role | None = None) -> list[ManagedInstance]:
        return [i for i in self.instances if i.state != "stopped" and (role is None or i.role == role)]

    def start(self, role: Role) -> ManagedInstance:
        index = self._next_index.get(role, 0)
        self._next_index[role] = index + 1
        instance_id = f"planned-{role}-{index}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{instance_id}.log", "wb")  # noqa: SIM115 - closed when the instance stops
        process = subprocess.Popen(
            self.command_for(role, instance_id), stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        instance = ManagedInstance(instance_id, role, process, log, time.monotonic())
        self.instances.append(instance)
        logger.info("started %s instance %s (pid %d)", role, instance_id, process.pid)
        return instance

    def mark_ready(self, instance: ManagedInstance) -> None:
        if instance.state == "starting":
            instance.state, instance.ready_at = "ready", time.monotonic()
            logger.info(
                "%s instance %s is ready after %.1f s",
                instance.role,
                instance.instance_id,
                instance.ready_at - instance.started_at,
            )

    def drain(self, instance: ManagedInstance, hand_over: bool = False) -> None:
        """Stop new work going to a ready instance; it keeps serving what it holds, or, with
        ``hand_over``, hands its streams back to their gateways to resume elsewhere."""
        if instance.state != "ready":
            raise RuntimeError(f"bug: draining {instance.instance_id} in state {instance.state}; only ready ones drain")
        instance.process.send_signal(signal.SIGUSR2 if hand_over else signal.SIGUSR1)
        instance.state, instance.drain_started_at = "draining", time.monotonic()
        logger.info(
            "draining %s instance %s%s",
            instance.role,
            instance.instance_id,
            " (handing its streams over)" if hand_over else "",
        )

    def stop(self, instance: ManagedInstance) -> int | None:
        """SIGTERM and wait for the exit (the instance drains what little is left, as on any
        SIGTERM); the exit status, None if it had to be killed."""
        returncode: int | None
        if instance.process.poll() is None:
            instance.process.send_signal(signal.SIGTERM)
        try:
            returncode = instance.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.error("%s did not stop within %.0f s; killing it", instance.instance_id, STOP_TIMEOUT_S)
            instance.process.kill()
            instance.process.wait()
            returncode = None
        instance.state, instance.stopped_at = "stopped", time.monotonic()
        instance.log.close()
        logger.info("stopped %s instance %s (exit %s)", instance.role, instance.instance_id, returncode)
        return returncode

    def reap_exited(self) -> list[ManagedInstance]:
        """Instances whose process exited without being stopped (a crash): marked stopped."""
        exited = [i for i in self.live() if i.exited]
        for instance in exited:
            logger.error(
                "%s instance %s exited by itself with %s; see %s",
                instance.role,
                instance.instance_id,
                instance.process.returncode,
                instance.log.name,
            )
            instance.state, instance.stopped_at = "stopped", time.monotonic()
            instance.log.close()
        return exited

    def stop_all(self) -> None:
        """Every live instance, SIGTERM together, then each waited for."""
        live = self.live()
        for instance in live:
            if instance.process.poll() is None:
                instance.process.send_signal(signal.SIGTERM)
        for instance in live:
            self.stop(instance)

    def instance_seconds(self, role: Role | None = None, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return sum(i.seconds(now) for i in self.instances if role is None or i.role == role)
