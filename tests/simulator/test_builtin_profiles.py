"""The shipped profiles load by name, agree with their models' shapes, and order steps sensibly;
the timing model loads without torch."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.timing_model import TimingProfile, builtin_profile_names, load_profile

ROOT = Path(__file__).resolve().parents[2]
GPU_PROFILES = ["llama-3.1-8b-h100", "llama-3.1-70b-tp4-h100"]
CPU_PROFILE = "smollm2-135m-cpu"
# layers * (K and V) * KV heads * head dim * bytes, from each model's config.json and KV dtype.
KV_BYTES_PER_TOKEN = {
    "llama-3.1-8b-h100": 32 * 2 * 8 * 128 * 2,  # bf16
    "llama-3.1-70b-tp4-h100": 80 * 2 * 8 * 128 * 2,  # bf16
    CPU_PROFILE: 30 * 2 * 3 * 64 * 4,  # float32
}


def test_every_shipped_profile_loads_by_name_and_names_itself() -> None:
    assert builtin_profile_names() == sorted(KV_BYTES_PER_TOKEN)
    for name in builtin_profile_names():
        profile = load_profile(name)
        assert profile.name == name
        assert profile.kv_bytes_per_token == KV_BYTES_PER_TOKEN[name]
        assert "docs/simulator.md" in profile.source or "simulator.measure_profile" in profile.source


def test_a_profile_file_loads_by_path_and_an_unknown_name_lists_the_shipped_ones(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(load_profile(CPU_PROFILE).to_json())
    assert load_profile(path) == load_profile(CPU_PROFILE)
    with pytest.raises(ValueError, match="llama-3.1-8b-h100"):
        load_profile("llama-9000")


@pytest.mark.parametrize("name", builtin_profile_names())
def test_more_work_takes_longer(name: str) -> None:
    profile = load_profile(name)
    assert profile.step_seconds([(1, 512)] * 64) > profile.step_seconds([(1, 512)])
    assert profile.step_seconds([(1, 8192)] * 8) > profile.step_seconds([(1, 128)] * 8)
    assert profile.prefill_seconds(2048) > profile.prefill_seconds(128) > 0
    assert profile.pull_seconds(128 * profile.block_bytes) > profile.pull_seconds(profile.block_bytes)


def test_gpu_profiles_are_in_the_orders_of_magnitude_of_their_hardware() -> None:
    small, large = (load_profile(name) for name in GPU_PROFILES)
    for profile in (small, large):
        # A decode step of a few rows: milliseconds, not microseconds nor seconds.
        assert 1e-3 < profile.step_seconds([(1, 1024)] * 8) < 0.1
        # A 2,048-token prompt: tens to hundreds of milliseconds.
        assert 0.01 < profile.prefill_seconds(2048) < 1.0
        # Hundreds of thousands of tokens of KV.
        assert 1e5 < profile.num_kv_blocks * profile.block_size < 1e7
    # The 70B model on four GPUs is slower per step than the 8B on one, and pulls more bytes per token.
    for rows in ([(1, 1024)] * 32, [(2048, 2048)]):
        assert large.step_seconds(rows) > small.step_seconds(rows)
    assert large.kv_bytes_per_token > small.kv_bytes_per_token
    # A pull of a 2,048-token prompt's KV takes less time than prefilling it (why disaggregation pays).
    for profile in (small, large):
        assert profile.pull_seconds(2048 * profile.kv_bytes_per_token) < profile.prefill_seconds(2048)


def test_the_cpu_profile_is_slower_than_a_gpu_and_predicts_the_steps_it_was_fitted_on() -> None:
    cpu, gpu = load_profile(CPU_PROFILE), load_profile("llama-3.1-8b-h100")
    assert cpu.step_seconds([(1, 512)] * 8) > gpu.step_seconds([(1, 512)] * 8)
    assert cpu.prefill_seconds(512) > gpu.prefill_seconds(512)
    assert_predicts_its_measured_steps(cpu)


def assert_predicts_its_measured_steps(profile: TimingProfile) -> None:
    """Every recorded step within a factor of 3 of its prediction, the median within 1.5."""
    assert len(profile.measured_steps) >= 10
    ratios = [profile.step_seconds(step.rows) / step.seconds for step in profile.measured_steps]
    assert all(1 / 3 < ratio < 3 for ratio in ratios), sorted(ratios)
    assert 1 / 1.5 < statistics.median(ratios) < 1.5


def test_the_timing_model_imports_without_torch() -> None:
    """Simulated instances start by the dozen on one host: the model and its profiles must not
    cost a torch import. The fit (numpy only) must not either."""
    code = (
        "import sys\n"
        "import simulator.timing_model, simulator.profile_fit\n"
        "simulator.timing_model.load_profile('llama-3.1-8b-h100').step_seconds([(1, 10)])\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'engine')))\n"
        "print(loaded)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
