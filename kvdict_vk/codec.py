"""NumPy reference codec: batched OMP encode, code words, reconstruct.

This module is three things at once: the reference every shader is validated against,
the CPU write path of the cache, and the forge's inner loop. So it is exact first
(float64 where it decides the result) and vectorised over many vectors second.

Code word (docs/DESIGN.md): bits 0–15 atom index, bits 16–31 IEEE-754 binary16 coefficient —
GLSL reads it with ``unpackHalf2x16(w).y`` and needs no optional Vulkan feature.
Attention references live in :mod:`kvdict_vk.attention_ref`.
"""
from __future__ import annotations

import numpy as np

from . import errors as E
from . import residual
from .dictionary import MAX_N_ATOMS, StreamDict

F16_MAX = 65504.0
# Below this squared norm (relative to the atom's, which is 1 after normalisation) a newly
# selected atom is considered linearly dependent on those already chosen: it gets
# coefficient 0 instead of an ill-conditioned division.
_DEPENDENT_NU2 = 1e-10
# Elements of the (chunk × n_atoms) correlation block: 4 MiB of float32, so it and the
# chunk's float64 Gram–Schmidt basis stay cache-resident (measured: 2× faster than 16 MiB).
_CHUNK_ELEMENTS = 1 << 20


# --- code words -------------------------------------------------------------------------

def pack_codes(idx: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """(…, s) atom indices + coefficients → (…, s) uint32 code words."""
    idx = np.asarray(idx)
    coef = np.asarray(coef)
    if idx.shape != coef.shape:
        raise E.ShapeError(f"indices {idx.shape} and coefficients {coef.shape} differ in shape")
    if idx.size and (idx.min() < 0 or idx.max() >= MAX_N_ATOMS):
        raise E.CodeWordError(f"atom index outside 0..{MAX_N_ATOMS - 1}")
    if not np.isfinite(coef).all():
        raise E.CodeWordError("non-finite coefficient")
    if coef.size and np.abs(coef).max() > F16_MAX:
        raise E.CodeWordError(f"coefficient {np.abs(coef).max():.6g} overflows binary16 "
                              f"(atoms too short for this data?)")
    half = coef.astype(np.float16).view(np.uint16).astype(np.uint32)
    return (half << 16) | idx.astype(np.uint32)


def unpack_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(…, s) uint32 code words → (int64 atom indices, float32 coefficients)."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint32:
        raise E.ShapeError(f"code words must be uint32, got {codes.dtype}")
    idx = (codes & 0xFFFF).astype(np.int64)
    coef = (codes >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    return idx, coef


# --- OMP ----------------------------------------------------------------------------------

class _Prepared:
    """One dictionary in its encoding space, ready for OMP: unit-norm atoms per head
    (float64, and transposed float32 for the correlation GEMM) and the factors back to the
    caller's atoms. Built once per StreamDict (they are immutable) and cached on it."""

    def __init__(self, atoms: np.ndarray, metric: np.ndarray | None):
        dw = np.asarray(atoms, np.float64)  # (G, K, d)
        self.w = None if metric is None else np.asarray(metric, np.float64)
        if self.w is not None:
            dw = dw @ self.w.T
        norms = np.linalg.norm(dw, axis=2)
        live = norms > 0  # an atom the metric maps to zero can never help
        self.inv = np.where(live, 1.0 / np.where(live, norms, 1.0), 0.0)  # (G, K)
        self.dn = dw * self.inv[..., None]  # unit-norm atoms (0 rows for dead ones)
        self.dn_t32 = np.ascontiguousarray(self.dn.transpose(0, 2, 1), dtype=np.float32)


def _prepared(d: StreamDict) -> _Prepared:
    prep = d.__dict__.get("_omp_prepared")
    if prep is None:
        prep = _Prepared(d.atoms, d.metric)
        object.__setattr__(d, "_omp_prepared", prep)  # a cache, not state: d stays immutable
    return prep


def omp(x: np.ndarray, atoms: np.ndarray, s: int, *, mean: np.ndarray | None = None,
        metric: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Batched orthogonal matching pursuit.

    x (N, d), atoms (K, d) of any non-zero norm. Returns (idx (N, s) int64, coef (N, s)
    float64) with x ≈ mean + coef · atoms[idx], chosen to minimise ‖W(x − x̂)‖ (W = metric).

    Every step picks the atom with the largest |⟨a, r⟩| / ‖a‖ (normalised correlation),
    then projects the residual out of the span of all chosen atoms (Gram–Schmidt, kept
    in float64). The one large product per step, the residual against all atoms, runs as
    a float32 GEMM; everything that sets a coefficient is float64. Selected atoms are
    always distinct; a linearly dependent pick (duplicate atoms, exhausted residual) gets
    coefficient 0, so degenerate inputs yield a valid, finite code.
    """
    x = np.asarray(x)
    atoms = np.asarray(atoms)
    if x.ndim != 2 or atoms.ndim != 2 or x.shape[1] != atoms.shape[1]:
        raise E.ShapeError(f"omp: x {x.shape} and atoms {atoms.shape} must be (N, d) and (K, d)")
    prep = _Prepared(atoms[None], metric)
    idx, coef = _omp_grouped(x[None], None if mean is None else np.asarray(mean)[None], prep, s)
    return idx[0], coef[0]


def _omp_grouped(x: np.ndarray, mean: np.ndarray | None, prep: _Prepared, s: int):
    """OMP of x (G, N, d) where group g is coded with head g of `prep` (G heads): one call
    for every KV head of a stream. mean (G, d) or None. Returns (idx, coef), each (G, N, s)."""
    g, n, d = x.shape
    n_atoms = prep.dn.shape[1]
    if not 1 <= s <= min(d, n_atoms):
        raise E.ShapeError(f"omp: sparsity {s} outside 1..min(d={d}, n_atoms={n_atoms})")
    xw = x.astype(np.float64)
    if mean is not None:
        xw = xw - np.asarray(mean, np.float64)[:, None, :]
    if prep.w is not None:
        xw = xw @ prep.w.T
    idx = np.zeros((g, n, s), np.int64)
    coef = np.zeros((g, n, s), np.float64)
    chunk = max(16, min(4096, _CHUNK_ELEMENTS // (n_atoms * g)))
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(n, c0 + chunk))
        idx[:, sl], coef[:, sl] = _omp_chunk(xw[:, sl], prep, s)
    coef *= np.take_along_axis(prep.inv[:, None, :], idx.reshape(g, 1, -1), axis=2).reshape(g, n, s)
    return idx, coef  # coefficients for the caller's (unnormalised) atoms


def _omp_chunk(xg: np.ndarray, prep: _Prepared, s: int):
    """OMP of one chunk: xg (G, m, d); returns (idx, coef) each (G, m, s)."""
    g, m, d = xg.shape
    n = g * m
    x = xg.reshape(n, d)
    group = np.repeat(np.arange(g), m)  # the dictionary head of every row
    dn, dn_t32 = prep.dn, prep.dn_t32
    rows = np.arange(n)
    idx = np.zeros((n, s), np.int64)
    q = np.zeros((n, s, d))  # orthonormal basis of the chosen atoms' span, per vector
    r_upper = np.zeros((n, s, s))  # atoms[idx[:, k]] = Σ_i r_upper[:, i, k] q[:, i]
    z = np.zeros((n, s))  # x's coordinates along q
    res = x.copy()
    corr = np.empty((g, m, dn_t32.shape[2]), np.float32)
    flat = corr.reshape(n, -1)
    for k in range(s):
        np.matmul(res.reshape(g, m, d).astype(np.float32), dn_t32, out=corr)
        # argmax |corr| without materialising |corr|: one pass each for max and min.
        hi, lo = flat.argmax(1), flat.argmin(1)
        j = np.where(flat[rows, hi] >= -flat[rows, lo], hi, lo)
        if k:
            dup = (idx[:, :k] == j[:, None]).any(1)
            if dup.any():  # only when every correlation is ~0: take the lowest free index
                taken = (idx[dup, :k, None] == np.arange(k + 1)).any(1)
                j[dup] = np.argmin(taken, axis=1)
        idx[:, k] = j
        v = dn[group, j]  # (n, d) unit atoms
        if k:
            # Gram–Schmidt against the basis; a second pass where the first cancelled
            # more than half the norm ("twice is enough") keeps q orthonormal to
            # machine precision even for near-duplicate atoms.
            qk = q[:, :k]
            h = np.matmul(qk, v[:, :, None])[:, :, 0]
            v -= np.matmul(h[:, None, :], qk)[:, 0]
            again = np.flatnonzero(np.einsum("nd,nd->n", v, v) < 0.5)
            if again.size:
                h2 = np.matmul(qk[again], v[again, :, None])[:, :, 0]
                v[again] -= np.matmul(h2[:, None, :], qk[again])[:, 0]
                h[again] += h2
            r_upper[:, :k, k] = h
        nu2 = np.einsum("nd,nd->n", v, v)
        ok = nu2 > _DEPENDENT_NU2
        nu = np.sqrt(nu2) * ok
        v *= (ok / np.where(ok, nu, 1.0))[:, None]
        q[:, k] = v
        r_upper[:, k, k] = nu
        zk = np.einsum("nd,nd->n", v, res)
        z[:, k] = zk
        res -= zk[:, None] * v
    # Solve R c = z by back-substitution; a dependent atom (R_kk = 0) gets c_k = 0.
    c = np.zeros((n, s))
    for k in range(s - 1, -1, -1):
        diag = r_upper[:, k, k]
        acc = z[:, k] - np.einsum("nj,nj->n", r_upper[:, k, k + 1:], c[:, k + 1:])
        c[:, k] = np.where(diag > 0, acc / np.where(diag > 0, diag, 1.0), 0.0)
    return idx.reshape(g, m, s), c.reshape(g, m, s)


# --- stream-level encode / decode ------------------------------------------------------------
#
# A coded head vector is one *slot* of StreamDict.slot_words uint32 words: `sparsity` code
# words, then (residual_bits > 0) the residual stage of kvdict_vk.residual.

def reconstruct(codes: np.ndarray, atoms: np.ndarray, mean: np.ndarray | None = None,
                dtype=np.float64) -> np.ndarray:
    """Code words (…, s) → head vectors (…, head_dim): mean + Σ coef · atoms[idx], for
    one head's atoms (n_atoms, head_dim).

    Out-of-range code words (atom index ≥ n_atoms) reconstruct as if their coefficient
    were 0 — the same documented behaviour as the shaders, which never read past the atoms.
    """
    idx, coef = unpack_codes(codes)
    atoms = np.asarray(atoms)
    n_atoms = atoms.shape[0]
    bad = idx >= n_atoms
    if bad.any():
        idx = np.where(bad, 0, idx)
        coef = np.where(bad, 0, coef)
    out = np.einsum("...s,...sd->...d", coef.astype(dtype), atoms.astype(dtype)[idx])
    if mean is not None:
        out += np.asarray(mean, dtype)
    return out


def encode(x: np.ndarray, d: StreamDict, head: int = 0, sparsity: int | None = None) -> np.ndarray:
    """Head vectors (N, head_dim) of KV head `head` → slots (N, slot_words) uint32."""
    g = 0 if d.n_heads == 1 else head
    d.head(head)  # range check
    return _encode_groups(np.asarray(x)[None], d, [g], sparsity)[0]


def _encode_groups(x: np.ndarray, d: StreamDict, heads: list, sparsity: int | None = None) -> np.ndarray:
    """x (G, N, head_dim), group i coded with dictionary head heads[i] → (G, N, slot_words).
    One OMP call and one residual call for all groups: per-call overhead is what a
    one-token append pays."""
    s = d.sparsity if sparsity is None else sparsity
    prep = _prepared(d)
    sub = prep if list(heads) == list(range(prep.dn.shape[0])) else _subset(prep, heads)
    mean = None if d.mean is None else d.mean[heads]
    idx, coef = _omp_grouped(x, mean, sub, s)
    codes = pack_codes(idx, coef)
    if not d.residual_bits:
        return codes
    g, n, hd = x.shape
    # The residual is taken against what the decoder will rebuild (binary16 coefficients).
    approx = np.stack([reconstruct(codes[i], d.atoms[h], None if d.mean is None else d.mean[h])
                       for i, h in enumerate(heads)])
    scale = np.repeat(d.residual_scale[heads], n, axis=0)  # per row
    res = residual.quantise((np.asarray(x, np.float64) - approx).reshape(g * n, hd), scale, d.residual_bits)
    return np.concatenate([codes, res.reshape(g, n, -1)], axis=2)


def _subset(prep: _Prepared, heads: list) -> _Prepared:
    sub = _Prepared.__new__(_Prepared)
    sub.w, sub.inv, sub.dn, sub.dn_t32 = prep.w, prep.inv[heads], prep.dn[heads], prep.dn_t32[heads]
    return sub


def decode(slots: np.ndarray, d: StreamDict, head: int = 0, dtype=np.float64,
           sparsity: int | None = None) -> np.ndarray:
    """Slots (…, slot_words) of KV head `head` → head vectors (…, head_dim)."""
    hd = d.head(head)
    s = hd.sparsity if sparsity is None else sparsity
    slots = np.asarray(slots)
    out = reconstruct(slots[..., :s], hd.atoms, hd.mean, dtype)
    if hd.residual_bits:
        lead = slots.shape[:-1]
        res = residual.dequantise(slots[..., s:].reshape(-1, slots.shape[-1] - s),
                                  hd.residual_scale, hd.residual_bits, dtype)
        out += res.reshape(*lead, -1)
    return out


def encode_heads(x: np.ndarray, d: StreamDict) -> np.ndarray:
    """(n_kv, T, head_dim) → (n_kv, T, slot_words): each KV head through its dictionary."""
    x = np.asarray(x)
    if x.ndim != 3 or x.shape[2] != d.head_dim:
        raise E.ShapeError(f"encode_heads: x {x.shape}, expected (n_kv, T, {d.head_dim})")
    n, t, hdim = x.shape
    if d.n_heads == 1:  # one dictionary: every head and token in one batch
        return _encode_groups(x.reshape(1, n * t, hdim), d, [0]).reshape(n, t, -1)
    if n != d.n_heads:
        raise E.ShapeError(f"encode_heads: {n} KV heads, the dictionary has {d.n_heads}")
    return _encode_groups(x, d, list(range(n)))


def decode_heads(slots: np.ndarray, d: StreamDict, dtype=np.float64) -> np.ndarray:
    """(n_kv, T, slot_words) → (n_kv, T, head_dim)."""
    slots = np.asarray(slots)
    if d.n_heads == 1:
        return decode(slots, d, 0, dtype)
    return np.stack([decode(slots[h], d, h, dtype) for h in range(slots.shape[0])])


def held_heads(x: np.ndarray, d: StreamDict, key_rope=None, t0: int = 0, dtype=np.float64) -> np.ndarray:
    """What a coded stream holds for x (n_kv, T, head_dim) appended at positions t0 …: x
    through d — for keys coded before RoPE (``key_rope``, a kvdict_vk.rope.KeyRope) turned back
    to position 0 first, and the decode turned to the positions (in float64) after."""
    if key_rope is None:
        return decode_heads(encode_heads(x, d), d, dtype)
    return key_rope.rotate(held_heads(key_rope.unturn(x, t0), d), t0).astype(dtype)


def roundtrip(x: np.ndarray, d: StreamDict, head: int = 0) -> np.ndarray:
    """What a dict-coded cache gives back for x (N, head_dim) of KV head `head` (float32)."""
    return decode(encode(x, d, head), d, head, np.float32)


def roundtrip_heads(x: np.ndarray, d: StreamDict) -> np.ndarray:
    """(n_kv, T, head_dim) → what the cache returns, float32."""
    return held_heads(x, d, dtype=np.float32)
