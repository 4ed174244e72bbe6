"""The dispatcher's failover rules, in process: fake prefill and decode instances behind an
in-memory channel, in a real instance pool, so each rule is one scenario that runs in
milliseconds (tests/gateway/test_routing.py and test_migration.py run them over real
processes).

- which gRPC codes move a call to another instance (``_RETRYABLE``) and which end the
  request at once, and which mark an instance down until it reports again;
- the HTTP status, error type and code each gRPC status becomes, and the gRPC code the
  gateway's own gRPC front answers with for it;
- no retry once a token has streamed: an error event follows the tokens, none is sent twice
  (with a migration budget, the request resumes on another D after the last token sent);
- a client that leaves releases P's KV exactly once and cancels the Decode call (D aborts);
- a D that cannot pull the KV (DATA_LOSS) sends the request back to prefill;
- the budgets: ``MAX_ATTEMPTS`` instances a phase (an instance gRPC could not connect to
  does not count: a real channel to a refused port), ``MAX_HANDOFFS`` lost hand-offs,
  ``--max-migrations``.

The fakes are servicers: objects whose async methods take and return the proto messages
of ``splitserve.v1`` or raise ``grpc.aio.AioRpcError``. :class:`FakeChannel` stands in for
the instance's ``grpc.aio.Channel``, so the dispatcher, ``cluster.prefill_control`` and the
generated stubs run unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from http import HTTPStatus
from typing import Any

import grpc
import pytest

from gateway.dispatch import Dispatcher
from gateway.dispatch_request import DispatchRequest
from gateway.errors import APIError
from gateway.failover import MAX_ATTEMPTS, MAX_HANDOFFS
from gateway.instance_limits import InstanceLimits
from gateway.instances import InstancePool, InstanceState, Role
from gateway.metrics import GatewayMetrics
from gateway.openai_common import SSE_DONE, sse, sse_response
from splitserve.v1 import disaggregation_pb2, generation_pb2

Code = grpc.StatusCode

# The classification under test, spelled out rather than imported: a code moved between the
# sets must fail a test here.
RETRYABLE = [
    Code.UNAVAILABLE,
    Code.CANCELLED,
    Code.ABORTED,
    Code.RESOURCE_EXHAUSTED,
    Code.UNKNOWN,
    Code.INTERNAL,
    Code.FAILED_PRECONDITION,
]
INSTANCE_DOWN = {Code.UNAVAILABLE, Code.CANCELLED, Code.UNKNOWN}  # skipped until the instance reports again
NOT_RETRYABLE = [code for code in Code if code not in RETRYABLE and code != Code.OK]
# DATA_LOSS from D before any token is a lost KV, not a failure (test_a_lost_kv_...).
NOT_RETRYABLE_ON_DECODE = [code for code in NOT_RETRYABLE if code != Code.DATA_LOSS]

FINGERPRINT = disaggregation_pb2.Fingerprint(
    model="m", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=16
)
PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 16
FIRST = 100  # the first token, P's
DECODED = [101, 102, 103]  # what a decode instance streams by default
DETAILS = "details of the failure"


def name(code: grpc.StatusCode) -> str:
    return code.name


def rpc_error(code: grpc.StatusCode, details: str = DETAILS) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def request(request_id: str = "r") -> DispatchRequest:
    return DispatchRequest(
        request_id=request_id,
        prompt_token_ids=list(PROMPT),
        sampling=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS),
    )


def tokens(*token_ids: int, finish_reason: str = "") -> dict[str, Any]:
    """One streamed response of a script, for Decode or Generate alike."""
    return {"token_ids": list(token_ids), "finish_reason": finish_reason}


DEFAULT_SCRIPT = [tokens(*DECODED[:-1]), tokens(DECODED[-1], finish_reason="length")]


class Hang:
    """A script step: the call waits here (a prefill running, a pull) until it is cancelled;
    ``entered`` is set once it does."""


HANG = Hang()


class Do:
    """A script step: run ``action`` (e.g. change the pool) when the call reaches it."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action


class FakeInstance:
    address = ""  # set by make_pool

    def __init__(self) -> None:
        self.entered = asyncio.Event()  # a call reached a HANG step

    async def _hang(self) -> None:
        self.entered.set()
        await asyncio.get_running_loop().create_future()  # until cancelled


class FakePrefill(FakeInstance):
    """A prefill instance. Each Prefill call takes the next outcome (an error to raise, HANG,
    Do, or None to answer); with none left it answers: FIRST and a KV handle under the call's
    request id. ReleaseKV and Abort record the id they name."""

    def __init__(self, *outcomes: grpc.aio.AioRpcError | Hang | Do | None) -> None:
        super().__init__()
        self.outcomes = list(outcomes)
        self.requests: list[disaggregation_pb2.PrefillRequest] = []
        self.released: list[str] = []
        self.aborted: list[str] = []

    async def Prefill(self, request: disaggregation_pb2.PrefillRequest) -> disaggregation_pb2.PrefillResponse:  # noqa: N802 - the stub calls it by the RPC name
        self.requests.append(request)
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, grpc.aio.AioRpcError):
            raise outcome
        if isinstance(outcome, Hang):
            await self._hang()
        if isinstance(outcome, Do):
            outcome.action()
        kv = disaggregation_pb2.KVHandle(
            prefill_address=self.address,
            request_id=request.request_id,
            num_tokens=len(request.prompt_token_ids),
            fingerprint=FINGERPRINT,
        )
        return disaggregation_pb2.PrefillResponse(request_id=request.request_id, first_token_id=FIRST, kv=kv)

    async def ReleaseKV(self, request: disaggregation_pb2.RequestRef) -> disaggregation_pb2.ReleaseKVResponse:  # noqa: N802 - the stub calls it by the RPC name
        self.released.append(request.request_id)
        return disaggregation_pb2.ReleaseKVResponse(released=True)

    async def Abort(self, request: disaggregation_pb2.RequestRef) -> disaggregation_pb2.AbortResponse:  # noqa: N802 - the stub calls it by the RPC name
        self.aborted.append(request.request_id)
        return disaggregation_pb2.AbortResponse(found=True)


class FakeDecode(FakeInstance):
    """A decode instance (Decode) or a colocated one (Generate). Each call plays the next
    script: steps of :func:`tokens` to stream, an error to end the call with, HANG, Do; with
    none left it streams DECODED. ``calls``: each call's :class:`FakeStreamCall`, to see
    which were cancelled."""

    def __init__(self, *scripts: list[Any]) -> None:
        super().__init__()
        self.scripts = list(scripts)
        self.requests: list[disaggregation_pb2.DecodeRequest | generation_pb2.GenerateRequest] = []
        self.calls: list[FakeStreamCall] = []

    async def _play(self, request: Any, response_type: type) -> AsyncIterator[Any]:
        self.requests.append(request)
        for step in self.scripts.pop(0) if self.scripts else DEFAULT_SCRIPT:
            if isinstance(step, grpc.aio.AioRpcError):
                raise step
            if isinstance(step, Hang):
                await self._hang()
            elif isinstance(step, Do):
                step.action()
            else:
                yield response_type(request_id=request.request_id, **step)

    def Decode(self, request: disaggregation_pb2.DecodeRequest) -> AsyncIterator[disaggregation_pb2.DecodeResponse]:  # noqa: N802 - the stub calls it by the RPC name
        return self._play(request, disaggregation_pb2.DecodeResponse)

    def Generate(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[generation_pb2.GenerateResponse]:  # noqa: N802 - the stub calls it by the RPC name
        return self._play(request, generation_pb2.GenerateResponse)


class FakeStreamCall:
    """A server-streaming call as ``grpc.aio.UnaryStreamCall`` behaves for the dispatcher:
    iterate it, ``done()``, ``cancel()``; a reader cancelled while it waits cancels the call,
    as grpc.aio does. A cancelled Decode call is what makes a real D abort the request."""

    def __init__(self, responses: AsyncIterator[Any], deserialize: Callable[[bytes], Any]) -> None:
        self._responses = responses
        self._deserialize = deserialize
        self._done = False
        self.cancelled = asyncio.Event()

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        self.cancelled.set()
        return True

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._read()

    async def _read(self) -> AsyncIterator[Any]:
        try:
            async for response in self._responses:
                yield self._deserialize(response.SerializeToString())
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            self._done = True


class FakeChannel:
    """What the generated stubs ask of a ``grpc.aio.Channel``: a callable per method, here one
    that calls the servicer's method of the same name, the messages through the stub's own
    serializers (what would cross the wire)."""

    def __init__(self, servicer: FakePrefill | FakeDecode) -> None:
        self.servicer = servicer

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes],
        response_deserializer: Callable[[bytes], Any],
        **_: Any,
    ):
        async def call(request: Any, timeout: float | None = None, **__: Any) -> Any:
            handler = getattr(self.servicer, method.rsplit("/", 1)[1])
            response = await handler(type(request).FromString(request_serializer(request)))
            return response_deserializer(response.SerializeToString())

        return call

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes],
        response_deserializer: Callable[[bytes], Any],
        **_: Any,
    ):
        def call(request: Any, timeout: float | None = None, **__: Any) -> FakeStreamCall:
            handler = getattr(self.servicer, method.rsplit("/", 1)[1])
            stream = FakeStreamCall(
                handler(type(request).FromString(request_serializer(request))), response_deserializer
            )
            self.servicer.calls.append(stream)
            return stream

        return call

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return grpc.ChannelConnectivity.READY  # the pool routes only over channels not failing fast

    async def close(self, grace: float | None = None) -> None:
        pass


def make_pool(
    prefill: Sequence[FakePrefill] = (),
    decode: Sequence[FakeDecode] = (),
    colocated: Sequence[FakeDecode] = (),
    limits: InstanceLimits | None = None,
) -> InstancePool:
    """A real pool over the fakes, every one healthy; within a role each ranks below the one
    before it (one more request waiting), so the first is picked first."""
    # A call each (--instance-calls per-call): the rules here do not depend on how calls are
    # framed; the multiplexed stream runs them in the real-process tests (test_migration.py).
    pool = InstancePool(stale_after_s=3600.0, limits=limits or InstanceLimits(), multiplex_calls=False)
    role: Role
    for role, fakes in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
        for i, fake in enumerate(fakes):
            fake.address = f"{role}-{i}:1"
            pool.instances[fake.address] = InstanceState(fake.address, role, FakeChannel(fake))
            set_load(pool, fake, num_waiting=i)
    return pool


def set_load(pool: InstancePool, fake: FakeInstance, num_waiting: int) -> None:
    state = pool.instances[fake.address]
    report = disaggregation_pb2.LoadReport(
        instance_id=fake.address, role=state.role, num_waiting=num_waiting, fingerprint=FINGERPRINT
    )
    pool.record_report(fake.address, report, serving=True)


def is_healthy(pool: InstancePool, fake: FakeInstance) -> bool:
    return pool.instances[fake.address] in pool.healthy(pool.instances[fake.address].role)


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test in a loop of its own."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


async def collect(dispatcher: Dispatcher, dispatch: DispatchRequest | None = None) -> tuple[list[int], APIError | None]:
    """Every token the request streams, and the error it ended with; background releases done."""
    token_ids: list[int] = []
    try:
        async for event in dispatcher.generate(dispatch or request()):
            token_ids.extend(event.token_ids)
    except APIError as error:
        return token_ids, error
    finally:
        await dispatcher.drain()
    return token_ids, None


def counter(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def wait_for(event: asyncio.Event) -> None:
    """An event the code under test must set; bounded so that a bug fails rather than hangs."""
    await asyncio.wait_for(event.wait(), timeout=10)


async def leave_when(entered: asyncio.Event, dispatcher: Dispatcher) -> None:
    """Run a request and cancel it once ``entered`` is set, as the server does when the client
    disconnects; then wait for the cleanup calls it left behind."""
    task = asyncio.create_task(collect(dispatcher))
    await wait_for(entered)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await dispatcher.drain()


# ------------------------------------------------------------------ retries


@pytest.mark.parametrize("code", RETRYABLE, ids=name)
@in_loop
async def test_a_prefill_failing_with_a_retryable_code_moves_to_another_prefill_instance(code: grpc.StatusCode) -> None:
    failing, answering, decode = FakePrefill(rpc_error(code)), FakePrefill(), FakeDecode()
    pool = make_pool(prefill=[failing, answering], decode=[decode])
    token_ids, error = await collect(Dispatcher(pool))
    assert error is None and token_ids == [FIRST, *DECODED]
    assert len(failing.requests) == len(answering.requests) == 1
    assert answering.requests[0] == failing.requests[0]  # the same call, under the request's id
    assert decode.requests[0].kv.prefill_address == answering.address
    assert is_healthy(pool, failing) == (code not in INSTANCE_DOWN)


@pytest.mark.parametrize("code", RETRYABLE, ids=name)
@in_loop
async def test_a_decode_failing_before_its_first_token_with_a_retryable_code_moves_to_another_decode_instance(
    code: grpc.StatusCode,
) -> None:
    prefill, failing, answering = FakePrefill(), FakeDecode([rpc_error(code)]), FakeDecode()
    pool = make_pool(prefill=[prefill], decode=[failing, answering])
    token_ids, error = await collect(Dispatcher(pool))
    assert error is None and token_ids == [FIRST, *DECODED]
    assert len(prefill.requests) == 1  # P keeps the KV pinned for the next D: no new prefill
    assert len(failing.requests) == len(answering.requests) == 1
    assert answering.requests[0] == failing.requests[0]  # the same hand-off
    assert answering.requests[0].kv.request_id == "r" and answering.requests[0].first_token_id == FIRST
    assert prefill.released == []  # the D that streamed took the KV over
    assert is_healthy(pool, failing) == (code not in INSTANCE_DOWN)


@pytest.mark.parametrize("code", NOT_RETRYABLE, ids=name)
@in_loop
async def test_a_prefill_failing_with_another_code_is_not_retried(code: grpc.StatusCode) -> None:
    failing, other, decode = FakePrefill(rpc_error(code)), FakePrefill(), FakeDecode()
    pool = make_pool(prefill=[failing, other], decode=[decode])
    token_ids, error = await collect(Dispatcher(pool))
    assert error is not None and token_ids == []
    assert len(failing.requests) == 1 and other.requests == [] and decode.requests == []
    assert is_healthy(pool, failing)  # the request's fault, not the instance's


@pytest.mark.parametrize("code", NOT_RETRYABLE_ON_DECODE, ids=name)
@in_loop
async def test_a_decode_failing_with_another_code_is_not_retried_and_releases_the_kv(code: grpc.StatusCode) -> None:
    prefill, failing, other = FakePrefill(), FakeDecode([rpc_error(code)]), FakeDecode()
    pool = make_pool(prefill=[prefill], decode=[failing, other])
    token_ids, error = await collect(Dispatcher(pool))
    assert error is not None and token_ids == [FIRST]
    assert len(failing.requests) == 1 and other.requests == [] and len(prefill.requests) == 1
    assert prefill.released == ["r"]  # no D took it: freed now, not at lease expiry


# ------------------------------------------------------ gRPC status -> HTTP

# status, error code, error type, the gRPC code the gateway's gRPC front answers with
_ANSWERS: dict[grpc.StatusCode, tuple[HTTPStatus, str | None, str, grpc.StatusCode]] = {
    Code.INVALID_ARGUMENT: (HTTPStatus.BAD_REQUEST, None, "invalid_request_error", Code.INVALID_ARGUMENT),
    Code.DEADLINE_EXCEEDED: (HTTPStatus.GATEWAY_TIMEOUT, "timeout", "timeout_error", Code.DEADLINE_EXCEEDED),
    Code.RESOURCE_EXHAUSTED: (HTTPStatus.TOO_MANY_REQUESTS, "overloaded", "rate_limit_error", Code.RESOURCE_EXHAUSTED),
}
_INSTANCE_FAILED = (HTTPStatus.SERVICE_UNAVAILABLE, "instance_failed", "service_unavailable_error", Code.UNAVAILABLE)


@pytest.mark.parametrize("code", [code for code in Code if code != Code.OK], ids=name)
@in_loop
async def test_an_instance_error_becomes_the_http_answer_the_mapping_names(code: grpc.StatusCode) -> None:
    # One prefill instance: a retryable code exhausts the candidates, and the last error answers.
    pool = make_pool(prefill=[FakePrefill(rpc_error(code))], decode=[FakeDecode()])
    _, error = await collect(Dispatcher(pool))
    assert error is not None
    assert (error.status, error.code, error.type, error.grpc_code) == _ANSWERS.get(code, _INSTANCE_FAILED)
    if code == Code.INVALID_ARGUMENT:
        assert error.message == DETAILS  # the instance's words reach the client as they are
    elif code == Code.DEADLINE_EXCEEDED:
        assert error.message == "the request timed out"
    else:
        # What failed inside the cluster is for the log only (GenerationService.stream logs it under
        # the request id): the client learns neither the instance, nor its address, nor its words.
        assert DETAILS not in error.message and "prefill-0" not in error.message
        assert error.detail is not None and DETAILS in error.detail and "prefill-0" in error.detail
        if error.status == HTTPStatus.SERVICE_UNAVAILABLE:
            assert code.name in error.detail


@in_loop
async def test_no_instance_answers_503_and_instances_at_their_limit_429() -> None:
    _, error = await collect(Dispatcher(make_pool(decode=[FakeDecode()])))
    assert error is not None
    assert (error.status, error.code, error.grpc_code) == (
        HTTPStatus.SERVICE_UNAVAILABLE,
        "no_healthy_instance",
        Code.UNAVAILABLE,
    )

    prefill = FakePrefill()
    pool = make_pool(prefill=[prefill], decode=[FakeDecode()], limits=InstanceLimits(max_inflight_per_instance=1))
    pool.instances[prefill.address].num_inflight = 1
    _, error = await collect(Dispatcher(pool))
    assert error is not None and (error.status, error.code, error.retry_after_s) == (
        HTTPStatus.TOO_MANY_REQUESTS,
        "overloaded",
        1,
    )
    assert prefill.requests == []


# ------------------------------------------------- once a token has streamed


@in_loop
async def test_a_colocated_instance_failing_after_a_token_is_not_retried() -> None:
    failing, other = FakeDecode([tokens(11), rpc_error(Code.UNAVAILABLE)]), FakeDecode()
    token_ids, error = await collect(Dispatcher(make_pool(colocated=[failing, other])))
    assert token_ids == [11] and other.requests == []
    assert error is not None and (error.status, error.code) == (HTTPStatus.SERVICE_UNAVAILABLE, "instance_failed")
    assert "mid-stream" in (error.detail or "")


@in_loop
async def test_a_decode_failing_after_a_token_without_a_migration_budget_ends_the_stream_with_an_error_event() -> None:
    prefill, failing, other = FakePrefill(), FakeDecode([tokens(11), rpc_error(Code.UNAVAILABLE)]), FakeDecode()
    dispatcher = Dispatcher(make_pool(prefill=[prefill], decode=[failing, other]), max_migrations=0)

    async def chunks() -> AsyncIterator[str]:
        async for event in dispatcher.generate(request()):
            yield sse({"token_ids": event.token_ids})

    body = [chunk async for chunk in sse_response(chunks()).body_iterator]
    await dispatcher.drain()
    assert body[-1] == SSE_DONE
    events = [json.loads(chunk.removeprefix("data: ")) for chunk in body[:-1]]
    assert events[:-1] == [{"token_ids": [FIRST]}, {"token_ids": [11]}]  # each token once
    assert events[-1]["error"]["code"] == "instance_failed"
    assert other.requests == [] and len(prefill.requests) == 1
    assert prefill.released == []  # the D that streamed owned the KV


@in_loop
async def test_a_decode_failing_after_tokens_migrates_and_sends_no_token_twice() -> None:
    prefill = FakePrefill()
    failing = FakeDecode([tokens(11), tokens(12), rpc_error(Code.UNAVAILABLE)])
    survivor = FakeDecode([tokens(13, 14), tokens(15, finish_reason="length")])
    pool = make_pool(prefill=[prefill], decode=[failing, survivor])
    metrics = GatewayMetrics(pool)
    token_ids, error = await collect(Dispatcher(pool, metrics))
    assert error is None and token_ids == [FIRST, 11, 12, 13, 14, 15]
    # The prompt plus every token sent but the last is prefilled again; D continues after the last.
    assert [r.request_id for r in prefill.requests] == ["r", "r.m1"]
    assert prefill.requests[1].kv_only and list(prefill.requests[1].prompt_token_ids) == [*PROMPT, FIRST, 11]
    resumed = survivor.requests[0]
    assert (
        resumed.request_id == "r"
        and list(resumed.prompt_token_ids) == [*PROMPT, FIRST, 11]
        and resumed.first_token_id == 12
    )
    assert resumed.kv.request_id == "r.m1" and resumed.sampling.max_tokens == MAX_TOKENS - 2
    assert counter(metrics, "splitserve_migrations_total", outcome="resumed") == 1


# ------------------------------------------------------- the client leaving


@in_loop
async def test_a_client_leaving_mid_prefill_aborts_it_on_the_prefill_instance() -> None:
    prefill, decode = FakePrefill(HANG), FakeDecode()
    dispatcher = Dispatcher(make_pool(prefill=[prefill], decode=[decode]))
    await leave_when(prefill.entered, dispatcher)
    assert prefill.aborted == ["r"] and prefill.released == [] and decode.requests == []


@in_loop
async def test_a_client_leaving_at_the_first_token_releases_the_kv_once() -> None:
    prefill, decode = FakePrefill(), FakeDecode()
    dispatcher = Dispatcher(make_pool(prefill=[prefill], decode=[decode]))
    events = dispatcher.generate(request())
    assert (await anext(events)).token_ids == [FIRST]
    await events.aclose()  # a stop string matched, or the client left
    await dispatcher.drain()
    assert prefill.released == ["r"] and decode.requests == []


@in_loop
async def test_a_client_leaving_while_decode_pulls_releases_the_kv_once_and_cancels_the_decode_call() -> None:
    prefill, decode = FakePrefill(), FakeDecode([HANG])
    dispatcher = Dispatcher(make_pool(prefill=[prefill], decode=[decode]))
    await leave_when(decode.entered, dispatcher)
    assert prefill.released == ["r"]
    assert [call.cancelled.is_set() for call in decode.calls] == [True]  # D aborts the request


@in_loop
async def test_a_stream_closed_after_decode_tokens_cancels_the_decode_call_and_leaves_the_kv_to_decode() -> None:
    prefill, decode = FakePrefill(), FakeDecode([tokens(11), HANG])
    dispatcher = Dispatcher(make_pool(prefill=[prefill], decode=[decode]))
    events = dispatcher.generate(request())
    assert [(await anext(events)).token_ids for _ in range(2)] == [[FIRST], [11]]
    await events.aclose()
    await wait_for(decode.calls[0].cancelled)  # the inner streams close as the loop finalizes them
    await dispatcher.drain()
    assert prefill.released == []  # D took the KV over when it streamed, and releases P itself


# ------------------------------------------------------------ a lost KV


@in_loop
async def test_a_lost_kv_is_prefilled_again_on_the_same_prefill_instance_and_handed_off_again() -> None:
    first, second = FakePrefill(), FakePrefill()
    # While D pulls, the first P reports a long queue: the re-prefill still goes there, where
    # its prefix cache holds the prompt.
    decode = FakeDecode(
        [Do(lambda: set_load(pool, first, num_waiting=10)), rpc_error(Code.DATA_LOSS, "the pull failed")]
    )
    pool = make_pool(prefill=[first, second], decode=[decode])
    metrics = GatewayMetrics(pool)
    token_ids, error = await collect(Dispatcher(pool, metrics))
    assert error is None and token_ids == [FIRST, *DECODED]  # P's token once, the re-prefill's never
    assert [(r.request_id, r.kv_only) for r in first.requests] == [("r", False), ("r.kv1", True)]
    assert first.requests[1].prompt_token_ids == first.requests[0].prompt_token_ids and second.requests == []
    assert [(r.kv.request_id, r.first_token_id, r.allow_recompute) for r in decode.requests] == [
        ("r", FIRST, False),
        ("r.kv1", FIRST, False),
    ]
    assert first.released == ["r"]  # the lost KV freed once; D took the new one over
    assert is_healthy(pool, decode)  # D is fine: the KV was lost
    assert counter(metrics, "splitserve_kv_reprefills_total") == 1


# ---------------------------------------------------------------- budgets


@in_loop
async def test_a_prefill_tries_at_most_max_attempts_instances() -> None:
    prefills = [FakePrefill(rpc_error(Code.UNAVAILABLE)) for _ in range(MAX_ATTEMPTS + 1)]
    decode = FakeDecode()
    token_ids, error = await collect(Dispatcher(make_pool(prefill=prefills, decode=[decode])))
    assert (
        token_ids == [] and error is not None and (error.detail or "").startswith("every prefill instance tried failed")
    )
    assert [len(p.requests) for p in prefills] == [1] * MAX_ATTEMPTS + [0]
    assert decode.requests == []


@in_loop
async def test_a_hand_off_tries_at_most_max_attempts_decode_instances_then_releases_the_kv() -> None:
    prefill = FakePrefill()
    decodes = [FakeDecode([rpc_error(Code.UNAVAILABLE)]) for _ in range(MAX_ATTEMPTS + 1)]
    token_ids, error = await collect(Dispatcher(make_pool(prefill=[prefill], decode=decodes)))
    assert (
        token_ids == [FIRST]
        and error is not None
        and (error.detail or "").startswith("every decode instance tried failed")
    )
    assert [len(d.requests) for d in decodes] == [1] * MAX_ATTEMPTS + [0]
    assert len(prefill.requests) == 1 and prefill.released == ["r"]


class RefusedPort:
    """A local port bound but not listening: every connection to it is refused at once, and
    nobody else can take it while this holds it."""

    def __enter__(self) -> str:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{self._socket.getsockname()[1]}"

    def __exit__(self, *_: object) -> None:
        self._socket.close()


async def collect_with_unreachable(
    pool: InstancePool, dead: Sequence[FakeInstance]
) -> tuple[list[int], APIError | None]:
    """Dispatch a request with ``dead`` reached through real gRPC channels to a refused port:
    what a dead host's instances look like to the gateway."""
    with RefusedPort() as address:
        channels = [grpc.aio.insecure_channel(address) for _ in dead]
        for fake, channel in zip(dead, channels, strict=True):
            pool.instances[fake.address].channel = channel
        try:
            return await collect(Dispatcher(pool))
        finally:
            for channel in channels:
                await channel.close()


@in_loop
async def test_unreachable_decode_instances_do_not_use_up_the_attempts() -> None:
    # A host with several decode instances died: they rank first, side by side. The request
    # goes past all of them (more than MAX_ATTEMPTS) to the live one, and they are skipped
    # from then on.
    prefill = FakePrefill()
    dead = [FakeDecode() for _ in range(MAX_ATTEMPTS + 1)]
    live = FakeDecode()
    pool = make_pool(prefill=[prefill], decode=[*dead, live])
    token_ids, error = await collect_with_unreachable(pool, dead)
    assert error is None and token_ids == [FIRST, *DECODED]
    assert len(live.requests) == 1 and prefill.released == []  # D took the KV over
    assert not any(is_healthy(pool, fake) for fake in dead) and is_healthy(pool, live)


@in_loop
async def test_unreachable_prefill_instances_do_not_use_up_the_attempts() -> None:
    dead = [FakePrefill() for _ in range(MAX_ATTEMPTS + 1)]
    live = FakePrefill()
    decode = FakeDecode()
    pool = make_pool(prefill=[*dead, live], decode=[decode])
    token_ids, error = await collect_with_unreachable(pool, dead)
    assert error is None and token_ids == [FIRST, *DECODED]
    assert len(live.requests) == 1 and not any(is_healthy(pool, fake) for fake in dead)


@in_loop
async def test_after_max_handoffs_lost_kvs_the_request_fails_and_only_the_last_may_recompute() -> None:
    prefill = FakePrefill()
    decode = FakeDecode(*[[rpc_error(Code.DATA_LOSS)] for _ in range(MAX_HANDOFFS)])
    token_ids, error = await collect(Dispatcher(make_pool(prefill=[prefill], decode=[decode])))
    assert token_ids == [FIRST]
    assert error is not None and (error.status, error.code) == (HTTPStatus.SERVICE_UNAVAILABLE, "instance_failed")
    assert "no decode instance could take the KV" in (error.detail or "")
    prefill_ids = ["r", *[f"r.kv{i}" for i in range(1, MAX_HANDOFFS)]]
    assert [r.request_id for r in prefill.requests] == prefill_ids
    assert [(r.kv.request_id, r.allow_recompute) for r in decode.requests] == [
        (i, i == prefill_ids[-1]) for i in prefill_ids
    ]
    assert sorted(prefill.released) == sorted(prefill_ids)  # every KV pinned, released once


@in_loop
async def test_migrations_stop_at_max_migrations() -> None:
    prefill = FakePrefill()
    decodes = [FakeDecode([tokens(11 + i), rpc_error(Code.UNAVAILABLE)]) for i in range(3)] + [FakeDecode()]
    pool = make_pool(prefill=[prefill], decode=decodes)
    metrics = GatewayMetrics(pool)
    token_ids, error = await collect(Dispatcher(pool, metrics, max_migrations=2))
    assert token_ids == [FIRST, 11, 12, 13]
    assert error is not None and (error.status, error.code) == (HTTPStatus.SERVICE_UNAVAILABLE, "instance_failed")
    assert [len(d.requests) for d in decodes] == [1, 1, 1, 0]
    assert [r.request_id for r in prefill.requests] == ["r", "r.m1", "r.m2"]
    assert prefill.released == []  # each D took its KV over
    assert counter(metrics, "splitserve_migrations_total", outcome="resumed") == 2
    assert counter(metrics, "splitserve_migrations_total", outcome="exhausted") == 1
