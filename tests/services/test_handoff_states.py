"""Every state a P -> D hand-off can be in, with the real servicers and engines in-process
(tests/services/inprocess_pd.py; only the byte copy is faked): the tokens equal the colocated
engine's where there are any, each failure ends the call with the status the gateway acts on,
and no KV block leaks on either side after any of them. With tracing on, D's renewals of P's
lease while it holds a handle are events of its call's span."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from cluster.tracing import Tracer
from engine import LLM
from engine.kv_cache_utils import cdiv
from serving.request_timing import CallSpans
from splitserve.v1 import disaggregation_pb2
from tests.checkpoints import random_prompts
from tests.services.client import GREEDY, decode_request, expected_tokens
from tests.services.inprocess_pd import PrefillAndDecode, Served, prefill_and_decode

BLOCK_SIZE = 16
LONG = disaggregation_pb2.DecodeRequest().sampling.__class__(temperature=0.0, max_tokens=64, ignore_eos=True)


def run(model: Path, test: Callable[[PrefillAndDecode], Awaitable[None]], **options: object) -> None:
    """Serve a prefill and a decode instance of ``model``, run ``test`` against them, and check
    that both have every block back afterwards."""

    async def main() -> None:
        async with prefill_and_decode(model, **options) as pd:  # type: ignore[arg-type]
            await test(pd)
            await pd.prefill.all_free()
            await pd.decode.all_free()

    asyncio.run(main())


async def prefill(pd: PrefillAndDecode, request_id: str, prompt: list[int]) -> disaggregation_pb2.PrefillResponse:
    return await pd.prefill_stub.Prefill(
        disaggregation_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=GREEDY)
    )


async def decode(
    pd: PrefillAndDecode, request_id: str, prompt: list[int], prefilled: disaggregation_pb2.PrefillResponse, **kw
) -> tuple[list[int], list[disaggregation_pb2.DecodeResponse]]:
    """The whole Decode stream: the tokens (P's first one included) and every response."""
    responses = [r async for r in pd.decode_stub.Decode(decode_request(request_id, prompt, prefilled, **kw))]
    return [prefilled.first_token_id] + [t for r in responses for t in r.token_ids], responses


async def decode_error(pd: PrefillAndDecode, request: disaggregation_pb2.DecodeRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in pd.decode_stub.Decode(request):
            pass
    return raised.value


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    for _ in range(6000):  # a minute at the least: a guard, not a timing assertion
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def pull_started(served: Served) -> None:
    await asyncio.wait_for(served.connector.pull_started.wait(), 60)
    served.connector.pull_started.clear()


def used_blocks(served: Served) -> int:
    report = served.engine.latest_load_report()
    return report.num_total_blocks - report.num_free_blocks


def trace_calls(served: Served, exported: InMemorySpanExporter) -> None:
    """Tracing on for the instance's calls from now on, its spans into ``exported``."""
    instance = served.instance
    instance.tracer = Tracer("unused", f"splitserve-{instance.role}", instance.instance_id, exporter=exported)


def decode_call_span(exported: InMemorySpanExporter) -> ReadableSpan:
    (span,) = [span for span in exported.get_finished_spans() if span.name == "splitserve.v1.Decode/Decode"]
    return span


# ---------------------------------------------------------------- pulled, decoded


def test_a_pulled_handoff_decodes_as_colocated_and_both_sides_free_their_blocks(model: Path) -> None:
    colocated = LLM(model=str(model), kv_cache_memory=1 << 22)
    prompts = random_prompts([5, 16, 40], seed=41)

    async def test(pd: PrefillAndDecode) -> None:
        for index, prompt in enumerate(prompts):
            prefilled = await prefill(pd, f"r{index}", prompt)
            tokens, responses = await decode(pd, f"r{index}", prompt, prefilled)
            assert tokens == expected_tokens(colocated, prompt)
            transfer = responses[0].kv_transfer
            assert (transfer.num_pulled_blocks, transfer.recomputed) == (cdiv(len(prompt), BLOCK_SIZE), False)
            assert not any(r.HasField("kv_transfer") for r in responses[1:])  # the first response only
        await wait_for(lambda: not pd.prefill.connector.published, "D released every handle on P")

    run(model, test)


def test_a_call_without_a_handle_prefills_on_the_decode_instance(model: Path) -> None:
    colocated = LLM(model=str(model), kv_cache_memory=1 << 22)
    prompt = random_prompts([20], seed=42)[0]

    async def test(pd: PrefillAndDecode) -> None:
        request = disaggregation_pb2.DecodeRequest(request_id="local", prompt_token_ids=prompt, sampling=GREEDY)
        responses = [r async for r in pd.decode_stub.Decode(request)]
        assert [t for r in responses for t in r.token_ids] == expected_tokens(colocated, prompt)
        assert pd.decode.connector.pulls_started == [] and pd.decode.instance.counters.num_local_prefills == 1

    run(model, test)


# ---------------------------------------------------------------- queued at D


def test_a_handoff_queued_at_a_full_decode_instance_keeps_its_lease_until_it_is_pulled(model: Path) -> None:
    """D's one sequence slot is taken by a hand-off whose pull is held; a second waits for the
    slot, without blocks, while D renews its lease (which would otherwise expire on P many
    times over); once the first is done, the second is pulled and decodes as colocated."""
    colocated = LLM(model=str(model), kv_cache_memory=1 << 22)
    first_prompt, second_prompt = random_prompts([24, 40], seed=43)

    async def test(pd: PrefillAndDecode) -> None:
        first_prefilled = await prefill(pd, "first", first_prompt)
        second_prefilled = await prefill(pd, "second", second_prompt)
        with pd.decode.connector.hold_pulls():
            first = asyncio.ensure_future(decode(pd, "first", first_prompt, first_prefilled))
            await pull_started(pd.decode)
            second = asyncio.ensure_future(decode(pd, "second", second_prompt, second_prefilled))
            await pd.decode.report_when(lambda r: r.num_waiting == 2)
            renewals = pd.prefill.instance.counters
            await wait_for(lambda: renewals.num_lease_renewals >= 6, "D renewed both leases three times")
            assert used_blocks(pd.decode) == cdiv(24, BLOCK_SIZE)  # the queued one holds none
            assert pd.prefill.instance.counters.num_lease_expiries == 0
        assert (await first)[0] == expected_tokens(colocated, first_prompt)
        assert (await second)[0] == expected_tokens(colocated, second_prompt)

    run(model, test, lease_s=0.6, decode_max_num_seqs=1)


def test_each_lease_renewal_is_an_event_of_the_decode_calls_span(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With tracing on, each renewal of P's lease that P confirms while D holds the handle (its
    pull held here) is an event of D's call span when it happens, naming P and the lease."""
    prompt = random_prompts([40], seed=50)[0]
    exported = InMemorySpanExporter()
    renewed: list[str] = []  # the renewals handed to D's call span, as they happen
    record = CallSpans.kv_lease_renewed

    def recorded(spans: CallSpans, prefill_address: str, prefill_request_id: str, lease_s: float) -> None:
        record(spans, prefill_address, prefill_request_id, lease_s)
        renewed.append(prefill_request_id)

    monkeypatch.setattr(CallSpans, "kv_lease_renewed", recorded)
    prefilled_kv: list[disaggregation_pb2.KVHandle] = []

    async def test(pd: PrefillAndDecode) -> None:
        trace_calls(pd.decode, exported)
        prefilled = await prefill(pd, "r", prompt)
        prefilled_kv.append(prefilled.kv)
        with pd.decode.connector.hold_pulls():
            call = asyncio.ensure_future(decode(pd, "r", prompt, prefilled))
            await pull_started(pd.decode)
            num_before_pull = len(renewed)
            await wait_for(lambda: len(renewed) >= num_before_pull + 2, "D recorded two renewals during the pull")
        await call
        assert pd.prefill.instance.counters.num_lease_renewals >= len(renewed)

    run(model, test, lease_s=0.6)
    (pull,) = [span for span in exported.get_finished_spans() if span.name == "kv pull"]
    events = [event for event in decode_call_span(exported).events if event.name == "kv lease renewed"]
    assert 2 <= len(events) <= len(renewed)  # one answered after the call ended adds nothing
    (handle,) = prefilled_kv
    for event in events:
        assert dict(event.attributes or {}) == {
            "splitserve.kv.prefill_address": handle.prefill_address,
            "splitserve.kv.prefill_request_id": handle.request_id,
            "splitserve.kv.lease_s": 0.6,
        }
    # They say when: at least the two the test waited for came while the pull was held.
    assert pull.start_time is not None and pull.end_time is not None
    assert sum(pull.start_time <= event.timestamp <= pull.end_time for event in events) >= 2


def test_kv_dropped_by_prefill_while_the_handoff_queues_is_handed_back_at_once(model: Path) -> None:
    """P no longer holds the KV of a hand-off still waiting for a slot on D (here: aborted on
    P): D learns it from its next lease renewal and ends the call with DATA_LOSS before any
    token, without waiting for the slot, so the gateway can prefill it again."""
    first_prompt, second_prompt = random_prompts([24, 40], seed=44)

    async def test(pd: PrefillAndDecode) -> None:
        first_prefilled = await prefill(pd, "first", first_prompt)
        second_prefilled = await prefill(pd, "second", second_prompt)
        with pd.decode.connector.hold_pulls():
            first = asyncio.ensure_future(decode(pd, "first", first_prompt, first_prefilled))
            await pull_started(pd.decode)
            second = asyncio.ensure_future(decode_error(pd, decode_request("second", second_prompt, second_prefilled)))
            await pd.decode.report_when(lambda r: r.num_waiting == 2)
            aborted = await pd.prefill_stub.Abort(disaggregation_pb2.RequestRef(request_id="second"))
            assert aborted.found
            error = await second  # while the first still holds the only slot
            assert error.code() == grpc.StatusCode.DATA_LOSS and "prefill it again" in error.details()
            assert pd.decode.instance.counters.num_kv_handbacks == 1
            assert pd.decode.connector.pulls_started == ["first"]
        await first

    run(model, test, lease_s=0.6, decode_max_num_seqs=1)


# ---------------------------------------------------------------- pull failed


@pytest.mark.parametrize(
    ("allow_recompute", "policy", "code"),
    [
        (False, "recompute", grpc.StatusCode.DATA_LOSS),  # hand back: prefill it again
        (True, "fail", grpc.StatusCode.UNAVAILABLE),  # the last resort, and this instance may not recompute
        (True, "recompute", None),  # the last resort: recompute here
    ],
    ids=["handed-back", "failed", "recomputed"],
)
def test_a_failed_pull(model: Path, allow_recompute: bool, policy: str, code: grpc.StatusCode | None) -> None:
    colocated = LLM(model=str(model), kv_cache_memory=1 << 22)
    prompt = random_prompts([40], seed=45)[0]

    async def test(pd: PrefillAndDecode) -> None:
        pd.decode.connector.fail_pulls_with = "the link went down"
        prefilled = await prefill(pd, "r", prompt)
        if code is not None:
            error = await decode_error(pd, decode_request("r", prompt, prefilled, allow_recompute=allow_recompute))
            assert error.code() == code and "the link went down" in error.details()
        else:
            tokens, responses = await decode(pd, "r", prompt, prefilled, allow_recompute=True)
            assert tokens == expected_tokens(colocated, prompt)
            assert responses[0].kv_transfer.recomputed
            assert pd.decode.instance.counters.num_kv_recomputes == 1
        counters = pd.decode.instance.counters
        assert counters.num_kv_pull_failures == 1
        assert counters.num_kv_handbacks == (1 if code == grpc.StatusCode.DATA_LOSS else 0)
        await wait_for(lambda: not pd.prefill.connector.published, "D released the handle on P")

    run(model, test, kv_failure_policy=policy)


def test_a_handed_back_calls_span_ends_with_the_reason(model: Path) -> None:
    """With tracing on, D's span of a call that ends before any token (its pull failed: the
    gateway prefills again) is exported, its status the error that ended it."""
    prompt = random_prompts([40], seed=51)[0]
    exported = InMemorySpanExporter()

    async def test(pd: PrefillAndDecode) -> None:
        trace_calls(pd.decode, exported)
        pd.decode.connector.fail_pulls_with = "the link went down"
        prefilled = await prefill(pd, "r", prompt)
        error = await decode_error(pd, decode_request("r", prompt, prefilled))
        assert error.code() == grpc.StatusCode.DATA_LOSS
        await wait_for(lambda: not pd.prefill.connector.published, "D released the handle on P")

    run(model, test)
    span = decode_call_span(exported)
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description is not None and "the link went down" in span.status.description
    assert span.attributes is not None and span.attributes["gen_ai.usage.output_tokens"] == 0
    (pull,) = [span for span in exported.get_finished_spans() if span.name == "kv pull"]
    assert pull.status.status_code == StatusCode.ERROR


# ---------------------------------------------------------------- ended mid-pull


@pytest.mark.parametrize("how", ["client-gone", "abort-rpc"])
def test_a_handoff_ended_during_its_pull_frees_its_blocks_only_after_the_pull_stopped(model: Path, how: str) -> None:
    """The client leaves (or the gateway aborts) while D pulls: the pull is cancelled, and the
    blocks it was writing are still allocated when it stops; then both sides free everything."""
    prompt = random_prompts([40], seed=46)[0]

    async def test(pd: PrefillAndDecode) -> None:
        used_at_cancel: list[int] = []
        pd.decode.connector.on_cancel = lambda: used_at_cancel.append(
            len(pd.decode.engine.core.kv_cache_manager.get_block_ids("r"))
        )
        prefilled = await prefill(pd, "r", prompt)
        with pd.decode.connector.hold_pulls():
            call = pd.decode_stub.Decode(decode_request("r", prompt, prefilled))
            responses = asyncio.ensure_future(_read_all(call))
            await pull_started(pd.decode)
            if how == "client-gone":
                call.cancel()
            else:
                aborted = await pd.decode_stub.Abort(disaggregation_pb2.RequestRef(request_id="r"))
                assert aborted.found
                (last,) = await responses
                assert last.finish_reason == "abort" and not last.token_ids
            await wait_for(lambda: pd.decode.connector.pulls_cancelled == ["r"], "the pull was cancelled")
        assert used_at_cancel == [cdiv(40, BLOCK_SIZE)]  # the engine still held them for the pull
        await asyncio.gather(responses, return_exceptions=True)
        await wait_for(lambda: not pd.prefill.connector.published, "D released the handle on P")

    run(model, test)


async def _read_all(call: grpc.aio.UnaryStreamCall) -> list[disaggregation_pb2.DecodeResponse]:
    return [response async for response in call]


# ---------------------------------------------------------------- the prefill side


def test_pinned_kv_is_freed_when_its_lease_expires(model: Path) -> None:
    async def test(pd: PrefillAndDecode) -> None:
        await prefill(pd, "r", random_prompts([40], seed=47)[0])
        assert used_blocks(pd.prefill) == cdiv(40, BLOCK_SIZE)
        await pd.prefill.all_free()  # nobody renews: the lease expires
        assert pd.prefill.instance.counters.num_lease_expiries == 1
        released = await pd.prefill_stub.ReleaseKV(disaggregation_pb2.RequestRef(request_id="r"))
        assert not released.released  # freed once, by the expiry

    run(model, test, lease_s=0.3)


def test_release_kv_frees_once_and_renew_kv_names_what_is_not_pinned(model: Path) -> None:
    async def test(pd: PrefillAndDecode) -> None:
        await prefill(pd, "r", random_prompts([40], seed=48)[0])
        renewed = await pd.prefill_stub.RenewKV(disaggregation_pb2.RenewKVRequest(request_ids=["r", "unknown"]))
        assert list(renewed.unknown_request_ids) == ["unknown"]
        first = await pd.prefill_stub.ReleaseKV(disaggregation_pb2.RequestRef(request_id="r"))
        second = await pd.prefill_stub.ReleaseKV(disaggregation_pb2.RequestRef(request_id="r"))
        assert (first.released, second.released) == (True, False)
        await pd.prefill.all_free()
        renewed = await pd.prefill_stub.RenewKV(disaggregation_pb2.RenewKVRequest(request_ids=["r"]))
        assert list(renewed.unknown_request_ids) == ["r"]

    run(model, test)


def test_a_handle_aborted_on_prefill_before_the_pull_is_handed_back(model: Path) -> None:
    prompt = random_prompts([40], seed=49)[0]

    async def test(pd: PrefillAndDecode) -> None:
        prefilled = await prefill(pd, "r", prompt)
        aborted = await pd.prefill_stub.Abort(disaggregation_pb2.RequestRef(request_id="r"))
        assert aborted.found
        await pd.prefill.all_free()
        error = await decode_error(pd, decode_request("r", prompt, prefilled))
        assert error.code() == grpc.StatusCode.DATA_LOSS

    run(model, test)


def test_a_prefill_aborted_while_it_computes_ends_aborted_and_pins_nothing(model: Path) -> None:
    """The Abort RPC answers while the prefill step is still inside the model (held here),
    and the Prefill call ends ABORTED once the step is over, with nothing pinned."""
    prompt = random_prompts([40], seed=50)[0]

    async def test(pd: PrefillAndDecode) -> None:
        runner = pd.prefill.engine.core.runner
        execute = runner.execute
        entered, release = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def held_execute(*args: object) -> object:
            loop.call_soon_threadsafe(entered.set)
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(60)
            return execute(*args)

        runner.execute = held_execute  # type: ignore[method-assign]
        call = asyncio.ensure_future(prefill(pd, "r", prompt))
        await asyncio.wait_for(entered.wait(), 60)
        aborted = await pd.prefill_stub.Abort(disaggregation_pb2.RequestRef(request_id="r"))
        assert aborted.found  # answered while the step computes
        runner.execute = execute  # type: ignore[method-assign]
        release.set()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.ABORTED
        assert pd.prefill.connector.published == []

    run(model, test)
