"""Reproducible learning: the same calibration vectors give the same dictionary bytes
whatever the number of worker processes and BLAS threads (learning pins BLAS to one
thread, so every reduction runs in one order)."""
from __future__ import annotations

import numpy as np
import pytest

from kvdict_vk.forge import parallel, pipeline as P


def _stream(seed: int) -> np.ndarray:
    """(3 KV heads, 400 tokens, 64) vectors with a few strong directions, like real keys."""
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((12, 64))
    return (rng.standard_normal((3, 400, 12)) @ basis + 0.1 * rng.standard_normal((3, 400, 64))).astype(np.float32)


def _learned_bytes(monkeypatch, workers: int, outer_blas: int) -> bytes:
    monkeypatch.setenv("KVDICT_FORGE_WORKERS", str(workers))
    kv = [(_stream(1), _stream(2)), (_stream(3), _stream(4))]
    cfg = P.ForgeConfig(n_atoms=48, train_vectors=300, iters=3, k_bits=4, v_bits=3)
    with parallel.blas_threads(outer_blas):
        art = P.learn_artifact(kv, cfg)
    return b"".join(a.tobytes() for pair in art.layers for d in pair
                    for a in (d.atoms, d.mean, d.residual_scale))


def test_same_bytes_under_any_thread_count(monkeypatch):
    if parallel.blas_thread_count() is None:
        pytest.fail("no OpenBLAS found in this process: the pin cannot be checked")
    one = _learned_bytes(monkeypatch, workers=1, outer_blas=1)
    assert one == _learned_bytes(monkeypatch, workers=1, outer_blas=2)
    assert one == _learned_bytes(monkeypatch, workers=2, outer_blas=2)


def test_blas_pin_is_restored():
    before = parallel.blas_thread_count()
    with parallel.blas_threads(1):
        assert parallel.blas_thread_count() == 1
    assert parallel.blas_thread_count() == before
