"""The residual stage on its own, and with per-token-group scales — measured in the forge
through the codec's own quantiser (kvdict_vk.residual), never packaged: dictionary.py
forbids s = 0 in an artifact, and group scales are not in the slot format.

* s = 0 ("residual only"): x ≈ mean + residual, the residual quantised to b bits with the
  stream's static per-channel scale (the RMS per channel of x − mean on calibration
  vectors) and the codec's per-vector clip-optimal step: no atoms at all. Its slot is
  ``residual_words(64, b)`` words: 4 · (2b + 1) B (b 4 → 36 B, b 3 → 28 B).
* group-adaptive scale: the per-channel scale is instead the RMS per channel of the
  residual over each group of 32 consecutive tokens (KIVI's key statistics, applied to
  what the atoms or the mean leave), stored binary16: + 64 × 2 B / 32 tokens = + 4 B per
  head vector. An engine would need a per-group scale block beside the slots.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import codec, residual
from ..residual import residual_words
from .llama import KVHook

GROUP = 32


def _floored(rms: np.ndarray) -> np.ndarray:
    """The forge's floor (pipeline.learn_head_stream): no channel's scale is 0."""
    return np.maximum(rms, 1e-3 * rms.max(axis=-1, keepdims=True) + 1e-12)


def learn_means_scales(kv: list) -> list:
    """Per layer, per stream: (mean, scale), each (n_kv, head_dim), from calibration K/V."""
    out = []
    for k, v in kv:
        pair = []
        for x in (k, v):
            x = np.asarray(x, np.float64)
            mean = x.mean(axis=1)
            rms = np.sqrt(np.mean((x - mean[:, None]) ** 2, axis=1))
            pair.append((mean.astype(np.float32), _floored(rms)))
        out.append(tuple(pair))
    return out


def group_scales(r: np.ndarray) -> np.ndarray:
    """r (n_kv, T, d) → per-row scales (n_kv, T, d): binary16 per-channel RMS per 32 tokens."""
    out = np.empty_like(r)
    for t0 in range(0, r.shape[1], GROUP):
        sl = slice(t0, t0 + GROUP)
        rms = np.sqrt(np.mean(r[:, sl] ** 2, axis=1, keepdims=True))
        stored = _floored(rms).astype(np.float16).astype(np.float64)
        out[:, sl] = np.maximum(stored, 2.0 ** -14)  # binary16's least normal: never 0
    return out


def quantise_residual(r: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """r (n_kv, T, d); scale (n_kv, d) static or (n_kv, T, d) per row → what the cache returns."""
    n, t, d = r.shape
    rows = np.broadcast_to(scale[:, None] if scale.ndim == 2 else scale, r.shape).reshape(n * t, d)
    words = residual.quantise(r.reshape(n * t, d), rows, bits)
    return residual.dequantise(words, rows, bits).reshape(n, t, d)


class ResidualOnlyHook(KVHook):
    """s = 0: every layer's K and V as mean + b-bit residual (static or group scales)."""

    def __init__(self, means_scales: list, k_bits: int, v_bits: int, group_adaptive: bool = False):
        self.ms, self.bits, self.group = means_scales, (k_bits, v_bits), group_adaptive

    def __call__(self, layer, k, v):
        out = []
        for j, x in enumerate((k, v)):
            mean, scale = self.ms[layer][j]
            r = np.asarray(x, np.float64) - mean[:, None]
            sc = group_scales(r) if self.group else scale.astype(np.float64)
            out.append((mean[:, None] + quantise_residual(r, sc, self.bits[j])).astype(np.float32))
        return out[0], out[1]


def residual_only_bytes(k_bits: int, v_bits: int, group_adaptive: bool = False, head_dim: int = 64) -> float:
    extra = 2 * head_dim / GROUP if group_adaptive else 0.0
    return 4 * (residual_words(head_dim, k_bits) + residual_words(head_dim, v_bits)) / 2 + extra


class DictLeverHook(KVHook):
    """A lever on the artifact's dictionaries, stream by stream: ``code(d, x, atoms_only)``
    gives what a coded stream's cache would return for x (n_kv, T, head_dim); passthrough
    streams are returned as they are."""

    def __init__(self, art):
        self.art = art

    def code(self, d, x, atoms_only) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, layer, k, v):
        out = []
        for k_not_v, x in ((True, k), (False, v)):
            d = self.art.stream(layer, k_not_v)
            if d is None:
                out.append(x)
                continue
            atoms_only = dataclasses.replace(d, residual_bits=0, residual_scale=None)
            out.append(self.code(d, x, atoms_only).astype(np.float32))
        return out[0], out[1]


class GroupScaleDictHook(DictLeverHook):
    """The dictionary's atoms (binary16 coefficients, as stored), then the residual they
    leave quantised with group-adaptive scales instead of the static per-channel scale."""

    def code(self, d, x, atoms_only):
        approx = codec.roundtrip_heads(x, atoms_only).astype(np.float64)
        r = np.asarray(x, np.float64) - approx
        return approx + quantise_residual(r, group_scales(r), d.residual_bits)
