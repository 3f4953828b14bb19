"""Keys coded before RoPE: the one definition the artifact (payload ``key_rope``, format
version 3), the codec's callers (a key is rotated back to position 0 before it is coded and
rotated to its position after it is decoded), the arena (a layer's rotation table) and the
shaders (shaders/rope.glsl) share.

RoPE here is the forward's (kvdict_vk.forge.llama): adjacent pairs (2i, 2i + 1) of the first
``dims`` elements turned by t·ω_i, ω_i = theta^(−2i/dims), elements past ``dims`` unturned.

A shader cannot take cos/sin of t·ω in float32 (at t = 131 072 the angle's ulp is 0.008), and
a table of every position costs more than a coded token (lab/probes/rope_tables_probe.py). So
with t = hi·B + lo (B a power of two near √n_ctx) the arena keeps two float32 tables — the
angles hi·B·ω and lo·ω, each cos/sin rounded from float64 — and a shader combines them by the
angle-sum identities in float32: within 1.5e-7 of float64 (the full table's rounding: 3e-8).

Table layout, ``table_rows(n_ctx)`` × ``head_dim`` float32 words: n_hi rows of the angles hi·B,
then the B lo angles. A row is (cos ω_i, sin ω_i) for i < head_dim / 2 in order — so quad c of
a row turns elements 4c … 4c + 3 of a key (pairs 2c and 2c + 1), one vec4 load per chunk — with
(1, 0) past dims / 2. The lo part is quad-major: quad c of every lo angle, lo = 0 … B − 1, then
quad c + 1's — so the quads a workgroup's consecutive tokens turn chunk c with are adjacent
(one memory transaction for many tokens, not one each: attend_flash_coded's K_ROPE build).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import errors as E

MAX_THETA = 1e9


@dataclass(frozen=True)
class KeyRope:
    """The RoPE the keys were coded before: base ``theta``, ``dims`` elements turned (even)."""
    theta: float
    dims: int

    def __post_init__(self):
        t, d = self.theta, self.dims
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or not 1.0 < float(t) <= MAX_THETA:
            raise E.DimsError(f"key_rope theta must be a number in (1, {MAX_THETA:g}], got {t!r}")
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 2 or d % 2:
            raise E.DimsError(f"key_rope dims must be an even integer ≥ 2, got {d!r}")
        object.__setattr__(self, "theta", float(t))
        object.__setattr__(self, "dims", int(d))

    def check_head_dim(self, head_dim: int) -> None:
        """DimsError unless keys of ``head_dim`` can carry this rotation in the arena: dims ≤
        head_dim, and head_dim a multiple of 4 (a table quad turns a vec4 chunk)."""
        if self.dims > head_dim or head_dim % 4:
            raise E.DimsError(f"keys coded before RoPE need dims ({self.dims}) ≤ head_dim and head_dim a "
                              f"multiple of 4, got head_dim {head_dim}")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """ω_i for i < head_dim / 2, float64: 0 past dims / 2 (those pairs do not turn)."""
        w = np.zeros(head_dim // 2)
        w[:self.dims // 2] = self.theta ** (-np.arange(0, self.dims, 2, dtype=np.float64) / self.dims)
        return w

    def rotate(self, x: np.ndarray, t0=0, inverse: bool = False) -> np.ndarray:
        """x (..., T, head_dim) turned to positions t0 … t0 + T − 1 — or, ``t0`` an array of T
        positions, to those (a batch's tokens, each at its own sequence's position) — (``inverse``:
        back from them to position 0), in float64: the reference of every read of a key coded
        before RoPE."""
        x = np.asarray(x, np.float64)
        hd, n = x.shape[-1], x.shape[-2]
        pos = np.arange(t0, t0 + n, dtype=np.float64) if np.ndim(t0) == 0 else np.asarray(t0, np.float64)
        if pos.shape != (n,):
            raise E.DimsError(f"{n} keys to turn, {pos.shape} positions given")
        angle = pos[:, None] * self.inv_freq(hd)[None]
        c, s = np.cos(angle), np.sin(angle) * (-1.0 if inverse else 1.0)
        out = x.copy()
        even, odd = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = even * c - odd * s
        out[..., 1::2] = even * s + odd * c
        return out

    def unturn(self, x: np.ndarray, t0) -> np.ndarray:
        """x (..., T, head_dim), keys at positions t0 … (or at the array t0's), turned back to position 0: what a key
        stream coded before RoPE codes (float32, as the encoders take rows)."""
        return self.rotate(x, t0, inverse=True).astype(np.float32)

    def to_dict(self) -> dict:
        return {"theta": self.theta, "dims": self.dims}


def table_block(n_ctx: int) -> int:
    """B: the smallest power of two whose square is ≥ n_ctx (both tables then ~√n_ctx rows)."""
    b = 1
    while b * b < n_ctx:
        b *= 2
    return b


def table_hi_rows(n_ctx: int) -> int:
    """The table's hi rows, ⌈n_ctx / B⌉; its B lo rows follow them."""
    return -(-n_ctx // table_block(n_ctx))


def table_rows(n_ctx: int) -> int:
    """Rows of a layer's rotation table for positions < n_ctx: the hi rows, then B lo rows."""
    return table_hi_rows(n_ctx) + table_block(n_ctx)


def table(rope: KeyRope, n_ctx: int, head_dim: int) -> np.ndarray:
    """The rotation table, table_rows(n_ctx) × head_dim float32 words (module docstring)."""
    b = table_block(n_ctx)
    pos = np.concatenate([np.arange(table_hi_rows(n_ctx)) * b, np.arange(b)]).astype(np.float64)
    angle = pos[:, None] * rope.inv_freq(head_dim)[None]
    rows = np.empty((pos.size, head_dim), np.float32)
    rows[:, 0::2] = np.cos(angle)
    rows[:, 1::2] = np.sin(angle)
    n_hi = table_hi_rows(n_ctx)
    lo_quads = rows[n_hi:].reshape(b, head_dim // 4, 4).transpose(1, 0, 2)
    return np.concatenate([rows[:n_hi].reshape(-1), lo_quads.reshape(-1)])


def table_rows_of(tab: np.ndarray, n_ctx: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A table's (hi rows (n_hi, head_dim), lo rows (B, head_dim)), each row in pair order."""
    b, n_hi = table_block(n_ctx), table_hi_rows(n_ctx)
    lo = tab[n_hi * head_dim:].reshape(head_dim // 4, b, 4).transpose(1, 0, 2).reshape(b, head_dim)
    return tab[:n_hi * head_dim].reshape(n_hi, head_dim), lo


def rotate_tabled(x: np.ndarray, t0: int, tab: np.ndarray, n_ctx: int) -> np.ndarray:
    """What shaders/rope.glsl computes: x (..., T, head_dim) float32 turned to positions t0 … by
    the two tables' angle sum, every operation in float32 (tests/unit/test_rope.py holds the
    formula against float64)."""
    x = np.asarray(x, np.float32)
    b = table_block(n_ctx)
    t = np.arange(t0, t0 + x.shape[-2])
    hi_rows, lo_rows = table_rows_of(tab, n_ctx, x.shape[-1])
    hi, lo = hi_rows[t // b], lo_rows[t % b]
    hc, hs, lc, ls = hi[:, 0::2], hi[:, 1::2], lo[:, 0::2], lo[:, 1::2]
    c = hc * lc - hs * ls
    s = hs * lc + hc * ls
    out = x.copy()
    even, odd = x[..., 0::2], x[..., 1::2]
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out
