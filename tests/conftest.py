"""Suite-wide settings and fixtures. Triton kernels run on CPU only through the interpreter,
and the variable must be set before triton is first imported."""

import os
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama checkpoint (``tests.checkpoints``), one per module; a module that
    needs another (a chat template, wider layers) defines its own ``model``."""
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose long prompts take a while to prefill (``tests.checkpoints.LONG_MODEL``)."""
    from tests.checkpoints import LONG_MODEL, make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("long-llama"), **LONG_MODEL)
