"""The gateway's prefix index: the same chain as the engine (salt included), events applied,
longest-prefix match, predictions that expire, a bound per instance."""

from __future__ import annotations

import time

from engine.kv_cache_utils import extend_block_hashes
from gateway.prefix_index import PrefixIndex, PromptBlocks
from splitserve.v1 import disaggregation_pb2


def _raw(hashes: list[int]) -> list[bytes]:
    return [h.to_bytes(16, "little") for h in hashes]


def _events(stored: list[int], removed: list[int] = (), snapshot: bool = False, epoch: int = 7, last_seq: int = 1):
    return disaggregation_pb2.KVEvents(
        epoch=epoch,
        last_seq=last_seq,
        snapshot=snapshot,
        stored=_raw(stored),
        removed=_raw(list(removed)),
        block_size=4,
    )


def test_the_chain_is_the_engines_with_the_salt() -> None:
    tokens = list(range(10))
    engine_chain: list = []
    extend_block_hashes(engine_chain, tokens, 4, b"salt")
    assert PromptBlocks(tokens, "salt").chain(4) == engine_chain and len(engine_chain) == 2
    assert PromptBlocks(tokens).chain(4) != engine_chain


def test_longest_prefix_match_follows_stores_and_evictions() -> None:
    index = PrefixIndex()
    prompt = PromptBlocks(list(range(17)))
    chain = prompt.chain(4)
    index.apply("p:1", _events(chain[:3], snapshot=True), max_blocks=100)
    assert index.num_hit_blocks("p:1", prompt) == 3 and index.num_hit_blocks("p:2", prompt) == 0
    index.apply("p:1", _events([], removed=[chain[1]], last_seq=2), max_blocks=100)
    assert index.num_hit_blocks("p:1", prompt) == 1  # a hole ends the prefix
    assert index.cursor("p:1") == (7, 2)
    index.apply("p:1", _events([chain[0]], snapshot=True, epoch=8, last_seq=1), max_blocks=100)  # restarted
    assert index.num_hit_blocks("p:1", prompt) == 1 and index.num_cached_blocks("p:1") == 1
    index.forget("p:1")
    assert index.cursor("p:1") == (0, 0) and index.num_hit_blocks("p:1", prompt) == 0


def test_predictions_count_until_they_expire() -> None:
    index = PrefixIndex(prediction_ttl_s=0.05)
    prompt = PromptBlocks(list(range(16)))
    index.apply("p:1", _events([], snapshot=True), max_blocks=100)
    index.predict("p:1", prompt, max_blocks=100)
    assert index.num_hit_blocks("p:1", prompt) == 4
    time.sleep(0.1)
    assert index.num_hit_blocks("p:1", prompt) == 0


def test_an_instance_holds_at_most_its_block_count() -> None:
    index = PrefixIndex()
    index.apply("p:1", _events(list(range(1, 50)), snapshot=True), max_blocks=8)
    assert index.num_cached_blocks("p:1") == 8
    index.predict("p:1", PromptBlocks(list(range(400))), max_blocks=8)
    assert len(index._instances["p:1"].predicted) == 8
