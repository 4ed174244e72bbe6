"""The command lines of the instances the local actuator starts, one process each: simulated
(``splitserve simulate ROLE --num-instances 1``) or real (``splitserve prefill|decode`` of a
model, the command ``splitserve up`` runs for its own instances). ``splitserve planner`` and
``python -m bench.planner`` both start theirs from here, so the two never drift apart.

Every instance listens on a port of its own choosing and registers in a Redis registry, where
the gateways find it; the planner knows it by its instance id alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.processes import LOCAL_UCX_ENV, splitserve_command
from planner.decision import Role

# The shape the planner prices real instances of the embedded SmolLM2 on a CPU with: how their
# capacity moves with prompt and output lengths. A capacity profile measured on them gives the level.
REAL_SHAPE_PROFILE = "smollm2-135m-cpu"


@dataclass(frozen=True, slots=True)
class Registration:
    """Where an instance registers, how often it says it is alive, and how much it logs."""

    registry_url: str
    heartbeat_seconds: float
    log_level: str = "WARNING"

    def argv(self, instance_id: str) -> list[str]:
        return [
            "--instance-id", instance_id, "--port", "0", "--registry-url", self.registry_url,
            "--heartbeat-seconds", str(self.heartbeat_seconds),
        ]  # fmt: skip


def simulated_instance_command(
    role: Role,
    instance_id: str,
    registration: Registration,
    timing_profile: str,
    time_scale: float,
    model: str | Path | None = None,
) -> list[str]:
    """One simulated instance of ``role``; ``model``: the folder it reads config and tokenizer from."""
    model_flags = ["--model", str(model)] if model is not None else []
    return splitserve_command(
        "--log-level", registration.log_level, "simulate", role, *model_flags, "--profile", timing_profile,
        "--time-scale", str(time_scale), "--num-instances", "1", *registration.argv(instance_id),
    )  # fmt: skip


def real_instance_command(
    role: Role,
    instance_id: str,
    registration: Registration,
    model: str | Path,
    engine_flags: Sequence[str] = (),
    kv_connector: str = "ucx",
    num_blocks: int | None = None,
) -> list[str]:
    """One real instance of ``role`` serving ``model``. ``engine_flags``: the engine's flags as
    ``splitserve up`` passes them on (``engine_args.flags.engine_argv``: dtype, KV cache size,
    parallelism ...); ``num_blocks``: a KV budget in blocks, so that several fit on one host."""
    blocks = ["--num-blocks", str(num_blocks)] if num_blocks is not None else []
    return splitserve_command(
        "--log-level", registration.log_level, role, "--model", str(model), *engine_flags, *blocks,
        "--kv-connector", kv_connector, *registration.argv(instance_id),
    )  # fmt: skip


def real_instance_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Real instances' environment on one host: UCX on loopback and shared memory, as ``splitserve
    up`` sets it; what ``base`` (default: this process's environment) sets wins."""
    return {**LOCAL_UCX_ENV, **(os.environ if base is None else base)}
