"""Small timing profiles for the simulator's tests."""

from __future__ import annotations

from typing import Any

from simulator.timing_model import TimingProfile


def make_profile(**overrides: Any) -> TimingProfile:
    """A profile with round coefficients, so that expected times can be worked out by hand."""
    values: dict[str, Any] = dict(
        name="test",
        source="round figures for tests",
        block_size=16,
        num_kv_blocks=100,
        kv_bytes_per_token=1000,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        step_fixed_s=1.0,
        token_s=0.1,
        attention_s=0.01,
        context_s=0.001,
        link_bytes_per_s=1000.0,
        pull_fixed_s=0.5,
    )
    values.update(overrides)
    return TimingProfile(**values)
