"""Suite-wide settings. Triton kernels run on CPU only through the interpreter,
and the variable must be set before triton is first imported."""

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One Redis server on a free loopback port for the whole run; skips where none is installed."""
    from tests.stores import start_redis, stop

    process, url = start_redis()
    try:
        yield url
    finally:
        stop(process)
