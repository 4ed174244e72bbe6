"""Child processes of ``splitserve up``: started with an optional CPU set, killed
by the kernel if the launcher dies (so nothing outlives it), stopped with
SIGTERM (each drains) and killed only if it overstays."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

CHILD_STOP_TIMEOUT_S = 40.0  # a child drains on SIGTERM for up to 30 s (serving/instance.py), then is killed
# `splitserve up` stops its children in three stages (the gateway; the instances, or the processes
# holding them; their store), each killed past CHILD_STOP_TIMEOUT_S: a bound on the whole stop.
UP_STOP_TIMEOUT_S = 3 * CHILD_STOP_TIMEOUT_S + 10

_PR_SET_PDEATHSIG = 1
# Shared memory for UCX between local processes; tcp stays for connection set-up. Here, not in
# up.py, for the benchmarks that start instances too (and import no connector).
LOCAL_UCX_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_RNDV_SCHEME": "put_zcopy", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def parse_cpu_list(spec: str) -> set[int]:
    """'0', '0-3' or '0,2,4-5' (taskset's syntax) as a set of CPU ids."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                cpus.update(range(low, high + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise ValueError(f"bad CPU list {spec!r}: use taskset's syntax, e.g. '0', '0-3' or '0,2'") from None
    available = os.sched_getaffinity(0)
    if not cpus or not cpus <= available:
        raise ValueError(f"CPU list {spec!r} is not within the CPUs this process may use: {sorted(available)}")
    return cpus


def parse_instance_cpu_lists(spec: str, count: int) -> list[set[int]]:
    """One CPU list per instance: ``spec`` is one list all ``count`` instances share, or
    ``count`` lists separated by ``|`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` syntax), the
    first for instance 0: '0|1' gives each of two instances a core of its own."""
    lists = spec.split("|")
    if len(lists) == 1:
        return [parse_cpu_list(spec)] * count
    if len(lists) != count:
        raise ValueError(f"CPU lists {spec!r}: {len(lists)} lists for {count} instances; give one, or one per instance")
    return [parse_cpu_list(one) for one in lists]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a child to listen on. Picked below the kernel's
    ephemeral range where it has one: the ports it hands out for outgoing connections and
    for listeners on port 0 (UCX's, LMCache's) come from that range, and one of them took a
    port picked there before the child could bind it (a test's decode instance exited with
    "Failed to add port")."""
    lowest_ephemeral = _lowest_ephemeral_port()
    if lowest_ephemeral - _LOWEST_PICKED_PORT >= 1000:
        for _ in range(100):
            port = random.randrange(_LOWEST_PICKED_PORT, lowest_ephemeral)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue  # in use, or in TIME_WAIT
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LOWEST_PICKED_PORT = 10_000  # above the ports well-known services use


def _lowest_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: the kernel picks


def _child_setup(cpus: set[int] | None) -> Callable[[], None]:
    def setup() -> None:
        # Die with the launcher: a killed `splitserve up` must not leave engines behind.
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return setup


def splitserve_command(*argv: str, source_dir: Path | None = None) -> list[str]:
    """The ``splitserve`` command line a child process runs, with this interpreter: every
    process splitserve starts (the launcher, the benchmarks, the tests) is spelt here.

    ``source_dir``: run that checkout's code instead (a benchmark's "before" tree), from its
    own folder, so that ``-m`` finds it ahead of this one's install. A tree from before the
    ``splitserve`` package ran ``python -m engine.cli``, with its gRPC stubs under ``proto/``."""
    if source_dir is None:
        return [sys.executable, "-m", "splitserve", *argv]
    source = source_dir.resolve()
    if (source / "splitserve" / "cli.py").is_file():
        module, python_path = "splitserve", str(source)
    else:
        module, python_path = "engine.cli", f"{source}{os.pathsep}{source / 'proto'}"
    # env(1) rather than Popen's cwd and env: the logged command line is then the whole command.
    return ["env", "-C", str(source), f"PYTHONPATH={python_path}", sys.executable, "-m", module, *argv]


def embedded_model(load_format: str, dtype: str) -> tuple[Path, str]:
    """The embedded model's path in the form ``load_format`` names (``auto``: chosen for
    ``dtype`` on this machine; engine/default_model.py), its folder converted first if it is
    that and not yet, and the name it is served under. A child process does it
    (launcher/embedded_model.py): the choice and the conversion load torch and the engine, which
    the launcher never imports. Its log and progress go to this process's stderr; the path and
    the name come back on its stdout."""
    command = [sys.executable, "-m", "launcher.embedded_model", "--load-format", load_format, "--dtype", dtype]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise ValueError("the embedded model is not available (above: why); or pass --model PATH")
    path, name = result.stdout.splitlines()
    return Path(path), name


class Child:
    def __init__(
        self,
        name: str,
        argv: list[str],
        env: Mapping[str, str | None] | None = None,
        cpus: set[int] | None = None,
        stop_stage: int = 1,
    ) -> None:
        """``env``: added to this process's environment; a None value unsets the variable."""
        self.name = name
        self.stop_stage = stop_stage  # children stop in stages, lowest first: each waits for the one before
        child_env = {**os.environ}
        for variable, value in (env or {}).items():
            if value is None:
                child_env.pop(variable, None)
            else:
                child_env[variable] = value
        if cpus is not None:
            # torch sizes its thread pool by the machine, not the affinity mask: oversubscribed
            # threads on a pinned process would fight over its cores.
            child_env["OMP_NUM_THREADS"] = str(len(cpus))
        logger.info("starting %s: %s", name, " ".join(argv))
        self.process = subprocess.Popen(argv, env=child_env, preexec_fn=_child_setup(cpus))

    @property
    def exited(self) -> bool:
        return self.process.poll() is not None

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s; killing it", self.name, timeout_s)
            self.process.kill()
            self.process.wait()
