"""What the scheduler decided for one step, and what the model produced for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.sampler import TokenLogprobs


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes, starting at request.num_computed_tokens
    block_ids: list[int]  # every block the request holds, in order
    samples: bool  # this step reaches the end of the request's known tokens, so it samples the next one


@dataclass(slots=True)
class KVLoad:
    """Decode role: blocks allocated for a prompt whose KV must be pulled from a prefill instance."""

    request_id: str
    block_ids: list[int]  # all of the prompt's blocks, local ids
    num_local_hit_tokens: int  # leading tokens already present from the local prefix cache: not pulled


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes (one new token) first, then prefills and chunks of prefills.
    scheduled: list[ScheduledRequest]
    num_decodes: int
    num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelOutput:
    """One sampled token (and its logprobs) per scheduled request that samples, in schedule order."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
