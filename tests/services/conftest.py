"""Fixtures of the service tests: the engine the disaggregated output must equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM


@pytest.fixture(scope="module")
def colocated(model: Path) -> LLM:
    """The module's model served in this process: its greedy tokens are what P and D must give."""
    return LLM(model=str(model), kv_cache_memory=1 << 22)
