"""``python -m simulator.measure_profile`` on a tiny random checkpoint: a profile whose coefficients
fit the steps it measured, and the pull figures as given."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.measure_profile import build_parser
from simulator.timing_model import TimingProfile
from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def measure(model: Path, output: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "simulator.measure_profile",
        "--model",
        str(model),
        "--output",
        str(output),
        "--threads",
        "1",
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_the_measured_profile_fits_the_steps_it_recorded(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "llama")
    output = tmp_path / "tiny-cpu.json"
    result = measure(
        model,
        output,
        "--prompt-lens",
        "16,128,700",
        "--batches",
        "4x64,16x32",
        "--chunk",
        "256",
        "--repeats",
        "3",
        "--link-bytes-per-s",
        "1.5e9",
        "--pull-fixed-s",
        "0.003",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "predicted / measured" in result.stdout and f"wrote {output}" in result.stdout

    profile = TimingProfile.from_json(output)
    assert profile.name == "tiny-cpu"
    coefficients = (profile.step_fixed_s, profile.token_s, profile.attention_s, profile.context_s)
    assert min(coefficients) >= 0.0 and profile.step_fixed_s + profile.token_s > 0
    # The tiny model's KV: 2 layers, K and V, 2 KV heads of 16, float32.
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert (profile.link_bytes_per_s, profile.pull_fixed_s) == (1.5e9, 0.003)
    assert "as given on the command line" in profile.source

    rows = [step.rows for step in profile.measured_steps]
    assert ((16, 16),) in rows and ((256, 512),) in rows  # a prompt alone; the 700-token one's second chunk
    assert tuple([(1, 33)] * 16) in rows  # the 16x32 batch's first decode
    # Timings on a shared host are noisy, so the bounds are loose; a formula that missed what the
    # steps depend on (tokens, context) would be off by far more on some of them.
    ratios = [profile.step_seconds(step.rows) / step.seconds for step in profile.measured_steps]
    assert 1 / 2 < statistics.median(ratios) < 2, sorted(ratios)
    assert sum(1 / 4 < ratio < 4 for ratio in ratios) >= 0.9 * len(ratios), sorted(ratios)


def test_a_workload_the_cache_cannot_hold_is_refused_with_the_fix(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "llama")
    result = measure(
        model,
        tmp_path / "out.json",
        "--prompt-lens",
        "16",
        "--batches",
        "64x900",
        "--kv-cache-memory",
        str(1 << 20),
        "--repeats",
        "1",
    )
    assert result.returncode != 0
    assert "error: the largest batch holds about" in result.stderr and "raise --kv-cache-memory" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(("flag", "value"), [("--batches", "4by128"), ("--batches", "0x8"), ("--prompt-lens", "16,-1")])
def test_malformed_workloads_are_refused_before_anything_loads(flag: str, value: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--output", "o.json", flag, value])
