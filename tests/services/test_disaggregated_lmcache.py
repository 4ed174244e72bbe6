"""The same request path with the lmcache connector: P stores the prompt's KV in a
Redis server, D retrieves it by tokens; greedy output equals the colocated engine's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM
from tests.checkpoints import random_prompts
from tests.services.client import assert_all_free, expected_tokens, run_decode, run_prefill
from tests.services.processes import Service, running

pytest.importorskip("lmcache")
os.environ["LMCACHE_TRACK_USAGE"] = "false"  # inherited by the service processes


@pytest.fixture(scope="module")
def services(model: Path, redis_url: str) -> Iterator[tuple[Service, Service]]:
    flags = ("--kv-connector", "lmcache", "--lmcache-url", redis_url)
    with running("prefill", model, *flags) as prefill, running("decode", model, *flags) as decode:
        yield prefill, decode


def test_lmcache_output_equals_colocated_and_reuses_local_prefixes(
    services: tuple[Service, Service], colocated: LLM
) -> None:
    prefill, decode = services
    shared = random_prompts([32], seed=41)[0]
    prompts = random_prompts([5, 16, 33, 70], seed=40) + [shared + suffix for suffix in random_prompts([9, 9], seed=42)]
    transfers = []
    for index, prompt in enumerate(prompts):
        prefilled = run_prefill(prefill, f"lm-{index}", prompt)
        assert prefilled.kv.connector == "lmcache"
        tokens, responses = run_decode(decode, f"lm-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfers.append(responses[0].kv_transfer)
    assert not any(t.recomputed for t in transfers)
    assert [t.num_pulled_blocks for t in transfers[:4]] == [1, 1, 3, 5]
    # The second prompt with the shared 32-token prefix finds its 2 blocks in D's own cache.
    assert (transfers[5].num_local_hit_blocks, transfers[5].num_pulled_blocks) == (2, 1)
    assert_all_free(prefill, decode)
