"""deploy/kubernetes/: every resource valid against the Kubernetes schemas (kubernetes-validate,
strict), what ``kubectl kustomize`` renders from it, and what the manifests promise: P and D on
GPU nodes of their own advertising their pod IPs, commands the real CLI parses, readiness from
``/ready`` and grpc.health.v1, the secrets mounted as files (each pod the ones it needs) and
nowhere else, Services and disruption budgets that select the pods they mean; every container
unprivileged on a read-only root, and network policies that let in only the paths the plane
uses (evaluated here as Kubernetes evaluates them). The simulated overlay
(deploy/kubernetes-simulated/) as ``kubectl kustomize`` renders it: valid, its commands parsed,
no GPU, the same hardening and secrets, and the same paths open on every instance's ports."""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.compose.test_compose import (
    MAX_SIMULATED_INSTANCES,
    check_simulated_instances,
    instance_ports,
    parse_command,
)

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
SIMULATED_DIR = ROOT / "deploy" / "kubernetes-simulated"  # an overlay of KUBERNETES_DIR
SIMULATED_INSTANCES = 8  # a simulated pod's
KUBERNETES_VERSION = "1.30.0"  # the oldest release still maintained when this was written
PORTS = {"prefill": 50061, "decode": 50071, "gateway": 8000}
SECRET_FILES = ("cluster-secret", "redis-registry-password", "redis-kv-password", "api-key")
FLAGS_NAMING_SECRETS = {"--require-cluster-secret"}  # flags whose names hold "secret"; never a secret


def resources() -> list[dict[str, Any]]:
    listed = yaml.safe_load((KUBERNETES_DIR / "kustomization.yaml").read_text())["resources"]
    return [
        document for name in listed for document in yaml.safe_load_all((KUBERNETES_DIR / name).read_text()) if document
    ]


def by_kind(kind: str, documents: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``documents`` (default: the manifests as written) of one kind, by name."""
    return (
        {d["metadata"]["name"]: d for d in resources() if d["kind"] == kind}
        if documents is None
        else {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}
    )


def container(name: str, documents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    (only,) = by_kind("Deployment", documents)[name]["spec"]["template"]["spec"]["containers"]
    return only


def kustomize(folder: Path, scratch: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of a copy of ``folder`` (deploy/'s folders copied beside it, the
    secret files made), as a list of resources."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: kustomize's output was not checked")
    for source in (KUBERNETES_DIR, SIMULATED_DIR):
        shutil.copytree(source, scratch / source.name)
    for name in SECRET_FILES:
        (scratch / KUBERNETES_DIR.name / name).write_text(f"test-{name}\n")
    result = subprocess.run(
        ["kubectl", "kustomize", str(scratch / folder.name)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@functools.cache
def simulated() -> list[dict[str, Any]]:
    """The simulated overlay as kustomize renders it."""
    with tempfile.TemporaryDirectory() as scratch:
        return kustomize(SIMULATED_DIR, Path(scratch))


def documents_of(manifests: str) -> list[dict[str, Any]] | None:
    """The resources of ``manifests``: None (the real ones, as written) or the simulated overlay's."""
    return simulated() if manifests == "simulated" else None


MANIFESTS = ["real", "simulated"]


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
    assert {d["kind"] for d in documents} == {
        "Namespace",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    validate(documents)


@pytest.mark.parametrize("folder", [KUBERNETES_DIR, SIMULATED_DIR], ids=["real", "simulated"])
def test_kustomize_renders_valid_resources_with_the_secret(folder: Path, tmp_path: Path) -> None:
    rendered = kustomize(folder, tmp_path)
    validate(rendered)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert {(d["kind"], d["metadata"]["name"]) for d in resources()} <= kinds, "every resource of the manifests"
    (secret,) = [d for d in rendered if d["kind"] == "Secret"]
    assert set(secret["data"]) == {"cluster_secret", "redis_registry_password", "redis_kv_password", "api_key"}
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
    assert args.registry_url == "redis://registry@redis:6379", "the registry's own Redis user"
    assert args.require_cluster_secret, "never started without the cluster secret"
    if role != "gateway":
        assert args.advertise_host == "$(POD_IP)", "each pod advertises its own address, so replicas scale"
        env = {e["name"]: e for e in container(role)["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert args.kv_port == PORTS[role] + 1
        assert args.lmcache_url == "redis://kv@redis:6379/1", "the KV store's own Redis user, in its own database"
        ports = {p["name"]: p["containerPort"] for p in container(role)["ports"]}
        assert ports == {"grpc": args.port, "kv": args.kv_port}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_simulated_instances_parse_with_the_real_cli_and_need_no_gpu(role: str) -> None:
    spec = container(role, simulated())
    args = parse_command([str(token) for token in spec["args"]])
    assert (args.command, args.role) == ("simulate", role)
    assert (args.host, args.port) == ("0.0.0.0", PORTS[role])
    assert args.registry_url == "redis://registry@redis:6379" and args.require_cluster_secret
    check_simulated_instances(args, SIMULATED_INSTANCES)
    env = {e["name"]: e for e in spec["env"]}
    # Each pod advertises its own address, and its instances' ids start with its own name:
    # replicas neither collide in the registry nor dial each other's addresses.
    assert (args.advertise_host, args.instance_id) == ("$(POD_IP)", "$(POD_NAME)")
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert {p["name"]: p["containerPort"] for p in spec["ports"]} == {"grpc": args.port, "kv": args.kv_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec[probe]["grpc"] == {"port": args.port}, f"{probe}: instance 0's gRPC health"
    pod = by_kind("Deployment", simulated())[role]["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod, "any node, not a GPU one"
    resources = spec["resources"]
    assert not any("gpu" in name for part in resources.values() for name in part), resources
    assert resources["requests"] == {"cpu": "500m", "memory": "1Gi"}, "a process that sleeps out step times"
    real = parse_command([str(token) for token in container(role)["args"]])
    shared = {"model", "block_size", "registry_url"}
    shared |= {"lease_seconds"} if role == "prefill" else {"kv_failure_policy", "kv_pull_timeout"}
    assert {key: getattr(args, key) for key in shared} == {key: getattr(real, key) for key in shared}


def test_simulated_gateway_serves_the_simulated_model_by_a_name_of_its_own() -> None:
    real = vars(parse_command([str(token) for token in container("gateway")["args"]]))
    args = vars(parse_command([str(token) for token in container("gateway", simulated())["args"]]))
    assert args["served_model_name"] == "simulated"
    assert {key for key in args if args[key] != real[key]} == {"served_model_name"}, "drifted from the real one"


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


@pytest.mark.parametrize("manifests", MANIFESTS)
def test_services_and_budgets_select_their_pods(manifests: str) -> None:
    documents = documents_of(manifests)
    pods = pod_labels(documents)
    for name, deployment in by_kind("Deployment", documents).items():
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pods[name].items(), name
    for name, service in by_kind("Service", documents).items():
        assert service["spec"]["selector"].items() <= pods[name].items(), name
        named = {p["name"] for p in container(name, documents)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named, name
    budgets = by_kind("PodDisruptionBudget", documents)
    assert set(budgets) == {"gateway", "prefill", "decode"}
    for name, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"].items() <= pods[name].items(), name


SECRETS_MOUNTED = {
    "redis": {"redis_registry_password", "redis_kv_password"},
    "prefill": {"cluster_secret", "redis_registry_password", "redis_kv_password"},
    "decode": {"cluster_secret", "redis_registry_password", "redis_kv_password"},
    # The registry's password, not the KV store's: the gateway never reads KV.
    "gateway": {"cluster_secret", "redis_registry_password", "api_key"},
}


@pytest.mark.parametrize("manifests", MANIFESTS)
@pytest.mark.parametrize("role", ["redis", "prefill", "decode", "gateway"])
def test_secrets_are_files_never_arguments(role: str, manifests: str) -> None:
    documents = documents_of(manifests)
    spec = container(role, documents)
    mounts = {m["mountPath"]: m for m in spec["volumeMounts"]}
    assert mounts["/run/secrets"]["readOnly"] is True
    deployment = by_kind("Deployment", documents)[role]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert {item["key"] for item in volume["secret"]["items"]} == SECRETS_MOUNTED[role]
    assert volume["secret"]["defaultMode"] == 0o440, "readable by the pod's group only"
    words = [str(token) for token in spec.get("args", []) + spec.get("command", [])]
    assert all(urlsplit(word).password is None for word in words if "://" in word), "no credentials in a URL"
    if role != "redis":
        env = {e["name"]: e.get("value") for e in spec["env"]}
        assert env["SPLITSERVE_CLUSTER_SECRET_FILE"] == "/run/secrets/cluster_secret"
        assert env["SPLITSERVE_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_{user}_password"
        words = [word for word in words if word not in FLAGS_NAMING_SECRETS]
        assert not any("secret" in word or "password" in word or "key" in word.lower() for word in words)
    if role == "gateway":
        env = {e["name"]: e.get("value") for e in spec["env"]}
        assert env["SPLITSERVE_API_KEY_FILE"] == "/run/secrets/api_key" and "SPLITSERVE_API_KEY" not in env


def pod_specs(documents: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    return {name: d["spec"]["template"]["spec"] for name, d in by_kind("Deployment", documents).items()}


@pytest.mark.parametrize("manifests", MANIFESTS)
def test_every_container_runs_unprivileged_on_a_read_only_root(manifests: str) -> None:
    for name, pod in pod_specs(documents_of(manifests)).items():
        assert pod.get("automountServiceAccountToken") is False, f"{name}: mounts a service account token"
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        context = pod.get("securityContext", {})
        assert context.get("runAsNonRoot") is True and context.get("runAsUser", 0) > 0, f"{name}: may run as root"
        assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for spec in pod["containers"] + pod.get("initContainers", []):
            security = spec.get("securityContext")
            assert security is not None, f"{name}/{spec['name']}: no securityContext"
            assert security.get("allowPrivilegeEscalation") is False, f"{name}/{spec['name']}"
            assert security.get("readOnlyRootFilesystem") is True, f"{name}/{spec['name']}"
            assert security.get("capabilities") == {"drop": ["ALL"]}, f"{name}/{spec['name']}"
            assert not security.get("privileged") and security.get("runAsUser", 1) != 0, f"{name}/{spec['name']}"
            tmp = {m["mountPath"]: m["name"] for m in spec["volumeMounts"]}.get("/tmp")
            assert tmp is not None and "emptyDir" in volumes[tmp], f"{name}/{spec['name']}: no writable /tmp"


# -------------------------------------------------------------------- network policies

EXTERNAL = None  # a client outside the namespace (or a pod without splitserve's labels)


def pod_labels(documents: list[dict[str, Any]] | None = None) -> dict[str, dict[str, str]]:
    return {name: d["spec"]["template"]["metadata"]["labels"] for name, d in by_kind("Deployment", documents).items()}


def _selects(selector: dict[str, Any], labels: dict[str, str] | None) -> bool:
    if labels is None:
        return False
    assert set(selector) <= {"matchLabels"}, f"the evaluator knows matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _port_range(rule_port: dict[str, Any], target: str, documents: list[dict[str, Any]] | None) -> range:
    """The ports a rule's port entry names: one (a number, or a container port's name) or, with
    ``endPort``, every one from ``port`` to it."""
    port = rule_port["port"]
    if isinstance(port, str):
        containers = pod_specs(documents)[target]["containers"]
        port = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}[port]
    return range(port, rule_port.get("endPort", port) + 1)


def allowed(source: str | None, target: str, port: int, documents: list[dict[str, Any]] | None = None) -> bool:
    """Whether NetworkPolicy lets ``source`` (a Deployment's pods, or EXTERNAL) reach ``target``
    on ``port``: the union of the ingress rules of every policy selecting the target; a pod no
    policy selects takes everything."""
    labels = pod_labels(documents)[target]
    sources = pod_labels(documents).get(source) if source else None
    policies = by_kind("NetworkPolicy", documents).values()
    selecting = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], labels)]
    selecting += [p["spec"] for p in policies if p["spec"]["podSelector"] == {}]
    if not selecting:
        return True
    for policy in selecting:
        assert "Ingress" in policy["policyTypes"] and "namespaceSelector" not in str(policy), policy
        for rule in policy.get("ingress", []):
            peers = rule.get("from")
            ports = rule.get("ports")
            if peers is not None and not any(_selects(peer["podSelector"], sources) for peer in peers):
                continue
            if ports is None or any(port in _port_range(p, target, documents) for p in ports):
                return True
    return False


def test_network_policies_let_in_only_the_paths_the_plane_uses() -> None:
    redis = 6379
    p_grpc, p_kv, d_grpc, d_kv = 50061, 50062, 50071, 50072
    expected = {
        # (source, target, port): who needs it
        (EXTERNAL, "gateway", 8000): True,  # clients, REST
        (EXTERNAL, "gateway", 50051): True,  # clients, gRPC
        ("gateway", "prefill", p_grpc): True,  # Prefill, Abort, ReleaseKV, load, KV events
        ("gateway", "decode", d_grpc): True,  # Decode, Abort, load, KV events
        ("decode", "prefill", p_grpc): True,  # RenewKV, ReleaseKV
        ("decode", "prefill", p_kv): True,  # the pull
        ("prefill", "decode", d_kv): True,
        ("gateway", "redis", redis): True,
        ("prefill", "redis", redis): True,
        ("decode", "redis", redis): True,
        # and nothing else
        (EXTERNAL, "prefill", p_grpc): False,
        (EXTERNAL, "prefill", p_kv): False,
        (EXTERNAL, "decode", d_grpc): False,
        (EXTERNAL, "decode", d_kv): False,
        (EXTERNAL, "redis", redis): False,
        ("gateway", "prefill", p_kv): False,  # the gateway never moves KV
        ("gateway", "decode", d_kv): False,
        ("prefill", "decode", d_grpc): False,  # P never calls D
        ("redis", "prefill", p_grpc): False,
        ("redis", "decode", d_kv): False,
        ("redis", "gateway", 9999): False,
        (EXTERNAL, "gateway", 9999): False,
    }
    found = {path: allowed(*path) for path in expected}
    assert found == expected, {path: found[path] for path in expected if found[path] != expected[path]}


def test_network_policies_open_the_same_paths_to_every_simulated_instance() -> None:
    """Every instance of a pod, up to the 1,000 the port ranges hold, reached as the real
    instance is: on its gRPC and KV ports by exactly the peers that need them."""
    documents = simulated()
    ports = {}
    for role in ("prefill", "decode"):
        args = parse_command([str(token) for token in container(role, documents)["args"]])
        ports[role] = instance_ports(argparse.Namespace(**{**vars(args), "num_instances": MAX_SIMULATED_INSTANCES}))
        assert set(ports[role]) == {"grpc", "kv"}, "no other port: the policies would need to open it"
    paths = {
        # (source, target, kind of port): open?
        ("gateway", "prefill", "grpc"): True,
        ("decode", "prefill", "grpc"): True,
        ("decode", "prefill", "kv"): True,
        ("prefill", "prefill", "kv"): True,
        ("gateway", "decode", "grpc"): True,
        ("prefill", "decode", "kv"): True,
        ("decode", "decode", "kv"): True,
        (EXTERNAL, "prefill", "grpc"): False,
        (EXTERNAL, "prefill", "kv"): False,
        (EXTERNAL, "decode", "grpc"): False,
        (EXTERNAL, "decode", "kv"): False,
        ("gateway", "prefill", "kv"): False,  # the gateway never moves KV
        ("gateway", "decode", "kv"): False,
        ("prefill", "decode", "grpc"): False,  # P never calls D
        ("redis", "prefill", "grpc"): False,
        ("redis", "decode", "kv"): False,
    }
    wrong = {
        (source, target, kind, port)
        for (source, target, kind), expected in paths.items()
        for port in ports[target][kind]
        if allowed(source, target, port, documents) != expected
    }
    assert not wrong, sorted(wrong, key=str)[:10]
    # Just past the ranges: closed, as every port no instance listens on.
    for target in ("prefill", "decode"):
        beyond = max(ports[target]["kv"]) + 1
        assert not allowed("decode", target, beyond, documents), (target, beyond)


def test_the_secret_files_stay_out_of_git() -> None:
    patterns = (ROOT / ".gitignore").read_text().splitlines()
    assert {f"deploy/kubernetes/{name}" for name in SECRET_FILES} <= set(patterns)


def test_redis_runs_its_command_with_two_users_and_no_default_one(tmp_path: Path) -> None:
    """The container's command and readiness probe with the real redis-server (the secrets are files here)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    from launcher.processes import free_port
    from tests.stores import stop, wait_for_port

    for user in ("registry", "kv"):
        (tmp_path / f"redis_{user}_password").write_text(f"k8s-{user}-password\n")
    spec = container("redis")
    assert spec["command"][:2] == ["sh", "-c"]
    port = free_port()
    script = spec["command"][2].replace("/run/secrets/", f"{tmp_path}/")
    server = subprocess.Popen(["sh", "-c", f"{script} --port {port} --bind 127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        wait_for_port(port, server, 10.0)
        refused = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, timeout=10)
        assert "NOAUTH" in refused.stdout + refused.stderr
        probe = spec["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["sh", "-c"]
        ready = probe[2].replace("/run/secrets/", f"{tmp_path}/").replace("redis-cli ", f"redis-cli -p {port} ")
        assert subprocess.run(["sh", "-c", ready], timeout=10).returncode == 0
        kv = subprocess.run(
            ["redis-cli", "-p", str(port), "--user", "kv", "set", "splitserve:instance:forged", "x"],
            env={"REDISCLI_AUTH": "k8s-kv-password", "PATH": "/usr/bin:/bin:/usr/local/bin"},
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert "NOPERM" in kv.stdout + kv.stderr, "the KV store's user may not write registrations"
    finally:
        stop(server)
