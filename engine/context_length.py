"""Whether a request fits the model's context: the one check, and its one message, for the
engine (``EngineCore.validate``) and the gateway (``GenerationService.prepare``), which
refuses with a 400 what an instance would refuse anyway. Torch-free: the gateway imports it."""

from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """A request longer than the context. ``param``: the request field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def resolve_max_tokens(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, max_tokens_param: str = "max_tokens"
) -> int:
    """The request's output budget: ``max_tokens``, or all the context the prompt leaves when
    it is None. Raises ContextLengthExceeded when the prompt leaves no room for one output
    token, or the prompt and ``max_tokens`` together exceed ``max_model_len``.
    ``max_tokens_param``: what the caller's API calls ``max_tokens``, for the message."""
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens (one more is needed for the output); shorten the prompt",
            param="prompt",
        )
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens + max_tokens} "
            f"were requested ({num_prompt_tokens} in the prompt, {max_tokens} for the completion); "
            f"lower {max_tokens_param} or shorten the prompt",
            param=max_tokens_param,
        )
    return max_tokens
