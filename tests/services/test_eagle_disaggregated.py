"""EAGLE through the prefill/decode hand-off, as real processes on loopback: P's draft proposes
a chain after the first token and the drafts travel in the signed KV handle; D verifies them at
its first step; the draft's KV over the prompt crosses in the UCX pull with the target's blocks,
whatever D's prefix-cache hits. Greedy tokens equal the colocated engine's without speculation,
a D with another EAGLE draft refuses P's handle naming both, and no block leaks. (That D's draft
then attends over the prompt as the colocated engine's does, chain for chain, is
tests/engine/spec_decode/test_eagle.py's.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine import LLM
from engine.spec_decode.eagle_checkpoint import save_eagle_draft
from kv_connector.fingerprint import eagle_draft
from splitserve.v1 import generation_pb2
from tests.checkpoints import random_prompts
from tests.engine.spec_decode.eagle_drafts import make_eagle_draft, random_draft
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


def eagle_config(draft: Path) -> str:
    return json.dumps({"method": "eagle", "model": str(draft), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random EAGLE draft of the module's model, and another of the same name and config."""
    folder = tmp_path_factory.mktemp("eagle")
    draft = make_eagle_draft(folder / "draft", "eagle")
    other = folder / "other" / "draft"
    save_eagle_draft(random_draft(seed=1), other, "eagle", {})
    return draft, other


@pytest.fixture(scope="module")
def prefill(model: Path, drafts: tuple[Path, Path]) -> Iterator[Service]:
    with running("prefill", model, "--speculative-config", eagle_config(drafts[0])) as service:
        yield service


@pytest.fixture(scope="module")
def decode(model: Path, drafts: tuple[Path, Path]) -> Iterator[Service]:
    with running("decode", model, "--speculative-config", eagle_config(drafts[0])) as service:
        yield service


def test_eagle_drafts_cross_the_hand_off_in_the_signed_handle(
    prefill: Service, decode: Service, colocated: LLM, drafts: tuple[Path, Path]
) -> None:
    """P's draft chains after the first token; the handle names the draft and carries the chain;
    D's tokens are the colocated engine's without speculation."""
    for index, prompt in enumerate(random_prompts([21, 40], seed=41)):
        prefilled = run_prefill(prefill, f"eagle-{index}", prompt)
        assert prefilled.kv.fingerprint.draft == eagle_draft(drafts[0])
        assert len(prefilled.kv.draft_token_ids) == NUM_SPECULATIVE_TOKENS
        tokens, _ = run_decode(decode, f"eagle-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
    # Three tokens in all: D's first step may verify one draft (max_tokens leaves room for no
    # more), its second none (its own chain starts from that step). So exactly one draft is
    # verified iff P's drafts came across.
    drafted = decode.load().counters.num_spec_draft_tokens
    short = generation_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = random_prompts([21], seed=42)[0]
    prefilled = run_prefill(prefill, "eagle-short", prompt, short)
    run_decode(decode, "eagle-short", prompt, prefilled, sampling=short)
    assert decode.load().counters.num_spec_draft_tokens == drafted + 1
    assert_all_free(prefill, decode)


def test_another_eagle_draft_refuses_the_handle_naming_both(
    model: Path, prefill: Service, decode: Service, colocated: LLM, drafts: tuple[Path, Path]
) -> None:
    """A D with another EAGLE draft than P's would verify drafts it cannot make (and attend over
    another draft's KV): its Decode call is refused naming both drafters, before it allocates a
    block. The same handle then decodes on a D with P's draft."""
    draft, other = drafts
    with running("decode", model, "--speculative-config", eagle_config(other)) as mismatched:
        prompt = random_prompts([21], seed=43)[0]
        prefilled = run_prefill(prefill, "other-draft", prompt)
        with pytest.raises(grpc.RpcError) as raised:
            run_decode(mismatched, "other-draft", prompt, prefilled)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        named = f"draft: decode has '{eagle_draft(other)}', prefill has '{eagle_draft(draft)}'"
        assert named in raised.value.details()
        assert_all_free(mismatched)
    tokens, _ = run_decode(decode, "other-draft", prompt, prefilled)
    assert tokens == expected_tokens(colocated, prompt)
    assert_all_free(prefill, decode)


def test_the_prompt_draft_kv_crosses_in_the_pull_whatever_d_holds(
    prefill: Service, decode: Service, colocated: LLM
) -> None:
    """Each pull's bytes are the blocks D lacked plus the draft's KV over the positions P's target
    computed (P's own prefix-cache hits have none): pulled with the blocks, and alone when D's
    prefix cache holds every block (D caches no draft KV)."""
    runner = colocated.engine.runner
    shape = runner.shape
    # One entry of the one-layer draft: K and V of the target's KV heads, in the served dtype.
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
        prefilled = run_prefill(prefill, f"draft-kv-{index}", prompt)
        tokens, responses = run_decode(decode, f"draft-kv-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        assert (transfer.num_local_hit_blocks, transfer.num_pulled_blocks) == (num_hit_blocks, num_pulled_blocks)
        assert transfer.num_bytes == num_pulled_blocks * block_bytes + num_entries * entry_bytes
    assert_all_free(prefill, decode)


def test_a_failed_or_aborted_hand_off_leaves_nothing_behind(prefill: Service, decode: Service, colocated: LLM) -> None:
    """A pull that fails (P's KV address unreachable) brings no draft KV: D recomputes the prompt,
    its draft makes its own KV over it, and the tokens are the colocated engine's. A hand-off
    aborted once its KV arrived frees every block too."""
    prompt = random_prompts([30], seed=47)[0]
    prefilled = run_prefill(prefill, "eagle-failed", prompt)
    prefilled.kv.connector_address = f"127.0.0.1:{free_port()}"  # nobody listens there
    tokens, responses = run_decode(decode, "eagle-failed", prompt, prefilled, allow_recompute=True)
    assert tokens == expected_tokens(colocated, prompt) and responses[0].kv_transfer.recomputed
    assert_all_free(prefill, decode)
    aborted = random_prompts([30], seed=48)[0]
    assert_an_abort_during_the_hand_off_frees_every_block(prefill, decode, "eagle-abort", aborted)
