"""Connector backends by name, imported only when chosen (each pulls in its own transport),
and the flags that choose one (:func:`add_kv_connector_arguments`).

Torch-free: the commands that take ``--kv-connector`` (the instances, ``splitserve up``)
declare it here, its choices the names in ``BACKENDS``, without loading a backend."""

from __future__ import annotations

import argparse
import importlib
import os
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


def add_kv_connector_arguments(parser: argparse.ArgumentParser, lmcache_url_default: str = "none") -> None:
    """``lmcache_url_default``: what the command does without ``--lmcache-url``."""
    parser.add_argument(
        "--kv-connector", default="ucx", choices=sorted(BACKENDS), help="how KV moves from prefill to decode"
    )
    parser.add_argument(
        "--lmcache-url",
        default=os.environ.get("SPLITSERVE_LMCACHE_URL", ""),
        help="lmcache connector: the store prefill and decode instances share, redis://[USER:PASSWORD@]HOST:PORT, "
        "rediss:// or lm://HOST:PORT (env SPLITSERVE_LMCACHE_URL, which keeps a password off the command line; "
        f"default: {lmcache_url_default})",
    )
