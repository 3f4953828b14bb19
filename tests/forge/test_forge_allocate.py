"""Residual bits per layer and stream (kvdict_vk.forge.allocate): the greedy allocation
meets its byte budget, gives a more sensitive stream at least the bits of a less sensitive
one, and re-coding an artifact at other bits keeps its atoms and scales."""
from __future__ import annotations

import numpy as np
import pytest

from kvdict_vk import codec
from kvdict_vk.dictionary import KvDictArtifact, StreamDict
from kvdict_vk.forge import allocate as AL

HD, S = 64, 4


def _artifact(n_layers=4, bits=4, seed=0) -> KvDictArtifact:
    rng = np.random.default_rng(seed)

    def stream():
        return StreamDict(rng.standard_normal((2, 64, HD)).astype(np.float32),
                          mean=rng.standard_normal((2, HD)).astype(np.float32), sparsity=S, residual_bits=bits,
                          residual_scale=(rng.random((2, HD)) + 0.5).astype(np.float32))
    return KvDictArtifact(HD, 64, S, [(stream(), stream()) for _ in range(n_layers)])


def _sens(art, seed=1) -> dict:
    rng = np.random.default_rng(seed)
    return {(li, kv): float(rng.random() * 10 ** rng.uniform(-6, -3)) for li in range(len(art.layers))
            for kv in (True, False)}


@pytest.mark.parametrize("target", [60.0, 48.0, 40.0, 36.0])
def test_allocation_meets_the_budget_and_follows_sensitivity(target):
    art = _artifact()
    sens, probe = _sens(art), {True: 2, False: 2}
    bits = AL.allocate(art, sens, probe, target)
    got = AL.mean_bytes(art, bits)
    assert got <= target
    assert got > target - 8 / len(bits) - 1e-9  # the last bit taken was needed: one step of 8 B on one stream
    keys = sorted(sens, key=sens.get)
    for lo, hi in zip(keys, keys[1:]):  # same probe bits: more sensitive never gets fewer bits
        assert bits[hi] >= bits[lo]
    # no single move of a bit from one stream to another lowers the modelled cost
    cost = AL.modelled_kl(sens, probe, bits)
    for a in bits:
        for b in bits:
            if a != b and bits[a] > 1 and bits[b] < 8:
                moved = dict(bits)
                moved[a] -= 1
                moved[b] += 1
                assert AL.modelled_kl(sens, probe, moved) >= cost * (1 - 1e-12)


def test_a_budget_below_one_bit_everywhere_is_refused():
    art = _artifact()
    with pytest.raises(ValueError, match="below 1 bit"):
        AL.allocate(art, _sens(art), {True: 2, False: 2}, 20.0)


def test_with_bits_keeps_the_atoms_and_codes_at_the_new_bits():
    art = _artifact(n_layers=2)
    bits = {(0, True): 6, (0, False): 2, (1, True): 3, (1, False): 1}
    coded = AL.with_bits(art, bits)
    for li, pair in enumerate(coded.layers):
        for j, d in enumerate(pair):
            old = art.layers[li][j]
            assert d.residual_bits == bits[(li, j == 0)]
            assert np.array_equal(d.atoms, old.atoms) and np.array_equal(d.residual_scale, old.residual_scale)
            assert d.slot_words == S + (HD * d.residual_bits + 31) // 32 + 1
    assert AL.mean_bytes(art, bits) == pytest.approx(np.mean([4 * coded.layers[li][j].slot_words
                                                                for li in range(2) for j in range(2)]))
    x = np.random.default_rng(3).standard_normal((2, 40, HD)).astype(np.float32)
    errs = [float(np.mean((codec.roundtrip_heads(x, coded.layers[0][j]) - x) ** 2)) for j in range(2)]
    assert errs[0] < errs[1]  # 6 bits beat 2 on the same atoms


def test_one_stream_hook_codes_only_its_stream():
    art = _artifact(n_layers=2)
    hook = AL.OneStreamHook(art, 1, False, 3)
    k = np.random.default_rng(4).standard_normal((2, 8, HD)).astype(np.float32)
    v = k + 1
    assert all(np.array_equal(a, b) for a, b in zip(hook(0, k, v), (k, v)))
    k1, v1 = hook(1, k, v)
    assert np.array_equal(k1, k) and not np.array_equal(v1, v)


def test_kl_of_a_distribution_with_itself_is_zero_and_positive_otherwise():
    rng = np.random.default_rng(5)
    z = rng.standard_normal((10, 50))
    lp = z - np.log(np.exp(z).sum(1, keepdims=True))
    assert AL._kl(lp.astype(np.float32), lp.astype(np.float32)) == pytest.approx(0.0, abs=1e-7)
    z2 = z + 0.1 * rng.standard_normal(z.shape)
    lp2 = z2 - np.log(np.exp(z2).sum(1, keepdims=True))
    assert AL._kl(lp.astype(np.float32), lp2.astype(np.float32)) > 1e-4
