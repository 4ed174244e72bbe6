"""EAGLE through the prefill/decode hand-off over LMCache, as real processes on loopback sharing a
real Redis server: P stores its draft's KV over the prompt beside the prompt's chunks and the
signed handle carries its digest (EAGLE and EAGLE-3 drafts alike); D fetches it with the chunks
it lacks (alone when its prefix cache holds every block: it caches no draft KV) and verifies P's
chain at its first step. Greedy
tokens equal the colocated engine's without speculation; a draft object the store lost or
altered fails the pull as a lost or forged chunk does; no block leaks after a finish, an abort
or a failed pull. (The connector's side, keys and refusals: tests/kv_connector/test_lmcache_draft_kv.py.)"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import redis

from cluster.auth import ClusterSecret
from cluster.derived_keys import kv_store_key
from engine import LLM
from engine.spec_decode.eagle3_checkpoint import save_eagle3_draft
from serving.convert import fingerprint_from_proto
from splitserve.v1 import disaggregation_pb2, generation_pb2
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

pytest.importorskip("lmcache")
os.environ["LMCACHE_TRACK_USAGE"] = "false"  # inherited by the service processes

from kv_connector.lmcache_connector import draft_kv_store_key  # only where lmcache is installed

SECRET = "eagle-lmcache-secret-9b2c"
NUM_SPECULATIVE_TOKENS = 3
pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_eagle_draft(tmp_path_factory.mktemp("eagle") / "draft", "eagle")


@pytest.fixture(scope="module")
def eagle3_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("eagle3") / "draft"
    save_eagle3_draft(random_eagle3_draft(feature_layer_ids=(0, 1)), folder, "speculators", {})
    return folder


@contextmanager
def lmcache_pair(model: Path, method: str, draft: Path, redis_url: str) -> Iterator[tuple[Service, Service]]:
    speculative = json.dumps({"method": method, "model": str(draft), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})
    flags = ("--kv-connector", "lmcache", "--lmcache-url", redis_url, "--speculative-config", speculative)
    with (
        running("prefill", model, *flags, secret=SECRET) as prefill,
        running("decode", model, *flags, secret=SECRET) as decode,
    ):
        yield prefill, decode


@pytest.fixture(scope="module")
def services(model: Path, draft: Path, redis_url: str) -> Iterator[tuple[Service, Service]]:
    with lmcache_pair(model, "eagle", draft, redis_url) as pair:
        yield pair


@pytest.fixture(scope="module")
def eagle3_services(model: Path, eagle3_draft: Path, redis_url: str) -> Iterator[tuple[Service, Service]]:
    with lmcache_pair(model, "eagle3", eagle3_draft, redis_url) as pair:
        yield pair


def draft_object(redis_url: str, prefilled: disaggregation_pb2.PrefillResponse, colocated: LLM) -> str:
    """The Redis key of the bytes of the draft KV P stored for ``prefilled``'s handle (as someone
    who holds the cluster secret and the handle could compute it)."""
    handle = prefilled.kv
    fingerprint = fingerprint_from_proto(handle.fingerprint)
    store_key = kv_store_key(ClusterSecret.from_text(SECRET)) or b""
    dtype = colocated.engine.runner.dtype
    key = draft_kv_store_key(fingerprint, store_key, "", handle.pull_token, handle.num_tokens, dtype)
    name = key.to_string() + "kv_bytes"
    assert redis.Redis.from_url(redis_url).exists(name), "P stored no draft KV under its key"
    return name


@pytest.mark.parametrize("pair", ["services", "eagle3_services"])
def test_the_draft_kv_crosses_with_the_chunks_whatever_d_holds(
    pair: str, request: pytest.FixtureRequest, colocated: LLM
) -> None:
    """Each pull's bytes are the chunks D lacked plus the draft's KV over the positions P's target
    computed (P's own prefix-cache hits have none), alone when D holds every block; D verifies
    P's chain at its first step; the tokens are the colocated engine's without speculation.
    EAGLE and EAGLE-3 drafts alike (one draft layer each, its KV in the target's KV shape)."""
    prefill, decode = request.getfixturevalue(pair)
    runner = colocated.engine.runner
    shape = runner.shape
    # One entry of the one-layer draft: K and V of the target's KV heads, in the served dtype.
    entry_bytes = 2 * shape.num_kv_heads * shape.head_dim * runner.dtype.itemsize
    token_bytes = runner.bytes_per_block // runner.block_size  # a pull fetches whole LMCache chunks
    shared = random_prompts([32], seed=61)[0]  # two full blocks
    cases = [
        # (prompt, D's hit blocks, blocks pulled, draft entries): first seen by both
        (shared + random_prompts([8], seed=62)[0], 0, 3, 40),
        # the same two blocks first: hits on both sides, P's draft KV starts after its hit
        (shared + random_prompts([8], seed=63)[0], 2, 1, 8),
        # the shared blocks alone: D pulls no block, only the draft KV (P recomputes the last block)
        (shared, 2, 0, 16),
    ]
    for index, (prompt, num_hit_blocks, num_pulled_blocks, num_entries) in enumerate(cases):
        prefilled = run_prefill(prefill, f"draft-kv-{index}", prompt)
        assert len(prefilled.kv.draft_kv_digest) == 32 and len(prefilled.kv.draft_token_ids) == NUM_SPECULATIVE_TOKENS
        tokens, responses = run_decode(decode, f"draft-kv-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        assert (transfer.num_local_hit_blocks, transfer.num_pulled_blocks) == (num_hit_blocks, num_pulled_blocks)
        chunk_bytes = len(prompt) * token_bytes if num_pulled_blocks else 0
        assert transfer.num_bytes == chunk_bytes + num_entries * entry_bytes
    # Three tokens in all: D's first step may verify one draft (max_tokens leaves room for no
    # more), its second none (its own chain starts from that step). So exactly one draft is
    # verified iff P's chain came across and D drafted from its first step.
    drafted = decode.load().counters.num_spec_draft_tokens
    short = generation_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = random_prompts([21], seed=64)[0]
    prefilled = run_prefill(prefill, "draft-kv-short", prompt, short)
    run_decode(decode, "draft-kv-short", prompt, prefilled, sampling=short)
    assert decode.load().counters.num_spec_draft_tokens == drafted + 1
    assert_all_free(prefill, decode)
    assert_an_abort_during_the_hand_off_frees_every_block(
        prefill, decode, "draft-kv-abort", random_prompts([30], seed=67)[0]
    )


def test_a_draft_object_lost_or_altered_fails_the_pull_as_a_chunk_would(
    services: tuple[Service, Service], colocated: LLM, redis_url: str
) -> None:
    """Other bytes under the draft KV's key: D refuses the pull before writing a block (handed back
    for another prefill, which decodes). The object gone: D recomputes on the last attempt. No
    block leaks either way."""
    prefill, decode = services
    store = redis.Redis.from_url(redis_url)
    prompt = random_prompts([40], seed=65)[0]
    prefilled = run_prefill(prefill, "forged-draft-1", prompt)
    forged = draft_object(redis_url, prefilled, colocated)
    store.set(forged, bytes(byte ^ 0x21 for byte in store.get(forged)))
    failures = decode.load().counters.num_kv_pull_failures
    with pytest.raises(grpc.RpcError) as raised:
        run_decode(decode, "forged-draft-1", prompt, prefilled)
    assert raised.value.code() == grpc.StatusCode.DATA_LOSS and "prefill it again" in raised.value.details()
    assert "other bytes for the draft KV than the prefill instance stored" in raised.value.details()
    assert decode.load().counters.num_kv_pull_failures == failures + 1
    assert_all_free(prefill, decode)
    # Prefilled again (the gateway's hand-back): new keys, genuine bytes, and every block pulled:
    # nothing of the refused pull is in D's prefix cache.
    again = run_prefill(prefill, "forged-draft-2", prompt)
    tokens, responses = run_decode(decode, "forged-draft-2", prompt, again)
    assert tokens == expected_tokens(colocated, prompt)
    assert (responses[0].kv_transfer.num_local_hit_blocks, responses[0].kv_transfer.num_pulled_blocks) == (0, 3)
    other = random_prompts([40], seed=66)[0]
    lost = run_prefill(prefill, "lost-draft", other)
    store.delete(draft_object(redis_url, lost, colocated))
    tokens, responses = run_decode(decode, "lost-draft", other, lost, allow_recompute=True)
    assert tokens == expected_tokens(colocated, other) and responses[0].kv_transfer.recomputed
    assert decode.load().counters.num_kv_pull_failures == failures + 2
    assert_all_free(prefill, decode)
