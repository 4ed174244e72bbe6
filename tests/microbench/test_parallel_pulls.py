"""microbench.tensor_parallel_pulls in its smallest form: a tiny checkpoint, a short prompt and
one timed pull of one pair of shapes, through real prefill and decode processes over UCX, so the
command docs/benchmarks.md gives for every TP x PP pair keeps working."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbench.tensor_parallel_pulls import main, parse_pairs, shape_label
from tests.checkpoints import make_checkpoint

pytest.importorskip("ucxx")

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 4, 8, 16  # the tiny checkpoint (tests/checkpoints.py)


def test_shapes_of_each_pair_and_their_labels() -> None:
    assert parse_pairs("1:1,1x2:1,1:1x2,2:1x2,2x2:1") == [
        ((1, 1), (1, 1)),
        ((1, 2), (1, 1)),
        ((1, 1), (1, 2)),
        ((2, 1), (1, 2)),
        ((2, 2), (1, 1)),
    ]
    assert [shape_label(shape) for shape in [(1, 1), (1, 2), (2, 1), (2, 2)]] == ["1", "PP2", "TP2", "TP2xPP2"]
    with pytest.raises(ValueError, match="PREFILL_SHAPE:DECODE_SHAPE"):
        parse_pairs("2x2")


def test_one_pull_from_a_prefill_at_pp2_to_a_decode_at_pp1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_checkpoint(tmp_path / "model", num_attention_heads=8, num_key_value_heads=NUM_KV_HEADS)
    output = tmp_path / "pulls.json"
    argv = ["--model", str(model), "--pairs", "1x2:1", "--input-len", "20", "--repeats", "1"]
    assert main([*argv, "--kv-cache-memory", str(1 << 22), "--output-json", str(output)]) == 0
    (row,) = json.loads(output.read_text())
    assert (row["prefill_tp"], row["prefill_pp"], row["decode_tp"], row["decode_pp"]) == (1, 2, 1, 1)
    # Both blocks of the 20-token prompt, every layer (from both of P's stages) and head, once.
    assert row["num_bytes"] == 2 * NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    assert row["pull_ms_min"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].split()[:3] == ["PP2", "->", "1"]
