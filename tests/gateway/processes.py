"""HTTP-serving processes for the gateway tests: ``splitserve up`` and ``splitserve
gateway``, started on free loopback ports and stopped (SIGTERM) by the test; the flags
that route a gateway to instance processes, completions streamed a few chunks at a time,
and a stream whose decode instance is killed under it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from launcher.processes import splitserve_command
from tests.services.processes import ROOT, SERVICE_ENV, Service
from tests.stores import free_port, stop


class HTTPProcess:
    def __init__(
        self, name: str, *argv: str, port: int, env: dict[str, str] | None = None, ready_path: str = "/ready"
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/splitserve-test-{name}-{port}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            splitserve_command(*argv),
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVICE_ENV, **(env or {})},
        )
        self._wait(ready_path)

    def _wait(self, path: str, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode}: {self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{self.url}{path} not answering 200 after {timeout_s} s: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self, timeout_s: float = 60.0) -> int:
        returncode = stop(self.process, timeout_s=timeout_s)
        self.log.close()
        return returncode


def routes(*instances: Service) -> list[str]:
    """The gateway flags that route to these instances (``--prefill ADDRESS``, ``--decode ADDRESS``, ...)."""
    return [arg for instance in instances for arg in (f"--{instance.role}", instance.address)]


@contextmanager
def running_gateway(
    model: Path, *extra: str, ready_path: str = "/ready", env: dict[str, str] | None = None
) -> Iterator[HTTPProcess]:
    port = free_port()
    gateway = HTTPProcess(
        "gateway",
        "gateway",
        "--model",
        str(model),
        "--port",
        str(port),
        "--grpc-port",
        "-1",
        "--poll-interval",
        "0.2",
        *extra,
        port=port,
        env=env,
        ready_path=ready_path,
    )
    try:
        yield gateway
    finally:
        gateway.stop()


def stream_until(url: str, body: dict[str, object], num_chunks: int) -> tuple[httpx.Client, httpx.Response]:
    """Open a streaming completion and read a few chunks; the caller closes it."""
    client = httpx.Client(timeout=120)
    response = client.send(
        client.build_request("POST", f"{url}/v1/completions", json={**body, "stream": True}), stream=True
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    seen = 0
    while seen < num_chunks:
        if next(lines).startswith("data: {"):
            seen += 1
    response.lines = lines  # type: ignore[attr-defined] - the rest of the stream, for the caller
    return client, response


def finish_stream(response: httpx.Response) -> list[dict[str, object]]:
    """The rest of a :func:`stream_until` stream, its chunks parsed."""
    events = []
    for line in response.lines:  # type: ignore[attr-defined]
        if line.startswith("data: {"):
            events.append(json.loads(line.removeprefix("data: ")))
    return events


def stream_killing_decode(
    gateway: HTTPProcess,
    decodes: list[Service],
    body: dict[str, object],
    after_chunks: int,
    headers: dict[str, str] | None = None,
    signum: int = signal.SIGKILL,
) -> tuple[list[dict[str, object]], Service]:
    """Stream ``body``, SIGKILL (or send ``signum`` to) the one of ``decodes`` serving it once
    ``after_chunks`` chunks arrived; return every chunk of the stream and the instance that
    was not signalled."""
    chunks: list[dict[str, object]] = []
    survivor = None
    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST", f"{gateway.url}/v1/completions", json={**body, "stream": True}, headers=headers
        ) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line.removeprefix("data: ")))
            if len(chunks) == after_chunks:
                running_on = [d.load().num_running for d in decodes]
                assert sorted(running_on) == [0, 1], running_on
                victim = decodes[running_on.index(1)]
                survivor = decodes[running_on.index(0)]
                if signum == signal.SIGKILL:
                    victim.stop(signal.SIGKILL)
                else:
                    victim.process.send_signal(signum)
    assert survivor is not None, "the stream ended before the signal"
    return chunks, survivor


def gateway_migrations(url: str) -> dict[str, float]:
    """The gateway's ``splitserve_migrations_total`` by outcome (resumed, exhausted, handed_over, ...)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r'splitserve_migrations_total\{outcome="(\w+)"\} (\S+)', text)}
