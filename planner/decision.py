"""How many prefill and decode instances to run: a pure function of the predicted workload,
what one instance of each role sustains (``planner/capacity.py``), the pools as they are, and
the bounds.

In order, for each role:

1. **Needed**: the predicted rate over one instance's capacity, rounded up (at least one).
2. **SLO miss**: when the observed p90 (TTFT for prefill, ITL for decode) is over its SLO and
   the model says the pool is big enough, one more than the pool has: the model is wrong
   about this traffic, and the metrics are the truth.
3. **Hysteresis**: a pool shrinks only to what the predicted rate times ``1 + down_margin``
   needs, so a rate hovering at a boundary does not flap.
4. **Bounds**: ``--min``/``--max`` of the role.
5. **Cooldowns**: a pool grows no sooner than ``up_cooldown_s`` after its last change and
   shrinks no sooner than ``down_cooldown_s`` after it; meanwhile it stays as it is.

Then the **budget**: when both together exceed ``max_total``, each role keeps its minimum and
the rest of the budget goes to the role whose shortfall (needed over given) is the larger, one
instance at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from planner.capacity import InstanceCapacity, Slo, Workload

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
Reason = Literal["steady", "load_up", "load_down", "slo_miss", "cooldown", "min", "max", "budget"]


@dataclass(frozen=True, slots=True)
class RoleBounds:
    min_instances: int
    max_instances: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_instances <= self.max_instances:
            raise ValueError(
                f"a role's bounds need 1 <= --min <= --max; got min {self.min_instances}, max {self.max_instances}"
            )


@dataclass(frozen=True, slots=True)
class PlannerBounds:
    prefill: RoleBounds
    decode: RoleBounds
    max_total: int  # instances of both roles together
    up_cooldown_s: float = 10.0
    down_cooldown_s: float = 60.0
    down_margin: float = 0.2  # shrink only to what 1.2x the predicted rate needs

    def __post_init__(self) -> None:
        if self.max_total < self.prefill.min_instances + self.decode.min_instances:
            raise ValueError(
                f"--max-instances {self.max_total} is below the roles' minimums together "
                f"({self.prefill.min_instances} + {self.decode.min_instances}): raise it or lower a --min"
            )
        if self.up_cooldown_s < 0 or self.down_cooldown_s < 0 or self.down_margin < 0:
            raise ValueError("cooldowns and the scale-down margin must be >= 0")

    def of(self, role: Role) -> RoleBounds:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True, slots=True)
class Observed:
    """What the pools are and how they do, at decision time."""

    prefill_instances: int  # ready (or starting) instances the planner counts as the pool
    decode_instances: int
    ttft_p90_s: float | None = None  # None: no request measured this interval
    itl_p90_s: float | None = None

    def instances(self, role: Role) -> int:
        return self.prefill_instances if role == "prefill" else self.decode_instances


@dataclass(frozen=True, slots=True)
class RoleDecision:
    desired: int
    needed: int  # what the model says the predicted rate needs, before bounds, cooldown and budget
    reason: Reason


@dataclass(frozen=True, slots=True)
class Decision:
    prefill: RoleDecision
    decode: RoleDecision

    def of(self, role: Role) -> RoleDecision:
        return self.prefill if role == "prefill" else self.decode


@dataclass(slots=True)
class Cooldowns:
    """When each role's pool last changed (monotonic seconds); the planner's loop alone writes it."""

    changed_at: dict[Role, float] = field(default_factory=dict)

    def since(self, role: Role, now: float) -> float:
        return now - self.changed_at.get(role, -math.inf)


def instances_needed(rate: float, capacity_per_instance: float) -> int:
    """Instances to carry ``rate`` at ``capacity_per_instance`` each (at least one)."""
    if rate <= 0:
        return 1
    if capacity_per_instance <= 0:
        return 2**31 - 1  # no instance meets the SLO: as many as the bounds allow
    return max(1, math.ceil(rate / capacity_per_instance - 1e-9))


def _role_decision(
    role: Role,
    workload: Workload,
    capacity: float,
    slo_observed_s: float | None,
    slo_target_s: float,
    current: int,
    bounds: RoleBounds,
    since_change_s: float,
    limits: PlannerBounds,
) -> RoleDecision:
    needed = instances_needed(workload.request_rate, capacity)
    reason: Reason = "load_up" if needed > current else "load_down" if needed < current else "steady"
    if slo_observed_s is not None and slo_observed_s > slo_target_s and needed <= current:
        needed, reason = current + 1, "slo_miss"
    desired = needed
    if desired < current:
        # Hysteresis: shrink only as far as a margin above the prediction allows.
        desired = max(desired, instances_needed(workload.request_rate * (1 + limits.down_margin), capacity))
        if desired >= current:
            desired, reason = current, "steady"
    if desired < bounds.min_instances:
        desired, reason = bounds.min_instances, "min"
    elif desired > bounds.max_instances:
        desired, reason = bounds.max_instances, "max"
    if desired > current and since_change_s < limits.up_cooldown_s:
        desired, reason = max(current, bounds.min_instances), "cooldown"
    elif desired < current and since_change_s < limits.down_cooldown_s:
        desired, reason = min(current, bounds.max_instances), "cooldown"
    return RoleDecision(desired, min(needed, 2**31 - 1), reason)


def decide(
    workload: Workload,
    capacity: InstanceCapacity,
    slo: Slo,
    observed: Observed,
    limits: PlannerBounds,
    cooldowns: Cooldowns,
    now: float,
) -> Decision:
    """The pools' desired sizes (module docstring). Pure: ``cooldowns`` is only read."""
    decisions: dict[Role, RoleDecision] = {
        "prefill": _role_decision(
            "prefill",
            workload,
            capacity.prefill_rate,
            observed.ttft_p90_s,
            slo.ttft_s,
            observed.prefill_instances,
            limits.prefill,
            cooldowns.since("prefill", now),
            limits,
        ),
        "decode": _role_decision(
            "decode",
            workload,
            capacity.decode_rate,
            observed.itl_p90_s,
            slo.itl_s,
            observed.decode_instances,
            limits.decode,
            cooldowns.since("decode", now),
            limits,
        ),
    }
    if decisions["prefill"].desired + decisions["decode"].desired > limits.max_total:
        decisions = _within_budget(decisions, limits)
    return Decision(decisions["prefill"], decisions["decode"])


def _within_budget(decisions: dict[Role, RoleDecision], limits: PlannerBounds) -> dict[Role, RoleDecision]:
    """Each role's minimum, then one instance at a time to the role short by the larger share."""
    given = {role: limits.of(role).min_instances for role in ROLES}
    wanted = {role: decisions[role].desired for role in ROLES}
    for _ in range(limits.max_total - sum(given.values())):
        short = [role for role in ROLES if given[role] < wanted[role]]
        if not short:
            break
        role = max(short, key=lambda r: (wanted[r] / given[r], r == "decode"))
        given[role] += 1
    return {
        role: RoleDecision(given[role], decisions[role].needed, "budget")
        if given[role] < wanted[role]
        else decisions[role]
        for role in ROLES
    }
