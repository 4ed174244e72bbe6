"""How a gateway tells a KV-event subscription whose instance is quiet (its prefix cache did
not change) from one whose instance went silent (a host gone without a FIN or RST: a dead NIC,
a partition; or a stuck process): the gateway asks for a heartbeat, an empty message the
instance writes after ``heartbeat_s`` without a batch (``KVEventsRequest.heartbeat_ms``,
``serving/kv_event_stream.py``), and ends a stream on which nothing came for ``silence_s``
(``gateway/kv_events.py``). Light (no gRPC): ``gateway/flags.py`` takes its defaults."""

from __future__ import annotations

from dataclasses import dataclass

# A heartbeat costs each instance a write of a few bytes per gateway process and interval;
# three missed ones end the stream.
DEFAULT_HEARTBEAT_S = 5.0  # --kv-event-heartbeat
DEFAULT_SILENCE_S = 15.0  # --kv-event-silence


@dataclass(frozen=True, slots=True)
class KVEventLiveness:
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    silence_s: float = DEFAULT_SILENCE_S

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0 or self.silence_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"--kv-event-silence ({self.silence_s} s) must be at least twice --kv-event-heartbeat "
                f"({self.heartbeat_s} s, which must be positive): one late heartbeat would end a live stream"
            )

    @property
    def heartbeat_ms(self) -> int:
        """As the request carries it."""
        return max(1, round(self.heartbeat_s * 1000))
