"""The KIVI format (kvdict_vk.kivi) on the host: its words, its values, the exact window's
rule — the reference the engine's cache and the forge's fidelity rows both use."""
from __future__ import annotations

import numpy as np
import pytest

from kvdict_vk import errors as E
from kvdict_vk import kivi as K
from kvdict_vk.forge import kivi as forge_kivi, llama


def _x(seed=0, shape=(3, 100, 64)):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    x[1, 5, 7] = 40.0  # an outlier channel value
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_words_round_trip_to_the_values(bits):
    x = _x()
    stats, levels = K.quantise_keys(x[:, :32], bits)
    assert stats.dtype == levels.dtype == np.uint32
    assert stats.shape == (3, 1, 64) and levels.shape == (3, 32, K.level_words(64, bits))
    k = K.dequantise_keys(stats, levels, bits, 64)
    np.testing.assert_array_equal(k, K.keys(x[:, :32], bits))
    words = K.quantise_values(x, bits)
    assert words.shape == (3, 100, K.value_row_words(64, bits))
    np.testing.assert_array_equal(K.dequantise_values(words, bits, 64), K.values(x, bits))
    # per (group, channel): the minimum comes back (binary16-rounded) and every value is
    # within half a step of the input
    scale = (stats & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    np.testing.assert_allclose(k.min(1), x[:, :32].min(1), rtol=2e-3, atol=2e-3)
    assert np.all(np.abs(k - x[:, :32]) <= scale * 0.5 + 2e-2 * np.abs(x[:, :32]) + 1e-3)
    # several whole groups in one call: each its own statistics, as one call per group
    stats4, levels4 = K.quantise_keys(x[:, :96], bits)
    assert stats4.shape == (3, 3, 64)
    for g in range(3):
        one = K.quantise_keys(x[:, 32 * g:32 * g + 32], bits)
        assert np.array_equal(stats4[:, g:g + 1], one[0]) and np.array_equal(levels4[:, 32 * g:32 * g + 32], one[1])
    with pytest.raises(E.ShapeError, match="whole groups"):
        K.quantise_keys(x[:, :40], bits)


def test_the_quantiser_is_the_previous_forge_one():
    """The forge's KIVI rows are this module's values: the forge's numbers hold for the engine.
    A group is quantised from its values rounded to binary16 (what the exact window held: the
    device quantises from it), the statistics as the forge computed them before."""
    x = _x(1)
    groups = [slice(t, t + 32) for t in range(0, 100, 32)]
    expect = np.empty_like(x)
    for sl in groups:  # per channel over each 32-token group, as KIVI's paper and the forge did
        g = x[:, sl].astype(np.float16).astype(np.float32)
        lo = g.min(axis=1, keepdims=True).astype(np.float16).astype(np.float32)
        sc = ((g.max(axis=1, keepdims=True) - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint((g - lo) / np.where(sc > 0, sc, np.float32(1))), 0, 15)
        expect[:, sl] = q * sc + lo
    np.testing.assert_array_equal(forge_kivi.keys(x, 4), expect)
    np.testing.assert_array_equal(forge_kivi.keys(x, 4), K.keys(x, 4))
    half = x.astype(np.float16).astype(np.float32)
    assert not np.array_equal(x, half)  # the float32 values' low bits do not matter
    assert all(np.array_equal(a, b) for a, b in zip(K.quantise_keys(x[:, :96], 3), K.quantise_keys(half[:, :96], 3)))
    assert np.array_equal(K.quantise_values(x, 3), K.quantise_values(half, 3))


def test_a_constant_group_is_stored_exactly():
    x = np.full((1, 32, 64), 1.25, np.float32)
    np.testing.assert_array_equal(K.keys(x, 2), x)
    np.testing.assert_array_equal(K.values(x, 2), x)


@pytest.mark.parametrize("recent", [0, 1, 31, 32, 128])
def test_quantised_end_is_the_forge_windows_rule(recent):
    """Token j is quantised for the query at t exactly when the forge's exact-window mask
    (forge.llama, exact_group = GROUP) says it is not exact."""
    hook = forge_kivi.KiviHook(4, 4, recent)
    hook.exact_recent = recent
    t = np.arange(300)
    mask = llama.exact_mask(hook, t, 300) if recent else np.zeros((300, 300), bool)
    for n in (1, 31, 32, 33, 160, 161, 200, 300):
        q = K.quantised_end(n, recent)
        assert q % K.GROUP == 0 and q <= max(0, n - recent)
        if recent:
            assert not mask[n - 1, :q].any() and mask[n - 1, q:n].all()


def test_cache_rows_splits_at_the_quantised_end():
    spec = K.KiviSpec(3, 5, 40)
    x = _x(2, (2, 200, 64))
    k, v = K.cache_rows(x, x + 1, 150, spec)
    q = K.quantised_end(150, 40)
    assert q == 96
    np.testing.assert_array_equal(k[:, :q], K.keys(x[:, :q], 3))
    np.testing.assert_array_equal(v[:, :q], K.values(x[:, :q] + 1, 5))
    np.testing.assert_array_equal(k[:, q:], x[:, q:150].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("bad", [dict(k_bits=1), dict(v_bits=9), dict(k_bits=4.0), dict(recent=-1),
                                 dict(recent=0.5)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(E.DimsError):
        K.KiviSpec(**bad)


def test_bytes_per_vector_at_head_dim_64():
    for bits in (2, 4, 5):
        assert 4 * (K.key_row_words(64, bits) + 64 / K.GROUP) == 8 * bits + 8
        assert 4 * K.value_row_words(64, bits) == 8 * bits + 8 == forge_kivi.quant_bytes(bits)
    with pytest.raises(E.DimsError, match="multiple of 32"):
        K.check_head_dim(48)
