"""Speculative decoding over one benchmark run, from the server's own counts: the acceptance
rate at each draft position and the accepted-length distribution, what decides whether a
drafter's depth pays.

A client cannot see drafts: a token streamed is a token, however it was produced. A splitserve
gateway exports every instance's counts (``splitserve_instance_spec_*``, one series per draft
position or accepted length, cluster/instance_counters.py); ``bench serve`` scrapes them once
before its measured requests and once after, each time once they have settled
(:func:`settled_scrape`), and reports the difference summed over the instances, so warm-ups
and earlier traffic do not count. A server without these series (another server, or no
speculation configured) gets no such section. Counts of an instance that restarted
during the run would go backwards: the run's figures are then withheld rather than wrong.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

_PREFIX = "splitserve_instance_spec_"
# Series name (without prefix and _total) -> the label that indexes it.
_SERIES = {
    "draft_tokens_per_pos": "position",
    "accepted_tokens_per_pos": "position",
    "verifications_by_accepted": "accepted",
}


@dataclass(slots=True)
class SpecDecodeCounts:
    """The cluster's counts at one scrape, summed over instances, by index."""

    draft_tokens_per_pos: Counter[int] = field(default_factory=Counter)
    accepted_tokens_per_pos: Counter[int] = field(default_factory=Counter)
    verifications_by_accepted: Counter[int] = field(default_factory=Counter)

    @classmethod
    def parse(cls, metrics_text: str) -> SpecDecodeCounts:
        counts = cls()
        for family in text_string_to_metric_families(metrics_text):
            name = family.name.removeprefix(_PREFIX)
            if not family.name.startswith(_PREFIX) or name not in _SERIES:
                continue
            by_index: Counter[int] = getattr(counts, name)
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    by_index[int(sample.labels[_SERIES[name]])] += round(sample.value)
        return counts


async def scrape(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> SpecDecodeCounts | None:
    """The gateway's counts now; None where the server exports none (or no /metrics)."""
    try:
        async with session.get(f"{base_url}/metrics", headers=headers) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError) as error:
        logger.info("no speculative-decoding counts: GET /metrics failed (%s)", error)
        return None
    if _PREFIX not in text:
        return None
    return SpecDecodeCounts.parse(text)


# A gateway learns its instances' counts from the load reports it polls (``--poll-interval``,
# 0.5 s by default): two scrapes this far apart that agree have seen every step taken so far.
SETTLE_S = 1.0
SETTLE_MAX_S = 15.0  # a server that keeps drafting (other traffic) is read as it is by then


async def settled_scrape(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> SpecDecodeCounts | None:
    """The gateway's counts once the steps of requests that have just ended are in them: scraped
    again every ``SETTLE_S`` until two scrapes agree (bounded by ``SETTLE_MAX_S``). Read the moment
    the last response ends, the counts miss the steps of the last poll interval, all of a short
    run's."""
    counts = await scrape(session, base_url, headers)
    deadline = asyncio.get_running_loop().time() + SETTLE_MAX_S
    while counts is not None and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(SETTLE_S)
        again = await scrape(session, base_url, headers)
        if again == counts:
            break
        counts = again
    return counts


def over_run(before: SpecDecodeCounts | None, after: SpecDecodeCounts | None) -> dict[str, Any] | None:
    """The run's figures (result JSON's ``spec_decode``): drafts and accepted tokens, acceptance
    rate overall and per position, mean accepted length and the accepted-length counts; None
    when the server drafted nothing during the run or its counts cannot be compared."""
    if before is None or after is None:
        return None
    drafts = after.draft_tokens_per_pos - before.draft_tokens_per_pos
    accepted = after.accepted_tokens_per_pos - before.accepted_tokens_per_pos
    lengths = after.verifications_by_accepted - before.verifications_by_accepted
    went_back = any(
        after_counts[i] < before_counts[i]
        for before_counts, after_counts in (
            (before.draft_tokens_per_pos, after.draft_tokens_per_pos),
            (before.accepted_tokens_per_pos, after.accepted_tokens_per_pos),
            (before.verifications_by_accepted, after.verifications_by_accepted),
        )
        for i in before_counts
    )
    if went_back:
        logger.warning(
            "speculative-decoding counts went backwards during the run (an instance restarted): not reported"
        )
        return None
    num_drafts, num_accepted = sum(drafts.values()), sum(accepted.values())
    if not num_drafts:
        return None
    num_verifications = sum(lengths.values())
    positions = range(max(drafts) + 1)
    return {
        "num_draft_tokens": num_drafts,
        "num_accepted_tokens": num_accepted,
        "acceptance_rate": num_accepted / num_drafts,
        "acceptance_rate_per_position": [accepted[i] / drafts[i] if drafts[i] else None for i in positions],
        "mean_accepted_length": num_accepted / num_verifications if num_verifications else None,
        "verifications_by_accepted": [lengths[n] for n in range(max(lengths, default=-1) + 1)],
    }
