"""The gateway pairs P and D of different TP x PP shapes (a pull maps one split onto the
other: kv_connector/layer_plan.py), never of different KV."""

from __future__ import annotations

from gateway.instances import kv_compatible
from kv_connector.fingerprint import Fingerprint
from serving.convert import fingerprint_from_proto, fingerprint_to_proto

BASE = Fingerprint(model="m-1", dtype="float32", block_size=16, num_layers=4, num_kv_heads=4, head_dim=8)


def test_shapes_pair_and_other_kv_does_not() -> None:
    pipelined = Fingerprint(**{**{f: getattr(BASE, f) for f in BASE.__slots__}, "stage_first_layers": (0, 2)})
    wide = Fingerprint(**{**{f: getattr(BASE, f) for f in BASE.__slots__}, "tensor_parallel_size": 2})
    other_blocks = Fingerprint(**{**{f: getattr(pipelined, f) for f in BASE.__slots__}, "block_size": 32})
    assert kv_compatible(fingerprint_to_proto(pipelined), fingerprint_to_proto(BASE))
    assert kv_compatible(fingerprint_to_proto(wide), fingerprint_to_proto(pipelined))
    assert not kv_compatible(fingerprint_to_proto(other_blocks), fingerprint_to_proto(BASE))


def test_the_stages_survive_the_proto() -> None:
    pipelined = Fingerprint(**{**{f: getattr(BASE, f) for f in BASE.__slots__}, "stage_first_layers": (0, 1, 3)})
    assert fingerprint_from_proto(fingerprint_to_proto(pipelined)) == pipelined
    assert fingerprint_from_proto(fingerprint_to_proto(BASE)) == BASE
