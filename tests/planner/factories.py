"""Small profiles and planner inputs whose numbers a reader checks by hand."""

from __future__ import annotations

from typing import Any

from planner.decision import PlannerBounds, RoleBounds
from simulator.timing_model import TimingProfile


def make_profile(**overrides: Any) -> TimingProfile:
    """1 ms a token and nothing else: a 100-token prompt takes 0.1 s, a step of 1,000 tokens 1 s;
    KV moves at 1e12 bytes a second (a pull costs nothing worth counting)."""
    values: dict[str, Any] = {
        "name": "hand",
        "source": "tests/planner/factories.py",
        "block_size": 16,
        "num_kv_blocks": 100_000,
        "kv_bytes_per_token": 1,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 1000,
        "step_fixed_s": 0.0,
        "token_s": 0.001,
        "attention_s": 0.0,
        "context_s": 0.0,
        "link_bytes_per_s": 1e12,
        "pull_fixed_s": 0.0,
    }
    values.update(overrides)
    return TimingProfile(**values)


def make_bounds(
    prefill: tuple[int, int] = (1, 10),
    decode: tuple[int, int] = (1, 10),
    max_total: int = 20,
    **overrides: Any,
) -> PlannerBounds:
    return PlannerBounds(
        RoleBounds(*prefill),
        RoleBounds(*decode),
        max_total,
        **{"up_cooldown_s": 0.0, "down_cooldown_s": 0.0, "down_margin": 0.2, **overrides},
    )
