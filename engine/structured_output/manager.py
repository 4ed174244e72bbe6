"""The engine's structured-output side: its grammar compiler, made on first use.

An instance has no tokenizer for text (it speaks token ids), but a grammar is
written in characters, so the first constrained request loads the model folder's
tokenizer.json once, for its vocabulary's bytes only. Engines that never see a
constrained request never load it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from engine.structured_output.bitmask import BitmaskWorker
from engine.structured_output.compiler import GrammarCompiler
from engine.structured_output.grammar_state import GrammarState
from engine.structured_output.spec import StructuredOutputSpec

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, model_path: Path, eos_token_ids: frozenset[int], vocab_size: int) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size  # the model's (logits width)
        self.eos_token_ids = eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._worker: BitmaskWorker | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if not (self.model_path / "tokenizer.json").is_file():
                    raise ValueError(
                        f"structured outputs need the model's tokenizer.json, and {self.model_path} has none; "
                        "send the request without response_format / structured_outputs"
                    )
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast.from_pretrained(str(self.model_path))
                self._compiler = GrammarCompiler.from_hf_tokenizer(tokenizer, self.eos_token_ids)
                logger.info("structured outputs: grammar vocabulary of %d tokens loaded", self._compiler.vocab_size)
            return self._compiler

    @property
    def worker(self) -> BitmaskWorker:
        """Made on the engine thread only (the first step with a constrained row)."""
        if self._worker is None:
            self._worker = BitmaskWorker(self.compiler.vocab_size, self.vocab_size)
        return self._worker

    def compile(self, spec: StructuredOutputSpec) -> None:
        """Compile ahead (any thread), so the engine thread finds it cached. Raises ValueError."""
        self.compiler.compile(spec)

    def new_state(self, spec: StructuredOutputSpec, request_id: str) -> GrammarState:
        """A fresh matcher for a new request (compiles on a cache miss). Raises ValueError."""
        return GrammarState(self.compiler.compile(spec).new_matcher(), request_id)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
