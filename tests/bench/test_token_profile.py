"""The profile breakdown of bench.token_profile, on py-spy raw lines written by hand."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.token_profile import breakdown, classify, cpu_seconds

ENGINE = (
    "thread (0x1): engine-step-loop;AsyncEngine._run (/src/engine/async_engine.py:259);"
    "EngineCore.step (/src/engine/engine_core.py:141)"
)


def test_the_innermost_frame_that_names_a_part_decides() -> None:
    linear = [
        *ENGINE.split(";")[1:],
        "PackedLinear.forward (/src/engine/models/cpu_linear.py:72)",
        "CPUKernels.linear (/src/engine/cpu_kernels.py:186)",
    ]
    norm = [
        *ENGINE.split(";")[1:],
        "NativeCPUOps.add_rms_norm (/src/engine/models/ops.py:66)",
        "CPUKernels.add_rms_norm (/src/engine/cpu_kernels.py:160)",
    ]
    assert classify(linear) == "linear layers"
    assert classify(norm) == "norm / rotary / SiLU kernels"
    assert classify(ENGINE.split(";")[1:]) == "engine core, outputs"
    assert classify(["main (/src/x.py:1)"]) == "other"


def test_samples_are_summed_by_thread_kind_and_part() -> None:
    raw = "\n".join(
        [
            f"{ENGINE};ModelRunner.execute (/src/engine/model_runner.py:128);CPUKernels.linear "
            "(/src/engine/cpu_kernels.py:186) 70",
            f"{ENGINE};ModelRunner.execute (/src/engine/model_runner.py:128);CPUKernels.linear "
            "(/src/engine/cpu_kernels.py:186) 5",
            f"{ENGINE};Sampler.forward (/src/engine/sampler.py:40) 3",
            "thread (0x2): MainThread;run (/src/colocated_svc/server.py:73);EpollSelector.select "
            "(/usr/lib/python3.11/selectors.py:468) 20",
            "not a stack line",
        ]
    )
    assert breakdown(raw) == {
        ("engine step thread", "linear layers"): 75,
        ("engine step thread", "sampling"): 3,
        ("event loop (main thread)", "waiting for events (idle)"): 20,
    }


def test_native_frames_name_the_kernel_or_the_openmp_runtime() -> None:
    step = [
        *ENGINE.split(";")[1:],
        "ModelRunner._forward (/src/engine/model_runner.py:301)",
        "NativeDecodeStep.__call__ (/src/engine/models/native_decode.py:120)",
    ]
    native = "/root/.cache/splitserve/kernels/libsplitserve_cpu_avx2.so"
    assert classify(step) == "decode step in one native call"
    assert classify([*step, f"decode_forward ({native})"]) == "embedding, logits"
    assert classify([*step, f"decode_forward ({native})", f"linear_panels._omp_fn.0 ({native})"]) == "linear layers"
    assert classify([*step, f"decode_forward ({native})", f"paged_decode_attention ({native})"]) == "attention"
    assert classify([*step, f"decode_forward ({native})", f"add_rms_norm._omp_fn.0 ({native})"]) == (
        "norm / rotary / SiLU kernels"
    )
    waiting = [*step, f"linear_panels._omp_fn.0 ({native})", "gomp_team_barrier_wait_end (libgomp.so.1)"]
    assert classify(waiting) == "OpenMP runtime (barriers, team wake-ups)"


def test_cpu_seconds_are_the_process_cpu_time_and_nothing_once_it_is_gone() -> None:
    sum(range(3_000_000))  # some CPU time of our own to read
    # /proc's ticks against getrusage's clock, both the kernel's count of this process's time.
    assert abs(cpu_seconds(os.getpid()) - time.process_time()) < 0.05
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert cpu_seconds(int(gone.stdout)) == 0.0
