"""``splitserve planner``: size the prefill and decode pools behind running gateways to the
TTFT and ITL SLOs, starting and stopping instances on this host (one process each,
``planner/actuator.py``; their commands: ``planner/instance_commands.py``), which register in
the gateways' Redis registry: simulated ones with ``--simulate-profile``, else real
``splitserve prefill|decode`` processes of ``--model``, priced by ``--capacity-profile``. Or,
with ``--actuator metrics`` or ``kubernetes``, only publishing or setting the counts it wants.

In call order: parse; start the initial instances; every ``--plan-interval`` run one tick of
``planner/loop.py``; on SIGTERM or SIGINT stop every instance it started (each drains as on any
SIGTERM) and exit. ``--metrics-port`` serves the planner's series (``planner/metrics.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

from prometheus_client import start_http_server

from engine_args.flags import add_engine_arguments, engine_argv, speculative_argv
from kv_connector.registry import add_kv_connector_arguments
from launcher.processes import embedded_model
from launcher.stop_signals import StopSignal
from planner.actuator import CommandFor, LocalActuator
from planner.capacity import scaled_profile
from planner.capacity_profile import check_slo, load_capacity_profile
from planner.flags import add_planner_arguments, bounds_of, slo_of
from planner.instance_commands import (
    REAL_SHAPE_PROFILE,
    Registration,
    real_instance_command,
    real_instance_environment,
    simulated_instance_command,
)
from planner.kubernetes_scaler import KubernetesScaler
from planner.loop import Planner, PlannerConfig
from planner.metrics import PlannerMetrics
from planner.observations import GatewayScraper
from simulator.timing_model import DEFAULT_PROFILE, load_profile

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway-url",
        action="append",
        required=True,
        help="a gateway whose /metrics the planner reads (repeat for several gateways)",
    )
    parser.add_argument(
        "--gateway-every-address",
        action="store_true",
        help="each --gateway-url's host resolves to every gateway (a headless Service): read each address, "
        "resolved again every interval",
    )
    parser.add_argument(
        "--actuator",
        choices=["local", "metrics", "kubernetes"],
        default="local",
        help="local: start and stop instances here, one process each (simulated with --simulate-profile, else "
        "real ones of --model); metrics: only publish the desired "
        "counts (splitserve_planner_desired_instances) for KEDA or an HPA to scale Deployments by "
        "(deploy/kubernetes-autoscaling/), with --metrics-port; kubernetes: set the Deployments' replicas through "
        "the API's scale subresource (docs/planner.md)",
    )
    parser.add_argument("--kubernetes-api-url", help="--actuator kubernetes: the API server (default: in-cluster)")
    parser.add_argument(
        "--kubernetes-namespace", help="--actuator kubernetes: the Deployments' namespace (default: the pod's)"
    )
    parser.add_argument(
        "--kubernetes-token-file", help="--actuator kubernetes: a bearer token's file (default: the pod's)"
    )
    parser.add_argument("--prefill-deployment", default="prefill", help="--actuator kubernetes: P's Deployment")
    parser.add_argument("--decode-deployment", default="decode", help="--actuator kubernetes: D's Deployment")
    parser.add_argument("--registry-url", help="--actuator local: redis://HOST:PORT the instances register in")
    parser.add_argument(
        "--simulate-profile",
        default=None,
        metavar="NAME|FILE",
        help="simulated instances of this timing profile, which also prices their capacity (docs/simulator.md); "
        "without it the local actuator starts real prefill and decode instances of --model",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulated instances' --time-scale")
    parser.add_argument(
        "--capacity-profile",
        default=None,
        metavar="FILE",
        help="what `splitserve profile` measured one instance of each role to sustain at these SLOs: it corrects "
        "the timing profile's capacity; real instances need it (docs/planner.md)",
    )
    parser.add_argument(
        "--shape-profile",
        default=None,
        metavar="NAME|FILE",
        help="without --simulate-profile: the timing profile whose shape (capacity against prompt and output "
        f"lengths) prices the instances, its level corrected by --capacity-profile (default: {REAL_SHAPE_PROFILE} "
        f"for real local instances, {DEFAULT_PROFILE} for the metrics and kubernetes actuators)",
    )
    # Real instances: the engine's flags as `splitserve up` takes and passes them on (--model,
    # --dtype, --kv-cache-memory ...), the KV budget in blocks, and the connector.
    add_engine_arguments(parser)
    parser.add_argument("--num-blocks", type=int, default=None, help="real instances: each one's KV blocks")
    add_kv_connector_arguments(parser)
    parser.add_argument("--heartbeat-seconds", type=float, default=1.0, help="the instances' registry heartbeat")
    parser.add_argument("--initial-prefill", type=int, default=1, help="prefill instances to start with")
    parser.add_argument("--initial-decode", type=int, default=1, help="decode instances to start with")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve the planner's metrics on this port")
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--instance-log-dir", default=None, help="where each instance's log goes (default: a temp dir)")
    add_planner_arguments(parser)


def starts_real_instances(args: argparse.Namespace) -> bool:
    return args.actuator == "local" and args.simulate_profile is None


def pricing_profile(args: argparse.Namespace) -> str:
    """The timing profile that prices an instance's capacity (module docstring)."""
    if args.simulate_profile is not None:
        return str(args.simulate_profile)
    if args.shape_profile is not None:
        return str(args.shape_profile)
    return REAL_SHAPE_PROFILE if starts_real_instances(args) else DEFAULT_PROFILE


def instance_command(args: argparse.Namespace) -> CommandFor:
    """The command line of one instance of a role, as the local actuator starts it."""
    registration = Registration(args.registry_url, args.heartbeat_seconds, args.log_level)
    if not starts_real_instances(args):
        return lambda role, instance_id: simulated_instance_command(
            role, instance_id, registration, args.simulate_profile, args.time_scale, args.model
        )
    # The embedded model, as `splitserve up` serves it, converted once here before any instance starts.
    model = args.model or embedded_model(args.load_format, args.dtype)[0]
    engine_flags = [*engine_argv(args), *speculative_argv(args)]
    return lambda role, instance_id: real_instance_command(
        role, instance_id, registration, model, engine_flags, args.kv_connector, args.num_blocks
    )


def instance_environment(args: argparse.Namespace) -> dict[str, str]:
    if not starts_real_instances(args):
        return dict(os.environ)
    env = real_instance_environment()
    if args.lmcache_url:  # in the environment: the URL may hold the store's password
        env["SPLITSERVE_LMCACHE_URL"] = args.lmcache_url
    return env


def check_real_instance_flags(args: argparse.Namespace) -> None:
    """Real instances have no timing model of their own: a measured capacity profile prices them."""
    if args.capacity_profile is None:
        raise ValueError(
            "real instances (no --simulate-profile) are priced by what one instance of each role sustains: measure "
            "it with `splitserve profile --gateway-url URL --output capacity.json` against one prefill and one "
            "decode instance of this model at these SLOs, then pass --capacity-profile capacity.json "
            "(docs/planner.md)"
        )
    if args.time_scale != 1.0:
        raise ValueError("--time-scale slows simulated instances: real ones run at their own speed; drop it")


def run(args: argparse.Namespace) -> int:
    if args.actuator == "local" and not args.registry_url:
        raise ValueError("--actuator local starts instances that register in a registry: pass --registry-url")
    if args.actuator == "metrics" and args.metrics_port is None:
        raise ValueError("--actuator metrics publishes the desired counts on its metrics port: pass --metrics-port")
    if starts_real_instances(args):
        check_real_instance_flags(args)
    measured = None
    if args.capacity_profile is not None:
        measured = load_capacity_profile(args.capacity_profile)
        check_slo(measured, slo_of(args))
    config = PlannerConfig(
        profile=scaled_profile(load_profile(pricing_profile(args)), args.time_scale),
        slo=slo_of(args),
        bounds=bounds_of(args),
        interval_s=args.plan_interval,
        predictor=args.predictor,
        initial_instances={"prefill": args.initial_prefill, "decode": args.initial_decode},
        prompt_tokens=args.plan_prompt_tokens,
        output_tokens=args.plan_output_tokens,
        measured=measured,
        decode_drain=args.decode_drain,
    )
    metrics = PlannerMetrics()
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, args.metrics_host, registry=metrics.registry)
    stop = StopSignal().install()
    scraper = GatewayScraper(args.gateway_url, every_address=args.gateway_every_address)
    actuator = None
    if args.actuator == "local":
        log_dir = Path(args.instance_log_dir or tempfile.mkdtemp(prefix="splitserve-planner-"))
        actuator = LocalActuator(instance_command(args), log_dir, env=instance_environment(args))
        logger.info("planner: instances' logs in %s", log_dir)
    scaler = None
    if args.actuator == "kubernetes":
        scaler = KubernetesScaler.from_environment(
            {"prefill": args.prefill_deployment, "decode": args.decode_deployment},
            args.kubernetes_api_url,
            args.kubernetes_namespace,
            args.kubernetes_token_file,
        )
    planner = Planner(config, scraper, actuator, metrics, scaler)
    try:
        planner.start_initial()
        planner.run(stop)
    finally:
        scraper.close()
    return 0
