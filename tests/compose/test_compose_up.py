"""compose/ for real: the CPU image built, the stack brought up with podman-compose as
compose/README.md prints it ("Without a registry"), served through the ``openai`` client,
Prometheus scraping every target, the status page listing both containers, the decode
container killed and brought back by its restart policy and routed to again, then taken down.

Skipped where there is no container runtime to do it with (podman, podman-compose, runc,
debootstrap, root); ``.ci/run`` installs them. Measured on a shared 2-core VM: cold (no local
images, empty layer cache) about 18 minutes: the base images from the Debian mirror 4 min, the
image build 8 to 12 min (pip installing the dependencies from PyPI), then 1.5 min of test;
warm (the images in podman's store, a source change) 2 to 4 min: the source layers rebuilt,
`up` until ``/ready`` 50 to 65 s, the decode container back 9 s after its process is killed,
``down`` 2 to 7 s. The base images stay in podman's store between runs, and the dependency
layer stays cached across edits to pyproject.toml that leave the dependency list alone.

The stack runs under a project name of its own, with its secrets in a temporary folder and
the gateway on free host ports, so that it never touches a developer's ``compose/`` stack;
``down`` runs whatever happens, and any container of the project left after it is removed
by id.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from launcher.processes import free_port
from tests.compose.test_compose import COMPOSE_DIR, SECRET_FILES, compose_environment

DASHBOARD = COMPOSE_DIR / "grafana" / "dashboards" / "splitserve.json"

logger = logging.getLogger(__name__)

TOOLS = ("podman", "podman-compose", "runc", "debootstrap")
FILES = ("-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "-f", "docker-compose.observability.yml")
# Grafana's image is in no registry reachable here (its dashboard is checked in test_observability.py).
SERVICES = ("redis", "prefill", "decode", "gateway", "prometheus")
BUILD_TIMEOUT_S = 1800.0  # a cold image build on a busy 2-core machine
READY_TIMEOUT_S = 600.0  # loading the model and warming up P, on 2 shared cores
RESTART_TIMEOUT_S = 300.0

pytestmark = [pytest.mark.containers, pytest.mark.timeout(3600)]


def missing_runtime() -> str | None:
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"no container runtime to run compose/ with: {', '.join(absent)} not installed (.ci/run installs them)"
    if os.geteuid() != 0:
        return "debootstrap and rootful podman need root"
    return None


@dataclass(slots=True)
class Stack:
    """One podman-compose project of compose/'s CPU stack."""

    project: str
    env: dict[str, str]
    gateway_port: int
    prometheus_port: int
    api_key: str
    timings: dict[str, float] = field(default_factory=dict)
    files: tuple[str, ...] = FILES  # the -f arguments

    def compose(self, *args: str, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
        argv = ["podman-compose", "--env-file", "local.env", "-p", self.project, *self.files, *args]
        result = subprocess.run(argv, cwd=COMPOSE_DIR, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited with {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        return result

    def podman(self, *args: str, check: bool = True) -> str:
        result = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {result.stderr}")
        return result.stdout.strip()

    def container_ids(self, service: str | None = None, all_states: bool = True) -> list[str]:
        filters = ["--filter", f"label=io.podman.compose.project={self.project}"]
        if service is not None:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.podman("ps", *(["-a"] if all_states else []), "-q", "--no-trunc", *filters).split()

    def inspect(self, container_id: str) -> dict:
        return json.loads(self.podman("inspect", container_id))[0]

    def container_logs(self, container: str, lines: int) -> str:
        """A container's last lines, both its streams: podman logs writes what the container wrote to
        stderr (Python's logging) to its own stderr."""
        result = subprocess.run(
            ["podman", "logs", "--tail", str(lines), container],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        return result.stdout.strip()

    def logs(self, service: str) -> str:
        return "\n".join(self.container_logs(cid, 40) for cid in self.container_ids(service))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def timed(self, phase: str, started: float) -> None:
        self.timings[phase] = time.monotonic() - started
        logger.warning("compose test: %s took %.1f s", phase, self.timings[phase])


def assert_every_container_stops_on_sigterm(stack: Stack) -> None:
    """``stop`` every container: podman sends SIGTERM, and SIGKILL (exit code 137) to one still
    running at its stop timeout, so an exit code other than 137 says it ended on SIGTERM."""
    running = stack.container_ids(all_states=False)
    started = time.monotonic()
    stack.compose("stop", timeout_s=300)
    stack.timed("stop", started)
    states = {stack.inspect(cid)["Name"]: stack.inspect(cid)["State"] for cid in running}
    killed = {name: state["ExitCode"] for name, state in states.items() if state["ExitCode"] == 137}
    last_words = {name: stack.container_logs(name, 30) for name in killed}
    assert running and not killed, f"ignored SIGTERM until killed: {killed}; their last lines: {last_words}"
    assert not any(state["Running"] for state in states.values()), states


def wait_until_ready(stack: Stack, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    body: dict | str = "no answer"
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(f"{stack.url}/ready", timeout=5)
            body = reply.json()
            if reply.status_code == 200:
                return body
        except (httpx.HTTPError, ValueError) as error:
            body = repr(error)
        time.sleep(2)
    logs = "\n".join(f"--- {service}\n{stack.logs(service)}" for service in ("prefill", "decode", "gateway"))
    raise AssertionError(f"the gateway is not ready after {timeout_s:.0f} s: {body}\n{logs}")


def scrape(stack: Stack) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The gateway's /metrics as {(name, labels): value}."""
    samples = {}
    for line in httpx.get(f"{stack.url}/metrics", timeout=10).text.splitlines():
        match = re.fullmatch(r"(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)", line)
        if match is None or line.startswith("#"):
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
        samples[(match["name"], labels)] = float(match["value"])
    return samples


def instance_samples(samples: dict, name: str, role: str) -> dict[str, float]:
    """{instance id: value} of one per-instance series for a role."""
    return {
        dict(labels)["instance"]: value
        for (sample, labels), value in samples.items()
        if sample == name and dict(labels).get("role") == role
    }


def is_ready(stack: Stack) -> bool:
    return httpx.get(f"{stack.url}/ready", timeout=10).status_code == 200


def cluster_view(stack: Stack) -> str:
    """What the gateway makes of its instances now, and the last lines of each service's log."""
    samples = scrape(stack)
    healthy = {role: instance_samples(samples, "splitserve_instance_healthy", role) for role in ("prefill", "decode")}
    logs = "\n".join(f"--- {service}\n{stack.logs(service)}" for service in ("gateway", "prefill", "decode"))
    return f"healthy instances as the gateway sees them now: {healthy}; /ready {is_ready(stack)}\n{logs}"


def chat_and_stream(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, timeout=300, max_retries=0)
    (model,) = [card.id for card in client.models.list()]  # compose serves the model under its folder's path
    prompt = "List the planets of the solar system, one per line, in order from the Sun."
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16,
        temperature=0,
    )
    assert reply.choices[0].message.content, reply
    assert reply.usage.completion_tokens > 1 and reply.usage.prompt_tokens > 16, (
        reply.usage
    )  # more than one KV block moved
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([piece for piece in pieces if piece]) > 1, pieces
    assert "".join(pieces) == reply.choices[0].message.content, "greedy streaming differs from the non-streaming reply"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    reason = missing_runtime()
    if reason is not None:
        pytest.skip(reason)
    scratch = tmp_path_factory.mktemp("compose-up")
    env = {**compose_environment(), "CONTAINERS_CONF": str(COMPOSE_DIR / "containers.conf")}
    for name, (variable, _) in SECRET_FILES.items():  # as compose/README.md has them made: 0644
        (scratch / name).write_text(secrets.token_urlsafe(32) + "\n")
        env[variable] = str(scratch / name)
    env |= {
        # Less than the CPU file's 1 GiB each: enough for these requests, kinder to a shared CI box.
        "KV_CACHE_MEMORY": str(256 * 1024 * 1024),
    }
    # Free host ports; inside the containers the defaults, which prometheus.yml scrapes.
    gateway_port, prometheus_port = free_port(), free_port()
    env |= {
        "GATEWAY_PUBLISHED_PORT": str(gateway_port),
        "GATEWAY_GRPC_PUBLISHED_PORT": str(free_port()),
        "PROMETHEUS_PUBLISHED_PORT": str(prometheus_port),
    }
    stack = Stack(
        project=f"splitserve-test-{os.getpid()}",
        env=env,
        gateway_port=gateway_port,
        prometheus_port=prometheus_port,
        api_key=(scratch / "api-key").read_text().strip(),
    )

    started = time.monotonic()
    for script in ("local-base.sh", "local-context.sh"):
        result = subprocess.run(
            [str(COMPOSE_DIR / script)], env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        assert result.returncode == 0, f"compose/{script}:\n{result.stdout}\n{result.stderr}"
    stack.timed("local base images", started)
    started = time.monotonic()
    # One service: P, D and the gateway run the same image, and podman-compose would build it
    # once per service, at the same time.
    stack.compose("build", "prefill", timeout_s=BUILD_TIMEOUT_S)
    stack.timed("image build", started)
    try:
        started = time.monotonic()
        stack.compose("up", "-d", *SERVICES)
        wait_until_ready(stack, READY_TIMEOUT_S)
        stack.timed("up until /ready", started)
        yield stack
    finally:
        started = time.monotonic()
        try:
            stack.compose("down", "-v", timeout_s=300)
        finally:
            for container_id in stack.container_ids():
                stack.podman("rm", "-f", "-t", "0", container_id, check=False)
            stack.timed("down", started)


def test_chat_and_streaming_run_through_prefill_and_decode_containers(stack: Stack) -> None:
    chat_and_stream(stack)
    running = {service: stack.container_ids(service, all_states=False) for service in SERVICES}
    assert all(len(ids) == 1 for ids in running.values()), running
    assert running["prefill"] != running["decode"]
    samples = scrape(stack)
    # The gateway reaches P and D by their service names across the compose network.
    addresses = {
        dict(labels)["role"]: dict(labels)["address"]
        for (name, labels) in samples
        if name == "splitserve_instance_healthy"
    }
    assert addresses == {"prefill": "prefill:50061", "decode": "decode:50071"}, addresses
    assert samples[("splitserve_kv_transfer_bytes_total", frozenset())] > 0, "no KV moved from P to D"
    # D's own count, as the gateway last heard it (a heartbeat a second).
    deadline = time.monotonic() + 120  # a safety net
    while not all(instance_samples(scrape(stack), "splitserve_instance_kv_transfer_bytes_total", "decode").values()):
        assert time.monotonic() < deadline, "the decode container's load reports never counted a pull"
        time.sleep(0.5)
    assert samples[("splitserve_kv_recomputes_total", frozenset())] == 0, "D recomputed instead of pulling"


def test_prometheus_scrapes_every_target_and_the_dashboard_series_arrive(stack: Stack) -> None:
    prometheus = f"http://127.0.0.1:{stack.prometheus_port}/api/v1"
    # The planner's row stays empty here: this stack runs no planner (deploy/kubernetes-autoscaling does).
    wanted = {name for name in re.findall(r"splitserve_\w+", DASHBOARD.read_text()) if "_planner_" not in name}
    deadline = time.monotonic() + 60  # a scrape every 5 s
    while True:
        targets = httpx.get(f"{prometheus}/targets", timeout=10).json()["data"]["activeTargets"]
        health = {target["labels"]["component"]: target["health"] for target in targets}
        names = set(httpx.get(f"{prometheus}/label/__name__/values", timeout=10).json()["data"])
        if health == {"gateway": "up", "prefill": "up", "decode": "up"} and wanted <= names:
            break
        assert time.monotonic() < deadline, (
            f"targets {health}; series the dashboard needs and Prometheus lacks: {sorted(wanted - names)}"
        )
        time.sleep(2)
    # The instances' own series, per instance: D's pulls as D counts them. The series exist from
    # D's first scrape on, which may predate the requests above: wait for a scrape after them.
    while True:
        result = httpx.get(
            f"{prometheus}/query",
            params={"query": 'splitserve_engine_kv_transfer_bytes_total{role="decode"}'},
            timeout=10,
        ).json()
        pulled = [float(sample["value"][1]) for sample in result["data"]["result"]]
        if pulled and pulled[0] > 0:
            break
        assert time.monotonic() < deadline, f"Prometheus has D's KV transfer bytes as {pulled}"
        time.sleep(2)


def test_status_page_lists_both_containers(stack: Stack) -> None:
    status = httpx.get(f"{stack.url}/status.json", headers=stack.auth, timeout=10).json()
    assert {(i["role"], i["address"], i["healthy"]) for i in status["instances"]} == {
        ("prefill", "prefill:50061", True),
        ("decode", "decode:50071", True),
    }
    assert status["ttft"] and status["itl"], "the requests above drew no latency points"
    shot = os.environ.get("SPLITSERVE_STATUS_SCREENSHOT")
    if shot:  # docs/images/status-page.png comes from here: the real model in real containers
        from tests.browser import headless_chromium

        with headless_chromium() as browser:
            browser.open(f"{stack.url}/status")
            browser.wait_for("return document.querySelectorAll('#instances tr[data-healthy=\"true\"]').length === 2;")
            browser.screenshot(Path(shot))


def test_killed_decode_container_is_restarted_and_routed_to_again(stack: Stack) -> None:
    (decode,) = stack.container_ids("decode", all_states=False)
    before = instance_samples(scrape(stack), "splitserve_instance_healthy", "decode")
    restarts = stack.inspect(decode)["RestartCount"]
    started = time.monotonic()
    # As a crash or the OOM killer would: `podman kill` counts as stopped by the user, after which
    # podman (as docker with unless-stopped) restarts nothing. The container's init (init: true)
    # is State.Pid; splitserve is its child.
    init_pid = stack.inspect(decode)["State"]["Pid"]
    (decode_pid,) = subprocess.run(
        ["pgrep", "-P", str(init_pid)], capture_output=True, text=True, check=True
    ).stdout.split()
    os.kill(int(decode_pid), signal.SIGKILL)
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        state = stack.inspect(decode)
        if state["RestartCount"] > restarts and state["State"]["Running"]:
            break
        assert time.monotonic() < deadline, f"the decode container was not restarted: {state['State']}"
        time.sleep(1)
    # The restarted D registers under a new instance id; the gateway routes to it once healthy,
    # and says so at /ready (a P and a D it can pair), as a load balancer in front would ask.
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        healthy = instance_samples(scrape(stack), "splitserve_instance_healthy", "decode")
        if any(instance not in before and value == 1 for instance, value in healthy.items()) and is_ready(stack):
            break
        assert time.monotonic() < deadline, (
            f"the gateway never saw the restarted decode instance: {healthy}\n{stack.logs('decode')}"
        )
        time.sleep(1)
    stack.timed("decode back after kill", started)
    transferred = scrape(stack)[("splitserve_kv_transfer_bytes_total", frozenset())]
    try:
        chat_and_stream(stack)
    except openai.APIError as error:
        raise AssertionError(f"the first requests after the restart failed: {error}\n{cluster_view(stack)}") from error
    samples = scrape(stack)
    assert samples[("splitserve_kv_transfer_bytes_total", frozenset())] > transferred
    deadline = time.monotonic() + 120  # a safety net
    while True:
        pulled = {
            i: v
            for i, v in instance_samples(scrape(stack), "splitserve_instance_kv_transfer_bytes_total", "decode").items()
            if i not in before
        }
        if pulled and all(pulled.values()):
            break
        assert time.monotonic() < deadline, f"the restarted decode instance pulled no KV: {pulled}"
        time.sleep(0.5)


def test_down_leaves_no_container(stack: Stack) -> None:
    assert_every_container_stops_on_sigterm(stack)
    started = time.monotonic()
    stack.compose("down", "-v", timeout_s=300)
    stack.timed("down", started)
    assert stack.container_ids() == []
