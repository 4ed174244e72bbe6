"""The disaggregated path under load and faults, with real processes: control calls
answer while the prefill instance is inside a long step, a request queued on decode
longer than the lease still gets its KV, lost KV goes back to prefill instead of
being recomputed on decode, and a recompute that must happen runs in chunks beside
the running streams. Free blocks are back to total on both sides after each."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2
from tests.checkpoints import LONG_MODEL_KV_MEMORY, LONG_PROMPT_TOKENS, random_prompts
from tests.services.client import GREEDY, assert_all_free, decode_request, run_prefill
from tests.services.processes import Service, running

pytest.importorskip("ucxx")


@pytest.fixture(scope="module")
def colocated(long_model: Path) -> LLM:
    return LLM(model=str(long_model), kv_cache_memory=1 << 26, dtype="float32")


@pytest.fixture(scope="module")
def prefill(long_model: Path) -> Iterator[Service]:
    with running("prefill", long_model, *LONG_MODEL_KV_MEMORY, "--dtype", "float32", "--lease-seconds", "2") as service:
        yield service


@pytest.fixture(scope="module")
def decode(long_model: Path) -> Iterator[Service]:
    """One sequence at a time: a second request queues behind the first."""
    with running("decode", long_model, *LONG_MODEL_KV_MEMORY, "--dtype", "float32", "--max-num-seqs", "1") as service:
        yield service


def expected_tokens(colocated: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return colocated.generate([prompt], params)[0].outputs[0].token_ids


def decode_call(
    decode: Service,
    request_id: str,
    prompt: list[int],
    prefilled: disaggregation_pb2.PrefillResponse,
    max_tokens: int,
    allow_recompute: bool = False,
) -> grpc.Future:
    sampling = generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return disaggregation_pb2_grpc.DecodeStub(decode.channel).Decode(
        decode_request(request_id, prompt, prefilled, sampling, allow_recompute), timeout=120
    )


def wait_until(condition, timeout_s: float = 120.0) -> None:  # a safety net
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)


def test_control_calls_answer_while_prefill_is_inside_a_long_step(prefill: Service) -> None:
    stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
    pinned = run_prefill(prefill, "ctl-pinned", random_prompts([40], seed=40)[0])
    steps_before = prefill.load().counters.num_steps
    long_prompt = random_prompts([LONG_PROMPT_TOKENS], seed=41)[0]
    with ThreadPoolExecutor(1) as pool:
        long_prefill = pool.submit(
            stub.Prefill,
            disaggregation_pb2.PrefillRequest(request_id="ctl-long", prompt_token_ids=long_prompt, sampling=GREEDY),
            timeout=120,
        )
        # Queued, then under way: P splits the prompt into chunks, and once the first one is done
        # the engine is computing the next while the calls below come in.
        wait_until(lambda: prefill.load().num_pending_prefill_tokens >= LONG_PROMPT_TOKENS)
        wait_until(lambda: prefill.load().counters.num_steps > steps_before)
        report = prefill.load()
        renewed = stub.RenewKV(disaggregation_pb2.RenewKVRequest(request_ids=["ctl-pinned", "nobody"]), timeout=5)
        released = stub.ReleaseKV(disaggregation_pb2.RequestRef(request_id="ctl-pinned"), timeout=5)
        health = health_pb2_grpc.HealthStub(prefill.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        aborted = stub.Abort(disaggregation_pb2.RequestRef(request_id="ctl-long"), timeout=5)
        # Every answer came while the long prefill was still computing, and none waited for a step
        # to end: four calls that each did would span four step ends after the report's (the abort
        # stops the steps), where four answered at once span one at most unless each took about a
        # step (chunks of "auto" size take about half a second).
        assert not long_prefill.done(), "the prefill ended before the control calls were answered"
        num_steps = prefill.load().counters.num_steps - report.counters.num_steps
        assert num_steps < 4, f"{num_steps} steps ended while four control calls were answered"
        # The report shows the long prompt's work still to do (how many of its chunks are done
        # depends on the machine's speed).
        assert 0 < report.num_pending_prefill_tokens <= LONG_PROMPT_TOKENS
        assert list(renewed.unknown_request_ids) == ["nobody"]
        assert released.released and aborted.found
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as raised:
            long_prefill.result()
        assert raised.value.code() == grpc.StatusCode.ABORTED
    assert pinned.kv.request_id == "ctl-pinned"
    assert_all_free(prefill)
    assert prefill.load().counters.num_lease_expiries == 0


def test_a_request_queued_on_decode_longer_than_the_lease_still_pulls(
    prefill: Service, decode: Service, colocated: LLM
) -> None:
    """D renews P's lease while the request waits behind another (max-num-seqs 1), so the
    KV is still there when its turn comes: pulled, not recomputed, and nothing expired."""
    before = prefill.load().counters
    first, queued = random_prompts([30, 50], seed=42)
    running_call = decode_call(decode, "busy", first, run_prefill(prefill, "busy", first), max_tokens=3000)
    next(running_call)  # decoding: D's one sequence slot is taken
    prefilled = run_prefill(prefill, "queued", queued)
    with ThreadPoolExecutor(1) as pool:
        queued_call = pool.submit(lambda: list(decode_call(decode, "queued", queued, prefilled, max_tokens=8)))
        # Queued past 2.5 leases (D renews every third of one): P's count of renewals, not a sleep.
        wait_until(lambda: prefill.load().counters.num_lease_renewals >= before.num_lease_renewals + 8)
        assert not queued_call.done()
        running_call.cancel()
        responses = queued_call.result(timeout=60)
    tokens = [prefilled.first_token_id] + [t for r in responses for t in r.token_ids]
    assert tokens == expected_tokens(colocated, queued, 8)
    transfer = responses[0].kv_transfer
    assert not transfer.recomputed and transfer.num_pulled_blocks == len(prefilled.kv.block_ids)
    after = prefill.load().counters
    assert after.num_lease_expiries == before.num_lease_expiries
    assert after.num_lease_renewals >= before.num_lease_renewals + 8
    assert_all_free(prefill, decode)


def test_kv_lost_while_queued_goes_back_to_prefill_and_the_output_is_unchanged(
    prefill: Service, decode: Service, colocated: LLM
) -> None:
    """P frees the KV of a request queued on D (here: a release from elsewhere). D learns it
    from its next renewal and hands the request back at once (DATA_LOSS, no token, no
    recompute); a kv_only prefill on the same P pins the prompt again under a new id, and
    the decode continues after the first token as if nothing happened."""
    first, queued = random_prompts([30, 60], seed=43)
    handbacks_before = decode.load().counters.num_kv_handbacks
    running_call = decode_call(decode, "busy-2", first, run_prefill(prefill, "busy-2", first), max_tokens=3000)
    next(running_call)
    prefilled = run_prefill(prefill, "lost", queued)
    lost_call = decode_call(decode, "lost", queued, prefilled, max_tokens=8)
    deadline = time.monotonic() + 120  # a safety net
    while decode.load().num_waiting == 0:  # the call is queued behind "busy-2"
        assert time.monotonic() < deadline, "the decode call never queued"
        time.sleep(0.02)
    disaggregation_pb2_grpc.PrefillStub(prefill.channel).ReleaseKV(disaggregation_pb2.RequestRef(request_id="lost"))
    with pytest.raises(grpc.RpcError) as raised:
        list(lost_call)
    assert raised.value.code() == grpc.StatusCode.DATA_LOSS
    assert running_call.running()  # handed back while still queued, not when its turn came
    assert decode.load().counters.num_kv_handbacks == handbacks_before + 1
    running_call.cancel()
    again = disaggregation_pb2_grpc.PrefillStub(prefill.channel).Prefill(
        disaggregation_pb2.PrefillRequest(
            request_id="lost.kv1", prompt_token_ids=queued, sampling=GREEDY, kv_only=True
        ),
        timeout=60,
    )
    assert again.kv.request_id == "lost.kv1" and again.num_cached_tokens >= 48  # P's prefix cache kept the blocks
    again.first_token_id = prefilled.first_token_id  # the token the client already has
    responses = list(decode_call(decode, "lost", queued, again, max_tokens=8))
    tokens = [prefilled.first_token_id] + [t for r in responses for t in r.token_ids]
    assert tokens == expected_tokens(colocated, queued, 8)
    assert not responses[0].kv_transfer.recomputed
    assert_all_free(prefill, decode)


def test_kv_only_prefill_pins_even_when_its_token_would_finish(prefill: Service) -> None:
    stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
    one = generation_pb2.SamplingParams(temperature=0.0, max_tokens=1)
    response = stub.Prefill(
        disaggregation_pb2.PrefillRequest(
            request_id="kv-only", prompt_token_ids=list(range(5, 40)), sampling=one, kv_only=True
        ),
        timeout=60,
    )
    assert not response.finish_reason and response.HasField("kv") and response.kv.lease_s == 2.0
    assert stub.ReleaseKV(disaggregation_pb2.RequestRef(request_id="kv-only")).released
    assert_all_free(prefill)


def test_a_forced_recompute_on_decode_runs_in_chunks_beside_running_streams(
    long_model: Path, prefill: Service, colocated: LLM
) -> None:
    """The last resort: a 2048-token prompt recomputed on D. With a chunk of 256 tokens per
    step, a running stream gets a token from each of the recompute's steps (instead of one
    token after a whole prompt's stall), and the recomputed request's output is exact."""
    chunk = 256
    long_prompt = random_prompts([LONG_PROMPT_TOKENS], seed=44)[0]
    stream_prompt = random_prompts([20], seed=45)[0]
    with running(
        "decode", long_model, *LONG_MODEL_KV_MEMORY, "--dtype", "float32", "--decode-recompute-chunk", str(chunk)
    ) as decode:
        stream_call = decode_call(
            decode, "stream", stream_prompt, run_prefill(prefill, "stream", stream_prompt), max_tokens=3000
        )
        next(stream_call)
        token_times: list[float] = []

        def read_stream() -> None:
            try:
                for _ in stream_call:
                    token_times.append(time.monotonic())
            except grpc.RpcError as error:  # cancelled by the test once the recompute is over
                if error.code() != grpc.StatusCode.CANCELLED:
                    raise

        reader = threading.Thread(target=read_stream)
        reader.start()
        orphan = run_prefill(prefill, "orphan", long_prompt)
        # P lets go of the KV: the pull is refused at once, and recompute is the last resort.
        disaggregation_pb2_grpc.PrefillStub(prefill.channel).ReleaseKV(
            disaggregation_pb2.RequestRef(request_id="orphan")
        )
        started = time.monotonic()
        orphan_call = decode_call(decode, "orphan", long_prompt, orphan, max_tokens=4, allow_recompute=True)
        first = next(orphan_call)
        first_token_at = time.monotonic()
        rest = list(orphan_call)
        stream_call.cancel()
        reader.join()
        assert first.kv_transfer.recomputed
        tokens = [orphan.first_token_id] + [t for r in [first, *rest] for t in r.token_ids]
        assert tokens == expected_tokens(colocated, long_prompt, 4)
        # One decode step of the running stream per recompute chunk (8 of them), at least, and
        # no gap of the stream anywhere near the whole recompute (one step of 2048 tokens).
        window = [started, *(t for t in token_times if started <= t <= first_token_at), first_token_at]
        longest_gap = max(later - earlier for earlier, later in zip(window, window[1:]))
        assert len(window) - 2 >= LONG_PROMPT_TOKENS // chunk - 1, window
        assert longest_gap < 0.5 * (first_token_at - started), (longest_gap, first_token_at - started)
        assert decode.load().counters.num_kv_recomputes == 1
        assert_all_free(decode)
    assert_all_free(prefill)
