"""Fuzz the REST API from its own OpenAPI schema (schemathesis): requests that follow
the schema and requests that break it, against a real gateway over a real prefill
and decode instance. No answer may be a 5xx (nor a stream that ends in an internal
error), and afterwards the gateway holds no pending slot and both instances have
every KV block free.

Bounded: a fixed number of examples per operation (derandomized, so a run is
repeatable, and as thorough on a slow machine as on a fast one)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.inprocess import make_chat_checkpoint
from tests.gateway.processes import HTTPProcess, routes, running_gateway
from tests.services.client import assert_all_free
from tests.services.processes import Service

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("ucxx")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402 - after the skips
from hypothesis import strategies as st  # noqa: E402

# Examples per operation and mode. Bodies are where the gateway can go wrong; the GETs
# take no input, so a few positive examples cover them.
NUM_BODY_EXAMPLES = 60
NUM_GET_EXAMPLES = 3
MAX_MODEL_LEN = 48  # keeps each generation the fuzzer gets through short


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("llama-chat"), slow_loops=False)


@pytest.fixture(scope="module")
def stack(model: Path, instances: tuple[Service, Service]) -> Iterator[tuple[HTTPProcess, Service, Service]]:
    prefill, decode = instances
    with running_gateway(
        model, *routes(prefill, decode), "--max-model-len", str(MAX_MODEL_LEN), "--max-pending-requests", "8"
    ) as gateway:
        yield gateway, prefill, decode


def pending_requests(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    return float(re.search(r"^splitserve_num_pending_requests (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]


# Every example runs, however long a loaded machine takes: the limit only stops a hang.
@pytest.mark.timeout(1800)
def test_fuzzed_requests_get_no_5xx_and_leak_nothing(stack: tuple[HTTPProcess, Service, Service]) -> None:
    gateway, prefill, decode = stack
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    num_calls = 0
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        has_body = operation.method.upper() == "POST"
        modes = list(schemathesis.GenerationMode) if has_body else [schemathesis.GenerationMode.POSITIVE]
        strategy = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))

        @settings(
            max_examples=NUM_BODY_EXAMPLES * len(modes) if has_body else NUM_GET_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def call(case: schemathesis.Case) -> None:
            nonlocal num_calls
            num_calls += 1
            response = case.call(base_url=gateway.url, timeout=60)
            if response.status_code >= 500 or '"internal_error"' in response.text:
                failures.append(f"{response.status_code} {response.text[:300]}\n  {case.as_curl_command()}")

        call()
    assert not failures, f"{len(failures)} of {num_calls} fuzzed requests failed:\n" + "\n".join(failures[:10])
    assert num_calls >= 300, f"only {num_calls} requests: the fuzzer ran out of examples"
    # Background aborts and releases land within moments.
    deadline = time.monotonic() + 120  # a safety net
    while pending_requests(gateway.url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pending_requests(gateway.url) == 0
    assert_all_free(prefill, decode)
