"""``python -m bench.gateway_routing`` on a small simulated cluster (2 prefill + 2 decode
instances, 2 gateways): both modes serve every request, their hit rates come from the
gateways' counters (some prefix reused, never more than the round's bound), and the report
and table are written. Routing quality itself is tested in tests/simulator/."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.gateway_routing import MODES, main, round_prompts

NUM_PROMPTS = 12
NUM_PREFIXES = 2
PREFIX_LEN = 256


def test_each_round_has_prefixes_of_its_own_shared_by_its_requests() -> None:
    args = argparse.Namespace(
        num_prompts=NUM_PROMPTS, num_prefixes=NUM_PREFIXES, prefix_len=PREFIX_LEN, suffix_len=8, vocab_size=1000
    )
    first, second = round_prompts(args, seed=0), round_prompts(args, seed=1)
    assert len({tuple(p[:PREFIX_LEN]) for p in first}) == NUM_PREFIXES
    assert len({tuple(p[PREFIX_LEN:]) for p in first}) == NUM_PROMPTS  # each suffix its own
    assert not {tuple(p[:PREFIX_LEN]) for p in first} & {tuple(p[:PREFIX_LEN]) for p in second}
    assert round_prompts(args, seed=0) == first  # a seed replays its round


def test_a_small_cluster_reports_both_modes(tmp_path: Path) -> None:
    argv = [
        "--output-dir", str(tmp_path), "--num-prefill", "2", "--num-decode", "2", "--processes-per-role", "1",
        "--num-gateways", "2", "--rounds", "1", "--num-prompts", str(NUM_PROMPTS), "--num-prefixes",
        str(NUM_PREFIXES), "--prefix-len", str(PREFIX_LEN), "--request-rate", "8", "--heartbeat-seconds", "0.5",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "gateway_routing.json").read_text())
    for mode in MODES:
        figures = report["modes"][mode]
        assert figures["failed"] == 0 and figures["requests"] == NUM_PROMPTS, mode
        assert 0 < figures["hit_rate"] <= figures["hit_rate_bound"] < 1, mode
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"], mode
    assert [(r["mode"], r["round_index"]) for r in report["rounds"]] == [("one", 0), ("all", 0), ("all", 1), ("one", 1)]
    assert "2 gateways against 1" in (tmp_path / "summary.md").read_text()
