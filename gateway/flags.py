"""The gateway's flags that ``splitserve up`` takes too, declared once: the API key and the
routing and admission flags, which ``up`` passes on to the gateway it starts
(:func:`routing_argv`). Light on purpose (argparse only): the launcher imports this module
without the gateway's web stack, the engine or torch."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Literal

Routing = Literal["load", "kv"]
ROUTINGS: tuple[Routing, ...] = ("load", "kv")
RequestLogFormat = Literal["off", "text", "json"]
REQUEST_LOG_FORMATS: tuple[RequestLogFormat, ...] = ("off", "text", "json")
DEFAULT_MAX_MIGRATIONS = 2
API_KEY_FILE_ENV = "SPLITSERVE_API_KEY_FILE"


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    """``splitserve up`` hands the key to its gateway through the environment, never argv.
    Read the key with :func:`resolve_api_key`."""
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPLITSERVE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on the API (env SPLITSERVE_API_KEY; a command line is "
        "readable by every local user: prefer --api-key-file)",
    )
    parser.add_argument(
        "--api-key-file",
        default=os.environ.get(API_KEY_FILE_ENV) or None,
        metavar="PATH",
        help=f"read the API key from this file, e.g. a compose or Kubernetes secret under /run/secrets "
        f"(env {API_KEY_FILE_ENV})",
    )


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key the flags give: ``--api-key``, or the content of ``--api-key-file``
    (surrounding whitespace stripped). Raises ValueError for both at once, or a file that
    cannot be read or is empty: a key file that gives no key must not leave the API open."""
    if args.api_key_file is None:
        return args.api_key
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
    # Admission control (gateway/admission.py): refuse at once rather than queue for minutes.
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
    argv += ["--disagg-min-prompt-tokens", str(args.disagg_min_prompt_tokens)]
    if args.max_queue_delay is not None:
        argv += ["--max-queue-delay", str(args.max_queue_delay)]
    if args.max_inflight_per_instance is not None:
        argv += ["--max-inflight-per-instance", str(args.max_inflight_per_instance)]
    return argv
