"""Costly work only after admission (gateway/gate.py, gateway/work_pool.py): the API key and
a pending slot before the body is read, /tokenize and /detokenize admitted like completions,
chat templates and grammars on bounded pools fair between clients, a template past its time
limit stopped, and a flood of costly requests refused with 429 while another client's
well-formed request is still answered; the connection limit beneath it all, which spares the probes.

In-process gateways (``tests.gateway.inprocess``) in front of a real prefill and decode
instance, and one gateway process for the connection limit and the key file. Every wait is
on a condition of the gateway's state, with a bound that only turns a hang into a failure."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from engine.structured_output.compiler import GrammarCompiler
from gateway.flags import API_KEY_FILE_ENV, add_api_key_argument, resolve_api_key
from gateway.limits import RequestLimits
from gateway.work_pool import WorkPool
from launcher.processes import splitserve_command
from tests.gateway.inprocess import InProcessGateway, make_chat_checkpoint, run_inprocess
from tests.gateway.processes import running_gateway
from tests.services.processes import ROOT, SERVICE_ENV, Service
from tests.stores import free_port

pytest.importorskip("ucxx")

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NORMAL_CHAT = {"messages": CHAT, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
# 100,000 x 1,000 Jinja loop turns: minutes; it ends only when the gateway stops it.
ENDLESS_CHAT = {**NORMAL_CHAT, "chat_template_kwargs": {"slow_loops": 100_000}}
HANG_GUARD_S = 300.0  # turns a hang into a failure; no assertion depends on it
FLOOD = 300


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("llama-chat"))


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for a condition of the gateway's state (it changes on this loop)."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


def client_at(gateway: InProcessGateway, address: str, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """A client of the in-process gateway with a peer address of its own: another client."""
    transport = httpx.ASGITransport(app=gateway.app, client=(address, 40000), raise_app_exceptions=False)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=HANG_GUARD_S, headers=headers)


def assert_refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    if status == 429:
        assert error["type"] == "rate_limit_error" and response.headers["retry-after"] == "1"


async def flood(
    client: httpx.AsyncClient, pool: WorkPool, body: Callable[[int], dict[str, object]], path: str
) -> tuple[list[asyncio.Task[httpx.Response]], list[asyncio.Task[httpx.Response]]]:
    """FLOOD requests from one client at once, until each is refused or holds the client's
    whole share of the pool. Returns (refused, held)."""
    tasks = [asyncio.create_task(client.post(path, json=body(i))) for i in range(FLOOD)]
    share = pool.max_running_per_client + pool.max_waiting_per_client
    await until(
        lambda: (
            sum(task.done() for task in tasks) == FLOOD - share
            and (pool.num_running, pool.num_waiting) == (pool.max_running_per_client, pool.max_waiting_per_client)
        ),
        f"the flood did not settle at its share of the {pool.name} pool",
    )
    refused = [task for task in tasks if task.done()]
    for task in refused:
        assert_refused(task.result(), 429, "work_queue_full")
    return refused, [task for task in tasks if not task.done()]


async def leave(tasks: list[asyncio.Task[httpx.Response]]) -> None:
    """The flooding client goes away: its requests are cancelled."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_a_flood_of_slow_templates_gets_429s_and_another_client_is_still_answered(
    model: Path, instances: tuple[Service, Service]
) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        pool = gateway.service.tokenizer.pool
        async with client_at(gateway, "10.0.0.1") as flooder, client_at(gateway, "10.0.0.2") as other:
            refused, held = await flood(flooder, pool, lambda i: ENDLESS_CHAT, "/v1/chat/completions")
            assert len(refused) == FLOOD - pool.max_running_per_client - pool.max_waiting_per_client > 0
            # Another client's request renders on the worker the flood cannot take, and is answered
            # while every one of the flood's admitted requests is still rendering or waiting.
            answer = await other.post("/v1/chat/completions", json=NORMAL_CHAT)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == NORMAL_CHAT["max_tokens"]
            assert not any(task.done() for task in held)
            await leave(held)
            # Their renders stop at the template's next line, though no time limit has passed.
            await until(lambda: pool.num_running == pool.num_waiting == 0, "a cancelled render kept its worker")
            assert gateway.service.num_pending == 0

    # A time limit the flood never reaches, and a slot for every request of it.
    run_inprocess(
        instances, model, scenario, RequestLimits(chat_template_timeout_s=3600.0), max_pending_requests=2 * FLOOD
    )


@pytest.fixture
def huge_grammars(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Compiling a regex that starts with "huge" blocks until the returned event is set: a
    stand-in for grammars that take long to compile, in the gateway's compiler only (the
    instances are other processes)."""
    compiled = threading.Event()
    build = GrammarCompiler._build

    def slow_build(self: GrammarCompiler, spec):  # type: ignore[no-untyped-def]
        if spec.kind == "regex" and spec.spec.startswith("huge"):
            compiled.wait()
        return build(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_build", slow_build)
    return compiled


def test_a_flood_of_huge_grammars_gets_429s_and_another_client_is_still_answered(
    model: Path, instances: tuple[Service, Service], huge_grammars: threading.Event
) -> None:
    def huge(index: int) -> dict[str, object]:  # each its own, so the compiled-grammar cache never answers
        return {"prompt": "hi", "max_tokens": 4, "guided_regex": f"huge{index}"}

    async def scenario(gateway: InProcessGateway) -> None:
        pool = gateway.service.grammars.pool
        async with client_at(gateway, "10.0.0.1") as flooder, client_at(gateway, "10.0.0.2") as other:
            _, held = await flood(flooder, pool, huge, "/v1/completions")
            # Tokenizing never waits on grammars: a plain request from the flooder itself goes through,
            assert (await flooder.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200
            # and another client's grammar compiles on the worker the flood cannot take.
            answer = await other.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0, "guided_choice": ["a", "b"]}
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] in ("a", "b")
            assert not any(task.done() for task in held)
            await leave(held)
            # llguidance cannot be interrupted: the flood's running compile keeps its worker until it returns.
            assert pool.num_waiting == 0 and pool.num_running == pool.max_running_per_client
            huge_grammars.set()
            await until(lambda: pool.num_running == 0, "a returned compile kept its worker")
            assert gateway.service.num_pending == 0

    run_inprocess(instances, model, scenario, max_pending_requests=2 * FLOOD)


def test_a_grammar_past_its_time_limit_is_a_400_and_its_worker_is_free_once_it_returns(
    model: Path, instances: tuple[Service, Service], huge_grammars: threading.Event
) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        pool = gateway.service.grammars.pool
        response = await gateway.client.post("/v1/completions", json={"prompt": "hi", "guided_regex": "huge"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "guided_regex" and "--grammar-compile-timeout" in error["message"], error
        assert pool.num_running == 1  # the compile still runs: its worker is not handed out twice
        huge_grammars.set()
        await until(lambda: pool.num_running == 0, "a returned compile kept its worker")

    run_inprocess(instances, model, scenario, RequestLimits(grammar_compile_timeout_s=0.2))


def test_templates_past_their_time_limit_free_their_workers(model: Path, instances: tuple[Service, Service]) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        pool = gateway.service.tokenizer.pool
        # As many endless renders as there are workers, from as many clients (each may hold all but one).
        clients = [client_at(gateway, f"10.0.1.{i}") for i in range(pool.num_workers)]
        responses = await asyncio.gather(*(c.post("/v1/chat/completions", json=ENDLESS_CHAT) for c in clients))
        for response in responses:
            assert response.status_code == 400 and "--chat-template-timeout" in response.json()["error"]["message"]
        await until(lambda: pool.num_running == 0, "a render past its time limit kept its worker")
        answer = await gateway.client.post("/v1/chat/completions", json=NORMAL_CHAT)
        assert answer.status_code == 200, answer.text
        for client in clients:
            await client.aclose()

    run_inprocess(instances, model, scenario, RequestLimits(chat_template_timeout_s=0.5))


class CountingBody:
    """A request body sent in chunks, counting those the server asked for."""

    def __init__(self) -> None:
        self.num_read = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        for piece in (b'{"prompt": "', b"x" * 1000, b'", "max_tokens": 2}'):
            self.num_read += 1
            yield piece


def test_the_key_then_a_slot_come_before_the_body_and_tokenize_is_admitted(
    model: Path, instances: tuple[Service, Service]
) -> None:
    key = {"authorization": "Bearer the-key"}

    async def post_counted(client: httpx.AsyncClient, path: str) -> tuple[httpx.Response, int]:
        body = CountingBody()
        response = await client.post(path, content=body.chunks(), headers={"content-type": "application/json"})
        return response, body.num_read

    async def scenario(gateway: InProcessGateway) -> None:
        async with client_at(gateway, "10.0.0.1") as stranger, client_at(gateway, "10.0.0.2", key) as member:
            response, num_read = await post_counted(stranger, "/v1/completions")
            assert_refused(response, 401, "invalid_api_key")
            assert num_read == 0, "the body was read before the key was checked"
            assert (await stranger.get("/health")).status_code == 200  # probes stay open

            # The one slot taken by a request whose template renders until it is cancelled.
            holder = asyncio.create_task(member.post("/v1/chat/completions", json=ENDLESS_CHAT))
            await until(lambda: gateway.service.tokenizer.pool.num_running == 1, "the holder never rendered")
            assert gateway.service.num_pending == 1
            for path in ("/v1/completions", "/tokenize", "/detokenize"):
                response, num_read = await post_counted(member, path)
                assert_refused(response, 429, "queue_full")
                assert num_read == 0, f"{path}: the body was read before a slot was free"
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            await until(lambda: gateway.service.num_pending == 0, "the cancelled request kept its slot")

            tokens = await member.post("/tokenize", json={"prompt": "hello"})
            assert tokens.status_code == 200 and tokens.json()["count"] > 0, tokens.text
            text = await member.post("/detokenize", json={"tokens": tokens.json()["tokens"]})
            assert text.status_code == 200 and "hello" in text.json()["prompt"], text.text
            assert gateway.service.num_pending == 0

    run_inprocess(
        instances,
        model,
        scenario,
        RequestLimits(chat_template_timeout_s=3600.0),
        max_pending_requests=1,
        api_key="the-key",
    )


def test_a_completion_takes_a_slot_for_each_prompt_before_tokenizing(
    model: Path, instances: tuple[Service, Service]
) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        refused = await gateway.client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert_refused(refused, 429, "queue_full")
        fits = await gateway.client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 2, fits.text
        assert gateway.service.num_pending == 0

    run_inprocess(instances, model, scenario, max_pending_requests=2)


def health_status(port: int) -> tuple[socket.socket, int]:
    """A new connection's answer to GET /health; the connection stays open (keep-alive)."""
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
    return connection, int(connection.recv(4096).split(b" ", 2)[1])


def until_healthy(port: int) -> socket.socket:
    """A connection the server took (the connections of earlier requests may take a moment to go)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        connection, status = health_status(port)
        if status == 200:
            return connection
        connection.close()
        assert status == 503 and time.monotonic() < deadline, status


def test_past_max_connections_the_api_gets_503_the_probes_an_answer_and_the_key_comes_from_a_file(
    model: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("file-key\n")
    nowhere = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with running_gateway(
        model,
        "--prefill",
        nowhere[0],
        "--decode",
        nowhere[1],
        "--max-connections",
        "2",  # counting the new connection itself: one other may be open
        "--max-connections-per-client",
        "8",
        "--api-key-file",
        str(key_file),
        ready_path="/health",
    ) as gateway:
        assert httpx.get(f"{gateway.url}/v1/models", timeout=30).status_code == 401
        models = httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": "Bearer file-key"}, timeout=30)
        assert models.status_code == 200, models.text
        idle = [until_healthy(gateway.port) for _ in range(2)]
        probe, status = health_status(gateway.port)  # a third connection: past the limit, a probe is answered
        assert status == 200
        probe.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer file-key\r\n\r\n")
        refused = b"".join(iter(lambda: probe.recv(4096), b""))  # up to the close the 503 announces
        probe.close()
        assert refused.startswith(b"HTTP/1.1 503 ") and b'"code":"too_many_connections"' in refused, refused
        for connection in idle:
            connection.close()
        until_models(gateway.url, "file-key")  # once they are closed, the API answers again


def until_models(url: str, api_key: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while (status := models_status(url, api_key)) != 200:
        assert status == 503 and time.monotonic() < deadline, status
        time.sleep(0.05)


def models_status(url: str, api_key: str) -> int:
    return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30).status_code


def test_an_api_key_or_key_file_given_empty_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SPLITSERVE_API_KEY=`` and ``SPLITSERVE_API_KEY_FILE=`` used to mean "no key": an open API
    for an operator whose secret did not reach the variable (issue 42, item 7). The flags read
    the variables as their defaults, so each parser is made after the variable is set."""

    def resolve(*argv: str) -> str | None:
        parser = argparse.ArgumentParser()
        add_api_key_argument(parser)
        return resolve_api_key(parser.parse_args(argv))

    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    monkeypatch.setenv("SPLITSERVE_API_KEY", "")
    with pytest.raises(ValueError, match="the API key is given but empty .* unset the variable"):
        resolve()
    monkeypatch.delenv("SPLITSERVE_API_KEY")
    with pytest.raises(ValueError, match="the API key is given but empty"):
        resolve("--api-key", " ")
    monkeypatch.setenv(API_KEY_FILE_ENV, "")
    with pytest.raises(ValueError, match="--api-key-file is given but names no file"):
        resolve()
    monkeypatch.delenv(API_KEY_FILE_ENV)
    assert resolve() is None  # not given at all: an open API, as before
    assert resolve("--api-key", "k") == "k"


def test_an_api_key_file_must_hold_a_key(model: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_api_key_argument(parser)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_api_key(parser.parse_args(["--api-key-file", str(empty)]))
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_key(parser.parse_args(["--api-key-file", str(tmp_path / "missing")]))
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key(parser.parse_args(["--api-key", "k", "--api-key-file", str(empty)]))
    # `splitserve up` takes the same flags and hands its gateway the key it read.
    from launcher import up

    up_parser = argparse.ArgumentParser()
    up.add_arguments(up_parser)
    key_file = tmp_path / "key"
    key_file.write_text("up-key\n")
    assert resolve_api_key(up_parser.parse_args(["--api-key-file", str(key_file)])) == "up-key"
    # A gateway given an empty key file does not start (an open API would be the alternative).
    nowhere = f"127.0.0.1:{free_port()}"
    started = subprocess.run(
        splitserve_command(
            "gateway", "--model", str(model), "--prefill", nowhere, "--decode", nowhere, "--api-key-file", str(empty)
        ),
        cwd=ROOT,
        env={**os.environ, **SERVICE_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0 and "is empty" in started.stderr, started.stderr
