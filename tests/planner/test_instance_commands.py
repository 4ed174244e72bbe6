"""The planner's real instances, as commands: ``splitserve planner`` without
``--simulate-profile`` starts ``splitserve prefill|decode`` of ``--model`` with the engine's
flags, the KV budget and the connector, in UCX's loopback environment; it and ``splitserve up
--planner`` refuse real instances without a capacity profile, naming ``splitserve profile``;
``up`` passes its engine flags and the profile on to the planner, or, with ``--simulate``,
simulate's timing profile. (tests/planner/test_up_planner.py runs them.)"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from launcher import up
from launcher.processes import splitserve_command
from planner import cli
from splitserve.cli import build_parser


def parse(*argv: str) -> argparse.Namespace:
    parser, _ = build_parser(list(argv))
    return parser.parse_args(list(argv))


PLANNER = ("planner", "--gateway-url", "http://127.0.0.1:1", "--registry-url", "redis://127.0.0.1:2")


def test_the_planner_starts_real_instances_of_the_model_without_a_timing_profile(tmp_path: Path) -> None:
    args = parse(
        *PLANNER, "--model", str(tmp_path), "--dtype", "float32", "--num-blocks", "64",
        "--capacity-profile", "cap.json",
    )  # fmt: skip
    argv = cli.instance_command(args)("decode", "planned-decode-0")
    assert argv[argv.index("splitserve") + 1 :][2:5] == ["decode", "--model", str(tmp_path)]
    for flag, value in {
        "--dtype": "float32",
        "--num-blocks": "64",
        "--kv-connector": "ucx",
        "--instance-id": "planned-decode-0",
        "--registry-url": "redis://127.0.0.1:2",
        "--port": "0",
    }.items():
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    assert cli.instance_environment(args)["UCX_TLS"]  # UCX on loopback, as `splitserve up` sets it
    assert cli.pricing_profile(args) == "smollm2-135m-cpu"


def test_the_planner_still_starts_simulated_instances_of_a_timing_profile() -> None:
    args = parse(*PLANNER, "--simulate-profile", "llama-3.1-8b-h100")
    argv = cli.instance_command(args)("prefill", "planned-prefill-0")
    assert argv[argv.index("splitserve") + 3 : argv.index("splitserve") + 5] == ["simulate", "prefill"]
    assert cli.pricing_profile(args) == "llama-3.1-8b-h100"


def test_real_instances_without_a_capacity_profile_are_refused_with_the_fix() -> None:
    # As a user runs them, bounded: a refusal that went missing would start instances instead.
    for argv in (PLANNER, ("up", "--planner")):
        result = subprocess.run(splitserve_command(*argv, "--model", "m"), capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "splitserve profile" in result.stderr and "--capacity-profile" in result.stderr, result.stderr


def test_up_passes_the_engine_flags_and_the_profile_to_the_planner(tmp_path: Path) -> None:
    real = parse("up", "--planner", "--capacity-profile", "cap.json", "--kv-cache-memory", "8388608")
    argv = up.planner_command(real, tmp_path, "redis://127.0.0.1:2")
    for flag, value in {
        "--capacity-profile": "cap.json",
        "--kv-cache-memory": "8388608",
        "--model": str(tmp_path),
    }.items():
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    assert "--simulate-profile" not in argv
    simulated = parse("up", "--simulate", "--planner")
    argv = up.planner_command(simulated, tmp_path, "redis://127.0.0.1:2")
    assert argv[argv.index("--simulate-profile") + 1] == "llama-3.1-8b-h100"
