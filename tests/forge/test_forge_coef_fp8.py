"""The fp8-coefficient lever (kvdict_vk.forge.coef_fp8): E4M3 rounding, the hook's
reconstruction, the bytes it charges."""
import dataclasses

import numpy as np

from conftest import random_artifact
from kvdict_vk import codec
from kvdict_vk.forge import coef_fp8 as F
from kvdict_vk.forge.residual_only import quantise_residual


def _all_e4m3() -> np.ndarray:
    """Every finite E4M3 value, from its bit patterns (1 sign, 4 exponent with bias 7, 3
    mantissa; S.1111.111 is NaN, so 448 is the largest)."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            out.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    vals = np.array(out)
    return np.concatenate([-vals[::-1], vals])


def test_e4m3_is_the_nearest_value_ties_to_even_and_saturates():
    grid = _all_e4m3()
    assert np.array_equal(F.e4m3(grid), grid.astype(np.float32))  # every value is its own rounding
    assert grid.max() == F.E4M3_MAX
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 2.5, 20000), [0.0, -0.0]])
    got = F.e4m3(x).astype(np.float64)
    assert np.isin(got, grid).all()
    inside = np.abs(x) <= F.E4M3_MAX
    best = np.abs(grid[None, :] - x[inside, None]).min(axis=1)
    assert np.array_equal(np.abs(got[inside] - x[inside]), best)  # the nearest (either of a tie)
    assert np.array_equal(got[~inside], np.copysign(F.E4M3_MAX, x[~inside]))
    # ties: to the even mantissa, normals and subnormals alike
    assert F.e4m3([1.0625, 1.1875, -1.1875, 2.0 ** -10, 3 * 2.0 ** -10]).tolist() == \
        [1.0, 1.25, -1.25, 0.0, 2.0 ** -8]
    assert np.signbit(F.e4m3([-0.0])[0])


def test_the_hook_is_omp_then_e4m3_coefficients_then_the_residual_stage():
    rng = np.random.default_rng(1)
    hd, n_kv = 32, 2
    art = random_artifact(rng, hd, 64, [((4, 3), None), (2, (4, 4))], n_heads=n_kv)
    hook = F.Fp8CoefHook(art)
    for layer in range(2):
        k = rng.standard_normal((n_kv, 40, hd)).astype(np.float32)
        v = rng.standard_normal((n_kv, 40, hd)).astype(np.float32)
        got = hook(layer, k, v)
        for x, out, d in zip((k, v), got, art.layers[layer]):
            if d is None:
                assert out is x
                continue
            atoms_only = dataclasses.replace(d, residual_bits=0, residual_scale=None)
            idx, coef = codec.unpack_codes(codec.encode_heads(x, atoms_only))
            assert not np.array_equal(F.e4m3(coef), coef)  # the rounding does something
            want = codec.decode_heads(codec.pack_codes(idx, F.e4m3(coef)), atoms_only)
            if d.residual_bits:
                want = want + quantise_residual(np.asarray(x, np.float64) - want, d.residual_scale, d.residual_bits)
            assert out.dtype == np.float32 and np.array_equal(out, want.astype(np.float32))
            # the residual stage absorbs most of what the coarser coefficients add
            err = lambda y: float(np.sum((y - x) ** 2) / np.sum(x ** 2))  # noqa: E731
            stored = codec.decode_heads(codec.encode_heads(x, d), d)
            assert err(out) < 4 * err(stored) + 1e-6


def test_three_byte_code_words_are_charged():
    rng = np.random.default_rng(2)
    art = random_artifact(rng, 64, 32, [((4, 4), (4, 3)), (None, 8)])
    k0, v0 = art.layers[0]
    v1 = art.layers[1][1]
    stored = [4 * k0.slot_words, 4 * v0.slot_words, 4 * 64, 4 * v1.slot_words]
    assert F.coded_bytes(art, 4) == np.mean(stored)
    assert F.coded_bytes(art, 3) == np.mean([stored[0] - 4, stored[1] - 4, stored[2], stored[3] - 8])
