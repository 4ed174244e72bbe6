"""What the scheduler decided for one step, and what the model produced for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import Request
from engine.sampler import TokenLogprobs

if TYPE_CHECKING:
    from engine.flat_batch import FlatBatch


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes, starting at request.num_computed_tokens
    block_ids: list[int]  # every block the request holds, in order
    samples: bool  # this step reaches the end of the request's known tokens, so it samples the next one
    # Speculative decoding: of num_new_tokens, how many are drafts (request.spec_token_ids[:n])
    # verified after the request's last token; 0 for a plain decode or prefill.
    num_draft_tokens: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes (one new token) first, then decodes verifying drafts, then prefills and chunks of prefills.
    scheduled: list[ScheduledRequest]
    num_decodes: int
    num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    num_spec_decodes: int = 0  # requests verifying drafts, right after the plain decodes
    num_spec_tokens: int = 0  # their tokens: one last token plus the drafts each

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelOutput:
    """One sampled token (and its logprobs) per scheduled request that samples, in schedule order.

    With speculative decoding that token is the bonus (all drafts accepted) or recovered one,
    and ``accepted_token_ids[i]`` lists the drafts accepted before it (None: no request verified
    drafts this step). ``draft_token_ids[i]``: drafts proposed for request i's next step from
    this step's hidden states (Medusa heads; None: the drafter proposes before scheduling)."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    accepted_token_ids: list[list[int]] | None = None
    accepted_logprobs: list[list[TokenLogprobs | None]] | None = None
    draft_token_ids: list[list[int]] | None = None


@dataclass(frozen=True, slots=True)
class PendingStep:
    """A scheduled batch the model runner has started (``ModelRunner.dispatch``) and not yet
    completed: under pipeline parallelism ``batch`` is the flat batch the stages are computing;
    None where the whole step runs at completion."""

    output: SchedulerOutput
    batch: FlatBatch | None = None
