"""Native CPU kernels (paged decode attention, fused elementwise ops), compiled on
first use with the system C compiler and loaded with ctypes.

Plain C needs no torch headers, so the library builds in about a second; it is
cached per sources, flags and CPU (``-march=native``). Where no compiler is
available, or ``SPLITSERVE_CPU_KERNELS=0``, :func:`load` returns None and every
caller keeps its pure-PyTorch path. Kernels run on torch's own OpenMP thread
pool: the library links the same ``libgomp.so.1`` soname torch has loaded.
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

_SOURCE_DIR = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _bind(library: ctypes.CDLL, name: str, restype: object, argtypes: list[object]) -> ctypes._CFuncPtr:
    function = getattr(library, name)
    function.restype, function.argtypes = restype, argtypes
    return function


class CPUKernels:
    """Typed wrappers; each takes contiguous CPU tensors of a :meth:`supports`-ed dtype."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = _bind(library, "paged_decode_attention", _INT, [_P] * 6 + [_I64] * 7 + [_F32, _INT])
        self._add_rms_norm = _bind(library, "add_rms_norm", None, [_P] * 4 + [_I64, _I64, _F32, _INT])
        self._silu_and_mul = _bind(library, "silu_and_mul", None, [_P, _P, _I64, _I64, _INT])
        self._rotary = _bind(library, "rotary_embedding", None, [_P, _I64, _P, _I64, _P, _P, _P] + [_I64] * 3 + [_INT])

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
        """query: [S, H, D]; layer_cache: [2, num_blocks, block_size, H_kv, D], each block contiguous
        (blocks may lie any stride apart: engine/kv_cache_layout.py); block_tables: [S, >=blocks]
        int32 with unit column stride; seq_lens: [S] int32. Returns [S, H, D], or None for shapes
        beyond the kernel's buffers."""
        num_seqs, num_heads, head_dim = query.shape
        block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
        if not (layer_cache[0, 0].is_contiguous() and block_tables.stride(1) == 1 and seq_lens.is_contiguous()):
            raise RuntimeError("paged_decode_attention needs contiguous cache blocks, block tables rows and seq_lens (bug)")
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
            layer_cache.stride(1),
            scale,
            _DTYPES[query.dtype],
        )
        return out if status == 0 else None

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x, residual: [T, hidden]; with a residual, it becomes ``residual + x`` in place and is what
        gets normalised. Returns ``weight * rms_norm(...)`` [T, hidden]."""
        out = torch.empty_like(x)
        num_rows, hidden = x.shape
        self._add_rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            num_rows,
            hidden,
            eps,
            _DTYPES[x.dtype],
        )
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2 * I] (gate, then up) -> silu(gate) * up: [T, I]."""
        num_rows, width = gate_up.shape
        out = gate_up.new_empty((num_rows, width // 2))
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, _DTYPES[gate_up.dtype])
        return out

    def rotary_embedding(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Rotate x: [T, heads, D] (rows may be strided; heads and D contiguous), neox style, into a new
        contiguous tensor; cos, sin: [max_positions, D / 2] in x's dtype; positions: [T] int64."""
        num_tokens, num_heads, head_dim = x.shape
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype)
        self._rotary(
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            num_tokens,
            num_heads,
            head_dim,
            _DTYPES[x.dtype],
        )
        return out


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
    sources = sorted(_SOURCE_DIR.glob("*.c"))
    key = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(_SOURCE_DIR.iterdir())))
    key.update(" ".join([compiler, *_FLAGS, platform.machine(), _cpu_flags()]).encode())
    from engine.default_model import cache_dir

    target = cache_dir() / "kernels" / f"splitserve_cpu-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *_FLAGS, *map(str, sources), "-o", str(built), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
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
