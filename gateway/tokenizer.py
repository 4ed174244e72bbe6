"""The gateway's tokenizer: prompts and chat templates to token ids, ids to text.

Only the gateway (and the offline ``engine.LLM``) hold a tokenizer; prefill and
decode instances speak token ids. Loaded as ``PreTrainedTokenizerFast`` because
``AutoTokenizer`` imports torch, which the gateway never needs.

Tokenizing, rendering a chat template and decoding a whole sequence run on a
bounded work pool (``gateway/work_pool.py``), never on the event loop: a long prompt
must not stall every other request's stream, and one client's flood must not hold
every worker. A prompt's characters are checked against ``--max-prompt-chars``
before it is tokenized. A chat template that takes longer than
``--chat-template-timeout`` fails the request with 400 and stops at its next line,
freeing its worker (``gateway/chat_template.py``).

Concurrent use from the pool is safe: the gateway never asks for truncation or
padding, so the Rust tokenizer's settings are never changed while one encodes.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerFast

from gateway.chat_template import ChatTemplate
from gateway.errors import bad_request
from gateway.gate import ClientId
from gateway.limits import RequestLimits
from gateway.protocol import ChatMessage
from gateway.work_pool import WorkPool

T = TypeVar("T")

# GIL-bound work (templates) gains nothing from more threads; the tokenizer's Rust code does.
NUM_WORKERS = max(2, min(4, os.cpu_count() or 1))
MAX_WAITING = 256  # tasks queued in all: a normal request spends a millisecond or two here
MAX_WAITING_PER_CLIENT = 64


class ModelTokenizer:
    def __init__(self, model_path: Path, limits: RequestLimits | None = None) -> None:
        if not (model_path / "tokenizer.json").is_file():
            raise ValueError(
                f"{model_path} has no tokenizer.json; the gateway needs a fast tokenizer from the model folder"
            )
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_path))
        self.chat_template = ChatTemplate(self.tokenizer)
        self.limits = limits or RequestLimits()
        config = json.loads((model_path / "config.json").read_text()) if (model_path / "config.json").is_file() else {}
        # The model's own limit, used until instances report theirs (they may be configured lower).
        self.config_max_model_len: int | None = config.get("max_position_embeddings")
        self.pool = WorkPool("tokenizer", NUM_WORKERS, MAX_WAITING, MAX_WAITING_PER_CLIENT)

    async def encode(
        self, text: str, *, client: ClientId, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        self.limits.check_prompt_chars(text, param)
        return await self.run(partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens), client)

    async def encode_chat(
        self,
        messages: list[ChatMessage],
        *,
        client: ClientId,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation through the model's chat template, as token ids."""
        render = self.chat_template.render_call(
            messages, add_generation_prompt, continue_final_message, template_kwargs
        )
        timeout_s = self.limits.chat_template_timeout_s
        try:
            text = await self.pool.run(client, render, timeout_s)
        except TimeoutError:
            raise bad_request(
                f"rendering the chat template took over {timeout_s} s (--chat-template-timeout); shorten the "
                "conversation",
                param="messages",
            ) from None
        self.limits.check_prompt_chars(text, "messages")
        # The rendered text carries the template's special tokens: add none.
        return await self.run(partial(self.tokenizer.encode, text, add_special_tokens=False), client)

    async def decode(self, token_ids: list[int], *, client: ClientId, skip_special_tokens: bool = True) -> str:
        return await self.run(
            partial(self.tokenizer.decode, token_ids, skip_special_tokens=skip_special_tokens), client
        )

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (as vLLM shows them: decoded, not the raw vocab entry)."""
        return self.tokenizer.decode([token_id])

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Raises APIError 400 naming the first ids outside the vocabulary."""
        vocab_size = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab_size}); got {bad[:5]}", param=param)

    def close(self) -> None:
        """Stop the worker threads once the work they hold is done; queued work is dropped."""
        self.pool.close()

    async def run(self, work: Callable[[], T], client: ClientId) -> T:
        """``work`` (which cannot stop early) on the pool, for ``client``."""
        return await self.pool.run(client, _unstoppable(work))


def _unstoppable(work: Callable[[], T]) -> Callable[[threading.Event], T]:
    return lambda stop: work()
