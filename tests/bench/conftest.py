"""Fixtures of the benchmark tests: one tiny tokenizer for the session."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from bench.prompt_text import load_tokenizer
from tests.bench.factories import make_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    return load_tokenizer(tokenizer_dir)
