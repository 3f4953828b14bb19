"""GPU reconstruction equals codec.reconstruct (float64), over a grid of shapes.

Code words go in with append_codes, so the GPU is compared with the reference on the very
same words (including out-of-range ones); every arena here is guarded (conftest.make_arena
verifies the sentinels after each test).
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import nmse, random_artifact, random_codes
from kvdict_vk import codec

pytestmark = pytest.mark.gpu

HEAD_DIMS = (32, 48, 64, 128, 256, 36, 50)  # 36, 50: not multiples of 4 → scalar shaders
N_ATOMS = (16, 1024, 4096, 65536)
SPARSITIES = (1, 4, 8, 16, 32)

# (head_dim, n_atoms, n_kv, n_ctx, per layer (K sparsity, V sparsity), None = passthrough).
# Hand-picked so every value of the grid appears, with mixed passthrough layers/streams,
# per-stream sparsity, s = 1 and n_ctx = 8192; plus seeded random draws below.
CASES = [
    (32, 16, 2, 64, ((1, 1),)),
    (48, 1024, 3, 300, ((4, None),)),
    (64, 4096, 2, 8192, ((8, 8),)),
    (128, 65536, 1, 96, ((16, None),)),
    (256, 1024, 2, 200, ((32, 32),)),
    (36, 16, 3, 100, ((None, 4),)),
    (50, 4096, 2, 64, ((8, 1), (None, None))),
    (64, 65536, 2, 256, ((32, 16),)),
    (32, 1024, 3, 128, ((8, 32), (None, None), (1, None))),
    (128, 16, 3, 2048, ((16, 4),)),
]


def _random_cases(n: int, seed: int = 20240601):
    rnd = random.Random(seed)
    out = []
    while len(out) < n:
        hd, na = rnd.choice(HEAD_DIMS), rnd.choice(N_ATOMS)
        if na * hd > 65536 * 64:  # keep the tail (2 × atoms) ≤ 32 MiB: test time and memory
            continue
        pick = lambda: rnd.choice([s for s in SPARSITIES if s <= min(hd, na)] + [None])
        layers = tuple((pick(), pick()) for _ in range(rnd.randint(1, 2)))
        if all(s is None for p in layers for s in p):
            continue
        out.append((hd, na, rnd.randint(1, 4), rnd.choice([16, 333, 1024]), layers))
    return out


def _fill(arena, rng, n_tokens: int, *, out_of_range: float = 0.01):
    """Append n_tokens of random words to every layer (two appends); returns them."""
    lay = arena.layout
    stored = []
    for ll in lay.layers:
        words = []
        for st in ll.streams:
            shape = (lay.n_kv_heads, n_tokens)
            if st.coded:
                words.append(random_codes(rng, shape + (st.sparsity,), lay.n_atoms, out_of_range=out_of_range))
            else:
                words.append(rng.standard_normal(shape + (lay.head_dim,), dtype=np.float32))
        cut = n_tokens // 3
        arena.append_codes(ll.index, words[0][:, :cut], words[1][:, :cut])
        arena.append_codes(ll.index, words[0][:, cut:], words[1][:, cut:])
        stored.append(words)
    return stored


def _check_read(arena, art, stored, layer, t0, t1):
    k, v = arena.read(layer, t0, t1)
    for out, words, d in zip((k, v), stored[layer], art.layers[layer]):
        assert out.dtype == np.float32 and out.shape == (arena.layout.n_kv_heads, t1 - t0, arena.layout.head_dim)
        if d is None:
            assert np.array_equal(out.view(np.uint32), words[:, t0:t1].view(np.uint32))
        else:
            ref = codec.reconstruct(words[:, t0:t1], d.atoms, d.mean, np.float64)
            err = nmse(ref, out)
            assert err <= 1e-12, f"layer {layer} [{t0}, {t1}): NMSE {err:.3g}"


@pytest.mark.parametrize("mapping", ["row", "chunk"])  # CPU-driver and GPU invocation mappings
@pytest.mark.parametrize("case", CASES + _random_cases(4), ids=lambda c: f"hd{c[0]}-na{c[1]}-kv{c[2]}-ctx{c[3]}-{c[4]}")
def test_gpu_reconstruct_equals_reference(case, mapping, make_arena, activate):
    hd, na, n_kv, n_ctx, layers = case
    rng = np.random.default_rng(hash(case) % 2 ** 32)
    art = random_artifact(rng, hd, na, layers)
    activate(art)
    arena = make_arena(len(layers), n_kv, hd, n_ctx, guard_words=4 * hd, shader_mapping=mapping)
    assert arena.mode == "dict"
    stored = _fill(arena, rng, n_ctx)
    for layer in range(len(layers)):
        _check_read(arena, art, stored, layer, 0, n_ctx)  # everything
        _check_read(arena, art, stored, layer, n_ctx // 3, n_ctx - n_ctx // 5)  # a middle range
        t = int(rng.integers(0, n_ctx))
        _check_read(arena, art, stored, layer, t, t + 1)  # one token


@pytest.mark.parametrize("mapping", ["row", "chunk"])
def test_out_of_range_words_contribute_zero_and_read_nothing_outside(mapping, make_arena, activate):
    """Atom index ≥ n_atoms → exactly zero contribution, whatever the coefficient; the
    sentinel after each atoms block is a NaN (and huge if read as a coefficient), so any
    read past the atoms would poison the output."""
    rng = np.random.default_rng(7)
    hd, na, n_kv = 64, 16, 2
    art = random_artifact(rng, hd, na, [(4, 4)])
    activate(art)
    # ≥ 8 atoms' worth of NaN after each block
    arena = make_arena(1, n_kv, hd, 8, guard_words=8 * hd, shader_mapping=mapping)
    f16 = lambda x: np.array(x, np.float16).view(np.uint16).astype(np.uint32) << 16
    good = random_codes(rng, (n_kv, 8, 4), na)
    bad = good.copy()
    edge = np.arange(na, na + 8, dtype=np.uint32)  # the atoms that would sit in the guard
    bad[:, :, 1] = (bad[:, :, 1] & 0xFFFF0000) | edge[:8][None, :]
    bad[:, 0, 2] = f16(np.nan) | 0xFFFF  # NaN coefficient, index 65535
    bad[:, 1, 2] = f16(np.inf) | na
    bad[:, 2, 3] = f16(65504.0) | (na + 1)
    arena.append_codes(0, bad, bad)
    k, v = arena.read(0)
    for out, d in zip((k, v), art.layers[0]):
        assert np.isfinite(out).all()
        idx, coef = codec.unpack_codes(bad)
        keep = np.where(idx < na, coef, 0)
        expected = np.einsum("hts,htsd->htd", keep.astype(np.float64), d.atoms.astype(np.float64)[np.where(idx < na, idx, 0)])
        if d.mean is not None:
            expected += d.mean
        assert nmse(expected, out) <= 1e-12
        assert nmse(codec.reconstruct(bad, d.atoms, d.mean), out) <= 1e-12  # the documented twin


def test_nan_and_inf_coefficients_propagate_like_the_reference(make_arena, activate):
    rng = np.random.default_rng(8)
    hd, na = 32, 64
    art = random_artifact(rng, hd, na, [(8, 2)], means=False)
    activate(art)
    arena = make_arena(1, 1, hd, 16)
    f16 = lambda x: np.array(x, np.float16).view(np.uint16).astype(np.uint32) << 16
    kc = random_codes(rng, (1, 16, 8), na)
    kc[0, 3, 0] = f16(np.inf) | 5
    kc[0, 4, 1] = f16(-np.inf) | 7
    kc[0, 5, 2] = f16(np.nan) | 1
    kc[0, 6, 0], kc[0, 6, 1] = f16(np.inf) | 2, f16(-np.inf) | 3  # inf − inf → NaN
    vc = random_codes(rng, (1, 16, 2), na)
    arena.append_codes(0, kc, vc)
    k, v = arena.read(0)
    ref = codec.reconstruct(kc, art.layers[0][0].atoms)
    assert not np.isfinite(ref[0, 3:7]).all()
    assert nmse(ref, k) <= 1e-12  # also asserts identical NaN/±Inf positions
    assert nmse(codec.reconstruct(vc, art.layers[0][1].atoms), v) <= 1e-12
