"""Rotated scalar quantisers: each head vector is multiplied by a random-sign Hadamard
matrix (orthonormal, seed fixed), block-quantised with ggml's q4_0 / q4_1 / q5_0 / q5_1,
and rotated back. The rotation spreads outlier channels over the whole vector (QuaRot,
QuIP#), so a 32-element block's scale is not set by one channel. The rotation is a
fixed function of head_dim: it costs no bytes per vector.

q5_0 / q5_1 follow ggml's ``quantize_row_q5_*_ref``: q5_0 d = (signed max-magnitude)/−16,
levels trunc(x/d + 16.5) clipped to 31; q5_1 d = (max − min)/31, m = min, levels
trunc((x − m)/d + 0.5). Blocks of 32: 16 B of low nibbles + 4 B of high bits + fp16 d
(+ fp16 m): 22 / 24 B per block, 44 / 48 B per 64-dim vector.
"""
from __future__ import annotations

import numpy as np

from . import quant
from .llama import KVHook

SEED = 20240601


def hadamard(n: int, seed: int = SEED) -> np.ndarray:
    """Orthonormal H·diag(random signs), n a power of two."""
    if n & (n - 1):
        raise ValueError(f"head_dim {n} is not a power of two")
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=n)
    return (h * signs[None, :] / np.sqrt(n)).astype(np.float32)


def q5_0(x: np.ndarray) -> np.ndarray:
    b = quant.blocks(x)
    first_max = np.argmax(np.abs(b), axis=-1)[..., None]
    d = np.take_along_axis(b, first_max, axis=-1) / np.float32(-16)
    q = np.minimum(np.float32(31), np.trunc(b * quant.safe_inverse(d) + np.float32(16.5)))
    return ((q - np.float32(16)) * quant.f16(d)).reshape(np.shape(x))


def q5_1(x: np.ndarray) -> np.ndarray:
    b = quant.blocks(x)
    lo = b.min(axis=-1, keepdims=True)
    d = (b.max(axis=-1, keepdims=True) - lo) / np.float32(31)
    q = np.minimum(np.float32(31), np.trunc((b - lo) * quant.safe_inverse(d) + np.float32(0.5)))
    return (q * quant.f16(d) + quant.f16(lo)).reshape(np.shape(x))


BLOCK_QUANTISERS = {"q4_0": (quant.q4_0, 36.0), "q4_1": (quant.q4_1, 40.0),
                    "q5_0": (q5_0, 44.0), "q5_1": (q5_1, 48.0)}  # bytes per 64-dim vector


def rotated(x: np.ndarray, fmt: str) -> np.ndarray:
    fn = BLOCK_QUANTISERS[fmt][0]
    h = hadamard(x.shape[-1])
    return (fn(np.asarray(x, np.float32) @ h.T) @ h).astype(np.float32)


def bytes_per_vector(k_fmt: str, v_fmt: str) -> float:
    return (BLOCK_QUANTISERS[k_fmt][1] + BLOCK_QUANTISERS[v_fmt][1]) / 2


class RotatedHook(KVHook):
    def __init__(self, k_fmt: str, v_fmt: str):
        self.k_fmt, self.v_fmt = k_fmt, v_fmt

    def __call__(self, layer, k, v):
        return rotated(k, self.k_fmt), rotated(v, self.v_fmt)
