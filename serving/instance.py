"""An engine instance served over gRPC: the engine on its thread, the KV connector,
standard health, the load report, and a drain on SIGTERM. Each role adds its servicer.

The server is the internal plane's (``cluster/internal_grpc.py``): with a cluster secret,
every call but health checks must carry it; with TLS flags, it serves TLS. Health turns
NOT_SERVING, and load reports carry ``engine_error``, once the engine's step loop has
died: the instance stays up so that its state can be read, but takes no new work."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.auth import load_cluster_secret
from cluster.derived_keys import kv_store_key, prefix_cache_key
from cluster.health_watch import BoundedHealthServicer
from cluster.instance_counters import fill_load_report
from cluster.internal_grpc import InternalPlane, add_internal_plane_arguments
from cluster.registration import RegistryHeartbeat
from cluster.startup_heap import freeze_startup_heap
from cluster.store_urls import redact_url
from cluster.tracing import Tracer, add_tracing_arguments, start_tracing
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, EngineRole
from engine.engine_core import EngineCore
from engine.kv_cache_utils import BlockHash
from engine.kv_events import KVEventBatch
from engine.kv_loader import KVLoader
from engine.pipeline_parallel.stages import plan_stages
from engine_args.config import engine_config_from_args
from engine_args.flags import add_device_argument, add_engine_arguments
from kv_connector.base import KVConnector, TransferStats
from kv_connector.fingerprint import Fingerprint, handoff_draft, model_identity
from kv_connector.registry import add_kv_connector_arguments, make_connector
from serving.call_mux import CallMultiplexer, MultiplexedMethod
from serving.convert import fingerprint_to_proto
from serving.kv_event_pages import KVEventPages
from serving.kv_event_stream import KVEventStreamLimits, KVEventStreams
from serving.metrics import MetricsServer, PhaseMetrics
from serving.ranked_connector import RankedConnector, serve_rank_connector
from serving.warmup import warm_up
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, multiplex_pb2_grpc

logger = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0
ENGINE_WATCH_S = 0.5  # how often the server checks that the engine's step loop still runs


def add_instance_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Flags every role takes; the names match compose/ and the gateway's expectations. The
    engine's flags are engine_args/flags.py's, which ``splitserve up`` passes on as declared."""
    add_engine_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind the gRPC server and the KV connector to")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port (0: any free port)")
    parser.add_argument("--advertise-host", default=None, help="host peers should dial (default: --host)")
    add_kv_connector_arguments(parser)
    parser.add_argument("--kv-port", type=int, default=0, help="KV connector port (0: any free port)")
    parser.add_argument("--instance-id", default=None, help="name in load reports (default: random)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-blocks", type=int, default=None, help="override the KV block count")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--registry-url",
        default=os.environ.get("SPLITSERVE_REGISTRY_URL", ""),
        help="redis://HOST:PORT to register in (with a heartbeat) so gateways find this instance",
    )
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=1.0,
        help="seconds between registry heartbeats; an entry expires after three missed ones",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve this instance's Prometheus metrics at http://HOST:PORT/metrics (default: off; 0: any free port)",
    )
    add_internal_plane_arguments(parser)
    add_tracing_arguments(parser)


def engine_config(args: argparse.Namespace, role: EngineRole) -> EngineConfig:
    """The engine flags' settings (engine_args/config.py), with the instance's own flags."""
    return engine_config_from_args(
        args,
        role,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks_override=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        # Keyed by the cluster secret, as the gateway hashes prompts for kv routing (cluster/derived_keys.py).
        prefix_cache_hash_key=prefix_cache_key(load_cluster_secret(args.cluster_secret, args.cluster_secret_file)),
    )


def fingerprint_of(core: EngineCore) -> Fingerprint:
    shape = core.runner.shape
    stages = plan_stages(shape.num_layers, core.config.pipeline_parallel_size, core.config.pipeline_stage_layers)
    spec = core.config.speculative  # the config's: the prefill role's core keeps no speculative method
    return Fingerprint(
        # Weights quantized at load are another model's: their KV is not the float checkpoint's.
        model=model_identity(core.model_path) + (f"+{core.config.quantization}" if core.config.quantization else ""),
        dtype=core.runner.kv_format.fingerprint_dtype,  # the KV cache's: "bfloat16", "int8/f32-token-head", ...
        block_size=core.config.block_size,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tensor_parallel_size=core.config.tensor_parallel_size,
        stage_first_layers=tuple(stage.layers.start for stage in stages),
        # Medusa's, EAGLE's and EAGLE-3's drafts cross the hand-off, on P and D alike; others draft on D alone.
        draft=handoff_draft(spec.method, Path(spec.model or "")) if spec is not None else "",
    )


@dataclass(slots=True)
class TransferCounters:
    """KV pulls this instance made since start (decode); cluster/instance_counters.py names
    the load-report field and the series of each."""

    num_transfers: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def add(self, stats: TransferStats) -> None:
        self.num_transfers += 1
        self.num_bytes += stats.num_bytes
        self.seconds += stats.seconds


@dataclass(slots=True)
class ServiceCounters:
    """What the role's servicer counts since start (the engine counts its preemptions itself);
    servicers add to a field directly. Each field has its entry in cluster/instance_counters.py,
    which the load report and both Prometheus endpoints follow."""

    num_lease_renewals: int = 0  # P
    num_lease_expiries: int = 0  # P
    num_kv_pull_failures: int = 0  # D
    num_kv_recomputes: int = 0  # D
    num_kv_handbacks: int = 0  # D
    num_kv_handles_refused: int = 0  # D: unsigned or altered handles (cluster/handle_signing.py)
    num_local_prefills: int = 0  # D: calls without a KV handle, prefilled here (conditional disaggregation)
    num_handovers: int = 0  # D: streams handed back to their gateways by a drain (SIGUSR2)


@dataclass
class Instance:
    """One prefill, decode or colocated instance: engine, connector (none when colocated) and identity."""

    role: EngineRole
    engine: AsyncEngine
    connector: KVConnector | None  # None in the colocated role: no KV leaves the instance
    fingerprint: Fingerprint
    instance_id: str
    grpc_address: str = ""
    connector_address: str = ""
    # Tensor parallelism: every rank's connector address, rank order (empty at size 1).
    connector_rank_addresses: list[str] = field(default_factory=list)
    transfers: TransferCounters = field(default_factory=TransferCounters)
    counters: ServiceCounters = field(default_factory=ServiceCounters)
    plane: InternalPlane = field(default_factory=InternalPlane)  # the cluster secret and TLS of its gRPC
    tracer: Tracer | None = None  # None: tracing is off (cluster/tracing.py)
    phase_metrics: PhaseMetrics = field(init=False)  # its share of requests' phases (serving/request_timing.py)
    # Set by serve() once a drain that hands streams over (SIGUSR2) has told gateways this
    # instance serves nothing new: from then on the decode servicer ends each call that may
    # hand over, for its gateway to resume elsewhere (decode_svc/server.py).
    handing_over: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.phase_metrics = PhaseMetrics(self.instance_id, self.role)

    @classmethod
    def create(cls, args: argparse.Namespace, role: EngineRole, config: EngineConfig | None = None) -> Instance:
        """Load the model and size the KV cache (blocking); log capacity and fingerprint.
        ``config`` replaces the one built from ``args`` (a role may adjust it first).
        Raises ValueError for a bad cluster secret or TLS flag before loading anything."""
        plane = InternalPlane.from_args(args, args.host)
        config = config or engine_config(args, role)
        ranked = role != "colocated" and config.world_size > 1
        if ranked:
            # Each rank holds its own KV (its heads of its stage's layers) and moves it itself
            # (serving/ranked_connector.py).
            config = dataclasses.replace(config, worker_extension=serve_rank_connector)
        engine = AsyncEngine(config)
        fingerprint = fingerprint_of(engine.core)
        connector: KVConnector | None = None
        if role != "colocated":
            # lmcache: its store keys are tagged under a key derived from the cluster secret (cluster/derived_keys.py).
            lmcache_options = {"remote_url": args.lmcache_url, "store_key": kv_store_key(plane.secret)}
            options: dict[str, Any] = lmcache_options if args.kv_connector == "lmcache" else {}
            # Rank 0's cache holds the last stage's layers.
            stage = {"pipeline_stage": config.pipeline_parallel_size - 1} if config.pipeline_parallel_size > 1 else {}
            connector = make_connector(args.kv_connector, engine.core.runner.kv_cache, fingerprint, options | stage)
            executor = engine.core.runner.tensor_parallel
            if ranked and executor is not None:
                connector = RankedConnector(connector, executor.named_extension_channels, args.kv_connector, options)
        return cls.assemble(args, role, engine, connector, fingerprint, plane)

    @classmethod
    def assemble(
        cls,
        args: argparse.Namespace,
        role: EngineRole,
        engine: AsyncEngine,
        connector: KVConnector | None,
        fingerprint: Fingerprint,
        plane: InternalPlane,
    ) -> Instance:
        """An instance of a built engine and connector (a simulated one's too: simulator/): its
        identity and tracing from ``args``; logs its capacity and fingerprint."""
        instance_id = args.instance_id or f"{role}-{uuid.uuid4().hex[:8]}"
        report = engine.core.load_report()
        logger.info(
            "%s %s: %d KV blocks x %d tokens = %d tokens; fingerprint %s",
            role,
            instance_id,
            report.num_total_blocks,
            fingerprint.block_size,
            report.num_total_blocks * fingerprint.block_size,
            fingerprint,
        )
        tracer = start_tracing(args.otlp_traces_endpoint, f"splitserve-{role}", instance_id)
        return cls(role, engine, connector, fingerprint, instance_id, plane=plane, tracer=tracer)

    @property
    def engine_error(self) -> str:
        """Why the engine's step loop has died; empty while it runs (or before it started)."""
        if self.engine.is_alive or self.engine.error is None:
            return ""
        return f"{type(self.engine.error).__name__}: {self.engine.error}"

    def load_report(self) -> disaggregation_pb2.LoadReport:
        """Identity, load and counters, as gateways (GetLoadReport, registry heartbeats) and
        this instance's own /metrics read them. Answers at once from the engine's latest
        snapshot, never waiting for a step; safe from the metrics server's thread. The load and
        counter fields are filled from the sources cluster/instance_counters.py names."""
        report = disaggregation_pb2.LoadReport(
            instance_id=self.instance_id,
            role=self.role,
            fingerprint=fingerprint_to_proto(self.fingerprint),
            connector=self.connector.name if self.connector is not None else "",
            connector_address=self.connector_address,
            max_model_len=self.engine.core.max_model_len,
            engine_error=self.engine_error,
        )
        fill_load_report(
            report,
            {
                "engine": self.engine.latest_load_report(),
                "service": self.counters,
                "transfers": self.transfers,
                "connector": self.connector,
            },
        )
        return report


class LoadServicer(disaggregation_pb2_grpc.LoadServicer):
    def __init__(self, instance: Instance, stream_limits: KVEventStreamLimits | None = None) -> None:
        self.instance = instance
        self._kv_event_pages: KVEventPages | None = None  # on the first call: the engine's log exists by then
        self.kv_event_streams: KVEventStreams | None = None  # on the first subscription, on the server's loop
        self.stopping = False  # end_streams() was called: no subscription from now on
        self._kv_event_stream_limits = stream_limits or KVEventStreamLimits()

    async def GetLoadReport(self, request, context):  # noqa: N802 - gRPC signature
        return self.instance.load_report()

    async def GetKVEvents(self, request, context):  # noqa: N802 - gRPC signature
        """Prefix-cache changes since the caller's cursor (engine/kv_events.py), a page at most
        (serving/kv_event_pages.py); answers at once (the log has its own lock and never waits
        for an engine step)."""
        if self._kv_event_pages is None:
            self._kv_event_pages = KVEventPages(self.instance.engine.core.kv_events)
        page = self._kv_event_pages.read(request.epoch, request.after_seq, request.snapshot_offset, request.max_hashes)
        message = self._kv_events_message(page.epoch, page.last_seq, page.snapshot, page.stored, page.removed)
        message.snapshot_offset, message.more = page.snapshot_offset, page.more
        return message

    async def WatchKVEvents(self, request, context):  # noqa: N802 - gRPC signature
        """Prefix-cache changes after the caller's cursor, then as engine steps make them
        (serving/kv_event_stream.py), until a resync marker, the stream's lifetime or the
        instance's stop (:meth:`end_streams`)."""
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this instance is stopping")
        if self.kv_event_streams is None:
            self.kv_event_streams = KVEventStreams(
                self.instance.engine.core.kv_events, self._batch_message, self._kv_event_stream_limits
            )
        streams = self.kv_event_streams
        subscriber = streams.subscribe(request.epoch, request.after_seq, request.max_hashes, request.heartbeat_ms)
        if subscriber is None:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this instance serves {streams.limits.max_subscribers} KV event subscriptions at once; poll instead",
            )
            return  # abort raises: never reached
        try:
            async with asyncio.timeout(streams.limits.lifetime_s):
                while (events := await subscriber.get()) is not None:
                    await context.write(events)
                    if events.resync:
                        return
        except TimeoutError:
            return  # the stream's lifetime: it ends OK, and the gateway subscribes again from its cursor
        finally:
            streams.unsubscribe(subscriber)

    def end_streams(self) -> None:
        """The instance is stopping: every KV-event subscription ends now, and none is taken
        from now on, so that the server's drain waits for requests alone."""
        self.stopping = True
        if self.kv_event_streams is not None:
            self.kv_event_streams.close()

    def _batch_message(self, batch: KVEventBatch) -> disaggregation_pb2.KVEvents:
        return self._kv_events_message(batch.epoch, batch.last_seq, batch.snapshot, batch.stored, batch.removed)

    def _kv_events_message(
        self, epoch: int, last_seq: int, snapshot: bool, stored: list[BlockHash], removed: list[BlockHash]
    ) -> disaggregation_pb2.KVEvents:
        return disaggregation_pb2.KVEvents(
            epoch=epoch,
            last_seq=last_seq,
            snapshot=snapshot,
            stored=[h.to_bytes(16, "little") for h in stored],
            removed=[h.to_bytes(16, "little") for h in removed],
            block_size=self.instance.fingerprint.block_size,
            block_hash=self.instance.engine.core.kv_cache_manager.block_hasher.name,
        )


async def serve(
    instance: Instance,
    args: argparse.Namespace,
    add_servicer: Callable[[grpc.aio.Server], None],
    ready: Callable[[str], None] | None = None,
    kv_loader: KVLoader | None = None,
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
    freeze_heap: bool = True,
    drain: asyncio.Event | None = None,
    multiplexed: Mapping[str, MultiplexedMethod] | None = None,
    hand_over: asyncio.Event | None = None,
) -> None:
    """Start engine, connector and gRPC server; run until SIGTERM/SIGINT (or ``stop`` is set,
    for a caller that runs the instance in its own event loop), then drain and stop.
    SIGUSR1 (or ``drain`` set) turns the instance NOT_SERVING in health and the registry, as a
    dead engine does, while it keeps serving: gateways route nothing new here and every stream
    already here runs to its end, so that a planner stops it, idle, without cutting one.
    SIGUSR2 (or ``hand_over`` set with ``drain``) drains faster: once NOT_SERVING is out, a
    decode instance hands each stream whose gateway can resume it back to that gateway, which
    moves it to another decode instance after the tokens already sent (as it does when a
    decode instance dies); the rest run to their end here.
    ``kv_loader`` (decode role): what fills hand-offs' blocks, given to the engine as it starts.
    ``on_start`` runs once the engine runs, before the server takes calls; ``on_stop`` once the
    server has drained, before the connector and engine stop. ``freeze_heap``: exempt what start-up
    built from garbage collection (cluster/startup_heap.py); a caller whose process outlives the
    instance passes False, or the instance's own reference cycles would never be collected.
    ``multiplexed``: the role's streaming methods, served over ``Multiplex.Calls`` too
    (serving/call_mux.py), by the ``MuxCall`` body that carries their request."""
    instance.plane.warn_if_open(f"{instance.role} {instance.instance_id}")
    await instance.engine.start(kv_loader)
    if instance.role != "decode":  # decode never prefills a prompt of its own in the normal case
        await warm_up(instance.engine)
    advertise = args.advertise_host or args.host
    if instance.connector is not None:
        connector_address = await instance.connector.start(args.host, args.kv_port)
        instance.connector_address = connector_address.replace(args.host, advertise, 1) if connector_address else ""
        if isinstance(instance.connector, RankedConnector):
            instance.connector_rank_addresses = [
                address.replace(args.host, advertise, 1) for address in instance.connector.rank_addresses
            ]
    if on_start is not None:
        await on_start()
    server = instance.plane.server()
    add_servicer(server)
    multiplexer = CallMultiplexer(multiplexed, instance.plane.call_counts) if multiplexed else None
    if multiplexer is not None:
        multiplex_pb2_grpc.add_MultiplexServicer_to_server(multiplexer, server)
    load_servicer = LoadServicer(instance)
    disaggregation_pb2_grpc.add_LoadServicer_to_server(load_servicer, server)
    health_servicer = BoundedHealthServicer()  # open to all: its Watch streams capped (cluster/health_watch.py)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = instance.plane.add_port(server, f"{args.host}:{args.port}", advertise)
    await server.start()
    if freeze_heap:
        freeze_startup_heap()  # model, engine, connector and server are all built by now
    instance.grpc_address = f"{advertise}:{port}"
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    logger.info(
        "%s %s serving gRPC on %s, KV on %s",
        instance.role,
        instance.instance_id,
        instance.grpc_address,
        instance.connector_address,
    )
    heartbeat = None
    if args.registry_url:
        secret = instance.plane.secret
        heartbeat = RegistryHeartbeat(
            args.registry_url,
            instance.instance_id,
            instance.grpc_address,
            instance.load_report,
            args.heartbeat_seconds,
            key=secret.registry_key if secret is not None else None,
        )
        await heartbeat.register()  # registered before we say we are up
        heartbeat.start()
        logger.info("registered as %s in %s", instance.instance_id, redact_url(args.registry_url))
    metrics = (
        MetricsServer(
            instance.load_report,
            f"{instance.role} {instance.instance_id}",
            args.host,
            args.metrics_port,
            instance.phase_metrics.registry,
            instance.plane,
        )
        if args.metrics_port is not None
        else None
    )
    watch = asyncio.create_task(_watch_engine(instance, health_servicer, heartbeat))
    if ready is not None:
        ready(instance.grpc_address)

    if stop is None:
        stop = asyncio.Event()
        drain = drain or asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, drain.set)
        hand_over = hand_over or asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR2, drain_handing_over, drain, hand_over)
    stop_serving = asyncio.create_task(_stop_serving_on(drain, instance, health_servicer, heartbeat, hand_over))
    await stop.wait()
    logger.info("draining: no new requests, waiting up to %.0f s for in-flight ones", DRAIN_GRACE_S)
    for task in (watch, stop_serving):
        task.cancel()
    await asyncio.gather(watch, stop_serving, return_exceptions=True)
    if heartbeat is not None:
        await heartbeat.stop()
    # Health Watch and KV-event streams stay open for as long as their gateways like: they end
    # here (health ones once NOT_SERVING is sent), or the drain below would wait on them.
    await health_servicer.enter_graceful_shutdown()
    load_servicer.end_streams()
    if multiplexer is not None:
        multiplexer.close()  # its streams end with their calls: the grace below waits for those alone
    started = time.monotonic()
    await server.stop(grace=DRAIN_GRACE_S)
    # Where a slow stop spent its time: the drain above, or what closes below.
    logger.info("gRPC drained in %.1f s; closing the KV connector and the engine", time.monotonic() - started)
    if on_stop is not None:
        await on_stop()
    if instance.connector is not None:
        await instance.connector.close()
    await instance.engine.stop()
    if metrics is not None:
        metrics.stop()
    if instance.tracer is not None:
        await asyncio.to_thread(instance.tracer.shutdown)
    logger.info("stopped after draining for %.1f s", time.monotonic() - started)


def drain_handing_over(drain: asyncio.Event, hand_over: asyncio.Event) -> None:
    """SIGUSR2: drain, and hand the streams over (:func:`serve`)."""
    hand_over.set()
    drain.set()


async def _stop_serving_on(
    drain: asyncio.Event | None,
    instance: Instance,
    health_servicer: health.aio.HealthServicer,
    heartbeat: RegistryHeartbeat | None,
    hand_over: asyncio.Event | None = None,
) -> None:
    """Once ``drain`` is set: NOT_SERVING in health and, at once, in the registry; the server
    keeps serving what it holds and what a gateway sent before it learnt. With ``hand_over``
    set too, the streams that may be handed over go back to their gateways then: only once
    gateways are told, so that fewer route a resumed stream straight back here."""
    if drain is None:
        return
    await drain.wait()
    handing_over = hand_over is not None and hand_over.is_set()
    logger.info(
        "%s %s: not serving new requests; %s",
        instance.role,
        instance.instance_id,
        "handing the streams it may over to their gateways" if handing_over else "finishing those it holds",
    )
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    if heartbeat is not None:
        heartbeat.set_serving(False)
        await heartbeat.beat()  # now, not at the next heartbeat: gateways stop routing here sooner
    if handing_over:
        instance.handing_over.set()


async def _watch_engine(
    instance: Instance, health_servicer: health.aio.HealthServicer, heartbeat: RegistryHeartbeat | None
) -> None:
    """Until the engine's step loop dies; then say NOT_SERVING (health and registry), so that
    gateways stop routing here and an orchestrator can restart the instance."""
    while instance.engine.is_alive:
        await asyncio.sleep(ENGINE_WATCH_S)
    logger.error(
        "%s %s: the engine's step loop has died (%s); answering NOT_SERVING from now on: restart this instance",
        instance.role,
        instance.instance_id,
        instance.engine_error or "stopped",
    )
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    if heartbeat is not None:
        heartbeat.set_serving(False)  # sent with the next heartbeat
