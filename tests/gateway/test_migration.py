"""Request migration over real processes (tiny random model, UCX on loopback): a decode
instance killed mid-stream, the request resumes on another one and the client's stream
continues with no token duplicated or missing; greedy, the text and tokens are those of an
uninterrupted run. With ``--max-migrations 0`` the stream ends with an error instead. A
decode instance that drains by handing its streams over (SIGUSR2, the planner's scale-down)
hands the stream back mid-way and it resumes the same way, outside the migration budget.
After each scenario every surviving instance reports all KV blocks free."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.gateway.processes import (
    HTTPProcess,
    gateway_migrations,
    routes,
    running_gateway,
    stream_killing_decode,
)
from tests.services.client import assert_all_free
from tests.services.processes import Service

pytest.importorskip("ucxx")

logger = logging.getLogger(__name__)

BODY = {
    "prompt": "Once upon a time, in a land far away,",
    "max_tokens": 300,
    "ignore_eos": True,
    "temperature": 0,
    "logprobs": 0,
}


@contextmanager
def two_decodes(model: Path) -> Iterator[list[Service]]:
    decodes = [Service("decode", model), Service("decode", model)]
    try:
        yield decodes
    finally:
        for decode in decodes:
            if decode.process.poll() is None:
                decode.stop()


def assert_migrations(gateway: HTTPProcess, expected: dict[str, float]) -> None:
    """The gateway's migrations by outcome; on a mismatch, its log says what it did (which
    instance failed or handed a request over, and when)."""
    counted = gateway_migrations(gateway.url)
    assert counted == expected, f"{counted} != {expected}; the gateway's log:\n{gateway.log_text()[-6000:]}"


def _text_and_tokens(chunks: list[dict[str, object]]) -> tuple[str, list[str]]:
    choices = [chunk["choices"][0] for chunk in chunks if chunk.get("choices")]
    return "".join(c["text"] for c in choices), [
        t for c in choices if c.get("logprobs") for t in c["logprobs"]["tokens"]
    ]


def test_a_greedy_stream_survives_its_decode_instance_and_matches_an_uninterrupted_run(
    model: Path, prefill: Service
) -> None:
    with two_decodes(model) as decodes:
        with running_gateway(model, *routes(prefill, *decodes)) as gateway:
            uninterrupted = httpx.post(f"{gateway.url}/v1/completions", json=BODY, timeout=120).json()["choices"][0]
            chunks, survivor = stream_killing_decode(gateway, decodes, BODY, after_chunks=5)
            assert_migrations(gateway, {"resumed": 1.0})
        text, tokens = _text_and_tokens(chunks)
        # Shown with --log-cli-level INFO (docs/benchmarks.md quotes it).
        logger.info("uninterrupted: %r", uninterrupted["text"])
        logger.info("migrated:      %r (%d chunks, the decode instance killed after the 5th)", text, len(chunks))
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert len(tokens) == BODY["max_tokens"]  # none missing, none twice
        assert tokens == uninterrupted["logprobs"]["tokens"]
        assert text == uninterrupted["text"]
        assert_all_free(prefill, survivor)


def test_without_a_migration_budget_the_stream_ends_with_an_error(model: Path, prefill: Service) -> None:
    with two_decodes(model) as decodes:
        with running_gateway(model, *routes(prefill, *decodes), "--max-migrations", "0") as gateway:
            chunks, survivor = stream_killing_decode(gateway, decodes, BODY, after_chunks=5)
            assert_migrations(gateway, {"exhausted": 1.0})
        assert "error" in chunks[-1], chunks[-1]
        assert_all_free(prefill, survivor)


def test_a_draining_decode_hands_its_stream_over_and_the_text_is_an_uninterrupted_runs(
    model: Path, prefill: Service
) -> None:
    # --max-migrations 0: a hand-over is no failure and spends none of the budget.
    with two_decodes(model) as decodes:
        with running_gateway(model, *routes(prefill, *decodes), "--max-migrations", "0") as gateway:
            uninterrupted = httpx.post(f"{gateway.url}/v1/completions", json=BODY, timeout=120).json()["choices"][0]
            chunks, survivor = stream_killing_decode(gateway, decodes, BODY, after_chunks=5, signum=signal.SIGUSR2)
            assert_migrations(gateway, {"handed_over": 1.0})
        drained = decodes[1 - decodes.index(survivor)]
        text, tokens = _text_and_tokens(chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert len(tokens) == BODY["max_tokens"]  # none missing, none twice
        assert tokens == uninterrupted["logprobs"]["tokens"]
        assert text == uninterrupted["text"]
        # The drained instance is still up, holds nothing, and handed over the one stream.
        assert drained.process.poll() is None
        assert drained.load().counters.num_handovers == 1
        assert survivor.load().counters.num_handovers == 0
        assert_all_free(prefill, survivor, drained)
        assert drained.stop() == 0
