"""Baseline KV-cache quantisers, the yardsticks a dictionary-coded cache must beat.

Every quantiser maps float32 head vectors (..., head_dim) to their *dequantised* float32
values (what attention would read back), and comes with its exact storage cost in bytes
per head vector. The ggml block formats follow ggml's ``quantize_row_*_ref`` bit for bit:
the scale is computed in float32, used unrounded to quantise, and stored as fp16 (so the
decoder multiplies by the fp16-rounded scale). Rounding is C's ``roundf`` (half away from
zero), not NumPy's half-to-even.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .llama import KVHook, f16, rotate_half_order

QK = 32  # ggml block size for q8_0 / q4_0 / q4_1


def _roundf(x: np.ndarray) -> np.ndarray:
    return np.copysign(np.floor(np.abs(x) + np.float32(0.5)), x)


def safe_inverse(d: np.ndarray) -> np.ndarray:
    """ggml's ``id = d ? 1.0f/d : 0.0f`` (an all-zero block quantises to zeros)."""
    out = np.zeros_like(d)
    np.divide(np.float32(1.0), d, out=out, where=d != 0)
    return out


def blocks(x: np.ndarray) -> np.ndarray:
    """x (…, d) as (…, d / QK, QK) blocks of ggml's size."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"head_dim {x.shape[-1]} is not a multiple of the block size {QK}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def q8_0(x: np.ndarray) -> np.ndarray:
    b = blocks(x)
    d = np.max(np.abs(b), axis=-1, keepdims=True) / np.float32(127)
    q = _roundf(b * safe_inverse(d))
    return (q * f16(d)).reshape(np.shape(x))


def q4_0(x: np.ndarray) -> np.ndarray:
    b = blocks(x)
    # d = (signed value of largest magnitude, first one on ties) / -8
    first_max = np.argmax(np.abs(b), axis=-1)[..., None]
    d = np.take_along_axis(b, first_max, axis=-1) / np.float32(-8)
    # (int8_t)(x*id + 8.5f) truncates; the argument is >= 0.5 here, so trunc == floor.
    q = np.minimum(np.float32(15), np.trunc(b * safe_inverse(d) + np.float32(8.5)))
    return ((q - np.float32(8)) * f16(d)).reshape(np.shape(x))


def q4_1(x: np.ndarray) -> np.ndarray:
    b = blocks(x)
    lo = b.min(axis=-1, keepdims=True)
    d = (b.max(axis=-1, keepdims=True) - lo) / np.float32(15)
    q = np.minimum(np.float32(15), np.trunc((b - lo) * safe_inverse(d) + np.float32(0.5)))
    return (q * f16(d) + f16(lo)).reshape(np.shape(x))


def _per_vector_symmetric(x: np.ndarray, qmax: int) -> np.ndarray:
    """One fp16 scale per head vector, integers in [-qmax, qmax].

    Unlike ggml we quantise with the fp16-rounded scale (clipping the one-ulp overshoot),
    which is what a careful implementation of a new format would do.
    """
    x = np.asarray(x, dtype=np.float32)
    scale = f16(np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(qmax))
    q = np.clip(_roundf(x * safe_inverse(scale)), -qmax, qmax)
    return q * scale


def int8_token(x: np.ndarray) -> np.ndarray:
    return _per_vector_symmetric(x, 127)


def int4_token(x: np.ndarray) -> np.ndarray:
    return _per_vector_symmetric(x, 7)


def mean_subtracted(quantiser: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """Quantise x - mean and add the mean back; x is (..., T, head_dim).

    The mean is taken over the token axis (-2), i.e. per layer and KV head over the
    window, and is stored as an fp16 vector — so the fp16-rounded mean is what is
    subtracted and added back. Its cost, head_dim*2 bytes per (layer, KV head, window),
    is charged amortised over the window's tokens in ``bytes_per_vector``. It is an
    oracle over the whole window (future tokens included); a streaming decode would take
    it from calibration or from a prefix instead.
    """
    def quantise(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        mean = f16(x.mean(axis=-2, keepdims=True))
        return quantiser(x - mean) + mean

    quantise.__name__ = f"mean_subtracted_{quantiser.__name__}"
    return quantise


BytesFn = Callable[..., float]


def _block_bytes(bytes_per_block: int) -> BytesFn:
    def cost(head_dim: int, window: int = 1024) -> float:
        return head_dim // QK * bytes_per_block
    return cost


def _with_mean(base: BytesFn) -> BytesFn:
    def cost(head_dim: int, window: int = 1024) -> float:
        return base(head_dim, window) + 2 * head_dim / window  # fp16 mean amortised
    return cost


_f16_bytes: BytesFn = lambda head_dim, window=1024: 2 * head_dim
_q8_0_bytes = _block_bytes(QK + 2)  # 32 int8 + fp16 d
_q4_0_bytes = _block_bytes(QK // 2 + 2)  # 32 nibbles + fp16 d
_q4_1_bytes = _block_bytes(QK // 2 + 4)  # 32 nibbles + fp16 d + fp16 m

# name -> (quantiser, bytes_per_vector(head_dim, window=1024))
QUANTISERS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], BytesFn]] = {
    "f32": (lambda x: np.asarray(x, dtype=np.float32), lambda head_dim, window=1024: 4 * head_dim),
    "f16": (f16, _f16_bytes),
    "q8_0": (q8_0, _q8_0_bytes),
    "q4_0": (q4_0, _q4_0_bytes),
    "q4_1": (q4_1, _q4_1_bytes),
    "mean_q8_0": (mean_subtracted(q8_0), _with_mean(_q8_0_bytes)),
    "mean_q4_0": (mean_subtracted(q4_0), _with_mean(_q4_0_bytes)),
    "mean_q4_1": (mean_subtracted(q4_1), _with_mean(_q4_1_bytes)),
    "int8_token": (int8_token, lambda head_dim, window=1024: head_dim + 2),
    "int4_token": (int4_token, lambda head_dim, window=1024: head_dim // 2 + 2),
}


def bytes_per_vector(name: str, head_dim: int, window: int = 1024) -> float:
    return QUANTISERS[name][1](head_dim, window)


class QuantHook(KVHook):
    """Replace K and/or V by their quantised-then-dequantised version before attention.

    ``keys_pre_rope=True`` quantises keys before RoPE (where per-channel structure such as
    a mean is not smeared by the rotation); otherwise after, as a llama.cpp cache does.
    ``key_order`` is the dim order the key quantiser sees: "gguf" (adjacent pairs, what a
    llama.cpp K cache holds) or "hf" (rotate-half, as in the HF model). Block formats give
    different results in each, because each 32-element block holds different dims.
    """

    def __init__(self, name: str, target: str = "kv", keys_pre_rope: bool = False,
                 value_name: str | None = None, key_order: str = "gguf"):
        if target not in ("k", "v", "kv"):
            raise ValueError("target must be 'k', 'v' or 'kv'")
        if key_order not in ("gguf", "hf"):
            raise ValueError("key_order must be 'gguf' or 'hf'")
        self.key_quantiser = QUANTISERS[name][0]
        self.value_quantiser = QUANTISERS[value_name or name][0]
        self.target = target
        self.pre_rope = keys_pre_rope
        self.key_order = key_order

    def _keys(self, k: np.ndarray) -> np.ndarray:
        if self.key_order == "gguf":
            return self.key_quantiser(k)
        to_hf = rotate_half_order(k.shape[-1])
        return self.key_quantiser(k[..., to_hf])[..., np.argsort(to_hf)]

    def keys_pre_rope(self, layer: int, k: np.ndarray) -> np.ndarray:
        return self._keys(k) if "k" in self.target and self.pre_rope else k

    def __call__(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if "k" in self.target and not self.pre_rope:
            k = self._keys(k)
        if "v" in self.target:
            v = self.value_quantiser(v)
        return k, v
