"""A request as the engine tracks it, from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.kv_cache_utils import BlockHash, BlockHasher, extend_block_hashes
from engine.kv_loader import KVLoadFailurePolicy
from engine.request_timing import RequestTiming
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output.grammar_state import GrammarState

if TYPE_CHECKING:  # the EAGLE modules are loaded only where a draft is
    from engine.spec_decode.prompt_draft_kv import PromptDraftKV


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # decode role: blocks allocated, prompt KV being pulled
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or the context length
    FINISHED_ABORTED = enum.auto()
    FINISHED_PREFILLED = enum.auto()  # prefill role: first token sampled, KV pinned for the decode side
    FINISHED_RELEASED = enum.auto()  # prefill role: its pinned KV released (the decode side has it, or gave up)
    FINISHED_ERROR = enum.auto()  # decode role: the prompt's KV could not be loaded, and the request may not recompute

    @property
    def is_finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI name of why the request ended; None while it runs or continues elsewhere."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against the context length at admission
    eos_token_ids: frozenset[int]
    priority: int = 0  # lower runs first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: bytes = b""
    status: RequestStatus = RequestStatus.WAITING
    # Prompt followed by every sampled token; the scheduler computes KV for a prefix of it.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    # Decode role: how many prompt tokens arrive from a prefill instance instead of being computed,
    # and what to do if they cannot be loaded (engine/kv_loader.py).
    num_external_tokens: int = 0
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    error: str | None = None  # why the request ended with FINISHED_ERROR
    # Set when sampling_params.structured is: the grammar, advanced over every output token.
    grammar: GrammarState | None = None
    # Speculative decoding (engine/spec_decode): drafts the proposer wants verified in the next
    # step, and their ids (n-gram: known before scheduling; a draft model fills them in the runner).
    num_spec_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    # EAGLE, decode role: the draft's KV over the prompt, pulled from the prefill instance with
    # the target's, until the proposer takes it at the request's first step (engine/spec_decode/prompt_draft_kv.py).
    prompt_draft_kv: PromptDraftKV | None = None
    # Draft model: leading tokens whose KV the draft model holds (it computes its own, prompt included).
    num_draft_computed_tokens: int = 0
    # Drafts verified for it so far, and those accepted (its trace shows them).
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # When things happened to it here (engine/request_timing.py), for its phases and trace spans.
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(added_at=time.monotonic()))

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)
        if self.grammar is not None:
            self.grammar.sync(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def update_block_hashes(self, block_size: int, hasher: BlockHasher) -> None:
        """Hash every newly full block of known tokens (prefix caching works on full blocks only)."""
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.cache_salt, hasher)
