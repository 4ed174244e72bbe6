"""The instances the gateway knows, their latest load reports, and how it picks
one: the best ranked (``gateway.routing``: by load, or by load and cached prefix) among
the healthy ones within the instance limits (``gateway.instance_limits``), never pairing a
prefill and a decode instance whose KV fingerprints differ; equally ranked ones in this
gateway's own order (``gateway.tie_break``), so that several gateways do not herd.

Discovery (``gateway.discovery``) keeps the reports fresh; the dispatcher
reports RPC failures here so a dead instance is skipped at once rather than
after its reports go stale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import grpc

from cluster.background import BackgroundTasks
from cluster.draft_pairing import drafts_pair
from cluster.internal_grpc import InternalPlane
from gateway.call_mux import CallMux
from gateway.flags import Routing
from gateway.instance_limits import InstanceLimits, Overloaded, estimated_wait_s, retry_after_s
from gateway.prefix_index import DEFAULT_MAX_BLOCKS, PrefixIndex, PromptBlocks
from gateway.registry_state import RegistryState
from gateway.routing import (
    WAITING_WEIGHT,
    decode_cost,
    num_hit_tokens,
    num_new_blocks,
    prefill_costs_s,
    prefill_estimate,
)
from gateway.tie_break import GatewaySlot
from splitserve.v1 import disaggregation_pb2

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")
# A rate to divide queued prompt tokens by when no candidate has measured one yet.
_UNMEASURED_PREFILL_TOKENS_PER_S = 1000.0
# A prefill rate not measured again for this long counts as unknown to kv routing (_routing_rates).
RATE_STALE_S = 30.0
CHANNEL_CLOSE_GRACE_S = 30.0
# gRPC backs off up to minutes between reconnects by default; an instance that comes
# (back) up should be routable within a poll or two.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(slots=True, eq=False)
class InstanceState:
    address: str  # gRPC host:port
    role: Role
    channel: grpc.aio.Channel
    report: disaggregation_pb2.LoadReport | None = None
    serving: bool = False  # the instance's own health status
    reported_at: float = 0.0  # monotonic time the latest report arrived
    failed_at: float | None = None  # monotonic time an RPC to it last failed
    # Requests sent since the latest report, which it cannot show yet; without this
    # a burst between two polls would all go to the same instance.
    num_dispatched: int = 0
    num_dispatched_tokens: int = 0  # their prompt tokens (with kv routing: those its prefix cache lacks)
    charged_tokens: int = 0  # what the latest pick added to num_dispatched_tokens; :meth:`call` takes it back
    num_inflight: int = 0  # calls from this gateway outstanding on it now
    num_picked: int = 0  # requests routed here since the gateway started
    # Dispatches whose first token came back since the latest report: running there now (a
    # stream still decodes), which that report cannot show either.
    num_started: int = 0
    num_reports: int = 0  # reports recorded so far: which dispatches the latest one can show
    # Monotonic time its reported prefill rate last changed: every step that computes prompt
    # tokens moves it, so an unchanged rate is one measured that long ago.
    rate_measured_at: float = 0.0
    # This gateway process's call stream to it (gateway/call_mux.py), opened by the first call.
    _call_mux: CallMux | None = field(default=None, repr=False)

    @property
    def call_mux(self) -> CallMux:
        if self._call_mux is None:
            self._call_mux = CallMux(self.channel, self.address)
        return self._call_mux

    @contextmanager
    def call(self, num_prompt_tokens: int | None = None) -> Iterator[Callable[[], None]]:
        """Count one call from this gateway as outstanding while the block runs; enter it right
        after the pick that dispatched it (no await between): ``num_prompt_tokens`` defaults to
        what that pick charged. The block gets ``mark_running``, to call once the
        instance answers (a streamed call's first response: a prefill's first token, or a decode
        stream's); from then on, or from
        the block's end, the dispatch no longer counts as queued work but as running (until the
        block's end or the next report). Without this a finished prompt would count as queued
        until the next report (a poll interval) and hold off the instance limits and routing for nothing,
        and a stream that started would count as nothing at all."""
        if num_prompt_tokens is None:
            num_prompt_tokens = self.charged_tokens
        num_reports = self.num_reports
        settled = started = False

        def mark_running() -> None:
            nonlocal settled, started
            if settled:
                return
            settled = True
            if self.num_reports == num_reports:  # no report since has taken the dispatch over
                self.num_dispatched = max(0, self.num_dispatched - 1)
                self.num_dispatched_tokens = max(0, self.num_dispatched_tokens - num_prompt_tokens)
                self.num_started += 1
                started = True

        self.num_inflight += 1
        try:
            yield mark_running
        finally:
            self.num_inflight -= 1
            if not settled:
                mark_running()
            if started and self.num_reports == num_reports:  # over before a report could show it running
                self.num_started = max(0, self.num_started - 1)

    @property
    def healthy_report(self) -> disaggregation_pb2.LoadReport:
        """The latest load report of an instance routed to (healthy ones always have one)."""
        if self.report is None:
            raise RuntimeError(f"bug: {self.role} instance {self.address} was routed to before it reported")
        return self.report

    @property
    def instance_id(self) -> str:
        return self.report.instance_id if self.report is not None and self.report.instance_id else self.address

    @property
    def score(self) -> int:
        if self.report is None:
            return WAITING_WEIGHT * self.num_dispatched
        return (
            WAITING_WEIGHT * (self.report.num_waiting + self.num_dispatched)
            + self.report.num_running
            + self.num_started
        )

    def unhealthy_reason(self, now: float, stale_after_s: float) -> str | None:
        """Why it is not routed to now (for the log), or None when it is healthy."""
        if self.report is None:
            return "no load report yet"
        if not self.serving:
            return "not serving (its health or registration says so, or its last poll failed)"
        age_s = now - self.reported_at
        if age_s > stale_after_s:
            return f"its latest load report is {age_s:.1f} s old (--stale-after {stale_after_s:g})"
        # A channel whose last connection attempt failed fails every call at once until its
        # reconnect backoff (up to a second) has passed, even once the instance is back: an
        # instance restarted at the same address registers before this gateway's channel has
        # reconnected to it. It becomes routable again when the channel tries again by itself.
        if self.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            return "its channel is reconnecting"
        # After a failed RPC, only a report that arrived later proves it is back.
        if self.failed_at is not None and self.reported_at <= self.failed_at:
            return f"a call to it failed {now - self.failed_at:.1f} s ago, with no load report since"
        return None

    def is_healthy(self, now: float, stale_after_s: float) -> bool:
        return self.unhealthy_reason(now, stale_after_s) is None


@dataclass
class InstancePool:
    stale_after_s: float
    limits: InstanceLimits = field(default_factory=InstanceLimits)
    routing: Routing = "load"  # gateway.routing
    index: PrefixIndex = field(default_factory=PrefixIndex)  # filled by gateway.kv_events with kv routing
    plane: InternalPlane = field(default_factory=InternalPlane)  # the cluster secret and TLS of every channel
    instances: dict[str, InstanceState] = field(default_factory=dict)  # by address
    registry: RegistryState | None = None  # with Redis discovery: its reachability and refused records
    slot: GatewaySlot = field(default_factory=GatewaySlot)  # this gateway's tie order (gateway.tie_break)
    # Streaming calls ride one stream per instance (gateway/call_mux.py); False: a call each.
    multiplex_calls: bool = True
    _closing: BackgroundTasks = field(default_factory=BackgroundTasks)  # channels of removed instances

    def add(self, address: str, role: Role) -> InstanceState:
        state = self.instances.get(address)
        if state is None or state.role != role:
            if state is not None:
                self._close(state)
                self.index.forget(address)
            state = self.instances[address] = InstanceState(
                address, role, self.plane.channel(address, options=_CHANNEL_OPTIONS)
            )
            logger.info("%s instance %s added", role, address)
        return state

    def remove(self, address: str) -> None:
        state = self.instances.pop(address, None)
        if state is not None:
            logger.info("%s instance %s removed", state.role, address)
            self._close(state)
            self.index.forget(address)

    def record_report(self, address: str, report: disaggregation_pb2.LoadReport, serving: bool) -> None:
        """``serving``: the instance's health (or registration) says so. An instance whose engine
        has died is not serving whatever its health says."""
        state = self.instances.get(address)
        if state is None:
            return
        if report.engine_error:
            if state.report is None or not state.report.engine_error:  # said once, not at every poll
                logger.error(
                    "%s instance %s (%s) has lost its engine (%s); routing nothing to it",
                    state.role,
                    address,
                    report.instance_id,
                    report.engine_error,
                )
            serving = False
        now = time.monotonic()
        was_healthy = state.is_healthy(now, self.stale_after_s)
        if state.report is None or report.prefill_tokens_per_s != state.report.prefill_tokens_per_s:
            state.rate_measured_at = now
        state.report, state.serving, state.reported_at = report, serving, now
        state.num_dispatched = state.num_dispatched_tokens = state.num_started = 0
        state.num_reports += 1
        if not was_healthy and state.is_healthy(now, self.stale_after_s):
            logger.info("%s instance %s (%s) is healthy", state.role, address, report.instance_id)

    def record_unreachable(self, address: str) -> None:
        state = self.instances.get(address)
        if state is not None and state.serving:
            logger.warning("%s instance %s is unreachable", state.role, address)
            state.serving = False

    def record_failure(self, state: InstanceState) -> None:
        """An RPC to this instance failed as if it were down: skip it until it reports again."""
        logger.warning("%s instance %s failed a request; skipping it until it reports again", state.role, state.address)
        state.failed_at = time.monotonic()

    def healthy(self, role: Role) -> list[InstanceState]:
        now = time.monotonic()
        return [s for s in self.instances.values() if s.role == role and s.is_healthy(now, self.stale_after_s)]

    def pick(
        self,
        role: Role,
        exclude: Iterable[InstanceState] = (),
        fingerprint: disaggregation_pb2.Fingerprint | None = None,
        num_prompt_tokens: int = 0,
        prefer: InstanceState | None = None,
        prompt: PromptBlocks | None = None,
    ) -> InstanceState | None:
        """The best-ranked healthy instance of a role within the instance limits, optionally
        KV-compatible with a fingerprint; ``prefer`` wins when it qualifies (its prefix cache
        holds the prompt). ``prompt``: the request's blocks, for kv routing. None when there
        is no candidate at all; :class:`Overloaded` when every candidate is over a limit."""
        excluded = {id(s) for s in exclude}
        candidates = [
            s
            for s in self.healthy(role)
            if id(s) not in excluded
            and (fingerprint is None or kv_compatible(s.healthy_report.fingerprint, fingerprint))
        ]
        return self._within_limits(role, candidates, num_prompt_tokens, prefer, prompt=prompt)

    def pick_prefill(
        self,
        exclude: Iterable[InstanceState] = (),
        num_prompt_tokens: int = 0,
        prefer: InstanceState | None = None,
        exempt: bool = False,
        prompt: PromptBlocks | None = None,
    ) -> InstanceState | None:
        """As :meth:`pick`, among the prefill instances some healthy decode instance can pair with.
        ``exempt``: the request got past the limits before (a re-prefill): no limit refuses it now."""
        excluded = {id(s) for s in exclude}
        candidates = [s for s in self._pairable_prefills() if id(s) not in excluded]
        return self._within_limits("prefill", candidates, num_prompt_tokens, prefer, exempt, prompt)

    def _within_limits(
        self,
        role: Role,
        candidates: list[InstanceState],
        num_prompt_tokens: int,
        prefer: InstanceState | None,
        exempt: bool = False,
        prompt: PromptBlocks | None = None,
    ) -> InstanceState | None:
        """Limits apply where a request enters, at its prefill (P or colocated); a request
        past that point is served, whatever the decode instances' load."""
        if not candidates:
            return None
        limits = InstanceLimits() if exempt or role == "decode" else self.limits
        admissible: list[InstanceState] = []
        excess_waits: list[float] = []
        for state in candidates:
            if limits.max_inflight_per_instance is not None and state.num_inflight >= limits.max_inflight_per_instance:
                continue
            if limits.max_queue_delay_s is not None:
                wait_s = estimated_wait_s(state.report, state.num_dispatched_tokens)
                if wait_s > limits.max_queue_delay_s:
                    excess_waits.append(wait_s - limits.max_queue_delay_s)
                    continue
            admissible.append(state)
        if not admissible:
            if excess_waits:
                raise Overloaded(
                    f"every {role} instance has more than --max-queue-delay {limits.max_queue_delay_s:g} s of prompts "
                    "queued",
                    retry_after_s(min(excess_waits)),
                )
            raise Overloaded(
                f"every {role} instance has --max-inflight-per-instance {limits.max_inflight_per_instance} calls "
                "outstanding",
                1,
            )
        kv_prompt = prompt if self.routing == "kv" else None  # routed by its cached prefix
        # Each candidate's cached prefix of the prompt, in blocks (kv routing only).
        hits = (
            {id(s): self.index.num_hit_blocks(s.address, kv_prompt) for s in admissible}
            if kv_prompt is not None
            else {}
        )
        # Equally ranked instances go in this gateway's own order, so that gateways do not herd.
        tie = self.slot.tie_order((s.instance_id, s.address) for s in self.instances.values() if s.role == role)
        if prefer in admissible:
            chosen = prefer
        elif kv_prompt is not None:
            costs = dict(
                zip(
                    (id(s) for s in admissible),
                    self._kv_costs(role, admissible, num_prompt_tokens, kv_prompt, hits),
                    strict=True,
                )
            )
            chosen = min(admissible, key=lambda s: (costs[id(s)], s.score, tie[s.address]))
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "kv routing of a %d-token prompt to a %s instance: %s",
                    num_prompt_tokens,
                    role,
                    ", ".join(
                        f"{s.address} cost {costs[id(s)]:.3g} hit {hits[id(s)]}{' (chosen)' if s is chosen else ''}"
                        for s in admissible
                    ),
                )
        else:
            chosen = min(admissible, key=lambda s: (s.score, tie[s.address]))
        charge = num_prompt_tokens
        if role == "decode":
            charge = 0  # decode instances queue no prompt tokens
        elif kv_prompt is not None:
            hit_tokens = {
                id(s): num_hit_tokens(hits[id(s)], self._block_size(s), num_prompt_tokens) for s in admissible
            }
            kv_prompt.expected_hit_tokens = hit_tokens[id(chosen)]
            kv_prompt.passed_over_tokens = max(hit_tokens.values()) - kv_prompt.expected_hit_tokens
            charge = num_prompt_tokens - kv_prompt.expected_hit_tokens
        chosen.num_dispatched += 1
        chosen.num_picked += 1
        chosen.num_dispatched_tokens += charge
        chosen.charged_tokens = charge
        if kv_prompt is not None:
            self.index.predict(chosen.address, kv_prompt, self._max_blocks(chosen))
        return chosen

    def _kv_costs(
        self,
        role: Role,
        candidates: list[InstanceState],
        num_prompt_tokens: int,
        prompt: PromptBlocks,
        hits: dict[int, int],
    ) -> list[float]:
        """``gateway.routing``'s cost of sending the prompt to each candidate (lower is better),
        given the blocks of it each one holds (``hits``, by ``id``)."""
        if role == "decode":
            return [
                decode_cost(
                    s.healthy_report.num_waiting + s.num_dispatched,
                    s.healthy_report.num_running + s.num_started,
                    num_new_blocks(num_prompt_tokens, hits[id(s)], self._block_size(s)),
                    s.healthy_report.num_free_blocks,
                )
                for s in candidates
            ]
        rates = _routing_rates(candidates, time.monotonic())
        measured = [rate for rate in rates.values() if rate > 0]
        fallback_rate = sum(measured) / len(measured) if measured else _UNMEASURED_PREFILL_TOKENS_PER_S
        estimates = []
        for state in candidates:
            report, block_size, num_hit_blocks = state.healthy_report, self._block_size(state), hits[id(state)]
            num_new = num_new_blocks(num_prompt_tokens, num_hit_blocks, block_size)
            num_evicted = self.index.eviction_cost_blocks(state.address, prompt, num_new, report.num_total_blocks)
            estimates.append(
                prefill_estimate(
                    report.num_pending_prefill_tokens + state.num_dispatched_tokens,
                    rates[id(state)],
                    num_prompt_tokens - num_hit_tokens(num_hit_blocks, block_size, num_prompt_tokens),
                    num_evicted * block_size,
                    fallback_rate,
                )
            )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "prefill estimates (s): %s",
                ", ".join(
                    f"{s.address} wait {e.wait_s:.2f} compute {e.compute_s:.2f} eviction {e.eviction_s:.2f} "
                    f"at {rates[id(s)] or fallback_rate:.0f} tokens/s"
                    for s, e in zip(candidates, estimates, strict=True)
                ),
            )
        return prefill_costs_s(estimates)

    def _num_hit_tokens(self, state: InstanceState, num_prompt_tokens: int, prompt: PromptBlocks) -> int:
        return num_hit_tokens(
            self.index.num_hit_blocks(state.address, prompt), self._block_size(state), num_prompt_tokens
        )

    def _block_size(self, state: InstanceState) -> int:
        return self.index.block_size(state.address) or state.healthy_report.fingerprint.block_size or 16

    @staticmethod
    def _max_blocks(state: InstanceState) -> int:
        return (
            state.report.num_total_blocks
            if state.report is not None and state.report.num_total_blocks
            else DEFAULT_MAX_BLOCKS
        )

    def min_decode_uncached_tokens(self, num_prompt_tokens: int, prompt: PromptBlocks) -> int | None:
        """Prompt tokens the healthy decode instance with the longest cached prefix of this prompt
        would still compute (all of them without kv routing); None when no decode instance is healthy."""
        decodes = self.healthy("decode")
        if not decodes:
            return None
        if self.routing != "kv":
            return num_prompt_tokens
        return num_prompt_tokens - max(self._num_hit_tokens(s, num_prompt_tokens, prompt) for s in decodes)

    def is_ready(self) -> bool:
        """Requests can be served: a colocated instance, or a compatible prefill + decode pair."""
        return bool(self.healthy("colocated")) or bool(self._pairable_prefills())

    def unready_reason(self) -> str:
        """Why :meth:`is_ready` is false, instance by instance, for the gateway's log."""
        now = time.monotonic()
        reasons = [
            f"{s.role} {s.instance_id} at {s.address}: {reason}"
            for s in self.instances.values()
            if (reason := s.unhealthy_reason(now, self.stale_after_s)) is not None
        ]
        if not reasons and self.instances:
            reasons.append("no healthy prefill instance shares its KV fingerprint with a healthy decode instance")
        return "; ".join(reasons) or "no instance is known"

    def _pairable_prefills(self) -> list[InstanceState]:
        """The healthy prefill instances whose KV fingerprint some healthy decode instance shares."""
        decode_fingerprints = [s.healthy_report.fingerprint for s in self.healthy("decode")]
        return [
            s
            for s in self.healthy("prefill")
            if any(kv_compatible(s.healthy_report.fingerprint, other) for other in decode_fingerprints)
        ]

    def max_model_len(self) -> int | None:
        """The smallest context any healthy instance accepts (a request must fit wherever it lands)."""
        lengths = [
            report.max_model_len
            for role in ROLES
            for report in (s.healthy_report for s in self.healthy(role))
            if report.max_model_len
        ]
        return min(lengths, default=None)

    async def close(self) -> None:
        for state in self.instances.values():
            await state.channel.close()
        self.instances.clear()

    def _close(self, state: InstanceState) -> None:
        # Requests still streaming over the channel may finish within the grace period.
        self._closing.spawn(state.channel.close(grace=CHANNEL_CLOSE_GRACE_S))


def _routing_rates(candidates: list[InstanceState], now: float) -> dict[int, float]:
    """Each candidate's prefill rate for kv routing (by ``id``), 0 for one to take as the
    measured ones' mean: unmeasured, or measured more than ``RATE_STALE_S`` ago while another
    candidate's rate is recent. An instance that measured itself slow (its start-up prefill
    beside other instances' start-ups, a burst of other work on its core) would otherwise be
    passed over for as long as the others' queues stay short, and never measure again: in a
    benchmark run, a prefill instance whose warm-up had measured 141 tokens/s took no request
    in the first 19, while the other measured 500 and more."""
    fresh = {id(s) for s in candidates if now - s.rate_measured_at <= RATE_STALE_S}
    return {id(s): s.healthy_report.prefill_tokens_per_s if id(s) in fresh or not fresh else 0.0 for s in candidates}


def kv_compatible(a: disaggregation_pb2.Fingerprint, b: disaggregation_pb2.Fingerprint) -> bool:
    """One instance's KV means the same in the other's cache: every fingerprint field equal but
    the tensor-parallel size and the pipeline stages, since a pull maps one split of the KV heads
    and layers onto another; and their drafters pair (cluster/draft_pairing.py). The instances'
    own check: kv_connector/fingerprint.py."""
    return _kv_identity(a) == _kv_identity(b) and drafts_pair(a.draft, b.draft)


def _kv_identity(fingerprint: disaggregation_pb2.Fingerprint) -> disaggregation_pb2.Fingerprint:
    identity = disaggregation_pb2.Fingerprint()
    identity.CopyFrom(fingerprint)
    identity.ClearField("tensor_parallel_size")
    identity.ClearField("stage_first_layers")
    identity.ClearField("draft")
    return identity
