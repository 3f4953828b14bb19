"""KIVI-style asymmetric quantisation of the KV cache (Liu et al., 2024): keys per channel
over groups of 32 consecutive tokens, values per token over groups of 32 dims, b bits,
each group with a binary16 scale and a binary16 minimum — optionally with the most recent
tokens kept in binary16 (KIVI's "residual" of R full-precision tokens).

Arrays are (n_kv, T, head_dim); keys are quantised as the cache holds them (after RoPE).
Levels are round-to-nearest of (x − min)/scale with the *stored* (binary16) scale and
min, clipped to [0, 2^b − 1]. A key group that is not yet full (the window's tail) takes
its statistics over the tokens it has.

Bytes per head vector (head_dim 64): b·64/8 for the levels plus 64 channels × 4 B per 32
tokens (keys) or 2 groups × 4 B (values) = 8 B either way: 8b + 8 — 5 bit 48 B, 4 bit
40 B, 3 bit 32 B, 2 bit 24 B. A window of R exact tokens costs R × 128 B (binary16 K or
V rows) instead of their quantised bytes; ``bytes_per_vector`` charges it at the
evaluation's context (1024 tokens), where R of the 1024 cached tokens are exact.
"""
from __future__ import annotations

import numpy as np

from .llama import KVHook, f16

GROUP = 32


def _asym(x: np.ndarray, axis: int, bits: int) -> np.ndarray:
    """Quantise-dequantise x with one binary16 (scale, min) per slice along `axis`."""
    lo = f16(x.min(axis=axis, keepdims=True))
    hi = x.max(axis=axis, keepdims=True)
    levels = (1 << bits) - 1
    scale = f16((hi - lo) / levels)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint((x - lo) / safe), 0, levels)
    return (q * scale + lo).astype(np.float32)


def keys(k: np.ndarray, bits: int) -> np.ndarray:
    """Per channel over groups of GROUP tokens: k (…, T, d)."""
    k = np.asarray(k, np.float32)
    out = np.empty_like(k)
    for t0 in range(0, k.shape[-2], GROUP):
        sl = slice(t0, t0 + GROUP)
        out[..., sl, :] = _asym(k[..., sl, :], -2, bits)
    return out


def values(v: np.ndarray, bits: int) -> np.ndarray:
    """Per token over groups of GROUP dims: v (…, d) with d a multiple of GROUP."""
    v = np.asarray(v, np.float32)
    d = v.shape[-1]
    g = v.reshape(*v.shape[:-1], d // GROUP, GROUP)
    return _asym(g, -1, bits).reshape(v.shape)


def quant_bytes(bits: int, head_dim: int = 64) -> float:
    return bits * head_dim / 8 + 4 * head_dim / GROUP


def bytes_per_vector(k_bits: int, v_bits: int, recent: int = 0, head_dim: int = 64,
                     context: int = 1024) -> float:
    q = (quant_bytes(k_bits, head_dim) + quant_bytes(v_bits, head_dim)) / 2
    return ((context - recent) * q + recent * 2 * head_dim) / context


class KiviHook(KVHook):
    """K and V of every layer KIVI-quantised; `recent` exact tokens (binary16) if > 0."""

    exact_group = GROUP  # a key group is quantised once all its tokens left the window

    def __init__(self, k_bits: int, v_bits: int, recent: int = 0):
        self.k_bits, self.v_bits, self.exact_recent = k_bits, v_bits, recent

    def __call__(self, layer, k, v):
        return keys(k, self.k_bits), values(v, self.v_bits)
