"""Cache-aware routing (``--routing kv``) over real processes, 2 prefill + 2 decode
instances on loopback (tiny random model, UCX): a burst of long prompts spreads over both
prefill instances, a shared prefix lands where it is cached, an instance that stops
reporting is drained from routing and used again once it is back. After each scenario
every instance reports all KV blocks free."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cluster.auth import ClusterSecret
from cluster.derived_keys import prefix_cache_key
from engine.kv_cache_utils import BlockHasher
from gateway.prefix_index import PromptBlocks
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.gateway.processes import HTTPProcess, routes, running_gateway
from tests.services.client import GREEDY, assert_all_free
from tests.services.processes import Service, running

pytest.importorskip("ucxx")

VOCAB = range(3, 300)  # ids the tiny tokenizer knows, past its special tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Wider than the other tests' model: a long prompt's prefill takes a good part of a second,
    # so a burst really queues (with the tiny one each prefill is over before the next arrives).
    return make_checkpoint(
        tmp_path_factory.mktemp("llama"),
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


@pytest.fixture(scope="module")
def cluster(model: Path) -> Iterator[tuple[list[Service], list[Service]]]:
    kv = ("--kv-cache-memory", str(1 << 25))  # 256 blocks of 16 tokens
    with (
        running("prefill", model, "--lease-seconds", "10", *kv) as p1,
        running("prefill", model, "--lease-seconds", "10", *kv) as p2,
        running("decode", model, *kv) as d1,
        running("decode", model, *kv) as d2,
    ):
        yield [p1, p2], [d1, d2]


def _prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB) for _ in range(num_tokens)]


def _complete(url: str, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
        timeout=120,
    )


def _routed(gateway: HTTPProcess) -> dict[str, float]:
    """Requests the gateway routed to each instance so far, by address."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    pattern = r'splitserve_instance_routed_requests_total\{[^}]*address="([^"]+)"[^}]*\} (\S+)'
    return {found[1]: float(found[2]) for found in re.finditer(pattern, text)}


def _healthy(gateway: HTTPProcess, address: str) -> bool:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    found = re.search(rf'splitserve_instance_healthy\{{[^}}]*address="{re.escape(address)}"[^}}]*\}} (\S+)', text)
    return found is not None and float(found[1]) == 1.0


def _indexed_blocks(gateway: HTTPProcess, address: str) -> float:
    """Prefix-cache blocks the gateway's index holds for the instance at ``address``."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    pattern = rf'splitserve_instance_indexed_kv_blocks\{{[^}}]*address="{re.escape(address)}"[^}}]*\}} (\S+)'
    found = re.search(pattern, text)
    return float(found[1]) if found is not None else 0.0


def _delta(after: dict[str, float], before: dict[str, float], address: str) -> int:
    return int(after.get(address, 0) - before.get(address, 0))


def test_a_burst_of_long_prompts_spreads_over_both_prefill_instances(model: Path, cluster) -> None:
    prefills, decodes = cluster

    async def burst(url: str) -> list[httpx.Response]:
        # One event loop sends all eight at once: threads on a starved host could send them far apart.
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{url}/v1/completions",
                        json={"prompt": _prompt(i, 900), "max_tokens": 4, "ignore_eos": True, "temperature": 0},
                    )
                    for i in range(8)
                )
            )

    with running_gateway(model, *routes(*prefills, *decodes), "--routing", "kv") as gateway:
        before = _routed(gateway)
        answers = asyncio.run(burst(gateway.url))
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
        after = _routed(gateway)
    served = [_delta(after, before, p.address) for p in prefills]
    # Prompts queued at an instance count against it, so the burst spreads; equally idle ones go
    # in tie order, so without that every prompt would go to one. kv routing weighs each instance's
    # queue by its own measured prefill rate, and on a busy host one may measure itself markedly
    # faster and take the larger share: the split need not be even.
    assert sum(served) == 8 and min(served) >= 2, f"prefill instances served {served}"
    assert_all_free(*prefills, *decodes)


def test_a_shared_prefix_lands_on_the_instance_that_holds_it(model: Path, cluster) -> None:
    prefills, decodes = cluster
    holder = prefills[1]  # the one load routing would not pick first among equals
    system = _prompt(100, 512)
    warm = disaggregation_pb2_grpc.PrefillStub(holder.channel).Prefill(
        disaggregation_pb2.PrefillRequest(request_id="warm", prompt_token_ids=system + [7], sampling=GREEDY), timeout=30
    )
    disaggregation_pb2_grpc.PrefillStub(holder.channel).ReleaseKV(
        disaggregation_pb2.RequestRef(request_id="warm"), timeout=10
    )
    assert warm.HasField("kv")
    with running_gateway(model, *routes(*prefills, *decodes), "--routing", "kv") as gateway:
        # Until the gateway's index has the holder's cached prefix (its KV events reached it).
        deadline = time.monotonic() + 120  # a safety net, far past the wait
        while _indexed_blocks(gateway, holder.address) < len(system) // 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _indexed_blocks(gateway, holder.address) >= len(system) // 16, "the holder's blocks never indexed"
        before = _routed(gateway)
        cached = []
        for i in range(4):
            answer = _complete(gateway.url, system + _prompt(200 + i, 40))
            assert answer.status_code == 200, answer.text
            cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        after = _routed(gateway)
    assert _delta(after, before, holder.address) == 4, (before, after)
    assert all(c >= 512 for c in cached), cached
    assert_all_free(*prefills, *decodes)


def test_keyed_sha256_prefix_hashes_are_what_the_gateway_routes_by(model: Path) -> None:
    """Instances on --prefix-cache-hash sha256 with a cluster secret report HMAC-SHA256 hashes under
    the key derived from it; the gateway, holding the same secret, computes the very same chain,
    so a shared prefix still lands on the prefill instance that holds it."""
    secret = "kv-routing-secret-0f6b2c9d"
    flags = ("--prefix-cache-hash", "sha256", "--kv-cache-memory", str(1 << 25), "--lease-seconds", "10")
    with (
        running("prefill", model, *flags, secret=secret) as other,
        running("prefill", model, *flags, secret=secret) as holder,
        running("decode", model, *flags[:4], secret=secret) as decode,
    ):
        system = _prompt(500, 512)
        warm = disaggregation_pb2_grpc.PrefillStub(holder.channel).Prefill(
            disaggregation_pb2.PrefillRequest(request_id="warm", prompt_token_ids=system + [7], sampling=GREEDY),
            timeout=30,
        )
        disaggregation_pb2_grpc.PrefillStub(holder.channel).ReleaseKV(
            disaggregation_pb2.RequestRef(request_id="warm"), timeout=10
        )
        assert warm.HasField("kv")
        events = disaggregation_pb2_grpc.LoadStub(holder.channel).GetKVEvents(
            disaggregation_pb2.KVEventsRequest(), timeout=10
        )
        key = prefix_cache_key(ClusterSecret.from_text(secret))
        chain = PromptBlocks(system + [7]).chain(events.block_size, BlockHasher("sha256", key))
        assert events.block_hash == "hmac-sha256" and len(chain) == 32
        assert {h.to_bytes(16, "little") for h in chain} <= set(events.stored)
        with running_gateway(
            model, *routes(other, holder, decode), "--routing", "kv", env={"SPLITSERVE_CLUSTER_SECRET": secret}
        ) as gateway:
            before = _routed(gateway)
            cached = []
            for i in range(4):
                answer = _complete(gateway.url, system + _prompt(600 + i, 40))
                assert answer.status_code == 200, answer.text
                cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            after = _routed(gateway)
        assert _delta(after, before, holder.address) == 4, (before, after)
        assert all(c >= 512 for c in cached), cached
        assert_all_free(other, holder, decode)


def test_an_instance_that_stops_reporting_is_drained_and_used_again_when_back(model: Path, cluster) -> None:
    prefills, decodes = cluster
    with running_gateway(model, *routes(*prefills, *decodes), "--routing", "kv", "--stale-after", "1.0") as gateway:
        # Each prefill instance in turn stops reporting (SIGSTOP) while the other is back from
        # its own silence: every request goes to the one that reports, the first one included
        # once it is back. (Sharing a burst between the two would measure their prefill rates,
        # which a loaded machine skews by 2-3x between instances, not whether one is used.)
        for first_seed, silent, serving in ((300, prefills[0], prefills[1]), (400, prefills[1], prefills[0])):
            _wait_healthy(gateway, serving.address, True)
            silent.process.send_signal(signal.SIGSTOP)
            try:
                _wait_healthy(gateway, silent.address, False)
                before = _routed(gateway)
                seeds = range(first_seed, first_seed + 4)
                with ThreadPoolExecutor(4) as pool:
                    answers = list(pool.map(lambda seed: _complete(gateway.url, _prompt(seed, 600)), seeds))
                assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
                after = _routed(gateway)
                assert _delta(after, before, silent.address) == 0, (before, after)
                assert _delta(after, before, serving.address) == 4, (before, after)
            finally:
                silent.process.send_signal(signal.SIGCONT)
        _wait_healthy(gateway, prefills[1].address, True)
    assert_all_free(*prefills, *decodes)


def _wait_healthy(gateway: HTTPProcess, address: str, healthy: bool) -> None:
    """Until the gateway's health of ``address`` is ``healthy`` (120 s at most, a safety net)."""
    deadline = time.monotonic() + 120
    while _healthy(gateway, address) != healthy and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _healthy(gateway, address) == healthy, f"{address} never became {'healthy' if healthy else 'unhealthy'}"
