"""The gateway's tokenizer: prompts and chat templates to token ids, ids to text.

Only the gateway (and the offline ``engine.LLM``) hold a tokenizer; prefill and
decode instances speak token ids. Loaded as ``PreTrainedTokenizerFast`` because
``AutoTokenizer`` imports torch, which the gateway never needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from gateway.errors import bad_request
from gateway.protocol import ChatMessage


class ModelTokenizer:
    def __init__(self, model_path: Path) -> None:
        if not (model_path / "tokenizer.json").is_file():
            raise ValueError(f"{model_path} has no tokenizer.json; the gateway needs a fast tokenizer from the model folder")
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_path))
        config = json.loads((model_path / "config.json").read_text()) if (model_path / "config.json").is_file() else {}
        # The model's own limit, used until instances report theirs (they may be configured lower).
        self.config_max_model_len: int | None = config.get("max_position_embeddings")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation through the model's chat template, as token ids."""
        if self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message")
        try:
            encoded = self.tokenizer.apply_chat_template(
                [_message_dict(m, i) for i, m in enumerate(messages)],
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                return_dict=True,
                **(template_kwargs or {}),
            )
        except ValueError as error:  # transformers' own checks, e.g. continue_final_message without one
            raise bad_request(f"cannot apply the chat template: {error}", param="messages") from error
        return list(encoded["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

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


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates expect it: content as one string."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{index}] has a {part.type!r} content part; this server accepts text parts only",
                    param=f"messages.{index}.content",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    return result
