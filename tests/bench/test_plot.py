"""bench plot writes real PNG files, overlays runs, and draws a sweep when given one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.metrics import RunInfo, compute_metrics, result_json
from splitserve.cli import main
from tests.bench.factories import make_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_result(path: Path, rate: float, label: str | None, ttft: float) -> Path:
    records = [
        make_record(ttft=ttft + 0.01 * i, itl=[0.02, 0.03, 0.025], output_tokens=4, start_time=0.1 * i)
        for i in range(8)
    ] + [make_record(error="HTTP 503")]
    info = RunInfo(
        date="20250101-000000",
        backend="openai",
        label=label,
        model_id="m",
        tokenizer_id="t",
        num_prompts=len(records),
        request_rate=rate,
        burstiness=1.0,
        max_concurrency=None,
        base_url="http://x",
        endpoint="/v1/completions",
        dataset="random",
        seed=0,
        num_warmups=0,
        goodput_slos_ms={},
    )
    path.write_text(json.dumps(result_json(info, records, compute_metrics(records, 2.0), 2.0)))
    return path


def _assert_pngs(directory: Path, names: set[str]) -> None:
    assert {p.name for p in directory.iterdir()} == names
    for name in names:
        data = (directory / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_plot_overlays_runs_and_draws_rate_plots_for_a_sweep(tmp_path: Path) -> None:
    files = [
        _write_result(tmp_path / "a1.json", 1.0, "splitserve", 0.1),
        _write_result(tmp_path / "a2.json", 4.0, "splitserve", 0.2),
        _write_result(tmp_path / "ainf.json", math.inf, "splitserve", 0.4),
        _write_result(tmp_path / "b.json", 1.0, None, 0.3),
    ]
    assert main(["bench", "plot", *map(str, files), "--output-dir", str(tmp_path / "figures")]) == 0
    _assert_pngs(
        tmp_path / "figures",
        {"ttft_cdf.png", "itl_cdf.png", "itl_over_time.png", "throughput_vs_rate.png", "latency_vs_rate.png"},
    )


def test_plot_without_a_sweep_skips_rate_plots_and_accepts_labels(tmp_path: Path) -> None:
    files = [_write_result(tmp_path / "a.json", 2.0, None, 0.1), _write_result(tmp_path / "b.json", 2.0, None, 0.2)]
    args = [
        "bench",
        "plot",
        *map(str, files),
        "--output-dir",
        str(tmp_path / "out"),
        "--label",
        "vllm",
        "--label",
        "ours",
    ]
    assert main(args) == 0
    _assert_pngs(tmp_path / "out", {"ttft_cdf.png", "itl_cdf.png", "itl_over_time.png"})


def test_plot_rejects_a_label_count_mismatch_and_non_results(tmp_path: Path) -> None:
    from bench.plot import load_runs

    good = _write_result(tmp_path / "a.json", 2.0, None, 0.1)
    with pytest.raises(ValueError, match="one --label per result file"):
        load_runs([good], ["x", "y"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a bench serve result"):
        load_runs([bad])
