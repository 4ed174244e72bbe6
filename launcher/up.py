"""``splitserve up``: start a gateway with its prefill and decode instances (or one
colocated instance) as local processes, wait until ready, stop all on Ctrl-C / SIGTERM.

The internal plane is closed: a cluster secret is made for each run (or taken from
``SPLITSERVE_CLUSTER_SECRET``) and handed to every child through its environment, never
its command line, which other local users can read."""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from cluster.tracing import add_tracing_arguments, tracing_argv
from engine_args.flags import add_engine_arguments, engine_argv, speculative_argv
from gateway.flags import (
    API_KEY_FILE_ENV,
    DEFAULT_GRPC_PORT,
    DEFAULT_PORT,
    add_api_key_argument,
    add_api_server_count_argument,
    add_request_log_argument,
    add_routing_arguments,
    request_log_argv,
    resolve_api_key,
    routing_argv,
)
from kv_connector.registry import add_kv_connector_arguments
from launcher.processes import (
    CHILD_STOP_TIMEOUT_S,
    LOCAL_UCX_ENV,
    Child,
    embedded_model,
    free_port,
    parse_instance_cpu_lists,
    splitserve_command,
)
from launcher.stop_signals import StopSignal
from planner.flags import add_planner_arguments, planner_argv
from simulator.timing_model import DEFAULT_PROFILE

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # the first run converts the embedded model, and loads take a while on 2 cores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The engine's flags, passed on to every instance (speculative ones to decoding instances only).
    add_engine_arguments(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the gateway binds to (instances stay on 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="REST port")
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC Generation port")
    add_api_key_argument(parser)
    add_kv_connector_arguments(parser, lmcache_url_default="a local redis-server started here")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill instances")
    parser.add_argument("--num-decode", type=int, default=1, help="decode instances")
    parser.add_argument(
        "--colocated", action="store_true", help="one instance doing both phases instead of prefill + decode"
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-cpus",
            default=None,
            help=f"CPU list for {role} instances in taskset's syntax ('0-3'), all sharing it, or one list per "
            "instance separated by '|' ('0|1': one core each)",
        )
    parser.add_argument("--colocated-cpus", default=None, help="CPU list for the colocated instance")
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-tensor-parallel-size",
            type=int,
            default=None,
            metavar="N",
            help=f"{role} instances' tensor parallel size (default: --tensor-parallel-size)",
        )
        parser.add_argument(
            f"--{role}-pipeline-parallel-size",
            type=int,
            default=None,
            metavar="N",
            help=f"{role} instances' pipeline parallel size, its layers split as equally as they allow (default: "
            "--pipeline-parallel-size); P and D may differ, each decode rank pulling its layers from the prefill "
            "ranks that hold them",
        )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="simulated instances (splitserve simulate: the real internal API, a timing model for the model), "
        "found by the gateway through a local Redis registry; dozens start on a small host",
    )
    parser.add_argument(
        "--simulate-profile",
        default=None,
        metavar="NAME|FILE",
        help="--simulate: the instances' timing profile (docs/simulator.md; default: splitserve simulate's)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="--simulate: every simulated time multiplied by this"
    )
    parser.add_argument(
        "--planner",
        action="store_true",
        help="a planner sizes the pools to --ttft-slo and --itl-slo, starting and stopping one process per "
        "instance (simulated ones with --simulate, else real ones, priced by --capacity-profile); --num-prefill and "
        "--num-decode are the sizes it starts with (docs/planner.md)",
    )
    parser.add_argument(
        "--capacity-profile",
        default=None,
        metavar="FILE",
        help="--planner: what `splitserve profile` measured one instance of each role to sustain at these SLOs "
        "(needed for real instances; docs/planner.md)",
    )
    add_planner_arguments(parser)  # passed on to the planner
    add_routing_arguments(parser)  # passed on to the gateway
    add_request_log_argument(parser)  # passed on to the gateway
    add_api_server_count_argument(parser)  # passed on to the gateway
    add_tracing_arguments(parser)  # passed on to every process


def run(args: argparse.Namespace) -> int:
    args.api_key = resolve_api_key(args)  # --api-key-file read here, once
    if args.num_prefill < 1 or args.num_decode < 1:
        raise ValueError("--num-prefill and --num-decode must be at least 1")
    if args.planner and not args.simulate and args.capacity_profile is None:
        raise ValueError(
            "--planner on real instances prices them by what one instance of each role sustains: measure it first "
            "with `splitserve profile` (docs/planner.md) and pass --capacity-profile FILE, or add --simulate"
        )
    for role in ("prefill", "decode"):
        size = getattr(args, f"{role}_pipeline_parallel_size")
        if size is not None and size != args.pipeline_parallel_size and args.pipeline_stage_layers:
            raise ValueError(
                f"--pipeline-stage-layers {args.pipeline_stage_layers} names the stages of --pipeline-parallel-size "
                f"{args.pipeline_parallel_size}, not of --{role}-pipeline-parallel-size {size}: drop one of them"
            )
    cpus = instance_cpus(args)
    # The embedded model is converted (once) before anything starts, so instances never race to.
    model, name = (Path(args.model), None) if args.model else embedded_model(args.load_format, args.dtype)
    stop = StopSignal().install()

    cluster_env = _cluster_secret_env()
    children: list[Child] = []
    try:
        routes = _start_instances(args, model, cpus, children, cluster_env)
        # The key travels in the environment, not argv, where any local user could read it.
        children.append(
            Child(
                "gateway",
                splitserve_command("--log-level", args.log_level, "gateway", *gateway_flags(args, model, routes, name)),
                # None unsets: the gateway's own environment gives it this key or none, never an empty one.
                env={"SPLITSERVE_API_KEY": args.api_key, API_KEY_FILE_ENV: None, **cluster_env},
                stop_stage=0,
            )
        )
        url = f"http://{_dial_host(args.host)}:{args.port}"
        if not _wait_ready(url, children, stop):
            return 0 if stop.is_set() else 1  # stopped by the user before it was ready: not a failure
        _print_banner(args, url, name)
        while not stop.wait(0.5):
            dead = [c for c in children if c.exited]
            if dead:
                logger.error("%s exited with %s; stopping everything", dead[0].name, dead[0].process.returncode)
                return 1
        return 0
    finally:
        # The gateway first (no new requests), then the instances drain theirs, then the store they used.
        for stage in sorted({c.stop_stage for c in children}):
            group = [c for c in children if c.stop_stage == stage]
            names, started = ", ".join(c.name for c in group), time.monotonic()
            logger.info("stopping %s", names)
            for child in group:
                child.terminate()
            for child in group:
                child.wait(CHILD_STOP_TIMEOUT_S)
            logger.info("stopped %s in %.1f s", names, time.monotonic() - started)
        logger.info("stopped")


def instance_cpus(args: argparse.Namespace) -> dict[str, list[set[int] | None]]:
    """Each role's instances' CPU lists, instance by instance (None: not pinned)."""
    counts = {"prefill": args.num_prefill, "decode": args.num_decode, "colocated": 1}
    cpus: dict[str, list[set[int] | None]] = {}
    for role, count in counts.items():
        spec = getattr(args, f"{role}_cpus")
        cpus[role] = list(parse_instance_cpu_lists(spec, count)) if spec else [None] * count
    return cpus


def gateway_flags(
    args: argparse.Namespace, model: Path, routes: list[str], served_name: str | None = None
) -> list[str]:
    """The gateway's flags: its ports, the instances (``routes``: ``--prefill ADDRESS`` ...), and
    what ``up`` takes on its behalf (routing, the request log, tracing)."""
    flags = ["--model", str(model), "--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port)]
    flags += routes
    if served_name is not None:  # the embedded model's, the same in whichever form it is served
        flags += ["--served-model-name", served_name]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    flags += ["--api-server-count", str(args.api_server_count)]
    return flags + routing_argv(args) + request_log_argv(args) + tracing_argv(args)


def engine_flags(args: argparse.Namespace, model: Path) -> list[str]:
    """The flags every engine instance of this run gets, whatever its role."""
    return ["--model", str(model), *engine_argv(args), *tracing_argv(args)]


def _start_instances(
    args: argparse.Namespace,
    model: Path,
    cpus: dict[str, list[set[int] | None]],
    children: list[Child],
    cluster_env: dict[str, str],
) -> list[str]:
    """Start the engines, each with ``cluster_env``; return the gateway's routing flags for them."""
    common = engine_flags(args, model)
    if args.planner:
        return _start_planner(args, model, children, cluster_env)
    if args.simulate:
        return _start_simulated_instances(args, common, children, cluster_env)
    if args.colocated:
        port = free_port()
        argv = splitserve_command(
            "--log-level", args.log_level, "colocated", *common, *speculative_argv(args), "--port", str(port)
        )
        children.append(Child("colocated", argv, env=cluster_env, cpus=cpus["colocated"][0]))
        return ["--colocated", f"127.0.0.1:{port}"]
    connector = ["--kv-connector", args.kv_connector]
    env = _real_instance_env(args, children, cluster_env)
    routes: list[str] = []
    gpus = _visible_gpus()
    next_gpu = 0
    for role, count in (("prefill", args.num_prefill), ("decode", args.num_decode)):
        for index in range(count):
            port = free_port()
            # Decode instances verify drafts. Prefill ones sample one token per request and never
            # verify, but with Medusa heads they draft once, for the hand-off: they take the
            # flags too (other methods ignore them there).
            spec = speculative_argv(args)
            tensor_parallel_size = getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size
            pipeline_parallel_size = getattr(args, f"{role}_pipeline_parallel_size") or args.pipeline_parallel_size
            argv = splitserve_command(
                "--log-level",
                args.log_level,
                role,
                *common,
                "--tensor-parallel-size",  # the role's own, after the common one: the last one counts
                str(tensor_parallel_size),
                "--pipeline-parallel-size",
                str(pipeline_parallel_size),
                *connector,
                *spec,
                "--port",
                str(port),
                "--instance-id",
                f"{role}-{index}",
            )
            child_env = dict(env)
            if gpus:
                # GPUs of their own per instance, round robin: one per rank of every stage.
                first, num_ranks = next_gpu, tensor_parallel_size * pipeline_parallel_size
                next_gpu += num_ranks
                ranks = range(first, first + num_ranks)
                child_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i % len(gpus)] for i in ranks)
            children.append(Child(f"{role}-{index}", argv, env=child_env, cpus=cpus[role][index]))
            routes += [f"--{role}", f"127.0.0.1:{port}"]
    return routes


def _real_instance_env(args: argparse.Namespace, children: list[Child], cluster_env: dict[str, str]) -> dict[str, str]:
    """Real instances' environment: UCX on loopback (what the user set wins), the cluster secret,
    and for the lmcache connector its store's URL (in the environment: it may hold a password)."""
    env = {**{k: v for k, v in LOCAL_UCX_ENV.items() if k not in os.environ}, **cluster_env}
    if args.kv_connector == "lmcache":
        env["SPLITSERVE_LMCACHE_URL"] = args.lmcache_url or _start_redis(
            children,
            "--kv-connector lmcache needs a store: pass --lmcache-url, or install redis-server to have one "
            "started here",
        )
    return env


def _start_planner(
    args: argparse.Namespace, model: Path, children: list[Child], cluster_env: dict[str, str]
) -> list[str]:
    """``splitserve planner`` as a child, which starts the instances (one process each) and
    registers them in a Redis started here; return the gateway's flags to find them and it."""
    registry_url = _start_redis(
        children, "--planner registers its instances in a local Redis: install redis-server to have one started here"
    )
    # Real instances get their environment from the planner, which passes its own on.
    env = cluster_env if args.simulate else _real_instance_env(args, children, cluster_env)
    # Its metrics on a port of its own, which the gateway's status page reads.
    metrics_port = free_port()
    argv = [*planner_command(args, model, registry_url), "--metrics-port", str(metrics_port)]
    children.append(Child("planner", argv, env=env))
    return ["--registry-url", registry_url, "--planner-url", f"http://127.0.0.1:{metrics_port}"]


def _start_simulated_instances(
    args: argparse.Namespace, common: list[str], children: list[Child], cluster_env: dict[str, str]
) -> list[str]:
    """One ``splitserve simulate`` process per role, holding that role's instances, which
    register in a Redis started here; return the gateway's flags to find them there."""
    registry_url = _start_redis(
        children, "--simulate registers its instances in a local Redis: install redis-server to have one started here"
    )
    counts = {"colocated": 1} if args.colocated else {"prefill": args.num_prefill, "decode": args.num_decode}
    profile = ["--profile", args.simulate_profile] if args.simulate_profile else []
    for role, count in counts.items():
        argv = splitserve_command(
            "--log-level",
            args.log_level,
            "simulate",
            role,
            *common,
            *profile,
            "--time-scale",
            str(args.time_scale),
            "--num-instances",
            str(count),
            "--instance-id",
            role,
            "--port",
            "0",
            "--registry-url",
            registry_url,
        )
        children.append(Child(f"simulate-{role}", argv, env=cluster_env))
    return ["--registry-url", registry_url]


def planner_command(args: argparse.Namespace, model: Path, registry_url: str) -> list[str]:
    """``splitserve planner`` for ``up --planner``: it starts the instances (one process each)
    and reads this run's gateway. Simulated ones of ``--simulate-profile``, or real ones of the
    model with the engine's flags ``up`` gives its own instances, priced by ``--capacity-profile``."""
    if args.colocated:
        raise ValueError("--planner sizes prefill and decode pools: drop --colocated")
    if args.simulate:
        # The planner starts real instances without a timing profile: name simulate's default.
        instances = [
            "--simulate-profile",
            args.simulate_profile or DEFAULT_PROFILE,
            "--time-scale",
            str(args.time_scale),
        ]
    else:
        instances = [*engine_argv(args), *speculative_argv(args), "--kv-connector", args.kv_connector]
    if args.capacity_profile is not None:
        instances += ["--capacity-profile", args.capacity_profile]
    return splitserve_command(
        "--log-level", args.log_level, "planner",
        "--gateway-url", f"http://{_dial_host(args.host)}:{args.port}", "--registry-url", registry_url,
        "--model", str(model), *instances,
        "--initial-prefill", str(args.num_prefill), "--initial-decode", str(args.num_decode),
        *planner_argv(args),
    )  # fmt: skip


def _cluster_secret_env() -> dict[str, str]:
    """The environment that gives every child the cluster secret: one made for this run, so
    that only this run's processes get in, unless the user gave one (a file they then all read).
    Raises ValueError for one given empty, as every child would."""
    secret_file = os.environ.get("SPLITSERVE_CLUSTER_SECRET_FILE")
    if secret_file is not None:
        if not secret_file.strip():
            raise ValueError(
                "SPLITSERVE_CLUSTER_SECRET_FILE is set but empty: name the file that holds the cluster secret, or "
                "unset it to have a secret made for this run"
            )
        return {}
    given = os.environ.get("SPLITSERVE_CLUSTER_SECRET")
    if given is not None and not given.strip():
        raise ValueError(
            "SPLITSERVE_CLUSTER_SECRET is set but empty: set it to the cluster's secret, or unset it to have a "
            "secret made for this run"
        )
    return {"SPLITSERVE_CLUSTER_SECRET": given or secrets.token_urlsafe(32)}


def _visible_gpus() -> list[str]:
    """NVIDIA GPU indices this process may use (none without nvidia-smi), without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu for gpu in visible.split(",") if gpu.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return (
        [line.strip() for line in listing.stdout.splitlines() if line.strip().isdigit()]
        if listing.returncode == 0
        else []
    )


def _start_redis(children: list[Child], missing: str) -> str:
    """A throwaway Redis on loopback (no persistence): the lmcache connector's store, or the
    simulated instances' registry. ``missing``: the error where redis-server is not installed."""
    if shutil.which("redis-server") is None:
        raise ValueError(missing)
    port = free_port()
    children.append(
        Child(
            "redis",
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
            stop_stage=2,
        )
    )
    return f"redis://127.0.0.1:{port}"


def _dial_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _wait_ready(url: str, children: list[Child], stop: StopSignal) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stop.is_set():
        dead = [c for c in children if c.exited]
        if dead:
            logger.error("%s exited with %s before the stack was ready", dead[0].name, dead[0].process.returncode)
            return False
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                if json.load(response).get("ready"):
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        stop.wait(0.5)
    if not stop.is_set():
        logger.error("the stack was not ready after %.0f s", READY_TIMEOUT_S)
    return False


def masked_key(key: str) -> str:
    """An API key as the banner shows it: its last four characters at most, a quarter of a short one."""
    return "****" + key[-min(4, len(key) // 4) :] if len(key) >= 4 else "****"


def _print_banner(args: argparse.Namespace, url: str, served_name: str | None) -> None:
    # Never the key itself: terminals are scrolled back, shared and recorded.
    auth = ' -H "Authorization: Bearer $SPLITSERVE_API_KEY"' if args.api_key else ""
    key_note = (
        f"the API wants the key you gave ({masked_key(args.api_key)}): export it as SPLITSERVE_API_KEY to run this\n"
        if args.api_key
        else ""
    )
    example = json.dumps(
        {
            "model": served_name or args.model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
        }
    )
    print(
        f"\nsplitserve is up: OpenAI API at {url}/v1, gRPC Generation at {_dial_host(args.host)}:{args.grpc_port}\n"
        f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{example}'\n"
        f"{key_note}Ctrl-C stops everything.\n",
        flush=True,
    )
