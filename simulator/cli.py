"""``splitserve simulate prefill|decode|colocated``: simulated instances that speak the real
internal API, with a timing model in place of the model.

Each simulated instance is a real instance of its role (the role's gRPC servicer, KV handles
signed by P, leases, load reports, KV events with paging, registry heartbeats, health, the
cluster secret) around a real engine core (scheduler, block pool, prefix cache) whose model
runner waits out a :class:`~simulator.timing_model.TimingProfile`'s step times
(simulator/runner.py) and whose KV connector checks pulls for real and waits out their bytes
(simulator/connector.py). What a gateway, discovery, routing or a planner does is therefore
tested against the same calls, answers and failures as real instances give.

One process serves ``--num-instances`` of a role, each on its own ports, so that dozens start
on a small host: the process pays for its imports once, and an idle simulated instance costs
only its event loop's timers. The role's own flags all apply (``splitserve simulate decode
--help``); ``--port`` and ``--kv-port``, when not 0, are the first of consecutive ports, and
``--instance-id`` gets ``-0``, ``-1``, ... appended when there are several.

In call order: parse; build each instance (its engine core loads the model folder's
``config.json`` and tokenizer, no weights); serve them all on one event loop until SIGTERM or
SIGINT, then each drains as a real instance does. SIGUSR1: every instance turns NOT_SERVING
(health and registry) and keeps serving what it holds, for a planner to stop it once idle;
SIGUSR2: the same, and a decode instance hands its streams back to their gateways to resume
elsewhere (serving/instance.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
from types import ModuleType

from cluster.internal_grpc import InternalPlane
from colocated_svc import server as colocated_server
from decode_svc import server as decode_server
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, EngineRole
from prefill_svc import server as prefill_server
from serving.instance import Instance, drain_handing_over, engine_config, fingerprint_of
from simulator.connector import SimulatedConnector
from simulator.runner import simulated_runner_factory
from simulator.timing_model import DEFAULT_PROFILE, TimingProfile, load_profile

logger = logging.getLogger(__name__)

ROLE_SERVERS: dict[EngineRole, ModuleType] = {
    "prefill": prefill_server,
    "decode": decode_server,
    "colocated": colocated_server,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, module in ROLE_SERVERS.items():
        sub = roles.add_parser(role, help=f"simulated {role} instances")
        module.add_arguments(sub)
        sub.add_argument(
            "--profile",
            default=DEFAULT_PROFILE,
            help="a built-in timing profile's name or a profile's JSON file (simulator/profiles/, docs/simulator.md)",
        )
        sub.add_argument(
            "--time-scale",
            type=float,
            default=1.0,
            help="multiply every simulated time by this (10: ten times slower than the profile's hardware)",
        )
        sub.add_argument("--num-instances", type=int, default=1, help="instances of this role in this process")


def engine_config_for(args: argparse.Namespace, profile: TimingProfile) -> EngineConfig:
    """The role's own engine settings, as its real command builds them, with the batch limits
    of the profile's hardware (its step times were measured or published at those)."""
    config = decode_server.decode_engine_config(args) if args.role == "decode" else engine_config(args, args.role)
    return dataclasses.replace(
        config, max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens
    )


def simulated_instance(args: argparse.Namespace, profile: TimingProfile) -> Instance:
    """One simulated instance of ``args.role`` (blocking: its engine core loads the folder's
    config and tokenizer). Raises ValueError for flags a simulation cannot honour."""
    role: EngineRole = args.role
    plane = InternalPlane.from_args(args, args.host)
    engine = AsyncEngine(engine_config_for(args, profile), simulated_runner_factory(profile, args.time_scale))
    # The simulated hardware is part of the model's identity: instances simulating different
    # profiles must never pair, as real ones of different models never do.
    fingerprint = fingerprint_of(engine.core)
    fingerprint = dataclasses.replace(fingerprint, model=f"{fingerprint.model}@simulated:{profile.name}")
    connector = (
        None
        if role == "colocated"
        else SimulatedConnector(engine.core.runner.kv_cache, fingerprint, profile, args.time_scale)
    )
    return Instance.assemble(args, role, engine, connector, fingerprint, plane)


def instance_args(args: argparse.Namespace, index: int) -> argparse.Namespace:
    """The flags of the ``index``-th instance of this process: its own ports and id."""
    if args.num_instances == 1:
        return args

    def nth(port: int | None) -> int | None:
        return port + index if port else port

    return argparse.Namespace(
        **{
            **vars(args),
            "port": nth(args.port),
            "kv_port": nth(args.kv_port),
            "metrics_port": nth(args.metrics_port),
            "instance_id": f"{args.instance_id or args.role}-{index}",
        }
    )


def run(args: argparse.Namespace) -> int:
    if args.num_instances < 1:
        raise ValueError(f"--num-instances must be at least 1, got {args.num_instances}")
    profile = load_profile(args.profile)
    each_args = [instance_args(args, index) for index in range(args.num_instances)]
    instances = [simulated_instance(one, profile) for one in each_args]
    asyncio.run(_serve_all(instances, each_args))
    return 0


async def _serve_all(instances: list[Instance], each_args: list[argparse.Namespace]) -> None:
    stop, drain, hand_over = asyncio.Event(), asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, drain.set)  # every instance of the process stops serving new requests
    loop.add_signal_handler(signal.SIGUSR2, drain_handing_over, drain, hand_over)  # and hands its streams over
    serve_instance = ROLE_SERVERS[instances[0].role].serve_instance
    await asyncio.gather(
        *(
            serve_instance(instance, args, stop=stop, freeze_heap=False, drain=drain, hand_over=hand_over)
            for instance, args in zip(instances, each_args)
        )
    )
