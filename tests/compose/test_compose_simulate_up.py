"""compose/docker-compose.simulate.yml for real: the CPU image (test_compose_up.py's), the
stack brought up with podman-compose and the simulate file after the CPU one, as
compose/README.md prints it ("A simulated cluster"): the gateway finds all 8 + 8 simulated
instances of the two containers in Redis and serves a completion and a stream through them
with the ``openai`` client, the KV pulled from a simulated prefill instance by a simulated
decode one; then ``down`` leaves no container.

One stack for the module: one ``up`` and one ``down``. Skipped where test_compose_up.py is
(no podman, podman-compose, runc, debootstrap or root). It adds no image build to a run of
both modules (they build the same image: whichever runs first builds its layers, the other
finds them cached), only an ``up`` of a stack that loads no weights, three requests and a
``down``; each phase's time is logged ("compose test: ... took").
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from launcher.processes import free_port
from tests.compose.test_compose import COMPOSE_DIR, SECRET_FILES, compose_environment
from tests.compose.test_compose_up import (
    BUILD_TIMEOUT_S,
    READY_TIMEOUT_S,
    Stack,
    assert_every_container_stops_on_sigterm,
    missing_runtime,
    scrape,
    wait_until_ready,
)

FILES = ("-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "-f", "docker-compose.simulate.yml")
SERVICES = ("redis", "prefill", "decode", "gateway")
INSTANCES = 8  # a container's, the simulate file's default
FIRST_PORTS = {"prefill": 50061, "decode": 50071}
MODEL = "simulated"  # the simulate file's served model name
REGISTERED_TIMEOUT_S = 120.0  # every instance's heartbeat in Redis and the gateway's next poll

pytestmark = [pytest.mark.containers, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    reason = missing_runtime()
    if reason is not None:
        pytest.skip(reason)
    scratch = tmp_path_factory.mktemp("compose-simulate-up")
    env = {**compose_environment(), "CONTAINERS_CONF": str(COMPOSE_DIR / "containers.conf")}
    for name, (variable, _) in SECRET_FILES.items():
        (scratch / name).write_text(secrets.token_urlsafe(32) + "\n")
        env[variable] = str(scratch / name)
    gateway_port = free_port()
    env |= {"GATEWAY_PUBLISHED_PORT": str(gateway_port), "GATEWAY_GRPC_PUBLISHED_PORT": str(free_port())}
    stack = Stack(
        project=f"splitserve-simulate-test-{os.getpid()}",
        env=env,
        gateway_port=gateway_port,
        prometheus_port=0,  # no observability file here
        api_key=(scratch / "api-key").read_text().strip(),
        files=FILES,
    )
    started = time.monotonic()
    for script in ("local-base.sh", "local-context.sh"):  # images already there are kept
        result = subprocess.run(
            [str(COMPOSE_DIR / script)], env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        assert result.returncode == 0, f"compose/{script}:\n{result.stdout}\n{result.stderr}"
    stack.compose("build", "prefill", timeout_s=BUILD_TIMEOUT_S)
    stack.timed("base images and image build", started)
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


def instances(stack: Stack) -> set[tuple[str, str, bool]]:
    status = httpx.get(f"{stack.url}/status.json", headers=stack.auth, timeout=10).json()
    return {(i["role"], i["address"], i["healthy"]) for i in status["instances"]}


def test_the_gateway_finds_every_simulated_instance_of_both_containers(stack: Stack) -> None:
    expected = {
        (role, f"{role}:{first + index}", True) for role, first in FIRST_PORTS.items() for index in range(INSTANCES)
    }
    started = time.monotonic()
    while (found := instances(stack)) != expected:
        assert time.monotonic() - started < REGISTERED_TIMEOUT_S, (
            f"missing {sorted(expected - found)}, unexpected {sorted(found - expected)}\n{stack.logs('prefill')}"
        )
        time.sleep(1)
    stack.timed("every instance registered after /ready", started)
    running = {service: stack.container_ids(service, all_states=False) for service in SERVICES}
    assert all(len(ids) == 1 for ids in running.values()), f"one container a service: {running}"


def test_a_completion_and_a_stream_run_through_simulated_instances(stack: Stack) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, timeout=120, max_retries=0)
    assert [card.id for card in client.models.list()] == [MODEL]
    prompt = "List the planets of the solar system, one per line, in order from the Sun."
    # A simulated instance never samples EOS: a request runs to its max_tokens.
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 16, reply.usage  # 2+ KV blocks
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8, chunks[-1]
    assert [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason] == ["length"]
    samples = scrape(stack)
    assert samples[("splitserve_kv_transfer_bytes_total", frozenset())] > 0, "no KV pulled from P to D"
    assert samples[("splitserve_kv_recomputes_total", frozenset())] == 0, "D recomputed instead of pulling"


def test_down_leaves_no_container(stack: Stack) -> None:
    assert_every_container_stops_on_sigterm(stack)
    started = time.monotonic()
    stack.compose("down", "-v", timeout_s=300)
    stack.timed("down", started)
    assert stack.container_ids() == []
