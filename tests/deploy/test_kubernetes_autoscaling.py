"""deploy/kubernetes-autoscaling/ as ``kubectl kustomize`` renders it: every built-in resource
valid against the Kubernetes schemas (kubernetes-validate, strict) and each KEDA ScaledObject
against the fields of KEDA's ScaledObject schema it uses (written here from KEDA's CRD: the
CRD is not installed on this host). What it promises: KEDA scales each role's Deployment to
exactly the series the planner exports for that role, within the planner's own bounds; the
planner only publishes (no API rights, no token) and reads every gateway pod; P and D drain in
a preStop hook that reads each instance's own metrics endpoint, inside a grace period longer
than the longest stream the gateway lets run. Its ``direct-api`` component (the planner scaling
through the API instead) replaces KEDA with a Role that may get and patch the scale of the two
Deployments and nothing else."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from planner.metrics import PlannerMetrics
from serving.instance import DRAIN_GRACE_S
from tests.compose.test_compose import parse_command
from tests.deploy.test_kubernetes import KUBERNETES_DIR, SECRET_FILES, validate

ROOT = Path(__file__).resolve().parents[2]
AUTOSCALING_DIR = ROOT / "deploy" / "kubernetes-autoscaling"
ROLES = ("prefill", "decode")

# The part of KEDA's ScaledObject schema (keda.sh/v1alpha1) these manifests use.
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "kind": {"type": "string"}},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer"},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "behavior": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        direction: {
                                            "type": "object",
                                            "additionalProperties": False,
                                            "properties": {
                                                "stabilizationWindowSeconds": {
                                                    "type": "integer",
                                                    "minimum": 0,
                                                    "maximum": 3600,
                                                },
                                                "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
                                                "policies": {
                                                    "type": "array",
                                                    "items": {
                                                        "type": "object",
                                                        "required": ["type", "value", "periodSeconds"],
                                                        "additionalProperties": False,
                                                        "properties": {
                                                            "type": {"enum": ["Pods", "Percent"]},
                                                            "value": {"type": "integer", "minimum": 1},
                                                            "periodSeconds": {
                                                                "type": "integer",
                                                                "minimum": 1,
                                                                "maximum": 1800,
                                                            },
                                                        },
                                                    },
                                                },
                                            },
                                        }
                                        for direction in ("scaleUp", "scaleDown")
                                    },
                                }
                            },
                        }
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            # Every trigger's metadata value is a string in KEDA's schema.
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
}


def render(scratch: Path, components: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of a copy of the overlay (the secret files made), with ``components``
    added to its kustomization."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: kustomize's output was not checked")
    for source in (KUBERNETES_DIR, AUTOSCALING_DIR):
        shutil.copytree(source, scratch / source.name)
    for name in SECRET_FILES:
        (scratch / KUBERNETES_DIR.name / name).write_text(f"test-{name}\n")
    kustomization = scratch / AUTOSCALING_DIR.name / "kustomization.yaml"
    config = yaml.safe_load(kustomization.read_text())
    if components:
        config["components"] = list(components)
    kustomization.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        ["kubectl", "kustomize", str(scratch / AUTOSCALING_DIR.name)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(tmp_path_factory.mktemp("kustomize"))


def named(documents: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def only_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[Any], name: str) -> str:
    return str(args[args.index(name) + 1])


def test_every_resource_is_valid(rendered: list[dict[str, Any]]) -> None:
    validate([d for d in rendered if d["kind"] != "ScaledObject"])
    namespaced = [d for d in rendered if d["kind"] != "Namespace"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"splitserve"}, "the overlay's own resources too"
    scaled_objects = named(rendered, "ScaledObject")
    assert set(scaled_objects) == set(ROLES)
    for scaled_object in scaled_objects.values():
        jsonschema.validate(scaled_object, SCALED_OBJECT_SCHEMA)


def exported_series() -> dict[str, set[str]]:
    """The planner's series, each with its label names."""
    return {
        metric.name: {label for sample in metric.samples for label in sample.labels}
        for metric in PlannerMetrics().registry.collect()
    } | {"splitserve_planner_desired_instances": {"role"}}  # labelled: no sample until the first decision


@pytest.mark.parametrize("role", ROLES)
def test_keda_scales_each_role_to_the_count_the_planner_publishes_within_its_bounds(
    rendered: list[dict[str, Any]], role: str
) -> None:
    spec = named(rendered, "ScaledObject")[role]["spec"]
    assert spec["scaleTargetRef"]["name"] in named(rendered, "Deployment")
    assert spec["scaleTargetRef"]["name"] == role
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    # replicas = ceil(value / threshold) only for an AverageValue target of 1.
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == 1
    match = re.fullmatch(r'max\((\w+)\{role="(\w+)"\}\)', trigger["metadata"]["query"])
    assert match, trigger["metadata"]["query"]
    assert match.group(1) in exported_series() and "role" in exported_series()[match.group(1)]
    assert match.group(1) == "splitserve_planner_desired_instances" and match.group(2) == role
    planner = parse_command([str(token) for token in only_container(named(rendered, "Deployment")["planner"])["args"]])
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (
        getattr(planner, f"min_{role}"),
        getattr(planner, f"max_{role}"),
    ), "KEDA's bounds are the planner's: a count it publishes is never clipped"


def test_the_planner_only_publishes_reads_every_gateway_and_is_scraped(rendered: list[dict[str, Any]]) -> None:
    deployments = named(rendered, "Deployment")
    pod = deployments["planner"]["spec"]["template"]
    container = only_container(deployments["planner"])
    args = parse_command([str(token) for token in container["args"]])
    assert args.command == "planner" and args.actuator == "metrics", "publish only: KEDA acts"
    # No API rights: a ServiceAccount without token, bound to no role.
    assert pod["spec"]["serviceAccountName"] == "planner"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert named(rendered, "ServiceAccount")["planner"]["automountServiceAccountToken"] is False
    assert not [d for d in rendered if d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
    assert "direct-api" not in yaml.safe_load((AUTOSCALING_DIR / "kustomization.yaml").read_text()).get(
        "components", []
    ), "KEDA by default"
    # Every gateway pod: a headless Service over the gateway's pods, on its REST port.
    (gateway_url,) = args.gateway_url
    url = urlsplit(gateway_url)
    service = named(rendered, "Service")[url.hostname or ""]
    assert args.gateway_every_address and service["spec"]["clusterIP"] == "None"
    gateway_pod = deployments["gateway"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= gateway_pod["metadata"]["labels"].items()
    assert url.port == int(flag(only_container(deployments["gateway"])["args"], "--port"))
    # Its metrics where Prometheus is told to look, and let in by a policy.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": args.metrics_port} and args.metrics_host == "0.0.0.0"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    policy = named(rendered, "NetworkPolicy")["planner"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == ["metrics"]


@pytest.mark.parametrize("role", ROLES)
def test_instances_drain_in_a_pre_stop_hook_within_their_grace(rendered: list[dict[str, Any]], role: str) -> None:
    deployments = named(rendered, "Deployment")
    pod_spec = deployments[role]["spec"]["template"]["spec"]
    container = only_container(deployments[role])
    instance = parse_command([str(token) for token in container["args"]])
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == "splitserve"
    drain = parse_command(hook[1:])
    assert drain.command == "drain" and drain.pid == 1, "the entrypoint's process is the instance"
    # A decode pod hands its streams over to the pods that stay; a prefill pod has none to hand.
    assert drain.hand_over == (role == "decode")
    metrics_url = urlsplit(drain.metrics_url)
    assert (metrics_url.hostname, metrics_url.port) == ("127.0.0.1", instance.metrics_port)
    # Grace: the hook and then SIGTERM's own drain. A decode pod's hook lasts as long as its
    # longest stream, which the gateway ends at its --request-timeout.
    grace_s = pod_spec["terminationGracePeriodSeconds"]
    assert grace_s > DRAIN_GRACE_S
    if role == "decode":
        request_timeout_s = float(flag(only_container(deployments["gateway"])["args"], "--request-timeout"))
        assert grace_s > request_timeout_s + DRAIN_GRACE_S


def test_the_direct_api_component_gives_the_planner_the_scale_of_its_two_deployments_only(tmp_path: Path) -> None:
    rendered = render(tmp_path, ("direct-api",))
    validate(rendered)
    assert not named(rendered, "ScaledObject"), "the planner scales: KEDA must not as well"
    deployments = named(rendered, "Deployment")
    planner_pod = deployments["planner"]["spec"]["template"]["spec"]
    args = parse_command([str(token) for token in only_container(deployments["planner"])["args"]])
    assert args.actuator == "kubernetes"
    assert planner_pod["automountServiceAccountToken"] is True, "the token the API calls carry"
    targets = {args.prefill_deployment, args.decode_deployment}
    assert targets == set(ROLES) and targets <= set(deployments)
    (role,) = named(rendered, "Role").values()
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["apps"] and rule["resources"] == ["deployments/scale"]
    assert set(rule["resourceNames"]) == targets and set(rule["verbs"]) == {"get", "patch"}
    (binding,) = named(rendered, "RoleBinding").values()
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": planner_pod["serviceAccountName"], "namespace": "splitserve"}
    ]
    assert not named(rendered, "ClusterRole") and not named(rendered, "ClusterRoleBinding")
