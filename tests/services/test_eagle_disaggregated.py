"""EAGLE and EAGLE-3 through the prefill/decode hand-off, as real processes on loopback (one P
and one D per method, shared by the module's tests): P's draft proposes a chain after the first
token and the drafts travel in the signed KV handle; D verifies them at its first step; the
draft's KV over the prompt crosses in the UCX pull with the target's blocks, whatever D's
prefix-cache hits. Greedy tokens equal the colocated engine's without speculation, a D with
another drafter (EAGLE-3 for P's EAGLE, or the reverse) refuses P's handle naming both, and no
block leaks. (That D's draft then attends over the prompt as the colocated engine's does, chain
for chain, is tests/engine/spec_decode/test_eagle.py's.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine import LLM
from engine.spec_decode.eagle3_checkpoint import save_eagle3_draft
from kv_connector.fingerprint import eagle_draft, handoff_draft
from splitserve.v1 import generation_pb2
from tests.checkpoints import random_prompts
from tests.engine.spec_decode.eagle3_drafts import random_eagle3_draft
from tests.engine.spec_decode.eagle_drafts import make_eagle_draft
from tests.services.client import (
    assert_all_free,
    assert_an_abort_during_the_hand_off_frees_every_block,
    expected_tokens,
    run_decode,
    run_prefill,
)
from tests.services.processes import Service, running
from tests.stores import free_port

pytest.importorskip("ucxx")

NUM_SPECULATIVE_TOKENS = 3


def eagle_config(draft: Path, method: str = "eagle") -> str:
    return json.dumps({"method": method, "model": str(draft), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random EAGLE draft of the module's model."""
    return make_eagle_draft(tmp_path_factory.mktemp("eagle") / "draft", "eagle")


@pytest.fixture(scope="module")
def eagle3_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random EAGLE-3 draft of the module's two-layer model, fusing the residual streams entering
    both layers (EAGLE-3's default layers need eight)."""
    folder = tmp_path_factory.mktemp("eagle3") / "draft"
    save_eagle3_draft(random_eagle3_draft(feature_layer_ids=(0, 1)), folder, "speculators", {})
    return folder


@pytest.fixture(scope="module")
def eagle3_prefill(model: Path, eagle3_draft: Path) -> Iterator[Service]:
    with running("prefill", model, "--speculative-config", eagle_config(eagle3_draft, "eagle3")) as service:
        yield service


@pytest.fixture(scope="module")
def eagle3_decode(model: Path, eagle3_draft: Path) -> Iterator[Service]:
    with running("decode", model, "--speculative-config", eagle_config(eagle3_draft, "eagle3")) as service:
        yield service


@pytest.fixture(scope="module")
def prefill(model: Path, draft: Path) -> Iterator[Service]:
    with running("prefill", model, "--speculative-config", eagle_config(draft)) as service:
        yield service


@pytest.fixture(scope="module")
def decode(model: Path, draft: Path) -> Iterator[Service]:
    with running("decode", model, "--speculative-config", eagle_config(draft)) as service:
        yield service


@dataclass(frozen=True, slots=True)
class Pair:
    """A P and a D with the same draft, and the name their fingerprints give it."""

    method: str
    prefill: Service
    decode: Service
    draft: str


@pytest.fixture(params=["eagle", "eagle3"])
def pair(request: pytest.FixtureRequest) -> Pair:
    """Each method's P and D (the module's: started once, shared by the tests)."""
    if request.param == "eagle":
        named = eagle_draft(request.getfixturevalue("draft"))
        return Pair("eagle", request.getfixturevalue("prefill"), request.getfixturevalue("decode"), named)
    named = handoff_draft("eagle3", request.getfixturevalue("eagle3_draft"))
    return Pair("eagle3", request.getfixturevalue("eagle3_prefill"), request.getfixturevalue("eagle3_decode"), named)


def test_drafts_cross_the_hand_off_in_the_signed_handle(pair: Pair, colocated: LLM) -> None:
    """P's draft chains after the first token; the handle names the draft (``eagle:`` or
    ``eagle3:``) and carries the chain; D's tokens are the colocated engine's without speculation."""
    for index, prompt in enumerate(random_prompts([21, 40], seed=41)):
        prefilled = run_prefill(pair.prefill, f"{pair.method}-{index}", prompt)
        assert prefilled.kv.fingerprint.draft == pair.draft and pair.draft.startswith(f"{pair.method}:")
        assert len(prefilled.kv.draft_token_ids) == NUM_SPECULATIVE_TOKENS
        tokens, _ = run_decode(pair.decode, f"{pair.method}-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
    # Three tokens in all: D's first step may verify one draft (max_tokens leaves room for no
    # more), its second none (its own chain starts from that step). So exactly one draft is
    # verified iff P's drafts came across.
    drafted = pair.decode.load().counters.num_spec_draft_tokens
    short = generation_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = random_prompts([21], seed=42)[0]
    prefilled = run_prefill(pair.prefill, f"{pair.method}-short", prompt, short)
    run_decode(pair.decode, f"{pair.method}-short", prompt, prefilled, sampling=short)
    assert pair.decode.load().counters.num_spec_draft_tokens == drafted + 1
    assert_all_free(pair.prefill, pair.decode)


def test_the_prompt_draft_kv_crosses_in_the_pull_whatever_d_holds(pair: Pair, colocated: LLM) -> None:
    """Each pull's bytes are the blocks D lacked plus the draft's KV over the positions P's target
    computed (P's own prefix-cache hits have none): pulled with the blocks, and alone when D's
    prefix cache holds every block (D caches no draft KV)."""
    runner = colocated.engine.runner
    shape = runner.shape
    # One entry of the one-layer draft: K and V of its KV heads (the target's count and width
    # for both methods' drafts here), in the served dtype.
    entry_bytes = 2 * shape.num_kv_heads * shape.head_dim * runner.dtype.itemsize
    block_bytes = runner.bytes_per_block
    shared = random_prompts([32], seed=44)[0]  # two full blocks
    cases = [
        # (prompt, D's hit blocks, blocks pulled, draft entries): first seen by both
        (shared + random_prompts([8], seed=45)[0], 0, 3, 40),
        # the same two blocks first: hits on both sides, P's draft KV starts after its hit
        (shared + random_prompts([8], seed=46)[0], 2, 1, 8),
        # the shared blocks alone: D pulls no block, only the draft KV (P recomputes the last block)
        (shared, 2, 0, 16),
    ]
    for index, (prompt, num_hit_blocks, num_pulled_blocks, num_entries) in enumerate(cases):
        prefilled = run_prefill(pair.prefill, f"{pair.method}-draft-kv-{index}", prompt)
        tokens, responses = run_decode(pair.decode, f"{pair.method}-draft-kv-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        assert (transfer.num_local_hit_blocks, transfer.num_pulled_blocks) == (num_hit_blocks, num_pulled_blocks)
        assert transfer.num_bytes == num_pulled_blocks * block_bytes + num_entries * entry_bytes
    assert_all_free(pair.prefill, pair.decode)


def test_a_failed_or_aborted_hand_off_leaves_nothing_behind(pair: Pair, colocated: LLM) -> None:
    """A pull that fails (P's KV address unreachable) brings no draft KV: D recomputes the prompt,
    its draft makes its own KV over it, and the tokens are the colocated engine's. A hand-off
    aborted once its KV arrived frees every block too."""
    prompt = random_prompts([30], seed=47)[0]
    prefilled = run_prefill(pair.prefill, f"{pair.method}-failed", prompt)
    prefilled.kv.connector_address = f"127.0.0.1:{free_port()}"  # nobody listens there
    tokens, responses = run_decode(pair.decode, f"{pair.method}-failed", prompt, prefilled, allow_recompute=True)
    assert tokens == expected_tokens(colocated, prompt) and responses[0].kv_transfer.recomputed
    assert_all_free(pair.prefill, pair.decode)
    aborted = random_prompts([30], seed=48)[0]
    assert_an_abort_during_the_hand_off_frees_every_block(pair.prefill, pair.decode, f"{pair.method}-abort", aborted)


def test_eagle_and_eagle3_drafts_refuse_each_others_handles_naming_both(
    prefill: Service,
    decode: Service,
    eagle3_prefill: Service,
    eagle3_decode: Service,
    colocated: LLM,
    draft: Path,
    eagle3_draft: Path,
) -> None:
    """A D with another drafter than P's would verify drafts it cannot make (and attend over
    another draft's KV): an EAGLE P's handle on an EAGLE-3 D, and an EAGLE-3 P's on an EAGLE D,
    are refused naming both drafters before D allocates a block; each handle then decodes on a D
    with P's draft. (Two EAGLE or two EAGLE-3 drafts that differ fall to the same rule, without a
    process of their own: tests/kv_connector/test_fingerprint.py.)"""
    eagle, eagle3 = eagle_draft(draft), handoff_draft("eagle3", eagle3_draft)
    # (P, a D with the other method's draft, a D with P's draft, P's drafter, the other D's)
    pairs = [(prefill, eagle3_decode, decode, eagle, eagle3), (eagle3_prefill, decode, eagle3_decode, eagle3, eagle)]
    for index, (p_service, other_d, same_d, p_draft, other_draft) in enumerate(pairs):
        prompt = random_prompts([21], seed=55 + index)[0]
        prefilled = run_prefill(p_service, f"crossed-{index}", prompt)
        with pytest.raises(grpc.RpcError) as raised:
            run_decode(other_d, f"crossed-{index}", prompt, prefilled)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"draft: decode has '{other_draft}', prefill has '{p_draft}'" in raised.value.details()
        assert_all_free(other_d)
        tokens, _ = run_decode(same_d, f"crossed-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
    assert_all_free(prefill, decode, eagle3_prefill, eagle3_decode)
