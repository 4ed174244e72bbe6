"""splitserve's engine: paged-KV continuous batching for Llama-family models.

Public API::

    from engine import LLM, SamplingParams
    outputs = LLM(model=None).generate(["Hello"], SamplingParams(max_tokens=16))

Heavy names load lazily, so torch-free pieces (``engine.sampling_params``,
``engine.detokenizer``) can be imported by the gateway without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers only; at run time __getattr__ below loads each name on use
    from engine.async_engine import AsyncEngine as AsyncEngine
    from engine.config import EngineConfig as EngineConfig
    from engine.engine_core import EngineCore as EngineCore
    from engine.llm import LLM as LLM
    from engine.outputs import CompletionOutput as CompletionOutput
    from engine.outputs import EngineCoreOutput as EngineCoreOutput
    from engine.outputs import RequestOutput as RequestOutput
    from engine.sampling_params import SamplingParams as SamplingParams
    from engine.spec_decode.config import SpeculativeConfig as SpeculativeConfig

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "EngineConfig": "engine.config",
    "EngineCore": "engine.engine_core",
    "AsyncEngine": "engine.async_engine",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EngineCoreOutput": "engine.outputs",
    "SpeculativeConfig": "engine.spec_decode.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
