"""The pre-RoPE-keys lever (kvdict_vk.forge.pre_rope): which dictionary codes which tensor,
and where in the forward; the artifact it measures and the bytes it charges."""
import numpy as np

from conftest import random_artifact
from kvdict_vk import codec
from kvdict_vk.forge import coef_fp8
from kvdict_vk.forge import pre_rope as R


def _pair(rng):
    # layer 0: both streams coded; layer 1: the rotated keys pass through, the pre-RoPE ones do not
    art = random_artifact(rng, 64, 32, [((4, 4), (4, 3)), (None, (2, 2))], n_heads=2)
    keys = random_artifact(rng, 64, 32, [((4, 4), None), ((3, 2), None)], n_heads=2)
    return art, keys


def test_keys_are_coded_before_rope_values_after_and_passthrough_streams_are_kept():
    rng = np.random.default_rng(4)
    art, keys = _pair(rng)
    pre = R.with_keys_of(keys, art)
    assert all(p[0] is kp[0] and p[1] is a[1] for p, kp, a in zip(pre.layers, keys.layers, art.layers))
    hook = R.PreRopeKeysHook(pre)
    k, v = (rng.standard_normal((2, 40, 64)).astype(np.float32) for _ in range(2))
    for layer in (0, 1):
        got = hook.keys_pre_rope(layer, k)
        assert np.array_equal(got, codec.roundtrip_heads(k, keys.stream(layer, True)))
        assert not np.array_equal(got, k)
        k_out, v_out = hook(layer, k, v)
        assert k_out is k  # the rotated keys are not coded again
        assert np.array_equal(v_out, codec.roundtrip_heads(v, art.stream(layer, False)))
    # the codec hook (the row beside it) codes the rotated keys with the artifact's dictionaries
    k_out, v_out = R.CodecHook(art)(0, k, v)
    assert np.array_equal(k_out, codec.roundtrip_heads(k, art.stream(0, True)))
    assert np.array_equal(R.CodecHook(art)(1, k, v)[0], k)


def test_fp8_coefficients_reach_both_streams_and_are_charged():
    rng = np.random.default_rng(5)
    art, keys = _pair(rng)
    pre = R.with_keys_of(keys, art)
    hook = R.PreRopeKeysHook(pre, fp8=True)
    k, v = (rng.standard_normal((2, 40, 64)).astype(np.float32) for _ in range(2))
    got = hook.keys_pre_rope(0, k)
    assert np.array_equal(got, coef_fp8.fp8_roundtrip(pre.stream(0, True), k).astype(np.float32))
    assert not np.array_equal(got, codec.roundtrip_heads(k, pre.stream(0, True)))  # the rounding shows
    assert np.array_equal(hook(0, k, v)[1], coef_fp8.fp8_roundtrip(pre.stream(0, False), v).astype(np.float32))
    slots = [d.slot_words for pair in pre.layers for d in pair]
    assert coef_fp8.coded_bytes(pre, 4) == np.mean(slots) * 4
    assert coef_fp8.coded_bytes(pre, 3) == np.mean([4 * w - d.sparsity for pair in pre.layers for d, w in
                                                     zip(pair, [p.slot_words for p in pair])])
