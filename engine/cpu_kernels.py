"""Native CPU kernels (paged decode attention and its KV store, over the model's dtype or 8-bit
rows with their scales (engine/csrc/kv_quant.h), fused elementwise ops, a
linear layer for decode steps on weight panels, linear layers on GGUF's quantized blocks
(:mod:`engine.cpu_quant_kernels`), and a whole decode step of a Llama-family
model strung from them: engine/models/native_decode.py), compiled on first use with the system C
compiler and loaded with ctypes.

One library is built per instruction set, with explicit flags (``ISA_FLAGS``), and
the best one this CPU runs is loaded (:mod:`engine.cpu_features`; a build that fails
falls back to the next weaker ISA). Explicit flags rather than ``-march=native``
make every build testable on any CPU that runs it: the test suite builds the AVX2
library on an AVX-512 machine and checks it too. Plain C needs no torch headers, so
a library builds in about a second; it is cached per sources, compiler, flags and
ISA. Where no compiler is available, or ``SPLITSERVE_CPU_KERNELS=0``, :func:`load`
returns None and every caller keeps its pure-PyTorch path. Kernels run on torch's
own OpenMP thread pool: the library links the same ``libgomp.so.1`` soname torch has
loaded.

The wrappers are on the per-token path (five calls per layer per step), so they do
no more than allocate the output and pass pointers: argument types are declared
once, and a kernel that gets one decode token runs on the calling thread (the C
side decides, by size) instead of waking the thread team.
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

from engine.cpu_features import KERNEL_ISAS, KernelISA, cpu_features
from engine.cpu_quant_kernels import QuantKernels

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"]
ISA_FLAGS: dict[KernelISA, list[str]] = {
    "generic": [],  # the compiler's baseline for the machine: SSE2 on x86-64, NEON on aarch64
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": [*_AVX512, "-mavx512bf16"],
}
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}
# A layer cache's format code (engine/csrc/kv_quant.h) by its dtype; any other dtype: 0, the
# model's own (engine/kv_cache_dtype.py).
_KV_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2}

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _bind(library: ctypes.CDLL, name: str, restype: object, argtypes: list[object]) -> ctypes._CFuncPtr:
    function = getattr(library, name)
    function.restype, function.argtypes = restype, argtypes
    return function


class CPUKernels:
    """Typed wrappers over one ISA's library; each takes CPU tensors of a :meth:`supports`-ed dtype."""

    def __init__(self, library: ctypes.CDLL, isa: KernelISA) -> None:
        built_for = _bind(library, "simd_isa", ctypes.c_char_p, [])().decode()
        if built_for != isa:
            raise RuntimeError(f"the {isa} kernel library reports {built_for}: its build flags did not take (bug)")
        self.isa = isa
        # Bytes the panel kernel reads ahead of itself (the build's PANEL_PREFETCH_BYTES).
        self.panel_prefetch_bytes: int = _bind(library, "panel_prefetch_bytes", _I64, [])()
        self._library = library  # keeps the handle alive as long as the bound functions
        self._decode = _bind(library, "paged_decode_attention", _INT, [_P] * 6 + [_I64] * 7 + [_F32, _INT, _INT])
        self._add_rms_norm = _bind(library, "add_rms_norm", None, [_P] * 4 + [_I64, _I64, _F32, _INT])
        self._silu_and_mul = _bind(library, "silu_and_mul", None, [_P, _P, _I64, _I64, _INT])
        self._rotary = _bind(library, "rotary_embedding", None, [_P, _I64, _P, _I64] + [_P] * 5 + [_I64] * 4 + [_INT])
        self._store_kv = _bind(library, "store_kv", None, [_P, _I64, _P, _I64, _P, _P, _P] + [_I64] * 6 + [_INT])
        self._linear = _bind(library, "linear_panels", _INT, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT])
        self._panel_elements = _bind(library, "panel_elements", _I64, [_I64, _I64, _INT])
        self._pack_panels = _bind(library, "pack_panels", None, [_P, _P, _I64, _I64, _INT])
        self._unpack_panels = _bind(library, "unpack_panels", None, [_P, _P, _I64, _I64, _I64, _INT])
        self._paged_decode_supports = _bind(library, "paged_decode_supports", _INT, [_I64] * 3)
        # decode_forward(model, input_ids, positions, slot_mapping, block_tables, block_table_stride,
        # seq_lens, num_rows, logits, hidden_out, capture_layers, num_captures, captured_out):
        # engine/models/native_decode.py builds the model struct.
        self.decode_forward = _bind(library, "decode_forward", _INT, [_P] * 5 + [_I64, _P, _I64, _P, _P, _P, _I64, _P])
        # Output features per panel of a packed weight (pack_panels).
        self.panel_width: int = _bind(library, "panel_width", _INT, [])()
        # Linear layers and embeddings on GGUF's quantized blocks (engine/csrc/quant_linear.c).
        self.quant = QuantKernels(library, _bind)

    def bind(self, name: str, restype: object, argtypes: list[object]) -> ctypes._CFuncPtr:
        """Another module's function of this library, typed (engine/tensor_parallel's rank flags)."""
        return _bind(self._library, name, restype, argtypes)

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
        """query: [S, H, D]; layer_cache: [2, num_blocks, block_size, H_kv, D] of the query's dtype, or
        [2, num_blocks, block_size, H_kv, D + 4] quantized rows (engine/kv_cache_dtype.py), each block
        contiguous (blocks may lie any stride apart: engine/kv_cache_layout.py); block_tables:
        [S, >=blocks] int32 with unit column stride; seq_lens: [S] int32. Returns [S, H, D], or None
        for shapes beyond the kernel's buffers."""
        num_seqs, num_heads, head_dim = query.shape
        block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
        if not (layer_cache[0, 0].is_contiguous() and block_tables.stride(1) == 1 and seq_lens.is_contiguous()):
            raise RuntimeError(
                "paged_decode_attention needs contiguous cache blocks, block tables rows and seq_lens (bug)"
            )
        query = query.contiguous()
        out = torch.empty_like(query)
        key_ptr = layer_cache.data_ptr()
        status = self._decode(
            query.data_ptr(),
            key_ptr,
            key_ptr + layer_cache.stride(0) * layer_cache.element_size(),
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
            kv_format_code(layer_cache),
        )
        return out if status == 0 else None

    def paged_decode_supports(self, num_heads: int, head_dim: int, block_size: int) -> bool:
        """Whether :meth:`paged_decode_attention` takes these sizes (it returns None beyond them)."""
        return bool(self._paged_decode_supports(num_heads, head_dim, block_size))

    def store_kv(
        self, layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> bool:
        """Write key, value: [T, H_kv, D] (rows may be strided) into their slots of layer_cache:
        [2, num_blocks, block_size, H_kv, D] of their dtype, or quantized rows [..., D + 4] that
        they are quantized into (bf16 or float32 keys and values); slot_mapping: [T] int64. Returns
        False, having written nothing, for layouts the kernel does not take (the caller writes
        them itself)."""
        num_tokens, num_kv_heads, head_dim = key.shape
        kv_format = kv_format_code(layer_cache)
        if not (
            key.stride(2) == value.stride(2) == 1
            and key.stride(1) == value.stride(1) == head_dim
            and key.dtype == value.dtype
            and (key.dtype in _DTYPES if kv_format else key.dtype == layer_cache.dtype)
            and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()
            and layer_cache[0, 0].is_contiguous()
        ):
            return False
        key_ptr = layer_cache.data_ptr()
        self._store_kv(
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            key_ptr,
            key_ptr + layer_cache.stride(0) * layer_cache.element_size(),
            slot_mapping.data_ptr(),
            num_tokens,
            num_kv_heads,
            head_dim,
            layer_cache.shape[2],
            layer_cache.stride(1),
            key.element_size(),
            kv_format,
        )
        return True

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x, residual: [T, hidden], contiguous; with a residual, it becomes ``residual + x`` in place
        and is what gets normalised. Returns ``weight * rms_norm(...)`` [T, hidden]."""
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
        """gate_up: [T, 2 * I] (gate, then up), contiguous -> silu(gate) * up: [T, I]."""
        num_rows, width = gate_up.shape
        out = torch.empty(num_rows, width // 2, dtype=gate_up.dtype)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, _DTYPES[gate_up.dtype])
        return out

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [out, in] in the layout :meth:`linear` reads (engine/csrc/linear_panels.c): an
        opaque 1-D tensor of the weight's dtype, about as large as the weight."""
        out_features, in_features = weight.shape
        weight = weight.detach().contiguous()
        dtype = _DTYPES[weight.dtype]
        panels = torch.empty(self._panel_elements(out_features, in_features, dtype), dtype=weight.dtype)
        self._pack_panels(weight.data_ptr(), panels.data_ptr(), out_features, in_features, dtype)
        return panels

    def unpack_panels(self, panels: torch.Tensor, in_features: int, start: int, end: int) -> torch.Tensor:
        """Panels ``start``..``end`` as float32 columns of the transposed weight: [in, (end - start) *
        panel_width], covering output features ``start * panel_width`` on (zero past the last one)."""
        columns = torch.empty(in_features, (end - start) * self.panel_width, dtype=torch.float32)
        self._unpack_panels(panels.data_ptr(), columns.data_ptr(), in_features, start, end, _DTYPES[panels.dtype])
        return columns

    def linear(
        self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """For decode steps: x: [T, in] with contiguous rows; ``panels`` from :meth:`pack_panels`,
        bias: [out], all of one dtype. Returns ``x @ weight.T + bias``: [T, out], accumulated in
        float32 (and rounded once in bf16)."""
        num_rows, in_features = x.shape
        out = torch.empty(num_rows, out_features, dtype=x.dtype)
        status = self._linear(
            x.data_ptr(),
            x.stride(0),
            panels.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            num_rows,
            in_features,
            out_features,
            _DTYPES[x.dtype],
        )
        if status != 0:
            raise MemoryError(f"linear: no memory for a float32 copy of a {num_rows} x {in_features} input")
        return out

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q: [T, H, D] and k: [T, H_kv, D] (rows may be strided; heads and D contiguous),
        neox style, in one call, into new contiguous tensors; cos, sin: [max_positions, D / 2] in
        q's dtype; positions: [T] int64."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        # empty_like: building a tensor from a torch.Size costs twice as much, per call.
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
        k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
        self._rotary(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            q_out.data_ptr(),
            k_out.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            _DTYPES[q.dtype],
        )
        return q_out, k_out


def kv_format_code(layer_cache: torch.Tensor) -> int:
    """How the kernels read a layer cache's rows (engine/csrc/kv_quant.h): 0, the model's dtype; 1, int8
    rows; 2, fp8 e4m3 rows (engine/kv_cache_dtype.py)."""
    return _KV_FORMATS.get(layer_cache.dtype, 0)


def load(isa: KernelISA | None = None) -> CPUKernels | None:
    """The compiled kernels for ``isa`` (default: the best this CPU runs, falling back to weaker
    builds if that one fails), or None when none can be built here (logged once)."""
    if os.environ.get("SPLITSERVE_CPU_KERNELS", "1") == "0":
        return None
    if isa is not None:
        return _load_isa(isa)
    return _load_best()


@functools.cache
def _load_best() -> CPUKernels | None:
    best = cpu_features().kernel_isa
    for isa in reversed(KERNEL_ISAS[: KERNEL_ISAS.index(best) + 1]):
        kernels = _load_isa(isa)
        if kernels is not None:
            logger.info("CPU kernels: the %s build, panels read %d bytes ahead", isa, kernels.panel_prefetch_bytes)
            return kernels
    return None


@functools.cache
def _load_isa(isa: KernelISA) -> CPUKernels | None:
    features = cpu_features()
    if isa not in features.supported_isas:
        raise ValueError(
            f"CPU kernels for {isa} would not run on this CPU ({features.describe()}); "
            f"use one of {', '.join(features.supported_isas)}"
        )
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention uses the slower pure-PyTorch path")
        return None
    try:
        return CPUKernels(ctypes.CDLL(str(_build(compiler, isa))), isa)
    except (OSError, subprocess.CalledProcessError) as error:
        stderr = getattr(error, "stderr", b"") or b""
        logger.warning("building the %s CPU kernels failed (%s %s)", isa, error, stderr.decode(errors="replace")[-500:])
        return None


def clear_cache() -> None:
    """Forget the loaded libraries (tests that change the environment)."""
    _load_best.cache_clear()
    _load_isa.cache_clear()


def _tuning_flags() -> list[str]:
    """Build settings the environment may change: ``SPLITSERVE_PANEL_PREFETCH_BYTES``, how far
    ahead the panel kernel asks for its weights (csrc/linear_panels.c; 0 turns it off), for a
    CPU whose memory wants another distance than the one measured."""
    value = os.environ.get("SPLITSERVE_PANEL_PREFETCH_BYTES")
    if value is None:
        return []
    if not value.isdigit() or int(value) > 1 << 20:
        raise ValueError(f"SPLITSERVE_PANEL_PREFETCH_BYTES must be a byte count from 0 to {1 << 20}, got {value!r}")
    return [f"-DPANEL_PREFETCH_BYTES={int(value)}"]


def _build(compiler: str, isa: KernelISA) -> Path:
    sources = sorted(_SOURCE_DIR.glob("*.c"))
    flags = [*_FLAGS, *ISA_FLAGS[isa], *_tuning_flags()]
    key = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(_SOURCE_DIR.iterdir())))
    key.update(" ".join([compiler, *flags, platform.machine()]).encode())
    from engine.default_model import cache_dir

    target = cache_dir() / "kernels" / f"splitserve_cpu-{isa}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, *map(str, sources), "-o", str(built), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
        built.replace(target)
    logger.info("built CPU kernels for %s: %s", isa, target)
    return target
