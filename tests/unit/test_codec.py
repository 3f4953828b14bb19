"""The NumPy reference codec: OMP against a textbook OMP and scikit-learn, code words,
reconstruction, and the degenerate inputs that must still give valid, finite codes."""
from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import orthogonal_mp_gram

from kvdict_vk import codec, errors as E
from kvdict_vk.dictionary import StreamDict
from kvdict_vk.metrics import nmse

from helpers import unit_atoms


def textbook_omp(x, atoms, s):
    """One vector at a time, least squares from scratch at every step; atoms of any norm
    are compared by normalised correlation."""
    x = np.asarray(x, np.float64)
    a = np.asarray(atoms, np.float64)
    norms = np.linalg.norm(a, axis=1)
    chosen, coef = [], np.zeros(0)
    r = x.copy()
    for _ in range(s):
        score = np.abs(a @ r) / norms
        score[chosen] = -1
        chosen.append(int(np.argmax(score)))
        sub = a[chosen].T
        coef = np.linalg.lstsq(sub, x, rcond=None)[0]
        r = x - sub @ coef
    return np.array(chosen), coef


def _compare_sets(idx, coef, ref_idx, ref_coef):
    o, ro = np.argsort(idx), np.argsort(ref_idx)
    assert np.array_equal(idx[o], ref_idx[ro])
    np.testing.assert_allclose(coef[o], ref_coef[ro], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("d,k,s", [(16, 32, 1), (16, 64, 4), (48, 200, 8), (64, 1024, 8), (12, 40, 12)])
def test_matches_textbook_omp(d, k, s):
    rng = np.random.default_rng(d * k + s)
    atoms = unit_atoms(rng, k, d)
    x = rng.standard_normal((200, d)).astype(np.float32)
    idx, coef = codec.omp(x, atoms, s)
    for i in range(len(x)):
        _compare_sets(idx[i], coef[i], *textbook_omp(x[i], atoms, s))


@pytest.mark.parametrize("d,k,s", [(64, 1024, 8), (32, 256, 16), (16, 48, 16), (64, 4096, 4)])
def test_matches_scikit_learn(d, k, s):
    rng = np.random.default_rng(k + s)
    atoms = unit_atoms(rng, k, d).astype(np.float64)
    x = rng.standard_normal((400, d))
    idx, coef = codec.omp(x, atoms, s)
    ref = orthogonal_mp_gram(atoms @ atoms.T, atoms @ x.T, n_nonzero_coefs=s).T
    for i in range(len(x)):
        nz = np.flatnonzero(ref[i])
        _compare_sets(idx[i], coef[i], nz, ref[i, nz])


def test_atoms_of_any_norm():
    rng = np.random.default_rng(2)
    atoms = unit_atoms(rng, 300, 32)
    scale = rng.uniform(0.01, 100, size=300).astype(np.float32)
    x = rng.standard_normal((300, 32))
    i1, c1 = codec.omp(x, atoms, 6)
    i2, c2 = codec.omp(x, atoms * scale[:, None], 6)
    assert np.array_equal(i1, i2)
    np.testing.assert_allclose(c2 * scale[i2], c1, rtol=1e-5)
    for i in range(20):
        _compare_sets(i2[i], c2[i], *textbook_omp(x[i], atoms * scale[:, None], 6))


def test_mean_and_metric_are_honoured():
    rng = np.random.default_rng(4)
    d = 24
    atoms = unit_atoms(rng, 128, d)
    mean = rng.standard_normal(d)
    w = np.eye(d) + 0.3 * rng.standard_normal((d, d))
    x = rng.standard_normal((100, d)) + mean
    idx, coef = codec.omp(x, atoms, 5, mean=mean, metric=w)
    for i in range(len(x)):
        _compare_sets(idx[i], coef[i], *textbook_omp(w @ (x[i] - mean), atoms @ w.T, 5))


def test_adversarial_duplicates_zero_vectors_full_sparsity():
    rng = np.random.default_rng(6)
    d = 16
    atoms = unit_atoms(rng, 40, d)
    atoms[7] = atoms[3]  # exact duplicate
    atoms[9] = -atoms[5]  # antiparallel duplicate
    x = rng.standard_normal((60, d))
    x[:5] = 0  # zero vectors
    x[5] = atoms[3] * 2.5  # exactly one (duplicated) atom
    for s in (1, 4, d):  # s = head_dim: exact representation
        idx, coef = codec.omp(x, atoms, s)
        assert np.isfinite(coef).all()
        assert all(len(set(r)) == s for r in idx), "indices must be distinct"
        assert (idx >= 0).all() and (idx < 40).all()
        assert not coef[:5].any()
        rec = np.einsum("ns,nsd->nd", coef, atoms.astype(np.float64)[idx])
        assert np.allclose(rec[5], x[5], atol=1e-6)
        if s == d:
            assert nmse(x, rec) < 1e-20
        ref = orthogonal_mp_gram(atoms.astype(np.float64) @ atoms.T.astype(np.float64),
                                 atoms.astype(np.float64) @ x.T, n_nonzero_coefs=s).T
        ref_rec = ref @ atoms.astype(np.float64)
        assert nmse(ref_rec[5:], rec[5:]) < 1e-12 or s == 1


def test_singular_metric_never_nan():
    rng = np.random.default_rng(8)
    atoms = unit_atoms(rng, 20, 8)
    w = np.diag([1, 1, 1, 1, 0, 0, 0, 0.0])
    atoms[0] = [0, 0, 0, 0, 1, 0, 0, 0]  # invisible under the metric
    idx, coef = codec.omp(rng.standard_normal((30, 8)), atoms, 4, metric=w)
    assert np.isfinite(coef).all() and not coef[idx == 0].any()


def test_code_words_pack_unpack():
    idx = np.array([[0, 1, 65535], [42, 7, 3]])
    coef = np.array([[1.0, -2.5, 65504.0], [1e-3, -0.0, 3.14159]])
    codes = codec.pack_codes(idx, coef)
    assert codes.dtype == np.uint32 and codes[0, 0] == (0x3C00 << 16)  # 1.0 in binary16
    i2, c2 = codec.unpack_codes(codes)
    assert np.array_equal(i2, idx)
    assert np.array_equal(c2, coef.astype(np.float16).astype(np.float32))
    for bad_idx, bad_coef, exc in (([70000], [1.0], E.CodeWordError), ([-1], [1.0], E.CodeWordError),
                                   ([1], [np.nan], E.CodeWordError), ([1], [1e6], E.CodeWordError),
                                   ([1, 2], [1.0], E.ShapeError)):
        with pytest.raises(exc):
            codec.pack_codes(np.array(bad_idx), np.array(bad_coef))
    with pytest.raises(E.ShapeError):
        codec.unpack_codes(np.zeros(3, np.int32))


def test_reconstruct_and_out_of_range_code_words():
    rng = np.random.default_rng(9)
    atoms = unit_atoms(rng, 10, 8)
    mean = rng.standard_normal(8).astype(np.float32)
    codes = codec.pack_codes(np.array([[1, 2], [3, 9]]), np.array([[0.5, -1.0], [2.0, 0.25]]))
    rec = codec.reconstruct(codes, atoms, mean)
    want = mean + 0.5 * atoms[1].astype(np.float64) - atoms[2]
    assert np.allclose(rec[0], want, atol=1e-6)
    bad = codes.copy()
    bad[1, 1] = (bad[1, 1] & 0xFFFF0000) | 12  # index 12 >= n_atoms: contributes zero
    rec2 = codec.reconstruct(bad, atoms, mean)
    assert np.allclose(rec2[1], mean + 2.0 * atoms[3].astype(np.float64), atol=1e-6)


def test_encode_roundtrip_quality_and_sparsity_override():
    rng = np.random.default_rng(10)
    atoms = unit_atoms(rng, 512, 32)
    d = StreamDict(atoms, None, None, 8)
    x = rng.standard_normal((500, 32)).astype(np.float32)
    assert codec.encode(x, d).shape == (500, 8)
    assert codec.encode(x, d, sparsity=4).shape == (500, 4)
    idx, coef = codec.omp(x, atoms, 8)
    exact = np.einsum("ns,nsd->nd", coef, atoms.astype(np.float64)[idx])
    assert nmse(exact, codec.roundtrip(x, d)) < 1e-6  # binary16 coefficients: the only loss
    assert 0.01 < nmse(x, exact) < 0.5  # 8 of 512 atoms in 32 dimensions: an approximation


def test_bad_shapes():
    atoms = np.ones((4, 8), np.float32)
    with pytest.raises(E.ShapeError):
        codec.omp(np.ones((3, 7)), atoms, 2)
    with pytest.raises(E.ShapeError):
        codec.omp(np.ones((3, 8)), atoms, 5)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("hd", [16, 36, 64])
def test_residual_stage_round_trip(bits, hd):
    from kvdict_vk import residual
    rng = np.random.default_rng(bits * hd)
    r = rng.standard_normal((500, hd)) * rng.uniform(0.1, 3, hd)
    scale = r.std(0)
    words = residual.quantise(r, scale, bits)
    assert words.shape == (500, residual.residual_words(hd, bits)) and words.dtype == np.uint32
    rec = residual.dequantise(words, scale, bits)
    # near the optimum uniform quantiser of a Gaussian (0.363, 0.119, 0.037, 0.0115, …)
    assert nmse(r, rec) < {1: 0.40, 2: 0.13, 3: 0.042, 4: 0.013, 5: 0.004, 8: 1e-4}[bits]
    # the levels are exactly what the bitstream says (straddling words included)
    levels = residual.unpack_levels(words[:, :-1], hd, bits)
    assert levels.min() >= 0 and levels.max() < 1 << bits
    assert np.array_equal(residual.pack_levels(levels, bits), words[:, :-1])


def test_slots_per_head_and_residual():
    rng = np.random.default_rng(13)
    d = StreamDict(unit_atoms(rng, 64, 24)[None].repeat(2, 0) * [[[1.0]], [[2.0]]], rng.standard_normal((2, 24)),
                   None, 4, residual_bits=4, residual_scale=np.ones((2, 24)))
    assert d.n_heads == 2 and d.slot_words == 4 + 24 * 4 // 32 + 1
    x = rng.standard_normal((2, 100, 24)).astype(np.float32)
    slots = codec.encode_heads(x, d)
    assert slots.shape == (2, 100, d.slot_words)
    out = codec.decode_heads(slots, d)
    for h in range(2):
        assert np.array_equal(slots[h], codec.encode(x[h], d, h))
        assert nmse(x[h], out[h]) < 0.01
    with pytest.raises(E.ShapeError):
        codec.encode_heads(x[:1], d)
    with pytest.raises(E.LayerIndexError):
        d.head(2)
