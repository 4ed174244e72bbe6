"""``splitserve up`` with pipeline parallelism per role: the official ``openai`` client gets the
offline engine's greedy text from a prefill instance split into two stages handing off to a
decode instance of one (its one rank pulls each stage's layers from the rank holding them), and
``up`` leaves no process behind when it stops; a stage split that names another role's stage
count is refused before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from launcher.up import add_arguments, run
from tests.checkpoints import make_checkpoint
from tests.gateway.test_tensor_parallel_up import assert_offline_text, descendants, start_up, stop_cleanly


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers (a stage each at PP 2), 2 KV heads."""
    return make_checkpoint(tmp_path_factory.mktemp("pp-up"), num_attention_heads=4, num_key_value_heads=2)


def test_prefill_at_pp2_hands_off_to_decode_at_pp1(tiny: Path) -> None:
    up = start_up(tiny, "--prefill-pipeline-parallel-size", "2", "--decode-pipeline-parallel-size", "1")
    try:
        below = descendants(up.process.pid)
        workers = [pid for pid in below if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) == 1, "one worker process: the prefill instance's first stage"
        assert_offline_text(up, tiny)
    finally:
        stop_cleanly(up)


def test_stage_layers_of_another_stage_count_are_refused_before_anything_starts() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--pipeline-parallel-size", "2", "--pipeline-stage-layers", "1,1", "--decode-pipeline-parallel-size", "1"]
    )
    with pytest.raises(ValueError, match="not of --decode-pipeline-parallel-size 1: drop one of them"):
        run(args)
