"""The KIVI-style quantised cache (Liu et al., 2024) — its words and their values, the one
definition the engine's cache (``KvArena(cache="kivi")``, shaders/read_rows_kivi.comp) and
the forge's fidelity rows (kvdict_vk.forge.kivi) share.

* Keys per channel over groups of GROUP consecutive tokens: each (group, channel) one
  binary16 scale and one binary16 minimum; each key one b-bit level per channel.
* Values per token over groups of GROUP dims: each (token, dim group) a binary16 scale and
  minimum; one b-bit level per dim.
* A group is quantised from its values rounded to binary16 — what the exact window held
  them as (KIVI keeps its recent tokens in fp16), so a device that quantises from the window
  (shaders/append_kivi.comp) stores the same words as the host.
* Level = round-to-nearest((x − min) / scale) with the *stored* binary16 scale and min,
  clipped to [0, 2^b − 1]; the value is level · scale + min (float32). A zero scale (a
  constant group) stores the minimum exactly.
* The most recent tokens stay binary16 (KIVI's full-precision "residual" of R tokens): a
  token's group is quantised once the whole group is ``recent`` tokens old —
  at n cached tokens, tokens below ``quantised_end(n)`` are quantised, the rest exact; the
  forge's exact-window mask (forge.llama, exact_group = GROUP) is the same rule per query.

Words (little-endian, docs/ARENA.md): a stats word is the scale's binary16 bits in the low
half and the minimum's in the high half; levels pack element e at bit e·b of a per-token
bitstream (the dictionary cache's residual layout, kvdict_vk.residual). Per head vector at
head_dim 64 and b bits: 2b + 2 words = 8b + 8 bytes (keys: levels + 64 stats words per 32
tokens; values: 2 stats words + levels).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import errors as E
from .residual import pack_levels, unpack_levels

GROUP = 32
MIN_BITS, MAX_BITS = 2, 8


@dataclass(frozen=True)
class KiviSpec:
    """A KIVI cache's settings. The default — 4 bits, 128 recent tokens — is the smallest
    KIVI row that passes the forge's gate on every evaluation text (docs/FIDELITY.md)."""
    k_bits: int = 4
    v_bits: int = 4
    recent: int = 128

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            b = getattr(self, name)
            if type(b) is not int or not MIN_BITS <= b <= MAX_BITS:
                raise E.DimsError(f"KIVI {name} must be an integer in {MIN_BITS}..{MAX_BITS}, got {b!r}")
        if type(self.recent) is not int or self.recent < 0:
            raise E.DimsError(f"KIVI recent must be a non-negative integer, got {self.recent!r}")

    @property
    def window(self) -> int:
        """Tokens an exact (binary16) window holds at most: the recent ones and a group not yet quantised."""
        return self.recent + GROUP

    def bits(self, k_not_v: bool) -> int:
        return self.k_bits if k_not_v else self.v_bits


def check_head_dim(head_dim: int) -> None:
    if head_dim % GROUP:
        raise E.DimsError(f"a KIVI cache needs head_dim a multiple of {GROUP}, got {head_dim}")


def level_words(head_dim: int, bits: int) -> int:
    """Words of one vector's levels."""
    return -(-head_dim * bits // 32)


def key_row_words(head_dim: int, bits: int) -> int:
    return level_words(head_dim, bits)


def value_row_words(head_dim: int, bits: int) -> int:
    """A value's words: its dim groups' stats words, then its levels."""
    return head_dim // GROUP + level_words(head_dim, bits)


def stats_words_per_head(n_tokens: int, head_dim: int) -> int:
    """Words of one KV head's key group statistics over n_tokens (a word — binary16 scale
    and minimum — per channel and group, the last group possibly partial)."""
    return -(-n_tokens // GROUP) * head_dim


def window_words_per_head(window: int, head_dim: int) -> int:
    """Words of one KV head's exact window of ``window`` binary16 rows."""
    return window * head_dim // 2


def stats_words(n_kv: int, n_ctx: int, seqs: int, head_dim: int) -> int:
    """Words of a layer's key statistics: n_kv × seqs KIVI heads (KV head, sequence) of
    n_ctx / seqs tokens each (docs/ARENA.md)."""
    return n_kv * seqs * stats_words_per_head(n_ctx // seqs, head_dim)


def window_words(n_kv: int, seqs: int, window: int, head_dim: int) -> int:
    """Words of a layer stream's rings: one a KIVI head (KV head, sequence)."""
    return n_kv * seqs * window_words_per_head(window, head_dim)


def quantised_end(n_tokens: int, recent: int) -> int:
    """Tokens [0, quantised_end) of a cache holding n_tokens are quantised: whole groups
    whose last token is at least ``recent`` tokens behind the newest."""
    return max(0, n_tokens - recent) // GROUP * GROUP


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def _stats_levels(x: np.ndarray, axis: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """One (scale, min) per slice along ``axis`` as binary16, and the levels of x rounded to
    binary16 (the window's values)."""
    x = _f16(x).astype(np.float32)
    lo = _f16(x.min(axis=axis, keepdims=True))
    top = (1 << bits) - 1
    scale = _f16((x.max(axis=axis, keepdims=True) - lo.astype(np.float32)) / np.float32(top))
    s32 = scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, np.float32(1.0))
    levels = np.clip(np.rint((x - lo.astype(np.float32)) / safe), 0, top).astype(np.int64)
    return np.concatenate([scale, lo], axis=axis), levels


def _stats_words(scale_lo: np.ndarray, axis: int) -> np.ndarray:
    """(…, 2, …) binary16 [scale, min] along ``axis`` → uint32 words, scale in the low half."""
    scale, lo = np.split(scale_lo, 2, axis=axis)
    return (scale.view(np.uint16).astype(np.uint32) | (lo.view(np.uint16).astype(np.uint32) << 16)).squeeze(axis)


def _stats_of(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(words, np.uint32)
    return ((w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32),
            (w >> 16).astype(np.uint16).view(np.float16).astype(np.float32))


def _key_groups(t: int) -> tuple[int, int]:
    """(groups, tokens per group) of t keys quantised together: whole GROUPs, or one group
    of t < GROUP tokens."""
    if t <= GROUP:
        return 1, t
    if t % GROUP:
        raise E.ShapeError(f"keys quantise in whole groups of {GROUP} tokens (or one shorter group), got {t}")
    return t // GROUP, GROUP


def quantise_keys(k: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys (n, T, d), T whole groups (or one group of T < GROUP tokens) → (stats words
    (n, groups, d), level words (n, T, level_words))."""
    k = np.asarray(k, np.float32)
    n, t, d = k.shape
    n_g, g = _key_groups(t)
    sl, levels = _stats_levels(k.reshape(n, n_g, g, d), 2, bits)
    return _stats_words(sl, 2), pack_levels(levels.reshape(n * t, d), bits).reshape(n, t, -1)


def dequantise_keys(stats: np.ndarray, levels: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    """(stats (n, groups, d), level words (n, T, L)) → keys (n, T, d) float32."""
    n, t, _ = levels.shape
    n_g, g = _key_groups(t)
    scale, lo = _stats_of(stats)
    q = unpack_levels(np.asarray(levels, np.uint32).reshape(n * t, -1), head_dim, bits).reshape(n, n_g, g, head_dim)
    return (q.astype(np.float32) * scale[:, :, None, :] + lo[:, :, None, :]).reshape(n, t, head_dim)


def quantise_values(v: np.ndarray, bits: int) -> np.ndarray:
    """Values (n, T, d) → words (n, T, value_row_words)."""
    v = np.asarray(v, np.float32)
    n, t, d = v.shape
    check_head_dim(d)
    sl, levels = _stats_levels(v.reshape(n, t, d // GROUP, GROUP), 3, bits)
    stats = _stats_words(sl, 3)  # (n, t, d/GROUP)
    packed = pack_levels(levels.reshape(n * t, d), bits).reshape(n, t, -1)
    return np.concatenate([stats, packed], axis=2)


def dequantise_values(words: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    """Words (n, T, value_row_words) → values (n, T, d) float32."""
    w = np.asarray(words, np.uint32)
    n, t, _ = w.shape
    n_groups = head_dim // GROUP
    scale, lo = _stats_of(w[..., :n_groups])
    q = unpack_levels(w[..., n_groups:].reshape(n * t, -1), head_dim, bits).reshape(n, t, n_groups, GROUP)
    return (q.astype(np.float32) * scale[..., None] + lo[..., None]).reshape(n, t, head_dim).astype(np.float32)


def keys(k: np.ndarray, bits: int) -> np.ndarray:
    """Keys (…, T, d) as the cache returns them once quantised, group by group from token 0
    (a last, partial group takes its statistics over the tokens it has)."""
    k = np.asarray(k, np.float32)
    lead, (t, d) = k.shape[:-2], k.shape[-2:]
    flat = k.reshape(-1, t, d)
    out = np.empty_like(flat)
    whole = t // GROUP * GROUP
    for t0, t1 in ((0, whole), (whole, t)):  # the whole groups, then a partial one
        if t1 > t0:
            out[:, t0:t1] = dequantise_keys(*quantise_keys(flat[:, t0:t1], bits), bits, d)
    return out.reshape(*lead, t, d)


def values(v: np.ndarray, bits: int) -> np.ndarray:
    """Values (…, T, d) as the cache returns them once quantised."""
    v = np.asarray(v, np.float32)
    lead, (t, d) = v.shape[:-2], v.shape[-2:]
    flat = v.reshape(-1, t, d)
    return dequantise_values(quantise_values(flat, bits), bits, d).reshape(*lead, t, d)


def cache_rows(k: np.ndarray, v: np.ndarray, n_tokens: int, spec: KiviSpec) -> tuple[np.ndarray, np.ndarray]:
    """What a KIVI cache holding the first n_tokens of k, v (n_kv, ≥ n_tokens, d) returns for
    them: the quantised groups, then the exact window as binary16 (the engine's reference)."""
    q = quantised_end(n_tokens, spec.recent)
    out = []
    for x, fn, bits in ((k, keys, spec.k_bits), (v, values, spec.v_bits)):
        x = np.asarray(x[:, :n_tokens], np.float32)
        y = x.astype(np.float16).astype(np.float32)
        if q:
            y[:, :q] = fn(x[:, :q], bits)
        out.append(y)
    return out[0], out[1]


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_tokens: int, n_used: int, spec: KiviSpec,
           scale: float | None = None) -> np.ndarray:
    """The float64 reference of attention over a KIVI cache holding the first n_tokens of
    k, v (n_kv, ≥ n_tokens, d): query q (n_heads, d) over its first n_used tokens as the cache
    returns them (cache_rows) — what the fused kernel (attend_flash.comp's KIVI build) and the
    read-out path must equal."""
    from .attention_ref import attend as attend_rows  # attention_ref imports the codec: only here
    kr, vr = cache_rows(k, v, n_tokens, spec)
    return attend_rows(q, kr, vr, n_used, scale)
