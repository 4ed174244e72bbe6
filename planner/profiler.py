"""Measuring what one prefill and one decode instance sustain within the SLOs, through a
gateway that routes to one instance of each role (``splitserve profile``, ``planner/profile_cli.py``).

Every request has the same mix: ``prompt_tokens`` random token ids (a prompt of its own, so
that no prefix cache serves it) and ``output_tokens`` tokens out, EOS ignored.

- **Prefill**: open-loop Poisson arrivals at a rate, each request asking for one token, so the
  request ends at prefill and the decode instance is not in the measurement; its TTFT is the
  one the gateway timed, where it sends it (:func:`gateway_ttft`), over the level's requests
  after the first :data:`WARMUP_SHARE` (sent into an empty queue). The first rate is
  half what prompts one at a time say (one over a lone prompt's TTFT); the rate doubles while
  the TTFT p90 stays within the SLO, then the last rate that met it and the first that did not
  are bisected ``refine_steps`` times. The capacity is the largest rate that met it.
- **Decode**: a closed loop of ``n`` streams, each worker starting its next stream when its last
  one ends, for ``seconds_per_level``; the inter-token gaps count from the moment every worker's
  first stream has its first token (before that, fewer than ``n`` streams share the steps). The
  gaps are the gateway's own (its chunk write times, ``bench/token_gaps.py``) where it sends
  them, so the client's scheduling is not in them. ``n`` doubles from 1 while the ITL p90 stays
  within the SLO, then is bisected to one stream. The rate is priced from the largest ``n`` as
  ``planner/capacity.py`` prices it: a Poisson number of streams of mean ``L`` fits in ``n``
  nine steps in ten, and by Little's law the rate is ``L`` over a stream's measured duration.

Each level is its own set of requests; nothing carries over but what the instances hold.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import numpy as np

from bench.arrivals import arrival_offsets
from bench.client import RequestRecord, fetch_model, request_headers, send_request
from planner.capacity import InstanceCapacity, Slo, poisson_mean_within
from planner.capacity_profile import CapacityProfile, DecodePoint, PrefillPoint

logger = logging.getLogger(__name__)

# A level's first requests find the queue empty: their TTFTs are not the steady state's, and
# counting them reads the tail low. This share of each level's requests is sent, not counted.
WARMUP_SHARE = 0.25
NUM_PROBES = 3  # prompts one at a time, for the first rate of the prefill sweep
TOKEN_ID_RANGE = (1000, 20000)  # ordinary vocabulary entries of any tokenizer the model may have


@dataclass(frozen=True, slots=True)
class SweepConfig:
    base_url: str
    slo: Slo
    prompt_tokens: int = 512
    output_tokens: int = 128
    seconds_per_level: float = 20.0
    min_requests_per_level: int = 20  # a prefill level's p90 over fewer would be one request's
    refine_steps: int = 3
    max_streams: int = 256
    max_levels: int = 12  # per sweep: a bound on its time whatever the instance does
    api_key: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 2:
            raise ValueError("--prompt-tokens must be >= 1 and --output-tokens >= 2 (a gap needs two tokens)")
        if self.seconds_per_level <= 0:
            raise ValueError(f"--seconds-per-level must be > 0; got {self.seconds_per_level}")


def p90(values: list[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None


class Profiler:
    """One sweep of each role through one gateway; :meth:`run` returns the profile."""

    def __init__(self, config: SweepConfig, source: str) -> None:
        self.config = config
        self.source = source
        self._rng = np.random.default_rng(config.seed)
        self._headers = request_headers(config.api_key)
        self._model = ""
        self._started_at = time.perf_counter()

    async def run(self) -> CapacityProfile:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self._model = (await fetch_model(session, self.config.base_url, self._headers)).model_id
            prefill_sweep = await self._prefill_sweep(session)
            decode_sweep = await self._decode_sweep(session)
        prefill_rate = max((p.request_rate for p in prefill_sweep if p.met), default=0.0)
        best = max((p for p in decode_sweep if p.met), key=lambda p: p.num_streams, default=None)
        decode_rate = 0.0
        if best is not None and best.itl_mean_s:
            stream_s = self.config.output_tokens * best.itl_mean_s
            decode_rate = poisson_mean_within(best.num_streams) / stream_s
        return CapacityProfile(
            source=self.source,
            slo=self.config.slo,
            prompt_tokens=self.config.prompt_tokens,
            output_tokens=self.config.output_tokens,
            capacity=InstanceCapacity(prefill_rate, decode_rate, best.num_streams if best else 0),
            prefill_sweep=tuple(prefill_sweep),
            decode_sweep=tuple(decode_sweep),
        )

    async def _send(self, session: aiohttp.ClientSession, max_tokens: int) -> RequestRecord:
        low, high = TOKEN_ID_RANGE
        prompt = self._rng.integers(low, high, size=self.config.prompt_tokens).tolist()
        payload = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        record = RequestRecord(prompt_len=self.config.prompt_tokens, output_len=max_tokens)
        url = f"{self.config.base_url}/v1/completions"
        return await send_request(session, url, self._headers, payload, record, self._started_at)

    # -- prefill ---------------------------------------------------------------------------

    async def _prefill_sweep(self, session: aiohttp.ClientSession) -> list[PrefillPoint]:
        probes = [await self._send(session, 1) for _ in range(NUM_PROBES)]
        ttfts = [ttft for ttft in map(gateway_ttft, probes) if ttft is not None]
        if len(ttfts) < len(probes):
            raise ValueError(f"the gateway at {self.config.base_url} failed a request: {_first_error(probes)}")
        alone_s = float(np.median(ttfts))
        if alone_s > self.config.slo.ttft_s:
            logger.warning("profile: one prompt alone takes %.3f s, over the TTFT SLO: prefill capacity 0", alone_s)
            return []
        points: list[PrefillPoint] = []

        async def level(rate: float) -> bool:
            points.append(await self._prefill_level(session, rate, len(points)))
            return points[-1].met

        await search(level, 0.5 / alone_s, self.config.refine_steps, self.config.max_levels, integer=False)
        return points

    async def _prefill_level(self, session: aiohttp.ClientSession, rate: float, index: int) -> PrefillPoint:
        num_requests = max(self.config.min_requests_per_level, math.ceil(rate * self.config.seconds_per_level))
        offsets = arrival_offsets(num_requests, rate, seed=self.config.seed + index)
        started = time.perf_counter()

        async def at(offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            return await self._send(session, 1)

        records = await asyncio.gather(*(at(offset) for offset in offsets))  # in the order sent
        all_ttfts = [gateway_ttft(record) for record in records]
        num_failed = all_ttfts.count(None)
        ttfts = [ttft for ttft in all_ttfts[int(WARMUP_SHARE * len(records)) :] if ttft is not None]
        if num_failed:
            logger.warning(
                "profile: %d requests failed at %.3f req/s, the first: %s", num_failed, rate, _first_error(records)
            )
        ttft_p90 = p90(ttfts)
        met = num_failed == 0 and ttft_p90 is not None and ttft_p90 <= self.config.slo.ttft_s
        logger.info(
            "profile: prefill at %.3f req/s: TTFT p90 %s s (%s)", rate, _fmt(ttft_p90), "met" if met else "missed"
        )
        return PrefillPoint(rate, len(records), num_failed, ttft_p90, met)

    # -- decode ----------------------------------------------------------------------------

    async def _decode_sweep(self, session: aiohttp.ClientSession) -> list[DecodePoint]:
        points: list[DecodePoint] = []

        async def level(num_streams: float) -> bool:
            points.append(await self._decode_level(session, int(num_streams)))
            return points[-1].met

        await search(
            level, 1, self.config.refine_steps, self.config.max_levels, integer=True, high=self.config.max_streams
        )
        return points

    async def _decode_level(self, session: aiohttp.ClientSession, num_streams: int) -> DecodePoint:
        deadline = time.perf_counter() + self.config.seconds_per_level
        records: list[RequestRecord] = []

        async def worker() -> None:
            while True:
                record = await self._send(session, self.config.output_tokens)
                records.append(record)
                if record.error is not None or time.perf_counter() >= deadline:
                    return

        await asyncio.gather(*(worker() for _ in range(num_streams)))
        # Every worker's first stream is among the first num_streams records to start.
        by_start = sorted(records, key=lambda r: r.start_time)
        first_tokens = [r.start_time + r.ttft for r in by_start[:num_streams] if r.ttft is not None]
        steady_from = max(first_tokens, default=math.inf)
        gaps: list[float] = []
        for record in records:
            if record.error is not None or record.ttft is None:
                continue
            gaps += steady_gaps(record, steady_from)
        num_failed = sum(1 for r in records if r.error is not None)
        if num_failed:
            logger.warning(
                "profile: %d streams failed of %d, the first: %s", num_failed, num_streams, _first_error(records)
            )
        itl_p90 = p90(gaps)
        itl_mean = float(np.mean(gaps)) if gaps else None
        met = num_failed == 0 and itl_p90 is not None and itl_p90 <= self.config.slo.itl_s
        logger.info(
            "profile: decode with %d streams: ITL p90 %s s, mean %s s over %d gaps (%s)",
            num_streams,
            _fmt(itl_p90),
            _fmt(itl_mean),
            len(gaps),
            "met" if met else "missed",
        )
        return DecodePoint(num_streams, len(gaps), num_failed, itl_p90, itl_mean, met)


def gateway_ttft(record: RequestRecord) -> float | None:
    """The TTFT the gateway timed (its ``x-splitserve-timing`` header), else the client's. A
    request of one token whose token has no text of its own (a byte of a longer character)
    streams no content, and the client counts it failed; the gateway still timed its token."""
    if record.server_timing is not None and "ttft" in record.server_timing:
        return record.server_timing["ttft"]
    return record.ttft if record.error is None else None


def steady_gaps(record: RequestRecord, steady_from: float) -> list[float]:
    """``record``'s inter-token gaps that end at or after ``steady_from`` (seconds from the
    run's start, as ``record.start_time``): the gateway's own where it sent them."""
    if record.ttft is None:
        return []
    gaps = record.server_itl if record.server_itl is not None else record.itl
    ends = record.start_time + record.ttft + np.cumsum(record.itl)
    return [gap for gap, end in zip(gaps, ends.tolist(), strict=True) if end >= steady_from]


async def search(
    level: Callable[[float], Awaitable[bool]],
    start: float,
    refine_steps: int,
    max_levels: int,
    *,
    integer: bool,
    high: float = math.inf,
) -> None:
    """Find the largest load ``level`` meets, calling it at most ``max_levels`` times: from
    ``start``, double while it meets (halve while it misses, if the first misses), then bisect
    between the last load met and the first missed ``refine_steps`` times (an integer load:
    until they are one apart)."""
    met_at: float | None = None
    missed_at: float | None = None
    load = start
    num_levels = 0
    # Bracket: a load met and one missed.
    while num_levels < max_levels and (met_at is None or missed_at is None):
        num_levels += 1
        if await level(load):
            met_at = load
            load = min(load * 2, high)
            if load == met_at:
                return  # met at the highest load asked for
        else:
            missed_at = load
            load = math.floor(load / 2) if integer else load / 2
            if met_at is None and load < (1 if integer else start / 64):
                return  # nothing met: the capacity is 0
    num_refined = 0
    while met_at is not None and missed_at is not None and num_levels < max_levels:
        middle = (met_at + missed_at) / 2
        if integer:
            middle = math.floor(middle)
            if middle <= met_at:
                return
        elif num_refined >= refine_steps:
            return
        num_levels += 1
        num_refined += 1
        if await level(middle):
            met_at = middle
        else:
            missed_at = middle


def _first_error(records: list[RequestRecord]) -> str | None:
    return next((r.error for r in records if r.error is not None), None)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
