"""Keep the garbage collector off what a server built at start-up.

A loaded instance or gateway holds hundreds of thousands of objects that live as long as the
process (modules, the model's and the tokenizer's Python objects, gRPC and protobuf machinery).
Every full collection walks all of them, and stops every thread that needs the GIL meanwhile,
so each one is a token gap of that length for every stream on the instance (how long, on a
2-vCPU machine: docs/benchmarks.md, "vLLM's CPU server beside splitserve"). Once start-up is done
they are moved to the permanent generation, which collections skip (``gc.freeze``, as vLLM
does after loading its model); objects made afterwards are collected as before.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then exempt every surviving object from later collections; returns how many."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("%d start-up objects exempt from garbage collection", frozen)
    return frozen
