"""``splitserve gateway``: the OpenAI-compatible REST front and the gRPC
``Generation`` front, routing each request to a prefill and a decode instance."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from pathlib import Path

import uvicorn
from prometheus_client import Info

from cluster.derived_keys import prefix_cache_key
from cluster.internal_grpc import InternalPlane
from cluster.startup_heap import freeze_startup_heap
from cluster.tracing import start_tracing
from engine.default_model import DEFAULT_MODEL_NAME, default_model_path
from engine.gguf_files import metadata_folder
from gateway import limits
from gateway.api_servers import reuse_port_socket, run_api_servers
from gateway.app import create_app
from gateway.connection_guard import ConnectionGuard, ConnectionLimits
from gateway.discovery import DiscoveryLoop, RedisDiscovery, StaticDiscovery
from gateway.event_loop import loop_factory, resolved_loop
from gateway.flags import add_gateway_arguments, resolve_api_key, resolve_grpc_front_tls
from gateway.generation import GenerationService
from gateway.grpc_front import GrpcFront, start_grpc_front
from gateway.instance_limits import InstanceLimits
from gateway.instances import InstancePool
from gateway.kv_event_liveness import KVEventLiveness
from gateway.kv_event_traffic import KVEventTraffic
from gateway.kv_events import KVEventsSync, run_kv_events
from gateway.metrics import GatewayMetrics
from gateway.prefix_index import PrefixIndex
from gateway.tie_break import GatewaySlot
from gateway.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)

# How long a stopping gateway lets the requests it holds finish, REST and gRPC side by side: as
# an instance's drain, within a pod's terminationGracePeriodSeconds and compose's
# stop_grace_period (45 s), so that SIGKILL never comes first.
DRAIN_GRACE_S = 30  # seconds: uvicorn takes a whole number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags (``splitserve/cli.py``), declared in ``gateway/flags.py``."""
    add_gateway_arguments(parser)


def run(args: argparse.Namespace) -> int:
    args.api_key = resolve_api_key(args)
    args.grpc_tls = resolve_grpc_front_tls(args)  # its files read once, and their errors before any start
    if not (args.prefill or args.decode or args.colocated or args.registry_url):
        raise ValueError(
            "no instances to route to: give --registry-url redis://HOST:PORT, or --prefill and --decode HOST:PORT (or "
            "--colocated)"
        )
    if bool(args.prefill) != bool(args.decode):
        raise ValueError("static routing needs both --prefill and --decode instances (or --colocated)")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count {args.api_server_count}: give at least 1")
    gateway_slot(args)  # its ValueError before any process starts
    if args.api_server_count > 1 and args.api_server_index is None:
        return run_api_servers(args)
    with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        runner.run(serve(args))
    return 0


def gateway_slot(args: argparse.Namespace) -> GatewaySlot:
    return GatewaySlot.of(args.gateway_index, args.num_gateways, args.api_server_index or 0, args.api_server_count)


async def serve(args: argparse.Namespace) -> None:
    """Serve REST and gRPC until SIGTERM/SIGINT, then let in-flight requests finish."""
    # Room for every admitted request and as many idle keep-alive connections.
    max_connections = args.max_connections or 2 * args.max_pending_requests + 64
    connections = ConnectionGuard(
        ConnectionLimits(
            max_connections=max_connections,
            max_per_client=args.max_connections_per_client or max(1, max_connections // 2),
            headers_timeout_s=args.timeout_request_headers,
            body_timeout_s=args.timeout_request_body,
        )
    )
    model_path = Path(args.model) if args.model else default_model_path()
    model_name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    instance_limits = InstanceLimits(
        max_queue_delay_s=args.max_queue_delay, max_inflight_per_instance=args.max_inflight_per_instance
    )
    plane = InternalPlane.from_args(args, args.host)
    plane.warn_if_open("gateway")
    pool = InstancePool(
        stale_after_s=args.stale_after,
        limits=instance_limits,
        plane=plane,
        routing=args.routing,
        # Instances hashing their prefix cache with --prefix-cache-hash sha256 key it with the secret too.
        index=PrefixIndex(hash_key=prefix_cache_key(plane.secret)),
        slot=gateway_slot(args),
        multiplex_calls=args.instance_calls == "multiplexed",
    )
    discovery: RedisDiscovery | StaticDiscovery
    if args.registry_url:
        discovery = redis_discovery = RedisDiscovery(pool, args.registry_url, args.poll_interval)
        await redis_discovery.first_poll()
    else:
        discovery = StaticDiscovery(
            pool, {"prefill": args.prefill, "decode": args.decode, "colocated": args.colocated}, args.poll_interval
        )
        await discovery.poll_once()
    discovery_loop = DiscoveryLoop(discovery)
    kv_events_task = None
    kv_event_traffic = KVEventTraffic()  # counted by the KV-event followers, exported on /metrics
    if args.routing == "kv":
        kv_sync = KVEventsSync(
            pool,
            pool.index,
            args.poll_interval,
            KVEventLiveness(heartbeat_s=args.kv_event_heartbeat, silence_s=args.kv_event_silence),
            kv_event_traffic,
        )
        await kv_sync.poll_once()
        kv_events_task = asyncio.create_task(run_kv_events(kv_sync))
    metrics = GatewayMetrics(pool, kv_event_traffic)
    # Which of the processes sharing the port answered a scrape (each counts only its own requests).
    Info("splitserve_api_server", "This gateway process among --api-server-count", registry=metrics.registry).info(
        {
            "index": str(args.api_server_index or 0),
            "count": str(args.api_server_count),
            "loop": resolved_loop(args.loop),
        }
    )
    request_limits = limits.RequestLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_json_values=args.max_request_json_values,
        max_prompts=args.max_prompts_per_request,
        max_prompt_chars=args.max_prompt_chars,
        max_stop=args.max_stop_sequences,
        max_stop_chars=args.max_stop_chars,
        chat_template_timeout_s=args.chat_template_timeout,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
    )
    # A GGUF file's tokenizer is in the folder derived from its metadata (once, engine/gguf_files.py).
    tokenizer = ModelTokenizer(metadata_folder(model_path), request_limits)
    tracer = start_tracing(args.otlp_traces_endpoint, "splitserve-gateway", f"gateway-{args.host}:{args.port}")
    service = GenerationService(
        pool,
        tokenizer,
        metrics,
        args.max_pending_requests,
        args.request_timeout,
        args.max_model_len,
        args.enable_priority,
        args.max_migrations,
        args.disagg_min_prompt_tokens,
        model_name=model_name,
        tracer=tracer,
        request_log=args.request_log,
        max_pending_per_client=args.max_pending_requests_per_client,
    )
    grpc_front = None
    if args.grpc_port >= 0:
        grpc_front = await start_grpc_front(
            service, model_name, args.api_key, args.host, args.grpc_port, max_connections, args.grpc_tls
        )
        logger.info("gRPC Generation API on %s:%d%s", args.host, grpc_front.port, " (TLS)" if args.grpc_tls else "")
    app = create_app(
        service,
        model_name,
        args.api_key,
        discovery_alive=lambda: discovery_loop.alive,
        planner_url=args.planner_url,
    )
    config = uvicorn.Config(
        # A backstop beneath the gate's 429s (gateway/gate.py) that spares the probes, in place of
        # uvicorn's limit_concurrency, which answers them 503 too.
        connections.asgi(app),
        http=connections.protocol(),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=DRAIN_GRACE_S,
        timeout_keep_alive=args.timeout_keep_alive,
    )
    freeze_startup_heap()  # the tokenizer, app and clients are built by now
    logger.info("serving %s: OpenAI API on http://%s:%d/v1", model_name, args.host, args.port)
    # uvicorn handles SIGTERM/SIGINT while it serves, then raises the signal again once it has
    # shut down, for the handler it found: with the default one the process died there, before
    # the cleanup below (the gRPC front's drain, background releases, the last traces' export).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stopped_already)
    # --api-server-count: a socket of this process's own on the shared port (gateway/api_servers.py).
    sockets = [reuse_port_socket(args.host, args.port)] if args.api_server_index is not None else None
    try:
        # Returns after SIGTERM/SIGINT and a graceful shutdown, of the gRPC front's calls too.
        await DrainingServer(config, grpc_front).serve(sockets=sockets)
    finally:
        if grpc_front is not None:
            await grpc_front.stop(grace=DRAIN_GRACE_S)  # at once if the drain stopped it already
        await discovery_loop.stop()
        if kv_events_task is not None:
            kv_events_task.cancel()
            await asyncio.gather(kv_events_task, return_exceptions=True)
        await service.dispatcher.drain()
        if isinstance(discovery, RedisDiscovery):
            await discovery.close()
        await pool.close()
        service.close()
        tokenizer.close()
        if tracer is not None:
            await asyncio.to_thread(tracer.shutdown)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown drains the gRPC front beside the REST
    connections: both within one grace, not one grace after the other (past a pod's
    terminationGracePeriodSeconds, or a container's stop timeout)."""

    def __init__(self, config: uvicorn.Config, grpc_front: GrpcFront | None) -> None:
        super().__init__(config)
        self.grpc_front = grpc_front

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.grpc_front is None:
            await super().shutdown(sockets)
            return
        await asyncio.gather(super().shutdown(sockets), self.grpc_front.stop(grace=DRAIN_GRACE_S))


def _stopped_already(signum: int, frame: object) -> None:
    """The signal uvicorn raises again after its shutdown: the cleanup that follows is the stop."""
