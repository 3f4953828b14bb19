"""Reference decode attention (float64): the NumPy twin of the attention shaders.

One new query token per call: grouped-query attention (query head h reads KV head
h // (n_heads / n_kv)), causal over the first ``n_used`` cached tokens, scaled softmax
with the maximum subtracted. Two entry points with one signature shape: over an f32
cache, and over a dict-coded cache (each stream either slots + its StreamDict, or f32
rows for a passthrough stream), which decodes in float64 and calls the first.
"""
from __future__ import annotations

import numpy as np

from . import codec
from . import errors as E
from .dictionary import StreamDict


def _check(q, n_kv, t, hd, n_used):
    if q.ndim != 2 or q.shape[1] != hd:
        raise E.ShapeError(f"q {q.shape}, expected (n_heads, {hd})")
    if q.shape[0] % n_kv:
        raise E.ShapeError(f"n_heads {q.shape[0]} is not a multiple of n_kv_heads {n_kv}")
    if not 1 <= n_used <= t:
        raise E.ShapeError(f"n_used {n_used} outside 1..{t}")


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_used: int, scale: float | None = None) -> np.ndarray:
    """q (n_heads, hd); k, v (n_kv, n_ctx, hd) → (n_heads, hd) float64."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    n_kv, t, hd = k.shape
    _check(q, n_kv, t, hd, n_used)
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    group = q.shape[0] // n_kv
    qg = q.reshape(n_kv, group, hd)
    scores = np.einsum("kgd,ktd->kgt", qg, k[:, :n_used]) * scale
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("kgt,ktd->kgd", p, v[:, :n_used]).reshape(q.shape[0], hd)


def _stream(x, d: StreamDict | None, n_used: int) -> np.ndarray:
    x = np.asarray(x)
    if d is None:
        return x[:, :n_used].astype(np.float64)
    if x.dtype != np.uint32:
        raise E.ShapeError("a coded stream is given as uint32 slots")
    return codec.decode_heads(x[:, :n_used], d, np.float64)


def attend_coded(q: np.ndarray, k, v, k_dict: StreamDict | None, v_dict: StreamDict | None,
                 n_used: int, scale: float | None = None) -> np.ndarray:
    """Attention over a dict-coded cache: k / v are (n_kv, n_ctx, slot_words) uint32 slots
    of their StreamDict, or (n_kv, n_ctx, hd) float rows when that dict is None."""
    kk = _stream(k, k_dict, n_used)
    vv = _stream(v, v_dict, n_used)
    return attend(q, kk, vv, n_used, scale)
