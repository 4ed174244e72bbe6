"""Conditional disaggregation over real processes (tiny random model, UCX on loopback): with
``--disagg-min-prompt-tokens``, a short prompt is prefilled on the decode instance itself and
gives the disaggregated text; a long one still goes through the prefill instance; a long one
mostly in the decode instance's prefix cache (``--routing kv``) stays on it. The decision and
its reason are in ``splitserve_pd_decision_total``. Every instance ends with all blocks free."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.processes import HTTPProcess, routes, running_gateway
from tests.services.client import assert_all_free
from tests.services.processes import Service, running

pytest.importorskip("ucxx")

VOCAB = range(3, 300)


@pytest.fixture(scope="module")
def pair(model: Path) -> Iterator[tuple[Service, Service]]:
    with (
        running("prefill", model, "--lease-seconds", "10") as prefill,
        running("decode", model, "--decode-recompute-chunk", "32") as decode,
    ):
        yield prefill, decode


def _prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB) for _ in range(num_tokens)]


def _complete(gateway: HTTPProcess, prompt: list[int] | str) -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0, "logprobs": 0}
    answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _decisions(gateway: HTTPProcess) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return {
        (m[1], m[2]): float(m[3])
        for m in re.finditer(r'splitserve_pd_decision_total\{path="(\w+)",reason="(\w+)"\} (\S+)', text)
    }


def _decode_blocks_indexed(gateway: HTTPProcess) -> bool:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return re.search(r'splitserve_instance_indexed_kv_blocks\{[^}]*role="decode"[^}]*\} [1-9]', text) is not None


def test_a_short_prompt_is_prefilled_on_the_decode_instance_with_the_same_text(
    model: Path, pair: tuple[Service, Service]
) -> None:
    prefill, decode = pair
    # Load routing: the gateway knows nothing of D's cache, so only the length decides (with kv
    # routing the long prompt, pulled by D in the first run, would count as cached there).
    flags = [*routes(prefill, decode), "--routing", "load"]
    short, long = "The capital of France is", _prompt(1, 200)
    with running_gateway(model, *flags) as gateway:
        expected_short, expected_long = _complete(gateway, short), _complete(gateway, long)
        assert _decisions(gateway) == {("disaggregated", "always"): 2.0}
    pulls_before, local_before = decode.load().kv_transfers, decode.load().counters.num_local_prefills
    with running_gateway(model, *flags, "--disagg-min-prompt-tokens", "64") as gateway:
        local, remote = _complete(gateway, short), _complete(gateway, long)
        assert _decisions(gateway) == {("decode", "short_prompt"): 1.0, ("disaggregated", "uncached_prompt"): 1.0}
    for answer, expected in ((local, expected_short), (remote, expected_long)):
        assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
        assert answer["choices"][0]["logprobs"]["tokens"] == expected["choices"][0]["logprobs"]["tokens"]
    report = decode.load()
    assert report.counters.num_local_prefills - local_before == 1 and report.kv_transfers - pulls_before == 1
    assert_all_free(prefill, decode)


def test_a_prompt_mostly_cached_on_the_decode_instance_stays_there(model: Path, pair: tuple[Service, Service]) -> None:
    prefill, decode = pair
    flags = [*routes(prefill, decode), "--routing", "kv"]
    shared = _prompt(2, 320)  # 20 blocks
    with running_gateway(model, *flags, "--disagg-min-prompt-tokens", "64") as gateway:
        _complete(gateway, shared + _prompt(3, 8))  # through P; D caches the pulled blocks
        deadline = time.monotonic() + 120  # a safety net
        while not _decode_blocks_indexed(gateway) and time.monotonic() < deadline:
            time.sleep(0.1)  # a KV event poll
        answer = _complete(gateway, shared + _prompt(4, 40))  # 360 tokens, 40 of them new to D
        assert _decisions(gateway) == {("disaggregated", "uncached_prompt"): 1.0, ("decode", "cached_on_decode"): 1.0}
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 320
    assert_all_free(prefill, decode)
