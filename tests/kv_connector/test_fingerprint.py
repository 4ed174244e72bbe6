from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_connector.fingerprint import (
    Fingerprint,
    FingerprintMismatchError,
    eagle_draft,
    handoff_draft,
    medusa_draft,
    model_identity,
)
from tests.checkpoints import make_checkpoint

BASE = Fingerprint(model="m-1", dtype="bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)


def test_equal_fingerprints_pair() -> None:
    BASE.check_compatible(Fingerprint(**{f: getattr(BASE, f) for f in BASE.__slots__}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "m-2"}, "model: decode has 'm-1', prefill has 'm-2'"),
        ({"dtype": "float16"}, "dtype: decode has 'bfloat16', prefill has 'float16'"),
        ({"block_size": 32}, "block_size: decode has 16, prefill has 32"),
        ({"num_layers": 2}, "num_layers"),
        ({"num_kv_heads": 9}, "num_kv_heads"),
        ({"head_dim": 128}, "head_dim"),
    ],
)
def test_any_difference_is_refused_naming_both_values(change: dict[str, object], message: str) -> None:
    other = Fingerprint(**{**{f: getattr(BASE, f) for f in BASE.__slots__}, **change})
    with pytest.raises(FingerprintMismatchError, match=message):
        BASE.check_compatible(other, this_side="decode", other_side="prefill")


def test_tensor_parallel_sizes_may_differ() -> None:
    """P and D may split the same KV heads their own ways: a pull maps one layout onto the
    other head by head, so the size alone never refuses a pair (head counts still must match)."""
    wide = Fingerprint(**{**{f: getattr(BASE, f) for f in BASE.__slots__}, "tensor_parallel_size": 3})
    BASE.check_compatible(wide)
    wide.check_compatible(BASE)


def test_pipeline_shapes_may_differ() -> None:
    """P and D may split the layers into different stages (and heads over different TP sizes):
    a pull maps one split onto the other span by span (kv_connector/layer_plan.py)."""
    fields = {f: getattr(BASE, f) for f in BASE.__slots__}
    shapes = [
        Fingerprint(**{**fields, "stage_first_layers": (0, 15)}),
        Fingerprint(**{**fields, "stage_first_layers": [0, 10, 20], "tensor_parallel_size": 3}),  # as JSON has it
        BASE,
    ]
    for mine in shapes:
        for theirs in shapes:
            mine.check_compatible(theirs)


def test_a_split_that_is_no_split_of_the_model_is_refused_naming_both_shapes() -> None:
    fields = {f: getattr(BASE, f) for f in BASE.__slots__}
    beyond = Fingerprint(**{**fields, "stage_first_layers": (0, 30), "tensor_parallel_size": 3})
    with pytest.raises(FingerprintMismatchError) as refused:
        BASE.check_compatible(beyond, this_side="decode", other_side="prefill")
    assert str(refused.value) == (
        "KV caches are incompatible, refusing to pair decode at TP 1 x PP 1 (stages from layers 0) with prefill at "
        "TP 3 x PP 2 (stages from layers 0, 30): prefill's split is no split of its model: stages from layers "
        "[0, 30]: each must hold at least one of the 30 layers"
    )
    # Another difference is named with both shapes too.
    other = Fingerprint(**{**fields, "block_size": 32, "stage_first_layers": (0, 15)})
    with pytest.raises(FingerprintMismatchError, match=r"TP 1 x PP 1 .* TP 1 x PP 2 \(stages from layers 0, 15\)"):
        BASE.check_compatible(other)


def test_model_identity_tells_weights_and_configs_apart(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "same", seed=0)
    b = make_checkpoint(tmp_path / "other" / "same", seed=1)  # same name and config, other weights
    assert model_identity(a) == model_identity(a)
    assert model_identity(a) != model_identity(b)
    config = json.loads((a / "config.json").read_text())
    config["transformers_version"] = "0.0.0"  # tooling noise does not change the identity
    before = model_identity(a)
    (a / "config.json").write_text(json.dumps(config))
    assert model_identity(a) == before
    config["rms_norm_eps"] = 0.5
    (a / "config.json").write_text(json.dumps(config))
    assert model_identity(a) != before


def test_kv_caches_of_other_dtypes_or_scale_layouts_refuse_to_pair() -> None:
    """--kv-cache-dtype: the fingerprint's dtype names how the KV is stored (the values' format and,
    when quantized, the scales' layout), so P and D never pair across KV dtypes, nor across scale
    layouts of one format."""
    import torch

    from engine.kv_cache_dtype import KVCacheFormat

    fields = {f: getattr(BASE, f) for f in BASE.__slots__}
    int8, fp8, plain = (
        Fingerprint(**{**fields, "dtype": KVCacheFormat(name, torch.bfloat16, 64).fingerprint_dtype})
        for name in ("int8", "fp8_e4m3", "auto")
    )
    assert plain == BASE
    for mine, theirs in [(int8, plain), (int8, fp8), (int8, Fingerprint(**{**fields, "dtype": "int8/f16-block-head"}))]:
        with pytest.raises(
            FingerprintMismatchError, match=f"dtype: decode has '{mine.dtype}', prefill has '{theirs.dtype}'"
        ):
            mine.check_compatible(theirs, this_side="decode", other_side="prefill")
    int8.check_compatible(Fingerprint(**{**fields, "dtype": "int8/f32-token-head"}))


def with_fields(fingerprint: Fingerprint, **change: object) -> Fingerprint:
    return Fingerprint(**{**{f: getattr(fingerprint, f) for f in fingerprint.__slots__}, **change})


def test_drafters_that_differ_refuse_to_pair_naming_both() -> None:
    """D would verify drafts from Medusa heads it does not have."""
    mine, theirs = with_fields(BASE, draft="medusa:heads-aaaa"), with_fields(BASE, draft="medusa:heads-bbbb")
    named = "draft: decode has 'medusa:heads-aaaa', prefill has 'medusa:heads-bbbb'"
    with pytest.raises(FingerprintMismatchError, match=named):
        mine.check_compatible(theirs, this_side="decode", other_side="prefill")
    mine.check_compatible(with_fields(BASE, draft="medusa:heads-aaaa"))


def test_no_drafter_on_either_side_pairs_and_the_layout_stays_free() -> None:
    """A P without heads sends no drafts; a D without heads ignores P's. Shapes still may differ."""
    drafting = with_fields(BASE, draft="medusa:heads-aaaa", stage_first_layers=(0, 15))
    for mine, theirs in [(drafting, BASE), (BASE, drafting), (with_fields(BASE, tensor_parallel_size=3), drafting)]:
        mine.check_compatible(theirs)
    # The drafter is no licence for other KV: a differing field is still refused, by itself.
    with pytest.raises(FingerprintMismatchError) as refused:
        drafting.check_compatible(with_fields(BASE, block_size=32), this_side="decode", other_side="prefill")
    assert "block_size: decode has 16, prefill has 32" in str(refused.value) and "draft" not in str(refused.value)


def test_medusa_draft_tells_head_sets_apart(tmp_path: Path) -> None:
    from tests.engine.spec_decode.medusa_heads import make_medusa_heads

    heads = make_medusa_heads(tmp_path / "heads", "vllm", seed=0)
    other = make_medusa_heads(tmp_path / "other" / "heads", "vllm", seed=1)  # same name and config, other weights
    medusa_1 = make_medusa_heads(tmp_path / "medusa-1" / "heads", "medusa-1", seed=0)
    assert medusa_draft(heads) == medusa_draft(heads) and medusa_draft(heads).startswith("medusa:heads-")
    assert len({medusa_draft(heads), medusa_draft(other), medusa_draft(medusa_1)}) == 3


def test_eagle_draft_tells_drafts_apart_and_only_crossing_drafters_are_named(tmp_path: Path) -> None:
    """EAGLE drafts of one name and config but other weights differ; a Medusa and an EAGLE
    drafter never pair; methods that draft on D alone name nothing."""
    from engine.spec_decode.eagle_checkpoint import save_eagle_draft
    from tests.engine.spec_decode.eagle_drafts import random_draft
    from tests.engine.spec_decode.medusa_heads import make_medusa_heads

    draft, other = tmp_path / "draft", tmp_path / "other" / "draft"
    save_eagle_draft(random_draft(seed=0), draft, "eagle", {})
    save_eagle_draft(random_draft(seed=1), other, "eagle", {})
    assert eagle_draft(draft) == handoff_draft("eagle", draft) and eagle_draft(draft).startswith("eagle:draft-")
    assert eagle_draft(draft) != eagle_draft(other)
    heads = make_medusa_heads(tmp_path / "heads", "vllm")
    assert handoff_draft("medusa", heads) == medusa_draft(heads)
    assert handoff_draft("draft_model", draft) == handoff_draft("ngram", Path()) == ""
    with pytest.raises(FingerprintMismatchError, match="draft: decode has 'eagle:draft-"):
        with_fields(BASE, draft=eagle_draft(draft)).check_compatible(
            with_fields(BASE, draft=medusa_draft(heads)), this_side="decode", other_side="prefill"
        )


def test_eagle3_drafts_are_named_apart_from_each_other_and_from_eagle_ones(tmp_path: Path) -> None:
    """EAGLE-3 drafts cross the hand-off too: named ``eagle3:<identity>``, two of one name and
    config but other weights differ, and one never pairs with an EAGLE draft (each side named)."""
    from engine.spec_decode.eagle3_checkpoint import save_eagle3_draft
    from engine.spec_decode.eagle_checkpoint import save_eagle_draft
    from tests.engine.spec_decode.eagle3_drafts import random_eagle3_draft
    from tests.engine.spec_decode.eagle_drafts import random_draft

    draft3, other3, draft = tmp_path / "draft", tmp_path / "other" / "draft", tmp_path / "eagle" / "draft"
    save_eagle3_draft(random_eagle3_draft(seed=0), draft3, "speculators", {})
    save_eagle3_draft(random_eagle3_draft(seed=1), other3, "speculators", {})
    save_eagle_draft(random_draft(seed=0), draft, "eagle", {})
    named = handoff_draft("eagle3", draft3)
    assert named.startswith("eagle3:draft-") and named != handoff_draft("eagle3", other3)
    with pytest.raises(FingerprintMismatchError, match=f"draft: decode has '{named}', prefill has 'eagle3:draft-"):
        with_fields(BASE, draft=named).check_compatible(
            with_fields(BASE, draft=handoff_draft("eagle3", other3)), this_side="decode", other_side="prefill"
        )
    with pytest.raises(FingerprintMismatchError, match=f"draft: decode has '{named}', prefill has 'eagle:draft-"):
        with_fields(BASE, draft=named).check_compatible(
            with_fields(BASE, draft=eagle_draft(draft)), this_side="decode", other_side="prefill"
        )
