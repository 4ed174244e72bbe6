"""``splitserve drain``, the preStop hook of deploy/kubernetes-autoscaling/, against a real
simulated decode instance behind a real gateway: with a stream running on the instance it turns
the instance NOT_SERVING (the gateway stops routing there) and waits; it returns only after the
stream ran to its last token, and the instance then stops on SIGTERM at once, cleanly."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from launcher.processes import splitserve_command
from planner.drain import add_arguments, held, run
from tests.gateway.processes import HTTPProcess
from tests.simulator.cluster import (
    MODEL,
    SimulatedInstances,
    prompt,
    ready_counts,
    registry_gateway,
    wait_for,
    write_profile,
)
from tests.stores import free_port, start_redis, stop

NUM_TOKENS = 300  # some 10 s at the time scale: the drain's decisions fall inside the stream


class Stream(threading.Thread):
    """One streamed completion on its own thread: when its first token came, when it ended, and
    how many tokens it had."""

    def __init__(self, gateway_url: str) -> None:
        super().__init__(daemon=True)
        self.gateway_url = gateway_url
        self.first_token = threading.Event()
        self.done = threading.Event()
        self.completion_tokens: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": MODEL,
            "prompt": prompt(0),
            "max_tokens": NUM_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", f"{self.gateway_url}/v1/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk.get("choices"):
                        self.first_token.set()
                    if chunk.get("usage"):
                        self.completion_tokens = chunk["usage"]["completion_tokens"]
        except BaseException as error:  # the test reads it on its own thread
            self.error = error
        finally:
            self.done.set()


def test_the_drain_hook_returns_only_once_the_instance_holds_nothing(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    redis_process, registry_url = start_redis()
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    started: list[SimulatedInstances | HTTPProcess] = []
    hook: subprocess.Popen[bytes] | None = None
    try:
        started.append(SimulatedInstances("prefill", 1, profile, registry_url, "drain-prefill"))
        decode = SimulatedInstances(
            "decode", 1, profile, registry_url, "drain-decode", "--time-scale", "4", "--metrics-port", str(metrics_port)
        )
        started.append(decode)
        gateway = registry_gateway("gateway-drain", registry_url)
        started.append(gateway)
        wait_for(lambda: ready_counts(gateway.url) == {"prefill": 1, "decode": 1, "colocated": 0}, "both roles up")
        assert held(httpx.get(metrics_url, timeout=5).text) == 0, "idle before the stream"

        stream = Stream(gateway.url)
        stream.start()
        assert stream.first_token.wait(60), f"no first token: {stream.error}"
        assert held(httpx.get(metrics_url, timeout=5).text) > 0, "the stream is held on the instance"
        hook = subprocess.Popen(
            splitserve_command(
                "drain",
                "--pid",
                str(decode.process.pid),
                "--metrics-url",
                metrics_url,
                "--poll-seconds",
                "0.2",
                "--idle-checks",
                "3",
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        # NOT_SERVING: the gateway stops routing to it while the stream goes on there.
        wait_for(lambda: ready_counts(gateway.url).get("decode") == 0, "the gateway to stop routing to decode")
        assert not stream.done.is_set(), "the stream outlasts the drain's start (make NUM_TOKENS larger)"
        assert hook.poll() is None, "the hook returned while a stream was held"

        assert stream.done.wait(120) and stream.error is None, stream.error
        assert stream.completion_tokens == NUM_TOKENS, "the stream ran to its end"
        output = hook.communicate(timeout=60)[0].decode()
        assert hook.returncode == 0, output
        assert held(httpx.get(metrics_url, timeout=5).text) == 0
        assert decode.process.poll() is None, "the hook only drains: Kubernetes' SIGTERM stops the instance"
        assert decode.stop() == 0, decode.log_text()[-3000:]
        assert "not serving new requests" in decode.log_text()
    finally:
        if hook is not None and hook.poll() is None:
            hook.kill()
            hook.wait()
        for process in reversed(started):
            process.stop()
        stop(redis_process)


# A process that blocks both drain signals, says so, and prints the first one it gets.
_SIGNAL_WAITER = """
import signal
signals = {signal.SIGUSR1, signal.SIGUSR2}
signal.pthread_sigmask(signal.SIG_BLOCK, signals)
print("waiting", flush=True)
print(signal.Signals(signal.sigwait(signals)).name, flush=True)
"""


def test_the_hook_sends_sigusr2_to_hand_streams_over_and_sigusr1_otherwise() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    closed_port = free_port()  # nothing listens: the hook returns 1 once it has signalled
    for flags, expected in (([], "SIGUSR1"), (["--hand-over"], "SIGUSR2")):
        waiter = subprocess.Popen([sys.executable, "-c", _SIGNAL_WAITER], stdout=subprocess.PIPE, text=True)
        try:
            assert waiter.stdout is not None and waiter.stdout.readline().strip() == "waiting"
            metrics_url = f"http://127.0.0.1:{closed_port}/metrics"
            args = parser.parse_args([*flags, "--pid", str(waiter.pid), "--metrics-url", metrics_url])
            assert run(args) == 1, "the instance's metrics were unreachable"
            assert waiter.stdout.readline().strip() == expected
            assert waiter.wait(timeout=30) == 0
        finally:
            if waiter.poll() is None:
                waiter.kill()
                waiter.wait()
