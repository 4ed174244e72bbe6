"""Reusable staging buffers for KV transfers.

A transfer stages its chunks in a small ring of equal buffers on each side. Fresh
memory costs a page fault per 4 KiB page on first touch, which made staging a whole
request in a new tensor cost more than the wire itself (8192 tokens of SmolLM2: 110 ms
of faults beside 83 ms of transfer). Buffers here are touched once when made and then
reused.

Ownership: :meth:`StagingPool.acquire` hands buffers to one transfer, which gives them
back with :meth:`StagingPool.release` once no transport operation can touch them any
more. A transfer that fails or is cancelled while the transport may still read or
write a buffer never gives it back: it is dropped (freed when the transport lets go of
it), so no later transfer can see its bytes change under it.
"""

from __future__ import annotations

import torch


class StagingPool:
    """Buffers of ``slot_bytes`` bytes (uint8, on ``device``), at most ``max_idle`` kept between transfers."""

    def __init__(self, slot_bytes: int, device: torch.device, max_idle: int) -> None:
        if slot_bytes < 1 or max_idle < 0:
            raise ValueError(f"slot_bytes must be >= 1 and max_idle >= 0, got {slot_bytes} and {max_idle}")
        self.slot_bytes = slot_bytes
        self.device = device
        self.max_idle = max_idle
        self._idle: list[torch.Tensor] = []

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def reserve(self, count: int) -> None:
        """Make buffers now (so the first transfer does not pay their page faults), up to ``max_idle``."""
        while len(self._idle) < min(count, self.max_idle):
            self._idle.append(self._new_slot())

    def acquire(self, count: int) -> list[torch.Tensor]:
        """``count`` buffers for one transfer: idle ones first, then new ones."""
        taken = [self._idle.pop() for _ in range(min(count, len(self._idle)))]
        return taken + [self._new_slot() for _ in range(count - len(taken))]

    def release(self, slots: list[torch.Tensor]) -> None:
        """Take back buffers no transport operation uses any more; beyond ``max_idle`` they are freed."""
        for slot in slots:
            if len(self._idle) < self.max_idle:
                self._idle.append(slot)

    def _new_slot(self) -> torch.Tensor:
        slot = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
        slot.fill_(0)  # touch every page now rather than in the middle of a transfer
        return slot
