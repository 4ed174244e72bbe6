"""What the kernel says a process has used, read from /proc without touching the process:
CPU time (``stat``: utime + stime, every thread) and resident memory (``status``: VmRSS).
Its network bytes are ``bench/socket_bytes.py``'s (``io``'s rchar and wchar miss gRPC's
sendmsg/recvmsg).

A benchmark samples a group of processes at the start and end of a window and divides the
difference by the window's seconds (:func:`group_rates`). Linux only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One process at one moment (the counters are totals since it started)."""

    cpu_s: float  # utime + stime, every thread
    rss_bytes: int


def sample(pid: int) -> ProcSample:
    """Read a live process's counters; raises OSError when it is gone."""
    proc = Path(f"/proc/{pid}")
    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    rss_kib = next(
        int(line.split()[1]) for line in (proc / "status").read_text().splitlines() if line.startswith("VmRSS:")
    )
    return ProcSample(cpu_s, rss_kib * 1024)


def tree_cpu_s(pid: int) -> float:
    """utime + stime so far, seconds, of a process and every live process below it (a parent
    that runs its work in children, as the gateway's ``--api-server-count`` does)."""
    parents: dict[int, list[int]] = {}
    cpu_s: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        child = int(stat.parent.name)
        parents.setdefault(int(fields[1]), []).append(child)
        cpu_s[child] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    total, frontier = 0.0, [pid]
    while frontier:
        current = frontier.pop()
        total += cpu_s.get(current, 0.0)
        frontier += parents.get(current, [])
    return total


@dataclass(frozen=True, slots=True)
class GroupRates:
    """A group of processes over a window, summed over its processes."""

    num_processes: int
    cpu_cores: float  # CPU seconds per second
    rss_bytes: int  # at the window's end


def group_rates(before: list[ProcSample], after: list[ProcSample], seconds: float) -> GroupRates:
    """The group's rates between two samples of the same processes, in the same order."""
    if len(before) != len(after) or seconds <= 0:
        raise ValueError(f"{len(before)} samples before and {len(after)} after over {seconds} s: a bug in the caller")
    return GroupRates(
        num_processes=len(after),
        cpu_cores=sum(b.cpu_s - a.cpu_s for a, b in zip(before, after)) / seconds,
        rss_bytes=sum(b.rss_bytes for b in after),
    )
