"""Prefill and decode services as real processes on loopback: P -> KV connector -> D
gives the colocated engine's greedy tokens, and no KV block leaks on any path."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine import LLM
from engine.kv_cache_utils import cdiv
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2
from tests.checkpoints import make_checkpoint, random_prompts
from tests.services.client import (
    GREEDY,
    assert_all_free,
    assert_altered_handle_refused,
    decode_request,
    expected_tokens,
    run_decode,
    run_prefill,
)
from tests.services.processes import Service, running
from tests.stores import free_port

pytest.importorskip("ucxx")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama-other"), seed=1)


@pytest.fixture(scope="module")
def prefill(model: Path) -> Iterator[Service]:
    with running("prefill", model, "--lease-seconds", "5") as service:
        yield service


@pytest.fixture(scope="module")
def decode(model: Path) -> Iterator[Service]:
    with running("decode", model, "--kv-pull-timeout", "5") as service:
        yield service


def test_disaggregated_output_equals_colocated(prefill: Service, decode: Service, colocated: LLM) -> None:
    for index, prompt in enumerate(random_prompts([3, 16, 17, 40, 70], seed=21)):
        request_id = f"match-{index}"
        prefilled = run_prefill(prefill, request_id, prompt)
        assert prefilled.kv.num_tokens == len(prompt) and len(prefilled.kv.block_ids) == cdiv(len(prompt), 16)
        tokens, responses = run_decode(decode, request_id, prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        assert responses[-1].finish_reason == "length"
        transfer = responses[0].kv_transfer
        assert not transfer.recomputed and transfer.num_pulled_blocks == len(prefilled.kv.block_ids)
    assert_all_free(prefill, decode)
    report = decode.load()
    assert report.kv_transfers >= 5 and report.kv_transfer_bytes > 0
    # The connector's own state in both reports: no pull under way, and the one connection D
    # keeps for its next pull from P (P serves it).
    prefill_report = prefill.load()
    assert (report.num_kv_transfers_in_flight, prefill_report.num_kv_transfers_in_flight) == (0, 0)
    assert (report.num_kv_connections, prefill_report.num_kv_connections) == (1, 1)


def test_structured_output_equals_colocated_token_for_token(
    model: Path, prefill: Service, decode: Service, colocated: LLM
) -> None:
    """P samples the first token under the grammar, D rebuilds the matcher over it and goes on:
    greedy, the tokens are the colocated engine's, and the text parses or matches."""
    from transformers import PreTrainedTokenizerFast

    from cluster.sampling_proto import sampling_params_from_proto
    from tests.engine.test_structured_output import PERSON, REGEX, check_output

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model))
    formats = [
        generation_pb2.SamplingParams(temperature=0.0, max_tokens=100, json_schema=json.dumps(PERSON)),
        generation_pb2.SamplingParams(temperature=0.0, max_tokens=100, regex=REGEX),
        generation_pb2.SamplingParams(
            temperature=0.0,
            max_tokens=100,
            json_schema=json.dumps({"type": "array", "items": {"enum": [1, 22, 333]}, "minItems": 2, "maxItems": 4}),
        ),
    ]
    for index, prompt in enumerate(random_prompts([5, 17, 30, 9, 40, 12], seed=24)):
        sampling = formats[index % len(formats)]
        request_id = f"structured-{index}"
        prefilled = run_prefill(prefill, request_id, prompt, sampling)
        tokens, responses = run_decode(decode, request_id, prompt, prefilled, sampling=sampling)
        params = sampling_params_from_proto(sampling)
        expected = colocated.generate([prompt], params)[0].outputs[0]
        assert tokens == expected.token_ids
        assert responses[-1].finish_reason == expected.finish_reason == "stop"
        check_output(params.structured, tokenizer.decode(tokens))
    assert_all_free(prefill, decode)


def test_decode_prefix_hit_pulls_only_new_blocks(prefill: Service, decode: Service, colocated: LLM) -> None:
    shared = random_prompts([48], seed=22)[0]  # three full blocks
    transfers = []
    for index, suffix in enumerate(random_prompts([20, 20], seed=23)):
        prompt = shared + suffix
        prefilled = run_prefill(prefill, f"prefix-{index}", prompt)
        tokens, responses = run_decode(decode, f"prefix-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfers.append(responses[0].kv_transfer)
    assert (transfers[0].num_local_hit_blocks, transfers[0].num_pulled_blocks) == (0, 5)
    assert (transfers[1].num_local_hit_blocks, transfers[1].num_pulled_blocks) == (3, 2)
    assert_all_free(prefill, decode)


def test_unreleased_kv_is_freed_at_lease_expiry(prefill: Service) -> None:
    expiries_before = prefill.load().counters.num_lease_expiries
    run_prefill(prefill, "lease", random_prompts([40], seed=24)[0])
    report = prefill.load()
    assert report.num_total_blocks - report.num_free_blocks == 3
    # The fixture's lease is 5 s (long enough for every other test's pull on a slow machine); the
    # bound only stops a lease that never expires from hanging the test.
    deadline = time.monotonic() + 120
    while prefill.load().counters.num_lease_expiries == expiries_before:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)
    assert prefill.load().counters.num_lease_expiries == expiries_before + 1
    assert_all_free(prefill)
    released = disaggregation_pb2_grpc.PrefillStub(prefill.channel).ReleaseKV(
        disaggregation_pb2.RequestRef(request_id="lease")
    )
    assert not released.released  # exactly once: the lease already freed them


def test_abort_frees_pinned_blocks(prefill: Service) -> None:
    run_prefill(prefill, "abort-pinned", random_prompts([40], seed=25)[0])
    found = disaggregation_pb2_grpc.PrefillStub(prefill.channel).Abort(
        disaggregation_pb2.RequestRef(request_id="abort-pinned")
    )
    assert found.found
    assert_all_free(prefill)


def test_client_leaving_mid_decode_frees_both_sides(prefill: Service, decode: Service) -> None:
    prompt = random_prompts([50], seed=26)[0]
    prefilled = run_prefill(prefill, "leave", prompt)
    stub = disaggregation_pb2_grpc.DecodeStub(decode.channel)
    long_run = generation_pb2.SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    call = stub.Decode(decode_request("leave", prompt, prefilled, long_run))
    next(call)
    call.cancel()
    assert_all_free(prefill, decode)


def test_dead_prefill_instance_hands_the_request_back(model: Path, decode: Service) -> None:
    """Without leave to recompute, a pull that cannot happen ends the call before any token
    with DATA_LOSS: the gateway then prefills again elsewhere."""
    prompt = random_prompts([45], seed=27)[0]
    with running("prefill", model) as doomed:
        prefilled = run_prefill(doomed, "orphan", prompt)
        doomed.stop(signal.SIGKILL)
    before = decode.load().counters
    with pytest.raises(grpc.RpcError) as raised:
        run_decode(decode, "orphan", prompt, prefilled)
    assert raised.value.code() == grpc.StatusCode.DATA_LOSS
    assert "prefill it again" in raised.value.details()
    after = decode.load().counters
    assert after.num_kv_handbacks == before.num_kv_handbacks + 1 and after.num_kv_recomputes == before.num_kv_recomputes
    assert_all_free(decode)


def test_dead_prefill_instance_with_recompute_allowed_recomputes(model: Path, decode: Service, colocated: LLM) -> None:
    prompt = random_prompts([45], seed=31)[0]
    with running("prefill", model) as doomed:
        prefilled = run_prefill(doomed, "orphan-recompute", prompt)
        doomed.stop(signal.SIGKILL)
    tokens, responses = run_decode(decode, "orphan-recompute", prompt, prefilled, allow_recompute=True)
    assert tokens == expected_tokens(colocated, prompt)
    assert responses[0].kv_transfer.recomputed
    assert decode.load().counters.num_kv_recomputes >= 1
    assert_all_free(decode)


def test_unreachable_peer_with_fail_policy_is_a_clear_error(model: Path, prefill: Service) -> None:
    prompt = random_prompts([20], seed=28)[0]
    prefilled = run_prefill(prefill, "unreachable", prompt)
    prefilled.kv.connector_address = f"127.0.0.1:{free_port()}"  # nobody listens there
    with running("decode", model, "--kv-failure-policy", "fail", "--kv-pull-timeout", "3") as strict:
        with pytest.raises(grpc.RpcError) as raised:
            run_decode(strict, "unreachable", prompt, prefilled, allow_recompute=True)
        # D ended the call itself, on the failed pull (the client's own deadline would be
        # DEADLINE_EXCEEDED): neither recomputed nor handed back.
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV transfer from the prefill instance failed" in raised.value.details()
        counters = strict.load().counters
        assert (counters.num_kv_pull_failures, counters.num_kv_recomputes, counters.num_kv_handbacks) == (1, 0, 0)
        assert_all_free(strict)
    assert_all_free(prefill)  # D still released P's blocks


def test_mismatched_fingerprints_refuse_to_pair(
    other_model: Path, prefill: Service, decode: Service, colocated: LLM
) -> None:
    prompt = random_prompts([20], seed=29)[0]
    with running("decode", other_model) as stranger:
        prefilled = run_prefill(prefill, "stranger", prompt)
        with pytest.raises(grpc.RpcError) as raised:
            run_decode(stranger, "stranger", prompt, prefilled)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model: decode has" in raised.value.details() and "prefill has" in raised.value.details()
        assert_all_free(stranger)
        # Both keep serving: the same prefill pairs with the matching decode instance.
        tokens, _ = run_decode(decode, "stranger", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
    assert_all_free(prefill, decode)


@pytest.mark.parametrize(
    ("field", "alter", "message"),
    [
        (
            "connector",
            lambda kv: setattr(kv, "connector", "lmcache"),
            "the KV handle is for the 'lmcache' connector; this decode instance uses 'ucx'",
        ),
        (
            "num_tokens",
            lambda kv: setattr(kv, "num_tokens", kv.num_tokens - 1),
            "the KV handle holds the KV of 19 tokens; this call's prompt has 20",
        ),
    ],
)
def test_a_handle_decode_cannot_pull_is_refused_before_anything_is_allocated(
    prefill: Service,
    decode: Service,
    colocated: LLM,
    field: str,
    alter,
    message: str,
) -> None:
    prompt = random_prompts([20], seed=31)[0]
    assert_altered_handle_refused(
        prefill, decode, colocated, f"unpullable-{field}", prompt, alter, grpc.StatusCode.INVALID_ARGUMENT, message
    )


def test_sigterm_drains_in_flight_requests(model: Path, prefill: Service) -> None:
    prompt = random_prompts([30], seed=30)[0]
    service = Service("decode", model)
    try:
        prefilled = run_prefill(prefill, "drain", prompt)  # once D is up: starting it may take longer than the lease
        stub = disaggregation_pb2_grpc.DecodeStub(service.channel)
        longer = generation_pb2.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        call = stub.Decode(decode_request("drain", prompt, prefilled, longer))
        first = next(call)
        service.process.send_signal(signal.SIGTERM)
        responses = [first, *call]  # a fast decode may have merged every token into the first
        assert sum(len(r.token_ids) for r in responses) == 39  # every token after the first one P sampled
        assert responses[-1].finish_reason == "length"
        assert service.process.wait(timeout=30) == 0
    finally:
        service.stop()
    assert_all_free(prefill)


def test_first_token_that_finishes_pins_nothing(prefill: Service) -> None:
    stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
    one = generation_pb2.SamplingParams(temperature=0.0, max_tokens=1)
    response = stub.Prefill(
        disaggregation_pb2.PrefillRequest(request_id="one", prompt_token_ids=[5, 6, 7], sampling=one)
    )
    assert response.finish_reason == "length" and not response.HasField("kv")
    assert_all_free(prefill)


def test_bad_sampling_parameters_are_invalid_argument(prefill: Service) -> None:
    stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Prefill(
            disaggregation_pb2.PrefillRequest(
                request_id="bad", prompt_token_ids=[5], sampling=generation_pb2.SamplingParams(top_p=1.5)
            )
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        stub.Prefill(disaggregation_pb2.PrefillRequest(request_id="empty", prompt_token_ids=[], sampling=GREEDY))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in raised.value.details()
    assert_all_free(prefill)


def test_a_fresh_prefill_instance_reports_its_prefill_rate(model: Path) -> None:
    """A warm-up prefill at start measures the rate admission control divides queues by, so
    the gateway can estimate waits before the first real prefill ends; it leaves nothing held."""
    with running("prefill", model) as fresh:
        report = fresh.load()
        assert report.prefill_tokens_per_s > 0
        assert report.num_free_blocks == report.num_total_blocks and report.num_waiting == report.num_running == 0


def test_a_speculating_decode_instance_equals_colocated(model: Path, prefill: Service, colocated: LLM) -> None:
    """D drafts with a draft model (the target itself: every draft right), computing the draft's KV
    for the pulled prompt locally; tokens as colocated, counts in its load report, no leak."""
    with running("decode", model, "--speculative-model", str(model), "--num-speculative-tokens", "3") as decode:
        for index, prompt in enumerate(random_prompts([5, 33], seed=27)):
            request_id = f"spec-{index}"
            prefilled = run_prefill(prefill, request_id, prompt)
            tokens, responses = run_decode(decode, request_id, prompt, prefilled)
            assert tokens == expected_tokens(colocated, prompt)
            assert len(responses) < len(tokens) - 1  # several tokens per step
        assert_all_free(prefill, decode)
        counters = decode.load().counters
        assert counters.num_spec_draft_tokens > 0
        assert counters.num_spec_accepted_tokens == counters.num_spec_draft_tokens


def test_medusa_drafts_cross_the_hand_off_in_the_signed_handle(model: Path, colocated: LLM, tmp_path: Path) -> None:
    """P and D with the same Medusa heads: P's heads draft once after the first token and the
    drafts travel in the KV handle; D verifies them at its first step. Tokens as colocated."""
    from tests.engine.spec_decode.medusa_heads import make_medusa_heads

    heads = make_medusa_heads(tmp_path / "heads", "vllm")
    config = json.dumps({"method": "medusa", "model": str(heads)})
    with (
        running("prefill", model, "--speculative-config", config) as p,
        running("decode", model, "--speculative-config", config) as d,
    ):
        prompt = random_prompts([21], seed=29)[0]
        prefilled = run_prefill(p, "medusa-0", prompt)
        assert len(prefilled.kv.draft_token_ids) == 3  # one per head
        tokens, _ = run_decode(d, "medusa-0", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        # Three tokens in all: D's first step may verify one draft (max_tokens leaves room for no
        # more), its second none. So exactly one draft verified iff P's drafts came across.
        drafted = d.load().counters.num_spec_draft_tokens
        short = generation_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        prefilled = run_prefill(p, "medusa-1", prompt, short)
        run_decode(d, "medusa-1", prompt, prefilled, sampling=short)
        assert d.load().counters.num_spec_draft_tokens == drafted + 1
        assert_all_free(p, d)


def test_other_medusa_heads_refuse_the_handle_naming_both(
    model: Path, decode: Service, colocated: LLM, tmp_path: Path
) -> None:
    """A D with other heads than P's would verify drafts from heads it does not have: the Decode
    call is refused naming both drafters. A D without heads takes the same handle (it ignores
    P's drafts)."""
    from kv_connector.fingerprint import medusa_draft
    from tests.engine.spec_decode.medusa_heads import make_medusa_heads

    heads = make_medusa_heads(tmp_path / "heads", "vllm", seed=0)
    other = make_medusa_heads(tmp_path / "other" / "heads", "vllm", seed=1)  # same name, other weights
    with (
        running("prefill", model, "--speculative-config", json.dumps({"method": "medusa", "model": str(heads)})) as p,
        running("decode", model, "--speculative-config", json.dumps({"method": "medusa", "model": str(other)})) as d,
    ):
        prompt = random_prompts([21], seed=30)[0]
        prefilled = run_prefill(p, "other-heads", prompt)
        assert prefilled.kv.fingerprint.draft == medusa_draft(heads) and prefilled.kv.draft_token_ids
        with pytest.raises(grpc.RpcError) as raised:
            run_decode(d, "other-heads", prompt, prefilled)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        named = f"draft: decode has '{medusa_draft(other)}', prefill has '{medusa_draft(heads)}'"
        assert named in raised.value.details()
        assert_all_free(d)
        tokens, _ = run_decode(decode, "other-heads", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        assert_all_free(p, decode)
