"""The gateway routing over real prefill and decode processes (tiny random model,
UCX on loopback): load spreads over two decode instances, a killed decode
instance loses no request, a client that
leaves frees every block at once, registration through Redis, and the 429 /
503 answers. After each scenario every instance reports all KV blocks free."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.gateway.processes import finish_stream, routes, running_gateway, stream_until
from tests.services.client import assert_all_free
from tests.services.processes import Service, running
from tests.stores import free_port

pytest.importorskip("ucxx")

# This model decodes some 1,300 tokens a second per stream, and a stream a test holds open
# must outlast its checks.
LONG = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 960, "ignore_eos": True, "temperature": 0}
# A stream the test ends itself (by leaving) before it would finish: some 3 s of decoding, several
# times what the checks around it take; it needs the module's model to allow a longer context.
HELD = {**LONG, "max_tokens": 4000}
SHORT = {"prompt": "The capital of France is", "max_tokens": 16, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 4,096-token context, for :data:`HELD` (35 prompt tokens + 4,000)."""
    return make_checkpoint(tmp_path_factory.mktemp("llama"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def decodes(model: Path) -> Iterator[tuple[Service, Service]]:
    with running("decode", model) as first, running("decode", model) as second:
        yield first, second


def _complete(url: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_load_spreads_over_two_decode_instances(
    model: Path, prefill: Service, decodes: tuple[Service, Service]
) -> None:
    before = [d.load().kv_transfers for d in decodes]
    with running_gateway(model, *routes(prefill, *decodes)) as gateway, ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: _complete(gateway.url, {**SHORT, "max_tokens": 48}), range(8)))
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48 for r in responses)
    served = [d.load().kv_transfers - b for d, b in zip(decodes, before, strict=True)]
    assert sum(served) == 8 and min(served) >= 2, f"decode instances served {served}"
    assert_all_free(prefill, *decodes)


def test_client_disconnect_frees_blocks_at_once(
    model: Path, prefill: Service, decodes: tuple[Service, Service]
) -> None:
    with running_gateway(model, *routes(prefill, *decodes)) as gateway:
        steps_before = sum(d.load().counters.num_steps for d in decodes)
        expiries_before = prefill.load().counters.num_lease_expiries
        client, response = stream_until(gateway.url, HELD, num_chunks=3)
        assert sum(d.load().num_running for d in decodes) == 1
        response.close()
        client.close()
        for service in (prefill, *decodes):
            report = service.wait_all_free(timeout_s=120.0)  # a safety net: the abort frees them
            assert report.num_free_blocks == report.num_total_blocks and report.num_running == 0, service.address
        # Freed because the request was aborted, not because it ran out its tokens (D decodes all
        # but P's first, a step each) nor because P's lease on the KV expired.
        num_steps = sum(d.load().counters.num_steps for d in decodes) - steps_before
        assert num_steps < HELD["max_tokens"] - 1, num_steps
        assert prefill.load().counters.num_lease_expiries == expiries_before
        # The gateway keeps serving.
        assert _complete(gateway.url, SHORT).status_code == 200
    assert_all_free(prefill, *decodes)


def test_killed_decode_instance_loses_no_request(model: Path, prefill: Service) -> None:
    # running() stops both at the end; stopping the killed one again is a no-op.
    with running("decode", model) as first, running("decode", model) as second:
        decodes = [first, second]
        # Slow polling: the gateway still believes the victim healthy when requests reach it,
        # so the hand-off itself must fail over to the survivor.
        with running_gateway(
            model, *routes(prefill, *decodes), "--poll-interval", "5", "--stale-after", "60"
        ) as gateway:
            # Opened together, so that they are all still decoding when the victim is killed
            # (400-token streams opened one after another had finished by then).
            with ThreadPoolExecutor(4) as pool:
                streams = list(pool.map(lambda _: stream_until(gateway.url, LONG, num_chunks=2), range(4)))
            running_on = [d.load().num_running for d in decodes]
            assert min(running_on) >= 1, running_on  # both decoding when one is killed
            victim, survivor = decodes
            victim.stop(signal.SIGKILL)
            with ThreadPoolExecutor(6) as pool:
                after = list(pool.map(lambda _: _complete(gateway.url, SHORT), range(6)))
            assert [r.status_code for r in after] == [200] * 6, [r.text for r in after]
            assert all(r.json()["usage"]["completion_tokens"] == SHORT["max_tokens"] for r in after)
            outcomes = []
            for client, response in streams:
                events = finish_stream(response)
                client.close()
                outcomes.append("error" if "error" in events[-1] else events[-1]["choices"][0]["finish_reason"])
            # Those decoding on the victim migrate to the survivor (tests/gateway/test_migration.py): all finish.
            assert outcomes == ["length"] * 4, outcomes
            assert httpx.get(f"{gateway.url}/ready").status_code == 200
        assert_all_free(prefill, survivor)


def test_queue_full_gets_429(model: Path, prefill: Service, decodes: tuple[Service, Service]) -> None:
    with running_gateway(model, *routes(prefill, *decodes), "--max-pending-requests", "1") as gateway:
        client, response = stream_until(gateway.url, LONG, num_chunks=1)
        refused = _complete(gateway.url, SHORT)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        response.close()
        client.close()
        deadline = time.monotonic() + 120  # a safety net
        while (answer := _complete(gateway.url, SHORT)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answer.status_code == 200
    assert_all_free(prefill, *decodes)


def test_no_healthy_instance_gets_503(model: Path) -> None:
    nowhere = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with running_gateway(model, "--prefill", nowhere[0], "--decode", nowhere[1], ready_path="/health") as gateway:
        assert httpx.get(f"{gateway.url}/ready").status_code == 503
        answer = _complete(gateway.url, SHORT)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_healthy_instance"


def test_mismatched_fingerprints_are_never_paired(tmp_path: Path, model: Path, prefill: Service) -> None:
    other = make_checkpoint(tmp_path / "other", seed=1)
    with (
        running("decode", other) as decode,
        running_gateway(model, *routes(prefill, decode), ready_path="/health") as gateway,
    ):
        time.sleep(0.5)  # a poll or two
        assert httpx.get(f"{gateway.url}/ready").status_code == 503
        assert _complete(gateway.url, SHORT).status_code == 503


def test_instances_found_through_redis(model: Path, redis_url: str) -> None:
    registry = ["--registry-url", redis_url, "--heartbeat-seconds", "0.2"]
    with running("prefill", model, *registry) as prefill, running("decode", model, *registry) as decode:
        with running_gateway(model, "--registry-url", redis_url) as gateway:
            answer = _complete(gateway.url, SHORT)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == SHORT["max_tokens"]
            assert decode.load().kv_transfers == 1
            decode.stop()  # deregisters while draining
            deadline = time.monotonic() + 120  # a safety net
            while httpx.get(f"{gateway.url}/ready").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert httpx.get(f"{gateway.url}/ready").status_code == 503
        assert_all_free(prefill)


def test_colocated_instance_gives_the_disaggregated_text(
    model: Path, prefill: Service, decodes: tuple[Service, Service]
) -> None:
    body = {**SHORT, "max_tokens": 40, "logprobs": 1}
    with running_gateway(model, *routes(prefill, *decodes)) as gateway:
        disaggregated = _complete(gateway.url, body).json()
    with running("colocated", model) as colocated, running_gateway(model, "--colocated", colocated.address) as gateway:
        answer = _complete(gateway.url, body).json()
        streamed = [
            json.loads(line.removeprefix("data: "))
            for line in httpx.post(
                f"{gateway.url}/v1/completions", json={**body, "stream": True}, timeout=60
            ).text.splitlines()
            if line.startswith("data: {")
        ]
        assert_all_free(colocated)
    assert answer["choices"][0]["text"] == disaggregated["choices"][0]["text"]
    assert answer["choices"][0]["logprobs"]["tokens"] == disaggregated["choices"][0]["logprobs"]["tokens"]
    assert answer["usage"] == disaggregated["usage"]
    assert "".join(chunk["choices"][0]["text"] for chunk in streamed) == answer["choices"][0]["text"]


def test_first_token_streams_before_decode_starts(model: Path, prefill: Service) -> None:
    # A decode instance that runs one request at a time: the second request's first token
    # (from prefill) must reach the client while decode is still busy with the first, and the
    # rest only once the first lets decode go. The test decides when that is (the busy client
    # leaves), so the check holds however fast the model decodes.
    with (
        running("decode", model, "--max-num-seqs", "1") as decode,
        running_gateway(model, *routes(prefill, decode)) as gateway,
        ThreadPoolExecutor(1) as reader,
    ):
        busy_client, busy = stream_until(gateway.url, HELD, num_chunks=2)
        client = httpx.Client(timeout=120)
        with client.stream("POST", f"{gateway.url}/v1/completions", json={**SHORT, "stream": True}) as response:
            chunks = (line for line in response.iter_lines() if line.startswith("data: {"))
            next(chunks)
            first_at = time.monotonic()
            # The Decode call may still be on its way; once it lands it must queue behind the first request.
            while (report := decode.load()).num_waiting == 0 and time.monotonic() - first_at < 120.0:  # safety net
                time.sleep(0.02)
            assert (report.num_running, report.num_waiting) == (1, 1), (
                "decode should still be busy with the first request"
            )
            second = reader.submit(next, chunks)
            time.sleep(0.5)
            assert not second.done(), "a decode token arrived while decode was busy with another request"
            report = decode.load()
            assert (report.num_running, report.num_waiting) == (1, 1), "the busy request ended on its own too soon"
            busy.close()
            busy_client.close()
            # Decode free: the rest comes. Tokens the client has not read yet travel together, so
            # the next chunk may already carry the last token and the finish.
            rest = [second.result(timeout=30), *chunks]
            events = [json.loads(line.removeprefix("data: ")) for line in rest]
        client.close()
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert_all_free(prefill, decode)
