"""Dictionary learning for one stream: approximate K-SVD (or MOD) over the batched OMP.

Atoms are learned unit-norm in the space they are coded in: after subtracting the
stream's mean and, when a metric W is given, after mapping by W (the codec's OMP works
in that same space, so what is learned is what is used). The returned StreamDict holds
atoms mapped back to the data space.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import codec
from ..dictionary import StreamDict, round_to_f16


@dataclass
class LearnStats:
    iters: int
    rel_error: list  # per iteration: Σ‖x − x̂‖² / Σ‖x − mean‖² on the training vectors
    replaced: list  # atoms re-seeded per iteration (unused or duplicates)


def _normalise(d: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(d, axis=1, keepdims=True)
    return d / np.where(n > 0, n, 1.0)


def _init_atoms(x: np.ndarray, n_atoms: int, rng) -> np.ndarray:
    """Distinct training vectors (normalised); random directions if there are too few."""
    n = len(x)
    pick = rng.choice(n, size=min(n, n_atoms), replace=False)
    d = x[pick]
    if len(d) < n_atoms:
        d = np.concatenate([d, rng.standard_normal((n_atoms - len(d), x.shape[1]))])
    d = _normalise(d)
    zero = np.linalg.norm(d, axis=1) == 0
    d[zero] = _normalise(rng.standard_normal((int(zero.sum()), x.shape[1])))
    return d


def _residual(x, d, idx, coef):
    return x - np.einsum("ns,nsd->nd", coef, d[idx])


def _ksvd_update(x, d, idx, coef, rng):
    """Approximate K-SVD (one power step per atom, Rubinstein et al. 2008): each atom in
    turn becomes the best rank-1 fit of the residual of the vectors that use it, with
    that atom's own contribution added back; the residual is kept current."""
    res = _residual(x, d, idx, coef)
    flat_idx = idx.reshape(-1)
    order = np.argsort(flat_idx, kind="stable")
    bounds = np.searchsorted(flat_idx[order], np.arange(d.shape[0] + 1))
    unused = []
    for j in rng.permutation(d.shape[0]):
        users = order[bounds[j]:bounds[j + 1]]
        if users.size == 0:
            unused.append(j)
            continue
        rows, slots = np.divmod(users, idx.shape[1])
        g = coef[rows, slots]
        e = res[rows] + np.outer(g, d[j])
        a = e.T @ g
        norm = np.linalg.norm(a)
        if norm == 0:
            unused.append(j)
            continue
        a /= norm
        g_new = e @ a
        res[rows] = e - np.outer(g_new, a)
        d[j] = a
        coef[rows, slots] = g_new
    return d, res, unused


def _mod_update(x, d, idx, coef, ridge=1e-6):
    """Method of optimal directions: D = argmin ‖X − C D‖ given the codes C (sparse)."""
    k = d.shape[0]
    s = idx.shape[1]
    gram = np.zeros((k, k))
    np.add.at(gram, (np.repeat(idx, s, axis=1).ravel(), np.tile(idx, (1, s)).ravel()),
              (coef[:, :, None] * coef[:, None, :]).ravel())
    rhs = np.zeros_like(d)
    np.add.at(rhs, idx.ravel(), (coef[:, :, None] * x[:, None, :]).reshape(-1, x.shape[1]))
    used = np.diag(gram) > 0
    d = d.copy()
    sub = np.ix_(used, used)
    d[used] = np.linalg.solve(gram[sub] + ridge * np.eye(int(used.sum())), rhs[used])
    return _normalise(d), list(np.flatnonzero(~used))


def _reseed(x, d, res, unused, rng):
    """Dead atoms restart at the worst-coded training vectors; near-duplicates too."""
    dup = np.flatnonzero(np.triu(np.abs(d @ d.T) > 0.999, 1).any(0)) if len(d) <= 4096 else []
    dead = sorted(set(int(j) for j in unused) | set(int(j) for j in dup))
    if dead:
        err = np.einsum("nd,nd->n", res, res)
        worst = np.argsort(err)[::-1][: len(dead)]
        fresh = x[worst] if len(worst) == len(dead) else rng.standard_normal((len(dead), x.shape[1]))
        d[dead] = _normalise(fresh + 1e-6 * rng.standard_normal(fresh.shape))
    return len(dead)


def learn_stream(x: np.ndarray, n_atoms: int, sparsity: int, *, iters: int = 10,
                 method: str = "ksvd", use_mean: bool = True, metric: np.ndarray | None = None,
                 seed: int = 0, progress=None, f16_atoms: bool = True) -> tuple[StreamDict, LearnStats]:
    """Learn one stream's dictionary from training vectors x (N, head_dim); f16_atoms: its
    atoms rounded to binary16 values (below)."""
    x = np.asarray(x, np.float64)
    rng = np.random.default_rng(seed)
    mean = x.mean(0) if use_mean else None
    xc = x - mean if use_mean else x
    w = None if metric is None else np.asarray(metric, np.float64)
    xw = xc @ w.T if w is not None else xc
    denom = float(np.einsum("nd,nd->", xw, xw)) or 1.0
    d = _init_atoms(xw, n_atoms, rng)
    stats = LearnStats(iters, [], [])
    for it in range(iters):
        idx, coef = codec.omp(xw, d, sparsity)
        if method == "ksvd":
            d, res, unused = _ksvd_update(xw, d, idx, coef, rng)
        elif method == "mod":
            d, unused = _mod_update(xw, d, idx, coef)
            res = _residual(xw, d, idx, coef)
        else:
            raise ValueError(f"unknown method {method!r} (ksvd or mod)")
        stats.rel_error.append(float(np.einsum("nd,nd->", res, res)) / denom)
        stats.replaced.append(_reseed(xw, d, res, unused, rng))
        if progress is not None:
            progress(it, stats.rel_error[-1])
    atoms = d if w is None else np.linalg.solve(w, d.T).T  # back to the data space
    # Binary16 values (kept as float32): the arena then keeps its one copy of the atoms in
    # binary16 — half the bytes of float32 atoms, and reconstruct gathers a quad (8 halves)
    # per load, half the loads (docs/ARENA.md).
    # Rounding moves an atom by ≤ 2^-11 of itself, far under the codes' own error; the
    # coefficients, residual scales and the certificate come after it.
    atoms = atoms.astype(np.float32)
    return StreamDict(round_to_f16(atoms) if f16_atoms else atoms, None if mean is None else mean.astype(np.float32),
                      None if w is None else w.astype(np.float32), sparsity), stats
