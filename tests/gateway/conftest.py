"""Fixtures of the gateway tests that route to real instance processes (``tests.services.processes``):
started once per module, on the module's ``model``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services.processes import Service, running


@pytest.fixture(scope="module")
def prefill(model: Path) -> Iterator[Service]:
    with running("prefill", model, "--lease-seconds", "10") as service:
        yield service


@pytest.fixture(scope="module")
def instances(model: Path) -> Iterator[tuple[Service, Service]]:
    """A prefill and a decode instance."""
    with running("prefill", model, "--lease-seconds", "10") as prefill, running("decode", model) as decode:
        yield prefill, decode
