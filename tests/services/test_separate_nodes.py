"""P, D, the gateway and Redis as separate nodes: a network namespace each, joined through a
bridge, links shaped to 10 Gbit/s (tests/netns.py). Nothing reaches another part over
loopback, so every bind and advertised address, the UCX listener, the registry and the KV pull
work as across hosts, with UCX on TCP alone (shared memory would bypass the link).

Skips where network namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from launcher.processes import splitserve_command
from tests.checkpoints import make_checkpoint
from tests.netns import Network, Node, separate_nodes
from tests.services.processes import ROOT
from tests.stores import stop

pytest.importorskip("ucxx")

PARTS = ("registry", "prefill", "decode", "gateway")
# compose's ports: each part's own, so that a loopback connection could only reach another part.
PORTS = {"prefill": (50061, 50062), "decode": (50071, 50072)}  # gRPC, KV
HTTP_PORT, REDIS_PORT = 8000, 6379
# As across hosts: TCP on the namespace's own interface, no shared memory between the processes.
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "UCX_WARN_UNUSED_ENV_VARS": "n"}


@contextmanager
def started(node: Node, name: str, argv: list[str], env: dict[str, str], logs: Path) -> Iterator[subprocess.Popen]:
    log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        node.command(*argv), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
    )
    try:
        yield process
    finally:
        stop(process, timeout_s=30)
        log.close()


def wait_ready(url: str, processes: dict[str, subprocess.Popen], logs: Path, timeout_s: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, process in processes.items():
            if process.poll() is not None:
                raise AssertionError(
                    f"{name} exited with {process.returncode}:\n{(logs / f'{name}.log').read_text()[-3000:]}"
                )
        try:
            reply = httpx.get(f"{url}/ready", timeout=2)
            if reply.status_code == 200:
                return reply.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tails = "\n".join(f"--- {name}\n{(logs / f'{name}.log').read_text()[-2000:]}" for name in processes)
    raise AssertionError(f"{url}/ready never answered 200\n{tails}")


def reachable(node: Node, host: str, port: int) -> bool:
    """Whether a TCP connection from inside ``node`` to host:port succeeds."""
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=2).close()"
    return subprocess.run(node.command(sys.executable, "-c", code), capture_output=True, timeout=30).returncode == 0


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(?P<labels>[^}}]*)\}})? (?P<value>\S+)", line)
        if match and all(f'{key}="{value}"' in (match["labels"] or "") for key, value in labels.items()):
            return float(match["value"])
    raise AssertionError(f"no {name} {labels} in the metrics")


@contextmanager
def serving(nodes: dict[str, Node], model: Path, scratch: Path, kv_cache_memory: int = 1 << 22) -> Iterator[str]:
    """Redis, P, D and the gateway, each on its node; the gateway's URL once it is ready."""
    # Redis requires a password, as in compose: off loopback it refuses everyone otherwise.
    password = secrets.token_urlsafe(16)
    (scratch / "redis-password").write_text(password + "\n")
    env = {
        "SPLITSERVE_CLUSTER_SECRET": secrets.token_urlsafe(32),
        "SPLITSERVE_REDIS_PASSWORD_FILE": str(scratch / "redis-password"),
        "PYTHONUNBUFFERED": "1",
        **UCX_ENV,
        "UCX_NET_DEVICES": "lo" if nodes["decode"].namespace is None else "eth0",
    }
    registry = f"redis://{nodes['registry'].address}:{REDIS_PORT}"
    with ExitStack() as stack:
        processes = {
            "registry": stack.enter_context(
                started(
                    nodes["registry"],
                    "registry",
                    [
                        "redis-server",
                        "--bind",
                        nodes["registry"].address,
                        "--port",
                        str(REDIS_PORT),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--requirepass",
                        password,
                    ],
                    env,
                    scratch,
                )
            ),
        }
        for role in ("prefill", "decode"):
            node, (grpc_port, kv_port) = nodes[role], PORTS[role]
            processes[role] = stack.enter_context(
                started(
                    node,
                    role,
                    splitserve_command(
                        role,
                        "--model",
                        str(model),
                        "--host",
                        node.address,
                        "--port",
                        str(grpc_port),
                        "--kv-port",
                        str(kv_port),
                        "--registry-url",
                        registry,
                        "--kv-cache-memory",
                        str(kv_cache_memory),
                    ),
                    env,
                    scratch,
                )
            )
        gateway = nodes["gateway"]
        processes["gateway"] = stack.enter_context(
            started(
                gateway,
                "gateway",
                splitserve_command(
                    "gateway",
                    "--model",
                    str(model),
                    "--host",
                    gateway.address,
                    "--port",
                    str(HTTP_PORT),
                    "--grpc-port",
                    "-1",
                    "--registry-url",
                    registry,
                    "--poll-interval",
                    "0.2",
                ),
                env,
                scratch,
            )
        )
        url = f"http://{gateway.address}:{HTTP_PORT}"
        wait_ready(url, processes, scratch)
        yield url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Network, str, Path]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    scratch = tmp_path_factory.mktemp("separate-nodes")
    model = make_checkpoint(scratch / "model")
    with separate_nodes(PARTS) as network, serving(network.nodes, model, scratch) as url:
        yield network, url, scratch


def test_parts_reach_each_other_only_through_the_link(cluster: tuple[Network, str, Path]) -> None:
    network, url, _ = cluster
    nodes = network.nodes
    status = httpx.get(f"{url}/status.json", timeout=10).json()
    addresses = {instance["role"]: instance["address"] for instance in status["instances"]}
    assert addresses == {role: f"{nodes[role].address}:{PORTS[role][0]}" for role in PORTS}
    # D dials P's KV listener at P's own address; over loopback there is nothing to dial.
    prefill_kv = PORTS["prefill"][1]
    assert reachable(nodes["decode"], nodes["prefill"].address, prefill_kv)
    assert not reachable(nodes["decode"], "127.0.0.1", prefill_kv)
    assert not reachable(nodes["gateway"], "127.0.0.1", PORTS["prefill"][0])
    assert not reachable(nodes["gateway"], "127.0.0.1", PORTS["decode"][0])
    assert not reachable(nodes["prefill"], "127.0.0.1", REDIS_PORT)
    # gRPC binds only the node's address (--host); the UCX listener binds every interface of
    # its node (ucxx.create_listener takes no address), so it answers on loopback there too.
    assert not reachable(nodes["prefill"], "127.0.0.1", PORTS["prefill"][0])


def test_requests_pull_kv_across_the_link(cluster: tuple[Network, str, Path]) -> None:
    network, url, _ = cluster
    prompt = "Once upon a time, in a land far away, there lived a king who had three daughters and"
    for _ in range(3):
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert metric(text, "splitserve_kv_transfer_bytes_total") > 0
    assert metric(text, "splitserve_kv_recomputes_total") == 0, "D recomputed instead of pulling over the link"
    assert metric(text, "splitserve_kv_transfer_seconds_count") == 3
    # D's own count, as the gateway last heard it from the registry (a heartbeat a second).
    decode_address = f"{network.nodes['decode'].address}:{PORTS['decode'][0]}"
    deadline = time.monotonic() + 120  # a safety net
    while (
        metric(
            httpx.get(f"{url}/metrics", timeout=10).text,
            "splitserve_instance_kv_transfer_bytes_total",
            role="decode",
            address=decode_address,
        )
        == 0
    ):
        assert time.monotonic() < deadline, "D's load reports never counted the pulls"
        time.sleep(0.5)


def pull_times(url: str, prompt_ids: list[int], num_requests: int) -> dict[str, float]:
    """Mean KV pull of ``num_requests`` hand-offs of one prompt, as D timed them (the gateway's
    histogram of D's reported pull seconds), after one untimed warm-up."""
    body = {"prompt": prompt_ids, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json={**body, "cache_salt": "warm-up"}, timeout=300).raise_for_status()
    before = httpx.get(f"{url}/metrics", timeout=10).text
    for index in range(num_requests):
        # A salt per request: no prefix-cache hit on D, every block crosses the link.
        httpx.post(f"{url}/v1/completions", json={**body, "cache_salt": f"run-{index}"}, timeout=300).raise_for_status()
    after = httpx.get(f"{url}/metrics", timeout=10).text
    count = metric(after, "splitserve_kv_transfer_seconds_count") - metric(
        before, "splitserve_kv_transfer_seconds_count"
    )
    seconds = metric(after, "splitserve_kv_transfer_seconds_sum") - metric(before, "splitserve_kv_transfer_seconds_sum")
    num_bytes = metric(after, "splitserve_kv_transfer_bytes_total") - metric(
        before, "splitserve_kv_transfer_bytes_total"
    )
    assert count == num_requests and metric(after, "splitserve_kv_recomputes_total") == 0
    return {
        "pulls": count,
        "mib_per_pull": num_bytes / count / 2**20,
        "ms_per_pull": 1000 * seconds / count,
        "gbit_per_s": 8 * num_bytes / seconds / 1e9,
    }


@pytest.mark.skipif(
    not os.environ.get("SPLITSERVE_NETNS_BENCH"), reason="a measurement: SPLITSERVE_NETNS_BENCH=results.json runs it"
)
def test_measure_pulls_across_the_link_beside_loopback(tmp_path: Path) -> None:
    """docs/benchmarks.md: the embedded SmolLM2-135M (float32 KV), prompts of 256 and 1024
    tokens, the same pulls with the parts as separate nodes and on loopback (UCX on TCP both)."""
    from engine.default_model import default_model_path

    model = default_model_path()
    results = {}
    loopback = {part: Node(None, "127.0.0.1") for part in PARTS}
    for setup in ("separate nodes", "loopback"):
        scratch = tmp_path / setup.replace(" ", "-")
        scratch.mkdir()
        with ExitStack() as stack:
            nodes = stack.enter_context(separate_nodes(PARTS)).nodes if setup == "separate nodes" else loopback
            url = stack.enter_context(serving(nodes, model, scratch, kv_cache_memory=512 << 20))
            for num_tokens in (256, 1024):
                results[f"{setup}, {num_tokens} tokens"] = pull_times(
                    url, [(7 * i) % 40000 + 100 for i in range(num_tokens)], 10
                )
    Path(os.environ["SPLITSERVE_NETNS_BENCH"]).write_text(json.dumps(results, indent=2) + "\n")
