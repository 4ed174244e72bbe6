"""The same request path with the lmcache connector: P stores the prompt's KV in a
Redis server, D retrieves it by tokens; greedy output equals the colocated engine's. The
store is not believed: bytes forged under a real key of P's are refused by D (the request is
handed back, or recomputed on the last attempt, and nothing of them enters D's cache), and
a store that stops answering mid-publish holds up neither P's RenewKV nor its health."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.auth import ClusterSecret
from cluster.derived_keys import kv_store_key
from engine import LLM
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc
from tests.checkpoints import random_prompts
from tests.services.client import assert_all_free, expected_tokens, run_decode, run_prefill
from tests.services.processes import Service, running
from tests.stalling_proxy import stalling_proxy

pytest.importorskip("lmcache")
os.environ["LMCACHE_TRACK_USAGE"] = "false"  # inherited by the service processes

from kv_connector.lmcache_connector import key_tag  # only where lmcache is installed

SECRET = "lmcache-cluster-secret-4e1d"
SALT = "tenant-7"
pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")


@pytest.fixture(scope="module")
def services(model: Path, redis_url: str) -> Iterator[tuple[Service, Service]]:
    flags = ("--kv-connector", "lmcache", "--lmcache-url", redis_url)
    with (
        running("prefill", model, *flags, secret=SECRET) as prefill,
        running("decode", model, *flags, secret=SECRET) as decode,
    ):
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


def _forge(redis_url: str, handle: disaggregation_pb2.KVHandle, cache_salt: str) -> int:
    """Overwrite every chunk P stored for ``handle`` with other bytes of the same length, as
    someone who can write the store could (its keys follow from the secret, the salt and the
    handle's pull token). Returns how many chunks were forged."""
    client = redis.Redis.from_url(redis_url)
    store_key = kv_store_key(ClusterSecret.from_text(SECRET)) or b""
    tags = [key_tag(store_key, cache_salt, handle.pull_token, head) for head in range(handle.fingerprint.num_kv_heads)]
    keys = [key for tag in tags for key in client.scan_iter(match=f"*@k%{tag}kv_bytes")]
    for key in keys:
        client.set(key, bytes(byte ^ 0x21 for byte in client.get(key)))
    return len(keys)


def test_bytes_forged_under_a_real_key_are_refused(
    services: tuple[Service, Service], colocated: LLM, redis_url: str
) -> None:
    prefill, decode = services
    prompt = random_prompts([70], seed=43)[0]  # 5 blocks: one LMCache chunk (256 tokens)
    prefilled = run_prefill(prefill, "forged-1", prompt, cache_salt=SALT)
    heads = prefilled.kv.fingerprint.num_kv_heads  # each head of the one chunk is stored apart
    assert len(prefilled.kv.chunk_digests) == heads
    assert _forge(redis_url, prefilled.kv, SALT) == heads
    failures = decode.load().counters.num_kv_pull_failures
    with pytest.raises(grpc.RpcError) as raised:
        run_decode(decode, "forged-1", prompt, prefilled, cache_salt=SALT)
    assert raised.value.code() == grpc.StatusCode.DATA_LOSS and "prefill it again" in raised.value.details()
    assert "returned other bytes" in raised.value.details()
    assert decode.load().counters.num_kv_pull_failures == failures + 1
    assert_all_free(prefill, decode)
    # Prefilled again (the gateway's hand-back): new keys, genuine bytes. D pulls every block:
    # nothing of the forged pull is in its prefix cache.
    again = run_prefill(prefill, "forged-2", prompt, cache_salt=SALT)
    tokens, responses = run_decode(decode, "forged-2", prompt, again, cache_salt=SALT)
    assert tokens == expected_tokens(colocated, prompt)
    transfer = responses[0].kv_transfer
    assert (transfer.num_local_hit_blocks, transfer.num_pulled_blocks, transfer.recomputed) == (0, 5, False)
    # On the gateway's last attempt D recomputes instead of believing the store.
    other = random_prompts([40], seed=44)[0]
    forged = run_prefill(prefill, "forged-3", other, cache_salt=SALT)
    assert _forge(redis_url, forged.kv, SALT) == heads
    tokens, responses = run_decode(decode, "forged-3", other, forged, allow_recompute=True, cache_salt=SALT)
    assert tokens == expected_tokens(colocated, other) and responses[0].kv_transfer.recomputed
    assert_all_free(prefill, decode)


def test_a_slow_store_holds_up_neither_renewals_nor_health(model: Path, redis_url: str) -> None:
    """The store stops answering while P publishes a prompt's KV: P still answers RenewKV and
    health checks within their deadlines (the publish waits off the event loop), holds the
    request's lease meanwhile, and hands out the handle once the store answers again."""
    prompt = random_prompts([40], seed=45)[0]
    with stalling_proxy(redis_url) as (proxy, url):
        flags = ("--kv-connector", "lmcache", "--lmcache-url", url)
        with running("prefill", model, *flags, secret=SECRET) as prefill, ThreadPoolExecutor(1) as pool:
            stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
            health = health_pb2_grpc.HealthStub(prefill.channel)
            proxy.stall()
            prefilling = pool.submit(run_prefill, prefill, "slow-1", prompt)
            assert proxy.holding.wait(timeout=60), "P never wrote to the store"
            # The lease starts as the publish does: until then the request is unknown.
            while True:
                renewed = stub.RenewKV(disaggregation_pb2.RenewKVRequest(request_ids=["slow-1", "x"]), timeout=2.0)
                if "slow-1" not in renewed.unknown_request_ids:
                    break
                assert not prefilling.done(), prefilling.result()
                time.sleep(0.05)
            assert list(renewed.unknown_request_ids) == ["x"]
            serving = health.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
            assert serving == health_pb2.HealthCheckResponse.SERVING
            assert not prefilling.done(), "the publish finished while the store held its writes"
            proxy.resume()
            prefilled = prefilling.result(timeout=60)
            assert len(prefilled.kv.chunk_digests) == prefilled.kv.fingerprint.num_kv_heads
            stub.ReleaseKV(disaggregation_pb2.RequestRef(request_id="slow-1"), timeout=10)
            assert_all_free(prefill)
