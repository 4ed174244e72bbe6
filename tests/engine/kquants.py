"""Valid K-quant blocks (Q4_K, Q5_K, Q6_K), built here: the ``gguf`` package (0.19) dequantizes
the K-quants but cannot quantize them (``gguf.quants.quantize`` raises NotImplementedError).

The scales are chosen the simple way, not by llama.cpp's search (``make_qkx2_quants``): per
sub-block the range over its steps (Q4_K, Q5_K: min clipped at 0, scale ``(max - min) / 15`` or
``/ 31``), per 16-element group the extreme over -32 (Q6_K, so that its scales come out signed
as llama.cpp's do), then each quantized against the super-block's fp16 scale. The blocks are
laid out bit for bit as llama.cpp lays them (``block_q4_K``, ``block_q5_K``, ``block_q6_K``),
which the tests check by dequantizing them with ``gguf.quants.dequantize``.

Also llama.cpp's Q8_K rounding of activations (``quantize_row_q8_K_ref``), in float32 as the
kernels do it, for the reference of the integer kernels (engine/csrc/quant_q8k.c).
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def quantize(values: np.ndarray, qtype: Q) -> np.ndarray:
    """``gguf.quants.quantize``, with the K-quants built here. values: [rows, cols] float32."""
    if qtype not in K_QUANTS:
        return gguf.quants.quantize(values, qtype)
    rows, cols = values.shape
    if cols % 256:
        raise ValueError(f"{qtype.name} rows are whole 256-element super-blocks; got {cols} columns")
    blocks = values.astype(np.float32).reshape(-1, 256)
    packed = _q6_k(blocks) if qtype == Q.Q6_K else _q45_k(blocks, 31 if qtype == Q.Q5_K else 15)
    return packed.reshape(rows, -1)


def _fp16(values: np.ndarray) -> np.ndarray:
    """Rounded to fp16 as stored, back in float32."""
    return values.astype(np.float16).astype(np.float32)


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    safe = np.where(denominator == 0, 1.0, denominator)
    return np.where(denominator == 0, 0.0, numerator / safe).astype(np.float32)


def _q45_k(blocks: np.ndarray, top: int) -> np.ndarray:
    n = blocks.shape[0]
    subs = blocks.reshape(n, 8, 32)
    low = np.minimum(subs.min(axis=-1), 0.0)  # [n, 8]
    sub_scale, sub_min = (subs.max(axis=-1) - low) / top, -low
    d, dmin = _fp16(sub_scale.max(axis=-1) / 63), _fp16(sub_min.max(axis=-1) / 63)  # [n]
    sc = np.clip(np.rint(_ratio(sub_scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(sub_min, dmin[:, None])), 0, 63).astype(np.uint8)
    step, offset = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint(_ratio(subs + offset, step)), 0, top).astype(np.uint8)  # [n, 8, 32]
    scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )
    nibbles = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(n, 128)
    head = [d.astype(np.float16).view(np.uint8).reshape(n, 2), dmin.astype(np.float16).view(np.uint8).reshape(n, 2)]
    if top == 15:
        return np.concatenate([*head, scales, qs], axis=-1)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for s in range(8):
        qh |= ((q[:, s] >> 4) & 1) << s
    return np.concatenate([*head, scales, qh, qs], axis=-1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    groups = blocks.reshape(n, 16, 16)
    extreme = np.take_along_axis(groups, np.abs(groups).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    group_scale = extreme / -32.0  # the extreme maps to -32: scales signed as llama.cpp's
    d = _fp16(np.abs(group_scale).max(axis=-1) / 127)
    sc = np.clip(np.rint(_ratio(group_scale, d[:, None])), -128, 127).astype(np.int8)
    step = (d[:, None] * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(_ratio(groups, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, half, r, l]
    low, high = q & 0x0F, q >> 4
    # ql: per half, bytes 0..31 hold r = 0 (low nibble) and 2 (high), bytes 32..63 r = 1 and 3.
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [
            ql.reshape(n, 128).astype(np.uint8),
            qh.reshape(n, 64).astype(np.uint8),
            sc.view(np.uint8),
            d.astype(np.float16).view(np.uint8).reshape(n, 2),
        ],
        axis=-1,
    )


def through_q8_k(x: np.ndarray) -> np.ndarray:
    """x [rows, cols] (cols whole super-blocks) rounded to Q8_K and back, in float32."""
    blocks = x.astype(np.float32).reshape(-1, 256)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[:, None], axis=-1)  # first largest
    iscale = _ratio(np.full_like(extreme, -127.0), extreme)
    q = np.minimum(np.rint(iscale * blocks), 127)
    d = _ratio(np.ones_like(iscale), iscale)
    return (q * d).astype(np.float32).reshape(x.shape)
