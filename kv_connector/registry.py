"""Connector backends by name, imported only when chosen (each pulls in its own transport).

Torch-free: the commands that take ``--kv-connector`` (splitserve/flags.py) list its
choices from ``BACKENDS`` without loading a backend."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing these loads torch
    import torch

    from kv_connector.base import KVConnector
    from kv_connector.fingerprint import Fingerprint

# name -> "module:class"
BACKENDS = {
    "ucx": "kv_connector.ucx:UCXConnector",
    "lmcache": "kv_connector.lmcache_connector:LMCacheConnector",
}


def make_connector(
    name: str, kv_cache: torch.Tensor, fingerprint: Fingerprint, options: dict[str, object] | None = None
) -> KVConnector:
    """``options`` are the backend's own keyword arguments (lmcache: ``remote_url``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown KV connector {name!r}; choose one of {', '.join(sorted(BACKENDS))}")
    module_name, _, class_name = BACKENDS[name].partition(":")
    connector_class = getattr(importlib.import_module(module_name), class_name)
    return connector_class(kv_cache, fingerprint, **(options or {}))
