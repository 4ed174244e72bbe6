"""Suite-wide settings and fixtures. Triton kernels run on CPU only through the interpreter,
and the variable must be set before triton is first imported.

The README's test command runs the suite on two pytest-xdist workers, a test file to a worker
(:func:`pytest_xdist_make_scheduler`): most of a test's wall time is spent waiting for servers
it started, so two files side by side keep the two cores busy."""

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


# Test files that must not run beside each other on two workers: both compose stacks build the
# same image and run podman, which one build at a time keeps cached for the other.
_SERIAL_FILES = ("tests/compose/test_compose_up.py", "tests/compose/test_compose_simulate_up.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """A test file to a worker (its module fixtures, servers included, start once), with the
    files of ``_SERIAL_FILES`` as one unit."""
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "compose stacks" if path in _SERIAL_FILES else path

    return FileScheduling(config, log)  # type: ignore[arg-type]
