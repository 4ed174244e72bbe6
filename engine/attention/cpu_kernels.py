"""Native CPU attention kernels, compiled on first use with the system C compiler and loaded with ctypes.

A plain C file needs no torch headers, so it builds in about a second; the
shared object is cached per source, flags and CPU (``-march=native``). Where no
compiler is available, or ``SPLITSERVE_CPU_KERNELS=0``, :func:`load` returns
None and the torch backend keeps its pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


class CPUKernels:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = library.paged_decode_attention
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None:
        """query: [S, H, D]; layer_cache: [2, num_blocks, block_size, H_kv, D]; block_tables: [S, >=blocks]
        int32 with unit column stride; seq_lens: [S] int32. Returns [S, H, D], or None for shapes
        beyond the kernel's buffers."""
        num_seqs, num_heads, head_dim = query.shape
        block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
        if not (layer_cache.is_contiguous() and block_tables.stride(1) == 1 and seq_lens.is_contiguous()):
            raise RuntimeError("paged_decode_attention needs contiguous cache, block tables rows and seq_lens (bug)")
        query = query.contiguous()
        out = torch.empty_like(query)
        status = self._decode(
            query.data_ptr(),
            layer_cache[0].data_ptr(),
            layer_cache[1].data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            block_tables.stride(0),
            scale,
            _DTYPES[query.dtype],
        )
        return out if status == 0 else None


@functools.cache
def load() -> CPUKernels | None:
    """The compiled kernels, or None when they cannot be built here (logged once)."""
    if os.environ.get("SPLITSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention uses the slower pure-PyTorch path")
        return None
    try:
        return CPUKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("building CPU kernels failed (%s): using the pure-PyTorch path", error)
        return None


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, platform.machine(), _cpu_flags()]).encode())
    from engine.default_model import cache_dir

    target = cache_dir() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True)
        built.replace(target)
    logger.info("built CPU attention kernels: %s", target)
    return target


def _cpu_flags() -> str:
    """What -march=native compiles for: a cache built on another CPU must not be reused."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
