"""What following the instances' KV events (``gateway/kv_events.py``) costs and how it goes,
counted where the messages land: batches and their bytes received by stream (pushed down a
``WatchKVEvents`` subscription) or by poll (``GetKVEvents``: a resync, first contact, or an
instance that refuses subscriptions), heartbeats, and streams ended for their silence.
Exported on the gateway's ``/metrics`` (``gateway/metrics.py``); ``bench.cluster_scale``
reads them there, as the instances cannot count what they push."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from splitserve.v1 import disaggregation_pb2

Via = Literal["stream", "poll"]
VIAS: tuple[Via, ...] = ("stream", "poll")


@dataclass(slots=True)
class KVEventTraffic:
    """Event-loop only (the followers and the scrape share the gateway's loop): no lock."""

    num_messages: dict[Via, int] = field(default_factory=lambda: dict.fromkeys(VIAS, 0))
    num_bytes: dict[Via, int] = field(default_factory=lambda: dict.fromkeys(VIAS, 0))  # serialized, as sent
    num_heartbeats: int = 0  # empty messages an idle stream sent
    num_silent_streams: int = 0  # streams ended for hearing nothing, not even a heartbeat

    def received(self, via: Via, events: disaggregation_pb2.KVEvents) -> None:
        """A batch (a resync marker and a snapshot's page each count as one) other than a heartbeat."""
        self.num_messages[via] += 1
        self.num_bytes[via] += events.ByteSize()


class KVEventTrafficCollector(Collector):
    def __init__(self, traffic: KVEventTraffic) -> None:
        self.traffic = traffic

    def collect(self) -> Iterator[CounterMetricFamily]:
        traffic = self.traffic
        messages = CounterMetricFamily(
            "splitserve_kv_event_messages",
            "KV-event batches received from instances: pushed down a subscription (via=stream) or read by a "
            "GetKVEvents call (via=poll: resyncs, first contact, instances that refuse subscriptions); "
            "heartbeats left out",
            labels=["via"],
        )
        sizes = CounterMetricFamily(
            "splitserve_kv_event_message_bytes",
            "Serialized bytes of the KV-event batches received, by the same via (gRPC and HTTP/2 framing left out)",
            labels=["via"],
        )
        for via in VIAS:
            messages.add_metric([via], traffic.num_messages[via])
            sizes.add_metric([via], traffic.num_bytes[via])
        yield messages
        yield sizes
        yield CounterMetricFamily(
            "splitserve_kv_event_heartbeats",
            "Empty messages received on KV-event subscriptions that had nothing to push (--kv-event-heartbeat)",
            value=traffic.num_heartbeats,
        )
        yield CounterMetricFamily(
            "splitserve_kv_event_silent_streams",
            "KV-event subscriptions ended because nothing, not even a heartbeat, came for --kv-event-silence; "
            "each is followed by a resync from the gateway's cursor",
            value=traffic.num_silent_streams,
        )
