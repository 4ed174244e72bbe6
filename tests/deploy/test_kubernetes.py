"""deploy/kubernetes/: every resource valid against the Kubernetes schemas (kubernetes-validate,
strict), what ``kubectl kustomize`` renders from it, and what the manifests promise: P and D on
GPU nodes of their own advertising their pod IPs, commands the real CLI parses, readiness from
``/ready`` and grpc.health.v1, the secrets mounted as files and nowhere else, Services and
disruption budgets that select the pods they mean."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.compose.test_compose import parse_command

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"  # the oldest release still maintained when this was written
PORTS = {"prefill": 50061, "decode": 50071, "gateway": 8000}


def resources() -> list[dict[str, Any]]:
    listed = yaml.safe_load((KUBERNETES_DIR / "kustomization.yaml").read_text())["resources"]
    return [
        document for name in listed for document in yaml.safe_load_all((KUBERNETES_DIR / name).read_text()) if document
    ]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {document["metadata"]["name"]: document for document in resources() if document["kind"] == kind}


def container(name: str) -> dict[str, Any]:
    (only,) = by_kind("Deployment")[name]["spec"]["template"]["spec"]["containers"]
    return only


def validate(documents: list[dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (in the test extras)"
    )
    for document in documents:
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{document['kind']} {document['metadata']['name']}: {error.message} at {list(error.path)}")


def test_every_resource_is_valid_against_the_kubernetes_schemas() -> None:
    documents = resources()
    assert {d["kind"] for d in documents} == {"Namespace", "Deployment", "Service", "PodDisruptionBudget"}
    validate(documents)


def test_kustomize_renders_valid_resources_with_the_secret(tmp_path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: kustomize's output was not checked")
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES_DIR, copy)
    for name in ("cluster-secret", "redis-password"):
        (copy / name).write_text(f"test-{name}\n")
    result = subprocess.run(["kubectl", "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = [document for document in yaml.safe_load_all(result.stdout) if document]
    validate(rendered)
    (secret,) = [d for d in rendered if d["kind"] == "Secret"]
    assert set(secret["data"]) == {"cluster_secret", "redis_password"}
    namespaced = [d for d in rendered if d["kind"] != "Namespace"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"splitserve"}
    for deployment in (d for d in rendered if d["kind"] == "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        names = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert names == {secret["metadata"]["name"]}, "the Deployments mount the generated Secret by its hashed name"
        if deployment["metadata"]["name"] != "redis":
            assert spec["containers"][0]["image"] == "registry.example.com/splitserve:0.1.0"


@pytest.mark.parametrize("role", ["prefill", "decode", "gateway"])
def test_commands_parse_with_the_real_cli(role: str) -> None:
    args = parse_command([str(token) for token in container(role)["args"]])
    assert args.command == role
    assert (args.host, args.port) == ("0.0.0.0", PORTS[role])
    assert args.registry_url == "redis://redis:6379"
    if role != "gateway":
        assert args.advertise_host == "$(POD_IP)", "each pod advertises its own address, so replicas scale"
        env = {e["name"]: e for e in container(role)["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert args.kv_port == PORTS[role] + 1
        ports = {p["name"]: p["containerPort"] for p in container(role)["ports"]}
        assert ports == {"grpc": args.port, "kv": args.kv_port}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_instances_get_a_gpu_on_their_own_nodes_and_grpc_health_readiness(role: str) -> None:
    spec = by_kind("Deployment")[role]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"splitserve.io/role": role}
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec["containers"][0][probe]["grpc"] == {"port": PORTS[role]}, probe


def test_gateway_is_ready_on_ready_and_alive_on_health() -> None:
    gateway = container("gateway")
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    service = by_kind("Service")["gateway"]
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 50051}


def test_services_and_budgets_select_their_pods() -> None:
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in by_kind("Deployment").items()}
    for name, deployment in by_kind("Deployment").items():
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pods[name].items(), name
    for name, service in by_kind("Service").items():
        assert service["spec"]["selector"].items() <= pods[name].items(), name
        named = {p["name"] for p in container(name)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named, name
    budgets = by_kind("PodDisruptionBudget")
    assert set(budgets) == {"gateway", "prefill", "decode"}
    for name, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"].items() <= pods[name].items(), name


@pytest.mark.parametrize("role", ["redis", "prefill", "decode", "gateway"])
def test_secrets_are_files_never_arguments(role: str) -> None:
    spec = container(role)
    mounts = {m["mountPath"]: m for m in spec["volumeMounts"]}
    assert mounts["/run/secrets"]["readOnly"] is True
    words = [str(token) for token in spec.get("args", []) + spec.get("command", [])]
    assert not any("@" in word for word in words), "no credentials in a URL"
    if role != "redis":
        env = {e["name"]: e.get("value") for e in spec["env"]}
        assert env["SPLITSERVE_CLUSTER_SECRET_FILE"] == "/run/secrets/cluster_secret"
        assert env["SPLITSERVE_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
        assert not any("secret" in word or "password" in word for word in words)


def test_the_secret_files_stay_out_of_git() -> None:
    patterns = (ROOT / ".gitignore").read_text().splitlines()
    assert {"deploy/kubernetes/cluster-secret", "deploy/kubernetes/redis-password"} <= set(patterns)
