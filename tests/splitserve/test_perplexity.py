"""``splitserve perplexity``: run through the ``splitserve`` entry point on a tiny checkpoint, it
prints llama-perplexity's running figures and final line and writes the engine's figures as JSON;
its default text ships with the package, its source stated beside it; bad input is a clear error."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from engine.perplexity import ChunkPlan, measure, open_engine
from splitserve.cli import main
from splitserve.perplexity import DEFAULT_TEXT, default_text

DATA = Path(__file__).resolve().parents[2] / "splitserve" / "data"


def test_the_default_text_ships_with_its_source_stated_beside_it() -> None:
    text = default_text()
    assert text == (DATA / DEFAULT_TEXT).read_text(encoding="utf-8")
    assert text.startswith("CHAPTER I.\n\nIt is a truth universally acknowledged") and len(text.split()) > 5000
    readme = (DATA / "README.md").read_text()
    assert DEFAULT_TEXT in readme and "public domain" in readme and "eBook #1342" in readme
    assert "_" not in text and "[Illustration" not in text  # the transcription's markup is out


def test_the_command_prints_running_figures_and_writes_the_engines_figure(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text_file = tmp_path / "text.txt"
    text_file.write_text(default_text()[:4000], encoding="utf-8")
    output = tmp_path / "ppl.json"
    flags = ["--model", str(model), "--dtype", "float32", "--ctx-size", "64", "--chunks", "3"]
    assert main(["perplexity", *flags, "--text-file", str(text_file), "--output-json", str(output)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\[1\][\d.]+,\[2\][\d.]+,\[3\][\d.]+", printed[0])
    figures = json.loads(output.read_text())
    assert printed[1].startswith(f"PPL = {figures['perplexity']:.4f} +/- {figures['standard_error']:.5f} (")
    assert "3 chunks of 64 tokens, 93 scored" in printed[1]
    plan = ChunkPlan(ctx_size=64, max_chunks=3)
    with open_engine(str(model), plan, dtype="float32") as llm:
        expected = measure(llm, text_file.read_text(encoding="utf-8"), plan)
    assert figures["perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert figures["running_perplexity"] == pytest.approx(expected.running_perplexity, rel=1e-9)
    assert (figures["num_chunks"], figures["num_scored"], figures["ctx_size"]) == (3, 93, 64)
    assert (figures["dtype"], figures["kv_cache_dtype"], figures["kv_cache_storage"]) == ("float32", "auto", "float32")
    assert figures["text_sha256"] == hashlib.sha256(text_file.read_bytes()).hexdigest()


def test_the_default_text_and_an_int8_kv_cache(model: Path, tmp_path: Path) -> None:
    output = tmp_path / "ppl.json"
    flags = ["--model", str(model), "--ctx-size", "128", "--chunks", "2", "--kv-cache-dtype", "int8"]
    assert main(["perplexity", *flags, "--output-json", str(output)]) == 0
    figures = json.loads(output.read_text())
    assert figures["text_file"] == f"splitserve/data/{DEFAULT_TEXT}"
    assert figures["text_sha256"] == hashlib.sha256(default_text().encode()).hexdigest()
    assert figures["kv_cache_storage"].startswith("int8") and figures["num_scored"] == 2 * 63


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ctx-size", "2048"], r"--ctx-size 2048 exceeds the model's context \(1024 tokens\)"),
        (["--ctx-size", "1024"], r"the text has \d+ tokens; chunks of --ctx-size 1024 need at least 2048"),
    ],
    ids=["ctx-beyond-the-model", "text-shorter-than-two-chunks"],
)
def test_bad_input_is_a_clear_error(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    text_file = tmp_path / "short.txt"
    text_file.write_text(default_text()[:1500], encoding="utf-8")
    with pytest.raises(SystemExit) as exited:
        main(["perplexity", "--model", str(model), "--text-file", str(text_file), *flags])
    assert exited.value.code == 2
    assert re.search(f"splitserve perplexity: error: {message}", capsys.readouterr().err)
