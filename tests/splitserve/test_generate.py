"""``splitserve generate``: the engine's offline command, run through the ``splitserve`` entry
point on a tiny checkpoint, prints what the engine generates for the same flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from splitserve.cli import main


def test_generate_prints_the_engines_greedy_text(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model", str(model), "--kv-cache-memory", str(1 << 22), "--max-tokens", "6", "--raw"]
    assert main(["generate", *flags, "hello world", "one two"]) == 0
    llm = LLM(model=str(model), kv_cache_memory=1 << 22)
    outputs = llm.generate(["hello world", "one two"], SamplingParams(temperature=0.0, max_tokens=6))
    texts = [output.outputs[0].text.strip() for output in outputs]
    assert all(texts) and capsys.readouterr().out.splitlines() == texts
