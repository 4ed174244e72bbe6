"""``splitserve up`` with tensor parallelism: the official ``openai`` client gets the offline
engine's greedy text from a colocated instance split over two rank processes, from a prefill
instance at TP 2 handing off to a decode instance at TP 1 (2 KV heads, one a rank), and, with 4
and 8 KV heads (2 and 4 a rank), from a prefill instance at TP 1 handing off to a decode
instance at TP 2, each of whose ranks pulls its own heads; a rank killed mid-stream
ends that stream with an error, takes the instance out of service at once, and leaves no
process behind when ``up`` stops."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from launcher.processes import UP_STOP_TIMEOUT_S
from tests.checkpoints import make_checkpoint
from tests.gateway.processes import HTTPProcess
from tests.stores import free_port

MAX_TOKENS = 16
PROMPTS = ["The quick brown fox", "Paris is the capital of"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp-up"), num_attention_heads=4, num_key_value_heads=2)


COLOCATED_TP2 = ("--colocated", "--tensor-parallel-size", "2")


def start_up(model: Path, *layout: str) -> HTTPProcess:
    port = free_port()
    return HTTPProcess(
        "up-tp",
        "up",
        *(layout or COLOCATED_TP2),
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(8 << 20),
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        port=port,
    )


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def wait_until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` until it holds; a minute at the least is a guard, not a timing assertion."""
    for _ in range(600):
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("the condition never held")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_cleanly(up: HTTPProcess) -> None:
    below = descendants(up.process.pid)
    assert up.stop(UP_STOP_TIMEOUT_S) == 0, up.log_text()[-6000:]
    assert not [pid for pid in below if alive(pid)], "splitserve up left processes behind"


@pytest.fixture(scope="module")
def stack(tiny: Path) -> Iterator[HTTPProcess]:
    up = start_up(tiny)
    try:
        yield up
    finally:
        stop_cleanly(up)


def test_greedy_text_equals_the_offline_engine(stack: HTTPProcess, tiny: Path) -> None:
    assert_offline_text(stack, tiny)


def test_prefill_at_tp2_hands_off_to_decode_at_tp1(tiny: Path) -> None:
    up = start_up(tiny, "--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1")
    try:
        assert_offline_text(up, tiny)
    finally:
        stop_cleanly(up)


@pytest.fixture(scope="module", params=[4, 8], ids=lambda n: f"{n}-kv-heads")
def split_heads(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, HTTPProcess]]:
    """A model with 8 query heads and ``request.param`` KV heads, and ``up`` with P at TP 1 and D
    at TP 2: D computes every token after the first with half the KV heads on each rank."""
    num_kv_heads = request.param
    model = make_checkpoint(
        tmp_path_factory.mktemp(f"tp-up-{num_kv_heads}kv"),
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=num_kv_heads,
    )
    up = start_up(model, "--prefill-tensor-parallel-size", "1", "--decode-tensor-parallel-size", "2")
    try:
        yield model, up
    finally:
        stop_cleanly(up)


def test_decode_at_tp2_splits_4_and_8_kv_heads_and_gives_the_offline_text(
    split_heads: tuple[Path, HTTPProcess],
) -> None:
    model, up = split_heads
    assert_offline_text(up, model)


def assert_offline_text(stack: HTTPProcess, tiny: Path) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    with LLM(model=str(tiny), dtype="float32", kv_cache_memory=1 << 22) as offline:
        expected = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, reference in zip(PROMPTS, expected):
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].text == reference.outputs[0].text


def test_a_rank_killed_mid_stream_ends_the_stream_and_the_instance_and_up_leaves_nothing(tiny: Path) -> None:
    up = start_up(tiny)
    below = descendants(up.process.pid)
    try:
        workers = [pid for pid in below if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) == 1, "one worker process: rank 1"
        with httpx.Client(timeout=120) as client:
            body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
            model = client.get(f"{up.url}/v1/models").json()["data"][0]["id"]
            with client.stream("POST", f"{up.url}/v1/completions", json={**body, "model": model}) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                os.kill(workers[0], signal.SIGKILL)
                rest = list(lines)
            # The stream ends with an error event, not a finish: the engine died under it.
            assert any('"error"' in line for line in rest), rest[-3:]
            # The gateway stops routing to the instance once its health says NOT_SERVING.
            wait_until(lambda: client.get(f"{up.url}/ready").status_code != 200)
    finally:
        up.stop()
    assert not [pid for pid in below if alive(pid)], "splitserve up left processes behind"
