"""Random but well-formed slots, for the tests and the benchmarks.

Decoding, reconstruction and attention cost nearly the same whatever the codes say, and their
results are checked against the NumPy decode of the very same words, so these stand in
for OMP-encoded data wherever encoding that many rows would only cost time. The exception is
how often code words of nearby tokens pick the same atom (attend_flash_coded hands V's to the
atom's owner): real code words repeat atoms more than uniform ones (lab/NOTEBOOK.md, attend_flash_coded:
the atom usage of captured code words),
so with_code_words puts captured code words into such slots.
"""
from __future__ import annotations

import numpy as np

from . import codec
from .dictionary import StreamDict, round_to_f16


def random_dicts(rng: np.random.Generator, head_dim: int, n_atoms: int, sparsity: int, bits, heads: int = 1) -> list:
    """(K, V) StreamDicts of ``heads`` dictionaries each (per KV head where heads > 1):
    random binary16 atoms (as the forge rounds them), a small mean, residual stages of
    ``bits`` = (K bits, V bits) (0: atoms only) with positive scales."""
    return [StreamDict(round_to_f16(rng.standard_normal((heads, n_atoms, head_dim), dtype=np.float32)
                                    / np.sqrt(head_dim)),
                       mean=rng.standard_normal((heads, head_dim), dtype=np.float32) * 0.1, sparsity=sparsity,
                       residual_bits=b, residual_scale=rng.random((heads, head_dim), dtype=np.float32) + 0.5 if b else None)
            for b in bits]


def random_codes(rng: np.random.Generator, shape, n_atoms: int, *, out_of_range: float = 0.0) -> np.ndarray:
    """Code words of ``shape`` (…, s): uniform atom indices and N(0, 1) binary16
    coefficients; a fraction ``out_of_range`` gets an atom index ≥ n_atoms (where one
    fits in 16 bits), which every decoder must read as zero."""
    shape = tuple(shape)
    idx = rng.integers(0, n_atoms, shape)
    if out_of_range and n_atoms < 1 << 16:
        bad = rng.random(shape) < out_of_range
        idx = np.where(bad, rng.integers(n_atoms, 1 << 16, shape), idx)
    return codec.pack_codes(idx, rng.standard_normal(shape))


def random_slots(rng: np.random.Generator, d: StreamDict, shape, *, out_of_range: float = 0.0) -> np.ndarray:
    """Slots (*shape, d.slot_words) uint32 of stream ``d``: random code words, then — with a
    residual stage — random level bits (padding bits too: decoders must ignore them) and a
    finite positive step."""
    shape = tuple(shape)
    codes = random_codes(rng, shape + (d.sparsity,), d.n_atoms, out_of_range=out_of_range)
    extra = d.slot_words - d.sparsity
    if not extra:
        return codes
    levels = rng.integers(0, 1 << 32, shape + (extra - 1,), dtype=np.uint64).astype(np.uint32)
    step = (np.abs(rng.standard_normal(shape + (1,))) * 0.2 + 1e-3).astype(np.float32).view(np.uint32)
    return np.concatenate([codes, levels, step], axis=-1)


def with_code_words(slots: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``slots`` (n_kv, n_ctx, words) with their first s words replaced by captured code words
    ``codes`` (streams, tokens, s) uint32: KV head g takes stream g % streams, token t its
    token t % tokens (a capture tiled to any context keeps its blocks' atom collisions)."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint32 or codes.ndim != 3 or codes.shape[2] > slots.shape[2] or 0 in codes.shape:
        raise ValueError(f"code words must be uint32 (streams, tokens, s ≤ {slots.shape[2]}), "
                         f"got {codes.dtype} {codes.shape}")
    n_kv, n_ctx = slots.shape[:2]
    streams, tokens, s = codes.shape
    out = slots.copy()
    out[..., :s] = codes[np.arange(n_kv)[:, None] % streams, np.arange(n_ctx)[None, :] % tokens]
    return out
