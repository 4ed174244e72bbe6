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


def test_drafters_pair_as_the_instances_check_them() -> None:
    """The gateway never pairs what the instances would refuse: two Medusa head sets that differ
    do not pair, a side without heads pairs with either, whatever the shapes."""
    heads_a = Fingerprint(**{**{f: getattr(BASE, f) for f in BASE.__slots__}, "draft": "medusa:heads-aaaa"})
    heads_b = Fingerprint(**{**{f: getattr(BASE, f) for f in BASE.__slots__}, "draft": "medusa:heads-bbbb"})
    wide_a = Fingerprint(**{**{f: getattr(heads_a, f) for f in BASE.__slots__}, "tensor_parallel_size": 2})
    assert not kv_compatible(fingerprint_to_proto(heads_a), fingerprint_to_proto(heads_b))
    for mine, theirs in [(heads_a, BASE), (BASE, heads_b), (heads_a, wide_a), (wide_a, BASE)]:
        assert kv_compatible(fingerprint_to_proto(mine), fingerprint_to_proto(theirs))
    assert fingerprint_from_proto(fingerprint_to_proto(wide_a)) == wide_a
