"""The local actuator's scale-down on a real decode instance of the tiny model: the planner's
loop drains it (``LocalActuator.drain``) while it holds a stream, then stops it once every
gateway shows it idle. The instance turns NOT_SERVING (the gateway stops routing to it) while
the stream goes on; the stream runs to its last token; the process exits only on the stop,
after the stream, cleanly on SIGTERM; no KV block is left held.

The instances are the actuator's own, started from the command lines ``splitserve planner``
starts real instances with (``planner/instance_commands.py``); the test makes the loop's two
calls itself, at the moments the loop would (``planner/loop.py``, steps 2 and 5), so that the
drain falls inside the stream."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import openai
import pytest

from planner.actuator import LocalActuator, ManagedInstance
from planner.decision import Role
from planner.instance_commands import Registration, real_instance_command, real_instance_environment
from planner.observations import GatewayScraper, InstanceView
from tests.checkpoints import make_checkpoint
from tests.planner.test_up_planner import blocks_held
from tests.services.processes import SERVICE_ENV
from tests.simulator.cluster import SECRET, instance_metrics, ready_counts, registry_gateway, wait_for
from tests.stores import start_redis, stop

# Several seconds of decode on two busy cores: the gateway learns of the stream (a load report
# a heartbeat apart), of the drain (a registry scan apart) and of the end, all inside it.
NUM_TOKENS = 6000
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", str(8 << 20)]


class Stream(threading.Thread):
    """One streamed completion through the real ``openai`` client, on its own thread: its text
    chunks, usage and finish reason, and when it ended."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        super().__init__(daemon=True)
        self.client, self.model = client, model
        self.done = threading.Event()
        self.num_chunks = 0
        self.completion_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model,
                prompt="The quick brown fox",
                max_tokens=NUM_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
                if chunk.choices:
                    self.num_chunks += 1
                    self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
        except BaseException as error:  # the test reads it on its own thread
            self.error = error
        finally:
            self.done.set()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with room for a stream of ``NUM_TOKENS``."""
    return make_checkpoint(tmp_path_factory.mktemp("llama"), max_position_embeddings=8192)


def view_of(gateway_url: str, instance_id: str) -> InstanceView | None:
    """The instance as the planner's loop sees it through the gateway's metrics."""
    scraper = GatewayScraper([gateway_url])
    try:
        return scraper.scrape().instances.get(instance_id)
    finally:
        scraper.close()


@pytest.mark.slow  # a gateway and two real instances of the tiny model on two busy cores
def test_scaling_down_drains_a_real_decode_instance_without_cutting_its_stream(tmp_path: Path, model: Path) -> None:
    redis_process, registry_url = start_redis()
    registration = Registration(registry_url, heartbeat_seconds=0.5, log_level="INFO")  # INFO: the drain's log line

    def command_for(role: Role, instance_id: str) -> list[str]:
        return real_instance_command(role, instance_id, registration, model, ENGINE_FLAGS)

    environment = real_instance_environment({**os.environ, **SERVICE_ENV, "SPLITSERVE_CLUSTER_SECRET": SECRET})
    actuator = LocalActuator(command_for, tmp_path / "instances", env=environment)
    gateway = None
    try:
        prefill, decode = actuator.start("prefill"), actuator.start("decode")
        gateway = registry_gateway("gateway-real-drain", registry_url, "--model", str(model))
        instances = (prefill, decode)
        wait_for(lambda: _routed_or_exited(gateway.url, instances), "both instances up", timeout_s=180)
        for instance in instances:
            actuator.mark_ready(instance)  # as the loop does once every gateway routes to it

        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        stream = Stream(client, client.models.list().data[0].id)
        stream.start()
        # The stream is on the decode instance once its load report shows it running there.
        wait_for(lambda: _running_on(gateway.url, decode) or stream.done.is_set(), "the stream to run on decode")
        assert not stream.done.is_set(), f"the stream ended before the drain (make NUM_TOKENS larger): {stream.error}"

        actuator.drain(decode)  # what the loop calls to shrink the decode pool
        assert decode.process.poll() is None, "the drain stopped the instance"
        # NOT_SERVING: the gateway stops routing to it, while the stream goes on there.
        wait_for(lambda: ready_counts(gateway.url).get("decode") == 0, "the gateway to stop routing to decode")
        assert not stream.done.is_set(), "the stream outlasts the drain's start (make NUM_TOKENS larger)"
        view = view_of(gateway.url, decode.instance_id)
        assert view is not None and not view.idle, "the gateway sees the draining instance, holding the stream"

        # The loop stops a draining instance once the gateways show it idle: only after the stream.
        wait_for(lambda: _idle(gateway.url, decode), "the drained instance to hold nothing", timeout_s=120)
        assert stream.done.is_set(), "idle while the stream still ran"
        assert stream.error is None, stream.error
        assert stream.completion_tokens == NUM_TOKENS and stream.finish_reason == "length", (
            stream.completion_tokens,
            stream.finish_reason,
        )
        assert stream.num_chunks > 1, "streamed, not answered at once"
        assert decode.process.poll() is None, "the instance exits on the actuator's stop, not before"
        assert actuator.stop(decode) == 0, _log_tail(decode)  # 0: stopped on SIGTERM, not killed
        assert "not serving new requests" in _log_tail(decode)

        # The surviving prefill instance keeps no block of the finished request.
        wait_for(lambda: blocks_held(gateway.url) == 0, "the surviving instances to hold no KV block")
        assert [i.instance_id for i in actuator.live()] == [prefill.instance_id]
    finally:
        actuator.stop_all()
        if gateway is not None:
            gateway.stop()
        stop(redis_process)


def _routed_or_exited(gateway_url: str, instances: tuple[ManagedInstance, ...]) -> bool:
    """Whether the gateway routes to each role; an instance that exited fails at once, with its log."""
    for instance in instances:
        if instance.exited:
            raise RuntimeError(f"{instance.instance_id} exited: {_log_tail(instance)}")
    return ready_counts(gateway_url) == {"prefill": 1, "decode": 1, "colocated": 0}


def _running_on(gateway_url: str, instance: ManagedInstance) -> bool:
    return instance_metrics(gateway_url, "num_running").get(instance.instance_id, 0) >= 1


def _idle(gateway_url: str, instance: ManagedInstance) -> bool:
    """The loop's rule for stopping a draining instance (``Planner._update_instances``)."""
    view = view_of(gateway_url, instance.instance_id)
    return view is not None and view.idle


def _log_tail(instance: ManagedInstance) -> str:
    if not instance.log.closed:
        instance.log.flush()
    return Path(instance.log.name).read_text()[-3000:]
