"""A measured capacity profile: what one instance of each role sustained within the SLOs, as
``splitserve profile`` measured it (``planner/profiler.py``), and how the planner uses it.

The file is the planner's own records as JSON: the :class:`~planner.capacity.Slo` it was
measured at, the mix (mean prompt and output tokens) it was measured with, the
:class:`~planner.capacity.InstanceCapacity` it found, and the sweep's points that show how.

The planner prices capacity with the timing profile's model for whatever mix traffic has
now; a measured profile corrects that model, role by role, by the ratio of the measured
capacity to the model's at the measured mix (:func:`calibrated_capacity`). That is Dynamo's
correction factor taken once from a sweep instead of from live traffic: the model keeps the
shape (how capacity moves with prompt and output lengths), the measurement its level. Capacity
at one SLO says nothing exact about another, so a profile measured at other SLOs is refused.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.capacity import InstanceCapacity, Slo, Workload, instance_capacity
from simulator.timing_model import TimingProfile


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    """One load level of the prefill sweep: an open-loop Poisson rate and what it gave."""

    request_rate: float
    num_requests: int
    num_failed: int
    ttft_p90_s: float | None
    met: bool  # TTFT p90 within the SLO and no request failed


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """One load level of the decode sweep: streams held at once and their inter-token gaps."""

    num_streams: int
    num_gaps: int
    num_failed: int
    itl_p90_s: float | None
    itl_mean_s: float | None
    met: bool  # ITL p90 within the SLO and no stream failed


@dataclass(frozen=True, slots=True)
class CapacityProfile:
    source: str  # what was measured: a gateway's URL, or the simulated instances' timing profile
    slo: Slo
    prompt_tokens: int  # the mix every request of the sweep had
    output_tokens: int
    capacity: InstanceCapacity
    prefill_sweep: tuple[PrefillPoint, ...] = ()
    decode_sweep: tuple[DecodePoint, ...] = ()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")


def load_capacity_profile(path: str | Path) -> CapacityProfile:
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        return CapacityProfile(
            source=data["source"],
            slo=Slo(**data["slo"]),
            prompt_tokens=int(data["prompt_tokens"]),
            output_tokens=int(data["output_tokens"]),
            capacity=InstanceCapacity(**data["capacity"]),
            prefill_sweep=tuple(PrefillPoint(**point) for point in data.get("prefill_sweep", ())),
            decode_sweep=tuple(DecodePoint(**point) for point in data.get("decode_sweep", ())),
        )
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is not a capacity profile ({error}); write one with `splitserve profile --output {path}`"
        ) from error


def check_slo(measured: CapacityProfile, slo: Slo) -> None:
    """Refuse a profile measured at other SLOs than the planner holds (module docstring)."""
    if measured.slo != slo:
        raise ValueError(
            f"the capacity profile was measured at --ttft-slo {measured.slo.ttft_s} --itl-slo {measured.slo.itl_s}, "
            f"the planner holds {slo.ttft_s} and {slo.itl_s}: measure again with `splitserve profile` at these SLOs"
        )


def _ratio(measured: float, modelled: float) -> float:
    # A model that says an instance takes nothing has no level to correct: the measurement is all.
    return measured / modelled if modelled > 0 else 1.0


def calibrated_capacity(
    profile: TimingProfile, workload: Workload, slo: Slo, measured: CapacityProfile | None
) -> InstanceCapacity:
    """One instance's capacity for ``workload``: the timing model's, scaled per role by the
    measured over the modelled capacity at the measured mix (module docstring)."""
    modelled = instance_capacity(profile, workload, slo)
    if measured is None:
        return modelled
    if workload.prompt_tokens == measured.prompt_tokens and workload.output_tokens == measured.output_tokens:
        return measured.capacity
    at_measured = instance_capacity(profile, Workload(0.0, measured.prompt_tokens, measured.output_tokens), slo)
    if at_measured.prefill_rate <= 0 or at_measured.decode_rate <= 0:
        # The model finds the measured mix beyond the SLO though the instance met it: its
        # shape is no guide here, and the measurement is the only figure there is.
        return measured.capacity
    streams = modelled.decode_streams * _ratio(measured.capacity.decode_streams, at_measured.decode_streams)
    return InstanceCapacity(
        modelled.prefill_rate * _ratio(measured.capacity.prefill_rate, at_measured.prefill_rate),
        modelled.decode_rate * _ratio(measured.capacity.decode_rate, at_measured.decode_rate),
        int(streams),
    )
