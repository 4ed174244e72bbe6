"""The compatibility fingerprint: what a prefill and a decode instance must share
for one's KV blocks to mean the same thing in the other's cache.

Checked at the connector handshake, and by the gateway before it pairs
instances. A mismatch is an error naming both values, never garbage tokens.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from cluster.draft_pairing import EAGLE3_DRAFT_PREFIX, EAGLE_DRAFT_PREFIX, MEDUSA_DRAFT_PREFIX, drafts_pair
from engine.gguf_files import gguf_digest, is_gguf
from kv_connector.layer_plan import KVLayout

# Bytes of each weights file folded into the model identity: enough to tell two
# fine-tunes of one architecture apart without reading gigabytes.
_WEIGHT_SAMPLE_BYTES = 1 << 16
# config.json keys that change with tooling, not with the model.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_model_name_or_path"}


# Fields that say how an instance splits its KV, not what the KV is.
LAYOUT_FIELDS = frozenset({"tensor_parallel_size", "stage_first_layers"})
# Fields that name what crosses the hand-off beside the KV, not what the KV is: paired by their
# own rule (cluster/draft_pairing.py), never part of the KV's identity (LMCache keys).
BESIDE_KV_FIELDS = frozenset({"draft"})


class FingerprintMismatchError(ValueError):
    """Two instances whose KV caches are not interchangeable."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    model: str  # folder name plus a digest of its config and weights
    # The KV cache's dtype: the model's ("bfloat16"), or a quantized cache's format and scale
    # layout ("int8/f32-token-head": engine/kv_cache_dtype.py), so neither differs between a pair.
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int = 1
    # Each pipeline stage's first layer (engine/pipeline_parallel/stages.py); (0,): one stage.
    stage_first_layers: tuple[int, ...] = (0,)
    # The drafter whose proposals cross the hand-off ("medusa:<heads' identity>", "eagle:<draft's
    # identity>", "eagle3:<draft's identity>"); "" for any other speculative method or none
    # (cluster/draft_pairing.py).
    draft: str = ""

    def __post_init__(self) -> None:
        # A fingerprint read back from JSON carries a list: kept as a tuple, so that equal ones compare equal.
        object.__setattr__(self, "stage_first_layers", tuple(self.stage_first_layers))

    @property
    def layout(self) -> KVLayout:
        """How this instance splits a block's KV between its ranks."""
        return KVLayout(self.num_layers, self.tensor_parallel_size, self.stage_first_layers)

    def check_compatible(self, other: Fingerprint, this_side: str = "this instance", other_side: str = "peer") -> None:
        """Raise :class:`FingerprintMismatchError` naming every field that differs, with both values,
        and both sides' shapes (TP x PP). The shapes may differ: each side splits the same KV its own
        way, and a pull maps one split onto the other, (layer range, head span) by span
        (kv_connector/layer_plan.py); a split that is no split of the model's layers is refused. Two
        drafters that differ are refused, an empty one on either side pairs (cluster/draft_pairing.py)."""
        differences = [
            f"{field.name}: {this_side} has {mine!r}, {other_side} has {theirs!r}"
            for field, mine, theirs in zip(fields(self), astuple(self), astuple(other), strict=True)
            if mine != theirs and field.name not in LAYOUT_FIELDS | BESIDE_KV_FIELDS
        ]
        if not drafts_pair(self.draft, other.draft):
            differences.append(
                f"draft: {this_side} has {self.draft!r}, {other_side} has {other.draft!r} (the decode side would "
                "verify drafts from a drafter it does not have; give both the same one, or one of them none)"
            )
        differences += [
            f"{side}'s split is no split of its model: {error}"
            for side, fingerprint in ((this_side, self), (other_side, other))
            if (error := fingerprint.layout.error()) is not None
        ]
        if differences:
            raise FingerprintMismatchError(
                f"KV caches are incompatible, refusing to pair {this_side} at {self.layout.describe()} with "
                f"{other_side} at {other.layout.describe()}: " + "; ".join(differences)
            )


def model_identity(model_path: Path) -> str:
    """``<folder name>-<digest>``: the digest covers config.json (minus tooling keys), every
    safetensors header (names, dtypes, shapes) and a sample of each file's weight bytes. A
    GGUF file is ``<file name>-<digest>`` over its header and a sample of its tensor bytes
    (engine/gguf_files.py)."""
    if is_gguf(model_path):
        return f"{model_path.name}-{gguf_digest(model_path)}"
    digest = hashlib.sha256()
    config = json.loads((model_path / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    for weights in sorted(model_path.glob("*.safetensors")):
        with weights.open("rb") as handle:
            (header_size,) = struct.unpack("<Q", handle.read(8))
            digest.update(handle.read(header_size))
            digest.update(handle.read(_WEIGHT_SAMPLE_BYTES))
    return f"{model_path.name}-{digest.hexdigest()[:16]}"


def medusa_draft(heads_path: Path) -> str:
    """The fingerprint's ``draft`` for the Medusa heads in ``heads_path``: their identity as
    :func:`model_identity` takes a model's (config, safetensors headers, weight samples)."""
    return MEDUSA_DRAFT_PREFIX + model_identity(heads_path.expanduser())


def eagle_draft(draft_path: Path) -> str:
    """The fingerprint's ``draft`` for the EAGLE draft checkpoint in ``draft_path``, identified as
    :func:`medusa_draft` identifies heads."""
    return EAGLE_DRAFT_PREFIX + model_identity(draft_path.expanduser())


def handoff_draft(method: str, model_path: Path) -> str:
    """The fingerprint's ``draft`` of an instance speculating with ``method`` from ``model_path``:
    the drafters whose proposals cross the hand-off are named, any other method is ""."""
    if method == "medusa":
        return medusa_draft(model_path)
    if method == "eagle":
        return eagle_draft(model_path)
    if method == "eagle3":
        return EAGLE3_DRAFT_PREFIX + model_identity(model_path.expanduser())
    return ""
