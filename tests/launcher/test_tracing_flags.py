"""``splitserve up --otlp-traces-endpoint`` reaches the gateway and every instance it starts,
each parsing it as given; without it nobody gets one (each then reads the standard variables);
``--request-log`` reaches the gateway."""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway.flags import add_gateway_arguments
from launcher.up import add_arguments, engine_flags, gateway_flags
from serving.instance import add_instance_arguments

ENDPOINT = "http://collector:4317"
ROUTES = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]


def parsed(add: object, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)  # type: ignore[operator]
    return parser.parse_args(list(argv))


def test_the_endpoint_reaches_the_gateway_and_every_instance_as_given() -> None:
    up = parsed(add_arguments, "--otlp-traces-endpoint", ENDPOINT, "--request-log", "json")
    instance = parsed(lambda p: add_instance_arguments(p, default_port=0), *engine_flags(up, Path("/m")))
    gateway = parsed(add_gateway_arguments, *gateway_flags(up, Path("/m"), ROUTES))
    assert instance.otlp_traces_endpoint == gateway.otlp_traces_endpoint == ENDPOINT
    assert gateway.request_log == "json" and gateway.prefill == ["127.0.0.1:1"]


def test_without_the_flag_nobody_gets_one() -> None:
    up = parsed(add_arguments)
    assert "--otlp-traces-endpoint" not in engine_flags(up, Path("/m"))
    assert "--otlp-traces-endpoint" not in gateway_flags(up, Path("/m"), ROUTES)
    assert parsed(add_gateway_arguments, *gateway_flags(up, Path("/m"), ROUTES)).request_log == "text"
