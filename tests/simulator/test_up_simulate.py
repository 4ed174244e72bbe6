"""``splitserve up --simulate``: the gateway and two ``splitserve simulate`` processes holding
12 prefill and 12 decode instances, found through the Redis ``up`` starts; the openai client
gets an answer of the requested length; Ctrl-C (SIGINT) stops everything it started."""

from __future__ import annotations

import signal
from pathlib import Path

import openai

from launcher.processes import UP_STOP_TIMEOUT_S
from tests.gateway.processes import HTTPProcess
from tests.gateway.test_tensor_parallel_up import alive, descendants
from tests.simulator.cluster import ready_counts, wait_for, write_profile
from tests.stores import free_port


def test_up_simulate_serves_a_dozen_of_each_role_and_stops_them_all(tmp_path: Path) -> None:
    port = free_port()
    up = HTTPProcess(
        "up-simulate",
        "up",
        "--simulate",
        "--simulate-profile",
        str(write_profile(tmp_path)),
        "--num-prefill",
        "12",
        "--num-decode",
        "12",
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        port=port,
    )
    below = descendants(up.process.pid)
    try:
        wait_for(lambda: ready_counts(up.url) == {"prefill": 12, "decode": 12, "colocated": 0}, "12 of each role")
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 16
        assert reply.choices[0].finish_reason == "length"
    finally:
        below = below or descendants(up.process.pid)
        up.process.send_signal(signal.SIGINT)
        assert up.stop(UP_STOP_TIMEOUT_S) == 0, up.log_text()[-6000:]
    assert below and not [pid for pid in below if alive(pid)], "splitserve up --simulate left processes behind"
