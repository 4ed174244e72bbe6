"""When things happened to one request inside an engine, as plain numbers.

The engine records these (``time.monotonic()`` seconds, this process's clock) and nothing
else: it never imports a tracing or metrics library. The serving layer turns them into the
phases of the request's time to first token and into trace spans
(``serving/request_timing.py``), after the engine has handed the request's output over.

Who writes what, in a request's order (a field stays None when its moment never came):

1. ``EngineCore.add_request`` (engine thread): the record, with ``added_at``.
2. ``Scheduler`` admitting it from the waiting queue: ``first_scheduled_at``, the first time
   (a preempted request keeps its first one). A hand-off (decode role) is admitted without
   computing: ``kv_load_started_at`` when its blocks are allocated and its load starts, and
   ``kv_loaded_at`` when the scheduler polls the load's end at a step boundary.
3. ``EngineCore.step``: each prompt (or recompute) chunk the request computed in a step, and
   the step that sampled its first token here (``first_token_step_started_at``,
   ``first_token_at``, the step's start and end). Every output of a step carries that step's
   :class:`StepStats`.

The event loop reads a request's record once its output has come through
``AsyncEngine.generate``; by then the engine thread has written every field the output
depends on (it writes them before it hands the output over).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PromptChunk:
    """One engine step's share of a request's prompt (or of its recompute)."""

    started_at: float  # the step's model execution, monotonic seconds
    ended_at: float
    num_tokens: int  # prompt tokens of this request the step computed
    num_batched_tokens: int  # tokens the whole step computed, every request's


@dataclass(frozen=True, slots=True)
class StepStats:
    """One engine step that ran the model: when, and what made it long or short (the outputs
    of its requests carry it, so a slow token can be explained)."""

    started_at: float  # its model execution, monotonic seconds
    ended_at: float
    num_rows: int  # requests it computed
    num_decodes: int  # of them, one-token decodes (drafts verified included)
    num_prefill_tokens: int  # prompt and recompute tokens it computed, every request's
    num_preempted: int  # requests it sent back to wait for lack of blocks
    num_loads_finished: int  # hand-offs whose KV load the scheduler took in just before it


@dataclass(slots=True)
class RequestTiming:
    """A request's moments in this engine, ``time.monotonic()`` seconds; None until they happen."""

    added_at: float
    first_scheduled_at: float | None = None
    kv_load_started_at: float | None = None  # decode role: blocks allocated, load started
    kv_loaded_at: float | None = None  # decode role: the load's end, as the scheduler polled it
    prompt_chunks: list[PromptChunk] = field(default_factory=list)
    first_token_step_started_at: float | None = None
    first_token_at: float | None = None  # the end of the step that sampled the first token here
