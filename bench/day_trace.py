"""A day of traffic compressed into a run: when each request arrives and how long its prompt
and output are.

- **Rate**: ``trough + (peak - trough) * (1 - cos(2 pi x)) / 2`` at the day's fraction ``x``:
  the night's trough at both ends, the peak at noon, ``peak / trough`` apart (10x by default).
  Arrivals are a Poisson process of that varying rate (thinning: candidates at the peak rate,
  each kept with probability ``rate / peak``).
- **Mix**: a request is long-prompt with probability ``long_share * sin(pi x) ** 2`` and chatty
  otherwise: chatty at night, mostly long prompts at noon, chatty again at the end. Lengths
  vary uniformly by a quarter around each kind's means.

Seeded: the same arguments give the same trace, for every way a benchmark replays it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Arrival:
    offset_s: float  # from the start of the run
    prompt_tokens: int
    output_tokens: int
    long_prompt: bool


@dataclass(frozen=True, slots=True)
class RequestKind:
    prompt_tokens: int
    output_tokens: int


CHATTY = RequestKind(prompt_tokens=128, output_tokens=256)
LONG_PROMPT = RequestKind(prompt_tokens=2048, output_tokens=128)
LENGTH_SPREAD = 0.25


def rate_at(x: float, peak_rate: float, trough_rate: float) -> float:
    """Requests a second at the day's fraction ``x`` in [0, 1]."""
    return trough_rate + (peak_rate - trough_rate) * (1 - math.cos(2 * math.pi * x)) / 2


def long_share_at(x: float, long_share: float) -> float:
    return long_share * math.sin(math.pi * x) ** 2


def day_trace(
    duration_s: float,
    peak_rate: float,
    trough_ratio: float = 0.1,
    long_share: float = 0.7,
    chatty: RequestKind = CHATTY,
    long_prompt: RequestKind = LONG_PROMPT,
    seed: int = 0,
) -> list[Arrival]:
    """The day's requests over ``duration_s`` seconds, in arrival order."""
    if duration_s <= 0 or peak_rate <= 0 or not 0 < trough_ratio <= 1 or not 0 <= long_share <= 1:
        raise ValueError(
            "a day trace needs duration_s > 0, peak_rate > 0, 0 < trough_ratio <= 1 and 0 <= long_share <= 1; "
            f"got {duration_s}, {peak_rate}, {trough_ratio}, {long_share}"
        )
    rng = np.random.default_rng(seed)
    trough_rate = peak_rate * trough_ratio
    arrivals: list[Arrival] = []
    offset = 0.0
    while True:
        offset += float(rng.exponential(1 / peak_rate))
        if offset >= duration_s:
            return arrivals
        x = offset / duration_s
        if rng.random() >= rate_at(x, peak_rate, trough_rate) / peak_rate:
            continue
        is_long = bool(rng.random() < long_share_at(x, long_share))
        kind = long_prompt if is_long else chatty
        spread = rng.uniform(1 - LENGTH_SPREAD, 1 + LENGTH_SPREAD, size=2)
        arrivals.append(
            Arrival(
                offset,
                max(1, round(kind.prompt_tokens * spread[0])),
                max(1, round(kind.output_tokens * spread[1])),
                is_long,
            )
        )


def windows_of(arrivals: list[Arrival], duration_s: float, window_s: float) -> list[list[Arrival]]:
    """The arrivals in each window of ``window_s`` seconds (the last may be shorter)."""
    windows: list[list[Arrival]] = [[] for _ in range(max(1, math.ceil(duration_s / window_s)))]
    for arrival in arrivals:
        windows[min(len(windows) - 1, int(arrival.offset_s // window_s))].append(arrival)
    return windows
