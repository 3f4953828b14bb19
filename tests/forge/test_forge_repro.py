"""Reproducible learning: the same calibration vectors give the same dictionary bytes
whatever the number of worker processes and BLAS threads (learning pins BLAS to one
thread, so every reduction runs in one order)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvdict_vk import errors as E
from kvdict_vk.forge import parallel, pipeline as P


def _stream(seed: int) -> np.ndarray:
    """(3 KV heads, 400 tokens, 64) vectors with a few strong directions, like real keys."""
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((12, 64))
    return (rng.standard_normal((3, 400, 12)) @ basis + 0.1 * rng.standard_normal((3, 400, 64))).astype(np.float32)


def _learned_bytes(monkeypatch, workers: int, outer_blas: int, per_head: bool = True) -> bytes:
    monkeypatch.setenv("KVDICT_FORGE_WORKERS", str(workers))
    kv = [(_stream(1), _stream(2)), (_stream(3), _stream(4))]
    cfg = P.ForgeConfig(n_atoms=48, train_vectors=300, iters=3, k_bits=4, v_bits=3, f16_atoms=False,
                        per_head=per_head)
    with parallel.blas_threads(outer_blas):
        art = P.learn_artifact(kv, cfg)
    return b"".join(a.tobytes() for pair in art.layers for d in pair
                    for a in (d.atoms, d.mean, d.residual_scale))


def test_the_forge_writes_binary16_atoms(monkeypatch):
    """By default every learned atom is a binary16 value (so the arena keeps its atoms in
    binary16), within 2^-11 of what the learner found; f16_atoms=False keeps
    the learner's float32 bits."""
    from kvdict_vk.layout import build_layout
    monkeypatch.setenv("KVDICT_FORGE_WORKERS", "1")
    kv = [(_stream(1), _stream(2))]
    cfg = P.ForgeConfig(n_atoms=48, train_vectors=300, iters=3, k_bits=4, v_bits=3)
    art = P.learn_artifact(kv, cfg)
    raw = P.learn_artifact(kv, dataclasses.replace(cfg, f16_atoms=False))
    assert art.atoms_f16_exact and not raw.atoms_f16_exact
    for d, r in zip(art.layers[0], raw.layers[0]):
        assert np.all(np.abs(d.atoms - r.atoms) <= 2.0 ** -11 * np.abs(r.atoms) + 2.0 ** -25)
    assert all(st.atoms_f16 for st in build_layout(1, 3, 64, 8, art).layers[0].streams)


@pytest.mark.parametrize("per_head", [True, False])
def test_same_bytes_under_any_thread_count(per_head, monkeypatch):
    if parallel.blas_thread_count() is None:
        pytest.fail("no OpenBLAS found in this process: the pin cannot be checked")
    one = _learned_bytes(monkeypatch, workers=1, outer_blas=1, per_head=per_head)
    assert one == _learned_bytes(monkeypatch, workers=1, outer_blas=2, per_head=per_head)
    assert one == _learned_bytes(monkeypatch, workers=2, outer_blas=2, per_head=per_head)


def test_blas_pin_is_restored():
    before = parallel.blas_thread_count()
    with parallel.blas_threads(1):
        assert parallel.blas_thread_count() == 1
    assert parallel.blas_thread_count() == before


_LEARN_SCRIPT = """
import hashlib, os, sys
import numpy as np
from kvdict_vk.forge import pipeline as P
def stream(seed):
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((40, 64))
    return (rng.standard_normal((3, 3000, 40)) @ basis + 0.1 * rng.standard_normal((3, 3000, 64))).astype(np.float32)
# f16_atoms=False: the learner's own float32 bits (rounding to binary16 hides most, not all,
# of the kernels' differences); a dictionary per KV head (three learned in the workers: the
# native kernels' difference shows in these; one shared over the pooled vectors hid it)
cfg = P.ForgeConfig(n_atoms=512, train_vectors=2500, iters=3, k_bits=4, v_bits=3, f16_atoms=False, per_head=True)
art = P.learn_artifact([(stream(1), stream(2))], cfg)
print(hashlib.sha256(b"".join(a.tobytes() for pair in art.layers for d in pair
                              for a in (d.atoms, d.mean, d.residual_scale))).hexdigest())
"""


def _bytes_hash_on(core: str, pin: str | None) -> str:
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", parallel.BLAS_CORE_ENV)}
    env["OPENBLAS_CORETYPE"] = core  # this process's own OpenBLAS, as on a machine of that CPU
    env["KVDICT_FORGE_WORKERS"] = "2"
    if pin is not None:
        env[parallel.BLAS_CORE_ENV] = pin
    out = subprocess.run([sys.executable, "-c", _LEARN_SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_same_bytes_whatever_the_machines_blas_kernels():
    """Two machines in one: the learning process's OpenBLAS on the Haswell and on the
    Sandybridge kernels (OpenBLAS picks them by CPU). Learning runs on one pinned kernel set
    (forge.parallel.learning_core), so the bytes agree; on each machine's own kernels
    ("native") they differ for these vectors — what made learned atoms differ between
    machines before."""
    if parallel.learning_core() is None or "avx" not in parallel.cpu_flags():
        pytest.fail("this CPU cannot run the pinned kernels (AVX2 + FMA): nothing to compare")
    assert _bytes_hash_on("Haswell", None) == _bytes_hash_on("Sandybridge", None)
    assert _bytes_hash_on("Haswell", "native") != _bytes_hash_on("Sandybridge", "native")


def test_evaluation_does_not_depend_on_the_blas_thread_count():
    """The gate's forward runs BLAS at one thread (certify.evaluate): the same windows and
    cache give the same per-token NLL whatever the process's BLAS thread count (the
    forward's last bits do depend on it otherwise — measured on K at 1 vs 2 threads)."""
    from kvdict_vk.forge import certify, tokenizer, texts as T
    toks = tokenizer.encode(T.EVAL_TEXTS["gpl3"].text())[:192]
    windows = [toks[:96], toks[96:]]
    with parallel.blas_threads(1):
        one = certify.baseline_nll(windows)
    with parallel.blas_threads(2):
        two = certify.baseline_nll(windows)
    assert np.array_equal(one, two)


def test_layer_share_learns_one_dictionary_a_run_of_layers_on_their_vectors_pooled(monkeypatch):
    """layer_share 2 over three layers: layers 0 and 1 hold one dictionary a stream, learned on
    both layers' vectors (not layer 0's dictionary copied: it differs from layer 0's own), and
    layer 2 its own, the same bytes as without sharing (its seed and vectors unchanged); a
    passthrough stream stays out of its run's pool."""
    monkeypatch.setenv("KVDICT_FORGE_WORKERS", "1")
    kv = [(_stream(1), _stream(2)), (_stream(3), _stream(4)), (_stream(5), _stream(6))]
    base = P.ForgeConfig(n_atoms=48, train_vectors=600, iters=2, k_bits=4, v_bits=3, f16_atoms=False)
    own = P.learn_artifact(kv, base)
    shared = P.learn_artifact(kv, dataclasses.replace(base, layer_share=2))
    for j in (0, 1):
        a, b = shared.layers[0][j], shared.layers[1][j]
        assert all(np.array_equal(x, y) for x, y in ((a.atoms, b.atoms), (a.mean, b.mean),
                                                      (a.residual_scale, b.residual_scale)))
        assert not np.array_equal(shared.layers[0][j].atoms, own.layers[0][j].atoms)
        assert np.array_equal(shared.layers[2][j].atoms, own.layers[2][j].atoms)
    pooled = P.learn_head_stream(np.concatenate([kv[0][0], kv[1][0]], axis=1), base, True, base.seed)
    assert np.array_equal(shared.layers[0][0].atoms, pooled.atoms)
    part = P.learn_artifact(kv, dataclasses.replace(base, layer_share=2, passthrough=["k:1"]))
    assert part.layers[1][0] is None and np.array_equal(part.layers[0][0].atoms, own.layers[0][0].atoms)
    with pytest.raises(E.DimsError, match="layer_share"):
        P.learn_artifact(kv, dataclasses.replace(base, layer_share=0))
