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

from engine.gguf_files import gguf_digest, is_gguf

# Bytes of each weights file folded into the model identity: enough to tell two
# fine-tunes of one architecture apart without reading gigabytes.
_WEIGHT_SAMPLE_BYTES = 1 << 16
# config.json keys that change with tooling, not with the model.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_model_name_or_path"}


# Fields that say how an instance splits its KV, not what the KV is.
LAYOUT_FIELDS = frozenset({"tensor_parallel_size"})


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

    def check_compatible(self, other: Fingerprint, this_side: str = "this instance", other_side: str = "peer") -> None:
        """Raise :class:`FingerprintMismatchError` naming every field that differs, with both values.
        The tensor-parallel size may differ: each side splits the same KV heads its own way, and
        a pull maps one layout onto the other head by head (kv_connector/head_plan.py)."""
        differences = [
            f"{field.name}: {this_side} has {mine!r}, {other_side} has {theirs!r}"
            for field, mine, theirs in zip(fields(self), astuple(self), astuple(other), strict=True)
            if mine != theirs and field.name not in LAYOUT_FIELDS
        ]
        if differences:
            raise FingerprintMismatchError("KV caches are incompatible, refusing to pair: " + "; ".join(differences))


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
