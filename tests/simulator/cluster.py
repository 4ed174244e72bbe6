"""A simulated cluster for tests: ``splitserve simulate`` processes registering in a real Redis,
and what the gateway (a real one, discovering them there) says about them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from launcher.processes import free_port, splitserve_command
from tests.gateway.processes import HTTPProcess
from tests.services.processes import ROOT, SERVICE_ENV
from tests.stores import stop

SECRET = "the-cluster-secret-of-the-simulated-cluster"
MODEL = "SmolLM2-135M-Instruct"  # the embedded model's tokenizer and config; no weights are read

# A GPU-like instance at a test's pace: a decode step of a few rows about 10 ms, a 512-token
# prefill about 40 ms, a pull of a 512-token prompt about 3 ms. Round numbers, not a measurement.
TEST_PROFILE = {
    "name": "test-gpu",
    "source": "round numbers for tests (tests/simulator/cluster.py)",
    "block_size": 16,
    "num_kv_blocks": 4096,
    "kv_bytes_per_token": 131072,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 2048,
    "step_fixed_s": 0.008,
    "token_s": 0.00006,
    "attention_s": 0.0,
    "context_s": 0.0000005,
    "link_bytes_per_s": 25e9,
    "pull_fixed_s": 0.001,
}


def write_profile(folder: Path, **overrides: object) -> Path:
    path = folder / "profile.json"
    path.write_text(json.dumps({**TEST_PROFILE, **overrides}))
    return path


class SimulatedInstances:
    """One ``splitserve simulate ROLE --num-instances N`` process, registering in ``registry_url``."""

    def __init__(self, role: str, num_instances: int, profile: Path, registry_url: str, name: str, *extra: str) -> None:
        self.role = role
        self.name = name
        self.log = open(f"/tmp/splitserve-test-simulate-{name}-{os.getpid()}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            splitserve_command(
                "simulate",
                role,
                "--profile",
                str(profile),
                "--num-instances",
                str(num_instances),
                "--instance-id",
                name,
                "--port",
                "0",
                "--registry-url",
                registry_url,
                "--heartbeat-seconds",
                "0.5",
                *extra,
            ),
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVICE_ENV, "SPLITSERVE_CLUSTER_SECRET": SECRET},
        )

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        returncode = stop(self.process, sig, timeout_s=60)
        self.log.close()
        return returncode


def ready_counts(gateway_url: str) -> dict[str, int]:
    """Healthy instances per role, as the gateway's /ready says."""
    try:
        return httpx.get(f"{gateway_url}/ready", timeout=5.0).json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


def wait_for(condition, what: str, timeout_s: float = 120.0, processes: tuple[SimulatedInstances, ...] = ()):
    """Poll a condition the cluster must bring about; bounded so that a bug fails rather than hangs,
    and a simulation process that died fails at once with its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        for process in processes:
            if process.process.poll() is not None:
                raise RuntimeError(
                    f"{process.name} exited with {process.process.returncode}: {process.log_text()[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.1)


def instance_metrics(gateway_url: str, name: str) -> dict[str, float]:
    """``splitserve_instance_<name>`` by instance id, from the gateway's /metrics (the instances'
    own load reports, as the gateway last received them)."""
    families = text_string_to_metric_families(httpx.get(f"{gateway_url}/metrics", timeout=10.0).text)
    wanted = f"splitserve_instance_{name}"
    values: dict[str, float] = {}
    for family in families:
        if family.name != wanted:
            continue
        for sample in family.samples:
            if sample.name in (wanted, f"{wanted}_total"):
                values[sample.labels["instance"]] = sample.value
    return values


def prompt(index: int, num_words: int = 200) -> str:
    """A prompt of its own (no prefix shared with another index's)."""
    return " ".join(f"w{index}x{i}" for i in range(num_words))


async def stream_completion(client: AsyncOpenAI, text: str, max_tokens: int) -> tuple[int, str | None]:
    """(completion tokens, finish reason) of one streamed completion."""
    num_tokens, finish_reason = 0, None
    stream = await client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
        if chunk.choices:
            finish_reason = chunk.choices[0].finish_reason or finish_reason
    return num_tokens, finish_reason


def registry_gateway(name: str, registry_url: str, *extra: str) -> HTTPProcess:
    """A gateway on a free port routing to what ``registry_url`` lists, polling it often, with
    the simulated cluster's secret; HTTP only unless ``extra`` gives a ``--grpc-port``."""
    port = free_port()
    return HTTPProcess(
        name,
        "gateway",
        "--port", str(port),
        "--grpc-port", "-1",
        "--registry-url", registry_url,
        "--poll-interval", "0.5",
        *extra,  # after the defaults: argparse keeps an option's last value
        port=port,
        env={"SPLITSERVE_CLUSTER_SECRET": SECRET},
        ready_path="/health",
    )  # fmt: skip
