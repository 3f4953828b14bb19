"""Second-stage code: the residual left by the atoms, quantised to a few bits per element.

Per head vector the stage stores ``residual_words(head_dim, bits)`` uint32 words:

* a bitstream of ``head_dim`` unsigned levels of ``bits`` bits each, element e at bit
  offset e·bits (little-endian within and across words; a level may straddle two words),
* then one word holding the step Δ as IEEE-754 float32.

Element e reconstructs as ``(level_e − (2^bits − 1)/2) · Δ · scale_e`` where ``scale`` is the
stream's static per-channel scale (learned by the forge: the residual's RMS per channel,
so outlier channels get proportionally coarser steps and the uniform quantiser sees
unit-variance inputs). Δ is chosen per vector among a few multiples of the vector's RMS
(after scaling), the one with the least squared error — a mid-rise uniform quantiser with
MSE-optimal clipping instead of max-abs scaling, which wastes levels on the tail.
"""
from __future__ import annotations

import numpy as np

from . import errors as E

MAX_BITS = 8
# Candidate clipping levels, as multiples of the vector's RMS (the step is 2·clip/L);
# the Gaussian-optimal clip grows from ~0.8 (1 bit) to ~4 (8 bits). The max-abs step
# (no clipping) is always a candidate too. 14 + 1 candidates cost little next to OMP.
_CLIP_MULTIPLIERS = np.geomspace(0.5, 4.5, 14)


def residual_words(head_dim: int, bits: int) -> int:
    """Words per head vector for the residual stage (0 when bits == 0)."""
    if bits == 0:
        return 0
    if not 1 <= bits <= MAX_BITS:
        raise E.DimsError(f"residual bits {bits} outside 1..{MAX_BITS}")
    return -(-head_dim * bits // 32) + 1


def slot_words(head_dim: int, sparsity: int, residual_bits: int) -> int:
    """Words of one coded head vector — a *slot* (docs/FORMAT.md): ``sparsity`` code words,
    then the residual stage. The one definition; the layout, the dictionaries and the
    shaders' dispatch checks all read it."""
    return sparsity + residual_words(head_dim, residual_bits)


def pack_levels(levels: np.ndarray, bits: int) -> np.ndarray:
    """(N, d) uint levels < 2^bits → (N, ceil(d·bits/32)) uint32 bitstream."""
    n, d = levels.shape
    n_words = -(-d * bits // 32)
    # bit j of the stream is bit (j mod bits) of element j // bits: element e sits at bit e·bits,
    # possibly straddling two words (a column at a time: d passes over N rows)
    out = np.zeros((n, n_words + 1), np.uint64)
    for e in range(d):
        w, sh = divmod(e * bits, 32)
        x = np.asarray(levels[:, e], np.uint64) << np.uint64(sh)
        out[:, w] |= x & np.uint64(0xFFFFFFFF)
        out[:, w + 1] |= x >> np.uint64(32)
    return out[:, :n_words].astype(np.uint32)


def unpack_levels(words: np.ndarray, d: int, bits: int) -> np.ndarray:
    """(N, ≥ ceil(d·bits/32)) uint32 bitstream → (N, d) int64 levels: the inverse of pack_levels."""
    n = words.shape[0]
    bit_index = np.arange(d * bits)
    stream_bits = (words[:, bit_index // 32] >> (bit_index % 32).astype(np.uint32)) & 1
    return (stream_bits.reshape(n, d, bits).astype(np.int64) << np.arange(bits)).sum(-1)


def quantise(r: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """Residuals (N, d) → (N, residual_words(d, bits)) uint32. `scale` is (d,) or per row (N, d)."""
    r = np.asarray(r, np.float64)
    n, d = r.shape
    words = np.empty((n, residual_words(d, bits)), np.uint32)
    scale = np.broadcast_to(np.asarray(scale, np.float64), (n, d))
    for c0 in range(0, n, _ROWS_PER_PASS):  # bounds the (rows × candidates × d) temporaries
        sl = slice(c0, min(n, c0 + _ROWS_PER_PASS))
        levels, step = _best_levels(r[sl] / scale[sl], bits)
        words[sl, :-1] = pack_levels(levels, bits)
        words[sl, -1] = step.view(np.uint32)
    return words


_ROWS_PER_PASS = 2048


def _best_levels(u: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the candidate step (float32, as stored) with the least squared error, and
    its levels. All candidates at once: a one-token append pays a handful of NumPy calls."""
    levels_max = (1 << bits) - 1
    half = levels_max / 2.0
    rms = np.sqrt(np.mean(u * u, axis=1))
    amax = np.max(np.abs(u), axis=1)
    steps = np.empty((len(u), len(_CLIP_MULTIPLIERS) + 1))
    steps[:, :-1] = 2.0 * rms[:, None] * _CLIP_MULTIPLIERS / (levels_max + 1)
    steps[:, -1] = 2.0 * amax / levels_max if levels_max > 1 else amax
    steps = steps.astype(np.float32).astype(np.float64)  # what is stored is what is measured
    safe = np.where(steps > 0, steps, 1.0)
    q = np.clip(np.rint(u[:, None, :] / safe[:, :, None] + half), 0, levels_max)
    err = np.sum((u[:, None, :] - (q - half) * steps[:, :, None]) ** 2, axis=2)
    best = np.argmin(err, axis=1)  # first minimum: ties go to the earlier candidate
    rows = np.arange(len(u))
    return q[rows, best].astype(np.int64), steps[rows, best].astype(np.float32)


def dequantise(words: np.ndarray, scale: np.ndarray, bits: int, dtype=np.float64) -> np.ndarray:
    """(N, residual_words) uint32 → residuals (N, d)."""
    words = np.asarray(words)
    if words.dtype != np.uint32:
        raise E.ShapeError(f"residual words must be uint32, got {words.dtype}")
    scale = np.asarray(scale)
    d = scale.shape[-1]
    levels = unpack_levels(words[:, :-1], d, bits)  # scale: (d,) or per row (N, d)
    step = words[:, -1].view(np.float32).astype(dtype)
    half = ((1 << bits) - 1) / 2.0
    return (levels - half).astype(dtype) * step[:, None] * scale.astype(dtype)
