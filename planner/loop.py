"""The planner's loop: every interval, in order,

1. scrape the gateways' metrics (``planner/observations.py``) and take the interval since the
   last scrape;
2. bring its instances' states up to date: a starting one every gateway routes to is ready
   (scale-up counts from readiness, not from the process's start); a draining one every
   gateway shows idle is stopped (``planner/actuator.py``); one that exited by itself is gone;
3. feed the observed request rate to the predictor and size for its forecast of the next
   interval, not for the rate just observed (one interval's count is noisy: the larger of the
   two would follow every upward blip; and a trend extrapolated over an instance's start-up,
   tried, turned that noise into pools started and stopped again before they were ready), at
   the mean prompt and output lengths of recent traffic; an SLO the metrics show missed
   corrects what the forecast misses (``planner/decision.py``);
4. price one instance of each role for that mix (``planner/capacity.py``, corrected by a
   measured profile if it has one, ``planner/capacity_profile.py``) and decide
   (``planner/decision.py``), counting starting and ready instances as the pool so that a
   start under way is not started twice;
5. act: start instances; or, to shrink, stop starting instances no gateway lists yet (they
   hold nothing), and drain ready ones, the least busy first, only while none of the role is
   starting (the pool never dips below what serves now); a decode instance drains by handing
   its streams over to the rest of the pool unless ``--decode-drain wait``; log the decision
   and its reasons and set the metrics (``planner/metrics.py``).

The loop runs on one thread and is the only writer of the actuator's instances and of the
cooldowns.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from launcher.stop_signals import StopSignal
from planner.actuator import DecodeDrain, LocalActuator, ManagedInstance
from planner.capacity import InstanceCapacity, Slo, Workload
from planner.capacity_profile import CapacityProfile, calibrated_capacity
from planner.decision import ROLES, Cooldowns, Decision, Observed, PlannerBounds, Role, decide
from planner.kubernetes_scaler import KubernetesScaler
from planner.metrics import PlannerMetrics
from planner.observations import GatewayScraper, Observation, Scrape, observe
from planner.predictors import make_predictor
from simulator.timing_model import TimingProfile

logger = logging.getLogger(__name__)

LENGTH_WEIGHT = 0.5  # each interval's mean lengths weigh this much against those before
DRAIN_TIMEOUT_S = 600.0  # a draining instance that never shows idle is stopped after this


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    profile: TimingProfile  # what the instances run, at their time scale (capacity.scaled_profile)
    slo: Slo
    bounds: PlannerBounds
    interval_s: float = 5.0
    predictor: str = "moving-average"
    initial_instances: dict[Role, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    prompt_tokens: float = 512.0  # the mix assumed before traffic says otherwise
    output_tokens: float = 128.0
    # A measured profile that corrects the timing model's capacity (planner/capacity_profile.py).
    measured: CapacityProfile | None = None
    decode_drain: DecodeDrain = "hand-over"  # how a decode instance scaled down drains (planner/actuator.py)


@dataclass(frozen=True, slots=True)
class Tick:
    """One interval's decision and what it was made from (for logs, tests and the benchmark)."""

    at: float
    observation: Observation
    workload: Workload
    capacity: InstanceCapacity
    decision: Decision
    ready: dict[Role, int]


class Planner:
    """``actuator`` None: publish only (``--actuator metrics``). The desired counts go out as
    metrics for KEDA or an HPA to scale Deployments by, and each role's pool is what was last
    published: an instance asked for counts from then on, as a started one does here, so that
    the count asked for never falls back while its pods start (a scale-down asked of Kubernetes
    is carried out by its pods' preStop drain, deploy/kubernetes-autoscaling/). With a
    ``scaler`` too (``--actuator kubernetes``) the planner sets the Deployments' replicas
    itself, each time a role's count changes; the pool before its first decision is then the
    Deployment's replicas."""

    def __init__(
        self,
        config: PlannerConfig,
        scraper: GatewayScraper,
        actuator: LocalActuator | None,
        metrics: PlannerMetrics,
        scaler: KubernetesScaler | None = None,
    ) -> None:
        self.config = config
        self.scraper = scraper
        self.actuator = actuator
        self.metrics = metrics
        self.cooldowns = Cooldowns()
        self._predictor = make_predictor(config.predictor)
        self._prompt_tokens = config.prompt_tokens
        self._output_tokens = config.output_tokens
        self._last_scrape: Scrape | None = None
        self._published: dict[Role, int] = {}  # publish only: the desired counts last published
        self.scaler = scaler
        self._scaled: dict[Role, int] = {}  # with a scaler: the replicas it last set
        # Every tick's decision, appended by the loop's thread; others only read it (a list's
        # append is atomic), as the benchmark and the tests do.
        self.history: list[Tick] = []

    def start_initial(self) -> None:
        if self.actuator is None:
            return  # the Deployments' own replicas are the initial pools
        for role in ROLES:
            bounds = self.config.bounds.of(role)
            wanted = min(max(self.config.initial_instances.get(role, 1), bounds.min_instances), bounds.max_instances)
            for _ in range(wanted):
                self.actuator.start(role)

    def run(self, stop: threading.Event | StopSignal) -> None:
        """Tick every interval until ``stop``; then stop every instance it started."""
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    tick = self.tick()
                    if tick is not None:
                        self.history.append(tick)
                except OSError as error:  # urllib's errors are OSErrors
                    logger.warning("planner: a gateway's metrics could not be read (%s); trying next interval", error)
                stop.wait(max(0.0, self.config.interval_s - (time.monotonic() - started)))
        finally:
            if self.actuator is not None:
                self.actuator.stop_all()

    def tick(self) -> Tick | None:
        """One interval (module docstring); None for the first scrape, which has no interval."""
        scrape = self.scraper.scrape()
        last, self._last_scrape = self._last_scrape, scrape
        if last is None:
            return None
        observation = observe(last, scrape)
        self._update_instances(observation)
        workload = self._workload(observation)
        capacity = calibrated_capacity(self.config.profile, workload, self.config.slo, self.config.measured)
        ready = {role: self._ready(role, observation) for role in ROLES}
        pool = {role: self._pool_size(role, ready[role]) for role in ROLES}
        starting = {role: ready[role] < pool[role] for role in ROLES}
        if self.actuator is not None:
            starting = {role: any(i.state == "starting" for i in self.actuator.live(role)) for role in ROLES}
        # An SLO missed while the role's new instance starts is that start's to fix, not one more's.
        observed = Observed(
            pool["prefill"],
            pool["decode"],
            None if starting["prefill"] else observation.ttft_p90_s,
            None if starting["decode"] else observation.itl_p90_s,
        )
        now = time.monotonic()
        decision = decide(workload, capacity, self.config.slo, observed, self.config.bounds, self.cooldowns, now)
        for role in ROLES:
            # The cooldown runs from a change made, not from one deferred (a drain waits for starts).
            desired = decision.of(role).desired
            if self.actuator is None:
                if self.scaler is not None and self._scaled.get(role) != desired:
                    # An API error raises OSError: the loop logs it and the next interval tries again.
                    self.scaler.scale(role, desired)
                    self._scaled[role] = desired
                    logger.info("planner: %s Deployment scaled to %d", role, desired)
                self._published[role] = desired
                if desired != pool[role]:
                    self.cooldowns.changed_at[role] = now
            elif desired != pool[role] and self._resize(role, desired, observation):
                self.cooldowns.changed_at[role] = now
        ready = {role: self._ready(role, observation) for role in ROLES}
        self._report(observation, workload, capacity, decision, pool, ready)
        return Tick(now, observation, workload, capacity, decision, ready)

    def _pool(self, role: Role) -> list[ManagedInstance]:
        if self.actuator is None:
            return []
        return [i for i in self.actuator.live(role) if i.state in ("starting", "ready")]

    def _ready(self, role: Role, observation: Observation) -> int:
        """Ready instances of ``role``: those started here that every gateway routes to; when
        publishing only, every instance of the role that every gateway routes to."""
        if self.actuator is not None:
            return sum(1 for i in self.actuator.live(role) if i.state == "ready")
        return sum(1 for view in observation.instances.values() if view.role == role and view.healthy)

    def _pool_size(self, role: Role, ready: int) -> int:
        if self.actuator is not None:
            return len(self._pool(role))
        if role not in self._published and self.scaler is not None:
            self._published[role] = self._scaled[role] = self.scaler.replicas(role)
        # Before its first decision, the pool the Deployment runs now (its minimum while none is up).
        return self._published.get(role, max(ready, self.config.bounds.of(role).min_instances))

    def _update_instances(self, observation: Observation) -> None:
        if self.actuator is None:
            return
        self.actuator.reap_exited()
        now = time.monotonic()
        for instance in self.actuator.live():
            view = observation.instances.get(instance.instance_id)
            if instance.state == "starting" and view is not None and view.healthy:
                self.actuator.mark_ready(instance)
            elif instance.state == "draining":
                drain_s = now - (instance.drain_started_at or now)
                if view is not None and view.idle:
                    self.actuator.stop(instance)
                elif drain_s > DRAIN_TIMEOUT_S:
                    logger.error(
                        "%s has drained for %.0f s and is still not idle; stopping it", instance.instance_id, drain_s
                    )
                    self.actuator.stop(instance)

    def _workload(self, observation: Observation) -> Workload:
        self._predictor.observe(observation.request_rate)
        predicted = self._predictor.predict()
        if observation.prompt_tokens is not None:
            self._prompt_tokens += LENGTH_WEIGHT * (observation.prompt_tokens - self._prompt_tokens)
        if observation.output_tokens is not None:
            self._output_tokens += LENGTH_WEIGHT * (observation.output_tokens - self._output_tokens)
        rate = observation.request_rate if predicted is None else predicted
        return Workload(rate, max(1.0, self._prompt_tokens), max(1.0, self._output_tokens))

    def _resize(self, role: Role, desired: int, observation: Observation) -> bool:
        """Start or stop instances towards ``desired``; whether it changed anything."""
        if self.actuator is None:
            raise RuntimeError("bug: resizing with no actuator; publishing only never resizes")
        pool = self._pool(role)
        if desired > len(pool):
            for _ in range(desired - len(pool)):
                self.actuator.start(role)
            return True
        excess = len(pool) - desired
        # A starting instance no gateway has listed yet holds nothing: stopping it is free.
        unseen = [i for i in pool if i.state == "starting" and i.instance_id not in observation.instances]
        for instance in unseen[::-1][:excess]:
            self.actuator.stop(instance)
            excess -= 1
        changed = excess < len(pool) - desired
        # Never drain a ready instance while others start: the pool would dip below what it
        # serves now. Once they are ready a later interval drains the excess, if any is left.
        if excess == 0 or any(i.state == "starting" for i in self._pool(role)):
            return changed
        ready = [i for i in pool if i.state == "ready"]

        def busy(instance: ManagedInstance) -> int:
            view = observation.instances.get(instance.instance_id)
            return view.num_running + view.num_waiting if view is not None else 0

        # The least busy first, so the drain ends soonest (and, handing over, moves the fewest streams).
        hand_over = role == "decode" and self.config.decode_drain == "hand-over"
        for instance in sorted(ready, key=busy)[:excess]:
            self.actuator.drain(instance, hand_over=hand_over)
        return True

    def _report(
        self,
        observation: Observation,
        workload: Workload,
        capacity: InstanceCapacity,
        decision: Decision,
        pool: dict[Role, int],
        ready: dict[Role, int],
    ) -> None:
        states: dict[tuple[str, str], int] = {}
        if self.actuator is None:
            for role in ROLES:
                states[(role, "ready")] = ready[role]
                states[(role, "starting")] = max(0, self._published[role] - ready[role])
        for instance in self.actuator.live() if self.actuator is not None else []:
            states[(instance.role, instance.state)] = states.get((instance.role, instance.state), 0) + 1
        self.metrics.record(
            decision,
            workload,
            observation.request_rate,
            capacity,
            states,
            observation.ttft_p90_s,
            observation.itl_p90_s,
            self.config.slo,
        )
        logger.info(
            "planner: %.2f req/s observed, sizing for %.2f (prompt %.0f, output %.0f tokens); one instance takes "
            "prefill %.2f, decode %.2f req/s; prefill %d -> %d (%s, needs %d), decode %d -> %d (%s, needs %d); "
            "TTFT p90 %s / %.3f s, ITL p90 %s / %.3f s",
            observation.request_rate,
            workload.request_rate,
            workload.prompt_tokens,
            workload.output_tokens,
            capacity.prefill_rate,
            capacity.decode_rate,
            pool["prefill"],
            decision.prefill.desired,
            decision.prefill.reason,
            decision.prefill.needed,
            pool["decode"],
            decision.decode.desired,
            decision.decode.reason,
            decision.decode.needed,
            _seconds(observation.ttft_p90_s),
            self.config.slo.ttft_s,
            _seconds(observation.itl_p90_s),
            self.config.slo.itl_s,
        )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
