"""The gateway's flags, each declared once (:func:`add_gateway_arguments`), and the ones
``splitserve up`` takes too: the API key, the routing and instance-limit flags, the process count
and the request log, which ``up`` passes on to the gateway it starts (:func:`routing_argv`).
Light on purpose (argparse only): the launcher imports this module without the gateway's web
stack, the engine or torch."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Literal

from cluster.tls import TLSFiles
from cluster.tracing import add_tracing_arguments
from gateway import kv_event_liveness
from gateway.event_loop import LOOPS

Routing = Literal["load", "kv"]
ROUTINGS: tuple[Routing, ...] = ("load", "kv")
InstanceCalls = Literal["multiplexed", "per-call"]
INSTANCE_CALLS: tuple[InstanceCalls, ...] = ("multiplexed", "per-call")
RequestLogFormat = Literal["off", "text", "json"]
REQUEST_LOG_FORMATS: tuple[RequestLogFormat, ...] = ("off", "text", "json")
DEFAULT_MAX_MIGRATIONS = 2
API_KEY_FILE_ENV = "SPLITSERVE_API_KEY_FILE"
DEFAULT_PORT = 8000
DEFAULT_GRPC_PORT = 50051
# What one request may ask (gateway/limits.py).
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token conversation as JSON, escapes included, with room to spare
# A 128k-token prompt as token ids, twice over; what FastAPI parses on the event loop once a body
# has passed the check (gateway/body_check.py), so its cost there is bounded by this.
DEFAULT_MAX_JSON_VALUES = 1 << 18
DEFAULT_MAX_PROMPTS = 128  # prompts in one /v1/completions request; each takes a pending slot
DEFAULT_MAX_PROMPT_CHARS = 1 << 20  # about 4 characters a token for 128k tokens, twice over
DEFAULT_MAX_STOP = 32  # stop strings, and separately stop token ids, per request
DEFAULT_MAX_STOP_CHARS = 256  # one stop string; matched against the text after every token
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 5.0
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0  # llguidance compiles a large JSON schema in well under a second
# A connection's deadlines (gateway/connection_guard.py). Clients send a request's headers as
# they open its connection, in one write; a browser's speculative connection that waits longer
# is opened again when it is needed.
DEFAULT_HEADERS_TIMEOUT_S = 10.0
# Room for the largest body (--max-request-body-bytes) over a slow client link.
DEFAULT_BODY_TIMEOUT_S = 30.0


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """``splitserve gateway``'s flags, every one of them (``gateway/server.py`` runs them)."""
    # grpc is imported here, for the gateway only: ``up`` imports this module too.
    from cluster.internal_grpc import add_internal_plane_arguments

    parser.add_argument(
        "--model",
        default=None,
        help="the model the instances serve: its local Hugging Face folder or .gguf file, whose tokenizer the "
        "gateway uses (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients send and /v1/models lists (default: --model as given)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind the REST and gRPC fronts to")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="REST port")
    parser.add_argument(
        "--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC Generation port (0: any free port, -1: off)"
    )
    add_grpc_front_tls_arguments(parser)
    add_api_key_argument(parser)
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a prefill instance (repeatable); static routing",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a decode instance (repeatable); static routing",
    )
    parser.add_argument(
        "--colocated",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an instance doing both phases (repeatable)",
    )
    parser.add_argument(
        "--registry-url",
        default=os.environ.get("SPLITSERVE_REGISTRY_URL", ""),
        help="redis://[USER:PASSWORD@]HOST:PORT (or rediss:// for TLS) where instances register, instead of static "
        "lists "
        "(env SPLITSERVE_REGISTRY_URL, which keeps a password off the command line)",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=0.5,
        help="seconds between the gateway's checks of its instances: with static lists, each instance's health and "
        "load poll; with --registry-url, the registry scan (heartbeats carry the load reports) and a look for reports "
        "older than half of --stale-after, whose instances it then polls. With --routing kv, also how often it "
        "subscribes again to instances whose KV-event subscription was lost (gateway/kv_events.py), and polls the "
        "KV events of those that refuse one",
    )
    parser.add_argument(
        "--stale-after",
        type=float,
        default=3.0,
        help="seconds without a fresh load report before an instance is skipped",
    )
    parser.add_argument(
        "--kv-event-heartbeat",
        type=float,
        default=kv_event_liveness.DEFAULT_HEARTBEAT_S,
        help="with --routing kv: seconds after which an instance with no prefix-cache change to push writes an "
        "empty message down this gateway's KV-event subscription, to show it is there (instances floor it at "
        "0.05)",
    )
    parser.add_argument(
        "--kv-event-silence",
        type=float,
        default=kv_event_liveness.DEFAULT_SILENCE_S,
        help="with --routing kv: seconds without any message, not even a heartbeat, after which a KV-event "
        "subscription is ended and the instance's events read again from the gateway's cursor (a host gone "
        "without closing its connections); at least twice --kv-event-heartbeat",
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="requests in flight at once; beyond this the gateway answers 429",
    )
    parser.add_argument(
        "--max-pending-requests-per-client",
        type=int,
        default=None,
        help="requests in flight at once from one client address (gRPC: its peer address); beyond this it gets 429 "
        "while others are still admitted. Behind a proxy every client has the proxy's address: raise it to "
        "--max-pending-requests (default: three quarters of --max-pending-requests, so that no one address fills "
        "them)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="HTTP connections (idle keep-alive ones too) and gRPC calls served at once; beyond it the REST "
        "server answers 503 on every path but the probes' (/health, /ready), the gRPC server RESOURCE_EXHAUSTED "
        "(default: twice --max-pending-requests, plus 64 for probes and scrapes)",
    )
    # Deadlines and a per-client cap on REST connections (gateway/connection_guard.py), as nginx's
    # client_header_timeout, client_body_timeout and limit_conn.
    parser.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        help="open HTTP connections from one client address (IPv6: one /64); one more is answered 503 and closed "
        "unread. Behind a proxy every client has the proxy's address: raise it to --max-connections "
        "(default: half of --max-connections, so that no one address can fill it)",
    )
    parser.add_argument(
        "--timeout-request-headers",
        type=float,
        default=DEFAULT_HEADERS_TIMEOUT_S,
        help="seconds a client has to send a request's line and headers, from the connection's start (or the "
        "next request's first byte); then the connection is closed (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout-request-body",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client has to send a request's body once its headers are in; then the connection is "
        "closed (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="refuse longer requests (default: what the instances report)"
    )
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take end to end")
    # Longer than clients keep an idle pooled connection (httpx, so the openai client: 5 s;
    # aiohttp: 15 s), so that the client, not the server, closes it. Shorter (uvicorn's 5 s),
    # a client reusing a connection as the server closes it gets a reset and loses the request:
    # one of sixteen in a benchmark run with aiohttp, whose requests came some 4 s apart.
    parser.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=75.0,
        help="seconds an idle HTTP connection stays open (as nginx's keepalive_timeout)",
    )
    parser.add_argument(
        "--planner-url",
        default=None,
        help="a planner's metrics endpoint (splitserve planner --metrics-port): the status page shows its decisions",
    )
    parser.add_argument(
        "--loop",
        default="auto",
        choices=LOOPS,
        help="the event loop (gateway/event_loop.py): auto, uvloop where it is installed (as uvicorn picks); "
        "asyncio, the standard library's (default: auto)",
    )
    add_routing_arguments(parser)
    # Several gateways (gateway/api_servers.py), each breaking routing ties in its own order (gateway/tie_break.py).
    add_api_server_count_argument(parser)
    parser.add_argument(
        "--gateway-index",
        type=int,
        default=0,
        metavar="I",
        help="this gateway's index among --num-gateways replicas sharing the instances (e.g. a StatefulSet's "
        "ordinal), so that their routing does not herd onto the same instances (default: 0)",
    )
    parser.add_argument(
        "--num-gateways",
        type=int,
        default=1,
        metavar="M",
        help="gateway replicas sharing the instances, each given its --gateway-index (default: 1)",
    )
    # Set by the parent of --api-server-count processes on each child.
    parser.add_argument("--api-server-index", type=int, default=None, help=argparse.SUPPRESS)
    # What one request may ask (gateway.limits); each limit is a 400 (413 for the body) naming it.
    parser.add_argument(
        "--enable-priority",
        action="store_true",
        help="honour requests' priority field (lower runs first); off: a nonzero priority is refused with 400",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body (REST) or message (gRPC); beyond it the gateway answers 413",
    )
    parser.add_argument(
        "--max-request-json-values",
        type=int,
        default=DEFAULT_MAX_JSON_VALUES,
        help="JSON values (numbers, strings, ...; objects: a sixteenth of it) one REST body may hold, checked off "
        "the event loop for bodies over 8 KiB; beyond it the gateway answers 400 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        help="prompts in one /v1/completions request",
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=DEFAULT_MAX_PROMPT_CHARS,
        help="characters of one prompt (or rendered conversation) before tokenizing",
    )
    parser.add_argument(
        "--max-stop-sequences",
        type=int,
        default=DEFAULT_MAX_STOP,
        help="stop strings, and separately stop token ids, in one request",
    )
    parser.add_argument(
        "--max-stop-chars", type=int, default=DEFAULT_MAX_STOP_CHARS, help="characters of one stop string"
    )
    parser.add_argument(
        "--chat-template-timeout",
        type=float,
        default=DEFAULT_CHAT_TEMPLATE_TIMEOUT_S,
        help="seconds the chat template may take to render one conversation",
    )
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
        help="seconds one structured output's grammar may take to compile",
    )
    # The internal plane: the cluster secret and TLS of the gateway's calls to instances.
    add_internal_plane_arguments(parser)
    add_tracing_arguments(parser)
    add_request_log_argument(parser)


def add_grpc_front_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """TLS for the public gRPC ``Generation`` front (``gateway/grpc_front.py``), apart from the
    internal plane's ``--tls-*``: clients and instances trust different CAs. Read them with
    :func:`resolve_grpc_front_tls`."""
    env = os.environ.get
    parser.add_argument(
        "--grpc-tls-cert",
        default=env("SPLITSERVE_GRPC_TLS_CERT") or None,
        help="PEM certificate the gRPC Generation front serves TLS with, so that the API key and prompts do not "
        "cross in the clear (env SPLITSERVE_GRPC_TLS_CERT; with --grpc-tls-key)",
    )
    parser.add_argument(
        "--grpc-tls-key",
        default=env("SPLITSERVE_GRPC_TLS_KEY") or None,
        help="PEM private key of --grpc-tls-cert (env SPLITSERVE_GRPC_TLS_KEY)",
    )
    parser.add_argument(
        "--grpc-tls-ca",
        default=env("SPLITSERVE_GRPC_TLS_CA") or None,
        help="PEM CA certificates: the gRPC front then requires client certificates they signed (mutual TLS) "
        "(env SPLITSERVE_GRPC_TLS_CA)",
    )


def resolve_grpc_front_tls(args: argparse.Namespace) -> TLSFiles | None:
    """The gRPC front's TLS files, read once; None for plaintext. Raises ValueError naming the flag
    to fix: a key without its certificate, a file it cannot read, a CA without a certificate."""
    tls = TLSFiles.load(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_ca, flags="--grpc-tls")
    if tls is not None and tls.cert is None:
        raise ValueError(
            "--grpc-tls-ca checks clients' certificates of a front serving TLS: give --grpc-tls-cert and "
            "--grpc-tls-key too"
        )
    return tls


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    """``splitserve up`` hands the key to its gateway through the environment, never argv.
    Read the key with :func:`resolve_api_key`."""
    parser.add_argument(
        "--api-key",
        # Set but empty is not the same as unset: an error at start (resolve_api_key).
        default=os.environ.get("SPLITSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API (env SPLITSERVE_API_KEY; a command line is "
        "readable by every local user: prefer --api-key-file)",
    )
    parser.add_argument(
        "--api-key-file",
        default=os.environ.get(API_KEY_FILE_ENV),
        metavar="PATH",
        help=f"read the API key from this file, e.g. a compose or Kubernetes secret under /run/secrets "
        f"(env {API_KEY_FILE_ENV})",
    )


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key the flags give: ``--api-key``, or the content of ``--api-key-file``
    (surrounding whitespace stripped). Raises ValueError for both at once, for either given but
    empty (``SPLITSERVE_API_KEY=``, ``SPLITSERVE_API_KEY_FILE=``), or a file that cannot be read
    or is empty: a key given but empty must not leave the API open."""
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(
            "the API key is given but empty (--api-key '' or SPLITSERVE_API_KEY set to nothing): set it to the key "
            "clients send, or unset the variable to serve without one"
        )
    if args.api_key_file is None:
        return args.api_key
    if not args.api_key_file.strip():
        raise ValueError(
            f"--api-key-file is given but names no file ({API_KEY_FILE_ENV} set to nothing?): name the file that "
            "holds the API key, or unset the variable to serve without one"
        )
    if args.api_key is not None:
        raise ValueError("give the API key once: --api-key (SPLITSERVE_API_KEY) or --api-key-file, not both")
    try:
        key = Path(args.api_key_file).read_text().strip()
    except OSError as error:
        raise ValueError(f"cannot read the API key from --api-key-file {args.api_key_file}: {error}") from None
    if not key:
        raise ValueError(f"--api-key-file {args.api_key_file} is empty: write the API key in it")
    return key


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """How requests are admitted, routed and recovered."""
    # Instance limits (gateway/instance_limits.py): refuse at once rather than queue for minutes.
    parser.add_argument(
        "--max-queue-delay",
        type=float,
        default=None,
        metavar="SECONDS",
        help="answer 429 with Retry-After when every prefill instance's queued prompts would delay a new "
        "request's prefill by more than this (estimated from their load reports; default: off)",
    )
    parser.add_argument(
        "--max-inflight-per-instance",
        type=int,
        default=None,
        metavar="N",
        help="calls the gateway keeps outstanding on one prefill (or colocated) instance at most; "
        "a request finding every instance at the cap gets 429 (default: off)",
    )
    parser.add_argument(
        "--routing",
        default="kv",
        choices=ROUTINGS,
        help="how instances are ranked (gateway/routing.py): 'load' by queue only, 'kv' by queued prompt work "
        "after the prompt's prefix-cache hit on each instance, learnt from their KV events (default: kv)",
    )
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=DEFAULT_MAX_MIGRATIONS,
        help="times one request may resume on another decode instance after its own failed mid-stream "
        "(its prompt plus the tokens sent so far prefilled again; 0: fail the request instead; "
        f"default: {DEFAULT_MAX_MIGRATIONS})",
    )
    parser.add_argument(
        "--instance-calls",
        default="multiplexed",
        choices=INSTANCE_CALLS,
        help="how this gateway process streams from an instance: every request's Decode or Generate call over "
        "one stream per instance, one message per engine step (multiplexed), or a gRPC call per request "
        "(per-call) (default: multiplexed)",
    )
    parser.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="conditional disaggregation: a prompt with fewer than N tokens the best decode instance lacks "
        "(short, or mostly in its prefix cache with --routing kv) is prefilled on that decode instance, "
        "in chunks inside its step budget, instead of on a prefill instance (default: 0, always disaggregate)",
    )


def add_api_server_count_argument(parser: argparse.ArgumentParser) -> None:
    """Gateway processes on one port (gateway/api_servers.py), which ``up`` passes on too."""
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes serving the same REST and gRPC ports (SO_REUSEPORT), each with its own discovery "
        "and routing, for more cores than one Python process uses (default: 1)",
    )


def add_request_log_argument(parser: argparse.ArgumentParser) -> None:
    """One line per finished request (gateway/request_log.py), which ``up`` passes on too."""
    parser.add_argument(
        "--request-log",
        default="text",
        choices=REQUEST_LOG_FORMATS,
        help="log one line per finished request at INFO: its id, trace id, outcome, tokens, TTFT and its phases, "
        "as key=value pairs (text) or a JSON object (json); off: none (default: text)",
    )


def request_log_argv(args: argparse.Namespace) -> list[str]:
    return ["--request-log", args.request_log]


def routing_argv(args: argparse.Namespace) -> list[str]:
    """The flags of :func:`add_routing_arguments` as parsed, for a gateway to parse the same."""
    argv = ["--routing", args.routing, "--max-migrations", str(args.max_migrations)]
    argv += ["--disagg-min-prompt-tokens", str(args.disagg_min_prompt_tokens), "--instance-calls", args.instance_calls]
    if args.max_queue_delay is not None:
        argv += ["--max-queue-delay", str(args.max_queue_delay)]
    if args.max_inflight_per_instance is not None:
        argv += ["--max-inflight-per-instance", str(args.max_inflight_per_instance)]
    return argv
