"""What the engine hands back: the shape users know from vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request_timing import RequestTiming, StepStats
from engine.sampler import TokenLogprobs

if TYPE_CHECKING:  # the EAGLE modules are loaded only where a draft is
    from engine.spec_decode.prompt_draft_kv import PromptDraftKV


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class KVHandoff:
    """Prefill role: where the prompt's KV sits, pinned, for a decode instance to pull."""

    block_ids: list[int]
    num_tokens: int  # prompt tokens whose KV the blocks hold
    # Medusa, EAGLE: the drafts proposed after the first token, so that the decode instance
    # verifies drafts from its first step (it has no hidden state of its own yet).
    draft_token_ids: list[int] = field(default_factory=list)
    # EAGLE: the draft's KV over the prompt, for the decode instance's draft to attend over
    # (engine/spec_decode/prompt_draft_kv.py); the KV connector carries it beside the blocks.
    prompt_draft_kv: PromptDraftKV | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class EngineCoreOutput:
    """Tokens-in, tokens-out: what one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running or when handed off
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_handoff: KVHandoff | None = None
    error: str | None = None  # finish reason "error": why (decode role: the prompt's KV could not be loaded)
    # The engine refused the request when it came to add it (what add_request's ValueError
    # said, e.g. its id is still held by a pinned prefill): nothing ran, nothing is held.
    refusal: str | None = None
    # The request's moments in the engine so far (engine/request_timing.py): the engine's own
    # record, shared by every output of the request, not a copy.
    timing: RequestTiming | None = None
    step: StepStats | None = None  # the step that produced it; None for an output between steps (an abort)
    # Speculative decoding: the request's drafts verified so far, and those accepted.
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.kv_handoff is not None or self.refusal is not None
