"""What compose ships for observability, checked without running it (the compose test runs
it): Prometheus's configs pass ``promtool check config`` and scrape the gateway and each
instance at the ports their commands use, the simulated stack's every simulated instance of
each container (its config written by ``compose/prometheus/simulated.py`` from the real
stack's and the simulate file's ports, and run by the observability file's Prometheus
service); the Grafana dashboard is what
``compose/grafana/dashboard.py`` builds with grafana-foundation-sdk, loads back into the SDK's
dashboard model, and queries only series splitserve exports."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.compose.test_compose import (
    BASE,
    COMPOSE_DIR,
    CPU,
    SIMULATE,
    command,
    compose_config,
    instance_ports,
    parse_command,
    raw,
    with_defaults,
)

OBSERVABILITY = "docker-compose.observability.yml"
PROMETHEUS_CONFIG = COMPOSE_DIR / "prometheus" / "prometheus.yml"
SIMULATED_PROMETHEUS_CONFIG = COMPOSE_DIR / "prometheus" / "prometheus.simulate.yml"
PROMETHEUS_CONFIG_IN_CONTAINER = "/etc/prometheus/prometheus.yml"
DASHBOARD = COMPOSE_DIR / "grafana" / "dashboards" / "splitserve.json"


def dashboard_module() -> ModuleType:
    pytest.importorskip("grafana_foundation_sdk", reason="pip install grafana-foundation-sdk (in the test extras)")
    spec = importlib.util.spec_from_file_location("splitserve_dashboard", COMPOSE_DIR / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def simulated_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("splitserve_simulated", COMPOSE_DIR / "prometheus" / "simulated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def targets_by_component(config: dict) -> dict[str, list[str]]:
    """{component label: its targets, in order} of a Prometheus config."""
    targets: dict[str, list[str]] = {}
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            targets.setdefault(group["labels"]["component"], []).extend(group["targets"])
    return targets


def scrape_targets() -> dict[str, str]:
    """{component label: target} of prometheus.yml."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    return {
        group["labels"]["component"]: target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }


@pytest.mark.parametrize("config", [PROMETHEUS_CONFIG, SIMULATED_PROMETHEUS_CONFIG], ids=lambda path: path.name)
def test_promtool_accepts_the_config(config) -> None:  # type: ignore[no-untyped-def]
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does)")
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("file", [BASE, CPU])
def test_prometheus_scrapes_every_service_where_it_serves_metrics(file: str) -> None:
    targets = scrape_targets()
    gateway = parse_command(command(BASE, "gateway"))
    assert targets["gateway"] == f"gateway:{gateway.port}"
    for role in ("prefill", "decode"):
        args = parse_command(command(file, role))
        assert args.metrics_port is not None, f"{file}: {role} serves no metrics"
        assert targets[role] == f"{role}:{args.metrics_port}"
        assert args.metrics_port not in (args.port, args.kv_port)


def test_the_simulated_stacks_prometheus_scrapes_the_gateway_and_every_simulated_instance() -> None:
    targets = targets_by_component(yaml.safe_load(SIMULATED_PROMETHEUS_CONFIG.read_text()))
    assert targets["gateway"] == [f"gateway:{parse_command(command(SIMULATE, 'gateway')).port}"]
    for role in ("prefill", "decode"):
        metrics_ports = instance_ports(parse_command(command(SIMULATE, role)))["metrics"]
        assert len(metrics_ports) > 1, f"{role}: one container serves several instances"
        assert targets[role] == [f"{role}:{port}" for port in metrics_ports], f"{role}: not every instance's /metrics"


def test_the_simulated_config_shares_the_real_ones_pieces_and_is_what_simulated_py_writes() -> None:
    simulated = simulated_module()
    assert SIMULATED_PROMETHEUS_CONFIG.read_text() == simulated.config_text({}), (
        "regenerate: python compose/prometheus/simulated.py > compose/prometheus/prometheus.simulate.yml"
    )
    real = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config = yaml.safe_load(SIMULATED_PROMETHEUS_CONFIG.read_text())
    assert config["global"] == real["global"]
    assert config["scrape_configs"][0] == real["scrape_configs"][0], "the gateway's job, as the real stack's"
    # Other counts and ports, from the variables compose reads: each instance a target still.
    environ = {"SIMULATE_PREFILL_INSTANCES": "3", "SIMULATE_DECODE_METRICS_PORT": "40000"}
    targets = targets_by_component(simulated.config(environ))
    assert targets["prefill"] == ["prefill:52061", "prefill:52062", "prefill:52063"]
    assert targets["decode"] == [f"decode:{40000 + index}" for index in range(8)]


def test_the_simulated_stack_runs_the_observability_prometheus_with_its_own_config() -> None:
    prometheus = compose_config("simulate")["services"]["prometheus"]
    mounts = {
        str(volume).split(":")[1]: str(volume).split(":")[0] for volume in prometheus["volumes"] if ":" in str(volume)
    }
    assert Path(mounts[PROMETHEUS_CONFIG_IN_CONTAINER]) == SIMULATED_PROMETHEUS_CONFIG
    observability = with_defaults(raw(OBSERVABILITY)["services"]["prometheus"])
    for key in ("image", "user", "entrypoint", "command", "read_only", "cap_drop", "security_opt", "healthcheck"):
        assert prometheus[key] == observability[key], f"{key}: not the observability file's"
    assert f"--config.file={PROMETHEUS_CONFIG_IN_CONTAINER}" in prometheus["command"]


def test_observability_services_mount_what_compose_ships() -> None:
    services = raw(OBSERVABILITY)["services"]
    assert set(services) == {"prometheus", "grafana"}
    mounts = {name: [str(volume).split(":")[0] for volume in service["volumes"]] for name, service in services.items()}
    assert "./prometheus/prometheus.yml" in mounts["prometheus"]
    assert {"./grafana/provisioning", "./grafana/dashboards"} <= set(mounts["grafana"])
    datasource = yaml.safe_load(
        (COMPOSE_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    (source,) = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090"
    uids = {
        target["datasource"]["uid"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel.get("targets", [])
    }
    assert uids == {source["uid"]}


def test_dashboard_json_is_what_the_sdk_builds() -> None:
    module = dashboard_module()
    assert DASHBOARD.read_text() == module.dashboard_json(), (
        "regenerate: python compose/grafana/dashboard.py > compose/grafana/dashboards/splitserve.json"
    )


def test_dashboard_loads_into_the_sdk_model() -> None:
    dashboard_module()
    from grafana_foundation_sdk.models.dashboard import Dashboard

    data = json.loads(DASHBOARD.read_text())
    loaded = Dashboard.from_json(data)
    assert loaded.title == "splitserve" and loaded.uid == "splitserve"
    titles = [panel["title"] for panel in data["panels"] if panel["type"] != "row"]
    for wanted in (
        "Time to first token",
        "Inter-token latency",
        "End-to-end latency",
        "Waiting requests",
        "KV cache use",
        "KV transfer bytes",
        "KV transfer time",
        "Failed requests",
        "KV failures",
    ):
        assert wanted in titles


def exported_names() -> set[str]:
    """Every series name splitserve exports: the gateway's registry, an instance's collector
    (over an empty load report) and the planner's registry."""
    from gateway.instances import InstancePool
    from gateway.metrics import GatewayMetrics
    from planner.metrics import PlannerMetrics
    from serving.metrics import InstanceCollector, PhaseMetrics
    from splitserve.v1 import disaggregation_pb2

    report = disaggregation_pb2.LoadReport(instance_id="prefill-1", role="prefill")
    families = [
        *GatewayMetrics(InstancePool(stale_after_s=1.0)).registry.collect(),
        *InstanceCollector(lambda: report).collect(),
        *PhaseMetrics("prefill-1", "prefill").registry.collect(),
        *PlannerMetrics().registry.collect(),
    ]
    names = set()
    for family in families:
        names |= {sample.name for sample in family.samples} | {family.name}
        if family.type == "counter":
            names.add(f"{family.name}_total")
        if family.type == "histogram":  # a labelled one has no samples before its first observation
            names |= {f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
    return names


def test_dashboard_queries_only_exported_series() -> None:
    names = exported_names()
    queried = set(re.findall(r"splitserve_\w+", DASHBOARD.read_text()))
    queried = {name.removesuffix("_bucket") if name.endswith("_bucket") else name for name in queried}
    missing = {name for name in queried if name not in names and f"{name}_bucket" not in names}
    assert not missing, f"the dashboard queries series nobody exports: {sorted(missing)}"
