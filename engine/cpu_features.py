"""What this CPU can run: its SIMD features, detected once, and the paths they allow.

The engine picks two things from them at load time, and logs both:

- the **linear path** for bfloat16 weights: oneDNN's pre-packed kernels where oneDNN
  has a bf16 path on this CPU (AVX-512 BW/VL/DQ, or AVX-NE-CONVERT), otherwise a
  fallback that keeps the weights in bf16 (:mod:`engine.models.cpu_linear`);
- the **kernel ISA** of the native C kernels (:mod:`engine.cpu_kernels`): one
  library is built per ISA with explicit ``-m`` flags, and the best one this CPU
  runs is loaded.

``SPLITSERVE_CPU_ISA`` caps what is detected (``generic``, ``avx2``, ``avx512``,
``avx512_bf16``): with ``avx2`` an AVX-512 machine takes the paths of an AVX2-only
one, which is how those paths are tested where no such machine is at hand. It only
ever removes features; it cannot claim ones the CPU lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import platform
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

KernelISA = Literal["generic", "avx2", "avx512", "avx512_bf16"]
# Weakest first: a CPU that runs one runs every ISA before it.
KERNEL_ISAS: tuple[KernelISA, ...] = ("generic", "avx2", "avx512", "avx512_bf16")

CAP_ENV = "SPLITSERVE_CPU_ISA"

# The x86 features each ISA level adds; a cap clears everything above it.
_X86_LEVELS: dict[KernelISA, tuple[str, ...]] = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c", "avx_ne_convert"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "amx_bf16", "amx_tile"),
}


@dataclass(frozen=True, slots=True)
class CPUFeatures:
    """The features splitserve chooses paths by (``/proc/cpuinfo`` flag names)."""

    arch: str  # platform.machine(): x86_64, aarch64, ...
    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512dq: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    amx_tile: bool = False
    avx_ne_convert: bool = False
    neon: bool = False  # aarch64 "asimd"

    @property
    def kernel_isa(self) -> KernelISA:
        """The best native-kernel build this CPU runs."""
        if self.avx512f and self.avx512bw and self.avx512vl and self.avx512dq:
            return "avx512_bf16" if self.avx512_bf16 else "avx512"
        if self.avx2 and self.fma and self.f16c:
            return "avx2"
        return "generic"

    @property
    def supported_isas(self) -> tuple[KernelISA, ...]:
        """Every kernel build this CPU can run, weakest first."""
        return KERNEL_ISAS[: KERNEL_ISAS.index(self.kernel_isa) + 1] if self.arch == "x86_64" else ("generic",)

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN has a bf16 matmul here: the condition torch checks before packing a
        bf16 weight (``mkldnn_reorder_linear_weight``), which raises on any other CPU."""
        if self.arch == "aarch64":
            return False  # oneDNN's aarch64 bf16 goes through ACL, which the CPU wheel lacks
        return (self.avx512bw and self.avx512vl and self.avx512dq) or self.avx_ne_convert

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware: bf16 matmuls are then faster than float32 ones."""
        return self.avx512_bf16 or self.amx_bf16

    def describe(self) -> str:
        names = [field.name for field in dataclasses.fields(self) if field.name != "arch" and getattr(self, field.name)]
        return f"{self.arch} [{' '.join(names) or 'no SIMD extensions detected'}]"


def parse_cpuinfo(text: str, arch: str) -> CPUFeatures:
    """Features from the text of ``/proc/cpuinfo``: x86 lists them under ``flags``, aarch64 under ``Features``."""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            break
    names = {field.name for field in dataclasses.fields(CPUFeatures)} - {"arch", "neon"}
    return CPUFeatures(arch=arch, neon="asimd" in flags, **{name: name in flags for name in names})


def cap_features(features: CPUFeatures, cap: str) -> CPUFeatures:
    """``features`` without anything above the ISA level ``cap``."""
    if cap not in KERNEL_ISAS:
        raise ValueError(f"{CAP_ENV}={cap!r} is not a CPU ISA level; use one of {', '.join(KERNEL_ISAS)}, or unset it")
    above = KERNEL_ISAS[KERNEL_ISAS.index(cap) + 1 :]
    return dataclasses.replace(features, **{name: False for level in above for name in _X86_LEVELS[level]})


def detect(cap: str | None = None, cpuinfo: str | None = None, arch: str | None = None) -> CPUFeatures:
    """This CPU's features (or those of ``cpuinfo`` text), capped at ``cap`` when given."""
    arch = arch or platform.machine()
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    features = parse_cpuinfo(cpuinfo, arch)
    if cpuinfo == "" and arch == "x86_64":
        features = _from_torch(arch)
    return features if cap is None else cap_features(features, cap)


@functools.cache
def cpu_features() -> CPUFeatures:
    """This CPU's features under ``SPLITSERVE_CPU_ISA``; computed once per process."""
    return detect(cap=os.environ.get(CAP_ENV) or None)


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            # The first processor's block is enough: every core of a host has the same features.
            return handle.read().split("\n\n", 1)[0]
    except OSError:
        return ""


def _from_torch(arch: str) -> CPUFeatures:
    """Without /proc/cpuinfo (not Linux): torch's own dispatch level, which says less (no bf16 bits)."""
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    avx2 = capability in ("AVX2", "AVX512")
    avx512 = capability == "AVX512"
    return CPUFeatures(
        arch=arch, avx2=avx2, fma=avx2, f16c=avx2, avx512f=avx512, avx512bw=avx512, avx512vl=avx512, avx512dq=avx512
    )
